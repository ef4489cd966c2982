// Test stand-ins for the AWS Lambda Node.js runtime: the response-streaming globals
// (awslambda.*), a parser for the streamed wire format, and a local "function URL".

import { once } from 'node:events'
import { mkdirSync, readFileSync, writeFileSync } from 'node:fs'
import { createServer, type Server } from 'node:http'
import type { AddressInfo } from 'node:net'
import { join } from 'node:path'
import { Writable } from 'node:stream'
import { pathToFileURL } from 'node:url'
import { inflateRawSync } from 'node:zlib'
import type { AwsLambdaGlobal, FunctionUrlEvent } from '../src/gateway/adapters/lambda.ts'

export interface ResponseMeta {
  statusCode: number
  headers: Record<string, string>
  cookies: string[]
}

/**
 * The response side of a streamed invocation as the Lambda runtime sends it: a JSON
 * prelude (status, headers), 8 NUL bytes, then the body. Parses it back.
 */
export class FunctionUrlResponse extends Writable {
  meta: ResponseMeta | undefined
  readonly chunks: Buffer[] = []
  #pending = Buffer.alloc(0)
  constructor(
    private readonly onMeta?: (m: ResponseMeta) => void,
    private readonly onData?: (b: Buffer) => void,
  ) {
    super()
  }
  override _write(chunk: Buffer, _enc: BufferEncoding, cb: (e?: Error | null) => void): void {
    if (this.meta) {
      this.chunks.push(chunk)
      this.onData?.(chunk)
      cb()
      return
    }
    this.#pending = Buffer.concat([this.#pending, chunk])
    const sep = this.#pending.indexOf(Buffer.alloc(8))
    if (sep >= 0) {
      this.meta = JSON.parse(this.#pending.subarray(0, sep).toString('utf8')) as ResponseMeta
      this.onMeta?.(this.meta)
      const rest = this.#pending.subarray(sep + 8)
      if (rest.length > 0) {
        this.chunks.push(rest)
        this.onData?.(rest)
      }
    }
    cb()
  }
  body(): Buffer {
    return Buffer.concat(this.chunks)
  }
}

export const fakeAwsLambda: AwsLambdaGlobal = {
  streamifyResponse: (fn) => Object.assign(fn, { streamified: true }),
  HttpResponseStream: {
    from(stream, metadata) {
      stream.write(Buffer.from(JSON.stringify(metadata)))
      stream.write(Buffer.alloc(8))
      return stream
    },
  },
}

export type StreamingFn = (event: FunctionUrlEvent, stream: Writable, context: unknown) => Promise<void>

export interface Invocation {
  status: number
  headers: Record<string, string>
  body: Buffer
  /** True when the handler destroyed the stream (a failed body). */
  destroyed: boolean
}

export async function invoke(fn: StreamingFn, event: FunctionUrlEvent): Promise<Invocation> {
  const out = new FunctionUrlResponse()
  const closed = once(out, 'close').catch(() => {})
  let destroyed = false
  out.on('error', () => {
    destroyed = true
  })
  await fn(event, out, {})
  if (!out.writableFinished && !out.destroyed) out.end()
  await closed
  return { status: out.meta?.statusCode ?? 0, headers: out.meta?.headers ?? {}, body: out.body(), destroyed }
}

/** A local stand-in for a function URL: HTTP in, v2 event, streamed handler, HTTP out. */
export async function functionUrlServer(fn: StreamingFn): Promise<{ server: Server; url: string }> {
  const server = createServer(async (req, res) => {
    const chunks: Buffer[] = []
    for await (const c of req) chunks.push(c as Buffer)
    const body = Buffer.concat(chunks)
    const u = new URL(req.url ?? '/', 'http://x')
    const headers: Record<string, string> = {}
    for (const [k, v] of Object.entries(req.headers)) if (typeof v === 'string') headers[k] = v
    const out = new FunctionUrlResponse(
      (m) => res.writeHead(m.statusCode, m.headers),
      (b) => res.write(b),
    )
    out.on('error', () => res.destroy())
    await fn(
      {
        version: '2.0',
        rawPath: u.pathname,
        rawQueryString: u.search.slice(1),
        headers,
        body: body.length > 0 ? body.toString('base64') : undefined,
        isBase64Encoded: body.length > 0,
        requestContext: { domainName: headers.host, http: { method: req.method ?? 'GET' } },
      },
      out,
      {},
    )
    if (!out.writableFinished) out.end()
    res.end()
  })
  server.listen(0, '127.0.0.1')
  await once(server, 'listening')
  return { server, url: `http://127.0.0.1:${(server.address() as AddressInfo).port}/` }
}

/**
 * Builds the Lambda zip (scripts/build-lambda.ts), unpacks it the way Lambda does
 * (into a task directory, central directory trusted) and imports its handler.
 * The handler reads its KVGATE_* environment at the first invocation.
 */
export async function loadBuiltHandler(work: string): Promise<StreamingFn> {
  const { buildLambda } = await import('../scripts/build-lambda.ts')
  const build = await buildLambda({ out: join(work, 'kvgate-gateway.zip') })
  const zip = readFileSync(build.zip)
  const task = join(work, 'task')
  mkdirSync(task, { recursive: true })
  const eocd = zip.lastIndexOf(Buffer.from([0x50, 0x4b, 0x05, 0x06]))
  let p = zip.readUInt32LE(eocd + 16)
  for (let i = zip.readUInt16LE(eocd + 10); i > 0; i--) {
    const method = zip.readUInt16LE(p + 10)
    const csize = zip.readUInt32LE(p + 20)
    const nameLen = zip.readUInt16LE(p + 28)
    const local = zip.readUInt32LE(p + 42)
    const name = zip.subarray(p + 46, p + 46 + nameLen).toString('utf8')
    const at = local + 30 + zip.readUInt16LE(local + 26) + zip.readUInt16LE(local + 28)
    const raw = zip.subarray(at, at + csize)
    writeFileSync(join(task, name), method === 8 ? inflateRawSync(raw) : raw)
    p += 46 + nameLen + zip.readUInt16LE(p + 30) + zip.readUInt16LE(p + 32)
  }
  ;(globalThis as { awslambda?: AwsLambdaGlobal }).awslambda = fakeAwsLambda
  const mod = (await import(pathToFileURL(join(task, 'index.mjs')).href)) as { handler: StreamingFn }
  return mod.handler
}
