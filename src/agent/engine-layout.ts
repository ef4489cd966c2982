// vLLM's paged KV layouts as the agent sees them: where block b's K (or V, or MLA latent)
// lies in a layer tensor, and where it lies in kvgate's chunk tensor.
//
// FlashAttention [2, num_blocks, block_size, kv_heads, head_size], FlashInfer
// [num_blocks, 2, block_size, kv_heads, head_size], MLA [num_blocks, block_size, latent_dim].
// In every one a block's K (V, latent) is one contiguous run of blockBytes.

import { type Dtype, dtypeBytes, type KvGeometry } from '../core/layout.ts'

export type EngineLayout = 'flash-attn' | 'flashinfer' | 'mla'
export const ENGINE_LAYOUTS: readonly EngineLayout[] = ['flash-attn', 'flashinfer', 'mla']

/** What an engine worker's KV looks like (per TP rank). */
export interface EngineGeometry {
  layout: EngineLayout
  layers: number
  /** KV heads on this rank (1 for MLA). */
  kvHeads: number
  /** Head size, or the latent dim for MLA. */
  headSize: number
  blockSize: number
  dtype: Dtype
}

/** Bytes of one block's K (or V, or latent) in one layer. */
export function blockBytes(g: EngineGeometry): number {
  return g.blockSize * g.kvHeads * g.headSize * dtypeBytes(g.dtype)
}

/** K and V (2) or the latent alone (1). */
export function sides(g: EngineGeometry): 1 | 2 {
  return g.layout === 'mla' ? 1 : 2
}

/** The shape vLLM allocates for one layer with `numBlocks` blocks. */
export function layerShape(g: EngineGeometry, numBlocks: number): number[] {
  switch (g.layout) {
    case 'flash-attn':
      return [2, numBlocks, g.blockSize, g.kvHeads, g.headSize]
    case 'flashinfer':
      return [numBlocks, 2, g.blockSize, g.kvHeads, g.headSize]
    case 'mla':
      return [numBlocks, g.blockSize, g.headSize]
  }
}

export function contiguousStrides(shape: readonly number[]): number[] {
  const out = new Array<number>(shape.length)
  let s = 1
  for (let i = shape.length - 1; i >= 0; i--) {
    out[i] = s
    s *= shape[i]!
  }
  return out
}

/** Bytes of one layer tensor. */
export function layerBytes(g: EngineGeometry, numBlocks: number): number {
  return sides(g) * numBlocks * blockBytes(g)
}

/** Byte offset of block `block`'s run for `side` (0 = K or latent, 1 = V) inside a layer tensor. */
export function blockOffset(g: EngineGeometry, numBlocks: number, side: number, block: number): number {
  const bb = blockBytes(g)
  if (g.layout === 'flash-attn') return (side * numBlocks + block) * bb
  if (g.layout === 'flashinfer') return (block * 2 + side) * bb
  return block * bb
}

/**
 * The kvgate geometry a chunk of this engine is stored with. Chunk tensors are
 * [layer][K|V][token][kvHead][headDim]; an MLA engine's are latent chunks,
 * [layer][token][latent] (kvHeads 1, headDim = the latent dim, docs/format.md flags bit 1),
 * so the codecs see the latent's own channels.
 */
export function storageGeometry(g: EngineGeometry): KvGeometry {
  if (g.layout === 'mla')
    return { layers: g.layers, kvHeads: 1, headDim: g.headSize, dtype: g.dtype, latent: true }
  return { layers: g.layers, kvHeads: g.kvHeads, headDim: g.headSize, dtype: g.dtype }
}

/** Byte offset of chunk-local block j's run for (layer, side) in the chunk tensor of `blocksPerChunk` blocks. */
export function chunkOffset(
  g: EngineGeometry,
  blocksPerChunk: number,
  layer: number,
  side: number,
  j: number,
): number {
  const bb = blockBytes(g)
  return ((layer * sides(g) + side) * blocksPerChunk + j) * bb
}

/**
 * The copy runs ([tensorOffset, slabOffset, bytes] triples) between the engine blocks
 * `ids[first .. first + blocksPerChunk)` of one layer tensor and that chunk's slab of one
 * layer. The same in every layer: a layer's slab and tensor are passed with them. Blocks
 * before `skip` (engine-wide index) are left out.
 */
export function chunkRuns(
  g: EngineGeometry,
  numBlocks: number,
  ids: readonly number[],
  first: number,
  blocksPerChunk: number,
  skip: number,
): number[] {
  const bb = blockBytes(g)
  const runs: number[] = []
  for (let side = 0; side < sides(g); side++) {
    for (let j = 0; j < blocksPerChunk; j++) {
      if (first + j < skip) continue
      runs.push(
        blockOffset(g, numBlocks, side, ids[first + j]!),
        chunkOffset(g, blocksPerChunk, 0, side, j),
        bb,
      )
    }
  }
  return runs
}
