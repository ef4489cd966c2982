// The gateway's bound on the bytes it holds for requests (limits.maxHeldBytes,
// src/gateway/memory-budget.ts): reserved before bytes are held, refused past the bound
// (PUTs 503 ERR_BUSY, GETs stream instead of buffering), given back on every path.

import { createHash } from 'node:crypto'
import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { describe, expect, it, vi } from 'vitest'
import { objectName } from '../src/core/keys.ts'
import { configFromEnv, lambdaPartConcurrency } from '../src/gateway/adapters/lambda.ts'
import { gatewayFromEnv } from '../src/gateway/adapters/workers.ts'
import { GetCoalescer } from '../src/gateway/coalesce.ts'
import { resolveServeConfig, settingsFromEnv } from '../src/gateway/config.ts'
import { HEADER_CACHE_BYTES } from '../src/gateway/context.ts'
import { createGateway, MemoryStore } from '../src/gateway/index.ts'
import {
  BODY_HOLD_BYTES,
  bodyHoldBytes,
  lambdaMaxHeldBytes,
  lookupHoldBytes,
  MemoryBudget,
  WORKER_MAX_HELD_BYTES,
  WORKER_PRESENCE_ENTRIES,
} from '../src/gateway/memory-budget.ts'
import { FsStore, S3Store } from '../src/gateway/node.ts'
import { type R2BucketLike, R2Store } from '../src/gateway/stores/r2.ts'
import type { StoreObject } from '../src/gateway/stores/types.ts'
import { makeChunk, putInit } from './gateway-fixtures.ts'

const MIB = 1024 * 1024
const sha = (b: Uint8Array) => createHash('sha256').update(b).digest('hex')
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms))
const errCode = async (r: Response) => ((await r.json()) as { error: { code: string } }).error.code

async function until(cond: () => boolean, ms = 5000): Promise<void> {
  const end = Date.now() + ms
  while (!cond()) {
    if (Date.now() > end) throw new Error('timed out')
    await sleep(5)
  }
}

/** Bytes that pass the calibration checks (magic "KVCL" + version); distinct per seed. */
function calib(seed: number, size: number): Uint8Array {
  const b = new Uint8Array(size)
  b.set([0x4b, 0x56, 0x43, 0x4c, 1, 0])
  for (let i = 8; i < size; i++) b[i] = (i * 131 + seed * 17) & 0xff
  return b
}

/**
 * A request body that sends its first `head` bytes, then waits for `go()`: it ends (the
 * rest), or errors (a client that went away) when `go(true)`.
 */
function gated(bytes: Uint8Array, head = 64) {
  let go!: (abort?: boolean) => void
  const gate = new Promise<boolean>((r) => {
    go = (abort = false) => r(abort)
  })
  const body = new ReadableStream<Uint8Array>({
    async start(ctl) {
      ctl.enqueue(bytes.slice(0, head))
      if (await gate) ctl.error(new Error('client went away'))
      else {
        ctl.enqueue(bytes.slice(head))
        ctl.close()
      }
    },
  })
  return { body, go }
}

const putOf = (bytes: Uint8Array, body: BodyInit = bytes as Uint8Array<ArrayBuffer>) =>
  ({
    method: 'PUT',
    headers: { 'content-type': 'application/octet-stream', 'content-length': String(bytes.length) },
    body,
    duplex: 'half',
  }) as RequestInit

/** A memory store that says it holds a part per PUT over `threshold`, as R2 and S3 multipart do. */
class PartedStore extends MemoryStore {
  constructor(
    readonly threshold: number,
    readonly partBytes: number,
  ) {
    super()
  }
  putHoldBytes(size: number): number {
    return size > this.threshold ? this.partBytes : 0
  }
}

describe('MemoryBudget', () => {
  it('grants reservations up to its limit, refuses past it, and a release is counted once', () => {
    const b = new MemoryBudget(100)
    const a = b.tryReserve(60)!
    expect(b.tryReserve(41)).toBeUndefined()
    const c = b.tryReserve(40)!
    expect([b.held, b.peak]).toEqual([100, 100])
    expect(b.tryReserve(1)).toBeUndefined()
    a.release()
    a.release() // idempotent: a second release must not free someone else's bytes
    expect(b.held).toBe(40)
    expect(b.tryReserve(61)).toBeUndefined()
    c.release()
    expect([b.held, b.peak]).toEqual([0, 100])
    expect(b.tryReserve(0)).toBeDefined()
    expect(b.render().join('\n')).toMatch(
      /kvgate_held_bytes 0\n[\s\S]*kvgate_held_bytes_peak 100[\s\S]*limit 100/,
    )
  })

  it('refuses malformed limits and reservations', () => {
    for (const bad of [0, -1, 1.5, Number.NaN, 2 ** 60])
      expect(() => new MemoryBudget(bad)).toThrow(TypeError)
    const b = new MemoryBudget(10)
    for (const bad of [-1, 0.5, Number.NaN, Number.POSITIVE_INFINITY])
      expect(() => b.tryReserve(bad)).toThrow(TypeError)
    expect(b.held).toBe(0)
  })

  it('a streamed PUT holds its read-ahead and the store parts, not its declared size', () => {
    const none = {}
    expect(bodyHoldBytes(1000, none)).toBe(1000)
    expect(bodyHoldBytes(90 * MIB, none)).toBe(BODY_HOLD_BYTES)
    expect(bodyHoldBytes(90 * MIB, new PartedStore(64 * MIB, 8 * MIB))).toBe(BODY_HOLD_BYTES + 8 * MIB)
    const bucket = { get: async () => null, put: async () => null } as unknown as R2BucketLike
    const r2 = new R2Store(bucket, { multipartThreshold: 64 * MIB, partBytes: 8 * MIB })
    expect(r2.putHoldBytes(90 * MIB)).toBe(8 * MIB)
    const s3 = new S3Store({ bucket: 'b', region: 'us-east-1', partSize: 16 * MIB, partConcurrency: 4 })
    expect(s3.putHoldBytes(512 * MIB)).toBe(80 * MIB) // 4 parts in flight + the one being filled
    expect(s3.putHoldBytes(100 * MIB)).toBe(4 * MIB) // its Readable's read-ahead
    expect(s3.getHoldBytes(100 * MIB)).toBe(4 * MIB) // a GET body reads ahead of its reader
  })
})

describe('a gateway past maxHeldBytes', () => {
  it('calibration PUTs: those past the budget get 503 ERR_BUSY; held bytes return to 0 after done, bad and aborted bodies', async () => {
    const size = 1000
    const app = createGateway({
      store: new MemoryStore(),
      limits: {
        maxHeldBytes: 3 * size,
        maxCalibrationBytes: size,
        maxChunkBytes: size,
        maxLookupBodyBytes: 10,
      },
    })
    const [ok, bad, aborted, late] = [1, 2, 3, 4].map((s) => calib(s, size)) as [
      Uint8Array,
      Uint8Array,
      Uint8Array,
      Uint8Array,
    ]
    const url = (h: string) => `/v1/ns/team/calibrations/${h}`
    const g = [gated(ok), gated(bad), gated(aborted)]
    const running = [
      app.request(url(sha(ok)), putOf(ok, g[0]!.body)),
      app.request(url(sha(late)), putOf(bad, g[1]!.body)), // its bytes are not its name
      app.request(url(sha(aborted)), putOf(aborted, g[2]!.body)),
    ]
    // Held whole while they arrive: three bodies fill the budget.
    await until(() => app.state.memory.held === 3 * size)
    const busy = await app.request(url(sha(late)), putOf(late))
    expect(busy.status).toBe(503)
    expect(busy.headers.get('retry-after')).toBe('1')
    expect(await errCode(busy)).toBe('ERR_BUSY')
    expect(app.state.metrics.busy.value({ what: 'calibration' })).toBe(1)
    g[0]!.go()
    g[1]!.go()
    g[2]!.go(true)
    const [a, b, c] = await Promise.all(running)
    expect(a!.status).toBe(201)
    expect([b!.status, await errCode(b!)]).toEqual([400, 'ERR_FORMAT_CHECKSUM'])
    expect(c!.status).toBeGreaterThanOrEqual(400)
    expect(app.state.memory.held).toBe(0)
    expect(app.state.memory.peak).toBe(3 * size)
    expect(app.state.inFlight.bytes).toBe(0)
    // Nothing half-stored: the refused one goes through now, the aborted one was never stored.
    expect((await app.request(url(sha(late)), putOf(late))).status).toBe(201)
    expect((await app.request(url(sha(aborted)), { method: 'HEAD' })).status).toBe(404)
    expect(app.state.memory.held).toBe(0)
  })

  it('a calibration PUT whose client stalls or trickles gives its reservation back after the body idle bounds (408)', async () => {
    const size = 100_000
    const app = createGateway({
      store: new MemoryStore(),
      limits: {
        maxHeldBytes: 2 * size,
        maxCalibrationBytes: size,
        maxChunkBytes: size,
        maxLookupBodyBytes: 1000,
        bodyIdleTimeoutMs: 200,
        bodyMinBytesPerSecond: 50_000,
      },
    })
    const url = (b: Uint8Array) => `/v1/ns/team/calibrations/${sha(b)}`
    const [stalled, slow, ok] = [1, 2, 3].map((s) => calib(s, size)) as [Uint8Array, Uint8Array, Uint8Array]
    // Sends 64 bytes, then nothing (the client is alive: its socket stays open).
    const g = gated(stalled)
    // Sends 1 KiB every 50 ms: never idle, ~20 KB/s.
    const trickle = new ReadableStream<Uint8Array>({
      async pull(c) {
        await sleep(50)
        c.enqueue(new Uint8Array(1024))
      },
    })
    const outcome = (p: Promise<Response>) =>
      Promise.race([p.then(async (r) => [r.status, await errCode(r)]), sleep(3000).then(() => 'still held')])
    const both = Promise.all([
      outcome(Promise.resolve(app.request(url(stalled), putOf(stalled, g.body)))),
      outcome(Promise.resolve(app.request(url(slow), putOf(slow, trickle)))),
    ])
    await until(() => app.state.memory.held === 2 * size)
    expect(await both).toEqual([
      [408, 'ERR_TIMEOUT'],
      [408, 'ERR_TIMEOUT'],
    ])
    expect([app.state.memory.held, app.state.inFlight.bytes]).toEqual([0, 0])
    expect((await app.request(url(ok), putOf(ok))).status).toBe(201)
    g.go(true)
  })

  it('chunk PUTs on the multipart path hold a part each: past the budget 503; held returns to 0 after done, bad and aborted bodies', async () => {
    const chunks = [0, 1, 2, 3].map(() => makeChunk({ layers: 2, sectionBytes: 64 * 1024 }))
    const size = chunks[0]!.bytes.length
    const part = MIB
    const store = new PartedStore(100 * 1024, part)
    // Two multipart PUTs fit (each its body, under the read-ahead, plus a part); a third does not.
    const app = createGateway({
      store,
      limits: {
        maxHeldBytes: 2 * (size + part) + 1000,
        maxLookupBodyBytes: 1000,
        maxChunkBytes: 200 * 1024,
        maxCalibrationBytes: 1000,
      },
    })
    const url = (k: string) => `/v1/ns/a/chunks/${k}`
    const [ok, bad, aborted, late] = chunks as [
      (typeof chunks)[0],
      (typeof chunks)[0],
      (typeof chunks)[0],
      (typeof chunks)[0],
    ]
    const corrupt = bad.bytes.slice()
    corrupt[corrupt.length - 10]! ^= 0xff // a section CRC fails at the end
    const g = [gated(ok.bytes), gated(corrupt)]
    const running = [
      app.request(url(ok.key), putOf(ok.bytes, g[0]!.body)),
      app.request(url(bad.key), putOf(corrupt, g[1]!.body)),
    ]
    await until(() => app.state.memory.held === 2 * (size + part))
    const busy = await app.request(url(late.key), putOf(late.bytes))
    expect([busy.status, busy.headers.get('retry-after'), await errCode(busy)]).toEqual([
      503,
      '1',
      'ERR_BUSY',
    ])
    expect(app.state.metrics.busy.value({ what: 'put' })).toBe(1)
    g[0]!.go()
    g[1]!.go()
    const [a, b] = await Promise.all(running)
    expect(a!.status).toBe(201)
    expect(b!.status).toBe(400)
    expect(app.state.memory.held).toBe(0)
    // A client that goes away mid-body gives its reservation back too.
    const ga = gated(aborted.bytes)
    const gone = app.request(url(aborted.key), putOf(aborted.bytes, ga.body))
    await until(() => app.state.memory.held === size + part)
    ga.go(true)
    expect((await gone).status).toBeGreaterThanOrEqual(400)
    expect(app.state.memory.held).toBe(0)
    expect(app.state.inFlight.bytes).toBe(0)
    // Nothing half-stored; the refused one goes through now.
    expect(await store.head(`kvgate/a/${bad.key.slice(0, 2)}/${bad.key}`)).toBeUndefined()
    expect(await store.head(`kvgate/a/${aborted.key.slice(0, 2)}/${aborted.key}`)).toBeUndefined()
    expect((await app.request(url(late.key), putOf(late.bytes))).status).toBe(201)
    expect(app.state.memory.peak).toBeLessThanOrEqual(app.state.limits.maxHeldBytes)
  })

  it('lookups hold their body, text and keys: past the budget 503; held returns to 0 after done, bad and aborted bodies', async () => {
    const max = 4096
    const app = createGateway({
      store: new MemoryStore(),
      limits: {
        maxHeldBytes: 2 * lookupHoldBytes(max, 4096),
        maxLookupBodyBytes: max,
        maxCalibrationBytes: 1000,
        maxChunkBytes: 1000,
      },
    })
    const url = '/v1/ns/a/lookup'
    const json = new TextEncoder().encode(JSON.stringify({ keys: ['ab'.repeat(32), 'cd'.repeat(32)] }))
    const post = (body: BodyInit, length?: number) =>
      ({
        method: 'POST',
        headers: {
          'content-type': 'application/json',
          ...(length === undefined ? {} : { 'content-length': String(length) }),
        },
        body,
        duplex: 'half',
      }) as RequestInit
    // Chunked bodies declare no length: each reserves for the largest body allowed.
    const g = [gated(json, 10), gated(json, 10)]
    const running = [app.request(url, post(g[0]!.body)), app.request(url, post(g[1]!.body))]
    await until(() => app.state.memory.held === 2 * lookupHoldBytes(max, 4096))
    const busy = await app.request(url, post(json as Uint8Array<ArrayBuffer>, json.length))
    expect(busy.status).toBe(503)
    expect(busy.headers.get('retry-after')).toBe('1')
    expect(await errCode(busy)).toBe('ERR_BUSY')
    expect(app.state.metrics.busy.value({ what: 'lookup' })).toBe(1)
    g[0]!.go()
    g[1]!.go(true)
    const [done, aborted] = await Promise.all(running)
    expect([done!.status, await done!.json()]).toEqual([200, { present: 0 }])
    expect(aborted!.status).toBeGreaterThanOrEqual(400)
    expect(app.state.memory.held).toBe(0)
    // With a declared length only that much is reserved; a bad body gives it back too.
    const bad = new TextEncoder().encode('{"keys": [')
    expect((await app.request(url, post(bad as Uint8Array<ArrayBuffer>, bad.length))).status).toBe(400)
    const ok = await app.request(url, post(json as Uint8Array<ArrayBuffer>, json.length))
    expect(ok.status).toBe(200)
    expect(app.state.memory.held).toBe(0)
    expect(app.state.memory.peak).toBe(2 * lookupHoldBytes(max, 4096))
  })

  it('a lookup body of many small JSON values is refused before it is parsed (JSON.parse would build ~22x the body)', async () => {
    const app = createGateway({ store: new MemoryStore() })
    const { maxLookupBodyBytes: max, maxLookupKeys } = app.state.limits
    const post = (text: string) =>
      app.request('/v1/ns/a/lookup', {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: text,
      })
    // Within the body cap: 512 KiB of `{}` are ~175,000 objects (~11 MB of heap) for 1.5 MiB reserved.
    const amplified = ['{}', '[]', '0', '{"a":0}'].map((v) => {
      const n = Math.floor((max - 20) / (v.length + 1))
      return `{"keys":[${Array(n).fill(v).join(',')}]}`
    })
    const parse = vi.spyOn(JSON, 'parse')
    try {
      for (const text of amplified) {
        expect(text.length).toBeLessThanOrEqual(max)
        const r = await post(text)
        expect(r.status).toBe(413)
        expect(await errCode(r)).toBe('ERR_PAYLOAD_TOO_LARGE')
        expect(parse.mock.calls.some(([t]) => typeof t === 'string' && t.length >= text.length)).toBe(false)
        expect(app.state.memory.held).toBe(0)
      }
    } finally {
      parse.mockRestore()
    }
    // The largest lookup allowed, with its other fields and commas, colons and brackets inside strings.
    const keys = Array.from({ length: maxLookupKeys }, (_, i) => i.toString(16).padStart(64, '0'))
    const full = JSON.stringify({ note: ',:[{\\"'.repeat(50), keys, sizes: false, more: [1, 2, { x: [] }] })
    const ok = await post(full)
    expect([ok.status, await ok.json()]).toEqual([200, { present: 0 }])
    // Past maxLookupKeys it is refused as before.
    const over = await post(JSON.stringify({ keys: [...keys, 'ab'.repeat(32)] }))
    expect(over.status).toBe(413)
    expect(app.state.memory.held).toBe(0)
  })

  it('a lookup reserves what parsing its largest body holds: body, text and the V8 heap of its values', () => {
    const keys = Array.from({ length: 4096 }, (_, i) => i.toString(16).padStart(64, '0'))
    const text = JSON.stringify({ keys })
    // Measured: ~100 bytes of heap per parsed key beyond its 64 characters (body and text count once each).
    expect(lookupHoldBytes(text.length, 4096)).toBeGreaterThanOrEqual(3 * text.length + 100 * 4096)
    expect(lookupHoldBytes(512 * 1024, 4096)).toBeLessThanOrEqual(3 * 512 * 1024 + 2 * MIB)
  })

  it('a lookup whose client stalls or trickles gives its reservation back after the body idle bounds (408)', async () => {
    const max = 64 * 1024
    const app = createGateway({
      store: new MemoryStore(),
      limits: {
        maxHeldBytes: 2 * lookupHoldBytes(max, 4096),
        maxLookupBodyBytes: max,
        maxCalibrationBytes: 1000,
        maxChunkBytes: 1000,
        bodyIdleTimeoutMs: 200,
        bodyMinBytesPerSecond: 50_000,
      },
    })
    const keys = Array.from({ length: 900 }, (_, i) => i.toString(16).padStart(64, '0'))
    const json = new TextEncoder().encode(JSON.stringify({ keys }))
    const post = (body: BodyInit) =>
      ({
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body,
        duplex: 'half',
      }) as RequestInit
    const g = gated(json, 10) // sends 10 bytes, then nothing
    const trickle = new ReadableStream<Uint8Array>({
      async pull(c) {
        await sleep(50)
        c.enqueue(new TextEncoder().encode(' '.repeat(1024))) // ~20 KB/s of JSON whitespace
      },
    })
    const outcome = (p: Promise<Response>) =>
      Promise.race([p.then(async (r) => [r.status, await errCode(r)]), sleep(3000).then(() => 'still held')])
    const both = Promise.all([
      outcome(Promise.resolve(app.request('/v1/ns/a/lookup', post(g.body)))),
      outcome(Promise.resolve(app.request('/v1/ns/a/lookup', post(trickle)))),
    ])
    await until(() => app.state.memory.held === 2 * lookupHoldBytes(max, 4096))
    expect(await both).toEqual([
      [408, 'ERR_TIMEOUT'],
      [408, 'ERR_TIMEOUT'],
    ])
    expect(app.state.memory.held).toBe(0)
    const ok = await app.request('/v1/ns/a/lookup', post(json as Uint8Array<ArrayBuffer>))
    expect([ok.status, await ok.json()]).toEqual([200, { present: 0 }])
    g.go(true)
  })

  it('a store that fails the PUT gives the reservation back', async () => {
    const store = new MemoryStore()
    store.putIfAbsent = async () => {
      throw new Error('store down')
    }
    const app = createGateway({ store })
    const c = makeChunk()
    const r = await app.request(`/v1/ns/a/chunks/${c.key}`, putOf(c.bytes))
    expect(r.status).toBeGreaterThanOrEqual(500)
    expect(app.state.memory.held).toBe(0)
    expect(app.state.memory.peak).toBe(c.bytes.length)
  })

  it('a calibration GET streams (hashed) instead of buffering when the budget is spent', async () => {
    const store = new MemoryStore()
    const bytes = calib(9, 4000)
    const writer = createGateway({ store })
    const url = `/v1/ns/team/calibrations/${sha(bytes)}`
    expect((await writer.request(url, putOf(bytes))).status).toBe(201)
    const app = createGateway({ store }) // a fresh instance: nothing cached
    const others = app.state.memory.tryReserve(app.state.limits.maxHeldBytes)!
    const g = await app.request(url)
    expect(g.status).toBe(200)
    expect(new Uint8Array(await g.arrayBuffer())).toEqual(bytes)
    expect(app.state.calibrations.size).toBe(0) // streamed, not read whole
    expect(app.state.memory.held).toBe(app.state.limits.maxHeldBytes)
    others.release()
    expect(new Uint8Array(await (await app.request(url)).arrayBuffer())).toEqual(bytes)
    expect(app.state.calibrations.size).toBe(1)
    expect(app.state.memory.held).toBe(0)
  })
})

describe('coalesced GET buffers', () => {
  const object = (n: number): StoreObject => ({
    body: new ReadableStream({
      start(c) {
        c.enqueue(new Uint8Array(n).fill(7))
        c.close()
      },
    }),
    size: n,
    offset: 0,
    length: n,
  })

  it('are reserved in the budget while a request holds them, and not buffered past it', async () => {
    const budget = new MemoryBudget(1000)
    const co = new GetCoalescer(8 * MIB, 64 * MIB, budget)
    let fetches = 0
    const fetch = async () => {
      fetches++
      await sleep(10)
      return object(600)
    }
    const [a, b] = await Promise.all([co.get('k', fetch), co.get('k', fetch)])
    expect([fetches, b.coalesced, budget.held]).toEqual([1, true, 600])
    await new Response(a.obj!.body).arrayBuffer()
    expect(budget.held).toBe(600) // the follower still holds it
    await new Response(b.obj!.body).arrayBuffer()
    expect(budget.held).toBe(0)

    // With the budget spent elsewhere, the leader streams and followers do their own GET.
    const others = budget.tryReserve(500)!
    fetches = 0
    const [c, d] = await Promise.all([co.get('k', fetch), co.get('k', fetch)])
    expect([fetches, d.coalesced, budget.held]).toEqual([2, false, 500])
    expect((await new Response(c.obj!.body).arrayBuffer()).byteLength).toBe(600)
    expect((await new Response(d.obj!.body).arrayBuffer()).byteLength).toBe(600)
    others.release()
    expect([budget.held, co.bufferedBytes]).toEqual([0, 0])
  })

  it('stay reserved until every request has read its bytes, not only started to (slow readers)', async () => {
    const n = 200 * 1024
    const budget = new MemoryBudget(300 * 1024)
    const co = new GetCoalescer(8 * MIB, 64 * MIB, budget)
    const fetch = async () => {
      await sleep(10)
      return object(n)
    }
    const [a, b] = await Promise.all([co.get('k', fetch), co.get('k', fetch)])
    expect(b.coalesced).toBe(true)
    // Each client has taken its first piece and reads no further yet (a slow socket).
    const ra = a.obj!.body.getReader()
    const rb = b.obj!.body.getReader()
    const first = [(await ra.read()).value!, (await rb.read()).value!]
    expect(first.every((p) => p.length < n)).toBe(true)
    expect(budget.held).toBe(n)
    let read = first[0]!.length
    for (let r = await ra.read(); !r.done; r = await ra.read()) read += r.value.length
    expect([read, budget.held]).toEqual([n, n]) // b is still reading it
    await rb.cancel()
    expect([budget.held, co.bufferedBytes]).toEqual([0, 0])
  })

  it('through the GET route: a client that never reads, or stops mid-body, gives the shared buffer back (idle bound, cancel)', async () => {
    let release!: () => void
    const gate = new Promise<void>((r) => (release = r))
    const base = new MemoryStore()
    const store = {
      kind: 'slow',
      get: async (n: string, o?: Parameters<MemoryStore['get']>[1]) => {
        await gate
        return base.get(n, o)
      },
      head: base.head.bind(base),
      putIfAbsent: base.putIfAbsent.bind(base),
      delete: base.delete.bind(base),
      list: base.list.bind(base),
    }
    const app = createGateway({ store, limits: { readerIdleTimeoutMs: 150 } })
    const c = makeChunk({ sectionBytes: 96 * 1024 }) // more than one 64 KiB piece
    expect((await app.request(`/v1/ns/a/chunks/${c.key}`, putInit(c.bytes))).status).toBeLessThan(300)
    const url = `/v1/ns/a/chunks/${c.key}`
    const pending = [app.request(url), app.request(url), app.request(url)]
    await sleep(20)
    release()
    const [whole, idle, stopped] = await Promise.all(pending)
    expect(app.state.metrics.coalesced.value()).toBe(2)
    expect(app.state.memory.held).toBe(c.bytes.length)
    expect(new Uint8Array(await whole!.arrayBuffer())).toEqual(c.bytes)
    const r = stopped!.body!.getReader()
    expect((await r.read()).value!.length).toBeLessThan(c.bytes.length)
    await r.cancel()
    expect(app.state.memory.held).toBe(c.bytes.length) // `idle` has not read a byte yet
    await until(() => app.state.memory.held === 0, 3000) // its reader idled out: released once
    expect(app.state.memory.held).toBe(0)
    expect(app.state.coalescer!.bufferedBytes).toBe(0)
    await idle!.body?.cancel().catch(() => {})
    expect(app.state.memory.held).toBe(0)
  })

  it('a store body that breaks while buffered gives its reservation back', async () => {
    const budget = new MemoryBudget(1000)
    const co = new GetCoalescer(8 * MIB, 64 * MIB, budget)
    const broken = async (): Promise<StoreObject> => ({
      body: new ReadableStream({
        pull(c) {
          c.error(new Error('socket reset'))
        },
      }),
      size: 600,
      offset: 0,
      length: 600,
    })
    await expect(co.get('k', broken)).rejects.toThrow(/socket reset/)
    expect([budget.held, co.bufferedBytes]).toEqual([0, 0])
  })
})

describe('store streams held by GET readers', () => {
  /** A memory store whose GET bodies say they read `hold` bytes ahead of the reader, as S3's do. */
  class ReadAheadStore extends MemoryStore {
    constructor(readonly hold: number) {
      super()
    }
    getHoldBytes(length: number): number {
      return Math.min(length, this.hold)
    }
    // Bodies in 64 KiB pieces, each read when pulled (a memory body is one piece, over at once).
    override async get(n: string, o?: Parameters<MemoryStore['get']>[1]) {
      const obj = await super.get(n, o)
      if (!obj) return obj
      const bytes = new Uint8Array(await new Response(obj.body).arrayBuffer())
      let at = 0
      const body = new ReadableStream<Uint8Array>(
        {
          pull(ctl) {
            if (at >= bytes.length) return ctl.close()
            ctl.enqueue(bytes.subarray(at, at + 64 * 1024))
            at += 64 * 1024
          },
        },
        { highWaterMark: 0 },
      )
      return { ...obj, body }
    }
  }

  it('count their read-ahead in maxHeldBytes: readers past the bound get 503 ERR_BUSY; each path gives it back', async () => {
    const store = new ReadAheadStore(MIB)
    const app = createGateway({
      store,
      coalesce: false,
      limits: {
        maxHeldBytes: 4 * MIB,
        maxChunkBytes: MIB,
        maxCalibrationBytes: MIB,
        calibrationCacheBytes: 0,
        // A reader that never reads is cut off only after this: slow readers hold meanwhile.
        readerIdleTimeoutMs: 60_000,
      },
    })
    const c = makeChunk({ layers: 4, sectionBytes: 100 * 1024 }) // over 64 KiB: pieces left to read
    const url = `/v1/ns/a/chunks/${c.key}`
    expect((await app.request(url, putInit(c.bytes))).status).toBe(201)
    const hold = Math.min(c.bytes.length, MIB)
    expect(hold).toBeLessThan(MIB) // the object is the bound, not the store's whole read-ahead
    const fit = Math.floor((4 * MIB) / hold)
    // Readers that take the head and then (all but) stop: a whole GET, a range, layers.
    const open: Response[] = []
    const kinds = [{}, { headers: { range: 'bytes=10-' } }, '?layers=0-3']
    for (let i = 0; i < fit; i++) {
      const k = kinds[i % kinds.length]!
      const r = typeof k === 'string' ? await app.request(url + k) : await app.request(url, k)
      expect(r.status).toBeLessThan(300)
      open.push(r)
    }
    expect(app.state.memory.held).toBeGreaterThan(4 * MIB - hold)
    for (const k of kinds) {
      const r = typeof k === 'string' ? await app.request(url + k) : await app.request(url, k)
      expect([r.status, r.headers.get('retry-after'), await errCode(r)]).toEqual([503, '1', 'ERR_BUSY'])
    }
    expect(app.state.metrics.busy.value({ what: 'get' })).toBe(3)
    // HEAD and a 304 open no store stream: not refused.
    expect((await app.request(url, { method: 'HEAD' })).status).toBe(200)
    // Read to the end, cancelled, or failed by the reader's pace: each gives its hold back.
    const [done, cancelled] = open
    expect(new Uint8Array(await done!.arrayBuffer())).toEqual(c.bytes)
    await cancelled!.body!.cancel()
    const again = await app.request(url)
    expect(again.status).toBe(200)
    expect(new Uint8Array(await again.arrayBuffer())).toEqual(c.bytes)
    for (const r of open.slice(2)) await r.body!.cancel()
    expect(app.state.memory.held).toBe(0)
  })

  it('a reader cut off by its pace, or a stream the store breaks, gives its hold back', async () => {
    const store = new ReadAheadStore(MIB)
    const app = createGateway({ store, coalesce: false, limits: { readerIdleTimeoutMs: 100 } })
    const c = makeChunk({ layers: 4, sectionBytes: 100 * 1024 })
    const url = `/v1/ns/a/chunks/${c.key}`
    expect((await app.request(url, putInit(c.bytes))).status).toBe(201)
    const idle = await app.request(url)
    expect(app.state.memory.held).toBe(c.bytes.length)
    await until(() => app.state.memory.held === 0, 3000)
    await idle.body?.cancel().catch(() => {})
    // A body found corrupt at its end fails the response: its hold goes with it.
    const other = makeChunk({ layers: 4, sectionBytes: 100 * 1024 })
    const bad = other.bytes.slice()
    bad[bad.length - 1]! ^= 1
    await store.putIfAbsent(objectName('kvgate', 'a', other.key), bad, bad.length)
    const failed = await app.request(`/v1/ns/a/chunks/${other.key}`)
    expect(failed.status).toBe(200)
    await expect(failed.arrayBuffer()).rejects.toThrow()
    expect(app.state.memory.held).toBe(0)
  })

  it('the fs store declares what a GET body reads ahead (its read stream and web queue): held while open', async () => {
    const root = mkdtempSync(join(tmpdir(), 'kvgate-hold-'))
    try {
      const store = await new FsStore({ root }).open()
      const app = createGateway({ store, coalesce: false })
      const c = makeChunk({ layers: 4, sectionBytes: 1024 * 1024 }) // 4 MiB: more than it reads ahead
      const url = `/v1/ns/a/chunks/${c.key}`
      expect((await app.request(url, putInit(c.bytes))).status).toBe(201)
      expect(store.getHoldBytes(c.bytes.length)).toBe(2 * MIB)
      expect(store.getHoldBytes(1000)).toBe(1000)
      const g = await app.request(url)
      expect(app.state.memory.held).toBe(2 * MIB)
      await g.body!.cancel()
      expect(app.state.memory.held).toBe(0)
    } finally {
      rmSync(root, { recursive: true, force: true })
    }
  })

  it('a GET is refused before it reads its body or the header (the hold covers the header peek and the tag read)', async () => {
    /** Counts the bytes pulled from each GET body and the store GETs (ranged or not). */
    class CountingStore extends ReadAheadStore {
      pulled: number[] = []
      gets: string[] = []
      override async get(n: string, o?: Parameters<MemoryStore['get']>[1]) {
        const obj = await super.get(n, o)
        this.gets.push(o?.range ? 'range' : 'whole')
        if (!obj) return obj
        const which = this.pulled.push(0) - 1
        const reader = obj.body.getReader()
        const body = new ReadableStream<Uint8Array>(
          {
            pull: async (c) => {
              const r = await reader.read()
              if (r.done) return c.close()
              this.pulled[which]! += r.value.length
              c.enqueue(r.value)
            },
            cancel: (why) => reader.cancel(why),
          },
          { highWaterMark: 0 },
        )
        return { ...obj, body }
      }
    }
    const store = new CountingStore(MIB)
    const app = createGateway({ store, coalesce: false })
    const c = makeChunk({ layers: 4, sectionBytes: 100 * 1024 })
    const url = `/v1/ns/a/chunks/${c.key}`
    expect((await app.request(url, putInit(c.bytes))).status).toBe(201)
    const full = app.state.memory.tryReserve(app.state.limits.maxHeldBytes - 1000)!
    const cases: Record<string, string>[] = [
      {},
      { range: 'bytes=10-' },
      { range: 'bytes=10-', 'if-range': '"kv1-0-0"' },
    ]
    for (const headers of cases) {
      store.pulled = []
      store.gets = []
      const r = await app.request(url, { headers })
      expect([r.status, await errCode(r)]).toEqual([503, 'ERR_BUSY'])
      // One store GET, refused with nothing of its body read: no header peeked, no tag read.
      expect([store.gets, store.pulled], JSON.stringify(headers)).toEqual([
        [Object.keys(headers).length ? 'range' : 'whole'],
        [0],
      ])
    }
    full.release()
    expect(app.state.memory.held).toBe(0)
    // Within the budget each is served, and what it held is given back.
    for (const headers of cases) {
      const r = await app.request(url, { headers })
      expect(r.status).toBeLessThan(300)
      await r.arrayBuffer()
    }
    expect(app.state.memory.held).toBe(0)
  })

  it('a calibration streamed from the store is held to the same bound', async () => {
    const store = new ReadAheadStore(MIB)
    const bytes = calib(3, 200 * 1024)
    const writer = createGateway({ store })
    const url = `/v1/ns/team/calibrations/${sha(bytes)}`
    expect((await writer.request(url, putOf(bytes))).status).toBe(201)
    const app = createGateway({ store, limits: { calibrationCacheBytes: 0 } }) // streams every body
    const others = app.state.memory.tryReserve(app.state.limits.maxHeldBytes - 100 * 1024)!
    const g = await app.request(url)
    expect([g.status, await errCode(g)]).toEqual([503, 'ERR_BUSY'])
    others.release()
    const ok = await app.request(url)
    expect(app.state.memory.held).toBe(bytes.length)
    expect(new Uint8Array(await ok.arrayBuffer())).toEqual(bytes)
    expect(app.state.memory.held).toBe(0)
  })
})

describe('maxHeldBytes per runtime', () => {
  it('is validated, and a budget one request could never fit fails at start', () => {
    for (const bad of [0, -1, 1.5, Number.NaN, '8' as unknown as number])
      expect(() => createGateway({ store: new MemoryStore(), limits: { maxHeldBytes: bad } })).toThrow(
        /maxHeldBytes/,
      )
    // A 16 MiB calibration is held whole: an 8 MiB budget would refuse it forever.
    expect(() =>
      createGateway({
        store: new MemoryStore(),
        limits: { maxHeldBytes: 8 * MIB, maxCalibrationBytes: 16 * MIB, maxChunkBytes: MIB },
      }),
    ).toThrow(/maxHeldBytes .* below .* calibration/)
    // S3 multipart parts in flight: 5 MiB read-ahead + 5 × 16 MiB do not fit 64 MiB.
    const s3 = new S3Store({ bucket: 'b', region: 'us-east-1' })
    expect(() => createGateway({ store: s3, limits: { maxHeldBytes: 64 * MIB } })).toThrow(/chunk PUT/)
    expect(createGateway({ store: s3 }).state.limits.maxHeldBytes).toBe(256 * MIB)
  })

  it('Node: 256 MiB unless set (file, env, flag)', () => {
    expect(resolveServeConfig().maxHeldBytes).toBe(256 * MIB)
    expect(resolveServeConfig(settingsFromEnv({ KVGATE_MAX_HELD_BYTES: '64MiB' })).maxHeldBytes).toBe(
      64 * MIB,
    )
    expect(() => resolveServeConfig(settingsFromEnv({ KVGATE_MAX_HELD_BYTES: '0' }))).toThrow(/MAX_HELD/)
  })

  it('Worker: 48 MiB of the 128 MB isolate unless KVGATE_MAX_HELD_BYTES says otherwise', () => {
    const bucket = { get: async () => null, put: async () => null } as unknown as R2BucketLike
    const worker = (v?: string) =>
      gatewayFromEnv({
        KVGATE_BUCKET: bucket,
        KVGATE_AUTH: 'disabled',
        ...(v === undefined ? {} : { KVGATE_MAX_HELD_BYTES: v }),
      }).state.limits.maxHeldBytes
    expect(worker()).toBe(WORKER_MAX_HELD_BYTES)
    expect(WORKER_MAX_HELD_BYTES).toBe(48 * MIB)
    expect(worker('33554432')).toBe(32 * MIB)
    for (const bad of ['0', '-1', '1.5', 'x']) expect(() => worker(bad)).toThrow(/KVGATE_MAX_HELD_BYTES/)
    // Smaller than one 16 MiB calibration PUT: refused at start, not at the first upload.
    expect(() => worker(String(8 * MIB))).toThrow(/maxHeldBytes/)
  })

  it('Worker: a presence cache sized for the isolate (Node keeps 100,000 entries, ~20 MiB)', () => {
    const bucket = { get: async () => null, put: async () => null } as unknown as R2BucketLike
    const app = gatewayFromEnv({ KVGATE_BUCKET: bucket, KVGATE_AUTH: 'disabled' })
    expect(app.state.lookup.cacheEntries).toBe(WORKER_PRESENCE_ENTRIES)
    expect(WORKER_PRESENCE_ENTRIES).toBeLessThanOrEqual(20_000)
    expect(createGateway({ store: new MemoryStore() }).state.lookup.cacheEntries).toBe(100_000)
  })

  it('Worker entry module exports only handlers and functions (workerd refuses to start otherwise)', async () => {
    const entry: Record<string, unknown> = await import('../src/gateway/adapters/workers.ts')
    for (const [name, value] of Object.entries(entry)) {
      const handler = typeof value === 'object' && value !== null && 'fetch' in value
      expect(typeof value === 'function' || handler, `export ${name}`).toBe(true)
    }
  })

  it('Lambda: from the function memory, and S3 part concurrency sized to fit', () => {
    const env = { KVGATE_S3_BUCKET: 'b', KVGATE_AUTH: 'disabled' }
    const held = (more: Record<string, string>) => configFromEnv({ ...env, ...more }).maxHeldBytes
    expect(held({ AWS_LAMBDA_FUNCTION_MEMORY_SIZE: '256' })).toBe(80 * MIB)
    expect(held({ AWS_LAMBDA_FUNCTION_MEMORY_SIZE: '1024' })).toBe(464 * MIB)
    expect(held({ AWS_LAMBDA_FUNCTION_MEMORY_SIZE: '1024', KVGATE_MAX_HELD_BYTES: String(MIB) })).toBe(MIB)
    expect(held({})).toBe(256 * MIB) // a local run of the bundle: the Node default
    expect(() => held({ AWS_LAMBDA_FUNCTION_MEMORY_SIZE: 'lots' })).toThrow(/AWS_LAMBDA_FUNCTION_MEMORY_SIZE/)
    expect(lambdaMaxHeldBytes(128)).toBe(16 * MIB) // never below 16 MiB
    // One commit's S3 multipart (5 + 4 MiB read-ahead + (n + 1) × 16 MiB parts) fits its budget.
    for (const mem of [256, 512, 1024, 10240]) {
      const budget = lambdaMaxHeldBytes(mem)
      const n = lambdaPartConcurrency(budget)
      expect(n).toBeGreaterThanOrEqual(1)
      expect(n).toBeLessThanOrEqual(4)
      expect(BODY_HOLD_BYTES + 4 * MIB + (n + 1) * 16 * MIB).toBeLessThanOrEqual(budget)
      const s3 = new S3Store({ bucket: 'b', region: 'us-east-1', partSize: 16 * MIB, partConcurrency: n })
      const uploads = { minBytes: MIB, maxBytes: 512 * MIB }
      expect(() => createGateway({ store: s3, uploads, limits: { maxHeldBytes: budget } })).not.toThrow()
    }
  })
})

describe('the decoded header cache (?layers=)', () => {
  it('is bounded in bytes, not only in entries: large headers cannot fill an isolate', async () => {
    const app = createGateway({ store: new MemoryStore() })
    // 1024 sections (the most a chunk has): a ~16 KiB header, ~64 KiB more decoded; 110 pass 8 MiB.
    const chunks = Array.from({ length: 110 }, () => makeChunk({ layers: 1024, sectionBytes: 16 }))
    for (const c of chunks) {
      expect((await app.request(`/v1/ns/a/chunks/${c.key}`, putOf(c.bytes))).status).toBe(201)
      const r = await app.request(`/v1/ns/a/chunks/${c.key}?layers=1-2`)
      expect(r.status).toBe(200)
      await r.arrayBuffer()
    }
    expect(app.state.headers.size).toBeGreaterThan(0)
    expect(app.state.headers.size).toBeLessThan(chunks.length)
    expect(app.state.headers.calculatedSize).toBeLessThanOrEqual(HEADER_CACHE_BYTES)
  })
})
