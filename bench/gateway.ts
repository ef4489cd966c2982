// Gateway benchmark against Ceph RadosGW on loopback, all in one run:
// 32 MiB chunk GET/PUT through the gateway vs direct through the same SDK (same
// concurrency), cold/warm 512-chunk lookups (store round trips + latency), N
// writers of one prefix, and lookup requests/s under load.
// Run: node --import tsx bench/gateway.ts   (starts its own RGW unless KVGATE_RGW_* is set)

import { spawn } from 'node:child_process'
import { readFileSync, writeFileSync } from 'node:fs'
import { cpus, loadavg } from 'node:os'
import { join } from 'node:path'
import { createInterface } from 'node:readline'
import { GetObjectCommand, PutObjectCommand } from '@aws-sdk/client-s3'
import { createGateway } from '../src/gateway/index.ts'
import { S3Store } from '../src/gateway/node.ts'
import { makeChain, makeChunk, putInit } from '../test/gateway-fixtures.ts'
import { rgwFromEnv, startRgw } from '../test/support/rgw.ts'
import { barChartSvg } from './lib/gateway-chart.ts'
import { type BarResult, machineLine, median, RESULTS_DIR, table, writeResult } from './lib/stats.ts'

const MIB = 1024 * 1024
const CHUNK = 32 * MIB
const OBJECTS = Number(process.env.BENCH_OBJECTS ?? 8)
const CONCURRENCY = Number(process.env.BENCH_CONCURRENCY ?? 4)
const REPEATS = Number(process.env.BENCH_REPEATS ?? 3)

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
const gw = await startServe()
// A second one answers large GETs with 307 to a presigned RGW URL (bytes bypass it).
const gwRedirect = await startServe(['--presign-min-bytes', String(16 * 1024 * 1024)])
// The floor: a bare Node pipe proxy (no verification, no web streams) in its own process.
const bare = await startBareProxy()
console.error(
  `rgw ${rgw.endpoint}, gateway ${gw.url}, redirecting gateway ${gwRedirect.url}, bare proxy ${bare.url}`,
)

async function startBareProxy(): Promise<{ url: string; pid: number; close(): Promise<void> }> {
  const file = new URL('./gateway-bare-proxy.ts', import.meta.url).pathname
  const proc = spawn(process.execPath, ['--import', 'tsx', file], {
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

async function startServe(
  extra: string[] = [],
): Promise<{ url: string; pid: number; close(): Promise<void> }> {
  const main = new URL('../src/cli/main.ts', import.meta.url).pathname
  const proc = spawn(
    process.execPath,
    [
      '--import',
      'tsx',
      main,
      'serve',
      '--port',
      '0',
      '--store',
      's3',
      '--s3-bucket',
      rgw.bucket,
      '--s3-endpoint',
      rgw.endpoint,
      '--prefix',
      'bench',
      '--log',
      'error',
      ...extra,
    ],
    {
      stdio: ['ignore', 'pipe', 'inherit'],
      env: {
        ...process.env,
        KVGATE_S3_ACCESS_KEY_ID: rgw.accessKeyId,
        KVGATE_S3_SECRET_ACCESS_KEY: rgw.secretAccessKey,
        KVGATE_CONFIG: '',
      },
    },
  )
  const url = await new Promise<string>((resolve, reject) => {
    createInterface({ input: proc.stdout! }).on('line', (l) => {
      const j = JSON.parse(l) as { msg?: string; url?: string }
      if (j.msg === 'listening') resolve(j.url!)
    })
    proc.once('exit', (code) => reject(new Error(`kvgate serve exited ${code}`)))
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
const chunks = Array.from({ length: OBJECTS }, () => makeChunk({ layers: 32, sectionBytes: CHUNK / 32 }))
const size = chunks[0]!.bytes.length
const mbps = (bytes: number, ms: number) => bytes / MIB / (ms / 1000)
const through = {
  putGateway: [] as number[],
  putDirect: [] as number[],
  getGateway: [] as number[],
  getDirect: [] as number[],
  getRedirect: [] as number[],
  putBare: [] as number[],
  getBare: [] as number[],
}
// Gateway CPU seconds per GiB moved (independent of how loaded the machine is).
const cpuPerGiB = { put: [] as number[], get: [] as number[] }
const bareCpuPerGiB = { put: [] as number[], get: [] as number[] }
// The direct client's own CPU per GiB (this process does nothing else meanwhile).
const directCpuPerGiB = { put: [] as number[], get: [] as number[] }
const selfCpu = () => {
  const u = process.cpuUsage()
  return (u.user + u.system) / 1e6
}
const GIB_MOVED = (OBJECTS * CHUNK) / 1024 ** 3

for (let rep = 0; rep < REPEATS; rep++) {
  const ns = `tp${rep}`
  // Direct and gateway alternate order per repeat so neither always runs on a warmer RGW.
  const order = rep % 2 === 0 ? ['direct', 'gateway'] : ['gateway', 'direct']
  for (const who of order) {
    const t = performance.now()
    if (who === 'direct') {
      const cpu0 = selfCpu()
      await pool(OBJECTS, CONCURRENCY, (i) =>
        direct.client.send(
          new PutObjectCommand({
            Bucket: rgw.bucket,
            Key: `direct/${ns}/${chunks[i]!.key}`,
            Body: chunks[i]!.bytes,
            ContentLength: size,
            IfNoneMatch: '*',
          }),
        ),
      )
      through.putDirect.push(mbps(size * OBJECTS, performance.now() - t))
      directCpuPerGiB.put.push((selfCpu() - cpu0) / GIB_MOVED)
    } else {
      const cpu0 = cpuSeconds(gw.pid)
      await pool(OBJECTS, CONCURRENCY, async (i) => {
        const r = await fetch(`${gw.url}/v1/ns/${ns}/chunks/${chunks[i]!.key}`, putInit(chunks[i]!.bytes))
        if (r.status !== 201) throw new Error(`gateway PUT ${r.status} ${await r.text()}`)
      })
      through.putGateway.push(mbps(size * OBJECTS, performance.now() - t))
      cpuPerGiB.put.push((cpuSeconds(gw.pid) - cpu0) / GIB_MOVED)
    }
  }
  for (const who of order) {
    const t = performance.now()
    if (who === 'direct') {
      const cpu0 = selfCpu()
      await pool(OBJECTS, CONCURRENCY, async (i) => {
        const r = await direct.client.send(
          new GetObjectCommand({ Bucket: rgw.bucket, Key: `direct/${ns}/${chunks[i]!.key}` }),
        )
        const n = await drain(r.Body!.transformToWebStream() as ReadableStream<Uint8Array>)
        if (n !== size) throw new Error('short direct GET')
      })
      through.getDirect.push(mbps(size * OBJECTS, performance.now() - t))
      directCpuPerGiB.get.push((selfCpu() - cpu0) / GIB_MOVED)
    } else {
      const cpu0 = cpuSeconds(gw.pid)
      await pool(OBJECTS, CONCURRENCY, async (i) => {
        const r = await fetch(`${gw.url}/v1/ns/${ns}/chunks/${chunks[i]!.key}`)
        const n = await drain(r.body)
        if (n !== size) throw new Error(`short gateway GET ${r.status}`)
      })
      through.getGateway.push(mbps(size * OBJECTS, performance.now() - t))
      cpuPerGiB.get.push((cpuSeconds(gw.pid) - cpu0) / GIB_MOVED)
    }
  }
  {
    const t = performance.now()
    await pool(OBJECTS, CONCURRENCY, async (i) => {
      const r = await fetch(`${gwRedirect.url}/v1/ns/${ns}/chunks/${chunks[i]!.key}`)
      const n = await drain(r.body)
      if (n !== size || !r.redirected) throw new Error(`redirected GET ${r.status} ${r.redirected}`)
    })
    through.getRedirect.push(mbps(size * OBJECTS, performance.now() - t))
  }
  {
    let cpu0 = cpuSeconds(bare.pid)
    let t = performance.now()
    await pool(OBJECTS, CONCURRENCY, async (i) => {
      const r = await fetch(`${bare.url}/k/bare/${ns}/${chunks[i]!.key}`, putInit(chunks[i]!.bytes))
      await r.arrayBuffer()
      if (r.status !== 200) throw new Error(`bare PUT ${r.status}`)
    })
    through.putBare.push(mbps(size * OBJECTS, performance.now() - t))
    bareCpuPerGiB.put.push((cpuSeconds(bare.pid) - cpu0) / GIB_MOVED)
    cpu0 = cpuSeconds(bare.pid)
    t = performance.now()
    await pool(OBJECTS, CONCURRENCY, async (i) => {
      const r = await fetch(`${bare.url}/k/bare/${ns}/${chunks[i]!.key}`)
      if ((await drain(r.body)) !== size) throw new Error(`bare GET ${r.status}`)
    })
    through.getBare.push(mbps(size * OBJECTS, performance.now() - t))
    bareCpuPerGiB.get.push((cpuSeconds(bare.pid) - cpu0) / GIB_MOVED)
  }
  // Free RGW's memstore between repeats.
  await pool(OBJECTS, 8, async (i) => {
    await direct.delete(`direct/${ns}/${chunks[i]!.key}`)
    await direct.delete(`bare/${ns}/${chunks[i]!.key}`)
    await direct.delete(`bench/${ns}/${chunks[i]!.key.slice(0, 2)}/${chunks[i]!.key}`)
  })
}
const tp = Object.fromEntries(Object.entries(through).map(([k, v]) => [k, median(v)])) as Record<
  keyof typeof through,
  number
>

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
await lookupReq()
const warm: number[] = []
let warmRequests = 0
for (let i = 0; i < 200; i++) {
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

// ---------------------------------------------------------------- report
const coldMs = median(cold.map((c) => c.ms))
const coldRounds = Math.max(...cold.map((c) => c.rounds))
const coldNsRounds = Math.max(...coldNoSizes.map((c) => c.rounds))
const warmMs = median(warm)
const putRatio = tp.putGateway / tp.putDirect
const getRatio = tp.getGateway / tp.getDirect
console.log(
  table([
    ['measure', 'gateway', 'direct S3 (same SDK)', 'ratio'],
    [
      `PUT 32 MiB ×${OBJECTS}, conc ${CONCURRENCY} (MiB/s)`,
      tp.putGateway.toFixed(0),
      tp.putDirect.toFixed(0),
      putRatio.toFixed(2),
    ],
    [
      `GET 32 MiB ×${OBJECTS}, conc ${CONCURRENCY} (MiB/s)`,
      tp.getGateway.toFixed(0),
      tp.getDirect.toFixed(0),
      getRatio.toFixed(2),
    ],
    [
      'PUT through a bare Node pipe proxy (MiB/s)',
      tp.putBare.toFixed(0),
      tp.putDirect.toFixed(0),
      (tp.putBare / tp.putDirect).toFixed(2),
    ],
    [
      'GET through a bare Node pipe proxy (MiB/s)',
      tp.getBare.toFixed(0),
      tp.getDirect.toFixed(0),
      (tp.getBare / tp.getDirect).toFixed(2),
    ],
    [
      'GET via 307 presigned redirect (MiB/s)',
      tp.getRedirect.toFixed(0),
      tp.getDirect.toFixed(0),
      (tp.getRedirect / tp.getDirect).toFixed(2),
    ],
  ]),
)
console.log(
  `CPU seconds per GiB: gateway process PUT ${median(cpuPerGiB.put).toFixed(2)} / GET ${median(cpuPerGiB.get).toFixed(2)}; ` +
    `bare pipe proxy PUT ${median(bareCpuPerGiB.put).toFixed(2)} / GET ${median(bareCpuPerGiB.get).toFixed(2)}; ` +
    `direct SDK client PUT ${median(directCpuPerGiB.put).toFixed(2)} / GET ${median(directCpuPerGiB.get).toFixed(2)} ` +
    `(load average ${loadavg()[0]!.toFixed(1)} on ${cpus().length} cores)`,
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
    ['warm (in-process)', warmMs.toFixed(3), String(warmRequests), '0', '-'],
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
  settings: { objects: OBJECTS, objectBytes: size, concurrency: CONCURRENCY, repeats: REPEATS },
  throughputMiBps: { ...tp, samples: through },
  gatewayCpuSecondsPerGiB: { put: median(cpuPerGiB.put), get: median(cpuPerGiB.get), samples: cpuPerGiB },
  bareProxyCpuSecondsPerGiB: {
    put: median(bareCpuPerGiB.put),
    get: median(bareCpuPerGiB.get),
    samples: bareCpuPerGiB,
  },
  directClientCpuSecondsPerGiB: {
    put: median(directCpuPerGiB.put),
    get: median(directCpuPerGiB.get),
    samples: directCpuPerGiB,
  },
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
  barChartSvg('kvgate gateway vs direct S3 (RadosGW, 32 MiB chunks)', 'MiB/s', [
    {
      label: 'PUT',
      bars: [
        { label: 'gateway', value: tp.putGateway },
        { label: 'direct S3', value: tp.putDirect },
        { label: 'bare Node proxy', value: tp.putBare },
      ],
    },
    {
      label: 'GET',
      bars: [
        { label: 'gateway', value: tp.getGateway },
        { label: 'direct S3', value: tp.getDirect },
        { label: 'bare Node proxy', value: tp.getBare },
      ],
    },
    {
      label: 'GET, 307 redirect',
      bars: [
        { label: 'gateway', value: tp.getRedirect },
        { label: 'direct S3', value: tp.getDirect },
      ],
    },
  ]),
)
for (const b of bars)
  console.log(`${b.met ? 'MET ' : 'MISS'}  ${b.bar}: ${b.figure.toFixed(2)} ${b.unit} (target ${b.target})`)
console.log(`wrote ${path} and gateway.svg`)

await gw.close()
await gwRedirect.close()
await bare.close()
await gwStore.close()
await direct.close()
await rgw.stop()
