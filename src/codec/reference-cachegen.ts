// LMCache's "cachegen" scheme, reimplemented as the benchmark baseline (DESIGN 2.3):
// per-token symmetric quantization (32 or 16 bins by layer, split as LMCache splits it for
// the model's layer count), one 33-entry 16-bit CDF per (layer, channel) stored with the
// data, and a 32-bit binary arithmetic coder. Correct, not fast: benchmarks only.

import { f16ToF32, f32ToF16 } from '../core/dtype.ts'
import { CorruptStreamError } from '../core/errors.ts'

const CDF_ENTRIES = 33
const CDF_TOTAL = 65535
const HALF = 2 ** 31
const Q1 = 2 ** 30
const Q3 = 3 * 2 ** 30
const TOP = 2 ** 32

/** Layers below `k` (K) / `v` (V) get 32 bins, the rest 16. */
export interface CachegenSplit {
  k: number
  v: number
}

/**
 * The split LMCache uses for a model of `layers` layers when it is not in its named
 * families: LMCache v1 `CacheGenConfig.from_model_name`
 * (lmcache/v1/storage_backend/naive_serde/cachegen_basics.py) gives models with fewer
 * than 10 layers 32 bins for K and V in every layer, others K 32 bins in layers 0–9 and
 * V 32 bins in layers 0–1 (the split its Llama-3.1-8B and Mistral-7B entries name too).
 */
export function lmcacheSplit(layers: number): CachegenSplit {
  return layers < 10 ? { k: layers, v: layers } : { k: 10, v: 2 }
}

/** The ≥ 10-layer split, for comparison on small models. */
export const LARGE_MODEL_SPLIT: CachegenSplit = { k: 10, v: 2 }

export function cachegenBins(kind: 0 | 1, layer: number, split: CachegenSplit): number {
  return layer < (kind === 0 ? split.k : split.v) ? 32 : 16
}

class BitSink {
  bytes = new Uint8Array(1024)
  n = 0
  acc = 0
  nbits = 0
  bit(b: number): void {
    this.acc = (this.acc << 1) | b
    if (++this.nbits === 8) {
      if (this.n === this.bytes.length) {
        const g = new Uint8Array(this.bytes.length * 2)
        g.set(this.bytes)
        this.bytes = g
      }
      this.bytes[this.n++] = this.acc
      this.acc = 0
      this.nbits = 0
    }
  }
  finish(): Uint8Array {
    while (this.nbits !== 0) this.bit(0)
    return this.bytes.subarray(0, this.n)
  }
}

/** Encodes one stream (T×C floats) at `bins` levels into `parts`. */
function encodeStream(x: Float32Array, t: number, c: number, bins: number, parts: Uint8Array[]): void {
  const m = bins / 2 - 1
  const scales = new Uint16Array(t)
  const q = new Uint8Array(t * c)
  for (let tt = 0; tt < t; tt++) {
    let mx = 0
    for (let ch = 0; ch < c; ch++) {
      const a = Math.abs(x[tt * c + ch]!)
      if (a > mx && Number.isFinite(a)) mx = a
    }
    scales[tt] = f32ToF16(mx)
    const s = f16ToF32(scales[tt]!)
    for (let ch = 0; ch < c; ch++) {
      const v = x[tt * c + ch]!
      const y = s > 0 && Number.isFinite(v) ? Math.round((v * m) / s + m) : m
      q[tt * c + ch] = Math.min(2 * m, Math.max(0, y))
    }
  }
  // One CDF per channel over its T symbols; each present symbol keeps ≥ 1.
  const cdfs = new Uint16Array(c * CDF_ENTRIES)
  const counts = new Float64Array(bins)
  for (let ch = 0; ch < c; ch++) {
    counts.fill(0)
    for (let tt = 0; tt < t; tt++) counts[q[tt * c + ch]!]!++
    const freq = new Array<number>(bins).fill(0)
    let sum = 0
    for (let s = 0; s < bins; s++) {
      if (counts[s]! > 0) freq[s] = Math.max(1, Math.floor((counts[s]! * (CDF_TOTAL - bins)) / t))
      sum += freq[s]!
    }
    let big = 0
    for (let s = 1; s < bins; s++) if (freq[s]! > freq[big]!) big = s
    freq[big]! += CDF_TOTAL - sum
    let cum = 0
    for (let s = 0; s < CDF_ENTRIES; s++) {
      cdfs[ch * CDF_ENTRIES + s] = cum
      if (s < bins) cum += freq[s]!
    }
  }
  const sink = new BitSink()
  let low = 0
  let high = TOP - 1
  let pending = 0
  const emit = (b: number): void => {
    sink.bit(b)
    for (; pending > 0; pending--) sink.bit(1 - b)
  }
  for (let i = 0; i < t * c; i++) {
    const ch = i % c
    const s = q[i]!
    const lo = cdfs[ch * CDF_ENTRIES + s]!
    const hi = cdfs[ch * CDF_ENTRIES + s + 1]!
    const range = high - low + 1
    high = low + Math.floor((range * hi) / CDF_TOTAL) - 1
    low = low + Math.floor((range * lo) / CDF_TOTAL)
    for (;;) {
      if (high < HALF) emit(0)
      else if (low >= HALF) {
        emit(1)
        low -= HALF
        high -= HALF
      } else if (low >= Q1 && high < Q3) {
        pending++
        low -= Q1
        high -= Q1
      } else break
      low = 2 * low
      high = 2 * high + 1
    }
  }
  pending++
  emit(low < Q1 ? 0 : 1)
  const bits = sink.finish()
  parts.push(new Uint8Array(scales.buffer), new Uint8Array(cdfs.buffer))
  const len = new Uint8Array(4)
  new DataView(len.buffer).setUint32(0, bits.length, true)
  parts.push(len, bits.slice())
}

/** Encodes one layer (K then V as float32, T×C each) as a section. */
export function encodeCachegenLayer(
  k: Float32Array,
  v: Float32Array,
  t: number,
  c: number,
  layer: number,
  split: CachegenSplit,
): Uint8Array {
  const parts: Uint8Array[] = []
  encodeStream(k, t, c, cachegenBins(0, layer, split), parts)
  encodeStream(v, t, c, cachegenBins(1, layer, split), parts)
  let n = 0
  for (const p of parts) n += p.length
  const out = new Uint8Array(n)
  let o = 0
  for (const p of parts) {
    out.set(p, o)
    o += p.length
  }
  return out
}

function decodeStream(
  sec: Uint8Array,
  at: number,
  t: number,
  c: number,
  bins: number,
  out: Float32Array,
): number {
  const fail = (): never => {
    throw new CorruptStreamError('corrupt reference-cachegen section')
  }
  const m = bins / 2 - 1
  const head = t * 2 + c * CDF_ENTRIES * 2 + 4
  if (at + head > sec.length) fail()
  const dv = new DataView(sec.buffer, sec.byteOffset, sec.byteLength)
  const scales = new Float32Array(t)
  for (let tt = 0; tt < t; tt++) scales[tt] = f16ToF32(dv.getUint16(at + 2 * tt, true)) / m
  const cdfAt = at + 2 * t
  const cdfs = new Uint16Array(c * CDF_ENTRIES)
  for (let i = 0; i < cdfs.length; i++) cdfs[i] = dv.getUint16(cdfAt + 2 * i, true)
  for (let ch = 0; ch < c; ch++) {
    const b = ch * CDF_ENTRIES
    if (cdfs[b] !== 0 || cdfs[b + bins] !== CDF_TOTAL) fail()
    for (let s = 0; s < bins; s++) if (cdfs[b + s + 1]! < cdfs[b + s]!) fail()
  }
  const nbytes = dv.getUint32(cdfAt + 2 * c * CDF_ENTRIES, true)
  const bitsAt = cdfAt + 2 * c * CDF_ENTRIES + 4
  if (bitsAt + nbytes > sec.length) fail()
  let bitPos = 0
  const totalBits = nbytes * 8
  const nextBit = (): number => {
    const b = bitPos < totalBits ? (sec[bitsAt + (bitPos >>> 3)]! >>> (7 - (bitPos & 7))) & 1 : 0
    bitPos++
    return b
  }
  let value = 0
  for (let i = 0; i < 32; i++) value = value * 2 + nextBit()
  let low = 0
  let high = TOP - 1
  for (let i = 0; i < t * c; i++) {
    const ch = i % c
    const b = ch * CDF_ENTRIES
    const range = high - low + 1
    const scaled = Math.min(
      CDF_TOTAL - 1,
      Math.max(0, Math.floor(((value - low + 1) * CDF_TOTAL - 1) / range)),
    )
    let s = 0
    while (s < bins - 1 && cdfs[b + s + 1]! <= scaled) s++
    const lo = cdfs[b + s]!
    const hi = cdfs[b + s + 1]!
    if (hi <= lo) fail()
    high = low + Math.floor((range * hi) / CDF_TOTAL) - 1
    low = low + Math.floor((range * lo) / CDF_TOTAL)
    for (;;) {
      if (high < HALF) {
        // nothing to subtract
      } else if (low >= HALF) {
        low -= HALF
        high -= HALF
        value -= HALF
      } else if (low >= Q1 && high < Q3) {
        low -= Q1
        high -= Q1
        value -= Q1
      } else break
      low = 2 * low
      high = 2 * high + 1
      value = 2 * value + nextBit()
    }
    out[i] = (s - m) * scales[(i / c) | 0]!
  }
  if (bitPos > totalBits + 64) fail()
  return bitsAt + nbytes
}

/** Decodes a section into K and V float32 arrays (T×C each). */
export function decodeCachegenLayer(
  sec: Uint8Array,
  t: number,
  c: number,
  layer: number,
  k: Float32Array,
  v: Float32Array,
  split: CachegenSplit,
): void {
  const at = decodeStream(sec, 0, t, c, cachegenBins(0, layer, split), k)
  const end = decodeStream(sec, at, t, c, cachegenBins(1, layer, split), v)
  if (end !== sec.length) throw new CorruptStreamError('corrupt reference-cachegen section (trailing bytes)')
}
