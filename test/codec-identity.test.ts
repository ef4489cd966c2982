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
