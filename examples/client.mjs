// A minimal kvgate client: memory tier only (no disk, no gateway). Stores the KV of a
// 512-token prompt, looks the prompt up, and reads the KV back byte for byte.
import { KVCache } from 'kvgate/client'
import { chunkBytes, MODEL_PRESETS } from 'kvgate/core'

const model = 'stories260k' // a preset; or { modelId, layers, kvHeads, headDim, dtype }
const chunkTokens = 256
const cache = await KVCache.open({ model, chunkTokens, memory: { bytes: '64MiB' } })
try {
  const tokens = Uint32Array.from({ length: 512 }, (_, i) => (i * 7919) % 512)
  // The engine's KV for these tokens, in kvgate's chunk layout (here: made-up bytes).
  const kv = new Uint8Array(2 * chunkBytes(MODEL_PRESETS[model], chunkTokens)).map((_, i) => i % 251)
  const stored = await cache.store(tokens, kv)
  const { tokens: cached } = await cache.lookup(tokens)
  const back = await cache.retrieve(tokens, { into: new Uint8Array(kv.length) })
  console.log(
    JSON.stringify({
      stored: stored.chunks,
      cachedTokens: cached,
      retrieved: back.every((m) => m === 1),
      native: cache.stats().native.loaded,
    }),
  )
} finally {
  await cache.close()
}
