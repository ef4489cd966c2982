// The per-namespace calibration object (src/codec/calibration.ts): built deterministically,
// opened only when well-formed, named by calibrated (format v2) chunks, required to decode
// them, and never changing what a chunk decodes to: only how many bytes it takes.

import { createHash } from 'node:crypto'
import { describe, expect, it } from 'vitest'
import { layerBlobs } from '../src/codec/calibration.ts'
import {
  buildCalibration,
  CalibrationMissingError,
  decodeChunk,
  decodeChunkInto,
  decodeLayer,
  encodeChunk,
  openCalibration,
} from '../src/codec/node.ts'
import { wasmCodec } from '../src/codec/runtime.ts'
import { Sha256, sha256Hex } from '../src/codec/sha256.ts'
import { crc32 } from '../src/core/checksum.ts'
import { decodeHeader, encodeChunk as encodeChunkObject } from '../src/core/format.ts'
import type { KvGeometry } from '../src/core/layout.ts'
import { syntheticKv as modelKv } from '../src/model/index.ts'
import { metaFor, syntheticKv, tensorOf } from './codec-fixtures.ts'

const g: KvGeometry = { layers: 2, kvHeads: 4, headDim: 16, dtype: 'fp16' }
const T = 64
// Same "model" (modelSeed), different content (seed): what a namespace calibrates on and stores.
const chunk = (seed: number, geometry = g, tokens = T) => modelKv({ geometry, tokens, seed })
const samples = [2, 3, 4].map((s) => chunk(s))
const bytes = buildCalibration(samples, { geometry: g, dtype: 'fp16' })
const cal = openCalibration(bytes)
const sha = (b: Uint8Array) => createHash('sha256').update(b).digest('hex')

/** The same bytes with the trailing CRC recomputed (so a mutation reaches the parser). */
function withCrc(b: Uint8Array): Uint8Array {
  const c = b.slice()
  if (c.length < 4) return c
  new DataView(c.buffer).setUint32(c.length - 4, crc32(c.subarray(0, c.length - 4)), true)
  return c
}

describe('SHA-256 (the codec’s TypeScript one)', () => {
  it('one-shot and incremental digests equal node:crypto’s for every length and split', () => {
    const bytes = Uint8Array.from({ length: 1000 }, (_, i) => (i * 131 + (i >> 3)) & 255)
    for (const n of [0, 1, 55, 56, 63, 64, 65, 119, 120, 128, 1000]) {
      const b = bytes.subarray(0, n)
      const want = createHash('sha256').update(b).digest('hex')
      expect(sha256Hex(b), `${n}`).toBe(want)
      for (const step of [1, 3, 63, 64, 65, 333]) {
        const h = new Sha256()
        for (let i = 0; i < n; i += step) h.update(b.subarray(i, i + step))
        expect(h.hex(), `${n} in pieces of ${step}`).toBe(want)
      }
    }
    const h = new Sha256().update(bytes)
    h.hex()
    expect(() => h.hex()).toThrow(/twice/)
    expect(() => h.update(bytes)).toThrow(/after hex/)
  })
})

describe('calibration object', () => {
  it('is deterministic and named by the SHA-256 of its bytes', () => {
    expect(Buffer.from(buildCalibration(samples, { geometry: g, dtype: 'fp16' }))).toEqual(Buffer.from(bytes))
    expect(cal.hash).toBe(sha(bytes))
    expect(cal.geometry).toEqual(g)
    expect(cal.dtype).toBe('fp16')
    expect(Buffer.from(bytes.subarray(0, 4)).toString()).toBe('KVCL')
    // Other samples, another object (and hash).
    expect(openCalibration(buildCalibration([chunk(9)], { geometry: g, dtype: 'fp16' })).hash).not.toBe(
      cal.hash,
    )
  })

  it('keeps its own copy of the bytes (a Node Buffer the caller reuses does not change it)', () => {
    const buf = Buffer.from(bytes)
    const opened = openCalibration(buf)
    buf.fill(0)
    expect(sha(opened.bytes)).toBe(cal.hash)
    expect(opened.hash).toBe(cal.hash)
  })

  it('refuses bad samples and geometries', () => {
    expect(() => buildCalibration([], { geometry: g, dtype: 'fp16' })).toThrow(/samples/)
    expect(() => buildCalibration([new Uint8Array(7)], { geometry: g, dtype: 'fp16' })).toThrow(
      /whole tokens/,
    )
    expect(() => buildCalibration(samples, { geometry: g, dtype: 'fp8' as 'fp16' })).toThrow(/dtype/)
    expect(() => buildCalibration(samples, { geometry: { ...g, layers: 0 }, dtype: 'fp16' })).toThrow()
  })

  it('a calibrated chunk is format v2 naming the calibration, decodes to exactly what the uncalibrated chunk decodes to, and is smaller', () => {
    const t = chunk(1)
    for (const quality of [1, 3, 5, 9]) {
      const plain = encodeChunk(t, metaFor(g, T), { mode: 'kvgate', quality })
      const calibrated = encodeChunk(t, metaFor(g, T), { mode: 'kvgate', quality, calibration: cal })
      const h = decodeHeader(calibrated)
      expect([h.formatVersion, h.calibration]).toEqual([2, cal.hash])
      expect(decodeHeader(plain).formatVersion).toBe(1)
      // Same quantization: the calibration moves side information, never values.
      expect(Buffer.from(decodeChunk(calibrated, { calibration: cal }))).toEqual(
        Buffer.from(decodeChunk(plain)),
      )
      expect(calibrated.length).toBeLessThan(plain.length)
    }
  })

  it('decodeChunkInto, decodeLayer and decodeSection take the calibration too', () => {
    const t = chunk(1)
    const obj = encodeChunk(t, metaFor(g, T), { mode: 'kvgate', calibration: cal })
    const whole = decodeChunk(obj, { calibration: cal })
    const out = new Uint8Array(whole.length)
    decodeChunkInto(obj, out, { calibration: cal })
    expect(Buffer.from(out)).toEqual(Buffer.from(whole))
    const h = decodeHeader(obj)
    const l1 = decodeLayer(obj, h, 1, undefined, { calibration: cal })
    expect(Buffer.from(l1)).toEqual(Buffer.from(whole.subarray(whole.length / 2)))
    expect(() => decodeLayer(obj, h, 1)).toThrow(CalibrationMissingError)
  })

  it('a chunk naming a calibration that is not given (or another one) is a typed miss, before any output is written', () => {
    const obj = encodeChunk(chunk(1), metaFor(g, T), { mode: 'kvgate', calibration: cal })
    const other = openCalibration(buildCalibration([chunk(9)], { geometry: g, dtype: 'fp16' }))
    for (const given of [undefined, other]) {
      const out = new Uint8Array(obj.length * 8).fill(0xaa)
      let err: unknown
      try {
        decodeChunkInto(obj, out.subarray(0, decodeChunk(obj, { calibration: cal }).length), {
          calibration: given,
        })
      } catch (e) {
        err = e
      }
      expect(err).toBeInstanceOf(CalibrationMissingError)
      expect(err).toMatchObject({ code: 'ERR_CALIBRATION_MISSING', hash: cal.hash })
      expect(out.every((b) => b === 0xaa)).toBe(true)
    }
    // An uncalibrated (v1) chunk decodes with or without one.
    const plain = encodeChunk(chunk(1), metaFor(g, T), { mode: 'kvgate' })
    expect(Buffer.from(decodeChunk(plain, { calibration: cal }))).toEqual(Buffer.from(decodeChunk(plain)))
  })

  it('only kvgate uses it; a calibration for another geometry is refused', () => {
    const t = chunk(1)
    for (const mode of ['lossless', 'q8', 'raw'] as const) {
      const obj = encodeChunk(t, metaFor(g, T), { mode, calibration: cal })
      expect(decodeHeader(obj).formatVersion).toBe(1)
    }
    // A v2 header on another codec's sections (never written, but a writer may be hostile)
    // still decodes them with that codec.
    const q8 = encodeChunk(t, metaFor(g, T), { mode: 'q8' })
    const h = decodeHeader(q8)
    const sections = h.sections.map((x) => q8.subarray(x.offset, x.offset + x.length))
    const q8v2 = encodeChunkObject({ ...h, calibration: cal.hash }, sections)
    expect(Buffer.from(decodeChunk(q8v2, { calibration: cal }))).toEqual(Buffer.from(decodeChunk(q8)))
    const g2 = { ...g, kvHeads: 2 }
    expect(() => encodeChunk(chunk(1, g2), metaFor(g2, T), { mode: 'kvgate', calibration: cal })).toThrow(
      /calibration .* is for 2×4×16 fp16/,
    )
  })

  it('a chunk unlike the calibration samples falls back to its own tables: still exact, hardly larger', () => {
    // Another "model": different channel scales and structure than the calibration saw.
    const f = syntheticKv(g, T, 11)
    const t = tensorOf(
      f.map((v, i) => v * (i % 3 === 0 ? 40 : 0.02)),
      'fp16',
    )
    const plain = encodeChunk(t, metaFor(g, T), { mode: 'kvgate' })
    const calibrated = encodeChunk(t, metaFor(g, T), { mode: 'kvgate', calibration: cal })
    expect(Buffer.from(decodeChunk(calibrated, { calibration: cal }))).toEqual(
      Buffer.from(decodeChunk(plain)),
    )
    expect(calibrated.length).toBeLessThan(plain.length * 1.03)
  })

  it('a plain object carrying the right bytes is accepted; one whose bytes do not hash to its name is not', () => {
    const obj = encodeChunk(chunk(1), metaFor(g, T), { mode: 'kvgate', calibration: cal })
    const plainCal = { hash: cal.hash, bytes: bytes.slice(), geometry: g, dtype: 'fp16' as const }
    expect(Buffer.from(decodeChunk(obj, { calibration: plainCal }))).toEqual(
      Buffer.from(decodeChunk(obj, { calibration: cal })),
    )
    const other = buildCalibration([chunk(9)], { geometry: g, dtype: 'fp16' })
    expect(() => decodeChunk(obj, { calibration: { ...plainCal, bytes: other } })).toThrow(/hash to/)
  })

  it('a plain object whose geometry is not its bytes’ is refused (no v2 chunk names a calibration of another model)', () => {
    // The bytes are a 2-layer calibration; the object claims 4 layers (or another dtype). Trusted,
    // layers 2-3 were coded without any calibration under a v2 header naming it, and a node
    // holding the real calibration refused the chunk for its geometry: a chunk no one decodes.
    const g4 = { ...g, layers: 4 }
    const t4 = new Uint8Array(2 * chunk(1).length)
    t4.set(chunk(1))
    t4.set(chunk(5), chunk(1).length)
    const lying = { hash: cal.hash, bytes: bytes.slice(), geometry: g4, dtype: 'fp16' as const }
    expect(() => encodeChunk(t4, metaFor(g4, T), { mode: 'kvgate', calibration: lying })).toThrow(
      /calibration .* is for 2×4×16 fp16/,
    )
    const wrongDtype = {
      hash: cal.hash,
      bytes: bytes.slice(),
      geometry: { ...g, dtype: 'bf16' as const },
      dtype: 'bf16' as const,
    }
    const gb = { ...g, dtype: 'bf16' as const }
    expect(() =>
      encodeChunk(tensorOf(syntheticKv(gb, T, 3), 'bf16'), metaFor(gb, T), {
        mode: 'kvgate',
        calibration: wrongDtype,
      }),
    ).toThrow(/calibration .* is for 2×4×16 fp16/)
    // Decoding: a v2 chunk of the claimed geometry naming these bytes is refused, never decoded
    // with the layers the bytes lack treated as uncalibrated.
    const obj4 = encodeChunk(t4, metaFor(g4, T), { mode: 'kvgate' })
    const h = decodeHeader(obj4)
    const sections = h.sections.map((x) => obj4.subarray(x.offset, x.offset + x.length))
    const v2 = encodeChunkObject({ ...h, calibration: cal.hash }, sections)
    expect(() => decodeChunk(v2, { calibration: lying })).toThrow(/calibration .* is for 2×4×16 fp16/)
  })

  it('a plain object changed after use to name another calibration is decoded with that one, not the first', () => {
    const mutable = { hash: cal.hash, bytes: bytes.slice(), geometry: g, dtype: 'fp16' as const }
    const obj = encodeChunk(chunk(1), metaFor(g, T), { mode: 'kvgate', calibration: cal })
    decodeChunk(obj, { calibration: mutable })
    const cal2 = openCalibration(buildCalibration([chunk(9), chunk(10)], { geometry: g, dtype: 'fp16' }))
    expect(cal2.hash).not.toBe(cal.hash)
    const obj2 = encodeChunk(chunk(1), metaFor(g, T), { mode: 'kvgate', calibration: cal2 })
    mutable.hash = cal2.hash
    mutable.bytes = cal2.bytes.slice()
    expect(Buffer.from(decodeChunk(obj2, { calibration: mutable }))).toEqual(
      Buffer.from(decodeChunk(obj2, { calibration: cal2 })),
    )
    // Encoding names the calibration of the bytes the object holds now.
    expect(
      decodeHeader(encodeChunk(chunk(1), metaFor(g, T), { mode: 'kvgate', calibration: mutable }))
        .calibration,
    ).toBe(cal2.hash)
  })
})

describe('calibration object under hostile bytes', () => {
  it('rejects every truncation, a bad magic, version, CRC, dtype, geometry and offsets with a CodecError', () => {
    for (let n = 0; n < bytes.length; n += Math.max(1, Math.floor(n / 8))) {
      expect(() => openCalibration(bytes.subarray(0, n))).toThrow(
        expect.objectContaining({ code: 'ERR_CODEC' }),
      )
      expect(() => openCalibration(withCrc(bytes.subarray(0, n)))).toThrow(
        expect.objectContaining({ code: 'ERR_CODEC' }),
      )
    }
    const patch = (at: number, v: number, width: 1 | 2 | 4) => {
      const b = bytes.slice()
      const dv = new DataView(b.buffer)
      if (width === 1) b[at] = v
      else if (width === 2) dv.setUint16(at, v, true)
      else dv.setUint32(at, v, true)
      return withCrc(b)
    }
    const cases: [Uint8Array, RegExp][] = [
      [patch(0, 0x4c43564c, 4), /magic/],
      [patch(4, 2, 2), /version 2/],
      [patch(6, 9, 1), /dtype/],
      [patch(7, 2, 1), /reserved/],
      // Byte 7 bit 0 marks a latent (MLA) calibration: one kv head only.
      [patch(7, 1, 1), /latent/],
      [patch(8, 0, 2), /geometry/],
      [patch(8, 3, 2), /offset|index|bytes after|malformed/],
      [patch(10, 5, 2), /tables are malformed|offset|bytes after/],
      [patch(24, 4, 4), /offset/],
      [patch(28, 0xffffffff, 4), /offset/],
      [
        (() => {
          const b = bytes.slice()
          b[100] = b[100]! ^ 1
          return b
        })(),
        /checksum/,
      ],
      [new Uint8Array(0), /too short/],
      ['not bytes' as unknown as Uint8Array, /not bytes/],
    ]
    for (const [b, why] of cases) expect(() => openCalibration(b)).toThrow(why)
  })

  it('mutated tables (CRC fixed) never trap: openCalibration or the decoder refuses them, or they decode', () => {
    const obj = encodeChunk(chunk(1), metaFor(g, T), { mode: 'kvgate', calibration: cal })
    const h = decodeHeader(obj)
    const c = g.kvHeads * g.headDim
    const blob = layerBlobs(cal)[0]!
    const section = obj.subarray(h.sections[0]!.offset, h.sections[0]!.offset + h.sections[0]!.length)
    let refused = 0
    for (let i = 0; i < 400; i++) {
      const b = blob.slice()
      const at = (i * 7919) % b.length
      b[at] = (b[at]! + 1 + (i % 255)) & 0xff
      // Straight into the wasm decoder (no kv_cal_check first).
      try {
        wasmCodec().decodeSection('kvgate', section, 1, T, c, new Uint8Array(2 * T * c * 2), b)
      } catch (e) {
        expect(e).toMatchObject({ code: 'ERR_CODEC' })
        expect((e as Error).message).not.toMatch(/inside wasm/)
        refused++
      }
    }
    // Only the table set a stream names is read: most mutations land elsewhere and decode.
    expect(refused).toBeGreaterThan(10)
    // The shared instance still decodes honest input exactly.
    expect(Buffer.from(decodeChunk(obj, { calibration: cal }))).toEqual(
      Buffer.from(decodeChunk(encodeChunk(chunk(1), metaFor(g, T), { mode: 'kvgate' }))),
    )
  })
})
