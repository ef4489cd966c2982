import type { ChunkInfo } from '../../src/codec/index.ts'
import type { KvGeometry } from '../../src/core/layout.ts'

/**
 * The chunk fields encodeChunk needs beside the tensor, for objects a benchmark codes and never
 * stores: zero namespace and keys (they only feed the header and its CRC, not the codec).
 */
export function chunkInfo(geometry: KvGeometry, tokens: number, chunkIndex = 0): ChunkInfo {
  return {
    geometry,
    tokens,
    chunkIndex,
    partial: false,
    namespaceId: new Uint8Array(16),
    chainKey: new Uint8Array(32),
    parentKey: new Uint8Array(32),
  }
}
