// Measurement: bits by effect. How much each layer's K and V error moves the model's next-token
// distribution (measured on the calibration windows: text the model writes itself, never the
// held-out stories), and the per-layer, per-stream error targets that minimise bytes for the
// same predicted effect, judged with the quality protocol of docs/codec.md on the held-out
// windows against today's every-layer-alike targets at the same level.
//
// Sensitivity: w[l][s] = mean KL(p_exact ‖ p_perturbed) / ε², with only stream s of layer l
// quantised (uniform step, relative error ε at today's q3 target; KL is quadratic in small
// perturbations). Allocation (reverse water-filling with one bit per halving of error):
// ε[l][s] = sqrt(D / (2L · w[l][s])), D = Σ w·ε_today², i.e. every stream contributes equally.
// KVGATE_QUALITY (3), KVGATE_CHUNK (256), KVGATE_SCALES (1,1.2,1.4: D multipliers tried).

import { decodeChunk, encodeChunk, type LayerTargets, layerTargets } from '../src/codec/node.ts'
import { decodeElements, encodeElements } from '../src/core/dtype.ts'
import { headerBytesFor } from '../src/core/format.ts'
import type { KvGeometry } from '../src/core/layout.ts'
import {
  argmax,
  attentionOutputError,
  exportChunk,
  findSharedData,
  HELD_OUT_STORIES,
  type KvCacheState,
  loadStories260k,
  type PreparedWindow,
  prepareWindows,
  protocolWindows,
  type RoundTrip,
  roundTripCache,
  runProtocol,
  sampledWindows,
  type Transformer,
} from '../src/model/index.ts'
import { chunkInfo } from './lib/chunk-info.ts'
import { centredRms, channelGains, queryEnergy, shapeK } from './lib/query-energy.ts'

const QUALITY = Number(process.env.KVGATE_QUALITY ?? 3)
const CHUNK = Number(process.env.KVGATE_CHUNK ?? 256)
const SCALES = (process.env.KVGATE_SCALES ?? '1,1.2,1.4').split(',').map(Number)
const PREFIXES = [256, 384]
const SHAPE_SCALES = (process.env.KVGATE_SHAPE_SCALES ?? '1,1.2').split(',').map(Number)

function resume(t: Transformer, cache: KvCacheState, prefix: number[]) {
  const c = cache.clone()
  c.truncate(prefix.length - 1)
  const logits = new Float32Array(t.config.vocabSize)
  t.step(prefix.at(-1)!, c, logits)
  return { cache: c, logits }
}

function logSoftmax(x: Float32Array): Float64Array {
  let m = Number.NEGATIVE_INFINITY
  for (const v of x) if (v > m) m = v
  let s = 0
  for (const v of x) s += Math.exp(v - m)
  const ls = Math.log(s)
  return Float64Array.from(x, (v) => v - m - ls)
}

/** Mean KL(exact ‖ decoded) of the next-token distribution, teacher-forced on the exact greedy continuation. */
function meanKl(
  t: Transformer,
  prefix: number[],
  exact: KvCacheState,
  decoded: KvCacheState,
  n: number,
): number {
  const e = resume(t, exact, prefix)
  const d = resume(t, decoded, prefix)
  let kl = 0
  for (let j = 0; j < n; j++) {
    const le = logSoftmax(e.logits)
    const ld = logSoftmax(d.logits)
    for (let i = 0; i < le.length; i++) kl += Math.exp(le[i]!) * (le[i]! - ld[i]!)
    const tok = argmax(e.logits)
    if (j + 1 < n) {
      t.step(tok, e.cache, e.logits)
      t.step(tok, d.cache, d.logits)
    }
  }
  return kl / n
}

/** Uniform quantisation of one plane (T×C) at relative error eps (K: against its channel-centred RMS). */
function quantisePlane(x: Float32Array, c: number, eps: number, centred: boolean): void {
  const t = x.length / c
  const mean = new Float64Array(c)
  for (let i = 0; i < x.length; i++) mean[i % c]! += x[i]! / t
  let ss = 0
  for (let i = 0; i < x.length; i++) ss += (centred ? x[i]! - mean[i % c]! : x[i]!) ** 2
  const step = eps * Math.sqrt(12) * Math.sqrt(ss / x.length)
  for (let i = 0; i < x.length; i++) x[i] = Math.round(x[i]! / step) * step
}

/** A round trip that quantises only stream `kind` of layer `layer`. */
function perturbOne(layer: number, kind: 0 | 1, eps: number): RoundTrip {
  return (tensor, info) => {
    const g = info.geometry
    const x = decodeElements(tensor, g.dtype)
    const c = g.kvHeads * g.headDim
    const plane = info.tokens * c
    const p = x.subarray((2 * layer + kind) * plane, (2 * layer + kind + 1) * plane)
    quantisePlane(p, c, eps, kind === 0)
    return encodeElements(x, g.dtype)
  }
}

/** kvgate with its own targets per layer: each layer coded as a one-layer chunk (bytes: sections + one header). */
function perLayer(targets: LayerTargets[], kGain?: Float64Array[]): RoundTrip {
  return (tensor, info) => {
    const g = info.geometry
    const g1: KvGeometry = { ...g, layers: 1 }
    const slab = tensor.length / g.layers
    const out = new Uint8Array(tensor.length)
    let bytes = 0
    for (let l = 0; l < g.layers; l++) {
      if (kGain) {
        bytes += shapedLayer(
          tensor.subarray(l * slab, (l + 1) * slab),
          out.subarray(l * slab, (l + 1) * slab),
          g1,
          info,
          targets[l]!,
          kGain[l]!,
        )
        continue
      }
      const meta = chunkInfo(g1, info.tokens, info.chunkIndex)
      const obj = encodeChunk(tensor.subarray(l * slab, (l + 1) * slab), meta, {
        mode: 'kvgate',
        errorTargets: targets[l]!,
      })
      out.set(decodeChunk(obj), l * slab)
      bytes += obj.byteLength
    }
    // One header for all layers, as a whole-chunk object has.
    return { decoded: out, encodedBytes: bytes - g.layers * headerBytesFor(1) + headerBytesFor(g.layers) }
  }
}

/**
 * K with per-channel steps Δ/g_c (simulated: K scaled by g_c, coded with one step, unscaled),
 * at the step that keeps Σ_c w_c·δ_c² (the logit error's variance) today's (shapeK). The
 * channel step codes (1 byte per K channel, the format's flag 1) are counted.
 */
function shapedLayer(
  slab: Uint8Array,
  out: Uint8Array,
  g1: KvGeometry,
  info: { tokens: number; chunkIndex: number },
  t: LayerTargets,
  gain: Float64Array,
): number {
  const c = g1.kvHeads * g1.headDim
  const x = decodeElements(slab, 'fp16')
  const plane = info.tokens * c
  const kErr = shapeK(x, plane, c, t.kError, gain)
  const meta = chunkInfo(g1, info.tokens, info.chunkIndex)
  const obj = encodeChunk(encodeElements(x, 'fp16'), meta, {
    mode: 'kvgate',
    errorTargets: { kError: kErr, vError: t.vError },
  })
  const d = decodeElements(decodeChunk(obj), 'fp16')
  for (let i = 0; i < plane; i++) d[i]! /= gain[i % c]!
  out.set(encodeElements(d, 'fp16'))
  return obj.byteLength + c
}

function klOver(t: Transformer, windows: PreparedWindow[], rt: RoundTrip): number {
  let s = 0
  let n = 0
  for (const w of windows)
    for (const p of PREFIXES) {
      const r = roundTripCache(w.cache, rt, { tokens: p, chunkTokens: CHUNK, dtype: 'fp16' })
      s += meanKl(t, w.tokens.slice(0, p), w.cache, r.decoded, w.tokens.length - p + 1)
      n++
    }
  return s / n
}

const data = findSharedData()
if (!data.paths) throw new Error(`stories260K needed: ${data.reason}`)
const { transformer, tokenizer } = loadStories260k(data.paths)
const seqLen = transformer.config.seqLen
const L = transformer.config.layers
const held = prepareWindows(transformer, protocolWindows(tokenizer, HELD_OUT_STORIES, seqLen, 8))
const cal = prepareWindows(transformer, sampledWindows(transformer, tokenizer, 4, seqLen))
const today = layerTargets(QUALITY, 0, L)
const eps0 = [today.kError, today.vError]

// 1. Sensitivities on the calibration windows.
const w: number[][] = []
for (
  let l = 0;
  l < (process.env.KVGATE_ONLY_SHAPE === '1' || process.env.KVGATE_MODE !== undefined ? 0 : L);
  l++
) {
  w.push(([0, 1] as const).map((k) => klOver(transformer, cal, perturbOne(l, k, eps0[k]!)) / eps0[k]! ** 2))
}
console.log(
  `q${QUALITY}, ${CHUNK}-token chunks; today's targets K ${eps0[0]!.toFixed(4)}, V ${eps0[1]!.toFixed(4)} in every layer`,
)
console.log("sensitivity w = KL / ε² (calibration windows), and KL at today's targets:")
for (let l = 0; l < w.length; l++)
  console.log(
    `  layer ${l}: K ${w[l]![0]!.toExponential(3)} (KL ${(w[l]![0]! * eps0[0]! ** 2).toExponential(2)}), V ${w[l]![1]!.toExponential(3)} (KL ${(w[l]![1]! * eps0[1]! ** 2).toExponential(2)})`,
  )
const D = w.reduce((a, x) => a + x[0]! * eps0[0]! ** 2 + x[1]! * eps0[1]! ** 2, 0)

function allocation(scale: number, kvOnly: boolean): LayerTargets[] {
  if (kvOnly) {
    // Only K vs V rebalanced (every layer alike): w summed over layers.
    const wk = w.reduce((a, x) => a + x[0]!, 0)
    const wv = w.reduce((a, x) => a + x[1]!, 0)
    const e = (ws: number) => Math.sqrt((scale * D) / (2 * ws))
    return Array.from({ length: L }, () => ({ kError: e(wk), vError: e(wv) }))
  }
  const e = (ws: number) => Math.sqrt((scale * D) / (2 * L * ws))
  return w.map((x) => ({ kError: e(x[0]!), vError: e(x[1]!) }))
}

// 2. Judge on the held-out windows.
const kGain = channelGains(queryEnergy(transformer, cal))
const configs: { name: string; targets: LayerTargets[]; shape?: boolean }[] = [
  { name: `today q${QUALITY} (every layer alike)`, targets: Array.from({ length: L }, () => today) },
]
for (const s of SCALES)
  configs.push({ name: `per layer + K/V by effect, D×${s}`, targets: allocation(s, false) })
for (const s of SCALES.slice(0, 2))
  configs.push({ name: `K/V by effect only, D×${s}`, targets: allocation(s, true) })
for (const s of SHAPE_SCALES)
  configs.push({
    name: `K channel steps by query energy, logit error ×${s}`,
    targets: Array.from({ length: L }, () => ({ kError: today.kError * s, vError: today.vError })),
    shape: true,
  })
if (process.env.KVGATE_ONLY_SHAPE === '1') configs.splice(1, configs.length - 1 - SHAPE_SCALES.length)
if (process.env.KVGATE_MODE !== undefined) configs.length = 0
let baseBytes = 0
if (configs.length)
  console.log(
    '| targets | bytes vs today | agreement | ppl Δ | mean KL (held-out) | targets K / V per layer |',
  )
if (configs.length) console.log('|---|---|---|---|---|---|')
for (const c of configs) {
  const rt = perLayer(c.targets, c.shape ? kGain : undefined)
  const r = runProtocol(transformer, held, rt, { chunkTokens: CHUNK, prefixes: PREFIXES })
  if (baseBytes === 0) baseBytes = r.encodedBytes
  const kl = klOver(transformer, held, rt)
  console.log(
    `| ${c.name} | ${(r.encodedBytes / baseBytes).toFixed(4)} | ${(100 * r.agreement.mean).toFixed(2)} ± ${(100 * r.agreement.se).toFixed(2)} % | ${(100 * r.pplChange.mean).toFixed(2)} ± ${(100 * r.pplChange.se).toFixed(2)} % | ${kl.toExponential(3)} | ${c.targets.map((t) => `${t.kError.toFixed(3)}/${t.vError.toFixed(3)}`).join(' ')} |`,
  )
}

// 3. (KVGATE_MODE=combined) The K/V split from measured sensitivities of the streams as they
// would be coded (K with or without channel steps by query energy), every layer alike, and the
// overall scale set so that the calibration windows' KL equals today's there (bisection on
// calibration text only); then judged on the held-out windows.
if (process.env.KVGATE_MODE === 'combined') {
  const allLayers =
    (kind: 0 | 1, eps: number, shaped: boolean): RoundTrip =>
    (tensor, info) => {
      const g = info.geometry
      const x = decodeElements(tensor, g.dtype)
      const c = g.kvHeads * g.headDim
      const plane = info.tokens * c
      for (let l = 0; l < g.layers; l++) {
        const p = x.subarray((2 * l + kind) * plane, (2 * l + kind + 1) * plane)
        if (kind === 0 && shaped) {
          // Same as shapedLayer: step Δ·sqrt(AM(g²)) on K·g, then unscaled.
          const gain = kGain[l]!
          quantisePlane(p, c, shapeK(p, plane, c, eps, gain), true)
          for (let i = 0; i < plane; i++) p[i]! /= gain[i % c]!
        } else quantisePlane(p, c, eps, kind === 0)
      }
      return encodeElements(x, g.dtype)
    }
  const todayRt = perLayer(Array.from({ length: L }, () => today))
  const klCalToday = klOver(transformer, cal, todayRt)
  const heldToday = runProtocol(transformer, held, todayRt, { chunkTokens: CHUNK, prefixes: PREFIXES })
  const klHeldToday = klOver(transformer, held, todayRt)
  console.log(
    `today: calibration KL ${klCalToday.toExponential(3)}, held-out KL ${klHeldToday.toExponential(3)}, agreement ${(100 * heldToday.agreement.mean).toFixed(2)} ± ${(100 * heldToday.agreement.se).toFixed(2)} %`,
  )
  console.log(
    '| K coding | sensitivity K / V (KL/ε², cal) | εK / εV | bytes vs today | agreement | ppl Δ | held-out KL vs today |',
  )
  console.log('|---|---|---|---|---|---|---|')
  for (const shaped of [false, true]) {
    const wk = klOver(transformer, cal, allLayers(0, eps0[0]!, shaped)) / eps0[0]! ** 2
    const wv = klOver(transformer, cal, allLayers(1, eps0[1]!, false)) / eps0[1]! ** 2
    const ratio = Math.sqrt(wv / wk) // εK / εV for equal contributions
    const rt = (m: number) => {
      const t = { kError: ratio * m, vError: m }
      return perLayer(
        Array.from({ length: L }, () => t),
        shaped ? kGain : undefined,
      )
    }
    let lo = 0.05
    let hi = 0.6
    for (let i = 0; i < 9; i++) {
      const mid = Math.sqrt(lo * hi)
      if (klOver(transformer, cal, rt(mid)) <= klCalToday) lo = mid
      else hi = mid
    }
    const r = runProtocol(transformer, held, rt(lo), { chunkTokens: CHUNK, prefixes: PREFIXES })
    const kl = klOver(transformer, held, rt(lo))
    console.log(
      `| ${shaped ? 'channel steps by query energy' : 'one step (today)'} | ${wk.toExponential(3)} / ${wv.toExponential(3)} | ${(ratio * lo).toFixed(4)} / ${lo.toFixed(4)} | ${(r.encodedBytes / heldToday.encodedBytes).toFixed(4)} | ${(100 * r.agreement.mean).toFixed(2)} ± ${(100 * r.agreement.se).toFixed(2)} % | ${(100 * r.pplChange.mean).toFixed(2)} ± ${(100 * r.pplChange.se).toFixed(2)} % | ${(kl / klHeldToday).toFixed(3)} |`,
    )
  }
}

// 4. (KVGATE_MODE=equalkl) Bytes at equal held-out KL: each allocation's overall scale is
// bisected until the held-out windows' mean KL is just at or below today's (a comparison at
// equal quality, as the benchmark compares with the reference at equal error; the allocations
// themselves come from the calibration windows), then the protocol is run at that scale.
if (process.env.KVGATE_MODE === 'equalkl') {
  const todayRt = perLayer(Array.from({ length: L }, () => today))
  const base = runProtocol(transformer, held, todayRt, { chunkTokens: CHUNK, prefixes: PREFIXES })
  const klToday = klOver(transformer, held, todayRt)
  // Per-layer sensitivities (as section 1, recomputed here) for the per-layer allocation.
  const wl: number[][] = []
  for (let l = 0; l < L; l++)
    wl.push(
      ([0, 1] as const).map((k) => klOver(transformer, cal, perturbOne(l, k, eps0[k]!)) / eps0[k]! ** 2),
    )
  const perLayerShape = (m: number) =>
    wl.map((x) => ({ kError: m / Math.sqrt(x[0]!), vError: m / Math.sqrt(x[1]!) }))
  const allocations: { name: string; rt: (m: number) => RoundTrip; m0: number }[] = [
    {
      name: 'today (every layer alike, σ = 5 split)',
      rt: (m) =>
        perLayer(Array.from({ length: L }, () => ({ kError: today.kError * m, vError: today.vError * m }))),
      m0: 1,
    },
    {
      name: 'K channel steps by query energy (σ = 5 split)',
      rt: (m) =>
        perLayer(
          Array.from({ length: L }, () => ({ kError: today.kError * m, vError: today.vError * m })),
          kGain,
        ),
      m0: 1,
    },
    { name: 'per layer and K/V by KL sensitivity', rt: (m) => perLayer(perLayerShape(m)), m0: 0.005 },
    {
      name: 'per layer and K/V by KL sensitivity + K channel steps',
      rt: (m) => perLayer(perLayerShape(m), kGain),
      m0: 0.005,
    },
  ]
  console.log(
    `today: held-out KL ${klToday.toExponential(3)}, agreement ${(100 * base.agreement.mean).toFixed(2)} ± ${(100 * base.agreement.se).toFixed(2)} %`,
  )
  console.log(
    '| allocation | scale | bytes vs today at equal held-out KL | agreement | ppl Δ | KL vs today |',
  )
  console.log('|---|---|---|---|---|---|')
  for (const a of allocations) {
    let lo = a.m0 / 2
    let hi = a.m0 * 2
    for (let i = 0; i < 8; i++) {
      const mid = Math.sqrt(lo * hi)
      if (klOver(transformer, held, a.rt(mid)) <= klToday) lo = mid
      else hi = mid
    }
    const r = runProtocol(transformer, held, a.rt(lo), { chunkTokens: CHUNK, prefixes: PREFIXES })
    const kl = klOver(transformer, held, a.rt(lo))
    console.log(
      `| ${a.name} | ${lo.toPrecision(4)} | ${(r.encodedBytes / base.encodedBytes).toFixed(4)} | ${(100 * r.agreement.mean).toFixed(2)} ± ${(100 * r.agreement.se).toFixed(2)} % | ${(100 * r.pplChange.mean).toFixed(2)} ± ${(100 * r.pplChange.se).toFixed(2)} % | ${(kl / klToday).toFixed(3)} |`,
    )
  }
}

// 5. (KVGATE_MODE=tokens) Per-token steps by attention received. A V error δv_t reaches a
// query's output as a_t·δv_t, so with independent errors the output error's variance is
// Σ_t a_t²·δv_t²: tokens that receive little attention can take coarser steps. The weights
// come from the queries the engine had when it computed the chunk (positions < the chunk's
// end; the queries that will read it later are unknown): w_t = Σ_heads mean_q a_{q,t}² over
// q ∈ [t, end), shrunk towards the chunk's mean (4 pseudo-queries). Steps Δ/g_t,
// g_t = sqrt(w_t / GM(w)) clamped to 1/16..16 (the format's token step codes, flag 2),
// at the step that keeps Σ w_t·δ_t² today's; side information 2 bits per token and layer.
if (process.env.KVGATE_MODE === 'tokens') {
  const cfg = transformer.config
  const hd = cfg.dim / cfg.heads
  const group = cfg.heads / cfg.kvHeads
  const C = cfg.kvHeads * hd
  const windowOf = (tensor: Uint8Array, start: number, tokens: number) => {
    const probe = tensor.subarray(0, Math.min(tensor.length, 2 * C * tokens))
    for (const w of held) {
      const e = exportChunk(w.cache, start, start + tokens, 'fp16')
      if (e.subarray(0, probe.length).every((b, i) => b === probe[i])) return w
    }
    throw new Error('chunk of no held-out window')
  }
  /** Row gains of chunk [s, e) in layer l from the window's own queries q < e. */
  const tokenGains = (w: PreparedWindow, l: number, s: number, e: number): Float64Array => {
    const kv = decodeElements(exportChunk(w.cache, 0, e, 'fp16'), 'fp16')
    const plane = e * C
    const K = kv.subarray(2 * l * plane, (2 * l + 1) * plane)
    const q = w.queries[l]!
    const sum = new Float64Array(e - s)
    const sc = new Float64Array(e)
    for (let pos = s; pos < e; pos++)
      for (let h = 0; h < cfg.heads; h++) {
        const g = Math.floor(h / group)
        let m = Number.NEGATIVE_INFINITY
        for (let t = 0; t <= pos; t++) {
          let d = 0
          for (let i = 0; i < hd; i++) d += q[pos * cfg.dim + h * hd + i]! * K[t * C + g * hd + i]!
          sc[t] = d / Math.sqrt(hd)
          if (sc[t]! > m) m = sc[t]!
        }
        let z = 0
        for (let t = 0; t <= pos; t++) z += Math.exp(sc[t]! - m)
        for (let t = s; t <= pos; t++) sum[t - s]! += (Math.exp(sc[t]! - m) / z) ** 2
      }
    const n = e - s
    const mean = sum.reduce((a, x, i) => a + x / (e - s - i), 0) / n
    const wts = sum.map((x, i) => (x + 4 * mean) / (e - s - i + 4))
    const gm = Math.exp(wts.reduce((a, x) => a + Math.log(x), 0) / n)
    return wts.map((x) => Math.min(16, Math.max(1 / 16, Math.sqrt(x / gm))))
  }
  const rms = (x: Float32Array) => Math.sqrt(x.reduce((a, v) => a + v * v, 0) / x.length)
  const tokenShaped =
    (targets: LayerTargets, which: 'v' | 'kv'): RoundTrip =>
    (tensor, info) => {
      const w = windowOf(tensor, info.start, info.tokens)
      const g = info.geometry
      const g1: KvGeometry = { ...g, layers: 1 }
      const slab = tensor.length / g.layers
      const plane = info.tokens * C
      const out = new Uint8Array(tensor.length)
      let bytes = 0
      for (let l = 0; l < g.layers; l++) {
        const gain = tokenGains(w, l, info.start, info.start + info.tokens)
        let am = 0
        for (const v of gain) am += v * v
        am /= gain.length
        const x = decodeElements(tensor.subarray(l * slab, (l + 1) * slab), 'fp16')
        const k = x.subarray(0, plane)
        const v = x.subarray(plane)
        const dv = targets.vError * rms(v)
        const dk = targets.kError * centredRms(k, C)
        for (let i = 0; i < plane; i++) v[i]! *= gain[Math.floor(i / C)]!
        const vErr = (dv * Math.sqrt(am)) / rms(v)
        let kErr = targets.kError
        if (which === 'kv') {
          for (let i = 0; i < plane; i++) k[i]! *= gain[Math.floor(i / C)]!
          kErr = (dk * Math.sqrt(am)) / centredRms(k, C)
        }
        const meta = chunkInfo(g1, info.tokens, info.chunkIndex)
        const obj = encodeChunk(encodeElements(x, 'fp16'), meta, {
          mode: 'kvgate',
          errorTargets: { kError: kErr, vError: vErr },
        })
        const d = decodeElements(decodeChunk(obj), 'fp16')
        for (let i = 0; i < plane; i++) {
          d[plane + i]! /= gain[Math.floor(i / C)]!
          if (which === 'kv') d[i]! /= gain[Math.floor(i / C)]!
        }
        out.set(encodeElements(d, 'fp16'), l * slab)
        bytes += obj.byteLength + Math.ceil(info.tokens / 4)
      }
      return { decoded: out, encodedBytes: bytes - g.layers * headerBytesFor(1) + headerBytesFor(g.layers) }
    }
  const todayRt = perLayer(Array.from({ length: L }, () => today))
  const base = runProtocol(transformer, held, todayRt, { chunkTokens: CHUNK, prefixes: PREFIXES })
  const klToday = klOver(transformer, held, todayRt)
  console.log(
    `today: held-out KL ${klToday.toExponential(3)}, agreement ${(100 * base.agreement.mean).toFixed(2)} ± ${(100 * base.agreement.se).toFixed(2)} %`,
  )
  console.log('| token steps | scale | bytes vs today | agreement | ppl Δ | KL vs today |')
  console.log('|---|---|---|---|---|---|')
  const scaled = (m: number) => ({ kError: today.kError * m, vError: today.vError * m })
  for (const which of ['v', 'kv'] as const) {
    const at = (m: number) => tokenShaped(scaled(m), which)
    for (const m of [1]) {
      const r = runProtocol(transformer, held, at(m), { chunkTokens: CHUNK, prefixes: PREFIXES })
      const kl = klOver(transformer, held, at(m))
      console.log(
        `| ${which}, at today's weighted error | ${m} | ${(r.encodedBytes / base.encodedBytes).toFixed(4)} | ${(100 * r.agreement.mean).toFixed(2)} ± ${(100 * r.agreement.se).toFixed(2)} % | ${(100 * r.pplChange.mean).toFixed(2)} ± ${(100 * r.pplChange.se).toFixed(2)} % | ${(kl / klToday).toFixed(3)} |`,
      )
    }
  }
}

// 6. (KVGATE_MODE=atterr) Per-layer K/V budgets from the protocol's attention-output error:
// s[l][k] = (layer l's attention-output error with only stream k of layer l quantised at ε0) / ε0
// on the calibration windows, and ε[l][k] = m / s[l][k] (every stream's contribution to the
// attention-output error equal: today's rule with each layer's own measured logit spread in place
// of σ = 5), m bisected to today's held-out KL as in section 4.
if (process.env.KVGATE_MODE === 'atterr') {
  const s: number[][] = []
  for (let l = 0; l < L; l++) {
    s.push(
      ([0, 1] as const).map((k) => {
        let a = 0
        for (const w of cal) {
          const r = roundTripCache(w.cache, perturbOne(l, k, eps0[k]!), { chunkTokens: CHUNK, dtype: 'fp16' })
          a += attentionOutputError(transformer, w.cache, r.decoded, w.queries, { stride: 8 }).perLayer[l]!
        }
        return a / cal.length / eps0[k]!
      }),
    )
    console.log(
      `layer ${l}: attention-output error per unit error: K ${s[l]![0]!.toFixed(3)} (σ_l), V ${s[l]![1]!.toFixed(3)}`,
    )
  }
  const todayRt = perLayer(Array.from({ length: L }, () => today))
  const base = runProtocol(transformer, held, todayRt, { chunkTokens: CHUNK, prefixes: PREFIXES })
  const klToday = klOver(transformer, held, todayRt)
  const alloc = (m: number) => s.map((x) => ({ kError: m / x[0]!, vError: m / x[1]! }))
  const m0 = Math.sqrt(s.reduce((a, x) => a + (x[0]! * eps0[0]!) ** 2 + (x[1]! * eps0[1]!) ** 2, 0) / (2 * L))
  console.log(
    '| allocation | scale | bytes vs today at equal held-out KL | agreement | ppl Δ | KL vs today | targets K / V per layer |',
  )
  console.log('|---|---|---|---|---|---|---|')
  for (const [name, shaped] of [
    ['per layer and K/V by attention-output error', false],
    ['the same + K channel steps by query energy', true],
  ] as const) {
    const rt = (m: number) => perLayer(alloc(m), shaped ? kGain : undefined)
    let lo = m0 / 2
    let hi = m0 * 2
    for (let i = 0; i < 8; i++) {
      const mid = Math.sqrt(lo * hi)
      if (klOver(transformer, held, rt(mid)) <= klToday) lo = mid
      else hi = mid
    }
    const r = runProtocol(transformer, held, rt(lo), { chunkTokens: CHUNK, prefixes: PREFIXES })
    const kl = klOver(transformer, held, rt(lo))
    console.log(
      `| ${name} | ${(lo / m0).toPrecision(4)} | ${(r.encodedBytes / base.encodedBytes).toFixed(4)} | ${(100 * r.agreement.mean).toFixed(2)} ± ${(100 * r.agreement.se).toFixed(2)} % | ${(100 * r.pplChange.mean).toFixed(2)} ± ${(100 * r.pplChange.se).toFixed(2)} % | ${(kl / klToday).toFixed(3)} | ${alloc(
        lo,
      )
        .map((t) => `${t.kError.toFixed(3)}/${t.vError.toFixed(3)}`)
        .join(' ')} |`,
    )
  }
}

// 7. (KVGATE_MODE=rdcurve) The same allocations compared on their rate–KL curves instead of one
// bisected point (KL wiggles with the scale by a few %): each at 5 scales around its equal-KL
// point, log KL fitted linearly in log bytes, and the bytes each fit needs at today's held-out KL.
// KVGATE_ALLOCS picks allocations by index (default all).
if (process.env.KVGATE_MODE === 'rdcurve') {
  const ws: number[][] = []
  const sa: number[][] = []
  for (let l = 0; l < L; l++) {
    ws.push(
      ([0, 1] as const).map((k) => klOver(transformer, cal, perturbOne(l, k, eps0[k]!)) / eps0[k]! ** 2),
    )
    sa.push(
      ([0, 1] as const).map((k) => {
        let a = 0
        for (const w of cal) {
          const r = roundTripCache(w.cache, perturbOne(l, k, eps0[k]!), { chunkTokens: CHUNK, dtype: 'fp16' })
          a += attentionOutputError(transformer, w.cache, r.decoded, w.queries, { stride: 8 }).perLayer[l]!
        }
        return a / cal.length / eps0[k]!
      }),
    )
  }
  const alike = (m: number) =>
    Array.from({ length: L }, () => ({ kError: today.kError * m, vError: today.vError * m }))
  // Each allocation normalised so that m = 1 is near today's held-out KL (the equal-KL scales of sections 4 and 6).
  const byKl = (m: number) =>
    ws.map((x) => ({ kError: (0.0078 * m) / Math.sqrt(x[0]!), vError: (0.0078 * m) / Math.sqrt(x[1]!) }))
  const m0 = Math.sqrt(
    sa.reduce((a, x) => a + (x[0]! * eps0[0]!) ** 2 + (x[1]! * eps0[1]!) ** 2, 0) / (2 * L),
  )
  const byAtt = (m: number) =>
    sa.map((x) => ({ kError: (0.9 * m0 * m) / x[0]!, vError: (0.9 * m0 * m) / x[1]! }))
  const allocs: { name: string; rt: (m: number) => RoundTrip }[] = [
    { name: 'today (every layer alike, σ = 5)', rt: (m) => perLayer(alike(m)) },
    { name: 'K channel steps by query energy', rt: (m) => perLayer(alike(0.94 * m), kGain) },
    { name: 'per layer and K/V by KL sensitivity', rt: (m) => perLayer(byKl(m)) },
    { name: 'per layer/K-V by KL + K channel steps', rt: (m) => perLayer(byKl(0.96 * m), kGain) },
    { name: 'per layer/K-V by attention-output error', rt: (m) => perLayer(byAtt(m)) },
    {
      name: 'per layer/K-V by attention error + K channel steps',
      rt: (m) => perLayer(byAtt(0.9 * m), kGain),
    },
  ]
  const pick = (process.env.KVGATE_ALLOCS ?? '0,1,2,3,4,5').split(',').map(Number)
  const klToday = klOver(transformer, held, perLayer(alike(1)))
  let bytesToday = 0
  for (const w of held)
    bytesToday += roundTripCache(w.cache, perLayer(alike(1)), { chunkTokens: CHUNK, dtype: 'fp16' })
      .encodedBytes!
  console.log(`today q${QUALITY}: held-out KL ${klToday.toExponential(3)}, bytes ${bytesToday}`)
  console.log(
    "| allocation | (bytes vs today, KL vs today) at 5 scales | fitted slope d ln KL / d ln bytes | bytes at today's KL (fit) |",
  )
  console.log('|---|---|---|---|')
  for (const i of pick) {
    const a = allocs[i]!
    const pts: [number, number][] = []
    for (const m of [0.8, 0.9, 1, 1.1, 1.25]) {
      let bytes = 0
      for (const w of held)
        bytes += roundTripCache(w.cache, a.rt(m), { chunkTokens: CHUNK, dtype: 'fp16' }).encodedBytes!
      pts.push([Math.log(bytes / bytesToday), Math.log(klOver(transformer, held, a.rt(m)) / klToday)])
    }
    const mx = pts.reduce((s, p) => s + p[0], 0) / pts.length
    const my = pts.reduce((s, p) => s + p[1], 0) / pts.length
    const slope =
      pts.reduce((s, p) => s + (p[0] - mx) * (p[1] - my), 0) / pts.reduce((s, p) => s + (p[0] - mx) ** 2, 0)
    const atToday = Math.exp(mx - my / slope)
    console.log(
      `| ${a.name} | ${pts.map((p) => `(${Math.exp(p[0]).toFixed(3)}, ${Math.exp(p[1]).toFixed(3)})`).join(' ')} | ${slope.toFixed(2)} | ${atToday.toFixed(4)} |`,
    )
  }
}
