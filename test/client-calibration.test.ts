// The client's calibration objects (src/client/calibration-store.ts and its wiring):
// verified fetch, bounded cache, persistence beside L2, the build-after-N policy and
// the create-only race; then whole clients on a gateway over RadosGW calibrating at
// once, decoding each other's chunks, a calibration deleted behind the gateway, and a
// restarted node decoding its L2 with the gateway gone.

import { execFileSync } from 'node:child_process'
import { createHash } from 'node:crypto'
import { existsSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { type CalibrationRemote, CalibrationStore } from '../src/client/calibration-store.ts'
import { CodecPool } from '../src/client/codec-pool.ts'
import { optionsFromEnvironment } from '../src/client/config.ts'
import { KVCache } from '../src/client/index.ts'
import { buildCalibration, openCalibration } from '../src/codec/calibration.ts'
import { encodeChunk } from '../src/codec/node.ts'
import { calibrationObjectName, currentCalibrationName } from '../src/coldtier/names.ts'
import { crc32 } from '../src/core/checksum.ts'
import { decodeHeader } from '../src/core/format.ts'
import { fromHex, namespaceId } from '../src/core/keys.ts'
import { chunkBytes, MODEL_PRESETS } from '../src/core/layout.ts'
import { createGateway, MemoryStore } from '../src/gateway/index.ts'
import { type RunningGateway, S3Store, serveGateway } from '../src/gateway/node.ts'
import { promptTokens } from './support/client-child.ts'
import { type Rgw, useRgw } from './support/rgw.ts'

const g = MODEL_PRESETS.stories260k
const T = 64
const CB = chunkBytes(g, T)
const codec = { build: buildCalibration, open: openCalibration }
const sha = (b: Uint8Array) => createHash('sha256').update(b).digest('hex')
const sum = (m: Uint8Array) => m.reduce((a, b) => a + b, 0)
const tmp = () => mkdtempSync(join(tmpdir(), 'kvgate-calib-'))

function kv(chunks: number, seed: number): Uint8Array {
  const out = new Uint8Array(chunks * CB)
  let x = seed * 2654435761
  for (let i = 0; i < out.length; i += 2) {
    x = (x * 1103515245 + 12345) >>> 0
    out[i] = x >>> 24
    out[i + 1] = 0x30 + ((x >>> 16) & 0x07) // small finite fp16 values
  }
  return out
}

/** A gateway in memory, as the store sees it (the real routes are tested in gateway-calibration). */
function fakeRemote() {
  const objects = new Map<string, Uint8Array>()
  let current: string | null = null
  /** What a gateway's cached pointer answers (it keeps one 60 s); undefined: the stored one. */
  let cached: string | null | undefined
  const calls = { get: 0, current: 0, put: 0, set: 0 }
  let reachable = true
  const remote: CalibrationRemote = {
    async getCalibration(hash) {
      calls.get++
      if (!reachable) return undefined
      return objects.get(hash) ?? null
    },
    async hasCalibration(hash) {
      return reachable ? objects.has(hash) : undefined
    },
    async currentCalibration(opts) {
      calls.current++
      if (!reachable) return undefined
      return opts?.fresh || cached === undefined ? current : cached
    },
    async putCalibration(hash, bytes) {
      calls.put++
      if (!reachable) return false
      if (!objects.has(hash)) objects.set(hash, bytes.slice())
      return true
    },
    async setCurrentCalibration(hash) {
      calls.set++
      if (!reachable) return undefined
      current ??= hash
      return current
    },
  }
  return {
    remote,
    objects,
    calls,
    setReachable: (r: boolean) => {
      reachable = r
    },
    setCurrent: (h: string | null) => {
      current = h
    },
    setCached: (h: string | null | undefined) => {
      cached = h
    },
  }
}

const sample = (seed: number) => buildCalibration([kv(1, seed)], { geometry: g, dtype: g.dtype })

describe('CalibrationStore', () => {
  it('fetches by hash, verifies the SHA-256, keeps a bounded cache and persists for offline use', async () => {
    const f = fakeRemote()
    const dir = tmp()
    const good = sample(1)
    f.objects.set(sha(good), good)
    const liar = sample(2)
    f.objects.set(sha(sample(3)), liar) // the gateway answers other bytes for this name
    const s = new CalibrationStore({ codec, geometry: g, remote: f.remote, dir, cacheEntries: 1 })
    expect((await s.get(sha(good)))?.bytes).toEqual(good)
    expect(await s.get(sha(sample(3)))).toBeUndefined()
    expect(await s.get('nothex')).toBeUndefined()
    expect(s.stats()).toMatchObject({ fetched: 1, rejected: 1 })
    expect(readdirSync(dir)).toEqual([`${sha(good)}.kvcl`])
    // Bounded: a second calibration pushes the first out of memory (it is still on disk).
    const other = sample(4)
    f.objects.set(sha(other), other)
    await s.get(sha(other))
    expect(s.peek(sha(good))).toBeUndefined()
    // A restarted node, gateway gone: from the directory, verified.
    f.setReachable(false)
    const again = new CalibrationStore({ codec, geometry: g, remote: f.remote, dir })
    expect((await again.get(sha(good)))?.hash).toBe(sha(good))
    expect(again.stats().loaded).toBe(1)
    // A damaged file is dropped (and not served); with the gateway back it is fetched again.
    writeFileSync(join(dir, `${sha(other)}.kvcl`), good)
    expect(await again.get(sha(other))).toBeUndefined()
    expect(readdirSync(dir)).not.toContain(`${sha(other)}.kvcl`)
    f.setReachable(true)
    expect((await again.get(sha(other)))?.hash).toBe(sha(other))
    rmSync(dir, { recursive: true, force: true })
  })

  it('a persisted name that is a FIFO or over maxBytes is not read: no decode waits on it, nothing big is read', async () => {
    const f = fakeRemote()
    const dir = tmp()
    const good = sample(5)
    const h = sha(good)
    f.objects.set(h, good)
    // A FIFO under the name: reading it waits for a writer that never comes.
    execFileSync('mkfifo', [join(dir, `${h}.kvcl`)])
    const s = new CalibrationStore({ codec, geometry: g, remote: f.remote, dir })
    const bound = new Promise<'held'>((r) => setTimeout(() => r('held'), 5000).unref())
    const got = await Promise.race([s.get(h), bound])
    expect(got).not.toBe('held')
    // Not read, left alone: the gateway's copy is fetched (and persisted over the name).
    expect((got as Awaited<ReturnType<CalibrationStore['get']>>)?.hash).toBe(h)
    expect(s.stats()).toMatchObject({ loaded: 0, fetched: 1, rejected: 0 })
    // A file over maxBytes under the name is not read either (it cannot be one this node accepts).
    const big = sample(6)
    const hb = sha(big)
    writeFileSync(join(dir, `${hb}.kvcl`), new Uint8Array(big.byteLength + 1))
    const small = new CalibrationStore({ codec, geometry: g, dir, maxBytes: big.byteLength })
    expect(await small.get(hb)).toBeUndefined()
    expect(small.stats()).toMatchObject({ loaded: 0, rejected: 0 })
    rmSync(dir, { recursive: true, force: true })
  })

  it('a directory shared by two models: one refuses the other’s calibration and leaves its file', async () => {
    const f = fakeRemote()
    const dir = tmp()
    const g2 = { ...g, kvHeads: 2 }
    const theirs = buildCalibration([new Uint8Array(chunkBytes(g2, 4)).fill(0x31)], {
      geometry: g2,
      dtype: g2.dtype,
    })
    const h = sha(theirs)
    f.objects.set(h, theirs)
    const owner = new CalibrationStore({ codec, geometry: g2, remote: f.remote, dir })
    expect((await owner.get(h))?.hash).toBe(h)
    // The other model's cache, same L2 directory (e.g. the same gateway namespace names it current).
    const other = new CalibrationStore({ codec, geometry: g, remote: f.remote, dir })
    expect(await other.get(h)).toBeUndefined()
    // Known to be another model's: not read, hashed and opened again at each ask (each encode).
    for (let i = 0; i < 3; i++) expect(await other.get(h)).toBeUndefined()
    expect(other.stats().rejected).toBe(1)
    expect(readdirSync(dir)).toContain(`${h}.kvcl`)
    // The owner restarted with the gateway gone still has it.
    f.setReachable(false)
    const restarted = new CalibrationStore({ codec, geometry: g2, remote: f.remote, dir })
    expect((await restarted.get(h))?.hash).toBe(h)
    rmSync(dir, { recursive: true, force: true })
  })

  it('a persisted file that is its name but that this build cannot open (a newer format) is left for its writer', async () => {
    const dir = tmp()
    // Another process sharing the L2 directory (a newer build) persisted a calibration of a
    // format version this build does not read: its bytes are its name, nothing is damaged.
    const newer = sample(31).slice()
    new DataView(newer.buffer).setUint16(4, 2, true)
    new DataView(newer.buffer).setUint32(newer.length - 4, crc32(newer.subarray(0, newer.length - 4)), true)
    const h = sha(newer)
    writeFileSync(join(dir, `${h}.kvcl`), newer)
    const store = new CalibrationStore({ codec, geometry: g, dir })
    expect(await store.get(h)).toBeUndefined()
    expect(store.stats().rejected).toBe(1)
    expect(Buffer.compare(readFileSync(join(dir, `${h}.kvcl`)), newer)).toBe(0)
    // Bytes that are not their name are damaged: dropped, so the gateway's copy replaces them.
    const other = sample(32)
    const h2 = sha(other)
    writeFileSync(join(dir, `${h2}.kvcl`), other.subarray(1))
    expect(await store.get(h2)).toBeUndefined()
    expect(existsSync(join(dir, `${h2}.kvcl`))).toBe(false)
    rmSync(dir, { recursive: true, force: true })
  })

  it('a calibration the gateway lacks is not asked for again at once; an unreachable one is', async () => {
    const f = fakeRemote()
    const s = new CalibrationStore({ codec, geometry: g, remote: f.remote })
    const h = sha(sample(40))
    expect(await s.forDecode(h)).toBeUndefined()
    expect(await s.forDecode(h)).toBeUndefined()
    expect([f.calls.get, s.stats().misses]).toEqual([1, 2])
    f.setReachable(false)
    const t = new CalibrationStore({ codec, geometry: g, remote: f.remote })
    await t.get(h)
    await t.get(h)
    expect(f.calls.get).toBe(3)
  })

  it('refuses a calibration of another geometry', async () => {
    const f = fakeRemote()
    const foreign = buildCalibration([new Uint8Array(chunkBytes(MODEL_PRESETS['llama-3.1-8b'], 1))], {
      geometry: MODEL_PRESETS['llama-3.1-8b'],
      dtype: 'bf16',
    })
    f.objects.set(sha(foreign), foreign)
    const s = new CalibrationStore({ codec, geometry: g, remote: f.remote })
    expect(await s.get(sha(foreign))).toBeUndefined()
    expect(s.stats().rejected).toBe(1)
  })

  it('current() never waits: unknown first, the calibration once the background refresh loaded it', async () => {
    const f = fakeRemote()
    const c = sample(5)
    f.objects.set(sha(c), c)
    f.setCurrent(sha(c))
    const s = new CalibrationStore({ codec, geometry: g, remote: f.remote, currentTtlMs: 60_000 })
    expect(s.current()).toBeUndefined()
    await s.settled()
    expect(s.current()?.hash).toBe(sha(c))
    expect(f.calls.current).toBe(1) // within the TTL: not asked again
    f.setReachable(false)
    expect(s.current()?.hash).toBe(sha(c))
  })

  it('builds after N full chunks in an uncalibrated namespace, publishes, and adopts an earlier winner', async () => {
    const f = fakeRemote()
    const a = new CalibrationStore({ codec, geometry: g, remote: f.remote, calibrateAfter: 2 })
    const b = new CalibrationStore({ codec, geometry: g, remote: f.remote, calibrateAfter: 2 })
    a.observe(kv(1, 10)) // unknown: kept, and the gateway is asked
    b.observe(kv(1, 20))
    await Promise.all([a.settled(), b.settled()])
    expect(f.calls).toMatchObject({ current: 2, put: 0 }) // one sample each: not yet
    a.observe(kv(1, 11))
    b.observe(kv(1, 21))
    await Promise.all([a.settled(), b.settled()])
    expect(f.objects.size).toBe(2) // both built and stored theirs (create-only, distinct)
    expect(a.stats().current).toBeDefined()
    expect(a.stats().current).toBe(b.stats().current)
    expect(a.stats().won + b.stats().won).toBe(1)
    expect(a.stats().adopted + b.stats().adopted).toBe(1)
    expect(a.current()?.hash).toBe(a.stats().current)
    expect(b.current()?.hash).toBe(a.stats().current)
    // Calibrated now: more chunks build nothing.
    a.observe(kv(1, 12))
    a.observe(kv(1, 13))
    await a.settled()
    expect(a.stats().built).toBe(1)
  })

  it('holds at most maxSampleBytes of samples: with a large `after` it builds from the chunks that fit', async () => {
    const f = fakeRemote()
    const one = kv(1, 30).byteLength
    const s = new CalibrationStore({
      codec,
      geometry: g,
      remote: f.remote,
      calibrateAfter: 1000,
      maxSampleBytes: 2 * one + 1,
    })
    s.observe(kv(1, 30))
    await s.settled()
    expect(s.stats().built).toBe(0)
    s.observe(kv(1, 31))
    await s.settled()
    // Two chunks fit the bound: built from them, not after 1000 chunks held in memory.
    expect(s.stats().built).toBe(1)
    expect(f.calls.put).toBe(1)
  })

  it('a holder puts the current calibration back when it is gone from the bucket', async () => {
    const f = fakeRemote()
    const s = new CalibrationStore({ codec, geometry: g, remote: f.remote, currentTtlMs: 0 })
    const c = await s.publish(sample(8))
    expect(c).toBeDefined()
    f.objects.clear() // deleted behind the gateway; the pointer still names it
    await s.refresh()
    expect(f.objects.get(c!.hash)).toEqual(c!.bytes)
    expect(s.stats().restored).toBe(1)
    await s.refresh() // present again: nothing to do
    expect(s.stats().restored).toBe(1)
  })

  it('an operator’s delete holds: a holder puts back only what the stored pointer still names', async () => {
    const f = fakeRemote()
    const s = new CalibrationStore({ codec, geometry: g, remote: f.remote, currentTtlMs: 0 })
    const c = await s.publish(sample(9))
    expect(s.stats().current).toBe(c!.hash)
    // The operator deletes the pointer, then the object; gateways still answer their cached pointer.
    f.setCached(c!.hash)
    f.setCurrent(null)
    f.objects.clear()
    await s.refresh()
    expect(f.objects.size).toBe(0)
    expect(f.calls.put).toBe(1) // the publish only
    expect(s.stats().restored).toBe(0)
    // The node stops encoding with it (chunks coded with it were removed with it).
    expect(s.stats().current).toBeUndefined()
    f.setCached(undefined)
    expect(s.current()).toBeUndefined()
    await s.settled()
    expect(f.objects.size).toBe(0)
  })

  it('a removed calibration stays removed while gateways still answer their cached pointer', async () => {
    const f = fakeRemote()
    const s = new CalibrationStore({ codec, geometry: g, remote: f.remote, currentTtlMs: 0 })
    const c = await s.publish(sample(10))
    f.setCached(c!.hash)
    f.setCurrent(null)
    f.objects.clear()
    await s.refresh()
    expect(s.stats().current).toBeUndefined()
    // The next refreshes (the gateways' cached pointers last 60 s) name it again: it is not
    // encoded with meanwhile, not even while the check is in flight.
    const head = f.remote.hasCalibration.bind(f.remote)
    let release: (() => void) | undefined
    f.remote.hasCalibration = async (h) => {
      if (release === undefined)
        await new Promise<void>((r) => {
          release = r
        })
      return head(h)
    }
    const p = s.refresh()
    while (release === undefined) await new Promise((r) => setTimeout(r, 5))
    expect(s.current()).toBeUndefined()
    release!()
    await p
    expect(s.current()).toBeUndefined()
    await s.settled()
    expect(f.objects.size).toBe(0)
    // Put back on purpose (objects, then the pointer): adopted again.
    f.remote.hasCalibration = head
    expect(await f.remote.putCalibration(c!.hash, c!.bytes)).toBe(true)
    f.setCurrent(c!.hash)
    f.setCached(undefined)
    await s.refresh()
    expect(s.stats().current).toBe(c!.hash)
    expect(s.current()?.hash).toBe(c!.hash)
  })

  it('a gateway that refuses the calibration for good (413: over its size cap) is not asked again', async () => {
    const f = fakeRemote()
    f.remote.putCalibration = async () => {
      f.calls.put++
      return 'refused'
    }
    const s = new CalibrationStore({ codec, geometry: g, remote: f.remote, calibrateAfter: 1 })
    for (let i = 0; i < 4; i++) {
      s.observe(kv(1, 50 + i))
      await s.settled()
    }
    // Built once and refused: no build (a codec worker reading every sample) and no sample
    // copies per `calibrateAfter` chunks after that, for as long as the process runs.
    expect([s.stats().built, f.calls.put, f.calls.set]).toEqual([1, 1, 0])
    expect(s.stats().current).toBeUndefined()
  })

  it('calibrateAfter 0 never builds; an unreachable gateway publishes nothing and is not an error', async () => {
    const f = fakeRemote()
    const s = new CalibrationStore({ codec, geometry: g, remote: f.remote, calibrateAfter: 0 })
    s.observe(kv(1, 1))
    await s.settled()
    expect(f.calls.current).toBe(0)
    f.setReachable(false)
    const t = new CalibrationStore({ codec, geometry: g, remote: f.remote })
    expect(await t.publish(sample(7))).toBeUndefined()
    expect(t.stats().won).toBe(0)
  })
})

describe('CodecPool.buildCalibration', () => {
  it('builds on a worker the same bytes as inline, leaving the calling thread free', async () => {
    const pool = new CodecPool(1)
    try {
      const samples = [kv(1, 31), kv(1, 32)]
      const want = buildCalibration(
        samples.map((x) => x.slice()),
        { geometry: g, dtype: g.dtype },
      )
      expect(await pool.buildCalibration(samples, g)).toEqual(want)
      expect(pool.counts.workerJobs).toBe(1)
      expect(pool.counts.inlineJobs).toBe(0)
    } finally {
      await pool.close()
    }
  })
})

describe('client options', () => {
  it('KVGATE_REMOTE_CALIBRATION(_AFTER) from the environment', () => {
    const env = { KVGATE_REMOTE_URL: 'http://g:1' }
    expect(optionsFromEnvironment({ ...env, KVGATE_REMOTE_CALIBRATION: 'off' }).remote).toMatchObject({
      calibration: false,
    })
    expect(optionsFromEnvironment({ ...env, KVGATE_REMOTE_CALIBRATION_AFTER: '8' }).remote).toMatchObject({
      calibration: { after: 8 },
    })
    expect(() => optionsFromEnvironment({ ...env, KVGATE_REMOTE_CALIBRATION: 'maybe' })).toThrow(/on or off/)
    expect(() => optionsFromEnvironment({ ...env, KVGATE_REMOTE_CALIBRATION_AFTER: 'x' })).toThrow()
  })
  it('remote.calibration keys are strict', async () => {
    for (const calibration of [{ after: -1 }, { afterr: 2 }, { currentTtlMs: 'x' }, 'yes', null]) {
      await expect(
        KVCache.open({
          model: 'stories260k',
          chunkTokens: T,
          memory: { bytes: 2 * CB },
          remote: { url: 'http://127.0.0.1:9', calibration: calibration as never },
        }),
      ).rejects.toMatchObject({ code: 'ERR_INVALID_ARGUMENT' })
    }
  })
})

describe('clients calibrating through a gateway on RadosGW', () => {
  let rgw: Rgw | undefined
  let store: S3Store
  let gw: RunningGateway | undefined
  const prefix = `calib${Date.now().toString(36)}`
  const caches: KVCache[] = []
  const dirs: string[] = []

  beforeAll(async () => {
    rgw = await useRgw('client calibration on RGW')
    if (!rgw) return
    store = new S3Store({
      bucket: rgw.bucket,
      endpoint: rgw.endpoint,
      region: rgw.region,
      credentials: { accessKeyId: rgw.accessKeyId, secretAccessKey: rgw.secretAccessKey },
    })
    gw = await serveGateway(createGateway({ store, prefix }), { port: 0 })
  })
  afterAll(async () => {
    for (const c of caches) await c.close(100)
    for (const d of dirs) rmSync(d, { recursive: true, force: true })
    await gw?.close(100)
    await rgw?.stop()
  })

  async function node(url: string, after = 2, namespace = 'calib') {
    const c = await KVCache.open({
      model: 'stories260k',
      chunkTokens: T,
      namespace,
      memory: { bytes: 32 * CB },
      remote: { url, codec: 'kvgate', calibration: { after, currentTtlMs: 50 } },
    })
    caches.push(c)
    return c
  }

  async function until(cond: () => boolean, ms = 10_000): Promise<void> {
    const end = Date.now() + ms
    while (!cond()) {
      if (Date.now() > end)
        throw new Error(`timed out: ${JSON.stringify(caches.map((c) => c.stats().calibration))}`)
      await new Promise((r) => setTimeout(r, 20))
    }
  }

  it('two clients calibrate at once: one winner, both encode with it and decode each other’s chunks', async (ctx) => {
    if (!gw) return ctx.skip()
    const a = await node(gw.url)
    const b = await node(gw.url)
    // Each samples its first two full chunks, learns the namespace has none, builds and publishes.
    await Promise.all([a.store(promptTokens(3, 1), kv(3, 1)), b.store(promptTokens(3, 2), kv(3, 2))])
    await until(() => Boolean(a.stats().calibration?.current && b.stats().calibration?.current))
    const winner = a.stats().calibration!.current!
    expect(b.stats().calibration!.current).toBe(winner)
    const sa = a.stats().calibration!
    const sb = b.stats().calibration!
    expect(sa.built + sb.built).toBeGreaterThanOrEqual(1)
    expect(sa.won + sb.won).toBe(1)
    // Calibrated encodes from now on: wait until each holds the winner, then store new prompts.
    await until(() => a.stats().calibration!.fetched + a.stats().calibration!.won > 0)
    await until(() => b.stats().calibration!.fetched + b.stats().calibration!.won > 0)
    await new Promise((r) => setTimeout(r, 100))
    const pa = promptTokens(3, 5)
    const pb = promptTokens(3, 6)
    await Promise.all([a.store(pa, kv(3, 5)), b.store(pb, kv(3, 6))])
    await Promise.all([a.flush(), b.flush()])
    for (const [c, p] of [
      [a, pa],
      [b, pb],
    ] as const) {
      for (const k of c.keys(p)) {
        const r = await fetch(`${gw.url}/v1/ns/calib/chunks/${k.hex}`)
        const h = decodeHeader(new Uint8Array(await r.arrayBuffer()))
        expect([h.formatVersion, h.calibration]).toEqual([2, winner])
      }
    }
    // Each decodes the other's chunks (L4 only: not in its own L1), and a fresh node both.
    const into = new Uint8Array(3 * CB)
    expect(sum(await a.retrieve(pb, { into }))).toBe(3 * T)
    expect(sum(await b.retrieve(pa, { into }))).toBe(3 * T)
    const c = await node(gw.url, 0)
    expect(sum(await c.retrieve(pa, { into }))).toBe(3 * T)
    expect(sum(await c.retrieve(pb, { into }))).toBe(3 * T)
    expect(c.stats().calibration).toMatchObject({ fetched: 1, misses: 0, built: 0 })

    // The calibration object deleted behind the gateway: a node without a copy misses, counted,
    // reports nothing corrupt, and serves no bytes. (A fresh gateway: no cached copy.)
    expect(await store.delete(calibrationObjectName(prefix, 'calib', winner))).toBe(true)
    const gw2 = await serveGateway(createGateway({ store, prefix }), { port: 0 })
    try {
      const d = await node(gw2.url, 0)
      const got = new Uint8Array(3 * CB).fill(0xee)
      expect(sum(await d.retrieve(pa, { into: got }))).toBe(0)
      expect(d.stats().calibration!.misses).toBeGreaterThan(0)
      expect(d.stats().remote!.corruptReported).toBe(0)
      expect(got.every((x) => x === 0xee)).toBe(true)
      // The chunk objects themselves are untouched.
      const k = d.keys(pa)[0]!
      expect((await fetch(`${gw2.url}/v1/ns/calib/chunks/${k.hex}`, { method: 'HEAD' })).status).toBe(200)
      // A node that holds it puts it back at its next refresh (the pointer still names it) ...
      await new Promise((r) => setTimeout(r, 60))
      await a.store(promptTokens(1, 7), kv(1, 7))
      await until(() => a.stats().calibration!.restored === 1)
      // ... and a node without a copy decodes again.
      const e = await node(gw2.url, 0)
      expect(sum(await e.retrieve(pa, { into: got }))).toBe(3 * T)
      expect(e.stats().calibration).toMatchObject({ fetched: 1, misses: 0 })
    } finally {
      await gw2.close(100)
    }
  })

  it('an operator’s delete of the pointer and the object holds: no holder puts the object back', async (ctx) => {
    if (!gw) return ctx.skip()
    const ns = 'calib-deleted'
    const a = await node(gw.url, 2, ns)
    await a.store(promptTokens(3, 11), kv(3, 11))
    await until(() => a.stats().calibration!.won === 1)
    const hash = a.stats().calibration!.current!
    // Deleted as docs/calibration.md says: the pointer, then the object. The gateway keeps
    // answering its cached pointer (60 s), so the holder's next refresh still hears the hash.
    expect(await store.delete(currentCalibrationName(prefix, ns))).toBe(true)
    expect(await store.delete(calibrationObjectName(prefix, ns, hash))).toBe(true)
    expect(await (await fetch(`${gw.url}/v1/ns/${ns}/calibration`)).json()).toEqual({ hash })
    await new Promise((r) => setTimeout(r, 60))
    await a.store(promptTokens(1, 12), kv(1, 12))
    await until(() => a.stats().calibration!.current === undefined)
    expect(await store.head(calibrationObjectName(prefix, ns, hash))).toBeUndefined()
    expect(a.stats().calibration!.restored).toBe(0)
  })
})

describe('calibrated chunks by layer ranges (memory gateway)', () => {
  it('retrieveLayers decodes calibrated layer groups, and misses them without the calibration', async () => {
    const store = new MemoryStore()
    const gw = await serveGateway(createGateway({ store }), { port: 0 })
    const open = (after: number) =>
      KVCache.open({
        model: 'stories260k',
        chunkTokens: T,
        namespace: 'layers',
        memory: { bytes: 8 * CB },
        remote: { url: gw.url, codec: 'kvgate', calibration: { after, currentTtlMs: 0 } },
      })
    const a = await open(1)
    const b = await open(0)
    try {
      await a.store(promptTokens(1, 1), kv(1, 1))
      await a.flush()
      const end = Date.now() + 5000
      while (!a.stats().calibration?.current && Date.now() < end) {
        await a.store(promptTokens(1, 2), kv(1, 2))
        await new Promise((r) => setTimeout(r, 20))
      }
      while (!a.stats().calibration!.won && Date.now() < end) await new Promise((r) => setTimeout(r, 20))
      const toks = promptTokens(2, 9)
      await a.store(toks, kv(2, 9))
      await a.flush()
      for (const k of a.keys(toks)) {
        const r = await fetch(`${gw.url}/v1/ns/layers/chunks/${k.hex}`)
        expect(decodeHeader(new Uint8Array(await r.arrayBuffer())).calibration).toBe(
          a.stats().calibration!.current,
        )
      }
      const layers: number[] = []
      for await (const batch of b.retrieveLayers(toks)) {
        expect(batch.chunks).toBe(2)
        layers.push(batch.layer)
      }
      expect(layers).toEqual([0, 1, 2, 3, 4])
      expect(b.stats().calibration).toMatchObject({ fetched: 1, misses: 0 })
      // Gone from the bucket, and a node without a copy: every layer group is a miss, nothing corrupt.
      const hash = a.stats().calibration!.current!
      await store.delete(calibrationObjectName('kvgate', 'layers', hash))
      const c = await open(0)
      try {
        for await (const batch of c.retrieveLayers(toks)) expect(batch.chunks).toBe(0)
        expect(c.stats().calibration!.misses).toBeGreaterThan(0)
        expect(c.stats().remote!.corruptReported).toBe(0)
      } finally {
        await c.close(100)
      }
    } finally {
      await a.close(100)
      await b.close(100)
      await gw.close(100)
    }
  })
})

describe('a restarted node decodes its L2 offline', () => {
  it('a gateway whose size cap refuses the calibration (413) is not sent another build', async () => {
    const app = createGateway({ store: new MemoryStore(), limits: { maxCalibrationBytes: 1000 } })
    const gw = await serveGateway(app, { port: 0 })
    const c = await KVCache.open({
      model: 'stories260k',
      chunkTokens: T,
      namespace: 'capped',
      memory: { bytes: 8 * CB },
      remote: { url: gw.url, codec: 'kvgate', calibration: { after: 1, currentTtlMs: 0 } },
    })
    try {
      const settle = async () => {
        await c.flush()
        await new Promise((r) => setTimeout(r, 100))
      }
      await c.store(promptTokens(1, 1), kv(1, 1))
      await settle()
      const end = Date.now() + 5000
      while (c.stats().calibration!.built === 0 && Date.now() < end)
        await new Promise((r) => setTimeout(r, 20))
      await settle()
      for (let i = 2; i <= 5; i++) {
        await c.store(promptTokens(1, i), kv(1, i))
        await settle()
      }
      // One build, refused for good: no more builds (each reads every sample on a codec worker).
      expect(c.stats().calibration).toMatchObject({ built: 1, current: undefined })
    } finally {
      await c.close(100)
      await gw.close(100)
    }
  })

  it('with the calibration persisted beside L2; without it, a counted miss and the file kept', async () => {
    const app = createGateway({ store: new MemoryStore() })
    const gw = await serveGateway(app, { port: 0 })
    const dir = tmp()
    const open = (url: string) =>
      KVCache.open({
        model: 'stories260k',
        chunkTokens: T,
        namespace: 'offline',
        memory: { bytes: 8 * CB },
        disk: { dir, bytes: 1 << 26 },
        remote: { url, codec: 'kvgate', calibration: { after: 1, currentTtlMs: 0 } },
      })
    let hash: string
    const a = await open(gw.url)
    try {
      await a.store(promptTokens(1, 1), kv(1, 1))
      await a.flush()
      await new Promise((r) => setTimeout(r, 50))
      await a.store(promptTokens(1, 2), kv(1, 2))
      await a.flush()
      const end = Date.now() + 5000
      while (!a.stats().calibration?.current && Date.now() < end) await new Promise((r) => setTimeout(r, 20))
      hash = a.stats().calibration!.current!
      expect(hash).toMatch(/^[0-9a-f]{64}$/)
    } finally {
      await a.close(100)
      await gw.close(100)
    }
    // An L2 file coded with that calibration (as a node keeping L4 objects in L2 would hold).
    const cal = openCalibration(readFileSync(join(dir, 'calibrations', `${hash}.kvcl`)))
    const toks = promptTokens(1, 3)
    const b = await open('http://127.0.0.1:9') // the gateway is gone
    const k = b.keys(toks)[0]!
    const obj = encodeChunk(
      kv(1, 3),
      {
        geometry: g,
        tokens: T,
        chunkIndex: 0,
        partial: false,
        namespaceId: fromHex(namespaceId({ modelId: g.modelId, geometry: g, chunkTokens: T })),
        chainKey: k.key,
        parentKey: fromHex(k.parentHex),
      },
      { mode: 'kvgate', calibration: cal },
    )
    expect(decodeHeader(obj).calibration).toBe(hash)
    await b.close(100)
    mkdirSync(join(dir, k.hex.slice(0, 2)), { recursive: true })
    writeFileSync(join(dir, k.hex.slice(0, 2), `${k.hex}.kvc`), obj)
    const c = await open('http://127.0.0.1:9')
    try {
      const into = new Uint8Array(CB)
      expect(sum(await c.retrieve(toks, { into }))).toBe(T)
      expect(c.stats().calibration).toMatchObject({ loaded: 1, misses: 0 })
    } finally {
      await c.close(100)
    }
    // Without the persisted calibration: a miss, counted, and the L2 file is not treated as corrupt.
    rmSync(join(dir, 'calibrations'), { recursive: true, force: true })
    const d = await open('http://127.0.0.1:9')
    try {
      expect(sum(await d.retrieve(toks, { into: new Uint8Array(CB) }))).toBe(0)
      expect(d.stats().calibration!.misses).toBe(1)
      expect(d.metrics()).toMatch(/^kvgate_client_calibration_misses_total 1$/m)
      // A's two chunks (raw L2 copies) and the calibrated one, which stays for when the calibration is back.
      expect(d.stats().disk).toMatchObject({ corrupt: 0, files: 3 })
      expect(existsSync(join(dir, k.hex.slice(0, 2), `${k.hex}.kvc`))).toBe(true)
    } finally {
      await d.close(100)
      rmSync(dir, { recursive: true, force: true })
    }
  })
})
