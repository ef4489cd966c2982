import { describe, expect, it } from 'vitest'
import { DEFAULT_QUALITY, decodeChunk, encodeChunk, LOGIT_SPREAD, layerTargets } from '../src/codec/node.ts'
import { decodeHeader } from '../src/core/format.ts'
import type { KvGeometry } from '../src/core/layout.ts'
import { kvRelativeError } from '../src/model/index.ts'
import { metaFor, syntheticKv, tensorOf } from './codec-fixtures.ts'

describe('kvgate error targets', () => {
  it('levels split an attention-output budget: K finer by the logit spread, √2 per level', () => {
    for (let q = 1; q < 9; q++) {
      const a = layerTargets(q, 0, 8)
      const b = layerTargets(q + 1, 0, 8)
      expect(a.vError / a.kError).toBeCloseTo(LOGIT_SPREAD, 9)
      expect(b.kError).toBeLessThan(a.kError)
      expect(b.vError).toBeLessThan(a.vError)
    }
    expect(layerTargets(DEFAULT_QUALITY, 0, 8).vError).toBeCloseTo(0.14 / Math.SQRT2, 9)
  })

  it('hits its targets: K against the channel-centred RMS, V against the RMS, whatever the chunk length', () => {
    const g: KvGeometry = { layers: 2, kvHeads: 4, headDim: 32, dtype: 'fp32' }
    for (const tokens of [64, 256]) {
      const tensor = tensorOf(syntheticKv(g, tokens, 7), 'fp32')
      const obj = encodeChunk(tensor, metaFor(g, tokens), {
        mode: 'kvgate',
        errorTargets: { kError: 0.02, vError: 0.1 },
      })
      expect(decodeHeader(obj).codecParams[0]).toBe(0)
      const e = kvRelativeError(g, [{ exact: tensor, decoded: decodeChunk(obj) }])
      for (let l = 0; l < g.layers; l++) {
        expect(e.kCentered[l]!).toBeGreaterThan(0.015)
        expect(e.kCentered[l]!).toBeLessThan(0.025)
        expect(e.v[l]!).toBeGreaterThan(0.08)
        expect(e.v[l]!).toBeLessThan(0.12)
      }
    }
  })

  it('coarse steps (very skewed symbol tables) still decode: the rANS reciprocal is exact up to 2^32', () => {
    // Before the fix, states ≥ 2^31 of symbols with freq > 1024 could be coded one slot off.
    for (const [t, c] of [
      [64, 256],
      [256, 256],
      [128, 512],
    ] as const) {
      const g: KvGeometry = { layers: 1, kvHeads: c / 64, headDim: 64, dtype: 'fp16' }
      for (let seed = 1; seed <= 4; seed++) {
        const tensor = tensorOf(syntheticKv(g, t, seed), 'fp16')
        for (const vError of [0.5, 0.7, 1, 1.5, 2, 3]) {
          const obj = encodeChunk(tensor, metaFor(g, t), {
            mode: 'kvgate',
            errorTargets: { kError: 0.05, vError },
          })
          expect(decodeChunk(obj).byteLength).toBe(tensor.byteLength)
        }
      }
    }
  })

  it('rejects bad targets and targets with a quality or another mode', () => {
    const g: KvGeometry = { layers: 1, kvHeads: 1, headDim: 8, dtype: 'fp16' }
    const tensor = tensorOf(syntheticKv(g, 4, 1), 'fp16')
    const enc = (o: object) => () => encodeChunk(tensor, metaFor(g, 4), o as never)
    expect(enc({ mode: 'kvgate', errorTargets: { kError: 0, vError: 0.1 } })).toThrow(/errorTargets/)
    expect(enc({ mode: 'kvgate', errorTargets: { kError: Number.NaN, vError: 0.1 } })).toThrow(/errorTargets/)
    expect(enc({ mode: 'kvgate', quality: 5, errorTargets: { kError: 0.1, vError: 0.1 } })).toThrow(
      /errorTargets/,
    )
    expect(enc({ mode: 'q8', errorTargets: { kError: 0.1, vError: 0.1 } })).toThrow(/errorTargets/)
  })
})
