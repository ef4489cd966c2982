import { describe, expect, it } from 'vitest'
import { fuzzCodec } from '../bench/lib/fuzz-codec.ts'
import { decodeChunk, encodeChunk } from '../src/codec/node.ts'
import { wasmCodec } from '../src/codec/runtime.ts'
import { WasmCodec } from '../src/codec/wasm-instance.ts'
import { CodecError, CorruptStreamError, provesCorrupt } from '../src/core/errors.ts'
import { metaFor, syntheticKv, tensorOf } from './codec-fixtures.ts'

describe('codec under hostile input', () => {
  it('a few thousand mutated chunks: only kvgate errors, no traps, bounded memory, instance intact', () => {
    const report = fuzzCodec({ iterations: 3000, seed: 7 })
    expect(report.failures).toEqual([])
    expect(report.traps).toBe(0)
    expect(report.rejected).toBeGreaterThan(1000)
    // Some mutations (e.g. in raw sections or quantized payload bytes) decode to other values.
    expect(report.decoded).toBeGreaterThan(0)
    expect(report.maxMemoryBytes).toBeLessThan(16 * 1024 * 1024)
    // Calibrated chunks and hostile calibration objects were in the mix.
    expect(report.perMode['kvgate+calibration']).toBeGreaterThan(200)
    expect(report.perMode['calibration bytes']).toBeGreaterThan(100)
    // So were latent (MLA) chunks, calibrated or not.
    expect(report.perMode['kvgate+latent']).toBeGreaterThan(100)
    expect(report.perMode['lossless+latent']).toBeGreaterThan(100)
    expect(report.perMode['q8+latent']).toBeGreaterThan(100)
    expect(report.perMode['kvgate+calibration+latent']).toBeGreaterThan(50)
  })

  it('buffers that do not hold the slab their arguments describe are refused before wasm reads or writes them', () => {
    // wasm takes a slab's length from (dtype, t, c), not from the buffer: a shorter input was
    // read past its end (heap bytes coded into the section), a shorter output written past its end.
    const codec = wasmCodec()
    const slab = new Uint8Array(64).map((_, i) => i) // fp16 K and V, 1 token × 16 channels
    const sec = codec.encodeSection('lossless', slab, 1, 1, 16)
    const out = new Uint8Array(64)
    codec.decodeSection('lossless', sec, 1, 1, 16, out)
    expect([...out]).toEqual([...slab])
    const refused = expect.objectContaining({
      code: 'ERR_CODEC',
      message: expect.stringMatching(/does not hold/),
    })
    expect(() => codec.encodeSection('lossless', slab.subarray(0, 62), 1, 1, 16)).toThrow(refused)
    expect(() => codec.encodeSection('lossless', slab, 1 | 0x100, 1, 16)).toThrow(refused) // latent: 32 bytes
    expect(() => codec.encodeSection('lossless', slab, 1, 1.5, 16)).toThrow(refused)
    expect(() => codec.encodeSection('lossless', slab, 9, 1, 16)).toThrow(refused)
    expect(() => codec.decodeSection('lossless', sec, 1, 1, 16, new Uint8Array(62))).toThrow(refused)
    expect(() => codec.decodeSection('lossless', sec, 3, 1, 16, out)).toThrow(refused) // fp32: 128 bytes
    expect(() => codec.symbolCounts(slab.subarray(2), 1, 1, 16, new Float32Array(8))).toThrow(refused)
    // A calibration blob goes with kvgate sections only (the calibrated entry points code kvgate
    // whatever mode was asked for), and an empty one is not "no calibration".
    const blob = new Uint8Array(8)
    const notKvgate = expect.objectContaining({
      code: 'ERR_CODEC',
      message: expect.stringMatching(/kvgate sections only/),
    })
    expect(() => codec.encodeSection('lossless', slab, 1, 1, 16, undefined, blob)).toThrow(notKvgate)
    expect(() => codec.decodeSection('q8', sec, 1, 1, 16, out, blob)).toThrow(notKvgate)
    expect(() => codec.decodeSection('kvgate', sec, 1, 1, 16, out, new Uint8Array(0))).toThrow(notKvgate)
    // The instance is intact.
    codec.decodeSection('lossless', sec, 1, 1, 16, out)
    expect([...out]).toEqual([...slab])
  })

  it('wasm refusing its arguments (a lossy mode on fp8) is no verdict on the section; a refused section is', () => {
    const codec = wasmCodec()
    const fp8 = new Uint8Array(32) // fp8e4m3 K and V, 1 token × 16 channels
    for (const mode of ['kvgate', 'q8'] as const) {
      let e: unknown
      try {
        codec.decodeSection(mode, new Uint8Array(40), 4, 1, 16, fp8)
      } catch (x) {
        e = x
      }
      expect(e).toBeInstanceOf(CodecError)
      expect(provesCorrupt(e)).toBe(false)
    }
    expect(() => codec.decodeSection('kvgate', new Uint8Array(40), 1, 1, 16, new Uint8Array(64))).toThrow(
      CorruptStreamError,
    )
  })

  it('a trap inside wasm becomes a CodecError and the instance is replaced', () => {
    // The real codec does not trap on hostile input (the fuzz test shows it), so
    // drive the recovery path with a stand-in module whose encode/decode trap.
    const codec = new WasmCodec(trappingModule())
    const out = new Uint8Array(64)
    for (let i = 0; i < 3; i++) {
      expect(() => codec.decodeSection('kvgate', new Uint8Array(8), 1, 1, 16, out)).toThrow(
        expect.objectContaining({ code: 'ERR_CODEC', message: expect.stringMatching(/inside wasm/) }),
      )
      expect(() => codec.encodeSection('lossless', out, 1, 1, 16)).toThrow(/inside wasm/)
    }
  })

  it('the shared instance survives garbage sections of every length', () => {
    const g = { layers: 1, kvHeads: 2, headDim: 8, dtype: 'bf16' as const }
    const tensor = tensorOf(syntheticKv(g, 16), 'bf16')
    const obj = encodeChunk(tensor, metaFor(g, 16), { mode: 'kvgate' })
    const before = wasmCodec().memoryBytes
    for (let n = 0; n < 300; n += 7) {
      const junk = new Uint8Array(n).map((_, i) => (i * 131 + n) & 0xff)
      expect(() =>
        wasmCodec().decodeSection('kvgate', junk, 2, 16, 16, new Uint8Array(tensor.length)),
      ).toThrow(expect.objectContaining({ code: 'ERR_CODEC' }))
    }
    expect(decodeChunk(obj).byteLength).toBe(tensor.length)
    expect(wasmCodec().memoryBytes).toBeLessThanOrEqual(Math.max(before, 4 * 1024 * 1024))
  })
})

/** A minimal module with the codec's exports whose kv_encode / kv_decode execute `unreachable`. */
function trappingModule(): WebAssembly.Module {
  const I32 = 0x7f
  const vec = (items: number[][]): number[] => [items.length, ...items.flat()]
  const section = (id: number, body: number[]): number[] => [id, body.length, ...body]
  const name = (s: string): number[] => [s.length, ...Array.from(s, (ch) => ch.charCodeAt(0))]
  const types = vec([
    [0x60, 0, 1, I32],
    [0x60, 1, I32, 1, I32],
    [0x60, 2, I32, I32, 0],
    [0x60, 0, 0],
    [0x60, 6, ...new Array(6).fill(I32), 1, I32],
    [0x60, 7, ...new Array(7).fill(I32), 1, I32],
  ])
  const funcs = [0, 1, 2, 0, 3, 4, 5]
  const names = [
    'kv_version',
    'kv_alloc',
    'kv_free',
    'kv_result_ptr',
    'kv_result_clear',
    'kv_encode',
    'kv_decode',
  ]
  const bodies = [
    [0, 0x41, 1, 0x0b],
    [0, 0x41, 0x80, 0x08, 0x0b],
    [0, 0x0b],
    [0, 0x41, 0, 0x0b],
    [0, 0x0b],
    [0, 0x00, 0x0b],
    [0, 0x00, 0x0b],
  ]
  const bytes = [
    0x00,
    0x61,
    0x73,
    0x6d,
    1,
    0,
    0,
    0,
    ...section(1, types),
    ...section(3, vec(funcs.map((f) => [f]))),
    ...section(5, [1, 0, 1]),
    ...section(7, vec([[...name('memory'), 2, 0], ...names.map((n, i) => [...name(n), 0, i])])),
    ...section(10, vec(bodies.map((b) => [b.length, ...b]))),
  ]
  return new WebAssembly.Module(new Uint8Array(bytes))
}
