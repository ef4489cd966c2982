// What FACTS.md says about stories260K's real KV, measured: grounds the synthetic
// generator and the codec's design choices (K per channel + token locality, V per token).

import { describe, expect, it } from 'vitest'
import {
  deltaVarianceRatio,
  exportChunk,
  findSharedData,
  loadStories260k,
  planeOf,
  quantizationError,
  SAMPLE_STORIES,
} from '../src/model/index.ts'

const data = findSharedData()
if (!data.paths) console.warn(`skipping real-KV statistics: ${data.reason}`)

describe.skipIf(!data.paths)('real KV of stories260K (256-token chunk)', () => {
  const load = () => {
    const { transformer, tokenizer } = loadStories260k()
    const ids = tokenizer.encode(SAMPLE_STORIES.join('\n'))
    const { cache } = transformer.prefill(ids.slice(0, 256))
    const g = transformer.geometry()
    const t = exportChunk(cache, 0, 256)
    return Array.from({ length: g.layers }, (_, l) => ({
      K: planeOf(t, g, 256, l, 0),
      V: planeOf(t, g, 256, l, 1),
    }))
  }

  it('K: per-channel 4-bit error ~0.05, about half the per-token error (~0.10)', () => {
    for (const [l, { K }] of load().entries()) {
      const ch = quantizationError(K, { axis: 'channel' })
      const tok = quantizationError(K, { axis: 'token' })
      expect(ch, `layer ${l}`).toBeGreaterThan(0.03)
      expect(ch, `layer ${l}`).toBeLessThan(0.07)
      expect(tok, `layer ${l}`).toBeGreaterThan(0.07)
      expect(tok, `layer ${l}`).toBeLessThan(0.14)
      expect(ch / tok, `layer ${l}`).toBeLessThan(0.65)
    }
  })

  it('K: consecutive-token deltas carry 0.12–0.32 of its variance', () => {
    for (const [l, { K }] of load().entries()) {
      const r = deltaVarianceRatio(K)
      expect(r, `layer ${l}`).toBeGreaterThan(0.12)
      expect(r, `layer ${l}`).toBeLessThan(0.32)
    }
  })

  it('V: deltas ~1.7× its variance, and per-token quantization beats per-channel', () => {
    const rs: number[] = []
    for (const [l, { V }] of load().entries()) {
      const r = deltaVarianceRatio(V)
      rs.push(r)
      expect(r, `layer ${l}`).toBeGreaterThan(1.4)
      expect(r, `layer ${l}`).toBeLessThan(2.1)
      expect(quantizationError(V, { axis: 'token' }), `layer ${l}`).toBeLessThan(
        quantizationError(V, { axis: 'channel' }),
      )
    }
    const mean = rs.reduce((a, b) => a + b, 0) / rs.length
    expect(mean).toBeGreaterThan(1.5)
    expect(mean).toBeLessThan(1.95)
  })
})
