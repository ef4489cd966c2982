// The codec quality protocol (docs/codec.md): windows of held-out text that fit the model's
// context, judged only at positions inside it, with standard errors over windows.
//
// Per window (seqLen tokens, BOS + stories from a distinct starting story): storage figures
// (bytes, per-layer K/V rRMSE, attention-output error) come from round-tripping the whole
// window's KV in full chunks; quality figures come from each prefix P (stored chunk by chunk,
// the last one partial where P is not a multiple of the chunk size), teacher-forced next-token
// agreement on the exact greedy continuation for positions P−1..seqLen−1 and the perplexity of
// the window's own text at positions P..seqLen−1. No position ever reaches seqLen.

import type { KvCacheState, Transformer } from './forward.ts'
import { ModelError } from './model-error.ts'
import {
  attentionOutputError,
  kvRelativeError,
  nextTokenAgreement,
  perplexityChange,
  type RoundTrip,
  roundTripCache,
} from './quality.ts'
import type { Tokenizer } from './tokenizer.ts'

/** Window i: BOS + stories i, i+1, … (cyclic, '\n'-joined), cut at `seqLen` tokens. */
export function protocolWindows(
  tokenizer: Tokenizer,
  stories: readonly string[],
  seqLen: number,
  count: number,
): number[][] {
  if (stories.length === 0) throw new ModelError('protocolWindows: no text')
  const windows: number[][] = []
  for (let i = 0; i < count; i++) {
    const parts: string[] = []
    let ids: number[] = []
    for (let j = 0; ids.length < seqLen; j++) {
      if (j >= 4 * stories.length) throw new ModelError('protocolWindows: text too short for a window')
      parts.push(stories[(i + j) % stories.length]!)
      ids = tokenizer.encode(parts.join('\n'))
    }
    windows.push(ids.slice(0, seqLen))
  }
  return windows
}

/** A window's exact KV (all seqLen positions) and its queries, computed once for every codec. */
export interface PreparedWindow {
  tokens: number[]
  cache: KvCacheState
  queries: Float32Array[]
}

export function prepareWindows(transformer: Transformer, windows: number[][]): PreparedWindow[] {
  return windows.map((tokens) => {
    const r = transformer.prefill(tokens, { queries: true, cacheOptions: { dtype: 'fp16' } })
    return { tokens, cache: r.cache, queries: r.queries! }
  })
}

export interface MeanSe {
  mean: number
  /** Standard error of the mean over units (window × prefix); 0 with one unit. */
  se: number
  units: number
}

export function meanSe(xs: readonly number[]): MeanSe {
  const n = xs.length
  if (n === 0) return { mean: Number.NaN, se: Number.NaN, units: 0 }
  const mean = xs.reduce((a, x) => a + x, 0) / n
  const v = n > 1 ? xs.reduce((a, x) => a + (x - mean) ** 2, 0) / (n - 1) : 0
  return { mean, se: Math.sqrt(v / n), units: n }
}

export interface ProtocolOptions {
  chunkTokens: number
  /** Stored prefix lengths; each must be < the window length. */
  prefixes: readonly number[]
  /** Query stride of the attention-output error. @default 8 */
  attentionStride?: number
}

export interface ProtocolResult {
  chunkTokens: number
  windows: number
  prefixes: readonly number[]
  rawBytes: number
  encodedBytes: number
  /** rawBytes / encodedBytes over every window's full chunks. */
  ratio: number
  /** Per-layer rRMSE over all windows' full chunks. */
  kLayer: number[]
  vLayer: number[]
  /** The per-layer figures averaged over layers (the protocol's K/V error). */
  kMean: number
  vMean: number
  /** Energy-weighted over layers (shown beside the average only). */
  kPooled: number
  vPooled: number
  /** Attention-output relative error per layer (no propagation), averaged over layers and windows. */
  attention: number
  /** Teacher-forced next-token agreement per unit (window × prefix). */
  agreement: MeanSe
  agreementPositions: number
  agreements: number
  /** Perplexity change (decoded / exact − 1) per unit. */
  pplChange: MeanSe
}

function encodedOf(r: ReturnType<typeof roundTripCache>): number {
  if (r.encodedBytes === undefined) throw new ModelError('the round trip must report encoded sizes')
  return r.encodedBytes
}

/** Runs one codec through the protocol over prepared windows. */
export function runProtocol(
  transformer: Transformer,
  windows: readonly PreparedWindow[],
  roundTrip: RoundTrip,
  opts: ProtocolOptions,
): ProtocolResult {
  const pairs: { exact: Uint8Array; decoded: Uint8Array }[] = []
  let raw = 0
  let enc = 0
  let att = 0
  const agree: number[] = []
  const ppl: number[] = []
  let positions = 0
  let agreements = 0
  for (const w of windows) {
    const n = w.tokens.length
    const full = roundTripCache(w.cache, roundTrip, { chunkTokens: opts.chunkTokens, dtype: 'fp16' })
    raw += full.rawBytes
    enc += encodedOf(full)
    full.exact.forEach((e, i) => {
      pairs.push({ exact: e, decoded: full.roundTripped[i]! })
    })
    const a = attentionOutputError(transformer, w.cache, full.decoded, w.queries, {
      stride: opts.attentionStride ?? 8,
    })
    att += a.perLayer.reduce((s, x) => s + x, 0) / a.perLayer.length
    for (const p of opts.prefixes) {
      if (!Number.isInteger(p) || p < 1 || p >= n) throw new ModelError(`prefix ${p} outside 1..${n - 1}`)
      const rt = roundTripCache(w.cache, roundTrip, {
        tokens: p,
        chunkTokens: opts.chunkTokens,
        dtype: 'fp16',
      })
      const prefix = w.tokens.slice(0, p)
      // Queries at positions p−1..n−1: the last prediction is made at the context's last position.
      const ag = nextTokenAgreement(transformer, prefix, w.cache, rt.decoded, n - p + 1)
      agree.push(ag.rate)
      positions += ag.positions
      agreements += ag.agree
      ppl.push(perplexityChange(transformer, prefix, w.cache, rt.decoded, w.tokens.slice(p, n)).relChange)
    }
  }
  const g = windows[0]!.cache.geometry('fp16')
  const e = kvRelativeError(g, pairs)
  const avg = (xs: number[]) => xs.reduce((s, x) => s + x, 0) / xs.length
  return {
    chunkTokens: opts.chunkTokens,
    windows: windows.length,
    prefixes: opts.prefixes,
    rawBytes: raw,
    encodedBytes: enc,
    ratio: raw / enc,
    kLayer: e.k,
    vLayer: e.v,
    kMean: avg(e.k),
    vMean: avg(e.v),
    kPooled: e.kAll,
    vPooled: e.vAll,
    attention: att / windows.length,
    agreement: meanSe(agree),
    agreementPositions: positions,
    agreements,
    pplChange: meanSe(ppl),
  }
}
