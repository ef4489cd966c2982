// Pins the kvgate codec's bytes: encoded objects and decoded tensors of fixed chunks whose
// rows hold escapes (fine K steps on wide rows), so speed work on the wasm cannot move a bit.

import { createHash } from 'node:crypto'
import { describe, expect, it } from 'vitest'
import { decodeChunk, encodeChunk, layerTargets, loadCodecModule } from '../src/codec/node.ts'
import type { Dtype, KvGeometry } from '../src/core/layout.ts'
import { metaFor, syntheticKv, tensorOf } from './codec-fixtures.ts'

const sha = (b: Uint8Array) => createHash('sha256').update(b).digest('hex').slice(0, 16)
const T = 64
const geometry = (dtype: Dtype): KvGeometry => ({ layers: 2, kvHeads: 8, headDim: 128, dtype })

/** Bytes of escape bits in layer 0's K stream, from the raw section (wasm/README.md's layout). */
function kEscapeBytes(quality: number): number {
  const g = geometry('fp16')
  const c = g.kvHeads * g.headDim
  const slab = tensorOf(syntheticKv(g, T, 5), 'fp16').subarray(0, 2 * T * c * 2)
  const e = new WebAssembly.Instance(loadCodecModule(), {}).exports as Record<
    string,
    (...a: number[]) => number
  > & {
    memory: WebAssembly.Memory
  }
  const src = e.kv_alloc!(slab.length)
  const par = e.kv_alloc!(32)
  const { kError, vError } = layerTargets(quality, 0, g.layers)
  new Float32Array(e.memory.buffer, par, 8).set([-kError, vError, 0, 0, 1, 8, 0, 0])
  new Uint8Array(e.memory.buffer, src, slab.length).set(slab)
  const n = e.kv_encode!(2, src, 1, T, c, par)
  expect(n).toBeGreaterThan(0)
  const s = new Uint8Array(e.memory.buffer, e.kv_result_ptr!(), n).slice()
  let p = 4 + 4 // K length, base
  const flags = s[p++]!
  expect(flags & 3).toBe(0) // error targets: no channel or token step codes
  if (flags & 4) p += c / 8
  for (let i = 0; i < c; i++) while (s[p++]! & 0x80);
  return new DataView(s.buffer).getUint32(p, true)
}

describe('kvgate codec bytes are pinned', () => {
  it('the fixtures exercise escapes (rows mixing direct and escape symbols)', () => {
    expect(kEscapeBytes(5)).toBeGreaterThan(0)
    expect(kEscapeBytes(9)).toBeGreaterThan(kEscapeBytes(5))
  })

  // Hashes from the build before the decode/encode speed work (main at 4ca2652).
  const pinned: Record<string, [string, string]> = {
    'q5 fp16': ['ad18f7dff6f5e993', '10008ad9d0a990be'],
    'q5 bf16': ['af099119fd426845', 'c3dad82dbf1eead3'],
    'q5 fp32': ['acd23a3618efaf43', 'ac2644f2458fa5f2'],
    'q9 fp16': ['f27148cc0aac0041', 'ee0c624e3ec820ea'],
    'q9 bf16': ['2515bdf1b908d41d', 'd0e2491dd61e45b5'],
    'q9 fp32': ['a3295462529987a8', '1dc0258ccb05a6a8'],
  }
  for (const [name, [objHash, outHash]] of Object.entries(pinned)) {
    it(`${name}: same object, same decoded tensor`, () => {
      const [q, dtype] = name.split(' ') as [string, Dtype]
      const g = geometry(dtype)
      const obj = encodeChunk(tensorOf(syntheticKv(g, T, 5), dtype), metaFor(g, T), {
        mode: 'kvgate',
        quality: Number(q.slice(1)),
      })
      expect([sha(obj), sha(decodeChunk(obj))]).toEqual([objHash, outHash])
    })
  }
})

describe('kvgate encoder paths beside the defaults are pinned', () => {
  // Raw sections of the encoder's other paths, in odd shapes: C not a multiple of 4 or 16 (the
  // symbol pass's and quantization's scalar tails), T ≥ 128 (sampled prediction rows), per-channel
  // K / per-token V steps, one V step from the row maxima, channel and token scales, rate-
  // distortion rounding (levels quantized in full), an MLA latent plane and kv_stats' counts.
  type Exports = Record<string, (...a: number[]) => number> & { memory: WebAssembly.Memory }
  const variants: [string, number[], number][] = [
    ['error targets', [-0.03, 0.14, 0, 0, 1, 8, 0, 0], 0],
    ['levels 12:16', [0, 0, 0, 0, 1, 8, 12, 16], 0],
    ['levels 12:-16', [0, 0, 0, 0, 1, 8, 12, -16], 0],
    ['gammas', [-0.03, 0.14, 0.5, 0.5, 1, 4, 0, 0], 0],
    ['rd rounding', [-0.03, 0.14, 0, 0, 1, 8, 0, 0], 0.5],
  ]
  const call = (e: Exports, input: Uint8Array, f: (src: number, par: number) => number, p: number[]) => {
    const src = e.kv_alloc!(input.length)
    const par = e.kv_alloc!(32)
    new Uint8Array(e.memory.buffer, src, input.length).set(input)
    new Float32Array(e.memory.buffer, par, 8).set(p)
    const n = f(src, par)
    expect(n).toBeGreaterThan(0)
    const out = new Uint8Array(e.memory.buffer, e.kv_result_ptr!(), n).slice()
    e.kv_result_clear!()
    e.kv_free!(src, input.length)
    e.kv_free!(par, 32)
    return out
  }
  /** sha of every variant's section, the latent's and kv_stats' counts, in that order. */
  function pathHashes(dtype: Dtype, t: number, kvHeads: number, headDim: number): string {
    const g: KvGeometry = { layers: 1, kvHeads, headDim, dtype }
    const c = kvHeads * headDim
    const slab = tensorOf(syntheticKv(g, t, 3), dtype)
    const dt = { fp16: 1, bf16: 2, fp32: 3 }[dtype as 'fp16' | 'bf16' | 'fp32']
    const e = new WebAssembly.Instance(loadCodecModule(), {}).exports as Exports
    const hashes = variants.map(([, p, rd]) => {
      e.kv_set_rd_lambda!(rd)
      const s = call(e, slab, (src, par) => e.kv_encode!(2, src, dt, t, c, par), p)
      e.kv_set_rd_lambda!(0)
      return sha(s)
    })
    const p = variants[0]![1]
    const latent = slab.subarray(0, slab.length / 2)
    hashes.push(sha(call(e, latent, (src, par) => e.kv_encode!(2, src, dt | 0x100, t, c, par), p)))
    hashes.push(sha(call(e, slab, (src, par) => e.kv_stats!(src, dt, t, c, par), p)))
    return hashes.join(' ')
  }
  // From main's build at 2096406. A row-by-row levels build (branch enc-wip) that trapped in
  // rate-distortion rounding failed all five.
  // Keys: dtype, T, kvHeads, headDim.
  const pinned: Record<string, string> = {
    'fp16 130 3 10':
      'f52cf3f6f69a0fd4 30fe2fce5745b1f4 99480dcd5d41a59e 4bba1c372666248d 5ad37f0b0d01a5a0 0628e34de42f68ff 5b2c344af02a0a44',
    'bf16 9 2 10':
      '446e393b93943367 a72e808f5c38fc93 e3ccaf8738ad095f 2d0eb49486edc4f7 fda5df41d83059a1 d073a0df5f59c68d 7808eed964cfc0e2',
    'fp32 130 3 10':
      'f1952de48872a654 620a916ba4de2681 67af44bf2348bacc de64002f3a4d84b8 97fd43786b7fa779 c4e1138fc568dd77 ff4a477d8ad1ec0e',
    'fp16 256 8 128':
      '587dcd86153d48b8 680aefcac24f612e 05b9f3795e727ec0 d17dbabe18e850f2 468f1d74e16155f3 b03a70879d5e36d5 489d5dc6ee26a412',
    'fp16 7 1 6':
      '9dca8d7b24568437 fe5dc9634138f723 49f0dce5961b0f01 ed66a94e19ed675e 5471650e16d0a11a 12b7f839d9f243fc ff35ec06241b5bc2',
  }
  for (const [name, want] of Object.entries(pinned)) {
    it(`${name}: same sections and counts`, () => {
      const [dtype, t, kvHeads, headDim] = name.split(' ') as [Dtype, string, string, string]
      expect(pathHashes(dtype, Number(t), Number(kvHeads), Number(headDim))).toBe(want)
    })
  }
})

describe('SIMD rANS encoder quotient', () => {
  // The SIMD encoder computes x / freq as (x + 1/2) · (1 / freq), floored by adding
  // 2^52 − 1/2 (wasm/README.md). Frequencies that are not powers of two (inexact reciprocals)
  // and the largest it takes (1024 = PROB_SCALE / 2) are where a wrong floor would show; a
  // wrong quotient codes states the decoder rejects or decodes to other bytes.
  it('codes a table with frequencies 1024, 683, 300, 37, 3 and 1 losslessly', () => {
    const freqs = [1024, 683, 300, 37, 3, 1] // sum 2048: the normalised table is exactly this
    const T = 2048
    const C = 8 // every channel holds each symbol `freq` times: one class, the table above
    let seed = 7
    const rnd = () => {
      seed = (Math.imul(seed, 1103515245) + 12345) >>> 0
      return seed / 2 ** 32
    }
    const column = freqs.flatMap((f, s) => Array<number>(f).fill(s * 37 + 5))
    const plane = new Uint8Array(2 * T * C) // K then V, fp8 bytes: one byte plane each
    for (let kv = 0; kv < 2; kv++)
      for (let ch = 0; ch < C; ch++) {
        const col = column.slice()
        for (let i = col.length - 1; i > 0; i--) {
          const j = Math.floor(rnd() * (i + 1))
          ;[col[i], col[j]] = [col[j]!, col[i]!]
        }
        for (let t = 0; t < T; t++) plane[kv * T * C + t * C + ch] = col[t]!
      }
    const e = new WebAssembly.Instance(loadCodecModule(), {}).exports as Record<
      string,
      (...a: number[]) => number
    > & { memory: WebAssembly.Memory }
    const src = e.kv_alloc!(plane.length)
    new Uint8Array(e.memory.buffer, src, plane.length).set(plane)
    const n = e.kv_encode!(1, src, 4, T, C, 0)
    expect(n).toBeGreaterThan(0)
    const section = new Uint8Array(e.memory.buffer, e.kv_result_ptr!(), n).slice()
    // K's plane: kind 1 (rANS), one class, one table: (symbols − 1), LEB128 frequencies.
    const table: number[] = []
    let p = 3
    for (let s = 0; s <= section[2]!; s++) {
      let v = 0
      for (let shift = 0; ; shift += 7) {
        const b = section[p++]!
        v |= (b & 0x7f) << shift
        if (b < 0x80) break
      }
      table.push(v)
    }
    expect([section[0], section[1]]).toEqual([1, 1])
    expect(table.filter((f) => f > 0)).toEqual(freqs)
    const inp = e.kv_alloc!(n)
    const dst = e.kv_alloc!(plane.length)
    new Uint8Array(e.memory.buffer, inp, n).set(section)
    expect(e.kv_decode!(1, inp, n, 4, T, C, dst)).toBe(0)
    expect(new Uint8Array(e.memory.buffer, dst, plane.length)).toEqual(plane)
  })
})
