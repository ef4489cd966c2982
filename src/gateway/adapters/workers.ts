// Cloudflare Workers entry: `export default { fetch }` building the gateway once per
// isolate from its bindings (R2 bucket, token table secret, limits from vars).
// workerd requires every export of the entry module to be a handler or a function: constants
// live in other modules (memory-budget.ts), never here.

import { parseColdTier } from '../../coldtier/policy.ts'
import { nearestKey } from '../../core/config-check.ts'
import { ConfigError, isKvgateError } from '../../core/errors.ts'
import { createGateway, type GatewayApp } from '../app.ts'
import { DEFAULT_READER_MIN_BYTES_PER_SECOND } from '../context.ts'
import { WORKER_MAX_HELD_BYTES, WORKER_PRESENCE_ENTRIES } from '../memory-budget.ts'
import type { TokenGrant } from '../middleware/auth.ts'
import { type R2BucketLike, R2Store } from '../stores/r2.ts'
import { parseTokenTable } from '../token-table.ts'
import { R2_PRICE_PER_GB_MONTH, scheduledGc } from './workers-cron.ts'

/**
 * Bindings declared in wrangler.toml. A [vars] value written without quotes (a TOML number,
 * boolean or table) reaches the Worker as that JSON value, so numbers and switches take both.
 */
export interface WorkerEnv {
  /** The R2 bucket holding chunk objects ([[r2_buckets]] binding). */
  KVGATE_BUCKET: R2BucketLike
  /** Secret: the token table as JSON (TokenGrant[]: sha256, scopes, namespaces). */
  KVGATE_TOKENS?: string
  /** "disabled" runs without auth: local development only. */
  KVGATE_AUTH?: string
  /** Object name prefix in the bucket. @default 'kv' */
  KVGATE_PREFIX?: string
  /** Largest PUT body. @default 94371840 (90 MiB, under the 100 MB request limit) */
  KVGATE_MAX_CHUNK_BYTES?: string | number
  /** Largest calibration object accepted (docs/calibration.md). @default 16 MiB */
  KVGATE_MAX_CALIBRATION_BYTES?: string | number
  /**
   * Bytes of verified calibration bodies kept in the isolate; larger ones stream from R2.
   * 0 keeps none. @default 8388608 (8 MiB of the isolate's 128 MB)
   */
  KVGATE_CALIBRATION_CACHE_BYTES?: string | number
  /** Bodies above this use an R2 multipart upload. @default 67108864 */
  KVGATE_MULTIPART_THRESHOLD?: string | number
  /** Multipart part size (≥ 5 MiB). @default 8388608 */
  KVGATE_PART_BYTES?: string | number
  /** "true": /metrics and the status page need no token. */
  KVGATE_PUBLIC_STATUS?: string | boolean
  /**
   * Bytes the gateway holds for requests at once in this isolate (read-ahead, multipart parts,
   * calibration PUT bodies, coalesced GET buffers, lookup bodies); past it PUTs and lookups get 503 ERR_BUSY.
   * @default 50331648 (48 MiB of the isolate's 128 MB: see WORKER_MAX_HELD_BYTES)
   */
  KVGATE_MAX_HELD_BYTES?: string | number
  /** Bytes the GET coalescer may buffer at once in this isolate. @default 33554432 (32 MiB) */
  KVGATE_COALESCE_MAX_BUFFERED_BYTES?: string | number
  /** How long a cached presence is trusted (ms). @default 30000 */
  KVGATE_PRESENCE_TTL_MS?: string | number
  /** A GET reader that takes nothing this long (ms) is cut off; also the window of the rate below. @default 30000 */
  KVGATE_READER_IDLE_TIMEOUT_MS?: string | number
  /**
   * A GET reader slower than this (bytes/s over KVGATE_READER_IDLE_TIMEOUT_MS spent waiting on
   * it) has its R2 stream cancelled and its response failed; 0 = off. @default 65536
   */
  KVGATE_READER_MIN_BYTES_PER_SECOND?: string | number
  /** The coldTier section as JSON: retention/quota per namespace, grace, use tracking (docs/cold-tier.md). */
  KVGATE_COLD_TIER?: string
}

// Every KVGATE_* name the Worker reads (WorkerEnv's keys): [vars] are typed by hand, so any
// other KVGATE_* name is a typo or a Node-only setting, and leaving a default in its place
// in silence would be worse than an ERR_CONFIG answer.
const WORKER_VARS = Object.keys({
  KVGATE_BUCKET: true,
  KVGATE_TOKENS: true,
  KVGATE_AUTH: true,
  KVGATE_PREFIX: true,
  KVGATE_MAX_CHUNK_BYTES: true,
  KVGATE_MAX_CALIBRATION_BYTES: true,
  KVGATE_CALIBRATION_CACHE_BYTES: true,
  KVGATE_MULTIPART_THRESHOLD: true,
  KVGATE_PART_BYTES: true,
  KVGATE_PUBLIC_STATUS: true,
  KVGATE_MAX_HELD_BYTES: true,
  KVGATE_COALESCE_MAX_BUFFERED_BYTES: true,
  KVGATE_PRESENCE_TTL_MS: true,
  KVGATE_READER_IDLE_TIMEOUT_MS: true,
  KVGATE_READER_MIN_BYTES_PER_SECOND: true,
  KVGATE_COLD_TIER: true,
} satisfies Record<keyof WorkerEnv, true>) as (keyof WorkerEnv)[]

function checkVars(env: WorkerEnv): void {
  for (const name of Object.keys(env)) {
    if (!name.startsWith('KVGATE_') || (WORKER_VARS as readonly string[]).includes(name)) continue
    const near = nearestKey(name, WORKER_VARS)
    throw new ConfigError(
      `unknown variable ${name}${near ? ` (did you mean '${near}'?)` : ''}: the Worker reads ${WORKER_VARS.join(', ')} (docs/deploy-workers.md)`,
    )
  }
  const status = publicStatusVar(env)
  if (status !== undefined && status !== 'true' && status !== 'false')
    throw new ConfigError(`KVGATE_PUBLIC_STATUS: expected 'true' or 'false', got '${String(status)}'`)
  if (env.KVGATE_AUTH !== undefined && env.KVGATE_AUTH !== 'disabled')
    throw new ConfigError(`KVGATE_AUTH: expected 'disabled' or unset, got '${String(env.KVGATE_AUTH)}'`)
}

/** KVGATE_PUBLIC_STATUS as text: `true` unquoted in [vars] is the boolean. */
function publicStatusVar(env: WorkerEnv): unknown {
  const v = env.KVGATE_PUBLIC_STATUS
  return typeof v === 'boolean' ? String(v) : v
}

function intVar(env: WorkerEnv, name: keyof WorkerEnv, fallback: number, min = 1): number {
  const raw: unknown = env[name]
  if (raw === undefined || raw === '') return fallback
  const n =
    typeof raw === 'number' ? raw : typeof raw === 'string' && /^\d+$/.test(raw) ? Number(raw) : Number.NaN
  if (!Number.isSafeInteger(n) || n < min) {
    throw new ConfigError(`${name} must be an integer ≥ ${min}, got ${String(raw)}`)
  }
  return n
}

function tokensOf(env: WorkerEnv): TokenGrant[] {
  if (env.KVGATE_AUTH === 'disabled') return []
  if (!env.KVGATE_TOKENS) {
    throw new ConfigError(
      'no token table: run `wrangler secret put KVGATE_TOKENS` (or set KVGATE_AUTH=disabled locally)',
    )
  }
  return parseTokenTable(env.KVGATE_TOKENS, 'KVGATE_TOKENS')
}

/** Builds the gateway for one isolate's bindings; throws ConfigError on bad settings. */
export function gatewayFromEnv(env: WorkerEnv): GatewayApp {
  if (!env.KVGATE_BUCKET) throw new ConfigError('missing the KVGATE_BUCKET R2 binding (see wrangler.toml)')
  checkVars(env)
  const tokens = tokensOf(env)
  const store = new R2Store(env.KVGATE_BUCKET, {
    multipartThreshold: intVar(env, 'KVGATE_MULTIPART_THRESHOLD', 64 * 1024 * 1024),
    partBytes: intVar(env, 'KVGATE_PART_BYTES', 8 * 1024 * 1024),
  })
  const coldTier = parseColdTier(env.KVGATE_COLD_TIER, 'KVGATE_COLD_TIER')
  return createGateway({
    store,
    coldTier: coldTier.tracking ? { usage: coldTier.usage } : { tracking: false },
    auth: tokens.length > 0 ? { tokens, publicStatus: publicStatusVar(env) === 'true' } : undefined,
    limits: {
      maxChunkBytes: intVar(env, 'KVGATE_MAX_CHUNK_BYTES', 90 * 1024 * 1024),
      maxCalibrationBytes: intVar(env, 'KVGATE_MAX_CALIBRATION_BYTES', 16 * 1024 * 1024),
      // The Node default (64 MiB) is half an isolate: keep a few calibrations, stream the rest.
      calibrationCacheBytes: intVar(env, 'KVGATE_CALIBRATION_CACHE_BYTES', 8 * 1024 * 1024, 0),
      maxHeldBytes: intVar(env, 'KVGATE_MAX_HELD_BYTES', WORKER_MAX_HELD_BYTES),
      readerIdleTimeoutMs: intVar(env, 'KVGATE_READER_IDLE_TIMEOUT_MS', 30_000),
      readerMinBytesPerSecond: intVar(
        env,
        'KVGATE_READER_MIN_BYTES_PER_SECOND',
        DEFAULT_READER_MIN_BYTES_PER_SECOND,
        0,
      ),
    },
    prefix: env.KVGATE_PREFIX ?? 'kv',
    // A 128 MB isolate: shared GET buffers stay a quarter of it (and within maxHeldBytes).
    coalesce: { maxBufferedBytes: intVar(env, 'KVGATE_COALESCE_MAX_BUFFERED_BYTES', 32 * 1024 * 1024) },
    // ~190 bytes an entry (measured): 20,000 (~4 MiB, some 40 chains of 512 chunks) fit the
    // isolate's runtime share; Node's 100,000 would take ~20 MiB of it.
    lookup: {
      presenceTtlMs: intVar(env, 'KVGATE_PRESENCE_TTL_MS', 30_000),
      cacheEntries: WORKER_PRESENCE_ENTRIES,
    },
    // R2 list price; no egress fees.
    storagePricePerGBMonth: R2_PRICE_PER_GB_MONTH,
  })
}

// Bindings are fixed for an isolate's lifetime (a new deploy or secret starts new
// isolates), so the app, its lookup cache and metrics live as long as the isolate.
let cached: GatewayApp | undefined

function appFor(env: WorkerEnv): GatewayApp {
  cached ??= gatewayFromEnv(env)
  return cached
}

/**
 * Gives the app a request whose body it may cancel without the client noticing: the
 * gateway answers some PUTs early ("exists", 401/403/413) without reading the body,
 * and a connection closed on unread bytes resets the client's upload (ECONNRESET)
 * before it can read the answer. After the app is done, the rest is read and dropped.
 */
function withDrainableBody(request: Request): { request: Request; drain(): Promise<void> } {
  const source = request.body
  if (!source) return { request, drain: async () => {} }
  const reader = source.getReader()
  let finished = false
  let reading: Promise<unknown> = Promise.resolve()
  const body = new ReadableStream<Uint8Array>(
    {
      async pull(c) {
        const read = reader.read()
        reading = read.catch(() => {})
        const { done, value } = await read
        if (done) {
          finished = true
          c.close()
        } else c.enqueue(value)
      },
      // Leave the source open: drain() consumes what the app did not.
      cancel() {},
    },
    { highWaterMark: 0 },
  )
  const init: RequestInit & { duplex: 'half' } = { body, duplex: 'half' }
  return {
    request: new Request(request, init),
    async drain() {
      await reading
      try {
        while (!finished) finished = (await reader.read()).done
      } catch {
        // The client went away: nothing left to protect.
      }
    },
  }
}

export default {
  async fetch(request: Request, env: WorkerEnv, ctx: unknown): Promise<Response> {
    let app: GatewayApp
    try {
      app = appFor(env)
    } catch (e) {
      console.error('kvgate: gateway misconfigured', e)
      const code = isKvgateError(e) ? e.code : 'ERR_CONFIG'
      const message = isKvgateError(e) ? e.message : 'gateway failed to start'
      return Response.json({ error: { code, message } }, { status: 500 })
    }
    const { request: req, drain } = withDrainableBody(request)
    const res = await app.fetch(req, env as unknown as Record<string, unknown>, ctx as never)
    await drain()
    return res
  },

  /** Cron Trigger: one gc pass (the promise keeps the invocation alive until it is done). */
  async scheduled(_event: unknown, env: WorkerEnv): Promise<void> {
    await scheduledGc(env)
  },
}
