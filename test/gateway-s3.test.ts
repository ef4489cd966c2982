// The s3 store and the gateway over a real S3 (Ceph RadosGW on loopback, see
// test/support/rgw.ts): conditional create, ranges, multipart, 40 MiB objects,
// lookup probing, presigned redirects followed by a real client, and S3 faults.

import { createHash } from 'node:crypto'
import * as net from 'node:net'
import { DeleteObjectCommand } from '@aws-sdk/client-s3'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createGateway } from '../src/gateway/index.ts'
import { type RunningGateway, S3Store, type S3StoreOptions, serveGateway } from '../src/gateway/node.ts'
import { makeChain, makeChunk, putInit } from './gateway-fixtures.ts'
import { type Rgw, useRgw } from './support/rgw.ts'

const MIB = 1024 * 1024
const rgw: Rgw | undefined = await useRgw('gateway-s3 (RadosGW)')
const run = rgw ? describe : describe.skip

let seq = 0
const uniq = () => `t${Date.now().toString(36)}${(++seq).toString(36)}`

function s3(opts: Partial<S3StoreOptions> = {}): S3Store {
  return new S3Store({
    bucket: rgw!.bucket,
    endpoint: rgw!.endpoint,
    region: rgw!.region,
    credentials: { accessKeyId: rgw!.accessKeyId, secretAccessKey: rgw!.secretAccessKey },
    ...opts,
  })
}

const sha = (b: Uint8Array) => createHash('sha256').update(b).digest('hex')
const text = (s: ReadableStream<Uint8Array>) => new Response(s).arrayBuffer().then((b) => new Uint8Array(b))

afterAll(async () => {
  await rgw?.stop()
})

run('s3 store on RadosGW', () => {
  const store = rgw ? s3({ multipartThreshold: 8 * MIB, partSize: 5 * MIB }) : undefined!
  afterAll(() => store.close())

  it('creates once; a second put answers exists (If-None-Match: *) and keeps the first bytes', async () => {
    const name = `${uniq()}/obj`
    const a = new Uint8Array(3000).fill(1)
    const b = new Uint8Array(3000).fill(2)
    expect(await store.putIfAbsent(name, a, a.length)).toBe('created')
    expect(await store.putIfAbsent(name, b, b.length)).toBe('exists')
    const got = await store.get(name)
    expect(await text(got!.body)).toEqual(a)
  })

  it('reads ranges, suffixes, and refuses a range past the end', async () => {
    const name = `${uniq()}/r`
    const bytes = Uint8Array.from({ length: 10_000 }, (_, i) => i & 0xff)
    await store.putIfAbsent(name, bytes, bytes.length)
    const r = await store.get(name, { range: { offset: 100, length: 50 } })
    expect(r).toMatchObject({ size: 10_000, offset: 100, length: 50 })
    expect(await text(r!.body)).toEqual(bytes.subarray(100, 150))
    const s = await store.get(name, { range: { suffix: 30 } })
    expect(s).toMatchObject({ offset: 9970, length: 30 })
    expect(await text(s!.body)).toEqual(bytes.subarray(9970))
    await expect(store.get(name, { range: { offset: 10_000 } })).rejects.toMatchObject({
      code: 'ERR_RANGE_NOT_SATISFIABLE',
    })
    expect(await store.get(`${name}-absent`)).toBeUndefined()
    expect(await store.head(`${name}-absent`)).toBeUndefined()
  })

  it('streams a 40 MiB body up in parts and back, identical', async () => {
    const name = `${uniq()}/big`
    const bytes = new Uint8Array(40 * MIB)
    for (let i = 0; i < bytes.length; i += 4096) bytes[i] = (i >>> 12) & 0xff
    // Feed it as an odd-sized stream so pieces straddle part boundaries.
    let at = 0
    const body = new ReadableStream<Uint8Array>({
      pull(c) {
        if (at >= bytes.length) return c.close()
        const n = Math.min(3 * MIB + 17, bytes.length - at)
        c.enqueue(bytes.subarray(at, at + n))
        at += n
      },
    })
    expect(await store.putIfAbsent(name, body, bytes.length)).toBe('created')
    expect(await store.head(name)).toMatchObject({ size: bytes.length })
    const got = await store.get(name)
    expect(sha(await text(got!.body))).toBe(sha(bytes))
    // Existing object: the HEAD before multipart answers without uploading.
    expect(await store.putIfAbsent(name, bytes, bytes.length)).toBe('exists')
  })

  it('a body stream that fails mid-upload leaves no object (single and multipart)', async () => {
    for (const size of [1 * MIB, 12 * MIB]) {
      const name = `${uniq()}/broken`
      const body = new ReadableStream<Uint8Array>({
        start(c) {
          c.enqueue(new Uint8Array(size / 2))
          c.error(new Error('client went away'))
        },
      })
      await expect(store.putIfAbsent(name, body, size)).rejects.toThrow(/client went away|body/)
      expect(await store.head(name)).toBeUndefined()
    }
  })

  it('a short body (less than declared) leaves no object', async () => {
    for (const size of [4096, 12 * MIB]) {
      const name = `${uniq()}/short`
      const body = new ReadableStream<Uint8Array>({
        start(c) {
          c.enqueue(new Uint8Array(size - 100))
          c.close()
        },
      })
      await expect(store.putIfAbsent(name, body, size)).rejects.toBeDefined()
      expect(await store.head(name)).toBeUndefined()
    }
  })

  it('deletes only the version named by ifMatch, though RadosGW 16.2 ignores If-Match on DELETE', async () => {
    const name = `${uniq()}/v`
    const first = new Uint8Array(100).fill(1)
    expect(await store.putIfAbsent(name, first, first.length)).toBe('created')
    const stale = (await store.head(name))!.etag!
    // What the store has to work around: RGW deletes whatever is there despite a wrong If-Match
    // (AWS S3 answers 412). If this starts failing, RGW honours it: update docs/calibration.md.
    await store.client.send(
      new DeleteObjectCommand({
        Bucket: store.bucket,
        Key: name,
        IfMatch: '"0123456789abcdef0123456789abcdef"',
      }),
    )
    expect(await store.head(name)).toBeUndefined()
    // A copy put back since the etag was read stays: the store checks the version first.
    const second = new Uint8Array(100).fill(2)
    expect(await store.putIfAbsent(name, second, second.length)).toBe('created')
    expect((await store.head(name))!.etag).not.toBe(stale)
    expect(await store.delete(name, { ifMatch: stale })).toBe(false)
    expect(await text((await store.get(name))!.body)).toEqual(second)
    expect(await store.delete(name, { ifMatch: (await store.head(name))!.etag })).toBe(true)
    expect(await store.head(name)).toBeUndefined()
  })

  it('lists with pagination and deletes', async () => {
    const dir = uniq()
    for (let i = 0; i < 5; i++) await store.putIfAbsent(`${dir}/o${i}`, new Uint8Array(i + 1), i + 1)
    const p1 = await store.list(`${dir}/`, { limit: 3 })
    expect(p1.entries.map((e) => e.name)).toEqual([`${dir}/o0`, `${dir}/o1`, `${dir}/o2`])
    const p2 = await store.list(`${dir}/`, { limit: 3, cursor: p1.cursor! })
    expect(p2.entries).toEqual([
      { name: `${dir}/o3`, size: 4, modified: expect.any(Number) },
      { name: `${dir}/o4`, size: 5, modified: expect.any(Number) },
    ])
    // gc's grace period reads the listed write time: S3 reports it to the second.
    expect(Math.abs(p2.entries[0]!.modified! - Date.now())).toBeLessThan(120_000)
    expect(p2.cursor).toBeUndefined()
    expect(await store.delete(`${dir}/o0`)).toBe(true)
    expect(await store.delete(`${dir}/o0`)).toBe(false)
  })
})

run('gateway over RadosGW (node server, real HTTP)', () => {
  let gw: RunningGateway
  let store: S3Store
  let app: ReturnType<typeof createGateway>
  const prefix = rgw ? uniq() : ''

  beforeAll(async () => {
    store = s3()
    app = createGateway({ store, prefix, presign: { minBytes: 32 * MIB, expiresSeconds: 60 } })
    gw = await serveGateway(app, { port: 0 })
  })
  afterAll(async () => {
    await gw.close()
    await store.close()
  })

  it('PUTs a 40 MiB chunk (streamed + verified), GETs it back, ranges and layers included', async () => {
    const c = makeChunk({ layers: 8, sectionBytes: 5 * MIB })
    expect(c.bytes.length).toBeGreaterThan(40 * MIB)
    const url = `${gw.url}/v1/ns/big/chunks/${c.key}`
    const put = await fetch(url, putInit(c.bytes))
    expect(put.status).toBe(201)
    // Below the presign threshold? No: 40 MiB ≥ 32 MiB, so GET redirects; a real client follows it.
    const get = await fetch(url)
    expect(get.status).toBe(200)
    expect(get.redirected).toBe(true)
    expect(sha(new Uint8Array(await get.arrayBuffer()))).toBe(sha(c.bytes))
    const manual = await fetch(url, { redirect: 'manual' })
    expect(manual.status).toBe(307)
    expect(manual.headers.get('location')).toMatch(/X-Amz-Signature=/)
    // The client's Range travels with the redirect to S3.
    const ranged = await fetch(url, { headers: { range: 'bytes=1000-1999' } })
    expect(ranged.status).toBe(206)
    expect(new Uint8Array(await ranged.arrayBuffer())).toEqual(c.bytes.subarray(1000, 2000))
    const layers = await fetch(`${url}?layers=3-4`)
    expect(layers.status).toBe(200)
    expect(Number(layers.headers.get('content-length'))).toBeGreaterThan(10 * MIB)
    await layers.arrayBuffer()
  })

  it('serves small chunks directly with ranges', async () => {
    const c = makeChunk({ layers: 4, sectionBytes: 4096 })
    const url = `${gw.url}/v1/ns/small/chunks/${c.key}`
    expect((await fetch(url, putInit(c.bytes))).status).toBe(201)
    const r = await fetch(url, { headers: { range: 'bytes=-100' } })
    expect(r.status).toBe(206)
    expect(new Uint8Array(await r.arrayBuffer())).toEqual(c.bytes.subarray(c.bytes.length - 100))
    const h = await fetch(url, { method: 'HEAD' })
    expect(h.headers.get('content-length')).toBe(String(c.bytes.length))
  })

  it("the ETag is the stored bytes', not S3's: one PUT and a multipart upload of a chunk get the same", async () => {
    const c = makeChunk({ layers: 4, sectionBytes: 3 * MIB }) // 12 MiB: parts of 5 MiB below
    const parted = s3({ multipartThreshold: 8 * MIB, partSize: 5 * MIB })
    const single = s3({ multipartThreshold: 64 * MIB })
    try {
      const tags: string[] = []
      const storeTags: string[] = []
      for (const st of [parted, single]) {
        const p = uniq()
        const a = createGateway({ store: st, prefix: p, coalesce: false })
        const path = `/v1/ns/e/chunks/${c.key}`
        expect((await a.request(path, putInit(c.bytes))).status).toBe(201)
        storeTags.push((await st.head(`${p}/e/${c.key.slice(0, 2)}/${c.key}`))?.etag ?? '')
        const g = await a.request(path)
        // The store's read-ahead is held in the budget while the stream is open, and given back.
        expect(a.state.memory.held).toBe(st.getHoldBytes(c.bytes.length))
        expect(sha(new Uint8Array(await g.arrayBuffer()))).toBe(sha(c.bytes))
        expect(a.state.memory.held).toBe(0)
        const h = await a.request(path, { method: 'HEAD' })
        expect(h.headers.get('etag')).toBe(g.headers.get('etag'))
        tags.push(g.headers.get('etag')!)
        const n = await a.request(path, { headers: { 'if-none-match': tags.at(-1)! } })
        expect(n.status).toBe(304)
        const past = await a.request(path, { headers: { range: `bytes=${c.bytes.length}-` } })
        expect([past.status, past.headers.get('content-range')]).toEqual([416, `bytes */${c.bytes.length}`])
        const empty = await a.request(path, { headers: { range: 'bytes=-0' } })
        expect([empty.status, empty.headers.get('content-range')]).toEqual([416, `bytes */${c.bytes.length}`])
      }
      expect(storeTags[0]).toMatch(/-\d+"?$/) // S3's multipart tag: "<md5 of md5s>-<parts>"
      expect(storeTags[0]).not.toBe(storeTags[1])
      expect(tags[0]).toBe(tags[1])
    } finally {
      await parted.close()
      await single.close()
    }
  })

  it('N concurrent writers of one prefix store one object per chunk', async () => {
    const chain = makeChain(6, { layers: 2, sectionBytes: 64 * 1024 })
    const writers = 8
    const results = await Promise.all(
      Array.from({ length: writers }, () =>
        Promise.all(
          chain.map(async (c) => {
            const r = await fetch(`${gw.url}/v1/ns/fleet/chunks/${c.key}`, putInit(c.bytes))
            return ((await r.json()) as { status: string }).status
          }),
        ),
      ),
    )
    const flat = results.flat()
    expect(flat.filter((s) => s === 'created')).toHaveLength(chain.length)
    expect(flat.filter((s) => s === 'exists')).toHaveLength(chain.length * (writers - 1))
    const listed = await store.list(`${prefix}/fleet/`)
    expect(listed.entries).toHaveLength(chain.length)
  })

  it('a corrupt chunk PUT stores nothing in S3', async () => {
    const c = makeChunk({ layers: 4, sectionBytes: 256 * 1024 })
    const bad = c.bytes.slice()
    bad[bad.length - 1]! ^= 0xff
    const r = await fetch(`${gw.url}/v1/ns/corrupt/chunks/${c.key}`, putInit(bad))
    expect(r.status).toBe(400)
    expect(((await r.json()) as { error: { code: string } }).error.code).toBe('ERR_FORMAT_CHECKSUM')
    expect((await store.list(`${prefix}/corrupt/`)).entries).toHaveLength(0)
  })

  it('a cold 512-key lookup over S3 takes ≤ 3 rounds; a warm one none', async () => {
    const chain = makeChain(512, { layers: 1, sectionBytes: 16 })
    const ns = 'chain'
    // Write 300 straight to S3 so the gateway cache is cold.
    await Promise.all(
      chain
        .slice(0, 300)
        .map((c) =>
          store.putIfAbsent(`${prefix}/${ns}/${c.key.slice(0, 2)}/${c.key}`, c.bytes, c.bytes.length),
        ),
    )
    const ask = (sizes: boolean) =>
      fetch(`${gw.url}/v1/ns/${ns}/lookup`, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify({ keys: chain.map((c) => c.key), sizes }),
      })
    const fast = await ask(false)
    expect(await fast.json()).toEqual({ present: 300 })
    expect(Number(fast.headers.get('x-kvgate-store-requests'))).toBeLessThan(60)
    expect(Number(fast.headers.get('x-kvgate-store-rounds'))).toBeLessThanOrEqual(3)
    const full = await ask(true)
    const body = (await full.json()) as { present: number; sizes: number[] }
    expect(body.present).toBe(300)
    expect(body.sizes).toEqual(chain.slice(0, 300).map((c) => c.bytes.length))
    // Warm: the cached run costs nothing; only the absent tail is probed again (one round).
    const warm = await ask(true)
    expect(((await warm.json()) as { present: number }).present).toBe(300)
    expect(Number(warm.headers.get('x-kvgate-store-rounds'))).toBe(1)
    const cached = await fetch(`${gw.url}/v1/ns/${ns}/lookup`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ keys: chain.slice(0, 300).map((c) => c.key) }),
    })
    expect(((await cached.json()) as { present: number }).present).toBe(300)
    expect(cached.headers.get('x-kvgate-store-requests')).toBe('0')
  })
})

run(
  'presence heals behind two gateways (objects deleted through the S3 API, as lifecycle expiry does)',
  () => {
    it('one failed GET or the presence TTL: lookups stop reporting them, and a re-PUT stores them', async () => {
      const prefix = uniq()
      const stores = [s3(), s3()]
      const gws = await Promise.all(
        stores.map((store) =>
          serveGateway(createGateway({ store, prefix, lookup: { presenceTtlMs: 1500 } }), { port: 0 }),
        ),
      )
      const [a, b] = gws as [RunningGateway, RunningGateway]
      try {
        const chain = makeChain(40, { layers: 2, sectionBytes: 512 })
        const keys = chain.map((c) => c.key)
        for (const c of chain)
          expect((await fetch(`${a.url}/v1/ns/ns/chunks/${c.key}`, putInit(c.bytes))).status).toBe(201)
        const present = async (gw: RunningGateway) => {
          const r = await fetch(`${gw.url}/v1/ns/ns/lookup`, {
            method: 'POST',
            headers: { 'content-type': 'application/json' },
            body: JSON.stringify({ keys }),
          })
          return ((await r.json()) as { present: number }).present
        }
        expect(await present(a)).toBe(40)
        expect(await present(b)).toBe(40)
        // Expiry removes the oldest chunks (1 and 2) directly in S3; neither gateway is told.
        for (const i of [1, 2]) {
          await stores[0]!.client.send(
            new DeleteObjectCommand({
              Bucket: rgw!.bucket,
              Key: `${prefix}/ns/${keys[i]!.slice(0, 2)}/${keys[i]}`,
            }),
          )
        }
        // A: one failed GET is enough.
        expect((await fetch(`${a.url}/v1/ns/ns/chunks/${keys[1]}`)).status).toBe(404)
        expect(await present(a)).toBe(1)
        // B saw no GET: within the TTL (and its background checks of inferred keys) it stops too.
        let fromB = await present(b)
        for (let i = 0; i < 40 && fromB !== 1; i++) {
          await new Promise((r) => setTimeout(r, 100))
          fromB = await present(b)
        }
        expect(fromB).toBe(1)
        // The next writer re-stores them through either gateway (create-only asks S3, not a cache).
        expect((await fetch(`${b.url}/v1/ns/ns/chunks/${keys[1]}`, putInit(chain[1]!.bytes))).status).toBe(
          201,
        )
        expect((await fetch(`${a.url}/v1/ns/ns/chunks/${keys[2]}`, putInit(chain[2]!.bytes))).status).toBe(
          201,
        )
        expect((await fetch(`${a.url}/v1/ns/ns/chunks/${keys[3]}`, putInit(chain[3]!.bytes))).status).toBe(
          200,
        )
        expect(await present(a)).toBe(40)
        let again = await present(b)
        for (let i = 0; i < 40 && again !== 40; i++) {
          await new Promise((r) => setTimeout(r, 100))
          again = await present(b)
        }
        expect(again).toBe(40)
        const g = await fetch(`${b.url}/v1/ns/ns/chunks/${keys[1]}`)
        expect(sha(new Uint8Array(await g.arrayBuffer()))).toBe(sha(chain[1]!.bytes))
      } finally {
        await Promise.all(gws.map((g) => g.close()))
        await Promise.all(stores.map((s) => s.close()))
      }
    })
  },
)

// A TCP proxy in front of RGW: close it to take "S3" away, or make it swallow bytes.
async function proxy(target: URL) {
  let mode: 'pass' | 'down' | 'stall' = 'pass'
  const sockets = new Set<net.Socket>()
  const server = net.createServer((client) => {
    sockets.add(client)
    client.on('close', () => sockets.delete(client))
    client.on('error', () => {})
    if (mode === 'down') return client.destroy()
    if (mode === 'stall') return // accept, never answer
    const up = net.connect(Number(target.port), target.hostname)
    sockets.add(up)
    up.on('close', () => sockets.delete(up))
    up.on('error', () => client.destroy())
    client.pipe(up).pipe(client)
  })
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r))
  const port = (server.address() as net.AddressInfo).port
  return {
    endpoint: `http://127.0.0.1:${port}`,
    set(m: typeof mode) {
      mode = m
      for (const s of sockets) s.destroy()
    },
    close: () =>
      new Promise<void>((r) => {
        server.close(() => r())
        for (const s of sockets) s.destroy()
      }),
  }
}

run('gateway when S3 fails', () => {
  it('S3 down → 503 ERR_STORE_UNAVAILABLE, slow S3 → 503 ERR_TIMEOUT; the server stays up and recovers', async () => {
    const px = await proxy(new URL(rgw!.endpoint))
    const store = s3({
      endpoint: px.endpoint,
      requestTimeoutMs: 1500,
      idleTimeoutMs: 1500,
      connectTimeoutMs: 1000,
      maxAttempts: 1,
    })
    const gw = await serveGateway(createGateway({ store, prefix: uniq() }), { port: 0 })
    try {
      const c = makeChunk()
      const url = `${gw.url}/v1/ns/f/chunks/${c.key}`
      expect((await fetch(url, putInit(c.bytes))).status).toBe(201)

      px.set('down')
      const other = makeChunk()
      for (const req of [
        fetch(url.replace(c.key, other.key)),
        fetch(url.replace(c.key, other.key), putInit(other.bytes)),
        fetch(`${gw.url}/v1/ns/f/lookup`, {
          method: 'POST',
          headers: { 'content-type': 'application/json' },
          body: JSON.stringify({ keys: [other.key] }),
        }),
      ]) {
        const r = await req
        expect(r.status).toBe(503)
        expect(((await r.json()) as { error: { code: string } }).error.code).toBe('ERR_STORE_UNAVAILABLE')
      }
      expect((await fetch(`${gw.url}/healthz`)).status).toBe(200)

      px.set('stall')
      const slow = await fetch(url.replace(c.key, other.key))
      expect(slow.status).toBe(503)
      expect(((await slow.json()) as { error: { code: string } }).error.code).toBe('ERR_TIMEOUT')

      px.set('pass')
      const back = await fetch(url)
      expect(back.status).toBe(200)
      expect(new Uint8Array(await back.arrayBuffer())).toEqual(c.bytes)
      // Nothing half-written while S3 was away.
      expect(await store.head(`x`)).toBeUndefined()
      const metrics = await (await fetch(`${gw.url}/metrics`)).text()
      expect(metrics).toMatch(/kvgate_errors_total\{code="ERR_STORE_UNAVAILABLE"\} [1-9]/)
    } finally {
      await gw.close(100)
      await store.close()
      await px.close()
    }
  })
})

run('gateway with bad S3 credentials and slow clients', () => {
  it('S3 refusing the request (bad secret) → 502 ERR_STORE with a code, nothing cached', async () => {
    const store = s3({
      credentials: { accessKeyId: rgw!.accessKeyId, secretAccessKey: 'wrong-secret' },
      maxAttempts: 1,
    })
    const app = createGateway({ store, prefix: uniq() })
    const c = makeChunk()
    for (const init of [undefined, putInit(c.bytes)]) {
      const r = await app.request(`/v1/ns/a/chunks/${c.key}`, init)
      expect(r.status).toBe(502)
      expect(((await r.json()) as { error: { code: string } }).error.code).toBe('ERR_STORE')
    }
    await store.close()
  })

  it('an upload cut off mid-body stores nothing; a slow but complete one succeeds', async () => {
    const store = s3()
    const prefix = uniq()
    const gw = await serveGateway(createGateway({ store, prefix }), { port: 0 })
    const rawPut = (key: string, bytes: Uint8Array) => {
      const sock = net.connect(gw.port, '127.0.0.1')
      sock.on('error', () => {})
      sock.write(
        `PUT /v1/ns/cut/chunks/${key} HTTP/1.1\r\nhost: x\r\ncontent-type: application/octet-stream\r\ncontent-length: ${bytes.length}\r\n\r\n`,
      )
      return sock
    }
    try {
      const c = makeChunk({ layers: 4, sectionBytes: 1 * MIB })
      const cut = rawPut(c.key, c.bytes)
      cut.write(c.bytes.subarray(0, c.bytes.length >> 1))
      await new Promise((r) => setTimeout(r, 300))
      cut.destroy()
      await new Promise((r) => setTimeout(r, 500))
      expect((await store.list(`${prefix}/cut/`)).entries).toHaveLength(0)
      expect((await fetch(`${gw.url}/healthz`)).status).toBe(200)

      const slow = rawPut(c.key, c.bytes)
      let response = ''
      slow.on('data', (d) => (response += d))
      for (let at = 0; at < c.bytes.length; at += 512 * 1024) {
        slow.write(c.bytes.subarray(at, at + 512 * 1024))
        await new Promise((r) => setTimeout(r, 30))
      }
      await new Promise<void>((r) => {
        const t = setInterval(() => {
          if (response.includes('\r\n\r\n{')) {
            clearInterval(t)
            r()
          }
        }, 20)
      })
      slow.destroy()
      expect(response).toMatch(/^HTTP\/1\.1 201/)
      expect((await store.list(`${prefix}/cut/`)).entries).toHaveLength(1)
    } finally {
      await gw.close(100)
      await store.close()
    }
  })

  it('a client that stops reading a large GET does not stall other requests', async () => {
    const store = s3()
    const gw = await serveGateway(createGateway({ store, prefix: uniq() }), { port: 0 })
    try {
      const c = makeChunk({ layers: 4, sectionBytes: 6 * MIB })
      expect((await fetch(`${gw.url}/v1/ns/slow/chunks/${c.key}`, putInit(c.bytes))).status).toBe(201)
      const sock = net.connect(gw.port, '127.0.0.1')
      await new Promise((r) => sock.once('connect', r))
      sock.write(`GET /v1/ns/slow/chunks/${c.key} HTTP/1.1\r\nhost: x\r\n\r\n`)
      sock.pause() // never read: the gateway must apply backpressure, not buffer 24 MiB
      await new Promise((r) => setTimeout(r, 500))
      const h = await fetch(`${gw.url}/healthz`)
      expect(h.status).toBe(200)
      const again = await fetch(`${gw.url}/v1/ns/slow/chunks/${c.key}`, { headers: { range: 'bytes=0-99' } })
      expect(new Uint8Array(await again.arrayBuffer())).toEqual(c.bytes.subarray(0, 100))
      sock.destroy()
    } finally {
      await gw.close(100)
      await store.close()
    }
  })
})
