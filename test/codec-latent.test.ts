// Latent (MLA) chunks through every codec: one section per layer holding [token][latent]
// (no V), coded on the latent's own channels; what is refused (the K/V-only baseline, a
// section of K/V size, a split-slab object read as latent).

import { describe, expect, it } from 'vitest'
import { checkIdentity } from '../src/client/chunk-codec.ts'
import { buildCalibration, openCalibration } from '../src/codec/calibration.ts'
import { decodeChunk, decodeLayer, encodeChunk } from '../src/codec/node.ts'
import { latentTarget } from '../src/codec/params.ts'
import { FormatError } from '../src/core/errors.ts'
import { decodeHeader, encodeChunk as encodeChunkObject, sectionOf } from '../src/core/format.ts'
import { fromHex, namespaceId } from '../src/core/keys.ts'
import { chunkBytes, type Dtype, type KvGeometry, layerSlabBytes } from '../src/core/layout.ts'
import { gaussian, metaFor, relRmse, rng, tensorOf, valuesOf } from './codec-fixtures.ts'

const T = 48
/** A DeepSeek-shaped latent, scaled down: 48 compressed channels and 16 rope channels. */
const C = 64
const ROPE = 16
const latentGeometry = (dtype: Dtype): KvGeometry => ({
  layers: 3,
  kvHeads: 1,
  headDim: C,
  dtype,
  latent: true,
})

/** [layer][token][latent]: per-channel offsets and scales, token locality, larger rope channels. */
function latentKv(g: KvGeometry, tokens: number, seed: number): Float32Array {
  const n = gaussian(rng(seed))
  const out = new Float32Array(g.layers * tokens * C)
  let o = 0
  for (let l = 0; l < g.layers; l++) {
    const bias = Array.from({ length: C }, (_, ch) => (ch % 9 === 4 ? 2 : 0.1 * (ch % 3)))
    const scale = Array.from({ length: C }, (_, ch) => (ch >= C - ROPE ? 3 : 0.4 + (ch % 5) * 0.2))
    const x = new Float64Array(C).map(() => n())
    for (let t = 0; t < tokens; t++) {
      for (let ch = 0; ch < C; ch++) {
        x[ch] = 0.85 * x[ch]! + 0.5 * n()
        out[o++] = bias[ch]! + scale[ch]! * x[ch]!
      }
    }
  }
  return out
}

/** RMS error over the RMS of the channel-centred values (the latent budget's reference). */
function centredError(a: Float32Array, b: Float32Array, tokens: number): number {
  let se = 0
  let ss = 0
  for (let base = 0; base < a.length; base += tokens * C) {
    for (let ch = 0; ch < C; ch++) {
      let m = 0
      for (let t = 0; t < tokens; t++) m += a[base + t * C + ch]! / tokens
      for (let t = 0; t < tokens; t++) {
        const i = base + t * C + ch
        se += (a[i]! - b[i]!) ** 2
        ss += (a[i]! - m) ** 2
      }
    }
  }
  return Math.sqrt(se / ss)
}

describe('latent (MLA) chunks through the codecs', () => {
  for (const dtype of ['fp16', 'bf16'] as const) {
    const g = latentGeometry(dtype)
    const values = latentKv(g, T, 5)
    const tensor = tensorOf(values, dtype)

    it(`${dtype}: raw and lossless are exact; every section is one latent plane`, () => {
      expect(tensor.byteLength).toBe(chunkBytes(g, T))
      expect(layerSlabBytes(g, T)).toBe(T * C * 2)
      for (const mode of ['raw', 'lossless'] as const) {
        const obj = encodeChunk(tensor, metaFor(g, T), { mode })
        const h = decodeHeader(obj)
        expect(h.geometry).toEqual(g)
        expect(new DataView(obj.buffer, obj.byteOffset).getUint16(6, true)).toBe(2)
        if (mode === 'raw') for (const s of h.sections) expect(s.length).toBe(T * C * 2)
        expect(decodeChunk(obj)).toEqual(tensor)
        expect(decodeLayer(obj, h, 2)).toEqual(tensor.subarray(2 * T * C * 2, 3 * T * C * 2))
      }
    })

    it(`${dtype}: q8 scales each token's whole latent row`, () => {
      const obj = encodeChunk(tensor, metaFor(g, T), { mode: 'q8' })
      const h = decodeHeader(obj)
      for (const s of h.sections) expect(s.length).toBe(T * (4 + C))
      const back = valuesOf(decodeChunk(obj), dtype)
      const input = valuesOf(tensor, dtype)
      for (let row = 0; row < back.length / C; row++) {
        let mx = 0
        for (let ch = 0; ch < C; ch++) mx = Math.max(mx, Math.abs(input[row * C + ch]!))
        // Half a step of 8 bits, plus the output dtype's rounding.
        const bound = mx / 254 + mx * (dtype === 'bf16' ? 2 ** -8 : 2 ** -11) + 1e-6
        for (let ch = 0; ch < C; ch++)
          expect(Math.abs(back[row * C + ch]! - input[row * C + ch]!)).toBeLessThanOrEqual(bound)
      }
    })

    it(`${dtype}: kvgate codes one stream per layer at the latent budget`, () => {
      const obj = encodeChunk(tensor, metaFor(g, T), { mode: 'kvgate' })
      expect(obj.byteLength).toBeLessThan(tensor.byteLength / 2)
      const err = centredError(values, valuesOf(decodeChunk(obj), dtype), T)
      // One uniform step of √12·ε·rms gives an error of about ε (the dtype adds a little).
      expect(err).toBeLessThan(1.3 * latentTarget(5))
      expect(err).toBeGreaterThan(0.5 * latentTarget(5))
      // Each layer decodes alone (layer-range reads).
      const h = decodeHeader(obj)
      const whole = decodeChunk(obj)
      const slab = layerSlabBytes(g, T)
      expect(decodeLayer(obj, h, 1)).toEqual(whole.subarray(slab, 2 * slab))
      // Finer quality, smaller error.
      const fine = encodeChunk(tensor, metaFor(g, T), { mode: 'kvgate', quality: 8 })
      expect(centredError(values, valuesOf(decodeChunk(fine), dtype), T)).toBeLessThan(0.5 * err)
    })

    it(`${dtype}: a latent calibration codes latent chunks to what they decode to uncalibrated, and only them`, () => {
      const bytes = buildCalibration(
        [1, 2].map((s) => tensorOf(latentKv(g, T, s), dtype)),
        { geometry: g, dtype },
      )
      const cal = openCalibration(bytes)
      expect(cal.geometry.latent).toBe(true)
      const plain = encodeChunk(tensor, metaFor(g, T), { mode: 'kvgate' })
      const calibrated = encodeChunk(tensor, metaFor(g, T), { mode: 'kvgate', calibration: cal })
      expect(decodeHeader(calibrated).calibration).toBe(cal.hash)
      expect(decodeChunk(calibrated, { calibration: cal })).toEqual(decodeChunk(plain))
      // The same numbers without the latent flag are another geometry.
      const kv = { ...g, latent: false }
      expect(() =>
        encodeChunk(new Uint8Array(chunkBytes(kv, T)), metaFor(kv, T), { mode: 'kvgate', calibration: cal }),
      ).toThrow(/latent/)
    })
  }

  it('odd shapes: an odd latent dim (the split slab refused it), one token, fp32', () => {
    for (const [headDim, tokens, dtype] of [
      [9, 5, 'fp16'],
      [575, 1, 'bf16'],
      [3, 17, 'fp32'],
    ] as const) {
      const g: KvGeometry = { layers: 2, kvHeads: 1, headDim, dtype, latent: true }
      const n = gaussian(rng(headDim))
      const tensor = tensorOf(
        Float32Array.from({ length: 2 * tokens * headDim }, () => n()),
        dtype,
      )
      for (const mode of ['raw', 'lossless', 'q8', 'kvgate'] as const) {
        const back = decodeChunk(encodeChunk(tensor, metaFor(g, tokens), { mode }))
        if (mode === 'raw' || mode === 'lossless') expect(back, mode).toEqual(tensor)
        else {
          expect(back.byteLength, mode).toBe(tensor.byteLength)
          const err = relRmse(valuesOf(tensor, dtype), valuesOf(back, dtype))
          expect(err, mode).toBeLessThan(mode === 'q8' ? 0.02 : 0.2)
        }
      }
    }
  })

  it('the reference-cachegen baseline (K and V only) refuses latent chunks, both ways', () => {
    const g = latentGeometry('fp16')
    const tensor = tensorOf(latentKv(g, T, 3), 'fp16')
    expect(() => encodeChunk(tensor, metaFor(g, T), { mode: 'reference-cachegen' })).toThrow(/latent/)
    // A hostile writer's header: the codec byte says reference-cachegen.
    const raw = encodeChunk(tensor, metaFor(g, T), { mode: 'raw' })
    const h = decodeHeader(raw)
    const forged = encodeChunkObject(
      { ...h, codec: 'reference-cachegen', codecVersion: 1, codecParams: new Uint8Array([16, 16]) },
      h.sections.map((_, l) => sectionOf(raw, h, l)),
    )
    expect(() => decodeChunk(forged)).toThrow(/latent/)
  })

  it('a latent header over K/V-sized sections is refused before anything is decoded', () => {
    const g = latentGeometry('bf16')
    const kv = { ...g, latent: false }
    const kvTensor = tensorOf(latentKv(g, 2 * T, 4), 'bf16') // K/V slab of T tokens: 2·T·C values per layer
    expect(kvTensor.byteLength).toBe(chunkBytes(kv, T))
    for (const mode of ['raw', 'q8', 'lossless', 'kvgate'] as const) {
      const obj = encodeChunk(kvTensor, metaFor(kv, T), { mode })
      const h = decodeHeader(obj)
      const relabelled = encodeChunkObject(
        { ...h, geometry: g },
        h.sections.map((_, l) => sectionOf(obj, h, l)),
      )
      expect(() => decodeChunk(relabelled), mode).toThrow()
    }
  })

  it('an MLA chunk stored the old way (split slab: kvHeads 1, headDim latent/2) is never read as latent', () => {
    const latent = latentGeometry('bf16')
    const split: KvGeometry = { layers: latent.layers, kvHeads: 1, headDim: C / 2, dtype: 'bf16' }
    // The bytes of one chunk are the same size either way: only the header tells them apart.
    expect(chunkBytes(split, T)).toBe(chunkBytes(latent, T))
    const ns = (geometry: KvGeometry) =>
      fromHex(
        namespaceId({ modelId: 'm', geometry, chunkTokens: T, scheme: 'vllm-sha256-cbor', hashSeed: '0' }),
      )
    const meta = (geometry: KvGeometry) => ({ ...metaFor(geometry, T), namespaceId: ns(geometry) })
    const old = encodeChunk(tensorOf(latentKv(latent, T, 6), 'bf16'), meta(split), { mode: 'lossless' })
    const h = decodeHeader(old)
    expect(h.geometry).toEqual(split)
    // What a latent reader asks for: another geometry and another namespace.
    expect(() => checkIdentity(h, meta(latent))).toThrow(FormatError)
    expect(() => checkIdentity(h, { ...meta(latent), namespaceId: h.namespaceId })).toThrow(/geometry/)
    expect(() => checkIdentity(h, { ...meta(split), namespaceId: ns(latent) })).toThrow(/namespace/)
    // And the reverse: a latent chunk is not a K/V chunk of the same numbers.
    const now = decodeHeader(
      encodeChunk(new Uint8Array(chunkBytes(latent, T)), meta(latent), { mode: 'raw' }),
    )
    expect(() => checkIdentity(now, { ...meta(latent), geometry: { ...latent, latent: false } })).toThrow(
      /geometry/,
    )
  })
})
