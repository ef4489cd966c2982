// A float32 forward pass of a llama2.c checkpoint that keeps its KV cache in the
// kvgate chunk tensor order, so real KV can be exported, stored, retrieved and resumed.
//
// Math follows llama2.c run.c: RMSNorm (eps 1e-5), RoPE on adjacent pairs with angle
// pos·10000^(−(i mod headDim)/headDim) for even i, GQA (query head h reads kv head
// h / (heads / kvHeads)), softmax attention scaled by 1/√headDim, SwiGLU FFN, final
// RMSNorm, classifier. One token at a time with preallocated buffers (no per-token
// allocation); the cache stores post-RoPE K and V per layer as [position][kvHead][headDim].

import { bf16ToF32, decodeElements, encodeElements, f16ToF32, f32ToBf16, f32ToF16 } from '../core/dtype.ts'
import { DTYPE_CODES, type Dtype, dtypeBytes, isFp8, type KvGeometry } from '../core/layout.ts'
import type { LlamaCheckpoint, LlamaConfig, LlamaWeights } from './llama2c.ts'
import { ModelError } from './model-error.ts'
import { BOS_ID } from './tokenizer.ts'

/** Hard cap on cached positions (RoPE is defined past seqLen; quality there is not). */
export const MAX_POSITIONS = 1 << 16

export interface KvCacheOptions {
  /**
   * Precision the cache holds K/V at: every value written (computed or imported) is
   * rounded to this dtype, like an engine that keeps its KV in fp16. With the default,
   * exporting fp16 chunks and importing them elsewhere is lossless, so a second
   * process continues bit-identically. 'fp32' keeps the exact float32 values.
   * @default 'fp16'
   */
  dtype?: Dtype
  /** Positions to allocate up front; the cache grows on demand. @default the model's seqLen */
  capacity?: number
}

function checkDtype(d: unknown): Dtype {
  // fp8 is a storage dtype (moved as bytes): this forward pass rounds KV to fp16, bf16 or fp32 only.
  if (typeof d !== 'string' || !Object.hasOwn(DTYPE_CODES, d) || isFp8(d as Dtype))
    throw new ModelError(`unknown dtype ${String(d)} (fp16, bf16, fp32)`)
  return d as Dtype
}

/** Rounds a float32 value to the nearest value of `dtype`. */
function rounder(dtype: Dtype): (x: number) => number {
  if (dtype === 'fp16') return (x) => f16ToF32(f32ToF16(x))
  if (dtype === 'bf16') return (x) => bf16ToF32(f32ToBf16(x))
  return Math.fround
}

/** Post-RoPE K and V of positions 0..length-1, per layer, as float32 [position][kvHead][headDim]. */
export class KvCacheState {
  readonly layers: number
  readonly kvHeads: number
  readonly headDim: number
  /** kvHeads * headDim. */
  readonly kvDim: number
  readonly dtype: Dtype
  /** Positions 0..length-1 hold valid K/V. */
  length = 0
  #capacity: number
  #k: Float32Array[]
  #v: Float32Array[]
  readonly round: (x: number) => number

  constructor(geometry: { layers: number; kvHeads: number; headDim: number }, opts: KvCacheOptions = {}) {
    const { layers, kvHeads, headDim } = geometry
    for (const [n, v] of Object.entries({ layers, kvHeads, headDim })) {
      if (!Number.isInteger(v) || v < 1 || v > 4096) throw new ModelError(`KV cache: invalid ${n} ${v}`)
    }
    this.layers = layers
    this.kvHeads = kvHeads
    this.headDim = headDim
    this.kvDim = kvHeads * headDim
    this.dtype = checkDtype(opts.dtype ?? 'fp16')
    this.round = rounder(this.dtype)
    const cap = opts.capacity ?? 512
    if (!Number.isInteger(cap) || cap < 1 || cap > MAX_POSITIONS) {
      throw new ModelError(`KV cache: capacity ${cap} outside 1..${MAX_POSITIONS}`)
    }
    this.#capacity = cap
    this.#k = Array.from({ length: layers }, () => new Float32Array(cap * this.kvDim))
    this.#v = Array.from({ length: layers }, () => new Float32Array(cap * this.kvDim))
  }

  get capacity(): number {
    return this.#capacity
  }

  /** The chunk geometry of this cache's KV stored as `dtype` (default: the cache's own). */
  geometry(dtype: Dtype = this.dtype): KvGeometry {
    return { layers: this.layers, kvHeads: this.kvHeads, headDim: this.headDim, dtype: checkDtype(dtype) }
  }

  /** Layer `layer`'s K as [capacity][kvDim]; rows past `length` are scratch. */
  keys(layer: number): Float32Array {
    return this.#k[this.#layer(layer)]!
  }

  values(layer: number): Float32Array {
    return this.#v[this.#layer(layer)]!
  }

  #layer(layer: number): number {
    if (!Number.isInteger(layer) || layer < 0 || layer >= this.layers) {
      throw new ModelError(`KV cache: layer ${layer} outside 0..${this.layers - 1}`)
    }
    return layer
  }

  /** Makes room for `positions` positions (doubling, so growth is amortized). */
  reserve(positions: number): void {
    if (positions <= this.#capacity) return
    if (positions > MAX_POSITIONS)
      throw new ModelError(`KV cache: ${positions} positions exceed ${MAX_POSITIONS}`)
    const cap = Math.min(MAX_POSITIONS, Math.max(positions, this.#capacity * 2))
    const grow = (a: Float32Array): Float32Array => {
      const b = new Float32Array(cap * this.kvDim)
      b.set(a.subarray(0, this.length * this.kvDim))
      return b
    }
    this.#k = this.#k.map(grow)
    this.#v = this.#v.map(grow)
    this.#capacity = cap
  }

  /** Forgets positions n.. (e.g. to recompute the last prompt token). */
  truncate(n: number): void {
    if (!Number.isInteger(n) || n < 0 || n > this.length) {
      throw new ModelError(`KV cache: cannot truncate to ${n} (length ${this.length})`)
    }
    this.length = n
  }

  clone(): KvCacheState {
    const c = new KvCacheState(this, { dtype: this.dtype, capacity: Math.max(1, this.#capacity) })
    for (let l = 0; l < this.layers; l++) {
      c.#k[l]!.set(this.#k[l]!)
      c.#v[l]!.set(this.#v[l]!)
    }
    c.length = this.length
    return c
  }
}

/** Bytes of a chunk tensor of `tokens` tokens of this cache's geometry in `dtype`. */
export function chunkTensorBytes(cache: KvCacheState, tokens: number, dtype: Dtype = 'fp16'): number {
  return cache.layers * 2 * tokens * cache.kvDim * dtypeBytes(checkDtype(dtype))
}

/**
 * Positions [start, end) of the cache as a kvgate chunk tensor
 * [layer][K|V][token][kvHead][headDim] of little-endian `dtype` elements.
 */
export function exportChunk(
  cache: KvCacheState,
  start: number,
  end: number,
  dtype: Dtype = 'fp16',
): Uint8Array {
  checkDtype(dtype)
  if (!Number.isInteger(start) || !Number.isInteger(end) || start < 0 || end > cache.length || start >= end) {
    throw new ModelError(
      `exportChunk: invalid range [${start}, ${end}) for a cache of ${cache.length} positions`,
    )
  }
  const d = cache.kvDim
  const n = end - start
  const plane = n * d * dtypeBytes(dtype)
  const out = new Uint8Array(chunkTensorBytes(cache, n, dtype))
  for (let l = 0; l < cache.layers; l++) {
    const base = l * 2 * plane
    encodeElements(cache.keys(l).subarray(start * d, end * d), dtype, out.subarray(base, base + plane))
    encodeElements(
      cache.values(l).subarray(start * d, end * d),
      dtype,
      out.subarray(base + plane, base + 2 * plane),
    )
  }
  return out
}

/**
 * Writes a chunk tensor (see exportChunk) into positions [start, start + tokens).
 * `start` may not leave a gap (start <= cache.length); the cache's length becomes at
 * least start + tokens. Values are rounded to the cache dtype; NaN/Inf is rejected.
 * Returns the number of tokens imported.
 */
export function importChunk(
  cache: KvCacheState,
  start: number,
  tensor: Uint8Array,
  dtype: Dtype = 'fp16',
): number {
  checkDtype(dtype)
  if (!(tensor instanceof Uint8Array)) throw new ModelError('importChunk: tensor must be a Uint8Array')
  const perToken = chunkTensorBytes(cache, 1, dtype)
  if (tensor.byteLength === 0 || tensor.byteLength % perToken !== 0) {
    throw new ModelError(
      `importChunk: ${tensor.byteLength} bytes is not a whole number of tokens (${perToken} bytes per token for ${cache.layers} layers × ${cache.kvHeads} kv heads × ${cache.headDim} ${dtype})`,
    )
  }
  const n = tensor.byteLength / perToken
  if (!Number.isInteger(start) || start < 0 || start > cache.length) {
    throw new ModelError(
      `importChunk: start ${start} would leave a gap (cache holds ${cache.length} positions)`,
    )
  }
  if (start + n > MAX_POSITIONS)
    throw new ModelError(`importChunk: ${start + n} positions exceed ${MAX_POSITIONS}`)
  cache.reserve(start + n)
  const d = cache.kvDim
  const plane = n * d * dtypeBytes(dtype)
  const round = cache.round
  const exact = dtype === cache.dtype || cache.dtype === 'fp32'
  for (let l = 0; l < cache.layers; l++) {
    for (const [kind, dst] of [
      [0, cache.keys(l)],
      [1, cache.values(l)],
    ] as const) {
      const src = tensor.subarray((2 * l + kind) * plane, (2 * l + kind + 1) * plane)
      const view = dst.subarray(start * d, (start + n) * d)
      decodeElements(src, dtype, view)
      for (let i = 0; i < view.length; i++) {
        const x = view[i]!
        if (x - x !== 0)
          throw new ModelError(`importChunk: non-finite value in layer ${l} ${kind ? 'V' : 'K'}`)
        if (!exact) view[i] = round(x)
      }
    }
  }
  cache.length = Math.max(cache.length, start + n)
  return n
}

export interface PrefillOptions {
  /** Continue this cache (tokens go to positions cache.length..); default: a new cache. */
  cache?: KvCacheState
  /** Options for the new cache when `cache` is not given. */
  cacheOptions?: KvCacheOptions
  /** Also return each layer's post-RoPE queries [token][heads*headDim] (for attention-error metrics). */
  queries?: boolean
  /** Also return the logits of every position [token][vocab] (for perplexity). */
  allLogits?: boolean
}

export interface PrefillResult {
  cache: KvCacheState
  /** Logits after the last token (a fresh copy). */
  logits: Float32Array
  queries?: Float32Array[]
  allLogits?: Float32Array
}

export interface GenerateOptions {
  /**
   * A cache already holding K/V for a prefix of `prompt` (e.g. imported chunks); only
   * the rest is computed. At least the last prompt token is always recomputed to get
   * its logits, like an engine that retrieved the whole prompt's KV.
   */
  cache?: KvCacheState
  cacheOptions?: KvCacheOptions
  /** Stop when the model emits BOS (llama2.c's sequence delimiter). @default true */
  stopAtBos?: boolean
  /** Called with each generated token. */
  onToken?: (token: number) => void
}

export interface GenerateResult {
  /** Generated tokens only (not the prompt). */
  tokens: number[]
  cache: KvCacheState
}

/** Index of the largest logit (lowest index on ties). */
export function argmax(x: ArrayLike<number>): number {
  let best = 0
  let bv = x[0]!
  for (let i = 1; i < x.length; i++) {
    if (x[i]! > bv) {
      bv = x[i]!
      best = i
    }
  }
  return best
}

// out = W x for W [nOut, nIn] at wOff. Two rows per pass share each load of x (~20%
// faster than one row in V8); float64 accumulators.
export function matvec(
  out: Float32Array,
  x: Float32Array,
  w: Float32Array,
  wOff: number,
  nIn: number,
  nOut: number,
): void {
  let i = 0
  for (; i + 1 < nOut; i += 2) {
    const b = wOff + i * nIn
    const c = b + nIn
    let s0 = 0
    let s1 = 0
    let t0 = 0
    let t1 = 0
    let j = 0
    for (; j + 1 < nIn; j += 2) {
      const x0 = x[j]!
      const x1 = x[j + 1]!
      s0 += w[b + j]! * x0
      s1 += w[b + j + 1]! * x1
      t0 += w[c + j]! * x0
      t1 += w[c + j + 1]! * x1
    }
    if (j < nIn) {
      s0 += w[b + j]! * x[j]!
      t0 += w[c + j]! * x[j]!
    }
    out[i] = s0 + s1
    out[i + 1] = t0 + t1
  }
  if (i < nOut) {
    const b = wOff + i * nIn
    let s = 0
    for (let j = 0; j < nIn; j++) s += w[b + j]! * x[j]!
    out[i] = s
  }
}

function rmsnorm(out: Float32Array, x: Float32Array, w: Float32Array, wOff: number, n: number): void {
  let ss = 0
  for (let j = 0; j < n; j++) ss += x[j]! * x[j]!
  const scale = 1 / Math.sqrt(ss / n + 1e-5)
  for (let j = 0; j < n; j++) out[j] = w[wOff + j]! * (scale * x[j]!)
}

/** Runs a llama2.c checkpoint. Not re-entrant: one call at a time per instance. */
export class Transformer {
  readonly config: LlamaConfig
  readonly #w: LlamaWeights
  // Activations, allocated once.
  readonly #x: Float32Array
  readonly #xb: Float32Array
  readonly #xb2: Float32Array
  readonly #q: Float32Array
  readonly #k: Float32Array
  readonly #v: Float32Array
  readonly #hb: Float32Array
  readonly #hb2: Float32Array
  readonly #logits: Float32Array
  readonly #invFreq: Float64Array
  readonly #cos: Float64Array
  readonly #sin: Float64Array
  #att: Float64Array

  constructor(checkpoint: LlamaCheckpoint) {
    const c = checkpoint.config
    this.config = c
    this.#w = checkpoint.weights
    this.#x = new Float32Array(c.dim)
    this.#xb = new Float32Array(c.dim)
    this.#xb2 = new Float32Array(c.dim)
    this.#q = new Float32Array(c.dim)
    this.#k = new Float32Array(c.kvDim)
    this.#v = new Float32Array(c.kvDim)
    this.#hb = new Float32Array(c.hiddenDim)
    this.#hb2 = new Float32Array(c.hiddenDim)
    this.#logits = new Float32Array(c.vocabSize)
    const half = c.headDim / 2
    this.#invFreq = new Float64Array(half)
    // float32 arithmetic as in run.c: 1.0f / powf(10000.0f, head_dim / (float)head_size).
    for (let p = 0; p < half; p++)
      this.#invFreq[p] = Math.fround(1 / Math.fround(10000 ** Math.fround((2 * p) / c.headDim)))
    this.#cos = new Float64Array(half)
    this.#sin = new Float64Array(half)
    this.#att = new Float64Array(c.seqLen)
  }

  /** The chunk geometry of this model's KV (fp16 unless told otherwise). */
  geometry(dtype: Dtype = 'fp16'): KvGeometry {
    const c = this.config
    return { layers: c.layers, kvHeads: c.kvHeads, headDim: c.headDim, dtype: checkDtype(dtype) }
  }

  newCache(opts: KvCacheOptions = {}): KvCacheState {
    return new KvCacheState(this.config, { capacity: this.config.seqLen, ...opts })
  }

  #checkCache(cache: KvCacheState): void {
    const c = this.config
    if (!(cache instanceof KvCacheState)) throw new ModelError('expected a KvCacheState')
    if (cache.layers !== c.layers || cache.kvHeads !== c.kvHeads || cache.headDim !== c.headDim) {
      throw new ModelError(
        `KV cache geometry ${cache.layers}×${cache.kvHeads}×${cache.headDim} does not match the model's ${c.layers}×${c.kvHeads}×${c.headDim}`,
      )
    }
  }

  #checkToken(t: unknown): number {
    if (typeof t !== 'number' || !Number.isInteger(t) || t < 0 || t >= this.config.vocabSize) {
      throw new ModelError(`token ${String(t)} outside 0..${this.config.vocabSize - 1}`)
    }
    return t
  }

  /**
   * Runs `token` at position cache.length, appends its K/V, and (when `logits` is
   * given) writes the next-token logits there. `queriesOut[l]` receives layer l's
   * post-RoPE query at `queriesOff`.
   */
  #forward(
    token: number,
    cache: KvCacheState,
    logits: Float32Array | null,
    queriesOut?: Float32Array[],
    qOff = 0,
  ): void {
    const c = this.config
    const w = this.#w
    const { dim, kvDim, headDim, hiddenDim, heads } = c
    const pos = cache.length
    cache.reserve(pos + 1)
    if (this.#att.length < pos + 1) this.#att = new Float64Array(Math.max(pos + 1, this.#att.length * 2))
    const x = this.#x
    const xb = this.#xb
    const q = this.#q
    const k = this.#k
    const v = this.#v
    const att = this.#att
    x.set(w.tokenEmbedding.subarray(token * dim, (token + 1) * dim))
    const half = headDim / 2
    for (let p = 0; p < half; p++) {
      const a = Math.fround(pos * this.#invFreq[p]!)
      this.#cos[p] = Math.cos(a)
      this.#sin[p] = Math.sin(a)
    }
    const kvMul = heads / c.kvHeads
    const scale = 1 / Math.sqrt(headDim)
    const round = cache.round
    const exact = cache.dtype === 'fp32'
    for (let l = 0; l < c.layers; l++) {
      rmsnorm(xb, x, w.rmsAtt, l * dim, dim)
      matvec(q, xb, w.wq, l * dim * dim, dim, dim)
      matvec(k, xb, w.wk, l * kvDim * dim, dim, kvDim)
      matvec(v, xb, w.wv, l * kvDim * dim, dim, kvDim)
      for (let i = 0; i < dim; i += 2) {
        const p = (i % headDim) >> 1
        const fc = this.#cos[p]!
        const fs = this.#sin[p]!
        const q0 = q[i]!
        const q1 = q[i + 1]!
        q[i] = q0 * fc - q1 * fs
        q[i + 1] = q0 * fs + q1 * fc
        if (i < kvDim) {
          const k0 = k[i]!
          const k1 = k[i + 1]!
          k[i] = k0 * fc - k1 * fs
          k[i + 1] = k0 * fs + k1 * fc
        }
      }
      const kc = cache.keys(l)
      const vc = cache.values(l)
      const row = pos * kvDim
      for (let i = 0; i < kvDim; i++) {
        kc[row + i] = exact ? k[i]! : round(k[i]!)
        vc[row + i] = exact ? v[i]! : round(v[i]!)
      }
      if (queriesOut) queriesOut[l]!.set(q, qOff)
      attend(xb, q, kc, vc, att, pos + 1, heads, kvMul, headDim, kvDim, scale)
      matvec(this.#xb2, xb, w.wo, l * dim * dim, dim, dim)
      for (let i = 0; i < dim; i++) x[i]! += this.#xb2[i]!
      rmsnorm(xb, x, w.rmsFfn, l * dim, dim)
      const hb = this.#hb
      const hb2 = this.#hb2
      matvec(hb, xb, w.w1, l * hiddenDim * dim, dim, hiddenDim)
      matvec(hb2, xb, w.w3, l * hiddenDim * dim, dim, hiddenDim)
      for (let i = 0; i < hiddenDim; i++) {
        const a = hb[i]!
        hb[i] = (a / (1 + Math.exp(-a))) * hb2[i]!
      }
      matvec(xb, hb, w.w2, l * dim * hiddenDim, hiddenDim, dim)
      for (let i = 0; i < dim; i++) x[i]! += xb[i]!
    }
    cache.length = pos + 1
    if (logits) {
      rmsnorm(xb, x, w.rmsFinal, 0, dim)
      matvec(logits, xb, w.wcls, 0, dim, c.vocabSize)
    }
  }

  /**
   * Feeds `tokens` at positions cache.length.. (a new cache by default) and returns the
   * cache and the logits after the last token.
   */
  prefill(tokens: ArrayLike<number>, opts: PrefillOptions = {}): PrefillResult {
    const c = this.config
    if (tokens.length === 0) throw new ModelError('prefill: no tokens')
    const cache = opts.cache ?? this.newCache(opts.cacheOptions)
    this.#checkCache(cache)
    for (let i = 0; i < tokens.length; i++) this.#checkToken(tokens[i])
    if (cache.length + tokens.length > MAX_POSITIONS) {
      throw new ModelError(`prefill: ${cache.length + tokens.length} positions exceed ${MAX_POSITIONS}`)
    }
    cache.reserve(cache.length + tokens.length)
    const n = tokens.length
    const queries = opts.queries
      ? Array.from({ length: c.layers }, () => new Float32Array(n * c.dim))
      : undefined
    const allLogits = opts.allLogits ? new Float32Array(n * c.vocabSize) : undefined
    const logits = new Float32Array(c.vocabSize)
    for (let i = 0; i < n; i++) {
      const last = i === n - 1
      const out = allLogits
        ? allLogits.subarray(i * c.vocabSize, (i + 1) * c.vocabSize)
        : last
          ? logits
          : null
      this.#forward(tokens[i]!, cache, out, queries, i * c.dim)
    }
    if (allLogits) logits.set(allLogits.subarray((n - 1) * c.vocabSize))
    const res: PrefillResult = { cache, logits }
    if (queries) res.queries = queries
    if (allLogits) res.allLogits = allLogits
    return res
  }

  /**
   * Feeds one token at position cache.length and returns the next-token logits. Without
   * `out` the result is an internal buffer that the next call overwrites.
   */
  step(token: number, cache: KvCacheState, out?: Float32Array): Float32Array {
    this.#checkCache(cache)
    this.#checkToken(token)
    const logits = out ?? this.#logits
    if (logits.length !== this.config.vocabSize)
      throw new ModelError(`step: out must hold ${this.config.vocabSize} logits`)
    if (cache.length + 1 > MAX_POSITIONS)
      throw new ModelError(`step: cache is full (${MAX_POSITIONS} positions)`)
    this.#forward(token, cache, logits)
    return logits
  }

  /** Greedy decoding of up to `n` tokens after `prompt` (which should start with BOS). */
  generate(prompt: ArrayLike<number>, n: number, opts: GenerateOptions = {}): GenerateResult {
    if (prompt.length === 0) throw new ModelError('generate: empty prompt (start it with BOS = 1)')
    if (!Number.isInteger(n) || n < 0) throw new ModelError(`generate: invalid token count ${n}`)
    const { stopAtBos = true, onToken } = opts
    const cache = opts.cache ?? this.newCache(opts.cacheOptions)
    this.#checkCache(cache)
    // The cache is trusted to hold prompt[0..length); the last prompt token is always run.
    if (cache.length >= prompt.length) cache.truncate(prompt.length - 1)
    const rest = Array.prototype.slice.call(prompt, cache.length) as number[]
    let logits = this.prefill(rest, { cache }).logits
    const out: number[] = []
    for (let i = 0; i < n; i++) {
      const t = argmax(logits)
      if (stopAtBos && t === BOS_ID) break
      out.push(t)
      onToken?.(t)
      if (i + 1 < n) logits = this.step(t, cache)
    }
    return { tokens: out, cache }
  }
}

/**
 * Causal attention of one position: out[h] = Σ_t softmax_t(q_h·k_t/√d) v_t over
 * positions 0..n-1, with query head h reading kv head ⌊h / kvMul⌋.
 */
export function attend(
  out: Float32Array,
  q: Float32Array,
  kc: Float32Array,
  vc: Float32Array,
  att: Float64Array,
  n: number,
  heads: number,
  kvMul: number,
  headDim: number,
  kvDim: number,
  scale: number,
): void {
  for (let h = 0; h < heads; h++) {
    const qo = h * headDim
    const ko = ((h / kvMul) | 0) * headDim
    // Head dim 8 (the real model) is unrolled: with 8-wide rows, loop overhead dominates.
    const max =
      headDim === 8
        ? scores8(q, qo, kc, ko, att, n, kvDim, scale)
        : scores(q, qo, kc, ko, att, n, headDim, kvDim, scale)
    let sum = 0
    for (let t = 0; t < n; t++) {
      const e = Math.exp(att[t]! - max)
      att[t] = e
      sum += e
    }
    const inv = 1 / sum
    if (headDim === 8) {
      let o0 = 0,
        o1 = 0,
        o2 = 0,
        o3 = 0,
        o4 = 0,
        o5 = 0,
        o6 = 0,
        o7 = 0
      for (let t = 0, b = ko; t < n; t++, b += kvDim) {
        const a = att[t]!
        o0 += a * vc[b]!
        o1 += a * vc[b + 1]!
        o2 += a * vc[b + 2]!
        o3 += a * vc[b + 3]!
        o4 += a * vc[b + 4]!
        o5 += a * vc[b + 5]!
        o6 += a * vc[b + 6]!
        o7 += a * vc[b + 7]!
      }
      out[qo] = o0 * inv
      out[qo + 1] = o1 * inv
      out[qo + 2] = o2 * inv
      out[qo + 3] = o3 * inv
      out[qo + 4] = o4 * inv
      out[qo + 5] = o5 * inv
      out[qo + 6] = o6 * inv
      out[qo + 7] = o7 * inv
    } else {
      for (let i = 0; i < headDim; i++) out[qo + i] = 0
      for (let t = 0; t < n; t++) {
        const a = att[t]! * inv
        const b = t * kvDim + ko
        for (let i = 0; i < headDim; i++) out[qo + i]! += a * vc[b + i]!
      }
    }
  }
}

/** Fills att[0..n) with scaled scores of one head; returns their max. */
function scores(
  q: Float32Array,
  qo: number,
  kc: Float32Array,
  ko: number,
  att: Float64Array,
  n: number,
  headDim: number,
  kvDim: number,
  scale: number,
): number {
  let max = Number.NEGATIVE_INFINITY
  for (let t = 0; t < n; t++) {
    const b = t * kvDim + ko
    let s = 0
    for (let i = 0; i < headDim; i++) s += q[qo + i]! * kc[b + i]!
    s *= scale
    att[t] = s
    if (s > max) max = s
  }
  return max
}

function scores8(
  q: Float32Array,
  qo: number,
  kc: Float32Array,
  ko: number,
  att: Float64Array,
  n: number,
  kvDim: number,
  scale: number,
): number {
  const q0 = q[qo]! * scale
  const q1 = q[qo + 1]! * scale
  const q2 = q[qo + 2]! * scale
  const q3 = q[qo + 3]! * scale
  const q4 = q[qo + 4]! * scale
  const q5 = q[qo + 5]! * scale
  const q6 = q[qo + 6]! * scale
  const q7 = q[qo + 7]! * scale
  let max = Number.NEGATIVE_INFINITY
  for (let t = 0, b = ko; t < n; t++, b += kvDim) {
    const s =
      q0 * kc[b]! +
      q1 * kc[b + 1]! +
      q2 * kc[b + 2]! +
      q3 * kc[b + 3]! +
      q4 * kc[b + 4]! +
      q5 * kc[b + 5]! +
      q6 * kc[b + 6]! +
      q7 * kc[b + 7]!
    att[t] = s
    if (s > max) max = s
  }
  return max
}
