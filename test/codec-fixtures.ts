// Small deterministic KV fixtures for the codec tests: keys with outlier channels
// and token locality, near-Gaussian values, in any dtype and odd shapes.

import type { ChunkInfo } from '../src/codec/index.ts'
import { decodeElements, encodeElements } from '../src/core/dtype.ts'
import type { Dtype, KvGeometry } from '../src/core/layout.ts'

export function rng(seed: number): () => number {
  let s = seed >>> 0 || 1
  return () => {
    s ^= s << 13
    s >>>= 0
    s ^= s >>> 17
    s ^= s << 5
    s >>>= 0
    return s / 4294967296
  }
}

export function gaussian(r: () => number): () => number {
  return () => Math.sqrt(-2 * Math.log(r() + 1e-12)) * Math.cos(2 * Math.PI * r())
}

/** Float32 chunk tensor values, [layer][K|V][token][channel]. */
export function syntheticKv(g: KvGeometry, tokens: number, seed = 1): Float32Array {
  const c = g.kvHeads * g.headDim
  const out = new Float32Array(g.layers * 2 * tokens * c)
  const n = gaussian(rng(seed))
  let o = 0
  for (let l = 0; l < g.layers; l++) {
    const chScale = Array.from({ length: c }, (_, i) => (i % 7 === 3 ? 6 : 0.5 + (i % 5) * 0.3))
    const chBias = Array.from({ length: c }, (_, i) => (i % 11 === 2 ? 3 : 0))
    const k = new Float64Array(c).map(() => n())
    for (let t = 0; t < tokens; t++) {
      for (let ch = 0; ch < c; ch++) {
        k[ch] = 0.9 * k[ch]! + 0.44 * n()
        out[o++] = chBias[ch]! + chScale[ch]! * k[ch]!
      }
    }
    for (let t = 0; t < tokens; t++) for (let ch = 0; ch < c; ch++) out[o++] = 0.8 * n()
  }
  return out
}

export function tensorOf(values: Float32Array, dtype: Dtype): Uint8Array {
  return encodeElements(values, dtype)
}

export function valuesOf(tensor: Uint8Array, dtype: Dtype): Float32Array {
  return decodeElements(tensor, dtype)
}

export function metaFor(geometry: KvGeometry, tokens: number): ChunkInfo {
  return {
    geometry,
    tokens,
    chunkIndex: 3,
    partial: false,
    namespaceId: new Uint8Array(16).fill(7),
    chainKey: new Uint8Array(32).fill(1),
    parentKey: new Uint8Array(32).fill(2),
  }
}

/** ||a − b|| / ||a|| over a range of elements. */
export function relRmse(a: Float32Array, b: Float32Array, from = 0, to = a.length): number {
  let se = 0
  let ss = 0
  for (let i = from; i < to; i++) {
    se += (a[i]! - b[i]!) ** 2
    ss += a[i]! ** 2
  }
  return Math.sqrt(se / (ss || 1))
}
