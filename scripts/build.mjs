// `npm run build`: compiles src/ and bench/ to dist/ (JavaScript, .d.ts, source maps)
// with tsc, then adds what tsc does not emit: the wasm codec and the codec worker's JS entry.

import { execFileSync } from 'node:child_process'
import { chmodSync, copyFileSync, mkdirSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import { createRequire } from 'node:module'
import { dirname, join } from 'node:path'

const root = join(dirname(new URL(import.meta.url).pathname), '..')
const dist = join(root, 'dist')
rmSync(dist, { recursive: true, force: true })

// typescript's exports map hides bin/: go through its package.json.
const tsc = join(dirname(createRequire(import.meta.url).resolve('typescript/package.json')), 'bin/tsc')
execFileSync(process.execPath, [tsc, '-p', join(root, 'tsconfig.build.json')], { stdio: 'inherit' })

// tsc writes files 0644. An installed package gets its bin made executable by npm, but in a
// checkout `npx kvgate` (the README's first command) runs this file as it is: without the
// bits, a fresh clone's `npx kvgate demo` failed with "Permission denied".
chmodSync(join(dist, 'src/cli/bin.js'), 0o755)

// Same relative place as in the checkout (../../wasm from src/codec), so one URL works in both.
mkdirSync(join(dist, 'wasm'))
copyFileSync(join(root, 'wasm/kvgate_codec.wasm'), join(dist, 'wasm/kvgate_codec.wasm'))
copyFileSync(join(root, 'src/client/codec-worker-entry.mjs'), join(dist, 'src/client/codec-worker-entry.mjs'))

// tsc rewrites `./x.ts` to `./x.js` in JavaScript but keeps it in declarations, where a
// consumer without allowImportingTsExtensions cannot follow it.
const walk = (dir) =>
  readdirSync(dir, { withFileTypes: true }).flatMap((e) =>
    e.isDirectory() ? walk(join(dir, e.name)) : [join(dir, e.name)],
  )
let rewritten = 0
for (const file of walk(dist).filter((f) => f.endsWith('.d.ts'))) {
  const text = readFileSync(file, 'utf8')
  const fixed = text.replace(/((?:from|import)\s*\(?\s*['"])(\.{1,2}\/[^'"]*?)\.ts(['"])/g, '$1$2.js$3')
  if (fixed !== text) {
    writeFileSync(file, fixed)
    rewritten++
  }
}
console.log(`build: dist/ written (${rewritten} declaration files had .ts specifiers rewritten)`)
