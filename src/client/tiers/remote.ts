// L4: the gateway over HTTP (undici pools, keep-alive). Bounded deadlines and bodies,
// retries with jitter, a circuit breaker and a shedding write-behind queue: it never throws into callers.

import { setMaxListeners } from 'node:events'
import { Agent, Pool } from 'undici'
import { InvalidArgumentError } from '../../core/errors.ts'
import { DEFAULT_MAX_CHUNK_BYTES } from '../../core/format.ts'
import { assertNamespaceName } from '../../core/keys.ts'
import type { KvGeometry } from '../../core/layout.ts'
import { maxLayerGroupBytes, maxObjectBytes } from '../chunk-codec.ts'
import { type BreakerState, CircuitBreaker } from '../circuit-breaker.ts'
import { PresenceSet } from '../presence.ts'
import { TierUploader } from '../remote-upload.ts'
import { type LatencySummary, LatencyWindow, since, TierCounters } from '../stats.ts'
import { UnservableKeys, type UnservableKeysOptions } from '../unservable-keys.ts'

export interface RemoteTierOptions {
  /** Gateway base URL, e.g. http://127.0.0.1:8080 (a path prefix is kept; a trailing /v1 is dropped). */
  url: string
  /** Bearer token; omitted when the gateway runs without auth. */
  token?: string | undefined
  /** Tenant namespace in the URL (`/v1/ns/{ns}`). */
  namespace: string
  /** Keep-alive connections. @default 8 */
  connections?: number
  /** Deadline of one chunk GET/PUT, retries included, ms. @default 10000 */
  timeoutMs?: number
  /** Deadline of a lookup, ms: lookups sit on the prefill path. @default 250 */
  lookupTimeoutMs?: number
  /** Retries of idempotent requests on 5xx / connection errors. @default 2 */
  retries?: number
  /** Consecutive failures that open the circuit breaker. @default 5 */
  breakerThreshold?: number
  /** First half-open probe after this many ms. @default 1000 */
  breakerCooldownMs?: number
  /**
   * Write-behind queue bound in chunks. Large on purpose: the byte bound is what
   * limits memory; a healthy gateway must not be shed at the normal rate of stores. @default 4096
   */
  maxQueuedWrites?: number
  /** Write-behind queue bound in bytes held beyond L1 (private copies; pinned L1 chunks cost none). @default 512 MiB */
  maxQueuedBytes?: number
  /** Concurrent background PUTs, on their own connections (uploads never delay lookups or GETs). @default 8 */
  writeConcurrency?: number
  /**
   * How long "the gateway holds this chunk" (learned from a lookup or a PUT) is
   * trusted: objects can vanish behind the gateway (lifecycle expiry, DELETE). @default 30000
   */
  presenceTtlMs?: number
  /** Chunks from this size ask the gateway for a direct-to-store upload first (remote-upload.ts). @default 1 MiB */
  uploadMinBytes?: number
}

/** What the cache around the tier tells it (not user options). */
export interface RemoteTierContext {
  /** Geometry and chunk size of the cache: every response body is capped at what such a chunk can be. */
  geometry?: KvGeometry | undefined
  chunkTokens?: number | undefined
  /** Where one-line warnings go (auth refused, uploads shed). @default process.emitWarning */
  warn?: (message: string, code: string) => void
  /** When keys whose reads keep failing with no verdict are held off (tests shorten it). */
  unservable?: UnservableKeysOptions
}

/** A background upload: `encode` runs when a writer picks the job up; `done` always runs once. */
export interface RemoteWriteJob {
  hex: string
  /** Bytes the job holds beyond L1 while queued (for the byte bound): 0 for a pinned L1 chunk. */
  bytesHint: number
  encode: () => Promise<Uint8Array | undefined>
  done: () => void
}

export interface RemoteTierStats {
  url: string
  breaker: BreakerState
  breakerOpened: number
  /** Times the breaker opened because requests hung (timeouts), not because they failed. */
  breakerOpenedByTimeouts: number
  breakerRejected: number
  queuedWrites: number
  queuedBytes: number
  /** Uploads dropped because the queue was full, the breaker open or the tier closing. */
  shedWrites: number
  /** shedWrites by cause. */
  shedByReason: { breaker: number; queueFull: number; closed: number }
  /** PUTs the gateway answered "exists" (another node stored it first). */
  existed: number
  retries: number
  redirects: number
  timeouts: number
  /** Requests the gateway refused with 401/403 (wrong or missing token, scope or namespace). */
  authErrors: number
  /** GETs answered 404 (the chunk and its chain's later chunks are no longer believed present). */
  notFound: number
  /** Response bodies larger than such a chunk can be: aborted, never buffered. */
  oversizedBodies: number
  /** Chunks reported to the gateway's verify endpoint after failing verification here. */
  corruptReported: number
  /** ... of which the gateway found corrupt (and deleted) or missing. */
  corruptConfirmed: number
  /**
   * Objects a newer kvgate wrote (a format version, flag, codec or dtype this build does not
   * know, under an intact header): misses, neither reported corrupt nor forgotten. Counted once
   * a hold (unservableHeld): GETs of it already on their way then (layer groups) count no more.
   */
  newerObjects: number
  /**
   * `?layers` GETs answered with the whole object (a caching proxy that drops the query): the
   * layers are served from it when they verify. Non-zero: that proxy costs whole-object transfers.
   */
  layersAnsweredWhole: number
  /**
   * Keys put on hold after repeated reads whose decode failed with no verdict on the bytes (see
   * readFailed): their GETs are skipped for a while (misses without the network).
   */
  unservableHeld: number
  /** GETs skipped because their key was on hold (each counted in misses too). */
  unservableSkipped: number
  /**
   * Lookups whose matched prefix stopped before a key on hold (see unservableHeld): its GET
   * would be skipped, so counting it present would promise the engine tokens a retrieve misses.
   */
  unservableLookupStops: number
  /** Lookup requests sent to the gateway. */
  lookupRequests: number
  /** Their round trips (readLatency counts chunk GETs only). */
  lookupLatency: LatencySummary
  /** Leading keys a lookup answered from what this client already knew was stored. */
  lookupKeysKnown: number
  /** Keys currently believed present in L4 (expire after presenceTtlMs). */
  knownPresent: number
}

interface HttpResult {
  status: number
  headers: Record<string, string | string[] | undefined>
  body: Uint8Array
  /** Answered by a presigned-redirect target, not the gateway. */
  redirected: boolean
}

/** The `hash` of a `{"hash": …}` answer, or undefined when it is not one. */
function hashOf(body: Uint8Array): string | undefined {
  try {
    const h = (JSON.parse(new TextDecoder().decode(body)) as { hash?: unknown }).hash
    return typeof h === 'string' && /^[0-9a-f]{64}$/.test(h) ? h : undefined
  } catch {
    return undefined
  }
}

/** Connection errors, 5xx: worth another attempt while the deadline lasts. */
class RetryableError extends Error {}
/** A body over its cap: the gateway (or redirect target) misbehaves; not retried. */
class OversizedError extends Error {}

/** Bodies of answers other than 200 (error JSON, lookup and verify answers) stay small. */
const MAX_SMALL_BODY = 64 * 1024
const MAX_LOOKUP_KEYS = 4096
/** Verify reports (contract C1): in flight at once, per minute, and keys remembered as reported. */
const MAX_VERIFY_IN_FLIGHT = 4
const MAX_VERIFY_PER_MINUTE = 60
const MAX_REPORTED_KEYS = 4096
/** At most one shed warning per this many ms (with the count since the last one). */
const SHED_WARN_INTERVAL_MS = 60_000

type Body = AsyncIterable<Uint8Array> & { destroy(err?: Error): unknown }

/**
 * Reads a response body of at most `cap` bytes: into `into` when the declared
 * length fits it (an L1 slot: no intermediate buffer), else into one buffer of
 * the declared length, else piece by piece. Past the cap it destroys the body
 * (the connection goes, nothing more is read) and throws OversizedError.
 */
async function readBody(
  body: Body,
  into: Uint8Array | undefined,
  declared: number | undefined,
  cap: number,
): Promise<Uint8Array> {
  const tooLong = (n: number) => {
    body.destroy()
    return new OversizedError(`response body of ${n}+ bytes is over its cap of ${cap}`)
  }
  if (declared !== undefined && declared > cap) throw tooLong(declared)
  if (declared !== undefined) {
    const dst = into && declared <= into.byteLength ? into : new Uint8Array(declared)
    let off = 0
    for await (const piece of body) {
      if (off + piece.byteLength > declared) {
        body.destroy()
        throw new RetryableError('body longer than its content-length')
      }
      dst.set(piece, off)
      off += piece.byteLength
    }
    return dst.subarray(0, off)
  }
  const parts: Uint8Array[] = []
  let total = 0
  for await (const piece of body) {
    total += piece.byteLength
    if (total > cap) throw tooLong(total)
    parts.push(piece)
  }
  const out = into && total <= into.byteLength ? into.subarray(0, total) : new Uint8Array(total)
  let off = 0
  for (const p of parts) {
    out.set(p, off)
    off += p.byteLength
  }
  return out
}

function contentLength(h: Record<string, string | string[] | undefined>): number | undefined {
  const v = h['content-length']
  const n = typeof v === 'string' ? Number(v) : Number.NaN
  return Number.isSafeInteger(n) && n >= 0 ? n : undefined
}

/** Base path of the gateway from a configured URL: a trailing /v1 (a common paste) is dropped. */
function gatewayPrefix(raw: string, url: URL): string {
  let path = url.pathname.replace(/\/+$/, '')
  if (path.endsWith('/v1')) path = path.slice(0, -3)
  if (/\/v1(\/|$)/.test(path)) {
    throw new InvalidArgumentError(
      `invalid remote.url: ${raw} (the gateway's base URL, e.g. http://host:8080; the client adds /v1/ns/{namespace})`,
    )
  }
  return path
}

interface RequestOptions {
  body?: Uint8Array | string
  headers?: Record<string, string>
  timeoutMs: number
  retries?: number
  into?: Uint8Array
  /** Largest 200 body accepted. */
  cap?: number
  /** Largest 200 body accepted, from the answer's headers (overrides cap). */
  capFor?: (headers: HttpResult['headers']) => number
  /** The caller's own deadline (e.g. a retrieve's): aborts without blaming the gateway. */
  signal?: AbortSignal | undefined
  /** A 401/403 here is not a misconfigured token (e.g. verify with a read-only token). */
  quietAuth?: boolean
  /**
   * Running out of time means the gateway hangs (chunk GETs and PUTs, whose
   * deadline is generous): counted toward opening the breaker within its window.
   * A lookup's deadline is tight by design; missing it is an ordinary failure.
   */
  hangIsTimeout?: boolean
  /** Called when the body went over its cap. */
  onOversized?: () => void
  /** Part of a background write (an upload's open and commit): sent on the write connections. */
  write?: boolean
}

export interface RemoteGetOptions {
  /** The caller's deadline: aborting it ends the request (not counted against the gateway). */
  signal?: AbortSignal
  /** A tighter body cap than the geometry's (e.g. a partial tail chunk). */
  maxBytes?: number
}

export class RemoteTier {
  readonly counters = new TierCounters()
  readonly breaker: CircuitBreaker
  readonly #pool: Pool
  readonly #writePool: Pool
  readonly #redirectAgent: Agent
  /** Presigned store PUTs of uploads: their own connections, apart from redirected GETs. */
  readonly #uploadAgent: Agent
  readonly #prefix: string
  readonly #base: string
  readonly #origin: string
  readonly #namespace: string
  readonly #auth: Record<string, string>
  readonly #timeoutMs: number
  readonly #lookupTimeoutMs: number
  readonly #retries: number
  readonly #maxQueued: number
  readonly #maxQueuedBytes: number
  readonly #writeConcurrency: number
  readonly #geometry: KvGeometry | undefined
  readonly #chunkTokens: number | undefined
  readonly #warn: (message: string, code: string) => void
  readonly #queue: RemoteWriteJob[] = []
  readonly #presence: PresenceSet
  readonly #idle = new Set<() => void>()
  /** Keys reported to the verify endpoint, with when (a key is reported once per window). */
  readonly #reported = new Map<string, number>()
  #verifyInFlight = 0
  #verifyWindowStart = 0
  #verifyInWindow = 0
  readonly #uploader: TierUploader
  #queuedBytes = 0
  #writers = 0
  #closed = false
  /**
   * Aborted by close(): every request still running ends then. The pools close gracefully
   * (they wait for their requests), so without it a stuck gateway held close() for a whole
   * request deadline (60 s for an upload's commit).
   */
  readonly #closing = new AbortController()
  #shed = 0
  readonly #shedBy = { breaker: 0, queueFull: 0, closed: 0 }
  #shedUnwarned = 0
  #shedWarnedAt = Number.NEGATIVE_INFINITY
  #authWarned = false
  #authErrors = 0
  #notFound = 0
  #oversized = 0
  #corruptReported = 0
  #corruptConfirmed = 0
  #newerObjects = 0
  #layersAnsweredWhole = 0
  readonly #unservable: UnservableKeys
  #unservableHeld = 0
  #unservableSkipped = 0
  #unservableLookupStops = 0
  #existed = 0
  #retried = 0
  #redirects = 0
  #timeouts = 0
  #lookupRequests = 0
  readonly #lookupLatency = new LatencyWindow()
  #lookupKeysKnown = 0

  constructor(opts: RemoteTierOptions, ctx: RemoteTierContext = {}) {
    // Every request in flight listens on the close signal (and stops when it ends): a busy node
    // has more than EventTarget's default 10 at once, which Node reports as a possible leak.
    // Their number is bounded by the tier's concurrency settings, not by this limit.
    setMaxListeners(0, this.#closing.signal)
    let url: URL
    try {
      url = new URL(opts.url)
    } catch {
      throw new InvalidArgumentError(`invalid remote.url: ${String(opts.url)}`)
    }
    if (url.protocol !== 'http:' && url.protocol !== 'https:') {
      throw new InvalidArgumentError(`invalid remote.url: ${opts.url} (http or https)`)
    }
    const ns = assertNamespaceName(opts.namespace)
    this.#namespace = ns
    this.#origin = url.origin
    this.#prefix = gatewayPrefix(opts.url, url)
    this.#base = `${this.#prefix}/v1/ns/${ns}`
    this.#auth = opts.token ? { authorization: `Bearer ${opts.token}` } : {}
    this.#timeoutMs = opts.timeoutMs ?? 10_000
    this.#lookupTimeoutMs = opts.lookupTimeoutMs ?? 250
    this.#retries = opts.retries ?? 2
    this.#maxQueued = opts.maxQueuedWrites ?? 4096
    this.#maxQueuedBytes = opts.maxQueuedBytes ?? 512 * 1024 * 1024
    this.#writeConcurrency = opts.writeConcurrency ?? 8
    this.#geometry = ctx.geometry
    this.#chunkTokens = ctx.chunkTokens
    this.#warn = ctx.warn ?? ((message, code) => process.emitWarning(message, { code }))
    this.#presence = new PresenceSet(opts.presenceTtlMs ?? 30_000)
    this.#unservable = new UnservableKeys(ctx.unservable)
    const connect = { timeout: Math.min(this.#timeoutMs, 5000) }
    this.#pool = new Pool(this.#origin, {
      connections: opts.connections ?? 8,
      keepAliveTimeout: 30_000,
      connect,
    })
    this.#writePool = new Pool(this.#origin, {
      connections: this.#writeConcurrency,
      keepAliveTimeout: 30_000,
      connect,
    })
    this.#redirectAgent = new Agent({ connections: opts.connections ?? 8, keepAliveTimeout: 30_000 })
    this.#uploadAgent = new Agent({ connections: this.#writeConcurrency, keepAliveTimeout: 30_000 })
    this.#uploader = new TierUploader({
      base: this.#base,
      minBytes: opts.uploadMinBytes ?? 1024 * 1024,
      timeoutMs: this.#timeoutMs,
      retries: this.#retries,
      agent: this.#uploadAgent,
      signal: this.#closing.signal,
      post: (path, body, timeoutMs) =>
        this.#request('POST', path, {
          body,
          headers: { 'content-type': 'application/json' },
          timeoutMs,
          write: true,
        }),
    })
    this.breaker = new CircuitBreaker({
      failureThreshold: opts.breakerThreshold ?? 5,
      cooldownMs: opts.breakerCooldownMs ?? 1000,
      probe: () => this.#probe(),
    })
  }

  /** True while a lookup or PUT showed (less than presenceTtlMs ago) that the gateway holds this chunk. */
  knownPresent(hex: string): boolean {
    return this.#presence.has(hex)
  }

  /**
   * True while `hex` is held off as unservable (its GETs skipped): a lookup's matched prefix
   * ends before it, and nothing after it counts either (prefix semantics). Counted
   * (unservableLookupStops): the caller stops its lookup there, once per lookup.
   */
  lookupStopsAt(hex: string): boolean {
    if (!this.#unservable.held(hex, performance.now())) return false
    this.#unservableLookupStops++
    return true
  }

  /**
   * Drops keys[index..] (one chain, in order) and every key learned after them
   * from the chunks believed present: the storage manager calls it when chunk
   * `index` turned out missing. GETs answering 404 do this themselves.
   */
  forgetFrom(keys: readonly string[], index: number): void {
    this.#presence.forgetFrom(keys, index)
  }

  /** Largest chunk object body accepted (a whole object, or layers first..last). */
  #cap(layers: readonly [number, number] | undefined): number {
    const g = this.#geometry
    if (!g || this.#chunkTokens === undefined) return DEFAULT_MAX_CHUNK_BYTES
    return layers
      ? maxLayerGroupBytes(g, this.#chunkTokens, layers[0], layers[1])
      : maxObjectBytes(g, this.#chunkTokens)
  }

  async #probe(): Promise<boolean> {
    const ac = new AbortController()
    const t = setTimeout(() => ac.abort(), Math.min(this.#timeoutMs, 2000))
    const onClose = () => ac.abort()
    this.#closing.signal.addEventListener('abort', onClose, { once: true })
    try {
      const r = await this.#pool.request({
        origin: this.#origin,
        path: `${this.#prefix}/healthz`,
        method: 'GET',
        signal: ac.signal,
      })
      await r.body.dump()
      return r.statusCode < 500
    } catch {
      return false
    } finally {
      clearTimeout(t)
      this.#closing.signal.removeEventListener('abort', onClose)
    }
  }

  /** One attempt; throws RetryableError on connection errors and 5xx, OversizedError past the cap. */
  async #once(
    method: 'GET' | 'PUT' | 'POST' | 'HEAD',
    path: string,
    opts: RequestOptions,
    signal: AbortSignal,
  ) {
    // Undici ends a request queued behind a busy connection only once it is dispatched, so
    // a deadline does not bound the wait: writes (a commit verifies a whole object) never
    // take the connections that lookups and GETs queue for.
    const pool = method === 'PUT' || opts.write ? this.#writePool : this.#pool
    let r: Awaited<ReturnType<Pool['request']>>
    try {
      r = await pool.request({
        origin: this.#origin,
        path,
        method,
        headers: { ...this.#auth, ...opts.headers },
        body: opts.body,
        signal,
      })
    } catch (e) {
      throw new RetryableError((e as Error).message)
    }
    if (r.statusCode === 307 || r.statusCode === 302 || r.statusCode === 303) {
      await r.body.dump().catch(() => {})
      const loc = r.headers.location
      if (method !== 'GET' || typeof loc !== 'string') throw new RetryableError('redirect without location')
      return this.#followRedirect(new URL(loc, this.#origin), opts, signal)
    }
    return this.#result(r, method, opts, false)
  }

  async #result(
    r: { statusCode: number; headers: HttpResult['headers']; body: Body & { dump(): Promise<void> } },
    method: string,
    opts: RequestOptions,
    redirected: boolean,
  ): Promise<HttpResult> {
    if (r.statusCode >= 500) {
      await r.body.dump().catch(() => {})
      throw new RetryableError(`HTTP ${r.statusCode}`)
    }
    const ok = r.statusCode === 200
    const body =
      method === 'HEAD'
        ? new Uint8Array(0)
        : await readBody(
            r.body,
            ok ? opts.into : undefined,
            contentLength(r.headers),
            ok ? (opts.capFor?.(r.headers) ?? opts.cap ?? MAX_SMALL_BODY) : MAX_SMALL_BODY,
          )
    return { status: r.statusCode, headers: r.headers, body, redirected }
  }

  /** Presigned store URLs: no Authorization header (the URL carries the grant); Range is kept; same caps. */
  async #followRedirect(url: URL, opts: RequestOptions, signal: AbortSignal): Promise<HttpResult> {
    this.#redirects++
    const h: Record<string, string> = {}
    if (opts.headers?.range) h.range = opts.headers.range
    let r: Awaited<ReturnType<Agent['request']>>
    try {
      r = await this.#redirectAgent.request({
        origin: url.origin,
        path: url.pathname + url.search,
        method: 'GET',
        headers: h,
        signal,
      })
    } catch (e) {
      throw new RetryableError((e as Error).message)
    }
    // A 401/403 from the store is an expired or bad presigned grant, not this client's token.
    return this.#result(r, 'GET', opts, true)
  }

  /**
   * A request with retries (full jitter) under the breaker, all attempts within
   * one deadline of `timeoutMs`; undefined when it failed. A hung request is not
   * retried (its deadline is spent) and counts as a timeout toward the breaker.
   */
  async #request(
    method: 'GET' | 'PUT' | 'POST' | 'HEAD',
    path: string,
    opts: RequestOptions,
  ): Promise<HttpResult | undefined> {
    if (this.#closed || opts.signal?.aborted) return undefined
    const retries = opts.retries ?? this.#retries
    const ac = new AbortController()
    let timedOut = false
    const timer = setTimeout(() => {
      timedOut = true
      ac.abort()
    }, opts.timeoutMs)
    const onCallerAbort = () => ac.abort()
    opts.signal?.addEventListener('abort', onCallerAbort, { once: true })
    this.#closing.signal.addEventListener('abort', onCallerAbort, { once: true })
    try {
      for (let attempt = 0; ; attempt++) {
        if (!this.breaker.allow()) return undefined
        try {
          const attempt = this.#once(method, path, opts, ac.signal)
          // Undici leaves a request queued behind a busy connection waiting past its abort
          // (it is ended only once dispatched): the deadline is kept here. A read into the
          // caller's buffer is waited for, so no write into it follows the return.
          const r = opts.into ? await attempt : await untilAborted(attempt, ac.signal)
          this.breaker.success()
          if ((r.status === 401 || r.status === 403) && !opts.quietAuth && !r.redirected) this.#authFailure(r)
          return r
        } catch (e) {
          // Ended by close(): not the gateway's failure.
          if (this.#closed) return undefined
          if (timedOut) {
            this.counters.errors++
            this.#timedOut(opts)
            return undefined
          }
          // The caller gave up: not the gateway's failure.
          if (opts.signal?.aborted) return undefined
          this.counters.errors++
          this.breaker.failure()
          if (e instanceof OversizedError) {
            this.#oversized++
            opts.onOversized?.()
            return undefined
          }
          if (attempt >= retries || this.#closed) return undefined
          this.#retried++
          await sleep(Math.random() * 25 * 2 ** attempt, ac.signal)
          if (timedOut) {
            this.#timedOut(opts)
            return undefined
          }
          if (ac.signal.aborted) return undefined
        }
      }
    } finally {
      clearTimeout(timer)
      opts.signal?.removeEventListener('abort', onCallerAbort)
      this.#closing.signal.removeEventListener('abort', onCallerAbort)
    }
  }

  #timedOut(opts: RequestOptions): void {
    this.#timeouts++
    if (opts.hangIsTimeout) this.breaker.timeout()
    else this.breaker.failure()
  }

  /** Counts a refused request and says once, in one line, what to fix. */
  #authFailure(r: HttpResult): void {
    this.#authErrors++
    this.counters.errors++
    if (this.#authWarned) return
    this.#authWarned = true
    let code = ''
    try {
      const j = JSON.parse(new TextDecoder().decode(r.body)) as { error?: { code?: unknown } }
      if (typeof j.error?.code === 'string') code = ` ${j.error.code}`
    } catch {
      // Not JSON: the status says enough.
    }
    const where = `the gateway at ${this.#origin}${this.#prefix}`
    this.#warn(
      r.status === 401
        ? `kvgate: ${where} refused the client's token (401${code}): set remote.token (KVGATE_REMOTE_TOKEN) to a token listed in the gateway's token table; L4 is unused until then (stats().remote.authErrors counts refusals)`
        : `kvgate: ${where} refused namespace '${this.#namespace}' (403${code}): give the token this namespace and the write scope in the gateway's token table, or set remote namespace to one it allows (stats().remote.authErrors counts refusals)`,
      'KVGATE_REMOTE_AUTH',
    )
  }

  /** Counts a non-success answer other than 401/403 (those were counted when they arrived). */
  #unexpected(r: { status: number } | undefined): void {
    if (r && r.status !== 401 && r.status !== 403) this.counters.errors++
  }

  /**
   * How many leading keys the gateway holds (0 when it is unreachable). Uses the
   * small lookup deadline and no retries: a slow gateway must not stall prefill.
   * Leading keys this client saw stored less than presenceTtlMs ago are not asked
   * again, so an engine's lookup → retrieve → store of one prompt costs one
   * gateway lookup, not three; past the TTL (or after a 404) the gateway is asked.
   * 'background' (the write-behind deciding what to upload) is off the prefill
   * path: it gets the chunk deadline and retries, so a burst of stores that slows
   * the gateway's answers does not read as a failing gateway and shed the uploads.
   */
  async lookup(
    hexes: readonly string[],
    priority: 'prefill' | 'background' = 'prefill',
  ): Promise<{ present: number }> {
    const background = priority === 'background'
    let present = 0
    while (present < hexes.length && this.#presence.has(hexes[present]!)) present++
    this.#lookupKeysKnown += present
    const known = present
    for (let i = present; i < hexes.length; i += MAX_LOOKUP_KEYS) {
      const batch = hexes.slice(i, i + MAX_LOOKUP_KEYS)
      const t0 = performance.now()
      this.#lookupRequests++
      const r = await this.#request('POST', `${this.#base}/lookup`, {
        body: JSON.stringify({ keys: batch }),
        headers: { 'content-type': 'application/json' },
        timeoutMs: background ? this.#timeoutMs : this.#lookupTimeoutMs,
        retries: background ? this.#retries : 0,
        cap: MAX_SMALL_BODY + 80 * batch.length,
      })
      this.#lookupLatency.record(since(t0))
      if (r?.status !== 200) {
        this.#unexpected(r)
        break
      }
      const parsed = parseLookup(r.body, batch.length)
      if (parsed === undefined) {
        this.counters.errors++
        break
      }
      present += parsed
      if (parsed < batch.length) break
    }
    // Linked to the known leading keys, so a 404 on any of them forgets these too.
    if (present > known)
      this.#presence.rememberChain(hexes.slice(Math.max(0, known - 1), present), known > 0 ? 1 : 0)
    return { present }
  }

  /**
   * GETs a chunk object, or with `layers` the header followed by sections a..b;
   * the body is capped at what such a chunk can be. Undefined on 404 (the key and
   * its chain's later keys are then no longer believed present) or failure; the
   * bytes are not verified here (the caller does, and calls reportCorrupt).
   */
  async get(
    hex: string,
    layers?: readonly [number, number],
    into?: Uint8Array,
    opts: RemoteGetOptions = {},
  ): Promise<Uint8Array | undefined> {
    const t0 = performance.now()
    if (this.#unservable.held(hex, t0)) {
      this.#unservableSkipped++
      this.counters.misses++
      return undefined
    }
    const spec = layers && `${layers[0]}-${layers[1]}`
    const q = spec ? `?layers=${spec}` : ''
    const most = opts.maxBytes ?? Number.POSITIVE_INFINITY
    const cap = Math.min(this.#cap(layers), most)
    // An answer that is not a layer subset (no x-kvgate-layers: a caching proxy that dropped the
    // query sends the whole object) is capped as a whole object: the reader serves the layers from it.
    const wholeCap = Math.min(this.#cap(undefined), most)
    let oversized = false
    const r = await this.#request('GET', `${this.#base}/chunks/${hex}${q}`, {
      timeoutMs: this.#timeoutMs,
      into,
      cap,
      ...(spec
        ? { capFor: (h: HttpResult['headers']) => (h['x-kvgate-layers'] === spec ? cap : wholeCap) }
        : {}),
      signal: opts.signal,
      hangIsTimeout: true,
      onOversized: () => {
        oversized = true
      },
    })
    if (r?.status !== 200) {
      this.counters.misses++
      if (r?.status === 404) {
        this.#notFound++
        this.#presence.forgetChainFrom(hex)
      } else this.#unexpected(r)
      // A body far over the size of any chunk: let the gateway check what it stores.
      if (oversized) this.#requestVerify(hex)
      return undefined
    }
    this.counters.hits++
    this.counters.bytesRead += r.body.byteLength
    this.counters.readLatency.record(since(t0))
    return r.body
  }

  /**
   * An object the caller found written by a newer kvgate (see newerObjects): a counted miss, its
   * key held off (unservableHeld) so that the next reads of it cost no GET until the hold ends.
   */
  newerObject(hex: string): void {
    // Once per hold: the layer groups of one retrieveLayers, all asked before any answered, each
    // find the same object (five counted for one key at one layer a request).
    if (!this.#unservable.holdNow(hex, performance.now())) return
    this.#newerObjects++
    this.#unservableHeld++
  }

  /**
   * The caller could not use an object get() served, for a reason that proves nothing about its
   * bytes (a decode that trapped or ran out of memory, its worker lost or hung, a codec version
   * this build lacks): a counted error; after a few such reads of the key within a window it is
   * held off for a while (unservableHeld), its GETs misses without the network.
   */
  readFailed(hex: string): void {
    this.counters.errors++
    if (this.#unservable.failed(hex, performance.now())) this.#unservableHeld++
  }

  /** A `?layers` GET was answered with the whole object (see layersAnsweredWhole). */
  answeredWhole(): void {
    this.#layersAnsweredWhole++
  }

  /**
   * The caller found this chunk's L4 object corrupt (CRC, format or identity):
   * counted, no longer believed present (with its chain's later keys), and
   * reported once to the gateway's verify endpoint, which checks the stored
   * object itself and deletes it only if it is corrupt, so the next writer can
   * re-upload. Fire-and-forget, bounded and rate-limited.
   */
  reportCorrupt(hex: string): void {
    this.counters.corrupt++
    this.#presence.forgetChainFrom(hex)
    this.#requestVerify(hex)
  }

  #requestVerify(hex: string): void {
    if (this.#closed || !/^[0-9a-f]{64}$/.test(hex)) return
    const now = performance.now()
    const at = this.#reported.get(hex)
    if (at !== undefined && now - at < 10 * 60_000) return
    if (now - this.#verifyWindowStart >= 60_000) {
      this.#verifyWindowStart = now
      this.#verifyInWindow = 0
    }
    if (this.#verifyInFlight >= MAX_VERIFY_IN_FLIGHT || this.#verifyInWindow >= MAX_VERIFY_PER_MINUTE) return
    this.#verifyInWindow++
    this.#reported.delete(hex)
    this.#reported.set(hex, now)
    if (this.#reported.size > MAX_REPORTED_KEYS)
      this.#reported.delete(this.#reported.keys().next().value as string)
    this.#corruptReported++
    this.#verifyInFlight++
    void this.#verify(hex).finally(() => this.#verifyInFlight--)
  }

  async #verify(hex: string): Promise<void> {
    const r = await this.#request('POST', `${this.#base}/chunks/${hex}/verify`, {
      timeoutMs: this.#timeoutMs,
      retries: 0,
      quietAuth: true,
    })
    if (r?.status !== 200) return
    try {
      const verdict = (JSON.parse(new TextDecoder().decode(r.body)) as { verdict?: unknown }).verdict
      if (verdict === 'corrupt' || verdict === 'missing') {
        this.#corruptConfirmed++
        this.#presence.forgetChainFrom(hex)
      }
    } catch {
      // Not an answer of this contract (an older gateway): nothing to learn.
    }
  }

  // ------------------------------------------------ calibration objects (docs/calibration.md)
  // Transport only: src/client/calibration-store.ts verifies, caches and decides.

  /** GET …/calibrations/{hash}: the body (unverified), null when the gateway has none, undefined when unreachable. */
  async getCalibration(hash: string, maxBytes: number): Promise<Uint8Array | null | undefined> {
    const r = await this.#request('GET', `${this.#base}/calibrations/${hash}`, {
      timeoutMs: this.#timeoutMs,
      cap: maxBytes,
    })
    if (r?.status === 200) return r.body
    if (r?.status === 404) return null
    this.#unexpected(r)
    return undefined
  }

  /** HEAD …/calibrations/{hash}: whether the gateway holds it, undefined when unreachable. */
  async hasCalibration(hash: string): Promise<boolean | undefined> {
    const r = await this.#request('HEAD', `${this.#base}/calibrations/${hash}`, {
      timeoutMs: this.#timeoutMs,
    })
    if (r?.status === 200) return true
    if (r?.status === 404) return false
    this.#unexpected(r)
    return undefined
  }

  /** GET …/calibration: the namespace's current hash, null when it has none, undefined when unknown (unreachable). */
  async currentCalibration(opts: { fresh?: boolean } = {}): Promise<string | null | undefined> {
    // Asked in the background (never on a lookup's path): the chunk deadline and retries.
    const r = await this.#request('GET', `${this.#base}/calibration`, {
      timeoutMs: this.#timeoutMs,
      // The gateway then reads the stored pointer instead of its cached copy.
      ...(opts.fresh ? { headers: { 'cache-control': 'no-cache' } } : {}),
    })
    if (r?.status === 404) return null
    if (r?.status !== 200) {
      this.#unexpected(r)
      return undefined
    }
    return hashOf(r.body)
  }

  /**
   * PUT …/calibrations/{hash} (create-only). True when stored or already there; 'refused' when
   * the gateway will never take these bytes from this client (400, 403, 413: over its size cap);
   * false when it could not be asked (worth another try later).
   */
  async putCalibration(hash: string, bytes: Uint8Array): Promise<boolean | 'refused'> {
    const r = await this.#request('PUT', `${this.#base}/calibrations/${hash}`, {
      body: bytes,
      headers: { 'content-type': 'application/octet-stream' },
      timeoutMs: this.#timeoutMs,
    })
    if (r?.status === 200 || r?.status === 201) return true
    this.#unexpected(r)
    return r?.status === 400 || r?.status === 403 || r?.status === 413 ? 'refused' : false
  }

  /** PUT …/calibration {hash} (create-only): the namespace's winner (ours or an earlier one), undefined on failure. */
  async setCurrentCalibration(hash: string): Promise<string | undefined> {
    const r = await this.#request('PUT', `${this.#base}/calibration`, {
      body: JSON.stringify({ hash }),
      headers: { 'content-type': 'application/json' },
      timeoutMs: this.#timeoutMs,
    })
    if (r?.status !== 200 && r?.status !== 201) {
      this.#unexpected(r)
      return undefined
    }
    return hashOf(r.body) ?? undefined
  }

  /** PUT now (create-only on the gateway). True when stored or already present ("exists" is success). */
  async put(hex: string, object: Uint8Array): Promise<boolean> {
    const t0 = performance.now()
    const up = await this.#uploader.put(hex, object)
    if (up === 'lost') {
      // A part the store refused, or an upload answer that is not one: nobody counted it yet.
      if (!this.#closed) this.counters.errors++
      return false
    }
    const r =
      up !== 'direct'
        ? up
        : await this.#request('PUT', `${this.#base}/chunks/${hex}`, {
            body: object,
            headers: { 'content-type': 'application/octet-stream' },
            timeoutMs: this.#timeoutMs,
            hangIsTimeout: true,
          })
    // 409: an older gateway's answer to a same-key re-PUT of another size (a lossy re-encode): it holds the key.
    if (!r || (r.status !== 200 && r.status !== 201 && r.status !== 409)) {
      this.#unexpected(r)
      return false
    }
    if (r.status !== 201) this.#existed++
    this.#presence.rememberChain([hex])
    this.counters.puts++
    this.counters.bytesWritten += object.byteLength
    this.counters.writeLatency.record(since(t0))
    return true
  }

  /**
   * Queues a background upload. Returns false (and counts a shed write) when the
   * queue is over its bounds or the breaker is open; `job.done` is then called at once.
   */
  enqueue(job: RemoteWriteJob): boolean {
    const reason = this.#closed
      ? 'closed'
      : this.breaker.state !== 'closed'
        ? 'breaker'
        : this.#queue.length >= this.#maxQueued || this.#queuedBytes + job.bytesHint > this.#maxQueuedBytes
          ? 'queueFull'
          : undefined
    if (reason) {
      this.#shedOne(reason)
      job.done()
      return false
    }
    this.#queue.push(job)
    this.#queuedBytes += job.bytesHint
    this.#pumpWrites()
    return true
  }

  /** Counts a dropped upload; says so in one line at most once a minute (closing is silent). */
  #shedOne(reason: 'breaker' | 'queueFull' | 'closed'): void {
    this.#shed++
    this.#shedBy[reason]++
    if (reason === 'closed') return
    this.#shedUnwarned++
    const now = performance.now()
    if (now - this.#shedWarnedAt < SHED_WARN_INTERVAL_MS) return
    const n = this.#shedUnwarned
    this.#shedUnwarned = 0
    this.#shedWarnedAt = now
    const where = `${this.#origin}${this.#prefix}`
    this.#warn(
      reason === 'breaker'
        ? `kvgate: dropped ${n} L4 upload(s): the gateway at ${where} is failing (circuit breaker open); check its /healthz and logs (stats().remote.shedByReason counts drops)`
        : `kvgate: dropped ${n} L4 upload(s): the write queue to ${where} is full (${this.#queue.length} uploads, ${Math.round(this.#queuedBytes / 2 ** 20)} MiB); the gateway is slower than stores arrive: raise remote.writeConcurrency or remote.maxQueuedBytes, or check the gateway's latency (stats().remote.shedByReason counts drops)`,
      'KVGATE_REMOTE_SHED',
    )
  }

  #pumpWrites(): void {
    while (this.#writers < this.#writeConcurrency && this.#queue.length > 0) {
      const job = this.#queue.shift()!
      this.#writers++
      void this.#runJob(job).finally(() => {
        this.#writers--
        this.#queuedBytes -= job.bytesHint
        this.#pumpWrites()
        if (this.#writers === 0 && this.#queue.length === 0) {
          for (const f of [...this.#idle]) f()
        }
      })
    }
  }

  async #runJob(job: RemoteWriteJob): Promise<void> {
    try {
      if (this.#presence.has(job.hex)) return
      if (this.breaker.state !== 'closed') {
        this.#shedOne('breaker')
        return
      }
      const object = await job.encode()
      // An upload close() ended (or found closed) is dropped like a queued one: counted.
      if (object && !(await this.put(job.hex, object)) && this.#closed) this.#shedOne('closed')
    } catch {
      this.counters.errors++
    } finally {
      job.done()
    }
  }

  /** Resolves when the write-behind queue is empty, or after `timeoutMs`. */
  flush(timeoutMs = 30_000): Promise<void> {
    if (this.#writers === 0 && this.#queue.length === 0) return Promise.resolve()
    return new Promise<void>((resolve) => {
      const done = () => {
        clearTimeout(t)
        this.#idle.delete(done)
        resolve()
      }
      const t = setTimeout(done, timeoutMs)
      t.unref()
      this.#idle.add(done)
    })
  }

  stats(): RemoteTierStats {
    return {
      url: this.#origin + this.#base,
      breaker: this.breaker.state,
      breakerOpened: this.breaker.opened,
      breakerOpenedByTimeouts: this.breaker.openedByTimeouts,
      breakerRejected: this.breaker.rejected,
      queuedWrites: this.#queue.length + this.#writers,
      queuedBytes: this.#queuedBytes,
      shedWrites: this.#shed,
      shedByReason: { ...this.#shedBy },
      existed: this.#existed,
      retries: this.#retried,
      redirects: this.#redirects,
      timeouts: this.#timeouts,
      authErrors: this.#authErrors,
      notFound: this.#notFound,
      oversizedBodies: this.#oversized,
      corruptReported: this.#corruptReported,
      corruptConfirmed: this.#corruptConfirmed,
      newerObjects: this.#newerObjects,
      layersAnsweredWhole: this.#layersAnsweredWhole,
      unservableHeld: this.#unservableHeld,
      unservableSkipped: this.#unservableSkipped,
      unservableLookupStops: this.#unservableLookupStops,
      lookupRequests: this.#lookupRequests,
      lookupLatency: this.#lookupLatency.summary(),
      lookupKeysKnown: this.#lookupKeysKnown,
      knownPresent: this.#presence.size,
    }
  }

  /** Drops queued (not started) uploads, ends the requests still running, then closes connections. */
  async close(flushMs = 5000): Promise<void> {
    await this.flush(flushMs)
    this.#closed = true
    for (const job of this.#queue.splice(0)) {
      this.#queuedBytes -= job.bytesHint
      this.#shedOne('closed')
      job.done()
    }
    this.#closing.abort()
    this.breaker.dispose()
    this.#presence.clear()
    this.#unservable.clear()
    await Promise.allSettled([
      this.#pool.close(),
      this.#writePool.close(),
      this.#redirectAgent.close(),
      this.#uploadAgent.close(),
    ])
  }
}

/** The `present` count of a lookup answer, or undefined when the body is not one. */
function parseLookup(body: Uint8Array, max: number): number | undefined {
  try {
    const present = (JSON.parse(new TextDecoder().decode(body)) as { present?: unknown }).present
    if (typeof present !== 'number' || !Number.isInteger(present) || present < 0 || present > max)
      return undefined
    return present
  } catch {
    return undefined
  }
}

/** `p`, or a rejection as soon as `signal` aborts (p's own outcome is then ignored). */
function untilAborted<T>(p: Promise<T>, signal: AbortSignal): Promise<T> {
  if (signal.aborted) {
    p.catch(() => {})
    return Promise.reject(new Error('aborted'))
  }
  return new Promise<T>((resolve, reject) => {
    const onAbort = () => {
      p.catch(() => {})
      reject(new Error('aborted'))
    }
    signal.addEventListener('abort', onAbort, { once: true })
    p.then(
      (v) => {
        signal.removeEventListener('abort', onAbort)
        resolve(v)
      },
      (e: unknown) => {
        signal.removeEventListener('abort', onAbort)
        reject(e)
      },
    )
  })
}

/** Backoff pause that ends early when the request's deadline fires (no timer left behind). */
function sleep(ms: number, signal: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    const done = () => {
      clearTimeout(t)
      signal.removeEventListener('abort', done)
      resolve()
    }
    const t = setTimeout(done, ms)
    signal.addEventListener('abort', done, { once: true })
  })
}
