// fp8 KV (float8_e4m3fn / float8_e5m2, vLLM's fp8 caches) is stored byte for byte: the raw and
// lossless codecs round-trip it exactly, the lossy codecs refuse it with ERR_CODEC_DTYPE (on
// encode, on a decoded header no encoder writes, and as a configured gateway codec).

import { randomBytes } from 'node:crypto'
import { describe, expect, it } from 'vitest'
import { resolveOptions } from '../src/client/config.ts'
import { decodeChunk, decodeSection, encodeChunk } from '../src/codec/node.ts'
import { decodeElements, encodeElements } from '../src/core/dtype.ts'
import { decodeHeader, encodeChunk as encodeChunkObject } from '../src/core/format.ts'
import { namespaceId } from '../src/core/keys.ts'
import { chunkBytes, type Dtype, dtypeFromCode, type KvGeometry, layerSlabBytes } from '../src/core/layout.ts'
import { metaFor } from './codec-fixtures.ts'

const fp8: Dtype[] = ['fp8e4m3', 'fp8e5m2']
const geometry = (dtype: Dtype): KvGeometry => ({ layers: 3, kvHeads: 2, headDim: 16, dtype })

/** fp8-like bytes with structure (a lossless codec has something to compress) and some noise. */
function fp8Tensor(g: KvGeometry, tokens: number): Uint8Array {
  const t = new Uint8Array(chunkBytes(g, tokens))
  const noise = randomBytes(t.length)
  for (let i = 0; i < t.length; i++) t[i] = (0x38 + ((i % 16) >> 2) + (noise[i]! & 3)) & 0xff
  return t
}

describe('fp8 KV', () => {
  for (const dtype of fp8) {
    it(`${dtype}: one byte per element; raw and lossless round-trip byte for byte`, () => {
      const g = geometry(dtype)
      expect(chunkBytes(g, 32)).toBe(2 * 3 * 32 * 2 * 16)
      const tensor = fp8Tensor(g, 32)
      for (const mode of ['raw', 'lossless'] as const) {
        const obj = encodeChunk(tensor, metaFor(g, 32), { mode })
        const h = decodeHeader(obj)
        expect(h.geometry.dtype).toBe(dtype)
        expect(h.codec).toBe(mode)
        expect(Buffer.from(decodeChunk(obj)).equals(Buffer.from(tensor))).toBe(true)
        if (mode === 'lossless') expect(obj.byteLength).toBeLessThan(tensor.byteLength)
      }
    })

    it(`${dtype}: the lossy codecs refuse it with ERR_CODEC_DTYPE`, () => {
      const g = geometry(dtype)
      const tensor = fp8Tensor(g, 32)
      for (const mode of ['kvgate', 'q8', 'reference-cachegen'] as const) {
        expect(() => encodeChunk(tensor, metaFor(g, 32), { mode })).toThrow(
          expect.objectContaining({ code: 'ERR_CODEC_DTYPE' }),
        )
      }
      // No element conversion either: fp8 never goes through floats here.
      expect(() => decodeElements(tensor, dtype)).toThrow(
        expect.objectContaining({ code: 'ERR_CODEC_DTYPE' }),
      )
      expect(() => encodeElements([1, 2], dtype)).toThrow(
        expect.objectContaining({ code: 'ERR_CODEC_DTYPE' }),
      )
    })

    it(`${dtype}: a header claiming a lossy codec for fp8 is refused on decode, never decoded`, () => {
      const g = geometry(dtype)
      // What no encoder writes: a kvgate-coded fp8 object (its sections taken from a 16-bit encode).
      const g16: KvGeometry = { ...g, dtype: 'fp16' }
      const t16 = new Uint8Array(chunkBytes(g16, 32)).fill(0x3c)
      const o16 = decodeHeader(encodeChunk(t16, metaFor(g16, 32), { mode: 'kvgate' }))
      const sections = Array.from({ length: 3 }, () => new Uint8Array(64).fill(1))
      const hostile = encodeChunkObject(
        { ...metaFor(g, 32), codec: 'kvgate', codecVersion: o16.codecVersion, codecParams: o16.codecParams },
        sections,
      )
      expect(() => decodeChunk(hostile)).toThrow(expect.objectContaining({ code: 'ERR_CODEC_DTYPE' }))
      const h = decodeHeader(hostile)
      expect(() => decodeSection(h, 0, sections[0]!, new Uint8Array(layerSlabBytes(g, 32)))).toThrow(
        expect.objectContaining({ code: 'ERR_CODEC_DTYPE' }),
      )
    })
  }

  it('dtype codes: 4 and 5 are the fp8 formats; 6 is still unknown', () => {
    expect([dtypeFromCode(4), dtypeFromCode(5), dtypeFromCode(6)]).toEqual(['fp8e4m3', 'fp8e5m2', undefined])
  })

  it('fp8 geometries have their own key namespaces (never sharing keys with 16-bit KV)', () => {
    const ns = (dtype: Dtype) =>
      namespaceId({
        modelId: 'm',
        geometry: geometry(dtype),
        chunkTokens: 256,
        scheme: 'sha256-v1',
      })
    expect(new Set([ns('fp16'), ns('fp8e4m3'), ns('fp8e5m2')]).size).toBe(3)
  })

  it('as the gateway codec: lossless by default, kvgate refused with ERR_CODEC_DTYPE', () => {
    const model = { modelId: 'm', ...geometry('fp8e4m3') }
    const remote = { url: 'http://127.0.0.1:1' }
    const codecOf = (o: ReturnType<typeof resolveOptions>) =>
      o.remote === false ? undefined : o.remote.codec
    expect(codecOf(resolveOptions({ model, remote }))).toBe('lossless')
    expect(codecOf(resolveOptions({ model, remote: { ...remote, codec: 'raw' } }))).toBe('raw')
    expect(() => resolveOptions({ model, remote: { ...remote, codec: 'kvgate' } })).toThrow(
      expect.objectContaining({ code: 'ERR_CODEC_DTYPE' }),
    )
    // 16-bit KV keeps kvgate as its default.
    expect(codecOf(resolveOptions({ model: { ...model, dtype: 'bf16' }, remote }))).toBe('kvgate')
  })
})
