// The fleet simulation: N node processes (some join mid-run, cold) behind one gateway,
// a deterministic prefix-sharing workload processed in sequence, judged against an oracle
// that knows every chunk ever stored; plus the cost of the S3 traffic it caused.

import { mkdirSync, mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import type { ChunkCodecName } from '../client/chunk-codec.ts'
import type { KVCacheStats } from '../client/index.ts'
import { InvalidArgumentError } from '../core/errors.ts'
import { chainKeys, type KeyNamespace } from '../core/keys.ts'
import { bytesPerToken, chunkBytes, MODEL_PRESETS, type ModelPreset } from '../core/layout.ts'
import { forkWorker, type WorkerHandle } from '../demo/worker.ts'
import { createGateway } from '../gateway/app.ts'
import { serveGateway } from '../gateway/node.ts'
import type { ObjectStore } from '../gateway/stores/types.ts'
import { siblingModule } from '../package-files.ts'
import { diffCounters, fetchGatewayCounters, type GatewayCounters } from './gateway-metrics.ts'
import type { FleetNodeConfig, RequestReport, TierCount } from './node.ts'
import { PrefixOracle } from './oracle.ts'
import { PRICES, type PriceSheet, requestCost, storageCostPerMonth } from './pricing.ts'
import { Rng } from './rng.ts'
import { generateWorkload, type WorkloadOptions } from './workload.ts'

export interface FleetOptions {
  /** The gateway's object store (s3 on RadosGW, or fs). */
  store: ObjectStore
  /** How the store is described in the report, e.g. "s3 (Ceph RadosGW 16.2 on loopback)". */
  storeLabel: string
  workload?: Partial<WorkloadOptions>
  /** @default stories260k geometry (fp16): small, so the simulation is about traffic, not bandwidth */
  model?: ModelPreset
  /** @default 64 */
  chunkTokens?: number
  /** L4 codec. @default 'lossless' (retrieved chunks verify byte for byte) */
  codec?: ChunkCodecName
  /** L1 per node. @default 8 MiB (smaller than the working set, so L2 serves too) */
  memoryBytes?: number
  /** L2 per node. @default 256 MiB */
  diskBytes?: number
  /** Assumed prefill speed of the engine the cache saves work for. @default 10000 tokens/s */
  prefillTokensPerSecond?: number
  /** Nodes that store one fresh prefix at once (N writers ⇒ 1 object). @default every node */
  concurrentWriters?: number
  /** Whole chunks in that prefix. @default 8 */
  writerChunks?: number
  price?: PriceSheet
  /** Node L2 dirs go here; default a temp dir removed afterwards. */
  workDir?: string
  /** @default 1000 */
  lookupTimeoutMs?: number
  onProgress?: (line: string) => void
}

export interface RequestRecord {
  seq: number
  node: number
  kind: string
  chunks: number
  served: number
  oracle: number
  byTier: TierCount
  badChunks: number
  /** Node-side milliseconds: lookup, retrieve, store + flush to L2/L4. */
  ms: { lookup: number; retrieve: number; store: number }
}

export interface NodeSummary {
  node: number
  joinAt: number
  pid: number
  requests: number
  chunks: number
  served: number
  oracle: number
  byTier: TierCount
  /** L4 chunk hits on chunks this node never stored itself: cross-node sharing. */
  stats: KVCacheStats | undefined
}

export interface FleetResult {
  config: {
    seed: number
    workload: WorkloadOptions
    model: ModelPreset
    chunkTokens: number
    codec: ChunkCodecName
    store: string
    memoryBytesPerNode: number
    diskBytesPerNode: number
    prefillTokensPerSecond: number
    price: PriceSheet
  }
  requests: RequestRecord[]
  nodes: NodeSummary[]
  totals: {
    requests: number
    chunks: number
    served: number
    oracle: number
    byTier: TierCount
    hitRate: number
    oracleHitRate: number
    /** hitRate / oracleHitRate (1 when the oracle has no hits either). */
    vsOracle: number
    badChunks: number
    /** Requests that got at least one chunk from the cache. */
    prefixHits: number
    /** Medians over requests, node side (ms). */
    p50Ms: { lookup: number; retrieve: number; store: number }
  }
  bytes: {
    /** Chunk bytes served by each tier (L4: on the wire, encoded). */
    read: TierCount
    /** Bytes written to L2 and sent to L4. */
    written: { disk: number; remote: number }
  }
  gateway: GatewayCounters
  cost: {
    requestDollars: number
    perThousandPrefixHits: number
    storedObjects: number
    storedBytes: number
    storageDollarsPerMonth: number
    /** The same stored tokens as Llama-3.1-8B bf16 KV at this run's compression ratio. */
    at8b: { storedBytes: number; storageDollarsPerMonth: number }
    compressionRatio: number
  }
  prefill: { savedTokens: number; savedSeconds: number; tokensPerSecond: number }
  writers: {
    nodes: number
    chunks: number
    objectsCreated: number
    putsAtGateway: number
    createdAtGateway: number
    existsAtGateway: number
    objectsPerChunk: number
  }
  wallMs: number
}

const MIB = 1024 * 1024

export async function runFleet(opts: FleetOptions): Promise<FleetResult> {
  const t0 = performance.now()
  const say = opts.onProgress ?? (() => {})
  const model = opts.model ?? MODEL_PRESETS.stories260k
  const chunkTokens = opts.chunkTokens ?? 64
  const codec = opts.codec ?? 'lossless'
  const memoryBytes = opts.memoryBytes ?? 8 * MIB
  const diskBytes = opts.diskBytes ?? 256 * MIB
  const tps = opts.prefillTokensPerSecond ?? 10_000
  const price = opts.price ?? PRICES['s3-standard']
  if (!Number.isInteger(chunkTokens) || chunkTokens < 1)
    throw new InvalidArgumentError('chunkTokens must be ≥ 1')
  if (!(tps > 0)) throw new InvalidArgumentError('prefillTokensPerSecond must be > 0')
  const workload = generateWorkload(opts.workload)
  const w = workload.options
  const totalNodes = workload.joinAt.length
  const workDir = opts.workDir ?? mkdtempSync(join(tmpdir(), 'kvgate-fleet-'))
  mkdirSync(workDir, { recursive: true })
  // A fresh namespace per run: a shared store (a reused RGW) must not hand out old objects.
  const namespace = `fleet-${w.seed}-${Date.now().toString(36)}`
  const prefix = 'kvgate'
  const ns: KeyNamespace = { modelId: model.modelId, geometry: model, chunkTokens }

  const app = createGateway({ store: opts.store, prefix })
  const gw = await serveGateway(app, { port: 0, host: '127.0.0.1' })
  say(
    `gateway ${gw.url} on ${opts.storeLabel}; ${totalNodes} nodes (${w.initialNodes} at start, ${w.joiningNodes} joining), ${w.requests} requests, seed ${w.seed}`,
  )
  const workers: (WorkerHandle | undefined)[] = new Array(totalNodes)
  const finalStats: (KVCacheStats | undefined)[] = new Array(totalNodes)
  const nodeConfig = (n: number): FleetNodeConfig => ({
    url: gw.url,
    namespace,
    model,
    chunkTokens,
    codec,
    memoryBytes,
    diskDir: join(workDir, `node-${n}`),
    diskBytes,
    lookupTimeoutMs: opts.lookupTimeoutMs ?? 1000,
  })
  const start = async (n: number, seq: number) => {
    const wk = await forkWorker(siblingModule(import.meta.url, './node.ts'))
    await wk.call('open', nodeConfig(n))
    workers[n] = wk
    const joinAt = workload.joinAt[n] ?? 0
    say(
      `  node ${n} (pid ${wk.pid}) ${joinAt === 0 ? 'up' : `joins at request ${joinAt} with cold L1/L2 (its first request: ${seq})`}`,
    )
    return wk
  }

  try {
    // Initial nodes start together; the others start (cold) when their first request comes.
    for (let n = 0; n < totalNodes; n++) if (workload.joinAt[n] === 0) await start(n, 0)
    const oracle = new PrefixOracle()
    const records: RequestRecord[] = []
    const every = Math.max(1, Math.floor(w.requests / 10))
    let served = 0
    let oracleHits = 0
    let chunks = 0
    for (const r of workload.requests) {
      const wk = workers[r.node] ?? (await start(r.node, r.seq))
      const keys = chainKeys(r.tokens, ns).map((k) => k.hex)
      const best = oracle.hits(keys)
      // Sequential and flushed: this request sees every chunk any earlier request stored.
      const rep = await wk.call<RequestReport>('request', { tokens: Array.from(r.tokens) })
      oracle.record(keys)
      if (rep.chunks !== keys.length)
        throw new Error(`node ${r.node} cut ${rep.chunks} chunks, coordinator ${keys.length}`)
      records.push({
        seq: r.seq,
        node: r.node,
        kind: r.kind,
        chunks: rep.chunks,
        served: rep.served,
        oracle: best,
        byTier: rep.byTier,
        badChunks: rep.badChunks,
        ms: { lookup: rep.lookupMs, retrieve: rep.retrieveMs, store: rep.storeMs },
      })
      served += rep.served
      oracleHits += best
      chunks += rep.chunks
      if ((r.seq + 1) % every === 0 || r.seq + 1 === w.requests) {
        const up = workers.filter(Boolean).length
        say(
          `  ${String(r.seq + 1).padStart(String(w.requests).length)}/${w.requests} requests, ${up} nodes up: hit rate ${pct(served / chunks)} (oracle ${pct(oracleHits / chunks)})`,
        )
      }
    }
    const before = await fetchGatewayCounters(gw.url)

    // N writers of one fresh prefix at once ⇒ one stored object per chunk.
    const writerCount = Math.min(opts.concurrentWriters ?? totalNodes, totalNodes)
    const writerChunks = opts.writerChunks ?? 8
    const rng = new Rng(w.seed ^ 0x5eed)
    const fresh = Array.from({ length: writerChunks * chunkTokens }, () => 3 + rng.int(w.vocab - 3))
    const nsPrefix = `${prefix}/${namespace}/`
    const objectsBefore = await countObjects(opts.store, nsPrefix)
    for (let n = 0; n < writerCount; n++) workers[n] ??= await start(n, -1)
    await Promise.all(workers.slice(0, writerCount).map((wk) => wk!.call('store', { tokens: fresh })))
    const objects = await countObjects(opts.store, nsPrefix)
    const afterWriters = diffCounters(await fetchGatewayCounters(gw.url), before)
    const writers = {
      nodes: writerCount,
      chunks: writerChunks,
      objectsCreated: objects.count - objectsBefore.count,
      putsAtGateway: afterWriters.puts.created + afterWriters.puts.exists,
      createdAtGateway: afterWriters.puts.created,
      existsAtGateway: afterWriters.puts.exists,
      objectsPerChunk: (objects.count - objectsBefore.count) / writerChunks,
    }
    say(
      `  ${writerCount} nodes stored one ${writerChunks}-chunk prefix at once: ${writers.putsAtGateway} PUTs reached the gateway, ${writers.objectsCreated} objects stored`,
    )

    for (let n = 0; n < totalNodes; n++) {
      finalStats[n] = await workers[n]?.call<KVCacheStats | undefined>('close')
    }
    const gateway = before
    const byTier = sumTiers(records.map((r) => r.byTier))
    const prefixHits = records.filter((r) => r.served > 0).length
    const requestDollars = requestCost(gateway.storeOps, price)
    const stored = objectsBefore
    const uniqueChunks = oracle.size
    const rawStored = uniqueChunks * chunkBytes(model, chunkTokens)
    const ratio = stored.bytes > 0 ? rawStored / stored.bytes : 0
    const at8bBytes =
      ratio > 0 ? (uniqueChunks * chunkTokens * bytesPerToken(MODEL_PRESETS['llama-3.1-8b'])) / ratio : 0
    const readBytes = { memory: 0, disk: 0, remote: 0 }
    const written = { disk: 0, remote: 0 }
    for (const s of finalStats) {
      if (!s) continue
      readBytes.memory += s.memory.bytesRead
      readBytes.disk += s.disk?.bytesRead ?? 0
      readBytes.remote += s.remote?.bytesRead ?? 0
      written.disk += s.disk?.bytesWritten ?? 0
      written.remote += s.remote?.bytesWritten ?? 0
    }
    const nodes: NodeSummary[] = workload.joinAt.map((joinAt, n) => {
      const mine = records.filter((r) => r.node === n)
      return {
        node: n,
        joinAt,
        pid: workers[n]?.pid ?? -1,
        requests: mine.length,
        chunks: mine.reduce((a, r) => a + r.chunks, 0),
        served: mine.reduce((a, r) => a + r.served, 0),
        oracle: mine.reduce((a, r) => a + r.oracle, 0),
        byTier: sumTiers(mine.map((r) => r.byTier)),
        stats: finalStats[n],
      }
    })
    const hitRate = chunks > 0 ? served / chunks : 0
    const oracleHitRate = chunks > 0 ? oracleHits / chunks : 0
    return {
      config: {
        seed: w.seed,
        workload: w,
        model,
        chunkTokens,
        codec,
        store: opts.storeLabel,
        memoryBytesPerNode: memoryBytes,
        diskBytesPerNode: diskBytes,
        prefillTokensPerSecond: tps,
        price,
      },
      requests: records,
      nodes,
      totals: {
        requests: records.length,
        chunks,
        served,
        oracle: oracleHits,
        byTier,
        hitRate,
        oracleHitRate,
        vsOracle: oracleHitRate > 0 ? hitRate / oracleHitRate : served === 0 ? 1 : Number.POSITIVE_INFINITY,
        badChunks: records.reduce((a, r) => a + r.badChunks, 0),
        prefixHits,
        p50Ms: {
          lookup: median(records.map((r) => r.ms.lookup)),
          retrieve: median(records.map((r) => r.ms.retrieve)),
          store: median(records.map((r) => r.ms.store)),
        },
      },
      bytes: { read: readBytes, written },
      gateway,
      cost: {
        requestDollars,
        perThousandPrefixHits: prefixHits > 0 ? (requestDollars / prefixHits) * 1000 : 0,
        storedObjects: stored.count,
        storedBytes: stored.bytes,
        storageDollarsPerMonth: storageCostPerMonth(stored.bytes, price),
        at8b: { storedBytes: at8bBytes, storageDollarsPerMonth: storageCostPerMonth(at8bBytes, price) },
        compressionRatio: ratio,
      },
      prefill: {
        savedTokens: served * chunkTokens,
        savedSeconds: (served * chunkTokens) / tps,
        tokensPerSecond: tps,
      },
      writers,
      wallMs: performance.now() - t0,
    }
  } finally {
    for (const wk of workers) await wk?.close(3000)
    await gw.close(1000)
    if (!opts.workDir) rmSync(workDir, { recursive: true, force: true })
  }
}

/** Objects and bytes under a name prefix, read from the store directly (not counted in the gateway's metrics). */
async function countObjects(store: ObjectStore, prefix: string): Promise<{ count: number; bytes: number }> {
  let count = 0
  let bytes = 0
  let cursor: string | undefined
  do {
    const page = await store.list(prefix, cursor === undefined ? {} : { cursor })
    for (const e of page.entries) {
      count++
      bytes += e.size
    }
    cursor = page.cursor
  } while (cursor !== undefined)
  return { count, bytes }
}

function sumTiers(xs: TierCount[]): TierCount {
  const out = { memory: 0, disk: 0, remote: 0 }
  for (const x of xs) {
    out.memory += x.memory
    out.disk += x.disk
    out.remote += x.remote
  }
  return out
}

function median(xs: number[]): number {
  if (xs.length === 0) return 0
  const s = [...xs].sort((a, b) => a - b)
  const m = s.length >> 1
  return s.length % 2 ? s[m]! : (s[m - 1]! + s[m]!) / 2
}

export function pct(x: number): string {
  return `${(100 * x).toFixed(1)}%`
}
