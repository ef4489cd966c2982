// vLLM's paged KV layouts as the agent sees them: where block b's K (or V, or MLA latent)
// lies in a layer tensor, and where it lies in kvgate's chunk tensor.
//
// Two families of shapes, both any strides (a view into a larger allocation):
// - vLLM up to 0.25 (MLA: 0.28): FlashAttention [2, num_blocks, block_size, kv_heads, head_size],
//   FlashInfer [num_blocks, 2, block_size, kv_heads, head_size], MLA [num_blocks, block_size, latent].
// - vLLM from 0.26 (PR #44455) and 0.29 (#51718, `create_kv_cache_views`): every layer is a 4-D
//   view [B, H, N, C] of one int8 allocation, in any of six physical orders of [L, B, H, N, C]
//   (LBNHC by default): C = 2 * head_size, K in its first half and V in its second (MLA: H = 1,
//   C = latent). With kernel blocks smaller than vLLM's block (`--block-size` above the
//   attention kernel's), B = num_blocks * r and N = block_size / r, kernel block k of block b
//   being b * r + k.
// In all of them the innermost run, one token's one head (head_size elements), is contiguous:
// that is the unit the agent copies, merged where neighbouring runs are contiguous on both
// sides (the old layouts then copy one run per block side, as before).

import { type Dtype, dtypeBytes, type KvGeometry } from '../core/layout.ts'
import { compressRuns, PLANE_FIELDS, planesOf, ROW_FIELDS, rememberRows, withOrders } from './copy-rows.ts'
import { shown } from './fields.ts'
import { AgentError } from './protocol.ts'

export type EngineLayout = 'flash-attn' | 'flashinfer' | 'mla'
export const ENGINE_LAYOUTS: readonly EngineLayout[] = ['flash-attn', 'flashinfer', 'mla']

/** What an engine worker's KV looks like (per TP rank). */
export interface EngineGeometry {
  layout: EngineLayout
  layers: number
  /** KV heads on this rank (1 for MLA). */
  kvHeads: number
  /** Head size, or the latent dim for MLA. */
  headSize: number
  blockSize: number
  dtype: Dtype
}

/** Bytes of one block's K (or V, or latent) in one layer. */
export function blockBytes(g: EngineGeometry): number {
  return g.blockSize * g.kvHeads * g.headSize * dtypeBytes(g.dtype)
}

/** K and V (2) or the latent alone (1). */
export function sides(g: EngineGeometry): 1 | 2 {
  return g.layout === 'mla' ? 1 : 2
}

/** The per-layer shape vLLM up to 0.25 registers (MLA: 0.28) with `numBlocks` blocks. */
export function layerShape(g: EngineGeometry, numBlocks: number): number[] {
  switch (g.layout) {
    case 'flash-attn':
      return [2, numBlocks, g.blockSize, g.kvHeads, g.headSize]
    case 'flashinfer':
      return [numBlocks, 2, g.blockSize, g.kvHeads, g.headSize]
    case 'mla':
      return [numBlocks, g.blockSize, g.headSize]
  }
}

export function contiguousStrides(shape: readonly number[]): number[] {
  const out = new Array<number>(shape.length)
  let s = 1
  for (let i = shape.length - 1; i >= 0; i--) {
    out[i] = s
    s *= shape[i]!
  }
  return out
}

/**
 * The kvgate geometry a chunk of this engine is stored with. Chunk tensors are
 * [layer][K|V][token][kvHead][headDim]; an MLA engine's are latent chunks,
 * [layer][token][latent] (kvHeads 1, headDim = the latent dim, docs/format.md flags bit 1),
 * so the codecs see the latent's own channels.
 */
export function storageGeometry(g: EngineGeometry): KvGeometry {
  if (g.layout === 'mla')
    return { layers: g.layers, kvHeads: 1, headDim: g.headSize, dtype: g.dtype, latent: true }
  return { layers: g.layers, kvHeads: g.kvHeads, headDim: g.headSize, dtype: g.dtype }
}

/** The 4-D per-layer shape vLLM from 0.26 registers: [B, H, N, C] (kernel blocks of N tokens). */
export function viewShape(g: EngineGeometry, numBlocks: number, kernelTokens = g.blockSize): number[] {
  const r = g.blockSize / kernelTokens
  return [numBlocks * r, g.kvHeads, kernelTokens, sides(g) * g.headSize]
}

/**
 * Where one layer's KV lies in its registered tensor, in bytes from the tensor's offset:
 * (side, block, token, head) starts at side·side + block·block + ⌊token/kernelTokens⌋·kernel
 * + (token mod kernelTokens)·token + head·head and runs `run` bytes. The same for every layer
 * of a registration (vLLM's views of one allocation share their strides).
 */
export interface LayerView {
  /** One token's one head: head_size (latent) elements, contiguous in every layout. */
  readonly run: number
  readonly side: number
  readonly block: number
  /** Tokens per kernel block: blockSize unless vLLM split its blocks for the attention kernel. */
  readonly kernelTokens: number
  readonly kernel: number
  readonly token: number
  readonly head: number
  /** Bytes from the tensor's offset past its last element: what is mapped and bounds-checked. */
  readonly span: number
  /** A block side's tokens and heads are one run in chunk order ([token][head][dim]). */
  readonly dense: boolean
}

/** A registered dimension: its extent and its stride in bytes. */
type Dim = readonly [extent: number, stride: number]

const MAX_DIM = 1 << 30

/**
 * The view of a layer tensor registered with `shape` and `strides` (elements; absent =
 * contiguous), or ERR_LAYOUT saying what was expected. Refuses strides whose elements
 * overlap (a save would read one engine byte into two chunk places, a load write two into
 * one) and tensors whose innermost dimension is not contiguous.
 */
export function layerView(
  g: EngineGeometry,
  numBlocks: number,
  shape: unknown,
  strides: unknown,
  what: string,
): LayerView {
  const legacy = layerShape(g, numBlocks)
  const dims = Array.isArray(shape) ? shape : []
  const e = dtypeBytes(g.dtype)
  const n = sides(g)
  let kernelTokens = g.blockSize
  if (!(Array.isArray(shape) && sameInts(shape, legacy))) {
    // vLLM's [B, H, N, C] views: N may be a kernel block (a divisor of the block size).
    const kt = dims[2]
    const ok =
      dims.length === 4 &&
      Number.isSafeInteger(kt) &&
      (kt as number) > 0 &&
      g.blockSize % (kt as number) === 0 &&
      sameInts(dims, viewShape(g, numBlocks, kt as number))
    if (!ok)
      throw new AgentError(
        'ERR_LAYOUT',
        `${what} has shape ${shown(shape)}; ${numBlocks} blocks of the ${g.layout} layout are ` +
          `${JSON.stringify(legacy)} (vLLM up to 0.25) or ${JSON.stringify(viewShape(g, numBlocks))} ` +
          '([blocks, kv_heads, block_size, K|V], vLLM from 0.26; block_size may be a kernel block size that divides it)',
      )
    kernelTokens = kt as number
  }
  const rank = dims.length
  const st =
    strides === undefined || strides === null ? contiguousStrides(dims as number[]) : (strides as unknown[])
  if (
    !Array.isArray(st) ||
    st.length !== rank ||
    !st.every((x) => Number.isSafeInteger(x) && (x as number) >= 0)
  )
    throw new AgentError(
      'ERR_LAYOUT',
      `${what}.strides must be ${rank} integers >= 0 (elements), got ${shown(strides)}`,
    )
  const s = (st as number[]).map((x) => x * e)
  if (s[rank - 1] !== e && dims[rank - 1] !== 1)
    throw new AgentError(
      'ERR_LAYOUT',
      `${what}: its last dimension has stride ${st[rank - 1]}; kvgate copies it as one contiguous run (stride 1)`,
    )
  const run = g.headSize * e
  const r = g.blockSize / kernelTokens
  let v: Omit<LayerView, 'span' | 'dense'>
  let all: Dim[]
  if (rank === 4) {
    // [B·r, H, N, C], C = K|V halves
    v = { run, side: run, block: s[0]! * r, kernelTokens, kernel: s[0]!, token: s[2]!, head: s[1]! }
    all = [
      [numBlocks * r, s[0]!],
      [g.kvHeads, s[1]!],
      [kernelTokens, s[2]!],
      [n, run],
    ]
  } else if (g.layout === 'mla') {
    v = { run, side: 0, block: s[0]!, kernelTokens, kernel: 0, token: s[1]!, head: 0 }
    all = [
      [numBlocks, s[0]!],
      [g.blockSize, s[1]!],
    ]
  } else {
    const [side, block] = g.layout === 'flash-attn' ? [s[0]!, s[1]!] : [s[1]!, s[0]!]
    v = { run, side, block, kernelTokens, kernel: 0, token: s[2]!, head: s[3]! }
    all = [
      [2, side],
      [numBlocks, block],
      [g.blockSize, s[2]!],
      [g.kvHeads, s[3]!],
    ]
  }
  const span = disjointSpan(all, run, what)
  const H = g.kvHeads
  const dense =
    (H === 1 || v.head === run) &&
    (g.blockSize === 1 || v.token === H * run) &&
    (r === 1 || v.kernel === kernelTokens * H * run)
  return { ...v, span, dense }
}

/**
 * Bytes from the first element past the last, when no two elements of the dims (with runs of
 * `run` contiguous bytes innermost) overlap; else ERR_LAYOUT. The sufficient condition, dims
 * sorted by stride: each steps past everything the smaller ones reach.
 */
function disjointSpan(dims: readonly Dim[], run: number, what: string): number {
  let reach = run
  for (const [extent, stride] of [...dims].filter(([x]) => x > 1).sort((a, b) => a[1] - b[1])) {
    if (extent > MAX_DIM || stride < reach)
      throw new AgentError(
        'ERR_LAYOUT',
        `${what}: its strides make elements overlap (a dimension of ${extent} with stride ${stride} bytes, ` +
          `inside ${reach} bytes its smaller dimensions cover)`,
      )
    reach += (extent - 1) * stride
    if (!Number.isSafeInteger(reach))
      throw new AgentError('ERR_LAYOUT', `${what} spans more bytes than can be addressed`)
  }
  return reach
}

function sameInts(a: readonly unknown[], b: readonly number[]): boolean {
  return a.length === b.length && a.every((x, i) => x === b[i])
}

/**
 * The copy runs ([tensorOffset, slabOffset, bytes] triples) between the engine blocks
 * `ids[first .. first + blocksPerChunk)` of one layer tensor and that chunk's slab of one
 * layer ([K|V][token][head][dim]), in slab order, contiguous neighbours merged. The same in
 * every layer: a layer's slab and tensor are passed with them. Blocks before `skip`
 * (engine-wide index) are left out. Frozen: the host copies turn them into 2-D row sets once
 * and reuse those for every layer (copy-rows.ts rowsOf).
 */
export function chunkRuns(
  g: EngineGeometry,
  v: LayerView,
  ids: readonly number[],
  first: number,
  blocksPerChunk: number,
  skip: number,
): ArrayLike<number> {
  const bb = g.blockSize * g.kvHeads * v.run
  const S = sides(g)
  if (v.dense) {
    // Side outer, so a side's consecutive blocks merge into one run.
    const runs: number[] = []
    for (let side = 0; side < S; side++) {
      for (let j = 0; j < blocksPerChunk; j++) {
        if (first + j < skip) continue
        const t = side * v.side + ids[first + j]! * v.block
        const h = (side * blocksPerChunk + j) * bb
        const n = runs.length
        if (n > 0 && runs[n - 3]! + runs[n - 1]! === t && runs[n - 2]! + runs[n - 1]! === h)
          runs[n - 1]! += bb
        else runs.push(t, h, bb)
      }
    }
    return Object.freeze(runs)
  }
  // Block outer, so one block's K and V halves (one page) are copied back to back: each block
  // side is the view's template shifted (a 32k-token load's 128 chunks of 4,096 runs each took
  // ~1 ms per chunk on the agent's event loop built run by run).
  const tpl = blockTemplate(g, v)
  let count = 0
  for (let j = 0; j < blocksPerChunk; j++) if (first + j >= skip) count++
  const { runs: tr, sets: ts, planes: tq, tensorEnd: te, slabEnd: se } = tpl
  const runs = new Float64Array(count * S * tr.length)
  // The row sets (copy-rows.ts) built alongside, shifted the same way: compressing each chunk's
  // runs again would cost as much as building them. Their 3-D form (the host copies') likewise.
  const sets = new Float64Array(count * S * ts.length)
  const planes = new Float64Array(count * S * tq.length)
  let o = 0
  let q = 0
  let p = 0
  let tensorEnd = 0
  for (let j = 0; j < blocksPerChunk; j++) {
    if (first + j < skip) continue
    const block = ids[first + j]! * v.block
    for (let side = 0; side < S; side++) {
      const t = side * v.side + block
      const h = (side * blocksPerChunk + j) * bb
      for (let i = 0; i < tr.length; i += 3) {
        runs[o++] = t + tr[i]!
        runs[o++] = h + tr[i + 1]!
        runs[o++] = tr[i + 2]!
      }
      for (let i = 0; i < ts.length; i += ROW_FIELDS, q += ROW_FIELDS) {
        sets[q] = t + ts[i]!
        sets[q + 1] = h + ts[i + 1]!
        sets[q + 2] = ts[i + 2]!
        sets[q + 3] = ts[i + 3]!
        sets[q + 4] = ts[i + 4]!
        sets[q + 5] = ts[i + 5]!
      }
      for (let i = 0; i < tq.length; i += PLANE_FIELDS, p += PLANE_FIELDS) {
        planes.set(tq.subarray(i, i + PLANE_FIELDS), p)
        planes[p] = t + tq[i]!
        planes[p + 1] = h + tq[i + 1]!
      }
      tensorEnd = Math.max(tensorEnd, t + te)
    }
  }
  // The slab's furthest byte: the last block side's (sides are laid out side-major in the slab).
  let slabEnd = 0
  for (let j = blocksPerChunk - 1; j >= 0 && slabEnd === 0; j--)
    if (first + j >= skip) slabEnd = ((S - 1) * blocksPerChunk + j) * bb + se
  rememberRows(runs, withOrders(sets, true, tensorEnd, slabEnd, planes))
  return runs
}

interface BlockTemplate {
  /** One block side's runs, relative to its start in the tensor and in the slab. */
  runs: Float64Array
  /** The same as row sets (copy-rows.ts), relative likewise. */
  sets: Float64Array
  /** The same as 3-D sets (copy-rows.ts planesOf), relative likewise. */
  planes: Float64Array
  tensorEnd: number
  slabEnd: number
}

const templates = new WeakMap<LayerView, BlockTemplate>()

/**
 * One block side's runs relative to its start in the tensor and in the slab ([token][head][dim]),
 * contiguous neighbours merged: the same for every block and side of a view.
 */
function blockTemplate(g: EngineGeometry, v: LayerView): BlockTemplate {
  let tpl = templates.get(v)
  if (tpl !== undefined) return tpl
  const out: number[] = []
  let dst = 0
  for (let t = 0; t < g.blockSize; t++) {
    const k = Math.floor(t / v.kernelTokens)
    const at = k * v.kernel + (t - k * v.kernelTokens) * v.token
    for (let h = 0; h < g.kvHeads; h++, dst += v.run) {
      const src = at + h * v.head
      const n = out.length
      if (n > 0 && out[n - 3]! + out[n - 1]! === src && out[n - 2]! + out[n - 1]! === dst)
        out[n - 1]! += v.run
      else out.push(src, dst, v.run)
    }
  }
  const c = compressRuns(out)
  tpl = {
    runs: Float64Array.from(out),
    sets: c.rows,
    planes: planesOf(c.rows),
    tensorEnd: c.tensorEnd,
    slabEnd: c.slabEnd,
  }
  templates.set(v, tpl)
  return tpl
}
