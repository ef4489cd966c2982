// A tiny gateway stand-in for the client tests: the /v1 HTTP API over a Map,
// with faults the test switches on (down, slow, 5xx, corrupt bytes, 307 redirects).

import { createServer, type IncomingMessage, type Server, type ServerResponse } from 'node:http'
import type { AddressInfo } from 'node:net'
import { decodeHeader, layerSpan, verifyChunk } from '../../src/core/format.ts'

export interface Faults {
  /** Delay every response by this many ms. */
  delayMs: number
  /** Answer 503 to everything except /healthz. */
  fail5xx: boolean
  /** Flip a byte in the middle of every chunk body served. */
  corrupt: boolean
  /** Answer chunk GETs with 307 to /presigned/... on this server. */
  redirect: boolean
  /** Destroy the socket without answering. */
  hangUp: boolean
}

export interface FaultGateway {
  url: string
  objects: Map<string, Uint8Array>
  faults: Faults
  requests: { method: string; path: string; range?: string; auth?: string }[]
  /** Closes the listener (the gateway is "down"); restart() listens again on the same port. */
  stop(): Promise<void>
  restart(): Promise<void>
  close(): Promise<void>
}

async function body(req: IncomingMessage): Promise<Uint8Array> {
  const parts: Buffer[] = []
  for await (const c of req) parts.push(c as Buffer)
  return new Uint8Array(Buffer.concat(parts))
}

export async function startFaultGateway(): Promise<FaultGateway> {
  const objects = new Map<string, Uint8Array>()
  const faults: Faults = { delayMs: 0, fail5xx: false, corrupt: false, redirect: false, hangUp: false }
  const requests: FaultGateway['requests'] = []
  const sockets = new Set<import('node:net').Socket>()

  const serveObject = (
    res: ServerResponse,
    obj: Uint8Array,
    range: string | undefined,
    layers: string | null,
  ) => {
    let out = obj
    const headers: Record<string, string> = { 'content-type': 'application/octet-stream' }
    if (layers) {
      const m = /^(\d+)-(\d+)$/.exec(layers)
      const h = decodeHeader(obj)
      if (!m || Number(m[2]) >= h.sections.length || Number(m[1]) > Number(m[2])) {
        res.writeHead(416).end()
        return
      }
      const span = layerSpan(h, Number(m[1]), Number(m[2]))
      out = new Uint8Array(h.headerBytes + span.end - span.start)
      out.set(obj.subarray(0, h.headerBytes))
      out.set(obj.subarray(span.start, span.end), h.headerBytes)
      headers['x-kvgate-layers'] = layers
    } else if (range) {
      const m = /^bytes=(\d+)-(\d+)$/.exec(range)
      if (m) out = obj.subarray(Number(m[1]), Number(m[2]) + 1)
    }
    if (faults.corrupt) {
      out = out.slice()
      const i = out.length - 7
      out[i] = (out[i] ?? 0) ^ 0x5a
    }
    res.writeHead(200, headers).end(out)
  }

  const handler = async (req: IncomingMessage, res: ServerResponse) => {
    const url = new URL(req.url ?? '/', 'http://x')
    requests.push({
      method: req.method ?? '',
      path: url.pathname + url.search,
      range: req.headers.range,
      auth: req.headers.authorization,
    })
    if (faults.hangUp) {
      req.socket.destroy()
      return
    }
    if (faults.delayMs > 0) await new Promise((r) => setTimeout(r, faults.delayMs))
    if (url.pathname === '/healthz') {
      res.writeHead(faults.fail5xx ? 503 : 200).end('ok')
      return
    }
    if (faults.fail5xx) {
      res
        .writeHead(503, { 'content-type': 'application/json' })
        .end('{"error":{"code":"ERR_STORE_UNAVAILABLE","message":"x"}}')
      return
    }
    const pre = /^\/presigned\/([0-9a-f]{64})$/.exec(url.pathname)
    if (pre) {
      const obj = objects.get(pre[1]!)
      if (!obj) res.writeHead(404).end()
      else serveObject(res, obj, req.headers.range, null)
      return
    }
    const lk = /^\/v1\/ns\/([a-z0-9._-]+)\/lookup$/.exec(url.pathname)
    if (lk && req.method === 'POST') {
      const j = JSON.parse(new TextDecoder().decode(await body(req))) as { keys: string[] }
      let n = 0
      const sizes: number[] = []
      while (n < j.keys.length && objects.has(j.keys[n]!)) sizes.push(objects.get(j.keys[n++]!)!.byteLength)
      res.writeHead(200, { 'content-type': 'application/json' }).end(JSON.stringify({ present: n, sizes }))
      return
    }
    const ck = /^\/v1\/ns\/([a-z0-9._-]+)\/chunks\/([0-9a-f]{64})$/.exec(url.pathname)
    if (ck) {
      const key = ck[2]!
      if (req.method === 'PUT') {
        const b = await body(req)
        try {
          verifyChunk(b)
        } catch {
          res.writeHead(400).end('{"error":{"code":"ERR_FORMAT_CHECKSUM","message":"bad"}}')
          return
        }
        const existed = objects.has(key)
        if (!existed) objects.set(key, b)
        res.writeHead(existed ? 200 : 201, { 'content-type': 'application/json' })
        res.end(JSON.stringify({ status: existed ? 'exists' : 'created', bytes: b.byteLength }))
        return
      }
      const obj = objects.get(key)
      if (!obj) {
        res.writeHead(404).end('{"error":{"code":"ERR_NOT_FOUND","message":"no"}}')
        return
      }
      if (req.method === 'HEAD') {
        res.writeHead(200, { 'content-length': String(obj.byteLength) }).end()
        return
      }
      if (faults.redirect && !url.searchParams.has('layers')) {
        res.writeHead(307, { location: `/presigned/${key}` }).end()
        return
      }
      serveObject(res, obj, req.headers.range, url.searchParams.get('layers'))
      return
    }
    res.writeHead(404).end()
  }

  let server: Server = createServer((req, res) => void handler(req, res).catch(() => res.destroy()))
  server.on('connection', (s) => {
    sockets.add(s)
    s.on('close', () => sockets.delete(s))
  })
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r))
  const port = (server.address() as AddressInfo).port
  const stop = async () => {
    for (const s of sockets) s.destroy()
    await new Promise<void>((r) => server.close(() => r()))
  }
  return {
    url: `http://127.0.0.1:${port}`,
    objects,
    faults,
    requests,
    stop,
    restart: async () => {
      server = createServer((req, res) => void handler(req, res).catch(() => res.destroy()))
      server.on('connection', (s) => {
        sockets.add(s)
        s.on('close', () => sockets.delete(s))
      })
      await new Promise<void>((r) => server.listen(port, '127.0.0.1', r))
    },
    close: stop,
  }
}
