// Benchmark: kvgate's rate-distortion rounding (`rdRounding`) against nearest rounding, in
// one run: bytes and per-layer K/V rRMSE at the same quality levels, agreement and
// perplexity with docs/codec.md's protocol (stories260K, when ../shared/data is present),
// the 8B shape's bytes at reference-cachegen's per-layer K and V error (both bisected to
// it), and encode/decode CPU time on the 8B chunk, the two encoders interleaved.
// Writes bench/results/codec-rd.json.

import {
  buildCalibration,
  type Calibration,
  decodeChunk,
  decodeChunkInto,
  encodeChunk,
  type LayerTargets,
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
  runProtocol,
  sampledWindows,
  syntheticKv,
} from '../src/model/index.ts'
import { chunkInfo } from './lib/chunk-info.ts'
import { machineLine, median, table, writeResult } from './lib/stats.ts'

const LEVELS = (process.env.KVGATE_RD_LEVELS ?? '1,2,3,5').split(',').map(Number)
/** Levels whose agreement and perplexity are measured (the protocol is the slow part). */
const PROTOCOL_LEVELS = (process.env.KVGATE_RD_PROTOCOL_LEVELS ?? '3,5')
  .split(',')
  .filter(Boolean)
  .map(Number)
const ROUNDS = Number(process.env.KVGATE_BENCH_REPEATS ?? 7)
const CHUNKS = [64, 256]
/** As bench/codec.ts: a calibration's bytes count as shared by this many chunks. */
const CAL_CHUNKS = 1000

const avg = (xs: number[]) => xs.reduce((a, x) => a + x, 0) / xs.length
const pm = (v: MeanSe | undefined, sign = false) =>
  v === undefined
    ? '—'
    : `${sign && v.mean >= 0 ? '+' : ''}${(100 * v.mean).toFixed(2)}% ± ${(100 * v.se).toFixed(2)}`

interface Row {
  dataset: string
  chunkTokens: number
  level: string
  rdRounding: boolean
  calibrated?: boolean
  /** Bytes over reference-cachegen's (LMCache's split) on the same KV. */
  vsReference?: number
  ratio: number
  bytes: number
  kErr: number
  vErr: number
  agreement?: MeanSe
  pplChange?: MeanSe
}
const rows: Row[] = []

const data = findSharedData()
if (data.paths) {
  const { transformer, tokenizer } = loadStories260k(data.paths)
  const seqLen = transformer.config.seqLen
  const windows = prepareWindows(transformer, protocolWindows(tokenizer, HELD_OUT_STORIES, seqLen, 8))
  const calWindows = prepareWindows(transformer, sampledWindows(transformer, tokenizer, 4, seqLen))
  const chunks = (chunkTokens: number) => (windows.length * seqLen) / chunkTokens
  for (const chunkTokens of CHUNKS) {
    const samples: Uint8Array[] = []
    for (const w of calWindows) {
      for (let s = 0; s + chunkTokens <= seqLen; s += chunkTokens)
        samples.push(exportChunk(w.cache, s, s + chunkTokens, 'fp16'))
    }
    const cal = openCalibration(
      buildCalibration(samples, { geometry: windows[0]!.cache.geometry('fp16'), dtype: 'fp16' }),
    )
    const storage = (opts: Parameters<typeof encodeChunk>[2], prefixes: number[], c?: Calibration) =>
      runProtocol(
        transformer,
        windows,
        (t, info) => {
          const obj = encodeChunk(t, chunkInfo(info.geometry, info.tokens, info.chunkIndex), {
            ...opts,
            calibration: c,
          })
          return { decoded: decodeChunk(obj, { calibration: c }), encodedBytes: obj.byteLength }
        },
        { chunkTokens, prefixes },
      )
    const refBytes = storage({ mode: 'reference-cachegen' }, []).encodedBytes
    for (const q of LEVELS) {
      for (const rdRounding of [false, true]) {
        const r = storage(
          { mode: 'kvgate', quality: q, rdRounding },
          PROTOCOL_LEVELS.includes(q) ? [256, 384] : [],
        )
        const base = {
          dataset: 'stories260K',
          chunkTokens,
          level: `q${q}`,
          rdRounding,
          kErr: r.kMean,
          vErr: r.vMean,
          agreement: PROTOCOL_LEVELS.includes(q) ? r.agreement : undefined,
          pplChange: PROTOCOL_LEVELS.includes(q) ? r.pplChange : undefined,
        }
        rows.push({ ...base, ratio: r.ratio, bytes: r.encodedBytes, vsReference: r.encodedBytes / refBytes })
        // A calibrated chunk decodes to the same tensor (same levels, other tables), so its
        // errors and quality are the row's above; its bytes count the calibration's share.
        const rc = storage({ mode: 'kvgate', quality: q, rdRounding }, [], cal)
        const bytes = rc.encodedBytes + (cal.bytes.length * chunks(chunkTokens)) / CAL_CHUNKS
        rows.push({
          ...base,
          calibrated: true,
          ratio: rc.rawBytes / bytes,
          bytes,
          vsReference: bytes / refBytes,
        })
      }
    }
  }
} else {
  console.error(`real model: skipped (${data.reason})`)
}

// ---- 8B shape: bytes at reference-cachegen's per-layer K and V error -----------------
const g8: KvGeometry = { layers: 32, kvHeads: 8, headDim: 128, dtype: 'bf16' }
const T = 256
const x8 = syntheticKv({ geometry: g8, tokens: T, seed: 1 })
const errors = (obj: Uint8Array) => {
  const e = kvRelativeError(g8, [{ exact: x8, decoded: decodeChunk(obj) }])
  return { kErr: avg(e.k), vErr: avg(e.v) }
}
const refObj = encodeChunk(x8, chunkInfo(g8, T, 0), { mode: 'reference-cachegen' })
const ref = errors(refObj)
for (const rdRounding of [false, true]) {
  const storage = (t: LayerTargets) => {
    const obj = encodeChunk(x8, chunkInfo(g8, T, 0), { mode: 'kvgate', errorTargets: t, rdRounding })
    return { bytes: obj.byteLength, ...errors(obj) }
  }
  // As bench/codec.ts's matchTargets: per-stream bisection in log space to just ≤ the reference.
  let k = [1e-4, 4]
  let v = [1e-4, 4]
  for (let i = 0; i < 14; i++) {
    const t = { kError: Math.sqrt(k[0]! * k[1]!), vError: Math.sqrt(v[0]! * v[1]!) }
    const s = storage(t)
    k = s.kErr <= ref.kErr ? [t.kError, k[1]!] : [k[0]!, t.kError]
    v = s.vErr <= ref.vErr ? [t.vError, v[1]!] : [v[0]!, t.vError]
  }
  const s = storage({ kError: k[0]!, vError: v[0]! })
  rows.push({
    dataset: 'synthetic 8B',
    chunkTokens: T,
    level: 'at reference error',
    rdRounding,
    ratio: x8.length / s.bytes,
    vsReference: s.bytes / refObj.byteLength,
    ...s,
  })
  for (const q of LEVELS) {
    const obj = encodeChunk(x8, chunkInfo(g8, T, 0), { mode: 'kvgate', quality: q, rdRounding })
    rows.push({
      dataset: 'synthetic 8B',
      chunkTokens: T,
      level: `q${q}`,
      rdRounding,
      ratio: x8.length / obj.byteLength,
      bytes: obj.byteLength,
      vsReference: obj.byteLength / refObj.byteLength,
      ...errors(obj),
    })
  }
}

// ---- speed: the two encoders interleaved, per CPU-second (the machine is shared) -------
const g16: KvGeometry = { ...g8, dtype: 'fp16' }
const x16 = encodeElements(decodeElements(x8, 'bf16'), 'fp16')
const out = new Uint8Array(x16.length)
const cpuMs: Record<'nearest' | 'rd', { enc: number[]; dec: number[] }> = {
  nearest: { enc: [], dec: [] },
  rd: { enc: [], dec: [] },
}
const cpu = () => {
  const u = process.cpuUsage()
  return (u.user + u.system) / 1000
}
for (let r = 0; r < ROUNDS + 1; r++) {
  for (const which of r % 2 ? (['nearest', 'rd'] as const) : (['rd', 'nearest'] as const)) {
    let c0 = cpu()
    const obj = encodeChunk(x16, chunkInfo(g16, T, 0), {
      mode: 'kvgate',
      quality: 5,
      rdRounding: which === 'rd',
    })
    const enc = cpu() - c0
    c0 = cpu()
    decodeChunkInto(obj, out)
    const dec = cpu() - c0
    if (r > 0) {
      cpuMs[which].enc.push(enc)
      cpuMs[which].dec.push(dec)
    }
  }
}
const mbps = (ms: number[]) => {
  const s = ms.map((m) => x16.length / 1e3 / m).sort((a, b) => a - b)
  return { min: s[0]!, median: median(s), max: s.at(-1)! }
}
const speed = {
  nearest: { encode: mbps(cpuMs.nearest.enc), decode: mbps(cpuMs.nearest.dec) },
  rd: { encode: mbps(cpuMs.rd.enc), decode: mbps(cpuMs.rd.dec) },
}

console.log(
  `\nkvgate, nearest vs rate-distortion rounding (same levels; K/V rRMSE per layer averaged over layers; calibrated rows: calibration shared by ${CAL_CHUNKS} chunks, same tensors as uncalibrated; reference-cachegen on the 8B shape: K ${ref.kErr.toFixed(4)}, V ${ref.vErr.toFixed(4)})`,
)
console.log(
  table([
    [
      'data set',
      'chunk',
      'level',
      'rounding',
      'ratio',
      'bytes vs nearest',
      'bytes / ref',
      'K rRMSE',
      'V rRMSE',
      'agreement',
      'ppl Δ',
    ],
    ...rows.map((r) => {
      const base = rows.find(
        (b) =>
          b.dataset === r.dataset &&
          b.chunkTokens === r.chunkTokens &&
          b.level === r.level &&
          b.calibrated === r.calibrated &&
          !b.rdRounding,
      )!
      return [
        r.dataset,
        String(r.chunkTokens),
        r.level,
        `${r.rdRounding ? 'rate-distortion' : 'nearest'}${r.calibrated ? ', calibrated' : ''}`,
        `${r.ratio.toFixed(3)}×`,
        (r.bytes / base.bytes).toFixed(4),
        r.vsReference === undefined ? '—' : r.vsReference.toFixed(3),
        r.kErr.toFixed(5),
        r.vErr.toFixed(5),
        pm(r.agreement),
        pm(r.pplChange, true),
      ]
    }),
  ]),
)
const f = (s: { min: number; median: number; max: number }) =>
  `${s.min.toFixed(0)} / ${s.median.toFixed(0)} / ${s.max.toFixed(0)}`
const load = (await import('node:os')).loadavg()
console.log(
  `\n8B chunk as fp16 (32 MiB), q5, ${ROUNDS} interleaved rounds, MB/s per CPU-second min / median / max (load ${load.map((l) => l.toFixed(1)).join(' ')}):`,
)
console.log(`  encode: nearest ${f(speed.nearest.encode)}, rate-distortion ${f(speed.rd.encode)}`)
console.log(`  decode: nearest ${f(speed.nearest.decode)}, rate-distortion ${f(speed.rd.decode)}`)
const path = writeResult({
  name: 'codec-rd',
  date: new Date().toISOString(),
  machine: await machineLine(),
  command: 'node --import tsx bench/codec-rd.ts',
  reference8B: ref,
  rows,
  speed,
  loadAverage: load,
  bars: [],
})
console.log(`wrote ${path}`)
