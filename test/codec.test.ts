import { describe, expect, it } from 'vitest'
import {
  CODEC_MODES,
  type CodecMode,
  decodeChunk,
  decodeChunkInto,
  decodeLayer,
  decodeSection,
  encodeChunk,
} from '../src/codec/node.ts'
import { wasmCodec } from '../src/codec/runtime.ts'
import { encodeElements, f32ToBf16, f32ToF16 } from '../src/core/dtype.ts'
import { decodeHeader, encodeChunk as encodeChunkObject, sectionOf } from '../src/core/format.ts'
import { chunkBytes, type Dtype, type KvGeometry, layerSlabBytes } from '../src/core/layout.ts'
import { metaFor, relRmse, syntheticKv, tensorOf, valuesOf } from './codec-fixtures.ts'

const DTYPES: Dtype[] = ['fp16', 'bf16', 'fp32']
// Odd shapes: one token, channel counts that are not multiples of 4/8, a
// token count that is not a multiple of the rANS interleave.
const SHAPES: { g: Omit<KvGeometry, 'dtype'>; tokens: number }[] = [
  { g: { layers: 2, kvHeads: 4, headDim: 8 }, tokens: 64 },
  { g: { layers: 1, kvHeads: 1, headDim: 3 }, tokens: 1 },
  { g: { layers: 3, kvHeads: 3, headDim: 5 }, tokens: 37 },
  { g: { layers: 2, kvHeads: 2, headDim: 16 }, tokens: 2 },
]
const LOSSY_BOUND: Record<CodecMode, number> = {
  raw: 0,
  lossless: 0,
  kvgate: 0.08,
  q8: 0.02,
  'reference-cachegen': 0.12,
}

describe('codec round trips', () => {
  for (const mode of CODEC_MODES) {
    for (const dtype of DTYPES) {
      it(`${mode} / ${dtype} over odd shapes`, () => {
        for (const { g: shape, tokens } of SHAPES) {
          const g = { ...shape, dtype }
          const vals = syntheticKv(g, tokens, 11)
          const tensor = tensorOf(vals, dtype)
          const obj = encodeChunk(tensor, metaFor(g, tokens), { mode })
          const header = decodeHeader(obj)
          expect(header.codec).toBe(mode)
          expect(header.geometry).toEqual(g)
          const back = decodeChunk(obj)
          expect(back.byteLength).toBe(chunkBytes(g, tokens))
          if (mode === 'raw' || mode === 'lossless') {
            expect(Buffer.compare(Buffer.from(back), Buffer.from(tensor))).toBe(0)
          } else {
            const err = relRmse(valuesOf(tensor, dtype), valuesOf(back, dtype))
            expect(err).toBeLessThan(LOSSY_BOUND[mode] + (dtype === 'bf16' ? 0.01 : 0))
            expect(err).toBeGreaterThan(0)
          }
        }
      })
    }
  }

  it('lossless keeps exact bits of NaN, Inf, subnormals and -0', () => {
    const g: KvGeometry = { layers: 1, kvHeads: 1, headDim: 8, dtype: 'fp16' }
    const tensor = new Uint8Array(chunkBytes(g, 5))
    const u16 = new Uint16Array(tensor.buffer)
    const specials = [0x7e00, 0x7c00, 0xfc00, 0x0001, 0x8000, 0x7bff, 0x0400, 0xffff]
    for (let i = 0; i < u16.length; i++) u16[i] = specials[i % specials.length]!
    const back = decodeChunk(encodeChunk(tensor, metaFor(g, 5), { mode: 'lossless' }))
    expect(Array.from(new Uint16Array(back.buffer))).toEqual(Array.from(u16))
  })

  it('lossy modes survive NaN and Inf inputs without poisoning the layer', () => {
    const g: KvGeometry = { layers: 1, kvHeads: 2, headDim: 8, dtype: 'fp32' }
    const vals = syntheticKv(g, 16, 5)
    vals[3] = Number.NaN
    vals[40] = Number.POSITIVE_INFINITY
    for (const mode of ['kvgate', 'q8', 'reference-cachegen'] as const) {
      const back = valuesOf(
        decodeChunk(encodeChunk(tensorOf(vals, 'fp32'), metaFor(g, 16), { mode })),
        'fp32',
      )
      expect(back.every((v) => Number.isFinite(v))).toBe(true)
      expect(Math.abs(back[100]! - vals[100]!)).toBeLessThan(0.5)
    }
  })

  it('kvgate compresses structured KV well below fp16 and quality levels are monotone', () => {
    const g: KvGeometry = { layers: 2, kvHeads: 4, headDim: 32, dtype: 'fp16' }
    const vals = syntheticKv(g, 256, 3)
    const tensor = tensorOf(vals, 'fp16')
    const sizes: number[] = []
    const errs: number[] = []
    for (const quality of [1, 5, 9]) {
      const obj = encodeChunk(tensor, metaFor(g, 256), { mode: 'kvgate', quality })
      sizes.push(obj.byteLength)
      errs.push(relRmse(valuesOf(tensor, 'fp16'), valuesOf(decodeChunk(obj), 'fp16')))
    }
    expect(tensor.byteLength / sizes[1]!).toBeGreaterThan(3)
    expect(sizes[0]).toBeLessThan(sizes[1]!)
    expect(sizes[1]).toBeLessThan(sizes[2]!)
    expect(errs[0]).toBeGreaterThan(errs[1]!)
    expect(errs[1]).toBeGreaterThan(errs[2]!)
  })

  it('lossless is smaller than raw on KV-like data', () => {
    const g: KvGeometry = { layers: 2, kvHeads: 4, headDim: 32, dtype: 'bf16' }
    const tensor = tensorOf(syntheticKv(g, 128, 4), 'bf16')
    const obj = encodeChunk(tensor, metaFor(g, 128), { mode: 'lossless' })
    expect(obj.byteLength).toBeLessThan(tensor.byteLength * 0.9)
  })
})

describe('kvgate symbol statistics', () => {
  it('large streams (tables from sampled rows) still code symbols that occur only in unsampled rows', () => {
    // 256 tokens × 256 channels: the encoder counts every 4th row; outliers sit in
    // rows 1, 2, 3, 5 and 7 only, giving residual symbols (direct and escaped) that
    // the counted rows never see. A symbol without a frequency would corrupt the stream.
    const g: KvGeometry = { layers: 1, kvHeads: 2, headDim: 128, dtype: 'fp32' }
    const t = 256
    const c = 256
    const vals = syntheticKv(g, t, 21)
    const spikes: [number, number, number][] = [
      [1, 5, 40],
      [2, 77, -300],
      [3, 130, 2500],
      [5, 201, 9],
      [7, 255, -600],
    ]
    for (const [row, ch, v] of spikes) {
      vals[row * c + ch] = v
      vals[t * c + row * c + ch] = v
    }
    const tensor = tensorOf(vals, 'fp32')
    // Half a K step (channel range / levels) at most, with room for V's coarser steps.
    for (const [quality, tol] of [
      [1, 0.12],
      [5, 0.04],
      [9, 0.01],
    ] as const) {
      const back = valuesOf(
        decodeChunk(encodeChunk(tensor, metaFor(g, t), { mode: 'kvgate', quality })),
        'fp32',
      )
      for (const [row, ch, v] of spikes) {
        for (const i of [row * c + ch, t * c + row * c + ch]) {
          expect(Math.abs(back[i]! - v)).toBeLessThanOrEqual(Math.abs(v) * tol + 5)
        }
      }
      expect(relRmse(vals, back)).toBeLessThan(0.2)
    }
  })
})

describe('wasm output conversion', () => {
  it('fp16/bf16 output equals round-to-nearest-even of the fp32 reconstruction, subnormals and overflow included', () => {
    // A kvgate section does not depend on the output dtype: decode one section three
    // ways and check the SIMD conversions against src/core/dtype.ts bit for bit.
    const t = 64
    const c = 24
    let subnormals = 0
    let infinities = 0
    for (const mags of [
      [2e-6, 1e-5, 3e-5, 1e-4],
      [0.01, 1, 300, 2000],
      [30000, 60000, 65000, 70000],
    ]) {
      const vals = new Float32Array(2 * t * c)
      for (let i = 0; i < vals.length; i++) vals[i] = Math.sin(i * 0.61) * mags[i % 4]!
      const slab = new Uint8Array(vals.buffer)
      // Fine per-channel K steps and per-token V steps.
      const params = new Float32Array([0, 0, 0, 0, 1, 8, 1000, 1000])
      const sec = wasmCodec().encodeSection('kvgate', slab, 3, t, c, params)
      const f32 = new Uint8Array(2 * t * c * 4)
      const f16 = new Uint8Array(2 * t * c * 2)
      const b16 = new Uint8Array(2 * t * c * 2)
      wasmCodec().decodeSection('kvgate', sec, 3, t, c, f32)
      wasmCodec().decodeSection('kvgate', sec, 1, t, c, f16)
      wasmCodec().decodeSection('kvgate', sec, 2, t, c, b16)
      const x = new Float32Array(f32.buffer)
      const h = new Uint16Array(f16.buffer)
      const b = new Uint16Array(b16.buffer)
      for (let i = 0; i < x.length; i++) {
        if (h[i] !== f32ToF16(x[i]!) || b[i] !== f32ToBf16(x[i]!)) {
          throw new Error(`element ${i}: ${x[i]} → fp16 ${h[i]} / bf16 ${b[i]}`)
        }
        if ((h[i]! & 0x7c00) === 0 && (h[i]! & 0x3ff) !== 0) subnormals++
        if ((h[i]! & 0x7fff) === 0x7c00) infinities++
      }
    }
    expect(subnormals).toBeGreaterThan(100)
    expect(infinities).toBeGreaterThan(10)
  })
})

describe('wasm input conversion', () => {
  it('reads fp16 and bf16 inputs exactly: subnormals, the normal boundary, large values, ±Inf and NaN', () => {
    const t = 32
    const c = 16
    // Per-channel K steps of range/1000 make any misread input stand out; each
    // stream keeps magnitudes within a few × of each other so no step hits its floor.
    for (const mags of [
      [3e-7, 5e-7, 2e-7, 4e-7],
      [6e-5, 1e-4, 5e-5, 8e-5],
      [30000, 60000, 40000, 50000],
    ]) {
      for (const [dtype, code] of [
        ['fp16', 1],
        ['bf16', 2],
      ] as const) {
        const vals = new Float32Array(2 * t * c)
        for (let i = 0; i < vals.length; i++) vals[i] = Math.cos(i * 0.37) * mags[i % 4]!
        vals[5] = Number.POSITIVE_INFINITY
        vals[6] = Number.NaN
        const tensor = tensorOf(vals, dtype)
        const exact = valuesOf(tensor, dtype)
        const params = new Float32Array([0, 0, 0, 0, 0, 8, 1000, 1000])
        const sec = wasmCodec().encodeSection('kvgate', tensor, code, t, c, params)
        const out = new Uint8Array(2 * t * c * 4)
        wasmCodec().decodeSection('kvgate', sec, 3, t, c, out)
        const back = new Float32Array(out.buffer)
        for (let ch = 0; ch < c; ch++) {
          const col = Array.from({ length: t }, (_, tt) => exact[tt * c + ch]!).filter(Number.isFinite)
          const tol = (Math.max(...col) - Math.min(...col)) / 1000
          for (let tt = 0; tt < t; tt++) {
            const i = tt * c + ch
            if (Number.isFinite(exact[i]!)) expect(Math.abs(back[i]! - exact[i]!)).toBeLessThanOrEqual(tol)
          }
        }
      }
    }
  })
})

describe('layer-wise decode', () => {
  it('each section decodes on its own, equal to the matching slab of decodeChunk', () => {
    const g: KvGeometry = { layers: 4, kvHeads: 2, headDim: 8, dtype: 'fp16' }
    const tensor = tensorOf(syntheticKv(g, 20, 9), 'fp16')
    for (const mode of CODEC_MODES) {
      const obj = encodeChunk(tensor, metaFor(g, 20), { mode })
      const header = decodeHeader(obj)
      const whole = decodeChunk(obj)
      const slab = layerSlabBytes(g, 20)
      for (const layer of [3, 0, 2, 1]) {
        const part = decodeSection(header, layer, sectionOf(obj, header, layer).slice())
        expect(
          Buffer.compare(Buffer.from(part), Buffer.from(whole.subarray(layer * slab, (layer + 1) * slab))),
        ).toBe(0)
        const into = new Uint8Array(slab)
        expect(decodeLayer(obj, header, layer, into)).toBe(into)
        expect(Buffer.compare(Buffer.from(into), Buffer.from(part))).toBe(0)
      }
    }
  })

  it('decodeChunkInto fills a caller buffer and checks its size', () => {
    const g: KvGeometry = { layers: 2, kvHeads: 2, headDim: 8, dtype: 'bf16' }
    const tensor = tensorOf(syntheticKv(g, 9, 2), 'bf16')
    const obj = encodeChunk(tensor, metaFor(g, 9), { mode: 'lossless' })
    const out = new Uint8Array(tensor.byteLength)
    expect(decodeChunkInto(obj, out).tokens).toBe(9)
    expect(Buffer.compare(Buffer.from(out), Buffer.from(tensor))).toBe(0)
    expect(() => decodeChunkInto(obj, new Uint8Array(tensor.byteLength - 2))).toThrow(/output must be/)
  })

  it('every codec decodes into a caller buffer at any byte offset (a Node Buffer slice, a packed slot)', () => {
    for (const dtype of ['fp16', 'bf16', 'fp32'] as const) {
      const g: KvGeometry = { layers: 2, kvHeads: 2, headDim: 8, dtype }
      const tensor = tensorOf(syntheticKv(g, 9, 4), dtype)
      for (const mode of CODEC_MODES) {
        const obj = encodeChunk(tensor, metaFor(g, 9), { mode })
        const whole = decodeChunk(obj)
        for (const shift of [1, 2, 3]) {
          const out = new Uint8Array(new ArrayBuffer(whole.byteLength + shift), shift, whole.byteLength)
          decodeChunkInto(obj, out)
          expect(Buffer.compare(Buffer.from(out), Buffer.from(whole)), `${mode} ${dtype} +${shift}`).toBe(0)
        }
      }
      // An output shorter than the values is refused, never written past its end.
      const buf = new Uint8Array(16)
      expect(() => encodeElements([1, 2, 3], dtype, buf.subarray(0, 5))).toThrow(/need/)
      expect(buf.every((b) => b === 0)).toBe(true)
    }
  })
})

describe('codec arguments and headers', () => {
  const g: KvGeometry = { layers: 2, kvHeads: 2, headDim: 8, dtype: 'fp16' }
  const tensor = tensorOf(syntheticKv(g, 8, 1), 'fp16')

  it('rejects bad encode arguments', () => {
    expect(() => encodeChunk(tensor.subarray(2), metaFor(g, 8), { mode: 'kvgate' })).toThrow(
      /chunk tensor must be/,
    )
    expect(() => encodeChunk(tensor, metaFor(g, 8), { mode: 'zstd' as CodecMode })).toThrow(
      /unknown codec mode/,
    )
    for (const quality of [0, 10, 2.5]) {
      expect(() => encodeChunk(tensor, metaFor(g, 8), { mode: 'kvgate', quality })).toThrow(/quality/)
    }
  })

  it('rejects a codec version or params mismatch with ERR_CODEC_MISMATCH', () => {
    const obj = encodeChunk(tensor, metaFor(g, 8), { mode: 'kvgate', quality: 4 })
    const h = decodeHeader(obj)
    const sections = h.sections.map((_, i) => sectionOf(obj, h, i))
    const rebuild = (codecVersion: number, codecParams: Uint8Array) =>
      encodeChunkObject({ ...h, codecVersion, codecParams }, sections)
    const bad = [
      rebuild(2, h.codecParams),
      rebuild(h.codecVersion, new Uint8Array([10])),
      rebuild(h.codecVersion, new Uint8Array([12])),
      rebuild(h.codecVersion, new Uint8Array([4, 0, 0, 1])),
    ]
    for (const b of bad)
      expect(() => decodeChunk(b)).toThrow(expect.objectContaining({ code: 'ERR_CODEC_MISMATCH' }))
    // A well-formed header with the right version still decodes.
    expect(decodeChunk(rebuild(h.codecVersion, h.codecParams)).byteLength).toBe(tensor.byteLength)
  })

  it('refuses a section that claims more output than its bytes can hold, before allocating', () => {
    for (const mode of ['kvgate', 'lossless', 'q8', 'raw', 'reference-cachegen'] as const) {
      const obj = encodeChunk(tensor, metaFor(g, 8), { mode })
      const h = decodeHeader(obj)
      const huge = { ...h, tokens: 1 << 20, geometry: { ...h.geometry, kvHeads: 1024, headDim: 4096 } }
      expect(() => decodeSection(huge, 0, sectionOf(obj, h, 0))).toThrow(
        expect.objectContaining({ code: 'ERR_CODEC', message: expect.stringMatching(/cannot hold/) }),
      )
    }
  })
})
