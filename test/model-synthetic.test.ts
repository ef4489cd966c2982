import { describe, expect, it } from 'vitest'
import { chunkBytes, type KvGeometry } from '../src/core/layout.ts'
import {
  channelRms,
  deltaVarianceRatio,
  excessKurtosis,
  outlierChannels,
  planeOf,
  quantizationError,
  syntheticKv,
  Xoshiro128,
} from '../src/model/index.ts'

const G8B: KvGeometry = { layers: 32, kvHeads: 8, headDim: 128, dtype: 'bf16' }
const SMALL: KvGeometry = { layers: 3, kvHeads: 2, headDim: 64, dtype: 'fp16' }

describe('Xoshiro128', () => {
  it('is deterministic per seed and roughly uniform', () => {
    const a = new Xoshiro128(42)
    const b = new Xoshiro128(42)
    const c = new Xoshiro128(43)
    const xs = Array.from({ length: 10000 }, () => a.next())
    expect(Array.from({ length: 10000 }, () => b.next())).toEqual(xs)
    expect(c.next()).not.toBe(xs[0])
    const mean = xs.reduce((s, x) => s + x / 2 ** 32, 0) / xs.length
    expect(Math.abs(mean - 0.5)).toBeLessThan(0.02)
    expect(new Set(xs).size).toBeGreaterThan(9990)
  })
})

describe('synthetic KV (Llama-3.1-8B shape)', () => {
  const kv = syntheticKv({ seed: 3, startPosition: 512 })

  it('is a 32 MiB bf16 chunk tensor, deterministic from its seeds', () => {
    expect(kv.byteLength).toBe(32 << 20)
    expect(kv.byteLength).toBe(chunkBytes(G8B, 256))
    const small = { geometry: SMALL, tokens: 64, seed: 9 }
    expect(Buffer.from(syntheticKv(small)).equals(Buffer.from(syntheticKv(small)))).toBe(true)
    expect(Buffer.from(syntheticKv(small)).equals(Buffer.from(syntheticKv({ ...small, seed: 10 })))).toBe(
      false,
    )
  })

  it('has the locality real KV has: K deltas carry 0.1–0.35 of its variance, V deltas > 1.3×', () => {
    for (let l = 0; l < 32; l += 5) {
      const k = deltaVarianceRatio(planeOf(kv, G8B, 256, l, 0))
      const v = deltaVarianceRatio(planeOf(kv, G8B, 256, l, 1))
      expect(k, `layer ${l} K`).toBeGreaterThanOrEqual(0.1)
      expect(k, `layer ${l} K`).toBeLessThanOrEqual(0.35)
      expect(v, `layer ${l} V`).toBeGreaterThan(1.3)
      expect(v, `layer ${l} V`).toBeLessThan(2.2)
    }
  })

  it('has K outlier channels (a few % of channels at ≥4× the median RMS) and a near-Gaussian V', () => {
    for (const l of [0, 15, 31]) {
      const K = planeOf(kv, G8B, 256, l, 0)
      const out = outlierChannels(K, 4)
      expect(out.length, `layer ${l}`).toBeGreaterThanOrEqual(8)
      expect(out.length, `layer ${l}`).toBeLessThanOrEqual(80)
      expect(excessKurtosis(K)).toBeGreaterThan(3)
      expect(Math.abs(excessKurtosis(planeOf(kv, G8B, 256, l, 1)))).toBeLessThan(4)
    }
  })

  it('favours per-channel quantization for K and per-token for V, as real KV does', () => {
    for (const l of [2, 20]) {
      const K = planeOf(kv, G8B, 256, l, 0)
      const V = planeOf(kv, G8B, 256, l, 1)
      expect(quantizationError(K, { axis: 'channel' })).toBeLessThan(
        0.5 * quantizationError(K, { axis: 'token' }),
      )
      expect(quantizationError(V, { axis: 'token', group: 128 })).toBeLessThan(
        quantizationError(V, { axis: 'channel' }),
      )
    }
  })

  it('keeps channel statistics across token seeds when the model seed is the same', () => {
    const a = planeOf(syntheticKv({ geometry: SMALL, seed: 1 }), SMALL, 256, 1, 0)
    const b = planeOf(syntheticKv({ geometry: SMALL, seed: 2 }), SMALL, 256, 1, 0)
    const c = planeOf(syntheticKv({ geometry: SMALL, seed: 2, modelSeed: 7 }), SMALL, 256, 1, 0)
    const corr = (x: Float64Array, y: Float64Array): number => {
      const mx = x.reduce((s, v) => s + v, 0) / x.length
      const my = y.reduce((s, v) => s + v, 0) / y.length
      let sxy = 0
      let sxx = 0
      let syy = 0
      for (let i = 0; i < x.length; i++) {
        sxy += (x[i]! - mx) * (y[i]! - my)
        sxx += (x[i]! - mx) ** 2
        syy += (y[i]! - my) ** 2
      }
      return sxy / Math.sqrt(sxx * syy)
    }
    expect(corr(channelRms(a), channelRms(b))).toBeGreaterThan(0.9)
    expect(corr(channelRms(a), channelRms(c))).toBeLessThan(0.6)
  })

  it('supports every dtype and rope style with finite values', () => {
    for (const dtype of ['fp16', 'bf16', 'fp32'] as const) {
      for (const rope of ['half', 'adjacent', 'none'] as const) {
        const g = { ...SMALL, dtype }
        const t = syntheticKv({ geometry: g, tokens: 16, rope })
        expect(t.byteLength).toBe(chunkBytes(g, 16))
        const p = planeOf(t, g, 16, 2, 0)
        expect(p.data.every((x) => Number.isFinite(x))).toBe(true)
      }
    }
  })

  it('rejects bad options', () => {
    expect(() => syntheticKv({ tokens: 0 })).toThrow(/invalid tokens/)
    expect(() => syntheticKv({ geometry: { ...SMALL, headDim: 0 } })).toThrow(/headDim/)
    expect(() => syntheticKv({ geometry: { ...SMALL, headDim: 7 } })).toThrow(/even head dim/)
    expect(() => syntheticKv({ geometry: SMALL, startPosition: -1 })).toThrow(/startPosition/)
    expect(() => syntheticKv({ geometry: SMALL, rope: 'x' as never })).toThrow(/rope style/)
    expect(() => syntheticKv({ geometry: { ...G8B, layers: 1024 }, tokens: 1 << 16 })).toThrow(/too large/)
  })
})

describe('KV statistics', () => {
  const plane = (f: (t: number, c: number) => number, tokens = 64, channels = 8) => {
    const data = new Float32Array(tokens * channels)
    for (let t = 0; t < tokens; t++) for (let c = 0; c < channels; c++) data[t * channels + c] = f(t, c)
    return { data, tokens, channels }
  }

  it('measures delta variance: 0 for constant channels, ≈2 for white noise', () => {
    expect(deltaVarianceRatio(plane((_, c) => c * 3))).toBe(0)
    const rng = new Xoshiro128(5)
    const noise = plane(() => rng.normal(), 2000, 16)
    expect(deltaVarianceRatio(noise)).toBeGreaterThan(1.9)
    expect(deltaVarianceRatio(noise)).toBeLessThan(2.1)
  })

  it('measures quantization error along the requested axis', () => {
    // Per channel, each channel takes two values: exact at any bit width.
    const twoLevel = plane((t, c) => (t % 2) * (c + 1) * 10)
    expect(quantizationError(twoLevel, { axis: 'channel', bits: 1 })).toBe(0)
    expect(quantizationError(twoLevel, { axis: 'token', bits: 2 })).toBeGreaterThan(0.01)
    expect(() => quantizationError(twoLevel, { axis: 'token', group: 3 })).toThrow(/divide/)
  })

  it('finds an outlier channel', () => {
    expect(outlierChannels(plane((t, c) => (c === 5 ? 20 : 1) * Math.sin(t + c)))).toEqual([5])
  })
})
