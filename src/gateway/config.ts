// Configuration of a served gateway (Node): a YAML file (KVGATE_CONFIG), then KVGATE_* env vars,
// then command-line flags, each overriding the one before; each checked by a valibot schema.
// Defaults give a working local gateway: fs store in ./.kvgate/store on 127.0.0.1:8787.

import * as v from 'valibot'
import { type ColdTierConfig, parseColdTier } from '../coldtier/policy.ts'
import { boolLike, byteSize, intLike, parseConfig } from '../core/config-check.ts'
import { readConfigFile } from '../core/config-file.ts'
import { ConfigError } from '../core/errors.ts'
import { isObjectPrefix } from '../core/keys.ts'
import { DEFAULT_CALIBRATION_CACHE_BYTES, DEFAULT_READER_MIN_BYTES_PER_SECOND } from './context.ts'
import { DEFAULT_MAX_HELD_BYTES } from './memory-budget.ts'
import type { TokenGrant } from './middleware/auth.ts'
import { TokenTableSchema } from './token-table.ts'

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
  /** Presigned staging uploads (s3 store; off unless a threshold is set: Node takes PUT bodies itself). */
  uploads?: { minBytes: number; maxBytes: number; expiresSeconds?: number; stagingPrefix?: string }
  maxChunkBytes?: number
  /** Largest calibration object accepted (docs/calibration.md). */
  maxCalibrationBytes: number
  /** Verified calibration bodies kept in memory (larger ones stream from the store; 0: none). */
  calibrationCacheBytes: number
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
  /** A GET reader slower than this (bytes/s while the gateway waits on it) is cut off; 0 = off. */
  readerMinBytesPerSecond: number
  /** Declared PUT body bytes in flight at once (503 ERR_BUSY above). */
  maxInFlightBytes: number
  /** Bytes the gateway holds for requests at once: read-ahead, parts, bodies (503 ERR_BUSY above). */
  maxHeldBytes: number
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

// A value pasted with a trailing space or newline (a secret file's last line) would become a bind
// address, bucket or key that fails later with an unrelated error (ENOTFOUND, SignatureDoesNotMatch).
const nonEmpty = v.pipe(
  v.string('expected a string'),
  v.minLength(1, 'must not be empty'),
  v.check((x: string) => x.trim() === x, 'must not begin or end with whitespace'),
)

/**
 * Every setting once: its schema (checks and converts values from any source), its KVGATE_*
 * variable, its flag, and its path in the YAML file. Adding an option is adding a line here
 * (plus its use in resolveServeConfig); the env list, the file schema and the messages follow.
 */
const OPTIONS = {
  host: { schema: nonEmpty, env: 'KVGATE_HOST', flag: '--host', file: 'host' },
  port: { schema: intLike(0, 65535), env: 'KVGATE_PORT', flag: '--port', file: 'port' },
  prefix: {
    schema: v.pipe(
      nonEmpty,
      v.check(
        (p: string) => isObjectPrefix(p),
        '/-separated segments of A-Z a-z 0-9 . _ -, none of them . or ..',
      ),
    ),
    env: 'KVGATE_PREFIX',
    flag: '--prefix',
    file: 'prefix',
  },
  store: {
    schema: v.picklist(['fs', 's3', 'memory'], 'expected fs, s3 or memory'),
    env: 'KVGATE_STORE',
    flag: '--store',
    file: 'store.kind',
  },
  dir: { schema: nonEmpty, env: 'KVGATE_STORE_DIR', flag: '--dir', file: 'store.dir' },
  fsync: { schema: boolLike, env: 'KVGATE_FSYNC', flag: 'store.fsync', file: 'store.fsync' },
  s3Bucket: { schema: nonEmpty, env: 'KVGATE_S3_BUCKET', flag: '--s3-bucket', file: 'store.s3.bucket' },
  s3Endpoint: {
    schema: v.pipe(v.string(), v.url('expected a URL such as http://127.0.0.1:7480')),
    env: 'KVGATE_S3_ENDPOINT',
    flag: '--s3-endpoint',
    file: 'store.s3.endpoint',
  },
  s3Region: { schema: nonEmpty, env: 'KVGATE_S3_REGION', flag: '--s3-region', file: 'store.s3.region' },
  s3PathStyle: {
    schema: boolLike,
    env: 'KVGATE_S3_FORCE_PATH_STYLE',
    flag: '--s3-path-style',
    file: 'store.s3.forcePathStyle',
  },
  s3AccessKeyId: {
    schema: nonEmpty,
    env: 'KVGATE_S3_ACCESS_KEY_ID',
    flag: 'KVGATE_S3_ACCESS_KEY_ID',
    file: 'store.s3.accessKeyId',
  },
  s3SecretAccessKey: {
    schema: nonEmpty,
    env: 'KVGATE_S3_SECRET_ACCESS_KEY',
    flag: 'KVGATE_S3_SECRET_ACCESS_KEY',
    file: 'store.s3.secretAccessKey',
  },
  presignMinBytes: {
    schema: v.union([v.literal('off'), byteSize()], "expected a byte size (8MiB) or 'off'"),
    env: 'KVGATE_PRESIGN_MIN_BYTES',
    flag: '--presign-min-bytes',
    file: 'presign.minBytes',
  },
  presignExpiresSeconds: {
    schema: intLike(1, 604800),
    env: 'KVGATE_PRESIGN_EXPIRES_SECONDS',
    flag: 'presign.expiresSeconds',
    file: 'presign.expiresSeconds',
  },
  uploadMinBytes: {
    schema: v.union([v.literal('off'), byteSize()], "expected a byte size (8MiB) or 'off'"),
    env: 'KVGATE_UPLOAD_MIN_BYTES',
    flag: '--upload-min-bytes',
    file: 'uploads.minBytes',
  },
  uploadExpiresSeconds: {
    schema: intLike(1, 604800),
    env: 'KVGATE_UPLOAD_TTL',
    flag: 'uploads.expiresSeconds',
    file: 'uploads.expiresSeconds',
  },
  stagingPrefix: {
    schema: nonEmpty,
    env: 'KVGATE_STAGING_PREFIX',
    flag: 'uploads.stagingPrefix',
    file: 'uploads.stagingPrefix',
  },
  maxChunkBytes: {
    schema: byteSize(1024, 4 * 1024 ** 3),
    env: 'KVGATE_MAX_CHUNK_BYTES',
    flag: '--max-chunk-bytes',
    file: 'maxChunkBytes',
  },
  maxCalibrationBytes: {
    schema: byteSize(8, 1024 ** 3),
    env: 'KVGATE_MAX_CALIBRATION_BYTES',
    flag: 'maxCalibrationBytes',
    file: 'maxCalibrationBytes',
  },
  calibrationCacheBytes: {
    schema: byteSize(0, 16 * 1024 ** 3),
    env: 'KVGATE_CALIBRATION_CACHE_BYTES',
    flag: 'calibrationCacheBytes',
    file: 'calibrationCacheBytes',
  },
  coalesceMaxBytes: {
    schema: byteSize(0, 1024 ** 3),
    env: 'KVGATE_COALESCE_MAX_BYTES',
    flag: 'coalesceMaxBytes',
    file: 'coalesceMaxBytes',
  },
  coalesceMaxBufferedBytes: {
    schema: byteSize(0, 16 * 1024 ** 3),
    env: 'KVGATE_COALESCE_MAX_BUFFERED_BYTES',
    flag: 'coalesceMaxBufferedBytes',
    file: 'coalesceMaxBufferedBytes',
  },
  presenceTtlMs: {
    schema: intLike(1, 3_600_000),
    env: 'KVGATE_PRESENCE_TTL_MS',
    flag: '--presence-ttl-ms',
    file: 'presenceTtlMs',
  },
  bodyIdleTimeoutMs: {
    schema: intLike(1, 3_600_000),
    env: 'KVGATE_BODY_IDLE_TIMEOUT_MS',
    flag: '--body-idle-timeout-ms',
    file: 'bodyIdleTimeoutMs',
  },
  bodyMinBytesPerSecond: {
    schema: byteSize(0, 1024 ** 3),
    env: 'KVGATE_BODY_MIN_BYTES_PER_SECOND',
    flag: 'bodyMinBytesPerSecond',
    file: 'bodyMinBytesPerSecond',
  },
  readerIdleTimeoutMs: {
    schema: intLike(1, 3_600_000),
    env: 'KVGATE_READER_IDLE_TIMEOUT_MS',
    flag: '--reader-idle-timeout-ms',
    file: 'readerIdleTimeoutMs',
  },
  readerMinBytesPerSecond: {
    schema: byteSize(0, 1024 ** 3),
    env: 'KVGATE_READER_MIN_BYTES_PER_SECOND',
    flag: '--reader-min-bytes-per-second',
    file: 'readerMinBytesPerSecond',
  },
  maxInFlightBytes: {
    schema: byteSize(1, 1024 ** 4),
    env: 'KVGATE_MAX_IN_FLIGHT_BYTES',
    flag: '--max-in-flight-bytes',
    file: 'maxInFlightBytes',
  },
  maxHeldBytes: {
    schema: byteSize(1, 1024 ** 4),
    env: 'KVGATE_MAX_HELD_BYTES',
    flag: '--max-held-bytes',
    file: 'maxHeldBytes',
  },
  maxConnections: {
    schema: intLike(1, 1_000_000),
    env: 'KVGATE_MAX_CONNECTIONS',
    flag: '--max-connections',
    file: 'maxConnections',
  },
  maxConcurrentVerifies: {
    schema: intLike(1, 1024),
    env: 'KVGATE_MAX_CONCURRENT_VERIFIES',
    flag: 'maxConcurrentVerifies',
    file: 'maxConcurrentVerifies',
  },
  // Checked by parseColdTier (unknown keys are errors there too); the variable holds it as JSON.
  coldTier: { schema: v.unknown(), env: 'KVGATE_COLD_TIER', flag: 'coldTier', file: 'coldTier' },
  tokens: { schema: TokenTableSchema, env: 'KVGATE_TOKENS', flag: 'auth.tokens', file: 'auth.tokens' },
  publicStatus: {
    schema: boolLike,
    env: 'KVGATE_PUBLIC_STATUS',
    flag: '--status-public',
    file: 'auth.publicStatus',
  },
  insecure: { schema: boolLike, env: 'KVGATE_INSECURE', flag: '--insecure', file: 'insecure' },
  log: {
    schema: v.picklist(['info', 'warn', 'error', 'silent'], 'expected info, warn, error or silent'),
    env: 'KVGATE_LOG',
    flag: '--log',
    file: 'log',
  },
} as const satisfies Record<string, { schema: v.GenericSchema; env: string; flag: string; file: string }>

type OptionName = keyof typeof OPTIONS

/** Settings after checking: the type each schema produces. */
export type ServeSettings = { [K in OptionName]?: v.InferOutput<(typeof OPTIONS)[K]['schema']> }

/** Unchecked settings, as an embedder or a test may pass them to resolveServeConfig. */
export type ServeSettingsInput = { [K in OptionName]?: unknown }

const NAMES = Object.keys(OPTIONS) as OptionName[]

export const ENV_VARS = NAMES.map((k) => OPTIONS[k].env)

/** The gateway's config file variable (the client reads KVGATE_CLIENT_CONFIG: the two schemas differ). */
export const CONFIG_ENV = 'KVGATE_CONFIG'

function checkSettings(raw: Record<string, unknown>, nameOf: (k: OptionName) => string): ServeSettings {
  const out: Record<string, unknown> = {}
  for (const [k, value] of Object.entries(raw)) {
    if (value === undefined) continue
    if (!Object.hasOwn(OPTIONS, k)) throw new ConfigError(`unknown setting ${k}`)
    const key = k as OptionName
    let input = value
    if (key === 'tokens' && typeof value === 'string') {
      try {
        input = JSON.parse(value)
      } catch {
        throw new ConfigError(
          `${nameOf(key)}: not valid JSON (a JSON array of {name, sha256, scopes, namespaces}; kvgate token prints one)`,
        )
      }
    }
    out[key] = parseConfig(OPTIONS[key].schema, input, nameOf(key))
    // Checked now, so a mistake names its variable or file (resolveServeConfig parses it again).
    if (key === 'coldTier') parseColdTier(input, nameOf(key))
  }
  return out as ServeSettings
}

/** Reads KVGATE_* variables; a bad value is an error naming the variable. */
export function settingsFromEnv(env: NodeJS.ProcessEnv): ServeSettings {
  const raw: Record<string, unknown> = {}
  for (const k of NAMES) {
    const value = env[OPTIONS[k].env]
    if (value !== undefined && value !== '') raw[k] = value
  }
  return checkSettings(raw, (k) => OPTIONS[k].env)
}

/** Checks command-line values (keyed by setting name); a bad value is an error naming the flag. */
export function settingsFromFlags(flags: Record<string, unknown>): ServeSettings {
  return checkSettings(flags, (k) => OPTIONS[k].flag)
}

type Tree = { [key: string]: Tree | null }

/** The YAML file's shape from the options' paths: nested strict objects, so unknown keys anywhere are errors. */
function fileSchema(tree: Tree): v.GenericSchema {
  const entries: Record<string, v.GenericSchema> = {}
  for (const [k, sub] of Object.entries(tree)) {
    let s = sub === null ? v.unknown() : fileSchema(sub)
    // `store: s3` is short for `store: { kind: s3 }`.
    if (k === 'store') {
      const obj = s
      s = v.lazy((x) => (typeof x === 'string' ? v.string() : obj))
    }
    entries[k] = v.optional(s)
  }
  return v.strictObject(entries)
}

const FILE_TREE: Tree = {}
for (const k of NAMES) {
  const parts = OPTIONS[k].file.split('.')
  let t = FILE_TREE
  for (const p of parts.slice(0, -1)) {
    t[p] ??= {}
    t = t[p] as Tree
  }
  t[parts.at(-1)!] = null
}

/** The YAML file's schema: unknown keys anywhere are errors (a typo must not turn auth or the store off). */
export const GATEWAY_FILE_SCHEMA = fileSchema(FILE_TREE)

/** Reads a YAML config file (nested form, see docs in `kvgate serve --help`) into flat settings. */
export function settingsFromFile(file: string): ServeSettings {
  const doc = readConfigFile(file)
  if (doc === undefined) return {}
  const d = parseConfig(GATEWAY_FILE_SCHEMA, doc, file) as Record<string, unknown>
  if (typeof d.store === 'string') d.store = { kind: d.store }
  const raw: Record<string, unknown> = {}
  for (const k of NAMES) {
    let node: unknown = d
    for (const p of OPTIONS[k].file.split('.')) node = (node as Record<string, unknown> | undefined)?.[p]
    if (node !== undefined) raw[k] = node
  }
  return checkSettings(raw, (k) => `${file}: ${OPTIONS[k].file}`)
}

/** Objects at least this large are served by presigned redirect from an s3 store, unless turned off. */
export const DEFAULT_PRESIGN_MIN_BYTES = 8 * 1024 * 1024

const LOOPBACK = /^(127\.\d+\.\d+\.\d+|::1|localhost)$/

/** Merges settings (later wins: file, env, flags) into a checked config. */
export function resolveServeConfig(...layers: ServeSettingsInput[]): ServeConfig {
  // Checked again: layers may be plain objects (tests, embedders); checking is idempotent.
  const s = checkSettings(Object.assign({}, ...layers), (k) => OPTIONS[k].flag)
  const tokens = s.tokens ?? []
  const kind = s.store ?? 'fs'
  let store: ServeConfig['store']
  if (kind === 'fs') store = { kind, dir: s.dir ?? './.kvgate/store', fsync: s.fsync ?? true }
  else if (kind === 'memory') store = { kind }
  else {
    if (!s.s3Bucket)
      throw new ConfigError('the s3 store needs a bucket (--s3-bucket / KVGATE_S3_BUCKET / store.s3.bucket)')
    // Half a pair would be dropped, and the SDK's default chain would sign for whatever account it finds.
    if ((s.s3AccessKeyId === undefined) !== (s.s3SecretAccessKey === undefined))
      throw new ConfigError(
        'the s3 store takes both KVGATE_S3_ACCESS_KEY_ID and KVGATE_S3_SECRET_ACCESS_KEY (store.s3.accessKeyId and secretAccessKey), or neither (the AWS SDK default chain)',
      )
    store = {
      kind,
      bucket: s.s3Bucket,
      region: s.s3Region ?? 'us-east-1',
      ...(s.s3Endpoint ? { endpoint: s.s3Endpoint } : {}),
      ...(s.s3PathStyle !== undefined ? { forcePathStyle: s.s3PathStyle } : {}),
      ...(s.s3AccessKeyId ? { accessKeyId: s.s3AccessKeyId } : {}),
      ...(s.s3SecretAccessKey ? { secretAccessKey: s.s3SecretAccessKey } : {}),
    }
  }
  // Large GETs from S3 answer 307 to a presigned URL by default: the bytes then
  // bypass the gateway (measured here, a proxy hop costs ~1.7 CPU-s/GiB and capped
  // GETs at 0.6–0.8× direct S3). 'off' keeps every byte flowing through the gateway
  // (clients that cannot reach the bucket's endpoint).
  const presignMin =
    s.presignMinBytes === 'off'
      ? undefined
      : (s.presignMinBytes ?? (kind === 's3' ? DEFAULT_PRESIGN_MIN_BYTES : undefined))
  const host = s.host ?? '127.0.0.1'
  const insecure = s.insecure ?? false
  if (tokens.length === 0 && !LOOPBACK.test(host) && !insecure) {
    throw new ConfigError(
      `refusing to serve without auth on ${host}: configure tokens (kvgate token), bind to 127.0.0.1, or pass --insecure`,
    )
  }
  const publicStatus = s.publicStatus ?? false
  if (publicStatus && tokens.length > 0 && !LOOPBACK.test(host) && !insecure) {
    // The status page and /metrics show namespaces and traffic: public only on loopback unless insisted.
    throw new ConfigError(
      `--status-public on ${host} exposes the status page to the network: bind to 127.0.0.1 or pass --insecure`,
    )
  }
  return {
    host,
    port: s.port ?? 8787,
    prefix: s.prefix ?? 'kvgate',
    store,
    ...(presignMin !== undefined
      ? { presign: { minBytes: presignMin, expiresSeconds: s.presignExpiresSeconds ?? 60 } }
      : {}),
    ...(s.uploadMinBytes !== undefined && s.uploadMinBytes !== 'off'
      ? {
          uploads: {
            minBytes: s.uploadMinBytes,
            maxBytes: s.maxChunkBytes ?? 512 * 1024 * 1024,
            ...(s.uploadExpiresSeconds !== undefined ? { expiresSeconds: s.uploadExpiresSeconds } : {}),
            ...(s.stagingPrefix !== undefined ? { stagingPrefix: s.stagingPrefix } : {}),
          },
        }
      : {}),
    ...(s.maxChunkBytes !== undefined ? { maxChunkBytes: s.maxChunkBytes } : {}),
    maxCalibrationBytes: s.maxCalibrationBytes ?? 16 * 1024 * 1024,
    calibrationCacheBytes: s.calibrationCacheBytes ?? DEFAULT_CALIBRATION_CACHE_BYTES,
    coalesceMaxBytes: s.coalesceMaxBytes ?? 8 * 1024 * 1024,
    coalesceMaxBufferedBytes: s.coalesceMaxBufferedBytes ?? 64 * 1024 * 1024,
    presenceTtlMs: s.presenceTtlMs ?? 30_000,
    bodyIdleTimeoutMs: s.bodyIdleTimeoutMs ?? 30_000,
    bodyMinBytesPerSecond: s.bodyMinBytesPerSecond ?? 8192,
    readerIdleTimeoutMs: s.readerIdleTimeoutMs ?? 30_000,
    readerMinBytesPerSecond: s.readerMinBytesPerSecond ?? DEFAULT_READER_MIN_BYTES_PER_SECOND,
    maxInFlightBytes: s.maxInFlightBytes ?? 1024 ** 3,
    maxHeldBytes: s.maxHeldBytes ?? DEFAULT_MAX_HELD_BYTES,
    maxConnections: s.maxConnections ?? 1024,
    maxConcurrentVerifies: s.maxConcurrentVerifies ?? 4,
    tokens,
    publicStatus,
    insecure,
    log: s.log ?? 'info',
    coldTier: parseColdTier(s.coldTier, 'coldTier'),
  }
}
