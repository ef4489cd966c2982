// Load vs recompute (issue 16): lookup + retrieve of a Llama-3.1-8B-shaped prefix into the
// caller's buffer from each tier (L1, L2 with the page cache dropped, L4 through a gateway on
// Ceph RadosGW with the default codec, decode on every core), beside the prefill time of the
// same prompt; break-even prefix length per tier and the node size at which L4 breaks even.
//
//   node --import tsx --expose-gc bench/load-vs-prefill.ts [--tokens 8192] [--repeats 3]
//
// Prefill is not measured here (no GPU on these machines): it is modelled from the model's
// FLOPs at a stated fraction of the H100's published bf16 dense peak (see PREFILL below).
// Loading is linear in tokens, so a run on fewer tokens than 32k is scaled linearly to 32k
// and says so.

import { mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync } from 'node:fs'
import { availableParallelism, loadavg } from 'node:os'
import { join } from 'node:path'
import { Pool } from 'undici'
import { KVCache } from '../src/client/index.ts'
import { evictFileCache } from '../src/client/native.ts'
import { decodeChunkInto } from '../src/codec/node.ts'
import { chunkBytes, MODEL_PRESETS } from '../src/core/layout.ts'
import { syntheticKv, tensorOf } from '../test/codec-fixtures.ts'
import { rgwFromEnv, startRgw } from '../test/support/rgw.ts'
import { startServeProcess } from './lib/serve-process.ts'
import { machineLine, median, table, writeResult } from './lib/stats.ts'
import { figureChart, writeSvg } from './lib/svg-chart.ts'

const HELP = `kvgate bench load-vs-prefill: time lookup + retrieve of a Llama-3.1-8B-shaped prefix from
L1, cold L2 and L4 (gateway on Ceph RadosGW, default codec; L4 also through retrieveLayers, the
agent's load path), with the client main thread's CPU per L4 chunk, beside the modelled GPU prefill.
  --tokens N    prefix length measured (multiple of 256; default 8192, scaled linearly to 32k)
  --repeats N   runs per tier (default 3; min/median/max reported)
Needs Ceph RadosGW (scripts/rgw/start.sh installs it as root) and writes load-vs-prefill.json.`

const argv = process.argv.slice(2)
if (argv.includes('--help') || argv.includes('-h')) {
  console.log(HELP)
  process.exit(0)
}
const flag = (name: string, dflt: number): number => {
  const i = argv.indexOf(name)
  if (i < 0) return dflt
  const v = Number(argv[i + 1])
  if (!Number.isInteger(v) || v <= 0) {
    console.error(`${name} needs a positive integer`)
    process.exit(2)
  }
  return v
}
const TOKENS = flag('--tokens', Number(process.env.KVGATE_BENCH_TOKENS ?? 8192))
const REPEATS = flag('--repeats', Number(process.env.KVGATE_BENCH_REPEATS ?? 3))
const TARGET = 32768
if (TOKENS % 256 !== 0) {
  console.error('--tokens must be a multiple of 256')
  process.exit(2)
}

const MODEL = 'llama-3.1-8b' as const
const g = MODEL_PRESETS[MODEL]
const CHUNK = 256
const cb = chunkBytes(g, CHUNK)
const N = TOKENS / CHUNK
const MiB = 1024 ** 2
const log = (s: string) => console.error(s)

// ---------------------------------------------------------------------------
// Prefill model. Llama-3.1-8B: d=4096, 32 layers, 32 query heads, 8 KV heads of 128, FFN 14336.
// Matmul FLOPs per token = 2 × non-embedding parameters; causal attention adds 2·d·n² per layer
// (QKᵀ and AV over the causal half). The GPU figure is NVIDIA's published H100 SXM bf16 dense
// peak (989 TFLOP/s, H100 datasheet); the model FLOPs utilisation of long-prompt prefill is taken
// as 0.5 (0.4–0.6 shown): a stated assumption, not a measurement.
const PREFILL = {
  d: 4096,
  layers: 32,
  kvDim: 1024,
  ffn: 14336,
  peakFlops: 989e12,
  mfu: 0.5,
  mfuRange: [0.4, 0.6] as const,
  source: 'FLOPs of Llama-3.1-8B at NVIDIA H100 SXM bf16 dense peak 989 TFLOP/s (datasheet) × MFU 0.5',
}
const PARAMS =
  PREFILL.layers *
  (PREFILL.d * (PREFILL.d + 2 * PREFILL.kvDim) + PREFILL.d * PREFILL.d + 3 * PREFILL.d * PREFILL.ffn)
function prefillFlops(n: number): number {
  return 2 * PARAMS * n + 2 * PREFILL.layers * PREFILL.d * n * n
}
function prefillMs(n: number, mfu = PREFILL.mfu): number {
  return (prefillFlops(n) / (PREFILL.peakFlops * mfu)) * 1000
}

// ---------------------------------------------------------------------------
function tokensOf(n: number, seed: number): Uint32Array {
  return Uint32Array.from({ length: n }, (_, i) => (i * 2654435761 + seed * 97) % 128256)
}

/**
 * Drops the page cache of every L2 file through the addon. Not by spawning dd: a fork
 * write-protects this process's pages (transparent huge pages), and the caller's buffer would
 * then pay a copy-on-write fault per page inside the timed retrieve.
 */
async function dropCache(dir: string): Promise<void> {
  for (const sub of readdirSync(dir)) {
    const d = join(dir, sub)
    for (const f of readdirSync(d)) await evictFileCache(join(d, f))
  }
}

interface Spread {
  min: number
  median: number
  max: number
}
const spread = (xs: number[]): Spread => ({ min: Math.min(...xs), median: median(xs), max: Math.max(...xs) })

/**
 * CPU time this process's main thread (the one that runs the client's JavaScript) has spent, ms,
 * from the kernel's scheduler statistics (ns; time waiting for a core not counted); undefined
 * where /proc has none. Node 20 has no per-thread CPU clock of its own.
 */
function mainThreadCpuMs(): number | undefined {
  try {
    const ns = Number(readFileSync(`/proc/self/task/${process.pid}/schedstat`, 'utf8').split(' ')[0])
    return Number.isFinite(ns) ? ns / 1e6 : undefined
  } catch {
    return undefined
  }
}

// ---------------------------------------------------------------------------
const scratch = mkdtempSync(join(process.env.KVGATE_BENCH_DIR ?? '/var/tmp', 'kvgate-load-bench-'))
const l2dir = join(scratch, 'l2')
mkdirSync(l2dir)
const cores = availableParallelism()
log(`load vs prefill: ${TOKENS} tokens (${N} chunks of ${cb / MiB} MiB), ${REPEATS} repeats, ${cores} cores`)
const rgw = rgwFromEnv() ?? (await startRgw({ bucket: 'kvgate-load-bench' }))
const gw = await startServeProcess(rgw, 'bench-load')
const toks = tokensOf(TOKENS, 11)
const into = new Uint8Array(N * cb)
const memory = { bytes: (N + 2) * (cb + 64 * 1024) }
// Timed to completion: a deadline would turn a slow tier into a partial (and faster-looking) answer.
const retrieveDeadlineMs = 3_600_000
const remote = {
  url: gw.url,
  timeoutMs: 120_000,
  lookupTimeoutMs: 10_000,
  maxQueuedWrites: N,
  maxQueuedBytes: 2 * N * cb,
}
const served = (mask: Uint8Array) => mask.reduce((a, b) => a + b, 0)

const res: Record<'l1' | 'l2' | 'l4', number[]> = { l1: [], l2: [], l4: [] }
let wireBytes = 0
let decodeGBsPerCore = 0
let perConnectionMBs = 0
// The main thread's CPU per L4 chunk: HTTP bodies in, copies out of the codec workers' staging
// into L1 and from L1 into the caller's buffer. One thread, so it caps a node's L4 rate whatever
// its cores: the model below counts it.
const mainMsPerChunk: number[] = []
/** The same through retrieveLayers (the agent's load path): wall ms per run, main-thread ms per chunk. */
const layersMs: number[] = []
const layersMainMsPerChunk: number[] = []
try {
  // Writer: every tier filled once (L4 through the gateway with the default codec).
  {
    log('[1/4] store the prefix into L1, L2 and L4 (default codec)…')
    const distinct = Array.from({ length: 4 }, (_, i) => tensorOf(syntheticKv(g, CHUNK, 21 + i), g.dtype))
    const kv = new Uint8Array(N * cb)
    for (let i = 0; i < N; i++) kv.set(distinct[i % distinct.length]!, i * cb)
    const w = await KVCache.open({
      model: MODEL,
      chunkTokens: CHUNK,
      memory,
      retrieveDeadlineMs,
      disk: { dir: l2dir, bytes: 2 * N * cb },
      remote,
      // The whole prefix goes down to L2 and L4 in the background: none of it may be shed.
      writeBehindBytes: 2 * N * cb,
    })
    await w.store(toks, kv)
    await w.flush(600_000)
    const s = w.stats()
    wireBytes = s.remote!.bytesWritten
    if (s.remote!.puts !== N) throw new Error(`only ${s.remote!.puts} of ${N} chunks reached L4`)
    // L1: the writer holds every chunk resident.
    log('[2/4] L1: lookup + retrieve of resident chunks…')
    for (let r = 0; r < REPEATS + 1; r++) {
      const t = performance.now()
      const mask = await w.retrieve(toks, { into })
      const ms = performance.now() - t
      if (served(mask) !== TOKENS) throw new Error(`L1 served ${served(mask)} of ${TOKENS}`)
      if (r > 0) res.l1.push(ms)
    }
    await w.close()
  }
  // L2: a new process view of the same directory, nothing in L1, page cache dropped each run.
  {
    log('[3/4] L2: lookup + retrieve with the page cache dropped…')
    const c = await KVCache.open({
      model: MODEL,
      chunkTokens: CHUNK,
      memory,
      retrieveDeadlineMs,
      disk: { dir: l2dir, bytes: 2 * N * cb },
    })
    for (let r = 0; r < REPEATS; r++) {
      c.clearMemory()
      await dropCache(l2dir)
      const t = performance.now()
      const mask = await c.retrieve(toks, { into })
      res.l2.push(performance.now() - t)
      if (served(mask) !== TOKENS) throw new Error(`L2 served ${served(mask)} of ${TOKENS}`)
    }
    await c.close()
  }
  // L4: a cold node (no L1/L2 content), decode on every core.
  {
    /**
     * One read of the whole prefix by a cold node (no L1/L2 content, a codec worker per core):
     * its wall ms and the main thread's CPU per chunk, after `read` checked what it served.
     */
    const coldRead = async (read: (c: KVCache) => Promise<void>, ms: number[], mainPerChunk: number[]) => {
      const c = await KVCache.open({
        model: MODEL,
        chunkTokens: CHUNK,
        memory,
        retrieveDeadlineMs,
        remote,
        codecWorkers: cores,
      })
      const cpu0 = mainThreadCpuMs()
      const t = performance.now()
      await read(c)
      ms.push(performance.now() - t)
      const cpu1 = mainThreadCpuMs()
      if (cpu0 !== undefined && cpu1 !== undefined) mainPerChunk.push((cpu1 - cpu0) / N)
      await c.close()
    }
    log(`[4/4] L4: cold node, lookup + retrieve through the gateway, ${cores} codec workers…`)
    for (let r = 0; r < REPEATS; r++) {
      await coldRead(
        async (c) => {
          const mask = await c.retrieve(toks, { into })
          if (served(mask) !== TOKENS) throw new Error(`L4 served ${served(mask)} of ${TOKENS}`)
        },
        res.l4,
        mainMsPerChunk,
      )
    }
    // The agent's load path (vLLM): layer by layer through `?layers=a-b` groups.
    log(`[4/4] L4: cold node, retrieveLayers (the agent's load path)…`)
    for (let r = 0; r < REPEATS; r++) {
      await coldRead(
        async (c) => {
          let chunks = 0
          for await (const batch of c.retrieveLayers(toks)) chunks = batch.chunks
          if (chunks !== N) throw new Error(`L4 retrieveLayers served ${chunks} of ${N} chunks`)
        },
        layersMs,
        layersMainMsPerChunk,
      )
    }
    // Components for the extrapolation: one core's decode rate, one connection's transfer rate.
    const pool = new Pool(gw.url, { connections: 1 })
    const probe = await KVCache.open({ model: MODEL, chunkTokens: CHUNK, memory: { bytes: 2 * cb }, remote })
    const hex = probe.keys(toks)[0]!.hex
    const ns = probe.namespace
    await probe.close()
    const objs: Uint8Array[] = []
    const getMs: number[] = []
    for (let r = 0; r < REPEATS + 1; r++) {
      const t = performance.now()
      const resp = await pool.request({
        path: `/v1/ns/${ns}/chunks/${hex}`,
        method: 'GET',
      })
      let body: Uint8Array
      if (resp.statusCode === 307) {
        await resp.body.dump()
        const loc = String(resp.headers.location)
        body = new Uint8Array(await (await fetch(loc)).arrayBuffer())
      } else body = new Uint8Array(await resp.body.arrayBuffer())
      if (r > 0) getMs.push(performance.now() - t)
      objs.push(body)
    }
    await pool.close()
    perConnectionMBs = objs[0]!.byteLength / median(getMs) / 1e3
    // Into one reused buffer, as the client decodes into L1 slots (a fresh 32 MiB output per call
    // would time page faults, not the codec).
    const out = new Uint8Array(cb)
    const decMs: number[] = []
    for (let r = 0; r < REPEATS + 4; r++) {
      const t = performance.now()
      decodeChunkInto(objs[r % objs.length]!, out)
      if (r > 1) decMs.push(performance.now() - t)
    }
    decodeGBsPerCore = cb / median(decMs) / 1e6
  }
} finally {
  await gw.close()
  await rgw.stop()
  rmSync(scratch, { recursive: true, force: true })
}

// ---------------------------------------------------------------------------
const scale = TARGET / TOKENS
const pf32k = prefillMs(TARGET)
const perToken = (ms: number) => ms / TOKENS
const tiers = (['l1', 'l2', 'l4'] as const).map((t) => {
  const s = spread(res[t])
  const at32k = s.median * scale
  // Break-even: the shortest prefix (whole chunks) whose load beats its prefill.
  let breakEven: number | undefined
  for (let n = CHUNK; n <= 131072; n += CHUNK) {
    if (perToken(s.median) * n < prefillMs(n)) {
      breakEven = n
      break
    }
  }
  return { tier: t, ms: s, at32kMs: at32k, marginX: pf32k / at32k, breakEvenTokens: breakEven }
})

// L4 on a node of c cores and a network of B Gbit/s: transfer, decode (min(16, c − 1) codec
// workers: the pool's default, which leaves the main thread a core; codecWorkers sets more) and the main thread's own work per chunk
// pipelined, so the slowest of the three sets the rate. Decode per token from the measured
// one-core rate; the main thread's from its measured CPU per chunk (on this shared machine a
// pessimistic figure: its copies compete with the workers for memory bandwidth).
const wirePerToken = wireBytes / TOKENS
const decodeMsPerTokenCore = (g.layers * 2 * g.kvHeads * g.headDim * 2) / (decodeGBsPerCore * 1e6)
const mainMs = mainMsPerChunk.length > 0 ? median(mainMsPerChunk) : 0
const mainThreadMs32k = (mainMs * TARGET) / CHUNK
const l4Model = (c: number, gbit: number) =>
  Math.max(
    ((wirePerToken * TARGET * 8) / (gbit * 1e9)) * 1000,
    (decodeMsPerTokenCore * TARGET) / Math.min(16, Math.max(1, c - 1)),
    mainThreadMs32k,
  )
const prefillPerToken32k = pf32k / TARGET
const coresToBreakEven = Math.ceil(decodeMsPerTokenCore / prefillPerToken32k) + 1
const gbitToBreakEven = (wirePerToken * 8) / (prefillPerToken32k / 1000) / 1e9
const nodeGrid = [8, 16, 32, 64].flatMap((c) =>
  [10, 25, 100].map((gbit) => ({ cores: c, gbit, ms: l4Model(c, gbit), beats: l4Model(c, gbit) < pf32k })),
)

const fmt = (x: number) => (x >= 100 ? x.toFixed(0) : x.toFixed(1))
console.log(
  `\nLoad vs prefill, Llama-3.1-8B-shaped bf16 KV (${(cb / MiB).toFixed(0)} MiB per 256 tokens), measured on ${TOKENS} tokens, scaled ×${scale} to ${TARGET}`,
)
console.log(
  `prefill of ${TARGET} tokens on one H100 (modelled: ${(prefillFlops(TARGET) / 1e12).toFixed(0)} TFLOP at MFU ${PREFILL.mfu}): ${fmt(pf32k)} ms (MFU ${PREFILL.mfuRange[1]}: ${fmt(prefillMs(TARGET, PREFILL.mfuRange[1]))} ms, ${PREFILL.mfuRange[0]}: ${fmt(prefillMs(TARGET, PREFILL.mfuRange[0]))} ms)`,
)
console.log(
  table([
    [
      'tier',
      `min ms (${TOKENS})`,
      'median',
      'max',
      `median at ${TARGET}`,
      'GB/s',
      'prefill ÷ load',
      'break-even',
    ],
    ...tiers.map((t) => [
      t.tier,
      fmt(t.ms.min),
      fmt(t.ms.median),
      fmt(t.ms.max),
      fmt(t.at32kMs),
      ((N * cb) / t.ms.median / 1e6).toFixed(2),
      `${t.marginX.toFixed(2)}×`,
      t.breakEvenTokens === undefined ? 'never ≤128k' : `${t.breakEvenTokens} tokens`,
    ]),
  ]),
)
console.log(
  `L4 components: ${(wireBytes / MiB).toFixed(1)} MiB on the wire (${((N * cb) / wireBytes).toFixed(2)}× smaller than bf16), one-core decode ${decodeGBsPerCore.toFixed(2)} GB/s of bf16 output, one connection ${perConnectionMBs.toFixed(0)} MB/s (localhost)`,
)
console.log(
  `L4 breaks even at 32k tokens with ≥ ${coresToBreakEven} cores (one of them the main thread's) and ≥ ${gbitToBreakEven.toFixed(1)} Gbit/s of network (${cores} cores here)`,
)
const layersMain = layersMainMsPerChunk.length > 0 ? median(layersMainMsPerChunk) : 0
console.log(
  `L4 through retrieveLayers (the agent's load path): median ${fmt(median(layersMs))} ms for ${TOKENS} tokens here (${fmt(median(layersMs) * scale)} ms at ${TARGET}); main thread ${fmt(layersMain)} ms of CPU per chunk (≥ ${fmt((layersMain * TARGET) / CHUNK)} ms for ${TARGET} tokens on any node)`,
)
console.log(
  `main thread: ${fmt(mainMs)} ms of CPU per L4 chunk (HTTP bodies, copies into L1 and into the caller's buffer): ${fmt(mainThreadMs32k)} ms for 32k tokens on any node, ${mainMs > 0 ? (cb / mainMs / 1e6).toFixed(1) : '—'} GB/s at most${mainThreadMs32k < pf32k ? '' : ' (at or over prefill)'}`,
)
console.log(
  table([
    ['node', ...[10, 25, 100].map((b) => `${b} Gbit/s`)],
    ...[8, 16, 32, 64].map((c) => [
      `${c} cores`,
      ...[10, 25, 100].map((b) => {
        const m = nodeGrid.find((x) => x.cores === c && x.gbit === b)!
        return `${fmt(m.ms)} ms ${m.beats ? '<' : '≥'} prefill`
      }),
    ]),
  ]),
)
console.log(
  `load average during the run: ${loadavg()
    .map((x) => x.toFixed(1))
    .join(' ')} (machine shared: figures are lower bounds)`,
)

const path = writeResult({
  name: 'load-vs-prefill',
  date: new Date().toISOString(),
  machine: await machineLine(),
  tokensMeasured: TOKENS,
  scaledTo: TARGET,
  prefill: { ...PREFILL, ms32k: pf32k, flops32k: prefillFlops(TARGET) },
  tiers,
  l4: {
    wireBytes,
    decodeGBsPerCore,
    perConnectionMBs,
    mainThreadMsPerChunk: mainMs,
    mainThreadMs32k,
    retrieveLayers: { ms: spread(layersMs), mainThreadMsPerChunk: layersMain },
    coresToBreakEven,
    gbitToBreakEven,
    nodeGrid,
  },
  bars: tiers.map((t) => ({
    bar: `${t.tier.toUpperCase()} load of a 32k-token Llama-3.1-8B prefix vs its prefill (lookup + retrieve into the caller's buffer)`,
    figure: t.at32kMs,
    unit: 'ms',
    baseline: pf32k,
    baselineLabel: 'modelled H100 prefill',
    ratio: t.marginX,
    target: 'load < prefill',
    met: t.at32kMs < pf32k,
    informational: true,
  })),
})
const svg = figureChart(
  `Load vs prefill of a ${TARGET}-token Llama-3.1-8B prefix (ms, lower is better; L4 on ${cores} cores here)`,
  'ms',
  [
    ...tiers.map((t) => ({ label: `${t.tier.toUpperCase()} lookup + retrieve`, value: t.at32kMs })),
    ...nodeGrid
      .filter((m) => m.gbit === 25)
      .map((m) => ({ label: `L4 modelled: ${m.cores} cores, 25 Gbit/s`, value: m.ms })),
    { label: 'prefill, one H100 (modelled)', value: pf32k, baseline: true },
  ],
  [{ value: pf32k, label: 'prefill' }],
)
log(`wrote ${path} and ${writeSvg('load-vs-prefill', svg)}`)
