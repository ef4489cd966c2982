// Builds the AWS Lambda package: the gateway's Lambda adapter bundled with esbuild
// into index.mjs, plus the codec .wasm, in a byte-reproducible zip (fixed times, sorted).

import { createHash } from 'node:crypto'
import { existsSync, mkdirSync, readFileSync, writeFileSync } from 'node:fs'
import { dirname, join, resolve } from 'node:path'
import { fileURLToPath } from 'node:url'
import { crc32, deflateRawSync } from 'node:zlib'
import { build } from 'esbuild'

const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), '..')

/** Lambda refuses direct uploads above 50 MB zipped (250 MB unzipped). */
export const LAMBDA_DIRECT_UPLOAD_LIMIT = 50 * 1000 * 1000

export interface ZipEntry {
  name: string
  data: Uint8Array
}

// 1980-01-01 00:00:00, the earliest DOS timestamp: the same bytes on every build.
const DOS_TIME = 0
const DOS_DATE = (0 << 9) | (1 << 5) | 1
const UNIX_FILE_0644 = (0o100644 << 16) >>> 0
const UTF8_NAMES = 0x0800

/**
 * A minimal zip writer (stored or deflated entries, no extra fields) whose output
 * depends only on the entries: names sorted, timestamps fixed, mode 0644.
 */
export function writeZip(entries: readonly ZipEntry[]): Uint8Array {
  const sorted = [...entries].sort((a, b) => (a.name < b.name ? -1 : a.name > b.name ? 1 : 0))
  const seen = new Set<string>()
  const locals: Buffer[] = []
  const centrals: Buffer[] = []
  let offset = 0
  for (const e of sorted) {
    if (seen.has(e.name)) throw new Error(`duplicate zip entry ${e.name}`)
    if (e.name === '' || e.name.startsWith('/') || e.name.split('/').includes('..')) {
      throw new Error(`bad zip entry name ${JSON.stringify(e.name)}`)
    }
    seen.add(e.name)
    const name = Buffer.from(e.name, 'utf8')
    const crc = crc32(e.data)
    const deflated = deflateRawSync(e.data, { level: 9 })
    // Store when deflate does not pay (already-compressed data, tiny files).
    const method = deflated.length < e.data.length ? 8 : 0
    const body = method === 8 ? deflated : Buffer.from(e.data)
    if (body.length >= 0xffffffff || offset >= 0xffffffff) throw new Error('zip64 is not supported')

    const local = Buffer.alloc(30)
    local.writeUInt32LE(0x04034b50, 0)
    local.writeUInt16LE(20, 4) // version needed: 2.0 (deflate)
    local.writeUInt16LE(UTF8_NAMES, 6)
    local.writeUInt16LE(method, 8)
    local.writeUInt16LE(DOS_TIME, 10)
    local.writeUInt16LE(DOS_DATE, 12)
    local.writeUInt32LE(crc, 14)
    local.writeUInt32LE(body.length, 18)
    local.writeUInt32LE(e.data.length, 22)
    local.writeUInt16LE(name.length, 26)
    local.writeUInt16LE(0, 28)
    locals.push(local, name, body)

    const central = Buffer.alloc(46)
    central.writeUInt32LE(0x02014b50, 0)
    central.writeUInt16LE((3 << 8) | 20, 4) // made by: Unix, zip 2.0 (so the mode bits count)
    central.writeUInt16LE(20, 6)
    central.writeUInt16LE(UTF8_NAMES, 8)
    central.writeUInt16LE(method, 10)
    central.writeUInt16LE(DOS_TIME, 12)
    central.writeUInt16LE(DOS_DATE, 14)
    central.writeUInt32LE(crc, 16)
    central.writeUInt32LE(body.length, 20)
    central.writeUInt32LE(e.data.length, 24)
    central.writeUInt16LE(name.length, 28)
    central.writeUInt32LE(UNIX_FILE_0644, 38)
    central.writeUInt32LE(offset, 42)
    centrals.push(central, name)

    offset += local.length + name.length + body.length
  }
  const cd = Buffer.concat(centrals)
  const end = Buffer.alloc(22)
  end.writeUInt32LE(0x06054b50, 0)
  end.writeUInt16LE(sorted.length, 8)
  end.writeUInt16LE(sorted.length, 10)
  end.writeUInt32LE(cd.length, 12)
  end.writeUInt32LE(offset, 16)
  return Buffer.concat([...locals, cd, end])
}

export interface LambdaBuildOptions {
  /** Entry module. @default src/gateway/adapters/lambda.ts */
  entry?: string
  /** Output zip. @default dist/lambda/kvgate-gateway.zip */
  out?: string
  /** The codec module shipped beside index.mjs when it exists. @default wasm/kvgate_codec.wasm */
  wasm?: string
  minify?: boolean
}

export interface LambdaBuild {
  zip: string
  bytes: number
  sha256: string
  entries: { name: string; bytes: number }[]
}

export async function buildLambda(opts: LambdaBuildOptions = {}): Promise<LambdaBuild> {
  const entry = resolve(ROOT, opts.entry ?? 'src/gateway/adapters/lambda.ts')
  const out = resolve(ROOT, opts.out ?? 'dist/lambda/kvgate-gateway.zip')
  const result = await build({
    entryPoints: [entry],
    bundle: true,
    write: false,
    outfile: 'index.mjs',
    format: 'esm',
    platform: 'node',
    target: 'node22',
    mainFields: ['module', 'main'],
    minify: opts.minify ?? true,
    // Names kept: stack traces in CloudWatch stay readable without a source map.
    keepNames: true,
    legalComments: 'none',
    logLevel: 'warning',
    // Bundled CommonJS dependencies may still call require() for Node builtins.
    banner: {
      js: "import { createRequire as __kvgateCreateRequire } from 'node:module'; const require = __kvgateCreateRequire(import.meta.url);",
    },
  })
  const js = result.outputFiles.find((f) => f.path.endsWith('index.mjs'))
  if (!js) throw new Error('esbuild produced no index.mjs')
  const entries: ZipEntry[] = [{ name: 'index.mjs', data: js.contents }]
  const wasm = resolve(ROOT, opts.wasm ?? 'wasm/kvgate_codec.wasm')
  if (existsSync(wasm)) entries.push({ name: 'kvgate_codec.wasm', data: readFileSync(wasm) })
  const zip = writeZip(entries)
  mkdirSync(dirname(out), { recursive: true })
  writeFileSync(out, zip)
  return {
    zip: out,
    bytes: zip.length,
    sha256: createHash('sha256').update(zip).digest('hex'),
    entries: entries.map((e) => ({ name: e.name, bytes: e.data.length })),
  }
}

if (process.argv[1] && resolve(process.argv[1]) === fileURLToPath(import.meta.url)) {
  const r = await buildLambda({ out: process.argv[2] })
  const listing = r.entries.map((e) => `${e.name} ${(e.bytes / 1024).toFixed(1)} KiB`).join(', ')
  console.log(`lambda zip: ${r.zip} ${(r.bytes / 1024).toFixed(1)} KiB (${listing}) sha256 ${r.sha256}`)
  if (r.bytes >= LAMBDA_DIRECT_UPLOAD_LIMIT) process.exitCode = 1
  writeFileSync(join(dirname(r.zip), 'size.json'), `${JSON.stringify(r, null, 2)}\n`)
}
