// Parses a llama2.c "legacy v0" checkpoint (seven int32 header fields, then float32
// weights) into typed views. Runtime-neutral: it takes bytes, the caller reads the file.
//
// Layout (karpathy/llama2.c export.py, legacy_export): header dim, hidden_dim, n_layers,
// n_heads, n_kv_heads, vocab_size, seq_len (int32 LE; a negative vocab_size means the
// classifier is stored separately at the end). Then row-major [out, in] float32 matrices:
// emb[vocab,dim], rms_att[L,dim], wq[L,dim,dim], wk[L,kvDim,dim], wv[L,kvDim,dim],
// wo[L,dim,dim], rms_ffn[L,dim], w1[L,hidden,dim], w2[L,dim,hidden], w3[L,hidden,dim],
// rms_final[dim], freq_cis_real[seq,headDim/2], freq_cis_imag[seq,headDim/2] (unused),
// then wcls[vocab,dim] when not shared.

import { ModelError } from './model-error.ts'

export interface LlamaConfig {
  /** Residual stream width. */
  readonly dim: number
  /** FFN hidden width. */
  readonly hiddenDim: number
  readonly layers: number
  /** Query heads. */
  readonly heads: number
  /** Key/value heads (GQA: query head h reads kv head h / (heads / kvHeads)). */
  readonly kvHeads: number
  readonly vocabSize: number
  /** Context the model was trained on. */
  readonly seqLen: number
  /** dim / heads. */
  readonly headDim: number
  /** kvHeads * headDim: width of one token's K (or V) in one layer. */
  readonly kvDim: number
  /** True when the classifier is the token embedding (positive vocab_size in the header). */
  readonly sharedClassifier: boolean
}

/** Float32 views into one buffer; per-layer tensors are stacked along the first axis. */
export interface LlamaWeights {
  readonly tokenEmbedding: Float32Array
  readonly rmsAtt: Float32Array
  readonly wq: Float32Array
  readonly wk: Float32Array
  readonly wv: Float32Array
  readonly wo: Float32Array
  readonly rmsFfn: Float32Array
  readonly w1: Float32Array
  readonly w2: Float32Array
  readonly w3: Float32Array
  readonly rmsFinal: Float32Array
  /** The classifier [vocab, dim]; the same array as tokenEmbedding when shared. */
  readonly wcls: Float32Array
}

export interface LlamaCheckpoint {
  readonly config: LlamaConfig
  readonly weights: LlamaWeights
}

export interface ParseCheckpointOptions {
  /**
   * Largest checkpoint accepted, in bytes. The size a header implies is checked
   * against this and against the buffer before anything is allocated.
   * @default 2 GiB
   */
  maxBytes?: number
  /**
   * Scan every weight for NaN/Inf (a cheap check against a corrupted file).
   * @default true
   */
  checkFinite?: boolean
}

export const LLAMA2C_HEADER_BYTES = 28

// Generous bounds: anything past them is a corrupt header, not a model.
const MAX_DIM = 1 << 16
const MAX_HIDDEN = 1 << 18
const MAX_LAYERS = 1024
const MAX_HEADS = 1024
const MAX_VOCAB = 1 << 20
const MAX_SEQ = 1 << 20

function field(name: string, v: number, max: number): void {
  if (!Number.isInteger(v) || v < 1 || v > max) {
    throw new ModelError(
      `llama2.c checkpoint: header field ${name}=${v} is outside 1..${max} (not a llama2.c v0 file?)`,
    )
  }
}

/** Validates the 28-byte header and derives the config (no weights read). */
export function parseLlama2cHeader(bytes: Uint8Array): LlamaConfig {
  if (!(bytes instanceof Uint8Array)) throw new ModelError('llama2.c checkpoint: expected bytes (Uint8Array)')
  if (bytes.byteLength < LLAMA2C_HEADER_BYTES) {
    throw new ModelError(
      `llama2.c checkpoint truncated: ${bytes.byteLength} bytes, the header alone is ${LLAMA2C_HEADER_BYTES}`,
    )
  }
  const dv = new DataView(bytes.buffer, bytes.byteOffset, LLAMA2C_HEADER_BYTES)
  const h = Array.from({ length: 7 }, (_, i) => dv.getInt32(i * 4, true))
  const [dim, hiddenDim, layers, heads, kvHeads, rawVocab, seqLen] = h as [
    number,
    number,
    number,
    number,
    number,
    number,
    number,
  ]
  const vocabSize = Math.abs(rawVocab)
  field('dim', dim, MAX_DIM)
  field('hidden_dim', hiddenDim, MAX_HIDDEN)
  field('n_layers', layers, MAX_LAYERS)
  field('n_heads', heads, MAX_HEADS)
  field('n_kv_heads', kvHeads, MAX_HEADS)
  field('vocab_size', vocabSize, MAX_VOCAB)
  field('seq_len', seqLen, MAX_SEQ)
  if (dim % heads !== 0)
    throw new ModelError(`llama2.c checkpoint: dim ${dim} is not a multiple of n_heads ${heads}`)
  if (heads % kvHeads !== 0) {
    throw new ModelError(`llama2.c checkpoint: n_heads ${heads} is not a multiple of n_kv_heads ${kvHeads}`)
  }
  const headDim = dim / heads
  if (headDim % 2 !== 0)
    throw new ModelError(`llama2.c checkpoint: head dim ${headDim} is odd (RoPE needs pairs)`)
  return {
    dim,
    hiddenDim,
    layers,
    heads,
    kvHeads,
    vocabSize,
    seqLen,
    headDim,
    kvDim: kvHeads * headDim,
    sharedClassifier: rawVocab > 0,
  }
}

/** Float32 elements of each tensor, in file order (freqCis = both unused RoPE tables). */
function tensorSizes(c: LlamaConfig): [keyof LlamaWeights | 'freqCis', number][] {
  const { dim, hiddenDim: hd, layers: L, kvDim, vocabSize: V } = c
  const sizes: [keyof LlamaWeights | 'freqCis', number][] = [
    ['tokenEmbedding', V * dim],
    ['rmsAtt', L * dim],
    ['wq', L * dim * dim],
    ['wk', L * kvDim * dim],
    ['wv', L * kvDim * dim],
    ['wo', L * dim * dim],
    ['rmsFfn', L * dim],
    ['w1', L * hd * dim],
    ['w2', L * dim * hd],
    ['w3', L * hd * dim],
    ['rmsFinal', dim],
    ['freqCis', c.seqLen * c.headDim],
  ]
  if (!c.sharedClassifier) sizes.push(['wcls', V * dim])
  return sizes
}

/** Exact file size the header implies (numbers stay far below 2^53 under the field bounds). */
export function llama2cFileBytes(c: LlamaConfig): number {
  return LLAMA2C_HEADER_BYTES + 4 * tensorSizes(c).reduce((a, [, n]) => a + n, 0)
}

/**
 * Parses a whole checkpoint. Throws ModelError (ERR_MODEL) on a bad header, a size
 * mismatch (truncated or trailing bytes), an oversized model or non-finite weights.
 */
export function parseLlama2c(bytes: Uint8Array, opts: ParseCheckpointOptions = {}): LlamaCheckpoint {
  const { maxBytes = 2 ** 31, checkFinite = true } = opts
  const config = parseLlama2cHeader(bytes)
  const expected = llama2cFileBytes(config)
  if (expected > maxBytes) {
    throw new ModelError(
      `llama2.c checkpoint: header implies ${expected} bytes, above the limit of ${maxBytes}`,
    )
  }
  if (bytes.byteLength < expected) {
    throw new ModelError(
      `llama2.c checkpoint truncated: ${bytes.byteLength} bytes, the header implies ${expected}`,
    )
  }
  if (bytes.byteLength > expected) {
    throw new ModelError(
      `llama2.c checkpoint: ${bytes.byteLength - expected} unexpected trailing bytes (header implies ${expected}; not a legacy v0 file?)`,
    )
  }
  // One aligned copy of the float32 payload (the input may sit at any byte offset).
  // Little-endian hosts only, like llama2.c itself (every platform Node runs on is LE).
  const floats = new Float32Array((expected - LLAMA2C_HEADER_BYTES) / 4)
  new Uint8Array(floats.buffer).set(bytes.subarray(LLAMA2C_HEADER_BYTES, expected))
  if (checkFinite) {
    for (let i = 0; i < floats.length; i++) {
      const x = floats[i]!
      if (x - x !== 0)
        throw new ModelError(`llama2.c checkpoint: weight ${i} is not finite (${x}); file corrupt`)
    }
  }
  const views: Partial<Record<keyof LlamaWeights, Float32Array>> = {}
  let off = 0
  for (const [name, n] of tensorSizes(config)) {
    if (name !== 'freqCis') views[name] = floats.subarray(off, off + n)
    off += n
  }
  if (config.sharedClassifier) views.wcls = views.tokenEmbedding
  return { config, weights: views as LlamaWeights }
}
