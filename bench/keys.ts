// Benchmark: chaining a 128k-token prompt into its 512 chunk keys. Figure: ms of
// hashing per 1k tokens (bar: well under 1 ms). Baselines in the same run: one
// SHA-256 over the same bytes (the floor) and the WebCrypto path (workerd's).

import { createHash } from 'node:crypto'
import { chainKeys, chainKeysAsync } from '../src/core/keys.ts'
import { MODEL_PRESETS } from '../src/core/layout.ts'
import { machineLine, median, table, timeRuns, writeResult } from './lib/stats.ts'

const p = MODEL_PRESETS['llama-3.1-8b']
const ns = { modelId: p.modelId, geometry: p, chunkTokens: 256 }
const TOKENS = 131072
const tokens = Uint32Array.from({ length: TOKENS }, (_, i) => (i * 2654435761) % 128256)
const asArray = Array.from(tokens)
const repeats = Number(process.env.KVGATE_BENCH_REPEATS ?? 41)

const sync = median(await timeRuns(() => chainKeys(tokens, ns), repeats, 5))
const syncArray = median(await timeRuns(() => chainKeys(asArray, ns), repeats, 5))
const subtle = median(await timeRuns(() => chainKeysAsync(tokens, ns), Math.ceil(repeats / 4), 2))
const bytes = new Uint8Array(tokens.buffer)
const floor = median(await timeRuns(() => createHash('sha256').update(bytes).digest(), repeats, 5))

const per1k = (ms: number) => ms / (TOKENS / 1000)
console.log(`Chain keys for a ${TOKENS}-token prompt (${TOKENS / 256} chunks), median of ${repeats}`)
console.log(
  table([
    ['path', 'ms total', 'ms per 1k tokens'],
    ['chainKeys (Uint32Array, node:crypto)', sync.toFixed(3), per1k(sync).toFixed(4)],
    ['chainKeys (number[])', syncArray.toFixed(3), per1k(syncArray).toFixed(4)],
    ['chainKeysAsync (WebCrypto)', subtle.toFixed(3), per1k(subtle).toFixed(4)],
    ['baseline: one SHA-256 over all token bytes', floor.toFixed(3), per1k(floor).toFixed(4)],
  ]),
)
const path = writeResult({
  name: 'keys',
  date: new Date().toISOString(),
  machine: await machineLine(),
  tokens: TOKENS,
  ms: { sync, syncArray, subtle, floor },
  bars: [
    {
      bar: 'Key chain hashing per 1k tokens (128k-token prompt)',
      figure: per1k(sync),
      unit: 'ms/1k tokens',
      baseline: per1k(floor),
      baselineLabel: 'one SHA-256 over the same bytes',
      ratio: sync / floor,
      target: '< 1 ms per 1k tokens',
      met: per1k(sync) < 1,
    },
  ],
})
console.log(`wrote ${path}`)
