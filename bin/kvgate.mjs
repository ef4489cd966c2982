#!/usr/bin/env node
// The `kvgate` command. The project ships TypeScript sources; tsx runs them
// without a build step, so the CLI always matches the code in the checkout.
import { register } from 'tsx/esm/api'

register()
await import('../src/cli/main.ts')
