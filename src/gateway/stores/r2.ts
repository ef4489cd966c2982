// Object store on a Cloudflare R2 bucket binding (Workers). Streams both ways: a Worker
// has 128 MB of memory and chunks are tens of MB, so no path holds a whole object.

import { StoreError } from '../../core/errors.ts'
import { RangeNotSatisfiableError } from './errors.ts'
import {
  type ByteRange,
  collectBody,
  type DeleteOptions,
  type GetOptions,
  type ObjectStore,
  type PutResult,
  resolveRange,
  type StoreEntry,
  type StoreObject,
} from './types.ts'

// The slice of the Workers R2 API this store uses, typed here so the gateway does not
// depend on @cloudflare/workers-types (whose globals clash with the DOM lib).
export interface R2ObjectLike {
  key: string
  size: number
  etag: string
  /** When the object was written (R2 lists it). */
  uploaded?: Date
}

export interface R2ObjectBodyLike extends R2ObjectLike {
  body: ReadableStream<Uint8Array>
}

export interface R2UploadedPartLike {
  partNumber: number
  etag: string
}

export interface R2MultipartUploadLike {
  uploadPart(partNumber: number, value: Uint8Array | ReadableStream<Uint8Array>): Promise<R2UploadedPartLike>
  complete(parts: R2UploadedPartLike[]): Promise<R2ObjectLike>
  abort(): Promise<void>
}

export type R2RangeLike = { offset: number; length?: number } | { suffix: number }

export interface R2BucketLike {
  get(key: string, options?: { range?: R2RangeLike }): Promise<R2ObjectBodyLike | null>
  head(key: string): Promise<R2ObjectLike | null>
  put(
    key: string,
    value: Uint8Array | ReadableStream<Uint8Array>,
    options?: { onlyIf?: { etagDoesNotMatch?: string } },
  ): Promise<R2ObjectLike | null>
  delete(keys: string | string[]): Promise<void>
  list(options?: {
    prefix?: string
    cursor?: string
    limit?: number
  }): Promise<{ objects: R2ObjectLike[]; truncated: boolean; cursor?: string }>
  createMultipartUpload(key: string): Promise<R2MultipartUploadLike>
}

/** workerd's FixedLengthStream: a TransformStream whose readable side has a known length. */
type FixedLengthStreamCtor = new (
  length: number,
) => { readable: ReadableStream<Uint8Array>; writable: WritableStream<Uint8Array> }

const MIB = 1024 * 1024
/** R2 refuses multipart parts under 5 MiB (except the last). */
export const R2_MIN_PART_BYTES = 5 * MIB

export interface R2StoreOptions {
  /**
   * Bodies above this size go through a multipart upload, one part buffered at a
   * time; smaller ones stream through a single conditional put.
   * @default 64 MiB
   */
  multipartThreshold?: number
  /** Size of every multipart part but the last (≥ 5 MiB). @default 8 MiB */
  partBytes?: number
}

export class R2Store implements ObjectStore {
  readonly kind = 'r2'
  readonly #bucket: R2BucketLike
  readonly #multipartThreshold: number
  readonly #partBytes: number

  constructor(bucket: R2BucketLike, opts: R2StoreOptions = {}) {
    if (!bucket || typeof bucket.get !== 'function' || typeof bucket.put !== 'function') {
      throw new TypeError('R2Store needs an R2 bucket binding')
    }
    const { multipartThreshold = 64 * MIB, partBytes = 8 * MIB } = opts
    if (!Number.isSafeInteger(partBytes) || partBytes < R2_MIN_PART_BYTES) {
      throw new TypeError(`invalid partBytes: R2 parts are at least ${R2_MIN_PART_BYTES} bytes`)
    }
    if (!Number.isSafeInteger(multipartThreshold) || multipartThreshold < partBytes) {
      throw new TypeError('invalid multipartThreshold: must be an integer >= partBytes')
    }
    this.#bucket = bucket
    this.#multipartThreshold = multipartThreshold
    this.#partBytes = partBytes
  }

  async get(name: string, opts: GetOptions = {}): Promise<StoreObject | undefined> {
    let obj: R2ObjectBodyLike | null
    try {
      obj = await this.#bucket.get(name, opts.range ? { range: toR2Range(opts.range) } : undefined)
    } catch (e) {
      if (opts.range && isRangeError(e)) {
        const head = await this.head(name)
        if (!head) return undefined
        throw new RangeNotSatisfiableError(head.size)
      }
      throw storeFailure('get', name, e)
    }
    if (!obj) return undefined
    const r = resolveRange(opts.range, obj.size)
    if (!r) {
      await obj.body.cancel().catch(() => {})
      throw new RangeNotSatisfiableError(obj.size)
    }
    return { body: obj.body, size: obj.size, offset: r.offset, length: r.length, etag: obj.etag }
  }

  async head(name: string): Promise<{ size: number; etag?: string } | undefined> {
    try {
      const obj = await this.#bucket.head(name)
      return obj ? { size: obj.size, etag: obj.etag } : undefined
    } catch (e) {
      throw storeFailure('head', name, e)
    }
  }

  /**
   * A multipart PUT holds the part being filled (uploadPart takes a whole one); a single put
   * streams through a FixedLengthStream. Outside workerd (a fake bucket) the body is collected.
   */
  putHoldBytes(size: number): number {
    if (size > this.#multipartThreshold) return Math.min(size, this.#partBytes)
    return (globalThis as { FixedLengthStream?: unknown }).FixedLengthStream ? 0 : size
  }

  async putIfAbsent(
    name: string,
    body: ReadableStream<Uint8Array> | Uint8Array,
    size: number,
  ): Promise<PutResult> {
    if (!Number.isSafeInteger(size) || size < 0) throw new TypeError(`invalid size ${size}`)
    if (size > this.#multipartThreshold) return this.#putMultipart(name, body, size)
    if (body instanceof Uint8Array) {
      if (body.length !== size) throw new TypeError(`body is ${body.length} bytes, declared ${size}`)
      return this.#putOnce(name, body)
    }
    const Fixed = (globalThis as { FixedLengthStream?: FixedLengthStreamCtor }).FixedLengthStream
    // Outside workerd (unit tests with a fake bucket) a small body is simply collected.
    if (!Fixed) return this.#putOnce(name, await collectBody(body, size))

    // R2 needs a stream of known length: pump through a FixedLengthStream, which also
    // errors (and so fails the put) when the body is shorter or longer than declared.
    const fixed = new Fixed(size)
    const pump = pumpInto(body, fixed.writable)
    try {
      return await this.#putOnce(name, fixed.readable)
    } catch (e) {
      // A body that failed (e.g. verification) surfaces as its own error, not as a store failure.
      const { sourceError } = await pump.done
      throw sourceError ?? e
    } finally {
      // R2 may answer a failed precondition before reading the whole body.
      await pump.stop()
    }
  }

  async #putOnce(name: string, value: Uint8Array | ReadableStream<Uint8Array>): Promise<PutResult> {
    let stored: R2ObjectLike | null
    try {
      // Create-only: R2 stores nothing and answers null when any object has the key.
      stored = await this.#bucket.put(name, value, { onlyIf: { etagDoesNotMatch: '*' } })
    } catch (e) {
      throw storeFailure('put', name, e)
    }
    return stored === null ? 'exists' : 'created'
  }

  async #putMultipart(
    name: string,
    body: ReadableStream<Uint8Array> | Uint8Array,
    size: number,
  ): Promise<PutResult> {
    const cancel = () => (body instanceof Uint8Array ? Promise.resolve() : body.cancel().catch(() => {}))
    if (await this.head(name)) {
      await cancel()
      return 'exists'
    }
    let upload: R2MultipartUploadLike
    try {
      upload = await this.#bucket.createMultipartUpload(name)
    } catch (e) {
      await cancel()
      throw storeFailure('createMultipartUpload', name, e)
    }
    try {
      const parts: R2UploadedPartLike[] = []
      for await (const part of partsOf(body, size, this.#partBytes)) {
        try {
          parts.push(await upload.uploadPart(parts.length + 1, part))
        } catch (e) {
          throw storeFailure('uploadPart', name, e)
        }
      }
      // Multipart completion has no precondition: re-check, so a writer that lost the
      // race leaves the first object in place. (A window of one request remains.)
      if (await this.head(name)) {
        await upload.abort().catch(() => {})
        return 'exists'
      }
      try {
        await upload.complete(parts)
      } catch (e) {
        throw storeFailure('completeMultipartUpload', name, e)
      }
      return 'created'
    } catch (e) {
      await upload.abort().catch(() => {})
      await cancel()
      throw e
    }
  }

  async delete(name: string, opts: DeleteOptions = {}): Promise<boolean> {
    // R2's delete does not say whether the key existed, and takes no condition: the HEAD also
    // keeps another version (put back since the etag was read) but for its one round trip.
    const head = await this.head(name)
    if (!head || (opts.ifMatch !== undefined && head.etag !== opts.ifMatch)) return false
    try {
      await this.#bucket.delete(name)
      return true
    } catch (e) {
      throw storeFailure('delete', name, e)
    }
  }

  async list(prefix: string, opts: { cursor?: string; limit?: number } = {}) {
    let page: Awaited<ReturnType<R2BucketLike['list']>>
    try {
      page = await this.#bucket.list({
        prefix,
        cursor: opts.cursor,
        limit: Math.min(opts.limit ?? 1000, 1000),
      })
    } catch (e) {
      throw storeFailure('list', prefix, e)
    }
    const entries: StoreEntry[] = page.objects.map((o) => ({
      name: o.key,
      size: o.size,
      ...(o.uploaded ? { modified: o.uploaded.getTime() } : {}),
    }))
    return page.truncated && page.cursor ? { entries, cursor: page.cursor } : { entries }
  }
}

/** Copies `body` into `sink`, recording an error of the body itself apart from sink errors. */
function pumpInto(body: ReadableStream<Uint8Array>, sink: WritableStream<Uint8Array>) {
  const reader = body.getReader()
  const writer = sink.getWriter()
  let stopped = false
  const done = (async (): Promise<{ sourceError?: unknown }> => {
    for (;;) {
      let chunk: ReadableStreamReadResult<Uint8Array>
      try {
        chunk = await reader.read()
      } catch (e) {
        await writer.abort(e).catch(() => {})
        return { sourceError: e }
      }
      try {
        if (chunk.done) {
          await writer.close()
          return {}
        }
        await writer.write(chunk.value)
      } catch {
        // The sink failed or was stopped: the put reports why.
        await reader.cancel().catch(() => {})
        return {}
      }
      if (stopped) {
        await reader.cancel().catch(() => {})
        return {}
      }
    }
  })()
  return {
    done,
    async stop() {
      stopped = true
      await writer.abort(new Error('put finished')).catch(() => {})
      // Also wakes a read still waiting for the client's next bytes.
      await reader.cancel().catch(() => {})
      await done
    },
  }
}

function toR2Range(range: ByteRange): R2RangeLike {
  return 'suffix' in range
    ? { suffix: range.suffix }
    : range.length === undefined
      ? { offset: range.offset }
      : range
}

function isRangeError(e: unknown): boolean {
  return /range/i.test(String((e as Error)?.message ?? e))
}

function storeFailure(op: string, name: string, cause: unknown): StoreError {
  return new StoreError(`r2 ${op} ${name} failed: ${(cause as Error)?.message ?? String(cause)}`, { cause })
}

/**
 * Cuts a body into parts of exactly `partBytes` (the last one shorter), holding at
 * most one part in memory. Throws when the body is not exactly `size` bytes.
 */
async function* partsOf(
  body: ReadableStream<Uint8Array> | Uint8Array,
  size: number,
  partBytes: number,
): AsyncGenerator<Uint8Array> {
  if (body instanceof Uint8Array) {
    if (body.length !== size) throw new TypeError(`body is ${body.length} bytes, declared ${size}`)
    for (let o = 0; o < size; o += partBytes) yield body.subarray(o, Math.min(o + partBytes, size))
    return
  }
  const reader = body.getReader()
  let part = new Uint8Array(Math.min(partBytes, size))
  let filled = 0
  let total = 0
  try {
    for (;;) {
      const { done, value } = await reader.read()
      if (done) break
      total += value.length
      if (total > size) throw new TypeError(`body is longer than the declared ${size} bytes`)
      let at = 0
      while (at < value.length) {
        const n = Math.min(part.length - filled, value.length - at)
        part.set(value.subarray(at, at + n), filled)
        filled += n
        at += n
        if (filled === part.length) {
          yield part
          const left = size - (total - (value.length - at))
          part = new Uint8Array(Math.min(partBytes, left))
          filled = 0
        }
      }
    }
    if (total !== size) throw new TypeError(`body ended at ${total} of ${size} bytes`)
  } finally {
    reader.releaseLock()
  }
}
