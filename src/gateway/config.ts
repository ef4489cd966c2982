// Configuration of a served gateway (Node): a YAML file (KVGATE_CONFIG), then KVGATE_* env vars,
// then command-line flags, each overriding the one before; each checked by a valibot schema.
// Defaults give a working local gateway: fs store in ./.kvgate/store on 127.0.0.1:8787.

import { readFileSync } from 'node:fs'
import * as v from 'valibot'
import { parse as parseYaml } from 'yaml'
import { boolLike, byteSize, intLike, parseConfig } from '../core/config-check.ts'
import { ConfigError } from '../core/errors.ts'
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
  maxChunkBytes?: number
  coalesceMaxBytes: number
  tokens: TokenGrant[]
  publicStatus: boolean
  insecure: boolean
  log: LogLevel
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
  tokens?: TokenGrant[] | string
  publicStatus?: string | boolean
  insecure?: string | boolean
  log?: string
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
  KVGATE_TOKENS: 'tokens',
  KVGATE_PUBLIC_STATUS: 'publicStatus',
  KVGATE_INSECURE: 'insecure',
  KVGATE_LOG: 'log',
}

export const ENV_VARS = Object.keys(ENV)

/** The gateway's config file variable (the client reads KVGATE_CLIENT_CONFIG: the two schemas differ). */
export const CONFIG_ENV = 'KVGATE_CONFIG'

// One schema per setting; every source (file, env, flag) is checked against it, and an
// error names the source: the file path and key, the variable, or the flag.
const nonEmpty = v.pipe(v.string('expected a string'), v.minLength(1, 'must not be empty'))
const SETTING: { [K in keyof ServeSettings]-?: v.GenericSchema } = {
  host: nonEmpty,
  port: intLike(0, 65535),
  prefix: nonEmpty,
  store: v.picklist(['fs', 's3', 'memory'], 'expected fs, s3 or memory'),
  dir: nonEmpty,
  fsync: boolLike,
  s3Bucket: nonEmpty,
  s3Endpoint: v.pipe(v.string(), v.url('expected a URL such as http://127.0.0.1:7480')),
  s3Region: nonEmpty,
  s3PathStyle: boolLike,
  s3AccessKeyId: nonEmpty,
  s3SecretAccessKey: nonEmpty,
  presignMinBytes: v.union([v.literal('off'), byteSize()], "expected a byte size (8MiB) or 'off'"),
  presignExpiresSeconds: intLike(1, 604800),
  maxChunkBytes: byteSize(1024, 4 * 1024 ** 3),
  coalesceMaxBytes: byteSize(0, 1024 ** 3),
  tokens: TokenTableSchema,
  publicStatus: boolLike,
  insecure: boolLike,
  log: v.picklist(['info', 'warn', 'error', 'silent'], 'expected info, warn, error or silent'),
}

/** Flag names of the settings (for error messages). */
export const FLAG_OF: { [K in keyof ServeSettings]-?: string } = {
  host: '--host',
  port: '--port',
  prefix: '--prefix',
  store: '--store',
  dir: '--dir',
  fsync: 'store.fsync',
  s3Bucket: '--s3-bucket',
  s3Endpoint: '--s3-endpoint',
  s3Region: '--s3-region',
  s3PathStyle: '--s3-path-style',
  s3AccessKeyId: 'KVGATE_S3_ACCESS_KEY_ID',
  s3SecretAccessKey: 'KVGATE_S3_SECRET_ACCESS_KEY',
  presignMinBytes: '--presign-min-bytes',
  presignExpiresSeconds: 'presign.expiresSeconds',
  maxChunkBytes: '--max-chunk-bytes',
  coalesceMaxBytes: 'coalesceMaxBytes',
  tokens: 'auth.tokens',
  publicStatus: '--status-public',
  insecure: '--insecure',
  log: '--log',
}

function checkSettings(
  raw: Record<string, unknown>,
  nameOf: (k: keyof ServeSettings) => string,
): ServeSettings {
  const out: Record<string, unknown> = {}
  for (const [k, value] of Object.entries(raw)) {
    if (value === undefined) continue
    const key = k as keyof ServeSettings
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
    out[key] = parseConfig(SETTING[key], input, nameOf(key))
  }
  return out as ServeSettings
}

/** Reads KVGATE_* variables; a bad value is an error naming the variable. */
export function settingsFromEnv(env: NodeJS.ProcessEnv): ServeSettings {
  const raw: Record<string, unknown> = {}
  const varOf: Record<string, string> = {}
  for (const [name, key] of Object.entries(ENV)) {
    const value = env[name]
    if (value !== undefined && value !== '') {
      raw[key] = value
      varOf[key] = name
    }
  }
  return checkSettings(raw, (k) => varOf[k] ?? k)
}

/** Checks command-line values; a bad value is an error naming the flag. */
export function settingsFromFlags(flags: Record<string, unknown>): ServeSettings {
  return checkSettings(flags, (k) => FLAG_OF[k])
}

const opt = v.optional
const S3_FILE = v.strictObject({
  bucket: opt(v.string()),
  endpoint: opt(v.string()),
  region: opt(v.string()),
  forcePathStyle: opt(v.unknown()),
  accessKeyId: opt(v.string()),
  secretAccessKey: opt(v.string()),
})
/** The YAML file's shape: unknown keys anywhere are errors (a typo must not turn auth or the store off). */
export const GATEWAY_FILE_SCHEMA = v.strictObject({
  host: opt(v.unknown()),
  port: opt(v.unknown()),
  prefix: opt(v.unknown()),
  store: opt(
    v.lazy((x) =>
      typeof x === 'string'
        ? v.string()
        : v.strictObject({
            kind: opt(v.unknown()),
            dir: opt(v.unknown()),
            fsync: opt(v.unknown()),
            s3: opt(S3_FILE),
          }),
    ),
  ),
  presign: opt(v.strictObject({ minBytes: opt(v.unknown()), expiresSeconds: opt(v.unknown()) })),
  maxChunkBytes: opt(v.unknown()),
  coalesceMaxBytes: opt(v.unknown()),
  auth: opt(v.strictObject({ tokens: opt(v.unknown()), publicStatus: opt(v.unknown()) })),
  insecure: opt(v.unknown()),
  log: opt(v.unknown()),
})

/** Reads a YAML config file (nested form, see docs in `kvgate serve --help`) into flat settings. */
export function settingsFromFile(file: string): ServeSettings {
  let doc: unknown
  try {
    doc = parseYaml(readFileSync(file, 'utf8'))
  } catch (e) {
    throw new ConfigError(`cannot read config file ${file}: ${(e as Error).message}`, { cause: e })
  }
  if (doc === null || doc === undefined) return {}
  const d = parseConfig(GATEWAY_FILE_SCHEMA, doc, file)
  const store = typeof d.store === 'object' ? d.store : {}
  const s3 = store.s3 ?? {}
  const raw = {
    host: d.host,
    port: d.port,
    prefix: d.prefix,
    store: typeof d.store === 'string' ? d.store : store.kind,
    dir: store.dir,
    fsync: store.fsync,
    s3Bucket: s3.bucket,
    s3Endpoint: s3.endpoint,
    s3Region: s3.region,
    s3PathStyle: s3.forcePathStyle,
    s3AccessKeyId: s3.accessKeyId,
    s3SecretAccessKey: s3.secretAccessKey,
    presignMinBytes: d.presign?.minBytes,
    presignExpiresSeconds: d.presign?.expiresSeconds,
    maxChunkBytes: d.maxChunkBytes,
    coalesceMaxBytes: d.coalesceMaxBytes,
    tokens: d.auth?.tokens,
    publicStatus: d.auth?.publicStatus,
    insecure: d.insecure,
    log: d.log,
  }
  const path: { [K in keyof ServeSettings]-?: string } = {
    host: 'host',
    port: 'port',
    prefix: 'prefix',
    store: typeof d.store === 'string' ? 'store' : 'store.kind',
    dir: 'store.dir',
    fsync: 'store.fsync',
    s3Bucket: 'store.s3.bucket',
    s3Endpoint: 'store.s3.endpoint',
    s3Region: 'store.s3.region',
    s3PathStyle: 'store.s3.forcePathStyle',
    s3AccessKeyId: 'store.s3.accessKeyId',
    s3SecretAccessKey: 'store.s3.secretAccessKey',
    presignMinBytes: 'presign.minBytes',
    presignExpiresSeconds: 'presign.expiresSeconds',
    maxChunkBytes: 'maxChunkBytes',
    coalesceMaxBytes: 'coalesceMaxBytes',
    tokens: 'auth.tokens',
    publicStatus: 'auth.publicStatus',
    insecure: 'insecure',
    log: 'log',
  }
  return checkSettings(raw, (k) => `${file}: ${path[k]}`)
}

/** Objects at least this large are served by presigned redirect from an s3 store, unless turned off. */
export const DEFAULT_PRESIGN_MIN_BYTES = 8 * 1024 * 1024

const LOOPBACK = /^(127\.\d+\.\d+\.\d+|::1|localhost)$/

/**
 * Merges settings (later wins) into a config. Each layer is expected to come from
 * settingsFromFile / settingsFromEnv / settingsFromFlags (already checked); plain objects are checked here.
 */
export function resolveServeConfig(...layers: ServeSettings[]): ServeConfig {
  const s = checkSettings(Object.assign({}, ...layers), (k) => FLAG_OF[k]) as CheckedSettings
  const tokens = s.tokens ?? []
  const kind = s.store ?? 'fs'
  let store: ServeConfig['store']
  if (kind === 'fs') store = { kind, dir: s.dir ?? './.kvgate/store', fsync: s.fsync ?? true }
  else if (kind === 'memory') store = { kind }
  else {
    if (!s.s3Bucket)
      throw new ConfigError('the s3 store needs a bucket (--s3-bucket / KVGATE_S3_BUCKET / store.s3.bucket)')
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
    ...(s.maxChunkBytes !== undefined ? { maxChunkBytes: s.maxChunkBytes } : {}),
    coalesceMaxBytes: s.coalesceMaxBytes ?? 8 * 1024 * 1024,
    tokens,
    publicStatus,
    insecure,
    log: s.log ?? 'info',
  }
}

/** Settings after checking: the types each schema produces. */
interface CheckedSettings {
  host?: string
  port?: number
  prefix?: string
  store?: 'fs' | 's3' | 'memory'
  dir?: string
  fsync?: boolean
  s3Bucket?: string
  s3Endpoint?: string
  s3Region?: string
  s3PathStyle?: boolean
  s3AccessKeyId?: string
  s3SecretAccessKey?: string
  presignMinBytes?: number | 'off'
  presignExpiresSeconds?: number
  maxChunkBytes?: number
  coalesceMaxBytes?: number
  tokens?: TokenGrant[]
  publicStatus?: boolean
  insecure?: boolean
  log?: LogLevel
}
