// The per-namespace calibration object (DESIGN §2.9): side information that does not vary
// per chunk, measured once on sample chunks and stored in the bucket under its SHA-256, so
// kvgate chunks carry only what varies. Per (layer, K|V) stream it holds the channel means
// (a chunk codes its centres as small offsets from them), the channels' entropy classes, and
// frequency tables for a ladder of step sizes (a chunk names the set that codes it smallest
// in one byte, or carries its own tables when its statistics are far off the calibration's).
//
// Layout (little-endian; docs/codec.md):
//   0 "KVCL" | 4 u16 version 1 | 6 u8 dtype code | 7 u8 flags (bit 0 latent) | 8 u16 layers | 10 u16 kvHeads
//   | 12 u16 headDim | 14 u16 table sets | 16 u32 sample tokens | 20 u32 0
//   | 24 u32 × (layers + 1) layer blob offsets (from the end of this index)
//   | layer blobs (wasm/src/lossy.rs parse_layer_cal) | u32 CRC-32 of everything before it

import { crc32 } from '../core/checksum.ts'
import { decodeElements } from '../core/dtype.ts'
import { CodecError, InvalidArgumentError } from '../core/errors.ts'
import {
  chunkBytes,
  DTYPE_CODES,
  type Dtype,
  dtypeFromCode,
  type KvGeometry,
  kvPlanes,
  layerSlabBytes,
  MAX_CHUNK_TOKENS,
  rowElements,
  sameGeometry,
  validateGeometry,
} from '../core/layout.ts'
import { wasmCodec } from './runtime.ts'
import { sha256Hex } from './sha256.ts'
import { WASM_LATENT } from './wasm-instance.ts'

/** The model geometry a calibration is measured for (the chunk geometry, dtype included). */
export type ModelGeometry = KvGeometry

export interface Calibration {
  /** SHA-256 hex of `bytes`: what a chunk header names. */
  readonly hash: string
  readonly bytes: Uint8Array
  readonly geometry: ModelGeometry
  readonly dtype: Dtype
}

/** A chunk names a calibration that was not given (or another one was). */
export class CalibrationMissingError extends CodecError {
  readonly hash: string
  constructor(hash: string, message = `chunk was coded with calibration ${hash}, which was not given`) {
    super(message, { code: 'ERR_CALIBRATION_MISSING' })
    this.hash = hash
    this.name = 'CalibrationMissingError'
  }
}

const MAGIC = 0x4c43564b // "KVCL" read as a little-endian u32
const VERSION = 1
const FIXED_BYTES = 24
/** Byte 7 flag: measured on latent (MLA) chunks, one stream per layer. */
const FLAG_LATENT = 1
/** Refused above this size before anything is parsed (an 8B-class model's is ~1 MiB). */
export const MAX_CALIBRATION_BYTES = 64 * 1024 * 1024
/** Channels per stream with their own class; the wasm decoder takes at most 8 classes. */
const MAX_CLASSES = 8

/**
 * Step sizes the table sets are measured at, as relative errors (K against its
 * channel-centred RMS, V against its RMS, the targets kvgate's levels give): √2 apart from
 * 0.4 (coarser than q1's V) down to ~0.0016 (finer than q9's K). A chunk whose step falls
 * between two sets codes with the nearer one (a √2 mismatch of a Laplacian's scale costs a
 * few hundredths of a bit per value); the encoder picks by coded size, not by step.
 */
const EPS_GRID: readonly number[] = Array.from({ length: 17 }, (_, i) => 0.4 * 2 ** (-i / 2))

/** Table sets for which a symbol absent from the samples still gets a frequency (tail margin). */
const TAIL_MARGIN = 4

/** The layer blobs of each Calibration openCalibration returned (frozen: its fields are its bytes'). */
const opened = new WeakMap<object, Uint8Array[]>()
/**
 * Any Calibration given to the codec → the one openCalibration made of its bytes. A plain
 * object's fields are claims: its geometry, and (it can be changed after use) its hash.
 */
const verified = new WeakMap<object, Calibration>()

function validSample(s: unknown, g: KvGeometry): number {
  const per = chunkBytes(g, 1)
  if (!(s instanceof Uint8Array) || s.byteLength === 0 || s.byteLength % per !== 0) {
    throw new InvalidArgumentError('each calibration sample must be a chunk tensor of whole tokens')
  }
  const t = s.byteLength / per
  if (t > MAX_CHUNK_TOKENS)
    throw new InvalidArgumentError(`a calibration sample has over ${MAX_CHUNK_TOKENS} tokens`)
  return t
}

/** Scales counts to a table summing to 2048 (the wasm coder's PROB_SCALE), every counted symbol ≥ 1. */
function normalize(counts: Float64Array): number[] {
  let n = counts.length
  while (n > 0 && counts[n - 1] === 0) n--
  const total = counts.subarray(0, n).reduce((a, b) => a + b, 0)
  const f = new Array<number>(Math.max(n, 2)).fill(0)
  if (total === 0) {
    f[0] = 2047
    f[1] = 1
    return f
  }
  for (let i = 0; i < n; i++) if (counts[i]! > 0) f[i] = Math.max(1, Math.floor((counts[i]! * 2048) / total))
  if (f.filter((v) => v > 0).length === 1) {
    const i = f.findIndex((v) => v > 0)
    f[i === 0 ? 1 : i - 1] = 1
  }
  let sum = f.reduce((a, b) => a + b, 0)
  while (sum !== 2048) {
    let imax = 0
    for (let i = 1; i < f.length; i++) if (f[i]! > f[imax]!) imax = i
    const diff = 2048 - sum
    const take = diff > 0 ? diff : -Math.min(f[imax]! - 1, -diff)
    if (take === 0) break
    f[imax]! += take
    sum += take
  }
  return f.map((v) => Math.min(v, 2047))
}

function append(out: number[], b: ArrayLike<number>): void {
  for (let i = 0; i < b.length; i++) out.push(b[i]!)
}

function putVarint(out: number[], v: number): void {
  while (v >= 0x80) {
    out.push((v & 0x7f) | 0x80)
    v >>>= 7
  }
  out.push(v)
}

/** One stream's calibration: `k, nsets, means, classes, set offsets, sets` (lossy.rs StreamCal). */
function streamBlob(means: Float64Array, counts: Float64Array[], c: number, alphabet: number): number[] {
  // Classes: channels ranked by the entropy of their own residuals at the middle of the
  // grid, cut into equal groups (the in-chunk coder's partition, measured once).
  const ref = counts[counts.length >> 1]!
  const entropy = (ch: number): number => {
    let tot = 0
    let h = 0
    for (let s = 0; s < alphabet; s++) tot += ref[ch * alphabet + s]!
    for (let s = 0; s < alphabet; s++) {
      const n = ref[ch * alphabet + s]!
      if (n > 0) h -= n * Math.log2(n / tot)
    }
    return tot > 0 ? h / tot : 0
  }
  let k = 1
  while (k * 2 <= Math.min(MAX_CLASSES, c)) k *= 2
  const order = Array.from({ length: c }, (_, ch) => [entropy(ch), ch] as const).sort(
    (a, b) => a[0] - b[0] || a[1] - b[1],
  )
  const classOf = new Uint8Array(c)
  order.forEach(([, ch], r) => {
    classOf[ch] = Math.floor((r * k) / c)
  })
  const sets: number[][] = counts.map((cnt) => {
    const out: number[] = []
    for (let cls = 0; cls < k; cls++) {
      const sum = new Float64Array(alphabet)
      for (let ch = 0; ch < c; ch++) {
        if (classOf[ch] !== cls) continue
        for (let s = 0; s < alphabet; s++) sum[s]! += cnt[ch * alphabet + s]!
      }
      // Symbols a little past the largest seen keep a frequency: a chunk slightly wider than
      // the samples still codes with the set (the alternative is its own tables).
      let top = -1
      for (let s = 0; s < alphabet; s++) if (sum[s]! > 0) top = s
      for (let s = 0; s <= Math.min(alphabet - 1, top + TAIL_MARGIN); s++) if (sum[s] === 0) sum[s] = 1e-9
      const f = normalize(sum)
      out.push(f.length - 1)
      for (const v of f) putVarint(out, v)
    }
    return out
  })
  const blob: number[] = [k, sets.length]
  const m = new DataView(new ArrayBuffer(4 * c))
  for (let ch = 0; ch < c; ch++) m.setFloat32(4 * ch, means[ch]!, true)
  append(blob, new Uint8Array(m.buffer))
  append(blob, classOf)
  let off = 0
  const offs = new DataView(new ArrayBuffer(4 * (sets.length + 1)))
  sets.forEach((s, i) => {
    offs.setUint32(4 * i, off, true)
    off += s.length
  })
  offs.setUint32(4 * sets.length, off, true)
  append(blob, new Uint8Array(offs.buffer))
  for (const s of sets) append(blob, s)
  return blob
}

/**
 * Bytes of a calibration object measured on `samples` (chunk tensors in the client's layout,
 * the bytes encodeChunk takes; any token counts). Deterministic: the same samples give the
 * same object, so two nodes calibrating on the same text agree on its hash.
 */
export function buildCalibration(
  samples: Uint8Array[],
  meta: { geometry: ModelGeometry; dtype: Dtype },
): Uint8Array {
  if (!(meta?.dtype in DTYPE_CODES)) throw new InvalidArgumentError(`unknown dtype '${String(meta?.dtype)}'`)
  const g = validateGeometry({ ...meta.geometry, dtype: meta.dtype })
  if (!Array.isArray(samples) || samples.length === 0)
    throw new InvalidArgumentError('calibration needs samples')
  const tokens = samples.map((s) => validSample(s, g))
  const totalTokens = tokens.reduce((a, b) => a + b, 0)
  const c = rowElements(g)
  const codec = wasmCodec()
  const A = codec.alphabet
  const dcode = DTYPE_CODES[g.dtype]
  const planes = kvPlanes(g)
  const wasmDtype = dcode | (planes === 1 ? WASM_LATENT : 0)
  const blobs: number[][] = []
  for (let l = 0; l < g.layers; l++) {
    const means = [new Float64Array(c), new Float64Array(c)]
    const counts = [0, 1].map(() => EPS_GRID.map(() => new Float64Array(c * A)))
    samples.forEach((s, i) => {
      const t = tokens[i]!
      const slab = layerSlabBytes(g, t)
      const layer = s.subarray(l * slab, (l + 1) * slab)
      const x = decodeElements(layer, g.dtype)
      for (let kv = 0; kv < planes; kv++) {
        for (let tt = 0; tt < t; tt++) {
          const o = (kv * t + tt) * c
          for (let ch = 0; ch < c; ch++) {
            const v = x[o + ch]!
            if (Number.isFinite(v)) means[kv]![ch]! += v / totalTokens
          }
        }
      }
      EPS_GRID.forEach((eps, gi) => {
        const n = codec.symbolCounts(layer, wasmDtype, t, c, new Float32Array([-eps, eps, 0, 0, 1, 8, 0, 0]))
        for (let kv = 0; kv < planes; kv++) {
          const dst = counts[kv]![gi]!
          const src = n.subarray(kv * c * A, (kv + 1) * c * A)
          for (let j = 0; j < c * A; j++) dst[j]! += src[j]!
        }
      })
    })
    const kBlob = streamBlob(means[0]!, counts[0]!, c, A)
    // A latent layer is one stream, coded with the K stream's calibration; the layer blob
    // keeps its K-then-V shape (what the wasm parser takes) with the latent's twice.
    const vBlob = planes === 1 ? kBlob : streamBlob(means[1]!, counts[1]!, c, A)
    const len = new DataView(new ArrayBuffer(4))
    len.setUint32(0, kBlob.length, true)
    const blob: number[] = []
    append(blob, new Uint8Array(len.buffer))
    append(blob, kBlob)
    append(blob, vBlob)
    blobs.push(blob)
  }
  const index = 4 * (g.layers + 1)
  const body = blobs.reduce((a, b) => a + b.length, 0)
  const out = new Uint8Array(FIXED_BYTES + index + body + 4)
  const dv = new DataView(out.buffer)
  dv.setUint32(0, MAGIC, true)
  dv.setUint16(4, VERSION, true)
  out[6] = dcode
  out[7] = planes === 1 ? FLAG_LATENT : 0
  dv.setUint16(8, g.layers, true)
  dv.setUint16(10, g.kvHeads, true)
  dv.setUint16(12, g.headDim, true)
  dv.setUint16(14, EPS_GRID.length, true)
  dv.setUint32(16, Math.min(totalTokens, 0xffffffff), true)
  let off = 0
  let p = FIXED_BYTES + index
  blobs.forEach((b, l) => {
    dv.setUint32(FIXED_BYTES + 4 * l, off, true)
    out.set(b, p)
    p += b.length
    off += b.length
  })
  dv.setUint32(FIXED_BYTES + 4 * g.layers, off, true)
  dv.setUint32(out.length - 4, crc32(out.subarray(0, out.length - 4)), true)
  if (out.length > MAX_CALIBRATION_BYTES) {
    throw new InvalidArgumentError(`calibration of ${out.length} bytes exceeds ${MAX_CALIBRATION_BYTES}`)
  }
  return out
}

/** Parses and validates calibration bytes (hostile bytes: CodecError, never a trap). */
export function openCalibration(bytes: Uint8Array): Calibration {
  const bad = (why: string): never => {
    throw new CodecError(`invalid calibration object: ${why}`)
  }
  if (!(bytes instanceof Uint8Array)) bad('not bytes')
  if (bytes.byteLength < FIXED_BYTES + 8) bad(`${bytes.byteLength} bytes is too short`)
  if (bytes.byteLength > MAX_CALIBRATION_BYTES) bad(`${bytes.byteLength} bytes is over the limit`)
  // A copy in its own ArrayBuffer (a Node Buffer's slice() would share the caller's memory).
  const copy = new Uint8Array(bytes)
  const dv = new DataView(copy.buffer)
  if (dv.getUint32(0, true) !== MAGIC) bad('bad magic')
  if (dv.getUint16(4, true) !== VERSION) bad(`version ${dv.getUint16(4, true)} is not supported`)
  if (crc32(copy.subarray(0, copy.length - 4)) !== dv.getUint32(copy.length - 4, true))
    bad('checksum mismatch')
  const dtype = dtypeFromCode(copy[6]!)
  if (dtype === undefined) bad(`unknown dtype code ${copy[6]}`)
  if ((copy[7]! & ~FLAG_LATENT) !== 0 || dv.getUint32(20, true) !== 0) bad('reserved bytes are not zero')
  let geometry: KvGeometry
  try {
    geometry = validateGeometry({
      layers: dv.getUint16(8, true),
      kvHeads: dv.getUint16(10, true),
      headDim: dv.getUint16(12, true),
      dtype: dtype as Dtype,
      ...(copy[7] === FLAG_LATENT ? { latent: true } : {}),
    })
  } catch (e) {
    return bad(`geometry: ${(e as Error).message}`)
  }
  const L = geometry.layers
  const start = FIXED_BYTES + 4 * (L + 1)
  const end = copy.length - 4
  if (start > end) bad('layer index is truncated')
  const c = rowElements(geometry)
  const codec = wasmCodec()
  const blobs: Uint8Array[] = []
  let prev = 0
  for (let l = 0; l <= L; l++) {
    const off = dv.getUint32(FIXED_BYTES + 4 * l, true)
    if ((l === 0 && off !== 0) || off < prev || start + off > end) bad(`layer ${l} offset ${off}`)
    if (l > 0) {
      const blob = copy.subarray(start + prev, start + off)
      if (!codec.checkLayerCalibration(blob, c)) bad(`layer ${l - 1} tables are malformed`)
      blobs.push(blob)
    }
    prev = off
  }
  if (start + prev !== end) bad('bytes after the last layer')
  const cal: Calibration = Object.freeze({
    hash: sha256Hex(copy),
    bytes: copy,
    geometry,
    dtype: dtype as Dtype,
  })
  opened.set(cal, blobs)
  verified.set(cal, cal)
  return cal
}

/**
 * What the codec codes with when given `cal`: the Calibration openCalibration made of its
 * bytes (hash, geometry and dtype are the bytes' own, not what a plain object says). One
 * given as a plain object is opened here and must hash to what it claims.
 */
export function verifiedCalibration(cal: Calibration): Calibration {
  const known = verified.get(cal)
  // A plain object changed since it was opened names other bytes now: opened again.
  if (known && known.hash === cal.hash) return known
  const fresh = openCalibration(cal?.bytes)
  if (fresh.hash !== cal.hash)
    throw new CodecError(`calibration bytes hash to ${fresh.hash}, not ${cal.hash}`)
  verified.set(cal, fresh)
  return fresh
}

/** The per-layer blobs of a calibration (of its bytes: see verifiedCalibration). */
export function layerBlobs(cal: Calibration): Uint8Array[] {
  return opened.get(verifiedCalibration(cal))!
}

/** Throws unless `cal` was measured for chunks of geometry `g`. */
export function checkCalibrationGeometry(cal: Calibration, g: KvGeometry): void {
  const h = cal.geometry
  if (!sameGeometry({ ...h, dtype: cal.dtype }, g)) {
    const latent = (x: KvGeometry) => (x.latent === true ? ' latent' : '')
    throw new CodecError(
      `calibration ${cal.hash.slice(0, 12)} is for ${h.layers}×${h.kvHeads}×${h.headDim} ${cal.dtype}${latent(h)}, ` +
        `the chunk is ${g.layers}×${g.kvHeads}×${g.headDim} ${g.dtype}${latent(g)}`,
    )
  }
}
