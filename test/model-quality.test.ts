import { describe, expect, it } from 'vitest'
import { encodeElements } from '../src/core/dtype.ts'
import type { KvGeometry } from '../src/core/layout.ts'
import {
  evaluateCodec,
  exportChunk,
  findSharedData,
  kvRelativeError,
  loadStories260k,
  ModelError,
  nextTokenAgreement,
  parseLlama2c,
  perplexityChange,
  type RoundTripInfo,
  roundTripCache,
  SAMPLE_STORIES,
  Transformer,
  uniformQuantRoundTrip,
} from '../src/model/index.ts'
import { tinyCheckpointBytes } from './model-fixtures.ts'

const tiny = () => new Transformer(parseLlama2c(tinyCheckpointBytes()))
const PREFIX = Array.from({ length: 40 }, (_, i) => (i * 7 + 1) % 40)
const identity = (t: Uint8Array) => t

describe('kvRelativeError', () => {
  const g: KvGeometry = { layers: 2, kvHeads: 1, headDim: 2, dtype: 'fp32' }
  // 3 tokens; layer 0 K exact, layer 0 V off by 10%, layer 1 K off by a constant, layer 1 V exact.
  const exact = Float32Array.from([1, 2, 3, 4, 5, 6, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 7, 8, 9, 1, 2, 3])
  const decoded = Float32Array.from(exact)
  for (let i = 6; i < 12; i++) decoded[i] = exact[i]! * 1.1
  for (let i = 12; i < 18; i++) decoded[i] = exact[i]! + 1

  it('reports per-layer and pooled relative RMSE', () => {
    const e = kvRelativeError(g, [
      { exact: encodeElements(exact, 'fp32'), decoded: encodeElements(decoded, 'fp32') },
    ])
    expect(e.k[0]).toBe(0)
    expect(e.v[0]).toBeCloseTo(0.1, 6)
    expect(e.k[1]).toBeCloseTo(0.5, 6)
    expect(e.v[1]).toBe(0)
    expect(e.vAll).toBeCloseTo(Math.sqrt(0.06 / (6 + 208)), 6)
    // Layer 1 K is constant per channel: any error is infinite relative to its (zero) spread.
    expect(e.kCentered[1]).toBe(Number.POSITIVE_INFINITY)
  })

  it('rejects mismatched tensors', () => {
    expect(() =>
      kvRelativeError(g, [{ exact: encodeElements(exact, 'fp32'), decoded: new Uint8Array(4) }]),
    ).toThrow(ModelError)
  })
})

describe('codec quality harness (tiny model)', () => {
  it('scores an identity round trip as perfect', () => {
    const r = evaluateCodec(tiny(), PREFIX, identity, {
      chunkTokens: 16,
      heldOut: [3, 4, 5, 6, 7],
      agreementTokens: 10,
    })
    expect(r.chunks).toBe(3)
    expect(r.kv.kAll).toBe(0)
    expect(r.kv.vAll).toBe(0)
    expect(r.attention.all).toBe(0)
    expect(r.agreement.rate).toBe(1)
    expect(r.agreement.firstDivergence).toBe(-1)
    expect(r.perplexity!.relChange).toBe(0)
    expect(r.ratio).toBeUndefined()
  })

  it('hands the codec each chunk with its position and reports encoded sizes', () => {
    const seen: RoundTripInfo[] = []
    const r = evaluateCodec(
      tiny(),
      PREFIX,
      (t, info) => {
        seen.push(info)
        t.fill(0) // a codec scribbling on its input must not corrupt the exact reference
        return {
          decoded: exportChunk(tiny().prefill(PREFIX).cache, info.start, info.start + info.tokens),
          encodedBytes: 100,
        }
      },
      { chunkTokens: 16 },
    )
    expect(seen.map((s) => [s.chunkIndex, s.start, s.tokens])).toEqual([
      [0, 0, 16],
      [1, 16, 16],
      [2, 32, 8],
    ])
    expect(seen[0]!.geometry).toEqual({ layers: 2, kvHeads: 2, headDim: 4, dtype: 'fp16' })
    expect(r.kv.kAll).toBe(0)
    expect(r.encodedBytes).toBe(300)
    expect(r.ratio).toBeCloseTo(r.rawBytes / 300)
  })

  it('ranks coarser quantization as worse on every metric', () => {
    const t = tiny()
    const fine = evaluateCodec(t, PREFIX, uniformQuantRoundTrip({ kLevels: 64, vLevels: 64 }), {
      chunkTokens: 16,
    })
    const coarse = evaluateCodec(t, PREFIX, uniformQuantRoundTrip({ kLevels: 4, vLevels: 4 }), {
      chunkTokens: 16,
    })
    expect(fine.kv.kAll).toBeGreaterThan(0)
    expect(coarse.kv.kAll).toBeGreaterThan(2 * fine.kv.kAll)
    expect(coarse.kv.vAll).toBeGreaterThan(2 * fine.kv.vAll)
    expect(coarse.attention.all).toBeGreaterThan(fine.attention.all)
  })

  it('detects destroyed KV in agreement and perplexity', () => {
    const t = tiny()
    const exact = t.prefill(PREFIX).cache
    const zeroV = roundTripCache(exact, (x, { geometry: g, tokens }) => {
      const y = x.slice()
      const plane = tokens * g.kvHeads * g.headDim * 2
      for (let l = 0; l < g.layers; l++) y.fill(0, (2 * l + 1) * plane, (2 * l + 2) * plane)
      return y
    })
    const a = nextTokenAgreement(t, PREFIX, exact, zeroV.decoded, 20)
    expect(a.rate).toBeLessThan(1)
    expect(a.firstDivergence).toBeGreaterThanOrEqual(0)
    expect(a.continuation).toHaveLength(20)
    const p = perplexityChange(t, PREFIX, exact, zeroV.decoded, [5, 6, 7, 8, 9, 10])
    expect(p.relChange).not.toBe(0)
    expect(p.exact).toBeGreaterThan(1)
  })

  it('rejects round trips that return the wrong size', () => {
    const t = tiny()
    const { cache } = t.prefill(PREFIX)
    expect(() => roundTripCache(cache, (x) => x.subarray(2))).toThrow(/expected a \d+-byte chunk tensor/)
    expect(() => roundTripCache(cache, () => undefined as unknown as Uint8Array)).toThrow(/no bytes/)
    expect(() => roundTripCache(cache, identity, { tokens: 41 })).toThrow(/outside/)
    expect(() => uniformQuantRoundTrip({ kLevels: 1 })).toThrow(/levels/)
  })
})

const data = findSharedData()
if (!data.paths) console.warn(`skipping real-model codec quality tests: ${data.reason}`)

describe.skipIf(!data.paths)('codec quality on stories260K', () => {
  it('reproduces the orientation points: 16 levels ≫ 8 levels, identity perfect', () => {
    const { transformer, tokenizer } = loadStories260k()
    const ids = tokenizer.encode(SAMPLE_STORIES.join('\n'))
    const prefix = ids.slice(0, 512)
    const heldOut = ids.slice(512, 640)
    const opts = { heldOut, agreementTokens: 64, attentionStride: 8 }
    const id = evaluateCodec(transformer, prefix, identity, opts)
    expect(id.agreement.rate).toBe(1)
    expect(id.perplexity!.relChange).toBe(0)
    const q16 = evaluateCodec(transformer, prefix, uniformQuantRoundTrip({ kLevels: 16, vLevels: 16 }), opts)
    const q8 = evaluateCodec(transformer, prefix, uniformQuantRoundTrip({ kLevels: 8, vLevels: 8 }), opts)
    // FACTS.md: per-channel 4-bit K error ~0.05.
    expect(q16.kv.kAll).toBeGreaterThan(0.03)
    expect(q16.kv.kAll).toBeLessThan(0.07)
    expect(q8.kv.kAll).toBeGreaterThan(1.8 * q16.kv.kAll)
    expect(q8.attention.all).toBeGreaterThan(q16.attention.all)
    expect(q16.agreement.rate).toBeGreaterThanOrEqual(0.85)
    expect(Math.abs(q16.perplexity!.relChange)).toBeLessThan(0.05)
  })
})
