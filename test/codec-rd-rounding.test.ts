import { readFileSync } from 'node:fs'
import { describe, expect, it } from 'vitest'
import {
  buildCalibration,
  decodeChunk,
  encodeChunk,
  loadCodecModule,
  openCalibration,
  RD_LAMBDA,
} from '../src/codec/node.ts'
import { WasmCodec } from '../src/codec/wasm-instance.ts'
import { CodecError } from '../src/core/errors.ts'
import { decodeHeader } from '../src/core/format.ts'
import type { KvGeometry } from '../src/core/layout.ts'
import { kvRelativeError } from '../src/model/index.ts'
import { metaFor, syntheticKv, tensorOf } from './codec-fixtures.ts'

// Rate-distortion rounding (EncodeOptions.rdRounding): an encoder-only choice of levels at a
// step that keeps nearest rounding's error; the format and the decoder are unchanged.
const g: KvGeometry = { layers: 2, kvHeads: 4, headDim: 32, dtype: 'fp32' }
const tokens = 256
const tensor = tensorOf(syntheticKv(g, tokens, 5), 'fp32')
const enc = (quality: number, rdRounding?: boolean, t = tensor, geo = g, n = tokens) =>
  encodeChunk(t, metaFor(geo, n), { mode: 'kvgate', quality, rdRounding })

describe('kvgate rate-distortion rounding', () => {
  it('is off by default: rdRounding false codes the same bytes as no option', () => {
    expect(enc(3, false)).toEqual(enc(3))
  })

  it('codes fewer bytes at a low level with per-layer K and V errors within 1.5 % of nearest rounding', () => {
    for (const q of [1, 2]) {
      const near = enc(q)
      const rd = enc(q, true)
      expect(rd.byteLength).toBeLessThan(0.995 * near.byteLength)
      const en = kvRelativeError(g, [{ exact: tensor, decoded: decodeChunk(near) }])
      const er = kvRelativeError(g, [{ exact: tensor, decoded: decodeChunk(rd) }])
      for (let l = 0; l < g.layers; l++) {
        expect(Math.abs(er.kCentered[l]! / en.kCentered[l]! - 1)).toBeLessThan(0.015)
        expect(Math.abs(er.v[l]! / en.v[l]! - 1)).toBeLessThan(0.015)
      }
    }
  })

  it('changes neither the header nor the decoder: the same codec version and params', () => {
    const a = decodeHeader(enc(2))
    const b = decodeHeader(enc(2, true))
    expect(b.codecVersion).toBe(a.codecVersion)
    expect(b.codecParams).toEqual(a.codecParams)
  })

  it('wasm: a λ set stays until reset (the wrapper sets and clears it around each encode); 0, negative and non-finite λ round to nearest', () => {
    const e = new WebAssembly.Instance(loadCodecModule(), {}).exports as Record<
      string,
      (...a: number[]) => number
    > & {
      memory: WebAssembly.Memory
    }
    const c = g.kvHeads * g.headDim
    const slab = tensor.subarray(0, 2 * tokens * c * 4)
    const src = e.kv_alloc!(slab.length)
    const par = e.kv_alloc!(32)
    new Float32Array(e.memory.buffer, par, 8).set([-0.07, 0.39, 0, 0, 1, 8, 0, 0])
    new Uint8Array(e.memory.buffer, src, slab.length).set(slab)
    const encode = () => {
      const n = e.kv_encode!(2, src, 3, tokens, c, par)
      expect(n).toBeGreaterThan(0)
      return new Uint8Array(e.memory.buffer, e.kv_result_ptr!(), n).slice()
    }
    const nearest = encode()
    e.kv_set_rd_lambda!(RD_LAMBDA)
    const rd = encode()
    expect(rd.byteLength).toBeLessThan(nearest.byteLength)
    expect(encode()).toEqual(rd)
    for (const l of [0, -1, Number.NaN, Number.POSITIVE_INFINITY]) {
      e.kv_set_rd_lambda!(l)
      expect(encode()).toEqual(nearest)
    }
    // Calibration statistics always count nearest rounding's symbols.
    e.kv_set_rd_lambda!(RD_LAMBDA)
    const stats = () => {
      const n = e.kv_stats!(src, 3, tokens, c, par)
      return new Uint8Array(e.memory.buffer, e.kv_result_ptr!(), n).slice()
    }
    const withRd = stats()
    e.kv_set_rd_lambda!(0)
    expect(stats()).toEqual(withRd)
  })

  it('wasm: values on the step grid (nearest rounding exact) keep nearest rounding’s error', () => {
    // V: every channel constant at 40 steps of 0.125 with rare one-step jumps, and one value
    // 2^-21 off the grid, with εV chosen so the step is exactly 0.125. The trial quantization's
    // error is ~0 while the rare jumps move (λ·Δbits > 1), so the measured rise is ~10^11:
    // the step correction must not follow it (a step shrunk by ~3·10^5 clamps every level
    // at QMAX: a 77 % error where nearest rounding's is 10^-9).
    const e = new WebAssembly.Instance(loadCodecModule(), {}).exports as Record<
      string,
      (...a: number[]) => number
    > & { memory: WebAssembly.Memory }
    const T = 256
    const C = 64
    const x = new Float32Array(2 * T * C)
    for (let i = 0; i < T * C; i++) x[i] = ((i * 7919) % 1000) / 1000 - 0.5 // K: anything
    const step = 0.125
    for (let t = 0; t < T; t++)
      for (let ch = 0; ch < C; ch++) x[T * C + t * C + ch] = 5 + ((t * 31 + ch * 17) % 1000 === 0 ? step : 0)
    x[T * C + 5 * C] = 5 + 2 ** -21 // channel 0 is in the trial's sample
    // εV = step / (√12 · rms), with rms as the encoder computes it (f32 row sums, exact here).
    let total = 0
    for (let t = 0; t < T; t++) {
      let rs = 0
      for (let ch = 0; ch < C; ch++) rs = Math.fround(rs + Math.fround(x[T * C + t * C + ch]! ** 2))
      total += rs
    }
    const rms = Math.sqrt(total / (T * C))
    let eps = Math.fround(step / (Math.sqrt(12) * rms))
    for (let k = 0; k < 64 && Math.fround(eps * Math.sqrt(12) * rms) !== step; k++)
      eps = Math.fround(eps * (1 + 2 ** -24))
    expect(Math.fround(eps * Math.sqrt(12) * rms)).toBe(step)
    const bytes = new Uint8Array(x.buffer)
    const src = e.kv_alloc!(bytes.length)
    new Uint8Array(e.memory.buffer, src, bytes.length).set(bytes)
    const par = e.kv_alloc!(32)
    new Float32Array(e.memory.buffer, par, 8).set([-0.07, eps, 0, 0, 1, 8, 0, 0])
    const dst = e.kv_alloc!(bytes.length)
    const vError = (lambda: number) => {
      e.kv_set_rd_lambda!(lambda)
      const n = e.kv_encode!(2, src, 3, T, C, par)
      e.kv_set_rd_lambda!(0)
      expect(n).toBeGreaterThan(0)
      const section = new Uint8Array(e.memory.buffer, e.kv_result_ptr!(), n).slice()
      const inp = e.kv_alloc!(n)
      new Uint8Array(e.memory.buffer, inp, n).set(section)
      expect(e.kv_decode!(2, inp, n, 3, T, C, dst)).toBe(0)
      const y = new Float32Array(e.memory.buffer.slice(dst + T * C * 4, dst + 2 * T * C * 4))
      let se = 0
      let ss = 0
      for (let i = 0; i < T * C; i++) {
        se += (y[i]! - x[T * C + i]!) ** 2
        ss += x[T * C + i]! ** 2
      }
      return Math.sqrt(se / ss)
    }
    expect(vError(0)).toBeLessThan(1e-6)
    expect(vError(RD_LAMBDA)).toBeLessThan(1e-6)
  })

  it('keeps non-finite and huge values as nearest rounding does, and every finite value close', () => {
    const x = tensorOf(syntheticKv(g, tokens, 6), 'fp32')
    const f = new Float32Array(x.buffer.slice(0))
    const special = [Number.NaN, Number.POSITIVE_INFINITY, Number.NEGATIVE_INFINITY, 3e38, -3e38]
    const at = (i: number) => (i * 7919) % f.length
    special.forEach((v, i) => {
      f[at(i)] = v
    })
    const t = new Uint8Array(f.buffer)
    const near = decodeChunk(enc(1, false, t))
    const rd = decodeChunk(enc(1, true, t))
    const dn = new Float32Array(near.buffer, near.byteOffset, near.byteLength / 4)
    const dr = new Float32Array(rd.buffer, rd.byteOffset, rd.byteLength / 4)
    const specials = new Set(special.map((_, i) => at(i)))
    let ser = 0
    let sen = 0
    for (let i = 0; i < f.length; i++) {
      // Same class of output as nearest rounding: finite where nearest gives finite.
      expect(Number.isFinite(dr[i]!)).toBe(Number.isFinite(dn[i]!))
      if (!specials.has(i)) {
        ser += (dr[i]! - f[i]!) ** 2
        sen += (dn[i]! - f[i]!) ** 2
      }
    }
    // The finite values' error: nearest rounding's (the ±3e38 make the step 1: ~14 %), not
    // more (a loose absolute bound would pass an RD error twice nearest's).
    expect(Math.sqrt(ser / sen)).toBeLessThan(1.02)
  })

  it('codes odd shapes, one token, narrow rows and latent chunks, and they decode', () => {
    const shapes: [KvGeometry, number][] = [
      [{ layers: 1, kvHeads: 1, headDim: 3, dtype: 'fp16' }, 1],
      [{ layers: 1, kvHeads: 1, headDim: 3, dtype: 'bf16' }, 17],
      [{ layers: 2, kvHeads: 3, headDim: 22, dtype: 'fp16' }, 64],
      [{ layers: 2, kvHeads: 1, headDim: 72, dtype: 'bf16', latent: true }, 64],
    ]
    for (const [geo, n] of shapes) {
      const v = syntheticKv(geo, n, 9)
      // A latent chunk is one plane per layer: the first half of each layer's K/V values.
      const t = tensorOf(geo.latent ? v.subarray(0, geo.layers * n * geo.headDim) : v, geo.dtype)
      for (const q of [1, 5, 9]) {
        const obj = enc(q, true, t, geo, n)
        expect(decodeChunk(obj).byteLength).toBe(t.byteLength)
      }
    }
  })

  it('with a calibration: fewer bytes than nearest with it, and the same tensor as without it', () => {
    const g16: KvGeometry = { ...g, dtype: 'fp16' }
    const t16 = tensorOf(syntheticKv(g16, tokens, 5), 'fp16')
    const cal = openCalibration(
      buildCalibration(
        [11, 12].map((seed) => tensorOf(syntheticKv(g16, tokens, seed), 'fp16')),
        { geometry: g16, dtype: 'fp16' },
      ),
    )
    const code = (rdRounding: boolean, calibration?: typeof cal) =>
      encodeChunk(t16, metaFor(g16, tokens), { mode: 'kvgate', quality: 1, rdRounding, calibration })
    const rdCal = code(true, cal)
    expect(rdCal.byteLength).toBeLessThan(code(false, cal).byteLength)
    expect(decodeChunk(rdCal, { calibration: cal })).toEqual(decodeChunk(code(true)))
  })

  describe('the wrapper (WasmCodec.encodeSection)', () => {
    const c = g.kvHeads * g.headDim
    const slab = tensor.subarray(0, 2 * tokens * c * 4)
    const params = new Float32Array([-0.07, 0.39, 0, 0, 1, 8, 0, 0])

    it('λ never carries into the next encode, also after one the wasm rejects', () => {
      // Each call sets its own λ (0 included) and clears it after; either alone prevents a leak.
      const codec = new WasmCodec(loadCodecModule())
      const nearest = codec.encodeSection('kvgate', slab, 3, tokens, c, params)
      expect(codec.encodeSection('kvgate', slab, 3, tokens, c, params, undefined, RD_LAMBDA)).not.toEqual(
        nearest,
      )
      expect(codec.encodeSection('kvgate', slab, 3, tokens, c, params)).toEqual(nearest)
      // εK = εV = 0 and no levels: the wasm rejects the parameters after λ was set.
      const none = new Float32Array([0, 0, 0, 0, 1, 8, 0, 0])
      expect(() => codec.encodeSection('kvgate', slab, 3, tokens, c, none, undefined, RD_LAMBDA)).toThrow(
        CodecError,
      )
      expect(codec.encodeSection('kvgate', slab, 3, tokens, c, params)).toEqual(nearest)
    })

    it('a codec build without kv_set_rd_lambda refuses λ > 0 and codes nearest rounding without it', () => {
      // The committed build with that export renamed (same length): an older build's exports.
      const bytes = readFileSync(new URL('../wasm/kvgate_codec.wasm', import.meta.url))
      const name = Buffer.from('kv_set_rd_lambda')
      const at = bytes.indexOf(name)
      expect(at).toBeGreaterThan(0)
      bytes[at + name.length - 1] = 'X'.charCodeAt(0)
      const old = new WasmCodec(new WebAssembly.Module(bytes))
      expect(() => old.encodeSection('kvgate', slab, 3, tokens, c, params, undefined, RD_LAMBDA)).toThrow(
        /lacks export 'kv_set_rd_lambda'/,
      )
      const nearest = new WasmCodec(loadCodecModule()).encodeSection('kvgate', slab, 3, tokens, c, params)
      expect(old.encodeSection('kvgate', slab, 3, tokens, c, params)).toEqual(nearest)
    })
  })

  it('rejects a non-boolean option', () => {
    expect(() => encodeChunk(tensor, metaFor(g, tokens), { mode: 'kvgate', rdRounding: 1 as never })).toThrow(
      /rdRounding/,
    )
  })
})
