// Gateway benchmark against Ceph RadosGW on loopback, all in one run:
// 32 MiB chunk GET/PUT through the gateway vs direct through the same SDK (same
// concurrency), cold/warm 512-chunk lookups (store round trips + latency), N
// writers of one prefix, and lookup requests/s under load.
// Run: node --import tsx bench/gateway.ts   (starts its own RGW unless KVGATE_RGW_* is set)

import { spawn } from 'node:child_process'
import { readdirSync, readFileSync, writeFileSync } from 'node:fs'
import { Agent, request as httpRequest } from 'node:http'
import { cpus, loadavg } from 'node:os'
import { join } from 'node:path'
import { createInterface } from 'node:readline'
import { fileURLToPath } from 'node:url'
import { GetObjectCommand, PutObjectCommand } from '@aws-sdk/client-s3'
import { createGateway } from '../src/gateway/index.ts'
import { S3Store } from '../src/gateway/node.ts'
import { nodeFlagsFor, siblingModule } from '../src/package-files.ts'
import { makeChain, makeChunk, putInit } from '../test/gateway-fixtures.ts'
import { rgwFromEnv, startRgw } from '../test/support/rgw.ts'
import { type ServeProcess, startServeProcess } from './lib/serve-process.ts'
import { type BarResult, machineLine, median, RESULTS_DIR, table, writeResult } from './lib/stats.ts'
import { barChart } from './lib/svg-chart.ts'

const MIB = 1024 * 1024
const CHUNK = 32 * MIB
const OBJECTS = Number(process.env.BENCH_OBJECTS ?? 8)
const CONCURRENCY = Number(process.env.BENCH_CONCURRENCY ?? 4)
const REPEATS = Number(process.env.BENCH_REPEATS ?? 5)

const rgw = rgwFromEnv() ?? (await startRgw({ bucket: 'kvgate-bench' }))
const storeOpts = {
  bucket: rgw.bucket,
  endpoint: rgw.endpoint,
  region: rgw.region,
  credentials: { accessKeyId: rgw.accessKeyId, secretAccessKey: rgw.secretAccessKey },
}
const direct = new S3Store(storeOpts) // its client is "the same SDK" with the same agent settings
const gwStore = new S3Store(storeOpts) // for in-process lookups (cold cache per app)
// The gateway runs as its own process (`kvgate serve`), as deployed: the load
// generator must not share its event loop.
const gw = await startServe(['--presign-min-bytes', 'off']) // every byte through the gateway
// A second one answers large GETs with 307 to a presigned RGW URL (bytes bypass it).
const gwRedirect = await startServe(['--presign-min-bytes', String(16 * 1024 * 1024)])
// Optional A/B: BENCH_GATEWAY_B=<another checkout's src/cli/main.ts> adds that build
// as a fourth path, measured in the same rotated repeats (e.g. main vs a branch).
const GATEWAY_B = process.env.BENCH_GATEWAY_B
const gwB = GATEWAY_B ? await startServe([], GATEWAY_B) : undefined
// The floor: a bare Node pipe proxy (no verification, no web streams) in its own process.
const bare = await startBareProxy()
console.error(
  `rgw ${rgw.endpoint}, gateway ${gw.url}, redirecting gateway ${gwRedirect.url}, bare proxy ${bare.url}`,
)

async function startBareProxy(): Promise<{ url: string; pid: number; close(): Promise<void> }> {
  const file = siblingModule(import.meta.url, './lib/gateway-bare-proxy.ts')
  const proc = spawn(process.execPath, [...nodeFlagsFor(file), fileURLToPath(file)], {
    stdio: ['ignore', 'pipe', 'inherit'],
    env: {
      ...process.env,
      RGW_ENDPOINT: rgw.endpoint,
      RGW_ACCESS_KEY: rgw.accessKeyId,
      RGW_SECRET_KEY: rgw.secretAccessKey,
      RGW_BUCKET: rgw.bucket,
    },
  })
  const url = await new Promise<string>((resolve, reject) => {
    createInterface({ input: proc.stdout! }).on('line', (l) =>
      resolve((JSON.parse(l) as { url: string }).url),
    )
    proc.once('exit', (code) => reject(new Error(`bare proxy exited ${code}`)))
  })
  return {
    url,
    pid: proc.pid!,
    close: () =>
      new Promise<void>((r) => {
        proc.once('exit', () => r())
        proc.kill('SIGTERM')
      }),
  }
}

/** CPU seconds (user+sys) a process has used, from /proc (Linux). */
function cpuSeconds(pid: number): number {
  try {
    const f = readFileSync(`/proc/${pid}/stat`, 'utf8').split(') ')[1]!.split(' ')
    return (Number(f[11]) + Number(f[12])) / 100
  } catch {
    return Number.NaN
  }
}

/** The Ceph daemons behind the RGW (pid files of a private one, or KVGATE_RGW_DIR); [] if unknown. */
function findCephPids(): number[] {
  const dir = rgw.dir ?? process.env.KVGATE_RGW_DIR
  if (!dir) return []
  const run = join(dir, 'run')
  try {
    return readdirSync(run)
      .filter((f) => f.endsWith('.pid'))
      .map((f) => Number(readFileSync(join(run, f), 'utf8').trim()))
      .filter((pid) => Number.isInteger(pid) && pid > 0)
  } catch {
    return []
  }
}

function startServe(extra: string[] = [], main?: string): Promise<ServeProcess> {
  return startServeProcess(rgw, 'bench', extra, ...(main ? [main] : []))
}

async function pool<T>(n: number, conc: number, fn: (i: number) => Promise<T>): Promise<T[]> {
  const out: T[] = new Array(n)
  let next = 0
  await Promise.all(
    Array.from({ length: conc }, async () => {
      for (let i = next++; i < n; i = next++) out[i] = await fn(i)
    }),
  )
  return out
}

async function drain(body: ReadableStream<Uint8Array> | null | undefined): Promise<number> {
  let n = 0
  if (!body) return 0
  for await (const piece of body as unknown as AsyncIterable<Uint8Array>) n += piece.length
  return n
}

// ---------------------------------------------------------------- throughput
// Each repeat runs PUT then GET for the three paths — direct SDK, gateway, bare
// pipe proxy — in an order rotated per repeat (none always runs first on a
// fresher RGW); figures are medians over repeats. Every phase also records the
// CPU seconds each party spent per GiB moved: this client, the proxy process
// and the Ceph processes (RGW, OSD, mon). On a 2-core machine that sum, not any
// one process, is what caps throughput: "CPU-bound ratio" (direct total / path
// total) is the ratio to expect when the cores are the bottleneck. Objects are deleted only after the last
// repeat so RGW's garbage collection (freed tails) never runs inside a phase.
const chunks = Array.from({ length: OBJECTS }, () => makeChunk({ layers: 32, sectionBytes: CHUNK / 32 }))
const size = chunks[0]!.bytes.length
const mbps = (bytes: number, ms: number) => bytes / MIB / (ms / 1000)
const GIB_MOVED = (OBJECTS * size) / 1024 ** 3
type Side = 'direct' | 'gateway' | 'bare' | 'gatewayB'
type Op = 'put' | 'get'
interface PhaseSample {
  mibps: number
  /** CPU seconds per GiB: this client, the proxy process (none for direct), Ceph, all three. */
  client: number
  proxy: number
  ceph: number
  total: number
}
const samples: Record<`${Op}-${Side}`, PhaseSample[]> = {
  'put-direct': [],
  'put-gateway': [],
  'put-bare': [],
  'get-direct': [],
  'get-gateway': [],
  'get-bare': [],
  'put-gatewayB': [],
  'get-gatewayB': [],
}
const getRedirect: number[] = []
const selfCpu = () => {
  const u = process.cpuUsage()
  return (u.user + u.system) / 1e6
}
const cephPids = findCephPids()
const cephCpu = () => cephPids.reduce((a, pid) => a + cpuSeconds(pid), 0)
const proxyPid: Record<Side, number | undefined> = {
  direct: undefined,
  gateway: gw.pid,
  bare: bare.pid,
  gatewayB: gwB?.pid,
}
const directKey = (ns: string, i: number) => `direct/${ns}/${chunks[i]!.key}`

async function transfer(side: Side, op: Op, ns: string, i: number): Promise<void> {
  const c = chunks[i]!
  if (side === 'direct') {
    if (op === 'put') {
      await direct.client.send(
        new PutObjectCommand({
          Bucket: rgw.bucket,
          Key: directKey(ns, i),
          Body: c.bytes,
          ContentLength: size,
          IfNoneMatch: '*',
        }),
      )
    } else {
      const r = await direct.client.send(new GetObjectCommand({ Bucket: rgw.bucket, Key: directKey(ns, i) }))
      if ((await drain(r.Body!.transformToWebStream() as ReadableStream<Uint8Array>)) !== size)
        throw new Error('short direct GET')
    }
    return
  }
  const url =
    side === 'bare'
      ? `${bare.url}/k/bare/${ns}/${c.key}`
      : `${(side === 'gatewayB' ? gwB! : gw).url}/v1/ns/${side === 'gatewayB' ? `b${ns}` : ns}/chunks/${c.key}`
  const r = FETCH_CLIENT
    ? await fetchCall(url, op === 'put' ? c.bytes : undefined)
    : await httpCall(url, op === 'put' ? c.bytes : undefined)
  if (op === 'put' && r.status !== (side === 'bare' ? 200 : 201))
    throw new Error(`${side} PUT ${r.status} ${r.bytes}`)
  if (op === 'get' && r.bytes !== size) throw new Error(`short ${side} GET ${r.status}`)
}

// The proxies' load generator speaks node:http over keep-alive sockets, as the
// SDK's handler does for the direct runs: the client library is then the same
// on both sides. (Node's fetch spent ~3 CPU-s per GiB sent — 4× the SDK — and on
// two shared cores that cost lands on the proxy's throughput, not the client's.)
// BENCH_PROXY_CLIENT=fetch drives the proxies with Node's fetch instead (it sends and
// reads smaller pieces: the case where the gateway's per-piece costs show).
const FETCH_CLIENT = process.env.BENCH_PROXY_CLIENT === 'fetch'
const clientAgent = new Agent({ keepAlive: true, maxSockets: CONCURRENCY * 2 })
async function fetchCall(url: string, body?: Uint8Array): Promise<{ status: number; bytes: number }> {
  const r = await fetch(url, body ? putInit(body) : undefined)
  return { status: r.status, bytes: await drain(r.body) }
}
function httpCall(url: string, body?: Uint8Array): Promise<{ status: number; bytes: number }> {
  return new Promise((resolve, reject) => {
    const req = httpRequest(
      url,
      {
        method: body ? 'PUT' : 'GET',
        agent: clientAgent,
        headers: body
          ? { 'content-type': 'application/octet-stream', 'content-length': String(body.length) }
          : {},
      },
      (res) => {
        let bytes = 0
        res.on('data', (piece: Buffer) => {
          bytes += piece.length
        })
        res.once('end', () => resolve({ status: res.statusCode ?? 0, bytes }))
        res.once('error', reject)
      },
    )
    req.once('error', reject)
    req.end(body)
  })
}

async function phase(side: Side, op: Op, ns: string): Promise<void> {
  const pid = proxyPid[side]
  const c0 = selfCpu()
  const p0 = pid ? cpuSeconds(pid) : 0
  const s0 = cephCpu()
  const t = performance.now()
  await pool(OBJECTS, CONCURRENCY, (i) => transfer(side, op, ns, i))
  const ms = performance.now() - t
  const client = (selfCpu() - c0) / GIB_MOVED
  const proxy = pid ? (cpuSeconds(pid) - p0) / GIB_MOVED : 0
  const ceph = (cephCpu() - s0) / GIB_MOVED
  samples[`${op}-${side}`].push({
    mibps: mbps(size * OBJECTS, ms),
    client,
    proxy,
    ceph,
    total: client + proxy + ceph,
  })
}

const SIDES: Side[] = gwB ? ['direct', 'gateway', 'bare', 'gatewayB'] : ['direct', 'gateway', 'bare']
for (let rep = 0; rep < REPEATS; rep++) {
  const ns = `tp${rep}-${Date.now().toString(36)}`
  const order = SIDES.map((_, k) => SIDES[(k + rep) % SIDES.length]!)
  for (const side of order) await phase(side, 'put', ns)
  for (const side of order) await phase(side, 'get', ns)
  const t = performance.now()
  await pool(OBJECTS, CONCURRENCY, async (i) => {
    const r = await fetch(`${gwRedirect.url}/v1/ns/${ns}/chunks/${chunks[i]!.key}`)
    const n = await drain(r.body)
    if (n !== size || !r.redirected) throw new Error(`redirected GET ${r.status} ${r.redirected}`)
  })
  getRedirect.push(mbps(size * OBJECTS, performance.now() - t))
}
const med = (k: `${Op}-${Side}`, f: keyof PhaseSample) => median(samples[k].map((x) => x[f]))
const tp = {
  putGateway: med('put-gateway', 'mibps'),
  putDirect: med('put-direct', 'mibps'),
  putBare: med('put-bare', 'mibps'),
  getGateway: med('get-gateway', 'mibps'),
  getDirect: med('get-direct', 'mibps'),
  getBare: med('get-bare', 'mibps'),
  getRedirect: median(getRedirect),
}
// Paired ratios (gateway vs the direct run of the same repeat), then the median.
const pairedRatio = (op: Op, side: Side) =>
  median(samples[`${op}-${side}`].map((x, k) => x.mibps / samples[`${op}-direct`][k]!.mibps))

async function cleanupThroughput(): Promise<void> {
  for (const prefix of ['direct/tp', 'bare/tp', 'bench/tp', 'bench/btp']) {
    for (;;) {
      const page = await direct.list(prefix, { limit: 1000 })
      if (page.entries.length === 0) break
      await pool(page.entries.length, 8, (i) => direct.delete(page.entries[i]!.name))
    }
  }
}

// ---------------------------------------------------------------- lookup
const chain = makeChain(512, { layers: 2, sectionBytes: 64 })
await pool(chain.length, 64, (i) => {
  const c = chain[i]!
  return direct.putIfAbsent(`bench/chain/${c.key.slice(0, 2)}/${c.key}`, c.bytes, c.bytes.length)
})
const keysBody = JSON.stringify({ keys: chain.map((c) => c.key) })
const headRtt: number[] = []
for (let i = 0; i < 20; i++) {
  const t = performance.now()
  await direct.head(`bench/chain/${chain[i]!.key.slice(0, 2)}/${chain[i]!.key}`)
  headRtt.push(performance.now() - t)
}
const rtt = median(headRtt)
const cold: { ms: number; requests: number; rounds: number }[] = []
const coldNoSizes: { ms: number; requests: number; rounds: number }[] = []
for (let i = 0; i < 5; i++) {
  for (const [sizes, into] of [
    [true, cold],
    [false, coldNoSizes],
  ] as const) {
    const fresh = createGateway({ store: gwStore, prefix: 'bench' }) // empty cache = cold
    const t = performance.now()
    const r = await fresh.request('/v1/ns/chain/lookup', {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ keys: chain.map((c) => c.key), sizes }),
    })
    const ms = performance.now() - t
    const j = (await r.json()) as { present: number }
    if (j.present !== 512) throw new Error(`cold lookup found ${j.present}`)
    into.push({
      ms,
      requests: Number(r.headers.get('x-kvgate-store-requests')),
      rounds: Number(r.headers.get('x-kvgate-store-rounds')),
    })
  }
}
const warmApp = createGateway({ store: gwStore, prefix: 'bench' })
const lookupReq = () =>
  warmApp.request('/v1/ns/chain/lookup', {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: keysBody,
  })
// A gateway serving lookups runs them optimised: 300 untimed first (the first ~100 run in
// V8's lower tiers), then 1,000 timed for the median and p99.
for (let i = 0; i < 300; i++) await (await lookupReq()).arrayBuffer()
const warm: number[] = []
let warmRequests = 0
for (let i = 0; i < 1000; i++) {
  const t = performance.now()
  const r = await lookupReq()
  await r.arrayBuffer()
  warm.push(performance.now() - t)
  warmRequests += Number(r.headers.get('x-kvgate-store-requests'))
}

// ---------------------------------------------------------------- N writers, one prefix
const WRITERS = 8
const writersNs = `writers-${Date.now().toString(36)}`
const prefixChain = makeChain(16, { layers: 8, sectionBytes: 128 * 1024 })
const statuses = await Promise.all(
  Array.from({ length: WRITERS }, () =>
    Promise.all(
      prefixChain.map(async (c) => {
        const r = await fetch(`${gw.url}/v1/ns/${writersNs}/chunks/${c.key}`, putInit(c.bytes))
        return ((await r.json()) as { status: string }).status
      }),
    ),
  ),
)
const listed = await direct.list(`bench/${writersNs}/`)
const storedBytes = listed.entries.reduce((a, e) => a + e.size, 0)
const createdCount = statuses.flat().filter((s) => s === 'created').length

// ---------------------------------------------------------------- lookups/s under load
await fetch(`${gw.url}/v1/ns/chain/lookup`, {
  method: 'POST',
  headers: { 'content-type': 'application/json' },
  body: keysBody,
})
const loadChunk = chunks[0]!
await fetch(`${gw.url}/v1/ns/load/chunks/${loadChunk.key}`, putInit(loadChunk.bytes))
let stop = false
let loadBytes = 0
const background = Promise.all(
  Array.from({ length: 2 }, async () => {
    while (!stop) loadBytes += await drain((await fetch(`${gw.url}/v1/ns/load/chunks/${loadChunk.key}`)).body)
  }),
)
let lookups = 0
const LOAD_MS = 3000
const t0 = performance.now()
await Promise.all(
  Array.from({ length: 16 }, async () => {
    while (performance.now() - t0 < LOAD_MS) {
      const r = await fetch(`${gw.url}/v1/ns/chain/lookup`, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: keysBody,
      })
      await r.arrayBuffer()
      lookups++
    }
  }),
)
const lookupRps = lookups / ((performance.now() - t0) / 1000)
stop = true
await background
// Free RGW's memstore only now: deleting the throughput objects starts RGW's garbage
// collection, which would otherwise share the 2 cores with the lookup measurements.
await cleanupThroughput()

// ---------------------------------------------------------------- report
const coldMs = median(cold.map((c) => c.ms))
const coldRounds = Math.max(...cold.map((c) => c.rounds))
const coldNsRounds = Math.max(...coldNoSizes.map((c) => c.rounds))
const warmMs = median(warm)
const putRatio = pairedRatio('put', 'gateway')
const getRatio = pairedRatio('get', 'gateway')
const row = (op: Op, side: Side, label: string) => {
  const k = `${op}-${side}` as const
  return [
    label,
    med(k, 'mibps').toFixed(0),
    side === 'direct' ? '1.00' : pairedRatio(op, side).toFixed(2),
    // If the cores are the bottleneck, throughput goes as 1 / total CPU per GiB.
    cephPids.length ? (med(`${op}-direct`, 'total') / med(k, 'total')).toFixed(2) : '?',
    med(k, 'client').toFixed(2),
    side === 'direct' ? '-' : med(k, 'proxy').toFixed(2),
    cephPids.length ? med(k, 'ceph').toFixed(2) : '?',
    cephPids.length ? med(k, 'total').toFixed(2) : '?',
  ]
}
console.log(
  `32 MiB chunk objects ×${OBJECTS}, concurrency ${CONCURRENCY}, median of ${REPEATS} rotated repeats, ` +
    `proxies driven by ${FETCH_CLIENT ? 'fetch' : 'node:http'} ` +
    `(ratio: to the direct run of the same repeat); CPU in seconds per GiB moved`,
)
console.log(
  table([
    ['path', 'MiB/s', 'vs direct', 'CPU-bound ratio', 'client CPU', 'proxy CPU', 'Ceph CPU', 'total CPU'],
    row('put', 'direct', 'PUT direct S3 (SDK)'),
    row('put', 'gateway', 'PUT via gateway'),
    row('put', 'bare', 'PUT via bare pipe proxy'),
    ...(gwB ? [row('put', 'gatewayB', 'PUT via gateway B')] : []),
    row('get', 'direct', 'GET direct S3 (SDK)'),
    row('get', 'gateway', 'GET via gateway'),
    row('get', 'bare', 'GET via bare pipe proxy'),
    ...(gwB ? [row('get', 'gatewayB', 'GET via gateway B')] : []),
    [
      'GET via 307 presigned redirect',
      tp.getRedirect.toFixed(0),
      (tp.getRedirect / tp.getDirect).toFixed(2),
      '',
      '',
      '',
      '',
      '',
    ],
  ]),
)
console.log(
  `load average ${loadavg()
    .map((x) => x.toFixed(1))
    .join(' ')} on ${cpus().length} cores`,
)
console.log()
console.log(
  table([
    ['512-chunk lookup', 'latency ms', 'store requests', 'sequential rounds', '≈ RTTs (latency / HEAD RTT)'],
    [
      'cold, with sizes',
      coldMs.toFixed(1),
      String(median(cold.map((c) => c.requests))),
      String(coldRounds),
      (coldMs / rtt).toFixed(1),
    ],
    [
      'cold, sizes:false',
      median(coldNoSizes.map((c) => c.ms)).toFixed(1),
      String(median(coldNoSizes.map((c) => c.requests))),
      String(coldNsRounds),
      (median(coldNoSizes.map((c) => c.ms)) / rtt).toFixed(1),
    ],
    [
      `warm (in-process; p99 ${[...warm].sort((a, b) => a - b)[Math.floor(warm.length * 0.99)]!.toFixed(3)})`,
      warmMs.toFixed(3),
      String(warmRequests),
      '0',
      '-',
    ],
    ['single HEAD RTT', rtt.toFixed(2), '1', '1', '1'],
  ]),
)
console.log()
console.log(
  `${WRITERS} writers × ${prefixChain.length} chunks of one prefix: ${listed.entries.length} objects stored, ` +
    `${createdCount} created answers, ${(storedBytes / MIB).toFixed(1)} MiB written (1 copy = ${(
      prefixChain.reduce((a, c) => a + c.bytes.length, 0) / MIB
    ).toFixed(1)} MiB)`,
)
console.log(
  `warm 512-key lookups under load (2 clients streaming 32 MiB GETs, ${(loadBytes / MIB / (LOAD_MS / 1000)).toFixed(0)} MiB/s): ${lookupRps.toFixed(0)} req/s over HTTP, 16 clients`,
)

const bars: BarResult[] = [
  {
    bar: 'gateway PUT throughput vs direct S3',
    figure: tp.putGateway,
    unit: 'MiB/s',
    baseline: tp.putDirect,
    baselineLabel: 'direct S3 PutObject, same SDK + concurrency',
    ratio: putRatio,
    target: '≥ 0.85×',
    met: putRatio >= 0.85,
  },
  {
    bar: 'gateway GET throughput vs direct S3',
    figure: tp.getGateway,
    unit: 'MiB/s',
    baseline: tp.getDirect,
    baselineLabel: 'direct S3 GetObject, same SDK + concurrency',
    ratio: getRatio,
    target: '≥ 0.85×',
    met: getRatio >= 0.85,
  },
  {
    bar: 'large GET via presigned 307 redirect vs direct S3',
    figure: tp.getRedirect,
    unit: 'MiB/s',
    baseline: tp.getDirect,
    baselineLabel: 'direct S3 GetObject, same SDK + concurrency',
    ratio: tp.getRedirect / tp.getDirect,
    target: '≥ 0.85×',
    met: tp.getRedirect / tp.getDirect >= 0.85,
  },
  {
    bar: 'cold 512-chunk lookup: sequential S3 round trips',
    figure: coldRounds,
    unit: 'rounds',
    target: '≤ 3',
    met: coldRounds <= 3,
  },
  { bar: 'warm 512-chunk lookup latency', figure: warmMs, unit: 'ms', target: '< 1 ms', met: warmMs < 1 },
  {
    bar: 'N writers of one prefix: objects stored per chunk',
    figure: listed.entries.length / prefixChain.length,
    unit: 'objects/chunk',
    target: '= 1',
    met: listed.entries.length === prefixChain.length,
  },
]
const path = writeResult({
  name: 'gateway',
  date: new Date().toISOString(),
  machine: await machineLine(),
  command: 'node --import tsx bench/gateway.ts',
  settings: {
    objects: OBJECTS,
    objectBytes: size,
    concurrency: CONCURRENCY,
    repeats: REPEATS,
    gatewayB: GATEWAY_B ?? null,
    proxyClient: FETCH_CLIENT ? 'fetch' : 'node:http',
  },
  throughputMiBps: tp,
  ratios: {
    put: putRatio,
    get: getRatio,
    putBare: pairedRatio('put', 'bare'),
    getBare: pairedRatio('get', 'bare'),
  },
  /** Per phase: MiB/s and CPU s/GiB of this client, the proxy process, Ceph (RGW+OSD+mon), their sum. */
  phases: samples,
  cpuSecondsPerGiB: Object.fromEntries(
    Object.keys(samples).map((k) => [
      k,
      {
        client: med(k as `${Op}-${Side}`, 'client'),
        proxy: med(k as `${Op}-${Side}`, 'proxy'),
        ceph: med(k as `${Op}-${Side}`, 'ceph'),
        total: med(k as `${Op}-${Side}`, 'total'),
      },
    ]),
  ),
  loadAverage: loadavg(),
  lookup: {
    headRttMs: rtt,
    cold,
    coldNoSizes,
    warmMedianMs: warmMs,
    warmP99Ms: [...warm].sort((a, b) => a - b)[Math.floor(warm.length * 0.99)],
    underLoadRps: lookupRps,
  },
  writers: {
    writers: WRITERS,
    chunks: prefixChain.length,
    objectsStored: listed.entries.length,
    storedBytes,
    createdCount,
  },
  bars,
})
writeFileSync(
  join(RESULTS_DIR, 'gateway.svg'),
  barChart({
    title: 'kvgate gateway vs direct S3 (RadosGW, 32 MiB chunks)',
    yLabel: 'MiB/s',
    categories: ['PUT', 'GET', 'GET, 307 redirect'],
    series: [
      { name: 'gateway', values: [tp.putGateway, tp.getGateway, tp.getRedirect] },
      { name: 'direct S3', values: [tp.putDirect, tp.getDirect, tp.getDirect] },
      { name: 'bare Node proxy', values: [tp.putBare, tp.getBare, Number.NaN] },
    ],
    digits: 0,
  }),
)
for (const b of bars)
  console.log(`${b.met ? 'MET ' : 'MISS'}  ${b.bar}: ${b.figure.toFixed(2)} ${b.unit} (target ${b.target})`)
console.log(`wrote ${path} and gateway.svg`)

clientAgent.destroy()
await gw.close()
await gwB?.close()
await gwRedirect.close()
await bare.close()
await gwStore.close()
await direct.close()
await rgw.stop()
