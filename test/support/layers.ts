// Checks on what retrieveLayers yields, shared by the L4 tests.

import { expect } from 'vitest'
import type { LayerBatch } from '../../src/client/index.ts'

/**
 * Reads every batch of a retrieveLayers run: each must hold `chunks` chunks and, unless `bytes`
 * is false (a lossy codec), chunk i's slab must equal its layer of `kv` (the chunk tensors of
 * `chunkBytes` back to back, `slab` bytes per layer). Returns the layers yielded, in order.
 */
export async function expectLayersAsStored(
  batches: AsyncIterable<LayerBatch>,
  kv: Uint8Array,
  o: { chunks: number; chunkBytes: number; slab: number; bytes?: boolean },
): Promise<number[]> {
  const layers: number[] = []
  for await (const batch of batches) {
    layers.push(batch.layer)
    expect(batch.chunks).toBe(o.chunks)
    if (o.bytes === false) continue
    for (let i = 0; i < o.chunks; i++) {
      const at = i * o.chunkBytes + batch.layer * o.slab
      expect(Buffer.compare(batch.slabs[i]!, kv.subarray(at, at + o.slab))).toBe(0)
    }
  }
  return layers
}
