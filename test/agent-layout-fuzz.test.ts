// Hostile registrations fuzzed: random and mutated shapes, strides, offsets and block ids fed to
// layerView, chunkRuns, rowsOf / rowsInside, stridedCopies and the addon's copyRows. Either a
// typed ERR_LAYOUT, or every byte a run names lies inside the view's span, is the element an
// independent model of the strided view puts there, and no two elements (blocks) share a byte.
// Seeded: a failure prints its seed and case, and reruns the same.

import { describe, expect, it } from 'vitest'
import { compressRuns, PLANE_FIELDS, ROW_FIELDS, rowsInside, rowsOf } from '../src/agent/copy-rows.ts'
import {
  chunkRuns,
  type EngineGeometry,
  layerShape,
  layerView,
  sides,
  viewShape,
} from '../src/agent/engine-layout.ts'
import { AgentError } from '../src/agent/protocol.ts'
import { stridedCopies } from '../src/agent/strided-copies.ts'
import { dtypeBytes } from '../src/core/layout.ts'

const native = await import('../src/client/native.ts')
const hasCopyRows = native.copyRowsAvailable()

/** mulberry32: small, seeded, good enough to pick cases. */
function prng(seed: number) {
  let a = seed >>> 0
  const next = () => {
    a = (a + 0x6d2b79f5) >>> 0
    let t = a
    t = Math.imul(t ^ (t >>> 15), t | 1)
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61)
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296
  }
  const int = (lo: number, hi: number) => lo + Math.floor(next() * (hi - lo + 1))
  const pick = <T>(xs: readonly T[]): T => xs[Math.floor(next() * xs.length)]!
  return { next, int, pick, chance: (p: number) => next() < p }
}
type Rng = ReturnType<typeof prng>

const HOSTILE: readonly unknown[] = [
  0,
  -1,
  -4,
  Number.NaN,
  1.5,
  Number.POSITIVE_INFINITY,
  2 ** 31,
  2 ** 32 + 1,
  2 ** 50,
  2 ** 53 - 1,
  2 ** 53,
  2 ** 53 + 2,
  2 ** 60,
  '4',
  null,
  [],
  { n: 1 },
]

function geometry(rng: Rng): EngineGeometry {
  const layout = rng.pick(['flash-attn', 'flashinfer', 'mla'] as const)
  return {
    layout,
    layers: 1,
    kvHeads: layout === 'mla' ? 1 : rng.int(1, 3),
    headSize: rng.int(1, 4),
    blockSize: rng.pick([1, 2, 3, 4, 6, 8]),
    dtype: rng.pick(['fp16', 'bf16', 'fp32', 'fp8e4m3'] as const),
  }
}

/** The shape a case registers: legacy or a [B·r, H, N, C] view (N a divisor of the block), or broken. */
function caseShape(rng: Rng, g: EngineGeometry, numBlocks: number): unknown {
  const divisors = Array.from({ length: g.blockSize }, (_, i) => i + 1).filter((d) => g.blockSize % d === 0)
  const shape: unknown[] = rng.chance(0.3)
    ? layerShape(g, numBlocks)
    : viewShape(g, numBlocks, rng.pick(divisors))
  if (rng.chance(0.15)) {
    const i = rng.int(0, shape.length - 1)
    shape[i] = rng.chance(0.5) ? rng.pick(HOSTILE) : (shape[i] as number) * rng.int(2, 3)
  }
  if (rng.chance(0.03)) shape.pop()
  if (rng.chance(0.03)) shape.push(1)
  if (rng.chance(0.02)) return rng.pick(['[2,3]', null, { 0: 2 }, 7])
  return shape
}

/** Strides (elements) for `shape`: a physical order with padding (vLLM-like), random, or mutated. */
function caseStrides(rng: Rng, shape: unknown): unknown {
  if (!Array.isArray(shape) || !shape.every((x) => Number.isSafeInteger(x) && x >= 0 && x < 2 ** 20))
    return rng.chance(0.5) ? undefined : [1, 2, 3]
  const dims = shape as number[]
  if (rng.chance(0.1)) return undefined
  let st: unknown[]
  if (rng.chance(0.2)) {
    st = dims.map(() => rng.int(0, 64))
    st[st.length - 1] = rng.chance(0.8) ? 1 : rng.int(0, 3)
  } else {
    // The last dim innermost (stride 1); the others in a random physical order, padded now and then.
    const order = dims.slice(0, -1).map((_, i) => i)
    for (let i = order.length - 1; i > 0; i--) {
      const j = rng.int(0, i)
      ;[order[i], order[j]] = [order[j]!, order[i]!]
    }
    const out = new Array<number>(dims.length)
    out[dims.length - 1] = 1
    let cur = dims[dims.length - 1]!
    for (let k = order.length - 1; k >= 0; k--) {
      if (rng.chance(0.2)) cur += rng.int(1, 5)
      out[order[k]!] = cur
      cur *= dims[order[k]!]!
    }
    st = out
  }
  if (rng.chance(0.35)) {
    const i = rng.int(0, st.length - 1)
    const mutation = rng.int(0, 4)
    if (mutation === 0) st[i] = rng.pick(HOSTILE)
    else if (mutation === 1) st[i] = (st[i] as number) + rng.pick([-2, -1, 1, 2])
    else if (mutation === 2) {
      const j = rng.int(0, st.length - 1)
      ;[st[i], st[j]] = [st[j], st[i]]
    } else if (mutation === 3) st[i] = 0
    else st.splice(i, 1)
  }
  return st
}

/** Byte offset (from the tensor's offset) of element c of (side, block, token, head), read from the raw shape and strides. */
function modelAt(
  g: EngineGeometry,
  dims: readonly number[],
  st: readonly number[],
  side: number,
  b: number,
  t: number,
  h: number,
  c: number,
): number {
  const e = dtypeBytes(g.dtype)
  let el: number
  if (dims.length === 4) {
    const N = dims[2]!
    const r = g.blockSize / N
    el =
      (b * r + Math.floor(t / N)) * st[0]! + h * st[1]! + (t % N) * st[2]! + (side * g.headSize + c) * st[3]!
  } else if (g.layout === 'mla') el = b * st[0]! + t * st[1]! + c * st[2]!
  else if (g.layout === 'flash-attn') el = side * st[0]! + b * st[1]! + t * st[2]! + h * st[3]! + c * st[4]!
  else el = b * st[0]! + side * st[1]! + t * st[2]! + h * st[3]! + c * st[4]!
  return el * e
}

function contiguous(dims: readonly number[]): number[] {
  const out = new Array<number>(dims.length)
  let s = 1
  for (let i = dims.length - 1; i >= 0; i--) {
    out[i] = s
    s *= dims[i]!
  }
  return out
}

/** Every (tensor byte → slab byte) pair the runs copy, refusing a tensor or slab byte named twice. */
function expand(runs: ArrayLike<number>, into = new Map<number, number>(), slabSeen = new Set<number>()) {
  for (let i = 0; i < runs.length; i += 3) {
    const [t, s, n] = [runs[i]!, runs[i + 1]!, runs[i + 2]!]
    for (let k = 0; k < n; k++) {
      if (into.has(t + k)) throw new Error(`tensor byte ${t + k} copied twice`)
      if (slabSeen.has(s + k)) throw new Error(`slab byte ${s + k} copied twice`)
      into.set(t + k, s + k)
      slabSeen.add(s + k)
    }
  }
  return into
}

/**
 * The (tensor → slab) byte pairs of sets [t, s, width, height, tPitch, sPitch] (2-D, `fields` =
 * ROW_FIELDS) or [..., planes, tPlanePitch, sPlanePitch] (3-D, PLANE_FIELDS); the indices name
 * where each field is (a toSlab set has the slab first).
 */
function expandRows(
  rows: ArrayLike<number>,
  tAt = 0,
  sAt = 1,
  tp = 4,
  sp = 5,
  fields = ROW_FIELDS,
  tpp = 7,
  spp = 8,
): Map<number, number> {
  const out = new Map<number, number>()
  for (let i = 0; i < rows.length; i += fields) {
    const planes = fields === PLANE_FIELDS ? rows[i + 6]! : 1
    for (let q = 0; q < planes; q++)
      for (let r = 0; r < rows[i + 3]!; r++)
        for (let k = 0; k < rows[i + 2]!; k++) {
          const t = rows[i + tAt]! + (q > 0 ? q * rows[i + tpp]! : 0) + r * rows[i + tp]! + k
          if (out.has(t)) throw new Error(`row sets copy tensor byte ${t} twice`)
          out.set(t, rows[i + sAt]! + (q > 0 ? q * rows[i + spp]! : 0) + r * rows[i + sp]! + k)
        }
  }
  return out
}

const sameMap = (a: Map<number, number>, b: Map<number, number>) =>
  a.size === b.size && [...a].every(([k, v]) => b.get(k) === v)

interface Outcome {
  refused: boolean
  elements: number
}

/**
 * One case: a typed refusal, or a view whose runs the model confirms byte for byte, inside the
 * span, distinct blocks disjoint, the row sets and the GPU's strided copies the same copies.
 */
function runCase(seed: number): Outcome {
  const rng = prng(seed)
  const g = geometry(rng)
  const numBlocks = rng.chance(0.05) ? rng.pick([2 ** 20, 2 ** 24, 2 ** 30]) : rng.int(1, 6)
  const shape = caseShape(rng, g, numBlocks)
  const strides = caseStrides(rng, shape)
  let v: ReturnType<typeof layerView>
  try {
    v = layerView(g, numBlocks, shape, strides, 'tensors[0]')
  } catch (e) {
    expect(e, `seed ${seed}`).toBeInstanceOf(AgentError)
    expect((e as AgentError).code).toBe('ERR_LAYOUT')
    // The message shows what was sent, clipped: a huge array sent back whole would amplify it.
    expect((e as Error).message.length).toBeLessThan(1200)
    return { refused: true, elements: 0 }
  }
  const dims = shape as number[]
  const st = (strides ?? contiguous(dims)) as number[]
  expect(Number.isSafeInteger(v.span) && v.span > 0, `seed ${seed}: span ${v.span}`).toBe(true)
  const e = dtypeBytes(g.dtype)
  const S = sides(g)
  const bb = g.blockSize * g.kvHeads * g.headSize * e
  // The whole tensor's elements are disjoint and inside the span (what layerView promised).
  const elements = numBlocks * S * g.blockSize * g.kvHeads * g.headSize
  if (elements <= 4096) {
    const seen = new Set<number>()
    for (let b = 0; b < numBlocks; b++)
      for (let side = 0; side < S; side++)
        for (let t = 0; t < g.blockSize; t++)
          for (let h = 0; h < g.kvHeads; h++)
            for (let c = 0; c < g.headSize; c++) {
              const at = modelAt(g, dims, st, side, b, t, h, c)
              for (let k = 0; k < e; k++) {
                if (!(at + k >= 0 && at + k < v.span))
                  expect.fail(`seed ${seed}: byte ${at + k} of span ${v.span}`)
                if (seen.has(at + k)) expect.fail(`seed ${seed}: two elements on byte ${at + k}`)
                seen.add(at + k)
              }
            }
  }
  // Chunks of distinct blocks (the last ones of a huge registration too).
  const chunks = rng.int(1, 2)
  const pool = Array.from({ length: Math.min(numBlocks, 8) }, (_, i) => (i % 2 ? numBlocks - 1 - i : i))
  const distinct = [...new Set(pool)]
  for (let i = distinct.length - 1; i > 0; i--) {
    const j = rng.int(0, i)
    ;[distinct[i], distinct[j]] = [distinct[j]!, distinct[i]!]
  }
  // A chunk's blocks are distinct (the agent refuses a load or save naming one twice).
  const bpc = Math.min(rng.int(1, 3), distinct.length)
  const ids = Array.from({ length: bpc * chunks }, (_, i) => distinct[i % distinct.length]!)
  const skip = rng.chance(0.3) ? rng.int(0, ids.length) : 0
  const allTensor = new Map<number, number>()
  const slabBytes = S * bpc * bb
  for (let c = 0; c < chunks; c++) {
    // Blocks repeat across chunks only when the registration has fewer than the chunks name.
    const shared = ids.length > distinct.length
    const runs = chunkRuns(g, v, ids, c * bpc, bpc, skip)
    const pairs = expand(runs)
    const want = new Map<number, number>()
    for (let j = 0; j < bpc; j++) {
      if (c * bpc + j < skip) continue
      const b = ids[c * bpc + j]!
      for (let side = 0; side < S; side++)
        for (let t = 0; t < g.blockSize; t++)
          for (let h = 0; h < g.kvHeads; h++)
            for (let ch = 0; ch < g.headSize; ch++) {
              const at = modelAt(g, dims, st, side, b, t, h, ch)
              const slab = (((side * bpc + j) * g.blockSize + t) * g.kvHeads + h) * g.headSize * e + ch * e
              for (let k = 0; k < e; k++) want.set(at + k, slab + k)
            }
    }
    expect(sameMap(pairs, want), `seed ${seed}: chunk ${c}'s runs are not the model's copies`).toBe(true)
    for (const [t, s] of pairs) {
      if (!(t < v.span && s < slabBytes))
        expect.fail(`seed ${seed}: run byte ${t}/${s} outside ${v.span}/${slabBytes}`)
      if (shared) continue
      if (allTensor.has(t)) expect.fail(`seed ${seed}: two blocks' runs share byte ${t}`)
      allTensor.set(t, s)
    }
    const sets = rowsOf(runs)
    expect(rowsInside(sets, v.span, slabBytes), `seed ${seed}`).toBe(true)
    expect(rowsInside(sets, v.span - 1, slabBytes) && pairs.has(v.span - 1)).toBe(false)
    expect(sameMap(expandRows(sets.rows), pairs), `seed ${seed}: row sets`).toBe(true)
    expect(
      sameMap(expandRows(sets.toTensor, 0, 1, 4, 5, PLANE_FIELDS, 7, 8), pairs),
      `seed ${seed}: toTensor`,
    ).toBe(true)
    expect(
      sameMap(expandRows(sets.toSlab, 1, 0, 5, 4, PLANE_FIELDS, 8, 7), pairs),
      `seed ${seed}: toSlab`,
    ).toBe(true)
    expect(sameMap(expandRows(stridedCopies(runs)), pairs), `seed ${seed}: strided copies`).toBe(true)
    if (hasCopyRows && pairs.size > 0 && v.span <= 1 << 16)
      nativeCopies(seed, rng, sets, pairs, v.span, slabBytes)
  }
  return { refused: false, elements }
}

const GUARD = 64

/** The addon's copyRows both ways on real buffers with guard bytes around, then hostile mutations of the sets. */
function nativeCopies(
  seed: number,
  rng: Rng,
  sets: ReturnType<typeof rowsOf>,
  pairs: Map<number, number>,
  span: number,
  slabBytes: number,
) {
  const tensorAll = new Uint8Array(span + 2 * GUARD)
  const fill = rng.int(0, 255)
  for (let i = 0; i < tensorAll.length; i++) tensorAll[i] = (i * 131 + fill) & 0xff
  const tensor = tensorAll.subarray(GUARD, GUARD + span)
  const slabAll = new Uint8Array(slabBytes + 2 * GUARD)
  const slab = slabAll.subarray(GUARD, GUARD + slabBytes)
  native.copyPlanes(slab, tensor, sets.toSlab)
  for (const [t, s] of pairs)
    if (slab[s] !== tensor[t]) expect.fail(`seed ${seed}: gathered byte ${t} -> ${s}`)
  const before = Uint8Array.from(tensorAll)
  slab.forEach((_, i) => {
    slab[i] = (i * 7 + 3) & 0xff
  })
  native.copyPlanes(tensor, slab, sets.toTensor)
  for (let i = 0; i < tensorAll.length; i++) {
    const t = i - GUARD
    const want = pairs.has(t) ? slab[pairs.get(t)!] : before[i]
    if (tensorAll[i] !== want)
      expect.fail(`seed ${seed}: scatter wrote tensor byte ${t} (${tensorAll[i]} != ${want})`)
  }
  // A mutated set: the addon copies it exactly when every row still lies inside both views and
  // the destination's rows stay apart (as this independent check in BigInt says), else refuses
  // it before any byte moves.
  for (let m = 0; m < 6; m++) {
    // Even m: the 3-D sets (copyPlanes); odd m: the 2-D ones (copyRows), both tensor-bound.
    const F = m % 2 === 0 ? PLANE_FIELDS : ROW_FIELDS
    const rows = Float64Array.from(F === PLANE_FIELDS ? sets.toTensor : sets.rows)
    const i = rng.int(0, rows.length / F - 1) * F + rng.int(0, F - 1)
    rows[i] = rng.pick([
      rows[i]! + 1,
      rows[i]! - 1,
      rows[i]! * 2 + 1,
      span,
      slabBytes,
      -1,
      0.5,
      Number.NaN,
      2 ** 53,
      2 ** 64,
      2 ** 40,
    ])
    const snapshot = Uint8Array.from(tensorAll)
    const slabSnap = Uint8Array.from(slabAll)
    let refused = false
    try {
      if (F === PLANE_FIELDS) native.copyPlanes(tensor, slab, rows)
      else native.copyRows(tensor, slab, rows)
    } catch (err) {
      refused = true
      expect(err, `seed ${seed}`).toBeInstanceOf(native.NativeError)
      expect(Buffer.from(tensorAll).equals(snapshot), `seed ${seed}: a refused copy wrote`).toBe(true)
    }
    expect(refused, `seed ${seed}: ${rows.join(',')} in ${span}/${slabBytes}`).toBe(
      !setsInside(rows, span, slabBytes, F),
    )
    expect(Buffer.from(slabAll).equals(slabSnap), `seed ${seed}: the source was written`).toBe(true)
    for (let k = 0; k < GUARD; k++) {
      if (tensorAll[k] !== snapshot[k] || tensorAll[GUARD + span + k] !== snapshot[GUARD + span + k])
        expect.fail(`seed ${seed}: a copy wrote outside the tensor (refused: ${refused})`)
    }
  }
}

/**
 * Whether every set [dst, src, width, height, dstPitch, srcPitch] (with `fields` = PLANE_FIELDS:
 * [..., planes, dstPlanePitch, srcPlanePitch]) lies inside both buffers, its destination rows
 * apart (no two rows of any planes touching a common byte), in BigInt.
 */
function setsInside(rows: Float64Array, dstBytes: number, srcBytes: number, fields: number): boolean {
  for (let i = 0; i < rows.length; i += fields) {
    const f = Array.from(rows.subarray(i, i + fields))
    if (!f.every((x) => Number.isSafeInteger(x) && x >= 0)) return false
    const [d, s, w, h, dp, sp, pl = 1n, dpp = 0n, spp = 0n] = f.map(BigInt) as bigint[]
    if (w === 0n || h === 0n || pl === 0n) {
      if (d! > BigInt(dstBytes) || s! > BigInt(srcBytes)) return false
      continue
    }
    const end = (off: bigint, pitch: bigint, planePitch: bigint) =>
      (pl - 1n) * planePitch + (h! - 1n) * pitch + off + w!
    if (end(d!, dp!, dpp) > BigInt(dstBytes) || end(s!, sp!, spp) > BigInt(srcBytes)) return false
    if (h! > 1n && dp! < w!) return false
    if (pl > 1n) {
      const plane = (h! - 1n) * dp! + w!
      const interleaved = h! > 1n && dpp >= w! && (pl - 1n) * dpp + w! <= dp!
      if (dpp < plane && !interleaved) return false
    }
  }
  return true
}

describe('hostile registrations (fuzz)', () => {
  it('every view is refused with ERR_LAYOUT or copies exactly its elements, inside its span, blocks disjoint', () => {
    let refused = 0
    let accepted = 0
    let slowest = 0
    const base = 0x5eed
    for (let k = 0; k < 3000; k++) {
      const t0 = performance.now()
      const o = runCase(base + k)
      slowest = Math.max(slowest, performance.now() - t0)
      if (o.refused) refused++
      else accepted++
    }
    // Both outcomes are exercised. (No timing is asserted: the test's own timeout bounds it, and the
    // slowest case is printed when it passes 500 ms: a view of 2^30 blocks should cost what a small
    // one does.)
    expect(refused).toBeGreaterThan(300)
    expect(accepted).toBeGreaterThan(300)
    if (slowest > 500) console.warn(`agent-layout-fuzz: slowest case ${slowest.toFixed(0)} ms`)
  })

  it('rowsInside holds only for runs that are whole and inside both sides (random and hostile runs)', () => {
    const rng = prng(0xb0b)
    for (let k = 0; k < 3000; k++) {
      const n = rng.int(0, 6)
      const runs: number[] = []
      for (let i = 0; i < n; i++) {
        const hostile = rng.chance(0.1)
        const t = hostile ? (rng.pick(HOSTILE) as number) : rng.int(0, 200)
        runs.push(t, rng.chance(0.05) ? (rng.pick(HOSTILE) as number) : rng.int(0, 200), rng.int(0, 40))
      }
      const T = rng.int(0, 240)
      const H = rng.int(0, 240)
      const inside = runs.every((x, i) => {
        if (!(Number.isSafeInteger(x) && x >= 0)) return false
        if (i % 3 === 2) return true
        return x + runs[i - (i % 3) + 2]! <= (i % 3 === 0 ? T : H)
      })
      const c = compressRuns(runs)
      if (rowsInside(c, T, H)) expect(inside, `case ${k}: ${JSON.stringify(runs)} ${T} ${H}`).toBe(true)
    }
  })
})
