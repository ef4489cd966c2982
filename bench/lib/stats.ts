// Small measurement helpers shared by the benchmarks: repeat, take medians, and
// write the JSON result a script (and the HTML report) reads.

import { mkdirSync, writeFileSync } from 'node:fs'
import { dirname, join, resolve } from 'node:path'
import { fileURLToPath } from 'node:url'

/**
 * Where results are written: $KVGATE_BENCH_OUT (kvgate bench --out), else bench/results in a
 * checkout, else ./kvgate-bench-results (compiled, inside an install: never into node_modules).
 */
export const RESULTS_DIR =
  process.env.KVGATE_BENCH_OUT ??
  (import.meta.url.endsWith('.ts')
    ? join(dirname(fileURLToPath(import.meta.url)), '..', 'results')
    : resolve('kvgate-bench-results'))

export function median(xs: readonly number[]): number {
  const s = [...xs].sort((a, b) => a - b)
  const m = s.length >> 1
  return s.length % 2 ? s[m]! : (s[m - 1]! + s[m]!) / 2
}

export function quantile(xs: readonly number[], q: number): number {
  const s = [...xs].sort((a, b) => a - b)
  return s[Math.min(s.length - 1, Math.floor(q * s.length))]!
}

/** Runs fn `repeats` times after `warmup` runs; returns milliseconds per run. */
export async function timeRuns(fn: () => unknown, repeats: number, warmup = 2): Promise<number[]> {
  for (let i = 0; i < warmup; i++) await fn()
  const out: number[] = []
  for (let i = 0; i < repeats; i++) {
    const t = performance.now()
    await fn()
    out.push(performance.now() - t)
  }
  return out
}

/** A bar from DESIGN.md section 4: the figure, its baseline from the same run, and the verdict. */
export interface BarResult {
  bar: string
  figure: number
  unit: string
  baseline?: number
  baselineLabel?: string
  ratio?: number
  target: string
  met: boolean
  /** A target the project set itself for a component, not one of DESIGN.md §4's bars. */
  informational?: boolean
}

export interface BenchResult {
  name: string
  date: string
  machine: string
  bars: BarResult[]
  [extra: string]: unknown
}

export async function machineLine(): Promise<string> {
  const os = await import('node:os')
  const cpu = os.cpus()[0]?.model ?? 'unknown cpu'
  return `${cpu}, ${os.cpus().length} cores, ${(os.totalmem() / 2 ** 30).toFixed(0)} GiB, Node ${process.version}`
}

export function writeResult(result: BenchResult): string {
  mkdirSync(RESULTS_DIR, { recursive: true })
  const path = join(RESULTS_DIR, `${result.name}.json`)
  writeFileSync(path, `${JSON.stringify(result, null, 2)}\n`)
  return path
}

export function table(rows: (string | number)[][]): string {
  const widths = rows[0]!.map((_, c) => Math.max(...rows.map((r) => String(r[c] ?? '').length)))
  return rows.map((r) => r.map((v, c) => String(v).padEnd(widths[c]!)).join('  ')).join('\n')
}
