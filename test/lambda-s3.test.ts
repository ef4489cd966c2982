// The AWS path end to end without AWS: the Lambda handler built from its environment
// (S3 store with presigned GETs) on a real S3 (Ceph RadosGW), driven by `kvgate smoke`
// through a local function URL, following the 307 to the presigned RGW URL.

import { createHash, randomBytes } from 'node:crypto'
import { afterAll, describe, expect, it } from 'vitest'
import { runSmoke } from '../src/cli/commands/smoke.ts'
import { configFromEnv, gatewayFromConfig, streamingHandler } from '../src/gateway/adapters/lambda.ts'
import type { GatewayApp } from '../src/gateway/app.ts'
import { makeChunk } from './gateway-fixtures.ts'
import { fakeAwsLambda, functionUrlServer, invoke, type StreamingFn } from './lambda-support.ts'
import { type Rgw, useRgw } from './support/rgw.ts'

const rgw: Rgw | undefined = await useRgw('lambda-s3 (RadosGW)')
const MIB = 1024 * 1024

afterAll(async () => {
  await rgw?.stop()
})

describe.skipIf(!rgw)('lambda handler on S3 (RadosGW)', () => {
  const token = randomBytes(24).toString('base64url')
  const tokens = [
    {
      name: 'fleet',
      sha256: createHash('sha256').update(token).digest('hex'),
      scopes: 'admin',
      namespaces: '*',
    },
  ]

  /** The function's settings on a prefix of its own. */
  const config = () => {
    // The SDK's default credential chain, as on Lambda (there: the execution role).
    process.env.AWS_ACCESS_KEY_ID = rgw!.accessKeyId
    process.env.AWS_SECRET_ACCESS_KEY = rgw!.secretAccessKey
    return configFromEnv({
      KVGATE_S3_BUCKET: rgw!.bucket,
      KVGATE_S3_ENDPOINT: rgw!.endpoint,
      AWS_REGION: rgw!.region,
      KVGATE_S3_PREFIX: `lambda-${randomBytes(4).toString('hex')}`,
      KVGATE_TOKENS: JSON.stringify(tokens),
    })
  }

  const handler = async (): Promise<StreamingFn> => {
    const app = await gatewayFromConfig(config())
    return streamingHandler(async () => app, fakeAwsLambda) as StreamingFn
  }

  it('passes kvgate smoke, large chunks through the presigned redirect', async () => {
    const fn = await handler()
    const { server, url } = await functionUrlServer(fn)
    try {
      // 1024 tokens → a 2 MiB chunk: above the 1 MiB redirect threshold, under the 4 MiB PUT limit.
      const big = await runSmoke({ url, token, chunkTokens: 1024, cleanup: true })
      expect(big.steps.filter((s) => !s.ok)).toEqual([])
      expect(big.steps.find((s) => s.name === 'get')?.detail).toMatch(/presigned/)
      // Byte ranges of a large object go to S3 too; ?layers= is served by the function.
      expect(big.steps.find((s) => s.name === 'get byte range')?.ok).toBe(true)
      const small = await runSmoke({ url, token, cleanup: true })
      expect(small.steps.filter((s) => !s.ok)).toEqual([])
      expect(small.steps.find((s) => s.name === 'get')?.detail).not.toMatch(/presigned/)
    } finally {
      server.close()
    }
  })

  it('a cold function answers a calibration HEAD from S3 metadata, never reading the body', async () => {
    const cfg = config()
    const calib = new Uint8Array(2 * MIB)
    calib.set([0x4b, 0x56, 0x43, 0x4c, 1, 0])
    for (let i = 8; i < calib.length; i++) calib[i] = (i * 131) & 0xff
    const hash = createHash('sha256').update(calib).digest('hex')
    const event = (method: string, body?: Uint8Array) => ({
      rawPath: `/v1/ns/a/calibrations/${hash}`,
      headers: {
        authorization: `Bearer ${token}`,
        ...(body
          ? { 'content-type': 'application/octet-stream', 'content-length': String(body.length) }
          : {}),
      },
      ...(body ? { body: Buffer.from(body).toString('base64'), isBase64Encoded: true } : {}),
      requestContext: { domainName: 'x.lambda-url.us-east-1.on.aws', http: { method } },
    })
    const writer = await gatewayFromConfig(cfg)
    const put = await invoke(
      streamingHandler(async () => writer, fakeAwsLambda) as StreamingFn,
      event('PUT', calib),
    )
    expect(put.status).toBe(201)
    // A new execution environment: nothing cached, one HeadObject, no GetObject.
    const cold = (await gatewayFromConfig(cfg)) as GatewayApp
    const r = await invoke(streamingHandler(async () => cold, fakeAwsLambda) as StreamingFn, event('HEAD'))
    expect([r.status, r.headers['content-length']]).toEqual([200, String(calib.length)])
    expect(cold.state.metrics.storeOps.value({ op: 'get' })).toBe(0)
    expect(cold.state.metrics.storeOps.value({ op: 'head' })).toBe(1)
  })

  it('refuses a PUT over the Lambda body limit before touching S3', async () => {
    const fn = await handler()
    const c = makeChunk({ layers: 2, sectionBytes: 3 * MIB })
    const r = await invoke(fn, {
      rawPath: `/v1/ns/a/chunks/${c.key}`,
      headers: {
        authorization: `Bearer ${token}`,
        'content-type': 'application/octet-stream',
        'content-length': String(c.bytes.length),
      },
      body: Buffer.from(c.bytes).toString('base64'),
      isBase64Encoded: true,
      requestContext: { domainName: 'x.lambda-url.us-east-1.on.aws', http: { method: 'PUT' } },
    })
    expect(r.status).toBe(413)
  })
})
