// KV content of a simulated chunk, derived only from its chain key: every node
// "computes" the same KV for the same prefix, so a node can verify whatever it retrieves.

import type { ChunkKey } from '../core/keys.ts'
import { chunkBytes, type KvGeometry } from '../core/layout.ts'
import { kvRelativeError, syntheticKv } from '../model/index.ts'

/**
 * The chunk tensor a forward pass would produce for this chunk: synthetic KV with
 * real KV's statistics (so codec ratios mean something), seeded by the chain key.
 */
export function chunkContent(g: KvGeometry, key: ChunkKey): Uint8Array {
  const k = key.key
  const seed = (k[0]! | (k[1]! << 8) | (k[2]! << 16) | (k[3]! << 24)) >>> 0
  return syntheticKv({
    geometry: g,
    tokens: key.end - key.start,
    seed,
    startPosition: key.start,
    rope: 'adjacent',
  })
}

/** Largest relative RMSE (K or V) a lossy retrieve may show; a wrong chunk lands near 1.4. */
export const LOSSY_VERIFY_BOUND = 0.2

/** True when `got` is this chunk's KV: byte-identical (exact codecs) or within the lossy bound. */
export function verifyChunk(g: KvGeometry, key: ChunkKey, got: Uint8Array, exact: boolean): boolean {
  const want = chunkContent(g, key)
  if (got.byteLength !== chunkBytes(g, key.end - key.start)) return false
  if (exact) return Buffer.compare(want, got) === 0
  const e = kvRelativeError(g, [{ exact: want, decoded: got }])
  return e.kAll <= LOSSY_VERIFY_BOUND && e.vAll <= LOSSY_VERIFY_BOUND
}
