// The `kvgate` command: a thin dispatcher. Each subcommand lives in its own
// module under commands/ and is loaded only when used, so `kvgate --help` stays fast.

import { readFileSync } from 'node:fs'
import { isKvgateError } from '../core/errors.ts'

export interface CommandModule {
  /** Runs the command; resolves to the process exit code. */
  run(argv: string[]): Promise<number>
}

interface CommandEntry {
  summary: string
}

// Registered up front so `--help` can list them; the module is imported on use.
const COMMANDS: Record<string, CommandEntry> = {
  demo: {
    summary: 'two nodes share a prompt prefix through a local gateway (the main job)',
  },
  serve: { summary: 'run the gateway (fs store by default, or S3)' },
  agent: { summary: 'run the per-node sidecar vLLM talks to (kvgate_vllm connector)' },
  inspect: {
    summary: "print a chunk object's header, layer index and checksums",
  },
  keys: { summary: 'compute chained prefix keys for a token list' },
  smoke: {
    summary: 'put, get and look up a chunk against a running gateway',
  },
  bench: { summary: 'run a benchmark (codec, gateway, native, client, fleet)' },
}

export function version(): string {
  const pkg = JSON.parse(readFileSync(new URL('../../package.json', import.meta.url), 'utf8')) as {
    version: string
  }
  return pkg.version
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
  ].join('\n')
}

export async function main(argv: string[]): Promise<number> {
  const [first, ...rest] = argv
  if (first === undefined || first === '-h' || first === '--help' || first === 'help') {
    const target = first === 'help' ? rest[0] : undefined
    if (target && Object.hasOwn(COMMANDS, target)) return main([target, '--help'])
    console.log(usage())
    return first === undefined ? 1 : 0
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

const invokedDirectly =
  process.argv[1] !== undefined && /(?:main\.ts|kvgate(?:\.mjs)?)$/.test(process.argv[1])
if (invokedDirectly) {
  main(process.argv.slice(2)).then(
    (code) => {
      process.exitCode = code
    },
    (e: unknown) => {
      if (isKvgateError(e)) console.error(`kvgate: ${e.message} [${e.code}]`)
      else console.error(e)
      process.exitCode = 1
    },
  )
}
