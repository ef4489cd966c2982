// The app is runtime-neutral: bundled for a neutral platform (no node: imports
// besides lru-cache's optional diagnostics channel) it serves the API in real
// workerd through Miniflare, with the memory store.

import { mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { build } from 'esbuild'
import { Miniflare } from 'miniflare'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { makeChunk, putInit } from './gateway-fixtures.ts'

const dir = mkdtempSync(join(tmpdir(), 'kvgate-workerd-'))
let mf: Miniflare

beforeAll(async () => {
  const entry = join(dir, 'entry.ts')
  const gateway = new URL('../src/gateway/index.ts', import.meta.url).pathname
  writeFileSync(
    entry,
    `import { createGateway, MemoryStore } from ${JSON.stringify(gateway)}
const app = createGateway({ store: new MemoryStore() })
export default { fetch: (req, env, ctx) => app.fetch(req, env, ctx) }
`,
  )
  const out = await build({
    entryPoints: [entry],
    bundle: true,
    platform: 'neutral',
    format: 'esm',
    mainFields: ['module', 'main'],
    external: ['node:*'],
    write: false,
    logLevel: 'silent',
  })
  const code = out.outputFiles[0]!.text
  // No node: imports, only lru-cache's optional, caught dynamic one (core probes
  // node:zlib / node:crypto through a guarded process.getBuiltinModule, not an import).
  const imports = code.match(/(?:from\s*|import\s*\(\s*)["']node:[a-z_/]+["']/g) ?? []
  expect(imports).toEqual(['import("node:diagnostics_channel"'])
  writeFileSync(join(dir, 'worker.mjs'), code)
  mf = new Miniflare({
    modules: true,
    scriptPath: join(dir, 'worker.mjs'),
    modulesRoot: dir,
    compatibilityDate: '2025-01-01',
    compatibilityFlags: ['nodejs_compat'],
  })
})

afterAll(async () => {
  await mf?.dispose()
  rmSync(dir, { recursive: true, force: true })
})

describe('gateway in workerd', () => {
  it('stores, serves layers, verifies and looks up', async () => {
    const c = makeChunk({ layers: 4, sectionBytes: 1024 })
    const put = await mf.dispatchFetch(`http://gw/v1/ns/a/chunks/${c.key}`, putInit(c.bytes) as never)
    expect(put.status).toBe(201)
    const layers = await mf.dispatchFetch(`http://gw/v1/ns/a/chunks/${c.key}?layers=1-2`)
    expect(layers.status).toBe(200)
    expect(layers.headers.get('x-kvgate-layers')).toBe('1-2')
    await layers.arrayBuffer()
    const other = makeChunk({ layers: 4, sectionBytes: 1024 })
    const otherBad = other.bytes.slice()
    otherBad[otherBad.length - 1]! ^= 1
    const rejected = await mf.dispatchFetch(
      `http://gw/v1/ns/a/chunks/${other.key}`,
      putInit(otherBad) as never,
    )
    expect(rejected.status).toBe(400)
    expect(((await rejected.json()) as { error: { code: string } }).error.code).toBe('ERR_FORMAT_CHECKSUM')
    const look = await mf.dispatchFetch('http://gw/v1/ns/a/lookup', {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ keys: [c.key, other.key], sizes: true }),
    })
    expect(await look.json()).toEqual({ present: 1, sizes: [c.bytes.length] })
  })
})
