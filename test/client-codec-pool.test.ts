// The codec pool must give the same bytes on worker threads as inline, report
// codec errors as errors, and fall back to inline work when workers are off.

import { afterAll, describe, expect, it } from 'vitest'
import { CodecPool } from '../src/client/codec-pool.ts'
import { decodeChunk, encodeChunk } from '../src/codec/node.ts'
import { decodeHeader } from '../src/core/format.ts'
import { chunkBytes, layerSlabBytes, MODEL_PRESETS } from '../src/core/layout.ts'
import { metaFor, syntheticKv, tensorOf } from './codec-fixtures.ts'

const g = MODEL_PRESETS.stories260k
const tensor = tensorOf(syntheticKv(g, 32, 3), g.dtype)
const meta = metaFor(g, 32)
const pools: CodecPool[] = []
afterAll(async () => {
  for (const p of pools) await p.close()
})

describe('CodecPool', () => {
  it.each([1, 0])('with %i workers: encode and decode match the codec called directly', async (workers) => {
    const pool = new CodecPool(workers)
    pools.push(pool)
    for (const mode of ['lossless', 'kvgate'] as const) {
      const obj = await pool.encode(mode, tensor, meta)
      expect(Buffer.compare(obj, encodeChunk(tensor, meta, { mode }))).toBe(0)
      const out = new Uint8Array(chunkBytes(g, 32))
      await pool.decodeInto(obj, mode, out)
      expect(Buffer.compare(out, decodeChunk(obj))).toBe(0)
      const h = decodeHeader(obj)
      const s = h.sections[2]!
      const slab = await pool.decodeSection(h, 2, obj.subarray(s.offset, s.offset + s.length))
      expect(Buffer.compare(slab, out.subarray(2 * layerSlabBytes(g, 32), 3 * layerSlabBytes(g, 32)))).toBe(0)
    }
    if (workers > 0) expect(pool.counts.workerJobs).toBeGreaterThan(0)
    else expect(pool.counts.workerJobs).toBe(0)
  })

  it('a garbage section is a CodecError from the worker, and the pool keeps working', async () => {
    const pool = new CodecPool(1)
    pools.push(pool)
    const obj = await pool.encode('kvgate', tensor, meta)
    const h = decodeHeader(obj)
    const s = h.sections[1]!
    const bad = obj.slice(s.offset, s.offset + s.length).fill(0xff)
    await expect(pool.decodeSection(h, 1, bad)).rejects.toMatchObject({ code: 'ERR_CODEC' })
    expect((await pool.encode('lossless', tensor, meta)).byteLength).toBeGreaterThan(0)
  })
})
