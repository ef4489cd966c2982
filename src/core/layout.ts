// KV geometry: how many layers / heads / dims a model's KV has, its dtype, and
// the byte layout of one chunk in host memory. Every tier and the codec agree on it.
//
// Host layout of a chunk (the "chunk tensor"): [layer][K|V][token][kvHead][headDim],
// contiguous, little-endian elements of `dtype`. One layer's K then V is a "layer
// slab"; the chunk object stores one section per layer, so a reader can fetch
// layers a..b with one range request. A latent (MLA) geometry has one plane per layer
// instead of K and V: [layer][token][latent] (kvHeads 1, headDim = the latent dim).

import { InvalidArgumentError } from './errors.ts'

/** fp8e4m3 / fp8e5m2: float8_e4m3fn / float8_e5m2 KV (vLLM's fp8 caches), stored as raw bytes. */
export type Dtype = 'fp16' | 'bf16' | 'fp32' | 'fp8e4m3' | 'fp8e5m2'

/** Wire codes for dtypes (chunk header byte). Never renumber. */
export const DTYPE_CODES: Readonly<Record<Dtype, number>> = {
  fp16: 1,
  bf16: 2,
  fp32: 3,
  fp8e4m3: 4,
  fp8e5m2: 5,
}

export function dtypeFromCode(code: number): Dtype | undefined {
  for (const [name, c] of Object.entries(DTYPE_CODES)) if (c === code) return name as Dtype
  return undefined
}

export function dtypeBytes(dtype: Dtype): number {
  return dtype === 'fp32' ? 4 : isFp8(dtype) ? 1 : 2
}

/**
 * fp8 KV is already quantised: it is stored byte for byte (raw or lossless codec), never
 * converted to floats and quantised again by a lossy codec.
 */
export function isFp8(dtype: Dtype): boolean {
  return dtype === 'fp8e4m3' || dtype === 'fp8e5m2'
}

export interface KvGeometry {
  /** Transformer layers that hold KV. */
  readonly layers: number
  /** KV heads per layer (GQA: fewer than query heads). */
  readonly kvHeads: number
  /** Dimension of one head (the latent dim when `latent`). */
  readonly headDim: number
  readonly dtype: Dtype
  /**
   * MLA: each layer holds one latent tensor [token][latent] (it becomes K and V only after
   * the model's up-projections), not K and V. kvHeads must be 1. @default false
   */
  readonly latent?: boolean
}

export interface ModelPreset extends KvGeometry {
  /** Identifier that enters the key namespace seed. */
  readonly modelId: string
}

/** Geometries of models people run. The key seed covers all of these fields. */
export const MODEL_PRESETS = {
  'llama-3.1-8b': { modelId: 'meta-llama/Llama-3.1-8B', layers: 32, kvHeads: 8, headDim: 128, dtype: 'bf16' },
  'llama-3.1-70b': {
    modelId: 'meta-llama/Llama-3.1-70B',
    layers: 80,
    kvHeads: 8,
    headDim: 128,
    dtype: 'bf16',
  },
  'mistral-7b': { modelId: 'mistralai/Mistral-7B-v0.3', layers: 32, kvHeads: 8, headDim: 128, dtype: 'bf16' },
  'qwen2.5-7b': { modelId: 'Qwen/Qwen2.5-7B', layers: 28, kvHeads: 4, headDim: 128, dtype: 'bf16' },
  /** The llama2.c TinyStories model in ../shared/data (dim 64, 5 layers, 4 KV heads of 8). */
  stories260k: {
    modelId: 'karpathy/tinyllamas/stories260K',
    layers: 5,
    kvHeads: 4,
    headDim: 8,
    dtype: 'fp16',
  },
} as const satisfies Record<string, ModelPreset>

export type PresetName = keyof typeof MODEL_PRESETS

export const MAX_LAYERS = 1024
export const MAX_KV_HEADS = 1024
export const MAX_HEAD_DIM = 4096
export const MAX_CHUNK_TOKENS = 1 << 20

function checkDim(name: string, v: unknown, max: number): void {
  if (typeof v !== 'number' || !Number.isInteger(v) || v < 1 || v > max) {
    throw new InvalidArgumentError(`invalid ${name}: expected an integer in 1..${max}, got ${String(v)}`)
  }
}

/** Throws InvalidArgumentError unless `g` is a usable geometry. */
export function validateGeometry(g: KvGeometry): KvGeometry {
  if (typeof g !== 'object' || g === null)
    throw new InvalidArgumentError('invalid geometry: expected an object')
  checkDim('layers', g.layers, MAX_LAYERS)
  checkDim('kvHeads', g.kvHeads, MAX_KV_HEADS)
  checkDim('headDim', g.headDim, MAX_HEAD_DIM)
  // Own keys only: `in` also finds toString and constructor on every object.
  if (!Object.hasOwn(DTYPE_CODES, g.dtype))
    throw new InvalidArgumentError(`invalid dtype: ${String(g.dtype)} (fp16, bf16, fp32, fp8e4m3 or fp8e5m2)`)
  if (g.latent !== undefined && typeof g.latent !== 'boolean')
    throw new InvalidArgumentError(`invalid latent: expected a boolean, got ${String(g.latent)}`)
  if (g.latent === true && g.kvHeads !== 1)
    throw new InvalidArgumentError(
      `a latent (MLA) geometry has kvHeads 1 (headDim = the latent dim), not ${g.kvHeads}`,
    )
  return g
}

/** Planes per layer: K and V (2), or a latent geometry's one latent tensor (1). */
export function kvPlanes(g: KvGeometry): 1 | 2 {
  return g.latent === true ? 1 : 2
}

/** True when two geometries describe the same chunk bytes (a missing latent is false). */
export function sameGeometry(a: KvGeometry, b: KvGeometry): boolean {
  return (
    a.layers === b.layers &&
    a.kvHeads === b.kvHeads &&
    a.headDim === b.headDim &&
    a.dtype === b.dtype &&
    (a.latent === true) === (b.latent === true)
  )
}

/** Elements of K (or V, or the latent) for one token in one layer. */
export function rowElements(g: KvGeometry): number {
  return g.kvHeads * g.headDim
}

/** Bytes of K+V (or the latent) for one token across all layers. Llama-3.1-8B bf16: 128 KiB. */
export function bytesPerToken(g: KvGeometry): number {
  return kvPlanes(g) * g.layers * rowElements(g) * dtypeBytes(g.dtype)
}

/** Bytes of one layer's K+V (or latent) for `tokens` tokens (one layer slab). */
export function layerSlabBytes(g: KvGeometry, tokens: number): number {
  return kvPlanes(g) * tokens * rowElements(g) * dtypeBytes(g.dtype)
}

/** Bytes of a whole chunk tensor. Llama-3.1-8B, 256 tokens, bf16: 32 MiB. */
export function chunkBytes(g: KvGeometry, tokens: number): number {
  return g.layers * layerSlabBytes(g, tokens)
}

export interface ByteRange {
  /** Inclusive start. */
  readonly start: number
  /** Exclusive end. */
  readonly end: number
}

/** Where layer `layer`'s slab lies in a chunk tensor of `tokens` tokens. */
export function layerRange(g: KvGeometry, tokens: number, layer: number): ByteRange {
  if (!Number.isInteger(layer) || layer < 0 || layer >= g.layers) {
    throw new InvalidArgumentError(`layer ${layer} out of range 0..${g.layers - 1}`)
  }
  const size = layerSlabBytes(g, tokens)
  return { start: layer * size, end: (layer + 1) * size }
}

/** A view of one layer's K (kind 0) or V (kind 1), or a latent geometry's latent (kind 0), inside a chunk tensor. */
export function kvRange(g: KvGeometry, tokens: number, layer: number, kind: 0 | 1): ByteRange {
  if (kind >= kvPlanes(g)) throw new InvalidArgumentError('a latent (MLA) geometry has no V plane')
  const { start } = layerRange(g, tokens, layer)
  const half = tokens * rowElements(g) * dtypeBytes(g.dtype)
  return { start: start + kind * half, end: start + (kind + 1) * half }
}

/**
 * Copies tokens [from, to) of every layer out of a chunk tensor into a new chunk
 * tensor of `to - from` tokens (used for partial hits and token-range retrieves).
 */
export function sliceTokens(
  g: KvGeometry,
  chunk: Uint8Array,
  tokens: number,
  from: number,
  to: number,
): Uint8Array {
  if (chunk.byteLength !== chunkBytes(g, tokens)) {
    throw new InvalidArgumentError(
      `chunk tensor is ${chunk.byteLength} bytes, geometry says ${chunkBytes(g, tokens)}`,
    )
  }
  if (!Number.isInteger(from) || !Number.isInteger(to) || from < 0 || to > tokens || from >= to) {
    throw new InvalidArgumentError(`invalid token range [${from}, ${to}) for ${tokens} tokens`)
  }
  const row = rowElements(g) * dtypeBytes(g.dtype)
  const n = to - from
  const out = new Uint8Array(chunkBytes(g, n))
  let o = 0
  for (let layer = 0; layer < g.layers; layer++) {
    for (let kind = 0; kind < kvPlanes(g); kind++) {
      const { start } = kvRange(g, tokens, layer, kind as 0 | 1)
      out.set(chunk.subarray(start + from * row, start + to * row), o)
      o += n * row
    }
  }
  return out
}

/** Resolves a preset name, or validates a custom geometry. */
export function resolveGeometry(model: PresetName | ModelPreset): ModelPreset {
  if (typeof model === 'string') {
    const p = (MODEL_PRESETS as Record<string, ModelPreset>)[model]
    if (!p) {
      throw new InvalidArgumentError(
        `unknown model preset '${model}': use one of ${Object.keys(MODEL_PRESETS).join(', ')} or pass a geometry`,
      )
    }
    return p
  }
  validateGeometry(model)
  if (typeof model.modelId !== 'string' || model.modelId.length === 0 || model.modelId.length > 256) {
    throw new InvalidArgumentError('invalid modelId: a non-empty string of at most 256 characters')
  }
  return model
}
