// Checks chunk objects the client receives: full verification, identity (the
// chunk asked for, this geometry), and layer-range answers of the gateway.

import { FormatError } from '../core/errors.ts'
import { type ChunkHeader, type ChunkMeta, openLayerSubset, verifyChunk } from '../core/format.ts'
import { toHex } from '../core/keys.ts'
import type { KvGeometry } from '../core/layout.ts'

export type ChunkCodecName = 'raw' | 'lossless' | 'kvgate'

/** What a chunk object describes besides its codec. */
export type ChunkIdentity = Omit<ChunkMeta, 'codec' | 'codecVersion' | 'codecParams'>

/**
 * Checks that a header describes the chunk we asked for; anything else (another
 * geometry, another key, another token count) is treated as corrupt.
 */
export function checkIdentity(h: ChunkHeader, g: KvGeometry, tokens: number, hex: string): void {
  const hg = h.geometry
  if (
    hg.layers !== g.layers ||
    hg.kvHeads !== g.kvHeads ||
    hg.headDim !== g.headDim ||
    hg.dtype !== g.dtype
  ) {
    throw new FormatError('ERR_FORMAT_BAD_FIELD', 'chunk geometry does not match this cache')
  }
  if (h.tokens !== tokens)
    throw new FormatError('ERR_FORMAT_BAD_FIELD', `chunk holds ${h.tokens} tokens, expected ${tokens}`)
  if (toHex(h.chainKey) !== hex)
    throw new FormatError('ERR_FORMAT_BAD_FIELD', 'chunk chain key does not match its name')
}

/**
 * Verifies a whole chunk object (header, every section CRC, exact length, identity)
 * and returns its header. Throws FormatError: callers treat that as a miss.
 */
export function verifyObject(object: Uint8Array, g: KvGeometry, tokens: number, hex: string): ChunkHeader {
  const h = verifyChunk(object)
  checkIdentity(h, g, tokens, hex)
  return h
}

/**
 * Opens a `?layers=a-b` answer (header + sections a..b): verifies the header,
 * identity and length; `section(l)` returns layer l's bytes, CRC checked.
 */
export function openLayerGroup(
  body: Uint8Array,
  first: number,
  last: number,
  g: KvGeometry,
  tokens: number,
  hex: string,
): { header: ChunkHeader; section(layer: number): Uint8Array } {
  const sub = openLayerSubset(body, first, last)
  checkIdentity(sub.header, g, tokens, hex)
  return sub
}
