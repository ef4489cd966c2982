import { describe, expect, it } from 'vitest'
import { decodeChunk, encodeChunk } from '../src/codec/node.ts'
import {
  findSharedData,
  HELD_OUT_STORIES,
  loadStories260k,
  meanSe,
  prepareWindows,
  protocolWindows,
  type RoundTripInfo,
  runProtocol,
} from '../src/model/index.ts'
import { metaFor } from './codec-fixtures.ts'

describe('codec protocol statistics', () => {
  it('mean ± standard error over units', () => {
    const s = meanSe([1, 0, 1, 0])
    expect(s.mean).toBe(0.5)
    expect(s.se).toBeCloseTo(Math.sqrt(1 / 3 / 4), 12)
    expect(meanSe([0.7]).se).toBe(0)
  })
})

const data = findSharedData()
describe.skipIf(!data.paths)('codec protocol on stories260K', () => {
  it('windows fit the context, start with BOS at distinct stories; a lossless codec scores exactly', () => {
    const { transformer, tokenizer } = loadStories260k()
    const seqLen = transformer.config.seqLen
    const wins = protocolWindows(tokenizer, HELD_OUT_STORIES, seqLen, 3)
    for (const w of wins) {
      expect(w.length).toBe(seqLen)
      expect(w[0]).toBe(1)
    }
    expect(new Set(wins.map((w) => w.slice(0, 8).join(','))).size).toBe(3)
    // Every step the protocol takes stays inside the context: the model would throw past MAX, so count them.
    let maxPos = 0
    const step = transformer.step.bind(transformer)
    transformer.step = (tok, cache, logits) => {
      maxPos = Math.max(maxPos, cache.length)
      return step(tok, cache, logits)
    }
    const prepared = prepareWindows(transformer, wins.slice(0, 1))
    const r = runProtocol(
      transformer,
      prepared,
      (t: Uint8Array, info: RoundTripInfo) => {
        const obj = encodeChunk(
          t,
          { ...metaFor(info.geometry, info.tokens), chunkIndex: info.chunkIndex },
          { mode: 'lossless' },
        )
        return { decoded: decodeChunk(obj), encodedBytes: obj.byteLength }
      },
      { chunkTokens: 256, prefixes: [384] },
    )
    expect(maxPos).toBe(seqLen - 1)
    expect(r.agreement.mean).toBe(1)
    expect(r.agreementPositions).toBe(seqLen - 384 + 1)
    expect(r.pplChange.mean).toBe(0)
    expect(r.kMean).toBe(0)
    expect(r.vMean).toBe(0)
    expect(r.ratio).toBeGreaterThan(1)
    expect(() =>
      runProtocol(transformer, prepared, () => new Uint8Array(0), { chunkTokens: 64, prefixes: [seqLen] }),
    ).toThrow()
  })
})
