// What the demo's coordinator and its two node processes exchange: the job each
// node runs, and what each reports back (timings, tier counters, continuation).

import type { KVCacheStats } from '../client/index.ts'
import type { ModelPreset } from '../core/layout.ts'

export type DemoCodec = 'lossless' | 'kvgate'

/** Where a node's KV comes from: the real model's forward pass, or synthetic KV. */
export type KvSource =
  | { kind: 'model'; dir: string; continueTokens: number }
  | { kind: 'synthetic'; seed: number }

export interface NodeJob {
  /** Gateway base URL (L4). */
  url: string
  namespace: string
  model: ModelPreset
  chunkTokens: number
  codec: DemoCodec
  /** L1 budget and this node's own L2 directory. */
  memoryBytes: number
  diskDir: string
  prompt: number[]
  source: KvSource
  lookupTimeoutMs: number
}

/** Node A's job result. */
export interface WriterReport {
  pid: number
  /** Time to produce the prompt's KV: the forward pass, or synthetic generation. */
  prefillMs: number
  prefillTokens: number
  /** store() (into L1) and the flush of L2 + L4 writes. */
  storeMs: number
  flushMs: number
  storedChunks: number
  continuation: number[]
  continuationText?: string
  stats: KVCacheStats
}

/** Node B's job result. */
export interface ReaderReport {
  pid: number
  /** Tier of each chunk lookup found, in chain order. */
  tiers: string[]
  lookupMs: number
  retrieveMs: number
  /** Tokens whose KV came from the cache (whole chunks). */
  retrievedTokens: number
  /** Import of retrieved chunk tensors into the engine's cache (model path). */
  importMs: number
  /** Tokens recomputed after the retrieved prefix, and the time it took. */
  recomputedTokens: number
  recomputeMs: number
  continuation: number[]
  continuationText?: string
  /** Teacher-forced next-token agreement with node A's continuation (model path). */
  agreement?: { matched: number; total: number }
  /** Synthetic path: byte equality / relative error of every retrieved chunk against its expected KV. */
  verify?: { chunks: number; identical: number; kRelErr: number; vRelErr: number }
  stats: KVCacheStats
}

export interface DemoCheck {
  name: string
  ok: boolean
  detail: string
}
