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

/** Parses argv for a subcommand; `help` is true when -h/--help was given. */
export function parseCommandArgs<O extends Options>(argv: string[], options: O): Parsed<O> {
  try {
    const { values, positionals } = parseArgs({
      args: argv,
      options: { ...options, help: { type: 'boolean', short: 'h' } },
      allowPositionals: true,
      strict: true,
    })
    const { help, ...rest } = values as Record<string, unknown>
    return { values: rest as Parsed<O>['values'], positionals, help: help === true }
  } catch (e) {
    throw new InvalidArgumentError(`${(e as Error).message}. Run with --help for usage.`)
  }
}
