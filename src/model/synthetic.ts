// Synthetic KV with the statistics real KV has, in any geometry (Llama-3.1-8B-shaped by
// default), deterministic from a seed: for codec benchmarks where no 8B model can run.
//
// Generation, per layer l, kv head h, channel d (pre-RoPE), token t:
//   K[t,d] = μ_d + σ_d · m_t · a_t,d      a_t,d = ρ_d a_{t−1},d + √(1−ρ_d²) ε   (AR(1), unit variance)
//   V[t,d] = ν_d + τ_d · b_t,d            b_t,d = φ_d b_{t−1},d + √(1−φ_d²) ε
// - σ_d: log-normal around a layer scale that grows with depth; a few outlier channels
//   per head (4 of 128, in the slowly rotating RoPE dims, like Llama) get 6–12× the scale.
// - μ_d: per-channel offsets carrying most of K's variance (real K's channel means are
//   large and stable, which is why per-channel quantization of K wins).
// - ρ_d ∈ [0.55, 0.95], higher for slowly rotating dims: consecutive-token deltas carry
//   ≈0.15–0.3 of K's variance (real: 0.14–0.29).
// - m_t = exp(0.25·z) per (token, head): a scale mixture that gives K heavy tails.
// - K is then rotated by RoPE at positions startPosition + t (Llama's rotate-half pairs
//   (d, d+64), θ = 500000 by default, or adjacent pairs as llama2.c, or none).
// - V: near-Gaussian, small offsets, φ_d ∈ [−0.25, 0.05] (slightly anti-correlated):
//   var(Δ)/var ≈ 1.7–2 (real: ≈1.7); its scale also grows with depth.
// Channel parameters depend only on `modelSeed` (one "model"); token noise on `seed`.
// Normals come from a 2^16-entry inverse-CDF table indexed by half of a xoshiro128**
// output (tails clipped at ±4.4σ before the scale mixture), which keeps 32 MiB under ~1 s.

import { encodeElements } from '../core/dtype.ts'
import { chunkBytes, type KvGeometry, MODEL_PRESETS, validateGeometry } from '../core/layout.ts'
import { ModelError } from './model-error.ts'

export interface SyntheticKvOptions {
  /** @default Llama-3.1-8B: 32 layers, 8 kv heads, head dim 128, bf16 */
  geometry?: KvGeometry
  /** @default 256 */
  tokens?: number
  /** Token noise. @default 1 */
  seed?: number
  /** Channel statistics (offsets, scales, outliers, correlations). @default 0 */
  modelSeed?: number
  /** RoPE position of the first token. @default 0 */
  startPosition?: number
  /** @default 'half' */
  rope?: 'half' | 'adjacent' | 'none'
  /** @default 500000 (Llama 3) */
  ropeTheta?: number
}

const LLAMA_8B: KvGeometry = (({ layers, kvHeads, headDim, dtype }) => ({ layers, kvHeads, headDim, dtype }))(
  MODEL_PRESETS['llama-3.1-8b'],
)

/** xoshiro128** seeded through splitmix32: small, fast, good enough for test data. */
export class Xoshiro128 {
  #s = new Uint32Array(4)

  constructor(seed: number) {
    let x = seed >>> 0
    for (let i = 0; i < 4; i++) {
      x = (x + 0x9e3779b9) >>> 0
      let z = x
      z = Math.imul(z ^ (z >>> 16), 0x85ebca6b)
      z = Math.imul(z ^ (z >>> 13), 0xc2b2ae35)
      this.#s[i] = (z ^ (z >>> 16)) >>> 0
    }
    if ((this.#s[0]! | this.#s[1]! | this.#s[2]! | this.#s[3]!) === 0) this.#s[0] = 1
  }

  /** Next 32 random bits as an unsigned integer. */
  next(): number {
    const s = this.#s
    const s1 = s[1]!
    const m = Math.imul(s1, 5)
    const r = Math.imul((m << 7) | (m >>> 25), 9) >>> 0
    const t = s1 << 9
    s[2]! ^= s[0]!
    s[3]! ^= s1
    s[1]! ^= s[2]!
    s[0]! ^= s[3]!
    s[2]! ^= t
    s[3] = (s[3]! << 11) | (s[3]! >>> 21)
    return r
  }

  /** Uniform in [0, 1). */
  uniform(): number {
    return this.next() / 4294967296
  }

  /** Standard normal (Box–Muller; for parameters, not the hot loop). */
  normal(): number {
    const u = (this.next() + 1) / 4294967297
    return Math.sqrt(-2 * Math.log(u)) * Math.cos(2 * Math.PI * this.uniform())
  }
}

// Acklam's rational approximation of the inverse normal CDF (relative error < 1.2e-9).
function inverseNormalCdf(p: number): number {
  const a = [
    -39.69683028665376, 220.9460984245205, -275.9285104469687, 138.357751867269, -30.66479806614716,
    2.506628277459239,
  ]
  const b = [-54.47609879822406, 161.5858368580409, -155.6989798598866, 66.80131188771972, -13.28068155288572]
  const c = [
    -0.007784894002430293, -0.3223964580411365, -2.400758277161838, -2.549732539343734, 4.374664141464968,
    2.938163982698783,
  ]
  const d = [0.007784695709041462, 0.3224671290700398, 2.445134137142996, 3.754408661907416]
  const lo = 0.02425
  if (p < lo) {
    const q = Math.sqrt(-2 * Math.log(p))
    return (
      (((((c[0]! * q + c[1]!) * q + c[2]!) * q + c[3]!) * q + c[4]!) * q + c[5]!) /
      ((((d[0]! * q + d[1]!) * q + d[2]!) * q + d[3]!) * q + 1)
    )
  }
  if (p > 1 - lo) return -inverseNormalCdf(1 - p)
  const q = p - 0.5
  const r = q * q
  return (
    ((((((a[0]! * r + a[1]!) * r + a[2]!) * r + a[3]!) * r + a[4]!) * r + a[5]!) * q) /
    (((((b[0]! * r + b[1]!) * r + b[2]!) * r + b[3]!) * r + b[4]!) * r + 1)
  )
}

let normalTable: Float32Array | undefined
function table(): Float32Array {
  if (!normalTable) {
    normalTable = new Float32Array(65536)
    for (let i = 0; i < 65536; i++) normalTable[i] = inverseNormalCdf((i + 0.5) / 65536)
  }
  return normalTable
}

interface LayerParams {
  kMu: Float32Array
  kSigma: Float32Array
  kRho: Float32Array
  vMu: Float32Array
  vTau: Float32Array
  vPhi: Float32Array
}

/** Index of the RoPE frequency (0 = fastest) of channel d, and its partner channel. */
function ropePair(
  style: 'half' | 'adjacent' | 'none',
  d: number,
  hd: number,
): { freq: number; partner: number } {
  if (style === 'adjacent') return { freq: d >> 1, partner: d ^ 1 }
  const half = hd >> 1
  return { freq: d % half, partner: d < half ? d + half : d - half }
}

function layerParams(
  g: KvGeometry,
  l: number,
  rng: Xoshiro128,
  style: 'half' | 'adjacent' | 'none',
): LayerParams {
  const hd = g.headDim
  const ch = g.kvHeads * hd
  const depth = g.layers > 1 ? l / (g.layers - 1) : 0
  const kScale = 0.6 + 1.4 * depth
  const vScale = 0.2 + 1.0 * depth ** 1.5
  const p: LayerParams = {
    kMu: new Float32Array(ch),
    kSigma: new Float32Array(ch),
    kRho: new Float32Array(ch),
    vMu: new Float32Array(ch),
    vTau: new Float32Array(ch),
    vPhi: new Float32Array(ch),
  }
  const half = Math.max(1, hd >> 1)
  // Outlier dims: a few slowly rotating frequencies per head, both channels of the pair.
  const nOut = Math.max(1, Math.round(hd / 64))
  for (let h = 0; h < g.kvHeads; h++) {
    const outliers = new Set<number>()
    for (let i = 0; i < nOut; i++) outliers.add(half - 1 - Math.floor(rng.uniform() * Math.max(1, half / 2)))
    for (let d = 0; d < hd; d++) {
      const c = h * hd + d
      const { freq } = ropePair(style, d, hd)
      const slow = half > 1 ? freq / (half - 1) : 1 // 0 = fastest rotating, 1 = slowest
      const outlier = style !== 'none' ? outliers.has(freq) : outliers.has(d % half)
      let sigma = kScale * Math.exp(0.3 * rng.normal()) * (0.6 + 0.6 * slow)
      if (outlier) sigma *= 3 + 2 * rng.uniform()
      p.kSigma[c] = sigma
      // Offsets mostly in slow dims, where RoPE does not spin them into noise.
      p.kMu[c] = sigma * (0.2 + 1.6 * slow) * (rng.uniform() < 0.5 ? -1 : 1) * (0.4 + 0.8 * rng.uniform())
      p.kRho[c] = 0.6 + 0.35 * slow * (0.7 + 0.3 * rng.uniform())
      p.vTau[c] = vScale * Math.exp(0.2 * rng.normal())
      p.vMu[c] = p.vTau[c]! * 0.3 * rng.normal()
      p.vPhi[c] = -0.1 + 0.2 * rng.uniform()
    }
  }
  return p
}

/** Synthetic KV as a chunk tensor [layer][K|V][token][kvHead][headDim] of geometry.dtype. */
export function syntheticKv(opts: SyntheticKvOptions = {}): Uint8Array {
  const g = validateGeometry(opts.geometry ?? LLAMA_8B)
  const tokens = opts.tokens ?? 256
  if (!Number.isInteger(tokens) || tokens < 1 || tokens > 1 << 20)
    throw new ModelError(`synthetic KV: invalid tokens ${tokens}`)
  const bytes = chunkBytes(g, tokens)
  if (bytes > 2 ** 31) throw new ModelError(`synthetic KV: ${bytes} bytes is too large for one chunk`)
  const style = opts.rope ?? 'half'
  if (!['half', 'adjacent', 'none'].includes(style))
    throw new ModelError(`synthetic KV: unknown rope style ${style}`)
  if (style !== 'none' && g.headDim % 2 !== 0)
    throw new ModelError('synthetic KV: RoPE needs an even head dim')
  const theta = opts.ropeTheta ?? 500000
  const start = opts.startPosition ?? 0
  if (!Number.isInteger(start) || start < 0)
    throw new ModelError(`synthetic KV: invalid startPosition ${start}`)
  const modelRng = new Xoshiro128((opts.modelSeed ?? 0) ^ 0x6b76)
  const rng = new Xoshiro128(Math.imul((opts.seed ?? 1) >>> 0, 0x9e3779b1) ^ 0x5eed)
  const nt = table()
  const hd = g.headDim
  const ch = g.kvHeads * hd
  const half = hd >> 1
  // RoPE cos/sin per (token, frequency), shared by every layer and head.
  const cos = new Float32Array(tokens * half)
  const sin = new Float32Array(tokens * half)
  if (style !== 'none') {
    for (let t = 0; t < tokens; t++) {
      for (let f = 0; f < half; f++) {
        const a = (start + t) * theta ** ((-2 * f) / hd)
        cos[t * half + f] = Math.cos(a)
        sin[t * half + f] = Math.sin(a)
      }
    }
  }
  const partner = new Int32Array(hd)
  const freqOf = new Int32Array(hd)
  const sign = new Float32Array(hd)
  for (let d = 0; d < hd; d++) {
    const r = ropePair(style, d, hd)
    partner[d] = r.partner
    freqOf[d] = r.freq
    // The first channel of a pair gets x·cos − y·sin, the second y·cos + x·sin.
    sign[d] = d < r.partner ? -1 : 1
  }
  const out = new Uint8Array(bytes)
  const plane = tokens * ch
  const kPre = new Float32Array(plane)
  const x = new Float32Array(plane)
  const state = new Float32Array(ch)
  const gain = new Float32Array(ch)
  const mag = new Float32Array(g.kvHeads)
  let spare = -1
  // Two table normals per 32-bit draw.
  const normal = (): number => {
    if (spare >= 0) {
      const v = nt[spare]!
      spare = -1
      return v
    }
    const r = rng.next()
    spare = r & 0xffff
    return nt[r >>> 16]!
  }
  const planeBytes = plane * (g.dtype === 'fp32' ? 4 : 2)
  for (let l = 0; l < g.layers; l++) {
    const p = layerParams(g, l, modelRng, style)
    // K, pre-RoPE.
    for (let c = 0; c < ch; c++) {
      state[c] = normal()
      gain[c] = Math.sqrt(1 - p.kRho[c]! ** 2)
    }
    for (let t = 0; t < tokens; t++) {
      for (let h = 0; h < g.kvHeads; h++) mag[h] = Math.exp(0.25 * normal())
      const row = t * ch
      for (let c = 0; c < ch; c++) {
        const a = p.kRho[c]! * state[c]! + gain[c]! * normal()
        state[c] = a
        kPre[row + c] = p.kMu[c]! + p.kSigma[c]! * mag[(c / hd) | 0]! * a
      }
    }
    if (style === 'none') x.set(kPre)
    else {
      for (let t = 0; t < tokens; t++) {
        const row = t * ch
        const tr = t * half
        for (let c = 0; c < ch; c++) {
          const d = c % hd
          const f = tr + freqOf[d]!
          x[row + c] = kPre[row + c]! * cos[f]! + sign[d]! * kPre[row + c - d + partner[d]!]! * sin[f]!
        }
      }
    }
    encodeElements(x, g.dtype, out.subarray(2 * l * planeBytes, (2 * l + 1) * planeBytes))
    // V.
    for (let c = 0; c < ch; c++) {
      state[c] = normal()
      gain[c] = Math.sqrt(1 - p.vPhi[c]! ** 2)
    }
    for (let t = 0; t < tokens; t++) {
      // Mostly a per-token magnitude (shared by heads): why per-token quantization suits V.
      const tokenMag = 0.3 * normal()
      for (let h = 0; h < g.kvHeads; h++) mag[h] = Math.exp(tokenMag + 0.1 * normal())
      const row = t * ch
      for (let c = 0; c < ch; c++) {
        const b = p.vPhi[c]! * state[c]! + gain[c]! * normal()
        state[c] = b
        x[row + c] = p.vMu[c]! + p.vTau[c]! * mag[(c / hd) | 0]! * b
      }
    }
    encodeElements(x, g.dtype, out.subarray((2 * l + 1) * planeBytes, (2 * l + 2) * planeBytes))
  }
  return out
}
