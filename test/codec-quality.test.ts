import { describe, expect, it } from 'vitest'
import { type CodecMode, DEFAULT_QUALITY, decodeChunk, encodeChunk } from '../src/codec/node.ts'
import type { KvGeometry } from '../src/core/layout.ts'
import {
  evaluateCodec,
  findSharedData,
  kvRelativeError,
  loadStories260k,
  type RoundTripInfo,
  roundTripCache,
  SAMPLE_STORIES,
  syntheticKv,
} from '../src/model/index.ts'
import { metaFor } from './codec-fixtures.ts'

function roundTrip(mode: CodecMode, quality?: number) {
  return (t: Uint8Array, info: RoundTripInfo) => {
    const obj = encodeChunk(
      t,
      { ...metaFor(info.geometry, info.tokens), chunkIndex: info.chunkIndex },
      { mode, quality },
    )
    return { decoded: decodeChunk(obj), encodedBytes: obj.byteLength }
  }
}

describe('codec on Llama-3.1-8B-shaped synthetic KV (4 of 32 layers)', () => {
  it('kvgate default: ≤ 0.75× reference-cachegen bytes at lower K and V error; lossless is exact and smaller', () => {
    const g: KvGeometry = { layers: 4, kvHeads: 8, headDim: 128, dtype: 'bf16' }
    const tensor = syntheticKv({ geometry: g, tokens: 256 })
    const run = (mode: CodecMode) => {
      const obj = encodeChunk(tensor, metaFor(g, 256), { mode })
      const back = decodeChunk(obj)
      return { bytes: obj.byteLength, back, err: kvRelativeError(g, [{ exact: tensor, decoded: back }]) }
    }
    const ref = run('reference-cachegen')
    const kv = run('kvgate')
    expect(kv.bytes).toBeLessThanOrEqual(0.75 * ref.bytes)
    expect(kv.err.kAll).toBeLessThanOrEqual(ref.err.kAll)
    expect(kv.err.vAll).toBeLessThanOrEqual(ref.err.vAll)
    expect(tensor.length / kv.bytes).toBeGreaterThan(4.5)
    const ll = run('lossless')
    expect(Buffer.compare(Buffer.from(ll.back), Buffer.from(tensor))).toBe(0)
    expect(ll.bytes).toBeLessThan(0.8 * tensor.length)
  })
})

const data = findSharedData()
if (!data.paths) console.warn(`skipping real-model codec tests: ${data.reason}`)

describe.skipIf(!data.paths)('codec on real KV (stories260K)', () => {
  it('kvgate default beats reference-cachegen: ≤ 0.75× bytes at ≤ its K and V error, good continuation', () => {
    const { transformer, tokenizer } = loadStories260k()
    const ids = tokenizer.encode(SAMPLE_STORIES.join('\n'))
    const prefix = ids.slice(0, 512)
    const { cache } = transformer.prefill(prefix)
    const measure = (mode: CodecMode) => {
      const rt = roundTripCache(cache, roundTrip(mode))
      const err = kvRelativeError(
        cache.geometry('fp16'),
        rt.exact.map((e, i) => ({ exact: e, decoded: rt.roundTripped[i]! })),
      )
      return { bytes: rt.encodedBytes!, raw: rt.rawBytes, err }
    }
    const ref = measure('reference-cachegen')
    const kv = measure('kvgate')
    expect(kv.bytes).toBeLessThanOrEqual(0.75 * ref.bytes)
    expect(kv.err.kAll).toBeLessThanOrEqual(ref.err.kAll)
    expect(kv.err.vAll).toBeLessThanOrEqual(ref.err.vAll)
    expect(kv.raw / kv.bytes).toBeGreaterThan(3.5)
    const q = evaluateCodec(transformer, prefix, roundTrip('kvgate', DEFAULT_QUALITY), {
      heldOut: ids.slice(512, 640),
      agreementTokens: 64,
      attentionStride: 8,
    })
    expect(q.agreement.rate).toBeGreaterThanOrEqual(0.9)
    expect(Math.abs(q.perplexity!.relChange)).toBeLessThan(0.03)
  })

  it('lossless round-trips real KV bit-exactly', () => {
    const { transformer, tokenizer } = loadStories260k()
    const { cache } = transformer.prefill(tokenizer.encode(SAMPLE_STORIES[0]!).slice(0, 300))
    const rt = roundTripCache(cache, roundTrip('lossless'))
    for (const [i, e] of rt.exact.entries()) {
      expect(Buffer.compare(Buffer.from(e), Buffer.from(rt.roundTripped[i]!))).toBe(0)
    }
    expect(rt.encodedBytes!).toBeLessThan(rt.rawBytes)
  })
})
