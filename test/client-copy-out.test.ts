// Decoded L4 chunks leave the calling thread: a codec worker's tensor goes from its staging into
// L1, and a fetched chunk from L1 into the caller's buffer, on the addon's pool (copyViews). What
// lands is exactly what was decoded, even when a copy is slow and the worker goes on decoding,
// and a copy that fails fails its own chunk only.

import { afterAll, afterEach, describe, expect, it, vi } from 'vitest'
import { KVCache, type KVCacheOptions } from '../src/client/index.ts'
import { copyViewsReady } from '../src/client/native.ts'
import { decodeChunk, encodeChunk } from '../src/codec/node.ts'
import { chunkBytes, MODEL_PRESETS } from '../src/core/layout.ts'
import { metaFor } from './codec-fixtures.ts'
import { pattern } from './support/bytes.ts'
import { startFaultGateway } from './support/client-fault-gateway.ts'
import { expectLayersAsStored } from './support/layers.ts'

/** The copier the pool and the cache call, slowed down or failed by each test. */
const copies = { delayMs: 0, fail: 0, calls: 0, inFlight: 0 }
vi.mock('../src/client/native.ts', async (importOriginal) => {
  const real = await importOriginal<typeof import('../src/client/native.ts')>()
  return {
    ...real,
    copyViews: async (dst: Uint8Array, src: Uint8Array) => {
      copies.calls++
      if (copies.fail > 0) {
        copies.fail--
        throw new Error('copy refused (test)')
      }
      copies.inFlight++
      try {
        if (copies.delayMs > 0) await new Promise((r) => setTimeout(r, copies.delayMs))
        return await real.copyViews(dst, src)
      } finally {
        copies.inFlight--
      }
    },
  }
})

const { CodecPool } = await import('../src/client/codec-pool.ts')

// Llama-3.1-8B at 16 tokens: 2 MiB tensors, the size from which copies leave the calling thread.
const g = MODEL_PRESETS['llama-3.1-8b']
const T = 16
const CB = chunkBytes(g, T)
const objects = Array.from({ length: 6 }, (_, i) =>
  encodeChunk(pattern(CB, 31 + i), metaFor(g, T), { mode: 'lossless' }),
)

/** A Llama-3.1-8B cache of `chunkTokens` on the gateway at `url`, lossless on the wire. */
function openCache(
  url: string,
  namespace: string,
  chunkTokens: number,
  chunks: number,
  extra: Partial<KVCacheOptions> = {},
): Promise<KVCache> {
  return KVCache.open({
    model: 'llama-3.1-8b',
    chunkTokens,
    namespace,
    memory: { bytes: chunks * (chunkBytes(g, chunkTokens) + 65536) },
    remote: { url, codec: 'lossless', token: 'secret' },
    ...extra,
  })
}

afterEach(() => {
  copies.delayMs = 0
  copies.fail = 0
})

describe.skipIf(!copyViewsReady())('copies out of a codec worker on the addon pool', () => {
  const pools: InstanceType<typeof CodecPool>[] = []
  afterAll(async () => {
    for (const p of pools) await p.close()
  })

  it('a slow copy out of one output buffer holds the worker back: no job decodes into it meanwhile', async () => {
    // One worker, six jobs at once: the worker decodes job 2 into the other buffer while job 1
    // is copied out, then job 3 would take job 1's buffer. Each copy waits 150 ms first, far
    // longer than a decode of these objects, so a worker handed job 3 early would overwrite
    // job 1's tensor before its copy read it.
    copies.delayMs = 150
    const pool = new CodecPool(1)
    pools.push(pool)
    const calls = copies.calls
    const outs = objects.map(() => new Uint8Array(CB))
    await Promise.all(objects.map((o, i) => pool.decodeInto(o, 'lossless', outs[i]!)))
    expect(copies.calls - calls).toBe(objects.length)
    for (const [i, o] of objects.entries()) expect(Buffer.compare(outs[i]!, decodeChunk(o))).toBe(0)
    expect(pool.counts).toMatchObject({ workerJobs: objects.length, inlineJobs: 0 })
  })

  it('a copy that fails fails its own job only; the buffer it held is given back', async () => {
    const pool = new CodecPool(1)
    pools.push(pool)
    copies.fail = 1
    const bad = new Uint8Array(CB)
    await expect(pool.decodeInto(objects[0]!, 'lossless', bad)).rejects.toThrow(/copy refused/)
    // Three more in a row on the same worker: each output buffer is taken again, none stays held.
    for (const i of [1, 2, 3]) {
      const out = new Uint8Array(CB)
      await pool.decodeInto(objects[i]!, 'lossless', out)
      expect(Buffer.compare(out, decodeChunk(objects[i]!))).toBe(0)
    }
  })
})

describe.skipIf(!copyViewsReady())('a cold retrieve from L4 copies on the addon pool', () => {
  it('into a plain and a shared buffer: the bytes stored, with every copy finished when it returns', async () => {
    const gw = await startFaultGateway()
    const open = () => openCache(gw.url, 'copy-out', T, 8, { codecWorkers: 1 })
    const toks = Array.from({ length: 3 * T }, (_, i) => (i * 37 + 5) % 32000)
    const kv = pattern(3 * CB, 77)
    const a = await open()
    const b = await open()
    const c = await open()
    try {
      await a.store(toks, kv)
      await a.flush()
      // Slow copies: retrieve still returns only once every byte is in place.
      copies.delayMs = 40
      const calls = copies.calls
      const into = new Uint8Array(3 * CB)
      expect((await b.retrieve(toks, { into })).every((m) => m === 1)).toBe(true)
      expect(Buffer.compare(into, kv)).toBe(0)
      // Per chunk: staging into L1, then L1 into the caller's buffer.
      expect(copies.calls - calls).toBe(6)
      // An L1 hit is copied on the calling thread: no more pool copies.
      const again = new Uint8Array(3 * CB)
      await b.retrieve(toks, { into: again })
      expect(copies.calls - calls).toBe(6)
      expect(Buffer.compare(again, kv)).toBe(0)
      // Into a SharedArrayBuffer (a caller sharing it with its own workers).
      const shared = new Uint8Array(new SharedArrayBuffer(3 * CB))
      expect((await c.retrieve(toks, { into: shared })).every((m) => m === 1)).toBe(true)
      expect(Buffer.compare(shared, kv)).toBe(0)
    } finally {
      for (const x of [a, b, c]) await x.close(100)
      await gw.close()
    }
  })

  it('a copy into the caller buffer that fails is the retrieve error, and the cache keeps serving', async () => {
    const gw = await startFaultGateway()
    const open = () => openCache(gw.url, 'copy-out-fail', T, 8, { codecWorkers: 0 })
    const toks = Array.from({ length: 2 * T }, (_, i) => (i * 41 + 9) % 32000)
    const kv = pattern(2 * CB, 78)
    const a = await open()
    const b = await open()
    try {
      await a.store(toks, kv)
      await a.flush()
      // Inline decodes (no workers): the only pool copies are into the caller's buffer.
      copies.fail = 1
      await expect(b.retrieve(toks, { into: new Uint8Array(2 * CB) })).rejects.toThrow(/copy refused/)
      const into = new Uint8Array(2 * CB)
      expect((await b.retrieve(toks, { into })).every((m) => m === 1)).toBe(true)
      expect(Buffer.compare(into, kv)).toBe(0)
      // Nothing stays pinned by the failed read: L1 can give every slot back.
      expect(b.stats().memory.livePins).toBe(0)
    } finally {
      for (const x of [a, b]) await x.close(100)
      await gw.close()
    }
  })
})

describe.skipIf(!copyViewsReady())(
  'retrieveLayers from L4 decodes layer groups into their L1 reservation',
  () => {
    // 64-token chunks: a layer group (8 layers of 256 KiB) is 2 MiB, copied on the pool.
    const T = 64
    const CB = chunkBytes(g, T)
    const toks = Array.from({ length: 2 * T }, (_, i) => (i * 43 + 11) % 32000)
    const kv = pattern(2 * CB, 79)
    const slab = CB / g.layers

    async function seededGateway() {
      const gw = await startFaultGateway()
      const a = await openCache(gw.url, 'layers-in-place', T, 4)
      await a.store(toks, kv)
      await a.flush()
      await a.close(100)
      return gw
    }

    it('with slow copies: every layer as stored, then the chunks resident in L1', async () => {
      const gw = await seededGateway()
      const b = await openCache(gw.url, 'layers-in-place', T, 4, { codecWorkers: 1 })
      try {
        copies.delayMs = 30
        const calls = copies.calls
        const layers = await expectLayersAsStored(b.retrieveLayers(toks), kv, {
          chunks: 2,
          chunkBytes: CB,
          slab,
        })
        expect(layers.length).toBe(g.layers)
        expect(copies.calls).toBeGreaterThan(calls) // the groups came through the pool's copies
        expect((await b.lookup(toks)).chunks.every((c) => c.tier === 'memory')).toBe(true)
        const into = new Uint8Array(2 * CB)
        expect((await b.retrieve(toks, { into })).every((m) => m === 1)).toBe(true)
        expect(Buffer.compare(into, kv)).toBe(0)
      } finally {
        await b.close(100)
        await gw.close()
      }
    })

    it('a read cut short by its deadline keeps its L1 slot until the copies into it end, then gives it back', async () => {
      // The deadline (1 s) ends the read after every layer group was decoded but while their
      // copies into the chunk's L1 reservation still run (3 s each): the slot must stay reserved
      // until they end (given back earlier, a store could take it and then have the late copies
      // land in its bytes), and then be given back, nothing committed.
      const gw = await seededGateway()
      const b = await openCache(gw.url, 'layers-in-place', T, 1, {
        codecWorkers: 1,
        retrieveDeadlineMs: 1000,
      })
      try {
        copies.delayMs = 3000
        let served = 0
        for await (const batch of b.retrieveLayers(toks.slice(0, T))) served = batch.chunks
        expect(served).toBe(0)
        expect(copies.inFlight).toBeGreaterThan(0) // the case under test: copies still running
        expect(b.stats().memory.liveReservations).toBe(1)
        const until = Date.now() + 20_000
        while (copies.inFlight > 0 && Date.now() < until) await new Promise((r) => setTimeout(r, 20))
        expect(copies.inFlight).toBe(0)
        expect(b.stats().memory.liveReservations).toBe(0)
        expect((await b.lookup(toks.slice(0, T))).chunks.some((c) => c.tier === 'memory')).toBe(false)
        // The slot serves the next chunk with its own bytes.
        copies.delayMs = 0
        const other = Array.from({ length: T }, (_, i) => (i * 59 + 3) % 32000)
        const otherKv = pattern(CB, 80)
        await b.store(other, otherKv)
        const into = new Uint8Array(CB)
        expect((await b.retrieve(other, { into }))[0]).toBe(1)
        expect(Buffer.compare(into, otherKv)).toBe(0)
        await b.flush()
        expect(b.stats().memory.livePins).toBe(0)
      } finally {
        await b.close(100)
        await gw.close()
      }
    })
  },
)
