// Copy runs as 2-D and 3-D row sets: a strided engine view's runs (one per token, head and side:
// 256 B each, 4,096 per layer of a chunk) become a few sets the addon copies without a per-run step.

/** Fields of one row set in {@link CopyRows.rows}. */
export const ROW_FIELDS = 6
/** Fields of one 3-D set in {@link CopyRows.toSlab} and {@link CopyRows.toTensor}. */
export const PLANE_FIELDS = 9

/**
 * A chunk's runs ([tensorOffset, slabOffset, bytes] triples) as row sets: set i is
 * `rows[6i .. 6i + 6)` = [tensorOffset, slabOffset, width, height, tensorPitch, slabPitch]; its
 * row r copies `width` bytes between `tensorOffset + r * tensorPitch` and
 * `slabOffset + r * slabPitch`. Both pitches are at least the width (rows apart on both sides).
 * The same for every layer: compressed once per chunk ({@link rowsOf}).
 */
export interface CopyRows {
  readonly rows: Float64Array
  /** Every triple's fields are non-negative safe integers (else the bounds below mean nothing, and merging could make a fractional pair whole). */
  readonly valid: boolean
  /** Bytes from the tensor's start past the furthest byte a run touches (0 for no runs). */
  readonly tensorEnd: number
  /** Bytes from the slab's start past the furthest byte a run touches. */
  readonly slabEnd: number
  /**
   * The host copies' sets, 3-D (the addon's copyPlanes), with the slab as the destination:
   * [slab, tensor, width, height, slabPitch, tensorPitch, planes, slabPlanePitch,
   * tensorPlanePitch], in tensor order. Plane q of a set is its row set shifted by q plane
   * pitches: consecutive row sets of one shape a constant step apart ({@link planesOf}: an HND
   * view's block side, a set per token over its heads, is one set of a plane per token).
   */
  readonly toSlab: Float64Array
  /** The same sets with the tensor as the destination: [tensor, slab, width, height, tensorPitch, slabPitch, planes, tensorPlanePitch, slabPlanePitch]. */
  readonly toTensor: Float64Array
}

/**
 * `runs` as row sets. Contiguous neighbours (on both sides) merge first; then runs of equal
 * width whose offsets step by the same deltas on both sides, each at least the width, are one
 * set; any other run is a set of height 1. Zero-byte runs copy nothing and are left out.
 */
export function compressRuns(runs: ArrayLike<number>): CopyRows {
  const out: number[] = []
  let valid = true
  let tensorEnd = 0
  let slabEnd = 0
  // The set being built: height 0 = none yet.
  let t0 = 0
  let s0 = 0
  let width = 0
  let height = 0
  let tp = 0
  let sp = 0
  const flush = () => {
    if (height === 0) return
    out.push(t0, s0, width, height, height > 1 ? tp : width, height > 1 ? sp : width)
    height = 0
  }
  const add = (t: number, s: number, n: number) => {
    if (height > 0 && n === width) {
      if (height === 1 && t - t0 >= width && s - s0 >= width) {
        tp = t - t0
        sp = s - s0
        height = 2
        return
      }
      if (height > 1 && t === t0 + height * tp && s === s0 + height * sp) {
        height++
        return
      }
    }
    flush()
    t0 = t
    s0 = s
    width = n
    height = 1
  }
  for (let i = 0; i < runs.length && valid; i += 3)
    valid = whole(runs[i]!) && whole(runs[i + 1]!) && whole(runs[i + 2]!)
  forMerged(runs, (t, s, n) => {
    if (t + n > tensorEnd) tensorEnd = t + n
    if (s + n > slabEnd) slabEnd = s + n
    if (n > 0) add(t, s, n)
  })
  flush()
  return withOrders(Float64Array.from(out), valid, tensorEnd, slabEnd)
}

/**
 * The {@link CopyRows} of row sets `rows` (in slab order) whose runs are `valid` and reach
 * `tensorEnd` and `slabEnd`; `planes`: the same copies as 3-D sets ([tensor, slab, width, height,
 * tensorPitch, slabPitch, planes, tensorPlanePitch, slabPlanePitch], slab order) when the caller
 * has them (chunkRuns shifts a block template's), else {@link planesOf}(rows).
 */
export function withOrders(
  rows: Float64Array,
  valid: boolean,
  tensorEnd: number,
  slabEnd: number,
  planes: Float64Array = planesOf(rows),
): CopyRows {
  // Sets in tensor order (they are disjoint: the order they copy in changes no byte): a block's
  // K and V sets, whose rows alternate in a strided view, become neighbours, which the addon
  // copies row by row together (the view read, or written, once and in order; native/src/mmap.cc
  // Zips), a save's and a load's alike. Sets of whole blocks (rows of 4 KiB and more: the old
  // layouts) keep slab order, as before.
  const F = PLANE_FIELDS
  const order = Array.from({ length: planes.length / F }, (_, k) => k)
  let small = false
  for (let k = 2; k < planes.length && !small; k += F) small = planes[k]! < 4096
  if (small) order.sort((a, b) => planes[a * F]! - planes[b * F]! || a - b)
  const toSlab = new Float64Array(planes.length)
  const toTensor = new Float64Array(planes.length)
  for (let k = 0; k < order.length; k++) {
    const from = order[k]! * F
    const o = k * F
    toTensor.set(planes.subarray(from, from + F), o)
    toSlab[o] = planes[from + 1]!
    toSlab[o + 1] = planes[from]!
    toSlab[o + 2] = planes[from + 2]!
    toSlab[o + 3] = planes[from + 3]!
    toSlab[o + 4] = planes[from + 5]!
    toSlab[o + 5] = planes[from + 4]!
    toSlab[o + 6] = planes[from + 6]!
    toSlab[o + 7] = planes[from + 8]!
    toSlab[o + 8] = planes[from + 7]!
  }
  return { rows, valid, tensorEnd, slabEnd, toSlab, toTensor }
}

/**
 * Row sets `rows` ([tensor, slab, width, height, tensorPitch, slabPitch]) as 3-D sets
 * ([..., planes, tensorPlanePitch, slabPlanePitch]): consecutive sets of one shape, two rows or
 * more, whose starts step by the same positive deltas on both sides are planes of one set, as
 * long as no two of its rows touch on either side (the addon's check: the planes one after
 * another, or each between two rows); every other set is a set of one plane. The copies are the
 * same: an HND view's block side (a set per token, each over the token's heads at the head
 * pitch) becomes one set of 16 planes, so the addon takes 32 sets per layer of a chunk, not 512.
 */
export function planesOf(rows: Float64Array): Float64Array {
  const R = ROW_FIELDS
  const out = new Float64Array((rows.length / R) * PLANE_FIELDS)
  let o = 0
  let i = 0
  while (i < rows.length) {
    const [t, s, w, h, tp, sp] = [
      rows[i]!,
      rows[i + 1]!,
      rows[i + 2]!,
      rows[i + 3]!,
      rows[i + 4]!,
      rows[i + 5]!,
    ]
    let n = 1
    let dt = 0
    let ds = 0
    let j = i + R
    if (h > 1 && j < rows.length) {
      dt = rows[j]! - t
      ds = rows[j + 1]! - s
      while (
        j < rows.length &&
        dt > 0 &&
        ds > 0 &&
        rows[j]! === t + n * dt &&
        rows[j + 1]! === s + n * ds &&
        rows[j + 2] === w &&
        rows[j + 3] === h &&
        rows[j + 4] === tp &&
        rows[j + 5] === sp &&
        rowsApart(w, h, tp, n + 1, dt) &&
        rowsApart(w, h, sp, n + 1, ds)
      ) {
        n++
        j += R
      }
    }
    out.set(rows.subarray(i, i + R), o)
    out[o + 6] = n
    out[o + 7] = n > 1 ? dt : 0
    out[o + 8] = n > 1 ? ds : 0
    o += PLANE_FIELDS
    i += n * R
  }
  return out.subarray(0, o)
}

/** No two rows of `planes` planes touch on one side (native/src/mmap.cc RowsApart). */
function rowsApart(w: number, h: number, pitch: number, planes: number, planePitch: number): boolean {
  if (h > 1 && pitch < w) return false
  if (planes <= 1) return true
  if (planePitch >= (h - 1) * pitch + w) return true
  return h > 1 && planePitch >= w && (planes - 1) * planePitch + w <= pitch
}

/** Runs adjacent on both sides (consecutive block ids, as vLLM often allocates) as one: `f` per merged run. */
export function forMerged(
  runs: ArrayLike<number>,
  f: (tensorAt: number, hostAt: number, bytes: number) => void,
): void {
  let i = 0
  while (i < runs.length) {
    const t = runs[i]!
    const h = runs[i + 1]!
    let n = runs[i + 2]!
    i += 3
    while (i < runs.length && runs[i] === t + n && runs[i + 1] === h + n) {
      n += runs[i + 2]!
      i += 3
    }
    f(t, h, n)
  }
}

function whole(x: number): boolean {
  return Number.isSafeInteger(x) && x >= 0
}

const cache = new WeakMap<object, CopyRows>()

/**
 * Makes `sets` what {@link rowsOf} answers for `runs`, which nobody changes after (chunkRuns
 * built both from one template: every block side of a view has the same sets, shifted; compressing
 * every chunk's runs again cost more than building them). `sets` must describe exactly the
 * copies `runs` do.
 */
export function rememberRows(runs: ArrayLike<number>, sets: CopyRows): void {
  cache.set(runs as object, sets)
}

/** Whether `runs` never change: a frozen array, or runs given to {@link rememberRows}. */
export function stableRuns(runs: ArrayLike<number>): boolean {
  return (Array.isArray(runs) && Object.isFrozen(runs)) || cache.has(runs as object)
}

/**
 * {@link compressRuns}, remembered for a frozen array of runs (a chunk's runs are the same in
 * every layer: chunkRuns freezes them, and the sets are made once per chunk, not per layer).
 * A runs array that is not frozen (it may change) is compressed at every call.
 */
export function rowsOf(runs: ArrayLike<number>): CopyRows {
  const known = cache.get(runs as object)
  if (known !== undefined) return known
  const c = compressRuns(runs)
  if (Array.isArray(runs) && Object.isFrozen(runs)) cache.set(runs, c)
  return c
}

/** Whether every run of `c` lies inside a tensor of `tensorBytes` and a slab of `slabBytes`. */
export function rowsInside(c: CopyRows, tensorBytes: number, slabBytes: number): boolean {
  return c.valid && c.tensorEnd <= tensorBytes && c.slabEnd <= slabBytes
}
