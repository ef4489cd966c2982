// Turns chunk tensors into chunk objects and back. 'raw' is built here on
// core/format; 'lossless' and 'kvgate' come from src/codec (loaded on first use).

import { CodecError, FormatError } from '../core/errors.ts'
import { type ChunkHeader, type ChunkMeta, type CodecId, encodeChunk, sectionOf, verifyChunk } from '../core/format.ts'
import { toHex } from '../core/keys.ts'
import { chunkBytes, type KvGeometry, layerSlabBytes } from '../core/layout.ts'

export type ChunkCodecName = 'raw' | 'lossless' | 'kvgate'

/** What a chunk object describes besides its codec. */
export type ChunkIdentity = Omit<ChunkMeta, 'codec' | 'codecVersion' | 'codecParams'>

/** The codec module's surface as the client uses it (src/codec/index.ts). */
interface CodecModule {
  encodeChunk: (tensor: Uint8Array, meta: ChunkIdentity, opts: { mode: string }) => Uint8Array | Promise<Uint8Array>
  decodeChunk: (bytes: Uint8Array, ...rest: unknown[]) => unknown
  decodeLayer?: (bytes: Uint8Array, ...rest: unknown[]) => unknown
}

let codecModule: Promise<CodecModule> | undefined

function loadCodec(): Promise<CodecModule> {
  // Computed specifier: src/codec may be absent from a partial checkout.
  const spec = '../codec/index.ts'
  codecModule ??= (import(spec) as Promise<CodecModule>).catch((e: Error) => {
    codecModule = undefined
    throw new CodecError(`codec module unavailable: ${e.message.split('\n')[0]}`)
  })
  return codecModule
}

function asBytes(v: unknown): Uint8Array {
  if (v instanceof Uint8Array) return v
  if (ArrayBuffer.isView(v)) return new Uint8Array(v.buffer, v.byteOffset, v.byteLength)
  if (typeof v === 'object' && v !== null) {
    const o = v as { tensor?: unknown; bytes?: unknown; data?: unknown }
    for (const x of [o.tensor, o.bytes, o.data]) if (x !== undefined) return asBytes(x)
  }
  throw new CodecError('codec returned no bytes')
}

/** Encodes one chunk tensor with `codec`. */
export async function encodeTensor(codec: ChunkCodecName, tensor: Uint8Array, id: ChunkIdentity): Promise<Uint8Array> {
  if (codec === 'raw') {
    const g = id.geometry
    const slab = layerSlabBytes(g, id.tokens)
    const sections: Uint8Array[] = []
    for (let l = 0; l < g.layers; l++) sections.push(tensor.subarray(l * slab, (l + 1) * slab))
    return encodeChunk({ ...id, codec: 'raw', codecVersion: 1, codecParams: new Uint8Array(0) }, sections)
  }
  const mod = await loadCodec()
  return asBytes(await mod.encodeChunk(tensor, id, { mode: codec }))
}

/**
 * Checks that a verified header describes the chunk we asked for; anything else
 * (another geometry, another key, a partial chunk) is treated as corrupt.
 */
export function checkIdentity(h: ChunkHeader, g: KvGeometry, tokens: number, hex: string): void {
  const hg = h.geometry
  if (hg.layers !== g.layers || hg.kvHeads !== g.kvHeads || hg.headDim !== g.headDim || hg.dtype !== g.dtype) {
    throw new FormatError('ERR_FORMAT_BAD_FIELD', 'chunk geometry does not match this cache')
  }
  if (h.tokens !== tokens) throw new FormatError('ERR_FORMAT_BAD_FIELD', `chunk holds ${h.tokens} tokens, expected ${tokens}`)
  if (toHex(h.chainKey) !== hex) throw new FormatError('ERR_FORMAT_BAD_FIELD', 'chunk chain key does not match its name')
}

/**
 * Verifies a whole chunk object and decodes it into `dst` (a chunk tensor). The
 * codec is the one the object names, whatever this node encodes with.
 * Throws FormatError / CodecError: callers treat that as a miss.
 */
export async function decodeObjectInto(
  object: Uint8Array,
  dst: Uint8Array,
  g: KvGeometry,
  tokens: number,
  hex: string,
): Promise<ChunkHeader> {
  const h = verifyChunk(object)
  checkIdentity(h, g, tokens, hex)
  if (dst.byteLength !== chunkBytes(g, tokens)) throw new CodecError('destination is not one chunk tensor')
  if (h.codec === 'raw') {
    const slab = layerSlabBytes(g, tokens)
    for (let l = 0; l < g.layers; l++) {
      const s = sectionOf(object, h, l)
      if (s.byteLength !== slab) throw new FormatError('ERR_FORMAT_BAD_FIELD', 'raw section has the wrong size')
      dst.set(s, l * slab)
    }
    return h
  }
  const mod = await loadCodec()
  const out = asBytes(await mod.decodeChunk(object))
  if (out.byteLength !== dst.byteLength) throw new CodecError('decoded chunk has the wrong size')
  dst.set(out)
  return h
}

/**
 * Decodes one layer section (already crc-checked) into a layer slab. For raw
 * chunks this is the section itself (no copy).
 */
export async function decodeSection(
  h: ChunkHeader,
  object: Uint8Array,
  layer: number,
  g: KvGeometry,
  tokens: number,
): Promise<Uint8Array> {
  const expected = layerSlabBytes(g, tokens)
  if (h.codec === 'raw') {
    const s = sectionOf(object, h, layer)
    if (s.byteLength !== expected) throw new FormatError('ERR_FORMAT_BAD_FIELD', 'raw section has the wrong size')
    return s
  }
  const mod = await loadCodec()
  if (!mod.decodeLayer) throw new CodecError('codec module has no decodeLayer')
  const out = asBytes(await mod.decodeLayer(object, h, layer))
  if (out.byteLength !== expected) throw new CodecError('decoded layer has the wrong size')
  return out
}

export function codecIdOf(name: ChunkCodecName): CodecId {
  return name
}
