// Presence and corruption heal (issue 11, contracts C1–C3), on memory stores through
// app.request: objects deleted or rotted behind the gateway stop being reported,
// are re-stored by the next writer, and what is served is what was stored or a miss.

import { describe, expect, it } from 'vitest'
import { crc32 } from '../src/core/checksum.ts'
import { openLayerSubset } from '../src/core/format.ts'
import { objectName } from '../src/core/keys.ts'
import { createGateway, hashToken, MemoryStore } from '../src/gateway/index.ts'
import type { GetOptions } from '../src/gateway/stores/types.ts'
import { makeChain, makeChunk, putInit } from './gateway-fixtures.ts'

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms))
const lookupInit = (keys: string[]): RequestInit => ({
  method: 'POST',
  headers: { 'content-type': 'application/json' },
  body: JSON.stringify({ keys }),
})
type App = ReturnType<typeof createGateway>
const present = async (app: App, ns: string, keys: string[]) =>
  ((await (await app.request(`/v1/ns/${ns}/lookup`, lookupInit(keys))).json()) as { present: number }).present
const name = (ns: string, key: string) => objectName('kvgate', ns, key)

/** Swaps the stored bytes behind the gateway (bit rot, a foreign writer). */
async function replace(store: MemoryStore, n: string, bytes: Uint8Array) {
  await store.delete(n)
  await store.putIfAbsent(n, bytes, bytes.length)
}

/** Reads a response body; resolves to an Error when the body failed mid-stream. */
async function body(r: Response): Promise<Uint8Array | Error> {
  try {
    return new Uint8Array(await r.arrayBuffer())
  } catch (e) {
    return e as Error
  }
}

describe('presence heals', () => {
  it('a GET that finds no object makes lookups stop at it, and a re-PUT stores it', async () => {
    const store = new MemoryStore()
    const app = createGateway({ store })
    const chain = makeChain(40)
    const keys = chain.map((c) => c.key)
    for (const c of chain)
      expect((await app.request(`/v1/ns/a/chunks/${c.key}`, putInit(c.bytes))).status).toBe(201)
    expect(await present(app, 'a', keys)).toBe(40)
    // Lifecycle expiry removes the chain's oldest chunks behind the gateway.
    await store.delete(name('a', keys[1]!))
    await store.delete(name('a', keys[2]!))
    expect((await app.request(`/v1/ns/a/chunks/${keys[1]}`)).status).toBe(404)
    // Chunk 39 is still stored and cached, yet the lookup must not infer 1 back.
    expect(await present(app, 'a', keys)).toBe(1)
    expect((await app.request(`/v1/ns/a/chunks/${keys[1]}`, { method: 'HEAD' })).status).toBe(404)
    // The create-only PUT asks the store, not the cache: the next writer re-stores both.
    const r1 = await app.request(`/v1/ns/a/chunks/${keys[1]}`, putInit(chain[1]!.bytes))
    expect(r1.status).toBe(201)
    expect(await present(app, 'a', keys)).toBe(2)
    expect((await app.request(`/v1/ns/a/chunks/${keys[2]}`, putInit(chain[2]!.bytes))).status).toBe(201)
    expect(await present(app, 'a', keys)).toBe(40)
    expect((await store.stats()).objects).toBe(40)
  })

  it('a miss forgets the later keys of its chain, so they are asked of the store again', async () => {
    const store = new MemoryStore()
    const app = createGateway({ store })
    const chain = makeChain(12)
    const keys = chain.map((c) => c.key)
    for (const c of chain) await app.request(`/v1/ns/a/chunks/${c.key}`, putInit(c.bytes))
    expect(await present(app, 'a', keys)).toBe(12)
    const before = app.state.lookup.cacheSize
    await store.delete(name('a', keys[4]!))
    expect((await app.request(`/v1/ns/a/chunks/${keys[4]}?layers=0-1`)).status).toBe(404)
    expect(app.state.lookup.cacheSize).toBe(before - 8)
    expect(app.state.metrics.invalidations.value()).toBe(8)
  })

  it('a re-PUT of an object deleted behind the gateway is stored, not answered "exists" from the cache', async () => {
    const store = new MemoryStore()
    const app = createGateway({ store })
    const c = makeChunk()
    await app.request(`/v1/ns/a/chunks/${c.key}`, putInit(c.bytes))
    await store.delete(name('a', c.key))
    const r = await app.request(`/v1/ns/a/chunks/${c.key}`, putInit(c.bytes))
    expect(r.status).toBe(201)
    expect(await store.head(name('a', c.key))).toEqual({ size: c.bytes.length, etag: expect.any(String) })
  })

  it('cached presence expires after presenceTtlMs: the lookup asks the store again', async () => {
    const store = new MemoryStore()
    const app = createGateway({ store, lookup: { presenceTtlMs: 1000 } })
    const chain = makeChain(30)
    const keys = chain.map((c) => c.key)
    for (const c of chain) await app.request(`/v1/ns/a/chunks/${c.key}`, putInit(c.bytes))
    await present(app, 'a', keys)
    const warm = await app.request('/v1/ns/a/lookup', lookupInit(keys))
    expect(warm.headers.get('x-kvgate-store-requests')).toBe('0')
    // Only half the chain is left; no GET told this gateway.
    for (const k of keys.slice(15)) await store.delete(name('a', k))
    await sleep(1100)
    const cold = await app.request('/v1/ns/a/lookup', lookupInit(keys))
    expect(Number(cold.headers.get('x-kvgate-store-requests'))).toBeGreaterThan(0)
    expect(((await cold.json()) as { present: number }).present).toBe(15)
  })

  it('repeating a lookup does not keep an inferred presence alive past its TTL', async () => {
    const store = new MemoryStore()
    const app = createGateway({ store, lookup: { presenceTtlMs: 100 } })
    const chain = makeChain(30)
    const keys = chain.map((c) => c.key)
    for (const c of chain) await store.putIfAbsent(name('a', c.key), c.bytes, c.bytes.length)
    expect(await present(app, 'a', keys)).toBe(30)
    let asked = 0
    for (let i = 0; i < 8; i++) {
      await sleep(25)
      const r = await app.request('/v1/ns/a/lookup', lookupInit(keys))
      asked += Number(r.headers.get('x-kvgate-store-requests'))
    }
    expect(asked).toBeGreaterThan(0)
  })
})

describe('corruption heals (C1)', () => {
  it('a GET of a rotten object fails its body, is counted, and the object is deleted for the next writer', async () => {
    const store = new MemoryStore()
    const app = createGateway({ store })
    const c = makeChunk({ layers: 4, sectionBytes: 4096 })
    await app.request(`/v1/ns/a/chunks/${c.key}`, putInit(c.bytes))
    const rotten = c.bytes.slice()
    rotten[rotten.length - 100]! ^= 0x10
    await replace(store, name('a', c.key), rotten)
    const g = await app.request(`/v1/ns/a/chunks/${c.key}`)
    expect(g.status).toBe(200)
    expect(await body(g)).toBeInstanceOf(Error)
    expect(app.state.metrics.corruptReads.value()).toBe(1)
    for (let i = 0; i < 50 && (await store.head(name('a', c.key))); i++) await sleep(10)
    expect(await store.head(name('a', c.key))).toBeUndefined()
    expect(app.state.metrics.corrupt.value({ by: 'get' })).toBe(1)
    expect(app.state.metrics.render()).toContain('kvgate_corrupt_objects_total{by="get"} 1')
    expect((await app.request(`/v1/ns/a/chunks/${c.key}`, putInit(c.bytes))).status).toBe(201)
    expect(await body(await app.request(`/v1/ns/a/chunks/${c.key}`))).toEqual(c.bytes)
  })

  it('a layer GET of a rotten section fails its body', async () => {
    const store = new MemoryStore()
    const app = createGateway({ store })
    const c = makeChunk({ layers: 6, sectionBytes: 1000 })
    await app.request(`/v1/ns/a/chunks/${c.key}`, putInit(c.bytes))
    const rotten = c.bytes.slice()
    rotten[rotten.length - 1500]! ^= 1 // inside section 4
    await replace(store, name('a', c.key), rotten)
    expect(await body(await app.request(`/v1/ns/a/chunks/${c.key}?layers=0-2`))).toBeInstanceOf(Uint8Array)
    expect(await body(await app.request(`/v1/ns/a/chunks/${c.key}?layers=3-5`))).toBeInstanceOf(Error)
    expect(app.state.metrics.corruptReads.value({ layers: 'true' })).toBe(1)
  })

  it('a layer GET of an object whose header is rotten or names another chunk: 502, counted, healed', async () => {
    for (const kind of ['rotten header', 'another key', 'another namespace id']) {
      const store = new MemoryStore()
      const ns = 'ab'.repeat(16)
      const app = createGateway({ store })
      const c = makeChunk({ layers: 4, sectionBytes: 1000, namespaceId: ns })
      const n = objectName('kvgate', ns, c.key)
      const bytes =
        kind === 'another key'
          ? makeChunk({ layers: 4, sectionBytes: 1000, namespaceId: ns }).bytes
          : kind === 'another namespace id'
            ? makeChunk({ layers: 4, sectionBytes: 1000, key: c.key, namespaceId: 'cd'.repeat(16) }).bytes
            : c.bytes.slice()
      if (kind === 'rotten header') bytes[30]! ^= 0x01
      await replace(store, n, bytes)
      const r = await app.request(`/v1/ns/${ns}/chunks/${c.key}?layers=0-1`)
      expect(r.status, kind).toBe(502)
      expect(app.state.metrics.corruptReads.value({ layers: 'true' }), kind).toBe(1)
      for (let i = 0; i < 50 && (await store.head(n)); i++) await sleep(10)
      expect(await store.head(n), kind).toBeUndefined()
      expect((await app.request(`/v1/ns/${ns}/chunks/${c.key}`, putInit(c.bytes))).status, kind).toBe(201)
      const good = await app.request(`/v1/ns/${ns}/chunks/${c.key}?layers=0-1`)
      expect(good.status, kind).toBe(200)
      expect(await body(good), kind).toBeInstanceOf(Uint8Array)
    }
  })

  it("a layer GET of an object cut short or with bytes past its header's length: 502, counted, healed", async () => {
    for (const kind of ['cut short', 'trailing bytes']) {
      const store = new MemoryStore()
      const app = createGateway({ store })
      const c = makeChunk({ layers: 4, sectionBytes: 1000 })
      const n = name('a', c.key)
      await replace(
        store,
        n,
        kind === 'cut short' ? c.bytes.slice(0, -10) : Uint8Array.from([...c.bytes, 1, 2, 3]),
      )
      // Every layer: the object is not the one its header describes, whichever layers are asked.
      const r = await app.request(`/v1/ns/a/chunks/${c.key}?layers=0-1`)
      expect(r.status, kind).toBe(502)
      expect(app.state.metrics.corruptReads.value({ layers: 'true' }), kind).toBe(1)
      for (let i = 0; i < 50 && (await store.head(n)); i++) await sleep(10)
      expect(await store.head(n), kind).toBeUndefined()
      expect((await app.request(`/v1/ns/a/chunks/${c.key}`, putInit(c.bytes))).status, kind).toBe(201)
      expect(await body(await app.request(`/v1/ns/a/chunks/${c.key}?layers=0-1`)), kind).toBeInstanceOf(
        Uint8Array,
      )
    }
  })

  it('a store that sends more bytes than it said is at fault, not the object: 502, nothing deleted', async () => {
    class Overlong extends MemoryStore {
      cancelled = 0
      override async get(n: string, opts?: Parameters<MemoryStore['get']>[1]) {
        const obj = await super.get(n, opts)
        if (!obj) return obj
        const extra = new Uint8Array(100).fill(7)
        const reader = obj.body.getReader()
        let tail = false
        const body = new ReadableStream<Uint8Array>(
          {
            async pull(c) {
              const r = await reader.read()
              if (!r.done) return c.enqueue(r.value)
              if (tail) return c.close()
              tail = true
              c.enqueue(extra)
            },
            cancel: () => {
              this.cancelled++
            },
          },
          { highWaterMark: 0 },
        )
        return { ...obj, body }
      }
    }
    const store = new Overlong()
    const app = createGateway({ store })
    const c = makeChunk()
    expect((await app.request(`/v1/ns/a/chunks/${c.key}`, putInit(c.bytes))).status).toBe(201)
    const v = await app.request(`/v1/ns/a/chunks/${c.key}/verify`, { method: 'POST' })
    expect(v.status).toBe(502)
    expect(((await v.json()) as { error: { code: string } }).error.code).toBe('ERR_STORE')
    expect(await store.head(name('a', c.key))).toBeDefined()
    expect(store.cancelled).toBe(1) // the store's stream released, not left open
  })

  it('POST …/verify: ok keeps an intact object, corrupt deletes it, missing says so', async () => {
    const store = new MemoryStore()
    const tokens = { writer: 'w-token', reader: 'r-token' }
    const app = createGateway({
      store,
      auth: {
        tokens: [
          { name: 'w', sha256: await hashToken(tokens.writer), scopes: 'write', namespaces: ['a'] },
          { name: 'r', sha256: await hashToken(tokens.reader), scopes: 'read', namespaces: ['a'] },
        ],
      },
    })
    const auth = (t: string) => ({ authorization: `Bearer ${t}` })
    const verify = (key: string, t = tokens.writer) =>
      app.request(`/v1/ns/a/chunks/${key}/verify`, { method: 'POST', headers: auth(t) })
    const c = makeChunk()
    await app.request(`/v1/ns/a/chunks/${c.key}`, putInit(c.bytes, tokens.writer))
    expect((await verify(c.key, tokens.reader)).status).toBe(403)
    const ok = await verify(c.key)
    expect(ok.status).toBe(200)
    expect(await ok.json()).toEqual({ key: c.key, verdict: 'ok', deleted: false })
    expect(await store.head(name('a', c.key))).toBeDefined()
    // Bytes that are a sound chunk of another key are corrupt under this name.
    const other = makeChunk()
    await replace(store, name('a', c.key), other.bytes)
    expect(await (await verify(c.key)).json()).toEqual({ key: c.key, verdict: 'corrupt', deleted: true })
    expect(await store.head(name('a', c.key))).toBeUndefined()
    expect(app.state.metrics.corrupt.value({ by: 'verify' })).toBe(1)
    expect(await (await verify(c.key)).json()).toEqual({ key: c.key, verdict: 'missing', deleted: false })
    // A truncated object is corrupt too.
    await app.request(`/v1/ns/a/chunks/${c.key}`, putInit(c.bytes, tokens.writer))
    await replace(store, name('a', c.key), c.bytes.subarray(0, c.bytes.length - 1))
    expect(((await (await verify(c.key)).json()) as { verdict: string }).verdict).toBe('corrupt')
  })

  // docs/format.md: new codecs, flags and versions are added so that older readers refuse them
  // cleanly. A fleet mid-upgrade has older gateways reading a newer writer's chunks: refused, not rot.
  it('a chunk in a format this build cannot read (intact header: a newer writer) is refused, never deleted', async () => {
    const newer = (at: number, value: number) => (b: Uint8Array) => {
      const dv = new DataView(b.buffer, b.byteOffset, b.byteLength)
      if (at === 4) dv.setUint16(4, value, true)
      else b[at] = value
      const hb = dv.getUint32(8, true)
      dv.setUint32(hb - 4, crc32(b.subarray(0, hb - 4)), true)
      return b
    }
    const cases: [string, (b: Uint8Array) => Uint8Array][] = [
      ['format version 3', newer(4, 3)],
      ['a new codec code', newer(24, 200)],
      ['a new flag', newer(6, 4)],
      ['a new dtype code', newer(26, 200)],
    ]
    for (const [kind, mutate] of cases) {
      const store = new MemoryStore()
      const app = createGateway({ store })
      const c = makeChunk({ layers: 4, sectionBytes: 1000 })
      const n = name('a', c.key)
      await replace(store, n, mutate(c.bytes.slice()))
      // Refused before any byte (its header is read first: the ETag comes from it).
      expect((await app.request(`/v1/ns/a/chunks/${c.key}`)).status, kind).toBe(502)
      expect((await app.request(`/v1/ns/a/chunks/${c.key}?layers=0-1`)).status, kind).toBe(502)
      const v = await app.request(`/v1/ns/a/chunks/${c.key}/verify`, { method: 'POST' })
      expect(v.status, kind).toBe(502)
      await sleep(50) // the GETs' background verifications
      expect(await store.head(n), kind).toBeDefined()
      expect(app.state.metrics.corrupt.value({ by: 'get' }), kind).toBe(0)
      // The same change with a header that no longer matches its CRC is rot: deleted.
      const rotten = mutate(c.bytes.slice())
      rotten[20]! ^= 0x40
      await replace(store, n, rotten)
      expect(
        await (await app.request(`/v1/ns/a/chunks/${c.key}/verify`, { method: 'POST' })).json(),
        kind,
      ).toEqual({
        key: c.key,
        verdict: 'corrupt',
        deleted: true,
      })
    }
  })

  it("a newer writer's object is verified once per key and size, not on every GET (the verdict is remembered)", async () => {
    let wholeReads = 0
    class CountingStore extends MemoryStore {
      override get(n: string, opts: GetOptions = {}) {
        if (!opts.range) wholeReads++
        return super.get(n, opts)
      }
    }
    const store = new CountingStore()
    const app = createGateway({ store })
    const c = makeChunk({ layers: 4, sectionBytes: 1000 })
    const n = name('a', c.key)
    const newer = (b: Uint8Array) => {
      const dv = new DataView(b.buffer, b.byteOffset, b.byteLength)
      dv.setUint16(4, 3, true) // format version 3, its header CRC intact
      const hb = dv.getUint32(8, true)
      dv.setUint32(hb - 4, crc32(b.subarray(0, hb - 4)), true)
      return b
    }
    await replace(store, n, newer(c.bytes.slice()))
    const gets = async (times: number) => {
      for (let i = 0; i < times; i++) {
        expect((await app.request(`/v1/ns/a/chunks/${c.key}`)).status).toBe(502)
        expect((await app.request(`/v1/ns/a/chunks/${c.key}?layers=0-1`)).status).toBe(502)
        await sleep(20) // let a background verification run
      }
    }
    await gets(5)
    // Five whole GETs read the object whole once each; one verification read it whole once more.
    expect(wholeReads).toBe(5 + 1)
    expect(await store.head(n)).toBeDefined()
    // Another object under the key (another size): verified again, once.
    const bigger = makeChunk({ layers: 4, sectionBytes: 1500, key: c.key })
    await replace(store, n, newer(bigger.bytes.slice()))
    wholeReads = 0
    await gets(3)
    expect(wholeReads).toBe(3 + 1)
  })

  it('an intact header refused for anything but a newer feature (a reserved byte set) is still corrupt: deleted', async () => {
    const store = new MemoryStore()
    const app = createGateway({ store })
    const c = makeChunk({ layers: 4, sectionBytes: 1000 })
    const b = c.bytes.slice()
    const dv = new DataView(b.buffer)
    b[27] = 1 // reserved, must be zero
    const hb = dv.getUint32(8, true)
    dv.setUint32(hb - 4, crc32(b.subarray(0, hb - 4)), true)
    await replace(store, name('a', c.key), b)
    expect(await (await app.request(`/v1/ns/a/chunks/${c.key}/verify`, { method: 'POST' })).json()).toEqual({
      key: c.key,
      verdict: 'corrupt',
      deleted: true,
    })
  })

  it('a namespace named by its 32-hex id accepts only chunks carrying that id (PUT, GET, verify)', async () => {
    const store = new MemoryStore()
    const app = createGateway({ store })
    const ns = 'ab'.repeat(16)
    const mine = makeChunk({ namespaceId: ns })
    const foreign = makeChunk({ namespaceId: 'cd'.repeat(16) })
    expect((await app.request(`/v1/ns/${ns}/chunks/${mine.key}`, putInit(mine.bytes))).status).toBe(201)
    const r = await app.request(`/v1/ns/${ns}/chunks/${foreign.key}`, putInit(foreign.bytes))
    expect(r.status).toBe(400)
    expect(await store.head(name(ns, foreign.key))).toBeUndefined()
    // A foreign object placed behind the gateway verifies corrupt, and is never served.
    await store.putIfAbsent(name(ns, foreign.key), foreign.bytes, foreign.bytes.length)
    const v = await app.request(`/v1/ns/${ns}/chunks/${foreign.key}/verify`, { method: 'POST' })
    expect(((await v.json()) as { verdict: string }).verdict).toBe('corrupt')
    await store.putIfAbsent(name(ns, foreign.key), foreign.bytes, foreign.bytes.length)
    expect((await app.request(`/v1/ns/${ns}/chunks/${foreign.key}`)).status).toBe(502)
    expect(await body(await app.request(`/v1/ns/${ns}/chunks/${mine.key}`))).toEqual(mine.bytes)
  })
})

describe('two gateway instances over one store', () => {
  it('?layers= never splices a header cached before a DELETE + re-PUT elsewhere onto new sections', async () => {
    const store = new MemoryStore()
    const a = createGateway({ store })
    const b = createGateway({ store })
    const c1 = makeChunk({ layers: 6, sectionBytes: 100 })
    await a.request(`/v1/ns/n/chunks/${c1.key}`, putInit(c1.bytes))
    expect(await body(await a.request(`/v1/ns/n/chunks/${c1.key}?layers=1-2`))).toBeInstanceOf(Uint8Array)
    for (const c2 of [
      // Another geometry (a lossy re-encode), then same size, other bytes.
      makeChunk({ layers: 6, sectionBytes: 180, key: c1.key }),
      makeChunk({ layers: 6, sectionBytes: 180, key: c1.key }),
    ]) {
      const admin = await b.request(`/v1/ns/n/chunks/${c1.key}`, { method: 'DELETE' })
      expect(admin.status).toBe(204)
      expect((await b.request(`/v1/ns/n/chunks/${c1.key}`, putInit(c2.bytes))).status).toBe(201)
      const got = await body(await a.request(`/v1/ns/n/chunks/${c1.key}?layers=1-2`))
      expect(got).toBeInstanceOf(Uint8Array)
      const subset = openLayerSubset(got as Uint8Array, 1, 2)
      for (const l of [1, 2]) {
        const s = subset.header.sections[l]!
        expect(subset.section(l)).toEqual(c2.bytes.subarray(s.offset, s.offset + s.length))
      }
    }
  })
})

describe('a heal racing a re-PUT', () => {
  /** A store whose reads send their bytes only when the test says (a slow store). */
  class GatedStore extends MemoryStore {
    gate: Promise<void> | undefined
    override async get(n: string, opts?: Parameters<MemoryStore['get']>[1]) {
      const obj = await super.get(n, opts)
      const gate = this.gate
      if (!obj || !gate) return obj
      const reader = obj.body.getReader()
      const body = new ReadableStream<Uint8Array>({
        async pull(c) {
          await gate
          const r = await reader.read()
          if (r.done) c.close()
          else c.enqueue(r.value)
        },
      })
      return { ...obj, body }
    }
  }

  it('deletes only the corrupt version it read: a sound copy put back meanwhile stays', async () => {
    const store = new GatedStore()
    const app = createGateway({ store })
    const c = makeChunk()
    const n = name('a', c.key)
    await replace(store, n, makeChunk().bytes) // a sound chunk of another key: corrupt under this name
    let open!: () => void
    store.gate = new Promise((r) => {
      open = r
    })
    const verdict = app.request(`/v1/ns/a/chunks/${c.key}/verify`, { method: 'POST' })
    await sleep(20)
    // While the verify reads: the object goes (an operator, gc) and a writer puts the real bytes.
    store.gate = undefined
    await replace(store, n, c.bytes)
    open()
    const v = (await (await verdict).json()) as { verdict: string; deleted: boolean }
    expect(v.verdict).toBe('corrupt')
    expect(v.deleted).toBe(false)
    const got = await app.request(`/v1/ns/a/chunks/${c.key}`)
    expect(got.status).toBe(200)
    expect(await body(got)).toEqual(c.bytes)
  })
})
