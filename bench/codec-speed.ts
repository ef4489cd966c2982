// Speed profile of the wasm kvgate codec on one Llama-3.1-8B-shaped 32 MiB chunk
// (fp16, level q5): the chunk API, plus an interleaved A/B of raw wasm builds
// (KVGATE_WASM_BASE=<old .wasm> against the committed one; KVGATE_WASM_BASE_LEVELS=12:16 for
// a build from before error targets) so a noisy shared machine hits both sides alike.
// Raw figures include the copies the API makes. The chunk API is timed with and without a
// calibration object (built from two other synthetic chunks of the same model).

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
import { median } from './lib/stats.ts'

const REPEATS = Number(process.env.KVGATE_BENCH_REPEATS ?? 9)
const QUALITY = Number(process.env.KVGATE_QUALITY ?? 5)
const T = 256
const g8: KvGeometry = { layers: 32, kvHeads: 8, headDim: 128, dtype: 'bf16' }
const bf = syntheticKv({ geometry: g8, tokens: T, seed: 1 })
const g: KvGeometry = { ...g8, dtype: 'fp16' }
const tensor = encodeElements(decodeElements(bf, 'bf16'), 'fp16')
const meta = {
  geometry: g,
  tokens: T,
  chunkIndex: 0,
  partial: false,
  namespaceId: new Uint8Array(16),
  chainKey: new Uint8Array(32),
  parentKey: new Uint8Array(32),
}
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
for (const [name, s] of samples) {
  const w = median(s.wall)
  const cp = median(s.cpu)
  console.log(
    `${name.padEnd(28)} ${w.toFixed(2).padStart(7)} ms  wall ${(mb / (w / 1e3)).toFixed(0).padStart(5)} MB/s  cpu ${(mb / (cp / 1e3)).toFixed(0).padStart(5)} MB/s`,
  )
}

// Decode through the client's codec pool: one prompt's chunks spread over 1, 2, … workers
// (KVGATE_POOL_SIZES, default 1,2 and all cores) — a node's decode rate should scale with its cores.
if (process.env.KVGATE_POOL_SIZES !== 'none') {
  const { CodecPool } = await import('../src/client/codec-pool.ts')
  const { availableParallelism } = await import('node:os')
  const sizes = (process.env.KVGATE_POOL_SIZES ?? `1,2,${availableParallelism()}`)
    .split(',')
    .map(Number)
    .filter((n, i, a) => n > 0 && a.indexOf(n) === i)
  const CHUNKS = 8
  for (const size of sizes) {
    const pool = new CodecPool(size)
    try {
      const outs = Array.from({ length: CHUNKS }, () => new Uint8Array(tensor.length))
      await Promise.all(outs.slice(0, size).map((o) => pool.decodeInto(obj, 'kvgate', o))) // start + warm the workers
      const walls: number[] = []
      for (let r = 0; r < 3; r++) {
        const t0 = performance.now()
        await Promise.all(outs.map((o) => pool.decodeInto(obj, 'kvgate', o)))
        walls.push(performance.now() - t0)
      }
      const w = median(walls)
      console.log(
        `pool of ${size} worker(s): ${CHUNKS} chunks decoded in ${w.toFixed(0)} ms = ${((CHUNKS * mb) / (w / 1e3)).toFixed(0)} MB/s fp16 (${pool.inline ? `inline: ${pool.inline}` : `${pool.counts.workerJobs} worker jobs`})`,
      )
    } finally {
      await pool.close()
    }
  }
}
