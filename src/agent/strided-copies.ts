// A layer's copy runs as strided (2-D) copies for the GPU path: in vLLM's packed K/V layouts a
// block's K is thousands of head-sized runs a fixed pitch apart, which one cudaMemcpy2DAsync moves.

import { ROW_FIELDS, rowsOf, stableRuns } from './copy-rows.ts'

/** Numbers per descriptor: [tensorOffset, hostOffset, width, height, tensorPitch, hostPitch]. */
export const STRIDED_FIELDS = ROW_FIELDS

/** cudaMemcpy2D refuses pitches from 2^31 on (cudaErrorInvalidPitchValue). */
const MAX_PITCH = 2 ** 31 - 1

/**
 * The fewest rows worth a 2-D copy. Two runs a pitch apart are as often two unrelated runs that
 * happen to line up (an old layout's K and V runs of contiguous blocks) as a pattern; they stay
 * two copies, as copyBatch issued them, and old layouts keep the copies they had.
 */
export const MIN_ROWS = 3

/** A run every field of which the copy can take; anything else is passed on alone, for the addon to refuse. */
function sound(t: number, h: number, w: number): boolean {
  return (
    Number.isSafeInteger(t) && Number.isSafeInteger(h) && Number.isSafeInteger(w) && t >= 0 && h >= 0 && w > 0
  )
}

/** Two rows a pitch apart that a 2-D copy can take: ascending by at least the width on each side. */
function pitchFits(dt: number, dh: number, w: number): boolean {
  return dt >= w && dh >= w && dt <= MAX_PITCH && dh <= MAX_PITCH
}

/**
 * `m` rows-of-`k` groups whose rows are pairwise disjoint on one side: rows at i·outer + j·inner
 * (i < m, j < k) lie either group after group or interleaved without touching.
 */
function disjoint(inner: number, outer: number, k: number, m: number, w: number): boolean {
  return outer >= (k - 1) * inner + w || inner >= (m - 1) * outer + w
}

/**
 * Compresses `[tensorOffset, hostOffset, bytes]` runs into `[tensorOffset, hostOffset, width,
 * height, tensorPitch, hostPitch]` descriptors (row r of one covers `width` bytes at tensorOffset
 * + r·tensorPitch and hostOffset + r·hostPitch), issued in order, with exactly the copies the
 * runs describe:
 * 1. zero-length runs are dropped and runs contiguous on both sides merged (as copyBatch does);
 * 2. consecutive runs of one width whose offsets advance by constant pitches (each ≥ the width,
 *    < 2^31) become one descriptor; a run that fits no pattern is one of height 1 (pitches = width);
 * 3. consecutive descriptors of one shape whose starts advance by constant deltas (a 3-D
 *    pattern, as HND-packed heads × tokens) are transposed when that gives fewer of them and
 *    their rows do not overlap on either side (so their order cannot matter);
 * 4. descriptors of fewer than {@link MIN_ROWS} rows are split back into their runs.
 * A malformed run (negative, fractional, NaN) is kept alone and unmerged, for the addon to refuse.
 */
export function stridedCopies(runs: ArrayLike<number>): Float64Array {
  // A chunk's runs are the same for every layer (chunkRuns freezes them): built once, not per layer.
  const frozen = stableRuns(runs)
  const known = frozen ? made.get(runs as object) : undefined
  if (known !== undefined) return known
  const out = build(runs)
  if (frozen) made.set(runs as object, out)
  return out
}

const made = new WeakMap<object, Float64Array>()

function build(runs: ArrayLike<number>): Float64Array {
  if (runs.length % 3 !== 0)
    throw new RangeError('copy runs must be [tensorOffset, hostOffset, bytes] triples')
  // 1 and 2: the host path's row sets (once per chunk for chunkRuns' frozen runs).
  const c = rowsOf(runs)
  if (!c.valid) return alone(runs)
  const d = c.rows
  const F = STRIDED_FIELDS
  let count = d.length / F
  let rows = 0
  for (let o = 3; o < d.length; o += F) rows += d[o]!
  // cudaMemcpy2D's pitch limit: a taller set with a pitch past it goes back to its rows.
  let out = d
  for (let o = 0; o < d.length; o += F) {
    if (d[o + 3]! > 1 && !pitchFits(d[o + 4]!, d[o + 5]!, d[o + 2]!)) {
      out = splitWide(d)
      count = out.length / F
      break
    }
  }
  return transpose(out, count, rows)
}

/** Row sets with a pitch past cudaMemcpy2D's limit as height-1 rows; the others as they are. */
function splitWide(d: Float64Array): Float64Array {
  const F = STRIDED_FIELDS
  const out: number[] = []
  for (let o = 0; o < d.length; o += F) {
    const [t, h, w, height, pt, ph] = [d[o]!, d[o + 1]!, d[o + 2]!, d[o + 3]!, d[o + 4]!, d[o + 5]!]
    if (height === 1 || pitchFits(pt, ph, w)) out.push(t, h, w, height, pt, ph)
    else for (let r = 0; r < height; r++) out.push(t + r * pt, h + r * ph, w, 1, w, w)
  }
  return Float64Array.from(out)
}

/**
 * A list with a malformed run (negative, fractional, NaN): sound runs merged where contiguous,
 * each malformed one alone and unmerged, every one of height 1, for the addon to refuse.
 */
function alone(runs: ArrayLike<number>): Float64Array {
  const out: number[] = []
  let last = false
  for (let i = 0; i < runs.length; i += 3) {
    const [t, h, w] = [runs[i]!, runs[i + 1]!, runs[i + 2]!]
    if (w === 0) continue
    const good = sound(t, h, w)
    const o = out.length - STRIDED_FIELDS
    if (good && last && out[o]! + out[o + 2]! === t && out[o + 1]! + out[o + 2]! === h) {
      out[o + 2]! += w
      out[o + 4] = out[o + 2]!
      out[o + 5] = out[o + 2]!
      continue
    }
    out.push(t, h, w, 1, w, w)
    last = good
  }
  return Float64Array.from(out)
}

/**
 * Step 3 of {@link stridedCopies} (`d` holds `count` descriptors covering `rows` runs), and the
 * last: descriptors shorter than {@link MIN_ROWS} go back to one per row.
 */
function transpose(d: Float64Array, count: number, rows: number): Float64Array {
  const F = STRIDED_FIELDS
  const out = new Float64Array(rows * F) // at most one descriptor per run
  let n = 0
  const write = (dt: number, dh: number, w: number, height: number, pt: number, ph: number) => {
    const o = n++ * F
    out[o] = dt
    out[o + 1] = dh
    out[o + 2] = w
    out[o + 3] = height
    out[o + 4] = pt
    out[o + 5] = ph
  }
  const put = (dt: number, dh: number, w: number, height: number, pt: number, ph: number) => {
    if (height >= MIN_ROWS || height === 1) write(dt, dh, w, height, pt, ph)
    else for (let r = 0; r < height; r++) write(dt + r * pt, dh + r * ph, w, 1, w, w)
  }
  const keep = (a: number) => put(d[a]!, d[a + 1]!, d[a + 2]!, d[a + 3]!, d[a + 4]!, d[a + 5]!)
  const same = (a: number, b: number) =>
    d[a + 2] === d[b + 2] && d[a + 3] === d[b + 3] && d[a + 4] === d[b + 4] && d[a + 5] === d[b + 5]
  for (let i = 0; i < count; ) {
    const a = i * F
    const k = d[a + 3]! // rows per descriptor
    let j = i + 1
    if (k < 2 || j >= count || !same(a, j * F)) {
      keep(a)
      i++
      continue
    }
    const DT = d[j * F]! - d[a]!
    const DH = d[j * F + 1]! - d[a + 1]!
    while (
      j < count &&
      same(a, j * F) &&
      d[j * F]! - d[(j - 1) * F]! === DT &&
      d[j * F + 1]! - d[(j - 1) * F + 1]! === DH
    )
      j++
    const groups = j - i
    const width = d[a + 2]!
    const pt = d[a + 4]!
    const ph = d[a + 5]!
    if (
      k < groups &&
      pitchFits(DT, DH, width) &&
      disjoint(pt, DT, k, groups, width) &&
      disjoint(ph, DH, k, groups, width)
    ) {
      for (let r = 0; r < k; r++) put(d[a]! + r * pt, d[a + 1]! + r * ph, width, groups, DT, DH)
    } else {
      for (let g = i; g < j; g++) keep(g * F)
    }
    i = j
  }
  return out.subarray(0, n * F)
}
