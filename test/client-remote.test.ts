// L4 through a gateway the test controls: cross-node sharing, layer range
// reads, 307 redirects, and faults (down, slow, 5xx, corrupt bytes, full queue).

import { afterEach, beforeEach, describe, expect, it } from 'vitest'
import { KVCache, type KVCacheOptions } from '../src/client/index.ts'
import { chunkBytes, layerSlabBytes, MODEL_PRESETS } from '../src/core/layout.ts'
import { pattern } from './support/bytes.ts'
import { type FaultGateway, startFaultGateway } from './support/client-fault-gateway.ts'
import { expectLayersAsStored } from './support/layers.ts'

const T = 16
const CB = chunkBytes(MODEL_PRESETS.stories260k, T)

function tokens(n: number, seed = 1): number[] {
  return Array.from({ length: n }, (_, i) => (i * 13 + seed * 101) % 512)
}
function kvFor(chunks: number, seed = 1): Uint8Array {
  return pattern(chunks * CB, seed * 7919)
}
const sum = (m: Uint8Array) => m.reduce((a, b) => a + b, 0)

let gw: FaultGateway
const caches: KVCache[] = []
beforeEach(async () => {
  gw = await startFaultGateway()
})
afterEach(async () => {
  for (const c of caches.splice(0)) await c.close(100)
  await gw.close()
})
async function node(
  remote: Partial<NonNullable<Exclude<KVCacheOptions['remote'], false>>> = {},
): Promise<KVCache> {
  const c = await KVCache.open({
    model: 'stories260k',
    chunkTokens: T,
    namespace: 'team-a',
    memory: { bytes: 32 * CB },
    remote: { url: gw.url, codec: 'raw', token: 'secret', breakerCooldownMs: 50, ...remote },
  })
  caches.push(c)
  return c
}

describe('L4 through the gateway', () => {
  it('a second node retrieves what the first stored, and promotes it into its L1', async () => {
    const a = await node()
    const toks = tokens(3 * T)
    const kv = kvFor(3)
    await a.store(toks, kv)
    await a.flush()
    expect(gw.objects.size).toBe(3)
    expect(gw.requests.some((r) => r.method === 'PUT' && r.auth === 'Bearer secret')).toBe(true)
    expect(gw.requests.every((r) => r.path.startsWith('/v1/ns/team-a/'))).toBe(true)

    const b = await node()
    const lookupPosts = () =>
      gw.requests.filter((r) => r.method === 'POST' && r.path.endsWith('/lookup')).length
    const before = lookupPosts()
    const lk = await b.lookup(toks)
    expect(lk.chunks.map((c) => c.tier)).toEqual(['remote', 'remote', 'remote'])
    const into = new Uint8Array(3 * CB)
    expect(sum(await b.retrieve(toks, { into }))).toBe(3 * T)
    expect(Buffer.compare(into, kv)).toBe(0)
    // lookup → retrieve asks the gateway once: retrieve reuses what the lookup learned.
    expect(lookupPosts() - before).toBe(1)
    expect(b.stats().remote?.lookupRequests).toBe(1)
    expect(b.stats().remote?.lookupKeysKnown).toBe(3)
    expect((await b.lookup(toks)).chunks.every((c) => c.tier === 'memory')).toBe(true)
    expect(b.stats().remote?.hits).toBe(3)
    // L4 read latency is the chunk GETs'; the lookup's round trip is counted apart.
    expect(b.stats().remote?.readLatency.count).toBe(3)
    expect(b.stats().remote?.lookupLatency.count).toBe(1)
    expect(b.metrics()).toMatch(/^kvgate_client_remote_lookup_latency_seconds\{quantile="0.5"\} [0-9.e-]+$/m)

    // Re-storing on b uploads nothing: the gateway holds it.
    const puts = gw.requests.filter((r) => r.method === 'PUT').length
    await b.store(toks, kv)
    await b.flush()
    expect(gw.requests.filter((r) => r.method === 'PUT').length).toBe(puts)
  })

  it('many requests in flight at once: no "possible EventTarget memory leak" warning from the close signal', async () => {
    const a = await node()
    const toks = tokens(16 * T, 33)
    const kv = kvFor(16, 33)
    await a.store(toks, kv)
    await a.flush()
    const warnings: string[] = []
    const onWarning = (w: Error) => warnings.push(`${w.name}: ${w.message}`)
    process.on('warning', onWarning)
    try {
      const b = await KVCache.open({
        model: 'stories260k',
        chunkTokens: T,
        namespace: 'team-a',
        memory: { bytes: 32 * CB },
        fetchConcurrency: 16,
        remote: { url: gw.url, codec: 'raw', token: 'secret' },
      })
      caches.push(b)
      gw.faults.delayMs = 50 // every GET overlaps the others
      const into = new Uint8Array(16 * CB)
      expect(sum(await b.retrieve(toks, { into }))).toBe(16 * T)
      expect(Buffer.compare(into, kv)).toBe(0)
      await new Promise((r) => setImmediate(r)) // warnings are emitted on the next tick
    } finally {
      process.off('warning', onWarning)
    }
    expect(warnings.filter((w) => w.includes('MaxListeners'))).toEqual([])
  })

  it('a partial tail chunk travels through the gateway too', async () => {
    const a = await node()
    const toks = tokens(T + 3, 14)
    const tail = chunkBytes(MODEL_PRESETS.stories260k, 3)
    const kv = kvFor(2, 14).subarray(0, CB + tail)
    await a.store(toks, kv, { includePartial: true })
    await a.flush()
    expect(gw.objects.size).toBe(2)
    const b = await node()
    const into = new Uint8Array(CB + tail)
    expect(sum(await b.retrieve(toks, { into, includePartial: true }))).toBe(T + 3)
    expect(Buffer.compare(into, kv)).toBe(0)
  })

  it('concurrent fetches of one chunk cost one GET', async () => {
    const a = await node()
    const toks = tokens(T, 2)
    await a.store(toks, kvFor(1, 2))
    await a.flush()
    // Lookups get room here: this is about GETs, and a loaded machine can miss the 250 ms prefill deadline.
    const b = await node({ lookupTimeoutMs: 5000 })
    const into = [new Uint8Array(CB), new Uint8Array(CB), new Uint8Array(CB)]
    const masks = await Promise.all(into.map((x) => b.retrieve(toks, { into: x })))
    expect(masks.map(sum)).toEqual([T, T, T])
    expect(gw.requests.filter((r) => r.method === 'GET' && r.path.includes('/chunks/')).length).toBe(1)
  })

  it.each(['raw', 'lossless'] as const)(
    'retrieveLayers reads remote %s chunks with ?layers ranges and yields exact slabs',
    async (codec) => {
      const a = await node({ codec })
      const toks = tokens(2 * T, 3)
      const kv = kvFor(2, 3)
      await a.store(toks, kv)
      await a.flush()
      const b = await node({ codec })
      const slab = layerSlabBytes(MODEL_PRESETS.stories260k, T)
      const layers = await expectLayersAsStored(b.retrieveLayers(toks), kv, {
        chunks: 2,
        chunkBytes: CB,
        slab,
      })
      expect(layers.length).toBe(5)
      const ranged = gw.requests.filter((r) => /\?layers=\d+-\d+$/.test(r.path))
      expect(ranged.length).toBeGreaterThan(2) // several groups per chunk
      expect(b.stats().remote?.layersAnsweredWhole).toBe(0) // each answered as its subset
      // The assembled chunks were promoted into L1.
      expect((await b.lookup(toks)).chunks.every((c) => c.tier === 'memory')).toBe(true)
    },
  )

  it('follows a 307 to a presigned URL without sending the bearer token there', async () => {
    const a = await node()
    const toks = tokens(T, 4)
    await a.store(toks, kvFor(1, 4))
    await a.flush()
    gw.faults.redirect = true
    const b = await node()
    const into = new Uint8Array(CB)
    expect(sum(await b.retrieve(toks, { into }))).toBe(T)
    expect(Buffer.compare(into, kvFor(1, 4))).toBe(0)
    const pre = gw.requests.find((r) => r.path.startsWith('/presigned/'))
    expect(pre?.auth).toBeUndefined()
    expect(b.stats().remote?.redirects).toBe(1)
  })

  it('corrupt bytes from the gateway are never served', async () => {
    const a = await node()
    const toks = tokens(2 * T, 5)
    await a.store(toks, kvFor(2, 5))
    await a.flush()
    gw.faults.corrupt = true
    const b = await node()
    const into = new Uint8Array(2 * CB)
    expect(sum(await b.retrieve(toks, { into }))).toBe(0)
    expect(into.every((x) => x === 0)).toBe(true)
    expect(b.stats().remote?.corrupt).toBeGreaterThanOrEqual(1)
    let yielded = 0
    for await (const batch of b.retrieveLayers(toks)) yielded += batch.chunks
    expect(yielded).toBe(0)
    expect((await b.lookup(toks)).chunks.some((c) => c.tier === 'memory')).toBe(false)
  })

  // A coded object is verified by its decode job (no separate verify): the CRCs must still gate L1.
  it.each([
    ['kvgate', 1],
    ['kvgate', 0],
    ['lossless', 1],
  ] as const)(
    'corrupt %s bytes (%i codec workers) are never served nor made resident',
    async (codec, workers) => {
      const open = async () => {
        const c = await KVCache.open({
          model: 'stories260k',
          chunkTokens: T,
          namespace: 'team-a',
          memory: { bytes: 32 * CB },
          codecWorkers: workers,
          remote: { url: gw.url, codec, token: 'secret', breakerCooldownMs: 50 },
        })
        caches.push(c)
        return c
      }
      const a = await open()
      const toks = tokens(2 * T, 6)
      await a.store(toks, kvFor(2, 6))
      await a.flush()
      gw.faults.corrupt = true
      const b = await open()
      const into = new Uint8Array(2 * CB)
      expect(sum(await b.retrieve(toks, { into }))).toBe(0)
      expect(into.every((x) => x === 0)).toBe(true)
      expect(b.stats().remote?.corrupt).toBeGreaterThanOrEqual(1)
      expect((await b.lookup(toks)).chunks.some((c) => c.tier === 'memory')).toBe(false)
      // The same objects, served intact, decode to what was stored.
      gw.faults.corrupt = false
      expect(sum(await b.retrieve(toks, { into }))).toBe(2 * T)
      if (codec === 'lossless') expect(Buffer.compare(into, kvFor(2, 6))).toBe(0)
    },
  )
})

describe('L4 faults never reach the caller', () => {
  it('gateway down: store and retrieve work from L1, the breaker opens, then closes after recovery', async () => {
    const c = await node({ breakerThreshold: 2, retries: 0 })
    await gw.stop()
    const toks = tokens(3 * T, 6)
    const kv = kvFor(3, 6)
    await c.store(toks, kv)
    await c.flush(2000)
    const into = new Uint8Array(3 * CB)
    expect(sum(await c.retrieve(toks, { into }))).toBe(3 * T)
    expect(Buffer.compare(into, kv)).toBe(0)
    // Unknown prefix: the gateway cannot answer, so nothing is available.
    expect((await c.lookup(tokens(2 * T, 99))).tokens).toBe(0)
    expect((await c.lookup(tokens(2 * T, 98))).tokens).toBe(0)
    const s = c.stats().remote!
    expect(s.breaker).not.toBe('closed')
    expect(s.errors).toBeGreaterThan(0)
    await gw.restart()
    for (let i = 0; i < 100 && c.stats().remote?.breaker !== 'closed'; i++)
      await new Promise((r) => setTimeout(r, 20))
    expect(c.stats().remote?.breaker).toBe('closed')
    expect(c.metrics()).toMatch(/kvgate_client_breaker_open 0/)
  })

  it('a slow gateway costs a lookup at most its deadline and still serves local hits', async () => {
    const c = await node({ lookupTimeoutMs: 50, timeoutMs: 100, retries: 0 })
    const toks = tokens(2 * T, 7)
    await c.store(toks, kvFor(2, 7))
    gw.faults.delayMs = 2000
    const longer = [...toks, ...tokens(2 * T, 8)]
    const lk = await c.lookup(longer)
    expect(lk.tokens).toBe(2 * T)
    expect(c.stats().remote?.timeouts).toBeGreaterThanOrEqual(1)
    const into = new Uint8Array(4 * CB)
    expect(sum(await c.retrieve(longer, { into }))).toBe(2 * T)
    gw.faults.delayMs = 0
  })

  it('5xx answers are retried with jitter, then counted', async () => {
    const c = await node({ retries: 2, breakerThreshold: 100 })
    gw.faults.fail5xx = true
    const toks = tokens(T, 10)
    await c.store(toks, kvFor(1, 10))
    await c.flush(3000)
    const s = c.stats().remote!
    expect(s.retries).toBeGreaterThanOrEqual(2)
    expect(gw.objects.size).toBe(0)
    gw.faults.fail5xx = false
  })

  it('a hung-up connection is a miss, not an exception', async () => {
    const a = await node()
    const toks = tokens(T, 12)
    await a.store(toks, kvFor(1, 12))
    await a.flush()
    const b = await node({ retries: 1 })
    gw.faults.hangUp = true
    expect(sum(await b.retrieve(toks, { into: new Uint8Array(CB) }))).toBe(0)
    gw.faults.hangUp = false
  })

  it('the write-behind queue sheds load when full and counts it', async () => {
    const c = await node({ maxQueuedWrites: 1, writeConcurrency: 1, timeoutMs: 2000 })
    gw.faults.delayMs = 300
    const toks = tokens(8 * T, 11)
    await c.store(toks, kvFor(8, 11))
    // store() resolved before any upload finished: nothing is on the gateway yet.
    expect(gw.objects.size).toBe(0)
    await c.flush(5000)
    const s = c.stats().remote!
    expect(s.shedWrites).toBeGreaterThan(0)
    expect(gw.objects.size + s.shedWrites).toBe(8)
    gw.faults.delayMs = 0
  })
})
