// Large writes on the AWS path without AWS: the BUILT Lambda zip's handler on a real S3
// (Ceph RadosGW) hands out presigned staging targets, the client uploads straight to
// RGW, and the commit verifies and publishes create-only. Failure paths leave nothing.

import { createHash, randomBytes } from 'node:crypto'
import { mkdtempSync, rmSync } from 'node:fs'
import type { Server } from 'node:http'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { ListMultipartUploadsCommand, PutObjectCommand } from '@aws-sdk/client-s3'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { runSmoke } from '../src/cli/commands/smoke.ts'
import { RemoteTier } from '../src/client/tiers/remote.ts'
import { decodeHeader, encodeChunk } from '../src/core/format.ts'
import { configFromEnv, type FunctionUrlEvent, gatewayFromConfig } from '../src/gateway/adapters/lambda.ts'
import { S3Store } from '../src/gateway/stores/s3.ts'
import { makeChunk } from './gateway-fixtures.ts'
import { functionUrlServer, loadBuiltHandler, type StreamingFn } from './lambda-support.ts'
import { type Rgw, useRgw } from './support/rgw.ts'

const rgw: Rgw | undefined = await useRgw('uploads-s3 (RadosGW)')
const MIB = 1024 * 1024

const sha256 = (s: string) => createHash('sha256').update(s).digest('hex')
const token = () => randomBytes(24).toString('base64url')
const TOKENS = { a: token(), b: token(), admin: token() }
const GRANTS = [
  { name: 'a', sha256: sha256(TOKENS.a), scopes: 'write', namespaces: ['a'] },
  { name: 'b', sha256: sha256(TOKENS.b), scopes: 'write', namespaces: ['b'] },
  { name: 'ops', sha256: sha256(TOKENS.admin), scopes: 'admin', namespaces: '*' },
]
const PREFIX = `up-${randomBytes(4).toString('hex')}`
const STAGING = `${PREFIX}-staging`

interface Presigned {
  mode: 'presigned'
  uploadId: string
  expiresAt: string
  parts: { url: string; offset: number; length: number }[]
}

let work: string
let server: Server
let url: string
let s3: S3Store
const seen: string[] = []
const savedEnv = { ...process.env }

afterAll(async () => {
  server?.close()
  if (s3) {
    for (const p of [`${PREFIX}/`, `${STAGING}/`]) {
      for (const e of (await s3.list(p)).entries) await s3.delete(e.name)
    }
    await s3.close()
  }
  for (const k of Object.keys(process.env)) if (!(k in savedEnv)) delete process.env[k]
  if (work) rmSync(work, { recursive: true, force: true })
  await rgw?.stop()
})

const env = () => ({
  KVGATE_S3_BUCKET: rgw!.bucket,
  KVGATE_S3_ENDPOINT: rgw!.endpoint,
  AWS_REGION: rgw!.region,
  KVGATE_S3_PREFIX: PREFIX,
  KVGATE_TOKENS: JSON.stringify(GRANTS),
  // The SDK's default credential chain, as on Lambda (there: the execution role).
  AWS_ACCESS_KEY_ID: rgw!.accessKeyId,
  AWS_SECRET_ACCESS_KEY: rgw!.secretAccessKey,
})

async function open(ns: string, tok: string, key: string, bytes: number, base = url) {
  const res = await fetch(`${base}v1/ns/${ns}/uploads`, {
    method: 'POST',
    headers: { authorization: `Bearer ${tok}`, 'content-type': 'application/json' },
    body: JSON.stringify({ key, bytes }),
  })
  return { status: res.status, json: (await res.json()) as Record<string, unknown> }
}

async function openPresigned(ns: string, tok: string, key: string, bytes: number, base = url) {
  const r = await open(ns, tok, key, bytes, base)
  expect(r.status).toBe(200)
  expect(r.json.mode).toBe('presigned')
  return r.json as unknown as Presigned
}

async function upload(p: Presigned, bytes: Uint8Array, only?: number[]) {
  const statuses: number[] = []
  for (const [i, part] of p.parts.entries()) {
    if (only && !only.includes(i)) continue
    // No Authorization header: the URL carries the grant.
    const res = await fetch(part.url, {
      method: 'PUT',
      body: bytes.subarray(part.offset, part.offset + part.length) as Uint8Array<ArrayBuffer>,
    })
    await res.arrayBuffer()
    statuses.push(res.status)
  }
  return statuses
}

async function commit(ns: string, tok: string, uploadId: string, base = url) {
  const res = await fetch(`${base}v1/ns/${ns}/uploads/${uploadId}/commit`, {
    method: 'POST',
    headers: { authorization: `Bearer ${tok}` },
  })
  const json = (await res.json()) as { status?: string; bytes?: number; error?: { code: string } }
  return { status: res.status, json, code: json.error?.code }
}

const finalName = (ns: string, key: string) => `${PREFIX}/${ns}/${key.slice(0, 2)}/${key}`

/** The staged object's name, as docs/deploy-aws.md describes it. */
function stagedName(ns: string, uploadId: string): string {
  const t = JSON.parse(Buffer.from(uploadId, 'base64url').toString('utf8'))
  return `${STAGING}/${ns}/${t.k}/${t.b}-${t.e}-${t.n}`
}

async function stagingLeft(): Promise<{ objects: string[]; multipart: number }> {
  const objects = (await s3.list(`${STAGING}/`)).entries.map((e) => e.name)
  const mpu = await s3.client.send(
    new ListMultipartUploadsCommand({ Bucket: rgw!.bucket, Prefix: `${STAGING}/` }),
  )
  return { objects, multipart: mpu.Uploads?.length ?? 0 }
}

/** A chunk object under a chosen chain key (two writers' different encodings of one key). */
function chunkWithKey(key: string, layers: number, sectionBytes: number, fill: number): Uint8Array {
  const sections = Array.from({ length: layers }, () => new Uint8Array(sectionBytes).fill(fill))
  return encodeChunk(
    {
      codec: 'raw',
      codecVersion: 1,
      codecParams: new Uint8Array(0),
      geometry: { layers, kvHeads: 1, headDim: 64, dtype: 'fp16' },
      tokens: 1,
      chunkIndex: 0,
      partial: false,
      namespaceId: new Uint8Array(16),
      chainKey: Uint8Array.from(Buffer.from(key, 'hex')),
      parentKey: new Uint8Array(32),
    },
    sections,
  )
}

describe.skipIf(!rgw)('presigned uploads through the built Lambda zip on S3 (RadosGW)', () => {
  beforeAll(async () => {
    work = mkdtempSync(join(tmpdir(), 'kvgate-uploads-'))
    Object.assign(process.env, env())
    const bundled = await loadBuiltHandler(work)
    const recording: StreamingFn = (event: FunctionUrlEvent, stream, ctx) => {
      seen.push(`${event.requestContext.http.method} ${event.rawPath}`)
      return bundled(event, stream, ctx)
    }
    ;({ server, url } = await functionUrlServer(recording))
    s3 = new S3Store({
      bucket: rgw!.bucket,
      endpoint: rgw!.endpoint,
      region: rgw!.region,
      credentials: { accessKeyId: rgw!.accessKeyId, secretAccessKey: rgw!.secretAccessKey },
    })
  })

  it('kvgate smoke stores a full-size Llama-3.1-8B chunk (32 MiB) through one presigned PUT', async () => {
    const report = await runSmoke({
      url,
      token: TOKENS.admin,
      model: 'llama-3.1-8b',
      chunkTokens: 256,
      cleanup: true,
      timeoutMs: 120_000,
    })
    expect(report.steps.filter((s) => !s.ok)).toEqual([])
    expect(report.bytes).toBeGreaterThan(32 * MIB)
    expect(report.steps.find((s) => s.name === 'put')?.detail).toMatch(/presigned upload, 1 part/)
    expect(report.steps.find((s) => s.name === 'put again (create-only)')?.detail).toMatch(/200 exists/)
    expect(report.steps.find((s) => s.name === 'get')?.detail).toMatch(/presigned/)
    // The body never went through the function: no chunk PUT reached it.
    expect(seen.filter((s) => s.startsWith('PUT '))).toEqual([])
  })

  it('the kvgate client stores an 80 MiB chunk (Llama-3.1-70B size) in presigned parts and reads it back', async () => {
    const c = makeChunk({ layers: 80, sectionBytes: MIB })
    const tier = new RemoteTier({ url, token: TOKENS.a, namespace: 'a', timeoutMs: 120_000 })
    try {
      seen.length = 0
      expect(await tier.put(c.key, c.bytes)).toBe(true)
      expect(seen.filter((s) => !s.startsWith('POST /v1/ns/a/uploads'))).toEqual([])
      expect(seen.some((s) => s.endsWith('/commit'))).toBe(true)
      const back = await tier.get(c.key)
      expect(back && Buffer.from(back).equals(Buffer.from(c.bytes))).toBe(true)
      expect(tier.stats().redirects).toBe(1)
      // A second writer of the same key moves no bytes: the upload answers "exists".
      seen.length = 0
      expect(await tier.put(c.key, c.bytes)).toBe(true)
      expect(seen).toEqual(['POST /v1/ns/a/uploads'])
      expect(tier.stats().existed).toBe(1)
    } finally {
      await tier.close()
    }
    expect((await s3.head(finalName('a', c.key)))?.size).toBe(c.bytes.length)
    // 80 MiB > the 64 MiB multipart threshold: 16 MiB parts.
    const p = await open('a', TOKENS.a, makeChunk().key, c.bytes.length)
    expect((p.json as unknown as Presigned).parts.map((x) => x.length)).toEqual([
      16 * MIB,
      16 * MIB,
      16 * MIB,
      16 * MIB,
      c.bytes.length - 64 * MIB,
    ])
    // Opened but never uploaded: the commit refuses it and aborts the multipart upload.
    const left = await commit('a', TOKENS.a, (p.json as unknown as Presigned).uploadId)
    expect([left.status, left.code]).toEqual([400, 'ERR_FORMAT_TRUNCATED'])
  })

  it('refuses corrupt, truncated, oversized and wrong-key staged uploads at commit, leaving nothing', async () => {
    const size = { layers: 4, sectionBytes: MIB / 2 }
    // Corrupt: one flipped byte in the last section.
    const c = makeChunk(size)
    const p1 = await openPresigned('a', TOKENS.a, c.key, c.bytes.length)
    const bad = c.bytes.slice()
    bad[bad.length - 1]! ^= 1
    expect(await upload(p1, bad)).toEqual([200])
    const r1 = await commit('a', TOKENS.a, p1.uploadId)
    expect([r1.status, r1.code]).toEqual([400, 'ERR_FORMAT_CHECKSUM'])

    // Wrong key: a valid chunk of another key, staged under this key's upload.
    const other = makeChunk(size)
    const p2 = await openPresigned('a', TOKENS.a, c.key, c.bytes.length)
    expect(await upload(p2, other.bytes)).toEqual([200])
    const r2 = await commit('a', TOKENS.a, p2.uploadId)
    expect([r2.status, r2.code]).toEqual([400, 'ERR_INVALID_KEY'])

    // A body of another size than signed: S3 refuses it at upload (Content-Length is signed).
    const p3 = await openPresigned('a', TOKENS.a, c.key, c.bytes.length)
    const [short] = await upload(p3, c.bytes.subarray(0, c.bytes.length - 100))
    expect(short).toBe(403)
    // A store that took it anyway: the commit checks the staged size itself.
    for (const [body, code] of [
      [c.bytes.subarray(0, c.bytes.length - 100), 'ERR_FORMAT_TRUNCATED'],
      [Buffer.concat([c.bytes, Buffer.alloc(100)]), 'ERR_FORMAT_BAD_FIELD'],
    ] as const) {
      const p = await openPresigned('a', TOKENS.a, c.key, c.bytes.length)
      await s3.client.send(
        new PutObjectCommand({ Bucket: rgw!.bucket, Key: stagedName('a', p.uploadId), Body: body }),
      )
      const r = await commit('a', TOKENS.a, p.uploadId)
      expect([r.status, r.code]).toEqual([400, code])
    }
    // The header's own size disagreeing with the upload is refused too (before any byte is stored).
    const p4 = await openPresigned('a', TOKENS.a, c.key, c.bytes.length + 16)
    expect(await upload(p4, Buffer.concat([c.bytes, Buffer.alloc(16)]))).toEqual([200])
    const r4 = await commit('a', TOKENS.a, p4.uploadId)
    expect([r4.status, r4.code]).toEqual([400, 'ERR_FORMAT_BAD_FIELD'])

    // Multipart with a part missing: refused, the multipart upload aborted.
    const big = makeChunk({ layers: 66, sectionBytes: MIB })
    const p5 = await openPresigned('a', TOKENS.a, big.key, big.bytes.length)
    expect(p5.parts).toHaveLength(4)
    expect(await upload(p5, big.bytes, [0, 3])).toEqual([200, 200])
    const r5 = await commit('a', TOKENS.a, p5.uploadId)
    expect([r5.status, r5.code]).toEqual([400, 'ERR_FORMAT_TRUNCATED'])

    for (const key of [c.key, other.key, big.key]) expect(await s3.head(finalName('a', key))).toBeUndefined()
    expect(await stagingLeft()).toEqual({ objects: [], multipart: 0 })
  })

  it('two writers committing one key leave one object (first commit wins, the other answers exists)', async () => {
    const key = makeChunk().key
    const v1 = chunkWithKey(key, 4, MIB / 2, 1)
    const v2 = chunkWithKey(key, 4, MIB / 2, 2)
    const p1 = await openPresigned('a', TOKENS.a, key, v1.length)
    const p2 = await openPresigned('a', TOKENS.a, key, v2.length)
    expect(await upload(p1, v1)).toEqual([200])
    expect(await upload(p2, v2)).toEqual([200])
    const [r1, r2] = await Promise.all([
      commit('a', TOKENS.a, p1.uploadId),
      commit('a', TOKENS.a, p2.uploadId),
    ])
    expect([r1.status, r2.status].sort()).toEqual([200, 201])
    const winner = r1.status === 201 ? v1 : v2
    const stored = await s3.get(finalName('a', key))
    expect(Buffer.from(await new Response(stored!.body).arrayBuffer()).equals(Buffer.from(winner))).toBe(true)
    expect(decodeHeader(winner).totalBytes).toBe(stored!.size)
    expect(await stagingLeft()).toEqual({ objects: [], multipart: 0 })
  })

  it('a foreign namespace can neither open nor commit a target; a forged upload id finds nothing', async () => {
    const c = makeChunk({ layers: 4, sectionBytes: MIB / 2 })
    const denied = await open('a', TOKENS.b, c.key, c.bytes.length)
    expect(denied.status).toBe(403)
    const p = await openPresigned('a', TOKENS.a, c.key, c.bytes.length)
    expect(await upload(p, c.bytes)).toEqual([200])
    const foreign = await commit('a', TOKENS.b, p.uploadId)
    expect([foreign.status, foreign.code]).toEqual([403, 'ERR_FORBIDDEN'])
    // B's own namespace: the same id names B's staging, where nothing was staged.
    const moved = await commit('b', TOKENS.b, p.uploadId)
    expect([moved.status, moved.code]).toEqual([404, 'ERR_NOT_FOUND'])
    expect(await s3.head(finalName('b', c.key))).toBeUndefined()
    // Any edited field (here the size) names another staging object: nothing there.
    const t = JSON.parse(Buffer.from(p.uploadId, 'base64url').toString('utf8'))
    const forged = Buffer.from(JSON.stringify({ ...t, b: t.b + 16 })).toString('base64url')
    const r = await commit('a', TOKENS.a, forged)
    expect([r.status, r.code]).toEqual([404, 'ERR_NOT_FOUND'])
    const garbage = await commit('a', TOKENS.a, 'not-a-ticket')
    expect([garbage.status, garbage.code]).toEqual([400, 'ERR_INVALID_ARGUMENT'])
    // The real upload is untouched by all of that.
    const ok = await commit('a', TOKENS.a, p.uploadId)
    expect([ok.status, ok.json.status]).toEqual([201, 'created'])
    // A retried commit (answer lost) finds the object stored: exists, not an error.
    const again = await commit('a', TOKENS.a, p.uploadId)
    expect([again.status, again.json.status]).toEqual([200, 'exists'])
    expect(await stagingLeft()).toEqual({ objects: [], multipart: 0 })
  })

  it('expired targets are refused by S3, and their commits by the gateway', async () => {
    // Same code as the zip, from source, with a 2-second upload lifetime.
    const app = await gatewayFromConfig(configFromEnv({ ...env(), KVGATE_UPLOAD_TTL: '2' }))
    const { server: s2, url: u2 } = await functionUrlServer(
      (await import('../src/gateway/adapters/lambda.ts')).streamingHandler(
        async () => app,
        (await import('./lambda-support.ts')).fakeAwsLambda,
      ) as StreamingFn,
    )
    try {
      const c = makeChunk({ layers: 4, sectionBytes: MIB / 2 })
      const inTime = await openPresigned('a', TOKENS.a, c.key, c.bytes.length, u2)
      const late = await openPresigned('a', TOKENS.a, c.key, c.bytes.length, u2)
      expect(await upload(inTime, c.bytes)).toEqual([200])
      await new Promise((r) => setTimeout(r, 3500))
      expect(await upload(late, c.bytes)).toEqual([403])
      const r = await commit('a', TOKENS.a, inTime.uploadId, u2)
      expect([r.status, r.code]).toEqual([410, 'ERR_UPLOAD_EXPIRED'])
      expect(await s3.head(finalName('a', c.key))).toBeUndefined()
      expect(await stagingLeft()).toEqual({ objects: [], multipart: 0 })
    } finally {
      s2.close()
    }
  })

  it('leaves the staging prefix empty: no staged object, no open multipart upload', async () => {
    expect(await stagingLeft()).toEqual({ objects: [], multipart: 0 })
  })
})
