import { describe, expect, it } from 'vitest'
import { decodeChunk, encodeChunk, LARGE_MODEL_SPLIT, lmcacheSplit } from '../src/codec/node.ts'
import { decodeHeader, encodeChunk as encodeChunkObject, sectionOf } from '../src/core/format.ts'
import type { KvGeometry } from '../src/core/layout.ts'
import { kvRelativeError } from '../src/model/index.ts'
import { metaFor, syntheticKv, tensorOf } from './codec-fixtures.ts'

describe('reference-cachegen is split as LMCache splits it for the model', () => {
  it('follows CacheGenConfig.from_model_name: < 10 layers → 32 bins everywhere, else K 0–9 and V 0–1', () => {
    expect(lmcacheSplit(5)).toEqual({ k: 5, v: 5 })
    expect(lmcacheSplit(9)).toEqual({ k: 9, v: 9 })
    expect(lmcacheSplit(10)).toEqual({ k: 10, v: 2 })
    expect(lmcacheSplit(32)).toEqual(LARGE_MODEL_SPLIT)
  })

  it('names its split in the header; a 5-layer chunk gets 32-bin V in every layer (lower V error)', () => {
    const g: KvGeometry = { layers: 5, kvHeads: 2, headDim: 8, dtype: 'fp16' }
    const tensor = tensorOf(syntheticKv(g, 64, 3), 'fp16')
    const dflt = encodeChunk(tensor, metaFor(g, 64), { mode: 'reference-cachegen' })
    const large = encodeChunk(tensor, metaFor(g, 64), {
      mode: 'reference-cachegen',
      cachegenSplit: LARGE_MODEL_SPLIT,
    })
    expect(Array.from(decodeHeader(dflt).codecParams.subarray(0, 3))).toEqual([5, 5, 0])
    expect(Array.from(decodeHeader(large).codecParams.subarray(0, 3))).toEqual([10, 2, 0])
    const e = (obj: Uint8Array) => kvRelativeError(g, [{ exact: tensor, decoded: decodeChunk(obj) }])
    const a = e(dflt)
    const b = e(large)
    // Layers 2–4: 32 vs 16 bins for V; K is 32 bins in both (layers < 10).
    for (let l = 2; l < 5; l++) expect(a.v[l]!).toBeLessThan(0.7 * b.v[l]!)
    expect(a.k).toEqual(b.k)
  })

  it("decodes with the header's split: chunks written with the fixed 10 / 2 split stay readable", () => {
    const g: KvGeometry = { layers: 3, kvHeads: 1, headDim: 8, dtype: 'fp16' }
    const tensor = tensorOf(syntheticKv(g, 16, 4), 'fp16')
    const old = encodeChunk(tensor, metaFor(g, 16), {
      mode: 'reference-cachegen',
      cachegenSplit: LARGE_MODEL_SPLIT,
    })
    const back = decodeChunk(old)
    // Decoding those sections with any other split would misread the bins: re-label the header and compare.
    const h = decodeHeader(old)
    const sections = Array.from({ length: g.layers }, (_, l) => sectionOf(old, h, l))
    const relabelled = encodeChunkObject({ ...h, codecParams: new Uint8Array([3, 3]) }, sections)
    expect(Buffer.compare(Buffer.from(decodeChunk(relabelled)), Buffer.from(back))).not.toBe(0)
    expect(() =>
      encodeChunk(tensor, metaFor(g, 16), { mode: 'reference-cachegen', cachegenSplit: { k: 300, v: 0 } }),
    ).toThrow(/0\.\.255/)
  })
})
