// Configuration of a served gateway (Node): a YAML file, then KVGATE_* env vars,
// then command-line flags, each overriding the one before; validated eagerly.
// Defaults give a working local gateway: fs store in ./.kvgate/store on 127.0.0.1:8787.

import { readFileSync } from 'node:fs'
import { parse as parseYaml } from 'yaml'
import { type ColdTierConfig, parseColdTier } from '../coldtier/policy.ts'
import { ConfigError } from '../core/errors.ts'
import type { TokenGrant } from './middleware/auth.ts'

export type LogLevel = 'info' | 'warn' | 'error' | 'silent'

export interface ServeConfig {
  host: string
  port: number
  prefix: string
  store:
    | { kind: 'fs'; dir: string; fsync: boolean }
    | { kind: 'memory' }
    | {
        kind: 's3'
        bucket: string
        endpoint?: string
        region: string
        forcePathStyle?: boolean
        accessKeyId?: string
        secretAccessKey?: string
      }
  presign?: { minBytes: number; expiresSeconds: number }
  maxChunkBytes?: number
  coalesceMaxBytes: number
  /** Bytes the GET coalescer may buffer at once (above it GETs stream on their own). */
  coalesceMaxBufferedBytes: number
  /** How long a cached presence (inferred or seen) is trusted. */
  presenceTtlMs: number
  /** A PUT body silent this long fails with 408. */
  bodyIdleTimeoutMs: number
  /** A PUT body slower than this (bytes/s while the gateway waits on it) fails with 408; 0 = off. */
  bodyMinBytesPerSecond: number
  /** A GET reader that takes nothing this long is cut off (store stream released). */
  readerIdleTimeoutMs: number
  /** Declared PUT body bytes in flight at once (503 ERR_BUSY above). */
  maxInFlightBytes: number
  /** Open connections at most. */
  maxConnections: number
  /** Stored-object verifications at once. */
  maxConcurrentVerifies: number
  tokens: TokenGrant[]
  publicStatus: boolean
  insecure: boolean
  log: LogLevel
  /** Retention, quotas, grace and use tracking (docs/cold-tier.md); `kvgate gc` reads the same section. */
  coldTier: ColdTierConfig
}

/** Flat settings, the common shape of the three sources. */
export interface ServeSettings {
  host?: string
  port?: string | number
  prefix?: string
  store?: string
  dir?: string
  fsync?: string | boolean
  s3Bucket?: string
  s3Endpoint?: string
  s3Region?: string
  s3PathStyle?: string | boolean
  s3AccessKeyId?: string
  s3SecretAccessKey?: string
  presignMinBytes?: string | number
  presignExpiresSeconds?: string | number
  maxChunkBytes?: string | number
  coalesceMaxBytes?: string | number
  coalesceMaxBufferedBytes?: string | number
  presenceTtlMs?: string | number
  bodyIdleTimeoutMs?: string | number
  bodyMinBytesPerSecond?: string | number
  readerIdleTimeoutMs?: string | number
  maxInFlightBytes?: string | number
  maxConnections?: string | number
  maxConcurrentVerifies?: string | number
  tokens?: TokenGrant[] | string
  publicStatus?: string | boolean
  insecure?: string | boolean
  log?: string
  /** The `coldTier` mapping (file) or its JSON (KVGATE_COLD_TIER). */
  coldTier?: unknown
}

const ENV: Record<string, keyof ServeSettings> = {
  KVGATE_HOST: 'host',
  KVGATE_PORT: 'port',
  KVGATE_PREFIX: 'prefix',
  KVGATE_STORE: 'store',
  KVGATE_STORE_DIR: 'dir',
  KVGATE_FSYNC: 'fsync',
  KVGATE_S3_BUCKET: 's3Bucket',
  KVGATE_S3_ENDPOINT: 's3Endpoint',
  KVGATE_S3_REGION: 's3Region',
  KVGATE_S3_FORCE_PATH_STYLE: 's3PathStyle',
  KVGATE_S3_ACCESS_KEY_ID: 's3AccessKeyId',
  KVGATE_S3_SECRET_ACCESS_KEY: 's3SecretAccessKey',
  KVGATE_PRESIGN_MIN_BYTES: 'presignMinBytes',
  KVGATE_PRESIGN_EXPIRES_SECONDS: 'presignExpiresSeconds',
  KVGATE_MAX_CHUNK_BYTES: 'maxChunkBytes',
  KVGATE_COALESCE_MAX_BYTES: 'coalesceMaxBytes',
  KVGATE_COALESCE_MAX_BUFFERED_BYTES: 'coalesceMaxBufferedBytes',
  KVGATE_PRESENCE_TTL_MS: 'presenceTtlMs',
  KVGATE_BODY_IDLE_TIMEOUT_MS: 'bodyIdleTimeoutMs',
  KVGATE_BODY_MIN_BYTES_PER_SECOND: 'bodyMinBytesPerSecond',
  KVGATE_READER_IDLE_TIMEOUT_MS: 'readerIdleTimeoutMs',
  KVGATE_MAX_IN_FLIGHT_BYTES: 'maxInFlightBytes',
  KVGATE_MAX_CONNECTIONS: 'maxConnections',
  KVGATE_MAX_CONCURRENT_VERIFIES: 'maxConcurrentVerifies',
  KVGATE_TOKENS: 'tokens',
  KVGATE_PUBLIC_STATUS: 'publicStatus',
  KVGATE_INSECURE: 'insecure',
  KVGATE_LOG: 'log',
  KVGATE_COLD_TIER: 'coldTier',
}

export const ENV_VARS = Object.keys(ENV)

export function settingsFromEnv(env: NodeJS.ProcessEnv): ServeSettings {
  const out: Record<string, string> = {}
  for (const [name, key] of Object.entries(ENV)) {
    const v = env[name]
    if (v !== undefined && v !== '') out[key] = v
  }
  return out as ServeSettings
}

/** Reads a YAML config file (nested form, see docs in `kvgate serve --help`) into flat settings. */
export function settingsFromFile(file: string): ServeSettings {
  let doc: unknown
  try {
    doc = parseYaml(readFileSync(file, 'utf8'))
  } catch (e) {
    throw new ConfigError(`cannot read config file ${file}: ${(e as Error).message}`, { cause: e })
  }
  if (doc === null || doc === undefined) return {}
  if (typeof doc !== 'object' || Array.isArray(doc))
    throw new ConfigError(`${file}: expected a mapping at the top level`)
  const d = doc as Record<string, unknown>
  const store = (d.store ?? {}) as Record<string, unknown>
  const s3 = (store.s3 ?? {}) as Record<string, unknown>
  const presign = (d.presign ?? {}) as Record<string, unknown>
  const auth = (d.auth ?? {}) as Record<string, unknown>
  const pick = (o: Record<string, unknown>, k: string) => (o[k] === undefined ? undefined : (o[k] as string))
  const out: ServeSettings = {
    host: pick(d, 'host'),
    port: pick(d, 'port'),
    prefix: pick(d, 'prefix'),
    store: typeof d.store === 'string' ? d.store : pick(store, 'kind'),
    dir: pick(store, 'dir'),
    fsync: pick(store, 'fsync'),
    s3Bucket: pick(s3, 'bucket'),
    s3Endpoint: pick(s3, 'endpoint'),
    s3Region: pick(s3, 'region'),
    s3PathStyle: pick(s3, 'forcePathStyle'),
    s3AccessKeyId: pick(s3, 'accessKeyId'),
    s3SecretAccessKey: pick(s3, 'secretAccessKey'),
    presignMinBytes: pick(presign, 'minBytes'),
    presignExpiresSeconds: pick(presign, 'expiresSeconds'),
    maxChunkBytes: pick(d, 'maxChunkBytes'),
    coalesceMaxBytes: pick(d, 'coalesceMaxBytes'),
    coalesceMaxBufferedBytes: pick(d, 'coalesceMaxBufferedBytes'),
    presenceTtlMs: pick(d, 'presenceTtlMs'),
    bodyIdleTimeoutMs: pick(d, 'bodyIdleTimeoutMs'),
    bodyMinBytesPerSecond: pick(d, 'bodyMinBytesPerSecond'),
    readerIdleTimeoutMs: pick(d, 'readerIdleTimeoutMs'),
    maxInFlightBytes: pick(d, 'maxInFlightBytes'),
    maxConnections: pick(d, 'maxConnections'),
    maxConcurrentVerifies: pick(d, 'maxConcurrentVerifies'),
    tokens: auth.tokens as TokenGrant[] | undefined,
    publicStatus: pick(auth, 'publicStatus'),
    log: pick(d, 'log'),
    coldTier: d.coldTier,
  }
  for (const k of Object.keys(out) as (keyof ServeSettings)[]) if (out[k] === undefined) delete out[k]
  return out
}

function int(name: string, v: string | number | undefined, min: number, max: number): number | undefined {
  if (v === undefined) return undefined
  const n = typeof v === 'number' ? v : /^\d+$/.test(String(v).trim()) ? Number(v) : Number.NaN
  if (!Number.isInteger(n) || n < min || n > max)
    throw new ConfigError(`${name} must be an integer in ${min}..${max}, got ${JSON.stringify(v)}`)
  return n
}

function bool(name: string, v: string | boolean | undefined): boolean | undefined {
  if (v === undefined || typeof v === 'boolean') return v
  const s = v.trim().toLowerCase()
  if (['1', 'true', 'yes', 'on'].includes(s)) return true
  if (['0', 'false', 'no', 'off'].includes(s)) return false
  throw new ConfigError(`${name} must be true or false, got ${JSON.stringify(v)}`)
}

/** Objects at least this large are served by presigned redirect from an s3 store, unless turned off. */
export const DEFAULT_PRESIGN_MIN_BYTES = 8 * 1024 * 1024

const LOOPBACK = /^(127\.\d+\.\d+\.\d+|::1|localhost)$/

/** Merges settings (later wins) into a validated config. */
export function resolveServeConfig(...layers: ServeSettings[]): ServeConfig {
  const s: ServeSettings = Object.assign({}, ...layers)
  let tokens: TokenGrant[] = []
  if (typeof s.tokens === 'string') {
    try {
      tokens = JSON.parse(s.tokens) as TokenGrant[]
    } catch {
      throw new ConfigError('KVGATE_TOKENS must be a JSON array of {sha256, scopes, namespaces}')
    }
  } else if (s.tokens) tokens = s.tokens
  if (!Array.isArray(tokens)) throw new ConfigError('tokens must be a list')
  for (const [i, t] of tokens.entries()) {
    if (typeof t?.sha256 !== 'string' || !/^[0-9a-f]{64}$/i.test(t.sha256)) {
      throw new ConfigError(
        `tokens[${i}].sha256 must be the 64-hex SHA-256 of the token (kvgate serve --hash-token)`,
      )
    }
  }
  const kind = s.store ?? 'fs'
  let store: ServeConfig['store']
  if (kind === 'fs') store = { kind, dir: s.dir ?? './.kvgate/store', fsync: bool('fsync', s.fsync) ?? true }
  else if (kind === 'memory') store = { kind }
  else if (kind === 's3') {
    if (!s.s3Bucket) throw new ConfigError('the s3 store needs a bucket (--s3-bucket / KVGATE_S3_BUCKET)')
    store = {
      kind,
      bucket: s.s3Bucket,
      region: s.s3Region ?? 'us-east-1',
      ...(s.s3Endpoint ? { endpoint: s.s3Endpoint } : {}),
      ...(s.s3PathStyle !== undefined ? { forcePathStyle: bool('s3 forcePathStyle', s.s3PathStyle)! } : {}),
      ...(s.s3AccessKeyId ? { accessKeyId: s.s3AccessKeyId } : {}),
      ...(s.s3SecretAccessKey ? { secretAccessKey: s.s3SecretAccessKey } : {}),
    }
  } else throw new ConfigError(`unknown store ${JSON.stringify(kind)}: use fs, s3 or memory`)
  const log = (s.log ?? 'info') as LogLevel
  if (!['info', 'warn', 'error', 'silent'].includes(log))
    throw new ConfigError(`log must be info, warn, error or silent`)
  // Large GETs from S3 answer 307 to a presigned URL by default: the bytes then
  // bypass the gateway (measured here, a proxy hop costs ~1.7 CPU-s/GiB and capped
  // GETs at 0.6–0.8× direct S3). 'off' keeps every byte flowing through the gateway
  // (clients that cannot reach the bucket's endpoint).
  const presignOff = s.presignMinBytes === 'off'
  const presignMin = presignOff
    ? undefined
    : (int('presign minBytes', s.presignMinBytes, 0, Number.MAX_SAFE_INTEGER) ??
      (kind === 's3' ? DEFAULT_PRESIGN_MIN_BYTES : undefined))
  const host = s.host ?? '127.0.0.1'
  const insecure = bool('insecure', s.insecure) ?? false
  if (tokens.length === 0 && !LOOPBACK.test(host) && !insecure) {
    throw new ConfigError(
      `refusing to serve without auth on ${host}: configure tokens, bind to 127.0.0.1, or pass --insecure`,
    )
  }
  const maxChunkBytes = int('maxChunkBytes', s.maxChunkBytes, 1024, 4 * 1024 ** 3)
  return {
    host,
    port: int('port', s.port, 0, 65535) ?? 8787,
    prefix: s.prefix ?? 'kvgate',
    store,
    ...(presignMin !== undefined
      ? {
          presign: {
            minBytes: presignMin,
            expiresSeconds: int('presign expiresSeconds', s.presignExpiresSeconds, 1, 604800) ?? 60,
          },
        }
      : {}),
    ...(maxChunkBytes !== undefined ? { maxChunkBytes } : {}),
    coalesceMaxBytes: int('coalesceMaxBytes', s.coalesceMaxBytes, 0, 1024 ** 3) ?? 8 * 1024 * 1024,
    coalesceMaxBufferedBytes:
      int('coalesceMaxBufferedBytes', s.coalesceMaxBufferedBytes, 0, 16 * 1024 ** 3) ?? 64 * 1024 * 1024,
    presenceTtlMs: int('presenceTtlMs', s.presenceTtlMs, 1, 3_600_000) ?? 30_000,
    bodyIdleTimeoutMs: int('bodyIdleTimeoutMs', s.bodyIdleTimeoutMs, 1, 3_600_000) ?? 30_000,
    bodyMinBytesPerSecond: int('bodyMinBytesPerSecond', s.bodyMinBytesPerSecond, 0, 1024 ** 3) ?? 8192,
    readerIdleTimeoutMs: int('readerIdleTimeoutMs', s.readerIdleTimeoutMs, 1, 3_600_000) ?? 30_000,
    maxInFlightBytes: int('maxInFlightBytes', s.maxInFlightBytes, 1, 1024 ** 4) ?? 1024 ** 3,
    maxConnections: int('maxConnections', s.maxConnections, 1, 1_000_000) ?? 1024,
    maxConcurrentVerifies: int('maxConcurrentVerifies', s.maxConcurrentVerifies, 1, 1024) ?? 4,
    tokens,
    publicStatus: bool('publicStatus', s.publicStatus) ?? false,
    insecure,
    log,
    coldTier: parseColdTier(s.coldTier, 'coldTier'),
  }
}
