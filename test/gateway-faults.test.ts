// The Node gateway under faults (issue 11: findings 3, 15, 21, 23): failed store PUTs
// release their timers and buffers, a large PUT holds bounded memory, stalled readers
// are cut off and release their store stream, and an "exists" answer reaches a client
// that closes after its request.

import { createHash } from 'node:crypto'
import { mkdtempSync, readdirSync, readlinkSync } from 'node:fs'
import { createServer, request, type Server } from 'node:http'
import type { AddressInfo } from 'node:net'
import net from 'node:net'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { Readable } from 'node:stream'
import { setFlagsFromString } from 'node:v8'
import { runInNewContext } from 'node:vm'
import { afterEach, describe, expect, it } from 'vitest'
import { KvgateError } from '../src/core/errors.ts'
import { encodeChunk } from '../src/core/format.ts'
import { toHex } from '../src/core/keys.ts'
import { createGateway } from '../src/gateway/index.ts'
import { GatewayMetrics } from '../src/gateway/metrics.ts'
import { FsStore, S3Store, serveGateway } from '../src/gateway/node.ts'
import { MemoryStore } from '../src/gateway/stores/memory.ts'
import type { GetOptions, PutResult, StoreObject } from '../src/gateway/stores/types.ts'
import { makeChunk, putInit } from './gateway-fixtures.ts'
import { pacedGet, splitResponse } from './support/paced-reader.ts'

const MIB = 1024 * 1024
setFlagsFromString('--expose-gc')
const gc = runInNewContext('gc') as () => void
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms))
const timers = () => process.getActiveResourcesInfo().filter((x) => x === 'Timeout').length
const settle = async () => {
  for (let i = 0; i < 5; i++) {
    await sleep(50)
    gc()
  }
}

const open: { close(ms?: number): Promise<void> }[] = []
afterEach(async () => {
  await Promise.all(open.splice(0).map((g) => g.close(100)))
})

async function serve(app: ReturnType<typeof createGateway>) {
  const gw = await serveGateway(app, { port: 0 })
  open.push(gw)
  return gw
}

/** A fake S3 endpoint that answers PutObject 503 SlowDown once it has read 1 MiB of the body. */
async function slowDownS3(): Promise<{ url: string; close(): Promise<void> }> {
  const s3: Server = createServer((req, res) => {
    if (req.method === 'HEAD' || req.method === 'GET') {
      res.writeHead(404).end()
      return
    }
    let got = 0
    req.on('data', (d: Buffer) => {
      got += d.length
      if (got >= MIB && !res.headersSent) {
        res.writeHead(503, { 'content-type': 'application/xml', connection: 'close' })
        res.end('<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>')
        setTimeout(() => req.socket.destroy(), 20)
      }
    })
  })
  await new Promise<void>((r) => s3.listen(0, '127.0.0.1', r))
  return {
    url: `http://127.0.0.1:${(s3.address() as AddressInfo).port}`,
    close: () =>
      new Promise<void>((r) => {
        s3.closeAllConnections()
        s3.close(() => r())
      }),
  }
}

/**
 * Streams a valid `layers` × `sectionBytes` chunk object to `url` without holding it:
 * every section is the same block (so the header's CRCs are cheap to compute).
 */
function streamChunk(url: string, layers: number, sectionBytes: number): () => Promise<number> {
  const block = new Uint8Array(sectionBytes).fill(7)
  const chainKey = crypto.getRandomValues(new Uint8Array(32))
  // The header depends only on section lengths and CRCs: encode it once with 1 layer
  // of the block repeated by reference (encodeChunk copies), then keep the header only.
  const whole = encodeChunk(
    {
      codec: 'raw',
      codecVersion: 1,
      codecParams: new Uint8Array(0),
      geometry: { layers, kvHeads: 1, headDim: 64, dtype: 'fp16' },
      tokens: 1,
      chunkIndex: 0,
      partial: false,
      namespaceId: new Uint8Array(16),
      chainKey,
      parentKey: new Uint8Array(32),
    },
    Array.from({ length: layers }, () => block),
  )
  const headerBytes = whole.length - layers * sectionBytes
  const header = Buffer.from(whole.subarray(0, headerBytes))
  const total = whole.length
  const u = new URL(`${url}/v1/ns/a/chunks/${toHex(chainKey)}`)
  return () =>
    new Promise((resolve, reject) => {
      const req = request(
        u,
        {
          method: 'PUT',
          headers: { 'content-type': 'application/octet-stream', 'content-length': String(total) },
        },
        (res) => {
          res.resume()
          res.on('end', () => resolve(res.statusCode ?? 0))
        },
      )
      req.on('error', reject)
      const buf = Buffer.from(block.buffer, block.byteOffset, block.length)
      let sent = 0
      const pump = () => {
        while (sent < layers) {
          sent++
          if (!req.write(buf)) return void req.once('drain', pump)
        }
        req.end()
      }
      req.write(header)
      pump()
    })
}

/**
 * PUTs `c` over a raw socket at 100 bytes every 100 ms (1 KB/s, never idle for 300 ms) until the
 * gateway answers ERR_TIMEOUT (or 5 s pass); returns what it answered.
 */
async function trickledPut(port: number, c: { key: string; bytes: Uint8Array }): Promise<string> {
  const sock = net.connect(port, '127.0.0.1')
  sock.on('error', () => {})
  let text = ''
  sock.on('data', (d) => {
    text += d
  })
  sock.write(
    `PUT /v1/ns/a/chunks/${c.key} HTTP/1.1\r\nhost: x\r\ncontent-type: application/octet-stream\r\ncontent-length: ${c.bytes.length}\r\n\r\n`,
  )
  let at = 0
  const trickle = setInterval(() => {
    if (at >= c.bytes.length || sock.destroyed) return
    sock.write(c.bytes.subarray(at, at + 100))
    at += 100
  }, 100)
  try {
    for (let i = 0; i < 100 && !text.includes('ERR_TIMEOUT'); i++) await sleep(50)
  } finally {
    clearInterval(trickle)
    sock.destroy()
  }
  return text
}

describe('failed store PUTs release what they hold', () => {
  it('20 PUTs refused by S3 (503 SlowDown mid-body): timers and buffers back to baseline', async () => {
    const s3 = await slowDownS3()
    const store = new S3Store({
      bucket: 'b',
      endpoint: s3.url,
      credentials: { accessKeyId: 'a', secretAccessKey: 'b' },
      maxAttempts: 1,
    })
    const gw = await serve(createGateway({ store }))
    const chunks = Array.from({ length: 20 }, () => makeChunk({ layers: 12, sectionBytes: MIB }))
    await settle()
    const t0 = timers()
    const ab0 = process.memoryUsage().arrayBuffers
    const statuses = new Set<number>()
    for (const c of chunks) {
      const r = await fetch(`${gw.url}/v1/ns/a/chunks/${c.key}`, putInit(c.bytes)).catch(() => undefined)
      statuses.add(r?.status ?? -1)
      await r?.arrayBuffer().catch(() => {})
    }
    expect([...statuses].every((s) => s === 503 || s === -1)).toBe(true)
    chunks.length = 0
    await settle()
    // Each leaked body kept a re-arming watchdog and its read-ahead (≥ 4 MiB).
    expect(timers()).toBeLessThanOrEqual(t0 + 2)
    expect(process.memoryUsage().arrayBuffers - ab0).toBeLessThan(24 * MIB)
    await store.close()
    await s3.close()
  })

  it('PUTs failing in the store (ENOSPC-like, after reading part of the body) leave no timer behind', async () => {
    class FailingStore extends MemoryStore {
      override async putIfAbsent(
        _n: string,
        body: ReadableStream<Uint8Array> | Uint8Array,
        _size: number,
      ): Promise<PutResult> {
        const reader = (body as ReadableStream<Uint8Array>).getReader()
        await reader.read()
        reader.releaseLock()
        throw new KvgateError('ERR_STORE_FULL', 'no space', { status: 507 })
      }
    }
    const gw = await serve(createGateway({ store: new FailingStore() }))
    await settle()
    const t0 = timers()
    for (let i = 0; i < 10; i++) {
      const c = makeChunk({ layers: 8, sectionBytes: MIB })
      const r = await fetch(`${gw.url}/v1/ns/a/chunks/${c.key}`, putInit(c.bytes)).catch((e) => e as Error)
      expect(r).not.toBeInstanceOf(Error) // the client gets the answer, not a reset
      expect((r as Response).status).toBe(507)
      await (r as Response).arrayBuffer().catch(() => {})
    }
    await settle()
    expect(timers()).toBeLessThanOrEqual(t0 + 2)
  })
})

describe('PUT memory is bounded (finding 15)', () => {
  it('a 256 MiB PUT raises the gateway process memory by far less than its size', async () => {
    let stored = 0
    class CountingStore extends MemoryStore {
      override async putIfAbsent(
        _n: string,
        body: ReadableStream<Uint8Array> | Uint8Array,
        _size: number,
      ): Promise<PutResult> {
        for await (const piece of body as ReadableStream<Uint8Array>) stored += piece.length
        return 'created'
      }
    }
    const gw = await serve(createGateway({ store: new CountingStore() }))
    const send = streamChunk(gw.url, 256, MIB)
    await settle()
    const base = process.memoryUsage()
    let peak = 0
    const sample = setInterval(() => {
      const m = process.memoryUsage()
      peak = Math.max(peak, m.arrayBuffers - base.arrayBuffers + (m.heapUsed - base.heapUsed))
    }, 5)
    try {
      expect(await send()).toBe(201)
    } finally {
      clearInterval(sample)
    }
    expect(stored).toBeGreaterThan(256 * MIB)
    // Read-ahead (4 MiB) + socket buffers + one section block on the client side.
    expect(peak).toBeLessThan(64 * MIB)
  })
})

describe('slow and closing clients', () => {
  it('an "exists" answer reaches a client that sends Connection: close (C3 size mismatch too)', async () => {
    const gw = await serve(createGateway({ store: new MemoryStore() }))
    const c = makeChunk({ layers: 8, sectionBytes: 2 * MIB })
    expect((await fetch(`${gw.url}/v1/ns/a/chunks/${c.key}`, putInit(c.bytes))).status).toBe(201)
    const other = makeChunk({ layers: 8, sectionBytes: MIB, key: c.key })
    // Same size first (answered from the store without reading the body), then C3's other size.
    for (let i = 0; i < 12; i++) {
      const bytes = i < 8 ? c.bytes : other.bytes
      const text = await new Promise<string>((resolve) => {
        const sock = net.connect(gw.port, '127.0.0.1')
        let got = ''
        sock.on('data', (d) => {
          got += d
        })
        sock.on('error', () => {})
        sock.on('close', () => resolve(got))
        sock.write(
          `PUT /v1/ns/a/chunks/${c.key} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n` +
            `content-type: application/octet-stream\r\ncontent-length: ${bytes.length}\r\n\r\n`,
        )
        // Sent in pieces, as a client streaming from elsewhere does: still sending when answered.
        let at = 0
        const next = () => {
          if (sock.destroyed) return
          if (at >= bytes.length) return void sock.end()
          sock.write(bytes.subarray(at, at + 256 * 1024))
          at += 256 * 1024
          setTimeout(next, 2)
        }
        next()
      })
      expect(text).toMatch(/^HTTP\/1\.1 200/)
      expect(text).toContain('"status":"exists"')
    }
  })

  it('a GET reader that stops reading is cut off after readerIdleTimeoutMs and releases the store stream', async () => {
    const gets: Readable[] = []
    class NodeStreamStore extends MemoryStore {
      override async get(n: string, opts?: GetOptions): Promise<StoreObject | undefined> {
        const obj = await super.get(n, opts)
        if (!obj) return obj
        const bytes = new Uint8Array(await new Response(obj.body).arrayBuffer())
        const native = Readable.from(
          (function* () {
            for (let at = 0; at < bytes.length; at += 64 * 1024)
              yield Buffer.from(bytes.subarray(at, at + 64 * 1024))
          })(),
        )
        gets.push(native)
        return { ...obj, body: Readable.toWeb(native) as ReadableStream<Uint8Array> }
      }
    }
    const gw = await serve(
      createGateway({ store: new NodeStreamStore(), limits: { readerIdleTimeoutMs: 300 }, coalesce: false }),
    )
    const c = makeChunk({ layers: 8, sectionBytes: 2 * MIB })
    expect((await fetch(`${gw.url}/v1/ns/a/chunks/${c.key}`, putInit(c.bytes))).status).toBe(201)
    const connections = () => new Promise<number>((r) => gw.server.getConnections((_, n) => r(n)))
    const n0 = await connections()
    const sock = net.connect(gw.port, '127.0.0.1')
    sock.on('error', () => {})
    sock.write(`GET /v1/ns/a/chunks/${c.key} HTTP/1.1\r\nhost: x\r\n\r\n`)
    await new Promise<void>((r) => sock.once('data', () => r()))
    sock.pause() // a stalled reader: never reads again, never closes
    expect(await connections()).toBe(n0 + 1)
    for (let i = 0; i < 100 && (await connections()) > n0; i++) await sleep(50)
    expect(await connections()).toBeLessThanOrEqual(n0)
    expect(gets[0]!.destroyed).toBe(true)
    sock.destroy()
  })

  describe('a GET reader that trickles (never quite idle) below readerMinBytesPerSecond', () => {
    // A 2 s window (readerIdleTimeoutMs) and 4 MiB/s: the fs store reads 1 MiB pieces, so a
    // reader at 2 MiB/s pulls one every half second and never idles for the window.
    const limits = { readerIdleTimeoutMs: 2000, readerMinBytesPerSecond: 4 * MIB }
    const storeFds = (root: string) =>
      readdirSync('/proc/self/fd').filter((fd) => {
        try {
          return readlinkSync(`/proc/self/fd/${fd}`).startsWith(root)
        } catch {
          return false // closed meanwhile
        }
      }).length

    async function fsGateway() {
      const root = mkdtempSync(join(tmpdir(), 'kvgate-readers-'))
      const store = await new FsStore({ root, fsync: false }).open()
      const metrics = new GatewayMetrics()
      const gw = await serve(createGateway({ store, metrics, limits, coalesce: false }))
      const connections = () => new Promise<number>((r) => gw.server.getConnections((_, n) => r(n)))
      return { root, metrics, gw, connections }
    }

    it('is cut off within a few windows, its file handle released and the cut-off counted as slow', async () => {
      const { root, metrics, gw, connections } = await fsGateway()
      // 48 MiB: at 2 MiB/s it would take 24 s; the socket buffers hold a few MiB.
      const c = makeChunk({ layers: 24, sectionBytes: 2 * MIB })
      expect((await fetch(`${gw.url}/v1/ns/a/chunks/${c.key}`, putInit(c.bytes))).status).toBe(201)
      const n0 = await connections()
      const fds0 = storeFds(root)
      const t0 = Date.now()
      const reader = pacedGet(gw.url, `/v1/ns/a/chunks/${c.key}`, 2 * MIB)
      try {
        for (let i = 0; i < 20 && storeFds(root) === fds0; i++) await sleep(25)
        expect(storeFds(root)).toBe(fds0 + 1) // the GET holds its file open
        const body = await Promise.race([reader.closed, sleep(15_000).then(() => undefined)])
        const took = Date.now() - t0
        expect(body).toBeDefined() // the gateway closed the connection
        expect(body!.length).toBeLessThan(c.bytes.length) // before the client had it all
        // The first windows count the burst that fills the socket buffers (several MiB, more
        // as they grow); then one window below the rate ends it, far before the 24 s it needs.
        expect(took).toBeLessThan(6 * limits.readerIdleTimeoutMs)
        expect(metrics.readersCutOff.value({ reason: 'slow' })).toBe(1)
        expect(metrics.readersCutOff.value({ reason: 'idle' })).toBe(0)
        for (let i = 0; i < 40 && storeFds(root) > fds0; i++) await sleep(25)
        expect(storeFds(root)).toBe(fds0)
        for (let i = 0; i < 40 && (await connections()) > n0; i++) await sleep(25)
        expect(await connections()).toBe(n0)
      } finally {
        reader.sock.destroy()
      }
    }, 30_000)

    it('a streamed calibration GET is held to the same pace: cut off, its file released, counted', async () => {
      const root = mkdtempSync(join(tmpdir(), 'kvgate-readers-'))
      const store = await new FsStore({ root, fsync: false }).open()
      const metrics = new GatewayMetrics()
      // No calibration cache: every GET streams from the store, hashed on the way.
      const app = createGateway({
        store,
        metrics,
        limits: { ...limits, calibrationCacheBytes: 0, maxCalibrationBytes: 64 * MIB },
      })
      const gw = await serve(app)
      const bytes = new Uint8Array(48 * MIB)
      bytes.set([0x4b, 0x56, 0x43, 0x4c, 1, 0])
      for (let i = 8; i < bytes.length; i += 4096) bytes[i] = i & 0xff
      const hash = createHash('sha256').update(bytes).digest('hex')
      const put = await fetch(`${gw.url}/v1/ns/a/calibrations/${hash}`, {
        method: 'PUT',
        headers: { 'content-type': 'application/octet-stream' },
        body: bytes,
      })
      expect(put.status).toBe(201)
      const fds0 = storeFds(root)
      const reader = pacedGet(gw.url, `/v1/ns/a/calibrations/${hash}`, 2 * MIB)
      try {
        const got = await Promise.race([reader.closed, sleep(15_000).then(() => undefined)])
        expect(got).toBeDefined()
        expect(got!.length).toBeLessThan(bytes.length)
        expect(metrics.readersCutOff.value({ reason: 'slow' })).toBe(1)
        for (let i = 0; i < 40 && storeFds(root) > fds0; i++) await sleep(25)
        expect(storeFds(root)).toBe(fds0)
      } finally {
        reader.sock.destroy()
      }
    }, 30_000)

    it('a reader above the rate (paced the same way) gets every byte, and nothing stays behind', async () => {
      const { root, metrics, gw, connections } = await fsGateway()
      const c = makeChunk({ layers: 24, sectionBytes: 2 * MIB })
      expect((await fetch(`${gw.url}/v1/ns/a/chunks/${c.key}`, putInit(c.bytes))).status).toBe(201)
      const n0 = await connections()
      const fds0 = storeFds(root)
      const reader = pacedGet(gw.url, `/v1/ns/a/chunks/${c.key}`, 12 * MIB) // 48 MiB: 4 s, two windows
      const raw = await Promise.race([reader.closed, sleep(20_000).then(() => undefined)])
      reader.sock.destroy()
      expect(raw).toBeDefined()
      const { head, body } = splitResponse(raw!)
      expect(head).toMatch(/^HTTP\/1\.1 200/)
      expect(Buffer.compare(body, Buffer.from(c.bytes))).toBe(0)
      expect(metrics.readersCutOff.value()).toBe(0)
      for (let i = 0; i < 40 && (storeFds(root) > fds0 || (await connections()) > n0); i++) await sleep(25)
      expect(storeFds(root)).toBe(fds0)
      expect(await connections()).toBe(n0)
    }, 30_000)
  })

  it('a trickled PUT body (never quite idle) fails with 408 once slower than bodyMinBytesPerSecond', async () => {
    const store = new MemoryStore()
    const gw = await serve(
      createGateway({ store, limits: { bodyIdleTimeoutMs: 300, bodyMinBytesPerSecond: 64 * 1024 } }),
    )
    const c = makeChunk({ layers: 2, sectionBytes: 256 * 1024 })
    expect(await trickledPut(gw.port, c)).toMatch(/^HTTP\/1\.1 408/)
    expect((await store.stats()).objects).toBe(0)
  })

  it('a trickled PUT of a stored chunk (answered "exists", the rest drained) fails with 408 too, its admission given back', async () => {
    const store = new MemoryStore()
    const app = createGateway({ store, limits: { bodyIdleTimeoutMs: 300, bodyMinBytesPerSecond: 64 * 1024 } })
    const gw = await serve(app)
    const c = makeChunk({ layers: 2, sectionBytes: 256 * 1024 })
    expect((await fetch(`${gw.url}/v1/ns/a/chunks/${c.key}`, putInit(c.bytes))).status).toBe(201)
    // It would hold its declared bytes of maxInFlightBytes for the ~8 minutes the rest takes.
    expect(await trickledPut(gw.port, c)).toMatch(/^HTTP\/1\.1 408/)
    expect(app.state.inFlight.bytes).toBe(0)
  })

  it('connections are bounded: past maxConnections a new one is closed at accept', async () => {
    const gw = await serveGateway(createGateway({ store: new MemoryStore() }), { port: 0, maxConnections: 2 })
    open.push(gw)
    const held = [0, 1].map(() => {
      const s = net.connect(gw.port, '127.0.0.1')
      s.on('error', () => {})
      return s
    })
    await Promise.all(held.map((s) => new Promise((r) => s.once('connect', r))))
    await sleep(50)
    const extra = net.connect(gw.port, '127.0.0.1')
    extra.on('error', () => {})
    const reply = new Promise<string>((resolve) => {
      let text = ''
      extra.on('data', (d) => {
        text += d
      })
      extra.on('close', () => resolve(text))
    })
    extra.write('GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n')
    expect(await Promise.race([reply, sleep(3000).then(() => 'still open')])).toBe('')
    for (const s of held) s.destroy()
    extra.destroy()
  })

  it('PUT bodies in flight are bounded: above maxInFlightBytes a PUT gets 503 ERR_BUSY', async () => {
    const gw = await serve(createGateway({ store: new MemoryStore(), limits: { maxInFlightBytes: 3 * MIB } }))
    const big = makeChunk({ layers: 2, sectionBytes: MIB })
    // One PUT in flight (sends half its body, then waits).
    const sock = net.connect(gw.port, '127.0.0.1')
    sock.on('error', () => {})
    sock.write(
      `PUT /v1/ns/a/chunks/${big.key} HTTP/1.1\r\nhost: x\r\ncontent-type: application/octet-stream\r\ncontent-length: ${big.bytes.length}\r\n\r\n`,
    )
    sock.write(big.bytes.subarray(0, 1000))
    await sleep(100)
    const other = makeChunk({ layers: 2, sectionBytes: MIB })
    const r = await fetch(`${gw.url}/v1/ns/a/chunks/${other.key}`, putInit(other.bytes))
    expect(r.status).toBe(503)
    expect(((await r.json()) as { error: { code: string } }).error.code).toBe('ERR_BUSY')
    sock.end(big.bytes.subarray(1000))
    await sleep(100)
    const again = await fetch(`${gw.url}/v1/ns/a/chunks/${other.key}`, putInit(other.bytes))
    expect(again.status).toBe(201)
    sock.destroy()
  })
})
