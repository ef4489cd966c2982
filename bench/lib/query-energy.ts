// K channel weights by effect: a K error δ_c in channel c moves a query's logit by Σ_c q_c·δ_c,
// so with independent errors the logit error's variance is Σ_c E[q_c²]·δ_c². Per-channel
// steps Δ/g_c with g_c = sqrt(E[q_c²] / GM) minimise bits at a given logit error (bench/codec-context.ts,
// bench/codec-layer-budget.ts). The queries come from the model: only an engine has them.

import type { PreparedWindow, Transformer } from '../../src/model/index.ts'

/** Query energy per K channel (GQA: summed over the query heads that read it), per layer. */
export function queryEnergy(t: Transformer, windows: readonly PreparedWindow[]): Float64Array[] {
  const cfg = t.config
  const hd = cfg.dim / cfg.heads
  const group = cfg.heads / cfg.kvHeads
  const out: Float64Array[] = []
  for (let l = 0; l < cfg.layers; l++) {
    const w = new Float64Array(cfg.kvHeads * hd)
    for (const win of windows) {
      const q = win.queries[l]!
      for (let i = 0; i < q.length; i++) {
        const h = Math.floor((i % cfg.dim) / hd)
        w[Math.floor(h / group) * hd + (i % hd)]! += q[i]! ** 2
      }
    }
    out.push(w)
  }
  return out
}

/** g_c = sqrt(w_c / geometric mean of w): the per-channel gains (geometric mean 1). */
export const channelGains = (w: readonly Float64Array[]): Float64Array[] =>
  w.map((x) => {
    const gm = Math.exp(x.reduce((a, v) => a + Math.log(v), 0) / x.length)
    return x.map((v) => Math.sqrt(v / gm))
  })

/** Centred RMS of a T×C plane (the codec's K reference). */
export function centredRms(x: Float32Array, c: number): number {
  const t = x.length / c
  const mean = new Float64Array(c)
  for (let i = 0; i < x.length; i++) mean[i % c]! += x[i]! / t
  let ss = 0
  for (let i = 0; i < x.length; i++) ss += (x[i]! - mean[i % c]!) ** 2
  return Math.sqrt(ss / x.length)
}

/**
 * Scales K of layer slab `x` (f32, K plane first) by `gain` in place and returns the K error
 * target that keeps Σ_c g_c²·δ_c² at what `kError` gives without scaling: Δ' = Δ·sqrt(mean g²).
 */
export function shapeK(
  x: Float32Array,
  plane: number,
  c: number,
  kError: number,
  gain: Float64Array,
): number {
  const k = x.subarray(0, plane)
  const delta = kError * centredRms(k, c)
  let am = 0
  for (const v of gain) am += v * v
  am /= c
  for (let i = 0; i < plane; i++) k[i]! *= gain[i % c]!
  return (delta * Math.sqrt(am)) / centredRms(k, c)
}
