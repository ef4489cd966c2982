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
}

export interface StoreEntry {
  name: string
  size: number
}

export type PutResult = 'created' | 'exists'

export interface GetOptions {
  range?: ByteRange
  signal?: AbortSignal
}

export interface ObjectStore {
  /** Short backend name for metrics and the status page: 'fs', 's3', 'memory', 'r2'. */
  readonly kind: string
  /** The object, or undefined when absent. A range past the end throws RangeNotSatisfiableError. */
  get(name: string, opts?: GetOptions): Promise<StoreObject | undefined>
  /** The object's size, or undefined when absent. */
  head(name: string): Promise<{ size: number } | undefined>
  /**
   * Stores `body` (exactly `size` bytes) under `name` unless an object already exists.
   * Atomic: readers see the whole object or nothing; a body stream that errors
   * leaves nothing behind. Resolves 'exists' without overwriting.
   */
  putIfAbsent(name: string, body: ReadableStream<Uint8Array> | Uint8Array, size: number): Promise<PutResult>
  /** Removes the object; resolves false when there was none. */
  delete(name: string): Promise<boolean>
  /** One page of objects under `prefix`, in name order. */
  list(
    prefix: string,
    opts?: { cursor?: string; limit?: number },
  ): Promise<{ entries: StoreEntry[]; cursor?: string | undefined }>
  /** A short-lived URL that GETs the object directly from the backend (s3). */
  presignGet?(name: string, expiresInSeconds: number): Promise<string>
  /** Object count and bytes, when the backend can tell cheaply (memory, fs). */
  stats?(): Promise<{ objects: number; bytes: number }>
  close?(): Promise<void>
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
