// Fuzzes the codec decoders with ≥ 100k mutated chunk objects (every mode) and
// writes bench/results/fuzz-codec.json. Usage: node --import tsx bench/fuzz-codec.ts [iterations] [seed]

import { mkdirSync, writeFileSync } from 'node:fs'
import { join } from 'node:path'
import { fuzzCodec } from './lib/fuzz-codec.ts'
import { RESULTS_DIR } from './lib/stats.ts'

const iterations = Number(process.argv[2] ?? 100_000)
const seed = Number(process.argv[3] ?? 20261121)
const t0 = performance.now()
const report = fuzzCodec({ iterations, seed })
const seconds = (performance.now() - t0) / 1000
console.log(`fuzz-codec: ${report.iterations} mutated inputs in ${seconds.toFixed(1)} s (seed ${seed})`)
console.log(
  `  decoded without error: ${report.decoded}, rejected with a kvgate error: ${report.rejected} (wasm traps: ${report.traps})`,
)
console.log(`  per mode: ${JSON.stringify(report.perMode)}`)
console.log(
  `  slowest decode: ${report.maxDecodeMs.toFixed(2)} ms, max wasm memory: ${report.maxMemoryBytes} bytes`,
)
console.log(`  failures (crashes / non-kvgate errors / corrupted instance): ${report.failures.length}`)
for (const f of report.failures.slice(0, 5))
  console.log(`   - ${f.mode}: ${f.error.split('\n').slice(0, 3).join(' | ')}`)
mkdirSync(RESULTS_DIR, { recursive: true })
writeFileSync(
  join(RESULTS_DIR, 'fuzz-codec.json'),
  `${JSON.stringify({ ...report, seed, seconds, failures: report.failures.slice(0, 50) }, null, 2)}\n`,
)
process.exitCode = report.failures.length === 0 ? 0 : 1
