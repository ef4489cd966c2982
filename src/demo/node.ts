// One demo "GPU node" in its own process: node A prefills a prompt and stores its
// KV through kvgate; node B (cold L1/L2) retrieves it through the gateway and continues.

import { join } from 'node:path'
import { KVCache } from '../client/index.ts'
import { decodeChunk, encodeChunk } from '../codec/node.ts'
import { chunkBytes, type KvGeometry } from '../core/layout.ts'
import {
  argmax,
  exportChunk,
  importChunk,
  kvRelativeError,
  type LoadedModel,
  loadStories260k,
  MODEL_FILE,
  syntheticKv,
  TOKENIZER_FILE,
} from '../model/index.ts'
import type { NodeJob, ReaderReport, WriterReport } from './types.ts'
import { progress, serveWorker } from './worker.ts'

function openCache(job: NodeJob): Promise<KVCache> {
  return KVCache.open({
    model: job.model,
    chunkTokens: job.chunkTokens,
    namespace: job.namespace,
    memory: { bytes: job.memoryBytes },
    disk: { dir: job.diskDir },
    remote: { url: job.url, codec: job.codec, lookupTimeoutMs: job.lookupTimeoutMs, timeoutMs: 10_000 },
  })
}

function loadModel(dir: string): LoadedModel {
  return loadStories260k({ dir, model: join(dir, MODEL_FILE), tokenizer: join(dir, TOKENIZER_FILE) })
}

/** Synthetic KV of positions [0, tokens): a deterministic stand-in for a forward pass. */
function syntheticPrefix(g: KvGeometry, tokens: number, seed: number): Uint8Array {
  return syntheticKv({ geometry: g, tokens, seed, rope: 'half' })
}

/** Splits a [layer][K|V][token]… tensor of n·T tokens into n chunk tensors of T tokens. */
function toChunks(g: KvGeometry, tensor: Uint8Array, tokens: number, T: number): Uint8Array[] {
  const row = chunkBytes(g, 1) / (2 * g.layers)
  const out: Uint8Array[] = []
  for (let c = 0; c * T + T <= tokens; c++) {
    const chunk = new Uint8Array(chunkBytes(g, T))
    let o = 0
    for (let p = 0; p < 2 * g.layers; p++) {
      const base = p * tokens * row
      chunk.set(tensor.subarray(base + c * T * row, base + (c + 1) * T * row), o)
      o += T * row
    }
    out.push(chunk)
  }
  return out
}

function concat(parts: Uint8Array[]): Uint8Array {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.byteLength, 0))
  let o = 0
  for (const p of parts) {
    out.set(p, o)
    o += p.byteLength
  }
  return out
}

async function writer(job: NodeJob): Promise<WriterReport> {
  const T = job.chunkTokens
  const full = Math.floor(job.prompt.length / T)
  const cache = await openCache(job)
  try {
    let kv: Uint8Array
    let continuation: number[] = []
    let continuationText: string | undefined
    let t = performance.now()
    let prefillMs: number
    let model: LoadedModel | undefined
    let engineCache: ReturnType<LoadedModel['transformer']['newCache']> | undefined
    if (job.source.kind === 'model') {
      model = loadModel(job.source.dir)
      warmUp(model, job.prompt)
      t = performance.now()
      engineCache = model.transformer.prefill(job.prompt).cache
      prefillMs = performance.now() - t
      kv = concat(
        Array.from({ length: full }, (_, i) => exportChunk(engineCache!, i * T, (i + 1) * T, 'fp16')),
      )
    } else {
      const all = syntheticPrefix(job.model, full * T, job.source.seed)
      kv = concat(toChunks(job.model, all, full * T, T))
      prefillMs = performance.now() - t
    }
    progress(`prefill ${job.prompt.length} tokens: ${fmtMs(prefillMs)}`)
    t = performance.now()
    const stored = await cache.store(job.prompt, kv)
    const storeMs = performance.now() - t
    t = performance.now()
    await cache.flush()
    const flushMs = performance.now() - t
    if (model && engineCache && job.source.kind === 'model') {
      continuation = model.transformer.generate(job.prompt, job.source.continueTokens, {
        cache: engineCache,
        stopAtBos: false,
      }).tokens
      continuationText = model.tokenizer.decode(continuation)
    }
    const report: WriterReport = {
      pid: process.pid,
      prefillMs,
      prefillTokens: job.prompt.length,
      storeMs,
      flushMs,
      storedChunks: stored.chunks,
      continuation,
      stats: cache.stats(),
    }
    if (continuationText !== undefined) report.continuationText = continuationText
    return report
  } finally {
    await cache.close()
  }
}

async function reader(job: NodeJob & { reference: number[] }): Promise<ReaderReport> {
  const T = job.chunkTokens
  const g = job.model
  const CB = chunkBytes(g, T)
  const full = Math.floor(job.prompt.length / T)
  const model = job.source.kind === 'model' ? loadModel(job.source.dir) : undefined
  const cache = await openCache(job)
  try {
    if (model) warmUp(model, job.prompt)
    warmCodec(job)
    // A running engine has its gateway connection open: make one before timing (a lookup that misses).
    await cache.lookup(Array.from({ length: T }, (_, i) => i))
    let t = performance.now()
    const found = await cache.lookup(job.prompt)
    const lookupMs = performance.now() - t
    t = performance.now()
    const into = new Uint8Array(full * CB)
    const mask = await cache.retrieve(job.prompt, { into })
    const retrieveMs = performance.now() - t
    let served = 0
    while (served < mask.length && mask[served] === 1) served++
    const chunks = served / T
    progress(`retrieved ${served} of ${job.prompt.length} tokens in ${fmtMs(lookupMs + retrieveMs)}`)
    const report: ReaderReport = {
      pid: process.pid,
      tiers: found.chunks.map((c) => c.tier),
      lookupMs,
      retrieveMs,
      retrievedTokens: served,
      importMs: 0,
      recomputedTokens: job.prompt.length - served,
      recomputeMs: 0,
      continuation: [],
      stats: cache.stats(),
    }
    if (model && job.source.kind === 'model') {
      const tf = model.transformer
      t = performance.now()
      const engine = tf.newCache()
      for (let i = 0; i < chunks; i++) importChunk(engine, i * T, into.subarray(i * CB, (i + 1) * CB), 'fp16')
      report.importMs = performance.now() - t
      // An engine needs the last prompt token's logits: with the whole prompt cached it reruns that token.
      if (engine.length >= job.prompt.length) engine.truncate(job.prompt.length - 1)
      t = performance.now()
      const tail = job.prompt.slice(engine.length)
      report.recomputedTokens = tail.length
      const logits = tf.prefill(tail, { cache: engine }).logits
      report.recomputeMs = performance.now() - t
      // Teacher-forced agreement: at each step, does B predict what A generated?
      const forced = engine.clone()
      let l: Float32Array = logits.slice()
      let matched = 0
      for (const want of job.reference) {
        if (argmax(l) === want) matched++
        l = tf.step(want, forced).slice()
      }
      report.agreement = { matched, total: job.reference.length }
      const n = job.source.continueTokens
      const out: number[] = []
      l = logits
      for (let i = 0; i < n; i++) {
        const next = argmax(l)
        out.push(next)
        if (i + 1 < n) l = tf.step(next, engine)
      }
      report.continuation = out
      report.continuationText = model.tokenizer.decode(out)
    } else if (job.source.kind === 'synthetic') {
      // What a forward pass would have produced: regenerate it and compare.
      t = performance.now()
      const expected = toChunks(g, syntheticPrefix(g, full * T, job.source.seed), full * T, T)
      report.recomputeMs = (performance.now() - t) * (report.recomputedTokens / Math.max(1, full * T))
      const pairs = expected
        .slice(0, chunks)
        .map((exact, i) => ({ exact, decoded: into.subarray(i * CB, (i + 1) * CB) }))
      const identical = pairs.filter((p) => Buffer.compare(p.exact, p.decoded) === 0).length
      const err = pairs.length > 0 ? kvRelativeError(g, pairs) : { kAll: 0, vAll: 0 }
      report.verify = { chunks: pairs.length, identical, kRelErr: err.kAll, vRelErr: err.vAll }
    }
    // Promotions of L4 hits into L2 run in the background: let them land before reporting.
    await cache.flush()
    report.stats = cache.stats()
    return report
  } finally {
    await cache.close()
  }
}

/**
 * Runs the forward pass on a scratch cache so timings are those of a warm engine
 * (a long-running server), not of V8 compiling the matmuls in a fresh process.
 */
function warmUp(model: LoadedModel, prompt: number[]): void {
  model.transformer.prefill(prompt.slice(0, 32), { cache: model.transformer.newCache() })
}

/** Encodes and decodes one small chunk so the codec's wasm is compiled to its fast tier, as in a running engine. */
function warmCodec(job: NodeJob): void {
  const tokens = Math.min(job.chunkTokens, 16)
  const meta = {
    geometry: job.model,
    tokens,
    chunkIndex: 0,
    partial: false,
    namespaceId: new Uint8Array(16),
    chainKey: new Uint8Array(32),
    parentKey: new Uint8Array(32),
  }
  const tensor = syntheticKv({ geometry: job.model, tokens, seed: 1 })
  decodeChunk(encodeChunk(tensor, meta, { mode: job.codec }))
}

function fmtMs(ms: number): string {
  return ms >= 1000 ? `${(ms / 1000).toFixed(2)} s` : `${ms.toFixed(0)} ms`
}

serveWorker({ writer, reader })
