// Baseline for bench/gateway.ts: the least a Node proxy hop can cost. PUT/GET
// /k/<key> are piped to a presigned RadosGW URL with no verification, no streams
// API, nothing else; the gap to it is the gateway's own overhead.
// Env: RGW_ENDPOINT RGW_ACCESS_KEY RGW_SECRET_KEY RGW_BUCKET. Prints {"url":…} when ready.

import http from 'node:http'
import type { AddressInfo } from 'node:net'
import { GetObjectCommand, PutObjectCommand, S3Client } from '@aws-sdk/client-s3'
import { getSignedUrl } from '@aws-sdk/s3-request-presigner'

const env = process.env
const client = new S3Client({
  region: 'us-east-1',
  endpoint: env.RGW_ENDPOINT,
  forcePathStyle: true,
  credentials: { accessKeyId: env.RGW_ACCESS_KEY ?? '', secretAccessKey: env.RGW_SECRET_KEY ?? '' },
})
const agent = new http.Agent({ keepAlive: true, maxSockets: 64 })

const server = http.createServer(async (req, res) => {
  const key = (req.url ?? '').slice(3)
  const put = req.method === 'PUT'
  const cmd = put
    ? new PutObjectCommand({ Bucket: env.RGW_BUCKET, Key: key })
    : new GetObjectCommand({ Bucket: env.RGW_BUCKET, Key: key })
  const url = new URL(await getSignedUrl(client, cmd, { expiresIn: 300 }))
  const headers: Record<string, string> = put
    ? { 'content-length': req.headers['content-length'] ?? '0' }
    : {}
  const up = http.request(url, { method: req.method, agent, headers }, (ur) => {
    res.writeHead(ur.statusCode ?? 502, { 'content-length': ur.headers['content-length'] ?? '0' })
    ur.pipe(res)
  })
  up.on('error', () => res.destroy())
  if (put) req.pipe(up)
  else up.end()
})
server.listen(0, '127.0.0.1', () => {
  console.log(JSON.stringify({ url: `http://127.0.0.1:${(server.address() as AddressInfo).port}` }))
})
process.once('SIGTERM', () => {
  server.close()
  agent.destroy()
  process.exit(0)
})
