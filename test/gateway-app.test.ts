// The gateway app on a memory store, driven through app.request (no network):
// the /v1 API, verification, create-only semantics, ranges and layers, auth, errors.

import { describe, expect, it } from 'vitest'
import { crc32 } from '../src/core/checksum.ts'
import { StoreError } from '../src/core/errors.ts'
import {
  FIXED_HEADER_BYTES,
  headerBytesFor,
  openLayerSubset,
  readHeaderLength,
  SECTION_ENTRY_BYTES,
} from '../src/core/format.ts'
import { objectName } from '../src/core/keys.ts'
import { createGateway, hashToken, MemoryStore } from '../src/gateway/index.ts'
import { concatPieces, type GetOptions, resolveRange, type StoreObject } from '../src/gateway/stores/types.ts'
import { makeChain, makeChunk, putInit } from './gateway-fixtures.ts'

function setup(opts: Partial<Parameters<typeof createGateway>[0]> = {}) {
  const ops: string[] = []
  const store = new MemoryStore({ onOp: (op) => ops.push(op) })
  const app = createGateway({ store, ...opts })
  return { app, store, ops }
}

const json = async (r: Response) => (await r.json()) as Record<string, unknown>
const errCode = async (r: Response) => ((await r.json()) as { error: { code: string } }).error.code

describe('PUT and GET', () => {
  it('stores a verified chunk once and reads it back byte for byte', async () => {
    const { app } = setup()
    const c = makeChunk()
    const r1 = await app.request(`/v1/ns/team/chunks/${c.key}`, putInit(c.bytes))
    expect(r1.status).toBe(201)
    expect(await json(r1)).toEqual({ status: 'created', bytes: c.bytes.length })
    const r2 = await app.request(`/v1/ns/team/chunks/${c.key}`, putInit(c.bytes))
    expect(r2.status).toBe(200)
    expect(await json(r2)).toEqual({ status: 'exists', bytes: c.bytes.length })
    const g = await app.request(`/v1/ns/team/chunks/${c.key}`)
    expect(g.status).toBe(200)
    expect(g.headers.get('content-length')).toBe(String(c.bytes.length))
    expect(new Uint8Array(await g.arrayBuffer())).toEqual(c.bytes)
  })

  it('answers HEAD with the size and 404 for an absent chunk', async () => {
    const { app } = setup()
    const c = makeChunk()
    expect((await app.request(`/v1/ns/a/chunks/${c.key}`, { method: 'HEAD' })).status).toBe(404)
    await app.request(`/v1/ns/a/chunks/${c.key}`, putInit(c.bytes))
    const h = await app.request(`/v1/ns/a/chunks/${c.key}`, { method: 'HEAD' })
    expect(h.status).toBe(200)
    expect(h.headers.get('content-length')).toBe(String(c.bytes.length))
    const g = await app.request(`/v1/ns/a/chunks/${makeChunk().key}`)
    expect(g.status).toBe(404)
    expect(await errCode(g)).toBe('ERR_NOT_FOUND')
  })

  it('serves byte ranges (a-b, a-, suffix) and 416 past the end', async () => {
    const { app } = setup()
    const c = makeChunk()
    await app.request(`/v1/ns/a/chunks/${c.key}`, putInit(c.bytes))
    const url = `/v1/ns/a/chunks/${c.key}`
    const r = await app.request(url, { headers: { range: 'bytes=10-19' } })
    expect(r.status).toBe(206)
    expect(r.headers.get('content-range')).toBe(`bytes 10-19/${c.bytes.length}`)
    expect(new Uint8Array(await r.arrayBuffer())).toEqual(c.bytes.subarray(10, 20))
    const open = await app.request(url, { headers: { range: `bytes=${c.bytes.length - 5}-` } })
    expect(new Uint8Array(await open.arrayBuffer())).toEqual(c.bytes.subarray(c.bytes.length - 5))
    const suffix = await app.request(url, { headers: { range: 'bytes=-7' } })
    expect(new Uint8Array(await suffix.arrayBuffer())).toEqual(c.bytes.subarray(c.bytes.length - 7))
    const past = await app.request(url, { headers: { range: `bytes=${c.bytes.length}-` } })
    expect(past.status).toBe(416)
    expect(await errCode(past)).toBe('ERR_RANGE_NOT_SATISFIABLE')
    expect((await app.request(url, { headers: { range: 'bytes=0-1,5-6' } })).status).toBe(400)
    expect((await app.request(url, { headers: { range: 'bytes=9-3' } })).status).toBe(416)
  })

  it('a 416 says the current length: Content-Range: bytes */size (RFC 9110 §15.5.17)', async () => {
    const { app } = setup()
    const c = makeChunk()
    await app.request(`/v1/ns/a/chunks/${c.key}`, putInit(c.bytes))
    const url = `/v1/ns/a/chunks/${c.key}`
    // Past the end, an empty suffix, and an inverted range (end before start) alike.
    for (const range of [`bytes=${c.bytes.length}-`, 'bytes=-0', 'bytes=9-3']) {
      const r = await app.request(url, { headers: { range } })
      expect([range, r.status, r.headers.get('content-range')]).toEqual([
        range,
        416,
        `bytes */${c.bytes.length}`,
      ])
      expect(await errCode(r)).toBe('ERR_RANGE_NOT_SATISFIABLE')
    }
    // An inverted range of an absent chunk is a miss, not a 416 without a length.
    const gone = await app.request(`/v1/ns/a/chunks/${makeChunk().key}`, { headers: { range: 'bytes=9-3' } })
    expect(gone.status).toBe(404)
    // Not a Range request: a layer span past the end says nothing about bytes.
    const layers = await app.request(`${url}?layers=0-99`)
    expect([layers.status, layers.headers.get('content-range')]).toEqual([416, null])
  })

  it('serves ?layers=a-b as header + contiguous sections a..b', async () => {
    const { app } = setup()
    const c = makeChunk({ layers: 6, sectionBytes: 100 })
    await app.request(`/v1/ns/a/chunks/${c.key}`, putInit(c.bytes))
    const r = await app.request(`/v1/ns/a/chunks/${c.key}?layers=2-4`)
    expect(r.status).toBe(200)
    expect(r.headers.get('x-kvgate-layers')).toBe('2-4')
    const body = new Uint8Array(await r.arrayBuffer())
    const subset = openLayerSubset(body, 2, 4)
    for (let l = 2; l <= 4; l++) {
      const s = subset.header.sections[l]!
      expect(subset.section(l)).toEqual(c.bytes.subarray(s.offset, s.offset + s.length))
    }
    expect((await app.request(`/v1/ns/a/chunks/${c.key}?layers=4-9`)).status).toBe(416)
    expect((await app.request(`/v1/ns/a/chunks/${c.key}?layers=x`)).status).toBe(400)
    expect(
      (await app.request(`/v1/ns/a/chunks/${c.key}?layers=1-2`, { headers: { range: 'bytes=0-1' } })).status,
    ).toBe(400)
  })

  it('HEAD ?layers=a-b answers the length GET ?layers=a-b sends, and its errors', async () => {
    const { app } = setup()
    const c = makeChunk({ layers: 6, sectionBytes: 100 })
    const url = `/v1/ns/a/chunks/${c.key}`
    await app.request(url, putInit(c.bytes))
    for (const spec of ['2-4', '0-0', '5-5', '0-5']) {
      // Cold (the header read for the HEAD) and warm (cached by the GET) alike.
      for (const round of [0, 1]) {
        const h = await app.request(`${url}?layers=${spec}`, { method: 'HEAD' })
        const g = await app.request(`${url}?layers=${spec}`)
        const body = new Uint8Array(await g.arrayBuffer())
        expect([spec, round, h.status, h.headers.get('content-length')]).toEqual([
          spec,
          round,
          200,
          String(body.length),
        ])
        expect(h.headers.get('x-kvgate-layers')).toBe(spec)
      }
    }
    expect((await app.request(`${url}?layers=4-9`, { method: 'HEAD' })).status).toBe(416)
    expect((await app.request(`${url}?layers=3-2`, { method: 'HEAD' })).status).toBe(416)
    expect((await app.request(`${url}?layers=x`, { method: 'HEAD' })).status).toBe(400)
    const both = await app.request(`${url}?layers=1-2`, { method: 'HEAD', headers: { range: 'bytes=0-1' } })
    expect(both.status).toBe(400)
    const absent = await app.request(`/v1/ns/a/chunks/${makeChunk().key}?layers=0-0`, { method: 'HEAD' })
    expect(absent.status).toBe(404)
  })

  describe('ETag, If-None-Match and If-Range', () => {
    const bodyOf = async (r: Response) => new Uint8Array(await r.arrayBuffer())

    it('a strong ETag from the stored bytes: the same on GET, HEAD, a range and another gateway on another store', async () => {
      const c = makeChunk({ layers: 6, sectionBytes: 100 })
      const url = `/v1/ns/a/chunks/${c.key}`
      const one = setup()
      await one.app.request(url, putInit(c.bytes))
      // Another store, whose own version tags differ (writes before it).
      const two = setup()
      await two.app.request(`/v1/ns/a/chunks/${makeChunk().key}`, putInit(makeChunk().bytes))
      await two.app.request(url, putInit(c.bytes))
      const g = await one.app.request(url)
      const etag = g.headers.get('etag')
      expect(etag).toMatch(/^"kv1-[0-9a-f]+-[0-9a-f]{8}"$/)
      expect(await bodyOf(g)).toEqual(c.bytes)
      const storeTag = (await one.store.head(objectName('kvgate', 'a', c.key)))!.etag
      expect(etag).not.toBe(storeTag)
      expect((await one.app.request(url, { method: 'HEAD' })).headers.get('etag')).toBe(etag)
      const part = await one.app.request(url, { headers: { range: 'bytes=100-199' } })
      expect([part.status, part.headers.get('etag')]).toEqual([206, etag])
      // A fresh gateway over the same store (a restart) and one over another store agree.
      expect((await createGateway({ store: one.store }).request(url)).headers.get('etag')).toBe(etag)
      expect((await two.app.request(url, { method: 'HEAD' })).headers.get('etag')).toBe(etag)
      expect((await two.app.request(url)).headers.get('etag')).toBe(etag)
      // Other bytes under the same key (deleted, re-encoded elsewhere): another tag.
      const other = makeChunk({ layers: 6, sectionBytes: 100, key: c.key })
      await one.app.request(url, { method: 'DELETE' })
      await one.app.request(url, putInit(other.bytes))
      const again = await one.app.request(url)
      expect(again.headers.get('etag')).not.toBe(etag)
      expect(await bodyOf(again)).toEqual(other.bytes)
    })

    it('a Range GET reads the header for its tag only for a precondition; one whose header read fails is served untagged, not failed', async () => {
      /** A store whose reads from byte 0 (the header's) fail while `failing`; every get's range recorded. */
      class FlakyHeaderStore extends MemoryStore {
        failing = false
        readonly ranges: (string | undefined)[] = []
        override async get(name: string, opts: GetOptions = {}): Promise<StoreObject | undefined> {
          const r = opts.range
          this.ranges.push(r && ('suffix' in r ? `-${r.suffix}` : `${r.offset}+${r.length}`))
          if (this.failing && r && 'offset' in r && r.offset === 0)
            throw new StoreError('store unavailable (test)', { code: 'ERR_STORE_UNAVAILABLE' })
          return super.get(name, opts)
        }
      }
      const c = makeChunk({ layers: 6, sectionBytes: 100 })
      const url = `/v1/ns/a/chunks/${c.key}`
      const store = new FlakyHeaderStore()
      expect((await createGateway({ store }).request(url, putInit(c.bytes))).status).toBe(201)
      const etag = (await createGateway({ store }).request(url, { method: 'HEAD' })).headers.get('etag')!
      // A fresh gateway (no cached header): a plain range is one store read, its own, untagged.
      const fresh = createGateway({ store })
      store.ranges.length = 0
      const plain = await fresh.request(url, { headers: { range: 'bytes=100-199' } })
      expect([plain.status, plain.headers.get('etag')]).toEqual([206, null])
      expect(await bodyOf(plain)).toEqual(c.bytes.subarray(100, 200))
      expect(store.ranges).toEqual(['100+100'])
      // The header read failing: the range is served all the same, untagged, with or without a precondition.
      store.failing = true
      const conditions: Record<string, string>[] = [
        {},
        { 'if-none-match': '"other"' },
        { 'if-none-match': etag },
      ]
      for (const headers of conditions) {
        const r = await createGateway({ store }).request(url, {
          headers: { range: 'bytes=100-199', ...headers },
        })
        expect([r.status, r.headers.get('etag'), r.headers.get('content-range')]).toEqual([
          206,
          null,
          `bytes 100-199/${c.bytes.length}`,
        ])
        expect(await bodyOf(r)).toEqual(c.bytes.subarray(100, 200))
      }
      // If-Range cannot be shown to hold: the whole object (its header read off its own body).
      const ifRange = await createGateway({ store }).request(url, {
        headers: { range: 'bytes=100-199', 'if-range': etag },
      })
      expect([ifRange.status, ifRange.headers.get('etag')]).toEqual([200, etag])
      expect(await bodyOf(ifRange)).toEqual(c.bytes)
      // With the header cached (a whole GET before), a plain range is tagged without a header read.
      store.failing = false
      const warm = createGateway({ store })
      await bodyOf(await warm.request(url))
      store.ranges.length = 0
      const tagged = await warm.request(url, { headers: { range: 'bytes=100-199' } })
      expect([tagged.status, tagged.headers.get('etag')]).toEqual([206, etag])
      await bodyOf(tagged)
      expect(store.ranges).toEqual(['100+100'])
    })

    it('a store that gives no version tag: a range is never tagged from a cached header (a same-size replacement would carry the old tag)', async () => {
      /** A store that names no object version (an S3-compatible store answering without ETag). */
      class UntaggedStore extends MemoryStore {
        override async get(name: string, opts: GetOptions = {}): Promise<StoreObject | undefined> {
          const o = await super.get(name, opts)
          if (o) delete o.etag
          return o
        }
        override async head(name: string): Promise<{ size: number; etag?: string } | undefined> {
          const h = await super.head(name)
          return h && { size: h.size }
        }
      }
      const c = makeChunk({ layers: 6, sectionBytes: 100 })
      const other = makeChunk({ layers: 6, sectionBytes: 100, key: c.key })
      expect(other.bytes.length).toBe(c.bytes.length)
      const url = `/v1/ns/a/chunks/${c.key}`
      const store = new UntaggedStore()
      const app = createGateway({ store })
      expect((await app.request(url, putInit(c.bytes))).status).toBe(201)
      const first = await app.request(url)
      const oldTag = first.headers.get('etag')!
      expect(await bodyOf(first)).toEqual(c.bytes) // its header cached
      // Replaced out of band (deleted and re-written by another instance): same size, other bytes.
      store.overwrite(objectName('kvgate', 'a', c.key), other.bytes)
      const plain = await app.request(url, { headers: { range: 'bytes=100-199' } })
      expect(plain.status).toBe(206)
      expect(await bodyOf(plain)).toEqual(other.bytes.subarray(100, 200))
      expect(plain.headers.get('etag')).toBeNull() // not the old version's tag on the new bytes
      // A client resuming its copy of the old version must not get the new one's range spliced in.
      const resumed = await app.request(url, { headers: { range: 'bytes=100-199', 'if-range': oldTag } })
      expect(resumed.status).toBe(200)
      expect(await bodyOf(resumed)).toEqual(other.bytes)
      expect(resumed.headers.get('etag')).not.toBe(oldTag)
      // Nor 304 for the old tag.
      const inm = await app.request(url, { headers: { range: 'bytes=100-199', 'if-none-match': oldTag } })
      expect(inm.status).toBe(206)
      expect(await bodyOf(inm)).toEqual(other.bytes.subarray(100, 200))
    })

    it('If-None-Match: 304 without a body for the current tag (weak, listed or *), 200 otherwise; GET and HEAD', async () => {
      const { app } = setup()
      const c = makeChunk()
      const url = `/v1/ns/a/chunks/${c.key}`
      await app.request(url, putInit(c.bytes))
      const etag = (await app.request(url, { method: 'HEAD' })).headers.get('etag')!
      for (const method of ['GET', 'HEAD']) {
        for (const inm of [etag, `W/${etag}`, `"nope", ${etag}`, '*']) {
          const r = await app.request(url, { method, headers: { 'if-none-match': inm } })
          expect([method, inm, r.status, r.headers.get('etag')]).toEqual([method, inm, 304, etag])
          expect((await bodyOf(r)).length).toBe(0)
        }
        const miss = await app.request(url, { method, headers: { 'if-none-match': '"nope"' } })
        expect([method, miss.status]).toEqual([method, 200])
        if (method === 'GET') expect(await bodyOf(miss)).toEqual(c.bytes)
        // Unquoted garbage names no tag.
        expect(
          (await app.request(url, { method, headers: { 'if-none-match': etag.slice(1, -1) } })).status,
        ).toBe(200)
      }
      // A Range request for the current tag is not modified either.
      const ranged = await app.request(url, { headers: { range: 'bytes=0-9', 'if-none-match': etag } })
      expect(ranged.status).toBe(304)
      // An absent chunk is a miss whatever the condition.
      const absent = `/v1/ns/a/chunks/${makeChunk().key}`
      expect((await app.request(absent, { headers: { 'if-none-match': '*' } })).status).toBe(404)
    })

    it('If-Range: the range while the tag holds, the whole object otherwise (a weak tag, a date, another tag)', async () => {
      const { app } = setup()
      const c = makeChunk()
      const url = `/v1/ns/a/chunks/${c.key}`
      await app.request(url, putInit(c.bytes))
      const etag = (await app.request(url, { method: 'HEAD' })).headers.get('etag')!
      const held = await app.request(url, { headers: { range: 'bytes=10-19', 'if-range': etag } })
      expect([held.status, held.headers.get('content-range')]).toEqual([206, `bytes 10-19/${c.bytes.length}`])
      expect(await bodyOf(held)).toEqual(c.bytes.subarray(10, 20))
      for (const ifRange of [`W/${etag}`, 'Wed, 21 Oct 2015 07:28:00 GMT', '"kv1-0-00000000"', `${etag}x`]) {
        const r = await app.request(url, { headers: { range: 'bytes=10-19', 'if-range': ifRange } })
        expect([ifRange, r.status, r.headers.get('etag'), r.headers.get('content-range')]).toEqual([
          ifRange,
          200,
          etag,
          null,
        ])
        expect(await bodyOf(r)).toEqual(c.bytes)
      }
    })

    it('preconditions come before the range (RFC 9110 §13.2.2): a stale If-Range past the new end gets the whole object, a matching If-None-Match 304, not 416', async () => {
      const { app } = setup()
      const c = makeChunk({ layers: 6, sectionBytes: 200 })
      const url = `/v1/ns/a/chunks/${c.key}`
      await app.request(url, putInit(c.bytes))
      const old = (await app.request(url, { method: 'HEAD' })).headers.get('etag')!
      // Replaced by a smaller re-encode: the client's range of the old one lies past its end.
      const small = makeChunk({ layers: 6, sectionBytes: 100, key: c.key })
      expect((await app.request(url, { method: 'DELETE' })).status).toBe(204)
      expect((await app.request(url, putInit(small.bytes))).status).toBe(201)
      const past = `bytes=${small.bytes.length + 10}-`
      const r = await app.request(url, { headers: { range: past, 'if-range': old } })
      expect([r.status, r.headers.get('content-range')]).toEqual([200, null])
      expect(await bodyOf(r)).toEqual(small.bytes)
      const now = r.headers.get('etag')!
      expect(now).not.toBe(old)
      const nm = await app.request(url, { headers: { range: past, 'if-none-match': now } })
      expect([nm.status, nm.headers.get('etag')]).toEqual([304, now])
      // The current tag holds: the range is the client's mistake, still 416 with the length.
      const cases: Record<string, string>[] = [
        { range: past, 'if-range': now },
        { range: past, 'if-none-match': old },
        { range: past },
      ]
      for (const headers of cases) {
        const bad = await app.request(url, { headers })
        expect([bad.status, bad.headers.get('content-range')]).toEqual([416, `bytes */${small.bytes.length}`])
      }
    })

    it("HEAD's tag is no older than its size: a same-size object put back elsewhere gets its own tag once the presence is re-learned", async () => {
      const c = makeChunk({ layers: 6, sectionBytes: 100 })
      const url = `/v1/ns/a/chunks/${c.key}`
      const store = new MemoryStore()
      const x = createGateway({ store, lookup: { presenceTtlMs: 50 } })
      const y = createGateway({ store })
      expect((await x.request(url, putInit(c.bytes))).status).toBe(201)
      const old = (await x.request(url)).headers.get('etag')!
      expect((await x.request(url, { method: 'HEAD' })).headers.get('etag')).toBe(old)
      // Another instance deletes it and takes a re-encode of the same size (other bytes).
      const other = makeChunk({ layers: 6, sectionBytes: 100, key: c.key })
      expect(other.bytes.length).toBe(c.bytes.length)
      expect((await y.request(url, { method: 'DELETE' })).status).toBe(204)
      expect((await y.request(url, putInit(other.bytes))).status).toBe(201)
      const now = (await y.request(url)).headers.get('etag')!
      expect(now).not.toBe(old)
      // Past the presence TTL a lookup here re-learns the key (its size, not its bytes).
      await new Promise((r) => setTimeout(r, 80))
      const look = await x.request('/v1/ns/a/lookup', {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify({ keys: [c.key] }),
      })
      expect(look.status).toBe(200)
      const h = await x.request(url, { method: 'HEAD' })
      expect([h.status, h.headers.get('etag')]).toEqual([200, now])
      expect((await x.request(url, { method: 'HEAD', headers: { 'if-none-match': old } })).status).toBe(200)
    })

    it('?layers= of zero bytes checks the header is current, as other spans do: not served from one of an object deleted or replaced', async () => {
      const store = new MemoryStore()
      const x = createGateway({ store })
      const y = createGateway({ store })
      const empty = makeChunk({ layers: 4, sectionBytes: 0 })
      const url = `/v1/ns/a/chunks/${empty.key}`
      expect((await x.request(url, putInit(empty.bytes))).status).toBe(201)
      const first = await x.request(`${url}?layers=1-1`)
      expect(first.status).toBe(200)
      expect(await bodyOf(first)).toEqual(empty.bytes) // the header, no section bytes
      // Another instance deletes it: x's cached header names an object that is gone.
      expect((await y.request(url, { method: 'DELETE' })).status).toBe(204)
      const gone = await x.request(`${url}?layers=1-1`)
      expect(gone.status).toBe(404)
      await gone.arrayBuffer()
      // Put back as other bytes (a re-encode with sections): their header and section, not the old header.
      const full = makeChunk({ layers: 4, sectionBytes: 100, key: empty.key })
      expect((await x.request(url, putInit(empty.bytes))).status).toBe(201)
      expect((await x.request(`${url}?layers=1-1`)).status).toBe(200) // cached again: the empty one
      expect((await y.request(url, { method: 'DELETE' })).status).toBe(204)
      expect((await y.request(url, putInit(full.bytes))).status).toBe(201)
      const now = await x.request(`${url}?layers=1-1`)
      expect(now.status).toBe(200)
      const sub = openLayerSubset(await bodyOf(now), 1, 1)
      expect(sub.header.totalBytes).toBe(full.bytes.length)
      expect(sub.section(1)).toEqual(
        full.bytes.subarray(sub.header.sections[1]!.offset, sub.header.sections[1]!.offset + 100),
      )
    })

    it('?layers= is another representation: its own tag per span, honoured by If-None-Match on GET and HEAD', async () => {
      const { app } = setup()
      const c = makeChunk({ layers: 6, sectionBytes: 100 })
      const url = `/v1/ns/a/chunks/${c.key}`
      await app.request(url, putInit(c.bytes))
      const whole = (await app.request(url, { method: 'HEAD' })).headers.get('etag')!
      const g = await app.request(`${url}?layers=2-4`)
      const tag = g.headers.get('etag')!
      await g.arrayBuffer()
      expect(tag).toMatch(/^"kv1-[0-9a-f]+-[0-9a-f]{8};layers=2-4"$/)
      expect(tag).not.toBe(whole)
      expect((await app.request(`${url}?layers=2-3`)).headers.get('etag')).not.toBe(tag)
      expect((await app.request(`${url}?layers=2-4`, { method: 'HEAD' })).headers.get('etag')).toBe(tag)
      for (const method of ['GET', 'HEAD']) {
        const r = await app.request(`${url}?layers=2-4`, { method, headers: { 'if-none-match': tag } })
        expect([method, r.status, r.headers.get('etag')]).toEqual([method, 304, tag])
        // The whole object's tag is not this representation's.
        const w = await app.request(`${url}?layers=2-4`, { method, headers: { 'if-none-match': whole } })
        expect([method, w.status]).toEqual([method, 200])
        await w.arrayBuffer()
      }
    })
  })

  it('serves ?layers of a chunk over 512 MiB that the gateway was configured to take (maxChunkBytes)', async () => {
    // A two-layer object whose layer 1 is 600 MiB, never materialized: bytes past layer 0 read as zero.
    const c = makeChunk({ layers: 2, sectionBytes: 8 })
    const head = c.bytes.slice(0, readHeaderLength(c.bytes) + 8)
    const dv = new DataView(head.buffer)
    const big = 600 * 1024 * 1024
    const size = head.length + big
    dv.setBigUint64(16, BigInt(size), true)
    dv.setUint32(FIXED_HEADER_BYTES + SECTION_ENTRY_BYTES + 8, big, true)
    const hb = readHeaderLength(head)
    dv.setUint32(hb - 4, crc32(head.subarray(0, hb - 4)), true)
    const name = objectName('kvgate', 'a', c.key)
    const store = Object.assign(Object.create(new MemoryStore()) as MemoryStore, {
      async head(n: string) {
        return n === name ? { size, etag: '"v"' } : undefined
      },
      async get(n: string, opts: GetOptions = {}): Promise<StoreObject | undefined> {
        if (n !== name) return undefined
        const r = resolveRange(opts.range, size)!
        const out = new Uint8Array(r.length)
        if (r.offset < head.length) out.set(head.subarray(r.offset, r.offset + r.length))
        return { body: new Blob([out]).stream(), size, offset: r.offset, length: r.length, etag: '"v"' }
      },
    })
    const app = createGateway({ store, limits: { maxChunkBytes: 1024 ** 3 } })
    const r = await app.request(`/v1/ns/a/chunks/${c.key}?layers=0-0`)
    expect(r.status).toBe(200)
    expect(new Uint8Array(await r.arrayBuffer())).toEqual(head)
  })

  it('a store that breaks off the ?layers header probe answers what a GET answers (typed, retryable), not 500', async () => {
    const c = makeChunk({ layers: 6, sectionBytes: 100 })
    let broken = false
    class BreakingStore extends MemoryStore {
      override async get(n: string, opts: GetOptions = {}): Promise<StoreObject | undefined> {
        const obj = await super.get(n, opts)
        if (!obj || !broken) return obj
        // A reset socket mid-body: the SDK's stream errors with a plain Error.
        const body = new ReadableStream<Uint8Array>({
          start(ctl) {
            ctl.enqueue(new Uint8Array(8))
            ctl.error(new Error('socket hang up'))
          },
        })
        return { ...obj, body }
      }
    }
    const app = createGateway({ store: new BreakingStore() })
    await app.request(`/v1/ns/a/chunks/${c.key}`, putInit(c.bytes))
    broken = true
    const whole = await app.request(`/v1/ns/a/chunks/${c.key}`)
    const layers = await app.request(`/v1/ns/a/chunks/${c.key}?layers=1-2`)
    expect([layers.status, await errCode(layers)]).toEqual([whole.status, await errCode(whole)])
    expect([layers.status, layers.headers.get('x-kvgate-error')]).toEqual([502, 'ERR_STORE'])
    // Sound again, the same request is served: nothing about the object was held against it.
    broken = false
    expect((await app.request(`/v1/ns/a/chunks/${c.key}?layers=1-2`)).status).toBe(200)
  })

  it('deletes (admin) and forgets the chunk', async () => {
    const { app } = setup()
    const c = makeChunk()
    await app.request(`/v1/ns/a/chunks/${c.key}`, putInit(c.bytes))
    expect((await app.request(`/v1/ns/a/chunks/${c.key}`, { method: 'DELETE' })).status).toBe(204)
    expect((await app.request(`/v1/ns/a/chunks/${c.key}`, { method: 'HEAD' })).status).toBe(404)
    const look = await app.request('/v1/ns/a/lookup', {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ keys: [c.key] }),
    })
    expect(await json(look)).toEqual({ present: 0 })
    expect((await app.request(`/v1/ns/a/chunks/${c.key}`, { method: 'DELETE' })).status).toBe(404)
  })

  it('a chunk deleted mid-chain ends the chain for lookups: later chunks cannot infer it back', async () => {
    // Presences trusted 300 ms (the default is 30 s): they have expired when the chunk is deleted.
    const { app } = setup({ lookup: { presenceTtlMs: 300, verifyInferred: 0 } })
    // Longer than one search round's fanout (24): the search samples the chain (0, 3, 5, 8, …).
    const chain = makeChain(60)
    for (const c of chain) await app.request(`/v1/ns/a/chunks/${c.key}`, putInit(c.bytes))
    const look = async () =>
      json(
        await app.request('/v1/ns/a/lookup', {
          method: 'POST',
          headers: { 'content-type': 'application/json' },
          body: JSON.stringify({ keys: chain.map((c) => c.key) }),
        }),
      )
    await new Promise((r) => setTimeout(r, 350))
    expect((await app.request(`/v1/ns/a/chunks/${chain[6]!.key}`, { method: 'DELETE' })).status).toBe(204)
    // This gateway deleted it: chunk 8 present does not make it present.
    expect(await look()).toEqual({ present: 6 })
    // Written again: the chain is whole again.
    await app.request(`/v1/ns/a/chunks/${chain[6]!.key}`, putInit(chain[6]!.bytes))
    expect(await look()).toEqual({ present: 60 })
  })
})

describe('PUT rejects bad bodies and leaves nothing behind', () => {
  async function rejects(
    mutate: (b: Uint8Array) => Uint8Array,
    status: number,
    code: RegExp,
    init?: RequestInit,
  ) {
    const { app, store } = setup()
    const c = makeChunk({ layers: 3, sectionBytes: 64 })
    const bytes = mutate(c.bytes.slice())
    const r = await app.request(`/v1/ns/a/chunks/${c.key}`, init ?? putInit(bytes))
    expect(r.status).toBe(status)
    expect(await errCode(r)).toMatch(code)
    expect((await store.stats()).objects).toBe(0)
  }

  const flip = (at: (b: Uint8Array) => number, mask: number) => (b: Uint8Array) => {
    b[at(b)]! ^= mask
    return b
  }
  it('a flipped section byte (checksum)', () =>
    rejects(
      flip((b) => b.length - 1, 1),
      400,
      /ERR_FORMAT_CHECKSUM/,
    ))
  it('a flipped header byte', () =>
    rejects(
      flip(() => 20, 0x40),
      400,
      /ERR_FORMAT/,
    ))
  it('garbage instead of a chunk', () => rejects((b) => b.fill(7), 400, /ERR_FORMAT_BAD_MAGIC/))
  it('a truncated body (header declares more)', () =>
    rejects((b) => b.subarray(0, b.length - 10), 400, /ERR_FORMAT_BAD_FIELD|ERR_FORMAT_TRUNCATED/))
  it('extra trailing bytes', () =>
    rejects((b) => Uint8Array.from([...b, 1, 2, 3]), 400, /ERR_FORMAT_BAD_FIELD/))

  // S3 and R2 store a PUT once Content-Length bytes arrived, without waiting for the body's end:
  // every byte up to the last must be verified before it reaches them.
  it('a body that ends inside its header never reaches a store that commits on its last byte', async () => {
    const inner = new MemoryStore()
    const store = Object.assign(Object.create(inner) as MemoryStore, {
      async putIfAbsent(name: string, body: ReadableStream<Uint8Array> | Uint8Array, size: number) {
        if (body instanceof Uint8Array) return inner.putIfAbsent(name, body, size)
        const reader = body.getReader()
        const pieces: Uint8Array[] = []
        let n = 0
        while (n < size) {
          const { done, value } = await reader.read()
          if (done) break
          pieces.push(value)
          n += value.length
        }
        reader.releaseLock()
        return inner.putIfAbsent(name, concatPieces(pieces, n), n)
      },
    })
    const app = createGateway({ store })
    const c = makeChunk({ layers: 40, sectionBytes: 8 })
    const cut = c.bytes.subarray(0, headerBytesFor(1))
    expect(readHeaderLength(c.bytes)).toBeGreaterThan(cut.length)
    const r = await app.request(`/v1/ns/a/chunks/${c.key}`, putInit(cut))
    expect(r.status).toBe(400)
    expect(await errCode(r)).toBe('ERR_FORMAT_TRUNCATED')
    expect((await inner.stats()).objects).toBe(0)
  })

  it('a body whose header key disagrees with the path', async () => {
    const { app, store } = setup()
    const c = makeChunk()
    const other = makeChunk()
    const r = await app.request(`/v1/ns/a/chunks/${other.key}`, putInit(c.bytes))
    expect(r.status).toBe(400)
    expect(await errCode(r)).toBe('ERR_INVALID_KEY')
    expect((await store.stats()).objects).toBe(0)
  })

  it('wrong or missing content type → 415', async () => {
    const { app } = setup()
    const c = makeChunk()
    for (const type of ['application/json', 'text/plain', '']) {
      const init = putInit(c.bytes)
      ;(init.headers as Record<string, string>)['content-type'] = type
      const r = await app.request(`/v1/ns/a/chunks/${c.key}`, init)
      expect(r.status).toBe(415)
      expect(await errCode(r)).toBe('ERR_UNSUPPORTED_MEDIA_TYPE')
    }
  })

  it('oversized bodies → 413 before reading them', async () => {
    const { app, ops } = setup({ limits: { maxChunkBytes: 1000 } })
    const c = makeChunk({ layers: 4, sectionBytes: 512 })
    const r = await app.request(`/v1/ns/a/chunks/${c.key}`, putInit(c.bytes))
    expect(r.status).toBe(413)
    expect(await errCode(r)).toBe('ERR_PAYLOAD_TOO_LARGE')
    expect(ops).toEqual([])
  })

  it('a Content-Length that lies (shorter than the body) is rejected', async () => {
    const { app, store } = setup()
    const c = makeChunk()
    const init = putInit(c.bytes)
    ;(init.headers as Record<string, string>)['content-length'] = String(c.bytes.length - 1)
    const r = await app.request(`/v1/ns/a/chunks/${c.key}`, init)
    expect(r.status).toBe(400)
    expect((await store.stats()).objects).toBe(0)
  })

  it('a stalled body times out with 408 and stores nothing', async () => {
    const { app, store } = setup({ limits: { bodyIdleTimeoutMs: 50 } })
    const c = makeChunk()
    const body = new ReadableStream<Uint8Array>({
      start(ctl) {
        ctl.enqueue(c.bytes.subarray(0, 100)) // then nothing, ever
      },
    })
    const r = await app.request(`/v1/ns/a/chunks/${c.key}`, {
      method: 'PUT',
      body,
      headers: { 'content-type': 'application/octet-stream', 'content-length': String(c.bytes.length) },
      duplex: 'half',
    } as RequestInit)
    expect(r.status).toBe(408)
    expect(await errCode(r)).toBe('ERR_TIMEOUT')
    expect((await store.stats()).objects).toBe(0)
  })

  it('a re-PUT of a key stored with another size (a lossy re-encode elsewhere) answers 200 exists (C3)', async () => {
    const { app, store } = setup()
    const c = makeChunk({ layers: 2, sectionBytes: 64 })
    await app.request(`/v1/ns/a/chunks/${c.key}`, putInit(c.bytes))
    const bigger = makeChunk({ layers: 2, sectionBytes: 128, key: c.key })
    const r = await app.request(`/v1/ns/a/chunks/${c.key}`, putInit(bigger.bytes))
    expect(r.status).toBe(200)
    expect(await json(r)).toEqual({ status: 'exists', bytes: c.bytes.length })
    // First writer wins: the stored object is untouched.
    const g = await app.request(`/v1/ns/a/chunks/${c.key}`)
    expect(new Uint8Array(await g.arrayBuffer())).toEqual(c.bytes)
    expect((await store.stats()).objects).toBe(1)
  })
})

describe('paths, keys and namespaces', () => {
  const key = makeChunk().key
  const bad = [
    ['/v1/ns/..%2F..%2Fetc/chunks/' + key, 'ERR_INVALID_NAMESPACE'],
    // URL parsing folds an encoded '..' segment away: the path no longer matches a route.
    ['/v1/ns/%2e%2e/chunks/' + key, 'ERR_NOT_FOUND'],
    ['/v1/ns/a..b/chunks/' + key, 'ERR_INVALID_NAMESPACE'],
    ['/v1/ns/UPPER/chunks/' + key, 'ERR_INVALID_NAMESPACE'],
    ['/v1/ns/-x/chunks/' + key, 'ERR_INVALID_NAMESPACE'],
    [`/v1/ns/${'a'.repeat(64)}/chunks/${key}`, 'ERR_INVALID_NAMESPACE'],
    ['/v1/ns/a/chunks/' + key.toUpperCase(), 'ERR_INVALID_KEY'],
    ['/v1/ns/a/chunks/' + key.slice(1), 'ERR_INVALID_KEY'],
    ['/v1/ns/a/chunks/..%2F..%2F' + key.slice(6), 'ERR_INVALID_KEY'],
    ['/v1/ns/a/chunks/%00' + key.slice(1), 'ERR_INVALID_KEY'],
  ] as const
  for (const [path, code] of bad) {
    it(`rejects ${path.slice(0, 60)}`, async () => {
      const { app, ops } = setup()
      for (const method of ['GET', 'HEAD', 'DELETE']) {
        const r = await app.request(path, { method })
        expect(r.status).toBe(code === 'ERR_NOT_FOUND' ? 404 : 400)
        if (method !== 'HEAD') expect(await errCode(r)).toBe(code)
      }
      const c = makeChunk()
      expect((await app.request(path, putInit(c.bytes))).status).toBe(code === 'ERR_NOT_FOUND' ? 404 : 400)
      expect(ops).toEqual([])
    })
  }

  it('unknown routes answer a JSON 404', async () => {
    const { app } = setup()
    const r = await app.request('/v2/whatever')
    expect(r.status).toBe(404)
    expect(await errCode(r)).toBe('ERR_NOT_FOUND')
  })
})

describe('lookup', () => {
  const post = (
    app: ReturnType<typeof setup>['app'],
    ns: string,
    body: unknown,
    headers: Record<string, string> = {},
  ) =>
    app.request(`/v1/ns/${ns}/lookup`, {
      method: 'POST',
      headers: { 'content-type': 'application/json', ...headers },
      body: typeof body === 'string' ? body : JSON.stringify(body),
    })

  it('finds the leading present run with sizes, far below one HEAD per key', async () => {
    const chain = makeChain(512, { layers: 1, sectionBytes: 16 })
    for (const present of [0, 1, 200, 511, 512]) {
      const { app, ops } = setup({ lookup: { cacheEntries: 1 } })
      for (const c of chain.slice(0, present))
        await app.state.rawStore.putIfAbsent(
          `kvgate/a/${c.key.slice(0, 2)}/${c.key}`,
          c.bytes,
          c.bytes.length,
        )
      ops.length = 0
      const r = await post(app, 'a', { keys: chain.map((c) => c.key), sizes: false })
      expect(await json(r)).toEqual({ present })
      expect(Number(r.headers.get('x-kvgate-store-rounds'))).toBeLessThanOrEqual(3)
      expect(ops.length).toBeLessThanOrEqual(3 * 24)
    }
  })

  it('verifies sizes and truncates at a hole in the chain', async () => {
    const chain = makeChain(40, { layers: 1, sectionBytes: 16 })
    const { app } = setup()
    for (const [i, c] of chain.entries())
      if (i !== 17) await app.request(`/v1/ns/a/chunks/${c.key}`, putInit(c.bytes))
    app.state.lookup.forget('x') // cache holds the written ones; the hole is never cached
    const r = await json(await post(app, 'a', { keys: chain.map((c) => c.key), sizes: true }))
    expect(r.present).toBe(17)
    expect(r.sizes).toEqual(chain.slice(0, 17).map((c) => c.bytes.length))
  })

  it('answers a warm lookup from the cache without store requests', async () => {
    const chain = makeChain(64, { layers: 1, sectionBytes: 16 })
    const { app, ops } = setup()
    for (const c of chain) await app.request(`/v1/ns/a/chunks/${c.key}`, putInit(c.bytes))
    ops.length = 0
    const r = await post(app, 'a', { keys: chain.map((c) => c.key) })
    expect((await json(r)).present).toBe(64)
    expect(ops).toEqual([])
  })

  it('rejects malformed lookups', async () => {
    const { app } = setup({ limits: { maxLookupKeys: 8 } })
    const k = makeChunk().key
    const cases: [unknown, number, string][] = [
      ['{not json', 400, 'ERR_INVALID_ARGUMENT'],
      [{ nokeys: [] }, 400, 'ERR_INVALID_ARGUMENT'],
      [{ keys: 'abc' }, 400, 'ERR_INVALID_ARGUMENT'],
      [{ keys: [k, 'zz'] }, 400, 'ERR_INVALID_KEY'],
      [{ keys: [k, 42] }, 400, 'ERR_INVALID_KEY'],
      [{ keys: Array(9).fill(k) }, 413, 'ERR_PAYLOAD_TOO_LARGE'],
      [{ keys: [k], sizes: 'yes' }, 400, 'ERR_INVALID_ARGUMENT'],
    ]
    for (const [body, status, code] of cases) {
      const r = await post(app, 'a', body)
      expect(r.status, JSON.stringify(body)).toBe(status)
      expect(await errCode(r)).toBe(code)
    }
    const wrongType = await post(app, 'a', { keys: [] }, { 'content-type': 'text/plain' })
    expect(wrongType.status).toBe(415)
    const big = await post(app, 'a', `{"keys":[${'"x",'.repeat(200_000)}"x"]}`)
    expect(big.status).toBe(413)
    // No Content-Length (a chunked body): refused once the bytes read pass the cap.
    // Few keys, many bytes (JSON whitespace): only the byte cap can refuse it.
    const pieces = ['{"keys":[', ...Array(200).fill(' '.repeat(4096)), ']}']
    const chunked = await app.request('/v1/ns/a/lookup', {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: new ReadableStream<Uint8Array>({
        start(ctl) {
          for (const p of pieces) ctl.enqueue(new TextEncoder().encode(p))
          ctl.close()
        },
      }),
      duplex: 'half',
    } as RequestInit)
    expect([chunked.status, await errCode(chunked)]).toEqual([413, 'ERR_PAYLOAD_TOO_LARGE'])
    expect(await json(await post(app, 'a', { keys: [] }))).toEqual({ present: 0 })
    expect(await json(await post(app, 'a', { keys: [], sizes: true }))).toEqual({ present: 0, sizes: [] })
  })
})

describe('auth', () => {
  async function authed() {
    const tokens = {
      reader: 'r-token-aaaa',
      writer: 'w-token-bbbb',
      admin: 'admin-cccc',
      other: 'other-dddd',
    }
    const app = createGateway({
      store: new MemoryStore(),
      auth: {
        tokens: [
          { name: 'reader', sha256: await hashToken(tokens.reader), scopes: ['read'], namespaces: ['a'] },
          { name: 'writer', sha256: await hashToken(tokens.writer), scopes: 'write', namespaces: ['a'] },
          { name: 'admin', sha256: await hashToken(tokens.admin), scopes: 'admin', namespaces: '*' },
          { name: 'other', sha256: await hashToken(tokens.other), scopes: 'admin', namespaces: ['b'] },
        ],
      },
    })
    return { app, tokens }
  }
  const bearer = (t: string) => ({ authorization: `Bearer ${t}` })

  it('401 without or with a wrong token, with a JSON body', async () => {
    const { app } = await authed()
    const c = makeChunk()
    for (const headers of [
      {},
      bearer('nope'),
      { authorization: 'Basic abc' },
      { authorization: 'Bearer ' },
    ]) {
      const r = await app.request(`/v1/ns/a/chunks/${c.key}`, { headers })
      expect(r.status).toBe(401)
      expect(r.headers.get('www-authenticate')).toMatch(/Bearer/)
      expect(await errCode(r)).toBe('ERR_UNAUTHORIZED')
    }
  })

  it('scopes: read cannot write, write cannot delete, admin can', async () => {
    const { app, tokens } = await authed()
    const c = makeChunk()
    const url = `/v1/ns/a/chunks/${c.key}`
    const r1 = await app.request(url, putInit(c.bytes, tokens.reader))
    expect(r1.status).toBe(403)
    expect(await errCode(r1)).toBe('ERR_FORBIDDEN')
    expect((await app.request(url, putInit(c.bytes, tokens.writer))).status).toBe(201)
    expect((await app.request(url, { headers: bearer(tokens.reader) })).status).toBe(200)
    expect((await app.request(url, { method: 'DELETE', headers: bearer(tokens.writer) })).status).toBe(403)
    expect((await app.request(url, { method: 'DELETE', headers: bearer(tokens.admin) })).status).toBe(204)
  })

  it('a token for namespace b never touches namespace a', async () => {
    const { app, tokens } = await authed()
    const c = makeChunk()
    await app.request(`/v1/ns/a/chunks/${c.key}`, putInit(c.bytes, tokens.writer))
    const h = bearer(tokens.other)
    expect((await app.request(`/v1/ns/a/chunks/${c.key}`, { headers: h })).status).toBe(403)
    expect((await app.request(`/v1/ns/a/chunks/${c.key}`, { method: 'HEAD', headers: h })).status).toBe(403)
    expect((await app.request(`/v1/ns/a/chunks/${c.key}`, { method: 'DELETE', headers: h })).status).toBe(403)
    expect((await app.request(`/v1/ns/a/chunks/${c.key}`, putInit(c.bytes, tokens.other))).status).toBe(403)
    const look = await app.request('/v1/ns/a/lookup', {
      method: 'POST',
      headers: { ...h, 'content-type': 'application/json' },
      body: JSON.stringify({ keys: [c.key] }),
    })
    expect(look.status).toBe(403)
    // Its own namespace does not see a's object either: names are per namespace.
    expect((await app.request(`/v1/ns/b/chunks/${c.key}`, { headers: h })).status).toBe(404)
  })

  it('metrics and status need a global admin token; healthz does not', async () => {
    const { app, tokens } = await authed()
    expect((await app.request('/healthz')).status).toBe(200)
    expect((await app.request('/metrics')).status).toBe(401)
    expect((await app.request('/metrics', { headers: bearer(tokens.other) })).status).toBe(403)
    const m = await app.request('/metrics', { headers: bearer(tokens.admin) })
    expect(m.status).toBe(200)
    expect(await m.text()).toContain('kvgate_http_requests_total')
    expect((await app.request('/', { headers: bearer(tokens.admin) })).status).toBe(200)
  })

  it('rejects bad token config eagerly', () => {
    expect(() =>
      createGateway({
        store: new MemoryStore(),
        auth: { tokens: [{ sha256: 'abc', scopes: 'read', namespaces: '*' }] },
      }),
    ).toThrow(TypeError)
  })

  it('rejects bad options eagerly, not at the first request: unknown keys, a prefix with . or .., bad presign', () => {
    const store = new MemoryStore()
    const bad: Record<string, unknown>[] = [
      { prefix: 'kv/..' },
      { prefix: '..' },
      { prefix: 'kv/./x' },
      { limitz: { maxChunkBytes: 1 } },
      { limits: { toString: 1 } }, // a name every object has is no limit either
      { presign: { minBytes: 0, expireSeconds: 60 } },
      { presign: { minBytes: 0, expiresSeconds: 0 } },
      { presign: { minBytes: 0, expiresSeconds: 8 * 24 * 3600 } },
      { coalesce: { maxByte: 1 } },
      { auth: { tokens: [], publicstatus: true } },
      { lookup: { presenceTTLMs: 1000 } },
      { coldTier: { trackng: false } },
      { coldTier: { usage: { flushIntervalMS: 1000 } } },
    ]
    for (const o of bad) expect(() => createGateway({ store, ...o }), JSON.stringify(o)).toThrow(TypeError)
    expect(() =>
      createGateway({ store, prefix: 'a.b/c..d', presign: { minBytes: 0, expiresSeconds: 60 } }),
    ).not.toThrow()
  })
})

describe('metrics, status page, coalescing', () => {
  it('each gateway in a process shows its own store on the status page', async () => {
    const one = createGateway({ store: new MemoryStore() })
    const two = createGateway({ store: new MemoryStore() })
    for (const c of [makeChunk(), makeChunk()])
      expect((await two.request(`/v1/ns/a/chunks/${c.key}`, putInit(c.bytes))).status).toBe(201)
    const status = async (app: typeof one) =>
      (
        (await (await app.request('/', { headers: { accept: 'application/json' } })).json()) as {
          objects: number
        }
      ).objects
    expect(await status(one)).toBe(0)
    expect(await status(two)).toBe(2)
  })

  it('counts requests, bytes and store ops in Prometheus text', async () => {
    const { app } = setup()
    const c = makeChunk()
    await app.request(`/v1/ns/a/chunks/${c.key}`, putInit(c.bytes))
    await app.request(`/v1/ns/a/chunks/${c.key}`)
    const text = await (await app.request('/metrics')).text()
    expect(text).toMatch(
      /kvgate_http_requests_total\{method="PUT",route="\/v1\/ns\/:ns\/chunks\/:key",status="201"\} 1/,
    )
    expect(text).toMatch(new RegExp(`kvgate_http_bytes_in_total ${c.bytes.length}`))
    expect(text).toMatch(/kvgate_store_op_seconds_bucket\{op="put",store="memory",le="\+Inf"\} 1/)
  })

  it('the status page shows objects, bytes, cost (only where a price applies), uptime and recent errors', async () => {
    const { app: app2 } = setup()
    const c = makeChunk()
    await app2.request(`/v1/ns/a/chunks/${c.key}`, putInit(c.bytes))
    const html = await (await app2.request('/')).text()
    expect(html).toContain('kvgate gateway')
    // A memory store has no price: no cost row rather than "$0.00".
    expect(html).not.toMatch(/storage cost/)
    expect(html).toMatch(/<th>uptime<\/th><td>\d+ s<\/td>/)
    expect(html).toContain('error answers (4xx and 5xx)')
    const mem = new MemoryStore()
    const priced = Object.assign(Object.create(mem) as MemoryStore, { kind: 's3' })
    const s3ish = createGateway({ store: priced })
    expect(await (await s3ish.request('/')).text()).toMatch(/storage cost \/ month.*list price/)
    const j = (await (await app2.request('/', { headers: { accept: 'application/json' } })).json()) as Record<
      string,
      number
    >
    expect(j.writtenObjects).toBe(1)
    expect(j.writtenBytes).toBe(c.bytes.length)
  })

  it('records 5xx errors for the status page without leaking internals', async () => {
    const base = new MemoryStore()
    const store = {
      kind: 'broken',
      get: async () => {
        throw new Error('secret internal detail')
      },
      head: base.head.bind(base),
      putIfAbsent: base.putIfAbsent.bind(base),
      delete: base.delete.bind(base),
      list: base.list.bind(base),
    }
    const app = createGateway({ store })
    const r = await app.request(`/v1/ns/a/chunks/${makeChunk().key}`)
    expect(r.status).toBe(500)
    const body = await r.text()
    expect(body).not.toContain('secret')
    expect(JSON.parse(body).error.code).toBe('ERR_INTERNAL')
    expect(app.state.recentErrors).toHaveLength(1)
  })

  it('coalesces concurrent GETs of one object into one store GET', async () => {
    let gets = 0
    let release!: () => void
    const gate = new Promise<void>((r) => (release = r))
    const base = new MemoryStore()
    const store = {
      kind: 'slow',
      get: async (n: string, o?: Parameters<MemoryStore['get']>[1]) => {
        gets++
        await gate
        return base.get(n, o)
      },
      head: base.head.bind(base),
      putIfAbsent: base.putIfAbsent.bind(base),
      delete: base.delete.bind(base),
      list: base.list.bind(base),
    }
    const app = createGateway({ store })
    const c = makeChunk()
    await app.request(`/v1/ns/a/chunks/${c.key}`, putInit(c.bytes))
    const pending = Array.from({ length: 8 }, () => app.request(`/v1/ns/a/chunks/${c.key}`))
    await new Promise((r) => setTimeout(r, 20))
    release()
    const bodies = await Promise.all(pending.map(async (p) => new Uint8Array(await (await p).arrayBuffer())))
    for (const b of bodies) expect(b).toEqual(c.bytes)
    expect(gets).toBe(1)
    expect(app.state.metrics.coalesced.value()).toBe(7)
  })
})

describe('a whole GET reads its header off the front of its body', () => {
  /** A memory store whose GET bodies come in `piece`-byte pieces, counting what was pulled from each. */
  class PiecedStore extends MemoryStore {
    pulled: number[] = []
    constructor(readonly piece: number) {
      super()
    }
    override async get(n: string, o?: GetOptions): Promise<StoreObject | undefined> {
      const obj = await super.get(n, o)
      if (!obj) return obj
      const bytes = new Uint8Array(await new Response(obj.body).arrayBuffer())
      let at = 0
      const which = this.pulled.push(0) - 1
      const body = new ReadableStream<Uint8Array>(
        {
          pull: (c) => {
            if (at >= bytes.length) return c.close()
            const p = bytes.subarray(at, at + this.piece)
            at += p.length
            this.pulled[which]! += p.length
            c.enqueue(p)
          },
        },
        { highWaterMark: 0 },
      )
      return { ...obj, body }
    }
  }
  const stored = async (store: MemoryStore, key: string, bytes: Uint8Array) =>
    store.putIfAbsent(objectName('kvgate', 'a', key), bytes, bytes.length)

  it('a body that ends inside its header, or a header that fails, is a 502 before any byte, counted corrupt', async () => {
    const c = makeChunk({ layers: 8, sectionBytes: 1000 })
    const headerBytes = readHeaderLength(c.bytes)
    for (const [what, bytes] of [
      ['ends inside the prefix', c.bytes.slice(0, 7)],
      ['ends inside the header', c.bytes.slice(0, headerBytes - 5)],
      [
        'a header CRC off',
        (() => {
          const b = c.bytes.slice()
          b[headerBytes - 1]! ^= 1
          return b
        })(),
      ],
    ] as const) {
      for (const piece of [1, 5, 1 << 20]) {
        const store = new PiecedStore(piece)
        const app = createGateway({ store })
        await stored(store, c.key, bytes)
        const r = await app.request(`/v1/ns/a/chunks/${c.key}`)
        expect([r.status, r.headers.get('etag')], `${what} / ${piece}`).toEqual([502, null])
        expect(await errCode(r)).toMatch(/^ERR_FORMAT_/)
        expect(app.state.metrics.corruptReads.value({ layers: 'false' })).toBe(1)
        expect(app.state.headers.has(objectName('kvgate', 'a', c.key))).toBe(false)
      }
    }
  })

  it('a hostile header length reads no more than the largest header (and one piece) before the 502', async () => {
    const c = makeChunk({ layers: 64, sectionBytes: 64 * 1024 }) // 4 MiB: far more than any header
    const largest = headerBytesFor(1024)
    for (const [what, length] of [
      ['the largest plausible header', largest],
      ['an implausible one', 0xfffffff0],
      ['one not a multiple of 16', headerBytesFor(8) + 1],
    ] as const) {
      const bytes = c.bytes.slice()
      new DataView(bytes.buffer).setUint32(8, length, true)
      const store = new PiecedStore(1000)
      // Not coalesced: a coalescer may buffer a small object whole before anything looks at it.
      const app = createGateway({ store, coalesce: false })
      await stored(store, c.key, bytes)
      const r = await app.request(`/v1/ns/a/chunks/${c.key}`)
      expect(r.status, what).toBe(502)
      // The GET's own body (a background verification reads the object again, on its own).
      expect(store.pulled[0], what).toBeLessThanOrEqual(largest + 1000)
    }
  })

  it('a store body broken off inside the header is 502 ERR_STORE (not a corrupt object), its stream released', async () => {
    const c = makeChunk({ layers: 8, sectionBytes: 1000 })
    class BreakingStore extends MemoryStore {
      override async get(n: string, o?: GetOptions): Promise<StoreObject | undefined> {
        const obj = await super.get(n, o)
        if (!obj || o?.range) return obj
        let sent = false
        const body = new ReadableStream<Uint8Array>({
          pull(ctl) {
            if (sent) throw new Error('socket hang up')
            sent = true
            ctl.enqueue(c.bytes.subarray(0, 40))
          },
        })
        return { ...obj, body }
      }
    }
    const store = new BreakingStore()
    const app = createGateway({ store })
    await stored(store, c.key, c.bytes)
    const r = await app.request(`/v1/ns/a/chunks/${c.key}`)
    expect([r.status, await errCode(r)]).toEqual([502, 'ERR_STORE'])
    expect(app.state.metrics.corruptReads.value()).toBe(0)
    expect(app.state.memory.held).toBe(0)
  })
})
