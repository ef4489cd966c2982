// Turns chunk tensors into chunk objects and back, through src/codec (raw,
// lossless, kvgate lossy). Decoding follows the codec the object names.

import { decodeChunkInto, decodeSection, encodeChunk } from '../codec/node.ts'
import { FormatError } from '../core/errors.ts'
import { type ChunkHeader, type ChunkMeta, openLayerSubset, verifyChunk } from '../core/format.ts'
import { toHex } from '../core/keys.ts'
import type { KvGeometry } from '../core/layout.ts'

export type ChunkCodecName = 'raw' | 'lossless' | 'kvgate'

/** What a chunk object describes besides its codec. */
export type ChunkIdentity = Omit<ChunkMeta, 'codec' | 'codecVersion' | 'codecParams'>

/** Encodes one chunk tensor. */
export function encodeTensor(codec: ChunkCodecName, tensor: Uint8Array, id: ChunkIdentity): Uint8Array {
  return encodeChunk(tensor, id, { mode: codec })
}

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

/** Verifies and decodes a whole object into `dst` (one chunk tensor). */
export function decodeObjectInto(
  object: Uint8Array,
  dst: Uint8Array,
  g: KvGeometry,
  tokens: number,
  hex: string,
): void {
  verifyObject(object, g, tokens, hex)
  decodeChunkInto(object, dst)
}

/**
 * Opens a `?layers=a-b` answer (header + sections a..b): verifies the header,
 * identity and length, and returns a decoder per layer (section CRC checked).
 */
export function openLayerGroup(
  body: Uint8Array,
  first: number,
  last: number,
  g: KvGeometry,
  tokens: number,
  hex: string,
): (layer: number, out?: Uint8Array) => Uint8Array {
  const sub = openLayerSubset(body, first, last)
  checkIdentity(sub.header, g, tokens, hex)
  return (layer, out) => decodeSection(sub.header, layer, sub.section(layer), out)
}
