// Checks chunk objects the client receives: full verification, identity (every
// field of the chunk asked for), the most bytes such an object can have, and layer-range answers.

import { FormatError, InvalidArgumentError } from '../core/errors.ts'
import {
  type ChunkHeader,
  type ChunkMeta,
  decodeHeader,
  FORMAT_VERSION_CALIBRATED,
  headerBytesFor,
  layerSpan,
  openLayerSubset,
  sectionOf,
  uncheckedSectionOf,
} from '../core/format.ts'
import { type KvGeometry, layerSlabBytes, sameGeometry } from '../core/layout.ts'

export type ChunkCodecName = 'raw' | 'lossless' | 'kvgate'

/** What a chunk object describes besides its codec. */
export type ChunkIdentity = Omit<ChunkMeta, 'codec' | 'codecVersion' | 'codecParams'>

function bad(message: string): never {
  throw new FormatError('ERR_FORMAT_BAD_FIELD', message)
}

function sameBytes(a: Uint8Array, b: Uint8Array): boolean {
  if (a.byteLength !== b.byteLength) return false
  for (let i = 0; i < a.byteLength; i++) if (a[i] !== b[i]) return false
  return true
}

/**
 * Checks that a header describes exactly the chunk we asked for: geometry and
 * dtype, token count, partial flag, position, namespace (model + key scheme),
 * parent and chain key. A valid object of another model, prompt position or
 * chain (forged or misfiled) is as wrong as a flipped bit: the caller counts it corrupt.
 */
export function checkIdentity(h: ChunkHeader, want: ChunkIdentity): void {
  const hg = h.geometry
  const g = want.geometry
  // Latent included: an MLA chunk of the other representation (a latent chunk read as a K/V
  // slab, or the reverse) has other bytes per layer and is as wrong as another model's.
  if (!sameGeometry(hg, g)) bad('chunk geometry does not match this cache')
  if (h.tokens !== want.tokens) bad(`chunk holds ${h.tokens} tokens, expected ${want.tokens}`)
  if (h.partial !== want.partial) bad(`chunk partial flag is ${h.partial}, expected ${want.partial}`)
  if (h.chunkIndex !== want.chunkIndex) bad(`chunk index is ${h.chunkIndex}, expected ${want.chunkIndex}`)
  if (!sameBytes(h.namespaceId, want.namespaceId))
    bad('chunk belongs to another namespace (model or key scheme)')
  if (!sameBytes(h.parentKey, want.parentKey)) bad('chunk parent key does not match its chain')
  if (!sameBytes(h.chainKey, want.chainKey)) bad('chunk chain key does not match its name')
}

/**
 * The most bytes one encoded layer section of `tokens` tokens may take. Raw is
 * the slab; lossless stores an incompressible byte plane as is (one flag byte
 * per plane); the lossy codec's worst case measured on random bits is 1.6× a
 * one-token slab. Twice the slab plus 1 KiB bounds them all with room to spare:
 * the point is refusing a body of gigabytes for a chunk of kilobytes.
 */
export function maxSectionBytes(g: KvGeometry, tokens: number): number {
  return 2 * layerSlabBytes(g, tokens) + 1024
}

/** The most bytes a whole chunk object of this geometry and token count can have (v2's longer header). */
export function maxObjectBytes(g: KvGeometry, tokens: number): number {
  return headerBytesFor(g.layers, FORMAT_VERSION_CALIBRATED) + g.layers * maxSectionBytes(g, tokens)
}

/** The most bytes a `?layers=first-last` answer (header + those sections) can have. */
export function maxLayerGroupBytes(g: KvGeometry, tokens: number, first: number, last: number): number {
  return headerBytesFor(g.layers, FORMAT_VERSION_CALIBRATED) + (last - first + 1) * maxSectionBytes(g, tokens)
}

/**
 * Opens a `?layers=a-b` answer (header + sections a..b): verifies the header,
 * identity and length; `section(l)` returns layer l's bytes, CRC checked. A whole
 * object where a subset was asked (a caching proxy in front of the gateway that
 * dropped the query) is opened as one (`whole`): its bytes may well be valid, and
 * the layers asked for are served from it when their sections verify.
 */
export function openLayerGroup(
  body: Uint8Array,
  first: number,
  last: number,
  want: ChunkIdentity,
): {
  header: ChunkHeader
  whole: boolean
  section(layer: number): Uint8Array
  /** The section with its CRC not yet checked (a codec worker checks it). */
  unchecked(layer: number): Uint8Array
} {
  const header = decodeHeader(body)
  const span = layerSpan(header, first, last)
  if (body.length === header.totalBytes && body.length !== header.headerBytes + span.end - span.start) {
    checkIdentity(header, want)
    const inSubset = (layer: number) => {
      if (!Number.isInteger(layer) || layer < first || layer > last)
        throw new InvalidArgumentError(`layer ${layer} is not in the subset ${first}-${last}`)
    }
    return {
      header,
      whole: true,
      section(layer: number): Uint8Array {
        inSubset(layer)
        return sectionOf(body, header, layer)
      },
      unchecked(layer: number): Uint8Array {
        inSubset(layer)
        return uncheckedSectionOf(body, header, layer)
      },
    }
  }
  const sub = openLayerSubset(body, first, last)
  checkIdentity(sub.header, want)
  return { ...sub, whole: false }
}
