// Test helpers that build chunk objects (codec 'raw') with deterministic contents.

import { type ChunkMeta, encodeChunk } from '../../src/core/format.ts'
import { type KvGeometry, layerSlabBytes } from '../../src/core/layout.ts'

export function pseudoRandomBytes(n: number, seed: number): Uint8Array {
  const out = new Uint8Array(n)
  let x = seed >>> 0 || 1
  for (let i = 0; i < n; i++) {
    x ^= x << 13
    x ^= x >>> 17
    x ^= x << 5
    out[i] = x & 0xff
  }
  return out
}

export const TINY: KvGeometry = { layers: 3, kvHeads: 2, headDim: 4, dtype: 'fp16' }

export function sampleMeta(overrides: Partial<ChunkMeta> = {}): ChunkMeta {
  return {
    codec: 'raw',
    codecVersion: 1,
    codecParams: new Uint8Array(0),
    geometry: TINY,
    tokens: 4,
    chunkIndex: 0,
    partial: false,
    namespaceId: pseudoRandomBytes(16, 1),
    chainKey: pseudoRandomBytes(32, 2),
    parentKey: pseudoRandomBytes(32, 3),
    ...overrides,
  }
}

/** A valid raw chunk object: one layer slab of random bytes per layer. */
export function sampleChunk(
  overrides: Partial<ChunkMeta> = {},
  seed = 9,
): { meta: ChunkMeta; sections: Uint8Array[]; bytes: Uint8Array } {
  const meta = sampleMeta(overrides)
  const sections = Array.from({ length: meta.geometry.layers }, (_, i) =>
    pseudoRandomBytes(layerSlabBytes(meta.geometry, meta.tokens), seed + i),
  )
  return { meta, sections, bytes: encodeChunk(meta, sections) }
}
