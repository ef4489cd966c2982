// The KV chunk object: one self-describing binary layout shared by L2 files, the
// wire and S3. A fixed header (geometry, codec, keys, a layer index with a CRC per
// section, a CRC over the header) followed by one independently decodable section
// per layer, so readers can range-GET layers a..b. Version 2 adds the SHA-256 of
// the namespace calibration object the codec used (DESIGN §2.9); uncalibrated
// objects stay version 1, byte for byte. The byte layout is docs/format.md.

import { crc32 } from './checksum.ts'
import { FormatError, InvalidArgumentError } from './errors.ts'
import { fromHex, toHex } from './keys.ts'
import {
  DTYPE_CODES,
  dtypeFromCode,
  type KvGeometry,
  MAX_CHUNK_TOKENS,
  MAX_HEAD_DIM,
  MAX_KV_HEADS,
  MAX_LAYERS,
} from './layout.ts'

export type CodecId = 'raw' | 'lossless' | 'kvgate' | 'reference-cachegen' | 'q8'

/** Header codes per codec. Never renumber: stored objects carry them. */
export const CODEC_CODES: Readonly<Record<CodecId, number>> = {
  raw: 0,
  lossless: 1,
  kvgate: 2,
  'reference-cachegen': 3,
  q8: 4,
}

export const CHUNK_MAGIC = 0x4347564b // "KVGC" read as a little-endian u32
/** The version of an uncalibrated object (what every writer emitted before calibration existed). */
export const FORMAT_VERSION = 1
/** The version of an object coded with a calibration object: v1 plus a 32-byte calibration hash. */
export const FORMAT_VERSION_CALIBRATED = 2
/** Fixed header of a version-1 object; the layer index starts here. */
export const FIXED_HEADER_BYTES = 140
/** Where a version-2 header holds the calibration object's SHA-256 (32 bytes). */
export const CALIBRATION_OFFSET = 140
export const CALIBRATION_BYTES = 32
/** Fixed header of a version-2 object (v1's plus the calibration hash); the layer index starts here. */
export const FIXED_HEADER_BYTES_V2 = FIXED_HEADER_BYTES + CALIBRATION_BYTES
export const SECTION_ENTRY_BYTES = 16
export const CODEC_PARAMS_BYTES = 16
/** Bytes a reader needs to learn the header length (magic, version, flags, header length). */
export const HEADER_PREFIX_BYTES = 12
/** Default upper bound on one chunk object: a 70B bf16 chunk is 80 MiB raw. */
export const DEFAULT_MAX_CHUNK_BYTES = 512 * 1024 * 1024
const MAX_SECTION_BYTES = 0xffffffff
const FLAG_PARTIAL = 1
/** MLA: one latent tensor per layer (no V); geometry kvHeads 1, headDim = latent dim. */
const FLAG_LATENT = 2

export interface ChunkMeta {
  codec: CodecId
  codecVersion: number
  /** Codec-specific parameters (quality level, bit budgets…); opaque here, at most 16 bytes. */
  codecParams: Uint8Array
  geometry: KvGeometry
  /** Tokens in this chunk (≤ chunkTokens; fewer only for a partial tail chunk). */
  tokens: number
  /** Position of the chunk in its prompt (chunk i covers tokens [i·chunkTokens, …)). */
  chunkIndex: number
  /** True when this is a trailing chunk with fewer than chunkTokens tokens. */
  partial: boolean
  /** First 16 bytes of the key namespace seed: a reader rejects chunks of another model. */
  namespaceId: Uint8Array
  chainKey: Uint8Array
  parentKey: Uint8Array
  /**
   * SHA-256 (64 lowercase hex) of the calibration object the sections were coded
   * with. Set: the object is format version 2 and names it; absent: version 1.
   */
  calibration?: string | undefined
}

export interface SectionEntry {
  /** Byte offset of the section from the start of the object. */
  offset: number
  length: number
  crc32: number
}

export interface ChunkHeader extends ChunkMeta {
  formatVersion: number
  headerBytes: number
  totalBytes: number
  sections: SectionEntry[]
}

function fixedHeaderBytes(version: number): number {
  return version === FORMAT_VERSION_CALIBRATED ? FIXED_HEADER_BYTES_V2 : FIXED_HEADER_BYTES
}

/**
 * The header length is a pure function of the format version and layer count
 * (16-byte aligned). Bounds that must hold for any object (buffer sizes) take
 * the larger, version 2.
 */
export function headerBytesFor(layers: number, version: number = FORMAT_VERSION): number {
  const unpadded = fixedHeaderBytes(version) + SECTION_ENTRY_BYTES * layers + 4
  return (unpadded + 15) & ~15
}

const HEX64 = /^[0-9a-f]{64}$/
const ZERO_HASH = '0'.repeat(64)

function fail(code: ConstructorParameters<typeof FormatError>[0], message: string): never {
  throw new FormatError(code, message)
}

function checkMeta(meta: ChunkMeta, sections: readonly Uint8Array[]): void {
  const g = meta.geometry
  // Own keys only: `in` also finds toString and constructor on every object.
  if (!Object.hasOwn(CODEC_CODES, meta.codec))
    throw new InvalidArgumentError(`unknown codec '${String(meta.codec)}'`)
  if (!Number.isInteger(meta.codecVersion) || meta.codecVersion < 0 || meta.codecVersion > 255) {
    throw new InvalidArgumentError('codecVersion must be an integer in 0..255')
  }
  if (!(meta.codecParams instanceof Uint8Array) || meta.codecParams.length > CODEC_PARAMS_BYTES) {
    throw new InvalidArgumentError(`codecParams must be a Uint8Array of at most ${CODEC_PARAMS_BYTES} bytes`)
  }
  if (!Object.hasOwn(DTYPE_CODES, g.dtype))
    throw new InvalidArgumentError(`unknown dtype '${String(g.dtype)}'`)
  if (g.latent !== undefined && typeof g.latent !== 'boolean')
    throw new InvalidArgumentError('geometry.latent must be a boolean')
  if (g.latent === true && g.kvHeads !== 1)
    throw new InvalidArgumentError('a latent (MLA) chunk has kvHeads 1 (headDim = the latent dim)')
  for (const [name, v, max] of [
    ['layers', g.layers, MAX_LAYERS],
    ['kvHeads', g.kvHeads, MAX_KV_HEADS],
    ['headDim', g.headDim, MAX_HEAD_DIM],
    ['tokens', meta.tokens, MAX_CHUNK_TOKENS],
  ] as const) {
    if (!Number.isInteger(v) || v < 1 || v > max)
      throw new InvalidArgumentError(`${name} must be an integer in 1..${max}`)
  }
  if (!Number.isInteger(meta.chunkIndex) || meta.chunkIndex < 0 || meta.chunkIndex > 0xffffffff) {
    throw new InvalidArgumentError('chunkIndex must be an integer in 0..2^32-1')
  }
  for (const [name, b, n] of [
    ['namespaceId', meta.namespaceId, 16],
    ['chainKey', meta.chainKey, 32],
    ['parentKey', meta.parentKey, 32],
  ] as const) {
    if (!(b instanceof Uint8Array) || b.length !== n)
      throw new InvalidArgumentError(`${name} must be ${n} bytes`)
  }
  if (
    meta.calibration !== undefined &&
    (typeof meta.calibration !== 'string' || !HEX64.test(meta.calibration) || meta.calibration === ZERO_HASH)
  ) {
    throw new InvalidArgumentError('calibration must be a SHA-256 as 64 lowercase hex digits (not all zero)')
  }
  if (sections.length !== g.layers) {
    throw new InvalidArgumentError(`expected one section per layer (${g.layers}), got ${sections.length}`)
  }
  for (const s of sections) {
    if (s.length > MAX_SECTION_BYTES) throw new InvalidArgumentError('a section exceeds 4 GiB')
  }
}

/** Builds a chunk object from its metadata and one encoded section per layer. */
export function encodeChunk(meta: ChunkMeta, sections: readonly Uint8Array[]): Uint8Array {
  checkMeta(meta, sections)
  const g = meta.geometry
  const version = meta.calibration === undefined ? FORMAT_VERSION : FORMAT_VERSION_CALIBRATED
  const fixed = fixedHeaderBytes(version)
  const headerBytes = headerBytesFor(g.layers, version)
  let total = headerBytes
  for (const s of sections) total += s.length
  const out = new Uint8Array(total)
  const dv = new DataView(out.buffer)
  dv.setUint32(0, CHUNK_MAGIC, true)
  dv.setUint16(4, version, true)
  dv.setUint16(6, (meta.partial ? FLAG_PARTIAL : 0) | (g.latent === true ? FLAG_LATENT : 0), true)
  dv.setUint32(8, headerBytes, true)
  dv.setUint32(12, g.layers, true)
  dv.setBigUint64(16, BigInt(total), true)
  out[24] = CODEC_CODES[meta.codec]
  out[25] = meta.codecVersion
  out[26] = DTYPE_CODES[g.dtype]
  out.set(meta.codecParams, 28)
  dv.setUint16(44, g.layers, true)
  dv.setUint16(46, g.kvHeads, true)
  dv.setUint16(48, g.headDim, true)
  dv.setUint32(52, meta.tokens, true)
  dv.setUint32(56, meta.chunkIndex, true)
  out.set(meta.namespaceId, 60)
  out.set(meta.chainKey, 76)
  out.set(meta.parentKey, 108)
  if (meta.calibration !== undefined) out.set(fromHex(meta.calibration), CALIBRATION_OFFSET)
  let offset = headerBytes
  sections.forEach((s, i) => {
    const e = fixed + i * SECTION_ENTRY_BYTES
    dv.setBigUint64(e, BigInt(offset), true)
    dv.setUint32(e + 8, s.length, true)
    dv.setUint32(e + 12, crc32(s), true)
    out.set(s, offset)
    offset += s.length
  })
  dv.setUint32(headerBytes - 4, crc32(out.subarray(0, headerBytes - 4)), true)
  return out
}

export interface DecodeOptions {
  /** Largest object accepted (default 512 MiB). */
  maxBytes?: number
}

/** Reads the header length from the first 12 bytes; validates magic, version and the length's bounds. */
export function readHeaderLength(prefix: Uint8Array): number {
  if (prefix.length < HEADER_PREFIX_BYTES)
    fail('ERR_FORMAT_TRUNCATED', `need ${HEADER_PREFIX_BYTES} bytes to read a header`)
  const dv = new DataView(prefix.buffer, prefix.byteOffset, prefix.byteLength)
  if (dv.getUint32(0, true) !== CHUNK_MAGIC)
    fail('ERR_FORMAT_BAD_MAGIC', 'not a kvgate chunk object (bad magic)')
  const version = dv.getUint16(4, true)
  if (version !== FORMAT_VERSION && version !== FORMAT_VERSION_CALIBRATED) {
    fail(
      'ERR_FORMAT_BAD_VERSION',
      `chunk format version ${version} is not supported (this build reads ${FORMAT_VERSION} and ${FORMAT_VERSION_CALIBRATED})`,
    )
  }
  const headerBytes = dv.getUint32(8, true)
  if (
    headerBytes < headerBytesFor(1, version) ||
    headerBytes > headerBytesFor(MAX_LAYERS, version) ||
    headerBytes % 16 !== 0
  ) {
    fail('ERR_FORMAT_BAD_FIELD', `implausible header length ${headerBytes}`)
  }
  return headerBytes
}

/**
 * Decodes and validates a header. `bytes` needs only the header (the object's
 * first headerBytes); section contents are not read. Throws FormatError.
 */
export function decodeHeader(bytes: Uint8Array, opts: DecodeOptions = {}): ChunkHeader {
  const maxBytes = opts.maxBytes ?? DEFAULT_MAX_CHUNK_BYTES
  const headerBytes = readHeaderLength(bytes)
  if (bytes.length < headerBytes)
    fail('ERR_FORMAT_TRUNCATED', `header needs ${headerBytes} bytes, got ${bytes.length}`)
  const dv = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength)
  const version = dv.getUint16(4, true)
  const fixed = fixedHeaderBytes(version)
  const stored = dv.getUint32(headerBytes - 4, true)
  if (crc32(bytes.subarray(0, headerBytes - 4)) !== stored)
    fail('ERR_FORMAT_CHECKSUM', 'header checksum mismatch')
  // From here the header is what its writer wrote; fields are still checked
  // because a writer may be hostile (the gateway accepts PUTs from clients).
  const flags = dv.getUint16(6, true)
  if (flags & ~(FLAG_PARTIAL | FLAG_LATENT))
    fail('ERR_FORMAT_BAD_FIELD', `unknown flags 0x${flags.toString(16)}`)
  const count = dv.getUint32(12, true)
  const layers = dv.getUint16(44, true)
  if (
    count !== layers ||
    layers < 1 ||
    layers > MAX_LAYERS ||
    headerBytesFor(layers, version) !== headerBytes
  ) {
    fail(
      'ERR_FORMAT_BAD_FIELD',
      `section count ${count} / layers ${layers} disagree with header length ${headerBytes}`,
    )
  }
  const totalBig = dv.getBigUint64(16, true)
  if (totalBig > BigInt(maxBytes))
    fail('ERR_FORMAT_TOO_LARGE', `object of ${totalBig} bytes exceeds the limit of ${maxBytes}`)
  const totalBytes = Number(totalBig)
  const codecCode = bytes[24]!
  const codec = (Object.keys(CODEC_CODES) as CodecId[]).find((c) => CODEC_CODES[c] === codecCode)
  if (codec === undefined) fail('ERR_FORMAT_BAD_FIELD', `unknown codec code ${codecCode}`)
  const dtype = dtypeFromCode(bytes[26]!)
  if (dtype === undefined) fail('ERR_FORMAT_BAD_FIELD', `unknown dtype code ${bytes[26]}`)
  if (bytes[27] !== 0 || dv.getUint16(50, true) !== 0)
    fail('ERR_FORMAT_BAD_FIELD', 'reserved header bytes are not zero')
  const kvHeads = dv.getUint16(46, true)
  const headDim = dv.getUint16(48, true)
  const tokens = dv.getUint32(52, true)
  if (kvHeads < 1 || kvHeads > MAX_KV_HEADS || headDim < 1 || headDim > MAX_HEAD_DIM) {
    fail('ERR_FORMAT_BAD_FIELD', `implausible geometry: ${kvHeads} kv heads × ${headDim} dims`)
  }
  if (tokens < 1 || tokens > MAX_CHUNK_TOKENS)
    fail('ERR_FORMAT_BAD_FIELD', `implausible token count ${tokens}`)
  if (flags & FLAG_LATENT && kvHeads !== 1)
    fail('ERR_FORMAT_BAD_FIELD', `a latent (MLA) chunk has 1 kv head, not ${kvHeads}`)
  const sections: SectionEntry[] = []
  let expected = headerBytes
  let calibration: string | undefined
  if (version === FORMAT_VERSION_CALIBRATED) {
    calibration = toHex(bytes.subarray(CALIBRATION_OFFSET, CALIBRATION_OFFSET + CALIBRATION_BYTES))
    // Version 2 exists to name a calibration; an uncalibrated writer emits version 1.
    if (calibration === ZERO_HASH) fail('ERR_FORMAT_BAD_FIELD', 'version-2 header names no calibration')
  }
  for (let i = 0; i < layers; i++) {
    const e = fixed + i * SECTION_ENTRY_BYTES
    const offset = dv.getBigUint64(e, true)
    const length = dv.getUint32(e + 8, true)
    // Sections are contiguous and in layer order: no gaps, overlaps or holes to hide data in.
    if (offset !== BigInt(expected))
      fail('ERR_FORMAT_BAD_FIELD', `section ${i} at ${offset}, expected ${expected}`)
    sections.push({ offset: expected, length, crc32: dv.getUint32(e + 12, true) })
    expected += length
  }
  if (expected !== totalBytes)
    fail('ERR_FORMAT_BAD_FIELD', `sections end at ${expected}, header says ${totalBytes} bytes`)
  for (let i = fixed + layers * SECTION_ENTRY_BYTES; i < headerBytes - 4; i++) {
    if (bytes[i] !== 0) fail('ERR_FORMAT_BAD_FIELD', 'header padding is not zero')
  }
  return {
    formatVersion: version,
    headerBytes,
    totalBytes,
    codec,
    codecVersion: bytes[25]!,
    codecParams: bytes.slice(28, 44),
    // The latent flag is part of the geometry (flags bit 1): absent, not false, on K/V chunks.
    geometry:
      flags & FLAG_LATENT
        ? { layers, kvHeads, headDim, dtype, latent: true }
        : { layers, kvHeads, headDim, dtype },
    tokens,
    chunkIndex: dv.getUint32(56, true),
    partial: (flags & FLAG_PARTIAL) !== 0,
    namespaceId: bytes.slice(60, 76),
    chainKey: bytes.slice(76, 108),
    parentKey: bytes.slice(108, 140),
    ...(calibration === undefined ? {} : { calibration }),
    sections,
  }
}

/** Validates a whole object: header, exact length and every section checksum. */
export function verifyChunk(bytes: Uint8Array, opts: DecodeOptions = {}): ChunkHeader {
  const header = decodeHeader(bytes, opts)
  if (bytes.length < header.totalBytes) {
    fail('ERR_FORMAT_TRUNCATED', `object is ${bytes.length} bytes, header says ${header.totalBytes}`)
  }
  if (bytes.length > header.totalBytes) {
    fail('ERR_FORMAT_BAD_FIELD', `object has ${bytes.length - header.totalBytes} trailing bytes`)
  }
  header.sections.forEach((s, i) => {
    if (crc32(bytes.subarray(s.offset, s.offset + s.length)) !== s.crc32) {
      fail('ERR_FORMAT_CHECKSUM', `section ${i} checksum mismatch`)
    }
  })
  return header
}

/**
 * True when `bytes` (at least the object's header) holds an intact header (its CRC, at the place
 * every version keeps it: the u32 length at byte 8, the CRC in the header's last 4 bytes) that
 * names something a later writer added: a format version, flag bit, codec code or dtype code this
 * build does not know. Readers refuse such an object; unlike rot it is not for them to delete.
 */
export function namesNewerFeature(bytes: Uint8Array): boolean {
  if (bytes.length < HEADER_PREFIX_BYTES) return false
  const dv = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength)
  if (dv.getUint32(0, true) !== CHUNK_MAGIC) return false
  const headerBytes = dv.getUint32(8, true)
  if (headerBytes < HEADER_PREFIX_BYTES + 4 || headerBytes > bytes.length) return false
  if (crc32(bytes.subarray(0, headerBytes - 4)) !== dv.getUint32(headerBytes - 4, true)) return false
  const version = dv.getUint16(4, true)
  if (version !== FORMAT_VERSION && version !== FORMAT_VERSION_CALIBRATED) return true
  if (headerBytes < 28) return false
  const codecCode = bytes[24]!
  return (
    (dv.getUint16(6, true) & ~(FLAG_PARTIAL | FLAG_LATENT)) !== 0 ||
    !Object.values(CODEC_CODES).includes(codecCode) ||
    dtypeFromCode(bytes[26]!) === undefined
  )
}

/** Byte range [start, end) of sections first..last (inclusive) within the object. */
export function layerSpan(header: ChunkHeader, first: number, last: number): { start: number; end: number } {
  const n = header.sections.length
  if (!Number.isInteger(first) || !Number.isInteger(last) || first < 0 || last >= n || first > last) {
    throw new InvalidArgumentError(`invalid layer range ${first}-${last} for ${n} layers`)
  }
  const a = header.sections[first]!
  const b = header.sections[last]!
  return { start: a.offset, end: b.offset + b.length }
}

function checkedSection(bytes: Uint8Array, at: number, entry: SectionEntry, layer: number): Uint8Array {
  const s = uncheckedSection(bytes, at, entry, layer)
  if (crc32(s) !== entry.crc32) fail('ERR_FORMAT_CHECKSUM', `section ${layer} checksum mismatch`)
  return s
}

/** A section's bytes, its length checked, its CRC not (the caller checks it: checkSectionCrcs). */
function uncheckedSection(bytes: Uint8Array, at: number, entry: SectionEntry, layer: number): Uint8Array {
  if (at + entry.length > bytes.length) fail('ERR_FORMAT_TRUNCATED', `section ${layer} is cut short`)
  return bytes.subarray(at, at + entry.length)
}

/**
 * Throws FormatError ERR_FORMAT_CHECKSUM unless each section (back to back in `sections`, of
 * `lengths`) has its CRC in `crcs` (layer first + i).
 */
export function checkSectionCrcs(
  sections: Uint8Array,
  lengths: readonly number[],
  crcs: readonly number[],
  first: number,
): void {
  if (crcs.length !== lengths.length) throw new InvalidArgumentError('one CRC per section expected')
  let at = 0
  lengths.forEach((n, i) => {
    if (crc32(sections.subarray(at, at + n)) !== crcs[i])
      throw new FormatError('ERR_FORMAT_CHECKSUM', `section ${first + i} checksum mismatch`)
    at += n
  })
}

/** Layer `layer`'s section of a whole object, its length checked, its CRC not (see checkSectionCrcs). */
export function uncheckedSectionOf(bytes: Uint8Array, header: ChunkHeader, layer: number): Uint8Array {
  const entry = header.sections[layer]
  if (!entry) throw new InvalidArgumentError(`layer ${layer} out of range 0..${header.sections.length - 1}`)
  return uncheckedSection(bytes, entry.offset, entry, layer)
}

/** Layer `layer`'s section of a whole object, checksum verified. */
export function sectionOf(bytes: Uint8Array, header: ChunkHeader, layer: number): Uint8Array {
  const entry = header.sections[layer]
  if (!entry) throw new InvalidArgumentError(`layer ${layer} out of range 0..${header.sections.length - 1}`)
  return checkedSection(bytes, entry.offset, entry, layer)
}

/**
 * A layer subset as the gateway's `?layers=a-b` answers it: the object's header
 * followed by sections first..last. Returns the header and a verified accessor.
 */
export function openLayerSubset(
  bytes: Uint8Array,
  first: number,
  last: number,
  opts: DecodeOptions = {},
): {
  header: ChunkHeader
  section(layer: number): Uint8Array
  /** The section with its CRC not yet checked (a codec worker checks it: checkSectionCrcs). */
  unchecked(layer: number): Uint8Array
} {
  const header = decodeHeader(bytes, opts)
  const span = layerSpan(header, first, last)
  const expected = header.headerBytes + (span.end - span.start)
  if (bytes.length !== expected) {
    fail(
      bytes.length < expected ? 'ERR_FORMAT_TRUNCATED' : 'ERR_FORMAT_BAD_FIELD',
      `layer subset is ${bytes.length} bytes, expected ${expected}`,
    )
  }
  const shift = span.start - header.headerBytes
  const entryOf = (layer: number) => {
    if (!Number.isInteger(layer) || layer < first || layer > last) {
      throw new InvalidArgumentError(`layer ${layer} is not in the subset ${first}-${last}`)
    }
    return header.sections[layer]!
  }
  return {
    header,
    section(layer: number): Uint8Array {
      const entry = entryOf(layer)
      return checkedSection(bytes, entry.offset - shift, entry, layer)
    },
    unchecked(layer: number): Uint8Array {
      const entry = entryOf(layer)
      return uncheckedSection(bytes, entry.offset - shift, entry, layer)
    },
  }
}

/**
 * Verifies a chunk object as it streams past (gateway PUT), holding only the
 * header in memory. push() each piece in order; finish() returns the header.
 */
export class ChunkVerifier {
  readonly #maxBytes: number
  #prefix: Uint8Array = new Uint8Array(0)
  #header: ChunkHeader | undefined
  #seen = 0
  #section = 0
  #sectionCrc = 0

  constructor(opts: DecodeOptions = {}) {
    this.#maxBytes = opts.maxBytes ?? DEFAULT_MAX_CHUNK_BYTES
  }

  /** The header, once enough bytes have been pushed to decode it. */
  get header(): ChunkHeader | undefined {
    return this.#header
  }

  get bytesSeen(): number {
    return this.#seen
  }

  push(bytes: Uint8Array): void {
    let input = bytes
    if (!this.#header) {
      const need =
        this.#prefix.length < HEADER_PREFIX_BYTES ? HEADER_PREFIX_BYTES : readHeaderLength(this.#prefix)
      const take = Math.min(need - this.#prefix.length, input.length)
      const merged = new Uint8Array(this.#prefix.length + take)
      merged.set(this.#prefix)
      merged.set(input.subarray(0, take), this.#prefix.length)
      this.#prefix = merged
      this.#seen += take
      input = input.subarray(take)
      if (this.#prefix.length === HEADER_PREFIX_BYTES) readHeaderLength(this.#prefix)
      if (
        this.#prefix.length >= HEADER_PREFIX_BYTES &&
        this.#prefix.length === readHeaderLength(this.#prefix)
      ) {
        this.#header = decodeHeader(this.#prefix, { maxBytes: this.#maxBytes })
      }
      if (input.length > 0) this.push(input)
      return
    }
    const h = this.#header
    if (this.#seen + input.length > h.totalBytes) {
      fail('ERR_FORMAT_BAD_FIELD', `object is longer than the ${h.totalBytes} bytes its header declares`)
    }
    while (input.length > 0) {
      const s = h.sections[this.#section]!
      const take = Math.min(s.offset + s.length - this.#seen, input.length)
      this.#sectionCrc = crc32(input.subarray(0, take), this.#sectionCrc)
      this.#seen += take
      input = input.subarray(take)
      this.#closeFinishedSections()
    }
  }

  #closeFinishedSections(): void {
    const h = this.#header!
    for (
      let s = h.sections[this.#section];
      s && this.#seen === s.offset + s.length;
      s = h.sections[this.#section]
    ) {
      if (this.#sectionCrc !== s.crc32)
        fail('ERR_FORMAT_CHECKSUM', `section ${this.#section} checksum mismatch`)
      this.#section++
      this.#sectionCrc = 0
    }
  }

  finish(): ChunkHeader {
    const h = this.#header
    if (!h) fail('ERR_FORMAT_TRUNCATED', `stream ended after ${this.#seen} bytes, inside the header`)
    this.#closeFinishedSections() // zero-length sections right after the header
    if (this.#seen !== h.totalBytes)
      fail('ERR_FORMAT_TRUNCATED', `stream ended at ${this.#seen} of ${h.totalBytes} bytes`)
    return h
  }
}
