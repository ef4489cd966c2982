// A namespace's calibration objects (DESIGN §2.9, docs/calibration.md):
//   PUT/GET/HEAD /v1/ns/{ns}/calibrations/{sha256}: content-addressed, create-only,
//     verified (the body's SHA-256 is its name), immutable, so cacheable anywhere;
//   PUT/GET /v1/ns/{ns}/calibration: the namespace's current one, `{hash}`,
//     create-only: the first stored calibration wins and every PUT learns the winner.
// Uploads (≤ limits.maxCalibrationBytes, 16 MiB by default) are read whole and hashed
// before anything is stored. Reads that fit limits.calibrationCacheBytes are read whole,
// hashed, then served and cached (a cached one only while the store still holds it: one
// HEAD); larger ones stream from the store, hashed on the way, and a mismatch errors the body.

import type { Context, Hono } from 'hono'
import { Sha256 } from '../../codec/sha256.ts'
import { calibrationObjectName, currentCalibrationName } from '../../coldtier/names.ts'
import { KvgateError, StoreError } from '../../core/errors.ts'
import { assertNamespaceName, isKeyHex, toHex } from '../../core/keys.ts'
import { admitted } from '../admission.ts'
import type { GatewayState } from '../context.ts'
import type { GatewayEnv } from '../env.ts'
import {
  badRequest,
  lengthRequired,
  notFound,
  payloadTooLarge,
  unsupportedMediaType,
} from '../http-errors.ts'
import { authorize, type Scope } from '../middleware/auth.ts'
import { holdStoreStream, readerPace } from '../reader-pace.ts'
import { readPromptly } from '../request-body.ts'
import { collectBody, type StoreObject } from '../stores/types.ts'
import { checkedStream, type StreamCheck } from '../verified-read.ts'

/** "KVCL": the first four bytes of every calibration object (src/codec/calibration.ts). */
export const CALIBRATION_MAGIC = Uint8Array.of(0x4b, 0x56, 0x43, 0x4c)
/** The smallest body that can be a calibration object: magic + version. */
const MIN_CALIBRATION_BYTES = 8
const NOT_ITS_NAME = 'its SHA-256 is not its name'
/** The current pointer is `{"hash":"<64 hex>"}`: anything much longer is not one. */
const MAX_POINTER_BYTES = 1024
/** How long a gateway trusts a current pointer it read (it only changes if an admin deletes it). */
const CURRENT_TTL_MS = 60_000

export async function sha256Hex(bytes: Uint8Array): Promise<string> {
  return toHex(new Uint8Array(await crypto.subtle.digest('SHA-256', bytes as Uint8Array<ArrayBuffer>)))
}

function hashParam(c: Context<GatewayEnv>): string {
  const h = c.req.param('hash')
  if (!isKeyHex(h)) throw badRequest('a calibration is named by its SHA-256: 64 lowercase hex characters')
  return h
}

function target(c: Context<GatewayEnv>, scope: Scope): string {
  const ns = assertNamespaceName(c.req.param('ns'))
  authorize(c, ns, scope)
  c.set('ns', ns)
  return ns
}

// A stored object that fails its checks is the store's fault, not the client's: 502, never its bytes.
function corrupt(message: string): KvgateError {
  return new KvgateError('ERR_FORMAT_CHECKSUM', `stored calibration is corrupt: ${message}`, { status: 502 })
}

async function readWhole(obj: StoreObject, max: number): Promise<Uint8Array> {
  if (obj.size > max) {
    await obj.body.cancel().catch(() => {})
    throw corrupt(`${obj.size} bytes, over the ${max}-byte limit`)
  }
  try {
    return await collectBody(obj.body, obj.length)
  } catch (e) {
    // A read the store broke off or cut short says nothing about the object's bytes:
    // only a whole body that is not its name is corrupt (and deleted, see load()).
    throw new StoreError(`reading the stored calibration failed: ${(e as Error).message}`)
  }
}

/**
 * A request body of at most `max` bytes: exactly Content-Length when given (required
 * for calibration objects), else read up to the cap (the small JSON pointer).
 */
async function requestBytes(
  c: Context<GatewayEnv>,
  limits: GatewayState['limits'],
  max: number,
  what: string,
  needLength = true,
): Promise<Uint8Array> {
  const lenHeader = c.req.header('content-length')
  if (lenHeader === undefined && needLength) throw lengthRequired()
  if (lenHeader !== undefined && !/^\d{1,15}$/.test(lenHeader)) throw badRequest('invalid Content-Length')
  const size = lenHeader === undefined ? undefined : Number(lenHeader)
  if (size !== undefined && size > max)
    throw payloadTooLarge(`${what} is ${size} bytes; this gateway accepts at most ${max}`)
  const body = c.req.raw.body
  if (!body) return new Uint8Array(0)
  if (size !== undefined) {
    try {
      return await readPromptly(body, { size }, limits)
    } catch (e) {
      if (e instanceof KvgateError) throw e
      throw badRequest(`${what}: ${(e as Error).message}`)
    }
  }
  const bytes = await readPromptly(body, { max }, limits)
  if (!bytes) throw payloadTooLarge(`${what} is over ${max} bytes`)
  return bytes
}

function parsePointer(bytes: Uint8Array): string | undefined {
  try {
    const v = JSON.parse(new TextDecoder('utf-8', { fatal: true }).decode(bytes)) as { hash?: unknown }
    return isKeyHex(v?.hash) ? v.hash : undefined
  } catch {
    return undefined
  }
}

const IMMUTABLE = 'public, max-age=31536000, immutable'

interface StreamHasher {
  update(piece: Uint8Array): unknown
  hex(): string
}

/**
 * An incremental SHA-256 for a streamed body: Node's native one where the runtime has it
 * (Node, Lambda: ~3× the TypeScript one), else the codec's TypeScript one (workerd).
 */
function streamHasher(): StreamHasher {
  const proc = (globalThis as { process?: { getBuiltinModule?: (id: string) => unknown } }).process
  const nodeCrypto = proc?.getBuiltinModule?.('node:crypto') as typeof import('node:crypto') | undefined
  if (!nodeCrypto) return new Sha256()
  const h = nodeCrypto.createHash('sha256')
  return { update: (piece) => h.update(piece), hex: () => h.digest('hex') }
}

/** What a GET serves: verified bytes (cached), or a body too large to cache, checked as it streams. */
type Served = { bytes: Uint8Array } | { stream: ReadableStream<Uint8Array>; size: number }

/** A shared read found the body too large to share: each reader streams its own. */
const STREAMED = Symbol('streamed')

export function calibrationRoutes(app: Hono<GatewayEnv>, state: GatewayState): void {
  const max = state.limits.maxCalibrationBytes
  // Immutable, content-addressed bodies: a bounded cache can never serve a stale one.
  const bodies = state.calibrations
  const cacheBytes = state.limits.calibrationCacheBytes
  const current = new Map<string, { hash: string; at: number }>()
  /** Store reads in progress by object name: a fleet asking for one calibration at once reads it once. */
  const reading = new Map<string, Promise<Uint8Array | typeof STREAMED | undefined>>()

  /** Calibration `hash` (verified, or checked as it streams), or undefined when the store has none. */
  async function open(
    c: Context<GatewayEnv>,
    ns: string,
    hash: string,
    share = true,
  ): Promise<Served | undefined> {
    const name = calibrationObjectName(state.prefix, ns, hash)
    const cached = bodies.get(name)
    // The cache saves the body and its hashing, not the store's word: an object deleted
    // behind the gateway (an operator, another instance) is gone here too.
    if (cached) {
      if (await state.store.head(name)) return { bytes: cached }
      bodies.delete(name)
      return undefined
    }
    const running = share ? reading.get(name) : undefined
    if (running) {
      const got = await running
      return got === STREAMED ? open(c, ns, hash, false) : got && { bytes: got }
    }
    // A streamed body is this request's alone (waiters on a shared read open their own).
    const p = read(c, name, hash)
    if (share) {
      const shared = p
        .then((s) => (s === undefined ? undefined : 'bytes' in s ? s.bytes : STREAMED))
        .finally(() => reading.delete(name))
      shared.catch(() => {}) // its waiters see the failure; with none it is not unhandled
      reading.set(name, shared)
    }
    return p
  }

  async function read(c: Context<GatewayEnv>, name: string, hash: string): Promise<Served | undefined> {
    const obj = await state.store.get(name)
    if (!obj) return undefined
    // Larger than the whole cache: never held here, whatever the runtime's memory. Nor when
    // the gateway holds its memory bound already: streamed (hashed on the way) instead.
    const lease = obj.size <= cacheBytes ? state.memory.tryReserve(obj.size) : undefined
    if (obj.size <= max && !lease) return { stream: hashedBody(c, name, hash, obj), size: obj.size }
    try {
      const bytes = await readWhole(obj, max)
      if ((await sha256Hex(bytes)) !== hash) {
        await drop(name, obj.etag)
        throw corrupt(NOT_ITS_NAME)
      }
      // From here the cache holds it (its own bound, calibrationCacheBytes).
      bodies.set(name, bytes)
      return { bytes }
    } finally {
      lease?.release()
    }
  }

  async function drop(name: string, etag: string | undefined): Promise<void> {
    // Named by their SHA-256, these bytes can never be this calibration (bit rot, a bad
    // restore). Left there, every GET would answer 502 and a create-only PUT "exists", so
    // no node holding the real bytes could put them back: drop them, as a corrupt chunk is.
    // Only the version read: a slow read may end after a holder put the real bytes back.
    state.metrics.calibrations.inc({ op: 'get', result: 'corrupt' })
    await state.store.delete(name, { ifMatch: etag })
  }

  /**
   * The store's body, hashed as it passes (checkedStream: the last piece is held back until
   * the hash is proven, and a reader that idles or trickles is cut off): bytes that are not the name, or fewer
   * than the store's size, fail the response before the client has all of it.
   */
  function hashedBody(
    c: Context<GatewayEnv>,
    name: string,
    hash: string,
    obj: StoreObject,
  ): ReadableStream<Uint8Array> {
    const held = holdStoreStream(state, obj, 'get')
    const hasher = streamHasher()
    let seen = 0
    const check: StreamCheck = {
      push(piece) {
        seen += piece.length
        // More than the store said: the client holds Content-Length bytes before the end proves
        // them, so fail here (the piece held back never goes out). A store fault: kept.
        if (seen > obj.length)
          throw new StoreError(`the store served more than the ${obj.length} calibration bytes it reported`)
        hasher.update(piece)
      },
      async finish() {
        // A store that ends early says nothing about the object: not corrupt, not dropped.
        if (seen !== obj.length)
          throw new StoreError(`the store served ${seen} of ${obj.length} calibration bytes`)
        if (hasher.hex() === hash) return
        // Dropped before the response fails: a Worker's work ends with its response.
        await drop(name, obj.etag)
        throw corrupt(NOT_ITS_NAME)
      },
    }
    return checkedStream(obj.body, check, {
      ...readerPace(state, c, held),
      onCorrupt: () => {}, // counted and dropped in finish()
    })
  }

  app.put('/v1/ns/:ns/calibrations/:hash', async (c) => {
    const ns = target(c, 'write')
    const hash = hashParam(c)
    const type = (c.req.header('content-type') ?? '').split(';')[0]!.trim().toLowerCase()
    if (type !== 'application/octet-stream')
      throw unsupportedMediaType(
        `calibration uploads must be application/octet-stream, got ${JSON.stringify(type || 'none')}`,
      )
    // Read whole before it is checked, and held until the store has it (S3: a whole PUT round
    // trip): all its bytes count against the memory budget and the bytes in flight. A missing,
    // malformed or oversized Content-Length is refused by requestBytes, after admission of 0.
    const declared = Number(c.req.header('content-length') ?? 0)
    const held = Number.isSafeInteger(declared) && declared <= max ? declared : 0
    return admitted(state, 'calibration', { declared: held, held }, () => storeUpload(c, ns, hash))
  })

  async function storeUpload(c: Context<GatewayEnv>, ns: string, hash: string): Promise<Response> {
    const bytes = await requestBytes(c, state.limits, max, 'calibration')
    if (bytes.length < MIN_CALIBRATION_BYTES)
      throw new KvgateError('ERR_FORMAT_TRUNCATED', `a ${bytes.length}-byte body cannot be a calibration`, {
        status: 400,
      })
    if (!CALIBRATION_MAGIC.every((b, i) => bytes[i] === b))
      throw new KvgateError('ERR_FORMAT_BAD_MAGIC', 'not a calibration object (magic is not "KVCL")', {
        status: 400,
      })
    const actual = await sha256Hex(bytes)
    if (actual !== hash)
      throw new KvgateError('ERR_FORMAT_CHECKSUM', `body SHA-256 is ${actual}, the URL names ${hash}`, {
        status: 400,
      })
    // TODO(lead, at merge with codec-calib): validate deeply with openCalibration(bytes) from
    // src/codec/calibration.ts (geometry, dtype, its own CRC) and answer its CodecError as 400.
    // codec-calib's openCalibration runs its checks in the wasm codec, which the gateway bundles
    // do not load today (Workers: mind the 3 MiB gzip limit). Until then a body passes on
    // magic + hash + size, and clients validate every calibration before use (CalibrationStore).
    const name = calibrationObjectName(state.prefix, ns, hash)
    const result = await state.store.putIfAbsent(name, bytes, bytes.length)
    if (bytes.length <= cacheBytes) bodies.set(name, bytes)
    c.set('bytes', bytes.length)
    state.metrics.calibrations.inc({ op: 'put', result })
    return c.json({ status: result, hash, bytes: bytes.length }, result === 'created' ? 201 : 200)
  }

  app.get('/v1/ns/:ns/calibrations/:hash', async (c) => {
    const ns = target(c, 'read')
    const hash = hashParam(c)
    const etag = `"${hash}"`
    const notModified = c.req
      .header('if-none-match')
      ?.split(',')
      .some((t) => t.trim() === etag || t.trim() === '*')
    if (c.req.method === 'HEAD') return headAnswer(c, ns, hash, notModified === true)
    const served = await open(c, ns, hash)
    state.metrics.calibrations.inc({ op: 'get', result: served ? 'hit' : 'missing' })
    if (!served) throw notFound(`no calibration ${hash} in namespace ${ns}`)
    const size = 'bytes' in served ? served.bytes.length : served.size
    const headers = {
      'content-type': 'application/octet-stream',
      'content-length': String(size),
      etag,
      'cache-control': IMMUTABLE,
    }
    if (notModified) {
      if ('stream' in served) await served.stream.cancel().catch(() => {})
      return c.body(null, 304, { etag, 'cache-control': IMMUTABLE })
    }
    c.set('bytes', size)
    state.metrics.bytesOut.inc({}, size)
    if ('stream' in served) return c.body(served.stream, 200, headers)
    return c.body(served.bytes as Uint8Array<ArrayBuffer>, 200, headers)
  })

  /**
   * HEAD from the store's metadata (S3 HeadObject, R2 head, fs stat), never the body: a cold
   * instance (a new Lambda, a Worker isolate) answers a holder's restore check in one small
   * request. The bytes are hashed where they are served (GET), which deletes an object that
   * is not its name, so the holder's next HEAD is a 404 and it puts the calibration back.
   */
  async function headAnswer(c: Context<GatewayEnv>, ns: string, hash: string, notModified: boolean) {
    const name = calibrationObjectName(state.prefix, ns, hash)
    const head = await state.store.head(name)
    const cached = bodies.get(name)
    // A verified copy vouches only for an object of its size: anything else was replaced behind us.
    if (cached && cached.length !== head?.size) bodies.delete(name)
    state.metrics.calibrations.inc({ op: 'head', result: head ? 'hit' : 'missing' })
    if (!head) throw notFound(`no calibration ${hash} in namespace ${ns}`)
    if (head.size > max || head.size < MIN_CALIBRATION_BYTES)
      throw corrupt(`${head.size} bytes, outside ${MIN_CALIBRATION_BYTES}..${max}`)
    const etag = `"${hash}"`
    if (notModified) return c.body(null, 304, { etag, 'cache-control': IMMUTABLE })
    return c.body(null, 200, {
      'content-type': 'application/octet-stream',
      'content-length': String(head.size),
      etag,
      'cache-control': IMMUTABLE,
    })
  }

  /** The namespace's current calibration hash, or undefined. */
  async function readCurrent(ns: string, fresh: boolean): Promise<string | undefined> {
    const known = current.get(ns)
    if (known && !fresh && Date.now() - known.at < CURRENT_TTL_MS) return known.hash
    const name = currentCalibrationName(state.prefix, ns)
    const obj = await state.store.get(name)
    if (!obj) {
      current.delete(ns)
      return undefined
    }
    // Larger than any pointer: not one (read no further), dropped like one that does not parse.
    const hash =
      obj.size > MAX_POINTER_BYTES
        ? await obj.body.cancel().then(
            () => undefined,
            () => undefined,
          )
        : parsePointer(await readWhole(obj, MAX_POINTER_BYTES))
    if (hash === undefined) {
      // Create-only, a pointer that is not one would block the namespace for good (every GET
      // and PUT a 502). Chunks name their calibration by hash, not through it: drop it.
      await state.store.delete(name, { ifMatch: obj.etag })
      current.delete(ns)
      throw corrupt(`the current pointer of namespace ${ns} is not {"hash": <sha256>}`)
    }
    current.set(ns, { hash, at: Date.now() })
    return hash
  }

  app.put('/v1/ns/:ns/calibration', async (c) => {
    const ns = target(c, 'write')
    const hash = parsePointer(
      await requestBytes(c, state.limits, MAX_POINTER_BYTES, 'current calibration', false),
    )
    if (hash === undefined) throw badRequest('body must be {"hash": "<sha256 of a stored calibration>"}')
    // The pointer must never name nothing: the calibration goes up first.
    if (!(await state.store.head(calibrationObjectName(state.prefix, ns, hash))))
      throw new KvgateError(
        'ERR_PRECONDITION_FAILED',
        `calibration ${hash} is not stored in ${ns}: PUT it first`,
        {
          status: 409,
        },
      )
    const body = new TextEncoder().encode(JSON.stringify({ hash }))
    const result = await state.store.putIfAbsent(currentCalibrationName(state.prefix, ns), body, body.length)
    state.metrics.calibrations.inc({ op: 'current', result })
    if (result === 'created') {
      current.set(ns, { hash, at: Date.now() })
      return c.json({ status: 'created', hash }, 201)
    }
    // Another writer won: answer its choice so the caller adopts it.
    const winner = await readCurrent(ns, true)
    if (winner === undefined)
      throw new KvgateError('ERR_STORE', 'the current calibration vanished while it was read; retry', {
        status: 503,
      })
    return c.json({ status: 'exists', hash: winner }, 200)
  })

  app.get('/v1/ns/:ns/calibration', async (c) => {
    const ns = target(c, 'read')
    // `Cache-Control: no-cache`: the stored pointer itself (a holder deciding whether to put back
    // an object it found gone must not act on a pointer an operator deleted a minute ago).
    const fresh = /\bno-cache\b/i.test(c.req.header('cache-control') ?? '')
    const hash = await readCurrent(ns, fresh)
    if (hash === undefined) throw notFound(`namespace ${ns} has no calibration`)
    return c.json({ hash }, 200, { 'cache-control': 'no-cache' })
  })
}
