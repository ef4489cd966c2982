// The gateway's calibration objects (routes/calibrations.ts) on every store the
// Node gateway runs on: memory, fs and S3 (Ceph RadosGW). Content-addressed PUT
// verified against its name, immutable GET, the create-only current pointer (one
// winner under a race), stores that lose or corrupt an object, and gc leaving
// calibrations alone. Workerd/R2 runs the same routes in test/workers.test.ts.

import { createHash } from 'node:crypto'
import { mkdtempSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, describe, expect, it } from 'vitest'
import { runGc } from '../src/coldtier/gc.ts'
import { calibrationObjectName, classify, currentCalibrationName } from '../src/coldtier/names.ts'
import { condemnWaitMs, parseColdTier } from '../src/coldtier/policy.ts'
import { crc32 } from '../src/core/checksum.ts'
import { decodeHeader, encodeChunk, openLayerSubset } from '../src/core/format.ts'
import { configFromEnv } from '../src/gateway/adapters/lambda.ts'
import { gatewayFromEnv } from '../src/gateway/adapters/workers.ts'
import { resolveServeConfig, settingsFromEnv } from '../src/gateway/config.ts'
import { createGateway, hashToken, MemoryStore } from '../src/gateway/index.ts'
import { FsStore, S3Store } from '../src/gateway/node.ts'
import type { R2BucketLike } from '../src/gateway/stores/r2.ts'
import type { ObjectStore } from '../src/gateway/stores/types.ts'
import { makeChain, makeChunk, putInit } from './gateway-fixtures.ts'
import { type Rgw, useRgw } from './support/rgw.ts'

const rgw: Rgw | undefined = await useRgw('gateway-calibration (RadosGW)')
afterAll(async () => {
  await rgw?.stop()
})

const MIB = 1024 * 1024
let seq = 0
const uniq = () => `c${Date.now().toString(36)}${(++seq).toString(36)}`
const sha = (b: Uint8Array) => createHash('sha256').update(b).digest('hex')

/** Bytes that pass the gateway's checks (magic "KVCL" + version); distinct per seed. */
function calib(seed: number, size = 200): Uint8Array {
  const b = new Uint8Array(size)
  b.set([0x4b, 0x56, 0x43, 0x4c, 1, 0])
  for (let i = 8; i < size; i++) b[i] = (i * 131 + seed * 17) & 0xff
  return b
}

const putCalib = (bytes: Uint8Array, hash = sha(bytes), headers: Record<string, string> = {}) =>
  [
    `/v1/ns/team/calibrations/${hash}`,
    {
      method: 'PUT',
      headers: {
        'content-type': 'application/octet-stream',
        'content-length': String(bytes.length),
        ...headers,
      },
      body: bytes as Uint8Array<ArrayBuffer>,
    },
  ] as const

const putCurrent = (hash: string) =>
  [
    '/v1/ns/team/calibration',
    {
      method: 'PUT',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ hash }),
    },
  ] as const

async function until(cond: () => Promise<boolean>, ms = 5000): Promise<void> {
  const end = Date.now() + ms
  while (!(await cond())) {
    if (Date.now() > end) throw new Error('timed out')
    await new Promise((r) => setTimeout(r, 10))
  }
}

const errCode = async (r: Response) => ((await r.json()) as { error: { code: string } }).error.code

interface Backend {
  name: string
  store: () => Promise<ObjectStore>
}

const backends: Backend[] = [
  { name: 'memory', store: async () => new MemoryStore() },
  { name: 'fs', store: () => new FsStore({ root: mkdtempSync(join(tmpdir(), 'kvgate-calib-')) }).open() },
]
if (rgw) {
  backends.push({
    name: 's3 (RadosGW)',
    store: async () =>
      new S3Store({
        bucket: rgw.bucket,
        endpoint: rgw.endpoint,
        region: rgw.region,
        credentials: { accessKeyId: rgw.accessKeyId, secretAccessKey: rgw.secretAccessKey },
      }),
  })
}

describe.each(backends)('calibration objects on the $name store', (backend) => {
  const gateway = async (limits = {}) => {
    const store = await backend.store()
    const prefix = uniq()
    return { store, prefix, app: createGateway({ store, prefix, limits }) }
  }

  it('stores once, then serves the exact bytes, immutable, with the hash as ETag', async () => {
    const { app } = await gateway()
    const c = calib(1)
    const h = sha(c)
    const r1 = await app.request(...putCalib(c))
    expect(r1.status).toBe(201)
    expect(await r1.json()).toEqual({ status: 'created', hash: h, bytes: c.length })
    const r2 = await app.request(...putCalib(c))
    expect([r2.status, ((await r2.json()) as { status: string }).status]).toEqual([200, 'exists'])
    const g = await app.request(`/v1/ns/team/calibrations/${h}`)
    expect(g.status).toBe(200)
    expect(g.headers.get('etag')).toBe(`"${h}"`)
    expect(g.headers.get('cache-control')).toContain('immutable')
    expect(new Uint8Array(await g.arrayBuffer())).toEqual(c)
    const head = await app.request(`/v1/ns/team/calibrations/${h}`, { method: 'HEAD' })
    expect([head.status, head.headers.get('content-length')]).toEqual([200, String(c.length)])
    const cond = await app.request(`/v1/ns/team/calibrations/${h}`, {
      headers: { 'if-none-match': `"${h}"` },
    })
    expect(cond.status).toBe(304)
    const other = await app.request(`/v1/ns/other/calibrations/${h}`)
    expect(other.status).toBe(404)
  })

  it('refuses a wrong hash, a foreign or short body, an oversized one and a bad name; stores nothing', async () => {
    const { app, store, prefix } = await gateway({ maxCalibrationBytes: 4096 })
    const c = calib(2)
    const wrong = await app.request(...putCalib(c, sha(calib(3))))
    expect([wrong.status, await errCode(wrong)]).toEqual([400, 'ERR_FORMAT_CHECKSUM'])
    const flipped = c.slice()
    flipped[100]! ^= 1
    const corrupt = await app.request(...putCalib(flipped, sha(c)))
    expect([corrupt.status, await errCode(corrupt)]).toEqual([400, 'ERR_FORMAT_CHECKSUM'])
    const foreign = new Uint8Array(200).fill(7)
    const magic = await app.request(...putCalib(foreign))
    expect([magic.status, await errCode(magic)]).toEqual([400, 'ERR_FORMAT_BAD_MAGIC'])
    const short = c.subarray(0, 5)
    expect((await app.request(...putCalib(short))).status).toBe(400)
    const big = calib(4, 4097)
    const huge = await app.request(...putCalib(big))
    expect([huge.status, await errCode(huge)]).toEqual([413, 'ERR_PAYLOAD_TOO_LARGE'])
    // A body longer than its Content-Length claims is refused, not truncated into a valid one.
    const lying = await app.request(...putCalib(c, sha(c.subarray(0, 100)), { 'content-length': '100' }))
    expect(lying.status).toBe(400)
    const typed = await app.request(...putCalib(c, sha(c), { 'content-type': 'text/plain' }))
    expect(typed.status).toBe(415)
    const badName = await app.request(...putCalib(c, sha(c).toUpperCase()))
    expect(badName.status).toBe(400)
    expect((await store.list(`${prefix}/`)).entries).toEqual([])
  })

  it('the first current calibration wins; later PUTs learn the winner; it must be stored first', async () => {
    const { app } = await gateway()
    const a = calib(5)
    const b = calib(6)
    expect((await app.request('/v1/ns/team/calibration')).status).toBe(404)
    const early = await app.request(...putCurrent(sha(a)))
    expect([early.status, await errCode(early)]).toEqual([409, 'ERR_PRECONDITION_FAILED'])
    expect((await app.request(...putCalib(a))).status).toBe(201)
    expect((await app.request(...putCalib(b))).status).toBe(201)
    const first = await app.request(...putCurrent(sha(a)))
    expect([first.status, await first.json()]).toEqual([201, { status: 'created', hash: sha(a) }])
    const second = await app.request(...putCurrent(sha(b)))
    expect([second.status, await second.json()]).toEqual([200, { status: 'exists', hash: sha(a) }])
    const got = await app.request('/v1/ns/team/calibration')
    expect(await got.json()).toEqual({ hash: sha(a) })
    for (const body of ['{}', '{"hash":"xyz"}', 'not json', JSON.stringify({ hash: 'A'.repeat(64) })]) {
      const r = await app.request('/v1/ns/team/calibration', { method: 'PUT', body })
      expect(r.status, body).toBe(400)
    }
    const long = await app.request('/v1/ns/team/calibration', { method: 'PUT', body: 'x'.repeat(2000) })
    expect(long.status).toBe(413)
  })

  it('GET calibration with Cache-Control: no-cache reads the stored pointer, past the instance’s cache', async () => {
    const { app, store, prefix } = await gateway()
    const a = calib(35)
    expect((await app.request(...putCalib(a))).status).toBe(201)
    expect((await app.request(...putCurrent(sha(a)))).status).toBe(201)
    await store.delete(currentCalibrationName(prefix, 'team'))
    // Cached for 60 s: an operator's delete is not seen at once ...
    expect((await app.request('/v1/ns/team/calibration')).status).toBe(200)
    // ... except by a reader that asks for the stored pointer (a holder about to put one back).
    const fresh = await app.request('/v1/ns/team/calibration', { headers: { 'cache-control': 'no-cache' } })
    expect(fresh.status).toBe(404)
    expect((await app.request('/v1/ns/team/calibration')).status).toBe(404)
  })

  it('two gateways race to set the current calibration: one winner, both answers name it', async () => {
    const store = await backend.store()
    const prefix = uniq()
    const g1 = createGateway({ store, prefix })
    const g2 = createGateway({ store, prefix })
    const a = calib(7)
    const b = calib(8)
    await Promise.all([g1.request(...putCalib(a)), g2.request(...putCalib(b))])
    const [r1, r2] = await Promise.all([g1.request(...putCurrent(sha(a))), g2.request(...putCurrent(sha(b)))])
    const answers = [(await r1.json()) as { hash: string }, (await r2.json()) as { hash: string }]
    expect([r1.status, r2.status].sort()).toEqual([200, 201])
    expect(answers[0]!.hash).toBe(answers[1]!.hash)
    expect([sha(a), sha(b)]).toContain(answers[0]!.hash)
  })

  it('an object deleted or corrupted behind the gateway is a miss or a 502, never other bytes', async () => {
    const { store, prefix } = await gateway()
    const a = calib(9)
    const h = sha(a)
    const writer = createGateway({ store, prefix })
    expect((await writer.request(...putCalib(a))).status).toBe(201)
    expect((await writer.request(...putCurrent(h))).status).toBe(201)
    // Replace the object with other bytes under the same name (bit rot, a bad restore).
    const name = calibrationObjectName(prefix, 'team', h)
    expect(await store.delete(name)).toBe(true)
    const rotten = a.slice()
    rotten[50]! ^= 0x10
    await store.putIfAbsent(name, rotten, rotten.length)
    const reader = createGateway({ store, prefix })
    const bad = await reader.request(`/v1/ns/team/calibrations/${h}`)
    expect([bad.status, await errCode(bad)]).toEqual([502, 'ERR_FORMAT_CHECKSUM'])
    await store.delete(name)
    const gone = await createGateway({ store, prefix }).request(`/v1/ns/team/calibrations/${h}`)
    expect(gone.status).toBe(404)
    // The writer cached the verified body: it still answers what the store holds, nothing more.
    expect((await writer.request(`/v1/ns/team/calibrations/${h}`)).status).toBe(404)
    expect((await writer.request(`/v1/ns/team/calibrations/${h}`, { method: 'HEAD' })).status).toBe(404)
    // A current pointer that is not one is the store's fault too.
    await store.delete(currentCalibrationName(prefix, 'team'))
    const junk = new TextEncoder().encode('{"hash": 1}')
    await store.putIfAbsent(currentCalibrationName(prefix, 'team'), junk, junk.length)
    const cur = await createGateway({ store, prefix }).request('/v1/ns/team/calibration')
    expect(cur.status).toBe(502)
    // It names nothing a chunk depends on (chunks name their calibration by hash): dropped, so
    // the namespace can be calibrated again instead of answering 502 to every node for good.
    const b = calib(20)
    const healer = createGateway({ store, prefix })
    expect((await healer.request(...putCalib(b))).status).toBe(201)
    const set = await healer.request(...putCurrent(sha(b)))
    expect([set.status, await set.json()]).toEqual([201, { status: 'created', hash: sha(b) }])
  })

  it('a current pointer too large to be one is dropped like any other that is not one', async () => {
    const { store, prefix } = await gateway()
    const junk = new TextEncoder().encode(`{"hash": "${'a'.repeat(64)}", "pad": "${' '.repeat(2000)}"}`)
    await store.putIfAbsent(currentCalibrationName(prefix, 'team'), junk, junk.length)
    const app = createGateway({ store, prefix })
    const cur = await app.request('/v1/ns/team/calibration')
    expect([cur.status, await errCode(cur)]).toEqual([502, 'ERR_FORMAT_CHECKSUM'])
    expect(await store.head(currentCalibrationName(prefix, 'team'))).toBeUndefined()
    const b = calib(21)
    expect((await app.request(...putCalib(b))).status).toBe(201)
    const set = await app.request(...putCurrent(sha(b)))
    expect([set.status, await set.json()]).toEqual([201, { status: 'created', hash: sha(b) }])
  })

  it('a stored object that is not its name is dropped, so a node holding the real bytes puts it back', async () => {
    const { store, prefix } = await gateway()
    const a = calib(13)
    const h = sha(a)
    const name = calibrationObjectName(prefix, 'team', h)
    const rotten = a.slice()
    rotten[60]! ^= 0x04
    await store.putIfAbsent(name, rotten, rotten.length)
    const reader = createGateway({ store, prefix })
    // HEAD answers from the store's metadata; the first GET (any node's) reads and hashes it.
    expect((await reader.request(`/v1/ns/team/calibrations/${h}`, { method: 'HEAD' })).status).toBe(200)
    const bad = await reader.request(`/v1/ns/team/calibrations/${h}`)
    expect(bad.status).toBe(502)
    // What a holder's refresh does (CalibrationStore#loadCurrent): HEAD, then on a 404 a create-only PUT.
    const head = await reader.request(`/v1/ns/team/calibrations/${h}`, { method: 'HEAD' })
    expect(head.status).toBe(404)
    expect((await reader.request(...putCalib(a))).status).toBe(201)
    const g = await createGateway({ store, prefix }).request(`/v1/ns/team/calibrations/${h}`)
    expect(g.status).toBe(200)
    expect(new Uint8Array(await g.arrayBuffer())).toEqual(a)
  })

  it('calibration uploads count against the bytes in flight: past the bound, 503 ERR_BUSY', async () => {
    const { app } = await gateway({ maxInFlightBytes: 300 })
    const a = calib(14)
    const b = calib(15)
    let finish!: () => void
    const held = new Promise<void>((r) => {
      finish = r
    })
    // An upload whose body is still arriving holds its declared bytes.
    const slow = new ReadableStream<Uint8Array>({
      async start(ctl) {
        ctl.enqueue(a.subarray(0, 100))
        await held
        ctl.enqueue(a.subarray(100))
        ctl.close()
      },
    })
    const [url, init] = putCalib(a)
    const first = app.request(url, { ...init, body: slow, duplex: 'half' } as RequestInit)
    await new Promise((r) => setTimeout(r, 20))
    const second = await app.request(...putCalib(b))
    expect([second.status, await errCode(second)]).toEqual([503, 'ERR_BUSY'])
    finish()
    expect((await first).status).toBe(201)
    // Released: the next upload goes through.
    expect((await app.request(...putCalib(b))).status).toBe(201)
  })

  it('verifies and serves a calibrated (format v2) chunk whole and by layers; a zeroed hash is refused', async () => {
    const { app } = await gateway()
    const v1 = makeChunk({ layers: 5, sectionBytes: 300 })
    const h1 = decodeHeader(v1.bytes)
    const sections = h1.sections.map((s) => v1.bytes.subarray(s.offset, s.offset + s.length))
    const named = sha(calib(12))
    const v2 = encodeChunk({ ...h1, calibration: named }, sections)
    // The same key with a zero calibration field and a valid header CRC: refused at the door.
    const zero = v2.slice()
    const h2 = decodeHeader(v2)
    zero.fill(0, 140, 172)
    new DataView(zero.buffer).setUint32(h2.headerBytes - 4, crc32(zero.subarray(0, h2.headerBytes - 4)), true)
    const refused = await app.request(`/v1/ns/team/chunks/${v1.key}`, putInit(zero))
    expect([refused.status, await errCode(refused)]).toEqual([400, 'ERR_FORMAT_BAD_FIELD'])
    expect((await app.request(`/v1/ns/team/chunks/${v1.key}`, putInit(v2))).status).toBe(201)
    const whole = await app.request(`/v1/ns/team/chunks/${v1.key}`)
    expect(new Uint8Array(await whole.arrayBuffer())).toEqual(v2)
    const r = await app.request(`/v1/ns/team/chunks/${v1.key}?layers=3-4`)
    const sub = openLayerSubset(new Uint8Array(await r.arrayBuffer()), 3, 4)
    expect(sub.header.calibration).toBe(named)
    expect(sub.section(4)).toEqual(sections[4])
  })

  it('a body larger than the calibration cache streams, hashed on the way, and is never kept', async () => {
    const limits = { calibrationCacheBytes: 1000 }
    const { app, store, prefix } = await gateway(limits)
    const small = calib(30)
    const big = calib(31, 64 * 1024 + 3)
    for (const c of [small, big]) expect((await app.request(...putCalib(c))).status).toBe(201)
    const bigName = calibrationObjectName(prefix, 'team', sha(big))
    const url = `/v1/ns/team/calibrations/${sha(big)}`
    expect(app.state.calibrations.has(calibrationObjectName(prefix, 'team', sha(small)))).toBe(true)
    // The writer and a cold instance alike: the exact bytes, and the cache stays within its bound.
    for (const g of [app, createGateway({ store, prefix, limits })]) {
      const r = await g.request(url)
      expect([r.status, r.headers.get('content-length')]).toEqual([200, String(big.length)])
      expect(new Uint8Array(await r.arrayBuffer())).toEqual(big)
      const head = await g.request(url, { method: 'HEAD' })
      expect([head.status, head.headers.get('content-length')]).toEqual([200, String(big.length)])
      expect((await g.request(url, { headers: { 'if-none-match': `"${sha(big)}"` } })).status).toBe(304)
      expect(g.state.calibrations.has(bigName)).toBe(false)
      expect(g.state.calibrations.calculatedSize).toBeLessThanOrEqual(1000)
    }
    // Other bytes under the name: the streamed body fails at its end, and the object is dropped
    // so a holder of the real bytes can put them back.
    await store.delete(bigName)
    const rotten = big.slice()
    rotten[40_000]! ^= 1
    await store.putIfAbsent(bigName, rotten, rotten.length)
    const cold = createGateway({ store, prefix, limits })
    const bad = await cold.request(url)
    await expect(bad.arrayBuffer()).rejects.toThrow(/SHA-256 is not its name/)
    // Dropped as the body fails (the response does not wait for the store's DELETE).
    await until(async () => (await store.head(bigName)) === undefined)
    expect((await cold.request(url)).status).toBe(404)
  })

  it('the store deletes only the version named by ifMatch; another one put back since stays', async () => {
    const store = await backend.store()
    const name = `${uniq()}/v`
    expect(await store.putIfAbsent(name, calib(50), 200)).toBe('created')
    const first = (await store.get(name))!
    await first.body.cancel()
    expect(first.etag).toBeDefined()
    expect(await store.delete(name)).toBe(true)
    expect(await store.putIfAbsent(name, calib(51), 200)).toBe('created')
    const second = await store.head(name)
    expect(second?.etag).not.toBe(first.etag)
    expect(await store.delete(name, { ifMatch: first.etag })).toBe(false)
    expect(await store.head(name)).toEqual(second)
    expect(await store.delete(name, { ifMatch: second!.etag })).toBe(true)
    expect(await store.head(name)).toBeUndefined()
    expect(await store.delete(name, { ifMatch: second!.etag })).toBe(false)
  })

  it('a corrupt body read slowly drops only what it read: a correct copy put back meanwhile stays', async () => {
    const limits = { calibrationCacheBytes: 1000 }
    const { store, prefix } = await gateway(limits)
    const big = calib(41, 64 * 1024 + 5)
    const h = sha(big)
    const name = calibrationObjectName(prefix, 'team', h)
    const rotten = big.slice()
    rotten[50_000]! ^= 1
    await store.putIfAbsent(name, rotten, rotten.length)
    // A slow read: the store's body ends only when the test says.
    let open!: () => void
    const gate = new Promise<void>((r) => {
      open = r
    })
    const slowStore: ObjectStore = {
      kind: store.kind,
      head: (n) => store.head(n),
      putIfAbsent: (...a) => store.putIfAbsent(...a),
      delete: (...a: Parameters<ObjectStore['delete']>) => store.delete(...a),
      list: (...a) => store.list(...a),
      async get(n: string, o?: Parameters<ObjectStore['get']>[1]) {
        const obj = await store.get(n, o)
        if (!obj) return obj
        const reader = obj.body.getReader()
        const body = new ReadableStream<Uint8Array>({
          async pull(c) {
            const r = await reader.read()
            if (r.done) {
              await gate
              c.close()
            } else c.enqueue(r.value)
          },
        })
        return { ...obj, body }
      },
    }
    const app = createGateway({ store: slowStore, prefix, limits })
    const slow = await app.request(`/v1/ns/team/calibrations/${h}`)
    expect(slow.status).toBe(200)
    // While it reads: an operator deletes the object and a holder puts the real bytes back.
    expect(await store.delete(name)).toBe(true)
    expect(await store.putIfAbsent(name, big, big.length)).toBe('created')
    open()
    await expect(slow.arrayBuffer()).rejects.toThrow(/SHA-256 is not its name/)
    await new Promise((r) => setTimeout(r, 100))
    expect((await store.head(name))?.size).toBe(big.length)
    const good = await createGateway({ store, prefix, limits }).request(`/v1/ns/team/calibrations/${h}`)
    expect(good.status).toBe(200)
    expect(new Uint8Array(await good.arrayBuffer())).toEqual(big)
  })

  it('HEAD answers from the store’s metadata, cold or warm, without reading the body', async () => {
    const { app, store, prefix } = await gateway()
    const a = calib(33, 8192)
    const h = sha(a)
    expect((await app.request(...putCalib(a))).status).toBe(201)
    const reads: string[] = []
    const get = store.get.bind(store)
    store.get = async (name, opts) => {
      reads.push(name)
      return get(name, opts)
    }
    const url = `/v1/ns/team/calibrations/${h}`
    const cold = createGateway({ store, prefix })
    for (const g of [cold, app]) {
      const r = await g.request(url, { method: 'HEAD' })
      expect([r.status, r.headers.get('content-length'), r.headers.get('etag')]).toEqual([
        200,
        String(a.length),
        `"${h}"`,
      ])
      expect((await g.request(url, { method: 'HEAD', headers: { 'if-none-match': `"${h}"` } })).status).toBe(
        304,
      )
    }
    expect(reads).toEqual([])
    expect(
      (await cold.request(`/v1/ns/team/calibrations/${sha(calib(34))}`, { method: 'HEAD' })).status,
    ).toBe(404)
    // An object whose size cannot be a calibration is the store's fault, from its size alone.
    const name = calibrationObjectName(prefix, 'team', h)
    await store.delete(name)
    await store.putIfAbsent(name, a.subarray(0, 4), 4)
    const tiny = await createGateway({ store, prefix }).request(url, { method: 'HEAD' })
    expect(tiny.status).toBe(502)
    // The writer's verified copy no longer vouches for what the store holds.
    expect((await app.request(url, { method: 'HEAD' })).status).toBe(502)
    expect(app.state.calibrations.has(name)).toBe(false)
    expect(reads).toEqual([])
  })

  it('gc deletes a namespace’s chunks past their quota and never its calibrations', async () => {
    const { app, store, prefix } = await gateway()
    const chain = makeChain(3)
    for (const c of chain)
      expect((await app.request(`/v1/ns/team/chunks/${c.key}`, putInit(c.bytes))).status).toBe(201)
    const a = calib(10)
    expect((await app.request(...putCalib(a))).status).toBe(201)
    expect((await app.request(...putCurrent(sha(a)))).status).toBe(201)
    const config = parseColdTier({ namespaces: { team: { quota: '1B' } }, grace: '1s' })
    // Two phases: the first run condemns the chunks, one past the wait deletes them.
    await runGc({ store, prefix, config, now: Date.now() + 86_400_000 })
    const r = await runGc({
      store,
      prefix,
      config,
      now: Date.now() + 86_400_000 + condemnWaitMs(config.usage),
    })
    expect(r.errors).toEqual([])
    const names = (await store.list(`${prefix}/`, { limit: 10_000 })).entries.map((e) => e.name)
    expect(names.filter((n) => classify(prefix, n).kind === 'chunk')).toEqual([])
    expect(names).toContain(calibrationObjectName(prefix, 'team', sha(a)))
    expect(names).toContain(currentCalibrationName(prefix, 'team'))
    const g = await createGateway({ store, prefix }).request(`/v1/ns/team/calibrations/${sha(a)}`)
    expect(new Uint8Array(await g.arrayBuffer())).toEqual(a)
  })
})

describe('calibration routes and auth', () => {
  it('reading needs read scope, writing needs write scope, per namespace', async () => {
    const tokens = [
      { name: 'r', sha256: await hashToken('reader'), scopes: 'read' as const, namespaces: ['team'] },
      { name: 'w', sha256: await hashToken('writer'), scopes: 'write' as const, namespaces: ['team'] },
    ]
    const app = createGateway({ store: new MemoryStore(), auth: { tokens } })
    const c = calib(11)
    const [url, init] = putCalib(c)
    const as = (token: string) => ({
      ...init,
      headers: { ...init.headers, authorization: `Bearer ${token}` },
    })
    expect((await app.request(url, init)).status).toBe(401)
    expect((await app.request(url, as('reader'))).status).toBe(403)
    expect((await app.request(url, as('writer'))).status).toBe(201)
    const get = (token: string, ns = 'team') =>
      app.request(`/v1/ns/${ns}/calibrations/${sha(c)}`, { headers: { authorization: `Bearer ${token}` } })
    expect((await get('reader')).status).toBe(200)
    expect((await get('reader', 'elsewhere')).status).toBe(403)
    const [curl, cinit] = putCurrent(sha(c))
    expect(
      (await app.request(curl, { ...cinit, headers: { ...cinit.headers, authorization: 'Bearer reader' } }))
        .status,
    ).toBe(403)
  })
})

describe('calibration reads on a cold gateway', () => {
  it('concurrent GETs of one calibration read and hash it once (a fleet restarting holds one copy)', async () => {
    const store = new MemoryStore()
    const a = calib(16, 64 * 1024)
    expect((await createGateway({ store }).request(...putCalib(a))).status).toBe(201)
    let reads = 0
    const get = store.get.bind(store)
    store.get = async (name, opts) => {
      if (name.includes('/_calibration/')) reads++
      // A store read takes a while: the requests below all arrive before the first is answered.
      await new Promise((r) => setTimeout(r, 20))
      return get(name, opts)
    }
    const cold = createGateway({ store })
    const answers = await Promise.all(
      Array.from({ length: 16 }, () => cold.request(`/v1/ns/team/calibrations/${sha(a)}`)),
    )
    for (const r of answers) expect(new Uint8Array(await r.arrayBuffer())).toEqual(a)
    expect(reads).toBe(1)
  })
})

describe('calibration reads that the store cuts short', () => {
  it('a store read that fails mid-body is a store fault (ERR_STORE), not a corrupt object, and keeps it', async () => {
    const store = new MemoryStore()
    const a = calib(17, 4096)
    expect((await createGateway({ store }).request(...putCalib(a))).status).toBe(201)
    const get = store.get.bind(store)
    let failing = true
    store.get = async (name, opts) => {
      const obj = await get(name, opts)
      if (!obj || !failing || !name.includes('/_calibration/')) return obj
      // The connection to the store drops after the first piece.
      const cut = new ReadableStream<Uint8Array>({
        start(ctl) {
          ctl.enqueue(a.subarray(0, 100))
          ctl.error(new Error('socket hang up'))
        },
      })
      return { ...obj, body: cut }
    }
    const app = createGateway({ store })
    const r = await app.request(`/v1/ns/team/calibrations/${sha(a)}`)
    expect(r.status).toBe(502)
    expect(await errCode(r)).toBe('ERR_STORE')
    failing = false
    const ok = await app.request(`/v1/ns/team/calibrations/${sha(a)}`)
    expect(new Uint8Array(await ok.arrayBuffer())).toEqual(a)
  })
})

describe('streamed calibration reads that the store cuts short', () => {
  it('a body larger than the cache cut off mid-stream fails the response and keeps the object', async () => {
    const store = new MemoryStore()
    const a = calib(36, 64 * 1024)
    const limits = { calibrationCacheBytes: 1024 }
    expect((await createGateway({ store, limits }).request(...putCalib(a))).status).toBe(201)
    const get = store.get.bind(store)
    let cut: 'error' | 'short' | undefined = 'error'
    store.get = async (name, opts) => {
      const obj = await get(name, opts)
      if (!obj || !cut || !name.includes('/_calibration/')) return obj
      const how = cut
      const body = new ReadableStream<Uint8Array>({
        start(ctl) {
          ctl.enqueue(a.subarray(0, 1000))
          // The connection drops, or the store ends the body early without an error.
          if (how === 'error') ctl.error(new Error('socket hang up'))
          else ctl.close()
        },
      })
      return { ...obj, body }
    }
    const app = createGateway({ store, limits })
    const url = `/v1/ns/team/calibrations/${sha(a)}`
    const dropped = await app.request(url)
    expect(dropped.status).toBe(200)
    await expect(dropped.arrayBuffer()).rejects.toThrow(/socket hang up/)
    cut = 'short'
    const short = await app.request(url)
    await expect(short.arrayBuffer()).rejects.toThrow(/1000 of 65536/)
    cut = undefined
    const ok = await app.request(url)
    expect(new Uint8Array(await ok.arrayBuffer())).toEqual(a)
  })
})

/**
 * A stored 64 KiB calibration (cache too small to hold it, so reads stream) whose store GET
 * answers with its bytes, one of them rotten, then `tail`: what a broken store or body adapter
 * sends at the end.
 */
async function streamedWithTail(seed: number, tail: Uint8Array) {
  const store = new MemoryStore()
  const a = calib(seed, 64 * 1024)
  const limits = { calibrationCacheBytes: 1024 }
  expect((await createGateway({ store, limits }).request(...putCalib(a))).status).toBe(201)
  const rotten = a.slice()
  rotten[50_000]! ^= 1
  const get = store.get.bind(store)
  store.get = async (name, opts) => {
    const obj = await get(name, opts)
    if (!obj || !name.includes('/_calibration/')) return obj
    const body = new ReadableStream<Uint8Array>({
      start(ctl) {
        ctl.enqueue(rotten.subarray(0, 40_000))
        ctl.enqueue(rotten.subarray(40_000))
        ctl.enqueue(tail)
        ctl.close()
      },
    })
    return { ...obj, body }
  }
  return { store, a, app: createGateway({ store, limits }) }
}

/** Reads `r` to its end or its error; `got()` is how many bytes the client held by then. */
function drain(r: Response): { done: Promise<void>; got: () => number } {
  const reader = r.body!.getReader()
  let got = 0
  const done = (async () => {
    for (;;) {
      const { done, value } = await reader.read()
      if (done) return
      got += value.length
    }
  })()
  return { done, got: () => got }
}

describe('streamed calibration reads that end with an empty piece', () => {
  it('rotten bytes then an empty piece: the client never holds all the bytes before the failure', async () => {
    // A store (or a body adapter) that closes with a zero-length read.
    const { a, app } = await streamedWithTail(37, new Uint8Array(0))
    const r = await app.request(`/v1/ns/team/calibrations/${sha(a)}`)
    expect(r.status).toBe(200)
    const read = drain(r)
    await expect(read.done).rejects.toThrow(/SHA-256 is not its name/)
    // Over HTTP a client holding Content-Length bytes has a complete (wrong) body.
    expect(read.got()).toBeLessThan(a.length)
  })
})

describe('streamed calibration reads longer than the store said', () => {
  it('bytes past the object size fail the response before the client holds Content-Length bytes', async () => {
    // A store whose body runs past the size it reported (a replaced object, a broken adapter).
    const { store, a, app } = await streamedWithTail(38, new Uint8Array(100))
    const r = await app.request(`/v1/ns/team/calibrations/${sha(a)}`)
    expect(r.headers.get('content-length')).toBe(String(a.length))
    const read = drain(r)
    await expect(read.done).rejects.toThrow(/65536/)
    expect(read.got()).toBeLessThan(a.length)
    // A store fault, not proof about the object: it is kept.
    expect(await store.head(calibrationObjectName(app.state.prefix, 'team', sha(a)))).toBeDefined()
  })
})

describe('calibration uploads held until stored', () => {
  it('an upload the store is still writing keeps its bytes in flight', async () => {
    const store = new MemoryStore()
    let finish!: () => void
    const held = new Promise<void>((r) => {
      finish = r
    })
    const put = store.putIfAbsent.bind(store)
    store.putIfAbsent = async (name, body, size) => {
      await held
      return put(name, body, size)
    }
    const app = createGateway({ store, limits: { maxInFlightBytes: 300 } })
    const first = app.request(...putCalib(calib(18)))
    await new Promise((r) => setTimeout(r, 20))
    const second = await app.request(...putCalib(calib(19)))
    expect([second.status, await errCode(second)]).toEqual([503, 'ERR_BUSY'])
    finish()
    expect((await first).status).toBe(201)
    expect((await app.request(...putCalib(calib(19)))).status).toBe(201)
  })
})

describe('the calibration cache bound per runtime', () => {
  it('is validated; 0 keeps no body; Node keeps 64 MiB, Lambda 16 MiB, a Worker 8 MiB', async () => {
    for (const bad of [-1, 1.5, Number.NaN, '8' as unknown as number])
      expect(() =>
        createGateway({ store: new MemoryStore(), limits: { calibrationCacheBytes: bad } }),
      ).toThrow(/calibrationCacheBytes/)
    const none = createGateway({ store: new MemoryStore(), limits: { calibrationCacheBytes: 0 } })
    const a = calib(32)
    expect((await none.request(...putCalib(a))).status).toBe(201)
    const g = await none.request(`/v1/ns/team/calibrations/${sha(a)}`)
    expect(new Uint8Array(await g.arrayBuffer())).toEqual(a)
    expect(none.state.calibrations.size).toBe(0)

    expect(createGateway({ store: new MemoryStore() }).state.limits.calibrationCacheBytes).toBe(64 * MIB)
    expect(resolveServeConfig().calibrationCacheBytes).toBe(64 * MIB)
    const env = (v: string) => settingsFromEnv({ KVGATE_CALIBRATION_CACHE_BYTES: v })
    expect(resolveServeConfig(env('8MiB')).calibrationCacheBytes).toBe(8 * MIB)
    expect(resolveServeConfig(env('0')).calibrationCacheBytes).toBe(0)
    for (const bad of ['lots', '-1', '17GiB']) expect(() => resolveServeConfig(env(bad))).toThrow()

    const lambda = (v?: string) =>
      configFromEnv({
        KVGATE_S3_BUCKET: 'b',
        KVGATE_AUTH: 'disabled',
        ...(v === undefined ? {} : { KVGATE_CALIBRATION_CACHE_BYTES: v }),
      }).calibrationCacheBytes
    expect(lambda()).toBe(16 * MIB)
    expect(lambda('0')).toBe(0)
    expect(() => lambda('-1')).toThrow(/KVGATE_CALIBRATION_CACHE_BYTES/)

    const bucket = { get: async () => null, put: async () => null } as unknown as R2BucketLike
    const worker = (v?: string) =>
      gatewayFromEnv({
        KVGATE_BUCKET: bucket,
        KVGATE_AUTH: 'disabled',
        ...(v === undefined ? {} : { KVGATE_CALIBRATION_CACHE_BYTES: v }),
      }).state.limits.calibrationCacheBytes
    expect(worker()).toBe(8 * MIB)
    expect(worker('0')).toBe(0)
    expect(worker('1048576')).toBe(MIB)
    for (const bad of ['-1', '1.5', 'x', '1e6'])
      expect(() => worker(bad)).toThrow(/KVGATE_CALIBRATION_CACHE_BYTES/)
  })
})
