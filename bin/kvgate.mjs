#!/usr/bin/env node
// The `kvgate` command of a checkout (npm run kvgate, the tests): runs the TypeScript
// sources through tsx so it always matches the code. Installs run dist/src/cli/bin.js.
import { register } from 'tsx/esm/api'

register()
await import('../src/cli/bin.ts')
