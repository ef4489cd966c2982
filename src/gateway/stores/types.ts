// The object store interface every backend (fs, s3, memory, r2) implements: the
// gateway needs only get/head/create-only put/delete/list, plus optional presigning.

/** A byte range to read: `offset` + optional `length`, or the last `suffix` bytes. */
export type ByteRange = { offset: number; length?: number } | { suffix: number }

export interface StoreObject {
  /** The requested bytes (the whole object without a range). */
  body: ReadableStream<Uint8Array>
  /** Size of the whole object. */
  size: number
  /** First byte served and number of bytes in `body`. */
  offset: number
  length: number
  /** The object version (S3/R2 ETag, fs inode+mtime, memory write count), where the store has one. */
  etag?: string
}

export interface StoreEntry {
  name: string
  size: number
  /** Last-modified time (ms since epoch) when the backend lists it (gc's grace period for new writes). */
  modified?: number | undefined
}

export type PutResult = 'created' | 'exists'

/** One presigned request of a direct upload: PUT body bytes [offset, offset + length) to `url`. */
export interface UploadPart {
  url: string
  offset: number
  length: number
}

/** Where a client uploads a body straight into the backend (s3): one PUT, or the parts of a multipart upload. */
export interface UploadTargets {
  /** The backend's multipart upload id when the body goes up in parts. */
  multipartId?: string
  parts: UploadPart[]
}

export interface PresignUploadOptions {
  expiresInSeconds: number
  /** Bodies above this go up in parts. */
  multipartThreshold: number
  /** Part size of a multipart upload (the last part may be shorter). */
  partBytes: number
}

export interface DeleteOptions {
  /** Delete only the object version with this etag (StoreObject.etag, head().etag). */
  ifMatch?: string | undefined
}

export interface GetOptions {
  range?: ByteRange
  signal?: AbortSignal
}

export interface ObjectStore {
  /** Short backend name for metrics and the status page: 'fs', 's3', 'memory', 'r2'. */
  readonly kind: string
  /** The object, or undefined when absent. A range past the end throws RangeNotSatisfiableError. */
  get(name: string, opts?: GetOptions): Promise<StoreObject | undefined>
  /** The object's size (and version tag, where the store has one), or undefined when absent. */
  head(name: string): Promise<{ size: number; etag?: string } | undefined>
  /**
   * Stores `body` (exactly `size` bytes) under `name` unless an object already exists.
   * Atomic: readers see the whole object or nothing; a body stream that errors
   * leaves nothing behind. Resolves 'exists' without overwriting.
   */
  putIfAbsent(name: string, body: ReadableStream<Uint8Array> | Uint8Array, size: number): Promise<PutResult>
  /**
   * Removes the object; resolves false when there was none. With `ifMatch` (an etag from get or
   * head) only that version goes: false when the name holds another one now (a copy put back
   * since). Atomic on memory, fs (to a stat and an unlink) and AWS S3 (DeleteObject If-Match);
   * RadosGW Pacific ignores If-Match on DELETE and R2's binding has no condition, so there the
   * version is checked by a HEAD just before the DELETE (docs/calibration.md: the window left).
   */
  delete(name: string, opts?: DeleteOptions): Promise<boolean>
  /**
   * Bytes the store holds in memory, beyond the body stream, to write `size` bytes with
   * putIfAbsent (multipart parts, its own read-ahead). The gateway reserves them against
   * limits.maxHeldBytes before the PUT (memory-budget.ts). Absent: none.
   */
  putHoldBytes?(size: number): number
  /** Bytes a get() body of `length` bytes reads ahead of its reader in memory (S3). Absent: none. */
  getHoldBytes?(length: number): number
  /** One page of objects under `prefix`, in name order. */
  list(
    prefix: string,
    opts?: { cursor?: string; limit?: number },
  ): Promise<{ entries: StoreEntry[]; cursor?: string | undefined }>
  /** A short-lived URL that GETs the object directly from the backend (s3). */
  presignGet?(name: string, expiresInSeconds: number): Promise<string>
  /**
   * Presigned URLs that write exactly `size` bytes under `name` straight into the
   * backend (s3). The gateway points them at a staging name, never a chunk name.
   */
  presignUpload?(name: string, size: number, opts: PresignUploadOptions): Promise<UploadTargets>
  /**
   * Assembles a multipart upload from its parts, which must have exactly `partLengths`
   * (the store asks the backend, never the client). 'missing' when no such upload is open.
   */
  completeUpload?(
    name: string,
    multipartId: string,
    partLengths: readonly number[],
  ): Promise<'completed' | 'missing' | 'mismatch'>
  /** Drops an unfinished multipart upload and its parts; idempotent. */
  abortUpload?(name: string, multipartId: string): Promise<void>
  /** Object count and bytes, when the backend can tell cheaply (memory, fs). */
  stats?(): Promise<{ objects: number; bytes: number }>
  close?(): Promise<void>
}

/**
 * Part lengths of a multipart upload: `partBytes` each, the remainder folded into
 * the last part (no tiny tail request; S3 allows the last part to be any size).
 */
export function partLengths(size: number, partBytes: number): number[] {
  const n = Math.max(1, Math.floor(size / partBytes))
  const out = new Array<number>(n).fill(partBytes)
  out[n - 1] = size - partBytes * (n - 1)
  return out
}

/** Resolves a ByteRange against an object size; undefined when unsatisfiable. */
export function resolveRange(
  range: ByteRange | undefined,
  size: number,
): { offset: number; length: number } | undefined {
  if (!range) return { offset: 0, length: size }
  if ('suffix' in range) {
    if (range.suffix <= 0 || size === 0) return undefined
    const length = Math.min(range.suffix, size)
    return { offset: size - length, length }
  }
  if (range.offset >= size) return undefined
  const length = Math.min(range.length ?? size - range.offset, size - range.offset)
  return length > 0 ? { offset: range.offset, length } : undefined
}

/** Reads a body argument fully (memory store, small fallbacks); checks the declared size. */
export async function collectBody(
  body: ReadableStream<Uint8Array> | Uint8Array,
  size: number,
): Promise<Uint8Array> {
  if (body instanceof Uint8Array) {
    if (body.length !== size) throw new Error(`body is ${body.length} bytes, declared ${size}`)
    return body
  }
  const out = new Uint8Array(size)
  let at = 0
  const reader = body.getReader()
  for (;;) {
    const { done, value } = await reader.read()
    if (done) break
    if (at + value.length > size) {
      await reader.cancel().catch(() => {})
      throw new Error(`body is longer than the declared ${size} bytes`)
    }
    out.set(value, at)
    at += value.length
  }
  if (at !== size) throw new Error(`body ended at ${at} of ${size} bytes`)
  return out
}

/**
 * Reads a body of unknown length, at most `max` bytes; undefined (the stream cancelled)
 * once it runs past `max`, so a caller answers 413 without holding more than the cap.
 */
export async function collectAtMost(
  body: ReadableStream<Uint8Array>,
  max: number,
): Promise<Uint8Array | undefined> {
  const pieces: Uint8Array[] = []
  let n = 0
  const reader = body.getReader()
  for (;;) {
    const { done, value } = await reader.read()
    if (done) break
    n += value.length
    if (n > max) {
      await reader.cancel().catch(() => {})
      return undefined
    }
    pieces.push(value)
  }
  return concatPieces(pieces, n)
}

/** `pieces` (of `total` bytes in all) as one array. */
export function concatPieces(pieces: readonly Uint8Array[], total: number): Uint8Array {
  const out = new Uint8Array(total)
  let at = 0
  for (const p of pieces) {
    out.set(p, at)
    at += p.length
  }
  return out
}
