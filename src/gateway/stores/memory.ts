// In-memory object store for tests and embedded use: a Map of name → bytes, with
// the same create-only and range semantics as the real backends.

import { RangeNotSatisfiableError } from './errors.ts'
import {
  collectBody,
  type DeleteOptions,
  type GetOptions,
  type ObjectStore,
  type PutResult,
  resolveRange,
  type StoreObject,
} from './types.ts'

export interface MemoryStoreOptions {
  /** Counts every call per op (tests assert request budgets with it). */
  onOp?: (op: 'get' | 'head' | 'put' | 'delete' | 'list') => void
}

export class MemoryStore implements ObjectStore {
  readonly kind = 'memory'
  readonly #objects = new Map<string, Uint8Array>()
  /** Write count per name: the version tag a re-PUT after a DELETE changes. */
  readonly #versions = new Map<string, number>()
  #writes = 0
  readonly #modified = new Map<string, number>()
  readonly #onOp: MemoryStoreOptions['onOp']

  constructor(opts: MemoryStoreOptions = {}) {
    this.#onOp = opts.onOp
  }

  async get(name: string, opts: GetOptions = {}): Promise<StoreObject | undefined> {
    this.#onOp?.('get')
    const bytes = this.#objects.get(name)
    if (!bytes) return undefined
    const r = resolveRange(opts.range, bytes.length)
    if (!r) throw new RangeNotSatisfiableError(bytes.length)
    const slice = bytes.subarray(r.offset, r.offset + r.length)
    const body = new ReadableStream<Uint8Array>({
      start(c) {
        if (slice.length > 0) c.enqueue(slice)
        c.close()
      },
    })
    return { body, size: bytes.length, offset: r.offset, length: r.length, etag: this.#etag(name) }
  }

  async head(name: string): Promise<{ size: number; etag?: string } | undefined> {
    this.#onOp?.('head')
    const bytes = this.#objects.get(name)
    return bytes ? { size: bytes.length, etag: this.#etag(name) } : undefined
  }

  #etag(name: string): string {
    return `"m${this.#versions.get(name) ?? 0}"`
  }

  /** Replaces stored bytes in place (tests: bit rot, an out-of-band rewrite). */
  overwrite(name: string, bytes: Uint8Array): void {
    this.#objects.set(name, bytes.slice())
    this.#versions.set(name, ++this.#writes)
  }

  async putIfAbsent(
    name: string,
    body: ReadableStream<Uint8Array> | Uint8Array,
    size: number,
  ): Promise<PutResult> {
    this.#onOp?.('put')
    if (this.#objects.has(name)) {
      if (!(body instanceof Uint8Array)) await body.cancel().catch(() => {})
      return 'exists'
    }
    const bytes = await collectBody(body, size)
    // A concurrent put may have won while we read the body: first one wins.
    if (this.#objects.has(name)) return 'exists'
    this.#objects.set(name, bytes.slice())
    this.#versions.set(name, ++this.#writes)
    this.#modified.set(name, Date.now())
    return 'created'
  }

  async delete(name: string, opts: DeleteOptions = {}): Promise<boolean> {
    this.#onOp?.('delete')
    if (opts.ifMatch !== undefined && this.#objects.has(name) && this.#etag(name) !== opts.ifMatch)
      return false
    this.#versions.delete(name)
    this.#modified.delete(name)
    return this.#objects.delete(name)
  }

  async list(prefix: string, opts: { cursor?: string; limit?: number } = {}) {
    this.#onOp?.('list')
    const limit = opts.limit ?? 1000
    const names = [...this.#objects.keys()]
      .filter((n) => n.startsWith(prefix) && (opts.cursor === undefined || n > opts.cursor))
      .sort()
    const page = names.slice(0, limit)
    const entries = page.map((name) => ({
      name,
      size: this.#objects.get(name)!.length,
      modified: this.#modified.get(name)!,
    }))
    return names.length > limit ? { entries, cursor: page[page.length - 1]! } : { entries }
  }

  async stats() {
    let bytes = 0
    for (const b of this.#objects.values()) bytes += b.length
    return { objects: this.#objects.size, bytes }
  }
}
