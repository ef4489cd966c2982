// The AWS Lambda deployment, locally: the zip from scripts/build-lambda.ts is built
// (reproducibly), its index.mjs is loaded with a stand-in for the Node.js runtime's
// response streaming, and fed function URL events (payload 2.0) against an fs store.

import { createHash, randomBytes } from 'node:crypto'
import { once } from 'node:events'
import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import { createServer } from 'node:http'
import type { AddressInfo } from 'node:net'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { pathToFileURL } from 'node:url'
import { inflateRawSync } from 'node:zlib'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { buildLambda, type LambdaBuild } from '../scripts/build-lambda.ts'
import { runSmoke } from '../src/cli/commands/smoke.ts'
import { decodeHeader, layerSpan } from '../src/core/format.ts'
import {
  type AwsLambdaGlobal,
  bufferedHandler,
  cachedApp,
  configFromEnv,
  eventToRequest,
  type FetchApp,
  type FunctionUrlEvent,
  gatewayFromConfig,
  parseTokens,
  streamingHandler,
} from '../src/gateway/adapters/lambda.ts'
import { createGateway } from '../src/gateway/app.ts'
import { MemoryStore } from '../src/gateway/stores/memory.ts'
import { makeChain, makeChunk } from './gateway-fixtures.ts'
import {
  fakeAwsLambda,
  functionUrlServer,
  type Invocation,
  invoke,
  type StreamingFn,
} from './lambda-support.ts'

const MIB = 1024 * 1024

function event(
  method: string,
  path: string,
  opts: { query?: string; headers?: Record<string, string>; body?: Uint8Array | string } = {},
): FunctionUrlEvent {
  const binary = opts.body instanceof Uint8Array
  return {
    version: '2.0',
    rawPath: path,
    rawQueryString: opts.query ?? '',
    headers: { host: 'abc123.lambda-url.eu-west-1.on.aws', ...opts.headers },
    body:
      opts.body === undefined
        ? undefined
        : binary
          ? Buffer.from(opts.body as Uint8Array).toString('base64')
          : (opts.body as string),
    isBase64Encoded: binary,
    requestContext: {
      domainName: 'abc123.lambda-url.eu-west-1.on.aws',
      http: { method, sourceIp: '10.0.0.1' },
    },
  }
}

function putEvent(ns: string, key: string, bytes: Uint8Array, token: string) {
  return event('PUT', `/v1/ns/${ns}/chunks/${key}`, {
    headers: {
      authorization: `Bearer ${token}`,
      'content-type': 'application/octet-stream',
      'content-length': String(bytes.length),
    },
    body: bytes,
  })
}

// ---------------------------------------------------------------- zip reader

/** Reads a zip's central directory (what `unzip` trusts) and inflates every entry. */
function readZip(zip: Buffer) {
  const eocd = zip.lastIndexOf(Buffer.from([0x50, 0x4b, 0x05, 0x06]))
  const count = zip.readUInt16LE(eocd + 10)
  let p = zip.readUInt32LE(eocd + 16)
  const entries: { name: string; data: Buffer; method: number; date: number; time: number; mode: number }[] =
    []
  for (let i = 0; i < count; i++) {
    expect(zip.readUInt32LE(p)).toBe(0x02014b50)
    const method = zip.readUInt16LE(p + 10)
    const time = zip.readUInt16LE(p + 12)
    const date = zip.readUInt16LE(p + 14)
    const csize = zip.readUInt32LE(p + 20)
    const nameLen = zip.readUInt16LE(p + 28)
    const extraLen = zip.readUInt16LE(p + 30)
    const commentLen = zip.readUInt16LE(p + 32)
    const mode = zip.readUInt32LE(p + 38) >>> 16
    const local = zip.readUInt32LE(p + 42)
    const name = zip.subarray(p + 46, p + 46 + nameLen).toString('utf8')
    const dataAt = local + 30 + zip.readUInt16LE(local + 26) + zip.readUInt16LE(local + 28)
    const raw = zip.subarray(dataAt, dataAt + csize)
    entries.push({ name, data: method === 8 ? inflateRawSync(raw) : raw, method, date, time, mode })
    p += 46 + nameLen + extraLen + commentLen
  }
  return entries
}

// ---------------------------------------------------------------- the built zip

const token = () => randomBytes(24).toString('base64url')
const sha256 = (s: string) => createHash('sha256').update(s).digest('hex')
const TOKENS = { writer: token(), reader: token(), other: token() }
const GRANTS = [
  { name: 'writer', sha256: sha256(TOKENS.writer), scopes: 'write', namespaces: ['a', 'smoke'] },
  { name: 'reader', sha256: sha256(TOKENS.reader), scopes: 'read', namespaces: ['a'] },
  { name: 'other', sha256: sha256(TOKENS.other), scopes: 'write', namespaces: ['b'] },
]

let work: string
let build: LambdaBuild
let bundled: StreamingFn
const savedEnv = { ...process.env }

beforeAll(async () => {
  work = mkdtempSync(join(tmpdir(), 'kvgate-lambda-'))
  build = await buildLambda({ out: join(work, 'a', 'kvgate-gateway.zip') })
  // Unpack the zip the way Lambda does (into /var/task) and load its handler.
  const task = join(work, 'task')
  mkdirSync(task)
  for (const e of readZip(readFileSync(build.zip))) writeFileSync(join(task, e.name), e.data)
  Object.assign(process.env, {
    KVGATE_FS_ROOT: join(work, 'objects'),
    KVGATE_TOKENS: JSON.stringify(GRANTS),
    KVGATE_S3_PREFIX: 'kv',
    KVGATE_MAX_CHUNK_BYTES: String(4 * MIB),
  })
  ;(globalThis as { awslambda?: AwsLambdaGlobal }).awslambda = fakeAwsLambda
  const mod = (await import(pathToFileURL(join(task, 'index.mjs')).href)) as { handler: StreamingFn }
  bundled = mod.handler
})

afterAll(() => {
  delete (globalThis as { awslambda?: unknown }).awslambda
  for (const k of Object.keys(process.env)) if (!(k in savedEnv)) delete process.env[k]
  if (work) rmSync(work, { recursive: true, force: true })
})

describe('the Lambda zip', () => {
  it('is reproducible, small, and holds index.mjs + the codec wasm with fixed metadata', async () => {
    const again = await buildLambda({ out: join(work, 'b', 'kvgate-gateway.zip') })
    expect(again.sha256).toBe(build.sha256)
    console.log(
      `lambda zip: ${(build.bytes / 1024).toFixed(1)} KiB (${build.entries.map((e) => e.name).join(', ')})`,
    )
    // Direct uploads are capped at 50 MB; a cold start loads all of index.mjs.
    expect(build.bytes).toBeLessThan(5 * MIB)
    const entries = readZip(readFileSync(build.zip))
    expect(entries.map((e) => e.name)).toEqual(['index.mjs', 'kvgate_codec.wasm'])
    for (const e of entries) {
      expect(e.date).toBe(0x21) // 1980-01-01
      expect(e.time).toBe(0)
      expect(e.mode).toBe(0o100644)
    }
    expect(
      entries[1]!.data.equals(readFileSync(join(import.meta.dirname, '..', 'wasm', 'kvgate_codec.wasm'))),
    ).toBe(true)
    expect((bundled as { streamified?: boolean }).streamified).toBe(true)
  })

  it('PUT (base64 event body), then conditional re-PUT answers exists', async () => {
    const c = makeChunk({ sectionBytes: 4096 })
    const r1 = await invoke(bundled, putEvent('a', c.key, c.bytes, TOKENS.writer))
    expect(r1.status).toBe(201)
    expect(JSON.parse(r1.body.toString())).toEqual({ status: 'created', bytes: c.bytes.length })
    const r2 = await invoke(bundled, putEvent('a', c.key, c.bytes, TOKENS.writer))
    expect(r2.status).toBe(200)
    expect(JSON.parse(r2.body.toString())).toEqual({ status: 'exists', bytes: c.bytes.length })
    // Stored under the prefix in the fs store, byte for byte.
    const stored = readFileSync(join(work, 'objects', 'kv', 'a', c.key.slice(0, 2), c.key))
    expect(stored.equals(Buffer.from(c.bytes))).toBe(true)
  })

  it('stores a calibration (hash-checked), serves it, and keeps the first current one', async () => {
    const calib = (seed: number) => {
      const b = new Uint8Array(256).fill(seed)
      b.set([0x4b, 0x56, 0x43, 0x4c, 1, 0])
      return b
    }
    const put = (b: Uint8Array, hash = createHash('sha256').update(b).digest('hex')) =>
      invoke(
        bundled,
        event('PUT', `/v1/ns/a/calibrations/${hash}`, {
          headers: {
            authorization: `Bearer ${TOKENS.writer}`,
            'content-type': 'application/octet-stream',
            'content-length': String(b.length),
          },
          body: b,
        }),
      )
    const current = (hash: string) =>
      invoke(
        bundled,
        event('PUT', '/v1/ns/a/calibration', {
          headers: { authorization: `Bearer ${TOKENS.writer}`, 'content-type': 'application/json' },
          body: JSON.stringify({ hash }),
        }),
      )
    const [x, y] = [calib(1), calib(2)]
    const hx = createHash('sha256').update(x).digest('hex')
    const hy = createHash('sha256').update(y).digest('hex')
    expect((await put(x)).status).toBe(201)
    expect((await put(y)).status).toBe(201)
    expect((await put(x, hy)).status).toBe(400)
    const got = await invoke(
      bundled,
      event('GET', `/v1/ns/a/calibrations/${hx}`, { headers: { authorization: `Bearer ${TOKENS.reader}` } }),
    )
    expect(got.status).toBe(200)
    expect(new Uint8Array(got.body)).toEqual(x)
    expect((await current(hx)).status).toBe(201)
    const lost = await current(hy)
    expect([lost.status, JSON.parse(lost.body.toString()).hash]).toEqual([200, hx])
    expect(readFileSync(join(work, 'objects', 'kv', '_calibration', 'a', hx)).equals(Buffer.from(x))).toBe(
      true,
    )
  })

  it('streams GETs (whole, Range, ?layers) with the right headers', async () => {
    const c = makeChunk({ layers: 5, sectionBytes: 300_000 })
    await invoke(bundled, putEvent('a', c.key, c.bytes, TOKENS.writer))
    const auth = { authorization: `Bearer ${TOKENS.reader}` }
    const whole = await invoke(bundled, event('GET', `/v1/ns/a/chunks/${c.key}`, { headers: auth }))
    expect(whole.status).toBe(200)
    expect(whole.headers['content-length']).toBe(String(c.bytes.length))
    expect(whole.body.equals(Buffer.from(c.bytes))).toBe(true)
    const ranged = await invoke(
      bundled,
      event('GET', `/v1/ns/a/chunks/${c.key}`, { headers: { ...auth, range: 'bytes=1000-1999' } }),
    )
    expect(ranged.status).toBe(206)
    expect(ranged.headers['content-range']).toBe(`bytes 1000-1999/${c.bytes.length}`)
    expect(ranged.body.equals(Buffer.from(c.bytes.subarray(1000, 2000)))).toBe(true)
    const h = decodeHeader(c.bytes)
    const span = layerSpan(h, 1, 3)
    const layers = await invoke(
      bundled,
      event('GET', `/v1/ns/a/chunks/${c.key}`, { query: 'layers=1-3', headers: auth }),
    )
    expect(layers.status).toBe(200)
    expect(layers.headers['x-kvgate-layers']).toBe('1-3')
    const expected = Buffer.concat([
      c.bytes.subarray(0, h.headerBytes),
      c.bytes.subarray(span.start, span.end),
    ])
    expect(layers.body.equals(expected)).toBe(true)
    const head = await invoke(bundled, event('HEAD', `/v1/ns/a/chunks/${c.key}`, { headers: auth }))
    expect(head.status).toBe(200)
    expect(head.body.length).toBe(0)
  })

  it('HTTP edges as on Node: HEAD ?layers= length, 416 Content-Range, the same ETag, 304 and If-Range', async () => {
    const c = makeChunk({ layers: 5, sectionBytes: 3000 })
    await invoke(bundled, putEvent('a', c.key, c.bytes, TOKENS.writer))
    const auth = { authorization: `Bearer ${TOKENS.reader}` }
    const path = `/v1/ns/a/chunks/${c.key}`
    const node = createGateway({ store: new MemoryStore() })
    await node.request(path, {
      method: 'PUT',
      headers: { 'content-type': 'application/octet-stream', 'content-length': String(c.bytes.length) },
      body: c.bytes as Uint8Array<ArrayBuffer>,
    })
    const nodeTag = (await node.request(path, { method: 'HEAD' })).headers.get('etag')!
    const nodeLayersTag = (await node.request(`${path}?layers=1-3`)).headers.get('etag')
    const head = await invoke(bundled, event('HEAD', path, { query: 'layers=1-3', headers: auth }))
    const layers = await invoke(bundled, event('GET', path, { query: 'layers=1-3', headers: auth }))
    expect([head.status, head.headers['content-length']]).toEqual([200, String(layers.body.length)])
    expect([head.headers.etag, layers.headers.etag]).toEqual([nodeLayersTag, nodeLayersTag])
    const past = await invoke(
      bundled,
      event('GET', path, { headers: { ...auth, range: `bytes=${c.bytes.length}-` } }),
    )
    expect([past.status, past.headers['content-range']]).toEqual([416, `bytes */${c.bytes.length}`])
    const whole = await invoke(bundled, event('GET', path, { headers: auth }))
    expect(whole.headers.etag).toBe(nodeTag)
    for (const method of ['GET', 'HEAD']) {
      const r = await invoke(bundled, event(method, path, { headers: { ...auth, 'if-none-match': nodeTag } }))
      expect([method, r.status, r.headers.etag, r.body.length]).toEqual([method, 304, nodeTag, 0])
    }
    const kept = await invoke(
      bundled,
      event('GET', path, { headers: { ...auth, range: 'bytes=0-99', 'if-range': nodeTag } }),
    )
    expect([kept.status, kept.body.length]).toEqual([206, 100])
    const other = await invoke(
      bundled,
      event('GET', path, { headers: { ...auth, range: 'bytes=0-99', 'if-range': '"other"' } }),
    )
    expect(other.status).toBe(200)
    expect(other.body.equals(Buffer.from(c.bytes))).toBe(true)
  })

  it('looks up a chain', async () => {
    const chain = makeChain(5)
    for (const c of chain.slice(0, 3)) await invoke(bundled, putEvent('a', c.key, c.bytes, TOKENS.writer))
    const r = await invoke(
      bundled,
      event('POST', '/v1/ns/a/lookup', {
        headers: { authorization: `Bearer ${TOKENS.reader}`, 'content-type': 'application/json' },
        body: JSON.stringify({ keys: chain.map((c) => c.key), sizes: true }),
      }),
    )
    expect(r.status).toBe(200)
    expect(JSON.parse(r.body.toString())).toEqual({
      present: 3,
      sizes: chain.slice(0, 3).map((c) => c.bytes.length),
    })
  })

  it('answers auth failures, bad keys, oversized and corrupt bodies with JSON errors', async () => {
    const c = makeChunk()
    const code = (r: Invocation) => (JSON.parse(r.body.toString()) as { error: { code: string } }).error.code
    const noToken = await invoke(bundled, event('GET', `/v1/ns/a/chunks/${c.key}`))
    expect([noToken.status, code(noToken)]).toEqual([401, 'ERR_UNAUTHORIZED'])
    const otherNs = await invoke(bundled, putEvent('a', c.key, c.bytes, TOKENS.other))
    expect([otherNs.status, code(otherNs)]).toEqual([403, 'ERR_FORBIDDEN'])
    const badKey = await invoke(bundled, putEvent('a', 'not-hex', c.bytes, TOKENS.writer))
    expect([badKey.status, code(badKey)]).toEqual([400, 'ERR_INVALID_KEY'])
    const big = makeChunk({ layers: 2, sectionBytes: 3 * MIB })
    const tooBig = await invoke(bundled, putEvent('a', big.key, big.bytes, TOKENS.writer))
    expect([tooBig.status, code(tooBig)]).toEqual([413, 'ERR_PAYLOAD_TOO_LARGE'])
    const bad = c.bytes.slice()
    bad[bad.length - 1]! ^= 1
    const corrupt = await invoke(bundled, putEvent('a', c.key, bad, TOKENS.writer))
    expect([corrupt.status, code(corrupt)]).toEqual([400, 'ERR_FORMAT_CHECKSUM'])
  })
})

// ---------------------------------------------------------------- adapter pieces in-process

/** A memory store that can presign, like the S3 store. */
class PresigningMemoryStore extends MemoryStore {
  async presignGet(name: string, expiresInSeconds: number): Promise<string> {
    return `https://kv-bucket.s3.eu-west-1.amazonaws.com/${name}?X-Amz-Expires=${expiresInSeconds}&X-Amz-Signature=test`
  }
}

describe('lambda adapter', () => {
  const app = createGateway({
    store: new PresigningMemoryStore(),
    presign: { minBytes: 1 * MIB, expiresSeconds: 120 },
    prefix: 'kv',
  })
  const getApp = async (): Promise<FetchApp> => app
  const streaming = streamingHandler(getApp, fakeAwsLambda) as StreamingFn

  it('answers GETs above the presign threshold with 307 to the store, below it with bytes', async () => {
    const big = makeChunk({ layers: 2, sectionBytes: 600_000 })
    const small = makeChunk()
    for (const c of [big, small]) {
      const r = await invoke(streaming, putEvent('a', c.key, c.bytes, 'unused'))
      expect(r.status).toBe(201)
    }
    const redirected = await invoke(streaming, event('GET', `/v1/ns/a/chunks/${big.key}`))
    expect(redirected.status).toBe(307)
    expect(redirected.headers.location).toBe(
      `https://kv-bucket.s3.eu-west-1.amazonaws.com/kv/a/${big.key.slice(0, 2)}/${big.key}?X-Amz-Expires=120&X-Amz-Signature=test`,
    )
    expect(redirected.body.length).toBe(0)
    const direct = await invoke(streaming, event('GET', `/v1/ns/a/chunks/${small.key}`))
    expect(direct.status).toBe(200)
    expect(direct.body.equals(Buffer.from(small.bytes))).toBe(true)
  })

  it('cuts the stream (no appended text) when the body fails mid-way', async () => {
    const failing: FetchApp = {
      fetch: () =>
        new Response(
          new ReadableStream({
            start(c) {
              c.enqueue(new Uint8Array([1, 2, 3]))
              c.error(new Error('store connection lost'))
            },
          }),
          { status: 200, headers: { 'content-length': '1000' } },
        ),
    }
    const r = await invoke(
      streamingHandler(async () => failing, fakeAwsLambda) as StreamingFn,
      event('GET', '/x'),
    )
    expect(r.status).toBe(200)
    expect(r.destroyed).toBe(true)
    expect(r.body.length).toBeLessThanOrEqual(3)
  })

  it('a failed cold start answers a JSON error and is retried; a good start is kept', async () => {
    let attempts = 0
    const getApp = cachedApp(async () => {
      attempts++
      if (attempts === 1) throw new Error('SSM unreachable')
      return app
    })
    const handler = streamingHandler(getApp, fakeAwsLambda) as StreamingFn
    const failed = await invoke(handler, event('GET', '/healthz'))
    expect(failed.status).toBe(500)
    expect(JSON.parse(failed.body.toString()).error.code).toMatch(/^ERR_/)
    expect((await invoke(handler, event('GET', '/healthz'))).status).toBe(200)
    expect((await invoke(handler, event('GET', '/healthz'))).status).toBe(200)
    expect(attempts).toBe(2)
  })

  it('buffered mode returns a base64 body', async () => {
    const c = makeChunk()
    await invoke(streaming, putEvent('a', c.key, c.bytes, 'unused'))
    const res = await bufferedHandler(getApp)(event('GET', `/v1/ns/a/chunks/${c.key}`))
    expect(res.statusCode).toBe(200)
    expect(res.isBase64Encoded).toBe(true)
    expect(Buffer.from(res.body, 'base64').equals(Buffer.from(c.bytes))).toBe(true)
  })

  it('turns function URL events into Requests (query, cookies, base64 and text bodies)', async () => {
    const e = event('POST', '/v1/ns/a/lookup', { query: 'x=1&y=2', body: '{"keys":[]}' })
    e.cookies = ['a=1', 'b=2']
    const req = eventToRequest(e)
    expect(req.url).toBe('https://abc123.lambda-url.eu-west-1.on.aws/v1/ns/a/lookup?x=1&y=2')
    expect(req.method).toBe('POST')
    expect(req.headers.get('cookie')).toBe('a=1; b=2')
    expect(await req.text()).toBe('{"keys":[]}')
    const bin = eventToRequest(event('PUT', '/p', { body: new Uint8Array([0, 255, 7]) }))
    expect(new Uint8Array(await bin.arrayBuffer())).toEqual(new Uint8Array([0, 255, 7]))
    // A GET never carries a body, whatever the event says.
    expect(eventToRequest({ ...event('GET', '/p'), body: 'zzz' }).body).toBeNull()
  })

  it('reads the token table from an SSM SecureString at cold start (decrypted)', async () => {
    const grants = [{ name: 'fleet', sha256: sha256('ssm-token'), scopes: 'write', namespaces: ['a'] }]
    const seen: { target?: string; body?: unknown }[] = []
    const ssm = createServer(async (req, res) => {
      let body = ''
      for await (const c of req) body += c
      seen.push({ target: req.headers['x-amz-target'] as string, body: JSON.parse(body) })
      res.writeHead(200, { 'content-type': 'application/x-amz-json-1.1' })
      res.end(
        JSON.stringify({
          Parameter: { Name: '/kvgate/auth-tokens', Type: 'SecureString', Value: JSON.stringify(grants) },
        }),
      )
    })
    ssm.listen(0, '127.0.0.1')
    await once(ssm, 'listening')
    // The SDK's own service-endpoint override, the way one points it at a local stand-in.
    Object.assign(process.env, {
      AWS_ENDPOINT_URL_SSM: `http://127.0.0.1:${(ssm.address() as AddressInfo).port}`,
      AWS_ACCESS_KEY_ID: 'AKIDEXAMPLE',
      AWS_SECRET_ACCESS_KEY: 'secret',
    })
    try {
      const app = await gatewayFromConfig(
        configFromEnv({
          KVGATE_FS_ROOT: join(work, 'ssm-store'),
          KVGATE_AUTH_SSM_PARAMETER: '/kvgate/auth-tokens',
          AWS_REGION: 'eu-west-1',
        }),
      )
      expect(seen).toEqual([
        { target: 'AmazonSSM.GetParameter', body: { Name: '/kvgate/auth-tokens', WithDecryption: true } },
      ])
      const key = makeChunk().key
      const anon = await app.fetch(new Request(`https://x/v1/ns/a/chunks/${key}`, { method: 'HEAD' }))
      expect(anon.status).toBe(401)
      const authed = await app.fetch(
        new Request(`https://x/v1/ns/a/chunks/${key}`, {
          method: 'HEAD',
          headers: { authorization: 'Bearer ssm-token' },
        }),
      )
      expect(authed.status).toBe(404)
    } finally {
      ssm.close()
      for (const k of ['AWS_ENDPOINT_URL_SSM', 'AWS_ACCESS_KEY_ID', 'AWS_SECRET_ACCESS_KEY'])
        delete process.env[k]
    }
  })

  it('an unknown KVGATE_* variable, or KVGATE_AUTH outside its value, is an error naming it', () => {
    const env = { KVGATE_S3_BUCKET: 'b', KVGATE_AUTH: 'disabled' }
    expect(() => configFromEnv({ ...env, KVGATE_MAX_CHUNK_BYTE: '1024' })).toThrow(
      /unknown variable KVGATE_MAX_CHUNK_BYTE \(did you mean 'KVGATE_MAX_CHUNK_BYTES'\?\)/,
    )
    expect(() => configFromEnv({ ...env, KVGATE_PORT: '8787' })).toThrow(/unknown variable KVGATE_PORT/)
    expect(() => configFromEnv({ KVGATE_S3_BUCKET: 'b', KVGATE_AUTH: 'off' })).toThrow(
      /KVGATE_AUTH: expected 'disabled'/,
    )
    // Other variables (the runtime's, the SDK's) are not kvgate's to judge.
    expect(configFromEnv({ ...env, AWS_REGION: 'eu-west-1', PATH: '/bin' }).bucket).toBe('b')
  })

  it('a number out of the range the gateway takes fails the cold start naming the variable', () => {
    // These reached createGateway and failed there as "presign.expiresSeconds must be 1..604800"
    // or "invalid limits.maxChunkBytes": options the operator never wrote.
    const env = { KVGATE_S3_BUCKET: 'b', KVGATE_AUTH: 'disabled' }
    for (const [name, value] of [
      ['KVGATE_PRESIGN_TTL', '0'],
      ['KVGATE_PRESIGN_TTL', '604801'],
      ['KVGATE_UPLOAD_TTL', '0'],
      ['KVGATE_UPLOAD_TTL', '9999999'],
      ['KVGATE_MAX_CHUNK_BYTES', '0'],
      ['KVGATE_MAX_HELD_BYTES', '0'],
      ['KVGATE_READER_MIN_BYTES_PER_SECOND', '-1'],
      ['KVGATE_READER_MIN_BYTES_PER_SECOND', '2000000000'],
      ['KVGATE_READER_MIN_BYTES_PER_SECOND', 'fast'],
    ])
      expect(() => configFromEnv({ ...env, [name!]: value }), `${name}=${value}`).toThrow(
        new RegExp(`^${name} must be an integer in`),
      )
    expect(configFromEnv({ ...env, KVGATE_PRESIGN_TTL: '604800' }).presignTtlSeconds).toBe(604800)
    expect(configFromEnv(env).readerMinBytesPerSecond).toBe(64 * 1024)
    expect(configFromEnv({ ...env, KVGATE_READER_MIN_BYTES_PER_SECOND: '0' }).readerMinBytesPerSecond).toBe(0)
  })

  it('a name-like variable that begins or ends with whitespace is an error naming it', () => {
    // Pasted into a console or a tfvars file with a trailing space, it became a bucket or
    // parameter name that failed at the first request (or at an SSM call) with an unrelated error.
    const env = { KVGATE_S3_BUCKET: 'b', KVGATE_AUTH: 'disabled' }
    for (const [name, value] of [
      ['KVGATE_S3_BUCKET', 'b '],
      ['KVGATE_S3_ENDPOINT', ' http://127.0.0.1:7480'],
      ['KVGATE_S3_PREFIX', 'kv\n'],
      ['KVGATE_AUTH_SSM_PARAMETER', '/kvgate/tokens '],
      ['KVGATE_FS_ROOT', '/tmp/x '],
      ['KVGATE_STAGING_PREFIX', ' kv-staging'],
    ])
      expect(() => configFromEnv({ ...env, [name!]: value }), name).toThrow(
        `${name}: must not begin or end with whitespace`,
      )
    expect(configFromEnv({ ...env, KVGATE_MAX_CHUNK_BYTES: ' 1024 ' }).maxChunkBytes).toBe(1024)
  })

  it('validates its environment eagerly', () => {
    expect(() => configFromEnv({ KVGATE_AUTH_SSM_PARAMETER: '/p' })).toThrow(/KVGATE_S3_BUCKET/)
    expect(() => configFromEnv({ KVGATE_S3_BUCKET: 'b' })).toThrow(/auth is required/)
    expect(() =>
      configFromEnv({ KVGATE_S3_BUCKET: 'b', KVGATE_AUTH: 'disabled', KVGATE_PRESIGN_THRESHOLD: '-1' }),
    ).toThrow(/KVGATE_PRESIGN_THRESHOLD/)
    expect(() =>
      configFromEnv({ KVGATE_S3_BUCKET: 'b', KVGATE_AUTH: 'disabled', KVGATE_MAX_CHUNK_BYTES: '1e3x' }),
    ).toThrow(/KVGATE_MAX_CHUNK_BYTES/)
    // Decimal digits only, as the Workers vars and the Node settings: hex, exponents and
    // fractions would be taken silently (0x10 as 16 bytes, 0.5 as 0.5 seconds).
    for (const raw of ['0x10', '1e6', '4.5', '-0', 'Infinity'])
      expect(
        () => configFromEnv({ KVGATE_S3_BUCKET: 'b', KVGATE_AUTH: 'disabled', KVGATE_UPLOAD_TTL: raw }),
        raw,
      ).toThrow(/KVGATE_UPLOAD_TTL/)
    const cfg = configFromEnv({
      KVGATE_S3_BUCKET: 'b',
      KVGATE_S3_PREFIX: 'kv',
      KVGATE_AUTH_SSM_PARAMETER: '/kvgate/auth-tokens',
      AWS_REGION: 'eu-west-1',
    })
    expect(cfg).toMatchObject({ bucket: 'b', prefix: 'kv', region: 'eu-west-1', presignMinBytes: MIB })
    expect(() => parseTokens('not json', 'X')).toThrow(/not valid JSON/)
    expect(() => parseTokens('[]', 'X')).toThrow(/non-empty/)
    expect(() => parseTokens('{"sha256":"x"}', 'X')).toThrow(/non-empty JSON array/)
  })
})

// ---------------------------------------------------------------- the smoke command

describe('kvgate smoke against the Lambda handler (docs/deploy-aws.md)', () => {
  it('passes every step through the bundled handler', async () => {
    const { server, url } = await functionUrlServer(bundled)
    try {
      const report = await runSmoke({ url, token: TOKENS.writer, ns: 'smoke' })
      expect(report.steps.filter((s) => !s.ok)).toEqual([])
      expect(report.steps.map((s) => s.name)).toContain('auth required')
    } finally {
      server.close()
    }
  })

  it('follows presigned redirects for large chunks', async () => {
    // Redirect everything to a second local server that plays the S3 bucket.
    const store = new MemoryStore()
    const bucket = createServer(async (req, res) => {
      expect(req.headers.authorization).toBeUndefined() // the bearer token never reaches the store
      const name = decodeURIComponent(new URL(req.url ?? '/', 'http://x').pathname.slice(1))
      const range = /^bytes=(\d+)-(\d+)$/.exec(req.headers.range ?? '')
      const obj = await store.get(
        name,
        range ? { range: { offset: Number(range[1]), length: Number(range[2]) - Number(range[1]) + 1 } } : {},
      )
      if (!obj) return res.writeHead(404).end()
      res.writeHead(range ? 206 : 200, { 'content-length': String(obj.length) })
      res.end(Buffer.from(await new Response(obj.body).arrayBuffer()))
    })
    bucket.listen(0, '127.0.0.1')
    await once(bucket, 'listening')
    const bucketUrl = `http://127.0.0.1:${(bucket.address() as AddressInfo).port}`
    class LocalPresign extends MemoryStore {
      override get = store.get.bind(store)
      override head = store.head.bind(store)
      override putIfAbsent = store.putIfAbsent.bind(store)
      async presignGet(name: string): Promise<string> {
        return `${bucketUrl}/${encodeURIComponent(name)}`
      }
    }
    const app = createGateway({ store: new LocalPresign(), presign: { minBytes: 0 }, prefix: 'kv' })
    const { server, url } = await functionUrlServer(
      streamingHandler(async () => app, fakeAwsLambda) as StreamingFn,
    )
    try {
      const report = await runSmoke({ url })
      expect(report.steps.filter((s) => !s.ok)).toEqual([])
      expect(report.steps.find((s) => s.name === 'get')?.detail).toMatch(/presigned/)
    } finally {
      server.close()
      bucket.close()
    }
  })
})
