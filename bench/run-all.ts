// `npm run bench [-- name…]`: runs every benchmark under bench/ (or the named
// ones) one after another — they share 2 cores, so never in parallel — then
// writes bench/results/report.html. A failing benchmark is reported, not fatal.

import { spawnSync } from 'node:child_process'
import { existsSync } from 'node:fs'
import { fileURLToPath } from 'node:url'
import { nodeFlagsFor, siblingModule } from '../src/package-files.ts'
import { writeReport } from './report.ts'

export const BENCHES = [
  'keys',
  'model',
  'codec',
  'native',
  'gateway',
  'client',
  'load-vs-prefill',
  'fleet',
  'cold-tier',
  'agent',
] as const

const wanted = process.argv.slice(2).filter((a) => !a.startsWith('-'))
const names = wanted.length > 0 ? wanted : [...BENCHES]
const failures: string[] = []
for (const [i, name] of names.entries()) {
  const file = fileURLToPath(siblingModule(import.meta.url, `./${name}.ts`))
  if (!existsSync(file)) {
    console.error(`[${i + 1}/${names.length}] ${name}: no bench/${name}.ts, skipped`)
    failures.push(`${name} (missing)`)
    continue
  }
  console.error(`\n[${i + 1}/${names.length}] bench/${name}.ts`)
  const t = performance.now()
  const r = spawnSync(process.execPath, [...nodeFlagsFor(file), '--expose-gc', file], { stdio: 'inherit' })
  const secs = ((performance.now() - t) / 1000).toFixed(0)
  if (r.status !== 0) failures.push(`${name} (exit ${r.status ?? r.signal})`)
  console.error(
    `[${i + 1}/${names.length}] ${name} finished in ${secs} s${r.status === 0 ? '' : ' — FAILED'}`,
  )
}
const report = writeReport()
console.log(`\nreport: ${report}`)
if (failures.length > 0) {
  console.error(`benchmarks that did not finish: ${failures.join(', ')}`)
  process.exitCode = 1
}
