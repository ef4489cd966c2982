// KVCache options: eager validation with clear messages and defaults that work
// on one machine with no gateway, plus a KVGATE_* environment / YAML file layer for the CLI.

import * as v from 'valibot'
import { byteSize, nearestKey, parseByteSize, parseConfig } from '../core/config-check.ts'
import { readConfigFile } from '../core/config-file.ts'
import { CodecError, ConfigError, InvalidArgumentError } from '../core/errors.ts'
import { DEFAULT_MAX_CHUNK_BYTES, FORMAT_VERSION_CALIBRATED, headerBytesFor } from '../core/format.ts'
import { isNamespaceName, type KeyScheme, SCHEME_CODES } from '../core/keys.ts'
import {
  chunkBytes,
  isFp8,
  MAX_CHUNK_TOKENS,
  type ModelPreset,
  type PresetName,
  resolveGeometry,
} from '../core/layout.ts'
import type { ChunkCodecName } from './chunk-codec.ts'
import type { RemoteTierOptions } from './tiers/remote.ts'

/** A byte count, or a string with a unit: '512MiB', '10GB' (k/M/G/T and KiB.. binary, kB/MB/GB/TB decimal). */
export type ByteSize = number | string

export interface MemoryOptions {
  /** Bytes of the pinned L1 region. @default 1 GiB (at least one chunk) */
  bytes?: ByteSize
}

export interface DiskOptions {
  /** Directory of chunk files (created if missing). */
  dir: string
  /** Byte budget; LRU files are deleted beyond it. @default 10 GiB */
  bytes?: ByteSize
  /** 'raw' (fastest reads) or 'lossless' (smaller, exact). @default 'raw' */
  storeAs?: 'raw' | 'lossless'
  /** Parallel file operations (2 lets one chunk's CRC overlap the next one's read). @default 2 */
  concurrency?: number
  /** 'auto': O_DIRECT reads into L1 slots through the addon (measured faster here); 'off': page cache. @default 'auto' */
  direct?: 'auto' | 'off'
}

/** L4 options: the remote tier's own (documented there) plus how chunks are encoded. */
export interface RemoteOptions extends Omit<RemoteTierOptions, 'namespace'> {
  /** Encoding of chunks sent to L4 ('kvgate' is lossy). @default 'kvgate' (falls back to 'raw' without the codec module) */
  codec?: ChunkCodecName
  /** kvgate codec quality, 1 (smallest) .. 9 (closest to the original). @default 5 (the codec's default) */
  quality?: number
  /**
   * The namespace calibration object lossy ('kvgate') chunks are coded with (docs/calibration.md);
   * false: never built nor used for encoding (chunks naming one still decode). @default {}
   */
  calibration?: CalibrationOptions | false
}

export interface CalibrationOptions {
  /** Full chunks this node stores in a namespace without a calibration before it builds and publishes one; 0: never build (adopt only). @default 4 */
  after?: number
  /** How long the namespace's current calibration (or its absence) is trusted before the gateway is asked again, ms. @default 30000 */
  currentTtlMs?: number
  /** Calibration objects kept in memory. @default 8 */
  cacheEntries?: number
}

export interface KVCacheOptions {
  /** A preset name (see MODEL_PRESETS) or a custom geometry with a modelId. */
  model: PresetName | ModelPreset
  /** Tokens per chunk. @default 256 */
  chunkTokens?: number
  /** Tenant namespace on the gateway (`/v1/ns/{ns}`). @default 'default' */
  namespace?: string
  /**
   * Key scheme: kvgate's `sha256-v1`, or `vllm-sha256-cbor` to reproduce vLLM's
   * block hashes (set hashSeed to vLLM's PYTHONHASHSEED). @default 'sha256-v1'
   */
  keyScheme?: KeyScheme
  /** Extra seed mixed into every key (isolates deployments that must not share); vLLM's PYTHONHASHSEED with keyScheme 'vllm-sha256-cbor'. @default none */
  hashSeed?: string
  memory?: MemoryOptions
  /** L2; off unless given. */
  disk?: DiskOptions | false
  /** L4; off unless given. */
  remote?: RemoteOptions | false
  /** Chunks fetched in parallel by one retrieve. @default 8 */
  fetchConcurrency?: number
  /** Layers per range request in retrieveLayers. @default ceil(layers / 4) */
  layersPerRequest?: number
  /** Try the native addon for pinned memory and GPU copies. @default true */
  native?: boolean
  /** Worker threads for lossless/kvgate encode and decode (0: on the calling thread). @default cores − 1, at most 16 */
  codecWorkers?: number
  /**
   * Bytes of private copies held at once for background L2/L4 writes (chunks L1 could
   * not take; chunks in L1 are pinned instead, which costs no memory beyond L1); beyond
   * it writes are shed and counted in stats().writeBehind.shedWrites. @default 512 MiB
   */
  writeBehindBytes?: number
  /**
   * Default deadline of one retrieve(), ms: past it the chunks not yet served are a miss.
   * Set it near the prefill time of a typical prompt (recomputing beats waiting longer). @default 10000
   */
  retrieveDeadlineMs?: number
}

export interface ResolvedOptions {
  model: ModelPreset
  chunkTokens: number
  namespace: string
  keyScheme: KeyScheme
  hashSeed: string | undefined
  memory: { bytes: number }
  disk: (Required<Omit<DiskOptions, 'bytes'>> & { bytes: number }) | false
  remote:
    | (Required<Omit<RemoteOptions, 'token' | 'quality' | 'calibration'>> & {
        token: string | undefined
        quality: number | undefined
        calibration: Required<CalibrationOptions> | false
      })
    | false
  fetchConcurrency: number
  layersPerRequest: number | undefined
  native: boolean
  codecWorkers: number | undefined
  writeBehindBytes: number
  retrieveDeadlineMs: number
}

const GiB = 1024 ** 3
const TOP_KEYS = new Set([
  'model',
  'chunkTokens',
  'namespace',
  'keyScheme',
  'hashSeed',
  'memory',
  'disk',
  'remote',
  'fetchConcurrency',
  'layersPerRequest',
  'native',
  'codecWorkers',
  'writeBehindBytes',
  'retrieveDeadlineMs',
])
const DISK_KEYS = new Set(['dir', 'bytes', 'storeAs', 'concurrency', 'direct'])
const CALIBRATION_KEYS = new Set(['after', 'currentTtlMs', 'cacheEntries'])
const REMOTE_KEYS = new Set([
  'calibration',
  'url',
  'token',
  'codec',
  'quality',
  'connections',
  'timeoutMs',
  'lookupTimeoutMs',
  'retries',
  'breakerThreshold',
  'breakerCooldownMs',
  'maxQueuedWrites',
  'maxQueuedBytes',
  'writeConcurrency',
  'presenceTtlMs',
  'uploadMinBytes',
])

function int(name: string, v: unknown, min: number, max: number, dflt?: number): number {
  if (v === undefined && dflt !== undefined) return dflt
  if (typeof v !== 'number' || !Number.isSafeInteger(v) || v < min || v > max) {
    throw new InvalidArgumentError(
      `invalid ${name}: expected an integer in ${min}..${max}, got ${typeof v === 'string' ? JSON.stringify(v) : String(v)}`,
    )
  }
  return v
}

function calibrationOptions(c: unknown): Required<CalibrationOptions> | false {
  if (c === false) return false
  if (c !== undefined && (typeof c !== 'object' || c === null || Array.isArray(c)))
    throw new InvalidArgumentError('invalid remote.calibration: an object or false')
  const o = (c ?? {}) as CalibrationOptions
  unknownKeys('remote.calibration.', o, CALIBRATION_KEYS)
  return {
    after: int('remote.calibration.after', o.after, 0, 1_000, 4),
    currentTtlMs: int('remote.calibration.currentTtlMs', o.currentTtlMs, 0, 3_600_000, 30_000),
    cacheEntries: int('remote.calibration.cacheEntries', o.cacheEntries, 1, 1_000, 8),
  }
}

function unknownKeys(where: string, o: object, allowed: Set<string>): void {
  for (const k of Object.keys(o)) {
    if (!allowed.has(k)) {
      const near = nearestKey(k, [...allowed])
      throw new InvalidArgumentError(
        `unknown option ${where}${k}${near ? ` (did you mean ${where}${near}?)` : ''}; valid: ${[...allowed].join(', ')}`,
      )
    }
  }
}

/** A byte count: an integer, or a string with a unit ('512MiB', '10GB'). */
function bytesOpt(name: string, v: unknown, min: number, dflt: number): number {
  if (v === undefined) return dflt
  return int(name, typeof v === 'string' ? parseBytes(name, v) : v, min, Number.MAX_SAFE_INTEGER)
}

function checkDirect(v: unknown): 'auto' | 'off' {
  if (v === undefined || v === 'auto' || v === 'off') return v ?? 'auto'
  throw new InvalidArgumentError(`invalid disk.direct: '${String(v)}' (auto or off)`)
}

/** Validates options and fills defaults. Throws InvalidArgumentError naming the bad option. */
export function resolveOptions(opts: KVCacheOptions): ResolvedOptions {
  if (typeof opts !== 'object' || opts === null)
    throw new InvalidArgumentError('KVCache options must be an object')
  unknownKeys('', opts, TOP_KEYS)
  if (opts.model === undefined)
    throw new InvalidArgumentError('missing option model (a preset name or a geometry)')
  const model = resolveGeometry(opts.model)
  const chunkTokens = int('chunkTokens', opts.chunkTokens, 1, MAX_CHUNK_TOKENS, 256)
  const namespace = opts.namespace ?? 'default'
  if (!isNamespaceName(namespace)) {
    throw new InvalidArgumentError(
      `invalid namespace '${String(namespace)}': lowercase [a-z0-9._-], 1..63 chars`,
    )
  }
  if (opts.hashSeed !== undefined && (typeof opts.hashSeed !== 'string' || opts.hashSeed.length > 256)) {
    throw new InvalidArgumentError('invalid hashSeed: a string of at most 256 characters')
  }
  const keyScheme = opts.keyScheme ?? 'sha256-v1'
  if (!Object.hasOwn(SCHEME_CODES, keyScheme)) {
    throw new InvalidArgumentError(`invalid keyScheme '${String(keyScheme)}': sha256-v1 or vllm-sha256-cbor`)
  }
  if (keyScheme === 'vllm-sha256-cbor' && opts.hashSeed === undefined) {
    throw new InvalidArgumentError(
      "keyScheme 'vllm-sha256-cbor' needs hashSeed: the PYTHONHASHSEED your vLLM runs with ('vllm-none-hash' where it is unset on vLLM with PR 51875; unset on older vLLM, its hashes are random per process)",
    )
  }
  const oneChunk = chunkBytes(model, chunkTokens)
  // Every reader (L2's index, the codec, the gateway by default) refuses chunk objects over this:
  // a chunk that cannot fit one would be written, then read back as corrupt and dropped.
  if (oneChunk + headerBytesFor(model.layers, FORMAT_VERSION_CALIBRATED) > DEFAULT_MAX_CHUNK_BYTES) {
    const fit = Math.floor(
      (DEFAULT_MAX_CHUNK_BYTES - headerBytesFor(model.layers, FORMAT_VERSION_CALIBRATED)) /
        chunkBytes(model, 1),
    )
    throw new InvalidArgumentError(
      `invalid chunkTokens: a chunk of ${chunkTokens} tokens of ${model.modelId} is ${oneChunk} bytes, over the ${DEFAULT_MAX_CHUNK_BYTES / 2 ** 20} MiB a chunk object may be: use chunkTokens ≤ ${fit}`,
    )
  }
  const memOpts = opts.memory ?? {}
  if (typeof memOpts !== 'object' || memOpts === null)
    throw new InvalidArgumentError('invalid memory: an object')
  unknownKeys('memory.', memOpts, new Set(['bytes']))
  const memBytes = bytesOpt('memory.bytes', memOpts.bytes, 1, Math.max(GiB, oneChunk))
  if (memBytes < oneChunk) {
    throw new InvalidArgumentError(
      `invalid memory.bytes: ${memBytes} is smaller than one chunk (${oneChunk} bytes for ${chunkTokens} tokens of ${model.modelId})`,
    )
  }

  let disk: ResolvedOptions['disk'] = false
  if (opts.disk !== undefined && opts.disk !== false) {
    const d = opts.disk
    if (typeof d !== 'object' || d === null)
      throw new InvalidArgumentError('invalid disk: an object or false')
    unknownKeys('disk.', d, DISK_KEYS)
    if (typeof d.dir !== 'string' || d.dir.length === 0)
      throw new InvalidArgumentError('invalid disk.dir: a directory path')
    const storeAs = d.storeAs ?? 'raw'
    if (storeAs !== 'raw' && storeAs !== 'lossless') {
      throw new InvalidArgumentError(`invalid disk.storeAs: '${String(storeAs)}' (raw or lossless)`)
    }
    disk = {
      dir: d.dir,
      bytes: bytesOpt('disk.bytes', d.bytes, 1, 10 * GiB),
      storeAs,
      concurrency: int('disk.concurrency', d.concurrency, 1, 256, 2),
      direct: checkDirect(d.direct),
    }
  }

  let remote: ResolvedOptions['remote'] = false
  if (opts.remote !== undefined && opts.remote !== false) {
    const r = opts.remote
    if (typeof r !== 'object' || r === null)
      throw new InvalidArgumentError('invalid remote: an object or false')
    unknownKeys('remote.', r, REMOTE_KEYS)
    let url: URL
    try {
      url = new URL(String(r.url))
    } catch {
      throw new InvalidArgumentError(`invalid remote.url: ${String(r.url)}`)
    }
    if (url.protocol !== 'http:' && url.protocol !== 'https:') {
      throw new InvalidArgumentError(`invalid remote.url: ${String(r.url)} (http: or https:)`)
    }
    // fp8 KV is stored byte for byte: its default is the lossless codec, and kvgate (lossy) is refused.
    const codec = r.codec ?? (isFp8(model.dtype) ? 'lossless' : 'kvgate')
    if (codec !== 'raw' && codec !== 'lossless' && codec !== 'kvgate') {
      throw new InvalidArgumentError(`invalid remote.codec: '${String(codec)}' (kvgate, lossless or raw)`)
    }
    if (codec === 'kvgate' && isFp8(model.dtype)) {
      throw new CodecError(
        `remote.codec kvgate is lossy and does not take ${model.dtype} KV: use lossless (the default for fp8) or raw`,
        { code: 'ERR_CODEC_DTYPE' },
      )
    }
    if (r.token !== undefined && (typeof r.token !== 'string' || /[\r\n]/.test(r.token))) {
      throw new InvalidArgumentError('invalid remote.token: a single-line string')
    }
    remote = {
      url: String(r.url),
      token: r.token,
      codec,
      quality: r.quality === undefined ? undefined : int('remote.quality', r.quality, 1, 9),
      connections: int('remote.connections', r.connections, 1, 1024, 8),
      timeoutMs: int('remote.timeoutMs', r.timeoutMs, 1, 600_000, 10_000),
      lookupTimeoutMs: int('remote.lookupTimeoutMs', r.lookupTimeoutMs, 1, 600_000, 250),
      retries: int('remote.retries', r.retries, 0, 10, 2),
      breakerThreshold: int('remote.breakerThreshold', r.breakerThreshold, 1, 1000, 5),
      breakerCooldownMs: int('remote.breakerCooldownMs', r.breakerCooldownMs, 1, 3_600_000, 1000),
      maxQueuedWrites: int('remote.maxQueuedWrites', r.maxQueuedWrites, 0, 1_000_000, 4096),
      maxQueuedBytes: bytesOpt('remote.maxQueuedBytes', r.maxQueuedBytes, 0, 512 * 1024 ** 2),
      writeConcurrency: int('remote.writeConcurrency', r.writeConcurrency, 1, 256, 8),
      presenceTtlMs: int('remote.presenceTtlMs', r.presenceTtlMs, 0, 3_600_000, 30_000),
      uploadMinBytes: bytesOpt('remote.uploadMinBytes', r.uploadMinBytes, 0, 1024 ** 2),
      calibration: calibrationOptions(r.calibration),
    }
  }

  if (opts.native !== undefined && typeof opts.native !== 'boolean')
    throw new InvalidArgumentError('invalid native: boolean')
  return {
    model,
    chunkTokens,
    namespace,
    keyScheme,
    hashSeed: opts.hashSeed,
    memory: { bytes: memBytes },
    disk,
    remote,
    fetchConcurrency: int('fetchConcurrency', opts.fetchConcurrency, 1, 1024, 8),
    layersPerRequest:
      opts.layersPerRequest === undefined
        ? undefined
        : int('layersPerRequest', opts.layersPerRequest, 1, model.layers),
    native: opts.native ?? true,
    codecWorkers: opts.codecWorkers === undefined ? undefined : int('codecWorkers', opts.codecWorkers, 0, 64),
    writeBehindBytes: bytesOpt('writeBehindBytes', opts.writeBehindBytes, 0, 512 * 1024 ** 2),
    retrieveDeadlineMs: int('retrieveDeadlineMs', opts.retrieveDeadlineMs, 1, 3_600_000, 10_000),
  }
}

/** Parses '512MiB', '10 GB', '4096' into bytes. */
export function parseBytes(name: string, v: unknown): number {
  if (typeof v === 'number') return int(name, v, 0, Number.MAX_SAFE_INTEGER)
  const n = parseByteSize(v)
  if (n === undefined)
    throw new ConfigError(`invalid ${name}: '${String(v)}' is not a byte size (e.g. 512MiB, 10GB)`)
  return n
}

/** The client's config file variable (the gateway's is KVGATE_CONFIG: the two files differ). */
export const CLIENT_CONFIG_ENV = 'KVGATE_CLIENT_CONFIG'

const anyOpt = v.optional(v.unknown())
/** The client YAML file's keys (values are checked by resolveOptions); unknown keys are errors. */
const CLIENT_FILE_SCHEMA = v.strictObject({
  ...Object.fromEntries([...TOP_KEYS].map((k) => [k, anyOpt])),
  memory: v.optional(v.strictObject({ bytes: v.optional(byteSize(1)) })),
  // lazy, not union: the object's own issue (an unknown key) is reported, not "expected false or an object".
  disk: v.optional(
    v.lazy((x) =>
      x === false
        ? v.literal(false)
        : v.strictObject({
            ...Object.fromEntries([...DISK_KEYS].map((k) => [k, anyOpt])),
            bytes: v.optional(byteSize(1)),
          }),
    ),
  ),
  remote: v.optional(
    v.lazy((x) =>
      x === false
        ? v.literal(false)
        : v.strictObject({
            ...Object.fromEntries([...REMOTE_KEYS].map((k) => [k, anyOpt])),
            maxQueuedBytes: v.optional(byteSize(0)),
          }),
    ),
  ),
})

function num(name: string, v: string): number {
  const n = Number(v)
  if (!/^\s*\d+\s*$/.test(v) || !Number.isSafeInteger(n))
    throw new ConfigError(`invalid ${name}: '${v}' is not an integer`)
  return n
}

type Plain = Record<string, unknown>

/** A tier switch variable: false for off/false, true for on/true (or empty); anything else names the variable. */
/**
 * Options for processes started from the CLI: the YAML file named by
 * KVGATE_CLIENT_CONFIG (or `file`), then KVGATE_* variables on top (env overrides file).
 * Unknown keys in the file are errors naming the path and the nearest valid key.
 * The result still goes through resolveOptions() in KVCache.open().
 */
export function optionsFromEnvironment(
  env: NodeJS.ProcessEnv = process.env,
  file?: string,
  /** Top-level file sections a daemon reads itself (e.g. the agent's `agent:`): passed through unchecked. */
  extraSections: readonly string[] = [],
): Partial<KVCacheOptions> {
  const out: Plain = {}
  const path = file ?? env[CLIENT_CONFIG_ENV]
  if (path) {
    const doc = readConfigFile(path)
    if (doc !== undefined) {
      const d = { ...doc }
      const extra: Plain = {}
      for (const k of extraSections) {
        if (k in d) extra[k] = d[k]
        delete d[k]
      }
      // The daemon's sections are valid keys too: a typo of one ('agnet:') is told the nearest.
      const schema =
        extraSections.length === 0
          ? CLIENT_FILE_SCHEMA
          : v.strictObject({
              ...CLIENT_FILE_SCHEMA.entries,
              ...Object.fromEntries(extraSections.map((k) => [k, anyOpt])),
            })
      Object.assign(out, parseConfig(schema, d, path), extra)
    }
  }
  const sub = (k: 'memory' | 'disk' | 'remote'): Plain => {
    const cur = out[k]
    if (typeof cur === 'object' && cur !== null) return cur as Plain
    const fresh: Plain = {}
    out[k] = fresh
    return fresh
  }
  // Variables with a fixed set of values are checked here, naming the variable: a daemon (the
  // agent) reads them at start-up and must not accept what fails every registration later.
  const oneOf = (name: string, allowed: readonly string[], shown: string): string | undefined => {
    const value = env[name]
    if (value === undefined || value === '') return undefined
    if (!allowed.includes(value)) throw new InvalidArgumentError(`invalid ${name}: '${value}' (${shown})`)
    return value
  }
  const onOff = (name: string): boolean | undefined => {
    const value = oneOf(name, ['on', 'off', 'true', 'false'], 'on or off')
    return value === undefined ? undefined : value === 'on' || value === 'true'
  }
  if (env.KVGATE_MODEL) out.model = env.KVGATE_MODEL
  if (env.KVGATE_CHUNK_TOKENS) out.chunkTokens = num('KVGATE_CHUNK_TOKENS', env.KVGATE_CHUNK_TOKENS)
  if (env.KVGATE_NAMESPACE) out.namespace = env.KVGATE_NAMESPACE
  if (env.KVGATE_HASH_SEED) out.hashSeed = env.KVGATE_HASH_SEED
  if (env.KVGATE_WRITE_BEHIND_BYTES)
    out.writeBehindBytes = parseBytes('KVGATE_WRITE_BEHIND_BYTES', env.KVGATE_WRITE_BEHIND_BYTES)
  if (env.KVGATE_RETRIEVE_DEADLINE_MS)
    out.retrieveDeadlineMs = num('KVGATE_RETRIEVE_DEADLINE_MS', env.KVGATE_RETRIEVE_DEADLINE_MS)
  const keyScheme = oneOf(
    'KVGATE_KEY_SCHEME',
    ['sha256-v1', 'vllm-sha256-cbor'],
    'sha256-v1 or vllm-sha256-cbor',
  )
  if (keyScheme) out.keyScheme = keyScheme
  if (env.KVGATE_MEMORY_BYTES)
    sub('memory').bytes = parseBytes('KVGATE_MEMORY_BYTES', env.KVGATE_MEMORY_BYTES)
  if (onOff('KVGATE_DISK') === false) out.disk = false
  else {
    if (env.KVGATE_DISK_DIR) sub('disk').dir = env.KVGATE_DISK_DIR
    if (env.KVGATE_DISK_BYTES) sub('disk').bytes = parseBytes('KVGATE_DISK_BYTES', env.KVGATE_DISK_BYTES)
    const storeAs = oneOf('KVGATE_DISK_STORE_AS', ['raw', 'lossless'], 'raw or lossless')
    if (storeAs) sub('disk').storeAs = storeAs
  }
  if (onOff('KVGATE_REMOTE') === false) out.remote = false
  else {
    if (env.KVGATE_REMOTE_URL) sub('remote').url = env.KVGATE_REMOTE_URL
    if (env.KVGATE_REMOTE_TOKEN) sub('remote').token = env.KVGATE_REMOTE_TOKEN
    const codec = oneOf('KVGATE_REMOTE_CODEC', ['kvgate', 'lossless', 'raw'], 'kvgate, lossless or raw')
    if (codec) sub('remote').codec = codec
    if (env.KVGATE_REMOTE_QUALITY)
      sub('remote').quality = num('KVGATE_REMOTE_QUALITY', env.KVGATE_REMOTE_QUALITY)
    if (env.KVGATE_REMOTE_TIMEOUT_MS)
      sub('remote').timeoutMs = num('KVGATE_REMOTE_TIMEOUT_MS', env.KVGATE_REMOTE_TIMEOUT_MS)
    if (env.KVGATE_REMOTE_LOOKUP_TIMEOUT_MS) {
      sub('remote').lookupTimeoutMs = num(
        'KVGATE_REMOTE_LOOKUP_TIMEOUT_MS',
        env.KVGATE_REMOTE_LOOKUP_TIMEOUT_MS,
      )
    }
    if (env.KVGATE_REMOTE_PRESENCE_TTL_MS) {
      sub('remote').presenceTtlMs = num('KVGATE_REMOTE_PRESENCE_TTL_MS', env.KVGATE_REMOTE_PRESENCE_TTL_MS)
    }
    // KVGATE_REMOTE_CALIBRATION=off turns calibrated encoding off; _AFTER sets the build policy.
    if (onOff('KVGATE_REMOTE_CALIBRATION') === false) sub('remote').calibration = false
    else if (env.KVGATE_REMOTE_CALIBRATION_AFTER) {
      const r = sub('remote')
      const fromFile = typeof r.calibration === 'object' && r.calibration !== null ? r.calibration : {}
      r.calibration = {
        ...fromFile,
        after: num('KVGATE_REMOTE_CALIBRATION_AFTER', env.KVGATE_REMOTE_CALIBRATION_AFTER),
      }
    }
    if (env.KVGATE_REMOTE_UPLOAD_MIN_BYTES) {
      sub('remote').uploadMinBytes = parseBytes(
        'KVGATE_REMOTE_UPLOAD_MIN_BYTES',
        env.KVGATE_REMOTE_UPLOAD_MIN_BYTES,
      )
    }
  }
  // Sizes in the YAML file may be written like the env values ("512MiB").
  for (const k of ['memory', 'disk'] as const) {
    const o = out[k]
    if (typeof o === 'object' && o !== null && typeof (o as Plain).bytes === 'string') {
      ;(o as Plain).bytes = parseBytes(`${k}.bytes`, (o as Plain).bytes)
    }
  }
  if (typeof out.writeBehindBytes === 'string')
    out.writeBehindBytes = parseBytes('writeBehindBytes', out.writeBehindBytes)
  const r = out.remote
  if (typeof r === 'object' && r !== null && typeof (r as Plain).maxQueuedBytes === 'string') {
    ;(r as Plain).maxQueuedBytes = parseBytes('remote.maxQueuedBytes', (r as Plain).maxQueuedBytes)
  }
  return out as Partial<KVCacheOptions>
}
