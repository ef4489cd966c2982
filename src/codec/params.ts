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
/** The product default for L4 (see docs/codec.md for what it buys). */
export const DEFAULT_QUALITY = 5
/** Header quality byte of a kvgate chunk coded with explicit error targets (benchmarks). */
export const CUSTOM_TARGETS = 0

/**
 * How a K error reaches the attention output compared with a V error. A V error of
 * relative size εV moves the output by about εV; a K error moves every logit by about
 * εK × the logit spread σ (in nats; εK relative to K's channel-centred RMS, since channel
 * offsets cancel in softmax), and the output by about σ·εK. Measured on stories260K's real
 * KV (attention re-run on decoded KV, 8 windows, bench/codec.ts's attention error):
 * error² ≈ (4.9·εK)² + (0.98·εV)², i.e. σ ≈ 5 nats, the order of magnitude a trained
 * model's attention needs to be selective at all.
 */
export const LOGIT_SPREAD = 5

/**
 * Target attention-output error per quality level (index = level): √2 apart from q1 to
 * q7 (half a bit per value per level), then near-lossless steps. The default q5 budgets
 * 0.14: on stories260K that keeps next-token agreement ≥ 99% with two standard errors to
 * spare at 64- and 256-token chunks (0.2, q4, does not at 64: docs/codec.md). Each level splits its
 * budget evenly between K and V (equal contributions minimise bytes for a given output
 * error when both streams cost one bit per halving): εK = ε/(√2·σ), εV = ε/√2, one
 * uniform step per stream (entropy-coded uniform steps beat per-channel steps in MSE per
 * bit), so the error no longer depends on chunk length or outlier channels.
 */
const ATTENTION_ERROR: readonly number[] = [0, 0.56, 0.4, 0.28, 0.2, 0.14, 0.1, 0.07, 0.035, 0.01]

/**
 * λ of the encoder's rate-distortion rounding (`rdRounding`; wasm/src/lossy.rs rd_round), in
 * squared steps per bit: each level is the nearest one or the next towards its prediction,
 * whichever costs less in error² + λ·bits. ln 2 / 6 is the slope of an entropy-coded
 * uniform quantizer's distortion–rate curve, dD/dR = −2 ln 2 · D with D = Δ²/12: the error
 * a bit buys anywhere else in the stream, a property of the coder, not of a model. The
 * encoder shrinks the step so the error stays nearest rounding's; the decoder is unchanged
 * (docs/codec.md).
 */
export const RD_LAMBDA = Math.LN2 / 6

export interface LayerTargets {
  /** Relative RMS error of K against its channel-centred RMS. */
  kError: number
  /** Relative RMS error of V against its RMS. */
  vError: number
}

/** Error targets of a layer's K and V at `quality` (every layer alike: the bars average over layers). */
export function layerTargets(quality: number, _layer: number, _layers: number): LayerTargets {
  const e = ATTENTION_ERROR[quality]!
  return { kError: e / (Math.SQRT2 * LOGIT_SPREAD), vError: e / Math.SQRT2 }
}

/**
 * Error target of a latent (MLA) layer's one stream at `quality`, relative to its
 * channel-centred RMS. The latent becomes both K and V (the model's up-projections are
 * linear: a relative error εL reaches K and V as about εL each), so its error reaches the
 * output as about √(σ² + 1)·εL, and the whole budget goes to this one stream:
 * εL = ε / √(σ² + 1). The rope slice (K only) takes the same step: its error counts only
 * in K's term, so it stays within the budget (docs/codec.md, "MLA latent chunks").
 */
export function latentTarget(quality: number): number {
  return ATTENTION_ERROR[quality]! / Math.hypot(LOGIT_SPREAD, 1)
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
  const q = params[0] ?? 0
  if (mode === 'kvgate' && q !== CUSTOM_TARGETS && !(q >= MIN_QUALITY && q <= MAX_QUALITY)) {
    mismatch(`quality ${params[0]} is unknown`)
  }
  if (params.length > CODEC_PARAMS_BYTES) mismatch('params are too long')
  for (let i = 0; i < CODEC_PARAMS_BYTES; i++) {
    if ((params[i] ?? 0) !== expected[i]) mismatch(`params differ at byte ${i}`)
  }
}
