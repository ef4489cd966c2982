// Latent (MLA) chunks in the format (flags bit 1, docs/format.md): the flag is part of the
// geometry, K/V objects read as they always did, and a malformed latent header or geometry
// is a typed error; the layout helpers and the namespace seed tell latent from K/V.

import { describe, expect, it } from 'vitest'
import { crc32 } from '../src/core/checksum.ts'
import { FormatError, InvalidArgumentError } from '../src/core/errors.ts'
import { ChunkVerifier, decodeHeader, encodeChunk, openLayerSubset, verifyChunk } from '../src/core/format.ts'
import { namespaceId } from '../src/core/keys.ts'
import {
  bytesPerToken,
  chunkBytes,
  type KvGeometry,
  kvPlanes,
  kvRange,
  layerSlabBytes,
  sameGeometry,
  sliceTokens,
  validateGeometry,
} from '../src/core/layout.ts'
import { sampleMeta } from './support/chunks.ts'

const LATENT = {
  layers: 2,
  kvHeads: 1,
  headDim: 16,
  dtype: 'bf16',
  latent: true,
} as const satisfies KvGeometry
const SPLIT = { layers: 2, kvHeads: 1, headDim: 8, dtype: 'bf16' } as const satisfies KvGeometry

/** Rewrites header bytes [at, at + 2) and fixes the header CRC (a hostile writer). */
function patchU16(bytes: Uint8Array, at: number, v: number): Uint8Array {
  const out = bytes.slice()
  const dv = new DataView(out.buffer)
  dv.setUint16(at, v, true)
  const hb = dv.getUint32(8, true)
  dv.setUint32(hb - 4, crc32(out.subarray(0, hb - 4)), true)
  return out
}

function typed(f: () => unknown, code: string): void {
  let err: unknown
  try {
    f()
  } catch (e) {
    err = e
  }
  expect(err).toBeInstanceOf(FormatError)
  expect((err as FormatError).code).toBe(code)
}

describe('latent (MLA) chunks in the format', () => {
  const latentObject = () =>
    encodeChunk(sampleMeta({ geometry: LATENT }), [new Uint8Array(4 * 16 * 2), new Uint8Array(4 * 16 * 2)])

  it('round-trips the latent flag as part of the geometry; K/V objects have none', () => {
    const latent = latentObject()
    expect(new DataView(latent.buffer).getUint16(6, true)).toBe(2)
    expect(decodeHeader(latent).geometry).toEqual(LATENT)
    expect(verifyChunk(latent).geometry).toEqual(LATENT)
    const h = decodeHeader(latent)
    const s1 = h.sections[1]!
    const subset = Uint8Array.from([
      ...latent.subarray(0, h.headerBytes),
      ...latent.subarray(s1.offset, s1.offset + s1.length),
    ])
    expect(openLayerSubset(subset, 1, 1).header.geometry).toEqual(LATENT)
    const v = new ChunkVerifier()
    v.push(latent)
    expect(v.finish().geometry).toEqual(LATENT)
    const plain = encodeChunk(sampleMeta(), [new Uint8Array(8), new Uint8Array(8), new Uint8Array(8)])
    expect(new DataView(plain.buffer).getUint16(6, true)).toBe(0)
    expect('latent' in decodeHeader(plain).geometry).toBe(false)
    // latent: false writes the same bytes as no latent at all.
    const g = sampleMeta().geometry
    const explicit = encodeChunk(sampleMeta({ geometry: { ...g, latent: false } }), [
      new Uint8Array(8),
      new Uint8Array(8),
      new Uint8Array(8),
    ])
    expect(explicit).toEqual(plain)
  })

  it('refuses a latent geometry with more than one kv head, or a latent that is not a boolean, on write', () => {
    const sections = [new Uint8Array(1), new Uint8Array(1), new Uint8Array(1)]
    const g = sampleMeta().geometry
    expect(g.kvHeads).toBe(2)
    expect(() => encodeChunk(sampleMeta({ geometry: { ...g, latent: true } }), sections)).toThrow(
      InvalidArgumentError,
    )
    expect(() =>
      encodeChunk(sampleMeta({ geometry: { ...g, latent: 1 as unknown as boolean } }), sections),
    ).toThrow(/latent/)
  })

  it('reads a hostile latent header as a typed error: more than one kv head, unknown flags', () => {
    const plain = encodeChunk(sampleMeta(), [new Uint8Array(8), new Uint8Array(8), new Uint8Array(8)])
    typed(() => decodeHeader(patchU16(plain, 6, 2)), 'ERR_FORMAT_BAD_FIELD')
    expect(() => decodeHeader(patchU16(plain, 6, 2))).toThrow(/latent/)
    typed(() => decodeHeader(patchU16(plain, 6, 4)), 'ERR_FORMAT_BAD_FIELD')
    typed(() => decodeHeader(patchU16(plain, 6, 3 | 8)), 'ERR_FORMAT_BAD_FIELD')
    // A latent object whose kv heads were raised to 4 (CRC fixed): refused, not read as K/V.
    typed(() => decodeHeader(patchU16(latentObject(), 46, 4)), 'ERR_FORMAT_BAD_FIELD')
    // Partial and latent together are fine.
    expect(decodeHeader(patchU16(latentObject(), 6, 3))).toMatchObject({ partial: true, geometry: LATENT })
    // The flag without a CRC fix is a checksum error (flags are covered).
    const flipped = latentObject()
    flipped[6] = 0
    typed(() => decodeHeader(flipped), 'ERR_FORMAT_CHECKSUM')
  })

  it('lays a latent chunk out as one plane per layer', () => {
    expect(kvPlanes(LATENT)).toBe(1)
    expect(kvPlanes(SPLIT)).toBe(2)
    expect(layerSlabBytes(LATENT, 4)).toBe(4 * 16 * 2)
    expect(chunkBytes(LATENT, 4)).toBe(chunkBytes(SPLIT, 4))
    expect(bytesPerToken(LATENT)).toBe(2 * 16 * 2)
    expect(kvRange(LATENT, 4, 1, 0)).toEqual({ start: 128, end: 256 })
    expect(() => kvRange(LATENT, 4, 1, 1)).toThrow(/no V/)
    // Tokens [1, 3) of each layer: rows of 16 values.
    const chunk = Uint8Array.from({ length: chunkBytes(LATENT, 4) }, (_, i) => i & 0xff)
    const part = sliceTokens(LATENT, chunk, 4, 1, 3)
    expect(part).toEqual(Uint8Array.from([...chunk.subarray(32, 96), ...chunk.subarray(160, 224)]))
    expect(() => validateGeometry({ ...LATENT, kvHeads: 2 })).toThrow(/latent/)
    expect(() => validateGeometry({ ...LATENT, latent: 'yes' as unknown as boolean })).toThrow(/latent/)
    expect(sameGeometry(LATENT, { ...LATENT })).toBe(true)
    expect(sameGeometry(LATENT, { ...LATENT, latent: false })).toBe(false)
    expect(sameGeometry(SPLIT, { ...SPLIT, latent: false })).toBe(true)
  })

  it('gives a latent geometry its own namespace; K/V namespaces are unchanged', () => {
    const ns = (geometry: KvGeometry) => namespaceId({ modelId: 'm', geometry, chunkTokens: 32 })
    const kv = { ...LATENT, latent: false }
    expect(ns(LATENT)).not.toBe(ns(kv))
    expect(ns(kv)).toBe(ns({ layers: 2, kvHeads: 1, headDim: 16, dtype: 'bf16' }))
  })
})

describe('dtype and codec names', () => {
  // An engine's registration or a library caller names them as strings: `in` also found
  // toString and constructor on every object, and the header then carried a code of 0.
  const names = ['toString', 'constructor', '__proto__', 'valueOf']
  it('a geometry whose dtype is a name every object has is refused', () => {
    for (const dtype of names) {
      const g = { layers: 2, kvHeads: 1, headDim: 4, dtype } as unknown as KvGeometry
      expect(() => validateGeometry(g), dtype).toThrow(InvalidArgumentError)
      expect(() => encodeChunk(sampleMeta({ geometry: g }), []), dtype).toThrow(InvalidArgumentError)
      expect(() => namespaceId({ modelId: 'm', geometry: g, chunkTokens: 4 }), dtype).toThrow(
        InvalidArgumentError,
      )
    }
  })
  it('so is such a codec', () => {
    for (const codec of names)
      expect(() => encodeChunk(sampleMeta({ codec: codec as 'raw' }), []), codec).toThrow(/unknown codec/)
  })
})
