import { readFileSync } from 'node:fs'
import { describe, expect, it } from 'vitest'
import { MODEL_PRESETS } from '../src/core/layout.ts'
import {
  findSharedData,
  llama2cFileBytes,
  loadCheckpointFile,
  ModelError,
  parseLlama2c,
  parseLlama2cHeader,
} from '../src/model/index.ts'
import { TINY, tinyCheckpointBytes } from './model-fixtures.ts'

function expectModelError(fn: () => unknown, message: RegExp): void {
  try {
    fn()
  } catch (e) {
    expect(e).toBeInstanceOf(ModelError)
    expect((e as ModelError).code).toBe('ERR_MODEL')
    expect((e as Error).message).toMatch(message)
    return
  }
  throw new Error('expected a ModelError')
}

function withHeader(fields: number[], extra = 0): Uint8Array {
  const b = new Uint8Array(28 + extra)
  const dv = new DataView(b.buffer)
  for (const [i, v] of fields.entries()) dv.setInt32(i * 4, v, true)
  return b
}

describe('llama2.c checkpoint parsing (synthetic files)', () => {
  it('parses a valid file into correctly placed views', () => {
    const bytes = tinyCheckpointBytes()
    const ck = parseLlama2c(bytes)
    expect(ck.config).toMatchObject({
      dim: 16,
      hiddenDim: 24,
      layers: 2,
      heads: 4,
      kvHeads: 2,
      headDim: 4,
      kvDim: 8,
    })
    expect(ck.config.sharedClassifier).toBe(true)
    expect(ck.weights.wcls).toBe(ck.weights.tokenEmbedding)
    // rmsFinal is the last tensor before the RoPE tables: check its first float in the file.
    const dv = new DataView(bytes.buffer)
    const c = ck.config
    const rmsFinalOff =
      28 + 4 * (c.vocabSize * 16 + 2 * (2 * 16) + 2 * 16 * 16 * 2 + 2 * 2 * 8 * 16 + 3 * 2 * 24 * 16)
    expect(ck.weights.rmsFinal[0]).toBe(dv.getFloat32(rmsFinalOff, true))
    expect(ck.weights.w3.length).toBe(2 * 24 * 16)
  })

  it('reads a separate classifier when vocab_size is negative', () => {
    const ck = parseLlama2c(tinyCheckpointBytes({ ...TINY, shared: false }))
    expect(ck.config.sharedClassifier).toBe(false)
    expect(ck.weights.wcls).not.toBe(ck.weights.tokenEmbedding)
    expect(ck.weights.wcls.length).toBe(TINY.vocab * TINY.dim)
  })

  it('accepts a buffer at an odd byte offset', () => {
    const bytes = tinyCheckpointBytes()
    const shifted = new Uint8Array(bytes.length + 1)
    shifted.set(bytes, 1)
    const ck = parseLlama2c(shifted.subarray(1))
    expect(Array.from(ck.weights.wo.subarray(0, 8))).toEqual(
      Array.from(parseLlama2c(bytes).weights.wo.subarray(0, 8)),
    )
  })

  it('rejects a short header', () => {
    expectModelError(() => parseLlama2c(new Uint8Array(27)), /truncated.*27 bytes/)
    expectModelError(() => parseLlama2c(new Uint8Array(0)), /truncated/)
  })

  it('rejects header fields that are zero, negative or absurd', () => {
    expectModelError(() => parseLlama2cHeader(withHeader([0, 172, 5, 8, 4, 512, 512])), /dim=0/)
    expectModelError(() => parseLlama2cHeader(withHeader([64, -1, 5, 8, 4, 512, 512])), /hidden_dim=-1/)
    expectModelError(() => parseLlama2cHeader(withHeader([64, 172, 5, 8, 4, 512, 2 ** 30])), /seq_len/)
    expectModelError(() => parseLlama2cHeader(withHeader([64, 172, 5, 8, 4, -(2 ** 31), 512])), /vocab_size/)
    expectModelError(
      () => parseLlama2cHeader(withHeader([64, 172, 5, 7, 4, 512, 512])),
      /multiple of n_heads/,
    )
    expectModelError(
      () => parseLlama2cHeader(withHeader([64, 172, 5, 8, 3, 512, 512])),
      /multiple of n_kv_heads/,
    )
    expectModelError(() => parseLlama2cHeader(withHeader([24, 172, 5, 8, 4, 512, 512])), /odd/)
  })

  it('refuses a header implying a huge model before allocating anything', () => {
    // ~ 4.4 TB implied; a 28-byte buffer must fail fast on the limit, not try to allocate.
    const bytes = withHeader([65536, 262144, 1024, 1024, 1024, 1 << 20, 1 << 20])
    expectModelError(() => parseLlama2c(bytes), /above the limit/)
    expectModelError(() => parseLlama2c(tinyCheckpointBytes(), { maxBytes: 1000 }), /above the limit of 1000/)
  })

  it('rejects truncated files and trailing bytes', () => {
    const bytes = tinyCheckpointBytes()
    expectModelError(() => parseLlama2c(bytes.subarray(0, bytes.length - 4)), /truncated/)
    expectModelError(() => parseLlama2c(bytes.subarray(0, 100)), /truncated/)
    const longer = new Uint8Array(bytes.length + 8)
    longer.set(bytes)
    expectModelError(() => parseLlama2c(longer), /8 unexpected trailing bytes/)
  })

  it('rejects non-finite weights', () => {
    const bytes = tinyCheckpointBytes()
    new DataView(bytes.buffer).setFloat32(28 + 400, Number.NaN, true)
    expectModelError(() => parseLlama2c(bytes), /weight 100 is not finite/)
    expect(() => parseLlama2c(bytes, { checkFinite: false })).not.toThrow()
  })

  it('never throws anything but ModelError on random or mutated bytes', () => {
    let seed = 7
    const rnd = () => {
      seed = (Math.imul(seed, 1103515245) + 12345) >>> 0
      return seed
    }
    const good = tinyCheckpointBytes()
    for (let i = 0; i < 300; i++) {
      const b = i % 2 ? new Uint8Array(rnd() % 200) : good.slice(0, rnd() % (good.length + 1))
      for (let j = 0; j < b.length; j++)
        if (i % 2 || j < 28) b[j] = i % 2 ? rnd() & 0xff : b[j]! ^ (rnd() % 3 === 0 ? rnd() & 0xff : 0)
      try {
        parseLlama2c(b, { maxBytes: 1 << 24 })
      } catch (e) {
        expect(e).toBeInstanceOf(ModelError)
      }
    }
  })
})

const data = findSharedData()
if (!data.paths) console.warn(`skipping real-model loader tests: ${data.reason}`)

describe.skipIf(!data.paths)('stories260K.bin', () => {
  it('has the geometry FACTS.md states and matches the stories260k preset', () => {
    const ck = loadCheckpointFile(data.paths!.model)
    expect(ck.config).toEqual({
      dim: 64,
      hiddenDim: 172,
      layers: 5,
      heads: 8,
      kvHeads: 4,
      vocabSize: 512,
      seqLen: 512,
      headDim: 8,
      kvDim: 32,
      sharedClassifier: true,
    })
    const p = MODEL_PRESETS.stories260k
    expect([ck.config.layers, ck.config.kvHeads, ck.config.headDim]).toEqual([p.layers, p.kvHeads, p.headDim])
    expect(llama2cFileBytes(ck.config)).toBe(1056540)
  })

  it('rejects the real file truncated by one byte', () => {
    const bytes = new Uint8Array(readFileSync(data.paths!.model))
    expectModelError(() => parseLlama2c(bytes.subarray(0, bytes.length - 1)), /truncated: 1056539 bytes/)
  })
})

describe('findSharedData', () => {
  it('reports an explicit KVGATE_SHARED_DATA that lacks the files', () => {
    const r = findSharedData({ KVGATE_SHARED_DATA: '/nonexistent/kvgate-data' })
    expect(r.paths).toBeUndefined()
    expect(r.reason).toMatch(/KVGATE_SHARED_DATA=\/nonexistent\/kvgate-data/)
  })

  it('installed as a dependency with nothing set, says it looked nowhere and how to point at the files', () => {
    const r = findSharedData({}, false)
    expect(r.paths).toBeUndefined()
    expect(r.reason).not.toMatch(/not found in ;/)
    expect(r.reason).toMatch(/not looked for .*; set KVGATE_SHARED_DATA \(or pass --model DIR\)$/)
  })

  it.skipIf(!data.paths)('honours KVGATE_SHARED_DATA', () => {
    const r = findSharedData({ KVGATE_SHARED_DATA: data.paths!.dir })
    expect(r.paths?.model).toBe(data.paths!.model)
  })
})
