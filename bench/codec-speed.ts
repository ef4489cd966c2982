// Quick speed profile of the wasm codec on one Llama-3.1-8B-shaped 32 MiB chunk
// (fp16): chunk API vs the raw wasm calls (no copies) vs a plain memcpy, so the
// wrapper's share is visible. Optional: KVGATE_WASM=<path> times another build.

import { readFileSync } from 'node:fs'
import { decodeChunkInto, encodeChunk, layerTargets } from '../src/codec/node.ts'
import { decodeElements, encodeElements } from '../src/core/dtype.ts'
import { decodeHeader, sectionOf } from '../src/core/format.ts'
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

/**
 * Median wall-clock ms and median ms of this process's CPU time (the machine is
 * shared: CPU time is the steadier profile figure; the bar is wall clock).
 */
function time(fn: () => void, repeats = REPEATS): [number, number] {
  fn()
  const wall: number[] = []
  const cpu: number[] = []
  for (let i = 0; i < repeats; i++) {
    const c0 = process.cpuUsage()
    const t0 = performance.now()
    fn()
    wall.push(performance.now() - t0)
    const u = process.cpuUsage(c0)
    cpu.push((u.user + u.system) / 1e3)
  }
  return [median(wall), median(cpu)]
}

const obj = encodeChunk(tensor, meta, { mode: 'kvgate', quality: QUALITY })
const header = decodeHeader(obj)
const out = new Uint8Array(tensor.length)
const c = g.kvHeads * g.headDim
const slab = tensor.length / g.layers
const sections = Array.from({ length: g.layers }, (_, l) => sectionOf(obj, header, l))
console.log(`q${QUALITY}: ${(tensor.length / obj.length).toFixed(3)}× vs fp16 (${obj.length} bytes)`)

const memcpy = time(() => out.set(tensor))
const encApi = time(() => encodeChunk(tensor, meta, { mode: 'kvgate', quality: QUALITY }))
const decApi = time(() => decodeChunkInto(obj, out))
const decBf = (() => {
  const o = encodeChunk(bf, { ...meta, geometry: g8 }, { mode: 'kvgate', quality: QUALITY })
  return time(() => decodeChunkInto(o, out))
})()

// Raw wasm: sections already in wasm memory, output left there.
const wasmPath = process.env.KVGATE_WASM ?? new URL('../wasm/kvgate_codec.wasm', import.meta.url)
const inst = new WebAssembly.Instance(new WebAssembly.Module(readFileSync(wasmPath)), {})
const e = inst.exports as Record<string, (...a: number[]) => number> & { memory: WebAssembly.Memory }
const srcPtrs = sections.map((s) => {
  const p = e.kv_alloc!(s.length)
  new Uint8Array(e.memory.buffer, p, s.length).set(s)
  return p
})
const dst = e.kv_alloc!(slab)
const decRaw = time(() => {
  for (let l = 0; l < g.layers; l++) {
    const rc = e.kv_decode!(2, srcPtrs[l]!, sections[l]!.length, 1, T, c, dst)
    if (rc !== 0) throw new Error(`decode ${rc}`)
  }
})
const src = e.kv_alloc!(slab)
new Uint8Array(e.memory.buffer, src, slab).set(tensor.subarray(0, slab))
const par = e.kv_alloc!(32)
const encRaw = time(() => {
  for (let l = 0; l < g.layers; l++) {
    const { kLevels, vLevels } = layerTargets(QUALITY, l, g.layers)
    new Float32Array(e.memory.buffer, par, 8).set([0, 0, 0, 0, 1, 8, kLevels, -vLevels])
    new Uint8Array(e.memory.buffer, src, slab).set(tensor.subarray(l * slab, (l + 1) * slab))
    const n = e.kv_encode!(2, src, 1, T, c, par)
    if (n < 0) throw new Error(`encode ${n}`)
  }
})
const row = (name: string, [ms, min]: [number, number]) =>
  console.log(
    `${name.padEnd(34)} median ${ms.toFixed(2).padStart(7)} ms ${(mb / (ms / 1e3)).toFixed(0).padStart(6)} MB/s   cpu ${(mb / (min / 1e3)).toFixed(0).padStart(6)} MB/s`,
  )
row('memcpy 32 MiB', memcpy)
row('encode (chunk API)', encApi)
row('encode (raw wasm, incl. copy in)', encRaw)
row('decode fp16 (chunk API)', decApi)
row('decode bf16 (chunk API)', decBf)
row('decode fp16 (raw wasm, no copies)', decRaw)
