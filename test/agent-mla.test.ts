// MLA engines through the agent as latent chunks (docs/vllm.md, "Tensor parallelism and MLA"):
// engine A saves [num_blocks, block_size, latent] blocks over host shared memory, a cold
// agent's engine B loads them into other blocks through the gateway with every codec (per-layer
// `?layers=` reads, calibrated kvgate) or from L2; the stored objects are latent chunks; a TP-2
// engine's ranks share one copy; an MLA chunk stored the old way (split slab) is never served.

import { createHash, randomBytes } from 'node:crypto'
import { mkdtempSync, readdirSync, readFileSync, rmSync, statSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { type AgentServer, resolveAgentConfig, startAgent } from '../src/agent/index.ts'
import { keyTag, type SpaceDescriptor } from '../src/agent/space.ts'
import type { RemoteOptions } from '../src/client/config.ts'
import { encodeChunk } from '../src/codec/node.ts'
import { latentTarget } from '../src/codec/params.ts'
import { crc32 } from '../src/core/checksum.ts'
import { decodeHeader } from '../src/core/format.ts'
import { fromHex, namespaceId } from '../src/core/keys.ts'
import type { KvGeometry } from '../src/core/layout.ts'
import { createGateway, hashToken, MemoryStore } from '../src/gateway/index.ts'
import { type RunningGateway, serveGateway } from '../src/gateway/node.ts'
import { gaussian, rng, tensorOf, valuesOf } from './codec-fixtures.ts'
import { AgentClient, type Msg } from './support/agent-client.ts'

const LAYERS = 3
const LATENT = 64
const BLOCK = 16
const CHUNK = 32
const NUM_BLOCKS = 12
const BB = BLOCK * LATENT * 2 // one block's latent run (fp16)
const LAYER_BYTES = NUM_BLOCKS * BB
const SHAPE = [NUM_BLOCKS, BLOCK, LATENT]
const TOKEN = 'tok-mla'
const NS = 'mla'
const STORED: KvGeometry = { layers: LAYERS, kvHeads: 1, headDim: LATENT, dtype: 'fp16', latent: true }

let dir: string
let store: MemoryStore
let gw: RunningGateway
const agents: AgentServer[] = []

beforeAll(async () => {
  dir = mkdtempSync(join(tmpdir(), 'kvgate-agent-mla-'))
  store = new MemoryStore()
  const app = createGateway({
    store,
    auth: { tokens: [{ name: 'a', sha256: await hashToken(TOKEN), namespaces: [NS], scopes: 'write' }] },
  })
  gw = await serveGateway(app, { port: 0 })
})

afterAll(async () => {
  for (const a of agents) await a.close()
  await gw?.close(100)
  rmSync(dir, { recursive: true, force: true })
})

let agentCount = 0
async function agent(
  remote: Partial<RemoteOptions> | false,
  extra: { disk?: string; layersPerRequest?: number; codecWorkers?: number | undefined } = {},
): Promise<string> {
  const socket = join(dir, `a${agentCount++}.sock`)
  const cfg = resolveAgentConfig({ socket, chunkTokens: CHUNK }, { KVGATE_MEMORY_BYTES: '4MiB' })
  cfg.cache = {
    ...cfg.cache,
    namespace: NS,
    codecWorkers: extra.codecWorkers ?? 0,
    disk: extra.disk ? { dir: extra.disk, bytes: 1 << 26, storeAs: 'lossless' } : false,
    remote: remote === false ? false : { url: gw.url, token: TOKEN, ...remote },
    ...(extra.layersPerRequest ? { layersPerRequest: extra.layersPerRequest } : {}),
  }
  agents.push(await startAgent(cfg, 'test'))
  return socket
}

/** Smooth latent values (per-channel offsets, token locality): something a lossy codec can code. */
function latentFile(seed: number): Buffer {
  const n = gaussian(rng(seed))
  const v = new Float32Array(LAYERS * NUM_BLOCKS * BLOCK * LATENT)
  const x = new Float64Array(LATENT)
  for (let row = 0; row < v.length / LATENT; row++)
    for (let ch = 0; ch < LATENT; ch++) {
      x[ch] = 0.8 * x[ch]! + 0.6 * n()
      v[row * LATENT + ch] = (ch % 7 === 2 ? 1.5 : 0) + (ch >= 48 ? 2 : 0.5) * x[ch]!
    }
  return Buffer.from(tensorOf(v, 'fp16'))
}

async function engine(socket: string, name: string, fill: number | undefined, rank = 0, world = 1) {
  const path = join(dir, name)
  writeFileSync(path, fill === undefined ? Buffer.alloc(LAYERS * LAYER_BYTES) : latentFile(fill))
  const c = await AgentClient.open(socket)
  const hello = await c.call('hello', {
    protocol: 1,
    model: 'test/mla',
    hashSeed: '0',
    geometry: { layout: 'mla', dtype: 'float16', layers: LAYERS, headSize: LATENT, blockSize: BLOCK, world },
  })
  expect(hello).toMatchObject({ ok: true, blocksPerChunk: 2 })
  const tensors = Array.from({ length: LAYERS }, (_, l) => ({
    kind: 'shm',
    path,
    offset: l * LAYER_BYTES,
    shape: SHAPE,
  }))
  const r = await c.call('register', { rank, numBlocks: NUM_BLOCKS, tensors })
  expect(r.ok).toBe(true)
  return { c, path, worker: r.worker as number }
}

/** Block b's latent run in layer l of an engine file. */
const blockAt = (buf: Buffer, l: number, b: number) =>
  buf.subarray(l * LAYER_BYTES + b * BB, l * LAYER_BYTES + (b + 1) * BB)

/** Gathers blocks `ids` of every layer as f32 values ([layer][block][token][latent]). */
function gather(buf: Buffer, ids: number[]): Float32Array {
  const parts: Buffer[] = []
  for (let l = 0; l < LAYERS; l++) for (const b of ids) parts.push(blockAt(buf, l, b))
  return valuesOf(new Uint8Array(Buffer.concat(parts)), 'fp16')
}

/** RMS error over the channel-centred RMS, per layer-block group (the latent budget's reference). */
function centredError(a: Float32Array, b: Float32Array): number {
  const rows = a.length / LATENT
  let se = 0
  let ss = 0
  for (let ch = 0; ch < LATENT; ch++) {
    let m = 0
    for (let r = 0; r < rows; r++) m += a[r * LATENT + ch]! / rows
    for (let r = 0; r < rows; r++) {
      se += (a[r * LATENT + ch]! - b[r * LATENT + ch]!) ** 2
      ss += (a[r * LATENT + ch]! - m) ** 2
    }
  }
  return Math.sqrt(se / ss)
}

async function gatewayObjects(): Promise<Map<string, Uint8Array>> {
  const out = new Map<string, Uint8Array>()
  for (const e of (await store.list('')).entries) {
    if (!/\/[0-9a-f]{2}\/[0-9a-f]{64}$/.test(e.name)) continue // chunks, not calibrations
    const o = await store.get(e.name)
    out.set(e.name, new Uint8Array(await new Response(o!.body).arrayBuffer()))
  }
  return out
}

/** What the agent derives for `hash` under key tag `tag` (space.ts). */
const keyFor = (hash: Uint8Array, tag: Uint8Array) =>
  new Uint8Array(createHash('sha256').update(hash).update(tag).digest())

describe('MLA engines store latent chunks', () => {
  const cases: {
    name: string
    remote: Partial<RemoteOptions>
    exact: boolean
    layersPerRequest?: number
    codecWorkers?: number
  }[] = [
    { name: 'raw', remote: { codec: 'raw' }, exact: true },
    {
      name: 'lossless, one layer per request',
      remote: { codec: 'lossless' },
      exact: true,
      layersPerRequest: 1,
    },
    { name: 'kvgate', remote: { codec: 'kvgate', calibration: false }, exact: false },
    { name: 'kvgate calibrated', remote: { codec: 'kvgate', calibration: { after: 1 } }, exact: false },
    {
      name: 'kvgate calibrated in a codec worker thread',
      remote: { codec: 'kvgate', calibration: { after: 1 } },
      exact: false,
      codecWorkers: 1,
    },
  ]
  for (const [i, k] of cases.entries()) {
    it(`${k.name}: engine B (cold agent) loads engine A's saved blocks through the gateway`, async () => {
      const before = new Set((await gatewayObjects()).keys())
      const a = await engine(await agent(k.remote, { codecWorkers: k.codecWorkers }), `a-${i}`, 10 + i)
      const keys = [randomBytes(32), randomBytes(32)]
      const src = [7, 2, 9, 0]
      // The calibrated case saves a first chunk alone: its store builds and publishes the
      // namespace's latent calibration, which the second chunk is then coded with.
      if (k.remote.calibration) {
        expect(
          await a.c.call('save', { worker: a.worker, keys: keys.slice(0, 1), blockIds: src.slice(0, 2) }),
        ).toMatchObject({ ok: true, stored: 1 })
        expect(await a.c.call('flush', {})).toMatchObject({ ok: true })
        // Building and publishing (or fetching) it is in the background: wait until the space holds it.
        const end = Date.now() + 20_000
        for (;;) {
          const st = (await a.c.call('stats', { spaces: true })) as {
            spaceStats: { cache: { calibration?: { current?: string; won: number; fetched: number } } }[]
          }
          const cal = st.spaceStats[0]?.cache.calibration
          if (cal?.current && cal.won + cal.fetched > 0) break
          if (Date.now() > end) throw new Error(`no calibration: ${JSON.stringify(cal)}`)
          await new Promise((r) => setTimeout(r, 20))
        }
      }
      expect(await a.c.call('save', { worker: a.worker, keys, blockIds: src })).toMatchObject({
        ok: true,
        chunks: 2,
      })
      expect(await a.c.call('flush', {})).toMatchObject({ ok: true })
      // What reached the gateway: latent chunks (one latent plane per layer, no V).
      const fresh = [...(await gatewayObjects()).entries()].filter(([n]) => !before.has(n))
      expect(fresh.length).toBe(2)
      const headers = fresh.map(([, b]) => decodeHeader(b))
      for (const h of headers) {
        expect(h.geometry).toEqual(STORED)
        expect(h.codec).toBe(k.remote.codec)
      }
      if (k.remote.calibration) expect(headers.some((h) => h.calibration !== undefined)).toBe(true)

      const b = await engine(
        await agent(k.remote, { layersPerRequest: k.layersPerRequest, codecWorkers: k.codecWorkers }),
        `b-${i}`,
        undefined,
      )
      expect(await b.c.call('lookup', { keys })).toMatchObject({ chunks: 2, tokens: 64 })
      const dst = [1, 11, 4, 5]
      const loaded = await b.c.call('load', { worker: b.worker, keys, blockIds: dst })
      expect(loaded).toMatchObject({ ok: true, chunks: 2, failedBlocks: [] })
      const A = readFileSync(a.path)
      const B = readFileSync(b.path)
      if (k.exact) {
        for (let l = 0; l < LAYERS; l++)
          for (let j = 0; j < 4; j++) expect(blockAt(B, l, dst[j]!).equals(blockAt(A, l, src[j]!))).toBe(true)
      } else {
        const err = centredError(gather(A, src), gather(B, dst))
        expect(err).toBeGreaterThan(0)
        expect(err).toBeLessThan(1.5 * latentTarget(5))
      }
      expect(blockAt(B, 0, 3).every((x) => x === 0)).toBe(true)
      a.c.close()
      b.c.close()
    })
  }

  it('L2: latent chunks stored losslessly on disk load back exact after the agent restarts', async () => {
    const l2 = join(dir, 'l2')
    const a = await engine(await agent(false, { disk: l2 }), 'l2-a', 30)
    const keys = [randomBytes(32)]
    expect(await a.c.call('save', { worker: a.worker, keys, blockIds: [5, 6] })).toMatchObject({ stored: 1 })
    expect(await a.c.call('flush', {})).toMatchObject({ ok: true })
    a.c.close()
    await agents.pop()!.close()
    const files: string[] = []
    const walk = (d: string) => {
      for (const n of readdirSync(d)) {
        const p = join(d, n)
        if (statSync(p).isDirectory()) walk(p)
        else files.push(p)
      }
    }
    walk(l2)
    const chunks = files.filter((f) => readFileSync(f).subarray(0, 4).toString('latin1') === 'KVGC')
    expect(chunks.length).toBe(1)
    const h = decodeHeader(new Uint8Array(readFileSync(chunks[0]!)))
    expect(h).toMatchObject({ geometry: STORED, codec: 'lossless' })
    const b = await engine(await agent(false, { disk: l2 }), 'l2-b', undefined)
    expect(await b.c.call('load', { worker: b.worker, keys, blockIds: [0, 9] })).toMatchObject({
      chunks: 1,
      failedBlocks: [],
    })
    const A = readFileSync(a.path)
    const B = readFileSync(b.path)
    for (let l = 0; l < LAYERS; l++) {
      expect(blockAt(B, l, 0).equals(blockAt(A, l, 5))).toBe(true)
      expect(blockAt(B, l, 9).equals(blockAt(A, l, 6))).toBe(true)
    }
    b.c.close()
  })

  it('TP 2: one copy is stored, and both ranks of another engine load it', async () => {
    const before = new Set((await gatewayObjects()).keys())
    const sockA = await agent({ codec: 'lossless' })
    // MLA's latent is replicated on every rank: both ranks hold the same bytes.
    const a0 = await engine(sockA, 'tp-a0', 40, 0, 2)
    const a1 = await engine(sockA, 'tp-a1', 40, 1, 2)
    const keys = [randomBytes(32), randomBytes(32)]
    const src = [3, 8, 10, 1]
    expect(await a0.c.call('save', { worker: a0.worker, keys, blockIds: src })).toMatchObject({ stored: 2 })
    // The other rank's save finds the one copy already there.
    expect(await a1.c.call('save', { worker: a1.worker, keys, blockIds: src })).toMatchObject({ stored: 0 })
    expect(await a0.c.call('flush', {})).toMatchObject({ ok: true })
    const fresh = [...(await gatewayObjects()).entries()].filter(([n]) => !before.has(n))
    expect(fresh.length).toBe(2)
    for (const [, o] of fresh) expect(decodeHeader(o).geometry).toEqual(STORED)
    expect(await a0.c.call('stats', {})).toMatchObject({ spaces: 1 })

    const sockB = await agent({ codec: 'lossless' })
    const b0 = await engine(sockB, 'tp-b0', undefined, 0, 2)
    const b1 = await engine(sockB, 'tp-b1', undefined, 1, 2)
    expect(await b0.c.call('lookup', { keys })).toMatchObject({ chunks: 2 })
    const dst0 = [0, 2, 4, 6]
    const dst1 = [11, 9, 7, 5]
    const [l0, l1] = await Promise.all([
      b0.c.call('load', { worker: b0.worker, keys, blockIds: dst0 }),
      b1.c.call('load', { worker: b1.worker, keys, blockIds: dst1 }),
    ])
    expect(l0).toMatchObject({ chunks: 2, failedBlocks: [] })
    expect(l1).toMatchObject({ chunks: 2, failedBlocks: [] })
    expect(await b0.c.call('stats', {})).toMatchObject({ spaces: 1 })
    const A = readFileSync(a0.path)
    const B0 = readFileSync(b0.path)
    const B1 = readFileSync(b1.path)
    for (let l = 0; l < LAYERS; l++)
      for (let j = 0; j < 4; j++) {
        expect(blockAt(B0, l, dst0[j]!).equals(blockAt(A, l, src[j]!))).toBe(true)
        expect(blockAt(B1, l, dst1[j]!).equals(blockAt(A, l, src[j]!))).toBe(true)
      }
    for (const e of [a0, a1, b0, b1]) e.c.close()
  })

  it('the gateway refuses a latent header with more than one kv head (CRC fixed) as a bad field', async () => {
    const key = randomBytes(32)
    const obj = encodeChunk(
      new Uint8Array(LAYERS * CHUNK * LATENT * 2),
      {
        geometry: { ...STORED, latent: false, kvHeads: 2, headDim: LATENT / 4 },
        tokens: CHUNK,
        chunkIndex: 0,
        partial: false,
        namespaceId: new Uint8Array(16),
        chainKey: key,
        parentKey: new Uint8Array(32),
      },
      { mode: 'raw' },
    )
    const dv = new DataView(obj.buffer, obj.byteOffset)
    dv.setUint16(6, 2, true) // flags: latent
    const hb = dv.getUint32(8, true)
    dv.setUint32(hb - 4, crc32(obj.subarray(0, hb - 4)), true)
    const res = await fetch(`${gw.url}/v1/ns/${NS}/chunks/${Buffer.from(key).toString('hex')}`, {
      method: 'PUT',
      headers: { authorization: `Bearer ${TOKEN}`, 'content-type': 'application/octet-stream' },
      body: Buffer.from(obj),
    })
    expect(res.status).toBe(400)
    expect(await res.text()).toContain('ERR_FORMAT_BAD_FIELD')
    const hex = Buffer.from(key).toString('hex')
    expect([...(await gatewayObjects()).keys()].some((n) => n.endsWith(hex))).toBe(false)
  })

  it('an MLA chunk stored the old way (split slab) is a miss: never looked up, never served', async () => {
    const d: SpaceDescriptor = {
      model: 'test/mla',
      layout: 'mla',
      dtype: 'fp16',
      layers: LAYERS,
      kvHeads: 1,
      headSize: LATENT,
      blockSize: BLOCK,
      world: 1,
      hashSeed: '0',
    }
    // The split-slab geometry the previous builds stored MLA chunks with.
    const split: KvGeometry = { layers: LAYERS, kvHeads: 1, headDim: LATENT / 2, dtype: 'fp16' }
    const nsOf = (geometry: KvGeometry) =>
      fromHex(
        namespaceId({
          modelId: 'test/mla',
          geometry,
          chunkTokens: CHUNK,
          scheme: 'vllm-sha256-cbor',
          hashSeed: '0',
        }),
      )
    const oldTag = new TextEncoder().encode('kvgate:vllm:v1\0test/mla\0')
    expect(Buffer.from(keyTag(d, null)).equals(Buffer.from(oldTag))).toBe(false)
    const hashes = [randomBytes(32), randomBytes(32)]
    const put = async (key: Uint8Array, namespace: Uint8Array) => {
      const obj = encodeChunk(
        new Uint8Array(latentFile(50).subarray(0, LAYERS * CHUNK * LATENT * 2)),
        {
          geometry: split,
          tokens: CHUNK,
          chunkIndex: 0,
          partial: false,
          namespaceId: namespace,
          chainKey: key,
          parentKey: new Uint8Array(32),
        },
        { mode: 'lossless' },
      )
      const hex = Buffer.from(key).toString('hex')
      const res = await fetch(`${gw.url}/v1/ns/${NS}/chunks/${hex}`, {
        method: 'PUT',
        headers: { authorization: `Bearer ${TOKEN}`, 'content-type': 'application/octet-stream' },
        body: Buffer.from(obj),
      })
      expect(res.status).toBeLessThan(300)
    }
    // Under the old key tag, as the old build wrote it; and (a forgery, or a collision) under
    // the new key with the new namespace id: only the header's geometry tells it apart.
    await put(keyFor(hashes[0]!, oldTag), nsOf(split))
    await put(keyFor(hashes[1]!, keyTag(d, null)), nsOf(STORED))
    const b = await engine(await agent({ codec: 'lossless' }), 'old-b', undefined)
    expect(await b.c.call('lookup', { keys: [hashes[0]] })).toMatchObject({ chunks: 0 })
    const load = await b.c.call('load', { worker: b.worker, keys: [hashes[1]], blockIds: [4, 5] })
    expect(load).toMatchObject({ ok: true, chunks: 0, failedBlocks: [4, 5] })
    expect(readFileSync(b.path).every((x) => x === 0)).toBe(true)
    // Refused by its header (counted corrupt), not merely absent.
    const st = (await b.c.call('stats', { spaces: true })) as { spaceStats: { cache: { remote: Msg } }[] }
    expect(st.spaceStats[0]!.cache.remote.corrupt).toBeGreaterThanOrEqual(1)
    b.c.close()
  })
})
