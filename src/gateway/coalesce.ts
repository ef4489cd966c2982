// Coalesces concurrent GETs of one object (and range) into one store GET. The
// leader buffers the body only when it is at most `maxBytes`, so followers share
// bytes; larger bodies are never buffered: followers then do their own GET.
// (A tee would buffer without bound behind the slowest client.)

import type { StoreObject } from './stores/types.ts'

type Shared =
  | { kind: 'absent' }
  | { kind: 'bytes'; bytes: Uint8Array; size: number; offset: number }
  | { kind: 'stream'; obj: StoreObject }

export interface CoalescedGet {
  obj: StoreObject | undefined
  /** True when this request was served by another request's store GET. */
  coalesced: boolean
}

export class GetCoalescer {
  readonly #inflight = new Map<string, Promise<Shared>>()
  readonly #maxBytes: number

  constructor(maxBytes: number) {
    if (!Number.isInteger(maxBytes) || maxBytes < 0) throw new TypeError('invalid coalesce maxBytes')
    this.#maxBytes = maxBytes
  }

  get inflight(): number {
    return this.#inflight.size
  }

  async get(key: string, fetch: () => Promise<StoreObject | undefined>): Promise<CoalescedGet> {
    const existing = this.#inflight.get(key)
    if (existing) {
      const shared = await existing
      if (shared.kind === 'absent') return { obj: undefined, coalesced: true }
      if (shared.kind === 'bytes') return { obj: fromBytes(shared), coalesced: true }
      // Too large to share: the leader owns that stream.
      return { obj: await fetch(), coalesced: false }
    }
    const leader = (async (): Promise<Shared> => {
      const obj = await fetch()
      if (!obj) return { kind: 'absent' }
      if (obj.length > this.#maxBytes) return { kind: 'stream', obj }
      const bytes = new Uint8Array(obj.length)
      let at = 0
      const reader = obj.body.getReader()
      for (;;) {
        const { done, value } = await reader.read()
        if (done) break
        if (at + value.length > bytes.length) throw new Error('store returned more bytes than announced')
        bytes.set(value, at)
        at += value.length
      }
      if (at !== bytes.length) throw new Error(`store body ended at ${at} of ${bytes.length} bytes`)
      return { kind: 'bytes', bytes, size: obj.size, offset: obj.offset }
    })()
    this.#inflight.set(key, leader)
    try {
      const shared = await leader
      if (shared.kind === 'absent') return { obj: undefined, coalesced: false }
      if (shared.kind === 'stream') return { obj: shared.obj, coalesced: false }
      return { obj: fromBytes(shared), coalesced: false }
    } finally {
      this.#inflight.delete(key)
    }
  }
}

function fromBytes(s: { bytes: Uint8Array; size: number; offset: number }): StoreObject {
  const body = new ReadableStream<Uint8Array>({
    start(c) {
      if (s.bytes.length > 0) c.enqueue(s.bytes)
      c.close()
    },
  })
  return { body, size: s.size, offset: s.offset, length: s.bytes.length }
}
