// The upload protocol without S3: "direct" answers from stores that cannot presign,
// request checks, option checks, the ticket and expiry logic over a fake staging
// store, and the client's remote tier learning that a gateway takes PUTs directly.

import { createHash } from 'node:crypto'
import { createServer } from 'node:http'
import type { AddressInfo } from 'node:net'
import { afterEach, describe, expect, it, vi } from 'vitest'
import { RemoteTier } from '../src/client/tiers/remote.ts'
import { usagePrefix } from '../src/coldtier/names.ts'
import { decodeBatch, ROOT_PARENT } from '../src/coldtier/records.ts'
import { serveGateway } from '../src/gateway/adapters/node.ts'
import { createGateway } from '../src/gateway/app.ts'
import { MemoryStore } from '../src/gateway/stores/memory.ts'
import type { UploadTargets } from '../src/gateway/stores/types.ts'
import { makeChunk, type TestChunk } from './gateway-fixtures.ts'

const MIB = 1024 * 1024
const sha256 = (s: string) => createHash('sha256').update(s).digest('hex')
const GRANTS = [
  { name: 'a', sha256: sha256('tok-a'), scopes: 'write' as const, namespaces: ['a'] },
  { name: 'r', sha256: sha256('tok-r'), scopes: 'read' as const, namespaces: ['a'] },
  { name: 'b', sha256: sha256('tok-b'), scopes: 'write' as const, namespaces: ['b'] },
]

type App = ReturnType<typeof createGateway>

async function open(app: App, ns: string, body: unknown, token = 'tok-a', type = 'application/json') {
  const res = await app.fetch(
    new Request(`http://gw/v1/ns/${ns}/uploads`, {
      method: 'POST',
      headers: { authorization: `Bearer ${token}`, 'content-type': type },
      body: typeof body === 'string' ? body : JSON.stringify(body),
    }),
  )
  const json = (await res.json()) as Record<string, unknown> & { error?: { code: string } }
  return { status: res.status, json, code: json.error?.code }
}

async function commit(app: App, ns: string, id: string, token = 'tok-a') {
  const res = await app.fetch(
    new Request(`http://gw/v1/ns/${ns}/uploads/${id}/commit`, {
      method: 'POST',
      headers: { authorization: `Bearer ${token}` },
    }),
  )
  const json = (await res.json()) as Record<string, unknown> & { error?: { code: string } }
  return { status: res.status, json, code: json.error?.code }
}

/** A memory store that "presigns": the URL names the staging object; tests stage bytes themselves. */
class StagingMemoryStore extends MemoryStore {
  async presignUpload(name: string, size: number): Promise<UploadTargets> {
    return { parts: [{ url: `https://bucket.invalid/${name}?X-Amz-Signature=t`, offset: 0, length: size }] }
  }
}

const stagedNameOf = (url: string) => decodeURIComponent(new URL(url).pathname.slice(1))

afterEach(() => {
  vi.useRealTimers()
})

/**
 * POSTs an upload request whose body sends `first` and then nothing, never closing; returns the
 * answer's status and error code (undefined after 2 s) and whether the gateway let go of the body.
 */
async function neverEndingUpload(
  app: { fetch: (r: Request) => Response | Promise<Response> },
  first: string,
): Promise<{ status: number | undefined; code: string | undefined; cancelled: boolean }> {
  let cancelled = false
  const body = new ReadableStream<Uint8Array>({
    start(c) {
      c.enqueue(new TextEncoder().encode(first))
    },
    cancel() {
      cancelled = true
    },
  })
  const req = new Request('http://gw/v1/ns/a/uploads', {
    method: 'POST',
    headers: { authorization: 'Bearer tok-a', 'content-type': 'application/json' },
    body,
    duplex: 'half',
  } as RequestInit)
  const res = await Promise.race([
    app.fetch(req),
    new Promise<undefined>((r) => setTimeout(() => r(undefined), 2000)),
  ])
  const code = res ? ((await res.json()) as { error: { code: string } }).error.code : undefined
  return { status: res?.status, code, cancelled }
}

describe('stores that cannot presign answer "direct"', () => {
  it('for every size, with or without the uploads option; there is nothing to commit', async () => {
    for (const uploads of [undefined, {}]) {
      const app = createGateway({ store: new MemoryStore(), auth: { tokens: GRANTS }, uploads })
      const c = makeChunk({ layers: 4, sectionBytes: MIB })
      const r = await open(app, 'a', { key: c.key, bytes: c.bytes.length })
      expect([r.status, r.json]).toEqual([200, { mode: 'direct', presignMinBytes: null }])
      const cm = await commit(app, 'a', 'eyJrIjoiMCJ9')
      expect([cm.status, cm.code]).toEqual([404, 'ERR_NOT_FOUND'])
    }
  })

  it('checks scope, namespace, content type, JSON, fields, key and size', async () => {
    const app = createGateway({ store: new MemoryStore(), auth: { tokens: GRANTS }, uploads: {} })
    const key = makeChunk().key
    const cases: [unknown, number, string, string?, string?][] = [
      [{ key, bytes: 4096 }, 403, 'ERR_FORBIDDEN', 'tok-r'],
      [{ key, bytes: 4096 }, 415, 'ERR_UNSUPPORTED_MEDIA_TYPE', 'tok-a', 'text/plain'],
      ['{not json', 400, 'ERR_INVALID_ARGUMENT'],
      [{ key, bytes: 4096, extra: 1 }, 400, 'ERR_INVALID_ARGUMENT'],
      [{ key: 'zz', bytes: 4096 }, 400, 'ERR_INVALID_KEY'],
      [{ key, bytes: -1 }, 400, 'ERR_INVALID_ARGUMENT'],
      [{ key, bytes: 10 }, 400, 'ERR_FORMAT_TRUNCATED'],
    ]
    for (const [body, status, code, token, type] of cases) {
      const r = await open(app, 'a', body, token, type)
      expect([r.status, r.code], JSON.stringify(body)).toEqual([status, code])
    }
    expect((await open(app, 'b', { key, bytes: 4096 })).status).toBe(403)
  })

  it('takes no larger chunk through an upload than through a PUT unless told to', async () => {
    class Presigning extends MemoryStore {
      async presignUpload(name: string, size: number): Promise<UploadTargets> {
        return { parts: [{ url: `https://bucket.invalid/${name}`, offset: 0, length: size }] }
      }
    }
    const key = makeChunk().key
    const app = createGateway({ store: new Presigning(), limits: { maxChunkBytes: MIB }, uploads: {} })
    const r = await open(app, 'a', { key, bytes: 2 * MIB })
    expect([r.status, r.code]).toEqual([413, 'ERR_PAYLOAD_TOO_LARGE'])
    const wide = createGateway({
      store: new Presigning(),
      limits: { maxChunkBytes: MIB },
      uploads: { maxBytes: 4 * MIB },
    })
    expect((await open(wide, 'a', { key, bytes: 2 * MIB })).json.mode).toBe('presigned')
  })

  it('refuses bad options eagerly', () => {
    const store = new MemoryStore()
    expect(() => createGateway({ store, uploads: { minBytes: 1, bogus: 1 } as never })).toThrow(
      /uploads.bogus/,
    )
    expect(() => createGateway({ store, uploads: { partBytes: MIB } })).toThrow(/partBytes/)
    expect(() => createGateway({ store, uploads: { expiresSeconds: 0 } })).toThrow(/expiresSeconds/)
    // Staging inside the chunk prefix would make unverified bytes look like chunks.
    expect(() => createGateway({ store, prefix: 'kv', uploads: { stagingPrefix: 'kv/staging' } })).toThrow(
      /stagingPrefix/,
    )
    expect(() => createGateway({ store, prefix: 'kv', uploads: { stagingPrefix: '../x' } })).toThrow(
      /stagingPrefix/,
    )
  })
})

describe('tickets over a staging store', () => {
  const setup = () => {
    const store = new StagingMemoryStore()
    const app = createGateway({
      store,
      prefix: 'kv',
      auth: { tokens: GRANTS },
      uploads: { minBytes: 1024, expiresSeconds: 60 },
    })
    return { store, app }
  }

  it('stages outside the chunk prefix, commits verified bytes, and removes the staged object', async () => {
    const { store, app } = setup()
    const c = makeChunk({ sectionBytes: 4096 })
    const r = await open(app, 'a', { key: c.key, bytes: c.bytes.length })
    expect(r.json.mode).toBe('presigned')
    const {
      uploadId,
      parts,
      commit: commitPath,
    } = r.json as {
      uploadId: string
      parts: { url: string }[]
      commit: string
    }
    expect(commitPath).toBe(`/v1/ns/a/uploads/${uploadId}/commit`)
    const staged = stagedNameOf(parts[0]!.url)
    expect(staged.startsWith(`kv-staging/a/${c.key}/${c.bytes.length}-`)).toBe(true)
    await store.putIfAbsent(staged, c.bytes, c.bytes.length)
    const done = await commit(app, 'a', uploadId)
    expect([done.status, done.json]).toEqual([201, { status: 'created', bytes: c.bytes.length }])
    expect(await store.head(staged)).toBeUndefined()
    const got = await store.get(`kv/a/${c.key.slice(0, 2)}/${c.key}`)
    expect(Buffer.from(await new Response(got!.body).arrayBuffer()).equals(Buffer.from(c.bytes))).toBe(true)
    // Stored now: a new open answers "exists" and moves nothing.
    const again = await open(app, 'a', { key: c.key, bytes: c.bytes.length })
    expect(again.json).toEqual({ mode: 'exists', bytes: c.bytes.length })
  })

  it('refuses a commit after the expiry and deletes what was staged', async () => {
    const { store, app } = setup()
    const c = makeChunk({ sectionBytes: 4096 })
    const r = await open(app, 'a', { key: c.key, bytes: c.bytes.length })
    const { uploadId, parts } = r.json as { uploadId: string; parts: { url: string }[] }
    const staged = stagedNameOf(parts[0]!.url)
    await store.putIfAbsent(staged, c.bytes, c.bytes.length)
    vi.useFakeTimers({ toFake: ['Date'] })
    vi.setSystemTime(Date.now() + 61_000)
    const late = await commit(app, 'a', uploadId)
    expect([late.status, late.code]).toEqual([410, 'ERR_UPLOAD_EXPIRED'])
    expect(await store.head(staged)).toBeUndefined()
    expect(await store.head(`kv/a/${c.key.slice(0, 2)}/${c.key}`)).toBeUndefined()
  })

  it('refuses corrupt staged bytes: nothing visible, the staged object removed', async () => {
    const { store, app } = setup()
    const c = makeChunk({ sectionBytes: 4096 })
    const r = await open(app, 'a', { key: c.key, bytes: c.bytes.length })
    const { uploadId, parts } = r.json as { uploadId: string; parts: { url: string }[] }
    const bad = c.bytes.slice()
    bad[bad.length - 10]! ^= 0x40
    await store.putIfAbsent(stagedNameOf(parts[0]!.url), bad, bad.length)
    const res = await commit(app, 'a', uploadId)
    expect([res.status, res.code]).toEqual([400, 'ERR_FORMAT_CHECKSUM'])
    expect(await store.head(`kv/a/${c.key.slice(0, 2)}/${c.key}`)).toBeUndefined()
    expect(await store.head(stagedNameOf(parts[0]!.url))).toBeUndefined()
  })

  it("binds a ticket to its namespace: another namespace's token finds nothing to commit", async () => {
    const { store, app } = setup()
    const c = makeChunk({ sectionBytes: 4096 })
    const r = await open(app, 'a', { key: c.key, bytes: c.bytes.length })
    const { uploadId, parts } = r.json as { uploadId: string; parts: { url: string }[] }
    await store.putIfAbsent(stagedNameOf(parts[0]!.url), c.bytes, c.bytes.length)
    expect((await commit(app, 'a', uploadId, 'tok-b')).status).toBe(403)
    const moved = await commit(app, 'b', uploadId, 'tok-b')
    expect([moved.status, moved.code]).toEqual([404, 'ERR_NOT_FOUND'])
    expect(await store.head(`kv/b/${c.key.slice(0, 2)}/${c.key}`)).toBeUndefined()
    expect((await commit(app, 'a', uploadId)).status).toBe(201)
  })

  it('refuses malformed and edited tickets', async () => {
    const { store, app } = setup()
    const c = makeChunk({ sectionBytes: 4096 })
    const r = await open(app, 'a', { key: c.key, bytes: c.bytes.length })
    const { uploadId, parts } = r.json as { uploadId: string; parts: { url: string }[] }
    await store.putIfAbsent(stagedNameOf(parts[0]!.url), c.bytes, c.bytes.length)
    const t = JSON.parse(Buffer.from(uploadId, 'base64url').toString())
    const edit = (patch: object) => Buffer.from(JSON.stringify({ ...t, ...patch })).toString('base64url')
    for (const [id, status] of [
      ['%%%', 400],
      [Buffer.from('[]').toString('base64url'), 400],
      [edit({ n: 'not-hex' }), 400],
      [edit({ k: 'zz' }), 400],
      [edit({ e: t.e + 60 }), 404],
      [edit({ k: makeChunk().key }), 404],
    ] as const) {
      expect((await commit(app, 'a', id)).status, id).toBe(status)
    }
    // The genuine ticket still works after all of that.
    expect((await commit(app, 'a', uploadId)).status).toBe(201)
  })
})

describe('a commit is a PUT to the rest of the gateway', () => {
  const setup = (grants = true) => {
    const store = new StagingMemoryStore()
    const app = createGateway({
      store,
      prefix: 'kv',
      ...(grants ? { auth: { tokens: GRANTS } } : {}),
      uploads: { minBytes: 1024, expiresSeconds: 60 },
      coldTier: { accountingRefreshMs: 0 },
    })
    return { store, app }
  }
  const stageAndCommit = async (app: App, store: StagingMemoryStore, ns: string, c: TestChunk) => {
    const r = await open(app, ns, { key: c.key, bytes: c.bytes.length })
    expect(r.json.mode).toBe('presigned')
    const { uploadId, parts } = r.json as { uploadId: string; parts: { url: string }[] }
    await store.putIfAbsent(stagedNameOf(parts[0]!.url), c.bytes, c.bytes.length)
    return commit(app, ns, uploadId)
  }

  it('counts a committed chunk in the accounting and records its parent link for gc', async () => {
    const { store, app } = setup(false)
    // A first chunk whose header parent is the namespace seed, as real chains have.
    const root = makeChunk({ sectionBytes: 4096, parent: 'ab'.repeat(32), index: 0 })
    const child = makeChunk({ sectionBytes: 4096, parent: root.key, index: 1 })
    expect((await stageAndCommit(app, store, 'a', root)).status).toBe(201)
    expect((await stageAndCommit(app, store, 'a', child)).status).toBe(201)
    const text = await (await app.request('/metrics')).text()
    expect(text).toMatch(/^kvgate_namespace_stored_objects\{ns="a"\} 2$/m)
    expect(text).toContain(
      `kvgate_namespace_stored_bytes{ns="a"} ${root!.bytes.length + child!.bytes.length}`,
    )
    await app.state.usage!.flush()
    const links = []
    for (const e of (await store.list(usagePrefix('kv', 'a'))).entries) {
      const obj = await store.get(e.name)
      links.push(...decodeBatch(new Uint8Array(await new Response(obj!.body).arrayBuffer())).links)
    }
    expect(links.find((l) => l.key === child!.key)?.parent).toBe(root!.key)
    // The first chunk's link names ROOT_PARENT, not the seed: gc tells it from a hole without a read.
    expect(links.find((l) => l.key === root!.key)?.parent).toBe(ROOT_PARENT)
  })

  it('a namespace named by its 32-hex id commits only chunks carrying that id, like PUT', async () => {
    const { store, app } = setup(false)
    const ns = 'ab'.repeat(16)
    const foreign = makeChunk({ sectionBytes: 4096, namespaceId: 'cd'.repeat(16) })
    const res = await stageAndCommit(app, store, ns, foreign)
    expect([res.status, res.code]).toEqual([400, 'ERR_FORMAT_BAD_FIELD'])
    expect(await store.head(`kv/${ns}/${foreign.key.slice(0, 2)}/${foreign.key}`)).toBeUndefined()
    const mine = makeChunk({ sectionBytes: 4096, namespaceId: ns })
    expect((await stageAndCommit(app, store, ns, mine)).status).toBe(201)
  })

  it('a commit counts against the bytes in flight, as a PUT does: past the bound, 503 ERR_BUSY', async () => {
    const store = new StagingMemoryStore()
    const app = createGateway({
      store,
      prefix: 'kv',
      uploads: { minBytes: 1024, expiresSeconds: 60 },
      limits: { maxInFlightBytes: 64 * 1024 },
    })
    const c = makeChunk({ sectionBytes: 4096 })
    const r = await open(app, 'a', { key: c.key, bytes: c.bytes.length })
    const { uploadId, parts } = r.json as { uploadId: string; parts: { url: string }[] }
    await store.putIfAbsent(stagedNameOf(parts[0]!.url), c.bytes, c.bytes.length)
    app.state.inFlight.bytes = 60 * 1024 // PUTs being received now
    const busy = await commit(app, 'a', uploadId)
    expect([busy.status, busy.code]).toEqual([503, 'ERR_BUSY'])
    expect(app.state.inFlight.bytes).toBe(60 * 1024)
    // The staged object stays for a retry (a busy answer is not a failed upload).
    expect(await store.head(stagedNameOf(parts[0]!.url))).toBeDefined()
    app.state.inFlight.bytes = 0
    expect((await commit(app, 'a', uploadId)).status).toBe(201)
    expect(app.state.inFlight.bytes).toBe(0)
  })

  it('a commit reserves its read-ahead in the memory bound: past it 503 ERR_BUSY, the staged object kept', async () => {
    const store = new StagingMemoryStore()
    const app = createGateway({
      store,
      prefix: 'kv',
      uploads: { minBytes: 1024, expiresSeconds: 60 },
      limits: { maxHeldBytes: 8 * 1024 * 1024, maxCalibrationBytes: 1024, maxChunkBytes: 1024 * 1024 },
    })
    const c = makeChunk({ sectionBytes: 4096 })
    const r = await open(app, 'a', { key: c.key, bytes: c.bytes.length })
    const { uploadId, parts } = r.json as { uploadId: string; parts: { url: string }[] }
    await store.putIfAbsent(stagedNameOf(parts[0]!.url), c.bytes, c.bytes.length)
    // Other requests hold all but less than this commit's body.
    const others = app.state.memory.tryReserve(app.state.limits.maxHeldBytes - c.bytes.length + 1)!
    const busy = await commit(app, 'a', uploadId)
    expect([busy.status, busy.code]).toEqual([503, 'ERR_BUSY'])
    expect(await store.head(stagedNameOf(parts[0]!.url))).toBeDefined()
    others.release()
    expect(app.state.memory.held).toBe(0)
    expect((await commit(app, 'a', uploadId)).status).toBe(201)
    expect(app.state.memory.held).toBe(0)
    // A commit that fails (its staged bytes are another chunk's) gives its reservation back too.
    const other = makeChunk({ sectionBytes: 4096 })
    const bad = makeChunk({ sectionBytes: 4096 })
    const o2 = await open(app, 'a', { key: other.key, bytes: bad.bytes.length })
    const t2 = o2.json as { uploadId: string; parts: { url: string }[] }
    await store.putIfAbsent(stagedNameOf(t2.parts[0]!.url), bad.bytes, bad.bytes.length)
    expect((await commit(app, 'a', t2.uploadId)).status).toBe(400)
    expect(app.state.memory.held).toBe(0)
  })

  it('never answers "exists" from a cached presence: a chunk deleted behind the gateway is uploaded again', async () => {
    const { store, app } = setup()
    const c = makeChunk({ sectionBytes: 4096 })
    expect((await stageAndCommit(app, store, 'a', c)).status).toBe(201)
    const final = `kv/a/${c.key.slice(0, 2)}/${c.key}`
    // gc (or another instance healing a corrupt object) deletes it; this instance still caches it.
    expect(await store.delete(final)).toBe(true)
    const res = await stageAndCommit(app, store, 'a', c)
    expect([res.status, res.json]).toEqual([201, { status: 'created', bytes: c.bytes.length }])
    expect((await store.head(final))?.size).toBe(c.bytes.length)
  })
})

describe('the remote tier', () => {
  it('an upload commit holds none of the connections lookups and GETs use', async () => {
    // A store that presigns into a local HTTP "bucket" and whose read of a staged
    // object (the commit's verification) waits until released.
    let release!: () => void
    const hold = new Promise<void>((r) => {
      release = r
    })
    let committing!: () => void
    const commitStarted = new Promise<void>((r) => {
      committing = r
    })
    let bucketUrl = ''
    class SlowStagingStore extends MemoryStore {
      async presignUpload(name: string, size: number): Promise<UploadTargets> {
        return { parts: [{ url: `${bucketUrl}/${encodeURIComponent(name)}`, offset: 0, length: size }] }
      }
      override async get(name: string, o?: Parameters<MemoryStore['get']>[1]) {
        if (name.includes('-staging/')) {
          committing()
          await hold
        }
        return super.get(name, o)
      }
    }
    const store = new SlowStagingStore()
    const bucket = createServer((req, res) => {
      const parts: Buffer[] = []
      req.on('data', (b: Buffer) => parts.push(b))
      req.on('end', () => {
        const bytes = new Uint8Array(Buffer.concat(parts))
        const name = decodeURIComponent(req.url!.slice(1))
        void store.putIfAbsent(name, bytes, bytes.length).then(() => res.end())
      })
    })
    await new Promise<void>((r) => bucket.listen(0, '127.0.0.1', r))
    bucketUrl = `http://127.0.0.1:${(bucket.address() as AddressInfo).port}`
    const gw = await serveGateway(createGateway({ store, uploads: { minBytes: 1024 } }), { port: 0 })
    const tier = new RemoteTier({
      url: gw.url,
      namespace: 'a',
      connections: 1,
      lookupTimeoutMs: 5000,
      uploadMinBytes: 1024,
    })
    try {
      const stored = makeChunk()
      const name = `kvgate/a/${stored.key.slice(0, 2)}/${stored.key}`
      await store.putIfAbsent(name, stored.bytes, stored.bytes.length)
      const big = makeChunk({ sectionBytes: 4096 })
      const order: string[] = []
      const put = tier.put(big.key, big.bytes).then((ok) => {
        order.push('commit')
        return ok
      })
      await commitStarted
      // Undici does not end a request queued behind a busy connection at its deadline: were the
      // commit on the lookup's connection, the lookup would wait for it. Released after a while
      // either way, so a failure shows as the wrong order, not a hang.
      const safety = setTimeout(release, 8000)
      const found = await tier.lookup([stored.key])
      order.push('lookup')
      release()
      clearTimeout(safety)
      expect(await put).toBe(true)
      expect(order).toEqual(['lookup', 'commit'])
      expect(found).toEqual({ present: 1 })
      expect((await store.head(`kvgate/a/${big.key.slice(0, 2)}/${big.key}`))?.size).toBe(big.bytes.length)
    } finally {
      release()
      await tier.close()
      await gw.close()
      await new Promise((r) => bucket.close(r))
    }
  })

  it('an upload lost at the store (a part PUT refused) is counted, not silent', async () => {
    // A bucket that refuses every part: the gateway's own requests all succeed.
    const bucket = createServer((req, res) => {
      req.resume()
      req.on('end', () => res.writeHead(403).end('AccessDenied'))
    })
    await new Promise<void>((r) => bucket.listen(0, '127.0.0.1', r))
    const bucketUrl = `http://127.0.0.1:${(bucket.address() as AddressInfo).port}`
    class RefusedStagingStore extends MemoryStore {
      async presignUpload(name: string, size: number): Promise<UploadTargets> {
        return { parts: [{ url: `${bucketUrl}/${encodeURIComponent(name)}`, offset: 0, length: size }] }
      }
    }
    const gw = await serveGateway(
      createGateway({ store: new RefusedStagingStore(), uploads: { minBytes: 1024 } }),
      {
        port: 0,
      },
    )
    const tier = new RemoteTier({ url: gw.url, namespace: 'a', uploadMinBytes: 1024, retries: 0 })
    try {
      const big = makeChunk({ sectionBytes: 4096 })
      expect(await tier.put(big.key, big.bytes)).toBe(false)
      expect(tier.counters.errors).toBe(1)
      expect(tier.counters.puts).toBe(0)
      expect(tier.knownPresent(big.key)).toBe(false)
    } finally {
      await tier.close()
      await gw.close()
      await new Promise((r) => bucket.close(r))
    }
  })

  it('asks a gateway that answers "direct" once, then PUTs large chunks without asking', async () => {
    const seen: string[] = []
    const app = createGateway({
      store: new MemoryStore(),
      uploads: {},
      logger: (e) => seen.push(`${e.method} ${String(e.path).replace(/[0-9a-f]{64}/, 'KEY')}`),
    })
    const gw = await serveGateway(app, { port: 0 })
    const tier = new RemoteTier({ url: gw.url, namespace: 'a' })
    try {
      const small = makeChunk()
      const big = [makeChunk({ sectionBytes: MIB / 2 }), makeChunk({ sectionBytes: MIB / 2 })]
      expect(await tier.put(small.key, small.bytes)).toBe(true)
      for (const c of big) expect(await tier.put(c.key, c.bytes)).toBe(true)
      expect(seen).toEqual([
        'PUT /v1/ns/a/chunks/KEY',
        'POST /v1/ns/a/uploads',
        'PUT /v1/ns/a/chunks/KEY',
        'PUT /v1/ns/a/chunks/KEY',
      ])
    } finally {
      await tier.close()
      await gw.close()
    }
  })
})

describe('an upload request body is bounded before it is read', () => {
  it('a body past 4 KiB that never ends is refused with 413, and its stream released', async () => {
    const app = createGateway({ store: new MemoryStore(), auth: { tokens: GRANTS }, uploads: {} })
    // Never closes: a gateway that reads to the end would hold it (and all it sent) forever.
    const r = await neverEndingUpload(app, `{"key": "${'0'.repeat(64)}", "pad": "${' '.repeat(8192)}`)
    expect(r).toEqual({ status: 413, code: 'ERR_PAYLOAD_TOO_LARGE', cancelled: true })
  })

  it('a body under 4 KiB that stalls fails with 408 after bodyIdleTimeoutMs, its stream released', async () => {
    const app = createGateway({
      store: new MemoryStore(),
      auth: { tokens: GRANTS },
      uploads: {},
      limits: { bodyIdleTimeoutMs: 200 },
    })
    // A slowloris: sends a little, then nothing (holding its socket until the request timeout).
    const r = await neverEndingUpload(app, `{"key": "${'0'.repeat(64)}", `)
    expect(r).toEqual({ status: 408, code: 'ERR_TIMEOUT', cancelled: true })
  })
})

describe('a commit that fails releases the staged read', () => {
  /** Stages like StagingMemoryStore; every staged read records whether it was released. */
  class WatchedStagingStore extends StagingMemoryStore {
    readonly reads: { cancelled: boolean; done: boolean }[] = []
    finalPut: 'fail' | 'exists' | undefined
    override async get(name: string, opts?: Parameters<MemoryStore['get']>[1]) {
      const obj = await super.get(name, opts)
      if (!obj || !name.includes('-staging/')) return obj
      const seen = { cancelled: false, done: false }
      this.reads.push(seen)
      const reader = obj.body.getReader()
      // One piece at a time, like a socket: the rest stays with the store until pulled.
      const body = new ReadableStream<Uint8Array>(
        {
          async pull(c) {
            const r = await reader.read()
            if (r.done) {
              seen.done = true
              c.close()
            } else for (let o = 0; o < r.value.length; o += 4096) c.enqueue(r.value.subarray(o, o + 4096))
          },
          cancel(reason) {
            seen.cancelled = true
            return reader.cancel(reason)
          },
        },
        { highWaterMark: 0 },
      )
      return { ...obj, body }
    }
    override async putIfAbsent(name: string, body: ReadableStream<Uint8Array> | Uint8Array, size: number) {
      if (name.includes('-staging/') || this.finalPut === undefined)
        return super.putIfAbsent(name, body, size)
      // The store gives up before it reads the body (S3: an early 412 or a reset socket; the SDK
      // only releases its hold on the stream); the body is left to the gateway.
      if (this.finalPut === 'exists') return 'exists'
      throw Object.assign(new Error('connection reset'), { code: 'ECONNRESET' })
    }
  }

  for (const outcome of ['fail', 'exists'] as const) {
    it(`the store ${outcome === 'fail' ? 'fails' : 'answers "exists"'} without reading the body: the staged read is cancelled`, async () => {
      const store = new WatchedStagingStore()
      const app = createGateway({
        store,
        prefix: 'kv',
        auth: { tokens: GRANTS },
        uploads: { minBytes: 1024, expiresSeconds: 60 },
      })
      // Larger than the commit's read-ahead (4 MiB): the body is never read to its end by itself.
      const c = makeChunk({ layers: 4, sectionBytes: MIB })
      const r = await open(app, 'a', { key: c.key, bytes: c.bytes.length })
      const { uploadId, parts } = r.json as { uploadId: string; parts: { url: string }[] }
      await store.putIfAbsent(stagedNameOf(parts[0]!.url), c.bytes, c.bytes.length)
      store.finalPut = outcome
      const res = await commit(app, 'a', uploadId)
      expect(res.status).toBe(outcome === 'fail' ? 500 : 200)
      await new Promise((r) => setTimeout(r, 100))
      expect(store.reads).toHaveLength(1)
      expect(store.reads[0]).toEqual({ cancelled: true, done: false })
    })
  }
})
