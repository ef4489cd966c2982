// Judges a lossy KV codec on real KV: the prefix's exact KV goes through a round trip
// (encode → decode) chunk by chunk, and the model runs on the decoded KV.
//
// Metrics: relative RMSE per layer for K and V; attention-output error (every layer's
// attention re-run for the prompt's own queries on exact vs decoded KV, no error
// propagation between layers); next-token agreement (teacher-forced on the exact greedy
// continuation, so one divergence does not cascade); perplexity of a held-out
// continuation given exact vs decoded prefix KV. Like an engine that retrieved a
// prompt's KV, the decoded runs recompute the last prefix token on top of the decoded
// KV of positions 0..n−2, so its logits (the first prediction) are affected too.

import { decodeElements, encodeElements } from '../core/dtype.ts'
import { type Dtype, dtypeBytes, type KvGeometry } from '../core/layout.ts'
import { argmax, attend, exportChunk, importChunk, type KvCacheState, type Transformer } from './forward.ts'
import { ModelError } from './model-error.ts'

export interface RoundTripInfo {
  /** Geometry of the chunk tensor (dtype included). */
  geometry: KvGeometry
  tokens: number
  /** Position of the chunk's first token. */
  start: number
  chunkIndex: number
}

/** A codec under test: chunk tensor in, decoded chunk tensor out (optionally with its encoded size). */
export type RoundTrip = (
  tensor: Uint8Array,
  info: RoundTripInfo,
) => Uint8Array | { decoded: Uint8Array; encodedBytes: number }

export interface RoundTripCacheOptions {
  /** Positions to round-trip (from 0). @default cache.length */
  tokens?: number
  /** Tokens per chunk handed to the codec; the last chunk may be shorter. @default 256 */
  chunkTokens?: number
  /** @default the cache's dtype (fp16 unless the cache is fp32/bf16) */
  dtype?: Dtype
}

export interface RoundTripCacheResult {
  /** A new cache holding the decoded KV of positions [0, tokens). */
  decoded: KvCacheState
  exact: Uint8Array[]
  roundTripped: Uint8Array[]
  /** Chunk tensor bytes (uncompressed). */
  rawBytes: number
  /** Sum of encoded sizes when every round trip reported one. */
  encodedBytes?: number
}

/** Cuts positions [0, tokens) into chunks, round-trips each, and imports the results. */
export function roundTripCache(
  cache: KvCacheState,
  roundTrip: RoundTrip,
  opts: RoundTripCacheOptions = {},
): RoundTripCacheResult {
  const tokens = opts.tokens ?? cache.length
  const chunkTokens = opts.chunkTokens ?? 256
  const dtype = opts.dtype ?? cache.dtype
  if (!Number.isInteger(tokens) || tokens < 1 || tokens > cache.length) {
    throw new ModelError(`roundTripCache: tokens ${tokens} outside 1..${cache.length}`)
  }
  if (!Number.isInteger(chunkTokens) || chunkTokens < 1)
    throw new ModelError(`invalid chunkTokens ${chunkTokens}`)
  const decoded = cache.clone()
  decoded.truncate(0)
  const exact: Uint8Array[] = []
  const roundTripped: Uint8Array[] = []
  let encoded: number | undefined = 0
  let rawBytes = 0
  for (let start = 0, i = 0; start < tokens; start += chunkTokens, i++) {
    const end = Math.min(tokens, start + chunkTokens)
    const t = exportChunk(cache, start, end, dtype)
    // The codec gets its own copy: a codec that mutates its input must not corrupt `exact`.
    const r = roundTrip(t.slice(), {
      geometry: cache.geometry(dtype),
      tokens: end - start,
      start,
      chunkIndex: i,
    })
    const d = r instanceof Uint8Array ? r : r?.decoded
    if (!(d instanceof Uint8Array) || d.byteLength !== t.byteLength) {
      throw new ModelError(
        `round trip of chunk ${i} returned ${d instanceof Uint8Array ? `${d.byteLength} bytes` : 'no bytes'}, expected a ${t.byteLength}-byte chunk tensor`,
      )
    }
    if (r instanceof Uint8Array || encoded === undefined) encoded = undefined
    else encoded += r.encodedBytes
    importChunk(decoded, start, d, dtype)
    exact.push(t)
    roundTripped.push(d)
    rawBytes += t.byteLength
  }
  const res: RoundTripCacheResult = { decoded, exact, roundTripped, rawBytes }
  if (encoded !== undefined) res.encodedBytes = encoded
  return res
}

export interface KvError {
  /** Relative RMSE ‖exact − decoded‖ / ‖exact‖ of each layer's K. */
  k: number[]
  v: number[]
  /** Pooled over all layers. */
  kAll: number
  vAll: number
  /**
   * ‖exact − decoded‖ / ‖exact − per-channel mean‖ (means over each chunk's tokens).
   * K's channel offsets carry most of its norm but cancel in softmax, so this is the
   * error attention actually sees; on stories260K it is ~2× kAll.
   */
  kCentered: number[]
  vCentered: number[]
  kCenteredAll: number
  vCenteredAll: number
}

/** Per-layer relative RMSE between chunk tensors (pairs of equal geometry and token count). */
export function kvRelativeError(
  geometry: KvGeometry,
  pairs: { exact: Uint8Array; decoded: Uint8Array }[],
): KvError {
  const L = geometry.layers
  const ch = geometry.kvHeads * geometry.headDim
  const row = ch * dtypeBytes(geometry.dtype)
  const se = new Float64Array(2 * L)
  const s2 = new Float64Array(2 * L)
  const sc = new Float64Array(2 * L)
  const mean = new Float64Array(ch)
  for (const { exact, decoded } of pairs) {
    if (
      exact.byteLength !== decoded.byteLength ||
      exact.byteLength === 0 ||
      exact.byteLength % (2 * L * row) !== 0
    ) {
      throw new ModelError(
        `kvRelativeError: tensors of ${exact.byteLength} and ${decoded.byteLength} bytes do not fit the geometry`,
      )
    }
    const plane = exact.byteLength / (2 * L)
    const tokens = plane / row
    for (let p = 0; p < 2 * L; p++) {
      const a = decodeElements(exact.subarray(p * plane, (p + 1) * plane), geometry.dtype)
      const b = decodeElements(decoded.subarray(p * plane, (p + 1) * plane), geometry.dtype)
      mean.fill(0)
      for (let i = 0; i < a.length; i++) {
        se[p]! += (a[i]! - b[i]!) ** 2
        s2[p]! += a[i]! * a[i]!
        mean[i % ch]! += a[i]! / tokens
      }
      for (let i = 0; i < a.length; i++) sc[p]! += (a[i]! - mean[i % ch]!) ** 2
    }
  }
  const rel = (e: number, s: number): number =>
    s > 0 ? Math.sqrt(e / s) : e > 0 ? Number.POSITIVE_INFINITY : 0
  const pick = (kind: 0 | 1, den: Float64Array): number[] =>
    Array.from({ length: L }, (_, l) => rel(se[2 * l + kind]!, den[2 * l + kind]!))
  const pooled = (kind: 0 | 1, den: Float64Array): number => {
    let e = 0
    let d = 0
    for (let l = 0; l < L; l++) {
      e += se[2 * l + kind]!
      d += den[2 * l + kind]!
    }
    return rel(e, d)
  }
  return {
    k: pick(0, s2),
    v: pick(1, s2),
    kAll: pooled(0, s2),
    vAll: pooled(1, s2),
    kCentered: pick(0, sc),
    vCentered: pick(1, sc),
    kCenteredAll: pooled(0, sc),
    vCenteredAll: pooled(1, sc),
  }
}

export interface AttentionError {
  /** Relative error ‖o_exact − o_decoded‖ / ‖o_exact‖ of each layer's attention output. */
  perLayer: number[]
  /** Pooled over layers. */
  all: number
}

/**
 * Re-runs each layer's causal attention for the prompt's queries (from
 * `prefill(…, { queries: true })`) over exact vs decoded KV of positions [0, tokens).
 * `stride` > 1 evaluates every stride-th query position (cost is quadratic in tokens).
 */
export function attentionOutputError(
  transformer: Transformer,
  exact: KvCacheState,
  decoded: KvCacheState,
  queries: Float32Array[],
  opts: { tokens?: number; stride?: number } = {},
): AttentionError {
  const c = transformer.config
  const tokens = opts.tokens ?? Math.min(exact.length, decoded.length)
  const stride = opts.stride ?? 1
  if (tokens > exact.length || tokens > decoded.length)
    throw new ModelError('attentionOutputError: caches too short')
  if (queries.length !== c.layers || queries.some((q) => q.length < tokens * c.dim)) {
    throw new ModelError(`attentionOutputError: need ${c.layers} query arrays of ${tokens}×${c.dim}`)
  }
  const att = new Float64Array(tokens)
  const oe = new Float32Array(c.dim)
  const od = new Float32Array(c.dim)
  const scale = 1 / Math.sqrt(c.headDim)
  const kvMul = c.heads / c.kvHeads
  const perLayer: number[] = []
  let te = 0
  let ts = 0
  for (let l = 0; l < c.layers; l++) {
    let se = 0
    let s2 = 0
    for (let t = tokens - 1; t >= 0; t -= stride) {
      const q = queries[l]!.subarray(t * c.dim, (t + 1) * c.dim)
      attend(oe, q, exact.keys(l), exact.values(l), att, t + 1, c.heads, kvMul, c.headDim, c.kvDim, scale)
      attend(od, q, decoded.keys(l), decoded.values(l), att, t + 1, c.heads, kvMul, c.headDim, c.kvDim, scale)
      for (let i = 0; i < c.dim; i++) {
        se += (oe[i]! - od[i]!) ** 2
        s2 += oe[i]! * oe[i]!
      }
    }
    perLayer.push(s2 > 0 ? Math.sqrt(se / s2) : 0)
    te += se
    ts += s2
  }
  return { perLayer, all: ts > 0 ? Math.sqrt(te / ts) : 0 }
}

/** A copy of `cache` that has re-run the last prefix token on top of positions 0..n−2. */
function resume(
  t: Transformer,
  cache: KvCacheState,
  prefix: ArrayLike<number>,
): { cache: KvCacheState; logits: Float32Array } {
  const n = prefix.length
  if (n < 1 || cache.length < n)
    throw new ModelError(`cache holds ${cache.length} positions, prefix has ${n}`)
  const c = cache.clone()
  c.truncate(n - 1)
  const logits = new Float32Array(t.config.vocabSize)
  t.step(prefix[n - 1]!, c, logits)
  return { cache: c, logits }
}

export interface Agreement {
  /** Predictions compared. */
  positions: number
  agree: number
  /** agree / positions. */
  rate: number
  /** First position whose argmax differs, or -1. */
  firstDivergence: number
  /** The exact greedy continuation the decoded run was teacher-forced on. */
  continuation: number[]
}

/**
 * Greedy continuation of `n` tokens from exact vs decoded prefix KV, teacher-forced on
 * the exact continuation: the fraction of positions whose argmax agrees.
 */
export function nextTokenAgreement(
  transformer: Transformer,
  prefix: ArrayLike<number>,
  exact: KvCacheState,
  decoded: KvCacheState,
  n = 64,
): Agreement {
  if (!Number.isInteger(n) || n < 1) throw new ModelError(`nextTokenAgreement: invalid n ${n}`)
  const e = resume(transformer, exact, prefix)
  const d = resume(transformer, decoded, prefix)
  let agree = 0
  let firstDivergence = -1
  const continuation: number[] = []
  for (let j = 0; j < n; j++) {
    const te = argmax(e.logits)
    const td = argmax(d.logits)
    if (te === td) agree++
    else if (firstDivergence < 0) firstDivergence = j
    continuation.push(te)
    if (j + 1 < n) {
      transformer.step(te, e.cache, e.logits)
      transformer.step(te, d.cache, d.logits)
    }
  }
  return { positions: n, agree, rate: agree / n, firstDivergence, continuation }
}

export interface PerplexityChange {
  tokens: number
  exact: number
  decoded: number
  /** decoded / exact − 1 (0.012 = +1.2%). */
  relChange: number
}

function logSoftmaxAt(logits: Float32Array, i: number): number {
  let m = Number.NEGATIVE_INFINITY
  for (let k = 0; k < logits.length; k++) if (logits[k]! > m) m = logits[k]!
  let s = 0
  for (let k = 0; k < logits.length; k++) s += Math.exp(logits[k]! - m)
  return logits[i]! - m - Math.log(s)
}

/** Perplexity of `heldOut` (tokens following the prefix) given exact vs decoded prefix KV. */
export function perplexityChange(
  transformer: Transformer,
  prefix: ArrayLike<number>,
  exact: KvCacheState,
  decoded: KvCacheState,
  heldOut: ArrayLike<number>,
): PerplexityChange {
  if (heldOut.length < 1) throw new ModelError('perplexityChange: empty held-out continuation')
  const e = resume(transformer, exact, prefix)
  const d = resume(transformer, decoded, prefix)
  let ne = 0
  let nd = 0
  for (let j = 0; j < heldOut.length; j++) {
    const tok = heldOut[j]!
    if (!Number.isInteger(tok) || tok < 0 || tok >= transformer.config.vocabSize) {
      throw new ModelError(`perplexityChange: token ${tok} outside the vocabulary`)
    }
    ne -= logSoftmaxAt(e.logits, tok)
    nd -= logSoftmaxAt(d.logits, tok)
    if (j + 1 < heldOut.length) {
      transformer.step(tok, e.cache, e.logits)
      transformer.step(tok, d.cache, d.logits)
    }
  }
  const pe = Math.exp(ne / heldOut.length)
  const pd = Math.exp(nd / heldOut.length)
  return { tokens: heldOut.length, exact: pe, decoded: pd, relChange: pd / pe - 1 }
}

export interface EvaluateCodecOptions {
  /** @default 256 */
  chunkTokens?: number
  /** Chunk tensor dtype handed to the codec (the exact KV is held at this precision). @default 'fp16' */
  dtype?: Dtype
  /** Tokens of teacher-forced greedy continuation to compare. @default 64 */
  agreementTokens?: number
  /** Tokens following the prefix, for the perplexity change (skipped when absent). */
  heldOut?: ArrayLike<number>
  /** Query stride of the attention-output error. @default 1 */
  attentionStride?: number
}

export interface CodecQualityReport {
  tokens: number
  chunks: number
  rawBytes: number
  encodedBytes?: number
  /** rawBytes / encodedBytes, when sizes were reported. */
  ratio?: number
  kv: KvError
  attention: AttentionError
  agreement: Agreement
  perplexity?: PerplexityChange
}

/** Runs every metric for one codec on the KV of `prefix` (which should start with BOS). */
export function evaluateCodec(
  transformer: Transformer,
  prefix: ArrayLike<number>,
  roundTrip: RoundTrip,
  opts: EvaluateCodecOptions = {},
): CodecQualityReport {
  const dtype = opts.dtype ?? 'fp16'
  const exact = transformer.prefill(prefix, { queries: true, cacheOptions: { dtype } })
  const rt = roundTripCache(exact.cache, roundTrip, { chunkTokens: opts.chunkTokens ?? 256, dtype })
  const report: CodecQualityReport = {
    tokens: prefix.length,
    chunks: rt.exact.length,
    rawBytes: rt.rawBytes,
    kv: kvRelativeError(
      exact.cache.geometry(dtype),
      rt.exact.map((e, i) => ({ exact: e, decoded: rt.roundTripped[i]! })),
    ),
    attention: attentionOutputError(transformer, exact.cache, rt.decoded, exact.queries!, {
      stride: opts.attentionStride ?? 1,
    }),
    agreement: nextTokenAgreement(transformer, prefix, exact.cache, rt.decoded, opts.agreementTokens ?? 64),
  }
  if (rt.encodedBytes !== undefined) {
    report.encodedBytes = rt.encodedBytes
    report.ratio = rt.rawBytes / rt.encodedBytes
  }
  if (opts.heldOut && opts.heldOut.length > 0) {
    report.perplexity = perplexityChange(transformer, prefix, exact.cache, rt.decoded, opts.heldOut)
  }
  return report
}

export interface UniformQuantOptions {
  /** Levels for K, quantized per channel over the chunk's tokens. @default 16 */
  kLevels?: number
  /** Levels for V, quantized per token over the layer's channels. @default 16 */
  vLevels?: number
}

/**
 * A reference lossy round trip: uniform min-max quantization, K per channel and V per
 * token (DESIGN §4's orientation points: 16 levels ≈ 100% agreement, 8 ≈ 96%). It
 * reports no encoded size (that depends on the entropy coder).
 */
export function uniformQuantRoundTrip(opts: UniformQuantOptions = {}): RoundTrip {
  const kLevels = opts.kLevels ?? 16
  const vLevels = opts.vLevels ?? 16
  for (const l of [kLevels, vLevels]) {
    if (!Number.isInteger(l) || l < 2 || l > 65536)
      throw new ModelError(`quantization levels ${l} outside 2..65536`)
  }
  return (tensor, { geometry: g, tokens }) => {
    const ch = g.kvHeads * g.headDim
    const plane = tokens * ch
    const x = decodeElements(tensor, g.dtype)
    const q = (off: number, stride: number, count: number, levels: number): void => {
      let lo = Number.POSITIVE_INFINITY
      let hi = Number.NEGATIVE_INFINITY
      for (let k = 0; k < count; k++) {
        const v = x[off + k * stride]!
        if (v < lo) lo = v
        if (v > hi) hi = v
      }
      const step = (hi - lo) / (levels - 1)
      if (!(step > 0)) return
      for (let k = 0; k < count; k++) {
        const i = off + k * stride
        x[i] = lo + Math.round((x[i]! - lo) / step) * step
      }
    }
    for (let l = 0; l < g.layers; l++) {
      const kb = 2 * l * plane
      const vb = kb + plane
      for (let c = 0; c < ch; c++) q(kb + c, ch, tokens, kLevels)
      for (let t = 0; t < tokens; t++) q(vb + t * ch, 1, ch, vLevels)
    }
    return encodeElements(x, g.dtype)
  }
}
