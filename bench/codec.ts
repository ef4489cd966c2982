// Benchmark: the KV codec on real KV (stories260K, when ../shared/data is present)
// and on Llama-3.1-8B-shaped synthetic KV. Per mode: ratio vs fp16 and vs LMCache's
// scheme (reference-cachegen) on the same KV, K/V relative RMSE, next-token
// agreement and perplexity change (real model), wasm encode/decode MB/s (median,
// single core, 32 MiB chunk). Writes bench/results/codec.json and codec.svg.

import {
  type CodecMode,
  DEFAULT_QUALITY,
  decodeChunk,
  decodeChunkInto,
  encodeChunk,
} from '../src/codec/node.ts'
import { decodeElements, encodeElements } from '../src/core/dtype.ts'
import type { KvGeometry } from '../src/core/layout.ts'
import {
  type CodecQualityReport,
  evaluateCodec,
  findSharedData,
  kvRelativeError,
  loadStories260k,
  type RoundTripInfo,
  SAMPLE_STORIES,
  syntheticKv,
} from '../src/model/index.ts'
import { type BarResult, machineLine, median, table, writeResult } from './lib/stats.ts'
import { barChart, lineChart, stackSvgs, writeSvg } from './lib/svg-chart.ts'

const REPEATS = Number(process.env.KVGATE_BENCH_REPEATS ?? 7)
// 8 windows × 128 teacher-forced tokens = 1024 agreement positions (one position is ~0.1%).
const WINDOWS = Number(process.env.KVGATE_BENCH_WINDOWS ?? 8)
const AGREEMENT_TOKENS = Number(process.env.KVGATE_BENCH_AGREEMENT_TOKENS ?? 128)

interface Config {
  label: string
  mode: CodecMode
  quality?: number
}

const CONFIGS: Config[] = [
  { label: 'raw', mode: 'raw' },
  { label: 'lossless', mode: 'lossless' },
  { label: `kvgate (default q${DEFAULT_QUALITY})`, mode: 'kvgate', quality: DEFAULT_QUALITY },
  { label: 'q8', mode: 'q8' },
  { label: 'reference-cachegen', mode: 'reference-cachegen' },
]
const LEVELS = [1, 2, 3, 4, 5, 6, 7, 8, 9]

interface Row {
  dataset: string
  label: string
  mode: CodecMode
  quality?: number
  bytes: number
  rawBytes: number
  ratio: number
  vsReference?: number
  kErr: number
  vErr: number
  agreement?: number
  agreementPositions?: number
  pplChange?: number
  encodeMBps?: number
  decodeMBps?: number
}

function meta(g: KvGeometry, tokens: number, chunkIndex: number) {
  return {
    geometry: g,
    tokens,
    chunkIndex,
    partial: false,
    namespaceId: new Uint8Array(16),
    chainKey: new Uint8Array(32),
    parentKey: new Uint8Array(32),
  }
}

function roundTrip(c: Config) {
  return (t: Uint8Array, info: RoundTripInfo) => {
    const obj = encodeChunk(t, meta(info.geometry, info.tokens, info.chunkIndex), {
      mode: c.mode,
      quality: c.quality,
    })
    return { decoded: decodeChunk(obj), encodedBytes: obj.byteLength }
  }
}

// ---- real model ----------------------------------------------------------------
const rows: Row[] = []
const data = findSharedData()
if (data.paths) {
  const { transformer, tokenizer } = loadStories260k(data.paths)
  const ids = tokenizer.encode(SAMPLE_STORIES.join('\n'))
  const span = 512 + 128
  const starts = Array.from({ length: WINDOWS }, (_, i) =>
    Math.floor((i * Math.max(0, ids.length - span)) / Math.max(1, WINDOWS - 1)),
  )
  const evalConfig = (c: Config): Row => {
    const reps: CodecQualityReport[] = starts.map((s) =>
      evaluateCodec(transformer, ids.slice(s, s + 512), roundTrip(c), {
        heldOut: ids.slice(s + 512, s + span),
        agreementTokens: AGREEMENT_TOKENS,
        attentionStride: 8,
      }),
    )
    const raw = reps.reduce((a, r) => a + r.rawBytes, 0)
    const enc = reps.reduce((a, r) => a + (r.encodedBytes ?? r.rawBytes), 0)
    const pos = reps.reduce((a, r) => a + r.agreement.positions, 0)
    const rms = (xs: number[]) => Math.sqrt(xs.reduce((a, x) => a + x * x, 0) / xs.length)
    return {
      dataset: 'stories260K',
      label: c.label,
      mode: c.mode,
      quality: c.quality,
      bytes: enc,
      rawBytes: raw,
      ratio: raw / enc,
      kErr: rms(reps.map((r) => r.kv.kAll)),
      vErr: rms(reps.map((r) => r.kv.vAll)),
      agreement: reps.reduce((a, r) => a + r.agreement.agree, 0) / pos,
      agreementPositions: pos,
      pplChange: reps.reduce((a, r) => a + r.perplexity!.relChange, 0) / reps.length,
    }
  }
  console.error(
    `real model: ${WINDOWS} windows of 512 prefix + 128 held-out tokens, ${AGREEMENT_TOKENS} teacher-forced agreement tokens each (fp16 KV, 256-token chunks)`,
  )
  for (const c of CONFIGS) rows.push(evalConfig(c))
  for (const q of LEVELS) {
    if (q !== DEFAULT_QUALITY) rows.push(evalConfig({ label: `kvgate q${q}`, mode: 'kvgate', quality: q }))
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
  const m = meta(g, T, 0)
  let obj = encodeChunk(tensor, m, { mode: c.mode, quality: c.quality })
  const out = new Uint8Array(tensor.length)
  const encMs: number[] = []
  const decMs: number[] = []
  const encCpu: number[] = []
  const decCpu: number[] = []
  const cpuMs = (u: NodeJS.CpuUsage) => (u.user + u.system) / 1000
  for (let i = 0; i < repeats + 1; i++) {
    let c0 = process.cpuUsage()
    let t0 = performance.now()
    obj = encodeChunk(tensor, m, { mode: c.mode, quality: c.quality })
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
for (const c of [
  ...CONFIGS,
  ...LEVELS.filter((q) => q !== DEFAULT_QUALITY).map((q) => ({
    label: `kvgate q${q}`,
    mode: 'kvgate' as const,
    quality: q,
  })),
]) {
  const obj = encodeChunk(tensor8, meta(g8, T, 0), { mode: c.mode, quality: c.quality })
  const dec = decodeChunk(obj)
  const e = kvRelativeError(g8, [{ exact: tensor8, decoded: dec }])
  const isLevelSweep = c.label.startsWith('kvgate q')
  const reps = c.mode === 'reference-cachegen' ? 1 : isLevelSweep ? 0 : REPEATS
  const sp = reps > 0 ? speed(c, g8f16, tensor8f16, reps) : undefined
  if (sp) speedFp16[c.label] = sp
  if (reps > 0) speedBf16[c.label] = speed(c, g8, tensor8, Math.min(reps, 3))
  rows.push({
    dataset: 'synthetic 8B',
    label: c.label,
    mode: c.mode,
    quality: c.quality,
    bytes: obj.byteLength,
    rawBytes: tensor8.length,
    ratio: tensor8.length / obj.byteLength,
    kErr: e.kAll,
    vErr: e.vAll,
    encodeMBps: sp?.enc,
    decodeMBps: sp?.dec,
  })
}

// ---- table -------------------------------------------------------------------
for (const ds of new Set(rows.map((r) => r.dataset))) {
  const ref = rows.find((r) => r.dataset === ds && r.mode === 'reference-cachegen')!
  for (const r of rows) if (r.dataset === ds) r.vsReference = r.bytes / ref.bytes
}
const f = (v: number | undefined, d: number) => (v === undefined ? '—' : v.toFixed(d))
const pct = (v: number | undefined, d: number) => (v === undefined ? '—' : `${(100 * v).toFixed(d)}%`)
console.log(
  `\nKV codec — ratio vs fp16, bytes vs reference-cachegen (LMCache's scheme) on the same KV, errors, quality, speed`,
)
console.log(
  table([
    [
      'data set',
      'mode',
      'ratio',
      'bytes/ref',
      'K rRMSE',
      'V rRMSE',
      'next-tok agree',
      'ppl Δ',
      'enc MB/s',
      'dec MB/s',
      'enc (cpu)',
      'dec (cpu)',
    ],
    ...rows
      .filter((r) => !r.label.startsWith('kvgate q') || r.dataset === 'stories260K')
      .map((r) => [
        r.dataset,
        r.label,
        `${f(r.ratio, 2)}×`,
        f(r.vsReference, 3),
        f(r.kErr, 4),
        f(r.vErr, 4),
        r.agreement === undefined ? '—' : `${pct(r.agreement, 1)} of ${r.agreementPositions}`,
        r.pplChange === undefined ? '—' : `${r.pplChange >= 0 ? '+' : ''}${pct(r.pplChange, 2)}`,
        f(r.encodeMBps, 0),
        f(r.decodeMBps, 0),
        f(speedFp16[r.label] && r.dataset === 'synthetic 8B' ? speedFp16[r.label]!.encCpu : undefined, 0),
        f(speedFp16[r.label] && r.dataset === 'synthetic 8B' ? speedFp16[r.label]!.decCpu : undefined, 0),
      ]),
  ]),
)
const load = (await import('node:os')).loadavg()
console.log(
  `speeds: wasm under Node, one thread, synthetic 8B chunk as fp16 (32 MiB), median of ${REPEATS}: wall clock, and per CPU-second of this process (cpu) — load average ${load.map((l) => l.toFixed(1)).join(' ')} on ${(await import('node:os')).cpus().length} cores`,
)
console.log('kvgate level sweep on synthetic 8B (ratio / K / V):')
console.log(
  rows
    .filter((r) => r.dataset === 'synthetic 8B' && r.mode === 'kvgate')
    .map(
      (r) =>
        `  q${r.quality}: ${r.ratio.toFixed(2)}× K ${r.kErr.toFixed(4)} V ${r.vErr.toFixed(4)} bytes/ref ${f(r.vsReference, 3)}`,
    )
    .join('\n'),
)

// ---- bars --------------------------------------------------------------------
const bars: BarResult[] = []
for (const ds of new Set(rows.map((r) => r.dataset))) {
  const ref = rows.find((r) => r.dataset === ds && r.mode === 'reference-cachegen')!
  const kv = rows.find((r) => r.dataset === ds && r.mode === 'kvgate' && r.quality === DEFAULT_QUALITY)!
  bars.push({
    bar: `kvgate default bytes vs reference-cachegen at ≤ its K and V error (${ds})`,
    figure: kv.bytes / ref.bytes,
    unit: '× reference bytes',
    baseline: ref.ratio,
    baselineLabel: `reference-cachegen ratio vs fp16 (K ${ref.kErr.toFixed(3)}, V ${ref.vErr.toFixed(3)}); kvgate K ${kv.kErr.toFixed(3)}, V ${kv.vErr.toFixed(3)}`,
    ratio: kv.bytes / ref.bytes,
    target: '≤ 0.75× with K and V error ≤ reference',
    met: kv.bytes <= 0.75 * ref.bytes && kv.kErr <= ref.kErr && kv.vErr <= ref.vErr,
  })
}
const real = rows.filter((r) => r.dataset === 'stories260K' && r.mode === 'kvgate')
if (real.length > 0) {
  const good = real.filter((r) => (r.agreement ?? 0) >= 0.99 && Math.abs(r.pplChange ?? 1) <= 0.01)
  const best = good.sort((a, b) => b.ratio - a.ratio)[0]
  const def = real.find((r) => r.quality === DEFAULT_QUALITY)!
  bars.push({
    bar: 'kvgate ratio vs fp16 at ≥ 99% next-token agreement and ≤ 1% perplexity change (stories260K, head dim 8)',
    figure: best?.ratio ?? 0,
    unit: '× fp16',
    baseline: rows.find((r) => r.dataset === 'stories260K' && r.mode === 'reference-cachegen')!.ratio,
    baselineLabel: `reference-cachegen ratio; best qualifying level: ${best ? `q${best.quality}` : 'none'}; default q${DEFAULT_QUALITY}: ${def.ratio.toFixed(2)}× at ${pct(def.agreement, 1)} agreement, ppl ${pct(def.pplChange, 2)}`,
    target: '≥ 6× (stretch)',
    met: (best?.ratio ?? 0) >= 6,
  })
}
const kv8 = rows.find(
  (r) => r.dataset === 'synthetic 8B' && r.mode === 'kvgate' && r.quality === DEFAULT_QUALITY,
)!
const q8row = rows.find((r) => r.dataset === 'synthetic 8B' && r.mode === 'q8')!
bars.push(
  {
    bar: 'kvgate wasm decode, fp16 output, one core (8B chunk, 32 MiB)',
    figure: kv8.decodeMBps!,
    unit: 'MB/s',
    baseline: q8row.decodeMBps,
    baselineLabel: `q8 decode (no entropy coding) in the same run; per CPU-second: kvgate ${speedFp16[kv8.label]!.decCpu.toFixed(0)} MB/s`,
    target: '≥ 1000 MB/s',
    met: kv8.decodeMBps! >= 1000,
  },
  {
    bar: 'kvgate wasm encode, one core (8B chunk, 32 MiB)',
    figure: kv8.encodeMBps!,
    unit: 'MB/s',
    baseline: q8row.encodeMBps,
    baselineLabel: `q8 encode in the same run; per CPU-second: kvgate ${speedFp16[kv8.label]!.encCpu.toFixed(0)} MB/s`,
    target: '≥ 500 MB/s',
    met: kv8.encodeMBps! >= 500,
  },
)
console.log('\nbars:')
for (const b of bars) {
  console.log(
    `  [${b.met ? 'MET' : 'NOT MET'}] ${b.bar}: ${b.figure.toFixed(3)} ${b.unit} (target ${b.target}; ${b.baselineLabel})`,
  )
}

// ---- outputs -----------------------------------------------------------------
const main = rows.filter((r) => !r.label.startsWith('kvgate q'))
const labels = CONFIGS.map((c) => c.label)
const datasets = [...new Set(rows.map((r) => r.dataset))]
const pick = (ds: string, key: keyof Row) =>
  labels.map((l) => Number(main.find((r) => r.dataset === ds && r.label === l)?.[key] ?? Number.NaN))
const charts = [
  barChart({
    title: 'Compression ratio vs fp16 (higher is better)',
    categories: labels,
    series: datasets.map((ds) => ({ name: ds, values: pick(ds, 'ratio') })),
    yLabel: '× smaller than fp16',
    refLines: [{ value: 6, label: '6× stretch bar' }],
  }),
  barChart({
    title: 'K / V relative RMSE (lower is better)',
    categories: labels.filter((l) => l !== 'raw' && l !== 'lossless'),
    series: datasets.flatMap((ds) => [
      { name: `${ds} K`, values: pick(ds, 'kErr').slice(2) },
      { name: `${ds} V`, values: pick(ds, 'vErr').slice(2) },
    ]),
    digits: 3,
  }),
  barChart({
    title: 'wasm speed on a 32 MiB 8B chunk, one core (MB/s of fp16 tensor)',
    categories: labels,
    series: [
      { name: 'encode', values: pick('synthetic 8B', 'encodeMBps') },
      { name: 'decode', values: pick('synthetic 8B', 'decodeMBps') },
    ],
    refLines: [
      { value: 1000, label: 'decode bar 1 GB/s' },
      { value: 500, label: 'encode bar 0.5 GB/s', color: '#f28e2b' },
    ],
    digits: 0,
  }),
  lineChart({
    title: 'kvgate quality levels: ratio vs K relative RMSE (reference-cachegen as a point)',
    xLabel: 'K relative RMSE',
    yLabel: '× smaller than fp16',
    series: datasets.flatMap((ds) => [
      {
        name: `kvgate ${ds}`,
        points: rows
          .filter((r) => r.dataset === ds && r.mode === 'kvgate')
          .sort((a, b) => a.kErr - b.kErr)
          .map((r) => [Number(r.kErr.toFixed(4)), Number(r.ratio.toFixed(3))] as const),
      },
      {
        name: `reference-cachegen ${ds}`,
        points: rows
          .filter((r) => r.dataset === ds && r.mode === 'reference-cachegen')
          .map((r) => [Number(r.kErr.toFixed(4)), Number(r.ratio.toFixed(3))] as const),
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
  repeats: REPEATS,
  realModel: data.paths
    ? { windows: WINDOWS, prefixTokens: 512, heldOutTokens: 128, agreementTokens: AGREEMENT_TOKENS }
    : data.reason,
  rows,
  speedFp16,
  speedBf16,
  loadAverage: load,
  bars,
})
console.log(`wrote ${jsonPath} and ${svgPath}`)
