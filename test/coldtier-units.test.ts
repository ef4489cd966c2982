// Cold tier units on a memory store: config validation, the use-record format, the
// recorder's request and memory bounds, the tail-first plan, and gc end to end.

import { readFileSync } from 'node:fs'
import { setFlagsFromString } from 'node:v8'
import { runInNewContext } from 'node:vm'
import { describe, expect, it, vi } from 'vitest'
import { parse as parseYaml } from 'yaml'
import {
  MAX_SNAPSHOT_BYTES,
  parseSnapshot,
  readLatestSnapshot,
  snapshotName,
} from '../src/coldtier/accounting.ts'
import { type ChunkNode, plan, settle } from '../src/coldtier/chain-graph.ts'
import { type GcProgress, runGc, usesUpTo } from '../src/coldtier/gc.ts'
import { classify, condemnedPrefix, indexPrefix, usagePrefix } from '../src/coldtier/names.ts'
import {
  condemnWaitMs,
  DEFAULT_COLD_TIER,
  DEFAULT_USAGE,
  parseColdTier,
  policyFor,
} from '../src/coldtier/policy.ts'
import { decodeBatch, encodeBatch } from '../src/coldtier/records.ts'
import { crc32 } from '../src/core/checksum.ts'
import { decodeHeader, FIXED_HEADER_BYTES, headerBytesFor } from '../src/core/format.ts'
import { createGateway, MemoryStore } from '../src/gateway/index.ts'
import type { ObjectStore } from '../src/gateway/stores/types.ts'
import { UsageRecorder } from '../src/gateway/usage/recorder.ts'
import { makeChain, makeChunk, putInit } from './gateway-fixtures.ts'

const DAY = 86_400_000
/** How long a condemned chunk waits at the default usage settings (6 min 15 s). */
const WAIT = condemnWaitMs(DEFAULT_USAGE)
const key = (i: number) => i.toString(16).padStart(64, '0')

/**
 * `store` whose listings also show `name` as a 64 GiB object modified at `t` (it does not
 * exist: only its listed size matters), recording every name gc GETs.
 */
function listingHuge(store: ObjectStore, name: string, t: number): { store: ObjectStore; got: string[] } {
  const got: string[] = []
  const wrapped: ObjectStore = {
    kind: store.kind,
    get: (n, o) => {
      got.push(n)
      return store.get(n, o)
    },
    head: (n) => store.head(n),
    putIfAbsent: (n, b, sz) => store.putIfAbsent(n, b, sz),
    delete: (n) => store.delete(n),
    list: async (p, o) => {
      const page = await store.list(p, o)
      return { ...page, entries: [...page.entries, { name, size: 2 ** 36, modified: t }] }
    },
  }
  return { store: wrapped, got }
}

describe('coldTier config', () => {
  it('parses durations, sizes and per-namespace policies', () => {
    const c = parseColdTier({
      grace: '5m',
      usage: { flushInterval: '30s', maxDelay: '2m', maxKeys: 1000 },
      namespaces: { prod: { retention: '30d', quota: '2GiB' }, '*': { retention: 7 * 86400 } },
    })
    expect(c.graceMs).toBe(300_000)
    expect(c.usage).toEqual({ flushIntervalMs: 30_000, maxDelayMs: 120_000, maxKeys: 1000 })
    expect(c.namespaces.prod).toEqual({ retentionMs: 30 * DAY, quotaBytes: 2 * 1024 ** 3 })
    expect(c.namespaces['*']).toEqual({ retentionMs: 7 * DAY })
    expect(parseColdTier(JSON.stringify({ namespaces: { a: { quota: '1TB' } } })).namespaces.a).toEqual({
      quotaBytes: 1e12,
    })
    expect(parseColdTier(undefined)).toBe(DEFAULT_COLD_TIER)
  })

  it('takes a condemning wait no shorter than usage.maxDelay (default: maxDelay plus margins)', () => {
    expect(parseColdTier({}).condemnWaitMs).toBeUndefined()
    expect(WAIT).toBe(300_000 + 15_000 + 60_000)
    expect(parseColdTier({ condemnWait: '20m' }).condemnWaitMs).toBe(1_200_000)
    expect(() => parseColdTier({ condemnWait: '4m' })).toThrow(/condemnWait is shorter than usage.maxDelay/)
    expect(() => parseColdTier({ condemnWait: 'soon' })).toThrow(/condemnWait must be a duration/)
    expect(
      parseColdTier({ condemnWait: '1s', usage: { flushInterval: '0s', maxDelay: '1s' } }).condemnWaitMs,
    ).toBe(1000)
  })

  it('rejects unknown keys, bad values and a retention shorter than the grace period', () => {
    const bad = [
      { retention: '30d' },
      { namespaces: { prod: { retension: '30d' } } },
      { usage: { flushEvery: '1m' } },
      { namespaces: { prod: { quota: 'lots' } } },
      { namespaces: { prod: { retention: '-3d' } } },
      { namespaces: { 'Bad/ns': { retention: '3d' } } },
      { grace: '1h', namespaces: { prod: { retention: '10m' } } },
      { usage: { flushInterval: '10m', maxDelay: '1m' } },
      '{not json',
    ]
    for (const b of bad)
      expect(() => parseColdTier(b), JSON.stringify(b)).toThrow(
        expect.objectContaining({ code: 'ERR_CONFIG' }),
      )
  })

  it('quota sizes are read like every other byte size of the gateway (8M, 512k, 10MB), and stay exact integers', () => {
    const q = (quota: unknown) => parseColdTier({ namespaces: { a: { quota } } }).namespaces.a!.quotaBytes
    expect(q('500G')).toBe(500 * 1024 ** 3)
    expect(q('512k')).toBe(512 * 1024)
    expect(q('10MB')).toBe(10e6)
    expect(q('2 TiB')).toBe(2 * 1024 ** 4)
    expect(q('4096')).toBe(4096)
    // Past 2^53 bytes a size is not an exact integer: an error, not 1.1e32 taken as given.
    expect(() => q('99999999999999999999TiB')).toThrow(/quota must be a size/)
    expect(() => q('-1GB')).toThrow(/quota must be a size/)
  })

  it("docs/cold-tier.md's example parses, its commented-out settings too, to the defaults it states", () => {
    const md = readFileSync(new URL('../docs/cold-tier.md', import.meta.url), 'utf8')
    const block = /^## Configuration[\s\S]*?^```yaml\n([\s\S]*?)^```$/m.exec(md)![1]!
    // Uncommented: a user enabling a shown setting gets what the comment says, not ERR_CONFIG.
    const doc = parseYaml(block.replace(/^(\s*)# (\w+:)/gm, '$1$2')) as { coldTier: unknown }
    const c = parseColdTier(doc.coldTier)
    expect(c.condemnWaitMs).toBe(WAIT)
    expect(c.usage).toEqual(DEFAULT_USAGE)
    expect(c.graceMs).toBe(DEFAULT_COLD_TIER.graceMs)
  })
})

describe('a namespace named like an Object.prototype member (constructor)', () => {
  // `constructor` is a valid namespace name; a plain object lookup found Object itself.
  it("gets '*' (or no policy), not Object as its policy", () => {
    expect(policyFor(parseColdTier({ namespaces: { '*': { retention: '1d' } } }), 'constructor')).toEqual({
      retentionMs: DAY,
    })
    expect(policyFor(parseColdTier({}), 'constructor')).toBeUndefined()
    expect(
      policyFor(parseColdTier({ namespaces: { constructor: { quota: '1GB' } } }), 'constructor'),
    ).toEqual({
      quotaBytes: 1e9,
    })
  })

  it('is accounted as itself, and writes nothing onto Object', async () => {
    const app = createGateway({ store: new MemoryStore(), prefix: 'kv' })
    const [c] = makeChain(1)
    expect((await app.request(`/v1/ns/constructor/chunks/${c!.key}`, putInit(c!.bytes))).status).toBe(201)
    const totals = app.state.accounting!.totals()
    expect(Object.hasOwn(totals, 'constructor')).toBe(true)
    expect(totals.constructor).toEqual({ objects: 1, bytes: c!.bytes.length })
    expect(Object.hasOwn(Object, 'bytes')).toBe(false)
    const metrics = await (await app.request('/metrics')).text()
    expect(metrics).toContain(`kvgate_namespace_stored_objects{ns="constructor"} 1`)
  })

  it('gc keeps it under no policy and gives it the catch-all policy when there is one', async () => {
    const store = new MemoryStore()
    const app = createGateway({ store, prefix: 'kv', coldTier: false })
    const chain = makeChain(2)
    for (const k of chain) await app.request(`/v1/ns/constructor/chunks/${k.key}`, putInit(k.bytes))
    const now = Date.now() + 20 * DAY
    const none = await runGc({ store, prefix: 'kv', config: parseColdTier({}), now, dryRun: true })
    expect(none.namespaces[0]).toMatchObject({
      ns: 'constructor',
      policy: undefined,
      condemned: { objects: 0 },
    })
    const star = parseColdTier({ namespaces: { '*': { retention: '10d' } } })
    const r = await runGc({ store, prefix: 'kv', config: star, now, dryRun: true })
    expect(r.namespaces[0]).toMatchObject({
      ns: 'constructor',
      policy: { retentionMs: 10 * DAY },
      condemned: { objects: 2 },
    })
  })
})

describe('gc options', () => {
  // Every caller (CLI, Worker cron, Lambda) passes its own prefix; the gateway refuses a bad
  // one at start, and gc must too rather than list nothing and write its objects under it.
  it('a prefix the gateway would refuse, or a concurrency below 1, is a ConfigError before any request', async () => {
    const store = new MemoryStore()
    await store.putIfAbsent('kv/_coldtier/accounting/x', new Uint8Array(1), 1)
    const config = parseColdTier({})
    for (const prefix of ['kv/', '/kv', 'kv//a', '../kv', 'kv/./a'])
      await expect(runGc({ store, prefix, config }), prefix).rejects.toThrow(
        expect.objectContaining({ code: 'ERR_CONFIG' }),
      )
    for (const concurrency of [0, -1, 1.5, Number.NaN])
      await expect(runGc({ store, prefix: 'kv', config, concurrency }), String(concurrency)).rejects.toThrow(
        expect.objectContaining({ code: 'ERR_CONFIG' }),
      )
    expect((await store.list('')).entries.map((e) => e.name)).toEqual(['kv/_coldtier/accounting/x'])
  })
})

describe('use records', () => {
  it('decode to flat key strings: gc holds a namespace index of ~300 bytes a link, not ~2 KiB', () => {
    // A hex string built by appending two characters at a time is a tree of ~30 string
    // pieces (~870 bytes) until something flattens it; gc keeps every decoded key and parent.
    setFlagsFromString('--expose-gc')
    const gc = runInNewContext('gc') as () => void
    const n = 20_000
    const links = Array.from({ length: n }, (_, i) => ({
      key: key(2 * i + 1),
      parent: key(2 * i),
      size: 1,
      at: 0,
    }))
    const bytes = encodeBatch({ kind: 'index', at: 0, uses: [], links })
    gc()
    const before = process.memoryUsage().heapUsed
    const decoded = decodeBatch(bytes)
    gc()
    const perLink = (process.memoryUsage().heapUsed - before) / n
    expect(decoded.links[n - 1]).toEqual(links[n - 1])
    expect(perLink).toBeLessThan(400)
  })

  it('round-trip and reject any flipped byte', () => {
    const b = encodeBatch({
      kind: 'usage',
      at: 1234.5,
      uses: [{ key: key(1), at: 99 }],
      links: [{ key: key(2), parent: key(1), size: 4096, at: 100 }],
    })
    expect(decodeBatch(b)).toEqual({
      kind: 'usage',
      at: 1234.5,
      uses: [{ key: key(1), at: 99 }],
      links: [{ key: key(2), parent: key(1), size: 4096, at: 100 }],
    })
    for (const i of [0, 7, 30, b.length - 1]) {
      const c = b.slice()
      c[i]! ^= 1
      expect(() => decodeBatch(c)).toThrow()
    }
    expect(() => decodeBatch(b.subarray(0, b.length - 5))).toThrow()
  })

  it('reject CRC-valid records whose times or sizes are not finite, non-negative numbers', () => {
    const ok = { key: key(2), parent: key(1), size: 4096, at: 100 }
    const bad = [
      { at: Number.NaN, uses: [], links: [] },
      { at: 1, uses: [{ key: key(1), at: Number.NaN }], links: [] },
      { at: 1, uses: [{ key: key(1), at: Number.POSITIVE_INFINITY }], links: [] },
      { at: 1, uses: [], links: [{ ...ok, at: Number.NaN }] },
      { at: 1, uses: [], links: [{ ...ok, size: -1 }] },
      { at: 1, uses: [], links: [{ ...ok, size: 1.5 }] },
      { at: 1, uses: [], links: [{ ...ok, size: Number.NaN }] },
    ]
    for (const b of bad)
      expect(() => decodeBatch(encodeBatch({ kind: 'usage', ...b })), JSON.stringify(b)).toThrow(
        expect.objectContaining({ code: 'ERR_FORMAT_BAD_FIELD' }),
      )
    expect(decodeBatch(encodeBatch({ kind: 'usage', at: 1, uses: [], links: [ok] })).links).toEqual([ok])
  })
})

describe('UsageRecorder', () => {
  function setup(opts: { maxKeys?: number } = {}) {
    let now = 1_000_000
    const puts: string[] = []
    const store = new MemoryStore({ onOp: (op) => op === 'put' && puts.push(op) })
    const r = new UsageRecorder(store, 'kv', undefined, {
      flushIntervalMs: 60_000,
      maxDelayMs: 300_000,
      maxKeys: opts.maxKeys ?? 1000,
      now: () => now,
    })
    return { r, store, puts, tick: (ms: number) => (now += ms) }
  }

  it('creation buckets stay bounded across namespaces (folded, totals kept); a snapshot prunes what it counts', () => {
    const { r, tick } = setup()
    // 1,000 namespaces each creating a chunk every second for 100 s: 100,000 busy seconds.
    for (let s = 0; s < 100; s++) {
      for (let n = 0; n < 1000; n++) r.created(`ns${n}`, key(n), key(n + 1), 10)
      tick(1000)
    }
    expect(r.accountedBuckets).toBeLessThanOrEqual(24_000)
    const held = [...r.createdBySecond.values()].reduce((a, m) => a + m.size, 0)
    expect(held).toBe(r.accountedBuckets)
    let bytes = 0
    let objects = 0
    for (const m of r.createdBySecond.values()) {
      for (const c of m.values()) {
        bytes += c.bytes
        objects++
      }
    }
    expect(bytes).toBe(100 * 1000 * 10) // folding coarsens times, never loses a creation
    expect(objects).toBe(held)
    // A snapshot's listing at "now" counts every creation so far: all of it goes.
    r.pruneCreatedBefore(1_000_000 + 101_000)
    expect(r.accountedBuckets).toBe(0)
    expect(r.createdBySecond.size).toBe(0)
  })

  it('a snapshot prunes only the seconds it counted', () => {
    const { r, tick } = setup()
    for (let s = 0; s < 10; s++) {
      r.created('prod', key(s), key(s + 1), 1)
      tick(1000)
    }
    // Seconds 1_000_000 .. 1_009_000; a listing at 1_004_500 counts those ending by then (4 of them).
    r.pruneCreatedBefore(1_004_500)
    expect([...r.createdBySecond.get('prod')!.keys()]).toEqual([
      1_004_000, 1_005_000, 1_006_000, 1_007_000, 1_008_000, 1_009_000,
    ])
    expect(r.accountedBuckets).toBe(6)
  })

  it('costs at most one PUT per 100 hits in steady state', async () => {
    const { r, puts, tick } = setup()
    let hits = 0
    // 10 minutes at 5 lookups/s of 4-chunk chains over 50 distinct chains.
    for (let s = 0; s < 600; s++) {
      for (let j = 0; j < 5; j++) {
        r.use('prod', key((s * 5 + j) % 50), 4)
        hits += 4
      }
      tick(1000)
      await r.flushIfDue()
    }
    expect(puts.length).toBeGreaterThan(0)
    expect(puts.length / hits).toBeLessThanOrEqual(1 / 100)
  })

  it('flushes a quiet batch after maxDelay (the loss window), not before', async () => {
    const { r, puts, tick } = setup()
    r.use('prod', key(1))
    tick(299_000)
    expect(r.due()).toBe(false)
    tick(1000)
    expect(r.due()).toBe(true)
    await r.flushIfDue()
    expect(puts.length).toBe(1)
  })

  it('bounds memory: flushes early at maxKeys and drops beyond twice that while a flush hangs', async () => {
    let release!: () => void
    const hang = new Promise<void>((r) => {
      release = r
    })
    const store = new MemoryStore()
    const slow: ObjectStore = Object.assign(Object.create(store) as ObjectStore, {
      putIfAbsent: async (n: string, b: Uint8Array, s: number) => {
        await hang
        return store.putIfAbsent(n, b, s)
      },
    })
    const r = new UsageRecorder(slow, 'kv', undefined, { maxKeys: 10 })
    for (let i = 0; i < 10; i++) r.use('a', key(i)) // the 10th starts a flush (hanging)
    expect(r.bufferedKeys).toBe(0)
    for (let i = 10; i < 40; i++) r.use('a', key(i))
    expect(r.bufferedKeys).toBe(20)
    expect(r.dropped.value()).toBe(10)
    release()
    await r.close()
    expect(r.bufferedKeys).toBe(0)
    const list = await store.list(usagePrefix('kv', 'a'))
    expect(list.entries.length).toBe(2)
  })

  it('a failed flush put back into a full buffer counts every entry it drops, links included', async () => {
    let fail!: (e: Error) => void
    const hang = new Promise<void>((_, reject) => {
      fail = reject
    })
    const store = new MemoryStore()
    const failing: ObjectStore = Object.assign(Object.create(store) as ObjectStore, {
      putIfAbsent: async () => {
        await hang
        return 'created' as const
      },
    })
    const r = new UsageRecorder(failing, 'kv', undefined, { maxKeys: 3 })
    r.created('a', key(100), key(99), 1000)
    r.use('a', key(1))
    r.use('a', key(2)) // the 3rd key starts a flush (hanging, then failing)
    for (let i = 10; i < 16; i++) r.use('a', key(i)) // fills the buffer to its cap (6)
    expect(r.dropped.value()).toBe(0)
    fail(new Error('503'))
    await r.pending
    // Two uses and one link had no room when put back: three entries lost, three counted.
    expect(r.dropped.value()).toBe(3)
    expect(r.bufferedKeys).toBe(6)
  })

  it('flush() resolves only after uses made before it are written, even with a flush in flight', async () => {
    let release!: () => void
    const hang = new Promise<void>((r) => {
      release = r
    })
    const store = new MemoryStore()
    let first = true
    const slow: ObjectStore = Object.assign(Object.create(store) as ObjectStore, {
      putIfAbsent: async (n: string, b: Uint8Array, s: number) => {
        if (first) {
          first = false
          await hang
        }
        return store.putIfAbsent(n, b, s)
      },
    })
    const r = new UsageRecorder(slow, 'kv', undefined, {})
    r.use('a', key(1))
    const inFlight = r.flush()
    r.use('a', key(2))
    const later = r.flush()
    release()
    await Promise.all([inFlight, later])
    const keys: string[] = []
    for (const e of (await store.list(usagePrefix('kv', 'a'))).entries) {
      const b = decodeBatch(new Uint8Array(await new Response((await store.get(e.name))!.body).arrayBuffer()))
      keys.push(...b.uses.map((u) => u.key))
    }
    expect(keys.sort()).toEqual([key(1), key(2)])
  })

  it('puts a failed flush back and writes it on the next one', async () => {
    const store = new MemoryStore()
    let fail = true
    const flaky: ObjectStore = Object.assign(Object.create(store) as ObjectStore, {
      putIfAbsent: async (n: string, b: Uint8Array, s: number) => {
        if (fail) throw new Error('store down')
        return store.putIfAbsent(n, b, s)
      },
    })
    const r = new UsageRecorder(flaky, 'kv', undefined, {})
    r.use('a', key(1))
    await expect(r.flush()).rejects.toThrow('store down')
    expect(r.bufferedKeys).toBe(1)
    fail = false
    await r.flush()
    const [e] = (await store.list(usagePrefix('kv', 'a'))).entries
    const got = decodeBatch(
      new Uint8Array(await new Response((await store.get(e!.name))!.body).arrayBuffer()),
    )
    expect(got.uses.map((u) => u.key)).toEqual([key(1)])
  })
})

describe('deletion plan', () => {
  function forest(chains: number, len: number, rnd: () => number): Map<string, ChunkNode> {
    const nodes = new Map<string, ChunkNode>()
    let id = 0
    for (let c = 0; c < chains; c++) {
      let parent: string | undefined
      // Branches: some chains fork off an earlier node of the previous chain.
      if (c > 0 && rnd() < 0.3) parent = key(Math.floor(rnd() * id))
      for (let i = 0; i < len; i++) {
        const k = key(++id)
        nodes.set(k, {
          key: k,
          size: 100 + Math.floor(rnd() * 900),
          parent,
          lastUse: rnd() < 0.5 ? Math.floor(rnd() * 100 * DAY) : undefined,
          modified: Math.floor(rnd() * 50 * DAY),
          depth: 0,
          effective: 0,
        })
        parent = k
      }
    }
    return nodes
  }

  it('never plans a chunk whose child is kept, under retention and quota, on random forests', () => {
    let seed = 7
    const rnd = () => {
      seed = (seed * 1103515245 + 12345) & 0x7fffffff
      return seed / 0x7fffffff
    }
    for (let t = 0; t < 50; t++) {
      const nodes = forest(20, 1 + Math.floor(rnd() * 8), rnd)
      settle(nodes, 100 * DAY)
      const total = [...nodes.values()].reduce((s, n) => s + n.size, 0)
      const p = plan(
        nodes,
        { retentionMs: 60 * DAY, quotaBytes: Math.floor(total * rnd() * 0.5) },
        100 * DAY,
        0,
      )
      const victims = new Set(p.victims.map((v) => v.node.key))
      const order = new Map(p.victims.map((v, i) => [v.node.key, i]))
      for (const n of nodes.values()) {
        if (n.parent !== undefined && victims.has(n.parent)) {
          expect(victims.has(n.key)).toBe(true)
          expect(order.get(n.key)!).toBeLessThan(order.get(n.parent)!)
        }
      }
      const kept = [...nodes.values()].filter((n) => !victims.has(n.key)).reduce((s, n) => s + n.size, 0)
      expect(kept).toBeLessThanOrEqual(Math.max(p.overQuotaBytes, total * 0.5) + 1000)
    }
  })
})

describe('gc on a memory store', () => {
  async function fleet(now: () => number) {
    const store = new MemoryStore()
    const app = createGateway({ store, prefix: 'kv', coldTier: { now } })
    const chains = [makeChain(4), makeChain(4), makeChain(3)]
    for (const c of chains)
      for (const k of c)
        expect((await app.request(`/v1/ns/prod/chunks/${k.key}`, putInit(k.bytes))).status).toBe(201)
    return { store, app, chains }
  }
  const lookup = (app: ReturnType<typeof createGateway>, keys: string[]) =>
    app.request('/v1/ns/prod/lookup', {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ keys }),
    })
  const present = async (store: MemoryStore, chain: { key: string }[]) => {
    const out: boolean[] = []
    for (const c of chain) out.push((await store.head(`kv/prod/${c.key.slice(0, 2)}/${c.key}`)) !== undefined)
    return out
  }

  it('retention deletes unused chains, keeps used ones; dry run first changes nothing', async () => {
    let t = Date.now()
    const { store, app, chains } = await fleet(() => t)
    t += 20 * DAY
    // Chain 0 used whole; chain 1 only its first two chunks; chain 2 not at all.
    expect(
      await (
        await lookup(
          app,
          chains[0]!.map((c) => c.key),
        )
      ).json(),
    ).toEqual({ present: 4 })
    expect((await app.request(`/v1/ns/prod/chunks/${chains[1]![1]!.key}`)).status).toBe(200)
    await app.state.usage!.flush()
    const config = parseColdTier({ grace: '10m', namespaces: { prod: { retention: '10d' } } })
    const before = (await store.stats()).objects
    const dry = await runGc({ store, prefix: 'kv', config, now: t + DAY, dryRun: true })
    expect(dry.namespaces[0]).toMatchObject({
      ns: 'prod',
      deleted: { objects: 0 },
      condemned: { objects: 5 },
    })
    expect((await store.stats()).objects).toBe(before)
    // Two phases: the first run condemns, a run at least WAIT later deletes.
    const first = await runGc({ store, prefix: 'kv', config, now: t + DAY })
    expect(first.namespaces[0]).toMatchObject({
      deleted: { objects: 0 },
      condemned: { objects: 5 },
      usageRecords: 2,
    })
    expect((await store.stats()).objects).toBe(before + 1) // the index, the condemned list, less the 2 records, plus a snapshot
    const early = await runGc({ store, prefix: 'kv', config, now: t + DAY + WAIT - 1 })
    expect(early.namespaces[0]).toMatchObject({ deleted: { objects: 0 }, condemned: { objects: 5 } })
    const r = await runGc({ store, prefix: 'kv', config, now: t + DAY + WAIT })
    expect(r.namespaces[0]).toMatchObject({
      deleted: { objects: 5, retention: 5 },
      kept: { objects: 6 },
      condemned: { objects: 0 },
    })
    expect(await present(store, chains[0]!)).toEqual([true, true, true, true])
    expect(await present(store, chains[1]!)).toEqual([true, true, false, false])
    expect(await present(store, chains[2]!)).toEqual([false, false, false])
    // Idempotent, and the use record was compacted into the index.
    const again = await runGc({ store, prefix: 'kv', config, now: t + DAY + WAIT })
    expect(again.namespaces[0]).toMatchObject({
      deleted: { objects: 0 },
      kept: { objects: 6 },
      usageRecords: 0,
      headerReads: 0,
      condemned: { objects: 0 },
    })
    expect((await store.list('kv/_usage/')).entries).toEqual([])
    expect((await store.list('kv/_coldtier/condemned/')).entries).toEqual([])
  })

  it('reads headers for chunks it has no links for (written before tracking) and still goes tail-first', async () => {
    const store = new MemoryStore()
    const app = createGateway({ store, prefix: 'kv', coldTier: false })
    const chain = makeChain(5)
    for (const k of chain) await app.request(`/v1/ns/prod/chunks/${k.key}`, putInit(k.bytes))
    const config = parseColdTier({ grace: '0s', namespaces: { prod: { quota: chain[0]!.bytes.length * 2 } } })
    const first = await runGc({ store, prefix: 'kv', config, now: Date.now() + 1000 })
    expect(first.namespaces[0]).toMatchObject({ headerReads: 5, chains: 1, condemned: { objects: 3 } })
    const r = await runGc({ store, prefix: 'kv', config, now: Date.now() + 1000 + WAIT })
    expect(r.namespaces[0]).toMatchObject({ headerReads: 0, chains: 1, deleted: { objects: 3, quota: 3 } })
    expect(await present(store, chain)).toEqual([true, true, false, false, false])
  })

  // A record (or index) with a hand-made, CRC-valid body: what a hostile or buggy writer leaves.
  async function putRecord(store: MemoryStore, uses: { key: string; at: number }[], seq = 1) {
    const bytes = encodeBatch({ kind: 'usage', at: Date.now(), uses, links: [] })
    await store.putIfAbsent(`${usagePrefix('kv', 'prod')}2026010100/feedface-${seq}`, bytes, bytes.length)
  }
  const noHole = (p: boolean[]) => p.every((x, i) => !x || i === 0 || p[i - 1])

  it('a header read that fails (store error) keeps the namespace whole: no parent goes before its unread child', async () => {
    const base = new MemoryStore()
    const app = createGateway({ store: base, prefix: 'kv', coldTier: false })
    const chain = makeChain(3)
    for (const k of chain) await app.request(`/v1/ns/prod/chunks/${k.key}`, putInit(k.bytes))
    const t = Date.now() + 20 * DAY
    // The tail was used an hour ago; its parents were not (a use of the tail covers them).
    await putRecord(base, [{ key: chain[2]!.key, at: t - 3_600_000 }])
    const tail = `kv/prod/${chain[2]!.key.slice(0, 2)}/${chain[2]!.key}`
    const store: ObjectStore = {
      kind: base.kind,
      get: (n, o) => (n === tail ? Promise.reject(new Error('503 SlowDown')) : base.get(n, o)),
      head: (n) => base.head(n),
      putIfAbsent: (n, b, sz) => base.putIfAbsent(n, b, sz),
      delete: (n) => base.delete(n),
      list: (p, o) => base.list(p, o),
    }
    const config = parseColdTier({ grace: '10m', namespaces: { prod: { retention: '10d' } } })
    // An earlier run condemned the two parents (seen without the tail they look unused).
    const list = encodeBatch({
      kind: 'condemned',
      at: t - WAIT,
      uses: chain.slice(0, 2).map((c) => ({ key: c.key, at: t - WAIT })),
      links: [],
    })
    await base.putIfAbsent(`${condemnedPrefix('kv', 'prod')}0000000000001-ab`, list, list.length)
    const r = await runGc({ store, prefix: 'kv', config, now: t })
    expect(await present(base, chain)).toEqual([true, true, true])
    expect(r.errors.join('\n')).toMatch(/503 SlowDown/)
    // The next run, with the store healthy, finds the tail used and keeps the chain too.
    const again = await runGc({ store: base, prefix: 'kv', config, now: t })
    expect(again.errors).toEqual([])
    expect(await present(base, chain)).toEqual([true, true, true])
  })

  it('a use record with a non-finite time is an error, never a reason to delete a parent of a kept chunk', async () => {
    let t = Date.now()
    const { store, chains } = await fleet(() => t)
    t += 20 * DAY
    const chain = chains[0]!
    await putRecord(store, [{ key: chain[3]!.key, at: Number.NaN }])
    const config = parseColdTier({ grace: '10m', namespaces: { prod: { retention: '10d' } } })
    const r = await runGc({ store, prefix: 'kv', config, now: t })
    expect(noHole(await present(store, chain))).toBe(true)
    expect(r.errors.join('\n')).toMatch(/feedface-1/)
  })

  it('a name whose shard is not the key’s first two characters is not that chunk (never deleted for it, not counted)', async () => {
    const store = new MemoryStore()
    const app = createGateway({ store, prefix: 'kv', coldTier: false })
    const [c] = makeChain(1)
    expect((await app.request(`/v1/ns/prod/chunks/${c!.key}`, putInit(c!.bytes))).status).toBe(201)
    // An old object under a longer shard: it lists after the real name and would stand for it.
    vi.useFakeTimers({ now: Date.now() - 30 * DAY, toFake: ['Date'] })
    try {
      await store.putIfAbsent(`kv/prod/${c!.key.slice(0, 3)}/${c!.key}`, c!.bytes, c!.bytes.length)
    } finally {
      vi.useRealTimers()
    }
    expect(classify('kv', `kv/prod/${c!.key.slice(0, 3)}/${c!.key}`).kind).toBe('other')
    expect(classify('kv', `kv/prod//${c!.key}`).kind).toBe('other')
    expect(classify('kv', `kv/prod/${c!.key.slice(0, 2)}/${c!.key}`).kind).toBe('chunk')
    const config = parseColdTier({ grace: '10m', namespaces: { prod: { retention: '10d' } } })
    const r = await runGc({ store, prefix: 'kv', config, now: Date.now() + 60_000 })
    expect(r.namespaces[0]).toMatchObject({ listed: { objects: 1 }, deleted: { objects: 0 } })
    expect(await present(store, [c!])).toEqual([true])
  })

  it('two runs at once: a run whose listed records another run folded meanwhile deletes nothing by them', async () => {
    let t = Date.now()
    const { store, app, chains } = await fleet(() => t)
    t += 20 * DAY
    const config = parseColdTier({ grace: '10m', namespaces: { prod: { retention: '10d' } } })
    // An earlier run condemned all three chains; chain 0 is used since (a 10-day retention
    // keeps only chain 0), in a record A folds and B misses.
    expect((await runGc({ store, prefix: 'kv', config, now: t })).namespaces[0]!.condemned.objects).toBe(11)
    t += WAIT
    await app.request(`/v1/ns/prod/chunks/${chains[0]![3]!.key}`)
    await app.state.usage!.flush()
    // Run B lists, then run A does its whole pass (folds the record into its index, deletes
    // it) before B reads anything: B sees neither the record nor A's index.
    let first = true
    const slow: ObjectStore = {
      kind: store.kind,
      get: (n, o) => store.get(n, o),
      head: (n) => store.head(n),
      putIfAbsent: (n, b, sz) => store.putIfAbsent(n, b, sz),
      delete: (n) => store.delete(n),
      list: async (p, o) => {
        const page = await store.list(p, o)
        if (first) {
          first = false
          const a = await runGc({ store, prefix: 'kv', config, now: t })
          expect(a.namespaces[0]).toMatchObject({ deleted: { objects: 7 }, usageRecords: 1 })
        }
        return page
      },
    }
    const b = await runGc({ store: slow, prefix: 'kv', config, now: t })
    expect(await present(store, chains[0]!)).toEqual([true, true, true, true])
    expect(b.namespaces[0]).toMatchObject({
      deleted: { objects: 0 },
      deferred: expect.stringMatching(/concurrent/),
    })
    // The next run has both indexes and agrees with A.
    const c = await runGc({ store, prefix: 'kv', config, now: t })
    expect(c.errors).toEqual([])
    expect(c.namespaces[0]).toMatchObject({ deleted: { objects: 0 }, kept: { objects: 4 }, headerReads: 0 })
  })

  it('a use record of a newer format (a gateway upgraded before gc) is kept and defers deletes, not folded away', async () => {
    let t = Date.now()
    const { store, chains } = await fleet(() => t)
    t += 20 * DAY
    const config = parseColdTier({ grace: '10m', namespaces: { prod: { retention: '10d' } } })
    // An earlier run condemned everything: this one would delete it all, were its view whole.
    await runGc({ store, prefix: 'kv', config, now: t - WAIT })
    const lists = (await store.list(condemnedPrefix('kv', 'prod'))).entries.map((e) => e.name)
    expect(lists).toHaveLength(1)
    const bytes = encodeBatch({ kind: 'usage', at: t, uses: [{ key: chains[0]![3]!.key, at: t }], links: [] })
    bytes[4] = 2 // format version 2: this build cannot read what it says
    const name = `${usagePrefix('kv', 'prod')}2026010100/feedface-9`
    await store.putIfAbsent(name, bytes, bytes.length)
    const r = await runGc({ store, prefix: 'kv', config, now: t })
    expect(await present(store, chains[0]!)).toEqual([true, true, true, true])
    expect(r.namespaces[0]).toMatchObject({
      deleted: { objects: 0 },
      condemned: { objects: 0 },
      saved: 0,
      deferred: expect.stringMatching(/newer/),
    })
    expect(r.errors.join('\n')).toMatch(/feedface-9/)
    expect(await store.head(name)).toBeDefined()
    // The condemned list is left as it was for a run with the whole view.
    expect((await store.list(condemnedPrefix('kv', 'prod'))).entries.map((e) => e.name)).toEqual(lists)
  })

  it('an oversized use record is not read into memory: an error, kept, and the namespace’s deletes deferred', async () => {
    let t = Date.now()
    const { store, chains } = await fleet(() => t)
    t += 20 * DAY
    const huge = `${usagePrefix('kv', 'prod')}2026010100/feedface-7`
    // The listing shows a 64 GiB record (only its size matters: gc must not fetch it).
    const { store: listed, got } = listingHuge(store, huge, t)
    const config = parseColdTier({ grace: '10m', namespaces: { prod: { retention: '10d' } } })
    await runGc({ store, prefix: 'kv', config, now: t - WAIT }) // condemns everything
    const r = await runGc({ store: listed, prefix: 'kv', config, now: t })
    expect(got).not.toContain(huge)
    expect(r.errors.join('\n')).toMatch(/feedface-7/)
    expect(r.namespaces[0]).toMatchObject({
      deleted: { objects: 0 },
      deferred: expect.stringMatching(/too large/),
    })
    expect(await present(store, chains[0]!)).toEqual([true, true, true, true])
  })

  it('a corrupt use record written at every run (a broken gateway) does not stop the quota: the least recently used known go', async () => {
    let t = Date.now()
    const { store, app, chains } = await fleet(() => t)
    t += 20 * DAY
    // Chain 0 used now; the others not since they were written 20 days ago.
    await lookup(
      app,
      chains[0]!.map((c) => c.key),
    )
    await app.state.usage!.flush()
    const quota = chains[0]!.reduce((a, c) => a + c.bytes.length, 0)
    const config = parseColdTier({ grace: '10m', namespaces: { prod: { retention: '365d', quota } } })
    /** A record of this run's hour that fails its checks: its uses could be as late as now. */
    const corruptRecord = async (at: number) => {
      const hour = new Date(at).toISOString().slice(0, 13).replace(/[-T]/g, '')
      const junk = new TextEncoder().encode('not a use record')
      await store.putIfAbsent(`${usagePrefix('kv', 'prod')}${hour}/feedface-${at}`, junk, junk.length)
    }
    await corruptRecord(t + DAY)
    const r = await runGc({ store, prefix: 'kv', config, now: t + DAY })
    expect(r.namespaces[0]).toMatchObject({ corruptRecords: 1, condemned: { objects: 7 } })
    await corruptRecord(t + DAY + WAIT)
    const r2 = await runGc({ store, prefix: 'kv', config, now: t + DAY + WAIT })
    // Both records kept (their hours are within retention), both failing: the quota still holds.
    expect(r2.namespaces[0]).toMatchObject({ corruptRecords: 2, deleted: { objects: 7 }, overQuotaBytes: 0 })
    expect(await present(store, chains[0]!)).toEqual([true, true, true, true])
    expect(await present(store, chains[1]!)).toEqual([false, false, false, false])
  })

  it("a corrupt record whose name says no time (not kvgate's, a future hour) keeps chunks one run only, then is folded", async () => {
    let t = Date.now()
    const { store } = await fleet(() => t)
    t += 20 * DAY
    const config = parseColdTier({ grace: '10m', namespaces: { prod: { retention: '10d' } } })
    const junk = new TextEncoder().encode('not a use record')
    const names = [
      `${usagePrefix('kv', 'prod')}garbage/feedface-1`,
      `${usagePrefix('kv', 'prod')}2999010100/feedface-2`,
    ]
    for (const n of names) await store.putIfAbsent(n, junk, junk.length)
    const r = await runGc({ store, prefix: 'kv', config, now: t })
    expect(r.namespaces[0]).toMatchObject({ corruptRecords: 2, condemned: { objects: 0 } })
    expect((await store.list(usagePrefix('kv', 'prod'))).entries).toEqual([])
    const r2 = await runGc({ store, prefix: 'kv', config, now: t + 11 * DAY })
    expect(r2.namespaces[0]).toMatchObject({ corruptRecords: 0, condemned: { objects: 11 } })
  })

  it('corrupt records among many cost one pass over the listed chunks, not one per record read', async () => {
    let t = Date.now()
    const { store } = await fleet(() => t)
    t += DAY
    const config = parseColdTier({ grace: '10m', namespaces: { prod: { retention: '10d' } } })
    const junk = new TextEncoder().encode('not a use record')
    for (let i = 0; i < 3000; i++)
      await store.putIfAbsent(`${usagePrefix('kv', 'prod')}2026010100/feedface-${i}`, junk, junk.length)
    // Each record read after the first corrupt one looked up every listed chunk again: count the lookups.
    const has = Set.prototype.has
    let lookups = 0
    Set.prototype.has = function (this: Set<unknown>, v: unknown) {
      lookups++
      return has.call(this, v)
    }
    try {
      const r = await runGc({ store, prefix: 'kv', config, now: t, dryRun: true })
      expect(r.namespaces[0]!.corruptRecords).toBe(3000)
    } finally {
      Set.prototype.has = has
    }
    // 11 chunks: one pass is tens of lookups per chunk at most; one per record was 3000 × 11.
    expect(lookups).toBeLessThan(20_000)
  })

  it('a chain index that fails its CRC loses no uses: every listed chunk counts as used at its run, kept until that is past retention', async () => {
    let t = Date.now()
    const { store, app, chains } = await fleet(() => t)
    t += 20 * DAY
    // Chain 0 used now; the others not since they were written 20 days ago.
    await lookup(
      app,
      chains[0]!.map((c) => c.key),
    )
    await app.state.usage!.flush()
    const config = parseColdTier({ grace: '10m', namespaces: { prod: { retention: '10d' } } })
    // This run folds the use record into its index: from now on only the index knows chain 0's use.
    await runGc({ store, prefix: 'kv', config, now: t + DAY })
    const [index] = (await store.list(indexPrefix('kv', 'prod'))).entries.map((e) => e.name)
    expect((await store.list(usagePrefix('kv', 'prod'))).entries).toEqual([])
    const body = new Uint8Array(await new Response((await store.get(index!))!.body).arrayBuffer())
    body[body.length - 10] = body[body.length - 10]! ^ 1
    await store.delete(index!)
    await store.putIfAbsent(index!, body, body.length)
    // Five days after chain 0's use it is within retention: neither condemned nor, a run later, deleted.
    const r = await runGc({ store, prefix: 'kv', config, now: t + 5 * DAY })
    expect(r.namespaces[0]).toMatchObject({
      corruptRecords: 1,
      condemned: { objects: 0 },
      deleted: { objects: 0 },
    })
    expect(r.errors.join('\n')).toContain(index!)
    await runGc({ store, prefix: 'kv', config, now: t + 5 * DAY + WAIT })
    expect(await present(store, chains[0]!)).toEqual([true, true, true, true])
    // The corrupt index stays while its bound can keep a chunk, read by each run (the bound is
    // not written into the rebuilt index as every chunk's use: that would erase the quota's LRU order).
    const again = await runGc({ store, prefix: 'kv', config, now: t + 5 * DAY + 2 * WAIT })
    expect(again.namespaces[0]).toMatchObject({ corruptRecords: 1, condemned: { objects: 0 } })
    expect((await store.list(indexPrefix('kv', 'prod'))).entries.map((e) => e.name)).toContain(index)
    // Past retention from that bound (the corrupt index's run, t + 1 day) chains go again (not
    // pinned for good), and the corrupt index is folded.
    const later = await runGc({ store, prefix: 'kv', config, now: t + 12 * DAY })
    expect(later.namespaces[0]).toMatchObject({ corruptRecords: 1, condemned: { objects: 11 } })
    expect((await store.list(indexPrefix('kv', 'prod'))).entries.map((e) => e.name)).not.toContain(index)
  })

  it('uses and links of chunks not in the listing (deleted since) are not held: memory stays with the namespace', async () => {
    setFlagsFromString('--expose-gc')
    const collect = runInNewContext('gc') as () => void
    let t = Date.now()
    const { store } = await fleet(() => t)
    t += DAY
    const config = parseColdTier({ grace: '10m', namespaces: { prod: { retention: '10d' } } })
    /** Heap in use once the records are folded (the maps full, the decoded records garbage). */
    const heapAfterFold = async () => {
      let heap = 0
      await runGc({
        store,
        prefix: 'kv',
        config,
        now: t,
        dryRun: true,
        onProgress: (p) => {
          if (p.phase === 'records' && p.done === p.total) {
            collect()
            heap = process.memoryUsage().heapUsed
          }
        },
      })
      return heap
    }
    const base = await heapAfterFold()
    // A use record naming 50,000 chunks that are not listed (gone since), each with a link.
    const n = 50_000
    const gone = Array.from({ length: n }, (_, i) => ({ key: key(1_000_000 + i), at: t }))
    const bytes = encodeBatch({
      kind: 'usage',
      at: t,
      uses: gone,
      links: gone.map((u, i) => ({ key: u.key, parent: key(2_000_000 + i), size: 1, at: t })),
    })
    await store.putIfAbsent(`${usagePrefix('kv', 'prod')}2026010100/feedface-5`, bytes, bytes.length)
    // Less the record the memory store holds: held, the uses and links were ~19 MB more (a map
    // entry and a 64-character key each, twice); not held, ~3 MB of garbage is left at most.
    const grown = (await heapAfterFold()) - base - bytes.byteLength
    expect(grown).toBeLessThan(8 * 2 ** 20)
  })

  it('usesUpTo: an index is bounded by its run time, a use record by the end of its hour, an unknown name by now', () => {
    const now = Date.UTC(2026, 5, 1)
    expect(
      usesUpTo('kv', `${indexPrefix('kv', 'prod')}${String(now - DAY).padStart(13, '0')}-abcd`, now),
    ).toBe(now - DAY)
    expect(
      usesUpTo('kv', `${indexPrefix('kv', 'prod')}${String(now + DAY).padStart(13, '0')}-abcd`, now),
    ).toBe(now)
    expect(usesUpTo('kv', `${usagePrefix('kv', 'prod')}2026010203/feedface-00000001`, now)).toBe(
      Date.UTC(2026, 0, 2, 4),
    )
    expect(usesUpTo('kv', `${usagePrefix('kv', 'prod')}garbage/feedface-1`, now)).toBe(now)
    expect(usesUpTo('kv', `${indexPrefix('kv', 'prod')}not-a-run`, now)).toBe(now)
  })

  it('a use record whose body outgrew its listed size (rewritten since the listing) is not read past that size', async () => {
    let t = Date.now()
    const { store, chains } = await fleet(() => t)
    t += 20 * DAY
    await putRecord(store, [{ key: chains[0]![3]!.key, at: t - 3_600_000 }], 8)
    const name = `${usagePrefix('kv', 'prod')}2026010100/feedface-8`
    const config = parseColdTier({ grace: '10m', namespaces: { prod: { retention: '10d' } } })
    await runGc({ store, prefix: 'kv', config, now: t - WAIT }) // condemns the unused chains
    await putRecord(store, [{ key: chains[0]![3]!.key, at: t - 3_600_000 }], 8) // folded: again
    // Its GET now answers 256 MiB (listed: ~70 bytes), in 1 MiB pieces made on demand.
    let pulled = 0
    const piece = new Uint8Array(1 << 20)
    const grown: ObjectStore = {
      ...store,
      kind: store.kind,
      get: async (n, o) => {
        if (n !== name) return store.get(n, o)
        let left = 256
        const body = new ReadableStream<Uint8Array>({
          pull(c) {
            if (left-- === 0) return c.close()
            pulled += piece.length
            c.enqueue(piece)
          },
        })
        return { body, size: 256 << 20, offset: 0, length: 256 << 20 }
      },
      list: (p, o) => store.list(p, o),
      head: (n) => store.head(n),
      putIfAbsent: (n, b, sz) => store.putIfAbsent(n, b, sz),
      delete: (n) => store.delete(n),
    }
    const r = await runGc({ store: grown, prefix: 'kv', config, now: t })
    // One piece past the listed size is enough to know; what it says is unknown: nothing deleted.
    expect(pulled).toBeLessThanOrEqual(2 << 20)
    expect(r.errors.join('\n')).toMatch(/feedface-8/)
    expect(r.namespaces[0]).toMatchObject({ deleted: { objects: 0 }, deferred: expect.any(String) })
    expect(await present(store, chains[0]!)).toEqual([true, true, true, true])
    expect(await store.head(name)).toBeDefined()
  })

  it('a chunk header longer than the probe is read by range, never the whole chunk', async () => {
    const store = new MemoryStore()
    // 300 layers: a header of ~5 KiB, past the 4 KiB probe; 64 KiB sections make a ~19 MiB chunk.
    const chain = makeChain(2, { layers: 300, sectionBytes: 64 << 10 })
    for (const c of chain) {
      const name = `kv/prod/${c.key.slice(0, 2)}/${c.key}`
      await store.putIfAbsent(name, c.bytes, c.bytes.length)
    }
    const reads: (number | undefined)[] = []
    const counted: ObjectStore = {
      kind: store.kind,
      get: (n, o) => {
        if (n.startsWith('kv/prod/')) reads.push(o?.range && 'length' in o.range ? o.range.length : undefined)
        return store.get(n, o)
      },
      head: (n) => store.head(n),
      putIfAbsent: (n, b, sz) => store.putIfAbsent(n, b, sz),
      delete: (n) => store.delete(n),
      list: (p, o) => store.list(p, o),
    }
    const config = parseColdTier({ grace: '0s', namespaces: { prod: { retention: '1d' } } })
    const r = await runGc({ store: counted, prefix: 'kv', config, now: Date.now() + 1000 })
    expect(r.errors).toEqual([])
    expect(r.namespaces[0]).toMatchObject({ headerReads: 2, chains: 1 })
    expect(reads.length).toBeGreaterThan(0)
    for (const n of reads) {
      expect(n).toBeDefined()
      expect(n!).toBeLessThan(16 << 10)
    }
  })

  it("a chunk over the format's 512 MiB default (a gateway with a larger maxChunkBytes) is read for its parent, not counted unreadable", async () => {
    const store = new MemoryStore()
    const [root, big] = makeChain(2)
    const bigName = `kv/prod/${big!.key.slice(0, 2)}/${big!.key}`
    await store.putIfAbsent(`kv/prod/${root!.key.slice(0, 2)}/${root!.key}`, root!.bytes, root!.bytes.length)
    // Only the header is stored (gc reads nothing else); it describes 4 sections of 160 MiB.
    const headerBytes = headerBytesFor(4)
    const header = big!.bytes.slice(0, headerBytes)
    const dv = new DataView(header.buffer)
    const section = 160 << 20
    for (let i = 0; i < 4; i++) {
      dv.setBigUint64(FIXED_HEADER_BYTES + i * 16, BigInt(headerBytes + i * section), true)
      dv.setUint32(FIXED_HEADER_BYTES + i * 16 + 8, section, true)
    }
    const total = headerBytes + 4 * section
    dv.setBigUint64(16, BigInt(total), true)
    dv.setUint32(headerBytes - 4, crc32(header.subarray(0, headerBytes - 4)), true)
    expect(decodeHeader(header, { maxBytes: total }).totalBytes).toBe(total)
    await store.putIfAbsent(bigName, header, header.length)
    const listed: ObjectStore = {
      kind: store.kind,
      get: (n, o) => store.get(n, o),
      head: (n) => store.head(n),
      putIfAbsent: (n, b, sz) => store.putIfAbsent(n, b, sz),
      delete: (n) => store.delete(n),
      list: async (p, o) => {
        const page = await store.list(p, o)
        return { ...page, entries: page.entries.map((e) => (e.name === bigName ? { ...e, size: total } : e)) }
      },
    }
    const config = parseColdTier({ grace: '0s', namespaces: { prod: { retention: '1d' } } })
    const r = await runGc({ store: listed, prefix: 'kv', config, now: Date.now() + 1000 })
    expect(r.errors).toEqual([])
    expect(r.namespaces[0]).toMatchObject({ headerReads: 2, chains: 1, unreadable: 0 })
  })

  it('incremental accounting counts a chunk once, though its link is in two records (a flush retried after an ambiguous failure)', async () => {
    let t = Date.now()
    const { store, app } = await fleet(() => t)
    await app.state.usage!.flush()
    const config = parseColdTier({ grace: '10m' })
    await runGc({ store, prefix: 'kv', config, now: t }) // the snapshot: 11 chunks
    t += 60_000
    const extra = makeChain(2)
    for (const k of extra)
      expect((await app.request(`/v1/ns/prod/chunks/${k.key}`, putInit(k.bytes))).status).toBe(201)
    await app.state.usage!.flush()
    // The same record again under the next name: the PUT had landed, its answer had not.
    const [rec] = (await store.list(usagePrefix('kv', 'prod'))).entries
    const obj = await store.get(rec!.name)
    const bytes = new Uint8Array(await new Response(obj!.body).arrayBuffer())
    await store.putIfAbsent(`${rec!.name}-again`, bytes, bytes.length)
    const r = await runGc({ store, prefix: 'kv', config, now: t + 1000, dryRun: true })
    expect(r.namespaces[0]!.listed.objects).toBe(13)
    expect(r.namespaces[0]!.incremental).toEqual(r.namespaces[0]!.listed)
  })

  it('reading many use records reports progress as it goes, not only once at the end', async () => {
    const store = new MemoryStore()
    for (let i = 0; i < 250; i++) await putRecord(store, [{ key: key(i + 1), at: Date.now() }], i)
    const seen: GcProgress[] = []
    await runGc({
      store,
      prefix: 'kv',
      config: parseColdTier({}),
      dryRun: true,
      concurrency: 4,
      onProgress: (p) => seen.push(p),
    })
    const reads = seen.filter((p) => p.phase === 'records')
    expect(reads.map((p) => p.phase === 'records' && [p.done, p.total])).toEqual([
      [100, 250],
      [200, 250],
      [250, 250],
    ])
    expect(reads.at(-1)).toMatchObject({ ns: 'prod', records: 250 })
  })

  it('a use in the future counts as now: it cannot pin a chain past its retention', async () => {
    let t = Date.now()
    const { store, chains } = await fleet(() => t)
    const chain = chains[0]!
    await putRecord(store, [{ key: chain[3]!.key, at: t + 10_000 * DAY }])
    const config = parseColdTier({ grace: '10m', namespaces: { prod: { retention: '10d' } } })
    await runGc({ store, prefix: 'kv', config, now: t + DAY })
    expect(await present(store, chain)).toEqual([true, true, true, true])
    t += 20 * DAY
    await runGc({ store, prefix: 'kv', config, now: t })
    await runGc({ store, prefix: 'kv', config, now: t + WAIT })
    expect(await present(store, chain)).toEqual([false, false, false, false])
  })

  // Two-phase deletes and holes (docs/cold-tier.md). Each of the first three fails on a gc
  // that deletes what one listing shows.
  const config10d = () => parseColdTier({ grace: '10m', namespaces: { prod: { retention: '10d' } } })
  /** Runs `fn` with Date (only) at `at`: the memory store dates its objects by it. */
  async function at<T>(when: number, fn: () => Promise<T>): Promise<T> {
    vi.useFakeTimers({ now: when, toFake: ['Date'] })
    try {
      return await fn()
    } finally {
      vi.useRealTimers()
    }
  }

  it('race 1: a read gc cannot see yet (still in a gateway buffer) saves its chain: condemned, then kept', async () => {
    let t = Date.now()
    const { store, app, chains } = await fleet(() => t)
    await app.state.usage!.flush()
    t += 20 * DAY
    // Chain 0 read one minute before gc lists; the gateway flushes within its maxDelay (5 min).
    expect(
      await (
        await lookup(
          app,
          chains[0]!.map((c) => c.key),
        )
      ).json(),
    ).toEqual({ present: 4 })
    const config = config10d()
    const first = await runGc({ store, prefix: 'kv', config, now: t + 60_000 })
    expect(await present(store, chains[0]!)).toEqual([true, true, true, true])
    expect(first.namespaces[0]).toMatchObject({ deleted: { objects: 0 }, condemned: { objects: 11 } })
    await app.state.usage!.flush()
    const second = await runGc({ store, prefix: 'kv', config, now: t + 60_000 + WAIT })
    expect(second.namespaces[0]).toMatchObject({
      deleted: { objects: 7 },
      saved: 4,
      condemned: { objects: 0 },
    })
    expect(await present(store, chains[0]!)).toEqual([true, true, true, true])
    expect(await present(store, chains[1]!)).toEqual([false, false, false, false])
    expect(second.errors).toEqual([])
  })

  it('race 2: a chunk written after the condemning run that extends a condemned chain saves it (no hole)', async () => {
    let t = Date.now()
    const { store, app, chains } = await fleet(() => t)
    await app.state.usage!.flush()
    t += 20 * DAY
    const config = config10d()
    await runGc({ store, prefix: 'kv', config, now: t })
    // A node extends chain 0 by one chunk two minutes later.
    const chain = chains[0]!
    const next = makeChunk({ parent: chain[3]!.key, index: 4 })
    t += 120_000
    await at(t, async () => {
      expect((await app.request(`/v1/ns/prod/chunks/${next.key}`, putInit(next.bytes))).status).toBe(201)
    })
    await app.state.usage!.flush()
    const r = await runGc({ store, prefix: 'kv', config, now: t + WAIT })
    expect(await present(store, [...chain, next])).toEqual([true, true, true, true, true])
    expect(r.namespaces[0]).toMatchObject({ deleted: { objects: 7 }, saved: 4 })
    const res = await lookup(
      app,
      [...chain, next].map((c) => c.key),
    )
    expect(await res.json()).toEqual({ present: 5 })
  })

  it('race 1 under a long listing: a read while the condemning run lists is still saved (condemned as of the listing’s end, not the run’s start)', async () => {
    let t = Date.now()
    const { store, app, chains } = await fleet(() => t)
    await app.state.usage!.flush()
    t += 20 * DAY
    const config = config10d()
    // The condemning run's listing takes 10 minutes (a big bucket); chain 0 is read 9 minutes
    // in, after its use records were listed: the gateway flushes that read within maxDelay.
    const LISTING = 600_000
    const slowList: ObjectStore = {
      kind: store.kind,
      get: (n, o) => store.get(n, o),
      head: (n) => store.head(n),
      putIfAbsent: (n, b, sz) => store.putIfAbsent(n, b, sz),
      delete: (n) => store.delete(n),
      list: async (p, o) => {
        const page = await store.list(p, o)
        vi.setSystemTime(Date.now() + LISTING)
        return page
      },
    }
    const first = await at(t, () => runGc({ store: slowList, prefix: 'kv', config, now: t }))
    expect(first.namespaces[0]).toMatchObject({ deleted: { objects: 0 }, condemned: { objects: 11 } })
    // The next run starts right after it (back to back), past condemnWait from the first
    // run's start but within maxDelay of the read: the read is still in the gateway's buffer.
    const second = await at(t + LISTING + 30_000, () =>
      runGc({ store, prefix: 'kv', config, now: t + LISTING + 30_000 }),
    )
    expect(await present(store, chains[0]!)).toEqual([true, true, true, true])
    expect(second.namespaces[0]).toMatchObject({ deleted: { objects: 0 }, condemned: { objects: 11 } })
    // The read lands; the run after that sees it.
    await putRecord(store, [{ key: chains[0]![3]!.key, at: t + LISTING - 60_000 }])
    const third = await runGc({ store, prefix: 'kv', config, now: t + LISTING + WAIT })
    expect(third.namespaces[0]).toMatchObject({ deleted: { objects: 7 }, saved: 4 })
    expect(await present(store, chains[0]!)).toEqual([true, true, true, true])
    expect(await present(store, chains[1]!)).toEqual([false, false, false, false])
  })

  it('race 1 under a long listing: a later-dated condemnation from a concurrent run is not moved back to this run’s start', async () => {
    let t = Date.now()
    const { store, chains } = await fleet(() => t)
    t += 20 * DAY
    const config = config10d()
    // A concurrent run whose listing ended 5 minutes after this run started condemned chain 0.
    const early = encodeBatch({
      kind: 'condemned',
      at: t,
      uses: chains[0]!.map((c) => ({ key: c.key, at: t + 300_000 })),
      links: [],
    })
    await store.putIfAbsent(`${condemnedPrefix('kv', 'prod')}0000000000001-aa`, early, early.length)
    // This run lists for 10 minutes; chain 0 is read 9 minutes in (after its records were listed).
    const LISTING = 600_000
    const slowList: ObjectStore = {
      kind: store.kind,
      get: (n, o) => store.get(n, o),
      head: (n) => store.head(n),
      putIfAbsent: (n, b, sz) => store.putIfAbsent(n, b, sz),
      delete: (n) => store.delete(n),
      list: async (p, o) => {
        const page = await store.list(p, o)
        vi.setSystemTime(Date.now() + LISTING)
        return page
      },
    }
    await at(t, () => runGc({ store: slowList, prefix: 'kv', config, now: t }))
    // A run past condemnWait from this run's start, within maxDelay of the read: nothing is due.
    const next = await runGc({ store, prefix: 'kv', config, now: t + 60_000 + WAIT })
    expect(next.namespaces[0]).toMatchObject({ deleted: { objects: 0 } })
    expect(await present(store, chains[0]!)).toEqual([true, true, true, true])
    await putRecord(store, [{ key: chains[0]![3]!.key, at: t + LISTING - 60_000 }])
    const last = await runGc({ store, prefix: 'kv', config, now: t + LISTING + WAIT })
    expect(last.namespaces[0]).toMatchObject({ deleted: { objects: 7 }, saved: 4 })
    expect(await present(store, chains[0]!)).toEqual([true, true, true, true])
  })

  it('a chunk behind a hole goes with its descendants once older than the grace period; first chunks and young uploads stay', async () => {
    const store = new MemoryStore()
    const t0 = Date.now()
    const app = createGateway({ store, prefix: 'kv', coldTier: { now: () => t0 } })
    const chain = makeChain(5)
    // First chunks whose header parent is a namespace seed (as real chains have), not zeros.
    const seeded = makeChunk({ parent: key(0xabc), index: 0 })
    const olderGateway = makeChunk({ parent: key(0xabd), index: 0 })
    for (const c of [...chain, seeded, olderGateway])
      expect((await app.request(`/v1/ns/prod/chunks/${c.key}`, putInit(c.bytes))).status).toBe(201)
    await app.state.usage!.flush()
    // An older gateway's link names the seed (today's names ROOT_PARENT).
    const old = encodeBatch({
      kind: 'usage',
      at: t0,
      uses: [],
      links: [{ key: olderGateway.key, parent: key(0xabd), size: olderGateway.bytes.length, at: t0 }],
    })
    await store.putIfAbsent(`${usagePrefix('kv', 'prod')}2026010100/feedface-1`, old, old.length)
    // Lifecycle expiry (or a gc race) took chunk 1; a young upload's parent has not landed yet.
    await store.delete(`kv/prod/${chain[1]!.key.slice(0, 2)}/${chain[1]!.key}`)
    const young = makeChunk({ parent: key(0xdef), index: 3 })
    await at(t0 + 3_600_000 - 60_000, () =>
      store.putIfAbsent(`kv/prod/${young.key.slice(0, 2)}/${young.key}`, young.bytes, young.bytes.length),
    )
    const config = config10d()
    const r = await runGc({ store, prefix: 'kv', config, now: t0 + 3_600_000 })
    expect(r.errors).toEqual([])
    expect(await present(store, chain)).toEqual([true, false, false, false, false])
    expect(await present(store, [seeded, olderGateway, young])).toEqual([true, true, true])
    // Young: one header read (no link); the older gateway's root: one, to tell it from a hole.
    expect(r.namespaces[0]).toMatchObject({
      deleted: { objects: 3, orphan: 3, retention: 0 },
      condemned: { objects: 0 },
      headerReads: 2,
    })
    // The index remembers both first chunks: no header read for them again.
    const again = await runGc({ store, prefix: 'kv', config, now: t0 + 3_600_000 })
    expect(again.namespaces[0]).toMatchObject({ deleted: { objects: 0 }, headerReads: 0 })
    // Past the grace period the young chunk's parent is still missing: a hole, swept.
    const later = await runGc({ store, prefix: 'kv', config, now: t0 + 2 * 3_600_000 })
    expect(later.namespaces[0]).toMatchObject({ deleted: { objects: 1, orphan: 1 } })
    expect(await present(store, [chain[0]!, seeded, olderGateway, young])).toEqual([true, true, true, false])
  })

  it('a hole healed after the listing (the parent written again) is not swept; a namespace with no policy is never swept', async () => {
    const base = new MemoryStore()
    const app = createGateway({ store: base, prefix: 'kv', coldTier: false })
    const chain = makeChain(3)
    for (const c of chain) await app.request(`/v1/ns/prod/chunks/${c.key}`, putInit(c.bytes))
    const name1 = `kv/prod/${chain[1]!.key.slice(0, 2)}/${chain[1]!.key}`
    await base.delete(name1)
    const store: ObjectStore = {
      kind: base.kind,
      get: (n, o) => base.get(n, o),
      head: (n) => base.head(n),
      putIfAbsent: (n, b, sz) => base.putIfAbsent(n, b, sz),
      delete: (n) => base.delete(n),
      // A node writes chunk 1 again right after gc's listing.
      list: async (p, o) => {
        const page = await base.list(p, o)
        await base.putIfAbsent(name1, chain[1]!.bytes, chain[1]!.bytes.length)
        return page
      },
    }
    const none = await runGc({ store: base, prefix: 'kv', config: parseColdTier({}), now: Date.now() + DAY })
    expect(none.namespaces[0]).toMatchObject({ deleted: { objects: 0 } })
    const r = await runGc({ store, prefix: 'kv', config: config10d(), now: Date.now() + DAY })
    expect(r.namespaces[0]).toMatchObject({ deleted: { objects: 0 } })
    expect(await present(base, chain)).toEqual([true, true, true])
  })

  it('condemned lists that are corrupt, oversized, of another kind or newer are skipped, stale or future ones do not count: never an early or wrong delete', async () => {
    const t0 = Date.now()
    let t = t0
    const { store, app, chains } = await fleet(() => t)
    t += 20 * DAY
    await app.request(`/v1/ns/prod/chunks/${chains[0]![3]!.key}`) // chain 0 in use
    await app.state.usage!.flush()
    const dir = condemnedPrefix('kv', 'prod')
    const list = (keys: { key: string }[], when: number, kind: 'condemned' | 'usage' = 'condemned') =>
      encodeBatch({ kind, at: t, uses: keys.map((k) => ({ key: k.key, at: when })), links: [] })
    const put = (id: string, b: Uint8Array) => store.putIfAbsent(`${dir}0000000000001-${id}`, b, b.length)
    const corrupt = list(chains[1]!, t - DAY)
    corrupt[30] = (corrupt[30] ?? 0) ^ 1
    await put('aa', corrupt)
    await put('bb', list(chains[1]!, t - DAY, 'usage'))
    const newer = list(chains[1]!, t - DAY)
    newer[4] = 2
    await put('cc', newer)
    await put('dd', list(chains[2]!, t0 - 60_000)) // before the chunks were written: another object
    await put('ee', list(chains[2]!, t + 100 * DAY)) // in the future: counts as now
    await put('ff', list(chains[0]!, t - DAY)) // CRC-valid and old, but the plan keeps chain 0
    const huge = `${dir}0000000000001-99`
    const { store: listed, got } = listingHuge(store, huge, t)
    const config = config10d()
    const r = await runGc({ store: listed, prefix: 'kv', config, now: t })
    expect(got).not.toContain(huge)
    expect(r.namespaces[0]).toMatchObject({
      deleted: { objects: 0 },
      condemned: { objects: 7 },
      saved: 4,
      condemnedSkipped: 4,
    })
    for (const id of ['aa', 'bb', 'cc']) expect(r.errors.join('\n')).toContain(`-${id}`)
    expect(await store.head(`${dir}0000000000001-cc`)).toBeDefined() // kept for a newer gc
    expect(await store.head(`${dir}0000000000001-ff`)).toBeUndefined() // folded
    // Not one chunk goes before a run WAIT after this one.
    const early = await runGc({ store, prefix: 'kv', config, now: t + WAIT - 1 })
    expect(early.namespaces[0]).toMatchObject({ deleted: { objects: 0 }, condemned: { objects: 7 } })
    const due = await runGc({ store, prefix: 'kv', config, now: t + WAIT })
    expect(due.namespaces[0]).toMatchObject({ deleted: { objects: 7 } })
    expect(await present(store, chains[0]!)).toEqual([true, true, true, true])
  })

  it('a run that dies between its condemned list and its deletes loses nothing: the next run deletes tail-first', async () => {
    let t = Date.now()
    const { store, chains } = await fleet(() => t)
    t += 20 * DAY
    const config = config10d()
    // Chain 0 was last used just inside its retention at the first run, outside it at the next.
    await putRecord(store, [{ key: chains[0]![3]!.key, at: t - 10 * DAY + WAIT / 2 }])
    expect((await runGc({ store, prefix: 'kv', config, now: t })).namespaces[0]!.condemned.objects).toBe(7)
    // The next run's process dies once its condemned list is written: nothing after it lands.
    let dead = false
    const dying: ObjectStore = {
      kind: store.kind,
      get: (n, o) => (dead ? Promise.reject(new Error('killed')) : store.get(n, o)),
      head: (n) => (dead ? Promise.reject(new Error('killed')) : store.head(n)),
      putIfAbsent: async (n, b, sz) => {
        if (dead) throw new Error('killed')
        const r = await store.putIfAbsent(n, b, sz)
        if (n.includes('/_coldtier/condemned/')) dead = true
        return r
      },
      delete: (n) => (dead ? Promise.reject(new Error('killed')) : store.delete(n)),
      list: (p, o) => store.list(p, o),
    }
    const crashed = await runGc({ store: dying, prefix: 'kv', config, now: t + WAIT })
    expect(crashed.errors.length).toBeGreaterThan(0)
    for (const c of chains) expect(noHole(await present(store, c))).toBe(true)
    expect((await store.list(condemnedPrefix('kv', 'prod'))).entries).toHaveLength(2)
    const next = await runGc({ store, prefix: 'kv', config, now: t + WAIT })
    expect(next.errors).toEqual([])
    expect(next.namespaces[0]).toMatchObject({ deleted: { objects: 7 }, condemned: { objects: 4 }, saved: 0 })
    expect(await present(store, chains[0]!)).toEqual([true, true, true, true])
    expect(await present(store, chains[2]!)).toEqual([false, false, false])
    // The two lists were merged into one: chain 0, condemned by the run that died.
    const lists = (await store.list(condemnedPrefix('kv', 'prod'))).entries
    expect(lists).toHaveLength(1)
    const last = decodeBatch(
      new Uint8Array(await new Response((await store.get(lists[0]!.name))!.body).arrayBuffer()),
    )
    expect(last.uses.map((u) => [u.key, u.at]).sort()).toEqual(
      [...chains[0]!]
        .reverse()
        .map((c) => [c.key, t + WAIT])
        .sort(),
    )
  })

  it('--namespace: other namespaces are only accounted (sizes, not entries), their records and lists left alone', async () => {
    let t = Date.now()
    const store = new MemoryStore()
    const app = createGateway({ store, prefix: 'kv', coldTier: { now: () => t } })
    const prod = makeChain(2)
    const other = makeChain(3)
    for (const c of prod) await app.request(`/v1/ns/prod/chunks/${c.key}`, putInit(c.bytes))
    for (const c of other) await app.request(`/v1/ns/batch/chunks/${c.key}`, putInit(c.bytes))
    await app.state.usage!.flush()
    t += 20 * DAY
    const config = parseColdTier({ grace: '10m', namespaces: { '*': { retention: '10d' } } })
    const r = await runGc({ store, prefix: 'kv', config, now: t, namespaces: ['prod'] })
    expect(r.namespaces.map((n) => n.ns)).toEqual(['prod'])
    expect(r.namespaces[0]).toMatchObject({ condemned: { objects: 2 }, usageRecords: 1 })
    expect((await store.list(usagePrefix('kv', 'batch'))).entries).toHaveLength(1)
    expect((await store.list(condemnedPrefix('kv', 'batch'))).entries).toHaveLength(0)
    const snap = await readLatestSnapshot(store, 'kv')
    expect(snap?.namespaces).toEqual({
      prod: { objects: 2, bytes: prod[0]!.bytes.length * 2 },
      batch: { objects: 3, bytes: other[0]!.bytes.length * 3 },
    })
  })
})

describe('accounting on /metrics and the status page', () => {
  it('shows gc snapshot totals per namespace plus this instance’s creations since, with the monthly cost', async () => {
    const store = new MemoryStore()
    const app = createGateway({ store, prefix: 'kv', coldTier: { accountingRefreshMs: 0 } })
    const a = makeChain(3)
    for (const k of a) await app.request(`/v1/ns/prod/chunks/${k.key}`, putInit(k.bytes))
    const before = await (await app.request('/metrics')).text()
    // No gc yet: this instance's own creations only.
    expect(before).toMatch(/^kvgate_namespace_stored_objects\{ns="prod"\} 3$/m)
    await new Promise((r) => setTimeout(r, 1100)) // the next creation lands in a later second
    await runGc({ store, prefix: 'kv', config: parseColdTier({}) })
    const b = makeChain(2)
    for (const k of b) await app.request(`/v1/ns/prod/chunks/${k.key}`, putInit(k.bytes))
    const bytes = [...a, ...b].reduce((s, k) => s + k.bytes.length, 0)
    await app.request('/v1/ns/prod/lookup', {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ keys: a.map((k) => k.key) }),
    })
    const text = await (await app.request('/metrics')).text()
    expect(text).toMatch(/^kvgate_namespace_stored_objects\{ns="prod"\} 5$/m)
    // The snapshot counts the first three: their second is let go; the later ones' stay.
    const snapAt = (await readLatestSnapshot(store, 'kv'))!.at
    const seconds = [...app.state.usage!.createdBySecond.get('prod')!.keys()]
    expect(seconds.length).toBeGreaterThan(0)
    expect(seconds.every((s) => s + 1000 > snapAt)).toBe(true)
    expect(app.state.usage!.accountedBuckets).toBe(seconds.length)
    expect(text).toContain(`kvgate_namespace_stored_bytes{ns="prod"} ${bytes}`)
    expect(text).toContain(`kvgate_namespace_storage_usd_per_month{ns="prod"} ${(bytes / 1e9) * 0.023}`)
    expect(text).toMatch(/^kvgate_usage_hits_total 3$/m)
    const page = (await (await app.request('/', { headers: { accept: 'application/json' } })).json()) as {
      namespaces: { ns: string; objects: number; bytes: number }[]
      accountingAt: number
    }
    expect(page.namespaces).toEqual([{ ns: 'prod', objects: 5, bytes, monthlyUsd: (bytes / 1e9) * 0.023 }])
    expect(page.accountingAt).toBeGreaterThan(0)
    const html = await (await app.request('/')).text()
    expect(html).toContain('<td>prod</td><td>5</td>')
  })
})

describe('accounting snapshots from the bucket', () => {
  const put = (store: MemoryStore, name: string, bytes: Uint8Array) =>
    store.putIfAbsent(name, bytes, bytes.length).then((r) => expect(r).toBe('created'))
  const json = (v: unknown) => new TextEncoder().encode(JSON.stringify(v))
  const older = snapshotName('kv', 1_000, 'a')
  const newer = snapshotName('kv', 2_000, 'b')

  it('skips a snapshot over the size gc ever writes, without holding it, for the one before', async () => {
    const store = new MemoryStore()
    await put(
      store,
      older,
      json({ at: 1_000, source: 'listing', namespaces: { prod: { objects: 7, bytes: 70 } } }),
    )
    // Valid JSON, but larger than MAX_SNAPSHOT_BYTES: read until the cap, then given up.
    const pad = 'x'.repeat(MAX_SNAPSHOT_BYTES)
    await put(
      store,
      newer,
      json({ at: 2_000, source: 'listing', pad, namespaces: { prod: { objects: 9, bytes: 90 } } }),
    )
    const s = await readLatestSnapshot(store, 'kv')
    expect(s?.namespaces).toEqual({ prod: { objects: 7, bytes: 70 } })
  })

  it('refuses a snapshot whose namespace names or counts a gc could not have written (labels stay clean)', async () => {
    for (const namespaces of [
      { 'prod"} 1\nkvgate_fake{ns="x': { objects: 1, bytes: 1 } },
      { 'Prod/../x': { objects: 1, bytes: 1 } },
      { prod: { objects: -1, bytes: 1 } },
      { prod: { objects: 1.5, bytes: 1 } },
      { prod: { objects: 1, bytes: 1e300 } },
    ]) {
      expect(parseSnapshot(json({ at: 1, source: 'listing', namespaces }))).toBeUndefined()
    }
    expect(
      parseSnapshot(json({ at: 1, source: 'listing', namespaces: { prod: { objects: 1, bytes: 1 } } })),
    ).toBeDefined()
    const store = new MemoryStore()
    await put(
      store,
      older,
      json({ at: 1_000, source: 'listing', namespaces: { prod: { objects: 7, bytes: 70 } } }),
    )
    await put(
      store,
      newer,
      json({
        at: 2_000,
        source: 'listing',
        namespaces: { 'a"} 1\nkvgate_fake 1\nx{ns="': { objects: 1, bytes: 1 } },
      }),
    )
    const app = createGateway({ store, prefix: 'kv', coldTier: { accountingRefreshMs: 0 } })
    await app.request('/metrics')
    const text = await (await app.request('/metrics')).text()
    expect(text).not.toMatch(/^kvgate_fake/m)
    expect(text).toMatch(/^kvgate_namespace_stored_objects\{ns="prod"\} 7$/m)
  })
})

describe('kvgate gc (CLI) on an fs store', () => {
  it('dry-runs, then deletes over quota from the tails, prints a summary, and rejects bad config', async () => {
    const { mkdtempSync, rmSync } = await import('node:fs')
    const { tmpdir } = await import('node:os')
    const { join } = await import('node:path')
    const { FsStore } = await import('../src/gateway/stores/fs.ts')
    const { run } = await import('../src/cli/commands/gc.ts')
    const dir = mkdtempSync(join(tmpdir(), 'kvgate-gc-cli-'))
    const saved = { ...process.env }
    const logs: string[] = []
    const log = console.log
    console.log = (s: string) => logs.push(String(s))
    try {
      const store = await new FsStore({ root: dir }).open()
      const app = createGateway({ store, prefix: 'kv', coldTier: false })
      const chain = makeChain(4)
      for (const k of chain) await app.request(`/v1/ns/prod/chunks/${k.key}`, putInit(k.bytes))
      process.env.KVGATE_CONFIG = ''
      process.env.KVGATE_COLD_TIER = JSON.stringify({
        grace: '0s',
        namespaces: { prod: { quota: chain[0]!.bytes.length } },
      })
      expect(await run(['--dir', dir, '--prefix', 'kv', '--dry-run', '--quiet'])).toBe(0)
      expect(logs.join('\n')).toMatch(
        /dry run[\s\S]*prod: quota[\s\S]*would delete 0 objects[\s\S]*would condemn 3 objects/,
      )
      expect((await store.stats()).objects).toBe(4)
      logs.length = 0
      expect(await run(['--dir', dir, '--prefix', 'kv', '--quiet'])).toBe(0)
      expect(logs.join('\n')).toMatch(/deleted\s+0 objects[\s\S]*condemned\s+3 objects/)
      logs.length = 0
      // The next run, past the wait (only Date moves: the files keep their real times).
      vi.useFakeTimers({ now: Date.now() + WAIT + 1000, toFake: ['Date'] })
      try {
        expect(await run(['--dir', dir, '--prefix', 'kv', '--quiet'])).toBe(0)
      } finally {
        vi.useRealTimers()
      }
      expect(logs.join('\n')).toMatch(/deleted\s+3 objects[\s\S]*kept\s+1 objects/)
      const left = (await store.list('kv/prod/')).entries.map((e) => e.name.slice(-64))
      expect(left).toEqual([chain[0]!.key])
      process.env.KVGATE_COLD_TIER = '{"namespaces":{"prod":{"quota":"lots"}}}'
      await expect(run(['--dir', dir, '--quiet'])).rejects.toMatchObject({ code: 'ERR_CONFIG' })
      expect(await run(['--dir', dir, '--concurrency', '0'])).toBe(2)
    } finally {
      console.log = log
      for (const k of Object.keys(process.env)) if (!(k in saved)) delete process.env[k]
      Object.assign(process.env, saved)
      rmSync(dir, { recursive: true, force: true })
    }
  })
})
