// Benchmark: the KV codec on real KV (stories260K, when ../shared/data is present)
// and on Llama-3.1-8B-shaped synthetic KV, with the protocol of docs/codec.md: quality
// only inside the model's context (8 windows of held-out text, prefixes 256 and 384,
// mean ± standard error), per-layer K/V rRMSE averaged over layers (pooled beside it),
// 64- and 256-token chunks, reference-cachegen split as LMCache splits it for the model
// (the other split beside it). Wasm encode/decode MB/s (median, one core, 32 MiB chunk).
// kvgate rows are repeated with a namespace calibration object (built from text the model
// writes itself, or from other synthetic chunks of the same model), its bytes counted as
// shared by CAL_CHUNKS chunks (and, beside it, by one chunk).
// Writes bench/results/codec.json and codec.svg.

import {
  buildCalibration,
  type CachegenSplit,
  type Calibration,
  type CodecMode,
  DEFAULT_QUALITY,
  decodeChunk,
  decodeChunkInto,
  encodeChunk,
  LARGE_MODEL_SPLIT,
  type LayerTargets,
  lmcacheSplit,
  openCalibration,
} from '../src/codec/node.ts'
import { decodeElements, encodeElements } from '../src/core/dtype.ts'
import type { KvGeometry } from '../src/core/layout.ts'
import {
  exportChunk,
  findSharedData,
  HELD_OUT_STORIES,
  kvRelativeError,
  loadStories260k,
  type MeanSe,
  prepareWindows,
  protocolWindows,
  type RoundTripInfo,
  roundTripCache,
  runProtocol,
  sampledWindows,
  syntheticKv,
} from '../src/model/index.ts'
import { chunkInfo } from './lib/chunk-info.ts'
import { type BarResult, machineLine, median, table, writeResult } from './lib/stats.ts'
import { barChart, lineChart, stackSvgs, writeSvg } from './lib/svg-chart.ts'

const REPEATS = Number(process.env.KVGATE_BENCH_REPEATS ?? 7)
const WINDOWS = Number(process.env.KVGATE_BENCH_WINDOWS ?? 8)
const PREFIXES = [256, 384]
const CHUNKS = [64, 256]
/** Chunks stored per namespace over which a calibration object's bytes are counted. */
const CAL_CHUNKS = Number(process.env.KVGATE_BENCH_CAL_CHUNKS ?? 1000)
/** Windows of model-written text the real model's calibration is built from. */
const CAL_WINDOWS = 4

interface Config {
  label: string
  mode: CodecMode
  quality?: number
  split?: CachegenSplit
  targets?: LayerTargets
  calibration?: Calibration
}

const REF_LABEL = 'reference-cachegen'
const REF_OTHER_LABEL = 'reference-cachegen (other split)'
const CONFIGS: Config[] = [
  { label: 'raw', mode: 'raw' },
  { label: 'lossless', mode: 'lossless' },
  { label: `kvgate (default q${DEFAULT_QUALITY})`, mode: 'kvgate', quality: DEFAULT_QUALITY },
  { label: 'q8', mode: 'q8' },
  { label: REF_LABEL, mode: 'reference-cachegen' },
]
const LEVELS = [1, 2, 3, 4, 5, 6, 7, 8, 9]

interface Row {
  dataset: string
  chunkTokens: number
  label: string
  mode: CodecMode
  quality?: number
  bytes: number
  rawBytes: number
  ratio: number
  vsReference?: number
  /** Per-layer rRMSE averaged over layers. */
  kErr: number
  vErr: number
  kPooled: number
  vPooled: number
  kLayer: number[]
  vLayer: number[]
  attention?: number
  agreement?: MeanSe
  agreementPositions?: number
  pplChange?: MeanSe
  encodeMBps?: number
  decodeMBps?: number
  /** Calibrated rows: the calibration object's size; bytes and ratio count it as shared by CAL_CHUNKS chunks. */
  calibrationBytes?: number
  /** Calibrated rows: chunk bytes alone. */
  chunkBytes?: number
  /** Calibrated rows: ratio with the whole calibration charged to one chunk. */
  ratioOneChunk?: number
}

/** A calibrated row's bytes with the calibration's share for `chunks` chunks (of CAL_CHUNKS). */
function withCalibration(r: Row, cal: Calibration | undefined, chunks: number): Row {
  if (!cal) return r
  const share = (cal.bytes.length * chunks) / CAL_CHUNKS
  return {
    ...r,
    calibrationBytes: cal.bytes.length,
    chunkBytes: r.bytes,
    bytes: r.bytes + share,
    ratio: r.rawBytes / (r.bytes + share),
    ratioOneChunk: r.rawBytes / chunks / (r.bytes / chunks + cal.bytes.length),
  }
}
const calibrated = (c: Config, calibration: Calibration): Config => ({
  ...c,
  label: `${c.label}, calibrated`,
  calibration,
})

const encodeOpts = (c: Config) => ({
  mode: c.mode,
  quality: c.quality,
  cachegenSplit: c.split,
  errorTargets: c.targets,
  calibration: c.calibration,
})
const MATCHED_LABEL = 'kvgate at reference error'

interface Storage {
  bytes: number
  kErr: number
  vErr: number
}

/**
 * kvgate's error targets at which its per-layer-average K and V errors are just ≤ the
 * reference's: a bisection in log space per stream (K and V are coded independently).
 */
function matchTargets(storage: (t: LayerTargets) => Storage, refK: number, refV: number): LayerTargets {
  let k = [1e-4, 4]
  let v = [1e-4, 4]
  for (let i = 0; i < 14; i++) {
    const t = { kError: Math.sqrt(k[0]! * k[1]!), vError: Math.sqrt(v[0]! * v[1]!) }
    const s = storage(t)
    k = s.kErr <= refK ? [t.kError, k[1]!] : [k[0]!, t.kError]
    v = s.vErr <= refV ? [t.vError, v[1]!] : [v[0]!, t.vError]
  }
  return { kError: k[0]!, vError: v[0]! }
}

function roundTrip(c: Config) {
  return (t: Uint8Array, info: RoundTripInfo) => {
    const obj = encodeChunk(t, chunkInfo(info.geometry, info.tokens, info.chunkIndex), encodeOpts(c))
    return { decoded: decodeChunk(obj, { calibration: c.calibration }), encodedBytes: obj.byteLength }
  }
}

// ---- real model ----------------------------------------------------------------
const rows: Row[] = []
const data = findSharedData()
let realLayers = 0
if (data.paths) {
  const { transformer, tokenizer } = loadStories260k(data.paths)
  const seqLen = transformer.config.seqLen
  realLayers = transformer.config.layers
  const windows = prepareWindows(transformer, protocolWindows(tokenizer, HELD_OUT_STORIES, seqLen, WINDOWS))
  // Calibration text: the model's own sampled stories, never the held-out ones.
  const calWindows = prepareWindows(transformer, sampledWindows(transformer, tokenizer, CAL_WINDOWS, seqLen))
  const evalConfig = (c: Config, chunkTokens: number): Row => {
    const r = runProtocol(transformer, windows, roundTrip(c), { chunkTokens, prefixes: PREFIXES })
    return withCalibration(
      {
        dataset: 'stories260K',
        chunkTokens,
        label: c.label,
        mode: c.mode,
        quality: c.quality,
        bytes: r.encodedBytes,
        rawBytes: r.rawBytes,
        ratio: r.ratio,
        kErr: r.kMean,
        vErr: r.vMean,
        kPooled: r.kPooled,
        vPooled: r.vPooled,
        kLayer: r.kLayer,
        vLayer: r.vLayer,
        attention: r.attention,
        agreement: r.agreement,
        agreementPositions: r.agreementPositions,
        pplChange: r.pplChange,
      },
      c.calibration,
      (WINDOWS * seqLen) / chunkTokens,
    )
  }
  const other =
    lmcacheSplit(realLayers).k === LARGE_MODEL_SPLIT.k ? { k: realLayers, v: realLayers } : LARGE_MODEL_SPLIT
  console.error(
    `real model: ${WINDOWS} windows of ${seqLen} tokens (context ${seqLen}), prefixes ${PREFIXES.join(' and ')}, agreement and perplexity at positions prefix..${seqLen - 1}; chunks ${CHUNKS.join(' and ')} tokens (fp16 KV)`,
  )
  const storage = (c: Config, chunkTokens: number): Storage => {
    const pairs: { exact: Uint8Array; decoded: Uint8Array }[] = []
    let bytes = 0
    for (const w of windows) {
      const rt = roundTripCache(w.cache, roundTrip(c), { chunkTokens, dtype: 'fp16' })
      bytes += rt.encodedBytes!
      rt.exact.forEach((e, i) => {
        pairs.push({ exact: e, decoded: rt.roundTripped[i]! })
      })
    }
    const e = kvRelativeError(windows[0]!.cache.geometry('fp16'), pairs)
    const avg = (xs: number[]) => xs.reduce((a, x) => a + x, 0) / xs.length
    return { bytes, kErr: avg(e.k), vErr: avg(e.v) }
  }
  for (const chunk of CHUNKS) {
    const samples: Uint8Array[] = []
    for (const w of calWindows) {
      for (let s = 0; s + chunk <= seqLen; s += chunk)
        samples.push(exportChunk(w.cache, s, s + chunk, 'fp16'))
    }
    const g16 = windows[0]!.cache.geometry('fp16')
    const cal = openCalibration(buildCalibration(samples, { geometry: g16, dtype: 'fp16' }))
    console.error(
      `real model, ${chunk}-token chunks: calibration ${cal.bytes.length} bytes from ${samples.length} chunks of model-written text (${cal.hash.slice(0, 12)})`,
    )
    for (const c of CONFIGS) rows.push(evalConfig(c, chunk))
    rows.push(evalConfig({ label: REF_OTHER_LABEL, mode: 'reference-cachegen', split: other }, chunk))
    const ref = rows.at(-2)!
    const targets = matchTargets(
      (t) => storage({ label: MATCHED_LABEL, mode: 'kvgate', targets: t }, chunk),
      ref.kErr,
      ref.vErr,
    )
    rows.push(evalConfig({ label: MATCHED_LABEL, mode: 'kvgate', targets }, chunk))
    // Calibrated coding moves side information only (decoded tensors are bit-identical), so
    // the same targets hold the same errors.
    rows.push(evalConfig(calibrated({ label: MATCHED_LABEL, mode: 'kvgate', targets }, cal), chunk))
    for (const q of LEVELS) {
      if (q !== DEFAULT_QUALITY)
        rows.push(evalConfig({ label: `kvgate q${q}`, mode: 'kvgate', quality: q }, chunk))
    }
    for (const q of LEVELS) {
      rows.push(evalConfig(calibrated({ label: `kvgate q${q}`, mode: 'kvgate', quality: q }, cal), chunk))
    }
  }
} else {
  console.error(`real model: skipped (${data.reason})`)
}

// ---- synthetic Llama-3.1-8B chunk ------------------------------------------------
const g8: KvGeometry = { layers: 32, kvHeads: 8, headDim: 128, dtype: 'bf16' }
const T = 256
const tensor8 = syntheticKv({ geometry: g8, tokens: T, seed: 1 })
const g8f16: KvGeometry = { ...g8, dtype: 'fp16' }
const tensor8f16 = encodeElements(decodeElements(tensor8, 'bf16'), 'fp16')
console.error(
  `synthetic 8B: one ${T}-token chunk, ${(tensor8.length / 2 ** 20).toFixed(0)} MiB (bf16; speed on an fp16 copy)`,
)

interface Speed {
  /** MB/s of tensor per wall-clock second (median of repeats): the bar's figure. */
  enc: number
  dec: number
  /** MB/s per second of this process's CPU time (median): what an idle core gives when the machine is shared. */
  encCpu: number
  decCpu: number
}

function speed(c: Config, g: KvGeometry, tensor: Uint8Array, repeats: number): Speed {
  const m = chunkInfo(g, T, 0)
  let obj = encodeChunk(tensor, m, encodeOpts(c))
  const out = new Uint8Array(tensor.length)
  const encMs: number[] = []
  const decMs: number[] = []
  const encCpu: number[] = []
  const decCpu: number[] = []
  const cpuMs = (u: NodeJS.CpuUsage) => (u.user + u.system) / 1000
  for (let i = 0; i < repeats + 1; i++) {
    let c0 = process.cpuUsage()
    let t0 = performance.now()
    obj = encodeChunk(tensor, m, encodeOpts(c))
    const te = performance.now() - t0
    const ce = cpuMs(process.cpuUsage(c0))
    c0 = process.cpuUsage()
    t0 = performance.now()
    decodeChunkInto(obj, out)
    const td = performance.now() - t0
    const cd = cpuMs(process.cpuUsage(c0))
    if (i > 0) {
      encMs.push(te)
      decMs.push(td)
      encCpu.push(ce)
      decCpu.push(cd)
    }
  }
  const mbps = (ms: number) => tensor.length / 1e3 / ms
  return {
    enc: mbps(median(encMs)),
    dec: mbps(median(decMs)),
    encCpu: mbps(median(encCpu)),
    decCpu: mbps(median(decCpu)),
  }
}

const speedBf16: Record<string, Speed> = {}
const speedFp16: Record<string, Speed> = {}
// The 8B shape has 32 layers: LMCache's split is K 32 bins in layers 0–9, V in 0–1; the other is all 32.
const synthStorage = (c: Config): Storage => {
  const obj = encodeChunk(tensor8, chunkInfo(g8, T, 0), encodeOpts(c))
  const e = kvRelativeError(g8, [
    { exact: tensor8, decoded: decodeChunk(obj, { calibration: c.calibration }) },
  ])
  const avg = (xs: number[]) => xs.reduce((a, x) => a + x, 0) / xs.length
  return { bytes: obj.byteLength, kErr: avg(e.k), vErr: avg(e.v) }
}
const synthRef = synthStorage({ label: REF_LABEL, mode: 'reference-cachegen' })
// The same synthetic model (modelSeed), other content: what a namespace would calibrate on.
const cal8 = openCalibration(
  buildCalibration(
    [2, 3].map((seed) => syntheticKv({ geometry: g8, tokens: T, seed })),
    { geometry: g8, dtype: 'bf16' },
  ),
)
console.error(
  `synthetic 8B: calibration ${cal8.bytes.length} bytes from 2 chunks of the same model (seeds 2, 3)`,
)
const synthConfigs: Config[] = [
  ...CONFIGS,
  { label: REF_OTHER_LABEL, mode: 'reference-cachegen', split: { k: 32, v: 32 } },
  {
    label: MATCHED_LABEL,
    mode: 'kvgate',
    targets: matchTargets(
      (t) => synthStorage({ label: MATCHED_LABEL, mode: 'kvgate', targets: t }),
      synthRef.kErr,
      synthRef.vErr,
    ),
  },
  ...LEVELS.filter((q) => q !== DEFAULT_QUALITY).map((q) => ({
    label: `kvgate q${q}`,
    mode: 'kvgate' as const,
    quality: q,
  })),
]
{
  const matched = synthConfigs.find((c) => c.label === MATCHED_LABEL)!
  synthConfigs.push(
    calibrated(matched, cal8),
    ...LEVELS.map((q) => calibrated({ label: `kvgate q${q}`, mode: 'kvgate', quality: q }, cal8)),
  )
}
for (const c of synthConfigs) {
  const obj = encodeChunk(tensor8, chunkInfo(g8, T, 0), encodeOpts(c))
  const dec = decodeChunk(obj, { calibration: c.calibration })
  const e = kvRelativeError(g8, [{ exact: tensor8, decoded: dec }])
  const isSweep =
    c.label.startsWith('kvgate q') ||
    c.label === REF_OTHER_LABEL ||
    c.label.startsWith(MATCHED_LABEL) ||
    c.calibration !== undefined
  const reps = c.mode === 'reference-cachegen' ? (isSweep ? 0 : 1) : isSweep ? 0 : REPEATS
  const sp = reps > 0 ? speed(c, g8f16, tensor8f16, reps) : undefined
  if (sp) speedFp16[c.label] = sp
  if (reps > 0) speedBf16[c.label] = speed(c, g8, tensor8, Math.min(reps, 3))
  const avg = (xs: number[]) => xs.reduce((a, x) => a + x, 0) / xs.length
  const row: Row = {
    dataset: 'synthetic 8B',
    chunkTokens: T,
    label: c.label,
    mode: c.mode,
    quality: c.quality,
    bytes: obj.byteLength,
    rawBytes: tensor8.length,
    ratio: tensor8.length / obj.byteLength,
    kErr: avg(e.k),
    vErr: avg(e.v),
    kPooled: e.kAll,
    vPooled: e.vAll,
    kLayer: e.k,
    vLayer: e.v,
    encodeMBps: sp?.enc,
    decodeMBps: sp?.dec,
  }
  rows.push(withCalibration(row, c.calibration, 1))
}

// ---- table -------------------------------------------------------------------
const groups = [...new Set(rows.map((r) => `${r.dataset}|${r.chunkTokens}`))].map((k) => {
  const [dataset, chunk] = k.split('|')
  return { dataset: dataset!, chunkTokens: Number(chunk) }
})
const inGroup = (g: { dataset: string; chunkTokens: number }) =>
  rows.filter((r) => r.dataset === g.dataset && r.chunkTokens === g.chunkTokens)
const refOf = (g: { dataset: string; chunkTokens: number }) => inGroup(g).find((r) => r.label === REF_LABEL)!
for (const g of groups) {
  const ref = refOf(g)
  for (const r of inGroup(g)) r.vsReference = r.bytes / ref.bytes
}
const f = (v: number | undefined, d: number) => (v === undefined ? '—' : v.toFixed(d))
const pm = (v: MeanSe | undefined, d: number, sign = false) =>
  v === undefined
    ? '—'
    : `${sign && v.mean >= 0 ? '+' : ''}${(100 * v.mean).toFixed(d)}% ± ${(100 * v.se).toFixed(d)}`
console.log(
  `\nKV codec — ratio vs fp16, bytes vs reference-cachegen (LMCache's scheme, LMCache's split for the model) on the same KV; K/V rRMSE per layer averaged over layers (pooled); quality inside the context (mean ± standard error over windows × prefixes)`,
)
console.log(
  table([
    [
      'data set',
      'chunk',
      'mode',
      'ratio',
      'bytes/ref',
      'K rRMSE (pooled)',
      'V rRMSE (pooled)',
      'attn err',
      'next-tok agree',
      'ppl Δ',
      'enc MB/s',
      'dec MB/s',
    ],
    ...rows.map((r) => [
      r.dataset,
      String(r.chunkTokens),
      r.label,
      r.ratioOneChunk === undefined
        ? `${f(r.ratio, 2)}×`
        : `${f(r.ratio, 2)}× (1 chunk ${f(r.ratioOneChunk, 2)}×)`,
      f(r.vsReference, 3),
      `${f(r.kErr, 4)} (${f(r.kPooled, 4)})`,
      `${f(r.vErr, 4)} (${f(r.vPooled, 4)})`,
      f(r.attention, 4),
      r.agreement === undefined ? '—' : `${pm(r.agreement, 2)} of ${r.agreementPositions}`,
      pm(r.pplChange, 2, true),
      f(r.encodeMBps, 0),
      f(r.decodeMBps, 0),
    ]),
  ]),
)
const load = (await import('node:os')).loadavg()
console.log(
  `speeds: wasm under Node, one thread, synthetic 8B chunk as fp16 (32 MiB), median of ${REPEATS} — load average ${load.map((l) => l.toFixed(1)).join(' ')} on ${(await import('node:os')).cpus().length} cores`,
)

// ---- bars --------------------------------------------------------------------
const bars: BarResult[] = []
const AGREE = 0.99
const PPL = 0.005
const keepsAnswers = (r: Row) => (r.agreement?.mean ?? 0) >= AGREE && Math.abs(r.pplChange?.mean ?? 1) <= PPL
const kvRows = (g: { dataset: string; chunkTokens: number }, withCal = false) =>
  inGroup(g)
    .filter((r) => r.mode === 'kvgate' && (r.calibrationBytes !== undefined) === withCal)
    .sort((a, b) => (a.quality ?? 0) - (b.quality ?? 0))
const calNote = `calibration counted as shared by ${CAL_CHUNKS} chunks`
for (const g of groups) {
  const ref = refOf(g)
  const name = `${g.dataset}, ${g.chunkTokens}-token chunks`
  const def = kvRows(g).find((r) => r.quality === DEFAULT_QUALITY)!
  if (g.dataset === 'stories260K') {
    bars.push({
      bar: `kvgate default q${DEFAULT_QUALITY} keeps the model's answers (${name})`,
      figure: def.agreement!.mean,
      unit: 'next-token agreement',
      baseline: ref.agreement!.mean,
      baselineLabel: `reference-cachegen agreement; default ppl ${pm(def.pplChange, 2, true)} (reference ${pm(ref.pplChange, 2, true)})`,
      target: '≥ 99% agreement and ≤ 0.5% perplexity change',
      met: keepsAnswers(def),
    })
    const target = g.chunkTokens >= 256 ? 5 : 4
    for (const withCal of [false, true]) {
      const best = kvRows(g, withCal)
        .filter(keepsAnswers)
        .sort((a, b) => b.ratio - a.ratio)[0]
      bars.push({
        bar: `kvgate ratio vs fp16 at ≥ 99% agreement and ≤ 0.5% perplexity change (${name}${withCal ? `, calibrated, ${calNote}` : ''})`,
        figure: best?.ratio ?? 0,
        unit: '× fp16',
        baseline: ref.ratio,
        baselineLabel: `reference-cachegen ratio; best qualifying level ${best ? `q${best.quality}` : 'none'}${best?.ratioOneChunk ? `; calibration on 1 chunk: ${best.ratioOneChunk.toFixed(2)}×` : ''}`,
        target: `≥ ${target}×`,
        met: (best?.ratio ?? 0) >= target,
      })
    }
  }
  for (const atRef of [MATCHED_LABEL, `${MATCHED_LABEL}, calibrated`].map((label) =>
    inGroup(g).find((r) => r.label === label && r.kErr <= ref.kErr && r.vErr <= ref.vErr),
  )) {
    const cal = atRef?.calibrationBytes !== undefined ? `, calibrated, ${calNote}` : ''
    if (g.dataset !== 'stories260K') {
      bars.push({
        bar: `kvgate ratio vs fp16 at per-layer K and V error ≤ reference's (${name}${cal})`,
        figure: atRef?.ratio ?? 0,
        unit: '× fp16',
        baseline: ref.ratio,
        baselineLabel: `reference-cachegen ratio (K ${ref.kErr.toFixed(4)}, V ${ref.vErr.toFixed(4)}); kvgate at matched error targets; default q${DEFAULT_QUALITY}: ${def.ratio.toFixed(2)}× (K ${def.kErr.toFixed(4)}, V ${def.vErr.toFixed(4)})`,
        target: '≥ 8× with K and V error ≤ reference',
        met: (atRef?.ratio ?? 0) >= 8,
      })
    }
    bars.push({
      bar: `kvgate bytes vs reference-cachegen at ≤ its per-layer K and V error (${name}${cal})`,
      figure: atRef ? atRef.bytes / ref.bytes : Number.POSITIVE_INFINITY,
      unit: '× reference bytes',
      baseline: ref.ratio,
      baselineLabel: `reference-cachegen ratio vs fp16 (K ${ref.kErr.toFixed(4)}, V ${ref.vErr.toFixed(4)}); kvgate at matched error targets: ${atRef ? `K ${atRef.kErr.toFixed(4)}, V ${atRef.vErr.toFixed(4)}` : 'none'}`,
      ratio: atRef ? atRef.bytes / ref.bytes : undefined,
      target: '≤ 0.75×',
      met: atRef !== undefined && atRef.bytes <= 0.75 * ref.bytes,
    })
  }
}
const kv8 = rows.find(
  (r) =>
    r.dataset === 'synthetic 8B' &&
    r.mode === 'kvgate' &&
    r.quality === DEFAULT_QUALITY &&
    r.calibrationBytes === undefined,
)!
const q8row = rows.find((r) => r.dataset === 'synthetic 8B' && r.mode === 'q8')!
bars.push(
  {
    bar: 'kvgate wasm decode, fp16 output, one core (8B chunk, 32 MiB)',
    figure: kv8.decodeMBps!,
    unit: 'MB/s',
    baseline: q8row.decodeMBps,
    baselineLabel: `q8 decode (no entropy coding) in the same run; per CPU-second: kvgate ${speedFp16[kv8.label]!.decCpu.toFixed(0)} MB/s`,
    target: '≥ 1500 MB/s',
    met: kv8.decodeMBps! >= 1500,
  },
  {
    bar: 'kvgate wasm encode, one core (8B chunk, 32 MiB)',
    figure: kv8.encodeMBps!,
    unit: 'MB/s',
    baseline: q8row.encodeMBps,
    baselineLabel: `q8 encode in the same run; per CPU-second: kvgate ${speedFp16[kv8.label]!.encCpu.toFixed(0)} MB/s`,
    target: '≥ 750 MB/s',
    met: kv8.encodeMBps! >= 750,
  },
)
console.log('\nbars:')
for (const b of bars) {
  console.log(
    `  [${b.met ? 'MET' : 'NOT MET'}] ${b.bar}: ${b.figure.toFixed(3)} ${b.unit} (target ${b.target}; ${b.baselineLabel})`,
  )
}

// ---- outputs -----------------------------------------------------------------
const labels = CONFIGS.map((c) => c.label)
const seriesGroups = groups.map((g) => ({ ...g, name: `${g.dataset} ${g.chunkTokens}` }))
const pick = (
  g: { dataset: string; chunkTokens: number },
  key: 'ratio' | 'kErr' | 'vErr' | 'encodeMBps' | 'decodeMBps',
) => labels.map((l) => Number(inGroup(g).find((r) => r.label === l)?.[key] ?? Number.NaN))
const synth = groups.find((g) => g.dataset === 'synthetic 8B')!
const charts = [
  barChart({
    title: 'Compression ratio vs fp16 (higher is better)',
    categories: labels,
    series: seriesGroups.map((g) => ({ name: g.name, values: pick(g, 'ratio') })),
    yLabel: '× smaller than fp16',
    refLines: [
      { value: 5, label: '5× bar (256-token chunks)' },
      { value: 8, label: '8× bar (8B-shaped)', color: '#f28e2b' },
    ],
  }),
  barChart({
    title: 'K / V relative RMSE per layer, averaged over layers (lower is better)',
    categories: labels.filter((l) => l !== 'raw' && l !== 'lossless'),
    series: seriesGroups.flatMap((g) => [
      { name: `${g.name} K`, values: pick(g, 'kErr').slice(2) },
      { name: `${g.name} V`, values: pick(g, 'vErr').slice(2) },
    ]),
    digits: 3,
  }),
  barChart({
    title: 'wasm speed on a 32 MiB 8B chunk, one core (MB/s of fp16 tensor)',
    categories: labels,
    series: [
      { name: 'encode', values: pick(synth, 'encodeMBps') },
      { name: 'decode', values: pick(synth, 'decodeMBps') },
    ],
    refLines: [
      { value: 1500, label: 'decode bar 1.5 GB/s' },
      { value: 750, label: 'encode bar 0.75 GB/s', color: '#f28e2b' },
    ],
    digits: 0,
  }),
  lineChart({
    title: 'kvgate quality levels: ratio vs per-layer K rRMSE (reference-cachegen as a point)',
    xLabel: 'K relative RMSE (per-layer average)',
    yLabel: '× smaller than fp16',
    series: seriesGroups.flatMap((g) => [
      {
        name: `kvgate ${g.name}`,
        points: kvRows(g)
          .sort((a, b) => a.kErr - b.kErr)
          .map((r) => [Number(r.kErr.toFixed(4)), Number(r.ratio.toFixed(3))] as const),
      },
      {
        name: `reference-cachegen ${g.name}`,
        points: [refOf(g)].map((r) => [Number(r.kErr.toFixed(4)), Number(r.ratio.toFixed(3))] as const),
      },
    ]),
  }),
]
const svgPath = writeSvg('codec', stackSvgs(charts))
const jsonPath = writeResult({
  name: 'codec',
  date: new Date().toISOString(),
  machine: await machineLine(),
  command: 'node --import tsx bench/codec.ts',
  calibrationChunks: CAL_CHUNKS,
  repeats: REPEATS,
  realModel: data.paths
    ? { windows: WINDOWS, prefixes: PREFIXES, chunks: CHUNKS, contextTokens: 512, layers: realLayers }
    : data.reason,
  rows,
  speedFp16,
  speedBf16,
  loadAverage: load,
  bars,
})
console.log(`wrote ${jsonPath} and ${svgPath}`)
