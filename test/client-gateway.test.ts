// The client against the real gateway app: a memory store for the normal
// paths (codecs, layer ranges, auth), and RadosGW behind the S3 store for
// several processes storing one prefix plus presigned 307 reads.

import { spawn } from 'node:child_process'
import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest'
import { KVCache, type KVCacheOptions } from '../src/client/index.ts'
import { decodeChunk, encodeChunk } from '../src/codec/node.ts'
import { fromHex, type KeyNamespace, namespaceId } from '../src/core/keys.ts'
import { chunkBytes, layerSlabBytes, MODEL_PRESETS } from '../src/core/layout.ts'
import { createGateway, hashToken, MemoryStore } from '../src/gateway/index.ts'
import { type RunningGateway, S3Store, serveGateway } from '../src/gateway/node.ts'
import { promptTokens, tensorFor } from './support/client-child.ts'
import { expectLayersAsStored } from './support/layers.ts'
import { type Rgw, useRgw } from './support/rgw.ts'

const g = MODEL_PRESETS.stories260k
const T = 64
const CB = chunkBytes(g, T)
const TOKEN = 'tok-team-a'
const sum = (m: Uint8Array) => m.reduce((a, b) => a + b, 0)

/** Realistic-ish fp16 KV (smooth values) so the lossy codec has something to work with. */
function kvFor(chunks: number, seed: number): Uint8Array {
  const out = new Uint8Array(chunks * CB)
  const dv = new DataView(out.buffer)
  for (let i = 0; i < out.length / 2; i++) {
    const x = Math.sin(i * 0.013 + seed) * 0.5 + Math.cos(i * 0.0007) * 0.25
    // fp16 bits for |x| < 1 via a float32 round trip is enough for test data.
    const f = new Float32Array([x])
    const b = new Uint32Array(f.buffer)[0]!
    const sign = (b >>> 16) & 0x8000
    const exp = ((b >>> 23) & 0xff) - 127 + 15
    const h = exp <= 0 ? sign : sign | (exp << 10) | ((b >>> 13) & 0x3ff)
    dv.setUint16(2 * i, h, true)
  }
  return out
}

let gw: RunningGateway
const caches: KVCache[] = []
const dirs: string[] = []

beforeAll(async () => {
  const app = createGateway({
    store: new MemoryStore(),
    auth: {
      tokens: [{ name: 'a', sha256: await hashToken(TOKEN), namespaces: ['team-a'], scopes: 'write' }],
    },
  })
  gw = await serveGateway(app, { port: 0 })
})
afterAll(async () => {
  await gw.close(100)
})
afterEach(async () => {
  // Every test ends with every L1 reservation and pin settled (background writes included).
  for (const c of caches) {
    await c.flush(10_000)
    const m = c.stats().memory
    expect({ reservations: m.liveReservations, pins: m.livePins }).toEqual({ reservations: 0, pins: 0 })
  }
  for (const c of caches.splice(0)) await c.close(100)
  for (const d of dirs.splice(0)) rmSync(d, { recursive: true, force: true })
})

async function node(
  remote: Partial<NonNullable<Exclude<KVCacheOptions['remote'], false>>> = {},
  disk = false,
) {
  const dir = mkdtempSync(join(tmpdir(), 'kvgate-gwnode-'))
  dirs.push(dir)
  const c = await KVCache.open({
    model: 'stories260k',
    chunkTokens: T,
    namespace: 'team-a',
    memory: { bytes: 16 * CB },
    disk: disk ? { dir, bytes: 1 << 26 } : false,
    remote: { url: gw.url, token: TOKEN, ...remote },
  })
  caches.push(c)
  return c
}

describe('client ↔ gateway app (memory store)', () => {
  it('lossless: a second node with its own L1/L2 gets the exact bytes, then serves them locally', async () => {
    const a = await node({ codec: 'lossless' })
    const toks = promptTokens(3, 21)
    const kv = kvFor(3, 21)
    await a.store(toks, kv)
    await a.flush()
    expect(a.stats().remote?.puts).toBe(3)
    const b = await node({ codec: 'lossless' }, true)
    expect((await b.lookup(toks)).chunks.map((c) => c.tier)).toEqual(['remote', 'remote', 'remote'])
    const into = new Uint8Array(3 * CB)
    expect(sum(await b.retrieve(toks, { into }))).toBe(3 * T)
    expect(Buffer.compare(into, kv)).toBe(0)
    await b.flush()
    expect(b.stats().disk?.files).toBe(3) // L4 hits were written to L2 too
    expect(b.stats().codec.workerJobs).toBeGreaterThan(0) // decoded off the calling thread
  })

  it('kvgate (lossy) on the wire: the reader gets exactly what the codec decodes, smaller than raw', async () => {
    const a = await node({ codec: 'kvgate' })
    const toks = promptTokens(2, 22)
    const kv = kvFor(2, 22)
    await a.store(toks, kv)
    await a.flush()
    const sent = a.stats().remote!.bytesWritten
    expect(sent).toBeLessThan(2 * CB)
    const b = await node({ codec: 'kvgate' })
    const into = new Uint8Array(2 * CB)
    expect(sum(await b.retrieve(toks, { into }))).toBe(2 * T)
    // Expected: encode + decode of each chunk with the same identity.
    const ns: KeyNamespace = { modelId: g.modelId, geometry: g, chunkTokens: T }
    const keys = b.keys(toks)
    for (let i = 0; i < 2; i++) {
      const k = keys[i]!
      const obj = encodeChunk(
        kv.subarray(i * CB, (i + 1) * CB),
        {
          geometry: g,
          tokens: T,
          chunkIndex: i,
          partial: false,
          namespaceId: fromHex(namespaceId(ns)),
          chainKey: k.key,
          parentKey: fromHex(k.parentHex),
        },
        { mode: 'kvgate' },
      )
      expect(Buffer.compare(into.subarray(i * CB, (i + 1) * CB), decodeChunk(obj))).toBe(0)
    }
    expect(Buffer.compare(into, kv)).not.toBe(0) // it is lossy
  })

  it('retrieveLayers pulls layer ranges from the gateway', async () => {
    const a = await node({ codec: 'raw' })
    const toks = promptTokens(2, 23)
    const kv = kvFor(2, 23)
    await a.store(toks, kv)
    await a.flush()
    const b = await node({ codec: 'raw' })
    const slab = layerSlabBytes(g, T)
    const layers = await expectLayersAsStored(b.retrieveLayers(toks), kv, { chunks: 2, chunkBytes: CB, slab })
    expect(layers).toEqual([0, 1, 2, 3, 4])
    expect(b.stats().remote?.hits).toBeGreaterThanOrEqual(4) // one GET per layer group per chunk
  })

  it('a wrong token or another tenant: writes and reads fail quietly, counted', async () => {
    const a = await node({ codec: 'raw', token: 'wrong' })
    const toks = promptTokens(1, 24)
    await a.store(toks, kvFor(1, 24))
    await a.flush()
    expect(a.stats().remote?.puts).toBe(0)
    expect(a.stats().remote?.errors).toBeGreaterThan(0)
    const other = await KVCache.open({
      model: 'stories260k',
      chunkTokens: T,
      namespace: 'team-b',
      memory: { bytes: 4 * CB },
      remote: { url: gw.url, token: TOKEN, codec: 'raw' },
    })
    caches.push(other)
    expect((await other.lookup(toks)).tokens).toBe(0)
  })
})

describe('client ↔ gateway on RadosGW (S3 store)', () => {
  let rgw: Rgw | undefined
  let s3gw: RunningGateway | undefined
  beforeAll(async () => {
    rgw = await useRgw('client on RGW')
    if (!rgw) return
    const store = new S3Store({
      bucket: rgw.bucket,
      endpoint: rgw.endpoint,
      region: rgw.region,
      credentials: { accessKeyId: rgw.accessKeyId, secretAccessKey: rgw.secretAccessKey },
    })
    s3gw = await serveGateway(createGateway({ store, presign: { minBytes: 1 } }), { port: 0 })
  })
  afterAll(async () => {
    await s3gw?.close(100)
    await rgw?.stop()
  })

  it('three processes store one prefix concurrently: one object per chunk; a fourth node reads through 307s', async (ctx) => {
    if (!rgw || !s3gw) {
      ctx.skip()
      return
    }
    const url = s3gw.url
    const child = join(import.meta.dirname, 'support', 'client-child.ts')
    const runs = await Promise.all(
      [0, 1, 2].map(
        () =>
          new Promise<{ code: number | null; out: string; err: string }>((resolve) => {
            const p = spawn(process.execPath, [
              '--import',
              'tsx',
              child,
              'store-prefix',
              JSON.stringify({ url, chunks: 4, seed: 31, lookupTimeoutMs: 10_000 }),
            ])
            let out = ''
            let err = ''
            p.stdout.on('data', (d) => {
              out += String(d)
            })
            p.stderr.on('data', (d) => {
              err += String(d)
            })
            p.on('exit', (code) => resolve({ code, out, err }))
          }),
      ),
    )
    for (const r of runs) expect(r.code, r.err).toBe(0)
    const stats = runs.map(
      (r) => JSON.parse(r.out.trim().split('\n').pop()!) as { puts: number; existed: number; errors: number },
    )
    expect(stats.every((s) => s.errors === 0)).toBe(true)
    // Every chunk acknowledged by every writer that tried; the store holds one copy (create-only).
    const created = stats.reduce((a, s) => a + s.puts - s.existed, 0)
    expect(created).toBe(4)

    const reader = await KVCache.open({
      model: 'stories260k',
      chunkTokens: T,
      namespace: 'shared',
      memory: { bytes: 8 * CB },
      remote: { url, codec: 'raw' },
    })
    try {
      const into = new Uint8Array(4 * CB)
      expect(sum(await reader.retrieve(promptTokens(4, 31), { into }))).toBe(4 * T)
      for (let i = 0; i < 4; i++)
        expect(Buffer.compare(into.subarray(i * CB, (i + 1) * CB), tensorFor(i, 31))).toBe(0)
      expect(reader.stats().remote?.redirects).toBe(4)
    } finally {
      await reader.close()
    }
  })
})
