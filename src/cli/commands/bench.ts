// `kvgate bench <name> [options]`: runs bench/<name>.ts of this checkout in its own Node
// process (through tsx) with the options passed on; `kvgate bench` lists what is there.

import { spawn } from 'node:child_process'
import { existsSync, readdirSync } from 'node:fs'
import { fileURLToPath } from 'node:url'
import { InvalidArgumentError } from '../../core/errors.ts'

const BENCH_DIR = fileURLToPath(new URL('../../../bench/', import.meta.url))
const TSX_LOADER = import.meta.resolve('tsx')

/** Benchmarks present in bench/ (fuzzers and helpers are not benchmarks). */
export function availableBenches(dir = BENCH_DIR): string[] {
  if (!existsSync(dir)) return []
  return readdirSync(dir)
    .filter((f) => f.endsWith('.ts') && !f.startsWith('fuzz-') && f !== 'run-all.ts' && f !== 'report.ts')
    .map((f) => f.slice(0, -3))
    .sort()
}

function help(): string {
  const names = availableBenches()
  return `Usage: kvgate bench <name> [options]    (kvgate bench <name> --help for its options)

Runs one benchmark of this checkout: bench/<name>.ts, which prints its figures
beside the baseline measured in the same run and writes bench/results/<name>.json
(+ a chart). \`npm run bench\` runs them all and writes bench/results/report.html.

Benchmarks here: ${names.length > 0 ? names.join(', ') : '(none found in bench/)'}

  fleet   N client processes behind one gateway on Ceph RadosGW (or --store fs):
          hit rate per tier vs an oracle, S3 requests and $ per 1,000 prefix hits
  cold-tier  the fleet workload under a quota below the working set with hourly gc:
          hit rate vs an oracle LRU and creation-age lifecycle, use-tracking requests`
}

export async function run(argv: string[]): Promise<number> {
  const [name, ...rest] = argv
  if (name === undefined || name === '-h' || name === '--help') {
    console.log(help())
    return name === undefined ? 1 : 0
  }
  if (!/^[a-z0-9][a-z0-9-]*$/.test(name) || !availableBenches().includes(name)) {
    throw new InvalidArgumentError(
      `unknown benchmark '${name}' (available: ${availableBenches().join(', ') || 'none'})`,
    )
  }
  const file = `${BENCH_DIR}${name}.ts`
  const child = spawn(process.execPath, ['--import', TSX_LOADER, '--expose-gc', file, ...rest], {
    stdio: 'inherit',
  })
  // Ctrl-C reaches the child through the terminal's process group; just wait for it.
  return new Promise((resolve) => {
    child.on('exit', (code, signal) => resolve(code ?? (signal ? 130 : 1)))
    child.on('error', () => resolve(1))
  })
}
