// Runs the wasm codec (lossless / kvgate) on worker threads so encoding for the
// write-behind and decoding L4 hits never stall the inference thread's event loop.

import { availableParallelism } from 'node:os'
import { Worker } from 'node:worker_threads'
import { decodeChunkInto, decodeSection, encodeChunk } from '../codec/node.ts'
import { CodecError } from '../core/errors.ts'
import type { ChunkHeader } from '../core/format.ts'
import type { ChunkCodecName, ChunkIdentity } from './chunk-codec.ts'
import type { CodecReply, CodecRequest } from './codec-worker.ts'

type Pending = { resolve: (b: Uint8Array) => void; reject: (e: Error) => void }

/** The worker died (not a codec error): the job is retried on the calling thread. */
class WorkerLost extends Error {}

interface Slot {
  worker: Worker
  busy: number
}

/** Distributive Omit, so each request variant keeps its own fields. */
type RequestBody = CodecRequest extends infer R ? (R extends CodecRequest ? Omit<R, 'id'> : never) : never

/**
 * A few workers (default: cores − 1, at most 4; 0 = run inline). 'raw' never
 * leaves the calling thread: it is a copy. If workers cannot start (no tsx
 * loader, sandbox), everything runs inline and `inline` says why.
 */
export class CodecPool {
  readonly #slots: Slot[] = []
  readonly #pending = new Map<number, Pending>()
  #next = 1
  #closed = false
  /** Why the pool runs inline, if it does. */
  inline: string | undefined
  /** Jobs run on workers / inline. */
  readonly counts = { workerJobs: 0, inlineJobs: 0 }

  readonly #size: number
  #started = false

  constructor(size = Math.min(4, Math.max(1, availableParallelism() - 1))) {
    this.#size = size
    if (size <= 0) this.inline = 'codec workers disabled'
  }

  /** Workers start on first use: caches that only move raw chunks never pay for them. */
  #start(): void {
    if (this.#started) return
    this.#started = true
    if (this.#size <= 0) return
    try {
      // A JS entry that registers tsx itself: loader flags of this process do not
      // reliably reach worker threads (npx tsx, vitest).
      const url = new URL('./codec-worker-entry.mjs', import.meta.url)
      for (let i = 0; i < this.#size; i++) {
        const worker = new Worker(url, { execArgv: [] })
        worker.unref()
        worker.on('message', (m: CodecReply) => this.#reply(m))
        worker.on('error', (e) => this.#fail(worker, e))
        this.#slots.push({ worker, busy: 0 })
      }
    } catch (e) {
      this.inline = `codec workers unavailable: ${(e as Error).message}`
      for (const s of this.#slots) void s.worker.terminate()
      this.#slots.length = 0
    }
  }

  #reply(m: CodecReply): void {
    const p = this.#pending.get(m.id)
    if (!p) return
    this.#pending.delete(m.id)
    if ('error' in m) p.reject(new CodecError(m.error))
    else p.resolve(new Uint8Array(m.bytes))
  }

  #fail(worker: Worker, e: Error): void {
    // A dead worker: drop it; its in-flight jobs reject (misses), later jobs use the others or run inline.
    const i = this.#slots.findIndex((s) => s.worker === worker)
    if (i >= 0) this.#slots.splice(i, 1)
    if (this.#slots.length === 0) this.inline = `codec workers failed: ${e.message}`
    for (const [id, p] of this.#pending) {
      this.#pending.delete(id)
      p.reject(new WorkerLost(e.message))
    }
  }

  #post(msg: RequestBody, transfer: ArrayBuffer[]): Promise<Uint8Array> | undefined {
    this.#start()
    if (this.#closed || this.#slots.length === 0) return undefined
    const slot = this.#slots.reduce((a, b) => (b.busy < a.busy ? b : a))
    const id = this.#next++
    this.counts.workerJobs++
    slot.busy++
    return new Promise<Uint8Array>((resolve, reject) => {
      this.#pending.set(id, { resolve, reject })
      slot.worker.postMessage({ ...msg, id } as CodecRequest, transfer)
    }).finally(() => {
      slot.busy--
    })
  }

  /** Encodes one chunk tensor (copied out first: L1 slots are not transferable). */
  async encode(codec: ChunkCodecName, tensor: Uint8Array, meta: ChunkIdentity): Promise<Uint8Array> {
    if (codec !== 'raw') {
      const copy = tensor.slice().buffer as ArrayBuffer
      const p = this.#post({ op: 'encode', mode: codec, tensor: copy, meta }, [copy])
      const out = p && (await p.catch(lostToUndefined))
      if (out) return out
    }
    this.counts.inlineJobs++
    return encodeChunk(tensor, meta, { mode: codec })
  }

  /** Decodes a verified whole object into `dst` (one chunk tensor). */
  async decodeInto(object: Uint8Array, codec: string, dst: Uint8Array): Promise<void> {
    if (codec !== 'raw') {
      const buf = object.slice().buffer as ArrayBuffer
      const p = this.#post({ op: 'decode', object: buf }, [buf])
      const out = p && (await p.catch(lostToUndefined))
      if (out) {
        if (out.byteLength !== dst.byteLength) throw new CodecError('decoded chunk has the wrong size')
        dst.set(out)
        return
      }
    }
    this.counts.inlineJobs++
    decodeChunkInto(object, dst)
  }

  /** Decodes one CRC-checked layer section into a new layer slab. */
  async decodeSection(header: ChunkHeader, layer: number, section: Uint8Array): Promise<Uint8Array> {
    if (header.codec !== 'raw') {
      const buf = section.slice().buffer as ArrayBuffer
      const p = this.#post({ op: 'section', header, layer, section: buf }, [buf])
      const out = p && (await p.catch(lostToUndefined))
      if (out) return out
    }
    this.counts.inlineJobs++
    return decodeSection(header, layer, section)
  }

  async close(): Promise<void> {
    this.#closed = true
    await Promise.allSettled(this.#slots.map((s) => s.worker.terminate()))
    this.#slots.length = 0
    for (const [id, p] of this.#pending) {
      this.#pending.delete(id)
      p.reject(new CodecError('codec pool closed'))
    }
  }
}

function lostToUndefined(e: unknown): undefined {
  if (e instanceof WorkerLost) return undefined
  throw e
}
