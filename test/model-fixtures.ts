// Test fixtures for src/model: tiny random llama2.c checkpoints and tokenizers built
// in memory (so loader/forward tests run without the shared model files), and a
// deliberately naive reference forward pass written straight from FACTS.md.

import type { LlamaCheckpoint } from '../src/model/index.ts'

export interface TinyConfig {
  dim: number
  hiddenDim: number
  layers: number
  heads: number
  kvHeads: number
  vocab: number
  seqLen: number
  shared?: boolean
}

export const TINY: TinyConfig = {
  dim: 16,
  hiddenDim: 24,
  layers: 2,
  heads: 4,
  kvHeads: 2,
  vocab: 40,
  seqLen: 64,
}

/** Deterministic uniform floats in [-a, a). */
function lcg(seed: number): () => number {
  let s = seed >>> 0
  return () => {
    s = (Math.imul(s, 1664525) + 1013904223) >>> 0
    return s / 2 ** 32
  }
}

/** A llama2.c v0 file with random weights (RMSNorm weights near 1). */
export function tinyCheckpointBytes(c: TinyConfig = TINY, seed = 1): Uint8Array {
  const headDim = c.dim / c.heads
  const kvDim = c.kvHeads * headDim
  const { dim, hiddenDim: h, layers: L, vocab: V } = c
  const sizes: [number, 'w' | 'norm' | 'zero'][] = [
    [V * dim, 'w'],
    [L * dim, 'norm'],
    [L * dim * dim, 'w'],
    [L * kvDim * dim, 'w'],
    [L * kvDim * dim, 'w'],
    [L * dim * dim, 'w'],
    [L * dim, 'norm'],
    [L * h * dim, 'w'],
    [L * dim * h, 'w'],
    [L * h * dim, 'w'],
    [dim, 'norm'],
    [c.seqLen * headDim, 'zero'],
  ]
  if (c.shared === false) sizes.push([V * dim, 'w'])
  const total = sizes.reduce((a, [n]) => a + n, 0)
  const out = new Uint8Array(28 + total * 4)
  const dv = new DataView(out.buffer)
  const header = [dim, h, L, c.heads, c.kvHeads, c.shared === false ? -V : V, c.seqLen]
  for (const [i, v] of header.entries()) dv.setInt32(i * 4, v, true)
  const rnd = lcg(seed)
  let off = 28
  for (const [n, kind] of sizes) {
    for (let i = 0; i < n; i++, off += 4) {
      const x = kind === 'w' ? (rnd() * 2 - 1) * 0.5 : kind === 'norm' ? 0.8 + 0.4 * rnd() : 0
      dv.setFloat32(off, x, true)
    }
  }
  return out
}

/** A tokenizer.bin: given pieces (text) and scores; ids 3..258 should be <0xHH>. */
export function tokenizerBytes(pieces: string[], scores: number[], maxLen?: number): Uint8Array {
  const enc = pieces.map((p) => new TextEncoder().encode(p))
  const ml = maxLen ?? Math.max(1, ...enc.map((e) => e.length))
  const out = new Uint8Array(4 + enc.reduce((a, e) => a + 8 + e.length, 0))
  const dv = new DataView(out.buffer)
  dv.setInt32(0, ml, true)
  let off = 4
  enc.forEach((e, i) => {
    dv.setFloat32(off, scores[i]!, true)
    dv.setInt32(off + 4, e.length, true)
    out.set(e, off + 8)
    off += 8 + e.length
  })
  return out
}

/** Naive, allocation-happy reference forward: logits of every position. */
export function referenceLogits(ck: LlamaCheckpoint, tokens: number[]): Float64Array[] {
  const c = ck.config
  const w = ck.weights
  const hd = c.headDim
  const kvDim = c.kvDim
  const mat = (m: Float32Array, off: number, x: number[], rows: number): number[] =>
    Array.from({ length: rows }, (_, i) => x.reduce((s, xj, j) => s + m[off + i * x.length + j]! * xj, 0))
  const norm = (x: number[], g: Float32Array, off: number): number[] => {
    const r = 1 / Math.sqrt(x.reduce((s, v) => s + v * v, 0) / x.length + 1e-5)
    return x.map((v, j) => g[off + j]! * v * r)
  }
  const rope = (v: number[], pos: number): number[] => {
    const o = v.slice()
    for (let i = 0; i < v.length; i += 2) {
      const ang = pos * 10000 ** (-(i % hd) / hd)
      o[i] = v[i]! * Math.cos(ang) - v[i + 1]! * Math.sin(ang)
      o[i + 1] = v[i]! * Math.sin(ang) + v[i + 1]! * Math.cos(ang)
    }
    return o
  }
  const K: number[][][] = Array.from({ length: c.layers }, () => [])
  const Vc: number[][][] = Array.from({ length: c.layers }, () => [])
  const out: Float64Array[] = []
  tokens.forEach((tok, pos) => {
    let x = Array.from(w.tokenEmbedding.subarray(tok * c.dim, (tok + 1) * c.dim))
    for (let l = 0; l < c.layers; l++) {
      const xb = norm(x, w.rmsAtt, l * c.dim)
      const q = rope(mat(w.wq, l * c.dim * c.dim, xb, c.dim), pos)
      K[l]!.push(rope(mat(w.wk, l * kvDim * c.dim, xb, kvDim), pos))
      Vc[l]!.push(mat(w.wv, l * kvDim * c.dim, xb, kvDim))
      const att: number[] = []
      for (let h = 0; h < c.heads; h++) {
        const g = Math.floor(h / (c.heads / c.kvHeads))
        const s = K[l]!.map(
          (k) =>
            q.slice(h * hd, (h + 1) * hd).reduce((a, qi, i) => a + qi * k[g * hd + i]!, 0) / Math.sqrt(hd),
        )
        const m = Math.max(...s)
        const e = s.map((v) => Math.exp(v - m))
        const z = e.reduce((a, b) => a + b, 0)
        for (let i = 0; i < hd; i++) att.push(Vc[l]!.reduce((a, v, t) => a + (e[t]! / z) * v[g * hd + i]!, 0))
      }
      const o = mat(w.wo, l * c.dim * c.dim, att, c.dim)
      x = x.map((v, i) => v + o[i]!)
      const xn = norm(x, w.rmsFfn, l * c.dim)
      const a = mat(w.w1, l * c.hiddenDim * c.dim, xn, c.hiddenDim)
      const b = mat(w.w3, l * c.hiddenDim * c.dim, xn, c.hiddenDim)
      const hgl = a.map((v, i) => (v / (1 + Math.exp(-v))) * b[i]!)
      const f = mat(w.w2, l * c.dim * c.hiddenDim, hgl, c.dim)
      x = x.map((v, i) => v + f[i]!)
    }
    out.push(Float64Array.from(mat(w.wcls, 0, norm(x, w.rmsFinal, 0), c.vocabSize)))
  })
  return out
}
