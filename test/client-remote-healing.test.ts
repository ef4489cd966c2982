// L4 reads that must heal or be refused: forged identities, corrupt objects
// reported to /verify, presence that expires and is dropped on 404, hung GETs,
// oversized bodies, refused tokens, a /v1 URL, and "exists" answers.

import { afterEach, beforeEach, describe, expect, it } from 'vitest'
import { CircuitBreaker } from '../src/client/circuit-breaker.ts'
import { KVCache, type KVCacheOptions } from '../src/client/index.ts'
import { PresenceSet } from '../src/client/presence.ts'
import { RemoteTier } from '../src/client/tiers/remote.ts'
import { crc32 } from '../src/core/checksum.ts'
import { type ChunkMeta, decodeHeader, encodeChunk, sectionOf } from '../src/core/format.ts'
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
const tiers: RemoteTier[] = []
beforeEach(async () => {
  gw = await startFaultGateway()
})
afterEach(async () => {
  for (const c of caches.splice(0)) await c.close(100)
  for (const t of tiers.splice(0)) await t.close(100)
  await gw.close()
})
type Remote = Partial<NonNullable<Exclude<KVCacheOptions['remote'], false>>>
async function node(remote: Remote = {}, extra: Partial<KVCacheOptions> = {}): Promise<KVCache> {
  const c = await KVCache.open({
    model: 'stories260k',
    chunkTokens: T,
    namespace: 'team-a',
    memory: { bytes: 32 * CB },
    // Lookups get room: a loaded CI machine can miss the 250 ms prefill deadline, which is not under test here.
    remote: {
      url: gw.url,
      codec: 'raw',
      token: 'secret',
      breakerCooldownMs: 50,
      lookupTimeoutMs: 5000,
      ...remote,
    },
    ...extra,
  })
  caches.push(c)
  return c
}
/** Stores `chunks` chunks through one node and returns the prompt, its KV and its keys. */
async function seeded(chunks: number, seed: number) {
  const a = await node()
  const toks = tokens(chunks * T, seed)
  const kv = kvFor(chunks, seed)
  await a.store(toks, kv)
  await a.flush()
  expect(gw.objects.size).toBeGreaterThanOrEqual(chunks)
  return { toks, kv, keys: a.keys(toks).map((k) => k.hex) }
}
const verifies = () => gw.requests.filter((r) => r.method === 'POST' && r.path.endsWith('/verify'))
const lookups = () => gw.requests.filter((r) => r.method === 'POST' && r.path.endsWith('/lookup'))
const chunkGets = () => gw.requests.filter((r) => r.method === 'GET' && r.path.includes('/chunks/'))

/** Collects process warnings with the given code while `fn` runs. */
async function warningsDuring(code: string, fn: () => Promise<void>): Promise<string[]> {
  const got: string[] = []
  const on = (w: Error & { code?: string }) => {
    if (w.code === code) got.push(w.message)
  }
  process.on('warning', on)
  try {
    await fn()
    // emitWarning delivers on the next tick.
    await new Promise((r) => setImmediate(r))
  } finally {
    process.off('warning', on)
  }
  return got
}

describe('identity: every header field is checked (finding 17)', () => {
  const forgeries: [string, (m: ChunkMeta) => void][] = [
    ['namespace id', (m) => (m.namespaceId = m.namespaceId.map((b) => b ^ 1))],
    ['parent key', (m) => (m.parentKey = m.parentKey.map((b) => b ^ 1))],
    ['chunk index', (m) => (m.chunkIndex += 1)],
    ['partial flag', (m) => (m.partial = !m.partial)],
  ]
  it.each(forgeries)(
    'a valid object with the right chain key but another %s is a counted corrupt miss',
    async (_, forge) => {
      const { toks, kv, keys } = await seeded(2, 40)
      // Rewrite chunk 1 as a well-formed object (every CRC right) that lies about one identity field.
      const stored = gw.objects.get(keys[1]!)!
      const h = decodeHeader(stored)
      const meta: ChunkMeta = { ...h }
      forge(meta)
      const sections = h.sections.map((_, l) => sectionOf(stored, h, l))
      gw.objects.set(keys[1]!, encodeChunk(meta, sections))

      const b = await node()
      const into = new Uint8Array(2 * CB)
      const mask = await b.retrieve(toks, { into })
      expect(sum(mask)).toBe(T) // chunk 0 only
      expect(Buffer.compare(into.subarray(0, CB), kv.subarray(0, CB))).toBe(0)
      expect(into.subarray(CB).every((x) => x === 0)).toBe(true)
      expect(b.stats().remote?.corrupt).toBe(1)
      // The layer path checks the same fields.
      const c = await node()
      let served = 0
      for await (const batch of c.retrieveLayers(toks)) served = batch.chunks
      expect(served).toBe(1)
      expect(c.stats().remote?.corrupt).toBeGreaterThanOrEqual(1)
    },
  )
})

describe('corrupt objects are reported to the gateway once (contract C1)', () => {
  it('a CRC failure POSTs /verify once per key, forgets the key, and counts what the gateway found', async () => {
    const { toks, keys } = await seeded(2, 41)
    gw.faults.corrupt = true
    gw.faults.verdict = 'corrupt'
    const b = await node()
    for (let i = 0; i < 3; i++) expect(sum(await b.retrieve(toks, { into: new Uint8Array(2 * CB) }))).toBe(0)
    for (let i = 0; i < 50 && b.stats().remote?.corruptConfirmed === 0; i++)
      await new Promise((r) => setTimeout(r, 10))
    for (let i = 0; i < 50 && b.stats().remote?.corruptConfirmed !== 2; i++)
      await new Promise((r) => setTimeout(r, 10))
    const v = verifies()
    expect(v.map((r) => r.path).sort()).toEqual(keys.map((k) => `/v1/ns/team-a/chunks/${k}/verify`).sort())
    expect(v[0]!.auth).toBe('Bearer secret')
    const s = b.stats().remote!
    expect(s.corruptReported).toBe(2)
    expect(s.corruptConfirmed).toBe(2)
    expect(s.corrupt).toBe(2)
    // The gateway deleted it; the next lookup asks again instead of trusting what it knew.
    gw.faults.corrupt = false
    expect((await b.lookup(toks)).tokens).toBe(0)
  })

  it.each([
    ['lossless', 1],
    ['lossless', 0],
    ['kvgate', 1],
  ] as const)(
    'a %s layer range with a flipped byte is never served (%i codec workers: its CRCs checked there)',
    async (codec, codecWorkers) => {
      const a = await node({ codec })
      const toks = tokens(2 * T, 43)
      const kv = kvFor(2, 43)
      await a.store(toks, kv)
      await a.flush()
      gw.faults.corrupt = true
      const b = await node({ codec }, { codecWorkers })
      let served = 0
      for await (const batch of b.retrieveLayers(toks)) served = batch.chunks
      expect(served).toBe(0)
      expect(b.stats().remote?.corrupt).toBeGreaterThanOrEqual(1)
      expect((await b.lookup(toks)).chunks.some((c) => c.tier === 'memory')).toBe(false)
      // Intact again: every layer as stored (lossless) or within the codec's bound (its bytes decode).
      gw.faults.corrupt = false
      const c = await node({ codec }, { codecWorkers })
      const slab = layerSlabBytes(MODEL_PRESETS.stories260k, T)
      const layers = await expectLayersAsStored(c.retrieveLayers(toks), kv, {
        chunks: 2,
        chunkBytes: CB,
        slab,
        bytes: codec === 'lossless',
      })
      expect(layers.length).toBe(MODEL_PRESETS.stories260k.layers)
    },
  )

  it('a layer-range read that fails verification reports too', async () => {
    const { toks, keys } = await seeded(1, 42)
    gw.faults.corrupt = true
    const b = await node()
    for await (const _ of b.retrieveLayers(toks)) {
      // nothing to use
    }
    for (let i = 0; i < 50 && verifies().length === 0; i++) await new Promise((r) => setTimeout(r, 10))
    expect(verifies().map((r) => r.path)).toEqual([`/v1/ns/team-a/chunks/${keys[0]}/verify`])
  })
})

describe('objects this build cannot read, answers a proxy changed: not corruption', () => {
  /** A copy of `stored` with a header field changed and its header CRC right (what a newer writer emits). */
  const newerWriter = (stored: Uint8Array, edit: (dv: DataView) => void) => {
    const b = stored.slice()
    const dv = new DataView(b.buffer)
    edit(dv)
    const hb = dv.getUint32(8, true)
    dv.setUint32(hb - 4, crc32(b.subarray(0, hb - 4)), true)
    return b
  }
  it.each([
    ['format version', (dv: DataView) => dv.setUint16(4, 3, true)],
    ['flag bit', (dv: DataView) => dv.setUint16(6, dv.getUint16(6, true) | 0x8000, true)],
  ] as const)(
    "a newer writer's object (a %s this build does not know) is a counted miss: not reported, its chain not forgotten",
    async (_, edit) => {
      const { toks, keys } = await seeded(2, 43)
      gw.objects.set(keys[1]!, newerWriter(gw.objects.get(keys[1]!)!, edit))
      const b = await node()
      expect((await b.lookup(toks)).tokens).toBe(2 * T)
      const lookupsBefore = lookups().length
      for (let i = 0; i < 2; i++)
        expect(sum(await b.retrieve(toks, { into: new Uint8Array(2 * CB) }))).toBe(T)
      let served = 0
      for await (const batch of b.retrieveLayers(toks)) served = batch.chunks
      expect(served).toBe(1)
      await new Promise((r) => setTimeout(r, 50))
      const s = b.stats().remote!
      expect(verifies()).toEqual([])
      expect(s.corrupt).toBe(0)
      expect(s.corruptReported).toBe(0)
      // Read once, then held off: the later reads' lookups stop before it (misses without a GET).
      expect(s.newerObjects).toBe(1)
      expect(s.unservableLookupStops).toBeGreaterThanOrEqual(2)
      // Still believed stored, but held: the next lookup's prefix stops before it (a lookup that
      // counted it would promise tokens every retrieve misses), without asking the gateway.
      expect((await b.lookup(toks)).tokens).toBe(T)
      expect(lookups().length).toBe(lookupsBefore)
      const stops = b.stats().remote!.unservableLookupStops
      expect(stops).toBe(s.unservableLookupStops + 1)
      expect(b.metrics()).toContain(`kvgate_client_remote_lookup_unservable_stops_total ${stops}`)
      expect(b.metrics()).toContain('kvgate_client_remote_unservable_held_total 1')
    },
  )

  it("a newer writer's object is held off after its first read: later reads of that key cost no GET", async () => {
    const { toks, keys } = await seeded(2, 45)
    gw.objects.set(
      keys[1]!,
      newerWriter(gw.objects.get(keys[1]!)!, (dv) => dv.setUint16(4, 3, true)),
    )
    const b = await node()
    expect(sum(await b.retrieve(toks, { into: new Uint8Array(2 * CB) }))).toBe(T)
    const getsOf = () => chunkGets().filter((r) => r.path.includes(keys[1]!)).length
    const first = getsOf()
    expect(first).toBeGreaterThanOrEqual(1)
    for (let i = 0; i < 3; i++) expect(sum(await b.retrieve(toks, { into: new Uint8Array(2 * CB) }))).toBe(T)
    for await (const _ of b.retrieveLayers(toks)) {
      // the first chunk serves; the held one is a miss without a request
    }
    expect(getsOf()).toBe(first)
    const s = b.stats().remote!
    expect(s.newerObjects).toBe(1)
    // Each later read's lookup stopped before the held key: no GET of it was planned.
    expect(s.unservableLookupStops).toBeGreaterThanOrEqual(4)
    expect(s.corruptReported).toBe(0)
  })

  it("a held key that L1 holds again (the engine recomputed and stored it) counts and serves from L1; the newer writer's object stays", async () => {
    const { toks, kv, keys } = await seeded(2, 47)
    const newer = newerWriter(gw.objects.get(keys[1]!)!, (dv) => dv.setUint16(4, 3, true))
    gw.objects.set(keys[1]!, newer)
    const b = await node()
    expect(sum(await b.retrieve(toks, { into: new Uint8Array(2 * CB) }))).toBe(T)
    expect(b.stats().remote!.unservableHeld).toBe(1)
    // Stored again here: L1 holds chunk 1 now, the hold only says L4's copy cannot be read.
    const putsOf = () => gw.requests.filter((r) => r.method === 'PUT' && r.path.includes(keys[1]!)).length
    const seededPuts = putsOf()
    await b.store(toks, kv)
    await b.flush()
    const stops = b.stats().remote!.unservableLookupStops
    expect((await b.lookup(toks)).tokens).toBe(2 * T)
    const out = new Uint8Array(2 * CB)
    expect(sum(await b.retrieve(toks, { into: out }))).toBe(2 * T)
    expect(out).toEqual(kv)
    expect(b.stats().remote!.unservableLookupStops).toBe(stops)
    // The write-behind put nothing over the newer writer's object: not even tried (known present).
    expect(putsOf()).toBe(seededPuts)
    expect(gw.objects.get(keys[1]!)).toEqual(newer)
  })

  it("a newer writer's object first met by retrieveLayers (its layer groups asked at once) puts one key on hold, counted once", async () => {
    const { toks, keys } = await seeded(2, 46)
    gw.objects.set(
      keys[1]!,
      newerWriter(gw.objects.get(keys[1]!)!, (dv) => dv.setUint16(4, 3, true)),
    )
    // One layer a request: 5 GETs of the key in flight before any answers (a proxy that drops
    // ?layers sends the whole object to each: the fault gateway cannot cut a newer format).
    gw.faults.ignoreLayers = true
    const b = await node({}, { layersPerRequest: 1 })
    let served = 0
    for await (const batch of b.retrieveLayers(toks)) served = batch.chunks
    expect(served).toBe(1)
    expect(chunkGets().filter((r) => r.path.includes(keys[1]!)).length).toBeGreaterThan(1)
    const s = b.stats().remote!
    // Every group found the newer object, but one key went on hold.
    expect(s.unservableHeld).toBe(1)
    expect(s.newerObjects).toBe(1)
    expect(b.metrics()).toContain('kvgate_client_remote_unservable_held_total 1\n')
  })

  it('a whole object answering ?layers (a proxy dropped the query) serves the layers when they verify, reports nothing', async () => {
    const { toks, kv } = await seeded(2, 44)
    gw.faults.ignoreLayers = true
    const b = await node()
    const slab = layerSlabBytes(MODEL_PRESETS.stories260k, T)
    const layers = await expectLayersAsStored(b.retrieveLayers(toks), kv, { chunks: 2, chunkBytes: CB, slab })
    expect(layers.length).toBe(MODEL_PRESETS.stories260k.layers)
    await new Promise((r) => setTimeout(r, 50))
    const s = b.stats().remote!
    expect(verifies()).toEqual([])
    expect(s.corrupt).toBe(0)
    expect(s.oversizedBodies).toBe(0)
    expect(s.layersAnsweredWhole).toBeGreaterThan(2)
    // Whole but damaged bytes are still corruption, reported.
    gw.faults.corrupt = true
    const c = await node()
    for await (const _ of c.retrieveLayers(toks)) {
      // the last layer's group fails
    }
    expect(c.stats().remote?.corrupt).toBeGreaterThanOrEqual(1)
  })
})

describe('presence heals (contract C2)', () => {
  it('a 404 drops that key and every later key of its chain, so the next lookup asks the gateway', async () => {
    const { toks, keys } = await seeded(3, 43)
    const b = await node()
    expect((await b.lookup(toks)).tokens).toBe(3 * T)
    expect(b.stats().remote?.knownPresent).toBe(3)
    gw.objects.delete(keys[1]!) // behind the gateway's back, like lifecycle expiry
    const asked = lookups().length
    expect(sum(await b.retrieve(toks, { into: new Uint8Array(3 * CB) }))).toBe(T)
    const s = b.stats().remote!
    expect(s.notFound).toBe(1)
    expect(s.knownPresent).toBe(1) // chunk 0 only: 1 and 2 were forgotten
    expect(lookups().length).toBe(asked)
    // Chunk 0 is in L1 now; the lookup asks the gateway about chunk 1 on.
    expect((await b.lookup(toks)).tokens).toBe(T)
    expect(lookups().length).toBe(asked + 1)
  })

  it('a key trimmed or expired takes the keys learned after it along: a later 404 on it could not reach them', () => {
    let now = 0
    const p = new PresenceSet(1000, 4, () => now)
    p.rememberChain(['a', 'b'])
    now = 10
    p.rememberChain(['a', 'x'], 1) // another continuation after a, learned later
    p.rememberChain(['c', 'd', 'e']) // over the bound: a, the oldest, goes, and b and x with it
    expect(['a', 'b', 'x', 'c', 'd', 'e'].map((k) => p.has(k))).toEqual([
      false,
      false,
      false,
      true,
      true,
      true,
    ])
    expect(p.size).toBe(3)
    now = 500
    p.rememberChain(['c', 'y'], 1) // y expires at 1500, c at 1010
    now = 1011
    expect(p.has('c')).toBe(false)
    expect(p.has('y')).toBe(false) // learned after c: gone with it
    expect(p.size).toBe(0)
  })

  it('presence learned from a lookup expires after presenceTtlMs', async () => {
    const { toks } = await seeded(2, 44)
    const b = await node({ presenceTtlMs: 30 })
    await b.lookup(toks)
    const asked = lookups().length
    await new Promise((r) => setTimeout(r, 60))
    await b.lookup(toks)
    expect(lookups().length).toBe(asked + 1)
    expect(b.stats().remote?.lookupKeysKnown).toBe(0)
  })

  it('forgetFrom drops keys from an index on, and what was learned after them', () => {
    let now = 0
    const p = new PresenceSet(1000, 100, () => now)
    p.rememberChain(['a', 'b', 'c', 'd'])
    p.rememberChain(['b', 'x'], 1) // another continuation after b; b itself is not renewed
    p.forgetFrom(['a', 'b', 'c'], 2)
    expect(['a', 'b', 'c', 'd', 'x'].map((k) => p.has(k))).toEqual([true, true, false, false, true])
    p.forgetChainFrom('b')
    expect(['a', 'b', 'x'].map((k) => p.has(k))).toEqual([true, false, false])
    now = 1001
    expect(p.has('a')).toBe(false)
  })
})

describe('deadlines and body caps', () => {
  it('hung GETs are not retried and open the breaker although lookups keep succeeding (finding 18)', async () => {
    const { toks } = await seeded(2, 45)
    gw.faults.hangGets = true
    const b = await node({ timeoutMs: 200, retries: 2, breakerThreshold: 5 }, { fetchConcurrency: 1 })
    const one = toks.slice(0, T)
    expect(sum(await b.retrieve(one, { into: new Uint8Array(CB) }))).toBe(0)
    expect(chunkGets().length).toBe(1) // its deadline is spent: no retry
    expect(b.stats().remote?.breaker).toBe('closed')
    // A lookup that succeeds in between does not wipe the hung request from memory.
    expect((await b.lookup(toks)).tokens).toBe(2 * T)
    expect(sum(await b.retrieve(one, { into: new Uint8Array(CB) }))).toBe(0)
    const s = b.stats().remote!
    expect(s.timeouts).toBe(2)
    expect(s.breaker).not.toBe('closed')
    expect(s.breakerOpenedByTimeouts).toBe(1)
    gw.faults.hangGets = false
  })

  it('timeouts open the breaker only within their window; successes do not reset them', () => {
    let now = 0
    const b = new CircuitBreaker({
      failureThreshold: 5,
      timeoutWindowMs: 1000,
      probe: async () => false,
      now: () => now,
    })
    b.timeout()
    now = 1500 // the first one is out of the window
    b.timeout()
    b.success()
    expect(b.state).toBe('closed')
    now = 1900
    b.timeout()
    expect(b.state).toBe('open')
    expect(b.openedByTimeouts).toBe(1)
    b.dispose()
  })

  it('a lookup queued behind a hung GET on a busy connection still ends at its deadline', async () => {
    const { keys } = await seeded(1, 49)
    gw.faults.hangGets = true
    const r = new RemoteTier({ url: gw.url, namespace: 'team-a', connections: 1, lookupTimeoutMs: 200 })
    tiers.push(r)
    const order: string[] = []
    // The GET holds the only read connection; it ends (caller's abort) long after the lookup's deadline.
    const ac = new AbortController()
    const safety = setTimeout(() => ac.abort(), 5000)
    const get = r.get(keys[0]!, undefined, undefined, { signal: ac.signal }).then(() => order.push('get'))
    for (let i = 0; i < 200 && chunkGets().length === 0; i++) await new Promise((res) => setTimeout(res, 10))
    expect(chunkGets()).toHaveLength(1)
    expect(await r.lookup(keys)).toEqual({ present: 0 })
    order.push('lookup')
    ac.abort()
    clearTimeout(safety)
    await get
    expect(order).toEqual(['lookup', 'get'])
    expect(r.stats().timeouts).toBe(1)
    gw.faults.hangGets = false
  })

  it("the caller's own deadline ends a GET without blaming the gateway", async () => {
    const { keys } = await seeded(1, 48)
    gw.faults.hangGets = true
    const r = new RemoteTier({ url: gw.url, namespace: 'team-a', timeoutMs: 60_000 })
    tiers.push(r)
    const ac = new AbortController()
    setTimeout(() => ac.abort(), 50)
    expect(await r.get(keys[0]!, undefined, undefined, { signal: ac.signal })).toBeUndefined()
    const s = r.stats()
    expect([s.timeouts, r.counters.errors, s.breaker]).toEqual([0, 0, 'closed'])
    gw.faults.hangGets = false
  })

  it.each([
    ['with a content-length', false, false],
    ['chunked', true, false],
    ['from a presigned-redirect target', true, true],
  ])(
    'a body far over the chunk size is aborted, never buffered (%s) (finding 19)',
    async (_, chunked, redirect) => {
      const { toks } = await seeded(1, 46)
      gw.faults.oversize = 64 * 1024 * 1024
      gw.faults.oversizeChunked = chunked
      gw.faults.redirect = redirect
      const b = await node({ retries: 2 })
      expect(sum(await b.retrieve(toks, { into: new Uint8Array(CB) }))).toBe(0)
      const s = b.stats().remote!
      expect(s.oversizedBodies).toBe(1)
      expect(chunkGets().length).toBe(1) // not retried
      // The gateway is asked to check what it stores (it answers ok here: nothing is deleted).
      expect(s.corruptReported).toBe(1)
      for (let i = 0; i < 50 && verifies().length === 0; i++) await new Promise((r) => setTimeout(r, 10))
      expect(verifies()).toHaveLength(1)
      // The reader hung up long before the 64 MiB were sent (socket buffers aside).
      await new Promise((r) => setTimeout(r, 50))
      expect(gw.oversizeWritten).toBeLessThan(16 * 1024 * 1024)
      gw.faults.oversize = 0
    },
  )

  it('close() ends what a stuck gateway holds (a GET past its retrieve, an upload) at once, blaming nobody', async () => {
    const { toks } = await seeded(2, 50)
    gw.faults.hangGets = true
    const b = await node({ timeoutMs: 60_000, retries: 0 })
    // The GET outlives its retrieve's deadline; it would hold its connection for a minute.
    expect(sum(await b.retrieve(toks, { into: new Uint8Array(2 * CB), deadlineMs: 100 }))).toBe(0)
    for (let i = 0; i < 200 && chunkGets().length < 2; i++) await new Promise((r) => setTimeout(r, 10))
    expect(chunkGets()).toHaveLength(2)
    // An upload the gateway answers a minute late (its lookup, then its PUT).
    gw.faults.delayMs = 60_000
    await b.store(tokens(T, 51), kvFor(1, 51))
    await new Promise((r) => setTimeout(r, 50))
    const closing = b.close(100).then(() => 'closed')
    const bound = new Promise((r) => setTimeout(() => r('still waiting on the gateway'), 10_000).unref())
    expect(await Promise.race([closing, bound])).toBe('closed')
    const s = b.stats().remote!
    // Ended by close, not by the gateway: no timeout or failure is counted against it.
    expect([s.timeouts, s.breaker]).toEqual([0, 'closed'])
    // The upload is dropped and counted, like one still queued at close.
    expect(s.shedByReason.closed).toBe(1)
    expect(b.stats().memory).toMatchObject({ liveReservations: 0, livePins: 0 })
    gw.faults.hangGets = false
    gw.faults.delayMs = 0
  }, 30_000)

  it('retrieveLayers keeps retrieveDeadlineMs on the L4 path too: a hung gateway ends the prefix there', async () => {
    const { toks, kv } = await seeded(3, 52)
    const b = await node({ timeoutMs: 60_000, retries: 0 }, { retrieveDeadlineMs: 200 })
    await b.store(toks.slice(0, T), kv.subarray(0, CB)) // chunk 0 local, chunks 1..2 in L4 only
    gw.faults.hangGets = true
    const run = (async () => {
      const batches: { chunks: number; slab0: Uint8Array | undefined }[] = []
      for await (const x of b.retrieveLayers(toks))
        batches.push({ chunks: x.chunks, slab0: x.slabs[0]?.slice() })
      return batches
    })()
    const bound = new Promise<'held'>((r) => setTimeout(() => r('held'), 10_000).unref())
    const batches = await Promise.race([run, bound])
    expect(batches).not.toBe('held')
    const got = batches as Awaited<typeof run>
    expect(got).toHaveLength(MODEL_PRESETS.stories260k.layers)
    // The local chunk is served whole; the L4 chunks are a miss from the first layer on.
    expect(got.map((x) => x.chunks)).toEqual(got.map(() => 1))
    const slab = CB / MODEL_PRESETS.stories260k.layers
    expect(Buffer.compare(got[0]!.slab0!, kv.subarray(0, slab))).toBe(0)
    expect(b.stats().memory).toMatchObject({ liveReservations: 0, livePins: 0 })
    // Counted like a retrieve cut short (not as a gateway timeout: the GETs still run).
    expect(b.stats().retrieveTimeouts).toBe(1)
    gw.faults.hangGets = false
  }, 30_000)

  it("retrieveLayers' deadline counts its own waits, not the caller's work between layers", async () => {
    const { toks, kv } = await seeded(1, 53)
    // One connection, one layer per request, every answer 200 ms late: the groups arrive one
    // after another (the last ~1.2 s in) while the caller works 150 ms on each layer. The
    // generator itself waits ~400 ms in all, well within its 900 ms deadline.
    const b = await node({ connections: 1 }, { retrieveDeadlineMs: 900, layersPerRequest: 1 })
    gw.faults.delayMs = 200
    const slab = CB / MODEL_PRESETS.stories260k.layers
    const chunks: number[] = []
    for await (const x of b.retrieveLayers(toks)) {
      chunks.push(x.chunks)
      if (x.chunks === 1)
        expect(Buffer.compare(x.slabs[0]!, kv.subarray(x.layer * slab, (x.layer + 1) * slab))).toBe(0)
      await new Promise((r) => setTimeout(r, 150))
    }
    gw.faults.delayMs = 0
    expect(chunks).toEqual([1, 1, 1, 1, 1])
    expect(b.stats().retrieveTimeouts).toBe(0)
  }, 30_000)

  it('layer-range answers are capped at their range', async () => {
    const { toks } = await seeded(1, 47)
    gw.faults.oversize = 1024 * 1024
    const b = await node()
    for await (const _ of b.retrieveLayers(toks)) {
      // nothing arrives intact
    }
    expect(b.stats().remote?.oversizedBodies).toBeGreaterThanOrEqual(1)
    gw.faults.oversize = 0
  })
})

describe('gateway answers the client can act on (issue 15)', () => {
  it.each([401, 403] as const)('a %i is counted and named in one warning', async (status) => {
    gw.faults.refuse = status
    const msgs = await warningsDuring('KVGATE_REMOTE_AUTH', async () => {
      const c = await node()
      for (let i = 0; i < 3; i++) {
        await c.store(tokens(T, 50 + i), kvFor(1, 50 + i))
        await c.lookup(tokens(2 * T, 60 + i))
      }
      await c.flush()
      const s = c.stats().remote!
      expect(s.authErrors).toBeGreaterThanOrEqual(6)
      expect(s.errors).toBeGreaterThanOrEqual(s.authErrors)
    })
    expect(msgs).toHaveLength(1)
    expect(msgs[0]).toMatch(status === 401 ? /remote\.token/ : /namespace 'team-a'/)
    gw.faults.refuse = 0
  })

  it.each(['/v1', '/v1/'])('a URL ending in %s reaches /v1/ns/…, not /v1/v1/', async (suffix) => {
    const { toks, kv } = await seeded(1, 51)
    const b = await node({ url: gw.url + suffix })
    const into = new Uint8Array(CB)
    expect(sum(await b.retrieve(toks, { into }))).toBe(T)
    expect(Buffer.compare(into, kv)).toBe(0)
    expect(gw.requests.some((r) => r.path.startsWith('/v1/v1/'))).toBe(false)
  })

  it('a URL naming a namespace path is refused at open', async () => {
    await expect(node({ url: `${gw.url}/v1/ns/team-a` })).rejects.toMatchObject({
      code: 'ERR_INVALID_ARGUMENT',
      message: expect.stringMatching(/base URL/),
    })
  })

  it('a 409 to a re-PUT (an older gateway, another size) counts as exists, not an error (contract C3)', async () => {
    const { keys } = await seeded(1, 52)
    gw.faults.conflictOnExists = true
    const r = new RemoteTier({ url: gw.url, namespace: 'team-a', token: 'secret' })
    tiers.push(r)
    expect(await r.put(keys[0]!, gw.objects.get(keys[0]!)!)).toBe(true)
    expect(r.stats().existed).toBe(1)
    expect(r.counters.errors).toBe(0)
    expect(r.knownPresent(keys[0]!)).toBe(true)
  })
})

describe('shedding is for a sick gateway, and visible (finding 20)', () => {
  it('an open breaker sheds with a reason and one warning a minute', async () => {
    const c = await node({ breakerThreshold: 1, retries: 0, breakerCooldownMs: 60_000 })
    gw.faults.fail5xx = true
    const msgs = await warningsDuring('KVGATE_REMOTE_SHED', async () => {
      for (let i = 0; i < 4; i++) {
        await c.store(tokens(2 * T, 70 + i), kvFor(2, 70 + i))
        await c.flush(1000)
      }
    })
    const s = c.stats().remote!
    expect(s.breaker).not.toBe('closed')
    expect(s.shedByReason.breaker).toBeGreaterThan(0)
    expect(s.shedWrites).toBe(s.shedByReason.breaker + s.shedByReason.queueFull + s.shedByReason.closed)
    expect(msgs).toHaveLength(1)
    expect(msgs[0]).toMatch(/circuit breaker open/)
    gw.faults.fail5xx = false
  })
})
