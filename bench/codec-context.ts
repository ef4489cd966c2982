// Measurement: what other entropy models of kvgate's quantized residuals would cost, on the
// residuals the codec itself produces (bench/lib/kvgate-streams.ts: encode, parse, decode +
// requantise). Nothing here changes the codec; each candidate is bits of the same symbols.
//
// Two regimes per candidate:
// - own:  the chunk carries its tables (11-bit, LEB128 as the format writes them): today's
//         uncalibrated objects. Bits = Σ n·(11 − log2 f) + table bytes.
// - cal:  the tables come from a namespace calibration (trained here on the calibration
//         windows' chunks at the same error targets, add-α smoothed), cross-entropy on the
//         held-out chunks; the calibration's extra table bytes are reported apart.
// Contexts are functions of already-decoded residual magnitudes, normalised by the class's
// mean |r| (which the decoder knows from the class's table), bucketed at the quantiles of a
// unit-mean exponential (the magnitude law of a Laplacian residual): no per-model tuning.
//
// KVGATE_QUALITY (default 3), KVGATE_CHUNKS (default 256,64), KVGATE_SYNTH=1 adds the 8B shape.

import { layerTargets } from '../src/codec/index.ts'
import { decodeElements, encodeElements } from '../src/core/dtype.ts'
import type { KvGeometry } from '../src/core/layout.ts'
import {
  exportChunk,
  findSharedData,
  HELD_OUT_STORIES,
  loadStories260k,
  prepareWindows,
  protocolWindows,
  sampledWindows,
  syntheticKv,
} from '../src/model/index.ts'
import {
  ALPHABET,
  type ChunkStreams,
  chunkStreams,
  type StreamLevels,
  symbolOf,
  zigzag,
} from './lib/kvgate-streams.ts'
import { channelGains, queryEnergy, shapeK } from './lib/query-energy.ts'

const QUALITY = Number(process.env.KVGATE_QUALITY ?? 3)
const CHUNKS = (process.env.KVGATE_CHUNKS ?? '256,64')
  .split(',')
  .map(Number)
  .filter((n) => n > 0)
const ALPHA = 0.05

// ---- per-stream symbol data ---------------------------------------------------------------

interface Sym {
  layer: number
  kind: 0 | 1
  t: number
  c: number
  headDim: number
  sym: Uint8Array
  extra: number
  /** |r| */
  mag: Float32Array
  z: Uint32Array
  lv: StreamLevels
}

function symsOf(lv: StreamLevels, layer: number, kind: 0 | 1, headDim: number): Sym {
  const n = lv.t * lv.c
  const sym = new Uint8Array(n)
  const mag = new Float32Array(n)
  const z = new Uint32Array(n)
  let extra = 0
  for (let i = 0; i < n; i++) {
    const zz = zigzag(lv.r[i]!)
    const s = symbolOf(zz)
    sym[i] = s.sym
    extra += s.extra
    mag[i] = Math.abs(lv.r[i]!)
    z[i] = zz
  }
  return { layer, kind, t: lv.t, c: lv.c, headDim, sym, extra, mag, z, lv }
}

/** 8 fine classes by rank of each channel's total bit length (the codec's ranking, unsampled). */
function fineClasses(streams: Sym[], c: number): Uint8Array {
  const cost = new Float64Array(c)
  for (const s of streams) for (let i = 0; i < s.z.length; i++) cost[i % c]! += 32 - Math.clz32(s.z[i]!)
  const order = [...cost.keys()].sort((a, b) => cost[a]! - cost[b]! || a - b)
  const kmax = Math.min(8, 2 ** Math.floor(Math.log2(c)))
  const fine = new Uint8Array(c)
  order.forEach((ch, r) => {
    fine[ch] = Math.floor((r * kmax) / c)
  })
  return fine
}

// ---- contexts --------------------------------------------------------------------------------

/** Quantiles of a unit-mean exponential: 2 buckets at the median, 3 at the terciles, 4 at the quartiles. */
const EXP_Q: Record<number, number[]> = {
  1: [],
  2: [Math.LN2],
  3: [Math.log(1.5), Math.log(3)],
  4: [Math.log(4 / 3), Math.LN2, Math.log(4)],
}
const bucket = (v: number, th: number[]) => {
  let b = 0
  while (b < th.length && v > th[b]!) b++
  return b
}

/** a[i] = |r[i]| / the class's mean |r| (scale). */
type Norm = Float32Array
interface Context {
  name: string
  buckets: number
  /** Needs symbols of the same row decoded before it (breaks the 8-lane interleave). */
  serial: boolean
  /** Per-row side bits (a signalled activity class). */
  rowSide?: number
  /** Bucket of every symbol of the stream. */
  of(s: Sym, a: Norm, rowClass?: Uint8Array): Uint8Array
}

function byValue(
  name: string,
  buckets: number,
  serial: boolean,
  v: (a: Norm, t: number, ch: number, c: number, rowPrev: Float64Array, rowSoFar: number) => number,
): Context {
  return {
    name,
    buckets,
    serial,
    of(s, a) {
      const { t, c } = s
      const out = new Uint8Array(t * c)
      const rowMean = new Float64Array(t)
      for (let tt = 0; tt < t; tt++) {
        let m = 0
        for (let ch = 0; ch < c; ch++) m += a[tt * c + ch]!
        rowMean[tt] = m / c
      }
      const th = EXP_Q[buckets]!
      for (let tt = 0; tt < t; tt++) {
        let so = 0
        for (let ch = 0; ch < c; ch++) {
          const runMean = ch > 0 ? so / ch : tt > 0 ? rowMean[tt - 1]! : 1
          out[tt * c + ch] = bucket(v(a, tt, ch, c, rowMean, runMean), th)
          so += a[tt * c + ch]!
        }
      }
      return out
    },
  }
}

const prev = (a: Norm, t: number, ch: number, c: number) => (t > 0 ? a[(t - 1) * c + ch]! : 1)
const left = (a: Norm, t: number, ch: number, c: number) => (ch > 0 ? a[t * c + ch - 1]! : 1)
const prevNb = (a: Norm, t: number, ch: number, c: number) =>
  t > 0 ? (a[(t - 1) * c + Math.max(0, ch - 1)]! + a[(t - 1) * c + Math.min(c - 1, ch + 1)]!) / 2 : 1
const rowPrev = (_a: Norm, t: number, _ch: number, _c: number, rp: Float64Array) => (t > 0 ? rp[t - 1]! : 1)

const rowSoFar = (_a: Norm, _t: number, _ch: number, _c: number, _rp: Float64Array, so: number) => so

function contexts(): Context[] {
  const out: Context[] = [byValue('today (classes only)', 1, false, () => 0)]
  if (process.env.KVGATE_FEW === '1') {
    out.push(byValue('prev token |r|, 4', 4, false, prev))
    out.push(byValue('left channel |r| (same token), 4', 4, true, left))
    out.push(byValue('row so far mean |r|, 4', 4, true, rowSoFar))
    return out
  }
  for (const b of [2, 4]) {
    out.push(byValue(`prev token |r|, ${b}`, b, false, prev))
    out.push(byValue(`left channel |r| (same token), ${b}`, b, true, left))
    out.push(byValue(`prev token's neighbours |r|, ${b}`, b, false, prevNb))
    out.push(byValue(`prev row mean |r|, ${b}`, b, false, rowPrev))
    out.push(byValue(`row so far mean |r|, ${b}`, b, true, rowSoFar))
    out.push(
      byValue(`prev token + prev nbrs + prev row, ${b}`, b, false, (a, t, ch, c, rp) =>
        t > 0 ? 0.5 * prev(a, t, ch, c) + 0.25 * prevNb(a, t, ch, c) + 0.25 * rp[t - 1]! : 1,
      ),
    )
    out.push(
      byValue(
        `prev token + left + row so far, ${b}`,
        b,
        true,
        (a, t, ch, c, _rp, so) => (prev(a, t, ch, c) + left(a, t, ch, c) + so) / 3,
      ),
    )
  }
  // Signalled per-row activity class (the encoder knows the row): row mean |r| bucketed at
  // the stream's quartiles (own) or the calibration's (cal); 2 bits per row.
  for (const b of [2, 4]) {
    out.push({
      name: `signalled row class, ${b} (+${Math.log2(b)} bits/row)`,
      buckets: b,
      serial: false,
      rowSide: Math.log2(b),
      of(s, _a, rowClass) {
        const out = new Uint8Array(s.t * s.c)
        for (let tt = 0; tt < s.t; tt++) out.fill(rowClass![tt]!, tt * s.c, (tt + 1) * s.c)
        return out
      },
    })
  }
  return out
}

// ---- costs ------------------------------------------------------------------------------------

const lebBytes = (v: number) => (v < 128 ? 1 : v < 16384 ? 2 : 3)

/** The codec's table: 11-bit frequencies, every seen symbol ≥ 1. */
function normalise(counts: Uint32Array | Float64Array, off: number): { f: Int32Array; max: number } {
  let n = 0
  let max = -1
  for (let s = 0; s < ALPHABET; s++) {
    n += counts[off + s]!
    if (counts[off + s]! > 0) max = s
  }
  const f = new Int32Array(ALPHABET)
  if (n === 0) return { f, max }
  let sum = 0
  let big = 0
  for (let s = 0; s < ALPHABET; s++) {
    const c = counts[off + s]!
    if (c > 0) f[s] = Math.max(1, Math.round((c * 2048) / n))
    sum += f[s]!
    if (f[s]! > f[big]!) big = s
  }
  f[big]! += 2048 - sum
  if (f[big]! < 1) {
    // Many rare symbols: take from the largest ones until the sum fits.
    let over = 1 - f[big]!
    f[big] = 1
    while (over > 0) {
      let b = 0
      for (let s = 0; s < ALPHABET; s++) if (f[s]! > f[b]!) b = s
      f[b]! -= 1
      over--
    }
  }
  return { f, max }
}

/** Bits of coding `counts` (groups × ALPHABET) with their own tables, + the tables' bytes. */
function ownCost(counts: Uint32Array, groups: number): number {
  let bits = 0
  for (let g = 0; g < groups; g++) {
    const { f, max } = normalise(counts, g * ALPHABET)
    let tb = 1
    for (let s = 0; s <= max; s++) {
      tb += lebBytes(f[s]!)
      const n = counts[g * ALPHABET + s]!
      if (n > 0) bits += n * (11 - Math.log2(f[s]!))
    }
    bits += 8 * (max < 0 ? 2 : tb)
  }
  return bits
}

interface CalModel {
  classOf: Uint8Array
  /** scale per class */
  scale: Float64Array
  /** per context: counts (classes × buckets × ALPHABET) */
  counts: Map<string, Float64Array>
  /** per signalled-row context: its row-activity thresholds */
  rowTh: Map<string, number[]>
}

function normed(s: Sym, classOf: Uint8Array, scale: Float64Array): Norm {
  const a = new Float32Array(s.mag.length)
  for (let i = 0; i < a.length; i++) a[i] = s.mag[i]! / scale[classOf[i % s.c]!]!
  return a
}

function classScale(s: Sym[], classOf: Uint8Array, k: number): Float64Array {
  const sum = new Float64Array(k)
  const n = new Float64Array(k)
  for (const x of s)
    for (let i = 0; i < x.mag.length; i++) {
      sum[classOf[i % x.c]!]! += x.mag[i]!
      n[classOf[i % x.c]!]! += 1
    }
  return sum.map((v, i) => Math.max(v / Math.max(n[i]!, 1), 0.05))
}

function rowActivity(s: Sym, a: Norm): Float64Array {
  const r = new Float64Array(s.t)
  for (let tt = 0; tt < s.t; tt++) {
    let m = 0
    for (let ch = 0; ch < s.c; ch++) m += a[tt * s.c + ch]!
    r[tt] = m / s.c
  }
  return r
}
const quantiles = (xs: Float64Array, b: number) => {
  const v = [...xs].sort((x, y) => x - y)
  return Array.from({ length: b - 1 }, (_, i) => v[Math.floor(((i + 1) * v.length) / b)]!)
}
const rowClasses = (act: Float64Array, th: number[]) => Uint8Array.from(act, (v) => bucket(v, th))

/** Own-table bits of one stream under context `cx`, best of 1/2/4/8 merged classes (+ class map). */
function ownStreamBits(s: Sym, cx: Context): number {
  const fine = fineClasses([s], s.c)
  let best = Number.POSITIVE_INFINITY
  for (let k = 1; k <= 8 && k <= s.c; k *= 2) {
    const shift = Math.log2(8 / k)
    const cls = Uint8Array.from(fine, (f) => f >> shift)
    const scale = classScale([s], cls, k)
    const a = normed(s, cls, scale)
    const rc = cx.rowSide
      ? rowClasses(rowActivity(s, a), quantiles(rowActivity(s, a), cx.buckets))
      : undefined
    const b = cx.of(s, a, rc)
    const counts = new Uint32Array(k * cx.buckets * ALPHABET)
    for (let i = 0; i < s.sym.length; i++)
      counts[(cls[i % s.c]! * cx.buckets + b[i]!) * ALPHABET + s.sym[i]!]! += 1
    const bits = ownCost(counts, k * cx.buckets) + (k > 1 ? 8 * s.c : 0) + (cx.rowSide ?? 0) * s.t
    best = Math.min(best, bits)
  }
  return best + s.extra
}

function trainCal(train: Sym[], cx: Context, c: number): CalModel {
  const classOf = fineClasses(train, c)
  const scale = classScale(train, classOf, 8)
  const counts = new Float64Array(8 * cx.buckets * ALPHABET)
  let rowTh: number[] = []
  if (cx.rowSide) {
    const all: number[] = []
    for (const s of train) all.push(...rowActivity(s, normed(s, classOf, scale)))
    rowTh = quantiles(Float64Array.from(all), cx.buckets)
  }
  for (const s of train) {
    const a = normed(s, classOf, scale)
    const b = cx.of(s, a, cx.rowSide ? rowClasses(rowActivity(s, a), rowTh) : undefined)
    for (let i = 0; i < s.sym.length; i++)
      counts[(classOf[i % c]! * cx.buckets + b[i]!) * ALPHABET + s.sym[i]!]! += 1
  }
  return { classOf, scale, counts: new Map([[cx.name, counts]]), rowTh: new Map([[cx.name, rowTh]]) }
}

function calStreamBits(s: Sym, cx: Context, m: CalModel): number {
  const counts = m.counts.get(cx.name)!
  const a = normed(s, m.classOf, m.scale)
  const b = cx.of(s, a, cx.rowSide ? rowClasses(rowActivity(s, a), m.rowTh.get(cx.name)!) : undefined)
  // Cost tables: −log2 p per (group, symbol), smoothed.
  const groups = 8 * cx.buckets
  const lp = new Float64Array(groups * ALPHABET)
  for (let g = 0; g < groups; g++) {
    let n = 0
    for (let x = 0; x < ALPHABET; x++) n += counts[g * ALPHABET + x]!
    for (let x = 0; x < ALPHABET; x++)
      lp[g * ALPHABET + x] = -Math.log2((counts[g * ALPHABET + x]! + ALPHA) / (n + ALPHA * ALPHABET))
  }
  let bits = 0
  for (let i = 0; i < s.sym.length; i++)
    bits += lp[(m.classOf[i % s.c]! * cx.buckets + b[i]!) * ALPHABET + s.sym[i]!]!
  return bits + s.extra + (cx.rowSide ?? 0) * s.t
}

/** Bytes the calibration's tables would take for this context (per layer/stream: 8 classes × buckets, 17 steps). */
function calTableBytes(m: CalModel, cx: Context): number {
  const counts = m.counts.get(cx.name)!
  let bytes = 0
  for (let g = 0; g < 8 * cx.buckets; g++) {
    const { f, max } = normalise(counts, g * ALPHABET)
    bytes += 1
    for (let s = 0; s <= max; s++) bytes += lebBytes(f[s]!)
  }
  return bytes * 17
}

// ---- joint pairs ------------------------------------------------------------------------------

/** Partner channel of `ch` in a pair scheme, or −1 when `ch` is the first of its pair. */
type Pairing = (ch: number, headDim: number) => number
const adjacent: Pairing = (ch) => (ch & 1 ? ch - 1 : -1)
const rotateHalf: Pairing = (ch, hd) => (ch % hd >= hd / 2 ? ch - hd / 2 : -1)

/**
 * Joint coding of a pair = the second symbol coded given the first exactly (chain rule).
 * Cal regime: tables per (layer, stream, class, partner symbol capped at CAP − 1).
 */
const CAP = 24
function pairContext(pairing: Pairing, label: string): Context {
  return {
    name: `joint pairs (${label})`,
    buckets: CAP + 1,
    serial: true,
    of(s) {
      const out = new Uint8Array(s.t * s.c)
      for (let tt = 0; tt < s.t; tt++)
        for (let ch = 0; ch < s.c; ch++) {
          const p = pairing(ch, s.headDim)
          out[tt * s.c + ch] = p < 0 ? CAP : Math.min(CAP - 1, s.sym[tt * s.c + p]!)
        }
      return out
    },
  }
}

/**
 * Mutual information of pair partners' symbols (capped at 16 values), plug-in over every
 * held-out chunk of a layer's stream pooled (≥ 16k pairs: bias < 0.01 bit), as a share of
 * the pair's coded bits: the most a joint pair alphabet could save over two singles.
 */
function pairInformation(held: Sym[][][]) {
  const cap = 16
  for (const [label, pairing] of [
    ['adjacent', adjacent],
    ['rotate-half', rotateHalf],
  ] as const) {
    let mi = 0
    let bits = 0
    for (const lk of held)
      for (const ss of lk) {
        const joint = new Float64Array(cap * cap)
        let n = 0
        for (const s of ss) {
          for (let t = 0; t < s.t; t++)
            for (let ch = 0; ch < s.c; ch++) {
              const p = pairing(ch, s.headDim)
              if (p < 0) continue
              joint[
                Math.min(cap - 1, s.sym[t * s.c + p]!) * cap + Math.min(cap - 1, s.sym[t * s.c + ch]!)
              ]! += 1
              n++
            }
        }
        const pa = new Float64Array(cap)
        const pb = new Float64Array(cap)
        for (let i = 0; i < cap; i++)
          for (let j = 0; j < cap; j++) {
            pa[i]! += joint[i * cap + j]! / n
            pb[j]! += joint[i * cap + j]! / n
          }
        for (let i = 0; i < cap; i++)
          for (let j = 0; j < cap; j++) {
            const pij = joint[i * cap + j]! / n
            if (pij > 0) mi += n * pij * Math.log2(pij / (pa[i]! * pb[j]!))
          }
        for (const s of ss) bits += ownStreamBits(s, contexts()[0]!)
      }
    console.log(
      `  pair information (${label} partners, symbols capped at ${cap}): ${((100 * mi) / bits).toFixed(2)} % of today's bits`,
    )
  }
}

/** Plug-in entropy (bits per sample) with the Miller–Madow correction, of a count map. */
function entropyMm(counts: Map<number, number>): { bits: number; n: number } {
  let n = 0
  for (const v of counts.values()) n += v
  let h = 0
  for (const v of counts.values()) h -= (v / n) * Math.log2(v / n)
  return { bits: n * (h + (counts.size - 1) / (2 * n * Math.LN2)), n }
}

/**
 * The pair helper's design (KVGATE_PART=pairs): b raw low bits per value and the high parts
 * h = z >> b of two channels coded as one symbol, against two single symbols (no split), per
 * (layer, stream, class of the pair's first channel), pooled over the held-out chunks.
 */
function pairDesign(d: Dataset) {
  const { held } = prepared(d)
  console.log(
    `${d.name}: pair symbols with b raw low bits vs today's singles (entropies, pooled per layer/stream/class)`,
  )
  console.log('| pairing | b | K | V | all |')
  console.log('|---|---|---|---|---|')
  for (const [label, pairing] of [
    ['adjacent', adjacent],
    ['rotate-half', rotateHalf],
  ] as const) {
    for (const b of [0, 1, 2, 3]) {
      const single = [0, 0]
      const pair = [0, 0]
      for (const lk of held)
        lk.forEach((ss, kind) => {
          const cls = fineClasses(ss, ss[0]!.c)
          const s1 = new Map<number, Map<number, number>>()
          const s2 = new Map<number, Map<number, number>>()
          const add = (m: Map<number, Map<number, number>>, k: number, v: number) => {
            const x = m.get(k) ?? new Map<number, number>()
            x.set(v, (x.get(v) ?? 0) + 1)
            m.set(k, x)
          }
          for (const s of ss)
            for (let t = 0; t < s.t; t++)
              for (let ch = 0; ch < s.c; ch++) {
                const z = s.z[t * s.c + ch]!
                add(s1, cls[ch]!, z)
                const p = pairing(ch, s.headDim)
                if (p < 0) continue
                const zp = s.z[t * s.c + p]!
                add(s2, cls[p]!, (zp >>> b) * 65536 + (z >>> b))
                pair[kind]! += 2 * b
              }
          for (const m of s1.values()) single[kind]! += entropyMm(m).bits
          for (const m of s2.values()) pair[kind]! += entropyMm(m).bits
        })
      const pct = (a: number, x: number) => `${((a / x - 1) * 100).toFixed(2)} %`
      console.log(
        `| ${label} | ${b} | ${pct(pair[0]!, single[0]!)} | ${pct(pair[1]!, single[1]!)} | ${pct(pair[0]! + pair[1]!, single[0]! + single[1]!)} |`,
      )
    }
  }
}

// ---- run ---------------------------------------------------------------------------------------

interface Dataset {
  name: string
  g: KvGeometry
  held: ChunkStreams[]
  train: ChunkStreams[]
  rawBytes: number
}

/** KVGATE_TARGETS=kError,vError overrides the level's targets (every layer alike). */
const TARGETS = process.env.KVGATE_TARGETS
  ? (([k, v]) => ({ kError: k!, vError: v! }))(process.env.KVGATE_TARGETS.split(',').map(Number))
  : undefined
/** KVGATE_SHAPE=1: K coded with per-channel steps by query energy (simulated by scaling; +C bytes per K stream). */
let kGains: Float64Array[] | undefined

/** KVGATE_LAYER_TARGETS=k0/v0,k1/v1,…: per-layer targets (bench/codec-layer-budget.ts's allocations). */
const LAYER_TARGETS = process.env.KVGATE_LAYER_TARGETS?.split(',').map((kv) =>
  (([k, v]) => ({ kError: k!, vError: v! }))(kv.split('/').map(Number)),
)

function collect(chunks: Uint8Array[], g: KvGeometry, tokens: number): ChunkStreams[] {
  const t0 = TARGETS ?? layerTargets(QUALITY, 0, g.layers)
  const tl = (l: number) => LAYER_TARGETS?.[l] ?? t0
  if (!kGains) return chunks.map((t) => chunkStreams(t, g, tokens, LAYER_TARGETS ?? t0))
  const c = g.kvHeads * g.headDim
  const plane = tokens * c
  return chunks.map((t) => {
    const x = decodeElements(t, 'fp16')
    const targets = Array.from({ length: g.layers }, (_, l) => ({
      kError: shapeK(x.subarray(2 * l * plane, (2 * l + 2) * plane), plane, c, tl(l).kError, kGains![l]!),
      vError: tl(l).vError,
    }))
    const cs = chunkStreams(encodeElements(x, 'fp16'), g, tokens, targets)
    return { ...cs, objectBytes: cs.objectBytes + g.layers * c }
  })
}

function streamsOf(cs: ChunkStreams[], g: KvGeometry): Sym[][][] {
  // [layer][kind][chunk]
  const out: Sym[][][] = Array.from({ length: g.layers }, () => [[], []])
  for (const c of cs)
    c.streams.forEach((lk, l) => {
      lk.forEach((lv, k) => {
        out[l]![k]!.push(symsOf(lv, l, k as 0 | 1, g.headDim))
      })
    })
  return out
}

/** A data set's symbols ([layer][kind][chunk]) and the held-out objects' coded bytes. */
function prepared(d: Dataset) {
  let tablesPayload = 0
  for (const x of d.held)
    for (const lk of x.streams)
      for (const lv of lk) tablesPayload += lv.tableBytes + lv.payloadBytes + lv.escapeBytes
  return {
    held: streamsOf(d.held, d.g),
    train: streamsOf(d.train, d.g),
    c: d.g.kvHeads * d.g.headDim,
    objBytes: d.held.reduce((a, x) => a + x.objectBytes, 0),
    /** Tables + rANS payload + escape bits: the part an entropy model replaces. */
    tablesPayload,
  }
}

function evaluate(d: Dataset) {
  const { held, train, c, objBytes, tablesPayload } = prepared(d)
  // Check: bits with the stream's own parsed tables vs its payload; today's estimate vs tables + payload.
  let parsedBits = 0
  let payload = 0
  for (const lk of held)
    for (const ss of lk)
      for (const s of ss) {
        const lv = s.lv
        for (let i = 0; i < s.sym.length; i++) {
          const f = lv.tables[lv.classOf[i % s.c]!]![s.sym[i]!]
          if (!f) throw new Error(`symbol ${s.sym[i]} has no frequency: levels do not match the codec's`)
          parsedBits += 11 - Math.log2(f)
        }
        payload += lv.payloadBytes - 4 - 32
      }
  console.log(
    `${d.name}: ${d.held.length} held-out chunks, object bytes ${objBytes}, ratio ${(d.rawBytes / objBytes).toFixed(3)}×; rANS payload ${payload} B vs Σ −log2 p with its own tables ${(parsedBits / 8).toFixed(0)} B (${((payload * 8) / parsedBits - 1) * 100 >= 0 ? '+' : ''}${(((payload * 8) / parsedBits - 1) * 100).toFixed(2)} %)`,
  )
  const cxs = [
    ...contexts(),
    pairContext(adjacent, 'adjacent channels'),
    pairContext(rotateHalf, 'rotate-half partners'),
  ]
  const rows: string[] = []
  let baseOwn = 0
  let baseCal = 0
  let baseCalTables = 0
  for (const cx of cxs) {
    let own = 0
    let cal = 0
    let calTables = 0
    for (let l = 0; l < d.g.layers; l++)
      for (const k of [0, 1]) {
        const m = trainCal(train[l]![k]!, cx, c)
        calTables += calTableBytes(m, cx)
        for (const s of held[l]![k]!) {
          if (cx.buckets <= 8) own += ownStreamBits(s, cx)
          cal += calStreamBits(s, cx, m)
        }
      }
    const ownB = own / 8 + 4 * held.length // escape-length fields ≈ unchanged; keep the overheads equal
    const calB = cal / 8
    if (cx.name.startsWith('today')) {
      baseOwn = ownB
      baseCal = calB
      baseCalTables = calTables
      console.log(
        `  today's estimate (own tables) ${ownB.toFixed(0)} B vs the codec's tables + payload + escapes ${tablesPayload} B (${((ownB / tablesPayload - 1) * 100).toFixed(2)} %)`,
      )
    }
    // Whole-object ratios: replace the coded part by the estimate, keeping heads (step, modes, centres).
    const rest = objBytes - tablesPayload
    const ownRatio = d.rawBytes / (rest + (tablesPayload * ownB) / baseOwn)
    const calShare = (calTables * d.held.length) / 1000 // calibration shared by 1,000 chunks
    const calRatio = d.rawBytes / (rest - 0 + (tablesPayload * calB) / baseOwn + calShare)
    rows.push(
      `| ${cx.name} | ${cx.serial ? 'serial' : 'row-parallel'} | ${cx.buckets <= 8 ? `${((ownB / baseOwn - 1) * 100).toFixed(2)} %` : '—'} | ${((calB / baseCal - 1) * 100).toFixed(2)} % | ${cx.buckets <= 8 ? `${ownRatio.toFixed(3)}×` : '—'} | ${calRatio.toFixed(3)}× | ${(calTables / 1024).toFixed(0)} KiB (${((calTables / baseCalTables) * 1).toFixed(1)}×) |`,
    )
  }
  pairInformation(held)
  console.log(
    '| context | decode | own tables: bits vs today | calibrated: bits vs today | ratio (own) | ratio (cal, tables ÷ 1,000 chunks) | calibration tables |',
  )
  console.log('|---|---|---|---|---|---|---|')
  for (const r of rows) console.log(r)
}

// ---- linear prediction on levels ----------------------------------------------------------------
//
// r' = r − round(Σ w_j f_j): today's residual predicted from residuals the decoder already has
// (same token, channels before it; or the previous token, any channel). Integer prediction on
// the levels: the decoded tensor is bit-identical to today's, only the symbols change. Weights
// by least squares on the calibration windows (cal regime, free ÷ 1,000 chunks) or on the
// chunk itself and signalled as 2 bytes each (own regime).

interface Predictor {
  name: string
  /** MACs per decoded value */
  macs: string
  /** candidate features of channel ch: [token offset (0 or −1), channel] */
  candidates(ch: number, c: number, hd: number): [number, number][]
  /** how many to keep (greedy forward selection), Infinity = all */
  p: number
}

function solve(a: Float64Array, b: Float64Array, n: number): Float64Array {
  // Cholesky with a small ridge.
  const m = Float64Array.from(a)
  let tr = 0
  for (let i = 0; i < n; i++) tr += m[i * n + i]!
  for (let i = 0; i < n; i++) m[i * n + i]! += 1e-6 * (tr / n) + 1e-9
  const l = new Float64Array(n * n)
  for (let i = 0; i < n; i++)
    for (let j = 0; j <= i; j++) {
      let s = m[i * n + j]!
      for (let k = 0; k < j; k++) s -= l[i * n + k]! * l[j * n + k]!
      l[i * n + j] = i === j ? Math.sqrt(Math.max(s, 1e-12)) : s / l[j * n + j]!
    }
  const y = new Float64Array(n)
  for (let i = 0; i < n; i++) {
    let s = b[i]!
    for (let k = 0; k < i; k++) s -= l[i * n + k]! * y[k]!
    y[i] = s / l[i * n + i]!
  }
  const x = new Float64Array(n)
  for (let i = n - 1; i >= 0; i--) {
    let s = y[i]!
    for (let k = i + 1; k < n; k++) s -= l[k * n + i]! * x[k]!
    x[i] = s / l[i * n + i]!
  }
  return x
}

const feat = (s: Sym, t: number, f: [number, number]) => {
  const tt = t + f[0]
  return tt < 0 ? 0 : s.lv.r[tt * s.c + f[1]]!
}

/** Gram matrix of the candidates and the target (last) over the streams' rows. */
function gram(streams: Sym[], ch: number, fs: [number, number][]): Float64Array {
  const n = fs.length + 1
  const g = new Float64Array(n * n)
  const x = new Float64Array(n)
  for (const s of streams)
    for (let t = 0; t < s.t; t++) {
      for (let i = 0; i < n - 1; i++) x[i] = feat(s, t, fs[i]!)
      x[n - 1] = s.lv.r[t * s.c + ch]!
      for (let i = 0; i < n; i++) for (let j = 0; j <= i; j++) g[i * n + j]! += x[i]! * x[j]!
    }
  for (let i = 0; i < n; i++) for (let j = i + 1; j < n; j++) g[i * n + j] = g[j * n + i]!
  return g
}

/** Least squares from a Gram matrix: weights on candidates `idx`, and the residual SSE. */
function fitGram(g: Float64Array, n: number, idx: number[]): { w: Float64Array; sse: number } {
  const yy = g[n * n - 1]!
  const m = idx.length
  if (m === 0) return { w: new Float64Array(0), sse: yy }
  const a = new Float64Array(m * m)
  const b = new Float64Array(m)
  for (let i = 0; i < m; i++) {
    b[i] = g[idx[i]! * n + n - 1]!
    for (let j = 0; j < m; j++) a[i * m + j] = g[idx[i]! * n + idx[j]!]!
  }
  const w = solve(a, b, m)
  let wb = 0
  for (let i = 0; i < m; i++) wb += w[i]! * b[i]!
  return { w, sse: yy - wb }
}

/** Greedy forward selection of up to p candidates; each must cut ≥ 1 % of the residual energy. */
function selectFit(
  streams: Sym[],
  ch: number,
  cands: [number, number][],
  p: number,
): { fs: [number, number][]; w: Float64Array } {
  const n = cands.length + 1
  const g = gram(streams, ch, cands)
  if (p >= cands.length)
    return {
      fs: cands,
      w: fitGram(
        g,
        n,
        cands.map((_, i) => i),
      ).w,
    }
  const chosen: number[] = []
  let best = fitGram(g, n, chosen).sse
  for (let k = 0; k < p; k++) {
    let pick = -1
    let pickSse = best
    for (let i = 0; i < cands.length; i++) {
      if (chosen.includes(i)) continue
      const e = fitGram(g, n, [...chosen, i]).sse
      if (e < pickSse) {
        pickSse = e
        pick = i
      }
    }
    if (pick < 0 || pickSse > 0.99 * best) break
    chosen.push(pick)
    best = pickSse
  }
  return { fs: chosen.map((i) => cands[i]!), w: fitGram(g, n, chosen).w }
}

interface Plan {
  fs: [number, number][][]
  w: Float64Array[]
}

function planFor(streams: Sym[], pr: Predictor, c: number, hd: number): Plan {
  const fs: [number, number][][] = []
  const w: Float64Array[] = []
  for (let ch = 0; ch < c; ch++) {
    const f = selectFit(streams, ch, pr.candidates(ch, c, hd), pr.p)
    fs.push(f.fs)
    w.push(f.w)
  }
  return { fs, w }
}

/** The stream with residuals r' (a copy: Sym fields recomputed). */
function predicted(s: Sym, plan: Plan): Sym {
  const r = new Int32Array(s.lv.r.length)
  for (let t = 0; t < s.t; t++)
    for (let ch = 0; ch < s.c; ch++) {
      const fs = plan.fs[ch]!
      const w = plan.w[ch]!
      let p = 0
      for (let i = 0; i < fs.length; i++) p += w[i]! * feat(s, t, fs[i]!)
      r[t * s.c + ch] = s.lv.r[t * s.c + ch]! - Math.round(p)
    }
  return symsOf({ ...s.lv, r }, s.layer, s.kind, s.headDim)
}

function predictors(c: number, hd: number): Predictor[] {
  const sameTokenBefore = (ch: number) => Array.from({ length: ch }, (_, j) => [0, j] as [number, number])
  const prevToken = (_ch: number, cc: number) =>
    Array.from({ length: cc }, (_, j) => [-1, j] as [number, number])
  const crossHead = (ch: number) => {
    const out: [number, number][] = []
    for (let j = ch % hd; j < ch; j += hd) out.push([0, j])
    return out
  }
  // A fixed local neighbourhood (any model): the channels just before, the RoPE partner of
  // either convention and the same index in earlier heads (same token); the same channel, its
  // partners and neighbours in the previous token.
  const local = (ch: number, cc: number): [number, number][] => {
    const same = new Set<number>([ch - 1, ch - 2, ch ^ 1, ch % hd >= hd / 2 ? ch - hd / 2 : -1])
    for (let j = ch % hd; j < ch; j += hd) same.add(j)
    const prevT = new Set<number>([ch, ch - 1, ch + 1, ch ^ 1, ch % hd >= hd / 2 ? ch - hd / 2 : ch + hd / 2])
    return [
      ...[...same].filter((j) => j >= 0 && j < ch).map((j) => [0, j] as [number, number]),
      ...[...prevT].filter((j) => j >= 0 && j < cc).map((j) => [-1, j] as [number, number]),
    ]
  }
  const out: Predictor[] = []
  for (const p of [1, 2, 4])
    out.push({ name: `local neighbourhood, best ${p}`, macs: `≤ ${p}`, candidates: local, p })
  if (c > 64) {
    out.push({
      name: 'cross-head, same channel index (heads before)',
      macs: '(H−1)/2',
      candidates: crossHead,
      p: Infinity,
    })
    return out
  }
  if (c <= 64) {
    out.push({
      name: 'same token, all channels before (≈ full KLT)',
      macs: 'C/2',
      candidates: sameTokenBefore,
      p: Infinity,
    })
    out.push({ name: 'previous token, all channels', macs: 'C', candidates: prevToken, p: Infinity })
    out.push({
      name: 'same token before + previous token, all',
      macs: '1.5·C',
      candidates: (ch, cc) => [...sameTokenBefore(ch), ...prevToken(ch, cc)],
      p: Infinity,
    })
  }
  for (const p of [1, 2, 4]) {
    out.push({ name: `same token, best ${p} before`, macs: `≤ ${p}`, candidates: sameTokenBefore, p })
    out.push({
      name: `same token before + previous token, best ${p}`,
      macs: `≤ ${p}`,
      candidates: (ch, cc) => [...sameTokenBefore(ch), ...prevToken(ch, cc)],
      p,
    })
  }
  out.push({
    name: 'cross-head, same channel index (heads before)',
    macs: '(H−1)/2',
    candidates: crossHead,
    p: Infinity,
  })
  return out
}

function predictEvaluate(d: Dataset) {
  const { held: heldS, train: trainS, c, objBytes, tablesPayload } = prepared(d)
  const base = contexts()[0]!
  let baseOwn = 0
  let baseCal = 0
  const baseK = [0, 0]
  for (let l = 0; l < d.g.layers; l++)
    for (const k of [0, 1]) {
      const m = trainCal(trainS[l]![k]!, base, c)
      for (const s of heldS[l]![k]!) {
        const o = ownStreamBits(s, base)
        baseOwn += o
        baseK[k]! += o
        baseCal += calStreamBits(s, base, m)
      }
    }
  console.log(
    `${d.name}: prediction on levels (today: K ${(baseK[0]! / 8).toFixed(0)} B, V ${(baseK[1]! / 8).toFixed(0)} B own-table estimate)`,
  )
  console.log(
    '| predictor | MACs/value | own (chunk-fitted, +2 B/weight): vs today | K / V | cal (calibration-fitted): vs today | K / V | ratio own | ratio cal |',
  )
  console.log('|---|---|---|---|---|---|---|---|')
  const rest = objBytes - tablesPayload
  for (const pr of predictors(c, d.g.headDim)) {
    let own = 0
    let cal = 0
    const ownK = [0, 0]
    const calK = [0, 0]
    const baseCalK = [0, 0]
    for (let l = 0; l < d.g.layers; l++)
      for (const k of [0, 1]) {
        const plan = planFor(trainS[l]![k]!, pr, c, d.g.headDim)
        const trainP = trainS[l]![k]!.map((s) => predicted(s, plan))
        const m = trainCal(trainP, base, c)
        const mb = trainCal(trainS[l]![k]!, base, c)
        for (const s of heldS[l]![k]!) {
          const cb = calStreamBits(predicted(s, plan), base, m)
          cal += cb
          calK[k]! += cb
          baseCalK[k]! += calStreamBits(s, base, mb)
          // own: weights fitted on this chunk alone, each signalled in 2 bytes
          const own1 = planFor([s], pr, c, d.g.headDim)
          const nw = own1.fs.reduce((a, f) => a + f.length, 0)
          const ob = ownStreamBits(predicted(s, own1), base) + 16 * nw
          own += ob
          ownK[k]! += ob
        }
      }
    const pct = (a: number, b: number) => `${((a / b - 1) * 100).toFixed(2)} %`
    const ownRatio = d.rawBytes / (rest + (tablesPayload * own) / baseOwn)
    const calRatio =
      d.rawBytes / (rest + (tablesPayload * cal) / baseOwn + (44 * 1024 * d.held.length) / 1000)
    console.log(
      `| ${pr.name} | ${pr.macs} | ${pct(own, baseOwn)} | ${pct(ownK[0]!, baseK[0]!)} / ${pct(ownK[1]!, baseK[1]!)} | ${pct(cal, baseCal)} | ${pct(calK[0]!, baseCalK[0]!)} / ${pct(calK[1]!, baseCalK[1]!)} | ${ownRatio.toFixed(3)}× | ${calRatio.toFixed(3)}× |`,
    )
  }
}

// ---- run ----
const datasets: Dataset[] = []
const data = findSharedData()
if (!data.paths) throw new Error(`stories260K needed: ${data.reason}`)
const { transformer, tokenizer } = loadStories260k(data.paths)
const seqLen = transformer.config.seqLen
const held = prepareWindows(transformer, protocolWindows(tokenizer, HELD_OUT_STORIES, seqLen, 8))
const cal = prepareWindows(transformer, sampledWindows(transformer, tokenizer, 4, seqLen))
const g16 = held[0]!.cache.geometry('fp16')
if (process.env.KVGATE_SHAPE === '1') kGains = channelGains(queryEnergy(transformer, cal))
for (const chunk of CHUNKS) {
  const cut = (ws: typeof held) =>
    ws.flatMap((w) =>
      Array.from({ length: seqLen / chunk }, (_, i) =>
        exportChunk(w.cache, i * chunk, (i + 1) * chunk, 'fp16'),
      ),
    )
  const h = cut(held)
  datasets.push({
    name: `stories260K q${QUALITY}, ${chunk}-token chunks`,
    g: g16,
    held: collect(h, g16, chunk),
    train: collect(cut(cal), g16, chunk),
    rawBytes: h.reduce((a, x) => a + x.length, 0),
  })
}
if (process.env.KVGATE_SYNTH === '1') {
  const g8: KvGeometry = { layers: 32, kvHeads: 8, headDim: 128, dtype: 'fp16' }
  const mk = (seed: number) =>
    encodeElements(
      decodeElements(syntheticKv({ geometry: { ...g8, dtype: 'bf16' }, tokens: 256, seed }), 'bf16'),
      'fp16',
    )
  const h = [mk(1)]
  datasets.push({
    name: `8B shape q${QUALITY}, 256 tokens`,
    g: g8,
    held: collect(h, g8, 256),
    train: collect([mk(2), mk(3)], g8, 256),
    rawBytes: h[0]!.length,
  })
}
const PART = process.env.KVGATE_PART ?? 'context'
for (const d of datasets) {
  if (PART === 'context') evaluate(d)
  else if (PART === 'pairs') pairDesign(d)
  else predictEvaluate(d)
}
