// Shared argument handling for subcommands: node:util parseArgs plus a uniform
// --help and a clear error when a flag is wrong.

import { type ParseArgsConfig, parseArgs } from 'node:util'
import { nearestKey } from '../core/config-check.ts'
import { InvalidArgumentError } from '../core/errors.ts'

export type Options = NonNullable<ParseArgsConfig['options']>

export interface Parsed<O extends Options> {
  values: { [K in keyof O]?: O[K]['type'] extends 'boolean' ? boolean : string }
  positionals: string[]
  help: boolean
}

/**
 * Parses argv for a subcommand; `help` is true when -h/--help was given. Positional arguments
 * are errors unless `positionals` says the command reads them (`kvgate serve 9000` must not
 * serve on the default port).
 */
export function parseCommandArgs<O extends Options>(
  argv: string[],
  options: O,
  { positionals: takesPositionals = false }: { positionals?: boolean } = {},
): Parsed<O> {
  let parsed: ReturnType<typeof parseArgs>
  try {
    parsed = parseArgs({
      args: argv,
      options: { ...options, help: { type: 'boolean', short: 'h' } },
      allowPositionals: true,
      strict: true,
    })
  } catch (e) {
    const err = e as Error & { code?: string }
    const unknown = /^Unknown option '([^']+)'/.exec(err.message)?.[1]
    if (err.code === 'ERR_PARSE_ARGS_UNKNOWN_OPTION' && unknown !== undefined) {
      // node's own text explains `--` for positionals; a mistyped flag needs the real one.
      const flags = [...Object.keys(options), 'help'].map((k) => `--${k}`)
      const near = unknown.startsWith('--') ? nearestKey(unknown, flags) : undefined
      throw new InvalidArgumentError(
        `unknown option '${unknown}'${near ? ` (did you mean '${near}'?)` : ''}. Run with --help for usage.`,
      )
    }
    // node's text can span lines ('--flag -1' is "ambiguous", then two lines of advice): errors are one line.
    const message = err.message.replace(/\s*\n\s*/g, ' ').replace(/\.$/, '')
    throw new InvalidArgumentError(`${message}. Run with --help for usage.`)
  }
  const { values, positionals } = parsed
  const { help, ...rest } = values as Record<string, unknown>
  if (!takesPositionals && positionals.length > 0 && help !== true)
    throw new InvalidArgumentError(
      `unexpected argument '${positionals[0]}' (this command takes only options). Run with --help for usage.`,
    )
  return { values: rest as Parsed<O>['values'], positionals, help: help === true }
}
