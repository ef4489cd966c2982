// One simulated inference node of the fleet, in its own process: for each request it
// looks up and retrieves the cached prefix (L1 → L2 → L4), verifies it, "computes" the
// rest, stores everything and flushes, so the next request anywhere sees it in L4.

import type { ChunkCodecName } from '../client/chunk-codec.ts'
import { KVCache, type KVCacheStats } from '../client/index.ts'
import type { ModelPreset } from '../core/layout.ts'
import { serveWorker } from '../demo/worker.ts'
import { chunkContent, verifyChunk } from './content.ts'

export interface FleetNodeConfig {
  url: string
  namespace: string
  model: ModelPreset
  chunkTokens: number
  codec: ChunkCodecName
  memoryBytes: number
  diskDir: string
  diskBytes: number
  lookupTimeoutMs: number
}

export interface TierCount {
  memory: number
  disk: number
  remote: number
}

export interface RequestReport {
  /** Whole chunks in the request and how many leading ones the cache served. */
  chunks: number
  served: number
  /** Served chunks by the tier lookup found them in. */
  byTier: TierCount
  /** Served chunks whose KV was not what the chain key says (must stay 0). */
  badChunks: number
  lookupMs: number
  retrieveMs: number
  /** store() + flush of L2 and L4 writes. */
  storeMs: number
}

let cache: KVCache | undefined
let config: FleetNodeConfig | undefined

async function open(c: FleetNodeConfig): Promise<{ native: boolean }> {
  config = c
  cache = await KVCache.open({
    model: c.model,
    chunkTokens: c.chunkTokens,
    namespace: c.namespace,
    memory: { bytes: c.memoryBytes },
    disk: { dir: c.diskDir, bytes: c.diskBytes },
    remote: { url: c.url, codec: c.codec, lookupTimeoutMs: c.lookupTimeoutMs },
  })
  return { native: cache.stats().native.loaded }
}

function need(): { cache: KVCache; config: FleetNodeConfig } {
  if (!cache || !config) throw new Error('fleet node: call open first')
  return { cache, config }
}

async function request(p: { tokens: number[] }): Promise<RequestReport> {
  const { cache, config } = need()
  const keys = cache.keys(p.tokens)
  const cb = cache.chunkBytes
  let t = performance.now()
  const found = await cache.lookup(p.tokens)
  const lookupMs = performance.now() - t
  t = performance.now()
  const kv = new Uint8Array(keys.length * cb)
  const mask = await cache.retrieve(p.tokens, { into: kv })
  const retrieveMs = performance.now() - t
  let servedTokens = 0
  while (servedTokens < mask.length && mask[servedTokens] === 1) servedTokens++
  const served = servedTokens / config.chunkTokens
  const byTier: TierCount = { memory: 0, disk: 0, remote: 0 }
  for (const c of found.chunks.slice(0, served)) byTier[c.tier]++
  let badChunks = 0
  const exact = config.codec !== 'kvgate'
  for (let i = 0; i < served; i++) {
    if (!verifyChunk(config.model, keys[i]!, kv.subarray(i * cb, (i + 1) * cb), exact)) badChunks++
  }
  // The "prefill" of what the cache did not have.
  for (let i = served; i < keys.length; i++) kv.set(chunkContent(config.model, keys[i]!), i * cb)
  t = performance.now()
  await cache.store(p.tokens, kv)
  await cache.flush()
  const storeMs = performance.now() - t
  return { chunks: keys.length, served, byTier, badChunks, lookupMs, retrieveMs, storeMs }
}

/** Stores a prefix and flushes (the concurrent-writers measurement). */
async function store(p: { tokens: number[] }): Promise<{ puts: number; existed: number }> {
  const { cache, config } = need()
  const keys = cache.keys(p.tokens)
  const kv = new Uint8Array(keys.length * cache.chunkBytes)
  for (let i = 0; i < keys.length; i++) kv.set(chunkContent(config.model, keys[i]!), i * cache.chunkBytes)
  const before = cache.stats().remote!
  await cache.store(p.tokens, kv)
  await cache.flush()
  const after = cache.stats().remote!
  return { puts: after.puts - before.puts, existed: after.existed - before.existed }
}

function stats(): KVCacheStats {
  return need().cache.stats()
}

async function close(): Promise<KVCacheStats | undefined> {
  if (!cache) return undefined
  const s = cache.stats()
  await cache.close()
  cache = undefined
  return s
}

serveWorker({ open, request, store, stats, close })
