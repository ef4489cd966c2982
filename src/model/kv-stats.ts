// Statistics of KV planes (one layer's K or V as [token][channel] floats) that a KV
// codec lives on: locality across tokens, outlier channels, quantization error per axis.
//
// Definitions (they reproduce FACTS.md's figures on stories260K's real KV):
// - delta variance ratio: the pooled variance of consecutive-token differences
//   x[t]-x[t-1] over the pooled variance of x (both around their global mean);
// - quantization error: uniform min-max quantization to 2^bits levels, one range per
//   channel (over tokens) or per token (over a group of channels), reported as
//   relative RMSE ‖x − x̂‖ / ‖x‖.

import { decodeElements } from '../core/dtype.ts'
import { dtypeBytes, type KvGeometry } from '../core/layout.ts'
import { ModelError } from './model-error.ts'

/** A [tokens][channels] float plane (channels = kvHeads * headDim). */
export interface KvPlane {
  readonly data: Float32Array
  readonly tokens: number
  readonly channels: number
}

function checkPlane(p: KvPlane): void {
  if (p.tokens < 1 || p.channels < 1 || p.data.length < p.tokens * p.channels) {
    throw new ModelError(
      `KV plane of ${p.tokens}×${p.channels} needs ${p.tokens * p.channels} values, has ${p.data.length}`,
    )
  }
}

/** Layer `layer`'s K (kind 0) or V (kind 1) of a chunk tensor, as float32. */
export function planeOf(
  tensor: Uint8Array,
  g: KvGeometry,
  tokens: number,
  layer: number,
  kind: 0 | 1,
): KvPlane {
  const channels = g.kvHeads * g.headDim
  const plane = tokens * channels * dtypeBytes(g.dtype)
  if (tensor.byteLength !== g.layers * 2 * plane) {
    throw new ModelError(
      `chunk tensor is ${tensor.byteLength} bytes, geometry and ${tokens} tokens say ${g.layers * 2 * plane}`,
    )
  }
  if (!Number.isInteger(layer) || layer < 0 || layer >= g.layers)
    throw new ModelError(`layer ${layer} out of range`)
  const off = (2 * layer + kind) * plane
  return { data: decodeElements(tensor.subarray(off, off + plane), g.dtype), tokens, channels }
}

/** Pooled var(x[t] − x[t−1]) / pooled var(x). ≈0.14–0.29 for real K, ≈1.7 for real V. */
export function deltaVarianceRatio(p: KvPlane): number {
  checkPlane(p)
  const { data: x, tokens: n, channels: c } = p
  if (n < 2) throw new ModelError('delta variance needs at least 2 tokens')
  let s = 0
  let ss = 0
  for (let i = 0; i < n * c; i++) {
    s += x[i]!
    ss += x[i]! * x[i]!
  }
  const m = n * c
  const varX = ss / m - (s / m) ** 2
  let ds = 0
  let dss = 0
  for (let i = c; i < n * c; i++) {
    const d = x[i]! - x[i - c]!
    ds += d
    dss += d * d
  }
  const md = (n - 1) * c
  const varD = dss / md - (ds / md) ** 2
  return varX > 0 ? varD / varX : 0
}

export interface QuantizationErrorOptions {
  /** @default 4 */
  bits?: number
  /** One range per channel (over all tokens) or per token. */
  axis: 'channel' | 'token'
  /** For axis 'token': channels sharing one range (e.g. headDim); default all channels of the token. */
  group?: number
}

/** Relative RMSE of uniform min-max quantization along `axis`. */
export function quantizationError(p: KvPlane, opts: QuantizationErrorOptions): number {
  checkPlane(p)
  const { data: x, tokens: n, channels: c } = p
  const levels = 2 ** (opts.bits ?? 4) - 1
  let se = 0
  let s2 = 0
  const run = (idx: (k: number) => number, count: number): void => {
    let lo = Number.POSITIVE_INFINITY
    let hi = Number.NEGATIVE_INFINITY
    for (let k = 0; k < count; k++) {
      const v = x[idx(k)]!
      if (v < lo) lo = v
      if (v > hi) hi = v
    }
    const step = (hi - lo) / levels
    for (let k = 0; k < count; k++) {
      const v = x[idx(k)]!
      const r = step > 0 ? lo + Math.round((v - lo) / step) * step : v
      se += (v - r) ** 2
      s2 += v * v
    }
  }
  if (opts.axis === 'channel') {
    for (let ch = 0; ch < c; ch++) run((t) => t * c + ch, n)
  } else {
    const g = opts.group ?? c
    if (!Number.isInteger(g) || g < 1 || c % g !== 0)
      throw new ModelError(`group ${g} must divide ${c} channels`)
    for (let t = 0; t < n; t++) for (let s = 0; s < c; s += g) run((k) => t * c + s + k, g)
  }
  return s2 > 0 ? Math.sqrt(se / s2) : 0
}

/** RMS of each channel over tokens. */
export function channelRms(p: KvPlane): Float64Array {
  checkPlane(p)
  const { data: x, tokens: n, channels: c } = p
  const out = new Float64Array(c)
  for (let t = 0; t < n; t++) for (let ch = 0; ch < c; ch++) out[ch]! += x[t * c + ch]! ** 2
  for (let ch = 0; ch < c; ch++) out[ch] = Math.sqrt(out[ch]! / n)
  return out
}

/** Channels whose RMS is at least `factor` times the median channel RMS. */
export function outlierChannels(p: KvPlane, factor = 4): number[] {
  const rms = channelRms(p)
  const sorted = Float64Array.from(rms).sort()
  const median = sorted[sorted.length >> 1]!
  const out: number[] = []
  rms.forEach((r, ch) => {
    if (r >= factor * median) out.push(ch)
  })
  return out
}

/** Excess kurtosis of all values of a plane (0 for a Gaussian; heavy tails are > 0). */
export function excessKurtosis(p: KvPlane): number {
  checkPlane(p)
  const n = p.tokens * p.channels
  let s = 0
  for (let i = 0; i < n; i++) s += p.data[i]!
  const m = s / n
  let m2 = 0
  let m4 = 0
  for (let i = 0; i < n; i++) {
    const d = (p.data[i]! - m) ** 2
    m2 += d
    m4 += d * d
  }
  m2 /= n
  m4 /= n
  return m2 > 0 ? m4 / (m2 * m2) - 3 : 0
}

/** ‖a − b‖ / ‖a‖ over the first `n` values (n defaults to a.length). */
export function relativeRmse(a: ArrayLike<number>, b: ArrayLike<number>, n = a.length): number {
  if (b.length < n || a.length < n) throw new ModelError('relativeRmse: arrays shorter than n')
  let se = 0
  let s2 = 0
  for (let i = 0; i < n; i++) {
    se += (a[i]! - b[i]!) ** 2
    s2 += a[i]! * a[i]!
  }
  return s2 > 0 ? Math.sqrt(se / s2) : se > 0 ? Number.POSITIVE_INFINITY : 0
}
