// A tiny gateway stand-in for the client tests: the /v1 HTTP API over a Map,
// with faults the test switches on (down, slow, 5xx, corrupt bytes, 307 redirects,
// hung GETs, oversized bodies, refused tokens, 409 re-PUTs) and the verify endpoint (contract C1).

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
  /** Never answer chunk GETs (lookups and PUTs still answer). */
  hangGets: boolean
  /** Append this many junk bytes to every chunk GET body (also from the presigned target). */
  oversize: number
  /** With oversize: send no content-length (chunked), so only the reader's own count can stop it. */
  oversizeChunked: boolean
  /** Answer every /v1 request with this status (401, 403) and an error body. */
  refuse: 401 | 403 | 0
  /** Answer a re-PUT of a stored key 409 (an older gateway's answer to another size). */
  conflictOnExists: boolean
  /** What POST …/verify answers for a stored key ('corrupt' also deletes it, as the real gateway does). */
  verdict: 'ok' | 'corrupt'
  /** Answer `?layers` GETs with the whole object, as a caching proxy that drops the query does. */
  ignoreLayers: boolean
}

export interface FaultGateway {
  url: string
  objects: Map<string, Uint8Array>
  faults: Faults
  requests: { method: string; path: string; range?: string; auth?: string }[]
  /** Junk bytes written by oversize answers (stops when the reader hangs up). */
  oversizeWritten: number
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
  const faults: Faults = {
    delayMs: 0,
    fail5xx: false,
    corrupt: false,
    redirect: false,
    hangUp: false,
    hangGets: false,
    oversize: 0,
    oversizeChunked: false,
    refuse: 0,
    conflictOnExists: false,
    verdict: 'ok',
    ignoreLayers: false,
  }
  const stats = { oversizeWritten: 0 }
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
    if (layers && !faults.ignoreLayers) {
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
    if (faults.oversize > 0) {
      void sendOversized(res, headers, out)
      return
    }
    res.writeHead(200, headers).end(out)
  }

  /** The object followed by junk, written with backpressure until done or the reader hangs up. */
  const sendOversized = async (res: ServerResponse, headers: Record<string, string>, obj: Uint8Array) => {
    const total = obj.byteLength + faults.oversize
    if (!faults.oversizeChunked) headers['content-length'] = String(total)
    res.writeHead(200, headers)
    res.write(obj)
    const piece = new Uint8Array(64 * 1024).fill(0xab)
    let left = faults.oversize
    while (left > 0 && !res.destroyed) {
      const n = Math.min(left, piece.byteLength)
      left -= n
      stats.oversizeWritten += n
      if (!res.write(n === piece.byteLength ? piece : piece.subarray(0, n))) {
        // Both listeners go once either fires: a slow reader drains many times.
        await new Promise<void>((r) => {
          const done = () => {
            res.off('drain', done)
            res.off('close', done)
            r()
          }
          res.on('drain', done)
          res.on('close', done)
        })
      }
    }
    res.end()
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
    if (faults.refuse && url.pathname.startsWith('/v1/')) {
      const code = faults.refuse === 401 ? 'ERR_UNAUTHORIZED' : 'ERR_FORBIDDEN'
      res
        .writeHead(faults.refuse, { 'content-type': 'application/json' })
        .end(JSON.stringify({ error: { code, message: 'refused' } }))
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
    const vf = /^\/v1\/ns\/([a-z0-9._-]+)\/chunks\/([0-9a-f]{64})\/verify$/.exec(url.pathname)
    if (vf && req.method === 'POST') {
      const key = vf[2]!
      const verdict = !objects.has(key) ? 'missing' : faults.verdict
      if (verdict === 'corrupt') objects.delete(key)
      res
        .writeHead(200, { 'content-type': 'application/json' })
        .end(JSON.stringify({ key, verdict, deleted: verdict === 'corrupt' }))
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
        if (existed && faults.conflictOnExists) {
          res.writeHead(409, { 'content-type': 'application/json' })
          res.end('{"error":{"code":"ERR_ALREADY_EXISTS","message":"another size"}}')
          return
        }
        res.writeHead(existed ? 200 : 201, { 'content-type': 'application/json' })
        res.end(JSON.stringify({ status: existed ? 'exists' : 'created', bytes: b.byteLength }))
        return
      }
      const obj = objects.get(key)
      if (!obj) {
        res.writeHead(404).end('{"error":{"code":"ERR_NOT_FOUND","message":"no"}}')
        return
      }
      if (faults.hangGets && req.method === 'GET') return
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
    get oversizeWritten() {
      return stats.oversizeWritten
    },
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
