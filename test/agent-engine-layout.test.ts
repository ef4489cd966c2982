// Where a block's KV lies in vLLM's per-layer tensors (src/agent/engine-layout.ts), checked
// against an independent model of vLLM's allocation: one buffer, the logical [L, B, H, N, C]
// axes laid out in each of vLLM's six physical orders (vllm/v1/kv_cache_layout.py), each
// layer a [B, H, N, C] view at its own offset, as `create_kv_cache_views` makes them; and the
// old 5-D and 3-D layouts, contiguous or as views. A chunk gathered through the runs must
// equal the chunk read element by element; scattered back, it must land in exactly those
// elements and nowhere else.

import { describe, expect, it } from 'vitest'
import { compressRuns, PLANE_FIELDS, rowsOf } from '../src/agent/copy-rows.ts'
import {
  chunkRuns,
  type EngineGeometry,
  layerShape,
  layerView,
  viewShape,
} from '../src/agent/engine-layout.ts'

const ORDERS = {
  LBHNC: [0, 1, 2, 3, 4],
  LBNHC: [0, 1, 3, 2, 4],
  LHBNC: [0, 2, 1, 3, 4],
  BLHNC: [1, 0, 2, 3, 4],
  BLNHC: [1, 0, 3, 2, 4],
  BHLNC: [1, 2, 0, 3, 4],
} as const

const G: EngineGeometry = {
  layout: 'flash-attn',
  layers: 3,
  kvHeads: 2,
  headSize: 3,
  blockSize: 4,
  dtype: 'fp16',
}
const MLA: EngineGeometry = { ...G, layout: 'mla', kvHeads: 1, headSize: 5 }
const E = 2 // float16
const NUM_BLOCKS = 5

/** A model of one registration: per-layer byte offsets, strides (elements) and an element's byte address. */
interface Model {
  buf: Uint8Array
  shape: number[]
  strides: number[]
  offsets: number[]
  /** Byte address of element `c` (in the K|V row) of (layer, block, token, head). */
  at(layer: number, block: number, token: number, head: number, c: number): number
}

/**
 * vLLM's allocation for `order`, element strides from the physical order (innermost last), with
 * `r` kernel blocks per block and `pad` spare elements after every page (a padded page) when
 * L and B are the outer axes.
 */
function vllmModel(g: EngineGeometry, order: readonly number[], r = 1, pad = 0): Model {
  const C = (g.layout === 'mla' ? 1 : 2) * g.headSize
  const H = g.kvHeads
  const N = g.blockSize / r
  const logical = [g.layers, NUM_BLOCKS * r, H, N, C]
  const strides = [0, 0, 0, 0, 0]
  let cur = 1
  for (let p = 4; p >= 0; p--) {
    const dim = order[p]!
    if (p === 1 && pad > 0) cur += pad // the page grid starts outside axis order[1]
    strides[dim] = cur
    cur *= logical[dim]!
  }
  const total = cur
  const buf = new Uint8Array(total * E + 64)
  const base = 32 // the views start inside the allocation
  return {
    buf,
    shape: logical.slice(1),
    strides: strides.slice(1),
    offsets: Array.from({ length: g.layers }, (_, l) => base + l * strides[0]! * E),
    at(l, b, t, h, c) {
      const kb = b * r + Math.floor(t / N)
      const el =
        l * strides[0]! + kb * strides[1]! + h * strides[2]! + (t % N) * strides[3]! + c * strides[4]!
      return base + el * E
    },
  }
}

/** The old layouts, each layer a contiguous tensor or (`spread`) a view with padding between rows. */
function legacyModel(g: EngineGeometry, spread = 0): Model {
  const shape = layerShape(g, NUM_BLOCKS)
  const strides = new Array<number>(shape.length)
  let cur = 1
  for (let i = shape.length - 1; i >= 0; i--) {
    strides[i] = cur
    cur *= shape[i]!
    if (i === shape.length - 1) cur += spread
  }
  const layerEls = cur
  const buf = new Uint8Array(layerEls * g.layers * E + 16)
  return {
    buf,
    shape,
    strides,
    offsets: Array.from({ length: g.layers }, (_, l) => 16 + l * layerEls * E),
    at(l, b, t, h, c) {
      const side = g.layout === 'mla' ? 0 : Math.floor(c / g.headSize)
      const d = c % g.headSize
      const idx =
        g.layout === 'flash-attn'
          ? [side, b, t, h, d]
          : g.layout === 'flashinfer'
            ? [b, side, t, h, d]
            : [b, t, d]
      return 16 + l * layerEls * E + idx.reduce((a, x, i) => a + x * strides[i]!, 0) * E
    },
  }
}

function fill(buf: Uint8Array, seed: number): void {
  let x = seed >>> 0 || 1
  for (let i = 0; i < buf.length; i++) {
    x ^= x << 13
    x ^= x >>> 17
    x ^= x << 5
    buf[i] = x & 0xff
  }
}

/** The chunk read element by element: [layer][K|V][token][head][dim], as kvgate stores it. */
function expectedChunk(g: EngineGeometry, m: Model, ids: number[]): Uint8Array {
  const S = g.layout === 'mla' ? 1 : 2
  const T = ids.length * g.blockSize
  const out = new Uint8Array(g.layers * S * T * g.kvHeads * g.headSize * E)
  let o = 0
  for (let l = 0; l < g.layers; l++)
    for (let s = 0; s < S; s++)
      for (let tok = 0; tok < T; tok++)
        for (let h = 0; h < g.kvHeads; h++)
          for (let d = 0; d < g.headSize; d++) {
            const a = m.at(l, ids[Math.floor(tok / g.blockSize)]!, tok % g.blockSize, h, s * g.headSize + d)
            out[o++] = m.buf[a]!
            out[o++] = m.buf[a + 1]!
          }
  return out
}

function gather(g: EngineGeometry, m: Model, runs: ArrayLike<number>, slab: number): Uint8Array {
  const out = new Uint8Array(g.layers * slab)
  for (let l = 0; l < g.layers; l++)
    for (let i = 0; i < runs.length; i += 3) {
      const src = m.offsets[l]! + runs[i]!
      out.set(m.buf.subarray(src, src + runs[i + 2]!), l * slab + runs[i + 1]!)
    }
  return out
}

function scatter(
  g: EngineGeometry,
  m: Model,
  runs: ArrayLike<number>,
  slab: number,
  chunk: Uint8Array,
): void {
  for (let l = 0; l < g.layers; l++)
    for (let i = 0; i < runs.length; i += 3) {
      const at = l * slab + runs[i + 1]!
      m.buf.set(chunk.subarray(at, at + runs[i + 2]!), m.offsets[l]! + runs[i]!)
    }
}

/**
 * Row sets (copy-rows.ts) expanded back into [tensor, slab, bytes] triples, one per row: those
 * the host and GPU copies use (`rowsOf`: for a strided view chunkRuns builds them from a block
 * template beside the runs), or the runs compressed anew.
 */
function rowRuns(runs: ArrayLike<number>, fresh = false): number[] {
  const { rows } = fresh ? compressRuns(runs) : rowsOf(runs)
  const out: number[] = []
  for (let i = 0; i < rows.length; i += 6) {
    const [t, s, w, h, tp, sp] = rows.subarray(i, i + 6)
    expect(h === 1 || (tp! >= w! && sp! >= w!)).toBe(true)
    for (let r = 0; r < h!; r++) out.push(t! + r * tp!, s! + r * sp!, w!)
  }
  return out
}

/**
 * The host copies' 3-D sets (copy-rows.ts toSlab or toTensor, whichever `side` names) expanded
 * back into [tensor, slab, bytes] triples, one per row of every plane, each set's rows checked
 * apart on both sides (no two rows of a set touch: the addon's RowsApart).
 */
function planeRuns(runs: ArrayLike<number>, side: 'toSlab' | 'toTensor'): number[] {
  const sets = rowsOf(runs)[side]
  const out: number[] = []
  for (let i = 0; i < sets.length; i += PLANE_FIELDS) {
    const [a, b, w, h, ap, bp, n, app, bpp] = Array.from(sets.subarray(i, i + PLANE_FIELDS))
    const [t, s, tp, sp, tpp, spp] = side === 'toTensor' ? [a, b, ap, bp, app, bpp] : [b, a, bp, ap, bpp, app]
    const spans: [number, number][][] = [[], []]
    for (let q = 0; q < n!; q++)
      for (let r = 0; r < h!; r++) {
        const at = [t! + q * tpp! + r * tp!, s! + q * spp! + r * sp!] as const
        out.push(at[0], at[1], w!)
        spans[0]!.push([at[0], at[0] + w!])
        spans[1]!.push([at[1], at[1] + w!])
      }
    for (const list of spans) {
      list.sort((x, y) => x[0] - y[0])
      for (let k = 1; k < list.length; k++) expect(list[k]![0]).toBeGreaterThanOrEqual(list[k - 1]![1])
    }
  }
  return out
}

/** Gathers blocks `ids`, checks them against the element-wise read, scatters them into `into` and checks which bytes changed. */
function roundTrip(g: EngineGeometry, m: Model, ids: number[], into: number[]): number {
  fill(m.buf, 7)
  const view = layerView(g, NUM_BLOCKS, m.shape, m.strides, 't')
  const runs = chunkRuns(g, view, ids, 0, ids.length, 0)
  const slab = (g.layout === 'mla' ? 1 : 2) * ids.length * g.blockSize * g.kvHeads * g.headSize * E
  for (let i = 0; i < runs.length; i += 3) {
    expect(runs[i]! + runs[i + 2]!).toBeLessThanOrEqual(view.span)
  }
  const want = expectedChunk(g, m, ids)
  expect(Buffer.from(gather(g, m, runs, slab)).equals(Buffer.from(want))).toBe(true)
  // The same bytes through the row sets the host copies use, and through the runs compressed anew.
  expect(Buffer.from(gather(g, m, rowRuns(runs), slab)).equals(Buffer.from(want))).toBe(true)
  expect(Buffer.from(gather(g, m, rowRuns(runs, true), slab)).equals(Buffer.from(want))).toBe(true)
  // And through the 3-D sets of a save (toSlab) and of a load (toTensor).
  expect(Buffer.from(gather(g, m, planeRuns(runs, 'toSlab'), slab)).equals(Buffer.from(want))).toBe(true)
  expect(Buffer.from(gather(g, m, planeRuns(runs, 'toTensor'), slab)).equals(Buffer.from(want))).toBe(true)
  const used = rowsOf(runs)
  const anew = compressRuns(runs)
  expect([used.valid, used.tensorEnd, used.slabEnd]).toEqual([anew.valid, anew.tensorEnd, anew.slabEnd])
  // Into other blocks: exactly their elements change, to the chunk's bytes.
  const before = m.buf.slice()
  const mark = new Uint8Array(want.length).map((_, i) => (i * 31 + 3) & 0xff)
  const back = chunkRuns(g, view, into, 0, into.length, 0)
  // A load through the 3-D sets lands what one through the runs lands.
  scatter(g, m, planeRuns(back, 'toTensor'), slab, mark)
  const viaPlanes = m.buf.slice()
  m.buf.set(before)
  scatter(g, m, back, slab, mark)
  expect(Buffer.from(m.buf).equals(Buffer.from(viaPlanes))).toBe(true)
  expect(Buffer.from(expectedChunk(g, m, into)).equals(Buffer.from(mark))).toBe(true)
  const touched = new Set<number>()
  const S = g.layout === 'mla' ? 1 : 2
  for (let l = 0; l < g.layers; l++)
    for (const b of into)
      for (let t = 0; t < g.blockSize; t++)
        for (let h = 0; h < g.kvHeads; h++)
          for (let c = 0; c < S * g.headSize; c++) {
            const a = m.at(l, b, t, h, c)
            touched.add(a).add(a + 1)
          }
  let changedElsewhere = 0
  for (let i = 0; i < m.buf.length; i++) if (!touched.has(i) && m.buf[i] !== before[i]) changedElsewhere++
  expect(changedElsewhere).toBe(0)
  return runs.length / 3
}

describe("vLLM's [B, H, N, C] views of one allocation (vLLM from 0.26)", () => {
  for (const [name, order] of Object.entries(ORDERS)) {
    it(`${name}: a chunk gathered through the runs equals the element-wise read, and scatters back into exactly its blocks`, () => {
      const m = vllmModel(G, order)
      roundTrip(G, m, [3, 0], [1, 4])
      roundTrip(MLA, vllmModel(MLA, order), [2, 4], [0, 3])
    })
  }

  it('kernel blocks (vLLM split each block into 2 for the kernel): block b is kernel blocks 2b and 2b+1', () => {
    for (const order of [ORDERS.LBNHC, ORDERS.LBHNC]) {
      roundTrip(G, vllmModel(G, order, 2), [4, 1], [0, 2])
      roundTrip(MLA, vllmModel(MLA, order, 4), [1, 3], [4, 0])
    }
  })

  it('padded pages (page_size_padded): the padding is never read nor written', () => {
    roundTrip(G, vllmModel(G, ORDERS.LBNHC, 1, 5), [2, 3], [4, 0])
    roundTrip(G, vllmModel(G, ORDERS.BLHNC, 1, 7), [0, 1], [3, 2])
  })

  it("HND pages: a block side is one 3-D set (a plane per token over its heads), K's beside V's", () => {
    const m = vllmModel(G, ORDERS.LBHNC)
    fill(m.buf, 7)
    const view = layerView(G, NUM_BLOCKS, m.shape, m.strides, 't')
    const runs = chunkRuns(G, view, [3, 0, 2], 0, 3, 0)
    const { toSlab, toTensor } = rowsOf(runs)
    expect(toSlab.length / PLANE_FIELDS).toBe(2 * 3)
    for (let i = 0; i < toTensor.length; i += PLANE_FIELDS) {
      // [tensor, slab, width, height, tensorPitch, slabPitch, planes, tensorPlanePitch, slabPlanePitch]
      expect(Array.from(toTensor.subarray(i + 2, i + PLANE_FIELDS))).toEqual([
        G.headSize * E,
        G.kvHeads,
        view.head,
        G.headSize * E,
        G.blockSize,
        view.token,
        G.kvHeads * G.headSize * E,
      ])
      // In tensor order, a block's K set then its V set, whose rows lie side by side in the tensor.
      if ((i / PLANE_FIELDS) % 2 === 1) expect(toTensor[i]).toBe(toTensor[i - PLANE_FIELDS]! + G.headSize * E)
    }
    // The same sets compressed anew from the runs (not from the block template).
    const fresh = compressRuns(Array.from(runs))
    expect(fresh.toSlab.length).toBe(toSlab.length)
  })

  it('NHD pages copy one head of one token per run: K and V are interleaved in every row', () => {
    const runs = roundTrip(G, vllmModel(G, ORDERS.LBNHC), [3, 0], [1, 4])
    expect(runs).toBe(2 * 2 * G.blockSize * G.kvHeads)
  })
})

describe('the old layouts (vLLM up to 0.25; MLA up to 0.28)', () => {
  for (const layout of ['flash-attn', 'flashinfer', 'mla'] as const) {
    const g = layout === 'mla' ? MLA : { ...G, layout }
    it(`${layout}: contiguous tensors copy one run per block side`, () => {
      expect(roundTrip(g, legacyModel(g), [3, 0], [1, 4])).toBe((layout === 'mla' ? 1 : 2) * 2)
      // Consecutive blocks in both places merge into one run (FlashInfer's V lies between two blocks' K).
      expect(roundTrip(g, legacyModel(g), [1, 2], [3, 4])).toBe(
        { 'flash-attn': 2, flashinfer: 4, mla: 1 }[layout],
      )
    })
    it(`${layout}: a strided view (padding after every row) copies row by row`, () => {
      roundTrip(g, legacyModel(g, 3), [3, 0], [1, 4])
    })
  }
})

describe('refused registrations', () => {
  const shape = viewShape(G, NUM_BLOCKS)
  const ok = vllmModel(G, ORDERS.LBNHC).strides
  const refuse =
    (s: unknown, st: unknown, g = G) =>
    () =>
      layerView(g, NUM_BLOCKS, s, st, 'tensors[0]')

  it('shapes that are neither layout name both', () => {
    expect(refuse([NUM_BLOCKS, 2, 4, 3], undefined)).toThrow(/\[2,5,4,2,3\].*\[5,2,4,6\]/)
    expect(refuse([NUM_BLOCKS * 4, 2, 1.5, 6], undefined)).toThrow(/ERR_LAYOUT|has shape/)
    expect(refuse([NUM_BLOCKS * 3, 2, 3, 6], undefined)).toThrow(/has shape/) // 3 does not divide 4
    expect(refuse([NUM_BLOCKS, 3, 4, 6], undefined)).toThrow(/has shape/) // heads
    expect(refuse('x', undefined)).toThrow(/has shape/)
  })

  it('strides that overlap, are not integers, or leave the last dimension strided', () => {
    expect(refuse(shape, [48, 6, 12, 1])).not.toThrow()
    expect(refuse(shape, ok)).not.toThrow()
    expect(refuse(shape, [48, 6, 6, 1])).toThrow(/overlap/) // two heads on one place
    expect(refuse(shape, [0, 6, 12, 1])).toThrow(/overlap/) // every block on block 0
    expect(refuse(shape, [48, 6, 12, 2])).toThrow(/contiguous run/)
    expect(refuse(shape, [48, 6, 12])).toThrow(/4 integers/)
    expect(refuse(shape, [48, -6, 12, 1])).toThrow(/integers >= 0/)
    expect(refuse(shape, [48, 6.5, 12, 1])).toThrow(/integers >= 0/)
    expect(refuse(shape, [2 ** 60, 6, 12, 1])).toThrow(/integers >= 0|addressed/)
  })
})
