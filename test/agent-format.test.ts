// Chunk header flags bit 1 (contract C4): MLA latent KV is representable, old objects
// read as not latent, and a latent header with more than one KV head is refused.

import { describe, expect, it } from 'vitest'
import { crc32 } from '../src/core/checksum.ts'
import { decodeHeader, encodeChunk, verifyChunk } from '../src/core/format.ts'
import { sampleMeta } from './support/chunks.ts'

const LATENT = { layers: 2, kvHeads: 1, headDim: 16, dtype: 'bf16' } as const

describe('latent (MLA) chunks', () => {
  it('round-trips the latent flag; objects without it read as not latent', () => {
    const latent = encodeChunk(sampleMeta({ geometry: LATENT, latent: true }), [
      new Uint8Array(4 * 16 * 2),
      new Uint8Array(4 * 16 * 2),
    ])
    expect(decodeHeader(latent).latent).toBe(true)
    expect(verifyChunk(latent).geometry).toEqual(LATENT)
    expect(new DataView(latent.buffer).getUint16(6, true)).toBe(2)
    const plain = encodeChunk(sampleMeta(), [new Uint8Array(8), new Uint8Array(8), new Uint8Array(8)])
    expect(decodeHeader(plain).latent).toBe(false)
  })

  it('refuses latent with more than one kv head, on write and on read', () => {
    expect(() =>
      encodeChunk(sampleMeta({ latent: true }), [new Uint8Array(1), new Uint8Array(1), new Uint8Array(1)]),
    ).toThrow(/latent/)
    // A hostile writer: set bit 1 on a 2-head header and fix its CRC.
    const bytes = encodeChunk(sampleMeta(), [new Uint8Array(8), new Uint8Array(8), new Uint8Array(8)])
    const dv = new DataView(bytes.buffer)
    dv.setUint16(6, 2, true)
    const hb = dv.getUint32(8, true)
    dv.setUint32(hb - 4, crc32(bytes.subarray(0, hb - 4)), true)
    expect(() => decodeHeader(bytes)).toThrow(/latent/)
    dv.setUint16(6, 4, true)
    dv.setUint32(hb - 4, crc32(bytes.subarray(0, hb - 4)), true)
    expect(() => decodeHeader(bytes)).toThrow(/unknown flags/)
  })
})
