// GPU sources and sinks through the native addon, driven by the repo's stub
// libcudart ("device" memory is host memory behind real CUDA-style checks).

import { beforeAll, describe, expect, it } from 'vitest'
import { chunkDescriptors, KVCache } from '../src/client/index.ts'
import { cuda, nativeAvailable, nativePaths } from '../src/client/native.ts'
import { chunkBytes, dtypeBytes, kvRange, MODEL_PRESETS, rowElements } from '../src/core/layout.ts'

// Must be set before the first CUDA call of this process.
process.env.KVGATE_CUDART = nativePaths.stubCudart

const g = MODEL_PRESETS.stories260k
const T = 16
const CB = chunkBytes(g, T)
const ROW = rowElements(g) * dtypeBytes(g.dtype)
const toks = Array.from({ length: 2 * T }, (_, i) => (i * 5 + 3) % 512)
const kv = Uint8Array.from({ length: 2 * CB }, (_, i) => (i * 7 + (i >> 9)) & 255)

let usable = false
beforeAll(() => {
  usable = nativeAvailable() && cuda.status().available && cuda.status().stub
  if (!usable)
    console.warn(`GPU tests skipped: ${nativeAvailable() ? cuda.status().reason : 'native addon not built'}`)
})

async function open(native = true): Promise<KVCache> {
  return KVCache.open({ model: 'stories260k', chunkTokens: T, memory: { bytes: 8 * CB }, native })
}

describe('descriptors for paged KV', () => {
  it('maps chunk tokens onto blocks, merging runs that are adjacent on both sides', () => {
    const blocks = Array.from({ length: g.layers }, (_, l) =>
      [0, 1].map((k) => [0, 1, 2, 3].map((b) => BigInt(0x10000 * (l * 8 + k * 4 + b + 1)))),
    )
    const d = chunkDescriptors({ kind: 'paged', blockTokens: 8, blocks }, g, T, 1)
    // Chunk 1 = tokens 16..31 = blocks 2 and 3 of each layer/side: separate device blocks, 2 copies each.
    expect(d.length).toBe(g.layers * 2 * 2)
    expect(d[0]).toEqual({ device: blocks[0]![0]![2]!, host: 0, bytes: 8 * ROW })
    expect(d[1]).toEqual({ device: blocks[0]![0]![3]!, host: 8 * ROW, bytes: 8 * ROW })
    const contiguous = [0, 1, 2, 3].map((b) => 0x100000n + BigInt(b * 8 * ROW))
    const merged = chunkDescriptors(
      {
        kind: 'paged',
        blockTokens: 8,
        blocks: Array.from({ length: g.layers }, () => [contiguous, contiguous]),
      },
      g,
      T,
      0,
    )
    expect(merged[0]).toEqual({ device: 0x100000n, host: 0, bytes: 16 * ROW })
    expect(chunkDescriptors({ kind: 'device', pointer: 0x1000n }, g, T, 2)).toEqual([
      { device: 0x1000n + BigInt(2 * CB), host: 0, bytes: CB },
    ])
  })
})

describe('GPU store / retrieve (stub libcudart)', () => {
  it('contiguous device buffer: store from it, retrieve into host and into another device buffer', async (ctx) => {
    if (!usable) return ctx.skip()
    const src = cuda.deviceAlloc(2 * CB)
    const dst = cuda.deviceAlloc(2 * CB)
    const c = await open()
    try {
      await cuda.copyToDevice(kv, src)
      expect((await c.store(toks, { kind: 'device', pointer: src })).stored).toBe(2)
      const host = new Uint8Array(2 * CB)
      expect((await c.retrieve(toks, { into: host })).every((m) => m === 1)).toBe(true)
      expect(Buffer.compare(host, kv)).toBe(0)
      expect((await c.retrieve(toks, { into: { kind: 'device', pointer: dst } })).every((m) => m === 1)).toBe(
        true,
      )
      const back = new Uint8Array(2 * CB)
      await cuda.copyFromDevice(dst, back)
      expect(Buffer.compare(back, kv)).toBe(0)
    } finally {
      await c.close()
      cuda.deviceFree(src)
      cuda.deviceFree(dst)
    }
  })

  it('paged block table: blocks scattered in device memory round-trip exactly', async (ctx) => {
    if (!usable) return ctx.skip()
    const B = 4
    const nBlocks = (2 * T) / B
    const pool = cuda.deviceAlloc(g.layers * 2 * nBlocks * B * ROW)
    const c = await open()
    try {
      // Block b of (layer, side) lives at a shuffled slot of the pool.
      const slotOf = (l: number, k: number, b: number) =>
        l * 2 * nBlocks + k * nBlocks + ((b * 5 + 3) % nBlocks)
      const blocks = Array.from({ length: g.layers }, (_, l) =>
        [0, 1].map((k) =>
          Array.from({ length: nBlocks }, (_, b) => pool + BigInt(slotOf(l, k, b) * B * ROW)),
        ),
      )
      // Place the KV independently of the code under test: token by token.
      for (let l = 0; l < g.layers; l++) {
        for (const k of [0, 1] as const) {
          for (let t = 0; t < 2 * T; t++) {
            const chunk = Math.floor(t / T)
            const off = chunk * CB + kvRange(g, T, l, k).start + (t % T) * ROW
            const dev = blocks[l]![k]![Math.floor(t / B)]! + BigInt((t % B) * ROW)
            await cuda.copyToDevice(kv.subarray(off, off + ROW), dev)
          }
        }
      }
      const paged = { kind: 'paged' as const, blockTokens: B, blocks }
      await c.store(toks, paged)
      const host = new Uint8Array(2 * CB)
      await c.retrieve(toks, { into: host })
      expect(Buffer.compare(host, kv)).toBe(0)
      // Retrieve into a zeroed paged cache and compare with the source placement.
      const pool2 = cuda.deviceAlloc(g.layers * 2 * nBlocks * B * ROW)
      const blocks2 = blocks.map((sides) => sides.map((bs) => bs.map((p) => p - pool + pool2)))
      await c.retrieve(toks, { into: { kind: 'paged', blockTokens: B, blocks: blocks2 } })
      const a = new Uint8Array(g.layers * 2 * nBlocks * B * ROW)
      const b = new Uint8Array(a.length)
      await cuda.copyFromDevice(pool, a)
      await cuda.copyFromDevice(pool2, b)
      expect(Buffer.compare(a, b)).toBe(0)
      cuda.deviceFree(pool2)
    } finally {
      await c.close()
      cuda.deviceFree(pool)
    }
  })

  it('a failing device copy rejects store and leaves nothing half-written in L1', async (ctx) => {
    if (!usable) return ctx.skip()
    const src = cuda.deviceAlloc(2 * CB)
    const c = await open()
    try {
      cuda.stubControl('cudaMemcpyAsync=1@0*1')
      await expect(c.store(toks, { kind: 'device', pointer: src })).rejects.toMatchObject({
        code: 'ERR_CUDA',
      })
      expect((await c.lookup(toks)).tokens).toBe(0)
      expect(c.stats().memory.freeSlots).toBe(c.stats().memory.slots)
    } finally {
      cuda.stubControl('reset')
      await c.close()
      cuda.deviceFree(src)
    }
  })

  it('a device copy failing part-way through a store leaks no pin: L1 frees every slot', async (ctx) => {
    if (!usable) return ctx.skip()
    const n = 4
    const four = Array.from({ length: n * T }, (_, i) => (i * 5 + 7) % 512)
    const src = cuda.deviceAlloc(n * CB)
    const c = await KVCache.open({ model: 'stories260k', chunkTokens: T, memory: { bytes: 8 * (CB + 4096) } })
    try {
      await cuda.copyToDevice(new Uint8Array(n * CB).fill(5), src)
      cuda.stubControl('cudaMemcpyAsync=2@2*1') // the third chunk's copy fails
      await expect(c.store(four, { kind: 'device', pointer: src })).rejects.toMatchObject({
        code: 'ERR_CUDA',
      })
      cuda.stubControl('reset')
      expect(c.stats().memory).toMatchObject({ liveReservations: 0, livePins: 0 })
      c.clearMemory()
      expect(c.stats().memory.freeSlots).toBe(c.stats().memory.slots)
    } finally {
      cuda.stubControl('reset')
      await c.close()
      cuda.deviceFree(src)
    }
  })

  it('GPU buffers are validated, and need the addon', async () => {
    const c = await open(false)
    try {
      await expect(c.store(toks, { kind: 'device', pointer: -1n })).rejects.toThrow(/pointer/)
      await expect(c.store(toks, { kind: 'paged', blockTokens: 4, blocks: [] })).rejects.toThrow(
        /one entry per layer/,
      )
      await expect(c.store(toks, { kind: 'device', pointer: 0x1000n })).rejects.toMatchObject({
        code: 'ERR_NATIVE',
      })
      // The build command named is one that exists where kvgate runs (the CLI when installed).
      await expect(c.store(toks, { kind: 'device', pointer: 0x1000n })).rejects.toThrow(
        nativePaths.buildCommand,
      )
    } finally {
      await c.close()
    }
  })
})
