import { describe, expect, it } from 'vitest'
import { crc32, crc32Combine, crc32Portable } from '../src/core/checksum.ts'
import { FormatError, KvgateError } from '../src/core/errors.ts'
import {
  CALIBRATION_OFFSET,
  ChunkVerifier,
  decodeHeader,
  encodeChunk,
  headerBytesFor,
  layerSpan,
  namesNewerFeature,
  openLayerSubset,
  readHeaderLength,
  sectionOf,
  verifyChunk,
} from '../src/core/format.ts'
import { pseudoRandomBytes, sampleChunk, sampleMeta } from './support/chunks.ts'

function codeOf(fn: () => unknown): string {
  try {
    fn()
  } catch (e) {
    if (!(e instanceof KvgateError)) throw new Error(`untyped error escaped: ${String(e)}`)
    return e.code
  }
  return 'OK'
}

function streamVerify(bytes: Uint8Array, pieces: number[]): string {
  return codeOf(() => {
    const v = new ChunkVerifier()
    let at = 0
    for (const p of pieces) {
      v.push(bytes.subarray(at, Math.min(bytes.length, at + p)))
      at += p
      if (at >= bytes.length) break
    }
    if (at < bytes.length) v.push(bytes.subarray(at))
    v.finish()
  })
}

describe('chunk object round trip', () => {
  it('decodes every field it encoded', () => {
    const { meta, sections, bytes } = sampleChunk({
      chunkIndex: 7,
      partial: true,
      codecParams: Uint8Array.of(3, 1, 4),
    })
    const h = verifyChunk(bytes)
    expect(h.headerBytes).toBe(headerBytesFor(3))
    expect(h.headerBytes % 16).toBe(0)
    expect(h.totalBytes).toBe(bytes.length)
    expect(h.codec).toBe('raw')
    expect(h.geometry).toEqual(meta.geometry)
    expect(h.tokens).toBe(4)
    expect(h.chunkIndex).toBe(7)
    expect(h.partial).toBe(true)
    expect(h.codecParams.subarray(0, 3)).toEqual(Uint8Array.of(3, 1, 4))
    expect(h.chainKey).toEqual(meta.chainKey)
    expect(h.parentKey).toEqual(meta.parentKey)
    expect(h.namespaceId).toEqual(meta.namespaceId)
    sections.forEach((s, i) => {
      expect(sectionOf(bytes, h, i)).toEqual(s)
    })
  })
  it('handles every codec, dtype and empty sections', () => {
    for (const codec of ['raw', 'lossless', 'kvgate', 'reference-cachegen', 'q8'] as const) {
      for (const dtype of ['fp16', 'bf16', 'fp32'] as const) {
        const meta = sampleMeta({ codec, geometry: { layers: 2, kvHeads: 1, headDim: 2, dtype } })
        const bytes = encodeChunk(meta, [new Uint8Array(0), Uint8Array.of(1, 2, 3)])
        const h = verifyChunk(bytes)
        expect([h.codec, h.geometry.dtype]).toEqual([codec, dtype])
        expect(streamVerify(bytes, [1])).toBe('OK')
      }
    }
  })
  it.each([1, 2])('layer spans and subsets serve layers a..b (format v%i)', (version) => {
    const { sections, bytes } = sampleChunk(version === 2 ? { calibration: 'cd'.repeat(32) } : {})
    const h = decodeHeader(bytes)
    const span = layerSpan(h, 1, 2)
    const subset = new Uint8Array(h.headerBytes + span.end - span.start)
    subset.set(bytes.subarray(0, h.headerBytes))
    subset.set(bytes.subarray(span.start, span.end), h.headerBytes)
    const view = openLayerSubset(subset, 1, 2)
    expect(view.header.calibration).toBe(version === 2 ? 'cd'.repeat(32) : undefined)
    expect(view.section(1)).toEqual(sections[1])
    expect(view.section(2)).toEqual(sections[2])
    expect(codeOf(() => view.section(0))).toBe('ERR_INVALID_ARGUMENT')
    expect(codeOf(() => openLayerSubset(subset.subarray(0, subset.length - 1), 1, 2))).toBe(
      'ERR_FORMAT_TRUNCATED',
    )
    subset[subset.length - 1]! ^= 1
    expect(codeOf(() => openLayerSubset(subset, 1, 2).section(2))).toBe('ERR_FORMAT_CHECKSUM')
    expect(codeOf(() => layerSpan(h, 2, 1))).toBe('ERR_INVALID_ARGUMENT')
    expect(codeOf(() => layerSpan(h, 0, 3))).toBe('ERR_INVALID_ARGUMENT')
  })
  it('the portable CRC matches the native one', () => {
    const b = pseudoRandomBytes(100_003, 5)
    expect(crc32Portable(b)).toBe(crc32(b))
    expect(crc32Portable(b.subarray(3), 1234)).toBe(crc32(b.subarray(3), 1234))
    expect(crc32Portable(new TextEncoder().encode('123456789'))).toBe(0xcbf43926)
  })
  it('a calibrated object is version 2 and names its calibration; an uncalibrated one stays version 1', () => {
    const calibration = 'ab'.repeat(32)
    const { meta, sections, bytes } = sampleChunk({ calibration })
    const h = verifyChunk(bytes)
    expect(h.formatVersion).toBe(2)
    expect(h.calibration).toBe(calibration)
    expect(h.headerBytes).toBe(headerBytesFor(3, 2))
    // v2 = v1 + 32 bytes before the layer index: align16(172 + 16·3 + 4) = 224.
    expect(h.headerBytes).toBe(224)
    expect(bytes.subarray(CALIBRATION_OFFSET, CALIBRATION_OFFSET + 32)).toEqual(new Uint8Array(32).fill(0xab))
    expect(new DataView(bytes.buffer).getBigUint64(172, true)).toBe(224n)
    sections.forEach((s, i) => {
      expect(sectionOf(bytes, h, i)).toEqual(s)
    })
    expect(h.chainKey).toEqual(meta.chainKey)
    const v1 = sampleChunk().bytes
    const h1 = verifyChunk(v1)
    expect([h1.formatVersion, h1.headerBytes, 'calibration' in h1]).toEqual([1, 192, false])
    // The same chunk without a calibration: v1 bytes exactly as before version 2 existed.
    expect(encodeChunk({ ...meta, calibration: undefined }, sections)).toEqual(v1)
    expect(new DataView(v1.buffer).getUint16(4, true)).toBe(1)
    expect(streamVerify(bytes, [5, 100])).toBe('OK')
  })
  it('rejects a calibration that is not a 64-hex SHA-256', () => {
    for (const calibration of ['AB'.repeat(32), 'ab'.repeat(31), `${'ab'.repeat(31)}zz`, '0'.repeat(64), 7]) {
      expect(codeOf(() => sampleChunk({ calibration: calibration as string }))).toBe('ERR_INVALID_ARGUMENT')
    }
  })
  it('rejects bad metadata when encoding', () => {
    expect(codeOf(() => encodeChunk(sampleMeta(), []))).toBe('ERR_INVALID_ARGUMENT')
    expect(codeOf(() => encodeChunk(sampleMeta({ tokens: 0 }), [new Uint8Array(1)]))).toBe(
      'ERR_INVALID_ARGUMENT',
    )
    expect(codeOf(() => encodeChunk(sampleMeta({ chainKey: new Uint8Array(31) }), []))).toBe(
      'ERR_INVALID_ARGUMENT',
    )
    expect(codeOf(() => encodeChunk(sampleMeta({ codecParams: new Uint8Array(17) }), []))).toBe(
      'ERR_INVALID_ARGUMENT',
    )
  })
})

describe.each([1, 2])('hostile and damaged objects (format v%i)', (version) => {
  const { bytes } = sampleChunk(version === 2 ? { calibration: '5e'.repeat(32) } : {})
  const h = decodeHeader(bytes)
  // The layer index follows the fixed header: 140 bytes in v1, 172 in v2.
  const index = version === 2 ? 172 : 140

  it('truncation anywhere is a typed error, streamed or whole', () => {
    for (let n = 0; n < bytes.length; n++) {
      const cut = bytes.subarray(0, n)
      expect(codeOf(() => verifyChunk(cut))).toMatch(/^ERR_FORMAT_(TRUNCATED|CHECKSUM|BAD_FIELD)$/)
      expect(streamVerify(cut, [7])).toBe('ERR_FORMAT_TRUNCATED')
    }
  })
  it('trailing bytes are rejected', () => {
    const long = new Uint8Array(bytes.length + 1)
    long.set(bytes)
    expect(codeOf(() => verifyChunk(long))).toBe('ERR_FORMAT_BAD_FIELD')
    expect(streamVerify(long, [5])).toBe('ERR_FORMAT_BAD_FIELD')
  })
  it('every single bit flip is detected', () => {
    for (let i = 0; i < bytes.length; i++) {
      for (const bit of [0, 7]) {
        const bad = bytes.slice()
        bad[i]! ^= 1 << bit
        const code = codeOf(() => verifyChunk(bad))
        expect(code, `flip at byte ${i}`).not.toBe('OK')
        expect(streamVerify(bad, [3, 50])).not.toBe('OK')
      }
    }
  })
  it('wrong magic, wrong version, hostile lengths', () => {
    const patch = (at: number, value: number, size: 2 | 4 | 8, fixCrc = true) => {
      const b = bytes.slice()
      const dv = new DataView(b.buffer)
      if (size === 2) dv.setUint16(at, value, true)
      else if (size === 4) dv.setUint32(at, value, true)
      else dv.setBigUint64(at, BigInt(value), true)
      if (fixCrc) dv.setUint32(h.headerBytes - 4, crc32(b.subarray(0, h.headerBytes - 4)), true)
      return b
    }
    expect(codeOf(() => decodeHeader(patch(0, 0x46445025, 4)))).toBe('ERR_FORMAT_BAD_MAGIC')
    expect(codeOf(() => decodeHeader(patch(4, 3, 2)))).toBe('ERR_FORMAT_BAD_VERSION')
    expect(codeOf(() => decodeHeader(patch(4, 0, 2)))).toBe('ERR_FORMAT_BAD_VERSION')
    // The other version with a valid CRC: its header length no longer fits (v1 192 / v2 224 for 3 layers).
    expect(codeOf(() => decodeHeader(patch(4, 3 - version, 2)))).toBe('ERR_FORMAT_BAD_FIELD')
    expect(codeOf(() => decodeHeader(patch(8, 0xffffffff, 4)))).toBe('ERR_FORMAT_BAD_FIELD')
    expect(codeOf(() => decodeHeader(patch(8, 17, 4)))).toBe('ERR_FORMAT_BAD_FIELD')
    // A header that claims a huge object is refused before anything is allocated.
    expect(codeOf(() => decodeHeader(patch(16, 2 ** 52, 8)))).toBe('ERR_FORMAT_TOO_LARGE')
    expect(codeOf(() => decodeHeader(patch(16, bytes.length + 1, 8)))).toBe('ERR_FORMAT_BAD_FIELD')
    // A section pointing outside its slot (overlap / gap) is refused even with a valid CRC.
    expect(codeOf(() => decodeHeader(patch(index, 0, 8)))).toBe('ERR_FORMAT_BAD_FIELD')
    expect(codeOf(() => decodeHeader(patch(index + 8, 0xffffffff, 4)))).toBe('ERR_FORMAT_BAD_FIELD')
    if (version === 2) {
      // A v2 header must name a calibration: an all-zero hash is refused even with a valid CRC.
      const zero = bytes.slice()
      zero.fill(0, CALIBRATION_OFFSET, CALIBRATION_OFFSET + 32)
      new DataView(zero.buffer).setUint32(h.headerBytes - 4, crc32(zero.subarray(0, h.headerBytes - 4)), true)
      expect(codeOf(() => decodeHeader(zero))).toBe('ERR_FORMAT_BAD_FIELD')
      expect(streamVerify(zero, [9])).toBe('ERR_FORMAT_BAD_FIELD')
      // Any other hash is just a name: it decodes and is reported as written.
      expect(decodeHeader(patch(CALIBRATION_OFFSET, 1, 4)).calibration).toBe(`01000000${'5e'.repeat(28)}`)
    }
    expect(codeOf(() => decodeHeader(patch(24, 99, 2)))).toBe('ERR_FORMAT_BAD_FIELD')
    expect(codeOf(() => decodeHeader(patch(44, 4, 2)))).toBe('ERR_FORMAT_BAD_FIELD')
    expect(codeOf(() => decodeHeader(patch(52, 0, 4)))).toBe('ERR_FORMAT_BAD_FIELD')
    expect(codeOf(() => decodeHeader(patch(6, 2, 2)))).toBe('ERR_FORMAT_BAD_FIELD')
    expect(codeOf(() => decodeHeader(patch(0, 0x46445025, 4, false)))).toBe('ERR_FORMAT_BAD_MAGIC')
    expect(codeOf(() => decodeHeader(patch(16, 5, 8, false)))).toBe('ERR_FORMAT_CHECKSUM')
    expect(codeOf(() => verifyChunk(bytes, { maxBytes: bytes.length - 1 }))).toBe('ERR_FORMAT_TOO_LARGE')
    expect(codeOf(() => readHeaderLength(new Uint8Array(3)))).toBe('ERR_FORMAT_TRUNCATED')
  })
  it('FormatErrors carry HTTP statuses', () => {
    const e = new FormatError('ERR_FORMAT_TOO_LARGE', 'x')
    expect(e.status).toBe(413)
    expect(new FormatError('ERR_FORMAT_CHECKSUM', 'x').status).toBe(400)
    expect(e.toJSON()).toEqual({ error: { code: 'ERR_FORMAT_TOO_LARGE', message: 'x' } })
  })
})

describe('fuzz: random and mutated inputs never escape as untyped errors', () => {
  // Deterministic so a failure reproduces; bench/fuzz-format.ts runs many more.
  let x = 0x9e3779b9
  const rnd = (n: number) => {
    x ^= x << 13
    x ^= x >>> 17
    x ^= x << 5
    return (x >>> 0) % n
  }
  const seeds = [
    sampleChunk().bytes,
    sampleChunk({ geometry: { layers: 1, kvHeads: 1, headDim: 1, dtype: 'fp32' }, tokens: 1 }).bytes,
    sampleChunk({ calibration: '77'.repeat(32) }).bytes,
    sampleChunk({
      geometry: { layers: 1, kvHeads: 1, headDim: 1, dtype: 'bf16' },
      tokens: 1,
      calibration: '0f'.repeat(32),
    }).bytes,
  ]

  it('3000 mutated objects: typed errors only; the ones that verify decode consistently', () => {
    let accepted = 0
    for (let i = 0; i < 3000; i++) {
      const b = seeds[rnd(seeds.length)]!.slice()
      const edits = 1 + rnd(4)
      for (let e = 0; e < edits; e++) {
        const kind = rnd(3)
        if (kind === 0) b[rnd(b.length)] = rnd(256)
        else if (kind === 1) b[rnd(b.length)]! ^= 1 << rnd(8)
        else new DataView(b.buffer).setUint32(rnd(b.length - 4), rnd(2 ** 31) * (rnd(2) + 1), true)
      }
      const cut = rnd(4) === 0 ? b.subarray(0, rnd(b.length)) : b
      const code = codeOf(() => verifyChunk(cut))
      if (code === 'OK') accepted++
      // Streaming and whole-object verification must agree on accept / reject.
      expect(streamVerify(cut, [1 + rnd(64)]) === 'OK').toBe(code === 'OK')
    }
    // Mutations that survive are ones that undo themselves; almost none should.
    expect(accepted).toBeLessThan(30)
  })
  it('2000 random byte strings, some with a valid prefix', () => {
    for (let i = 0; i < 2000; i++) {
      const b = pseudoRandomBytes(rnd(400), i + 1)
      if (rnd(2) && b.length >= 12) b.set(seeds[rnd(2) * 2]!.subarray(0, 12))
      expect(codeOf(() => verifyChunk(b))).toMatch(/^ERR_FORMAT_/)
      expect(streamVerify(b, [1 + rnd(32)])).toMatch(/^ERR_FORMAT_/)
    }
  })
})

describe("namesNewerFeature: a newer writer's intact header, told from rot", () => {
  const reseal = (b: Uint8Array) => {
    const dv = new DataView(b.buffer, b.byteOffset, b.byteLength)
    const hb = dv.getUint32(8, true)
    dv.setUint32(hb - 4, crc32(b.subarray(0, hb - 4)), true)
    return b
  }
  it('true for an unknown version, flag, codec or dtype under an intact CRC; false otherwise', () => {
    for (const calibration of [undefined, 'ab'.repeat(32)]) {
      const { bytes } = sampleChunk({ calibration })
      const hb = readHeaderLength(bytes)
      expect(namesNewerFeature(bytes)).toBe(false) // this build reads it
      const edit = (f: (b: Uint8Array, dv: DataView) => void, seal = true) => {
        const b = bytes.slice()
        f(b, new DataView(b.buffer))
        return seal ? reseal(b) : b
      }
      const setByte = (at: number, value: number) => (b: Uint8Array) => {
        b[at] = value
      }
      expect(namesNewerFeature(edit((_, dv) => dv.setUint16(4, 3, true)))).toBe(true)
      expect(namesNewerFeature(edit((_, dv) => dv.setUint16(6, 0x8000, true)))).toBe(true)
      expect(namesNewerFeature(edit(setByte(24, 250)))).toBe(true)
      expect(namesNewerFeature(edit(setByte(26, 250)))).toBe(true)
      // Refused for something else (a reserved byte): not a newer feature.
      expect(namesNewerFeature(edit(setByte(27, 1)))).toBe(false)
      // Rot: the same edits without a matching CRC.
      const rot = bytes.slice()
      new DataView(rot.buffer).setUint16(4, 3, true)
      expect(namesNewerFeature(rot)).toBe(false)
      // Truncated, oversized or absurd lengths, another magic: never "newer".
      const v3 = edit((_, dv) => dv.setUint16(4, 3, true))
      expect(namesNewerFeature(v3.subarray(0, hb - 1))).toBe(false)
      expect(namesNewerFeature(v3.subarray(0, 11))).toBe(false)
      expect(namesNewerFeature(edit((_, dv) => dv.setUint32(8, 0xffffffff, true), false))).toBe(false)
      expect(namesNewerFeature(edit((_, dv) => dv.setUint32(8, 4, true), false))).toBe(false)
      expect(namesNewerFeature(edit(setByte(0, 0)))).toBe(false)
    }
  })
})

describe('crc32Combine', () => {
  it('joins the CRCs of two pieces into the CRC of the whole (zlib crc32_combine)', () => {
    const data = pseudoRandomBytes(3 * 65536 + 77, 5)
    for (const cut of [0, 1, 15, 16, 4095, 65536, 2 * 65536 + 3, data.length - 1, data.length]) {
      const a = data.subarray(0, cut)
      const b = data.subarray(cut)
      expect(crc32Combine(crc32(a), crc32(b), b.length)).toBe(crc32(data))
    }
    // Three pieces, left to right, as the disk tier joins a section read in ranges.
    const [x, y] = [1000, 70000]
    const joined = crc32Combine(
      crc32Combine(crc32(data.subarray(0, x)), crc32(data.subarray(x, y)), y - x),
      crc32(data.subarray(y)),
      data.length - y,
    )
    expect(joined).toBe(crc32(data))
    expect(() => crc32Combine(1, 2, -1)).toThrow(RangeError)
  })
})
