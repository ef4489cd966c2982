// Chained prefix keys: chunk i's key hashes chunk i-1's key with chunk i's tokens,
// starting from a namespace seed of (model, geometry, dtype, chunk size, scheme).
// Deterministic on every node, process and runtime; byte encoding in docs/keys.md.

import { InvalidArgumentError, InvalidKeyError, InvalidNamespaceError } from './errors.ts'
import { DTYPE_CODES, type KvGeometry, MAX_CHUNK_TOKENS, validateGeometry } from './layout.ts'

/**
 * `sha256-v1`: kvgate's own scheme (the default).
 * `vllm-sha256-cbor`: vLLM's `sha256_cbor` block hash, so keys line up with vLLM /
 * llm-d prefix-cache events when block size = chunk size.
 */
export type KeyScheme = 'sha256-v1' | 'vllm-sha256-cbor'

export const SCHEME_CODES: Readonly<Record<KeyScheme, number>> = { 'sha256-v1': 1, 'vllm-sha256-cbor': 2 }

export type ExtraKey = string | number

export interface KeyNamespace {
  modelId: string
  geometry: KvGeometry
  chunkTokens: number
  /** @default 'sha256-v1' */
  scheme?: KeyScheme
  /**
   * sha256-v1: optional extra seed material (e.g. a LoRA or tenant salt).
   * vllm-sha256-cbor: the PYTHONHASHSEED string vLLM hashes into NONE_HASH;
   * required, because vLLM's default is 32 random bytes per process.
   */
  hashSeed?: string
  /** vllm-sha256-cbor only: the `extra_keys` element of every block (default null). */
  extraKeys?: readonly ExtraKey[] | null
}

export interface ChunkKey {
  /** Chunk position in the prompt. */
  index: number
  /** Token range [start, end) the chunk covers. */
  start: number
  end: number
  key: Uint8Array
  hex: string
  parentHex: string
  /** True for a trailing chunk shorter than chunkTokens (only with includePartial). */
  partial: boolean
}

export interface ChainOptions {
  /** Also key a trailing chunk of fewer than chunkTokens tokens. @default false */
  includePartial?: boolean
  /**
   * Continue a chain whose first chunks are already keyed: start at chunk `after.index + 1`
   * with `after` as the parent (tokens before it are not read). Caches of recent
   * prompts use it to hash only what is new.
   */
  after?: Pick<ChunkKey, 'index' | 'key' | 'hex'>
}

const te = new TextEncoder()
const SEED_DOMAIN = te.encode('kvgate:ns:v1\0')
const MAX_TOKEN = 0xffffffff

// ---------------------------------------------------------------- hex

const HEX_DIGITS = new TextEncoder().encode('0123456789abcdef')
const ASCII = new TextDecoder()

/**
 * Lowercase hex of `b`, as one flat string. Appending two characters at a time builds a
 * tree of ~30 string pieces (~870 bytes for a 32-byte key instead of ~90) that stays a
 * tree until something flattens it: gc holds two per chunk of a namespace, a gateway one
 * per chunk it has not flushed a use record for. Decoding the ASCII is as fast.
 */
export function toHex(b: Uint8Array): string {
  const out = new Uint8Array(b.length * 2)
  for (let i = 0; i < b.length; i++) {
    const v = b[i]!
    out[2 * i] = HEX_DIGITS[v >> 4]!
    out[2 * i + 1] = HEX_DIGITS[v & 15]!
  }
  return ASCII.decode(out)
}

export function fromHex(s: string): Uint8Array {
  if (typeof s !== 'string' || s.length % 2 !== 0 || !/^[0-9a-fA-F]*$/.test(s)) {
    throw new InvalidArgumentError('expected an even-length hex string')
  }
  const out = new Uint8Array(s.length / 2)
  for (let i = 0; i < out.length; i++) out[i] = Number.parseInt(s.slice(2 * i, 2 * i + 2), 16)
  return out
}

const KEY_HEX = /^[0-9a-f]{64}$/
const NS_NAME = /^[a-z0-9][a-z0-9._-]{0,62}$/

/** Exactly 64 lowercase hex characters: the only shape a key may take in a path. */
export function isKeyHex(s: unknown): s is string {
  return typeof s === 'string' && KEY_HEX.test(s)
}

export function assertKeyHex(s: unknown): string {
  if (!isKeyHex(s)) {
    const shown = typeof s === 'string' ? JSON.stringify(s.slice(0, 80)) : typeof s
    throw new InvalidKeyError(`invalid chunk key ${shown}: expected 64 lowercase hex characters`)
  }
  return s
}

const HEX_RUN = /^[0-9a-f]*$/

type HexDecoder = { from(s: string, encoding: 'hex'): { length: number } }
// Node's Buffer hex decoder stops at the first non-hex character, at native speed; the
// module must load in workerd too, so it is looked up, never imported.
const hexDecoder = (globalThis as { Buffer?: HexDecoder }).Buffer

/** Whether `s` is only lowercase hex digits and of even length. */
function isHexRun(s: string): boolean {
  if (hexDecoder === undefined) return HEX_RUN.test(s)
  return hexDecoder.from(s, 'hex').length * 2 === s.length && s.toLowerCase() === s
}

/**
 * Checks that every element is a chunk key, as assertKeyHex on each (the first bad one
 * is named), in one pass over their concatenation: 4096 separate regex calls took a
 * fifth of a warm lookup's time.
 */
export function assertKeysHex(keys: readonly unknown[]): readonly string[] {
  for (const k of keys) if (typeof k !== 'string' || k.length !== 64) assertKeyHex(k)
  if (!isHexRun((keys as readonly string[]).join(''))) for (const k of keys) assertKeyHex(k)
  return keys as readonly string[]
}

/** Namespace names: 1–63 of [a-z0-9._-], starting alphanumeric, no "..". */
export function isNamespaceName(s: unknown): s is string {
  return typeof s === 'string' && NS_NAME.test(s) && !s.includes('..')
}

export function assertNamespaceName(s: unknown): string {
  if (!isNamespaceName(s)) {
    const shown = typeof s === 'string' ? JSON.stringify(s.slice(0, 80)) : typeof s
    throw new InvalidNamespaceError(
      `invalid namespace ${shown}: use 1-63 characters of a-z 0-9 . _ -, starting with a letter or digit`,
    )
  }
  return s
}

/**
 * An object name prefix: '' or /-separated segments of [A-Za-z0-9._-], none of them . or ..
 * (a name is a path on the fs store). Checked where a prefix is configured, not per request.
 */
export function isObjectPrefix(prefix: unknown): prefix is string {
  return (
    typeof prefix === 'string' &&
    (prefix === '' ||
      (/^[A-Za-z0-9._-]+(\/[A-Za-z0-9._-]+)*$/.test(prefix) &&
        !prefix.split('/').some((p) => p === '.' || p === '..')))
  )
}

/** Object name in the bucket: `<prefix>/<ns>/<first 2 hex>/<key>`; the fan-out spreads S3 partitions. */
export function objectName(prefix: string, ns: string, keyHex: string): string {
  assertNamespaceName(ns)
  assertKeyHex(keyHex)
  if (!isObjectPrefix(prefix)) {
    throw new InvalidArgumentError(
      `invalid object prefix ${JSON.stringify(prefix)}: /-separated segments of A-Z a-z 0-9 . _ -, none . or ..`,
    )
  }
  const tail = `${ns}/${keyHex.slice(0, 2)}/${keyHex}`
  return prefix === '' ? tail : `${prefix}/${tail}`
}

// ---------------------------------------------------------------- hashing backends

type Sha256 = (parts: readonly Uint8Array[]) => Uint8Array

interface NodeHash {
  update(b: Uint8Array): NodeHash
  digest(): Uint8Array
}

function nodeSha256(): Sha256 | undefined {
  // No static node: import: this module must also load in workerd.
  const proc = (globalThis as { process?: { getBuiltinModule?: (id: string) => unknown } }).process
  const crypto = proc?.getBuiltinModule?.('node:crypto') as
    | {
        createHash?: (alg: string) => NodeHash
        hash?: (alg: string, data: Uint8Array, enc: 'buffer') => Uint8Array
      }
    | undefined
  const createHash = crypto?.createHash
  if (typeof createHash !== 'function') return undefined
  const oneShot = crypto?.hash
  return (parts) => {
    // crypto.hash (Node ≥ 20.12) skips the Hash object: ~2× faster for 1 KiB inputs.
    if (parts.length === 1 && typeof oneShot === 'function') {
      const d = oneShot('sha256', parts[0]!, 'buffer')
      return new Uint8Array(d.buffer, d.byteOffset, d.byteLength)
    }
    const h = createHash('sha256')
    for (const p of parts) h.update(p)
    const d = h.digest()
    return new Uint8Array(d.buffer, d.byteOffset, d.byteLength)
  }
}

const syncSha256 = nodeSha256()

function requireSync(): Sha256 {
  if (!syncSha256) {
    throw new InvalidArgumentError(
      'synchronous SHA-256 needs node:crypto; in this runtime use chainKeysAsync()',
    )
  }
  return syncSha256
}

async function subtleSha256(parts: readonly Uint8Array[]): Promise<Uint8Array> {
  let n = 0
  for (const p of parts) n += p.length
  const all = new Uint8Array(n)
  let o = 0
  for (const p of parts) {
    all.set(p, o)
    o += p.length
  }
  return new Uint8Array(await crypto.subtle.digest('SHA-256', all))
}

// ---------------------------------------------------------------- canonical CBOR (RFC 8949 §4.2.1)
// Only the items vLLM's block hash uses: unsigned/negative ints, byte and text
// strings, arrays, null. Canonical = shortest head for every length and integer.

function cborHead(major: number, n: number, out: number[]): void {
  const m = major << 5
  if (n < 24) out.push(m | n)
  else if (n <= 0xff) out.push(m | 24, n)
  else if (n <= 0xffff) out.push(m | 25, n >>> 8, n & 0xff)
  else if (n <= 0xffffffff) out.push(m | 26, n >>> 24, (n >>> 16) & 0xff, (n >>> 8) & 0xff, n & 0xff)
  else {
    const hi = Math.floor(n / 2 ** 32)
    const lo = n >>> 0
    out.push(m | 27, hi >>> 24, (hi >>> 16) & 0xff, (hi >>> 8) & 0xff, hi & 0xff)
    out.push(lo >>> 24, (lo >>> 16) & 0xff, (lo >>> 8) & 0xff, lo & 0xff)
  }
}

export type CborValue = number | string | Uint8Array | null | readonly CborValue[]

export function cborEncode(v: CborValue, out: number[] = []): number[] {
  if (v === null) out.push(0xf6)
  else if (typeof v === 'number') {
    if (!Number.isSafeInteger(v))
      throw new InvalidArgumentError(`CBOR encoder takes safe integers only, got ${v}`)
    if (v >= 0) cborHead(0, v, out)
    else cborHead(1, -1 - v, out)
  } else if (typeof v === 'string') {
    const b = te.encode(v)
    cborHead(3, b.length, out)
    for (const x of b) out.push(x)
  } else if (v instanceof Uint8Array) {
    cborHead(2, v.length, out)
    for (const x of v) out.push(x)
  } else if (Array.isArray(v)) {
    cborHead(4, v.length, out)
    for (const item of v) cborEncode(item, out)
  } else {
    throw new InvalidArgumentError('unsupported CBOR value')
  }
  return out
}

// ---------------------------------------------------------------- namespace

function validateNamespace(ns: KeyNamespace): Required<Pick<KeyNamespace, 'scheme'>> & KeyNamespace {
  if (typeof ns !== 'object' || ns === null) throw new InvalidArgumentError('key namespace must be an object')
  validateGeometry(ns.geometry)
  if (typeof ns.modelId !== 'string' || ns.modelId.length === 0 || te.encode(ns.modelId).length > 0xffff) {
    throw new InvalidArgumentError('modelId must be a non-empty string')
  }
  if (!Number.isInteger(ns.chunkTokens) || ns.chunkTokens < 1 || ns.chunkTokens > MAX_CHUNK_TOKENS) {
    throw new InvalidArgumentError(`chunkTokens must be an integer in 1..${MAX_CHUNK_TOKENS}`)
  }
  const scheme = ns.scheme ?? 'sha256-v1'
  // Own keys only: `in` also finds toString and constructor on every object.
  if (!Object.hasOwn(SCHEME_CODES, scheme))
    throw new InvalidArgumentError(
      `unknown key scheme '${String(scheme)}': ${Object.keys(SCHEME_CODES).join(' or ')}`,
    )
  if (
    ns.hashSeed !== undefined &&
    (typeof ns.hashSeed !== 'string' || te.encode(ns.hashSeed).length > 0xffff)
  ) {
    throw new InvalidArgumentError('hashSeed must be a string')
  }
  if (scheme === 'vllm-sha256-cbor' && ns.hashSeed === undefined) {
    throw new InvalidArgumentError(
      "the vllm-sha256-cbor scheme needs hashSeed: the PYTHONHASHSEED your vLLM runs with ('vllm-none-hash' where it is unset on vLLM with PR 51875; unset on older vLLM means random keys per process, never shared)",
    )
  }
  return { ...ns, scheme }
}

/** The canonical seed preimage (docs/keys.md): domain tag, then fields little-endian. */
function seedPreimage(ns: ReturnType<typeof validateNamespace>): Uint8Array {
  const model = te.encode(ns.modelId)
  const seed = te.encode(ns.hashSeed ?? '')
  const out = new Uint8Array(SEED_DOMAIN.length + 1 + 2 + model.length + 7 + 4 + 2 + seed.length)
  const dv = new DataView(out.buffer)
  let o = 0
  out.set(SEED_DOMAIN, o)
  o += SEED_DOMAIN.length
  out[o++] = SCHEME_CODES[ns.scheme]
  dv.setUint16(o, model.length, true)
  o += 2
  out.set(model, o)
  o += model.length
  dv.setUint16(o, ns.geometry.layers, true)
  dv.setUint16(o + 2, ns.geometry.kvHeads, true)
  dv.setUint16(o + 4, ns.geometry.headDim, true)
  // A latent (MLA) geometry sets the dtype byte's top bit: its chunks hold one plane per
  // layer, never the K/V chunks of a geometry with the same numbers (those seeds are unchanged).
  out[o + 6] = DTYPE_CODES[ns.geometry.dtype] | (ns.geometry.latent === true ? 0x80 : 0)
  o += 7
  dv.setUint32(o, ns.chunkTokens, true)
  o += 4
  dv.setUint16(o, seed.length, true)
  o += 2
  out.set(seed, o)
  return out
}

/** 32-byte seed that identifies the namespace (model, geometry, dtype, chunk size, scheme). */
export function namespaceSeed(ns: KeyNamespace): Uint8Array {
  return requireSync()([seedPreimage(validateNamespace(ns))])
}

/** 32 hex characters: the first 16 bytes of the seed, stored in every chunk header. */
export function namespaceId(ns: KeyNamespace): string {
  return toHex(namespaceSeed(ns).subarray(0, 16))
}

export async function namespaceSeedAsync(ns: KeyNamespace): Promise<Uint8Array> {
  return subtleSha256([seedPreimage(validateNamespace(ns))])
}

// ---------------------------------------------------------------- chains

function checkTokens(tokens: ArrayLike<number>): void {
  if (tokens instanceof Uint32Array) return
  if (typeof tokens !== 'object' || tokens === null || typeof tokens.length !== 'number') {
    throw new InvalidArgumentError('tokens must be an array of integers')
  }
  for (let i = 0; i < tokens.length; i++) {
    const t = tokens[i]!
    if (!Number.isInteger(t) || t < 0 || t > MAX_TOKEN) {
      throw new InvalidArgumentError(`token ${i} is ${String(t)}: tokens are integers in 0..2^32-1`)
    }
  }
}

interface ChunkPlan {
  index: number
  start: number
  end: number
  partial: boolean
}

function plan(count: number, chunkTokens: number, includePartial: boolean, firstIndex = 0): ChunkPlan[] {
  const out: ChunkPlan[] = []
  for (
    let index = firstIndex, start = firstIndex * chunkTokens;
    start < count;
    start += chunkTokens, index++
  ) {
    const end = Math.min(start + chunkTokens, count)
    const partial = end - start < chunkTokens
    if (partial && !includePartial) break
    out.push({ index, start, end, partial })
  }
  return out
}

/** sha256-v1 preimage of one chunk: parent key ‖ u32le(n) ‖ n × u32le(token). */
function v1Preimage(
  parent: Uint8Array,
  tokens: ArrayLike<number>,
  start: number,
  end: number,
  buf: Uint8Array,
): Uint8Array {
  const n = end - start
  const out = buf.length >= 36 + 4 * n ? buf.subarray(0, 36 + 4 * n) : new Uint8Array(36 + 4 * n)
  out.set(parent, 0)
  const words = new Uint32Array(out.buffer, out.byteOffset + 32, n + 1)
  words[0] = n
  if (tokens instanceof Uint32Array) words.set(tokens.subarray(start, end), 1)
  else for (let i = 0; i < n; i++) words[i + 1] = tokens[start + i]!
  return out
}

function vllmPreimage(
  parent: Uint8Array,
  tokens: ArrayLike<number>,
  start: number,
  end: number,
  extra: CborValue,
): Uint8Array {
  const ids: number[] = []
  for (let i = start; i < end; i++) ids.push(tokens[i]!)
  return Uint8Array.from(cborEncode([parent, ids, extra]))
}

function extraOf(ns: KeyNamespace): CborValue {
  if (ns.extraKeys === undefined || ns.extraKeys === null) return null
  if (!Array.isArray(ns.extraKeys)) throw new InvalidArgumentError('extraKeys must be an array or null')
  for (const k of ns.extraKeys) {
    if (typeof k !== 'string' && !Number.isSafeInteger(k))
      throw new InvalidArgumentError('extraKeys holds strings and integers')
  }
  return ns.extraKeys
}

// One fixed object shape (an object spread here measured ~2 µs per key: 1 ms of a
// 512-chunk chain).
function chunkKey(c: ChunkPlan, key: Uint8Array, hex: string, parentHex: string): ChunkKey {
  return { index: c.index, start: c.start, end: c.end, key, hex, parentHex, partial: c.partial }
}

function checkAfter(after: ChainOptions['after']): void {
  if (after === undefined) return
  if (
    !Number.isInteger(after.index) ||
    after.index < 0 ||
    !(after.key instanceof Uint8Array) ||
    after.key.length !== 32
  ) {
    throw new InvalidArgumentError('after must be a chunk key {index, key (32 bytes), hex}')
  }
}

function seedPreimageFor(ns: ReturnType<typeof validateNamespace>): Uint8Array {
  // vLLM's NONE_HASH = sha256_cbor(PYTHONHASHSEED string).
  return ns.scheme === 'vllm-sha256-cbor' ? Uint8Array.from(cborEncode(ns.hashSeed!)) : seedPreimage(ns)
}

/**
 * The chain as a coroutine over the hash function: yields each preimage (the seed
 * first, unless resuming) and receives its SHA-256, so the sync (node:crypto) and
 * async (WebCrypto) entry points share one loop. A yielded buffer may be reused by
 * the next step: hash it before resuming.
 */
function* chainSteps(
  tokens: ArrayLike<number>,
  ns: KeyNamespace,
  opts: ChainOptions,
): Generator<Uint8Array, ChunkKey[], Uint8Array> {
  const v = validateNamespace(ns)
  checkTokens(tokens)
  checkAfter(opts.after)
  const extra = extraOf(v)
  let parent = opts.after ? opts.after.key : yield seedPreimageFor(v)
  const buf = new Uint8Array(36 + 4 * v.chunkTokens)
  const out: ChunkKey[] = []
  let parentHex = opts.after ? opts.after.hex : toHex(parent)
  const first = opts.after ? opts.after.index + 1 : 0
  for (const c of plan(tokens.length, v.chunkTokens, opts.includePartial ?? false, first)) {
    const key: Uint8Array = yield v.scheme === 'sha256-v1'
      ? v1Preimage(parent, tokens, c.start, c.end, buf)
      : vllmPreimage(parent, tokens, c.start, c.end, extra)
    const hex = toHex(key)
    out.push(chunkKey(c, key, hex, parentHex))
    parent = key
    parentHex = hex
  }
  return out
}

/**
 * Keys of every full chunk of `tokens` (and the partial tail with includePartial).
 * Synchronous; needs node:crypto (Node, Bun, workerd with nodejs_compat).
 */
export function chainKeys(tokens: ArrayLike<number>, ns: KeyNamespace, opts: ChainOptions = {}): ChunkKey[] {
  const steps = chainSteps(tokens, ns, opts)
  let step = steps.next()
  if (step.done) return step.value
  const sha = requireSync()
  while (!step.done) step = steps.next(sha([step.value]))
  return step.value
}

/** Same keys as chainKeys, computed with WebCrypto (any runtime). */
export async function chainKeysAsync(
  tokens: ArrayLike<number>,
  ns: KeyNamespace,
  opts: ChainOptions = {},
): Promise<ChunkKey[]> {
  const steps = chainSteps(tokens, ns, opts)
  let step = steps.next()
  while (!step.done) step = steps.next(await subtleSha256([step.value]))
  return step.value
}
