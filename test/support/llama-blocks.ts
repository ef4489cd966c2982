// Llama-like engine blocks for agent tests (32 KiB each: 16 tokens x 8 KV heads x 128 dims, bf16)
// so that a threaded copy of a chunk is still running when a test ends or cancels its request.

export const LLAMA_LAYERS = 16
export const LLAMA_GEOMETRY = {
  layout: 'flash-attn',
  dtype: 'bfloat16',
  layers: LLAMA_LAYERS,
  kvHeads: 8,
  headSize: 128,
  blockSize: 16,
}
export const LLAMA_BLOCK_BYTES = 16 * 8 * 128 * 2
export const LLAMA_BLOCKS = 48
/** One layer's FlashAttention tensor [2, blocks, 16, 8, 128]. */
export const LLAMA_LAYER_BYTES = 2 * LLAMA_BLOCKS * LLAMA_BLOCK_BYTES
