// Chunk-level codec API: turns a chunk tensor into a chunk object (one section
// per layer, codec id/version/params in the header) and back, whole or per layer.

import { decodeElements, encodeElements } from '../core/dtype.ts'
import { CodecError, CorruptStreamError, InvalidArgumentError } from '../core/errors.ts'
import {
  type ChunkHeader,
  type ChunkMeta,
  decodeHeader,
  encodeChunk as encodeChunkObject,
  sectionOf,
} from '../core/format.ts'
import {
  chunkBytes,
  DTYPE_CODES,
  isFp8,
  type KvGeometry,
  kvPlanes,
  layerSlabBytes,
  MAX_CHUNK_TOKENS,
  rowElements,
  validateGeometry,
} from '../core/layout.ts'
import {
  type Calibration,
  CalibrationMissingError,
  checkCalibrationGeometry,
  layerBlobs,
  verifiedCalibration,
} from './calibration.ts'
import {
  CODEC_MODES,
  CODEC_VERSIONS,
  type CodecMode,
  checkHeaderCodec,
  checkQuality,
  DEFAULT_QUALITY,
  encodeParams,
  type LayerTargets,
  latentTarget,
  layerTargets,
  RD_LAMBDA,
  splitOfParams,
} from './params.ts'
import {
  type CachegenSplit,
  decodeCachegenLayer,
  encodeCachegenLayer,
  lmcacheSplit,
} from './reference-cachegen.ts'
import { wasmCodec } from './runtime.ts'
import { MAX_WASM_SLAB_BYTES, WASM_LATENT } from './wasm-instance.ts'

export type ChunkInfo = Omit<ChunkMeta, 'codec' | 'codecVersion' | 'codecParams'>

export interface EncodeOptions {
  mode: CodecMode
  /** kvgate only: 1 (smallest) .. 9 (closest); default DEFAULT_QUALITY. */
  quality?: number
  /** reference-cachegen only: its 32-bin layers; default as LMCache sets it for the layer count. */
  cachegenSplit?: CachegenSplit
  /**
   * kvgate only, instead of a quality level: relative RMS error targets for every layer's
   * K (against its channel-centred RMS) and V. Benchmarks use it to compare at equal error.
   * A latent (MLA) chunk's one stream takes `kError` (against its channel-centred RMS).
   */
  errorTargets?: LayerTargets
  /**
   * kvgate only (other modes ignore it): the namespace calibration object
   * (src/codec/calibration.ts, openCalibration) the sections are coded with; the object
   * becomes format v2 and names it by its SHA-256. Absent: format v1.
   */
  calibration?: Calibration
  /**
   * kvgate only (other modes ignore it): rate-distortion rounding (RD_LAMBDA,
   * docs/codec.md). Each stream keeps the error of nearest rounding at a smaller step and
   * codes fewer bytes: ~0.1–0.5 % at q5–q3, 1–2 % at q1–q2, ~6–7 % at the 8B shape's
   * reference-matched error; encoding costs ~1.5× the CPU. The object format and the
   * decoder are unchanged. @default false
   */
  rdRounding?: boolean
}

export interface DecodeLimits {
  /** Largest chunk tensor decodeChunk will allocate (default 2 GiB). */
  maxOutputBytes?: number
  /** The calibration a v2 object names (another or none: CalibrationMissingError). */
  calibration?: Calibration
}

/**
 * The calibration's layer blobs when `header` names one; throws when it is not `cal`. Its
 * bytes decide (their hash and geometry), not what a plain object given as `cal` claims.
 */
function calibrationFor(header: ChunkHeader, cal: Calibration | undefined): Uint8Array[] | undefined {
  const named = header.calibration
  if (named === undefined) return undefined
  const own = cal?.hash === named ? verifiedCalibration(cal) : undefined
  if (own?.hash !== named) throw new CalibrationMissingError(named)
  checkCalibrationGeometry(own, header.geometry)
  return layerBlobs(own)
}

const DEFAULT_MAX_OUTPUT = 2 * 1024 * 1024 * 1024
/**
 * The most symbols one input byte can carry: rANS at the most skewed table
 * (2047/2048) spends ≥ 0.0007 bits per symbol. A section claiming more output
 * than this is hostile and is refused before anything is allocated.
 */
const MAX_SYMBOLS_PER_BYTE = 12_000

/** kvgate encoder knobs (fixed per codec version; the decoder does not need them). */
const MAX_CLASSES = 8

/**
 * wasm params: [epsK, epsV, gammaK, gammaV, deltaK, maxClasses, levelsK, levelsV];
 * a negative epsK targets K's channel-centred RMS, one uniform step per stream. A latent
 * slab is one stream coded with K's parameters (epsV is then unused).
 */
function kvgateParams(targets: LayerTargets): Float32Array {
  const { kError, vError } = targets
  return new Float32Array([-kError, vError, 0, 0, 1, MAX_CLASSES, 0, 0])
}

/** The targets of layer `l`: a latent chunk's one stream gets latentTarget (its kError). */
function targetsOf(quality: number, l: number, g: KvGeometry): LayerTargets {
  if (g.latent !== true) return layerTargets(quality, l, g.layers)
  const e = latentTarget(quality)
  return { kError: e, vError: e }
}

/** The dtype code the wasm codec takes for a slab of `g` (a latent slab is one plane). */
function wasmDtype(g: KvGeometry): number {
  return DTYPE_CODES[g.dtype] | (g.latent === true ? WASM_LATENT : 0)
}

/** reference-cachegen is LMCache's K/V codec, kept as a baseline: it has no latent form. */
function checkCachegenLatent(mode: CodecMode, g: KvGeometry): void {
  if (mode === 'reference-cachegen' && g.latent === true)
    throw new CodecError(
      'the reference-cachegen baseline codes K and V; it does not take latent (MLA) chunks',
      {
        code: 'ERR_CODEC_MISMATCH',
      },
    )
}

/**
 * Encodes a chunk tensor ([layer][K|V][token][kvHead][headDim], or a latent geometry's
 * [layer][token][latent]) into a chunk object.
 */
export function encodeChunk(tensor: Uint8Array, meta: ChunkInfo, opts: EncodeOptions): Uint8Array {
  const mode = opts?.mode
  if (!CODEC_MODES.includes(mode)) throw new InvalidArgumentError(`unknown codec mode '${String(mode)}'`)
  const targets = opts?.errorTargets
  if (targets !== undefined) {
    const ok = (x: unknown) => typeof x === 'number' && x > 0 && x < 1e3
    if (mode !== 'kvgate' || opts.quality !== undefined || !ok(targets.kError) || !ok(targets.vError)) {
      throw new InvalidArgumentError('errorTargets: kvgate only, without quality, both errors in (0, 1000)')
    }
  }
  const quality =
    mode === 'kvgate' && targets === undefined ? checkQuality(opts.quality ?? DEFAULT_QUALITY) : 0
  const g = validateGeometry(meta?.geometry)
  checkCodecDtype(mode, g)
  checkCachegenLatent(mode, g)
  const t = meta.tokens
  if (!Number.isInteger(t) || t < 1 || t > MAX_CHUNK_TOKENS) {
    throw new InvalidArgumentError(`tokens must be an integer in 1..${MAX_CHUNK_TOKENS}, got ${String(t)}`)
  }
  if (!(tensor instanceof Uint8Array) || tensor.byteLength !== chunkBytes(g, t)) {
    throw new InvalidArgumentError(
      `chunk tensor must be ${chunkBytes(g, t)} bytes for ${t} tokens of this geometry, got ${tensor?.byteLength}`,
    )
  }
  const slab = layerSlabBytes(g, t)
  const c = rowElements(g)
  const split = opts.cachegenSplit ?? lmcacheSplit(g.layers)
  if (![split.k, split.v].every((x) => Number.isInteger(x) && x >= 0 && x <= 255)) {
    throw new InvalidArgumentError('cachegenSplit layers must be integers in 0..255')
  }
  // The calibration of its bytes: the header names their hash, the geometry checked is theirs.
  const cal =
    mode === 'kvgate' && opts.calibration !== undefined ? verifiedCalibration(opts.calibration) : undefined
  const rd = opts.rdRounding ?? false
  if (typeof rd !== 'boolean') throw new InvalidArgumentError('rdRounding must be a boolean')
  let blobs: Uint8Array[] | undefined
  if (cal !== undefined) {
    checkCalibrationGeometry(cal, g)
    blobs = layerBlobs(cal)
  }
  const sections: Uint8Array[] = []
  for (let l = 0; l < g.layers; l++) {
    const s = tensor.subarray(l * slab, (l + 1) * slab)
    const p = mode === 'kvgate' ? kvgateParams(targets ?? targetsOf(quality, l, g)) : undefined
    sections.push(encodeSection(mode, p, s, g, t, c, split, l, blobs?.[l], rd ? RD_LAMBDA : 0))
  }
  return encodeChunkObject(
    {
      ...meta,
      codec: mode,
      codecVersion: CODEC_VERSIONS[mode],
      codecParams: encodeParams(mode, quality, split),
      calibration: cal?.hash,
    },
    sections,
  )
}

function encodeSection(
  mode: CodecMode,
  kvgate: Float32Array | undefined,
  slab: Uint8Array,
  g: KvGeometry,
  t: number,
  c: number,
  split: CachegenSplit,
  layer: number,
  cal: Uint8Array | undefined,
  rdLambda: number,
): Uint8Array {
  switch (mode) {
    case 'raw':
      return slab
    case 'reference-cachegen': {
      const x = decodeElements(slab, g.dtype)
      return encodeCachegenLayer(x.subarray(0, t * c), x.subarray(t * c), t, c, layer, split)
    }
    case 'kvgate':
      return wasmCodec().encodeSection(mode, slab, wasmDtype(g), t, c, kvgate, cal, rdLambda)
    default:
      return wasmCodec().encodeSection(mode, slab, wasmDtype(g), t, c)
  }
}

function checkHeader(header: ChunkHeader): void {
  checkHeaderCodec(header.codec, header.codecVersion, header.codecParams)
  checkCodecDtype(header.codec, header.geometry)
  checkCachegenLatent(header.codec, header.geometry)
}

/** The byte-exact codecs the fp8 dtypes take (see isFp8); other codecs would quantise them again. */
export const FP8_CODECS: readonly CodecMode[] = ['raw', 'lossless']

/** fp8 KV with a lossy codec: refused on encode, and on decode (a header no encoder writes). */
export function checkCodecDtype(mode: CodecMode, g: KvGeometry): void {
  if (isFp8(g.dtype) && !FP8_CODECS.includes(mode)) {
    throw new CodecError(
      `the ${mode} codec does not take ${g.dtype} KV: fp8 is stored byte for byte, with the raw or lossless codec`,
      { code: 'ERR_CODEC_DTYPE' },
    )
  }
}

/** Refuses sections that could not honestly expand to the slab they claim. */
function checkExpansion(header: ChunkHeader, section: Uint8Array): void {
  const g = header.geometry
  const values = kvPlanes(g) * header.tokens * rowElements(g)
  const slab = layerSlabBytes(g, header.tokens)
  const ok =
    header.codec === 'raw'
      ? section.byteLength === slab
      : header.codec === 'q8'
        ? section.byteLength === kvPlanes(g) * header.tokens * (4 + rowElements(g))
        : header.codec === 'reference-cachegen'
          ? // Baseline only, decoded in TS: refuse implausible expansion (< 1/32 bit per value) to bound time.
            values <= (section.byteLength + 1) * 256
          : values <= (section.byteLength + 1) * MAX_SYMBOLS_PER_BYTE
  if (!ok)
    throw new CorruptStreamError(
      `${header.codec} section of ${section.byteLength} bytes cannot hold ${values} values`,
    )
}

/**
 * Decodes layer `layer`'s section (already extracted and CRC-checked, e.g. from a
 * layer-range GET) into `out` (the layer slab, K then V, or the latent) or a new buffer. A v2 header
 * needs the calibration it names in `opts`.
 */
export function decodeSection(
  header: ChunkHeader,
  layer: number,
  section: Uint8Array,
  out?: Uint8Array,
  opts: { calibration?: Calibration } = {},
): Uint8Array {
  checkHeader(header)
  const blobs = calibrationFor(header, opts.calibration)
  const g = header.geometry
  const t = header.tokens
  const c = rowElements(g)
  const slab = layerSlabBytes(g, t)
  if (!Number.isInteger(layer) || layer < 0 || layer >= g.layers) {
    throw new InvalidArgumentError(`layer ${layer} out of range 0..${g.layers - 1}`)
  }
  // Validate before allocating: a hostile header must not buy a huge buffer.
  checkExpansion(header, section)
  if (out === undefined && slab > MAX_WASM_SLAB_BYTES)
    throw new CodecError(`layer slab of ${slab} bytes is too large`)
  const dst = out ?? new Uint8Array(slab)
  if (dst.byteLength !== slab)
    throw new InvalidArgumentError(`output must be ${slab} bytes, got ${dst.byteLength}`)
  switch (header.codec) {
    case 'raw':
      dst.set(section)
      break
    case 'reference-cachegen': {
      const k = new Float32Array(t * c)
      const v = new Float32Array(t * c)
      decodeCachegenLayer(section, t, c, layer, k, v, splitOfParams(header.codecParams))
      const half = slab / 2
      encodeElements(k, g.dtype, dst.subarray(0, half))
      encodeElements(v, g.dtype, dst.subarray(half))
      break
    }
    default:
      // Only kvgate sections are coded against a calibration (other codecs never write v2,
      // and a v2 header on one must not turn its section into a kvgate one).
      wasmCodec().decodeSection(
        header.codec,
        section,
        wasmDtype(g),
        t,
        c,
        dst,
        header.codec === 'kvgate' ? blobs?.[layer] : undefined,
      )
  }
  return dst
}

/** Decodes one layer of a whole chunk object (section CRC checked). */
export function decodeLayer(
  obj: Uint8Array,
  header: ChunkHeader,
  layer: number,
  out?: Uint8Array,
  opts: { calibration?: Calibration } = {},
): Uint8Array {
  return decodeSection(header, layer, sectionOf(obj, header, layer), out, opts)
}

/** Header checks shared by the whole-chunk decoders; returns the header and its tensor size. */
function openChunk(obj: Uint8Array, limits: DecodeLimits): { header: ChunkHeader; size: number } {
  const header = decodeHeader(obj)
  checkHeader(header)
  // Before any output exists: a chunk whose calibration is not at hand is a typed miss.
  calibrationFor(header, limits.calibration)
  const size = chunkBytes(header.geometry, header.tokens)
  if (size > (limits.maxOutputBytes ?? DEFAULT_MAX_OUTPUT)) {
    throw new CodecError(`chunk decodes to ${size} bytes, over the limit`)
  }
  if (obj.byteLength !== header.totalBytes) {
    throw new CorruptStreamError(`chunk object is ${obj.byteLength} bytes, header says ${header.totalBytes}`)
  }
  return { header, size }
}

/** CRC-checks every section and checks it can hold its layer, before any output exists. */
function checkedSections(obj: Uint8Array, header: ChunkHeader): Uint8Array[] {
  const sections: Uint8Array[] = []
  for (let l = 0; l < header.geometry.layers; l++) {
    const s = sectionOf(obj, header, l)
    checkExpansion(header, s)
    sections.push(s)
  }
  return sections
}

function decodeSections(
  header: ChunkHeader,
  sections: Uint8Array[],
  out: Uint8Array,
  calibration: Calibration | undefined,
): void {
  const slab = layerSlabBytes(header.geometry, header.tokens)
  sections.forEach((s, l) => {
    decodeSection(header, l, s, out.subarray(l * slab, (l + 1) * slab), { calibration })
  })
}

/**
 * Decodes a whole chunk object into `out` (a caller buffer of the chunk tensor's
 * size: no intermediate chunk-sized allocation). Returns the header. Every
 * section is verified before `out` is written; a decode error part-way (a
 * corrupt stream with a valid CRC) leaves `out` partly written.
 */
export function decodeChunkInto(obj: Uint8Array, out: Uint8Array, limits: DecodeLimits = {}): ChunkHeader {
  const { header, size } = openChunk(obj, limits)
  if (out.byteLength !== size)
    throw new InvalidArgumentError(`output must be ${size} bytes, got ${out.byteLength}`)
  decodeSections(header, checkedSections(obj, header), out, limits.calibration)
  return header
}

/** Decodes a whole chunk object into a new chunk tensor in the header's dtype. */
export function decodeChunk(obj: Uint8Array, limits: DecodeLimits = {}): Uint8Array {
  const { header, size } = openChunk(obj, limits)
  // Check every section before allocating the output.
  const sections = checkedSections(obj, header)
  const out = new Uint8Array(size)
  decodeSections(header, sections, out, limits.calibration)
  return out
}
