// Coalesces concurrent GETs of one object (and range) into one store GET. The
// leader buffers the body only when it is at most `maxBytes` and the buffers of all
// coalesced GETs stay within `maxBufferedBytes`, so followers share bytes; otherwise
// the body is never buffered and followers do their own GET.
// (A tee would buffer without bound behind the slowest client.)

import { StoreError } from '../core/errors.ts'
import type { MemoryBudget, MemoryLease } from './memory-budget.ts'
import { storeBodyFailure } from './stores/errors.ts'
import type { StoreObject } from './stores/types.ts'

/** A shared buffer's pieces as served: what one socket write takes before it waits (Node, workerd). */
const PIECE_BYTES = 64 * 1024

type Shared =
  | { kind: 'absent' }
  | { kind: 'bytes'; bytes: Uint8Array; size: number; offset: number; etag?: string }
  | { kind: 'stream'; obj: StoreObject }

export interface CoalescedGet {
  obj: StoreObject | undefined
  /** True when this request was served by another request's store GET. */
  coalesced: boolean
  /** True when `obj` is read from a shared buffer (already in the memory budget), not a store stream. */
  buffered: boolean
}

/** Who still holds a leader's buffer: every request that joined it, until its body is handed on. */
interface Lease {
  refs: number
  bytes: number
  /** The buffer's reservation in the gateway's memory budget, given back with the last ref. */
  memory?: MemoryLease
}

export class GetCoalescer {
  readonly #inflight = new Map<string, { shared: Promise<Shared>; lease: Lease }>()
  readonly #maxBytes: number
  readonly #maxBuffered: number
  readonly #budget: MemoryBudget | undefined
  #buffered = 0

  /** `budget`: the gateway's memory budget, which a buffer must also fit (else the GET streams). */
  constructor(maxBytes: number, maxBufferedBytes = 64 * 1024 * 1024, budget?: MemoryBudget) {
    if (!Number.isInteger(maxBytes) || maxBytes < 0) throw new TypeError('invalid coalesce maxBytes')
    if (!Number.isInteger(maxBufferedBytes) || maxBufferedBytes < 0)
      throw new TypeError('invalid coalesce maxBufferedBytes')
    this.#maxBytes = maxBytes
    this.#maxBuffered = maxBufferedBytes
    this.#budget = budget
  }

  get inflight(): number {
    return this.#inflight.size
  }

  /** Bytes of shared buffers some request still holds (the bound is maxBufferedBytes). */
  get bufferedBytes(): number {
    return this.#buffered
  }

  #release(lease: Lease): void {
    if (--lease.refs > 0) return
    this.#buffered -= lease.bytes
    lease.memory?.release()
  }

  async get(key: string, fetch: () => Promise<StoreObject | undefined>): Promise<CoalescedGet> {
    const existing = this.#inflight.get(key)
    if (existing) {
      existing.lease.refs++
      let shared: Shared
      try {
        shared = await existing.shared
      } catch (e) {
        this.#release(existing.lease)
        throw e
      }
      if (shared.kind === 'bytes')
        return { obj: this.#fromBytes(shared, existing.lease), coalesced: true, buffered: true }
      this.#release(existing.lease)
      if (shared.kind === 'absent') return { obj: undefined, coalesced: true, buffered: false }
      // Too large to share: the leader owns that stream.
      return { obj: await fetch(), coalesced: false, buffered: false }
    }
    const lease: Lease = { refs: 1, bytes: 0 }
    const shared = (async (): Promise<Shared> => {
      const obj = await fetch()
      if (!obj) return { kind: 'absent' }
      if (obj.length > this.#maxBytes || this.#buffered + obj.length > this.#maxBuffered)
        return { kind: 'stream', obj }
      if (this.#budget) {
        const memory = this.#budget.tryReserve(obj.length)
        if (!memory) return { kind: 'stream', obj }
        lease.memory = memory
      }
      lease.bytes = obj.length
      this.#buffered += obj.length
      const reader = obj.body.getReader()
      try {
        const bytes = new Uint8Array(obj.length)
        let at = 0
        for (;;) {
          const { done, value } = await reader.read()
          if (done) break
          if (at + value.length > bytes.length)
            throw new StoreError('the store sent more bytes than it announced')
          bytes.set(value, at)
          at += value.length
        }
        if (at !== bytes.length)
          throw new StoreError(`the store body ended at ${at} of ${bytes.length} bytes`)
        return {
          kind: 'bytes',
          bytes,
          size: obj.size,
          offset: obj.offset,
          ...(obj.etag !== undefined ? { etag: obj.etag } : {}),
        }
      } catch (e) {
        // Stop the store read: nobody will take the rest.
        await reader.cancel(e).catch(() => {})
        // A body the store broke off is its fault (502), not the gateway's (500).
        throw storeBodyFailure(e)
      }
    })()
    this.#inflight.set(key, { shared, lease })
    try {
      const s = await shared
      if (s.kind === 'bytes') return { obj: this.#fromBytes(s, lease), coalesced: false, buffered: true }
      this.#release(lease)
      return { obj: s.kind === 'stream' ? s.obj : undefined, coalesced: false, buffered: false }
    } catch (e) {
      this.#release(lease)
      throw e
    } finally {
      this.#inflight.delete(key)
    }
  }

  // The buffer goes out in pieces (views, no copies), one per pull: a whole buffer handed
  // on at once would sit in the socket's write queue behind a slow client, held but no
  // longer reserved. This request's hold is released once it has taken the last piece (or gives up).
  #fromBytes(
    s: { bytes: Uint8Array; size: number; offset: number; etag?: string },
    lease: Lease,
  ): StoreObject {
    let held = true
    let at = 0
    const release = () => {
      if (!held) return
      held = false
      this.#release(lease)
    }
    const body = new ReadableStream<Uint8Array>(
      {
        pull(c) {
          if (at < s.bytes.length) {
            const end = Math.min(s.bytes.length, at + PIECE_BYTES)
            c.enqueue(s.bytes.subarray(at, end))
            at = end
            if (at < s.bytes.length) return
          }
          c.close()
          release()
        },
        cancel: release,
      },
      { highWaterMark: 0 },
    )
    return {
      body,
      size: s.size,
      offset: s.offset,
      length: s.bytes.length,
      ...(s.etag !== undefined ? { etag: s.etag } : {}),
    }
  }
}
