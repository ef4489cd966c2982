// Cold-tier benchmark: the fleet workload (src/fleet/workload.ts) against one gateway with use
// tracking and hourly `kvgate gc` under a byte quota smaller than the working set, beside an
// oracle LRU of the same budget and a creation-age lifecycle rule (the same average bytes),
// all on the same request sequence. Reports prefix hit rates, S3 requests added by tracking
// per 1,000 hits, $ per 1,000 prefix hits and $ per TB-month.
// Run: node --import tsx bench/cold-tier.ts [--help]   (or: npx kvgate bench cold-tier)

import { parseArgs } from 'node:util'
import { runGc } from '../src/coldtier/gc.ts'
import { parseColdTier } from '../src/coldtier/policy.ts'
import { encodeChunk } from '../src/core/format.ts'
import { chainKeys, type KeyNamespace } from '../src/core/keys.ts'
import { PRICES } from '../src/fleet/pricing.ts'
import { generateWorkload } from '../src/fleet/workload.ts'
import { createGateway, type GatewayApp, MemoryStore } from '../src/gateway/index.ts'
import type { ObjectStore } from '../src/gateway/stores/types.ts'
import { machineLine, table, writeResult } from './lib/stats.ts'

const HELP = `Usage: kvgate bench cold-tier [options]   (node --import tsx bench/cold-tier.ts [options])

The fleet's prefix-sharing workload replayed through one in-process gateway (memory
store, counted per request kind) on a virtual clock (--seconds-per-request), with gc
every virtual hour, a 10-minute grace period and a per-namespace quota of --quota-frac
of the bytes the workload ever stores. Side by side on the same sequence:
  oracle LRU     a chunk-level LRU of the same byte budget, updated on every request,
                 touching chains tail-first (the best an LRU of that size can do)
  lifecycle      creation-age expiry only (S3 lifecycle), its age chosen so the average
                 stored bytes fit the same budget
  unbounded      nothing ever deleted (the ceiling)

Options:
  --requests N              [2400]
  --seed N                  [42]
  --quota-frac F            quota as a fraction of all bytes ever stored [0.35]
  --seconds-per-request N   virtual time between requests [12]
  --gc-minutes N            virtual minutes between gc runs [60]
  --nominal-chunk-mib N     bytes a real chunk would have, for the $ lines [8]
  --price s3-standard|r2    [s3-standard]
  --out NAME                bench/results/NAME.json [cold-tier]
  -h, --help`

const { values } = parseArgs({
  options: {
    requests: { type: 'string' },
    seed: { type: 'string' },
    'quota-frac': { type: 'string' },
    'seconds-per-request': { type: 'string' },
    'gc-minutes': { type: 'string' },
    'nominal-chunk-mib': { type: 'string' },
    price: { type: 'string' },
    out: { type: 'string' },
    help: { type: 'boolean', short: 'h' },
  },
  strict: true,
})
if (values.help) {
  console.log(HELP)
  process.exit(0)
}
const num = (name: string, v: string | undefined, d: number) => {
  const n = v === undefined ? d : Number(v)
  if (!(n > 0)) {
    console.error(`bench cold-tier: invalid --${name}`)
    process.exit(2)
  }
  return n
}
const REQUESTS = Math.floor(num('requests', values.requests, 2400))
const SEED = Math.floor(num('seed', values.seed, 42))
const QUOTA_FRAC = num('quota-frac', values['quota-frac'], 0.35)
const DT = num('seconds-per-request', values['seconds-per-request'], 12) * 1000
const NOMINAL = num('nominal-chunk-mib', values['nominal-chunk-mib'], 8) * 2 ** 20
const PRICE = PRICES[(values.price ?? 's3-standard') as 's3-standard' | 'r2']
if (!PRICE) {
  console.error('bench cold-tier: --price must be s3-standard or r2')
  process.exit(2)
}
const HOUR = 3_600_000
const GC_EVERY = Math.max(1, Math.round((num('gc-minutes', values['gc-minutes'], 60) * 60_000) / DT))

// The virtual clock: the gateway's use records and the memory store's write times follow it.
const START = Date.UTC(2026, 0, 5)
let now = START
Date.now = () => now

const CHUNK_TOKENS = 64
const geometry = { layers: 2, kvHeads: 1, headDim: 64, dtype: 'fp16' as const }
const ns: KeyNamespace = { modelId: 'bench-cold-tier', geometry, chunkTokens: CHUNK_TOKENS }
const workload = generateWorkload({ seed: SEED, requests: REQUESTS })
const chains = workload.requests.map((r) => chainKeys(r.tokens, ns))

/** A real chunk object (raw codec, tiny sections) whose header names its parent: gc reads it. */
function chunkObject(i: number, chain: ReturnType<typeof chainKeys>): Uint8Array {
  const k = chain[i]!
  return encodeChunk(
    {
      codec: 'raw',
      codecVersion: 1,
      codecParams: new Uint8Array(0),
      geometry,
      tokens: 1,
      chunkIndex: i,
      partial: false,
      namespaceId: new Uint8Array(16),
      chainKey: k.key,
      parentKey: i > 0 ? chain[i - 1]!.key : new Uint8Array(32),
    },
    [new Uint8Array(256), new Uint8Array(256)],
  )
}
const OBJECT_BYTES = chunkObject(0, chains[0]!).length
const unique = new Set(chains.flatMap((c) => c.map((k) => k.hex)))
const QUOTA = Math.floor(unique.size * OBJECT_BYTES * QUOTA_FRAC)

// ---------------------------------------------------------------- kvgate: tracking + gc

const counts = { head: 0, put: 0, get: 0, list: 0, delete: 0, trackingPut: 0 }
const raw = new MemoryStore()
const counted: ObjectStore = {
  kind: 'memory',
  get: (n, o) => {
    counts.get++
    return raw.get(n, o)
  },
  head: (n) => {
    counts.head++
    return raw.head(n)
  },
  putIfAbsent: (n, b, s) => {
    if (n.includes('/_usage/')) counts.trackingPut++
    else counts.put++
    return raw.putIfAbsent(n, b, s)
  },
  delete: (n) => {
    counts.delete++
    return raw.delete(n)
  },
  list: (p, o) => {
    counts.list++
    return raw.list(p, o)
  },
}
const gcConfig = parseColdTier({ grace: '10m', namespaces: { fleet: { quota: QUOTA } } })
const gcRequests = { list: 0, get: 0, head: 0, put: 0, delete: 0 }
// A fresh gateway after each gc: the presence caches of the one before would still claim
// what gc deleted (the healing of issue 11 does that in production: 404 ⇒ drop, TTL).
const newApp = () => createGateway({ store: counted, prefix: 'kv', coldTier: {} })
let app: GatewayApp = newApp()
let hits = 0
let asked = 0
let chunkGets = 0
let storedByteTime = 0
const t0 = performance.now()

for (const [seq, chain] of chains.entries()) {
  now = START + seq * DT
  const keys = chain.map((k) => k.hex)
  const res = await app.request('/v1/ns/fleet/lookup', {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ keys }),
  })
  const { present } = (await res.json()) as { present: number }
  hits += present
  asked += keys.length
  chunkGets += present // the node then GETs every chunk it found (counted, not issued)
  for (let i = present; i < chain.length; i++) {
    const bytes = chunkObject(i, chain)
    const r = await app.request(`/v1/ns/fleet/chunks/${keys[i]}`, {
      method: 'PUT',
      body: bytes as Uint8Array<ArrayBuffer>,
      headers: { 'content-type': 'application/octet-stream', 'content-length': String(bytes.length) },
    })
    if (r.status >= 300 && r.status !== 200) throw new Error(`PUT answered ${r.status}`)
  }
  if ((seq + 1) % GC_EVERY === 0) {
    await app.state.usage?.pending
    const before = { ...counts }
    const report = await runGc({ store: counted, prefix: 'kv', config: gcConfig, now })
    for (const k of Object.keys(gcRequests) as (keyof typeof gcRequests)[])
      gcRequests[k] += report.requests[k]
    // gc's own requests were counted by the wrapper too: take them back out.
    Object.assign(counts, {
      ...counts,
      head: before.head,
      get: before.get,
      put: before.put,
      list: before.list,
      delete: before.delete,
    })
    app = newApp()
  }
  storedByteTime += (await kvBytes()) * DT
}
const elapsedS = (performance.now() - t0) / 1000

/** Chunk bytes stored now (use records and gc's indexes are kept out of "stored KV"). */
async function kvBytes(): Promise<number> {
  let bytes = 0
  let cursor: string | undefined
  do {
    const page = await raw.list('kv/fleet/', { limit: 100_000, ...(cursor ? { cursor } : {}) })
    for (const e of page.entries) bytes += e.size
    cursor = page.cursor
  } while (cursor)
  return bytes
}

// ---------------------------------------------------------------- simulated baselines

function oracleLru(budget: number): { hits: number; avgBytes: number } {
  const lru = new Map<string, true>()
  let h = 0
  let byteTime = 0
  for (const chain of chains) {
    let p = 0
    while (p < chain.length && lru.has(chain[p]!.hex)) p++
    h += p
    for (let i = chain.length - 1; i >= 0; i--) {
      lru.delete(chain[i]!.hex)
      lru.set(chain[i]!.hex, true)
    }
    while (lru.size * OBJECT_BYTES > budget) lru.delete(lru.keys().next().value!)
    byteTime += lru.size * OBJECT_BYTES * DT
  }
  return { hits: h, avgBytes: byteTime / (chains.length * DT) }
}

/** The oracle LRU whose average stored bytes reach `target` (bisection on its budget, in objects). */
function sameAverageBytes(target: number): { hits: number; avgBytes: number; budget: number } {
  let lo = 1
  let hi = chains.reduce((n, c) => n + c.length, 0)
  while (lo < hi) {
    const mid = Math.floor((lo + hi) / 2)
    if (oracleLru(mid * OBJECT_BYTES).avgBytes < target) lo = mid + 1
    else hi = mid
  }
  return { ...oracleLru(lo * OBJECT_BYTES), budget: lo * OBJECT_BYTES }
}

/** Creation-age expiry, evaluated hourly; re-PUTs of a present key keep the first creation time. */
function lifecycle(maxAgeMs: number): { hits: number; avgBytes: number; puts: number } {
  const created = new Map<string, number>()
  let h = 0
  let puts = 0
  let byteTime = 0
  let swept = START
  for (const [seq, chain] of chains.entries()) {
    const t = START + seq * DT
    if (t - swept >= STEP) {
      swept = t
      for (const [k, c] of created) if (t - c > maxAgeMs) created.delete(k)
    }
    let p = 0
    while (p < chain.length && created.has(chain[p]!.hex)) p++
    h += p
    for (let i = p; i < chain.length; i++) {
      puts++
      if (!created.has(chain[i]!.hex)) created.set(chain[i]!.hex, t)
    }
    byteTime += created.size * OBJECT_BYTES * DT
  }
  return { hits: h, avgBytes: byteTime / (chains.length * DT), puts }
}

const avgKvgateBytes = storedByteTime / (chains.length * DT)
// gc enforces the quota when it runs, so between runs the bucket holds more: compare at the
// same average bytes (the fair budget), and show the LRU held to the quota at every instant too.
// An LRU of budget B stores less than B on average (it starts empty and fills), so its budget
// is searched until its own average reaches kvgate's: the same bytes, not the same nominal budget.
const oracle = sameAverageBytes(avgKvgateBytes)
const oracleAtQuota = oracleLru(QUOTA)
// S3 evaluates lifecycle rules once a day; the simulation grants it every 10 minutes.
const STEP = 600_000
let lc = lifecycle(STEP)
let lcAge = STEP
for (let age = STEP; age <= chains.length * DT; age += STEP) {
  const r = lifecycle(age)
  if (r.avgBytes > avgKvgateBytes) break
  lc = r
  lcAge = age
}
const unbounded = lifecycle(Number.POSITIVE_INFINITY)

// ---------------------------------------------------------------- money

const durationMonths = (chains.length * DT) / (30 * 86_400_000)
const nominal = (bytes: number) => (bytes / OBJECT_BYTES) * NOMINAL
const reqCost = (c: { put: number; list: number; get: number; head: number }) =>
  ((c.put + c.list) / 1000) * PRICE.writePer1k + ((c.get + c.head) / 1000) * PRICE.readPer1k
const storageCost = (avgBytes: number) => (nominal(avgBytes) / 1e9) * PRICE.storagePerGbMonth * durationMonths
const trackingCost = reqCost({ put: counts.trackingPut, list: 0, get: 0, head: 0 })
const gcCost = reqCost({ ...gcRequests })
const kvgateCost =
  reqCost({ put: counts.put, list: 0, get: counts.get + chunkGets, head: counts.head }) +
  trackingCost +
  gcCost +
  storageCost(avgKvgateBytes)
// The lifecycle side issues the same kind of traffic: its HEADs scale like ours per lookup.
const lcCost = reqCost({ put: lc.puts, list: 0, get: lc.hits, head: counts.head }) + storageCost(lc.avgBytes)
const perTbMonth = (cost: number, avgBytes: number) =>
  cost / durationMonths / Math.max(1e-12, nominal(avgBytes) / 1e12)

const rate = (h: number) => h / asked
const kvRate = rate(hits)
const oracleRate = rate(oracle.hits)
const ratio = kvRate / oracleRate
const trackingPer1kHits = (1000 * counts.trackingPut) / hits
const rows: (string | number)[][] = [
  ['policy', 'prefix hit rate', 'avg stored', '$ / 1k prefix hits', '$ / TB-month (stored)'],
  [
    `kvgate gc (quota, hourly)`,
    `${(100 * kvRate).toFixed(1)}%`,
    `${((100 * avgKvgateBytes) / QUOTA).toFixed(0)}% of quota`,
    `$${((1000 * kvgateCost) / Math.max(1, hits)).toFixed(4)}`,
    `$${perTbMonth(kvgateCost - chunkTrafficCost(), avgKvgateBytes).toFixed(2)}`,
  ],
  [
    'oracle LRU, same avg bytes',
    `${(100 * oracleRate).toFixed(1)}%`,
    `${((100 * oracle.avgBytes) / QUOTA).toFixed(0)}% of quota`,
    '–',
    '–',
  ],
  [
    'oracle LRU, quota always',
    `${(100 * rate(oracleAtQuota.hits)).toFixed(1)}%`,
    `${((100 * oracleAtQuota.avgBytes) / QUOTA).toFixed(0)}% of quota`,
    '–',
    '–',
  ],
  [
    `lifecycle, expire at ${(lcAge / HOUR).toFixed(1)} h`,
    `${(100 * rate(lc.hits)).toFixed(1)}%`,
    `${((100 * lc.avgBytes) / QUOTA).toFixed(0)}% of quota`,
    `$${((1000 * lcCost) / Math.max(1, lc.hits)).toFixed(4)}`,
    `$${perTbMonth(storageCost(lc.avgBytes), lc.avgBytes).toFixed(2)}`,
  ],
  [
    'unbounded (ceiling)',
    `${(100 * rate(unbounded.hits)).toFixed(1)}%`,
    `${((100 * unbounded.avgBytes) / QUOTA).toFixed(0)}% of quota`,
    '–',
    '–',
  ],
]

function chunkTrafficCost(): number {
  return reqCost({ put: counts.put, list: 0, get: counts.get + chunkGets, head: counts.head })
}

console.log(
  `cold-tier: ${chains.length} requests over ${((chains.length * DT) / HOUR).toFixed(1)} virtual hours, ` +
    `${unique.size} distinct chunks, quota ${(QUOTA / OBJECT_BYTES).toFixed(0)} chunks (${(100 * QUOTA_FRAC).toFixed(0)}% of all ever stored), ` +
    `gc every ${GC_EVERY} requests; ${PRICE.name} list prices, ${NOMINAL / 2 ** 20} MiB per chunk for $; ran in ${elapsedS.toFixed(1)} s`,
)
console.log(table(rows))
console.log(
  `use tracking: ${counts.trackingPut} PUTs for ${hits} chunk hits = ${trackingPer1kHits.toFixed(2)} per 1,000 hits ` +
    `(bar ≤ 10); gc: ${gcRequests.list} LIST, ${gcRequests.get} GET, ${gcRequests.put} PUT, ${gcRequests.delete} DELETE`,
)
console.log(
  `hit rate vs oracle LRU: ${(100 * ratio).toFixed(1)}% (bar ≥ 95%); vs lifecycle at the same bytes: ` +
    `${(kvRate / rate(lc.hits)).toFixed(2)}×. $/TB-month = storage + tracking + gc per month over the average TB stored.`,
)

const path = writeResult({
  name: values.out ?? 'cold-tier',
  date: new Date(performance.timeOrigin).toISOString(),
  machine: await machineLine(),
  bars: [
    {
      bar: 'quota < working set: hit rate within 5% of an oracle LRU of the same byte budget',
      figure: kvRate,
      unit: 'prefix hit rate',
      baseline: oracleRate,
      baselineLabel: 'oracle LRU, same average bytes',
      ratio,
      target: '≥ 0.95',
      met: ratio >= 0.95,
    },
    {
      bar: 'use tracking ≤ 1 extra S3 request per 100 chunk hits',
      figure: trackingPer1kHits,
      unit: 'requests per 1,000 hits',
      target: '≤ 10',
      met: trackingPer1kHits <= 10,
    },
  ],
  requests: chains.length,
  quotaFrac: QUOTA_FRAC,
  hitRates: {
    kvgate: kvRate,
    oracleLruSameAvgBytes: oracleRate,
    oracleLruAtQuota: rate(oracleAtQuota.hits),
    lifecycle: rate(lc.hits),
    unbounded: rate(unbounded.hits),
  },
  avgStoredOverQuota: { kvgate: avgKvgateBytes / QUOTA, lifecycle: lc.avgBytes / QUOTA },
  lifecycleAgeHours: lcAge / HOUR,
  dollarsPer1kPrefixHits: { kvgate: (1000 * kvgateCost) / hits, lifecycle: (1000 * lcCost) / lc.hits },
  dollarsPerTbMonth: {
    kvgate: perTbMonth(kvgateCost - chunkTrafficCost(), avgKvgateBytes),
    lifecycle: perTbMonth(storageCost(lc.avgBytes), lc.avgBytes),
  },
  requestsByKind: { ...counts, chunkGets, gc: gcRequests },
})
console.log(`wrote ${path}`)
