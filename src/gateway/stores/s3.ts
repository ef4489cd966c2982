// S3 (and any S3-compatible endpoint: RadosGW, MinIO, R2's S3 API) behind the
// ObjectStore interface: streamed GET/PUT over keep-alive sockets, create-only
// writes with `If-None-Match: *`, own multipart (conditional on Complete), presigned GETs.

import { Agent as HttpAgent } from 'node:http'
import { Agent as HttpsAgent } from 'node:https'
import { Readable } from 'node:stream'
import {
  AbortMultipartUploadCommand,
  CompleteMultipartUploadCommand,
  CreateMultipartUploadCommand,
  DeleteObjectCommand,
  GetObjectCommand,
  HeadObjectCommand,
  ListObjectsV2Command,
  ListPartsCommand,
  PutObjectCommand,
  S3Client,
  UploadPartCommand,
} from '@aws-sdk/client-s3'
import { getSignedUrl } from '@aws-sdk/s3-request-presigner'
import { StoreError } from '../../core/errors.ts'
import { RangeNotSatisfiableError, storeTimeout, storeUnavailable } from './errors.ts'
import {
  type ByteRange,
  type DeleteOptions,
  type GetOptions,
  type ObjectStore,
  type PresignUploadOptions,
  type PutResult,
  partLengths,
  type StoreObject,
  type UploadTargets,
} from './types.ts'

export interface S3StoreOptions {
  bucket: string
  /** Endpoint URL for S3-compatible servers (RadosGW, MinIO…); omit for AWS. */
  endpoint?: string
  /** @default 'us-east-1' */
  region?: string
  /** Static credentials; omitted → the SDK's default chain (env, profile, IAM role). */
  credentials?: { accessKeyId: string; secretAccessKey: string; sessionToken?: string }
  /** Path-style URLs (bucket in the path): needed by most non-AWS endpoints. @default true when endpoint is set */
  forcePathStyle?: boolean
  /** Keep-alive sockets per host. @default 256 */
  maxSockets?: number
  /** @default 5000 */
  connectTimeoutMs?: number
  /** Time from sending a request to its response headers (a PUT's includes the upload). @default 120000 */
  requestTimeoutMs?: number
  /** A socket that moves no bytes for this long fails the request (a stalled S3). @default 30000 */
  idleTimeoutMs?: number
  /** SDK attempts per request (retries on 5xx/throttling). @default 2 */
  maxAttempts?: number
  /**
   * Bodies larger than this go up in parts. The create-only condition then sits on
   * CompleteMultipartUpload, which AWS S3 honours but Ceph Pacific RGW ignores (a
   * HEAD first narrows that race to concurrent writers). @default 256 MiB
   */
  multipartThreshold?: number
  /** @default 16 MiB (S3 minimum is 5 MiB) */
  partSize?: number
  /** Parts in flight per upload (memory: partSize × (this + 1)). @default 4 */
  partConcurrency?: number
}

const MIB = 1024 * 1024
const READ_AHEAD_BYTES = 4 * MIB

export class S3Store implements ObjectStore {
  readonly kind = 's3'
  readonly client: S3Client
  readonly bucket: string
  readonly #multipartThreshold: number
  readonly #partSize: number
  readonly #partConcurrency: number
  readonly #agents: { http: HttpAgent; https: HttpsAgent }

  constructor(opts: S3StoreOptions) {
    if (typeof opts?.bucket !== 'string' || opts.bucket === '')
      throw new TypeError('S3Store: bucket is required')
    const partSize = opts.partSize ?? 16 * MIB
    if (!Number.isInteger(partSize) || partSize < 5 * MIB)
      throw new TypeError('S3Store: partSize must be ≥ 5 MiB')
    this.bucket = opts.bucket
    this.#partSize = partSize
    this.#multipartThreshold = opts.multipartThreshold ?? 256 * MIB
    this.#partConcurrency = Math.max(1, opts.partConcurrency ?? 4)
    const maxSockets = opts.maxSockets ?? 256
    this.#agents = {
      http: new HttpAgent({ keepAlive: true, maxSockets }),
      https: new HttpsAgent({ keepAlive: true, maxSockets }),
    }
    this.client = new S3Client({
      region: opts.region ?? 'us-east-1',
      ...(opts.endpoint ? { endpoint: opts.endpoint } : {}),
      forcePathStyle: opts.forcePathStyle ?? opts.endpoint !== undefined,
      ...(opts.credentials ? { credentials: opts.credentials } : {}),
      maxAttempts: opts.maxAttempts ?? 2,
      // The SDK's default logger prints a warning for every streamed PUT it will not
      // retry, including the expected 412 of a create-only PUT; the store reports
      // real failures itself (typed errors, gateway metrics).
      logger: { trace() {}, debug() {}, info() {}, warn() {}, error() {} },
      // Chunk objects carry their own CRCs; SDK-side checksums would cost a pass
      // over every byte and use aws-chunked trailers older S3-compatibles reject.
      requestChecksumCalculation: 'WHEN_REQUIRED',
      responseChecksumValidation: 'WHEN_REQUIRED',
      requestHandler: {
        httpAgent: this.#agents.http,
        httpsAgent: this.#agents.https,
        connectionTimeout: opts.connectTimeoutMs ?? 5000,
        requestTimeout: opts.requestTimeoutMs ?? 120_000,
        throwOnRequestTimeout: true,
        socketTimeout: opts.idleTimeoutMs ?? 30_000,
      },
    })
  }

  async get(name: string, opts: GetOptions = {}): Promise<StoreObject | undefined> {
    try {
      const res = await this.client.send(
        new GetObjectCommand({
          Bucket: this.bucket,
          Key: name,
          ...(opts.range ? { Range: rangeHeader(opts.range) } : {}),
        }),
        opts.signal ? { abortSignal: opts.signal } : {},
      )
      const length = res.ContentLength ?? 0
      let size = length
      let offset = 0
      const m = res.ContentRange ? /^bytes (\d+)-(\d+)\/(\d+)$/.exec(res.ContentRange) : null
      if (m) {
        offset = Number(m[1])
        size = Number(m[3])
      }
      // Buffer a few MiB ahead of the client so S3 reads and client writes overlap.
      const body =
        res.Body instanceof Readable
          ? webStream(res.Body)
          : res.Body
            ? (res.Body.transformToWebStream() as ReadableStream<Uint8Array>)
            : new ReadableStream<Uint8Array>({ start: (c) => c.close() })
      return { body, size, offset, length, ...(res.ETag ? { etag: res.ETag } : {}) }
    } catch (e) {
      if (isNotFound(e)) return undefined
      if (status(e) === 416) {
        const h = await this.head(name)
        if (!h) return undefined
        throw new RangeNotSatisfiableError(h.size)
      }
      throw mapError(e, 'GET')
    }
  }

  async head(name: string): Promise<{ size: number; etag?: string } | undefined> {
    try {
      const res = await this.client.send(new HeadObjectCommand({ Bucket: this.bucket, Key: name }))
      return { size: res.ContentLength ?? 0, ...(res.ETag ? { etag: res.ETag } : {}) }
    } catch (e) {
      if (isNotFound(e)) return undefined
      throw mapError(e, 'HEAD')
    }
  }

  /**
   * A multipart PUT holds up to partConcurrency parts in flight and one being filled; a single
   * PUT, its Readable's read-ahead (READ_AHEAD_BYTES).
   */
  putHoldBytes(size: number): number {
    if (size > this.#multipartThreshold) return Math.min(size, this.#partSize * (this.#partConcurrency + 1))
    return Math.min(size, READ_AHEAD_BYTES)
  }

  /** A GET body reads up to READ_AHEAD_BYTES ahead of its reader (webStream). */
  getHoldBytes(length: number): number {
    return Math.min(length, READ_AHEAD_BYTES)
  }

  async putIfAbsent(
    name: string,
    body: ReadableStream<Uint8Array> | Uint8Array,
    size: number,
  ): Promise<PutResult> {
    if (size > this.#multipartThreshold) return this.#putMultipart(name, body, size)
    // A body stream that errors (failed verification, client gone) must abort the
    // upload, or the SDK would wait on a request that never ends; S3 then drops it.
    const abort = new AbortController()
    let bodyError: unknown
    let Body: Uint8Array | Readable
    if (body instanceof Uint8Array) Body = body
    else {
      const readable = Readable.from(exactly(body, size), {
        objectMode: false,
        highWaterMark: READ_AHEAD_BYTES,
      })
      readable.once('error', (e) => {
        bodyError = e
        abort.abort(e)
      })
      Body = readable
    }
    try {
      await this.client.send(
        new PutObjectCommand({
          Bucket: this.bucket,
          Key: name,
          Body,
          ContentLength: size,
          ContentType: 'application/octet-stream',
          IfNoneMatch: '*',
        }),
        { abortSignal: abort.signal },
      )
      return 'created'
    } catch (e) {
      if (bodyError !== undefined) throw bodyError
      if (status(e) === 412 || errName(e) === 'PreconditionFailed') return 'exists'
      // A concurrent conditional write of the same key is in flight: one will win.
      if (status(e) === 409 || errName(e) === 'ConditionalRequestConflict') {
        if (await this.head(name)) return 'exists'
      }
      throw mapError(e, 'PUT')
    } finally {
      if (Body instanceof Readable && !Body.destroyed) Body.destroy()
    }
  }

  // Parts are read from the stream one at a time (bounded memory), uploaded with
  // bounded concurrency; the create-only condition sits on CompleteMultipartUpload.
  /** Starts a multipart upload of `name`; its upload id. */
  async #createMultipart(name: string): Promise<string> {
    const created = await this.client
      .send(
        new CreateMultipartUploadCommand({
          Bucket: this.bucket,
          Key: name,
          ContentType: 'application/octet-stream',
        }),
      )
      .catch((e) => {
        throw mapError(e, 'CreateMultipartUpload')
      })
    return created.UploadId!
  }

  async #putMultipart(
    name: string,
    body: ReadableStream<Uint8Array> | Uint8Array,
    size: number,
  ): Promise<PutResult> {
    const stream =
      body instanceof Uint8Array
        ? new ReadableStream<Uint8Array>({
            start(c) {
              c.enqueue(body)
              c.close()
            },
          })
        : body
    if (await this.head(name)) {
      await stream.cancel().catch(() => {})
      return 'exists'
    }
    const uploadId = await this.#createMultipart(name)
    const abortUpload = () =>
      this.client
        .send(new AbortMultipartUploadCommand({ Bucket: this.bucket, Key: name, UploadId: uploadId }))
        .catch(() => {})
    const parts: { PartNumber: number; ETag: string }[] = []
    const inFlight = new Set<Promise<void>>()
    let failure: unknown
    const reader = stream.getReader()
    const parts_ = new PartReader(reader)
    try {
      let partNumber = 0
      let total = 0
      for (;;) {
        const part = await parts_.read(Math.min(this.#partSize, size - total))
        if (part.length === 0) break
        total += part.length
        if (total > size)
          throw new StoreError(`body is longer than the declared ${size} bytes`, { status: 400 })
        const n = ++partNumber
        const p = this.client
          .send(
            new UploadPartCommand({
              Bucket: this.bucket,
              Key: name,
              UploadId: uploadId,
              PartNumber: n,
              Body: part,
              ContentLength: part.length,
            }),
          )
          .then((r) => {
            parts.push({ PartNumber: n, ETag: r.ETag ?? '' })
          })
          .catch((e) => {
            failure ??= mapError(e, 'UploadPart')
          })
          .finally(() => inFlight.delete(p))
        inFlight.add(p)
        if (inFlight.size >= this.#partConcurrency) await Promise.race(inFlight)
        if (failure) throw failure
        if (total === size) {
          // Any extra byte means the declared size was wrong: fail, never store a cut object.
          if (await parts_.more())
            throw new StoreError(`body is longer than the declared ${size} bytes`, { status: 400 })
          break
        }
      }
      await Promise.all(inFlight)
      if (failure) throw failure
      if (total !== size) throw new StoreError(`body ended at ${total} of ${size} bytes`, { status: 400 })
      parts.sort((a, b) => a.PartNumber - b.PartNumber)
      try {
        await this.client.send(
          new CompleteMultipartUploadCommand({
            Bucket: this.bucket,
            Key: name,
            UploadId: uploadId,
            MultipartUpload: { Parts: parts },
            IfNoneMatch: '*',
          }),
        )
      } catch (e) {
        if (status(e) === 412 || errName(e) === 'PreconditionFailed') {
          await abortUpload()
          return 'exists'
        }
        throw mapError(e, 'CompleteMultipartUpload')
      }
      return 'created'
    } catch (e) {
      await reader.cancel(e).catch(() => {})
      await Promise.allSettled(inFlight)
      await abortUpload()
      throw e
    }
  }

  async delete(name: string, opts: DeleteOptions = {}): Promise<boolean> {
    const head = await this.head(name)
    // AWS S3 refuses a DELETE If-Match of another version (412); RadosGW Pacific ignores the
    // header and deletes whatever is there: the HEAD narrows that to one round trip.
    if (head && opts.ifMatch !== undefined && head.etag !== undefined && head.etag !== opts.ifMatch)
      return false
    try {
      await this.client.send(
        new DeleteObjectCommand({
          Bucket: this.bucket,
          Key: name,
          ...(opts.ifMatch !== undefined ? { IfMatch: opts.ifMatch } : {}),
        }),
      )
    } catch (e) {
      if (opts.ifMatch !== undefined && (status(e) === 412 || errName(e) === 'PreconditionFailed'))
        return false
      if (opts.ifMatch !== undefined && isNotFound(e)) return false
      throw mapError(e, 'DELETE')
    }
    return head !== undefined
  }

  async list(prefix: string, opts: { cursor?: string; limit?: number } = {}) {
    try {
      const res = await this.client.send(
        new ListObjectsV2Command({
          Bucket: this.bucket,
          Prefix: prefix,
          MaxKeys: opts.limit ?? 1000,
          ...(opts.cursor ? { StartAfter: opts.cursor } : {}),
        }),
      )
      const entries = (res.Contents ?? []).map((o) => ({
        name: o.Key ?? '',
        size: o.Size ?? 0,
        ...(o.LastModified ? { modified: o.LastModified.getTime() } : {}),
      }))
      const last = entries[entries.length - 1]
      return res.IsTruncated && last ? { entries, cursor: last.name } : { entries }
    } catch (e) {
      throw mapError(e, 'LIST')
    }
  }

  async presignGet(name: string, expiresInSeconds: number): Promise<string> {
    return getSignedUrl(this.client, new GetObjectCommand({ Bucket: this.bucket, Key: name }), {
      expiresIn: expiresInSeconds,
    })
  }

  // Content-Length is a signed header, so S3 refuses a body of any other size at
  // upload time; the gateway's commit checks the size again either way.
  async presignUpload(name: string, size: number, opts: PresignUploadOptions): Promise<UploadTargets> {
    const signing = { expiresIn: opts.expiresInSeconds, signableHeaders: new Set(['content-length']) }
    const sign = (command: PutObjectCommand | UploadPartCommand) =>
      command instanceof PutObjectCommand
        ? getSignedUrl(this.client, command, signing)
        : getSignedUrl(this.client, command, signing)
    if (size <= opts.multipartThreshold) {
      const url = await sign(new PutObjectCommand({ Bucket: this.bucket, Key: name, ContentLength: size }))
      return { parts: [{ url, offset: 0, length: size }] }
    }
    if (!Number.isInteger(opts.partBytes) || opts.partBytes < 5 * MIB)
      throw new TypeError('S3Store: upload parts must be ≥ 5 MiB')
    if (size / opts.partBytes > 10_000) throw new TypeError('S3Store: more than 10000 parts')
    const multipartId = await this.#createMultipart(name)
    const parts = []
    let offset = 0
    for (const [i, length] of partLengths(size, opts.partBytes).entries()) {
      const n = i + 1
      const url = await sign(
        new UploadPartCommand({
          Bucket: this.bucket,
          Key: name,
          UploadId: multipartId,
          PartNumber: n,
          ContentLength: length,
        }),
      )
      parts.push({ url, offset, length })
      offset += length
    }
    return { multipartId, parts }
  }

  // The part list comes from S3 (ListParts), not from the client: a missing,
  // extra or wrongly sized part aborts the upload instead of completing a cut object.
  async completeUpload(
    name: string,
    multipartId: string,
    partLengths: readonly number[],
  ): Promise<'completed' | 'missing' | 'mismatch'> {
    const seen: { PartNumber: number; ETag: string; Size: number }[] = []
    let marker: string | undefined
    try {
      for (;;) {
        const page = await this.client.send(
          new ListPartsCommand({
            Bucket: this.bucket,
            Key: name,
            UploadId: multipartId,
            ...(marker ? { PartNumberMarker: marker } : {}),
          }),
        )
        for (const p of page.Parts ?? [])
          seen.push({ PartNumber: p.PartNumber ?? 0, ETag: p.ETag ?? '', Size: p.Size ?? -1 })
        if (!page.IsTruncated || !page.NextPartNumberMarker || seen.length > partLengths.length) break
        marker = String(page.NextPartNumberMarker)
      }
    } catch (e) {
      if (isNoSuchUpload(e)) return 'missing'
      throw mapError(e, 'ListParts')
    }
    seen.sort((a, b) => a.PartNumber - b.PartNumber)
    const matches =
      seen.length === partLengths.length &&
      seen.every((p, i) => p.PartNumber === i + 1 && p.Size === partLengths[i])
    if (!matches) {
      await this.abortUpload(name, multipartId)
      return 'mismatch'
    }
    try {
      await this.client.send(
        new CompleteMultipartUploadCommand({
          Bucket: this.bucket,
          Key: name,
          UploadId: multipartId,
          MultipartUpload: { Parts: seen.map((p) => ({ PartNumber: p.PartNumber, ETag: p.ETag })) },
        }),
      )
    } catch (e) {
      if (isNoSuchUpload(e)) return 'missing'
      throw mapError(e, 'CompleteMultipartUpload')
    }
    return 'completed'
  }

  async abortUpload(name: string, multipartId: string): Promise<void> {
    try {
      await this.client.send(
        new AbortMultipartUploadCommand({ Bucket: this.bucket, Key: name, UploadId: multipartId }),
      )
    } catch (e) {
      if (!isNoSuchUpload(e)) throw mapError(e, 'AbortMultipartUpload')
    }
  }

  async close(): Promise<void> {
    this.client.destroy()
    this.#agents.http.destroy()
    this.#agents.https.destroy()
  }
}

// A Node response body as a web stream that reads up to READ_AHEAD_BYTES ahead
// of the client (Readable.toWeb's default strategy pauses the socket per piece).
// Pieces pass through uncopied: regrouping them into blocks cost more CPU (copies,
// allocation, GC) than the stream hops it saved.
function webStream(source: Readable): ReadableStream<Uint8Array> {
  const it = source[Symbol.asyncIterator]() as AsyncIterator<Uint8Array>
  return new ReadableStream<Uint8Array>(
    {
      async pull(c) {
        const { done, value } = await it.next()
        if (done) c.close()
        else c.enqueue(value)
      },
      cancel(reason) {
        source.destroy(reason instanceof Error ? reason : undefined)
      },
    },
    new ByteLengthQueuingStrategy({ highWaterMark: READ_AHEAD_BYTES }),
  )
}

// Passes a stream through, failing when it is longer or shorter than declared: a
// short body must abort the upload rather than leave S3 waiting for the rest.
async function* exactly(body: ReadableStream<Uint8Array>, size: number): AsyncGenerator<Uint8Array> {
  let seen = 0
  const reader = body.getReader()
  try {
    for (;;) {
      const { done, value } = await reader.read()
      if (done) break
      seen += value.length
      if (seen > size) throw new StoreError(`body is longer than the declared ${size} bytes`, { status: 400 })
      yield value
    }
  } finally {
    reader.releaseLock()
  }
  if (seen !== size) throw new StoreError(`body ended at ${seen} of ${size} bytes`, { status: 400 })
}

// Cuts a stream into parts of a fixed size; a source piece may straddle parts.
class PartReader {
  #left: Uint8Array | undefined
  constructor(readonly reader: ReadableStreamDefaultReader<Uint8Array>) {}

  /** Up to `want` bytes; shorter only at the end of the stream. */
  async read(want: number): Promise<Uint8Array> {
    const buf = new Uint8Array(want)
    let at = 0
    while (at < want) {
      let piece = this.#left
      this.#left = undefined
      if (!piece) {
        const { done, value } = await this.reader.read()
        if (done) break
        piece = value
      }
      const take = Math.min(piece.length, want - at)
      buf.set(piece.subarray(0, take), at)
      at += take
      if (take < piece.length) this.#left = piece.subarray(take)
    }
    return at === want ? buf : buf.subarray(0, at)
  }

  /** True when bytes remain (leftover or more from the stream). */
  async more(): Promise<boolean> {
    if (this.#left && this.#left.length > 0) return true
    for (;;) {
      const { done, value } = await this.reader.read()
      if (done) return false
      if (value.length > 0) {
        this.#left = value
        return true
      }
    }
  }
}

function rangeHeader(r: ByteRange): string {
  if ('suffix' in r) return `bytes=-${r.suffix}`
  return r.length === undefined ? `bytes=${r.offset}-` : `bytes=${r.offset}-${r.offset + r.length - 1}`
}

function status(e: unknown): number | undefined {
  return (e as { $metadata?: { httpStatusCode?: number } }).$metadata?.httpStatusCode
}

function errName(e: unknown): string {
  return (e as { name?: string }).name ?? ''
}

function isNotFound(e: unknown): boolean {
  return status(e) === 404 || errName(e) === 'NoSuchKey' || errName(e) === 'NotFound'
}

function isNoSuchUpload(e: unknown): boolean {
  return status(e) === 404 || errName(e) === 'NoSuchUpload'
}

const UNAVAILABLE = new Set([
  'ECONNREFUSED',
  'ECONNRESET',
  'EPIPE',
  'EHOSTUNREACH',
  'ENOTFOUND',
  'EAI_AGAIN',
  'ECONNABORTED',
])

/** SDK/network failures → StoreError: 503 when the store is unreachable or slow, 502 otherwise. */
function mapError(e: unknown, op: string): StoreError {
  if (e instanceof StoreError) return e
  const code = (e as { code?: string }).code ?? ''
  const name = errName(e)
  const msg = (e as Error).message ?? String(e)
  // The SDK labels a reset socket "TimeoutError": trust the errno code first.
  if (UNAVAILABLE.has(code) || status(e) === 503 || name === 'AbortError') {
    return storeUnavailable(`object store unavailable during ${op} (${code || name})`, e)
  }
  if (
    name === 'TimeoutError' ||
    code === 'ETIMEDOUT' ||
    name === 'RequestTimeout' ||
    /timed? ?out/i.test(msg)
  ) {
    return storeTimeout(`object store ${op} timed out`, e)
  }
  return new StoreError(`object store ${op} failed: ${name || code} ${status(e) ?? ''} ${msg}`.trim(), {
    cause: e,
  })
}
