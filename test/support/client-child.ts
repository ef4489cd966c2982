// Child process for the client's multi-process tests. argv: <mode> <json options>.
//   store-loop: store chunk after chunk into L2 forever (the parent SIGKILLs it)
//   store-prefix: store one prefix through the gateway, flush, print the stats line

import { KVCache } from '../../src/client/index.ts'
import { chunkBytes, MODEL_PRESETS } from '../../src/core/layout.ts'

const [mode, json] = process.argv.slice(2)
const opts = JSON.parse(json ?? '{}') as {
  dir?: string
  url?: string
  chunks?: number
  seed?: number
  lookupTimeoutMs?: number
}
const T = 64
const CB = chunkBytes(MODEL_PRESETS.stories260k, T)

/** Deterministic chunk tensor for chunk `i` of a prompt: the parent recomputes it to check. */
export function tensorFor(i: number, seed: number): Uint8Array {
  const out = new Uint8Array(CB)
  let x = (i + 1) * 2654435761 + seed
  for (let j = 0; j < out.length; j++) {
    x = (x * 1103515245 + 12345) >>> 0
    out[j] = x >>> 24
  }
  return out
}

export function promptTokens(chunks: number, seed: number): number[] {
  return Array.from({ length: chunks * T }, (_, i) => (i * 31 + seed) % 512)
}

async function main(): Promise<void> {
  if (mode === 'store-loop') {
    const cache = await KVCache.open({
      model: 'stories260k',
      chunkTokens: T,
      memory: { bytes: 8 * CB },
      disk: { dir: opts.dir!, bytes: 1 << 30 },
    })
    process.stdout.write('ready\n')
    // Every prompt extends the same seed chain, so chunk i of prompt n is chunk i of the big prompt.
    const n = 4096
    const toks = promptTokens(n, opts.seed ?? 1)
    for (let i = 0; i < n; i++) {
      const prefix = toks.slice(0, (i + 1) * T)
      const kv = new Uint8Array((i + 1) * CB)
      kv.set(tensorFor(i, opts.seed ?? 1), i * CB)
      // Only the last chunk is new; earlier ones are present in L1 or skipped by L2.
      await cache.store(prefix.slice(0, (i + 1) * T), await fillEarlier(cache, prefix, kv, i))
      if (i % 4 === 3) await cache.flush()
    }
  } else if (mode === 'store-prefix') {
    const cache = await KVCache.open({
      model: 'stories260k',
      chunkTokens: T,
      namespace: 'shared',
      memory: { bytes: 16 * CB },
      remote: { url: opts.url!, codec: 'raw', lookupTimeoutMs: opts.lookupTimeoutMs ?? 250 },
    })
    const chunks = opts.chunks ?? 4
    const kv = new Uint8Array(chunks * CB)
    for (let i = 0; i < chunks; i++) kv.set(tensorFor(i, opts.seed ?? 1), i * CB)
    await cache.store(promptTokens(chunks, opts.seed ?? 1), kv)
    await cache.flush()
    const s = cache.stats().remote!
    const out = {
      puts: s.puts,
      existed: s.existed,
      errors: s.errors,
      shed: s.shedWrites,
      timeouts: s.timeouts,
      breaker: s.breaker,
    }
    process.stdout.write(`${JSON.stringify(out)}\n`)
    await cache.close()
  }
}

async function fillEarlier(_c: KVCache, _p: number[], kv: Uint8Array, i: number): Promise<Uint8Array> {
  for (let j = 0; j < i; j++) kv.set(tensorFor(j, opts.seed ?? 1), j * CB)
  return kv
}

if (mode) await main()
