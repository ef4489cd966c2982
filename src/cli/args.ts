// Shared argument handling for subcommands: node:util parseArgs plus a uniform
// --help and a clear error when a flag is wrong.

import { type ParseArgsConfig, parseArgs } from 'node:util'
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
    throw new InvalidArgumentError(`${(e as Error).message}. Run with --help for usage.`)
  }
  const { values, positionals } = parsed
  const { help, ...rest } = values as Record<string, unknown>
  if (!takesPositionals && positionals.length > 0 && help !== true)
    throw new InvalidArgumentError(
      `unexpected argument '${positionals[0]}' (this command takes only options). Run with --help for usage.`,
    )
  return { values: rest as Parsed<O>['values'], positionals, help: help === true }
}
