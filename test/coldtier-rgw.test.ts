// The cold tier on a real S3 (Ceph RadosGW): retention deletes unused chains and keeps
// used ones, quota eviction goes tail-first with lookups consistent, two gc runs at once
// beside live traffic, and a killed gateway process loses at most its stated window of uses.

import { type ChildProcess, spawn } from 'node:child_process'
import { createInterface } from 'node:readline'
import { Writable } from 'node:stream'
import { afterAll, describe, expect, it, vi } from 'vitest'
import { runGc } from '../src/coldtier/gc.ts'
import { usagePrefix } from '../src/coldtier/names.ts'
import { condemnWaitMs, DEFAULT_USAGE, parseColdTier } from '../src/coldtier/policy.ts'
import { decodeBatch } from '../src/coldtier/records.ts'
import { objectName } from '../src/core/keys.ts'
import { streamingHandler } from '../src/gateway/adapters/lambda.ts'
import { createGateway, type GatewayApp } from '../src/gateway/index.ts'
import { S3Store } from '../src/gateway/node.ts'
import type { ObjectStore } from '../src/gateway/stores/types.ts'
import { makeChain, putInit, type TestChunk } from './gateway-fixtures.ts'
import { fakeAwsLambda } from './lambda-support.ts'
import { type Rgw, useRgw } from './support/rgw.ts'

const DAY = 86_400_000
/** Two-phase deletes: a run condemns, a run this much later deletes (default usage settings). */
const WAIT = condemnWaitMs(DEFAULT_USAGE)
const rgw: Rgw | undefined = await useRgw('coldtier (RadosGW)')
const run = rgw ? describe : describe.skip
let seq = 0
const uniq = () => `ct${Date.now().toString(36)}${(++seq).toString(36)}`

const s3 = () =>
  new S3Store({
    bucket: rgw!.bucket,
    endpoint: rgw!.endpoint,
    region: rgw!.region,
    credentials: { accessKeyId: rgw!.accessKeyId, secretAccessKey: rgw!.secretAccessKey },
  })

afterAll(async () => {
  await rgw?.stop()
})

const lookup = async (app: GatewayApp, keys: string[]) => {
  const r = await app.request('/v1/ns/prod/lookup', {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ keys }),
  })
  expect(r.status).toBe(200)
  return ((await r.json()) as { present: number }).present
}

async function put(app: GatewayApp, chain: TestChunk[]) {
  for (const c of chain)
    expect((await app.request(`/v1/ns/prod/chunks/${c.key}`, putInit(c.bytes))).status).toBe(201)
}

/** How many leading chunks of a chain exist, asserting nothing exists after the first gap. */
async function prefixLength(store: ObjectStore, prefix: string, chain: TestChunk[]): Promise<number> {
  const here = await Promise.all(chain.map((c) => store.head(objectName(prefix, 'prod', c.key))))
  const n = here.indexOf(undefined)
  const len = n < 0 ? chain.length : n
  expect(
    here.slice(len).every((h) => h === undefined),
    'a hole: a later chunk outlived an earlier one',
  ).toBe(true)
  return len
}

/** A store that checks, at every chunk delete, that the next chunk of its chain is already gone. */
function tailFirstGuard(store: ObjectStore, prefix: string, chains: TestChunk[][]) {
  const next = new Map<string, string>()
  for (const ch of chains) for (let i = 0; i + 1 < ch.length; i++) next.set(ch[i]!.key, ch[i + 1]!.key)
  const violations: string[] = []
  const guarded: ObjectStore = {
    kind: store.kind,
    get: (n, o) => store.get(n, o),
    head: (n) => store.head(n),
    putIfAbsent: (n, b, size) => store.putIfAbsent(n, b, size),
    list: (p, o) => store.list(p, o),
    delete: async (name: string) => {
      const key = name.slice(name.lastIndexOf('/') + 1)
      const child = next.get(key)
      if (child && (await store.head(objectName(prefix, 'prod', child)))) violations.push(key)
      return store.delete(name)
    },
  }
  return { guarded, violations }
}

run('cold tier on RadosGW', () => {
  const store = rgw ? s3() : undefined!
  afterAll(() => store.close())

  it('retention deletes chains unused for the period, keeps used ones; a second run is a no-op', async () => {
    const prefix = uniq()
    let t = Date.now()
    const app = createGateway({ store, prefix, coldTier: { now: () => t } })
    const chains = [makeChain(4), makeChain(4), makeChain(3)]
    for (const c of chains) await put(app, c)
    t += 20 * DAY
    expect(
      await lookup(
        app,
        chains[0]!.map((c) => c.key),
      ),
    ).toBe(4)
    // Chain 1 read only up to its second chunk (a shorter prompt shares that prefix).
    const g = await app.request(`/v1/ns/prod/chunks/${chains[1]![1]!.key}`)
    expect(new Uint8Array(await g.arrayBuffer())).toEqual(chains[1]![1]!.bytes)
    await app.state.usage!.flush()
    const config = parseColdTier({ namespaces: { prod: { retention: '10d' } } })
    const first = await runGc({ store, prefix, config, now: t + DAY })
    expect(first.namespaces[0]).toMatchObject({ deleted: { objects: 0 }, condemned: { objects: 5 } })
    const r = await runGc({ store, prefix, config, now: t + DAY + WAIT })
    expect(r.errors).toEqual([])
    expect(r.namespaces[0]).toMatchObject({
      ns: 'prod',
      deleted: { objects: 5, retention: 5 },
      kept: { objects: 6 },
    })
    expect(await prefixLength(store, prefix, chains[0]!)).toBe(4)
    expect(await prefixLength(store, prefix, chains[1]!)).toBe(2)
    expect(await prefixLength(store, prefix, chains[2]!)).toBe(0)
    // A gateway that never saw the chains answers lookups that agree with the bucket.
    const fresh = createGateway({ store, prefix, coldTier: false })
    expect([
      await lookup(
        fresh,
        chains[1]!.map((c) => c.key),
      ),
      await lookup(
        fresh,
        chains[2]!.map((c) => c.key),
      ),
    ]).toEqual([2, 0])
    // The live gateway never serves a deleted chunk's bytes: a miss.
    expect((await app.request(`/v1/ns/prod/chunks/${chains[2]![0]!.key}`)).status).toBe(404)
    const again = await runGc({ store, prefix, config, now: t + DAY + WAIT })
    expect(again.namespaces[0]).toMatchObject({
      deleted: { objects: 0 },
      kept: { objects: 6 },
      headerReads: 0,
    })
    expect((await store.list(usagePrefix(prefix, 'prod'))).entries).toEqual([])
  })

  it('quota evicts least-recently-used chains from their tails; lookups stay consistent', async () => {
    const prefix = uniq()
    let t = Date.now()
    const app = createGateway({ store, prefix, coldTier: { now: () => t } })
    const chains = Array.from({ length: 5 }, () => makeChain(4))
    for (const c of chains) await put(app, c)
    const chunkBytes = chains[0]![0]!.bytes.length
    // Used in the order 3, 0, 4, 1, 2 (2 most recent), one hour apart.
    for (const i of [3, 0, 4, 1, 2]) {
      t += 3_600_000
      expect(
        await lookup(
          app,
          chains[i]!.map((c) => c.key),
        ),
      ).toBe(4)
    }
    await app.state.usage!.flush()
    const { guarded, violations } = tailFirstGuard(store, prefix, chains)
    // Room for 10 chunks: chains 2 and 1 whole, then 2 chunks of chain 4.
    const config = parseColdTier({ namespaces: { prod: { quota: chunkBytes * 10 } } })
    const first = await runGc({ store: guarded, prefix, config, now: t + 3_600_000 })
    expect(first.namespaces[0]).toMatchObject({ deleted: { objects: 0 }, condemned: { objects: 10 } })
    const r = await runGc({ store: guarded, prefix, config, now: t + 3_600_000 + WAIT })
    expect(violations).toEqual([])
    expect(r.namespaces[0]).toMatchObject({
      deleted: { objects: 10, quota: 10 },
      kept: { objects: 10, bytes: chunkBytes * 10 },
    })
    const lens = []
    for (const c of chains) lens.push(await prefixLength(store, prefix, c))
    expect(lens).toEqual([0, 4, 4, 0, 2])
    const fresh = createGateway({ store, prefix, coldTier: false })
    for (const [i, c] of chains.entries())
      expect(
        await lookup(
          fresh,
          c.map((x) => x.key),
        ),
      ).toBe(lens[i])
    // Every chunk the live gateway serves is exactly what was stored, or a 404.
    for (const c of chains.flat()) {
      const res = await app.request(`/v1/ns/prod/chunks/${c.key}`)
      if (res.status === 200) expect(new Uint8Array(await res.arrayBuffer())).toEqual(c.bytes)
      else expect(res.status).toBe(404)
    }
  })

  it('two gc runs at once beside lookups, GETs and PUTs: no wrong bytes, no 5xx, no holes', async () => {
    const prefix = uniq()
    // Flush use records after every request so gc sees the traffic as it happens.
    const app = createGateway({ store, prefix, coldTier: { usage: { flushIntervalMs: 0, maxDelayMs: 0 } } })
    const cold = Array.from({ length: 6 }, () => makeChain(3))
    const hot = makeChain(3)
    for (const c of [...cold, hot]) await put(app, c)
    const chunkBytes = hot[0]!.bytes.length
    await new Promise((r) => setTimeout(r, 3500)) // out of the grace period
    // 3 s: S3 lists write times to the second, and fresh writes must stay protected.
    const config = parseColdTier({ grace: '3s', namespaces: { prod: { quota: chunkBytes * 6 } } })
    const all = new Map([...cold, hot].flat().map((c) => [c.key, c.bytes]))
    const written: TestChunk[][] = []
    const statuses: number[] = []
    let stop = false
    const traffic = (async () => {
      while (!stop) {
        statuses.push(
          (
            await app.request('/v1/ns/prod/lookup', {
              method: 'POST',
              headers: { 'content-type': 'application/json' },
              body: JSON.stringify({ keys: hot.map((c) => c.key) }),
            })
          ).status,
        )
        for (const c of [...hot, cold[0]![0]!]) {
          const res = await app.request(`/v1/ns/prod/chunks/${c.key}`)
          statuses.push(res.status)
          if (res.status === 200) expect(new Uint8Array(await res.arrayBuffer())).toEqual(all.get(c.key))
          else await res.body?.cancel()
        }
        const fresh = makeChain(2)
        await put(app, fresh)
        written.push(fresh)
      }
    })()
    await new Promise((r) => setTimeout(r, 300))
    const { guarded, violations } = tailFirstGuard(store, prefix, [...cold, hot])
    // An earlier run condemned; the two at once delete (no wait: the test's clock is real).
    const condemning = await runGc({ store: guarded, prefix, config })
    expect(condemning.namespaces[0]!.condemned.objects).toBeGreaterThanOrEqual(12)
    const [a, b] = await Promise.all([
      runGc({ store: guarded, prefix, config, condemnWaitMs: 0 }),
      runGc({ store: guarded, prefix, config, condemnWaitMs: 0 }),
    ])
    stop = true
    await traffic
    expect(violations).toEqual([])
    expect(statuses.filter((s) => s >= 500)).toEqual([])
    expect([...condemning.errors, ...a!.errors, ...b!.errors]).toEqual([])
    // Between them the two runs deleted each victim once; the other found it gone.
    const deleted = a!.namespaces[0]!.deleted.objects + b!.namespaces[0]!.deleted.objects
    expect(deleted).toBeGreaterThanOrEqual(12)
    expect(await prefixLength(store, prefix, hot)).toBe(3)
    for (const c of [...cold, ...written]) await prefixLength(store, prefix, c)
    for (const c of written) expect(await prefixLength(store, prefix, c)).toBe(2)
  })

  it('a chunk left behind a hole on S3 is swept with its descendants, tail first', async () => {
    const prefix = uniq()
    const app = createGateway({ store, prefix })
    const chain = makeChain(4)
    await put(app, chain)
    await app.state.usage!.flush()
    // Something other than gc (lifecycle expiry, an admin) took chunk 1.
    await store.delete(objectName(prefix, 'prod', chain[1]!.key))
    const keys = chain.map((c) => c.key)
    const config = parseColdTier({ namespaces: { prod: { retention: '10d' } } })
    const { guarded, violations } = tailFirstGuard(store, prefix, [chain])
    const r = await runGc({ store: guarded, prefix, config, now: Date.now() + 3_600_000 })
    expect(r.errors).toEqual([])
    expect(violations).toEqual([])
    expect(r.namespaces[0]).toMatchObject({ deleted: { objects: 2, orphan: 2 }, kept: { objects: 1 } })
    expect(await prefixLength(store, prefix, chain)).toBe(1)
    // (A 4-key lookup probes every key, so it saw 1 before too; a long chain's k-ary search
    // would have inferred chunk 1 from chunks 2-3.) Now nothing behind the hole is served.
    const fresh = createGateway({ store, prefix, coldTier: false })
    expect(await lookup(fresh, keys)).toBe(1)
    expect((await fresh.request(`/v1/ns/prod/chunks/${chain[2]!.key}`)).status).toBe(404)
  })

  it('the Lambda handler runs gc on the EventBridge schedule event, with KVGATE_COLD_TIER', async () => {
    const prefix = uniq()
    const app = createGateway({ store, prefix, coldTier: false })
    const chain = makeChain(3)
    await put(app, chain)
    const env = {
      KVGATE_S3_BUCKET: rgw!.bucket,
      KVGATE_S3_ENDPOINT: rgw!.endpoint,
      AWS_REGION: rgw!.region,
      AWS_ACCESS_KEY_ID: rgw!.accessKeyId,
      AWS_SECRET_ACCESS_KEY: rgw!.secretAccessKey,
      KVGATE_S3_PREFIX: prefix,
      KVGATE_AUTH_SSM_PARAMETER: '/never/read',
      KVGATE_COLD_TIER: JSON.stringify({
        grace: '0s',
        namespaces: { prod: { quota: chain[0]!.bytes.length } },
      }),
    }
    const saved = { ...process.env }
    Object.assign(process.env, env)
    try {
      const fn = streamingHandler(() => Promise.reject(new Error('gc must not build the app')), fakeAwsLambda)
      const invoke = async () => {
        const parts: Buffer[] = []
        const out = new Writable({
          write(c, _e, cb) {
            parts.push(c)
            cb()
          },
        })
        // What the Terraform module's aws_cloudwatch_event_target sends.
        await fn({ kvgate: 'gc' } as never, out)
        return JSON.parse(Buffer.concat(parts).toString())
      }
      expect(await invoke()).toMatchObject({ errors: 0 })
      expect(await prefixLength(store, prefix, chain)).toBe(3)
      // The schedule's next run (only Date moves on, within S3's 15-minute signing skew)
      // deletes what the first condemned.
      vi.useFakeTimers({ now: Date.now() + WAIT + 1000, toFake: ['Date'] })
      try {
        expect(await invoke()).toMatchObject({ errors: 0 })
      } finally {
        vi.useRealTimers()
      }
    } finally {
      for (const k of Object.keys(env)) delete process.env[k]
      Object.assign(process.env, saved)
    }
    expect(await prefixLength(store, prefix, chain)).toBe(1)
  })

  it('a gateway stopped with SIGTERM writes every use it buffered before exiting', async () => {
    const prefix = uniq()
    const chain = makeChain(2)
    // A long maxDelay: only the shutdown flush can have written the lookup's use.
    const gw = await startServe(prefix, { usage: { flushInterval: '10m', maxDelay: '10m' } })
    try {
      for (const k of chain)
        expect((await fetch(`${gw.url}/v1/ns/prod/chunks/${k.key}`, putInit(k.bytes))).status).toBe(201)
      const r = await fetch(`${gw.url}/v1/ns/prod/lookup`, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify({ keys: chain.map((c) => c.key) }),
      })
      expect(await r.json()).toEqual({ present: 2 })
      expect((await usesIn(store, prefix)).size).toBe(0)
      gw.proc.kill('SIGTERM')
      expect(await new Promise((r) => gw.proc.once('exit', r))).toBe(0)
    } finally {
      gw.proc.kill('SIGKILL')
    }
    expect([...(await usesIn(store, prefix))]).toEqual([chain[1]!.key])
  })

  it('a killed gateway process loses only uses younger than its maxDelay', async () => {
    const prefix = uniq()
    const chains = [makeChain(3), makeChain(3)]
    const gw = await startServe(prefix, { usage: { flushInterval: '1s', maxDelay: '2s' } })
    try {
      for (const c of chains)
        for (const k of c) {
          const r = await fetch(`${gw.url}/v1/ns/prod/chunks/${k.key}`, putInit(k.bytes))
          expect(r.status).toBe(201)
        }
      const look = (c: TestChunk[]) =>
        fetch(`${gw.url}/v1/ns/prod/lookup`, {
          method: 'POST',
          headers: { 'content-type': 'application/json' },
          body: JSON.stringify({ keys: c.map((x) => x.key) }),
        }).then((r) => r.json())
      expect(await look(chains[0]!)).toEqual({ present: 3 })
      // Older than maxDelay: the timer must have written it, traffic or not.
      await new Promise((r) => setTimeout(r, 3000))
      expect(await look(chains[1]!)).toEqual({ present: 3 })
      gw.proc.kill('SIGKILL')
      await new Promise((r) => gw.proc.once('exit', r))
    } finally {
      gw.proc.kill('SIGKILL')
    }
    const uses = new Map<string, number>()
    for (const e of (await store.list(usagePrefix(prefix, 'prod'))).entries) {
      const b = decodeBatch(new Uint8Array(await new Response((await store.get(e.name))!.body).arrayBuffer()))
      for (const u of b.uses) uses.set(u.key, u.at)
    }
    expect(uses.has(chains[0]![2]!.key)).toBe(true)
    // gc sees chain 0 as used after the kill; chain 1's last use (inside the window) may be lost.
    const r = await runGc({ store, prefix, config: parseColdTier({}), dryRun: true })
    expect(r.namespaces[0]).toMatchObject({ listed: { objects: 6 }, chains: 2, headerReads: 0 })
  })
})

async function usesIn(store: ObjectStore, prefix: string): Promise<Set<string>> {
  const keys = new Set<string>()
  for (const e of (await store.list(usagePrefix(prefix, 'prod'))).entries) {
    const b = decodeBatch(new Uint8Array(await new Response((await store.get(e.name))!.body).arrayBuffer()))
    for (const u of b.uses) keys.add(u.key)
  }
  return keys
}

function startServe(prefix: string, coldTier: unknown): Promise<{ proc: ChildProcess; url: string }> {
  const main = new URL('../src/cli/main.ts', import.meta.url).pathname
  const proc = spawn(process.execPath, ['--import', 'tsx', main, 'serve', '--port', '0', '--log', 'warn'], {
    stdio: ['ignore', 'pipe', 'inherit'],
    env: {
      ...process.env,
      KVGATE_CONFIG: '',
      KVGATE_STORE: 's3',
      KVGATE_PREFIX: prefix,
      KVGATE_S3_BUCKET: rgw!.bucket,
      KVGATE_S3_ENDPOINT: rgw!.endpoint,
      KVGATE_S3_REGION: rgw!.region,
      KVGATE_S3_ACCESS_KEY_ID: rgw!.accessKeyId,
      KVGATE_S3_SECRET_ACCESS_KEY: rgw!.secretAccessKey,
      KVGATE_PRESIGN_MIN_BYTES: 'off',
      KVGATE_COLD_TIER: JSON.stringify(coldTier),
    },
  })
  return new Promise((resolve, reject) => {
    createInterface({ input: proc.stdout! }).on('line', (l) => {
      const j = JSON.parse(l) as { msg?: string; url?: string }
      if (j.msg === 'listening') resolve({ proc, url: j.url! })
    })
    proc.once('exit', (code) => reject(new Error(`serve exited with ${code}`)))
  })
}
