// Chunk bodies through the Node adapter (a real HTTP server): verified PUT bodies
// read from the socket, GET bodies from a Node stream with backpressure, and every
// failure (corrupt, wrong key, stall, client gone) ends cleanly.

import net from 'node:net'
import { Readable } from 'node:stream'
import { afterEach, describe, expect, it } from 'vitest'
import { objectName } from '../src/core/keys.ts'
import { createGateway } from '../src/gateway/index.ts'
import { serveGateway } from '../src/gateway/node.ts'
import { MemoryStore } from '../src/gateway/stores/memory.ts'
import type { GetOptions, PutResult, StoreObject } from '../src/gateway/stores/types.ts'
import { makeChunk, putInit } from './gateway-fixtures.ts'

const MIB = 1024 * 1024

/** A memory store whose GET bodies come from Node streams (as S3Store's do), with a slow-upload knob. */
class NodeStreamStore extends MemoryStore {
  nativeGets: Readable[] = []
  /** Delay before the store starts reading an upload (a slow S3). */
  pullDelayMs = 0

  override async putIfAbsent(
    name: string,
    body: ReadableStream<Uint8Array> | Uint8Array,
    size: number,
  ): Promise<PutResult> {
    if (this.pullDelayMs) await new Promise((r) => setTimeout(r, this.pullDelayMs))
    return super.putIfAbsent(name, body, size)
  }

  override async get(name: string, opts?: GetOptions): Promise<StoreObject | undefined> {
    const obj = await super.get(name, opts)
    if (!obj) return obj
    const bytes = new Uint8Array(await new Response(obj.body).arrayBuffer())
    // Many small pieces, so a client that stops reading leaves most of them unsent.
    const native = Readable.from(
      (function* () {
        for (let at = 0; at < bytes.length; at += 64 * 1024)
          yield Buffer.from(bytes.subarray(at, at + 64 * 1024))
      })(),
    )
    this.nativeGets.push(native)
    return { ...obj, body: Readable.toWeb(native) as ReadableStream<Uint8Array> }
  }
}

const open: { close(ms?: number): Promise<void> }[] = []
afterEach(async () => {
  await Promise.all(open.splice(0).map((g) => g.close(100)))
})

async function serve(store: NodeStreamStore, limits = {}, logs?: Record<string, unknown>[]) {
  const app = createGateway({ store, limits, ...(logs ? { logger: (e) => logs.push(e) } : {}) })
  const gw = await serveGateway(app, { port: 0 })
  open.push(gw)
  return gw
}

function rawPut(port: number, key: string, size: number): net.Socket {
  const sock = net.connect(port, '127.0.0.1')
  sock.on('error', () => {})
  sock.write(
    `PUT /v1/ns/a/chunks/${key} HTTP/1.1\r\nhost: x\r\ncontent-type: application/octet-stream\r\ncontent-length: ${size}\r\n\r\n`,
  )
  return sock
}

const answer = (sock: net.Socket) =>
  new Promise<string>((resolve) => {
    let text = ''
    sock.on('data', (d) => {
      text += d
      if (/\r\n\r\n\{.*\}/s.test(text)) resolve(text)
    })
    sock.on('close', () => resolve(text))
  })

describe('gateway chunk bodies through the Node adapter', () => {
  it('PUT and GET (whole, Range): bytes identical, statuses logged', async () => {
    const store = new NodeStreamStore()
    const logs: Record<string, unknown>[] = []
    const gw = await serve(store, {}, logs)
    const c = makeChunk({ layers: 8, sectionBytes: 256 * 1024 })
    const put = await fetch(`${gw.url}/v1/ns/a/chunks/${c.key}`, putInit(c.bytes))
    expect(put.status).toBe(201)
    const get = await fetch(`${gw.url}/v1/ns/a/chunks/${c.key}`)
    expect(get.status).toBe(200)
    expect(get.headers.get('content-length')).toBe(String(c.bytes.length))
    expect(Buffer.compare(Buffer.from(await get.arrayBuffer()), Buffer.from(c.bytes))).toBe(0)
    const part = await fetch(`${gw.url}/v1/ns/a/chunks/${c.key}`, { headers: { range: 'bytes=100-199999' } })
    expect(part.status).toBe(206)
    expect(part.headers.get('content-range')).toBe(`bytes 100-199999/${c.bytes.length}`)
    expect(
      Buffer.compare(Buffer.from(await part.arrayBuffer()), Buffer.from(c.bytes.subarray(100, 200000))),
    ).toBe(0)
    expect(store.nativeGets).toHaveLength(2)
    expect(logs.map((l) => l.status)).toEqual([201, 200, 206])
  })

  it('a corrupt body or a key that disagrees with the header answers 400 and stores nothing', async () => {
    const store = new NodeStreamStore()
    const gw = await serve(store)
    const c = makeChunk({ layers: 4, sectionBytes: 512 * 1024 })
    const bad = c.bytes.slice()
    bad[bad.length - 10]! ^= 0xff
    const r1 = await fetch(`${gw.url}/v1/ns/a/chunks/${c.key}`, putInit(bad))
    expect(r1.status).toBe(400)
    expect(((await r1.json()) as { error: { code: string } }).error.code).toBe('ERR_FORMAT_CHECKSUM')
    const other = makeChunk()
    const r2 = await fetch(`${gw.url}/v1/ns/a/chunks/${other.key}`, putInit(c.bytes))
    expect(r2.status).toBe(400)
    expect(((await r2.json()) as { error: { code: string } }).error.code).toBe('ERR_INVALID_KEY')
    expect((await store.stats()).objects).toBe(0)
    // The connection and server stay usable.
    expect((await fetch(`${gw.url}/healthz`)).status).toBe(200)
  })

  it('a stalled body times out with 408; a store slow to read does not count as a stall', async () => {
    const store = new NodeStreamStore()
    const gw = await serve(store, { bodyIdleTimeoutMs: 150 })
    const c = makeChunk({ layers: 4, sectionBytes: 256 * 1024 })
    const sock = rawPut(gw.port, c.key, c.bytes.length)
    sock.write(c.bytes.subarray(0, 1000)) // then nothing
    const text = await answer(sock)
    sock.destroy()
    expect(text).toMatch(/^HTTP\/1\.1 408/)
    expect(text).toContain('ERR_TIMEOUT')
    expect((await store.stats()).objects).toBe(0)

    // Larger than what the gateway reads ahead, so the client is held back meanwhile.
    const big = makeChunk({ layers: 8, sectionBytes: 1 * MIB })
    store.pullDelayMs = 600 // 4× the idle limit before the store takes a byte
    const r = await fetch(`${gw.url}/v1/ns/a/chunks/${big.key}`, putInit(big.bytes))
    expect(r.status).toBe(201)
  })

  it('a client gone mid-body stores nothing and the server carries on', async () => {
    const store = new NodeStreamStore()
    const gw = await serve(store)
    const c = makeChunk({ layers: 4, sectionBytes: 1 * MIB })
    const sock = rawPut(gw.port, c.key, c.bytes.length)
    sock.write(c.bytes.subarray(0, c.bytes.length >> 1))
    await new Promise((r) => setTimeout(r, 200))
    sock.destroy()
    await new Promise((r) => setTimeout(r, 300))
    expect((await store.stats()).objects).toBe(0)
    const r = await fetch(`${gw.url}/v1/ns/a/chunks/${c.key}`, putInit(c.bytes))
    expect(r.status).toBe(201)
  })

  // fs: a file truncated under an open read ends its stream early without an error. A range is
  // not verified as a chunk, so only its length tells: the response must fail, not end quietly
  // short of its Content-Length (the client then waits on a kept-alive socket until it closes).
  it('a range the store serves short (or long) fails the response at once', async () => {
    for (const cut of [-1000, 1000]) {
      const store = new NodeStreamStore()
      const gw = await serve(store)
      const c = makeChunk({ layers: 4, sectionBytes: 3 * MIB })
      expect((await fetch(`${gw.url}/v1/ns/a/chunks/${c.key}`, putInit(c.bytes))).status).toBe(201)
      const get = store.get.bind(store)
      store.get = async (name, opts) => {
        const obj = await get(name, opts)
        if (!obj || !opts?.range) return obj
        const bytes = new Uint8Array(await new Response(obj.body).arrayBuffer())
        const served =
          cut < 0 ? bytes.subarray(0, bytes.length + cut) : Buffer.concat([bytes, new Uint8Array(cut)])
        return { ...obj, body: new Blob([served]).stream() }
      }
      const r = await fetch(`${gw.url}/v1/ns/a/chunks/${c.key}`, {
        // Over the coalescer's 8 MiB: streamed, not buffered (a buffer checks its length).
        headers: { range: 'bytes=100-9999999' },
      })
      expect(r.status).toBe(206)
      const body = r.arrayBuffer().then(
        (b) => `${b.byteLength} bytes`,
        () => 'failed',
      )
      const hung = new Promise((res) => setTimeout(() => res('hung'), 2000))
      expect(await Promise.race([body, hung])).toBe('failed')
    }
  })

  it('a GET client that goes away releases the store stream', async () => {
    const store = new NodeStreamStore()
    const gw = await serve(store)
    const c = makeChunk({ layers: 8, sectionBytes: 2 * MIB })
    expect((await fetch(`${gw.url}/v1/ns/a/chunks/${c.key}`, putInit(c.bytes))).status).toBe(201)
    const sock = net.connect(gw.port, '127.0.0.1')
    sock.on('error', () => {})
    sock.write(`GET /v1/ns/a/chunks/${c.key} HTTP/1.1\r\nhost: x\r\n\r\n`)
    await new Promise<void>((r) => sock.once('data', () => r()))
    sock.pause() // stop reading: backpressure holds the rest in the store stream
    await new Promise((r) => setTimeout(r, 100))
    const native = store.nativeGets[0]!
    expect(native.readableEnded).toBe(false)
    sock.destroy()
    await new Promise((r) => setTimeout(r, 200))
    expect(native.destroyed).toBe(true)
  })

  it('a streamed GET gives its read-ahead hold back exactly once on every end (aborts, store faults, 304, HEAD)', async () => {
    const HOLD = MIB
    /** Bodies in 64 KiB pieces that say they hold HOLD ahead (as S3's do); `broken` ones fail after two pieces. */
    class HoldingStore extends NodeStreamStore {
      broken = new Set<string>()
      getHoldBytes(length: number): number {
        return Math.min(length, HOLD)
      }
      override async get(name: string, opts?: GetOptions): Promise<StoreObject | undefined> {
        const obj = await super.get(name, opts)
        if (!obj || !this.broken.has(name)) return obj
        const reader = obj.body.getReader()
        let n = 0
        const body = new ReadableStream<Uint8Array>({
          async pull(c) {
            if (n++ === 2) throw new Error('connection reset by the store')
            const r = await reader.read()
            if (r.done) c.close()
            else c.enqueue(r.value)
          },
          cancel: (why) => reader.cancel(why),
        })
        return { ...obj, body }
      }
    }
    const store = new HoldingStore()
    const LIMIT = 8 * HOLD
    const app = createGateway({
      store,
      coalesce: false,
      limits: {
        maxHeldBytes: LIMIT,
        readerIdleTimeoutMs: 60_000,
        maxChunkBytes: 4 * MIB,
        maxCalibrationBytes: MIB,
        calibrationCacheBytes: 0,
      },
    })
    const gw = await serveGateway(app, { port: 0 })
    open.push(gw)
    const c = makeChunk({ layers: 8, sectionBytes: 400 * 1024 }) // over 3 MiB: 50 pieces, most unread
    const bad = makeChunk({ layers: 8, sectionBytes: 400 * 1024 })
    const url = `${gw.url}/v1/ns/a/chunks/${c.key}`
    expect((await fetch(url, putInit(c.bytes))).status).toBe(201)
    expect((await fetch(`${gw.url}/v1/ns/a/chunks/${bad.key}`, putInit(bad.bytes))).status).toBe(201)
    store.broken.add(objectName('kvgate', 'a', bad.key))
    const etag = (await fetch(url, { method: 'HEAD' })).headers.get('etag')!
    expect(etag).toMatch(/^"kv/)

    const read = async (res: Response, pieces: number) => {
      const r = res.body!.getReader()
      for (let i = 0; i < pieces; i++) if ((await r.read()).done) return
      await r.cancel()
    }
    const kinds: (() => Promise<unknown>)[] = [
      // Aborted before the answer came, right after it came, and mid-body.
      async () => {
        const ac = new AbortController()
        const p = fetch(url, { signal: ac.signal }).catch(() => undefined)
        setImmediate(() => ac.abort())
        await p
      },
      async () => {
        const ac = new AbortController()
        await fetch(url, { signal: ac.signal })
        ac.abort()
      },
      async () => read(await fetch(url), 3),
      async () => read(await fetch(url, { headers: { range: 'bytes=1000-' } }), 2),
      async () => read(await fetch(`${url}?layers=2-6`), 2),
      async () =>
        expect((await fetch(url)).arrayBuffer()).resolves.toHaveProperty('byteLength', c.bytes.length),
      // The store breaks the body off: the response fails.
      async () => {
        const r = await fetch(`${gw.url}/v1/ns/a/chunks/${bad.key}`, { headers: { range: 'bytes=0-' } })
        await r.arrayBuffer().catch(() => undefined)
      },
      // Answers that open no stream (or close it unread).
      async () => expect((await fetch(url, { headers: { 'if-none-match': etag } })).status).toBe(304),
      async () =>
        expect((await fetch(url, { headers: { 'if-none-match': etag, range: 'bytes=5-9' } })).status).toBe(
          304,
        ),
      async () => expect((await fetch(url, { method: 'HEAD' })).status).toBe(200),
    ]
    let peakSeen = 0
    for (let round = 0; round < 6; round++) {
      // At most 7 streams open at once: within the budget, so none is refused.
      await Promise.all(kinds.slice(0, 7).map((k) => k()))
      await Promise.all(kinds.slice(7).map((k) => k()))
      peakSeen = Math.max(peakSeen, app.state.memory.peak)
    }
    // Every lease ended: exactly 0 (one given back twice would leave it below), and it stays 0.
    await until(() => app.state.memory.held <= 0)
    await new Promise((r) => setTimeout(r, 200))
    expect(app.state.memory.held).toBe(0)
    expect(peakSeen).toBeLessThanOrEqual(LIMIT)
    expect(peakSeen).toBeGreaterThanOrEqual(2 * HOLD) // streams were held at once
    expect(app.state.metrics.busy.value({ what: 'get' })).toBe(0)
  })
})

async function until(cond: () => boolean, ms = 5000): Promise<void> {
  const t0 = Date.now()
  while (!cond()) {
    if (Date.now() - t0 > ms) throw new Error('condition not met in time')
    await new Promise((r) => setTimeout(r, 10))
  }
}
