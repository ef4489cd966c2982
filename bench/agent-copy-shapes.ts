// The agent's host copies alone, in one process: a Llama-3.1-8B 32 MiB chunk's 16 scattered
// blocks saved (gatherChunk) and loaded (scatterLayers) through HostCopier for each vLLM view
// order, against one memcpy of the same bytes per repeat (the agent bar's ratio, without the
// socket, the L1 and the event loop around it: for comparing copy shapes quickly; bench/agent-ab.ts
// is the judge).
//   KVGATE_BENCH_REPEATS=60 KVGATE_BENCH_KV_LAYOUT=LBHNC node --import tsx bench/agent-copy-shapes.ts
// Writes bench/results/agent-copy-shapes.json.

import { mkdirSync, unlinkSync, writeFileSync } from 'node:fs'
import { loadavg } from 'node:os'
import { join } from 'node:path'
import { chunkRuns, type EngineGeometry, layerView } from '../src/agent/engine-layout.ts'
import { HostCopier, HostTensor } from '../src/agent/host-tensor.ts'
import { loadNative } from '../src/client/native-api.ts'
import { headerBytesFor } from '../src/core/format.ts'
import { benchKvLayout, createLlama8BKv, shuffled } from './lib/agent-client.ts'
import { median, table } from './lib/stats.ts'

const layout = benchKvLayout()
const repeats = Number(process.env.KVGATE_BENCH_REPEATS ?? 40)
const threads = Number(process.env.KVGATE_BENCH_THREADS ?? 2)
const MiB = 1024 ** 2

const native = loadNative().api
if (!native) throw new Error(`no native addon: ${loadNative().reason}`)
const kv = createLlama8BKv(join(process.env.KVGATE_BENCH_SHM ?? '/dev/shm', `kvgate-shapes-${process.pid}`))
try {
  const g: EngineGeometry = {
    layout: 'flash-attn',
    dtype: 'bf16',
    layers: kv.layers,
    kvHeads: 8,
    headSize: 128,
    blockSize: 16,
  }
  const C = 256
  const shape = layout === 'flash-attn' ? [2, kv.numBlocks, 16, 8, 128] : [kv.numBlocks, 8, 16, C]
  const strides =
    layout === 'flash-attn'
      ? undefined
      : layout === 'LBNHC'
        ? [16 * 8 * C, C, 8 * C, 1]
        : [8 * 16 * C, 16 * C, C, 1]
  const view = layerView(g, kv.numBlocks, shape, strides, 'bench')
  const tensors = Array.from(
    { length: kv.layers },
    (_, l) => new HostTensor(kv.path, l * kv.layerBytes, kv.layerBytes, native),
  )
  const copier = HostCopier.for(tensors, native, threads)
  if (!copier) throw new Error('no HostCopier: the addon lacks copyRunsAsync or mapFile')
  const chunkBytes = 32 * MiB
  const slab = chunkBytes / kv.layers
  // As the agent's L1: the chunk tensor after the chunk object's header in a pinned slot.
  const offset = headerBytesFor(kv.layers)
  const region = new Uint8Array(native.allocPinnedSync(chunkBytes + offset + 4096).buffer)
  const chunk = region.subarray(offset, offset + chunkBytes)
  chunk.fill(3)
  const src = Buffer.alloc(chunkBytes, 7)
  const dst = Buffer.alloc(chunkBytes, 1)
  const save: number[] = []
  const load: number[] = []
  const memcpy: number[] = []
  for (let i = 0; i < repeats + 2; i++) {
    const order = shuffled(kv.numBlocks, i + 1)
    let t = performance.now()
    src.copy(dst)
    const m = performance.now() - t
    t = performance.now()
    await copier.gatherChunk(chunkRuns(g, view, order, 0, 16, 0), chunk, slab)
    const s = performance.now() - t
    t = performance.now()
    const runs = chunkRuns(g, view, order, 16, 16, 0)
    const group = Array.from({ length: kv.layers }, (_, l) => ({
      layer: l,
      chunks: 1,
      slabs: [chunk.subarray(l * slab, (l + 1) * slab)],
    }))
    await copier.scatterLayers(group, [runs])
    const l = performance.now() - t
    if (i < 2) continue
    memcpy.push(m)
    save.push(m / s)
    load.push(m / l)
  }
  for (const t of tensors) t.close()
  const spread = (xs: number[], d = 2) =>
    `${Math.min(...xs).toFixed(d)} / ${median(xs).toFixed(d)} / ${Math.max(...xs).toFixed(d)}`
  console.log(
    `${layout}, ${threads} copy threads, ${repeats} repeats; ratio to one memcpy of the same 32 MiB (min / median / max)`,
  )
  console.log(
    table([
      ['save', 'load', 'memcpy ms'],
      [spread(save), spread(load), spread(memcpy)],
    ]),
  )
  const load1 = loadavg()[0]!
  console.log(`machine load average: ${load1.toFixed(1)}`)
  mkdirSync('bench/results', { recursive: true })
  writeFileSync(
    'bench/results/agent-copy-shapes.json',
    JSON.stringify({ layout, threads, repeats, save, load, memcpy, loadavg: load1 }, null, 1),
  )
} finally {
  unlinkSync(kv.path)
}
