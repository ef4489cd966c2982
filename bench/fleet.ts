// Fleet simulation benchmark: N client processes (some joining mid-run, cold) share KV
// through one gateway on Ceph RadosGW (or --store fs); hit rate per tier vs an oracle,
// S3 requests and their list-price cost per 1,000 prefix hits, stored bytes, prefill saved.
// Run: node --import tsx bench/fleet.ts [--help]   (or: npx kvgate bench fleet)

import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { parseArgs } from 'node:util'
import type { ChunkCodecName } from '../src/client/chunk-codec.ts'
import { PRICES } from '../src/fleet/pricing.ts'
import { type FleetResult, pct, runFleet } from '../src/fleet/run.ts'
import { FsStore, S3Store } from '../src/gateway/node.ts'
import type { ObjectStore } from '../src/gateway/stores/types.ts'
import { type Rgw, rgwFromEnv, startRgw } from '../test/support/rgw.ts'
import { type BarResult, machineLine, table, writeResult } from './lib/stats.ts'
import { barChart, lineChart, stackSvgs, writeSvg } from './lib/svg-chart.ts'

const HELP = `Usage: kvgate bench fleet [options]   (node --import tsx bench/fleet.ts [options])

A fleet of client processes behind one gateway, driven by a deterministic
prefix-sharing workload (shared system prompts, Zipf-popular documents,
multi-turn conversations); nodes that join mid-run start with cold L1/L2.
Requests run in sequence and every node flushes its writes to L4 before the
next request, so the oracle (every chunk ever stored) is the best any cache
could do and each difference from it is a real miss.

Options:
  --requests N              requests in the run [400]
  --nodes N                 nodes in all [4]
  --joining N               of which join mid-run [2]
  --seed N                  workload seed [42]
  --store rgw|fs            gateway store: Ceph RadosGW (started here) or a directory [rgw]
  --codec C                 L4 codec: lossless | kvgate | raw [lossless]
  --chunk-tokens N          [64]
  --prefill-tokens-per-s N  assumed engine prefill speed for "time saved" [10000,
                            an 8B model on one H100]
  --price s3-standard|r2    list prices for the cost lines [s3-standard]
  --name NAME               result name: NAME.json + .svg in the results directory [fleet]
  --out DIR                 results directory (kvgate bench passes it as KVGATE_BENCH_OUT)
  -h, --help`

const { values } = parseArgs({
  options: {
    requests: { type: 'string' },
    nodes: { type: 'string' },
    joining: { type: 'string' },
    seed: { type: 'string' },
    store: { type: 'string' },
    codec: { type: 'string' },
    'chunk-tokens': { type: 'string' },
    'prefill-tokens-per-s': { type: 'string' },
    price: { type: 'string' },
    name: { type: 'string' },
    help: { type: 'boolean', short: 'h' },
  },
  strict: true,
})
if (values.help) {
  console.log(HELP)
  process.exit(0)
}

function int(name: string, v: string | undefined, dflt: number, min = 0): number {
  if (v === undefined) return dflt
  const n = Number(v)
  if (!/^\d+$/.test(v) || !Number.isSafeInteger(n) || n < min) {
    console.error(`bench fleet: invalid --${name} '${v}'`)
    process.exit(2)
  }
  return n
}

const requests = int('requests', values.requests, 400, 1)
const nodes = int('nodes', values.nodes, 4, 1)
const joining = int('joining', values.joining, Math.min(2, nodes - 1))
if (joining >= nodes) {
  console.error('bench fleet: --joining must leave at least one node at the start')
  process.exit(2)
}
const seed = int('seed', values.seed, 42)
const chunkTokens = int('chunk-tokens', values['chunk-tokens'], 64, 1)
const tps = int('prefill-tokens-per-s', values['prefill-tokens-per-s'], 10_000, 1)
const codec = (values.codec ?? 'lossless') as ChunkCodecName
if (!['lossless', 'kvgate', 'raw'].includes(codec)) {
  console.error(`bench fleet: invalid --codec '${codec}'`)
  process.exit(2)
}
const priceName = (values.price ?? 's3-standard') as keyof typeof PRICES
const price = PRICES[priceName]
if (!price) {
  console.error(`bench fleet: invalid --price '${priceName}' (s3-standard or r2)`)
  process.exit(2)
}
const outName = values.name ?? 'fleet'
const wantStore = values.store ?? 'rgw'
if (wantStore !== 'rgw' && wantStore !== 'fs') {
  console.error(`bench fleet: invalid --store '${wantStore}' (rgw or fs)`)
  process.exit(2)
}

// ---------------------------------------------------------------- store
let rgw: Rgw | undefined
let store: ObjectStore
let storeLabel: string
let fsDir: string | undefined
if (wantStore === 'rgw') {
  try {
    console.error('starting Ceph RadosGW (a real S3; ~15 s)…')
    rgw = rgwFromEnv() ?? (await startRgw({ bucket: 'kvgate-fleet' }))
  } catch (e) {
    console.error(
      `!! RadosGW could not start (${(e as Error).message.split('\n')[0]}): falling back to the fs store. Results below are NOT against S3.`,
    )
  }
}
if (rgw) {
  store = new S3Store({
    bucket: rgw.bucket,
    endpoint: rgw.endpoint,
    region: rgw.region,
    credentials: { accessKeyId: rgw.accessKeyId, secretAccessKey: rgw.secretAccessKey },
  })
  storeLabel = `s3 (Ceph RadosGW on loopback, ${rgw.endpoint})`
} else {
  fsDir = mkdtempSync(join(tmpdir(), 'kvgate-fleet-store-'))
  store = await new FsStore({ root: fsDir }).open()
  storeLabel = 'fs (local directory)'
}

// ---------------------------------------------------------------- run
let result: FleetResult
try {
  result = await runFleet({
    store,
    storeLabel,
    workload: { seed, requests, initialNodes: nodes - joining, joiningNodes: joining },
    chunkTokens,
    codec,
    prefillTokensPerSecond: tps,
    price,
    onProgress: (l) => console.error(l),
  })
} finally {
  await store.close?.()
  await rgw?.stop()
  if (fsDir) rmSync(fsDir, { recursive: true, force: true })
}

// ---------------------------------------------------------------- report
const t = result.totals
const KiB = 1024
const fmtB = (n: number) =>
  n >= 1024 ** 3
    ? `${(n / 1024 ** 3).toFixed(2)} GiB`
    : n >= 1024 ** 2
      ? `${(n / 1024 ** 2).toFixed(1)} MiB`
      : `${(n / KiB).toFixed(1)} KiB`
const share = (n: number) => (t.chunks > 0 ? pct(n / t.chunks) : '—')
console.log(
  `\nfleet: ${t.requests} requests, ${result.nodes.length} nodes, ${storeLabel}, codec ${codec}, ${chunkTokens}-token chunks, seed ${seed}`,
)
console.log('hit rates are over whole chunks requested (a trailing partial chunk is never cached)\n')
console.log(
  table([
    ['', 'chunks', 'hit rate'],
    ['requested', t.chunks, ''],
    ['L1 memory hits', t.byTier.memory, share(t.byTier.memory)],
    ['L2 disk hits', t.byTier.disk, share(t.byTier.disk)],
    ['L4 gateway hits', t.byTier.remote, share(t.byTier.remote)],
    ['all tiers', t.served, share(t.served)],
    ['oracle', t.oracle, share(t.oracle)],
    ['actual / oracle', '', `${t.vsOracle.toFixed(3)}×`],
  ]),
)
console.log('')
console.log(
  table([
    ['node', 'joins at', 'requests', 'hit rate', 'oracle', 'L1', 'L2', 'L4'],
    ...result.nodes.map((n) => [
      n.node,
      n.joinAt,
      n.requests,
      n.chunks > 0 ? pct(n.served / n.chunks) : '—',
      n.chunks > 0 ? pct(n.oracle / n.chunks) : '—',
      n.byTier.memory,
      n.byTier.disk,
      n.byTier.remote,
    ]),
  ]),
)
const ops = result.gateway.storeOps
const cost = result.cost
console.log('')
console.log(
  table([
    ['bytes moved', ''],
    ['L1 read', fmtB(result.bytes.read.memory)],
    ['L2 read / written', `${fmtB(result.bytes.read.disk)} / ${fmtB(result.bytes.written.disk)}`],
    [
      'L4 read / written (encoded)',
      `${fmtB(result.bytes.read.remote)} / ${fmtB(result.bytes.written.remote)}`,
    ],
  ]),
)
console.log('')
console.log(
  table([
    ['S3 requests (gateway /metrics)', 'count'],
    ['GET', ops.get],
    ['HEAD', ops.head],
    ['PUT', ops.put],
    ['LIST', ops.list],
    [`cost at ${price.name} list price`, `$${cost.requestDollars.toFixed(5)}`],
    [`$ per 1,000 prefix hits (${t.prefixHits} requests hit)`, `$${cost.perThousandPrefixHits.toFixed(5)}`],
  ]),
)
console.log('')
console.log(
  `stored: ${cost.storedObjects} objects, ${fmtB(cost.storedBytes)} (${cost.compressionRatio.toFixed(2)}× smaller than raw), $${cost.storageDollarsPerMonth.toFixed(6)}/month;` +
    ` the same tokens as Llama-3.1-8B bf16 KV: ${fmtB(cost.at8b.storedBytes)}, $${cost.at8b.storageDollarsPerMonth.toFixed(4)}/month`,
)
console.log(
  `prefill saved: ${result.prefill.savedTokens} tokens = ${result.prefill.savedSeconds.toFixed(2)} s of GPU prefill at an assumed ${tps} tokens/s (an 8B model on one H100)`,
)
console.log(
  `N writers: ${result.writers.nodes} nodes stored one ${result.writers.chunks}-chunk prefix at once → ${result.writers.putsAtGateway} PUTs at the gateway (${result.writers.createdAtGateway} created, ${result.writers.existsAtGateway} already there), ${result.writers.objectsCreated} objects stored`,
)
console.log(
  `node-side medians: lookup ${t.p50Ms.lookup.toFixed(1)} ms, retrieve ${t.p50Ms.retrieve.toFixed(1)} ms, store+flush ${t.p50Ms.store.toFixed(1)} ms; verified chunks that were wrong: ${t.badChunks}; wall ${(result.wallMs / 1000).toFixed(1)} s`,
)

const bars: BarResult[] = [
  {
    bar: 'fleet: overall hit rate within 5% of the oracle',
    figure: 100 * t.hitRate,
    unit: '% of chunks',
    baseline: 100 * t.oracleHitRate,
    baselineLabel: 'oracle (every chunk ever stored)',
    ratio: t.vsOracle,
    target: '≥ 0.95× oracle',
    met: t.vsOracle >= 0.95 && t.badChunks === 0,
  },
  {
    bar: `fleet: ${result.writers.nodes} writers of one prefix ⇒ 1 stored object per chunk`,
    figure: result.writers.objectsPerChunk,
    unit: 'objects / chunk',
    baseline: result.writers.putsAtGateway / Math.max(1, result.writers.chunks),
    baselineLabel: 'PUTs / chunk that reached the gateway',
    target: '= 1',
    met: result.writers.objectsPerChunk === 1,
  },
  {
    bar: 'fleet: S3 request cost per 1,000 prefix hits (reported)',
    figure: cost.perThousandPrefixHits,
    unit: `$ (${price.name})`,
    target: 'reported',
    met: true,
  },
]

// ---------------------------------------------------------------- chart
const win = Math.max(5, Math.floor(t.requests / 20))
const timeline = (pick: (r: FleetResult['requests'][number]) => number): [number, number][] => {
  const pts: [number, number][] = []
  for (let i = 0; i + win <= result.requests.length; i += Math.max(1, Math.floor(win / 2))) {
    const slice = result.requests.slice(i, i + win)
    const chunks = slice.reduce((a, r) => a + r.chunks, 0)
    pts.push([i + win, chunks > 0 ? (100 * slice.reduce((a, r) => a + pick(r), 0)) / chunks : 0])
  }
  return pts
}
const joins = result.nodes.filter((n) => n.joinAt > 0).map((n) => `node ${n.node} joins at ${n.joinAt}`)
const MiB = 1024 ** 2
const svg = stackSvgs([
  lineChart({
    title: `Chunk hit rate over the run, windows of ${win} requests${joins.length ? ` (${joins.join(', ')})` : ''}`,
    xLabel: 'request',
    yLabel: '% of chunks requested',
    series: [
      { name: 'oracle', points: timeline((r) => r.oracle), color: '#999999' },
      { name: 'actual, all tiers', points: timeline((r) => r.served) },
      { name: 'actual, from L4', points: timeline((r) => r.byTier.remote) },
    ],
  }),
  barChart({
    title: `Bytes moved per tier (${storeLabel}, codec ${codec})`,
    categories: ['L1 read', 'L2 read', 'L4 read', 'L2 written', 'L4 written'],
    series: [
      {
        name: 'MiB',
        values: [
          result.bytes.read.memory,
          result.bytes.read.disk,
          result.bytes.read.remote,
          result.bytes.written.disk,
          result.bytes.written.remote,
        ].map((b) => b / MiB),
      },
    ],
    yLabel: 'MiB',
    digits: 1,
  }),
])
const { requests: perRequest, ...summary } = result
const path = writeResult({
  name: outName,
  date: new Date().toISOString(),
  machine: await machineLine(),
  bars,
  ...summary,
  timeline: perRequest.map((r) => [
    r.seq,
    r.node,
    r.chunks,
    r.served,
    r.oracle,
    r.byTier.memory,
    r.byTier.disk,
    r.byTier.remote,
  ]),
  timelineColumns: ['seq', 'node', 'chunks', 'served', 'oracle', 'l1', 'l2', 'l4'],
})
const svgPath = writeSvg(outName, svg)
console.log(`\nbars:`)
for (const b of bars)
  console.log(
    `  ${b.met ? 'met    ' : 'NOT MET'} ${b.bar}: ${b.figure.toPrecision(4)} ${b.unit} (target ${b.target})`,
  )
console.log(`wrote ${path} and ${svgPath}`)
if (!bars.every((b) => b.met)) process.exitCode = 1
