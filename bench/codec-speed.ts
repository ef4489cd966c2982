// Speed profile of the wasm kvgate codec on one Llama-3.1-8B-shaped 32 MiB chunk
// (fp16, level q5): the chunk API, plus an interleaved A/B of raw wasm builds
// (KVGATE_WASM_BASE=<old .wasm> against the committed one; KVGATE_WASM_BASE_LEVELS=12:16 for
// a build from before error targets) so a noisy shared machine hits both sides alike.
// Raw figures include the copies the API makes. The chunk API is timed with and without a
// calibration object (built from two other synthetic chunks of the same model). Then the client's
// codec pool with 1, 2 and all workers beside this thread, decode and encode
// (KVGATE_BENCH_ONLY=pool: that part alone).

import { readFileSync } from 'node:fs'
import {
  buildCalibration,
  decodeChunkInto,
  encodeChunk,
  layerTargets,
  openCalibration,
} from '../src/codec/node.ts'
import { decodeElements, encodeElements } from '../src/core/dtype.ts'
import type { KvGeometry } from '../src/core/layout.ts'
import { syntheticKv } from '../src/model/index.ts'
import { chunkInfo } from './lib/chunk-info.ts'
import { median } from './lib/stats.ts'

const REPEATS = Number(process.env.KVGATE_BENCH_REPEATS ?? 9)
const QUALITY = Number(process.env.KVGATE_QUALITY ?? 5)
const T = 256
const g8: KvGeometry = { layers: 32, kvHeads: 8, headDim: 128, dtype: 'bf16' }
const bf = syntheticKv({ geometry: g8, tokens: T, seed: 1 })
const g: KvGeometry = { ...g8, dtype: 'fp16' }
const tensor = encodeElements(decodeElements(bf, 'bf16'), 'fp16')
const meta = chunkInfo(g, T)
const mb = tensor.length / 1e6
const c = g.kvHeads * g.headDim
const slab = tensor.length / g.layers
const out = new Uint8Array(tensor.length)

interface Sample {
  wall: number[]
  cpu: number[]
}
const sample = (): Sample => ({ wall: [], cpu: [] })

function timed(s: Sample, fn: () => void): void {
  const c0 = process.cpuUsage()
  const t0 = performance.now()
  fn()
  s.wall.push(performance.now() - t0)
  const u = process.cpuUsage(c0)
  s.cpu.push((u.user + u.system) / 1e3)
}

/**
 * One raw wasm build: encode copies each layer slab in and the section out;
 * decode copies the section in and the slab out (what src/codec's wrapper does).
 * `levels` ("K:V", e.g. 12:16 for the old q5): the build predates error targets and takes
 * per-channel K levels and one-step V levels instead (`perTokenV`: per-token V steps).
 */
function rawBuild(path: string | URL, perTokenV: boolean, levels?: string) {
  const e = new WebAssembly.Instance(new WebAssembly.Module(readFileSync(path)), {}).exports as Record<
    string,
    (...a: number[]) => number
  > & { memory: WebAssembly.Memory }
  const src = e.kv_alloc!(slab)
  const par = e.kv_alloc!(32)
  const dst = e.kv_alloc!(slab)
  const sections: Uint8Array[] = []
  const encode = () => {
    sections.length = 0
    for (let l = 0; l < g.layers; l++) {
      const { kError, vError } = layerTargets(QUALITY, l, g.layers)
      const [kl, vl] = (levels ?? '0:0').split(':').map(Number) as [number, number]
      new Float32Array(e.memory.buffer, par, 8).set(
        levels ? [0, 0, 0, 0, 1, 8, kl, perTokenV ? vl : -vl] : [-kError, vError, 0, 0, 1, 8, 0, 0],
      )
      new Uint8Array(e.memory.buffer, src, slab).set(tensor.subarray(l * slab, (l + 1) * slab))
      const n = e.kv_encode!(2, src, 1, T, c, par)
      if (n < 0) throw new Error(`encode ${n}`)
      sections.push(new Uint8Array(e.memory.buffer, e.kv_result_ptr!(), n).slice())
    }
  }
  const decode = () => {
    for (let l = 0; l < g.layers; l++) {
      const s = sections[l]!
      new Uint8Array(e.memory.buffer, src, s.length).set(s)
      const rc = e.kv_decode!(2, src, s.length, 1, T, c, dst)
      if (rc !== 0) throw new Error(`decode ${rc}`)
      out.set(new Uint8Array(e.memory.buffer, dst, slab), l * slab)
    }
  }
  encode()
  return { encode, decode, bytes: () => sections.reduce((a, s) => a + s.length, 0) }
}

const builds: [string, ReturnType<typeof rawBuild>][] = []
if (process.env.KVGATE_WASM_BASE) {
  builds.push([
    'base',
    rawBuild(
      process.env.KVGATE_WASM_BASE,
      process.env.KVGATE_WASM_BASE_PER_TOKEN_V === '1',
      process.env.KVGATE_WASM_BASE_LEVELS,
    ),
  ])
}
builds.push(['current', rawBuild(new URL('../wasm/kvgate_codec.wasm', import.meta.url), false)])

const obj = encodeChunk(tensor, meta, { mode: 'kvgate', quality: QUALITY })
const objBf = encodeChunk(bf, { ...meta, geometry: g8 }, { mode: 'kvgate', quality: QUALITY })
const calibration = openCalibration(
  buildCalibration(
    [2, 3].map((seed) =>
      encodeElements(decodeElements(syntheticKv({ geometry: g8, tokens: T, seed }), 'bf16'), 'fp16'),
    ),
    { geometry: g, dtype: 'fp16' },
  ),
)
const calOpts = { mode: 'kvgate' as const, quality: QUALITY, calibration }
const objCal = encodeChunk(tensor, meta, calOpts)
const samples = new Map<string, Sample>()
const at = (k: string): Sample => {
  const s = samples.get(k) ?? sample()
  samples.set(k, s)
  return s
}
// KVGATE_BENCH_ONLY=pool: only the codec pool section below.
if (process.env.KVGATE_BENCH_ONLY !== 'pool') {
  for (let i = 0; i <= REPEATS; i++) {
    // Round 0 warms up every path (V8 tiers wasm up after first calls).
    const keep = i > 0
    const s = (k: string) => (keep ? at(k) : sample())
    for (const [name, b] of builds) {
      timed(s(`${name} raw encode`), b.encode)
      timed(s(`${name} raw decode fp16`), b.decode)
    }
    timed(s('chunk API encode'), () => encodeChunk(tensor, meta, { mode: 'kvgate', quality: QUALITY }))
    timed(s('chunk API decode fp16'), () => decodeChunkInto(obj, out))
    timed(s('chunk API decode bf16'), () => decodeChunkInto(objBf, out))
    timed(s('chunk API encode, calibrated'), () => encodeChunk(tensor, meta, calOpts))
    timed(s('chunk API decode fp16, calibrated'), () => decodeChunkInto(objCal, out, { calibration }))
  }
  console.log(
    `q${QUALITY}, 8B synthetic 32 MiB chunk: current ${(tensor.length / obj.length).toFixed(3)}× vs fp16` +
      ` (calibrated ${(tensor.length / objCal.length).toFixed(3)}×, calibration ${calibration.bytes.length} bytes)` +
      builds.map(([n, b]) => `; ${n} raw sections ${b.bytes()} bytes`).join(''),
  )
  console.log(`median of ${REPEATS} interleaved rounds: MB/s of fp16 tensor, wall clock and per CPU-second`)
  // MB/s as min/median/max over the rounds (min from the slowest round).
  const rate = (ms: number[]) =>
    [Math.max(...ms), median(ms), Math.min(...ms)].map((t) => (mb / (t / 1e3)).toFixed(0)).join('/')
  for (const [name, s] of samples) {
    const w = median(s.wall)
    console.log(
      `${name.padEnd(28)} ${w.toFixed(2).padStart(7)} ms  wall ${rate(s.wall).padStart(14)} MB/s  cpu ${rate(s.cpu).padStart(14)} MB/s (min/median/max)`,
    )
  }
}

// Through the client's codec pool: one prompt's chunks spread over 1, 2, … workers
// (KVGATE_POOL_SIZES, default 1, 2 and all cores) beside the same chunks on this thread, every
// variant once per round, rounds interleaved. A node's decode rate should scale with its cores,
// and one worker should deliver what this thread does (the pool's overhead is copies and messages).
if (process.env.KVGATE_POOL_SIZES !== 'none') {
  const { CodecPool } = await import('../src/client/codec-pool.ts')
  const { availableParallelism } = await import('node:os')
  const cores = availableParallelism()
  const sizes = (process.env.KVGATE_POOL_SIZES ?? `1,2,${cores}`)
    .split(',')
    .map(Number)
    .filter((n, i, a) => n > 0 && a.indexOf(n) === i)
  const rounds = Number(process.env.KVGATE_POOL_ROUNDS ?? 5)
  const chunks = Math.max(8, 2 * Math.max(...sizes))
  const outs = Array.from({ length: chunks }, () => new Uint8Array(tensor.length))
  const pools = sizes.map((n) => ({ n, pool: new CodecPool(n, false) }))
  type Run = (job: 'decode' | 'encode') => Promise<unknown>
  const variants: [string, Run][] = [
    [
      'this thread',
      async (job) => {
        for (const o of outs)
          if (job === 'decode') decodeChunkInto(obj, o)
          else encodeChunk(tensor, meta, { mode: 'kvgate', quality: QUALITY })
      },
    ],
    ...pools.map(({ n, pool }): [string, Run] => [
      `pool of ${n}`,
      (job) =>
        Promise.all(
          outs.map((o) =>
            job === 'decode'
              ? pool.decodeInto(obj, 'kvgate', o)
              : pool.encode('kvgate', tensor, meta, QUALITY),
          ),
        ),
    ]),
  ]
  const rows = new Map<string, { gbs: number[]; cpuGbs: number[] }>()
  try {
    for (let r = 0; r <= rounds; r++) {
      for (const job of ['decode', 'encode'] as const) {
        for (const [name, run] of variants) {
          // process.cpuUsage counts every thread of the process: workers and the copies here.
          const c0 = process.cpuUsage()
          const t0 = performance.now()
          await run(job)
          const wall = (performance.now() - t0) / 1e3
          const u = process.cpuUsage(c0)
          if (r === 0) continue // round 0 starts the workers and lets V8 tier their wasm up
          const row = rows.get(`${job} ${name}`) ?? { gbs: [], cpuGbs: [] }
          rows.set(`${job} ${name}`, row)
          row.gbs.push((chunks * tensor.length) / wall / 1e9)
          row.cpuGbs.push((chunks * tensor.length) / ((u.user + u.system) / 1e6) / 1e9)
        }
      }
    }
  } finally {
    for (const { pool } of pools) await pool.close()
  }
  const spread = (xs: number[]) =>
    `${Math.min(...xs).toFixed(3)} / ${median(xs).toFixed(3)} / ${Math.max(...xs).toFixed(3)}`
  console.log(
    `\ncodec pool, ${chunks} chunks per run, ${rounds} interleaved rounds, ${cores} cores: GB/s of fp16 tensor (min / median / max), × this thread's median`,
  )
  const table: Record<string, unknown>[] = []
  for (const [name, row] of rows) {
    const job = name.split(' ')[0]!
    const base = rows.get(`${job} this thread`)!
    const ratio = median(row.gbs) / median(base.gbs)
    const cpuRatio = median(row.cpuGbs) / median(base.cpuGbs)
    table.push({ name, gbs: row.gbs, cpuGbs: row.cpuGbs, vsThisThread: ratio, cpuVsThisThread: cpuRatio })
    console.log(
      `${name.padEnd(20)} wall ${spread(row.gbs)} ×${ratio.toFixed(2)}   per CPU-second ${spread(row.cpuGbs)} ×${cpuRatio.toFixed(2)}`,
    )
  }
  const { writeResult, machineLine } = await import('./lib/stats.ts')
  const path = writeResult({
    name: 'codec-pool-speed',
    date: new Date().toISOString(),
    machine: await machineLine(),
    bars: [],
    quality: QUALITY,
    chunks,
    rounds,
    rows: table,
  })
  console.log(`result: ${path}`)
}
