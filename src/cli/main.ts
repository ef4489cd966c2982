// The `kvgate` command: a thin dispatcher. Each subcommand lives in its own
// module under commands/ and is loaded only when used, so `kvgate --help` stays fast.

import { isKvgateError } from '../core/errors.ts'
import { packageVersion } from '../package-files.ts'

export interface CommandModule {
  /** Runs the command; resolves to the process exit code. */
  run(argv: string[]): Promise<number>
}

interface CommandEntry {
  summary: string
}

// Registered up front so `--help` can list them; commands/<name>.ts is imported on use.
// One line per command: adding a command is adding a line and its module.
const COMMANDS: Record<string, CommandEntry> = {
  demo: { summary: 'two nodes share a prompt prefix through a local gateway (the main job)' },
  serve: { summary: 'run the gateway (fs store by default, or S3)' },
  token: { summary: "create a bearer token and print its entry for the gateway's token table" },
  smoke: { summary: 'put, get and look up a chunk against a running gateway' },
  inspect: { summary: "print a chunk object's header, layer index and checksums" },
  agent: { summary: 'run the per-node sidecar vLLM talks to (kvgate_vllm connector)' },
  keys: { summary: 'compute chained prefix keys for a token list' },
  bench: { summary: 'run one benchmark (kvgate bench --help lists them)' },
  gc: { summary: 'delete unused and over-quota chains from the bucket, tail first (cold tier)' },
  'build-native': { summary: 'build the native addon where kvgate is installed (pinned L1, O_DIRECT)' },
}

export function version(): string {
  return packageVersion()
}

function usage(): string {
  const width = Math.max(...Object.keys(COMMANDS).map((c) => c.length))
  const lines = Object.entries(COMMANDS).map(([name, c]) => `  ${name.padEnd(width)}  ${c.summary}`)
  return [
    'kvgate: share LLM KV cache across a fleet through object storage',
    '',
    'Usage: kvgate <command> [options]',
    '',
    'Commands:',
    ...lines,
    '',
    'Options:',
    '  -h, --help     show help (also: kvgate <command> --help)',
    '  -v, --version  print the version',
    '',
    'Exit status: 0 success, 1 failure, 2 wrong usage or configuration (unknown flag, bad KVGATE_* value).',
  ].join('\n')
}

export async function main(argv: string[]): Promise<number> {
  const [first, ...rest] = argv
  if (first === undefined || first === '-h' || first === '--help' || first === 'help') {
    const target = first === 'help' ? rest[0] : undefined
    // `kvgate help nope` answers like `kvgate nope`: an unknown command is wrong usage.
    if (target !== undefined) return main([target, '--help'])
    // Asked for: stdout, 0. No command at all is wrong usage: stderr, 2 (as documented).
    if (first !== undefined) {
      console.log(usage())
      return 0
    }
    console.error(usage())
    return EXIT_USAGE
  }
  if (first === '-v' || first === '--version') {
    console.log(version())
    return 0
  }
  const entry = Object.hasOwn(COMMANDS, first) ? COMMANDS[first] : undefined
  if (!entry) {
    console.error(`kvgate: unknown command '${first}'. Run 'kvgate --help' for the list.`)
    return 2
  }
  let mod: CommandModule
  try {
    // Computed specifier: commands land in separate modules and load only on use.
    mod = (await import(`./commands/${first}.ts`)) as CommandModule
  } catch (e) {
    console.error(`kvgate: command '${first}' is not available in this build (${(e as Error).message})`)
    return 2
  }
  return mod.run(rest)
}

/** Exit status of a usage or configuration mistake (a wrong flag, option or KVGATE_* value). */
export const EXIT_USAGE = 2

const USAGE_CODES = new Set(['ERR_INVALID_ARGUMENT', 'ERR_CONFIG'])

/**
 * Prints a failure that escaped a command as one line (no stack unless KVGATE_DEBUG=1)
 * and returns the exit code: 2 for usage and configuration mistakes, 1 otherwise.
 */
export function reportFailure(e: unknown, command: string | undefined): number {
  const who = command && Object.hasOwn(COMMANDS, command) ? `kvgate ${command}` : 'kvgate'
  if (process.env.KVGATE_DEBUG === '1') console.error(e)
  if (isKvgateError(e)) {
    console.error(`${who}: ${e.message} [${e.code}]`)
    return USAGE_CODES.has(e.code) ? EXIT_USAGE : 1
  }
  const err = e as NodeJS.ErrnoException
  const text = err instanceof Error ? err.message : String(e)
  console.error(`${who}: ${text}${err?.code ? ` [${err.code}]` : ''} (KVGATE_DEBUG=1 prints the stack)`)
  return 1
}

// `node --import tsx src/cli/main.ts …` (scripts and tests of a checkout) runs like the bin.
if (process.argv[1] !== undefined && /[\\/]cli[\\/]main\.[jt]s$/.test(process.argv[1])) {
  main(process.argv.slice(2)).then(
    (code) => {
      process.exitCode = code
    },
    (e: unknown) => {
      process.exitCode = reportFailure(e, process.argv[2])
    },
  )
}
