#!/usr/bin/env node
// The `kvgate` executable (package.json bin → dist/src/cli/bin.js): runs main() and
// turns what it throws into one line a user can act on, with the exit code.

import { main, reportFailure } from './main.ts'

main(process.argv.slice(2)).then(
  (code) => {
    process.exitCode = code
  },
  (e: unknown) => {
    process.exitCode = reportFailure(e, process.argv[2])
  },
)
