// L4: the gateway over HTTP (undici Pool, keep-alive). Deadlines, retries with
// jitter, a circuit breaker and a shedding write-behind queue: it never throws into callers.

import { Agent, Pool } from 'undici'
import { InvalidArgumentError } from '../../core/errors.ts'
import { assertNamespaceName } from '../../core/keys.ts'
import { type BreakerState, CircuitBreaker } from '../circuit-breaker.ts'
import { TierUploader } from '../remote-upload.ts'
import { since, TierCounters } from '../stats.ts'

export interface RemoteTierOptions {
  /** Gateway base URL, e.g. http://127.0.0.1:8080 (a path prefix is kept). */
  url: string
  /** Bearer token; omitted when the gateway runs without auth. */
  token?: string | undefined
  /** Tenant namespace in the URL (`/v1/ns/{ns}`). */
  namespace: string
  /** Keep-alive connections. @default 8 */
  connections?: number
  /** Deadline of one chunk GET/PUT attempt, ms. @default 10000 */
  timeoutMs?: number
  /** Deadline of a lookup, ms: lookups sit on the prefill path. @default 250 */
  lookupTimeoutMs?: number
  /** Retries of idempotent requests on 5xx / connection errors. @default 2 */
  retries?: number
  /** Consecutive failures that open the circuit breaker. @default 5 */
  breakerThreshold?: number
  /** First half-open probe after this many ms. @default 1000 */
  breakerCooldownMs?: number
  /** Write-behind queue bound in chunks. @default 64 */
  maxQueuedWrites?: number
  /** Write-behind queue bound in bytes (estimated). @default 512 MiB */
  maxQueuedBytes?: number
  /** Concurrent background PUTs. @default 4 */
  writeConcurrency?: number
  /** Chunks from this size ask the gateway for a direct-to-store upload first (remote-upload.ts). @default 1 MiB */
  uploadMinBytes?: number
}

/** A background upload: `encode` runs when a writer picks the job up; `done` always runs once. */
export interface RemoteWriteJob {
  hex: string
  /** Bytes the job holds while queued (for the byte bound). */
  bytesHint: number
  encode: () => Promise<Uint8Array | undefined>
  done: () => void
}

export interface RemoteTierStats {
  url: string
  breaker: BreakerState
  breakerOpened: number
  breakerRejected: number
  queuedWrites: number
  queuedBytes: number
  /** Uploads dropped because the queue was full or the breaker open. */
  shedWrites: number
  /** PUTs the gateway answered "exists" (another node stored it first). */
  existed: number
  retries: number
  redirects: number
  timeouts: number
  /** Lookup requests sent to the gateway. */
  lookupRequests: number
  /** Leading keys a lookup answered from what this client already knew was stored. */
  lookupKeysKnown: number
}

interface HttpResult {
  status: number
  headers: Record<string, string | string[] | undefined>
  body: Uint8Array
}

class RetryableError extends Error {}

/**
 * Reads a response body, into `into` when given and large enough (an L1 slot:
 * no intermediate buffer), else into a new buffer.
 */
async function readBody(
  body: AsyncIterable<Uint8Array> & { arrayBuffer(): Promise<ArrayBuffer> },
  into: Uint8Array | undefined,
  length: number | undefined,
): Promise<Uint8Array> {
  if (!into || length === undefined || length > into.byteLength)
    return new Uint8Array(await body.arrayBuffer())
  let off = 0
  for await (const piece of body) {
    if (off + piece.byteLength > into.byteLength)
      throw new RetryableError('body longer than its content-length')
    into.set(piece, off)
    off += piece.byteLength
  }
  return into.subarray(0, off)
}

function contentLength(h: Record<string, string | string[] | undefined>): number | undefined {
  const v = h['content-length']
  const n = typeof v === 'string' ? Number(v) : Number.NaN
  return Number.isSafeInteger(n) && n >= 0 ? n : undefined
}

const MAX_LOOKUP_KEYS = 4096

export class RemoteTier {
  readonly counters = new TierCounters()
  readonly breaker: CircuitBreaker
  readonly #pool: Pool
  readonly #redirectAgent: Agent
  readonly #base: string
  readonly #origin: string
  readonly #auth: Record<string, string>
  readonly #timeoutMs: number
  readonly #lookupTimeoutMs: number
  readonly #retries: number
  readonly #maxQueued: number
  readonly #maxQueuedBytes: number
  readonly #writeConcurrency: number
  readonly #queue: RemoteWriteJob[] = []
  readonly #knownPresent = new Set<string>()
  readonly #idle: (() => void)[] = []
  readonly #uploader: TierUploader
  #queuedBytes = 0
  #writers = 0
  #closed = false
  #shed = 0
  #existed = 0
  #retried = 0
  #redirects = 0
  #timeouts = 0
  #lookupRequests = 0
  #lookupKeysKnown = 0

  constructor(opts: RemoteTierOptions) {
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
    this.#origin = url.origin
    this.#base = `${url.pathname.replace(/\/+$/, '')}/v1/ns/${ns}`
    this.#auth = opts.token ? { authorization: `Bearer ${opts.token}` } : {}
    this.#timeoutMs = opts.timeoutMs ?? 10_000
    this.#lookupTimeoutMs = opts.lookupTimeoutMs ?? 250
    this.#retries = opts.retries ?? 2
    this.#maxQueued = opts.maxQueuedWrites ?? 64
    this.#maxQueuedBytes = opts.maxQueuedBytes ?? 512 * 1024 * 1024
    this.#writeConcurrency = opts.writeConcurrency ?? 4
    this.#pool = new Pool(this.#origin, {
      connections: opts.connections ?? 8,
      keepAliveTimeout: 30_000,
      connect: { timeout: Math.min(this.#timeoutMs, 5000) },
    })
    this.#redirectAgent = new Agent({ connections: opts.connections ?? 8, keepAliveTimeout: 30_000 })
    this.#uploader = new TierUploader({
      base: this.#base,
      minBytes: opts.uploadMinBytes ?? 1024 * 1024,
      timeoutMs: this.#timeoutMs,
      retries: this.#retries,
      agent: this.#redirectAgent,
      post: (path, body, timeoutMs) =>
        this.#request('POST', path, { body, headers: { 'content-type': 'application/json' }, timeoutMs }),
    })
    this.breaker = new CircuitBreaker({
      failureThreshold: opts.breakerThreshold ?? 5,
      cooldownMs: opts.breakerCooldownMs ?? 1000,
      probe: () => this.#probe(),
    })
  }

  /** True once a lookup or PUT showed the gateway holds this chunk. */
  knownPresent(hex: string): boolean {
    return this.#knownPresent.has(hex)
  }

  #remember(hex: string): void {
    // Bounded: a plain Set trimmed from its oldest end.
    this.#knownPresent.add(hex)
    if (this.#knownPresent.size > 65_536) {
      const first = this.#knownPresent.values().next().value as string
      this.#knownPresent.delete(first)
    }
  }

  async #probe(): Promise<boolean> {
    try {
      const r = await this.#pool.request({
        origin: this.#origin,
        path: `${this.#base.replace(/\/v1\/ns\/.*$/, '')}/healthz`,
        method: 'GET',
        signal: AbortSignal.timeout(Math.min(this.#timeoutMs, 2000)),
      })
      await r.body.dump()
      return r.statusCode < 500
    } catch {
      return false
    }
  }

  /** One attempt; throws RetryableError on connection errors, timeouts and 5xx. */
  async #once(
    method: 'GET' | 'PUT' | 'POST' | 'HEAD',
    path: string,
    opts: {
      body?: Uint8Array | string
      headers?: Record<string, string>
      timeoutMs: number
      into?: Uint8Array
    },
  ): Promise<HttpResult> {
    const signal = AbortSignal.timeout(opts.timeoutMs)
    try {
      const r = await this.#pool.request({
        origin: this.#origin,
        path,
        method,
        headers: { ...this.#auth, ...opts.headers },
        body: opts.body,
        signal,
      })
      if (r.statusCode === 307 || r.statusCode === 302 || r.statusCode === 303) {
        await r.body.dump()
        const loc = r.headers.location
        if (method !== 'GET' || typeof loc !== 'string') throw new RetryableError('redirect without location')
        return await this.#followRedirect(new URL(loc, this.#origin), opts.headers, signal, opts.into)
      }
      if (r.statusCode >= 500) {
        await r.body.dump()
        throw new RetryableError(`HTTP ${r.statusCode}`)
      }
      const body =
        method === 'HEAD'
          ? new Uint8Array(0)
          : await readBody(r.body, r.statusCode === 200 ? opts.into : undefined, contentLength(r.headers))
      return { status: r.statusCode, headers: r.headers, body }
    } catch (e) {
      if (e instanceof RetryableError) throw e
      if (signal.aborted) this.#timeouts++
      throw new RetryableError((e as Error).message)
    }
  }

  /** Presigned store URLs: no Authorization header (the URL carries the grant); Range is kept. */
  async #followRedirect(
    url: URL,
    headers: Record<string, string> | undefined,
    signal: AbortSignal,
    into?: Uint8Array,
  ): Promise<HttpResult> {
    this.#redirects++
    const h: Record<string, string> = {}
    if (headers?.range) h.range = headers.range
    const r = await this.#redirectAgent.request({
      origin: url.origin,
      path: url.pathname + url.search,
      method: 'GET',
      headers: h,
      signal,
    })
    if (r.statusCode >= 500) {
      await r.body.dump()
      throw new RetryableError(`HTTP ${r.statusCode} from redirect target`)
    }
    const body = await readBody(r.body, r.statusCode === 200 ? into : undefined, contentLength(r.headers))
    return { status: r.statusCode, headers: r.headers, body }
  }

  /** Idempotent request with retries (full jitter) under the breaker; undefined when it failed. */
  async #request(
    method: 'GET' | 'PUT' | 'POST' | 'HEAD',
    path: string,
    opts: {
      body?: Uint8Array | string
      headers?: Record<string, string>
      timeoutMs: number
      retries?: number
      into?: Uint8Array
    },
  ): Promise<HttpResult | undefined> {
    if (this.#closed) return undefined
    const retries = opts.retries ?? this.#retries
    for (let attempt = 0; ; attempt++) {
      if (!this.breaker.allow()) return undefined
      try {
        const r = await this.#once(method, path, opts)
        this.breaker.success()
        return r
      } catch {
        this.breaker.failure()
        this.counters.errors++
        if (attempt >= retries || this.#closed) return undefined
        this.#retried++
        await sleep(Math.random() * 25 * 2 ** attempt)
      }
    }
  }

  /**
   * How many leading keys the gateway holds (0 when it is unreachable). Uses the
   * small lookup deadline and no retries: a slow gateway must not stall prefill.
   * Leading keys already known to be stored are not asked again: chunk objects
   * are create-only, so presence does not go stale (an admin DELETE turns into a
   * 404 on GET, which is a miss). An engine's lookup → retrieve → store of one
   * prompt so costs one gateway lookup, not three.
   */
  async lookup(hexes: readonly string[]): Promise<{ present: number }> {
    let present = 0
    while (present < hexes.length && this.#knownPresent.has(hexes[present]!)) present++
    this.#lookupKeysKnown += present
    for (let i = present; i < hexes.length; i += MAX_LOOKUP_KEYS) {
      const batch = hexes.slice(i, i + MAX_LOOKUP_KEYS)
      const t0 = performance.now()
      this.#lookupRequests++
      const r = await this.#request('POST', `${this.#base}/lookup`, {
        body: JSON.stringify({ keys: batch }),
        headers: { 'content-type': 'application/json' },
        timeoutMs: this.#lookupTimeoutMs,
        retries: 0,
      })
      this.counters.readLatency.record(since(t0))
      if (r?.status !== 200) break
      const parsed = parseLookup(r.body, batch.length)
      if (parsed === undefined) {
        this.counters.errors++
        break
      }
      for (let j = 0; j < parsed; j++) this.#remember(batch[j]!)
      present += parsed
      if (parsed < batch.length) break
    }
    return { present }
  }

  /**
   * GETs a chunk object, or with `layers` the header followed by sections a..b.
   * Undefined on 404 or failure; the bytes are not verified here (the caller does).
   */
  async get(
    hex: string,
    layers?: readonly [number, number],
    into?: Uint8Array,
  ): Promise<Uint8Array | undefined> {
    const t0 = performance.now()
    const q = layers ? `?layers=${layers[0]}-${layers[1]}` : ''
    const r = await this.#request('GET', `${this.#base}/chunks/${hex}${q}`, {
      timeoutMs: this.#timeoutMs,
      into,
    })
    if (r?.status !== 200) {
      this.counters.misses++
      if (r && r.status !== 404) this.counters.errors++
      return undefined
    }
    this.counters.hits++
    this.counters.bytesRead += r.body.byteLength
    this.counters.readLatency.record(since(t0))
    return r.body
  }

  /** PUT now (create-only on the gateway). True when stored or already present. */
  async put(hex: string, object: Uint8Array): Promise<boolean> {
    const t0 = performance.now()
    const up = await this.#uploader.put(hex, object)
    const r =
      up !== 'direct'
        ? up
        : await this.#request('PUT', `${this.#base}/chunks/${hex}`, {
            body: object,
            headers: { 'content-type': 'application/octet-stream' },
            timeoutMs: this.#timeoutMs,
          })
    if (!r || (r.status !== 200 && r.status !== 201)) {
      if (r) this.counters.errors++
      return false
    }
    if (r.status === 200) this.#existed++
    this.#remember(hex)
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
    if (
      this.#closed ||
      this.breaker.state !== 'closed' ||
      this.#queue.length >= this.#maxQueued ||
      this.#queuedBytes + job.bytesHint > this.#maxQueuedBytes
    ) {
      this.#shed++
      job.done()
      return false
    }
    this.#queue.push(job)
    this.#queuedBytes += job.bytesHint
    this.#pumpWrites()
    return true
  }

  #pumpWrites(): void {
    while (this.#writers < this.#writeConcurrency && this.#queue.length > 0) {
      const job = this.#queue.shift()!
      this.#writers++
      void this.#runJob(job).finally(() => {
        this.#writers--
        this.#queuedBytes -= job.bytesHint
        this.#pumpWrites()
        if (this.#writers === 0 && this.#queue.length === 0) for (const f of this.#idle.splice(0)) f()
      })
    }
  }

  async #runJob(job: RemoteWriteJob): Promise<void> {
    try {
      if (this.#knownPresent.has(job.hex)) return
      if (this.breaker.state !== 'closed') {
        this.#shed++
        return
      }
      const object = await job.encode()
      if (object) await this.put(job.hex, object)
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
      const t = setTimeout(resolve, timeoutMs)
      t.unref()
      this.#idle.push(() => {
        clearTimeout(t)
        resolve()
      })
    })
  }

  stats(): RemoteTierStats {
    return {
      url: this.#origin + this.#base,
      breaker: this.breaker.state,
      breakerOpened: this.breaker.opened,
      breakerRejected: this.breaker.rejected,
      queuedWrites: this.#queue.length + this.#writers,
      queuedBytes: this.#queuedBytes,
      shedWrites: this.#shed,
      existed: this.#existed,
      retries: this.#retried,
      redirects: this.#redirects,
      timeouts: this.#timeouts,
      lookupRequests: this.#lookupRequests,
      lookupKeysKnown: this.#lookupKeysKnown,
    }
  }

  /** Drops queued (not started) uploads, then closes connections. */
  async close(flushMs = 5000): Promise<void> {
    await this.flush(flushMs)
    this.#closed = true
    for (const job of this.#queue.splice(0)) {
      this.#shed++
      job.done()
    }
    this.breaker.dispose()
    await Promise.allSettled([this.#pool.close(), this.#redirectAgent.close()])
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

function sleep(ms: number): Promise<void> {
  return new Promise((r) => setTimeout(r, ms))
}
