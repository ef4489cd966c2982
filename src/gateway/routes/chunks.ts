// /v1/ns/{ns}/chunks/{key}: create-only verified PUT, GET (Range, ?layers=a-b,
// presigned 307 for large objects, coalesced store GETs), HEAD and admin DELETE.

import type { Context, Hono } from 'hono'
import { ROOT_PARENT } from '../../coldtier/records.ts'
import { KvgateError } from '../../core/errors.ts'
import {
  type ChunkHeader,
  decodeHeader,
  HEADER_PREFIX_BYTES,
  headerBytesFor,
  layerSpan,
  readHeaderLength,
} from '../../core/format.ts'
import { assertKeyHex, assertNamespaceName, objectName, toHex } from '../../core/keys.ts'
import { admitted } from '../admission.ts'
import { chunkETag, ifRangeHolds, matchesNoneMatch } from '../chunk-etag.ts'
import type { CachedHeader, GatewayState } from '../context.ts'
import type { GatewayEnv } from '../env.ts'
import { isCorruption, namespaceIdOf, reportCorruptRead, type VerifyTarget } from '../heal.ts'
import {
  badRequest,
  lengthRequired,
  notFound,
  payloadTooLarge,
  unsupportedMediaType,
} from '../http-errors.ts'
import { bodyHoldBytes, type MemoryLease } from '../memory-budget.ts'
import { authorize, type Scope } from '../middleware/auth.ts'
import { holdStoreStream, readerPace } from '../reader-pace.ts'
import { RangeNotSatisfiableError, storeBodyFailure } from '../stores/errors.ts'
import type { ByteRange, StoreObject } from '../stores/types.ts'
import { iteratorSource, type PieceSource, streamSource, verifiedBody } from '../verified-body.ts'
import {
  checkedStream,
  checkIdentity,
  lengthCheck,
  objectCheck,
  type PieceReader,
  resumedReader,
  type StreamCheck,
  sectionsCheck,
} from '../verified-read.ts'

const PATH = '/v1/ns/:ns/chunks/:key'
// Enough for the header of a 247-layer (v1) / 244-layer (v2) model in one ranged GET; larger ones take a second.
const HEADER_PROBE_BYTES = 4096

function target(c: Context<GatewayEnv>, state: GatewayState, scope: Scope) {
  const ns = assertNamespaceName(c.req.param('ns'))
  const key = assertKeyHex(c.req.param('key'))
  authorize(c, ns, scope)
  c.set('ns', ns)
  return { ns, key, name: objectName(state.prefix, ns, key) }
}

export function chunkRoutes(app: Hono<GatewayEnv>, state: GatewayState): void {
  app.put(PATH, async (c) => {
    const { ns, key, name } = target(c, state, 'write')
    const type = (c.req.header('content-type') ?? '').split(';')[0]!.trim().toLowerCase()
    if (type !== 'application/octet-stream') {
      throw unsupportedMediaType(
        `chunk uploads must be application/octet-stream, got ${JSON.stringify(type || 'none')}`,
      )
    }
    const lenHeader = c.req.header('content-length')
    if (lenHeader === undefined) throw lengthRequired()
    if (!/^\d{1,15}$/.test(lenHeader)) throw badRequest('invalid Content-Length')
    const size = Number(lenHeader)
    if (size > state.limits.maxChunkBytes) {
      throw payloadTooLarge(
        `chunk is ${size} bytes; this gateway accepts at most ${state.limits.maxChunkBytes}`,
      )
    }
    if (size < headerBytesFor(1))
      throw new KvgateError('ERR_FORMAT_TRUNCATED', `a ${size}-byte body cannot be a chunk`, { status: 400 })
    // Bodies stream through, but each holds read-ahead (and the store's parts) and a socket:
    // admitted against the bytes in flight and the memory budget, both given back when it ends.
    const need = { declared: size, held: bodyHoldBytes(size, state.store) }
    const nsId = namespaceIdOf(ns)
    const { result, header } = await admitted(state, 'put', need, async () => {
      const source = requestBodySource(c)
      if (!source) throw badRequest('missing request body')
      const vb = verifiedBody(source, {
        keyHex: key,
        size,
        maxBytes: state.limits.maxChunkBytes,
        idleTimeoutMs: state.limits.bodyIdleTimeoutMs,
        minBytesPerSecond: state.limits.bodyMinBytesPerSecond,
        ...(nsId ? { namespaceIdHex: nsId } : {}),
      })
      try {
        // Always the store's create-only write (a conditional PUT's 412, link()'s
        // EEXIST): a cached presence may be stale, and "exists" from it stores nothing.
        const result = await state.store.putIfAbsent(name, vb.stream, size)
        // The store may say "exists" without reading the body: read the rest, so a
        // client that closes after its request (Connection: close) still gets the answer.
        if (result === 'exists') await vb.drain()
        return { result, header: vb.header() }
      } catch (e) {
        state.metrics.puts.inc({ result: 'rejected' })
        vb.release(e)
        throw vb.failure() ?? e
      }
    })
    if (result === 'exists') {
      state.usage?.use(ns, key, 0)
      const head = await state.store.head(name)
      if (head) state.lookup.remember(name, head.size)
      state.metrics.puts.inc({ result: 'exists' })
      // First writer wins, whatever its size (a lossy re-encode elsewhere): both are the same prefix.
      return c.json({ status: 'exists', bytes: head?.size ?? size }, 200)
    }
    state.lookup.remember(name, size)
    state.headers.delete(name)
    // A chain's first chunk names the namespace seed, never a stored chunk: ROOT_PARENT tells gc so.
    const parent = header && (header.chunkIndex === 0 ? ROOT_PARENT : toHex(header.parentKey))
    if (parent) state.usage?.created(ns, key, parent, size)
    state.metrics.puts.inc({ result: 'created' })
    state.metrics.bytesIn.inc({}, size)
    state.written.objects++
    state.written.bytes += size
    c.set('bytes', size)
    return c.json({ status: 'created', bytes: size }, 201)
  })

  app.get(PATH, async (c) => {
    const t = target(c, state, 'read')
    const { name, ns, key } = t
    const ifNoneMatch = c.req.header('if-none-match')
    const notModified = (etag: string) => c.body(null, 304, { etag })
    if (c.req.method === 'HEAD') {
      const spec = c.req.query('layers')
      if (spec !== undefined && c.req.header('range') !== undefined)
        throw badRequest('use either Range or ?layers=, not both')
      const layers = spec === undefined ? undefined : parseLayers(spec)
      // What the same GET would send, from the object's header (its tag is derived from it).
      const entry = await currentHeader(state, t)
      const span = layers && layersSpan(entry.header, layers.first, layers.last)
      state.usage?.use(ns, key)
      state.lookup.remember(name, entry.size)
      const etag = chunkETag(entry, layers)
      if (matchesNoneMatch(ifNoneMatch, etag)) return notModified(etag)
      if (layers && span) {
        return c.body(null, 200, {
          'content-length': String(entry.bytes.length + span.end - span.start),
          'content-type': 'application/octet-stream',
          'x-kvgate-layers': `${layers.first}-${layers.last}`,
          etag,
        })
      }
      return c.body(null, 200, {
        'content-length': String(entry.size),
        'accept-ranges': 'bytes',
        'content-type': 'application/octet-stream',
        etag,
      })
    }
    const layers = c.req.query('layers')
    const rangeHeader = c.req.header('range')
    if (layers !== undefined) {
      if (rangeHeader !== undefined) throw badRequest('use either Range or ?layers=, not both')
      const res = await layersAnswer(c, state, t, layers, ifNoneMatch)
      state.usage?.use(ns, key)
      return res
    }
    let range = rangeHeader === undefined ? undefined : await requestedRange(state, name, rangeHeader)

    if (state.presign) {
      const size = state.lookup.cached(name) ?? (await state.store.head(name))?.size
      if (size === undefined) {
        state.lookup.invalidateFrom(name)
        throw notFound()
      }
      state.lookup.remember(name, size)
      if (size >= state.presign.minBytes) {
        state.usage?.use(ns, key)
        const url = await state.store.presignGet!(name, state.presign.expiresSeconds)
        state.metrics.redirects.inc()
        return c.body(null, 307, { location: url, 'cache-control': 'no-store' })
      }
    }

    const ifRange = range && c.req.header('if-range')
    let obj: StoreObject & { buffered: boolean }
    try {
      obj = await fetchChunk(state, name, range, rangeHeader)
    } catch (e) {
      // RFC 9110 §13.2.2: the preconditions come before the range. A range past the end of the
      // object stored now, asked with If-Range of another version (a smaller re-encode replaced
      // it), is the whole object; with If-None-Match of this one, 304.
      if (!(e instanceof RangeNotSatisfiableError) || (ifRange === undefined && ifNoneMatch === undefined))
        throw e
      const etag = chunkETag(await readHeader(state, t))
      if (matchesNoneMatch(ifNoneMatch, etag)) {
        state.usage?.use(ns, key)
        return notModified(etag)
      }
      if (ifRange === undefined || ifRangeHolds(ifRange, etag)) throw e
      range = undefined
      obj = await fetchChunk(state, name, undefined, undefined)
    }
    // The store body is open from here: what the store reads ahead of it is reserved before
    // anything else is awaited (a header peeked off it, the tag's header read), so a GET the
    // budget cannot take reads nothing more. A shared buffer is in the budget already.
    let held = storeHold(state, obj)
    let entry: CachedHeader | undefined
    let body: ReadableStream<Uint8Array> | PieceReader
    try {
      if (range) {
        // A range says nothing of the header: its tag comes from the cached header, or one read
        // when a precondition needs it.
        entry = await rangeVersionHeader(state, t, obj, ifRange !== undefined || ifNoneMatch !== undefined)
        const etag = entry && chunkETag(entry)
        if (etag !== undefined && matchesNoneMatch(ifNoneMatch, etag)) {
          await obj.body.cancel().catch(() => {})
          held?.release()
          state.usage?.use(ns, key)
          return notModified(etag)
        }
        if (ifRange !== undefined && !ifRangeHolds(ifRange, etag)) {
          // The client's copy is another version (or unknown): the whole object, not its range.
          await obj.body.cancel().catch(() => {})
          held?.release()
          held = undefined
          range = undefined
          obj = await fetchChunk(state, name, undefined, undefined)
          held = storeHold(state, obj)
        }
      }
      if (range) body = obj.body
      else {
        // The whole object's header is its first bytes: read off the body, no store read of its own.
        const peeked = await peekHeader(state, t, obj)
        entry = peeked.entry
        body = peeked.body
        const etag = chunkETag(entry)
        if (matchesNoneMatch(ifNoneMatch, etag)) {
          await body.cancel().catch(() => {})
          held?.release()
          state.usage?.use(ns, key)
          state.lookup.remember(name, obj.size)
          return notModified(etag)
        }
      }
    } catch (e) {
      held?.release()
      throw e
    }
    state.usage?.use(ns, key)
    if (!range) state.lookup.remember(name, obj.size)
    state.metrics.bytesOut.inc({}, obj.length)
    c.set('bytes', obj.length)
    const headers: Record<string, string> = {
      'content-type': 'application/octet-stream',
      'content-length': String(obj.length),
      'accept-ranges': 'bytes',
    }
    if (entry) headers.etag = chunkETag(entry)
    // A whole object is verified as it streams (a range's bytes are the client's to check, its length is ours).
    const nsId = namespaceIdOf(t.ns)
    const check = range
      ? lengthCheck(obj.length)
      : objectCheck({
          keyHex: t.key,
          maxBytes: Math.max(state.limits.maxChunkBytes, obj.size),
          ...(nsId ? { namespaceIdHex: nsId } : {}),
        })
    const served = servedStream(c, state, body, check, t, false, obj.size, held)
    if (range) {
      headers['content-range'] = `bytes ${obj.offset}-${obj.offset + obj.length - 1}/${obj.size}`
      return c.body(served, 206, headers)
    }
    return c.body(served, 200, headers)
  })

  app.delete(PATH, async (c) => {
    const { name } = target(c, state, 'admin')
    const existed = await state.store.delete(name)
    // Absent from now on, with the rest of its chain: a later chunk still stored would
    // otherwise let a lookup infer this one present again.
    state.lookup.invalidateFrom(name)
    state.headers.delete(name)
    if (!existed) throw notFound()
    return c.body(null, 204)
  })
}

/** A store body on its way to the client: checked, cut off when the reader idles or trickles, healed when corrupt. */
function servedStream(
  c: Context<GatewayEnv>,
  state: GatewayState,
  src: ReadableStream<Uint8Array> | PieceReader,
  check: StreamCheck | undefined,
  t: VerifyTarget,
  layers: boolean,
  size: number,
  held: MemoryLease | undefined,
): ReadableStream<Uint8Array> {
  return checkedStream(src, check, {
    ...readerPace(state, c, held),
    // A store fault (a range served short) says nothing about the object.
    onCorrupt: (e) => {
      if (isCorruption(e)) reportCorruptRead(state, t, layers, size)
    },
  })
}

/**
 * The request body as pieces. On Node (@hono/node-server puts the IncomingMessage
 * in c.env.incoming) it is iterated directly: the web-stream view the adapter
 * builds costs two stream hops and a pause/resume per 16–64 KiB piece. Duck-typed,
 * so the app keeps no node: import; other runtimes use the Request body.
 */
function requestBodySource(c: Context<GatewayEnv>): PieceSource | undefined {
  const incoming = (c.env as { incoming?: unknown } | undefined)?.incoming as
    | {
        [Symbol.asyncIterator]?: () => AsyncIterator<Uint8Array>
        readableDidRead?: boolean
        readableEnded?: boolean
      }
    | undefined
  const iterate = incoming?.[Symbol.asyncIterator]
  if (
    typeof iterate === 'function' &&
    incoming?.readableDidRead === false &&
    incoming.readableEnded === false
  ) {
    return iteratorSource(iterate.call(incoming))
  }
  const body = c.req.raw.body
  return body ? streamSource(body) : undefined
}

/**
 * The Range header's bytes. An inverted one (end before start) is a 416 like one past the end,
 * and says the object's length the same way: looked up here, since no store read says it.
 */
async function requestedRange(state: GatewayState, name: string, h: string): Promise<ByteRange> {
  try {
    return parseRange(h)
  } catch (e) {
    if (!(e instanceof KvgateError) || e.status !== 416) throw e
    const size = state.lookup.cached(name) ?? (await state.store.head(name))?.size
    if (size === undefined) return notFoundFrom(state, name)
    throw new RangeNotSatisfiableError(size)
  }
}

/** `bytes=a-b`, `bytes=a-`, `bytes=-n`; one range only. */
export function parseRange(h: string): ByteRange {
  const m = /^bytes=(\d{0,15})-(\d{0,15})$/.exec(h.trim())
  if (!m || (m[1] === '' && m[2] === ''))
    throw badRequest(`unsupported Range ${JSON.stringify(h.slice(0, 80))}: use bytes=a-b`)
  if (m[1] === '') {
    // RFC 9110 §14.1.1: only a non-zero suffix is satisfiable; asked of S3 it would not say so.
    const suffix = Number(m[2])
    if (suffix === 0)
      throw new KvgateError('ERR_RANGE_NOT_SATISFIABLE', 'an empty suffix range', { status: 416 })
    return { suffix }
  }
  const offset = Number(m[1])
  if (m[2] === '') return { offset }
  const end = Number(m[2])
  if (end < offset)
    throw new KvgateError('ERR_RANGE_NOT_SATISFIABLE', `range end ${end} is before start ${offset}`, {
      status: 416,
    })
  return { offset, length: end - offset + 1 }
}

/** A short store read whole; a body the store broke off fails as a GET's does (storeBodyFailure). */
async function readAll(obj: StoreObject): Promise<Uint8Array> {
  const out = new Uint8Array(obj.length)
  let at = 0
  const reader = obj.body.getReader()
  try {
    for (;;) {
      const { done, value } = await reader.read()
      if (done) break
      out.set(value.subarray(0, Math.min(value.length, out.length - at)), at)
      at += value.length
    }
  } catch (e) {
    await reader.cancel(e).catch(() => {})
    throw storeBodyFailure(e)
  }
  return out.subarray(0, Math.min(at, out.length))
}

/**
 * The stored object's header, decoded and checked to name this chunk (key; namespace id when
 * the namespace is named by one), as a whole GET checks it: a header that fails is a corrupt
 * read, counted and verified in the background (deleted when corrupt), then a 502.
 */
async function readHeader(state: GatewayState, t: VerifyTarget): Promise<CachedHeader> {
  const seen: { size?: number } = {}
  try {
    return await decodeStoredHeader(state, t, seen)
  } catch (e) {
    if (isCorruption(e)) reportCorruptRead(state, t, true, seen.size)
    throw e
  }
}

/** `seen.size`: the object's size once a read has said it (what a failure is remembered by). */
async function decodeStoredHeader(
  state: GatewayState,
  t: VerifyTarget,
  seen: { size?: number },
): Promise<CachedHeader> {
  const { name } = t
  let probe: StoreObject | undefined
  try {
    probe = await state.store.get(name, { range: { offset: 0, length: HEADER_PROBE_BYTES } })
  } catch (e) {
    if (e instanceof RangeNotSatisfiableError)
      throw new KvgateError('ERR_FORMAT_TRUNCATED', 'stored object is empty', { status: 502 })
    throw e
  }
  if (!probe) return notFoundFrom(state, name)
  seen.size = probe.size
  let bytes = await readAll(probe)
  if (bytes.length < HEADER_PREFIX_BYTES) throw corrupt('stored object is too short for a chunk header')
  const headerBytes = guard(() => readHeaderLength(bytes))
  let version = { size: probe.size, etag: probe.etag }
  if (headerBytes > bytes.length) {
    const more = await state.store.get(name, { range: { offset: 0, length: headerBytes } })
    if (!more) return notFoundFrom(state, name)
    seen.size = more.size
    bytes = await readAll(more)
    version = { size: more.size, etag: more.etag }
  }
  return headerEntry(state, t, bytes, version)
}

/**
 * `bytes` (at least the header) of the object version `version` decoded, checked and cached: the
 * header names this chunk (key; namespace id when the namespace is named by one), as a whole GET
 * checks it, and the object's size.
 */
function headerEntry(
  state: GatewayState,
  t: VerifyTarget,
  bytes: Uint8Array,
  version: { size: number; etag: string | undefined },
): CachedHeader {
  const headerBytes = guard(() => readHeaderLength(bytes))
  if (headerBytes > bytes.length) throw corrupt(`stored object ends inside its ${headerBytes}-byte header`)
  // The bound a whole GET verifies against: a chunk this gateway took (maxChunkBytes may pass
  // the format's 512 MiB default) or one the store holds is not corrupt for its size alone.
  const maxBytes = Math.max(state.limits.maxChunkBytes, version.size)
  const header = guard(() => decodeHeader(bytes.subarray(0, headerBytes), { maxBytes }))
  const nsId = namespaceIdOf(t.ns)
  guard(() => checkIdentity(header, { keyHex: t.key, ...(nsId ? { namespaceIdHex: nsId } : {}) }))
  // Cut short or carrying bytes past its end, it is not the object its header describes: corrupt
  // (a whole GET fails it too). Taken for another version, every layer read would answer 503.
  if (header.totalBytes !== version.size)
    throw corrupt(`stored object is ${version.size} bytes, its header says ${header.totalBytes}`)
  const entry: CachedHeader = { header, bytes: bytes.slice(0, headerBytes), ...version, readAt: Date.now() }
  state.headers.set(t.name, entry)
  return entry
}

/**
 * What `obj`'s open body holds ahead of its reader, reserved (503 ERR_BUSY past the bound, the
 * body released); none for a shared buffer (in the budget already). Given back by the served
 * stream's end, or by whichever path answers without it.
 */
function storeHold(state: GatewayState, obj: StoreObject & { buffered: boolean }): MemoryLease | undefined {
  return obj.buffered ? undefined : holdStoreStream(state, obj, 'get')
}

/** The store's answer to a chunk GET (coalesced with concurrent ones of the same range); 404 when absent. */
async function fetchChunk(
  state: GatewayState,
  name: string,
  range: ByteRange | undefined,
  rangeHeader: string | undefined,
): Promise<StoreObject & { buffered: boolean }> {
  const fetchIt = () => state.store.get(name, range ? { range } : {})
  let obj: StoreObject | undefined
  let buffered = false
  if (state.coalescer) {
    const r = await state.coalescer.get(`${name}|${rangeHeader ?? ''}`, fetchIt)
    if (r.coalesced) state.metrics.coalesced.inc()
    obj = r.obj
    buffered = r.buffered
  } else obj = await fetchIt()
  if (!obj) return notFoundFrom(state, name)
  return { ...obj, buffered }
}

/**
 * The header of the version `obj` (a range of it) was read from: cached, else read when a
 * precondition (If-Range, If-None-Match) needs its tag. A tag is optional on a 206: a header read
 * only to tag one cost each plain Range GET a store round trip, and failed the range when it
 * failed. Undefined when none is had (not needed; a header that does not decode, reported as a
 * corrupt read; the object replaced or gone between the reads; the read failed: the store down a
 * moment): the range is served without a tag then (and a failed If-Range gets the whole object).
 */
async function rangeVersionHeader(
  state: GatewayState,
  t: VerifyTarget,
  obj: StoreObject,
  needed: boolean,
): Promise<CachedHeader | undefined> {
  const cached = state.headers.get(t.name)
  if (cached && provenSameVersion(cached, obj)) return cached
  if (!needed) return undefined
  try {
    const entry = await readHeader(state, t)
    return provenSameVersion(entry, obj) ? entry : undefined
  } catch {
    return undefined
  }
}

/**
 * sameVersion where a range's tag depends on it: the store's version tag on both, equal. A range's
 * bytes are not verified here, so size alone (a store naming no version) cannot tell a same-size
 * replacement: tagged with the old header, its bytes would pass an If-Range of the old version
 * and the client would splice two versions' ranges. Untagged then (a failed If-Range: the whole object).
 */
function provenSameVersion(h: CachedHeader, obj: StoreObject): boolean {
  return h.etag !== undefined && obj.etag !== undefined && sameVersion(h, obj)
}

/**
 * A whole object's header read off the front of its body (no store read of its own), decoded
 * and checked as readHeader checks it; the body handed back whole. A header that fails is a
 * corrupt read (verified in the background) and a 502 before any byte is sent.
 */
async function peekHeader(
  state: GatewayState,
  t: VerifyTarget,
  obj: StoreObject,
): Promise<{ entry: CachedHeader; body: PieceReader }> {
  const reader = obj.body.getReader()
  const pieces: Uint8Array[] = []
  let have = 0
  const readTo = async (n: number) => {
    while (have < n) {
      const { done, value } = await reader.read()
      if (done) throw corrupt(`stored object ends at ${have} bytes, inside its header`)
      pieces.push(value)
      have += value.length
    }
  }
  let entry: CachedHeader
  try {
    await readTo(HEADER_PREFIX_BYTES)
    const headerBytes = guard(() => readHeaderLength(front(pieces, HEADER_PREFIX_BYTES)))
    await readTo(headerBytes)
    entry = headerEntry(state, t, front(pieces, headerBytes), { size: obj.size, etag: obj.etag })
  } catch (e) {
    await reader.cancel(e).catch(() => {})
    if (isCorruption(e)) reportCorruptRead(state, t, false, obj.size)
    throw storeBodyFailure(e)
  }
  return { entry, body: resumedReader(pieces, reader) }
}

/**
 * The first `n` bytes of `pieces` (which hold at least that many): a view of the first piece when
 * it holds them, else a copy of just those bytes. A piece may be a whole MiB (fs) or the whole
 * object (memory): copying the pieces whole would cost a copy of up to all of it per GET.
 */
function front(pieces: readonly Uint8Array[], n: number): Uint8Array {
  if (pieces[0]!.length >= n) return pieces[0]!.subarray(0, n)
  const out = new Uint8Array(n)
  let at = 0
  for (const p of pieces) {
    if (at >= n) break
    const take = p.subarray(0, n - at)
    out.set(take, at)
    at += take.length
  }
  return out
}

function notFoundFrom(state: GatewayState, name: string): never {
  state.lookup.invalidateFrom(name)
  state.headers.delete(name)
  throw notFound()
}

// A stored object that fails to decode is the store's fault, not the client's.
function corrupt(message: string): KvgateError {
  return new KvgateError('ERR_FORMAT_CHECKSUM', `stored chunk is corrupt: ${message}`, { status: 502 })
}
function guard<T>(fn: () => T): T {
  try {
    return fn()
  } catch (e) {
    throw corrupt((e as Error).message)
  }
}

/** True when `obj` is the object version `h` was read from (size, and ETag where both have one). */
function sameVersion(h: CachedHeader, obj: StoreObject): boolean {
  if (obj.size !== h.size || h.header.totalBytes !== obj.size) return false
  return h.etag === undefined || obj.etag === undefined || h.etag === obj.etag
}

/** `?layers=a-b` as numbers (the header says whether they are its layers). */
function parseLayers(spec: string): { first: number; last: number } {
  const m = /^(\d{1,4})-(\d{1,4})$/.exec(spec)
  if (!m) throw badRequest(`invalid layers ${JSON.stringify(spec.slice(0, 40))}: use layers=a-b`)
  return { first: Number(m[1]), last: Number(m[2]) }
}

/** The bytes of layers first..last in the object `header` describes; 416 when it has no such layers. */
function layersSpan(header: ChunkHeader, first: number, last: number): { start: number; end: number } {
  if (first > last || last >= header.sections.length) {
    throw new KvgateError(
      'ERR_RANGE_NOT_SATISFIABLE',
      `layers ${first}-${last} not in 0-${header.sections.length - 1}`,
      { status: 416 },
    )
  }
  return layerSpan(header, first, last)
}

/**
 * The header of the object stored now, for answers that read no other byte of it (HEAD): the
 * cached one while the presence cache vouches for an object of its size (a HEAD trusts it for
 * the size as well) and it was read within the presence TTL, else read from the store. The
 * presence alone is re-learned without the bytes (a lookup's probe, another instance's re-PUT of
 * the same size): a header older than it may be another object's, whose tag would then pass for
 * this one's for as long as lookups keep the presence fresh.
 */
async function currentHeader(state: GatewayState, t: VerifyTarget): Promise<CachedHeader> {
  const cached = state.headers.get(t.name)
  if (
    cached &&
    state.lookup.cached(t.name) === cached.size &&
    Date.now() - cached.readAt < state.lookup.presenceTtlMs
  )
    return cached
  return readHeader(state, t)
}

async function layersAnswer(
  c: Context<GatewayEnv>,
  state: GatewayState,
  t: VerifyTarget,
  spec: string,
  ifNoneMatch: string | undefined,
) {
  const { name } = t
  const { first, last } = parseLayers(spec)
  const cached = state.headers.get(name)
  let entry = cached ?? (await readHeader(state, t))
  let read = cached === undefined
  let obj: StoreObject | undefined
  // A cached header may describe an object deleted and re-written since (another
  // instance): the sections' read tells its version; on a mismatch read the header again.
  for (let attempt = 0; ; attempt++) {
    const span = layersSpan(entry.header, first, last)
    const length = span.end - span.start
    if (length === 0) {
      // No section read to tell the version by: the header itself is read, unless it just was.
      if (read) break
      state.headers.delete(name)
      entry = await readHeader(state, t)
      read = true
      continue
    }
    try {
      obj = await state.store.get(name, { range: { offset: span.start, length } })
    } catch (e) {
      // The cached header's span no longer fits the object: it is another one now.
      if (!(e instanceof RangeNotSatisfiableError) || attempt > 0) throw e
      state.headers.delete(name)
      entry = await readHeader(state, t)
      read = true
      continue
    }
    if (!obj) return notFoundFrom(state, name)
    if (sameVersion(entry, obj)) break
    await obj.body.cancel().catch(() => {})
    obj = undefined
    if (attempt > 0)
      throw new KvgateError('ERR_STORE', 'the object changed while it was read', { status: 503 })
    state.headers.delete(name)
    entry = await readHeader(state, t)
    read = true
  }
  const { header, bytes } = entry
  const etag = chunkETag(entry, { first, last })
  if (matchesNoneMatch(ifNoneMatch, etag)) {
    await obj?.body.cancel().catch(() => {})
    return c.body(null, 304, { etag })
  }
  const span = layerSpan(header, first, last)
  const length = span.end - span.start
  const total = bytes.length + length
  const stream = obj
    ? concatStreams(
        bytes,
        servedStream(
          c,
          state,
          obj.body,
          sectionsCheck(header, first, last),
          t,
          true,
          obj.size,
          holdStoreStream(state, obj, 'get'),
        ),
      )
    : singleChunk(bytes)
  state.metrics.bytesOut.inc({}, total)
  c.set('bytes', total)
  return c.body(stream, 200, {
    'content-type': 'application/octet-stream',
    'content-length': String(total),
    'x-kvgate-layers': `${first}-${last}`,
    etag,
  })
}

function singleChunk(bytes: Uint8Array): ReadableStream<Uint8Array> {
  return new ReadableStream({
    start(c) {
      c.enqueue(bytes)
      c.close()
    },
  })
}

function concatStreams(head: Uint8Array, tail: ReadableStream<Uint8Array>): ReadableStream<Uint8Array> {
  return resumed([head], tail.getReader())
}

/** `head`'s pieces, then the rest of `reader`: a body whose front was read already. */
function resumed(
  head: Uint8Array[],
  reader: ReadableStreamDefaultReader<Uint8Array>,
): ReadableStream<Uint8Array> {
  let next = 0
  return new ReadableStream<Uint8Array>({
    async pull(c) {
      if (next < head.length) {
        c.enqueue(head[next]!)
        head[next++] = EMPTY
        return
      }
      const { done, value } = await reader.read()
      if (done) c.close()
      else c.enqueue(value)
    },
    cancel(reason) {
      return reader.cancel(reason)
    },
  })
}

const EMPTY = new Uint8Array(0)
