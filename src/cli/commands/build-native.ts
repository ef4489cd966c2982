// `kvgate build-native`: builds the native addon inside the installed package (for
// platforms without a prebuilt binary, or after a Node upgrade), then checks that it loads.

import { spawnSync } from 'node:child_process'
import { join } from 'node:path'
import { packageRoot } from '../../package-files.ts'
import { parseCommandArgs } from '../args.ts'

const HELP = `Usage: kvgate build-native [--clean]

Builds kvgate's native addon (pinned host memory, O_DIRECT, GPU copies) where kvgate is
installed, with node-gyp (the one inside npm will do) against the system Node headers.
Needs g++, make and python3 (Debian: apt-get install g++ make python3).
linux-x64 installs already carry a prebuilt addon; a local build takes precedence over it.

Options:
  --clean     remove the previous build and rebuild from scratch
  -h, --help  show this help`

export async function run(argv: string[]): Promise<number> {
  const { values, help } = parseCommandArgs(argv, { clean: { type: 'boolean' } })
  if (help) {
    console.log(HELP)
    return 0
  }
  const root = packageRoot()
  const r = spawnSync('bash', [join(root, 'scripts/build-native.sh'), ...(values.clean ? ['--clean'] : [])], {
    stdio: 'inherit',
  })
  if (r.status !== 0) {
    console.error(
      'kvgate build-native: the build failed (reason above); kvgate keeps running without the addon',
    )
    return 1
  }
  const { loadNative } = await import('../../client/native-api.ts')
  const n = loadNative()
  if (!n.api) {
    console.error(`kvgate build-native: built, but the addon does not load: ${n.reason}`)
    return 1
  }
  console.log('kvgate build-native: the addon loads')
  return 0
}
