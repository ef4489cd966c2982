import { describe, expect, it } from 'vitest'
import {
  type CodecMode,
  DEFAULT_QUALITY,
  decodeChunk,
  type EncodeOptions,
  encodeChunk,
  type LayerTargets,
} from '../src/codec/node.ts'
import type { KvGeometry } from '../src/core/layout.ts'
import {
  findSharedData,
  HELD_OUT_STORIES,
  kvRelativeError,
  loadStories260k,
  prepareWindows,
  protocolWindows,
  type RoundTripInfo,
  roundTripCache,
  runProtocol,
  SAMPLE_STORIES,
  syntheticKv,
} from '../src/model/index.ts'
import { metaFor } from './codec-fixtures.ts'

function roundTrip(opts: EncodeOptions) {
  return (t: Uint8Array, info: RoundTripInfo) => {
    const obj = encodeChunk(t, { ...metaFor(info.geometry, info.tokens), chunkIndex: info.chunkIndex }, opts)
    return { decoded: decodeChunk(obj), encodedBytes: obj.byteLength }
  }
}

const avg = (xs: number[]) => xs.reduce((a, x) => a + x, 0) / xs.length

interface Storage {
  bytes: number
  k: number
  v: number
}

/** kvgate error targets just within the reference's per-layer-average K and V errors (as bench/codec.ts). */
function atReferenceError(storage: (o: EncodeOptions) => Storage): { ref: Storage; kv: Storage } {
  const ref = storage({ mode: 'reference-cachegen' })
  let k = [1e-4, 4]
  let v = [1e-4, 4]
  for (let i = 0; i < 12; i++) {
    const t: LayerTargets = { kError: Math.sqrt(k[0]! * k[1]!), vError: Math.sqrt(v[0]! * v[1]!) }
    const s = storage({ mode: 'kvgate', errorTargets: t })
    k = s.k <= ref.k ? [t.kError, k[1]!] : [k[0]!, t.kError]
    v = s.v <= ref.v ? [t.vError, v[1]!] : [v[0]!, t.vError]
  }
  return { ref, kv: storage({ mode: 'kvgate', errorTargets: { kError: k[0]!, vError: v[0]! } }) }
}

describe('codec on Llama-3.1-8B-shaped synthetic KV (4 of 32 layers)', () => {
  it('kvgate at ≤ reference-cachegen per-layer K and V error: ≤ 0.75× its bytes; lossless exact', () => {
    const g: KvGeometry = { layers: 4, kvHeads: 8, headDim: 128, dtype: 'bf16' }
    const tensor = syntheticKv({ geometry: g, tokens: 256 })
    const run = (opts: EncodeOptions) => {
      const obj = encodeChunk(tensor, metaFor(g, 256), opts)
      const back = decodeChunk(obj)
      const e = kvRelativeError(g, [{ exact: tensor, decoded: back }])
      return { bytes: obj.byteLength, back, k: avg(e.k), v: avg(e.v) }
    }
    const { ref, kv } = atReferenceError(run)
    expect(kv.k).toBeLessThanOrEqual(ref.k)
    expect(kv.v).toBeLessThanOrEqual(ref.v)
    expect(kv.bytes).toBeLessThanOrEqual(0.75 * ref.bytes)
    // The default spends its budget by effect on attention: K far finer than the reference's.
    expect(run({ mode: 'kvgate' }).k).toBeLessThan(0.5 * ref.k)
    const ll = run({ mode: 'lossless' as CodecMode })
    expect(Buffer.compare(Buffer.from(ll.back), Buffer.from(tensor))).toBe(0)
    expect(ll.bytes).toBeLessThan(0.8 * tensor.length)
  })
})

const data = findSharedData()
if (!data.paths) console.warn(`skipping real-model codec tests: ${data.reason}`)

describe.skipIf(!data.paths)('codec on real KV (stories260K), inside the context', () => {
  it('the default keeps the continuation; at ≤ reference-cachegen error kvgate needs ≤ 0.75× its bytes', () => {
    const { transformer, tokenizer } = loadStories260k()
    const windows = prepareWindows(transformer, protocolWindows(tokenizer, HELD_OUT_STORIES, 512, 1))
    const q = runProtocol(transformer, windows, roundTrip({ mode: 'kvgate', quality: DEFAULT_QUALITY }), {
      chunkTokens: 64,
      prefixes: [384],
    })
    expect(q.agreement.mean).toBeGreaterThanOrEqual(0.98)
    expect(Math.abs(q.pplChange.mean)).toBeLessThan(0.01)
    const storage = (opts: EncodeOptions): Storage => {
      const rt = roundTripCache(windows[0]!.cache, roundTrip(opts), { chunkTokens: 256 })
      const e = kvRelativeError(
        windows[0]!.cache.geometry('fp16'),
        rt.exact.map((x, i) => ({ exact: x, decoded: rt.roundTripped[i]! })),
      )
      return { bytes: rt.encodedBytes!, k: avg(e.k), v: avg(e.v) }
    }
    const { ref, kv } = atReferenceError(storage)
    expect(kv.k).toBeLessThanOrEqual(ref.k)
    expect(kv.v).toBeLessThanOrEqual(ref.v)
    expect(kv.bytes).toBeLessThanOrEqual(0.75 * ref.bytes)
  })

  it('lossless round-trips real KV bit-exactly', () => {
    const { transformer, tokenizer } = loadStories260k()
    const { cache } = transformer.prefill(tokenizer.encode(SAMPLE_STORIES[0]!).slice(0, 300))
    const rt = roundTripCache(cache, roundTrip({ mode: 'lossless' }))
    for (const [i, e] of rt.exact.entries()) {
      expect(Buffer.compare(Buffer.from(e), Buffer.from(rt.roundTripped[i]!))).toBe(0)
    }
    expect(rt.encodedBytes!).toBeLessThan(rt.rawBytes)
  })
})
