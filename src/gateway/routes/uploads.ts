// /v1/ns/{ns}/uploads: large chunk writes that bypass the gateway's body path. The
// gateway hands out presigned targets into a staging prefix; at commit it streams the
// staged object through the same verifier as PUT into a create-only write, then drops it.

import type { Context, Hono } from 'hono'
import { ROOT_PARENT } from '../../coldtier/records.ts'
import { FormatError, KvgateError } from '../../core/errors.ts'
import { headerBytesFor } from '../../core/format.ts'
import { assertKeyHex, assertNamespaceName, isObjectPrefix, objectName, toHex } from '../../core/keys.ts'
import { admitted } from '../admission.ts'
import { assertFitsBudget, type GatewayState } from '../context.ts'
import type { GatewayEnv } from '../env.ts'
import { namespaceIdOf } from '../heal.ts'
import { badRequest, notFound, payloadTooLarge, unsupportedMediaType } from '../http-errors.ts'
import { bodyHoldBytes } from '../memory-budget.ts'
import { authorize } from '../middleware/auth.ts'
import { type BodyPace, readPromptly } from '../request-body.ts'
import { partLengths } from '../stores/types.ts'
import { streamSource, verifiedBody } from '../verified-body.ts'

const MIB = 1024 * 1024
/** An upload request is `{key, bytes}`: a few dozen bytes of JSON. */
const MAX_OPEN_REQUEST_BYTES = 4096

export interface UploadOptions {
  /** Bodies of at least this many bytes get presigned targets (stores that can presign). @default 1 MiB */
  minBytes?: number
  /** Largest chunk accepted through an upload. @default limits.maxChunkBytes (the PUT bound) */
  maxBytes?: number
  /** Targets expire, and commits are refused, this long after the upload was opened. @default 900 */
  expiresSeconds?: number
  /** One presigned PUT up to this size, presigned multipart parts above it. @default 64 MiB */
  multipartThreshold?: number
  /** Part size of a multipart upload (S3: ≥ 5 MiB). @default 16 MiB */
  partBytes?: number
  /** Where staged bodies live until commit (keep a lifecycle rule on it). @default `<prefix>-staging` */
  stagingPrefix?: string
}

export type UploadAnswer =
  | { mode: 'direct'; presignMinBytes: number | null }
  | { mode: 'exists'; bytes: number }
  | {
      mode: 'presigned'
      uploadId: string
      expiresAt: string
      commit: string
      parts: { url: string; offset: number; length: number }[]
    }

/** What an uploadId carries. It is not secret: see stagingName() for why it cannot be forged. */
interface UploadTicket {
  key: string
  bytes: number
  /** Unix seconds. */
  expires: number
  /** 128 random bits: the staging name cannot be guessed. */
  nonce: string
  multipartId?: string
}

function resolve(options: UploadOptions | undefined, prefix: string, maxChunkBytes: number) {
  if (options === undefined) return undefined
  const known = new Set([
    'minBytes',
    'maxBytes',
    'expiresSeconds',
    'multipartThreshold',
    'partBytes',
    'stagingPrefix',
  ])
  for (const k of Object.keys(options))
    if (!known.has(k)) throw new TypeError(`createGateway: unknown option uploads.${k}`)
  const o = {
    minBytes: options.minBytes ?? MIB,
    // A gateway told to take chunks up to N bytes takes no larger ones by another path.
    maxBytes: options.maxBytes ?? maxChunkBytes,
    expiresSeconds: options.expiresSeconds ?? 900,
    multipartThreshold: options.multipartThreshold ?? 64 * MIB,
    partBytes: options.partBytes ?? 16 * MIB,
    // Without a prefix, a leading dot keeps staging apart from every namespace name.
    stagingPrefix: options.stagingPrefix ?? (prefix === '' ? '.kvgate-staging' : `${prefix}-staging`),
  }
  for (const k of ['minBytes', 'maxBytes', 'expiresSeconds', 'multipartThreshold', 'partBytes'] as const) {
    if (!Number.isSafeInteger(o[k]) || o[k] < 0) throw new TypeError(`createGateway: invalid uploads.${k}`)
  }
  if (o.expiresSeconds < 1 || o.expiresSeconds > 7 * 24 * 3600)
    throw new TypeError('createGateway: uploads.expiresSeconds must be 1..604800 (SigV4 limit)')
  if (o.partBytes < 5 * MIB) throw new TypeError('createGateway: uploads.partBytes must be ≥ 5 MiB')
  if (
    o.stagingPrefix === '' ||
    !isObjectPrefix(o.stagingPrefix) ||
    o.stagingPrefix === prefix ||
    o.stagingPrefix.startsWith(`${prefix}/`)
  ) {
    throw new TypeError(
      `createGateway: invalid uploads.stagingPrefix ${JSON.stringify(o.stagingPrefix)} (must lie outside the chunk prefix)`,
    )
  }
  return o
}

type Resolved = NonNullable<ReturnType<typeof resolve>>

/**
 * The staged object's name spells out everything the upload is bound to (namespace,
 * key, size, expiry, nonce). Only the gateway can presign writes into the staging
 * prefix, so an object under this name exists only if the gateway opened exactly this
 * upload for this namespace: a ticket edited in any field names an object that does not exist.
 */
function stagingName(o: Resolved, ns: string, t: UploadTicket): string {
  return `${o.stagingPrefix}/${ns}/${t.key}/${t.bytes}-${t.expires}-${t.nonce}`
}

function encodeTicket(t: UploadTicket): string {
  const json = JSON.stringify({ k: t.key, b: t.bytes, e: t.expires, n: t.nonce, m: t.multipartId })
  return base64url(new TextEncoder().encode(json))
}

function decodeTicket(id: string): UploadTicket {
  const bad = () => badRequest('invalid upload id')
  if (id.length > 2048 || !/^[A-Za-z0-9_-]+$/.test(id)) throw bad()
  let v: { k?: unknown; b?: unknown; e?: unknown; n?: unknown; m?: unknown }
  try {
    v = JSON.parse(new TextDecoder('utf-8', { fatal: true }).decode(fromBase64url(id)))
  } catch {
    throw bad()
  }
  if (
    typeof v !== 'object' ||
    v === null ||
    typeof v.k !== 'string' ||
    !Number.isSafeInteger(v.b) ||
    !Number.isSafeInteger(v.e) ||
    typeof v.n !== 'string' ||
    !/^[0-9a-f]{32}$/.test(v.n) ||
    (v.m !== undefined && (typeof v.m !== 'string' || !/^[\x21-\x7e]{1,1024}$/.test(v.m)))
  ) {
    throw bad()
  }
  return {
    key: assertKeyHex(v.k),
    bytes: v.b as number,
    expires: v.e as number,
    nonce: v.n,
    ...(v.m !== undefined ? { multipartId: v.m as string } : {}),
  }
}

export function uploadRoutes(
  app: Hono<GatewayEnv>,
  state: GatewayState,
  options: UploadOptions | undefined,
): void {
  const o = resolve(options, state.prefix, state.limits.maxChunkBytes)
  const store = state.store
  const canPresign = o !== undefined && typeof store.presignUpload === 'function'
  if (canPresign)
    assertFitsBudget(state.limits.maxHeldBytes, {
      'an upload commit of uploads.maxBytes (read-ahead and store parts)':
        bodyHoldBytes(o.maxBytes, store) + (store.getHoldBytes?.(o.maxBytes) ?? 0),
    })

  app.post('/v1/ns/:ns/uploads', async (c) => {
    const ns = assertNamespaceName(c.req.param('ns'))
    authorize(c, ns, 'write')
    c.set('ns', ns)
    const { key, bytes } = await readOpenRequest(c, state.limits)
    if (!canPresign || bytes < o.minBytes) {
      const answer: UploadAnswer = { mode: 'direct', presignMinBytes: canPresign ? o.minBytes : null }
      return c.json(answer)
    }
    if (bytes > o.maxBytes)
      throw payloadTooLarge(`chunk is ${bytes} bytes; this gateway accepts at most ${o.maxBytes}`)
    // N nodes writing one prefix: only the first should move the bytes. Asked of the
    // store, never of the cache: a cached presence may be stale (gc, a heal elsewhere),
    // and "exists" from it would store nothing.
    const final = objectName(state.prefix, ns, key)
    const stored = (await store.head(final))?.size
    if (stored !== undefined) {
      state.usage?.use(ns, key, 0)
      state.lookup.remember(final, stored)
      state.metrics.puts.inc({ result: 'exists' })
      const answer: UploadAnswer = { mode: 'exists', bytes: stored }
      return c.json(answer)
    }
    const expires = Math.floor(Date.now() / 1000) + o.expiresSeconds
    const nonce = randomHex(16)
    const draft: UploadTicket = { key, bytes, expires, nonce }
    const targets = await store.presignUpload!(stagingName(o, ns, draft), bytes, {
      expiresInSeconds: o.expiresSeconds,
      multipartThreshold: o.multipartThreshold,
      partBytes: o.partBytes,
    })
    const uploadId = encodeTicket({
      ...draft,
      ...(targets.multipartId ? { multipartId: targets.multipartId } : {}),
    })
    const answer: UploadAnswer = {
      mode: 'presigned',
      uploadId,
      expiresAt: new Date(expires * 1000).toISOString(),
      commit: `/v1/ns/${ns}/uploads/${uploadId}/commit`,
      parts: targets.parts,
    }
    return c.json(answer)
  })

  app.post('/v1/ns/:ns/uploads/:id/commit', async (c) => {
    const ns = assertNamespaceName(c.req.param('ns'))
    authorize(c, ns, 'write')
    c.set('ns', ns)
    if (!canPresign) throw notFound('this gateway takes chunk bodies directly (PUT); it has no uploads')
    const t = decodeTicket(c.req.param('id'))
    const staged = stagingName(o, ns, t)
    const final = objectName(state.prefix, ns, t.key)
    // The staged body passes through the gateway as a PUT body does: the same bounds on bytes in
    // flight and held. Busy before anything is touched, so the staged object stays for the retry.
    const declared = t.bytes <= o.maxBytes ? t.bytes : 0
    // It also holds the staged GET's read-ahead (S3).
    const need = { declared, held: bodyHoldBytes(declared, store) + (store.getHoldBytes?.(declared) ?? 0) }
    return admitted(state, 'commit', need, () => commitStaged(c, o, ns, t, staged, final))
  })

  async function commitStaged(
    c: Context<GatewayEnv>,
    o: Resolved,
    ns: string,
    t: UploadTicket,
    staged: string,
    final: string,
  ): Promise<Response> {
    // Whatever the outcome, the staged object (and an unfinished multipart) goes.
    const cleanup = async () => {
      if (t.multipartId) await store.abortUpload?.(staged, t.multipartId).catch(() => {})
      await store.delete(staged).catch(() => {})
    }
    try {
      if (Math.floor(Date.now() / 1000) > t.expires) {
        throw new KvgateError('ERR_UPLOAD_EXPIRED', 'this upload expired: open a new one', { status: 410 })
      }
      if (t.bytes > o.maxBytes || t.bytes < headerBytesFor(1)) throw badRequest('invalid upload id')
      if (t.multipartId) {
        const lengths = partLengths(t.bytes, o.partBytes)
        const done = await store.completeUpload!(staged, t.multipartId, lengths)
        if (done === 'mismatch') {
          throw new FormatError(
            'ERR_FORMAT_TRUNCATED',
            `the staged parts are not the ${lengths.length} parts of ${t.bytes} bytes this upload was opened for`,
          )
        }
      }
      const stored = (await store.head(final))?.size
      if (stored !== undefined) return existsAnswer(c, state, ns, t.key, final, stored)
      const obj = await store.get(staged)
      if (!obj) {
        throw notFound('nothing staged under this upload: upload every part before the commit')
      }
      if (obj.size !== t.bytes) {
        await obj.body.cancel().catch(() => {})
        throw new FormatError(
          obj.size < t.bytes ? 'ERR_FORMAT_TRUNCATED' : 'ERR_FORMAT_BAD_FIELD',
          `the staged object is ${obj.size} bytes; the upload was opened for ${t.bytes}`,
        )
      }
      const nsId = namespaceIdOf(ns)
      const vb = verifiedBody(streamSource(obj.body), {
        keyHex: t.key,
        size: t.bytes,
        maxBytes: o.maxBytes,
        idleTimeoutMs: state.limits.bodyIdleTimeoutMs,
        ...(nsId ? { namespaceIdHex: nsId } : {}),
      })
      let result: 'created' | 'exists'
      try {
        result = await store.putIfAbsent(final, vb.stream, t.bytes)
      } catch (e) {
        throw vb.failure() ?? e
      } finally {
        // A store that gave up on the body (failed, or "exists" without reading it) leaves the
        // staged read open: release it, or its socket, read-ahead and idle watchdog stay behind.
        vb.release()
      }
      if (result === 'exists') {
        return existsAnswer(c, state, ns, t.key, final, (await store.head(final))?.size ?? t.bytes)
      }
      // What PUT does on a creation: presence, no stale layer header, a creation for gc and accounting.
      state.lookup.remember(final, t.bytes)
      state.headers.delete(final)
      // A chain's first chunk names the namespace seed, never a stored chunk: ROOT_PARENT tells gc so.
      const header = vb.header()
      const parent = header && (header.chunkIndex === 0 ? ROOT_PARENT : toHex(header.parentKey))
      if (parent) state.usage?.created(ns, t.key, parent, t.bytes)
      state.metrics.puts.inc({ result: 'created' })
      state.metrics.bytesIn.inc({}, t.bytes)
      state.written.objects++
      state.written.bytes += t.bytes
      c.set('bytes', t.bytes)
      return c.json({ status: 'created', bytes: t.bytes }, 201)
    } catch (e) {
      state.metrics.puts.inc({ result: 'rejected' })
      throw e
    } finally {
      await cleanup()
    }
  }
}

/** Create-only: the first writer's object stays, whatever its size (contract C3). */
function existsAnswer(
  c: Context<GatewayEnv>,
  state: GatewayState,
  ns: string,
  key: string,
  final: string,
  stored: number,
) {
  state.usage?.use(ns, key, 0)
  state.lookup.remember(final, stored)
  state.metrics.puts.inc({ result: 'exists' })
  return c.json({ status: 'exists', bytes: stored }, 200)
}

async function readOpenRequest(
  c: Context<GatewayEnv>,
  limits: BodyPace,
): Promise<{ key: string; bytes: number }> {
  const type = (c.req.header('content-type') ?? '').split(';')[0]!.trim().toLowerCase()
  if (type !== 'application/json') throw unsupportedMediaType('upload requests must be application/json')
  // Read at most the cap (an unbounded read would hold whatever a client sends), at a PUT
  // body's pace: a stalled or trickled one would hold its socket until the request timeout.
  const raw = c.req.raw.body
    ? await readPromptly(c.req.raw.body, { max: MAX_OPEN_REQUEST_BYTES }, limits)
    : new Uint8Array()
  if (!raw) throw payloadTooLarge('an upload request is at most 4 KiB of JSON')
  let text: string
  try {
    text = new TextDecoder('utf-8', { fatal: true }).decode(raw)
  } catch {
    throw badRequest('upload request is not UTF-8')
  }
  let body: { key?: unknown; bytes?: unknown }
  try {
    body = JSON.parse(text)
  } catch {
    throw badRequest('upload request is not valid JSON')
  }
  if (typeof body !== 'object' || body === null) throw badRequest('upload request must be {"key", "bytes"}')
  for (const k of Object.keys(body))
    if (k !== 'key' && k !== 'bytes') throw badRequest(`unknown field ${JSON.stringify(k.slice(0, 40))}`)
  const key = assertKeyHex(body.key)
  const bytes = body.bytes
  if (typeof bytes !== 'number' || !Number.isSafeInteger(bytes) || bytes < 0)
    throw badRequest('"bytes" must be the chunk size in bytes')
  if (bytes < headerBytesFor(1))
    throw new FormatError('ERR_FORMAT_TRUNCATED', `a ${bytes}-byte body cannot be a chunk`)
  return { key, bytes }
}

function randomHex(n: number): string {
  const b = crypto.getRandomValues(new Uint8Array(n))
  return Array.from(b, (x) => x.toString(16).padStart(2, '0')).join('')
}

function base64url(bytes: Uint8Array): string {
  let s = ''
  for (const b of bytes) s += String.fromCharCode(b)
  return btoa(s).replace(/\+/g, '-').replace(/\//g, '_').replace(/=+$/, '')
}

function fromBase64url(s: string): Uint8Array {
  const bin = atob(s.replace(/-/g, '+').replace(/_/g, '/'))
  return Uint8Array.from(bin, (ch) => ch.charCodeAt(0))
}
