// Codec ids, versions and the 16 header bytes of codec parameters, plus the
// kvgate quality ladder (target relative error per stream, finer in early layers).

import { CodecError } from '../core/errors.ts'
import type { CodecId } from '../core/format.ts'
import { CODEC_PARAMS_BYTES } from '../core/format.ts'
import { type CachegenSplit, LARGE_MODEL_SPLIT } from './reference-cachegen.ts'
import { WASM_CODEC_VERSION } from './wasm-instance.ts'

export type CodecMode = CodecId

export const CODEC_MODES: readonly CodecMode[] = ['raw', 'lossless', 'kvgate', 'reference-cachegen', 'q8']

/** Section-format version per codec; a chunk with another version is rejected. */
export const CODEC_VERSIONS: Readonly<Record<CodecMode, number>> = {
  raw: 1,
  lossless: WASM_CODEC_VERSION,
  kvgate: WASM_CODEC_VERSION,
  'reference-cachegen': 1,
  q8: WASM_CODEC_VERSION,
}

export const MIN_QUALITY = 1
export const MAX_QUALITY = 9
/** The product default for L4 (see bench/codec.ts for what it buys). */
export const DEFAULT_QUALITY = 5

/**
 * Quantization levels per quality level (index = level): K per channel (steps =
 * the channel's range over the chunk / levels), V with one step per layer
 * stream (the mean over tokens of 2·max|v_t| / levels: per-token quantization's
 * error without per-token side information), both entropy coded. Measured on
 * stories260K (bench/codec.ts): next-token agreement follows K's error, hardly
 * V's, so the upper levels refine K and keep V at the default's levels. Level 5
 * stays at or below reference-cachegen's K and V error on stories260K and on
 * 8B-shaped synthetic KV; level 7 is the first at ≥ 99% next-token agreement.
 */
const LADDER: readonly (readonly [number, number])[] = [
  [0, 0],
  [5, 8],
  [6, 10],
  [8, 12],
  [10, 14],
  [12, 16],
  [24, 16],
  [48, 16],
  [64, 32],
  [128, 160],
]

/** Early layers' errors propagate through every later layer: they get this many times the levels. */
export const EARLY_LAYER_BOOST = 1.5

export interface LayerTargets {
  kLevels: number
  /** V levels; V steps are uniform over the stream (see LADDER). */
  vLevels: number
}

/** Per-layer bit budget: the first ⌈layers/8⌉ layers get finer steps, the rest the level's. */
export function layerTargets(quality: number, layer: number, layers: number): LayerTargets {
  const [k, v] = LADDER[quality]!
  const early = layer < Math.max(1, Math.round(layers / 8))
  const f = early ? EARLY_LAYER_BOOST : 1
  return { kLevels: k * f, vLevels: v * f }
}

export function checkQuality(q: unknown): number {
  if (typeof q !== 'number' || !Number.isInteger(q) || q < MIN_QUALITY || q > MAX_QUALITY) {
    throw new CodecError(`quality must be an integer in ${MIN_QUALITY}..${MAX_QUALITY}, got ${String(q)}`)
  }
  return q
}

/** The 16 codecParams bytes a chunk of `mode` carries (`split`: reference-cachegen's 32-bin layers). */
export function encodeParams(mode: CodecMode, quality: number, split?: CachegenSplit): Uint8Array {
  const p = new Uint8Array(CODEC_PARAMS_BYTES)
  if (mode === 'kvgate') p[0] = quality
  if (mode === 'reference-cachegen') {
    // Layers below p[0] (K) / p[1] (V) use 32 bins, the rest 16 (LMCache's split).
    const s = split ?? LARGE_MODEL_SPLIT
    p[0] = s.k
    p[1] = s.v
  }
  return p
}

/** reference-cachegen's split as a header names it. */
export function splitOfParams(params: Uint8Array): CachegenSplit {
  return { k: params[0] ?? 0, v: params[1] ?? 0 }
}

/** Validates a header's codec version + params; throws ERR_CODEC_MISMATCH. */
export function checkHeaderCodec(mode: CodecMode, version: number, params: Uint8Array): void {
  const mismatch = (why: string): never => {
    throw new CodecError(`chunk codec '${mode}' ${why}`, { code: 'ERR_CODEC_MISMATCH' })
  }
  if (version !== CODEC_VERSIONS[mode])
    mismatch(`version ${version}, this build decodes ${CODEC_VERSIONS[mode]}`)
  const expected = encodeParams(
    mode,
    mode === 'kvgate' ? (params[0] ?? 0) : 0,
    mode === 'reference-cachegen' ? splitOfParams(params) : undefined,
  )
  if (mode === 'kvgate' && !((params[0] ?? 0) >= MIN_QUALITY && (params[0] ?? 0) <= MAX_QUALITY)) {
    mismatch(`quality ${params[0]} is unknown`)
  }
  if (params.length > CODEC_PARAMS_BYTES) mismatch('params are too long')
  for (let i = 0; i < CODEC_PARAMS_BYTES; i++) {
    if ((params[i] ?? 0) !== expected[i]) mismatch(`params differ at byte ${i}`)
  }
}
