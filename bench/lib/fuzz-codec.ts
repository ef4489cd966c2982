// Mutation fuzzer for the codec's decoders, shared by bench/fuzz-codec.ts (≥ 100k
// inputs) and the test suite (a few thousand). Sections are mutated and re-wrapped
// with valid CRCs so the hostile bytes reach the wasm/TS decoders themselves. kvgate chunks
// are also coded against a calibration object, and the calibration bytes are mutated too
// (with their CRC fixed, so hostile tables reach openCalibration and the wasm decoder).

import { layerBlobs } from '../../src/codec/calibration.ts'
import {
  buildCalibration,
  type Calibration,
  CODEC_MODES,
  type CodecMode,
  decodeChunk,
  encodeChunk,
  openCalibration,
} from '../../src/codec/node.ts'
import { wasmCodec } from '../../src/codec/runtime.ts'
import { WASM_LATENT } from '../../src/codec/wasm-instance.ts'
import { crc32 } from '../../src/core/checksum.ts'
import { encodeElements } from '../../src/core/dtype.ts'
import { isKvgateError } from '../../src/core/errors.ts'
import {
  type ChunkHeader,
  decodeHeader,
  encodeChunk as encodeChunkObject,
  sectionOf,
} from '../../src/core/format.ts'
import type { KvGeometry } from '../../src/core/layout.ts'
import { DTYPE_CODES, kvPlanes } from '../../src/core/layout.ts'
import { chunkInfo } from './chunk-info.ts'

export interface FuzzOptions {
  iterations: number
  seed?: number
  modes?: readonly CodecMode[]
  /** Also fuzz kvgate chunks coded with a calibration, and the calibration bytes (default true). */
  calibration?: boolean
}

export interface FuzzReport {
  iterations: number
  /** Mutated inputs that decoded without error (wrong values are allowed: CRCs guard integrity). */
  decoded: number
  /** Mutated inputs rejected with a KvgateError (CodecError / FormatError). */
  rejected: number
  /** Rejections that came from a wasm trap (instance replaced); expected 0. */
  traps: number
  /** Anything else: a crash escaping as a non-kvgate error. Must be empty. */
  failures: { mode: CodecMode; error: string }[]
  /** Slowest single decode in ms (a hang would show here, or never return). */
  maxDecodeMs: number
  /** Largest wasm linear memory seen, bytes. */
  maxMemoryBytes: number
  perMode: Record<string, number>
}

function rng(seed: number): () => number {
  let s = seed >>> 0 || 1
  return () => {
    s ^= s << 13
    s >>>= 0
    s ^= s >>> 17
    s ^= s << 5
    s >>>= 0
    return s / 4294967296
  }
}

interface Seed {
  mode: CodecMode
  obj: Uint8Array
  header: ChunkHeader
  sections: Uint8Array[]
  expected: Uint8Array
  calibration?: Calibration
}

function makeSeeds(modes: readonly CodecMode[], r: () => number, calibrated: boolean): Seed[] {
  const seeds: Seed[] = []
  const shapes: [KvGeometry, number][] = [
    [{ layers: 2, kvHeads: 2, headDim: 8, dtype: 'fp16' }, 24],
    [{ layers: 1, kvHeads: 3, headDim: 5, dtype: 'bf16' }, 7],
    [{ layers: 2, kvHeads: 1, headDim: 16, dtype: 'fp32' }, 33],
    // An MLA latent chunk: one [token][latent] plane per layer.
    [{ layers: 2, kvHeads: 1, headDim: 12, dtype: 'bf16', latent: true }, 19],
  ]
  for (const mode of modes) {
    for (const [g, tokens] of shapes) {
      if (g.latent && mode === 'reference-cachegen') continue // a K/V-only baseline
      const c = g.kvHeads * g.headDim
      const vals = new Float32Array(g.layers * kvPlanes(g) * tokens * c)
      for (let i = 0; i < vals.length; i++) vals[i] = (r() - 0.5) * (i % 7 === 0 ? 20 : 2) + Math.sin(i / c)
      const tensor = encodeElements(vals, g.dtype)
      const meta = chunkInfo(g, tokens)
      const obj = encodeChunk(tensor, meta, { mode })
      const header = decodeHeader(obj)
      const sections = header.sections.map((_, i) => sectionOf(obj, header, i).slice())
      seeds.push({ mode, obj, header, sections, expected: decodeChunk(obj) })
      if (mode === 'kvgate' && calibrated) {
        // Calibrated on a shifted copy: close enough that some streams use the table sets.
        const other = encodeElements(
          vals.map((v, i) => v * (1 + 0.1 * Math.sin(i))),
          g.dtype,
        )
        const calibration = openCalibration(
          buildCalibration([other, tensor], { geometry: g, dtype: g.dtype }),
        )
        const cobj = encodeChunk(tensor, meta, { mode, calibration })
        const ch = decodeHeader(cobj)
        seeds.push({
          mode,
          obj: cobj,
          header: ch,
          sections: ch.sections.map((_, i) => sectionOf(cobj, ch, i).slice()),
          expected: decodeChunk(cobj, { calibration }),
          calibration,
        })
      }
    }
  }
  return seeds
}

/** Mutated calibration bytes, CRC fixed most of the time so the mutation reaches the parser. */
function mutateCalibration(cal: Uint8Array, r: () => number, other: Uint8Array): Uint8Array {
  const b = mutate(cal, r, other)
  if (b.length >= 8 && r() < 0.8)
    new DataView(b.buffer, b.byteOffset).setUint32(b.length - 4, crc32(b.subarray(0, b.length - 4)), true)
  return b
}

const INTERESTING = [0, 1, 0x7f, 0x80, 0xff, 0x7fff, 0xffff, 0x7fffffff, 0x80000000, 0xffffffff]

function mutate(src: Uint8Array, r: () => number, other: Uint8Array): Uint8Array {
  let b = src.slice()
  const rounds = 1 + Math.floor(r() * 4)
  for (let k = 0; k < rounds; k++) {
    const at = Math.floor(r() * Math.max(1, b.length))
    switch (Math.floor(r() * 8)) {
      case 0:
        if (b.length) b[at] = b[at]! ^ (1 << Math.floor(r() * 8))
        break
      case 1:
        if (b.length) b[at] = Math.floor(r() * 256)
        break
      case 2:
        b = b.subarray(0, Math.floor(r() * b.length))
        break
      case 3: {
        const extra = new Uint8Array(1 + Math.floor(r() * 64)).map(() => Math.floor(r() * 256))
        const g = new Uint8Array(b.length + extra.length)
        g.set(b)
        g.set(extra, b.length)
        b = g
        break
      }
      case 4: {
        const v = INTERESTING[Math.floor(r() * INTERESTING.length)]!
        if (at + 4 <= b.length) new DataView(b.buffer, b.byteOffset).setUint32(at, v, true)
        break
      }
      case 5: {
        const n = Math.floor(r() * 32)
        b.fill(r() < 0.5 ? 0 : 0xff, at, at + n)
        break
      }
      case 6: {
        // Splice bytes from another section (valid structure, wrong place).
        const from = Math.floor(r() * Math.max(1, other.length))
        const n = Math.min(other.length - from, 1 + Math.floor(r() * 64))
        if (n > 0 && at + n <= b.length) b.set(other.subarray(from, from + n), at)
        break
      }
      default:
        if (b.length) b[at] = (b[at]! + (r() < 0.5 ? 1 : 255)) & 0xff
    }
  }
  return b
}

export function fuzzCodec(opts: FuzzOptions): FuzzReport {
  const r = rng(opts.seed ?? 1)
  const modes = opts.modes ?? CODEC_MODES
  const seeds = makeSeeds(modes, r, opts.calibration ?? true)
  const report: FuzzReport = {
    iterations: 0,
    decoded: 0,
    rejected: 0,
    traps: 0,
    failures: [],
    maxDecodeMs: 0,
    maxMemoryBytes: 0,
    perMode: {},
  }
  for (let i = 0; i < opts.iterations; i++) {
    const seed = seeds[i % seeds.length]!
    const other = seeds[Math.floor(r() * seeds.length)]!
    const label =
      (seed.calibration ? `${seed.mode}+calibration` : seed.mode) +
      (seed.header.geometry.latent ? '+latent' : '')
    let input: Uint8Array
    let calibration = seed.calibration
    const t0 = performance.now()
    if (calibration && r() < 0.3) {
      // Hostile calibration: through openCalibration, then (when it opens) as the chunk's named
      // calibration; or straight into the wasm decoder as a layer blob, bypassing the checks.
      const bad = mutateCalibration(calibration.bytes, r, other.obj)
      try {
        if (r() < 0.5) {
          const c = seed.header.geometry.kvHeads * seed.header.geometry.headDim
          const blobs = layerBlobs(calibration)
          const layer = Math.floor(r() * blobs.length)
          const blob = mutate(blobs[layer]!, r, bad)
          wasmCodec().decodeSection(
            'kvgate',
            seed.sections[layer]!,
            DTYPE_CODES[seed.header.geometry.dtype] | (seed.header.geometry.latent ? WASM_LATENT : 0),
            seed.header.tokens,
            c,
            new Uint8Array(seed.expected.byteLength / seed.header.geometry.layers),
            blob.length ? blob : new Uint8Array(1),
          )
        } else {
          const opened = openCalibration(bad)
          decodeChunk(encodeChunkObject({ ...seed.header, calibration: opened.hash }, seed.sections), {
            calibration: opened,
          })
        }
        report.decoded++
      } catch (e) {
        if (isKvgateError(e)) {
          report.rejected++
          if (/inside wasm/.test((e as Error).message)) report.traps++
        } else report.failures.push({ mode: seed.mode, error: String((e as Error)?.stack ?? e) })
      }
      report.maxDecodeMs = Math.max(report.maxDecodeMs, performance.now() - t0)
      report.perMode['calibration bytes'] = (report.perMode['calibration bytes'] ?? 0) + 1
      report.iterations++
      continue
    }
    if (r() < 0.1) {
      // Whole-object mutation: mostly caught by the format layer, sometimes not.
      input = mutate(seed.obj, r, other.obj)
    } else {
      const layer = Math.floor(r() * seed.sections.length)
      const sections = seed.sections.slice()
      sections[layer] = mutate(sections[layer]!, r, other.sections[0]!)
      input = encodeChunkObject(seed.header, sections)
    }
    if (calibration && r() < 0.05) calibration = other.calibration // another or none: a typed miss
    try {
      const out = decodeChunk(input, { calibration })
      if (out.byteLength !== seed.expected.byteLength && input.byteLength === seed.obj.byteLength) {
        // Sizes come from the header; a same-header decode must fill the same tensor.
        report.failures.push({ mode: seed.mode, error: 'decoded tensor has the wrong size' })
      }
      report.decoded++
    } catch (e) {
      if (isKvgateError(e)) {
        report.rejected++
        if (/inside wasm/.test((e as Error).message)) report.traps++
      } else report.failures.push({ mode: seed.mode, error: String((e as Error)?.stack ?? e) })
    }
    report.maxDecodeMs = Math.max(report.maxDecodeMs, performance.now() - t0)
    report.perMode[label] = (report.perMode[label] ?? 0) + 1
    report.iterations++
    if (i % 97 === 0) {
      // The instance must still decode honest input exactly after any hostile one.
      const again = decodeChunk(seed.obj, { calibration: seed.calibration })
      if (Buffer.compare(Buffer.from(again), Buffer.from(seed.expected)) !== 0) {
        report.failures.push({
          mode: seed.mode,
          error: 'honest chunk decoded differently after hostile input',
        })
      }
      report.maxMemoryBytes = Math.max(report.maxMemoryBytes, wasmCodec().memoryBytes)
    }
  }
  report.maxMemoryBytes = Math.max(report.maxMemoryBytes, wasmCodec().memoryBytes)
  return report
}
