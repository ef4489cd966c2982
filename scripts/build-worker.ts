// Bundles the Cloudflare Worker (src/gateway/adapters/workers.ts) the way wrangler
// does: one ES module for workerd, .wasm files kept as separate CompiledWasm modules.
// Prints the bundle's raw and gzip size against the free plan's 3 MiB limit.

import { copyFileSync, mkdirSync, readFileSync, writeFileSync } from 'node:fs'
import { basename, dirname, join, resolve } from 'node:path'
import { fileURLToPath } from 'node:url'
import { gzipSync } from 'node:zlib'
import { build, type Plugin } from 'esbuild'

const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), '..')

/** The Workers free plan refuses scripts above 3 MiB after gzip (paid: 10 MiB). */
export const FREE_PLAN_GZIP_LIMIT = 3 * 1024 * 1024

export interface WorkerBuildOptions {
  /** Entry module. @default src/gateway/adapters/workers.ts */
  entry?: string
  /** Output directory. @default dist/worker */
  outdir?: string
  minify?: boolean
}

export interface WorkerBuild {
  /** The bundled ES module (worker.js) inside outdir. */
  script: string
  /** CompiledWasm modules copied beside it, by the name the bundle imports. */
  wasm: string[]
  bytes: number
  gzipBytes: number
}

// workerd imports .wasm as a compiled WebAssembly.Module: keep each import as an
// external module and copy the file beside the bundle under its base name.
function wasmModules(outdir: string, copied: string[]): Plugin {
  return {
    name: 'kvgate-wasm-modules',
    setup(b) {
      b.onResolve({ filter: /\.wasm$/ }, (args) => {
        const source = resolve(args.resolveDir, args.path)
        const name = basename(source)
        copyFileSync(source, join(outdir, name))
        if (!copied.includes(name)) copied.push(name)
        return { path: `./${name}`, external: true }
      })
    },
  }
}

export async function buildWorker(opts: WorkerBuildOptions = {}): Promise<WorkerBuild> {
  const entry = resolve(ROOT, opts.entry ?? 'src/gateway/adapters/workers.ts')
  const outdir = resolve(ROOT, opts.outdir ?? 'dist/worker')
  mkdirSync(outdir, { recursive: true })
  const wasm: string[] = []
  const script = join(outdir, 'worker.js')
  await build({
    entryPoints: [entry],
    outfile: script,
    bundle: true,
    format: 'esm',
    platform: 'neutral',
    target: 'es2022',
    // The same resolution conditions wrangler uses for workerd.
    conditions: ['workerd', 'worker', 'browser'],
    mainFields: ['browser', 'module', 'main'],
    minify: opts.minify ?? true,
    sourcemap: false,
    legalComments: 'none',
    logLevel: 'warning',
    plugins: [wasmModules(outdir, wasm)],
  })
  const bytes = readFileSync(script)
  return { script, wasm, bytes: bytes.length, gzipBytes: gzipSync(bytes, { level: 9 }).length }
}

/** Raw + gzip size of the upload: the script plus every wasm module. */
export function uploadSize(result: WorkerBuild): { bytes: number; gzipBytes: number } {
  let bytes = result.bytes
  let gzipBytes = result.gzipBytes
  for (const name of result.wasm) {
    const w = readFileSync(join(dirname(result.script), name))
    bytes += w.length
    gzipBytes += gzipSync(w, { level: 9 }).length
  }
  return { bytes, gzipBytes }
}

if (process.argv[1] && resolve(process.argv[1]) === fileURLToPath(import.meta.url)) {
  const result = await buildWorker({ outdir: process.argv[2] })
  const total = uploadSize(result)
  const kib = (n: number) => `${(n / 1024).toFixed(1)} KiB`
  const report = {
    script: result.script,
    wasm: result.wasm,
    bytes: total.bytes,
    gzipBytes: total.gzipBytes,
    limitGzipBytes: FREE_PLAN_GZIP_LIMIT,
  }
  writeFileSync(join(dirname(result.script), 'size.json'), `${JSON.stringify(report, null, 2)}\n`)
  console.log(
    `worker bundle: ${kib(total.bytes)} raw, ${kib(total.gzipBytes)} gzip ` +
      `(free plan limit ${kib(FREE_PLAN_GZIP_LIMIT)} gzip; ${result.wasm.length} wasm module(s))`,
  )
  if (total.gzipBytes >= FREE_PLAN_GZIP_LIMIT) process.exitCode = 1
}
