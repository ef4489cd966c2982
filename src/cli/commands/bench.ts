// `kvgate bench <name> [options]`: runs one benchmark (bench/<name>, compiled in an install)
// in its own Node process; results go to --out DIR or the current directory, never into the package.

import { spawn } from 'node:child_process'
import { existsSync, mkdirSync, readdirSync } from 'node:fs'
import { resolve } from 'node:path'
import { fileURLToPath } from 'node:url'
import { InvalidArgumentError } from '../../core/errors.ts'
import { installedAsDependency, nodeFlagsFor, runsCompiled } from '../../package-files.ts'

const BENCH_DIR = fileURLToPath(new URL('../../../bench/', import.meta.url))
const EXT = runsCompiled ? '.js' : '.ts'

/** What each benchmark measures and needs (shown by --help without starting anything). */
export const BENCH_SUMMARY: Record<string, string> = {
  keys: 'chaining a 128k-token prompt into chunk keys (ms per 1k tokens) vs one SHA-256 of the same bytes',
  model:
    'the demo model (stories260K) forward pass and its real KV; needs the model files (KVGATE_SHARED_DATA)',
  codec: 'kvgate codec: compression ratio, quality and encode/decode speed vs 8-bit quantization',
  'codec-speed': 'codec throughput of the current wasm build vs a scalar build',
  native: 'pinned L1, O_DIRECT reads and (stub) GPU copies through the addon vs plain Node buffers',
  gateway: 'gateway PUT/GET/lookup throughput vs direct S3 (Ceph RadosGW when installed, else the fs store)',
  client: 'KVCache store/retrieve through L1/L2/L4 vs recomputing and vs a bare HTTP fetch',
  fleet:
    'N client processes behind one gateway: hit rate per tier vs an oracle, S3 requests, $ per 1,000 hits',
  'cold-tier':
    'the fleet workload under a quota below the working set with hourly gc: hit rate vs an oracle LRU and creation-age lifecycle',
  agent:
    'kvgate agent over its socket: save/load of scattered paged blocks vs one memcpy, 512-key lookup p50/p99',
  'load-vs-prefill':
    'lookup + retrieve of a Llama-3.1-8B-shaped prefix from L1, cold L2 and L4 (RadosGW) vs its modelled H100 prefill',
  'codec-rd':
    'rate-distortion rounding (rdRounding) vs nearest rounding: bytes, error, agreement and encode/decode time',
  'mla-latent':
    'MLA KV stored as latent chunks vs split K/V slabs (synthetic DeepSeek-shaped KV): bytes, error, speed',
}

/**
 * Developer tools in bench/, run with tsx in a checkout (their headers say how), not as
 * benchmarks: A/B tools that need a second build to compare against (an old .wasm, another
 * tree), the agent's copy shapes timed in-process (agent-copy-shapes: for comparing copy forms
 * quickly, bench/agent-ab.ts judges), and the codec research scripts (entropy models and bit allocations of docs/codec.md's
 * "What the 256-token bar needs"), which measure candidates, not a bar.
 */
const NOT_BENCHMARKS = new Set([
  'run-all',
  'report',
  'codec-diff',
  'l2-ab',
  'agent-ab',
  'agent-lookup',
  'agent-copy-shapes',
  'codec-context',
  'codec-layer-budget',
])

/** Benchmarks present (fuzzers and helpers are not benchmarks). */
export function availableBenches(dir = BENCH_DIR): string[] {
  if (!existsSync(dir)) return []
  return readdirSync(dir)
    .filter((f) => f.endsWith(EXT) && !f.endsWith('.d.ts') && !f.startsWith('fuzz-'))
    .map((f) => f.slice(0, -EXT.length))
    .filter((n) => !NOT_BENCHMARKS.has(n))
    .sort()
}

/** Where results go: --out, else bench/results in a checkout, else ./kvgate-bench-results. */
export function resultsDir(out: string | undefined): string {
  if (out !== undefined) return resolve(out)
  if (!installedAsDependency() && !runsCompiled) return resolve(BENCH_DIR, 'results')
  return resolve('kvgate-bench-results')
}

function help(): string {
  const names = availableBenches()
  const width = Math.max(0, ...names.map((n) => n.length))
  return `Usage: kvgate bench <name> [--out DIR]    (kvgate bench <name> --help: what it measures)

Runs one benchmark in its own Node process. It prints each figure beside the baseline
measured in the same run, and writes <name>.json (+ a chart) to --out DIR, or to
./kvgate-bench-results (bench/results in a checkout). The bars: docs/benchmarks.md.

Benchmarks:
${names.map((n) => `  ${n.padEnd(width)}  ${BENCH_SUMMARY[n] ?? ''}`).join('\n') || '  (none found)'}

Options:
  --out DIR   directory for the results [./kvgate-bench-results]
  -h, --help  this help; with a name, that benchmark's help (nothing is started)`
}

export async function run(argv: string[]): Promise<number> {
  const [name, ...rest] = argv
  if (name === '-h' || name === '--help') {
    console.log(help())
    return 0
  }
  if (name === undefined) {
    console.error(help()) // no benchmark named: wrong usage
    return 2
  }
  const names = availableBenches()
  if (!/^[a-z0-9][a-z0-9-]*$/.test(name) || !names.includes(name)) {
    throw new InvalidArgumentError(`unknown benchmark '${name}' (available: ${names.join(', ') || 'none'})`)
  }
  // Our own flags first: --help must never reach a benchmark that starts work on import.
  let out: string | undefined
  const passOn: string[] = []
  for (let i = 0; i < rest.length; i++) {
    const a = rest[i]!
    if (a === '-h' || a === '--help') {
      if (name !== 'fleet') {
        console.log(
          `kvgate bench ${name}: ${BENCH_SUMMARY[name] ?? 'a benchmark'}\n\nUsage: kvgate bench ${name} [--out DIR]\n  --out DIR  directory for ${name}.json and its chart [./kvgate-bench-results]`,
        )
        return 0
      }
      passOn.push('--help') // fleet parses its own options and prints its help before any work
    } else if (a === '--out' || a.startsWith('--out=')) {
      out = a === '--out' ? rest[++i] : a.slice('--out='.length)
      if (out === undefined || out === '') throw new InvalidArgumentError('--out needs a directory')
    } else if (name === 'fleet') passOn.push(a)
    else throw new InvalidArgumentError(`kvgate bench ${name} takes only --out DIR, got '${a}'`)
  }
  const file = `${BENCH_DIR}${name}${EXT}`
  const dir = resultsDir(out)
  if (!passOn.includes('--help')) mkdirSync(dir, { recursive: true })
  const child = spawn(process.execPath, [...nodeFlagsFor(file), '--expose-gc', file, ...passOn], {
    stdio: 'inherit',
    env: { ...process.env, KVGATE_BENCH_OUT: dir },
  })
  // Ctrl-C reaches the child through the terminal's process group; just wait for it.
  return new Promise((resolve) => {
    child.on('exit', (code, signal) => resolve(code ?? (signal ? 130 : 1)))
    child.on('error', () => resolve(1))
  })
}
