// Test stand-ins for the AWS Lambda Node.js runtime: the response-streaming globals
// (awslambda.*), a parser for the streamed wire format, and a local "function URL".

import { once } from 'node:events'
import { createServer, type Server } from 'node:http'
import type { AddressInfo } from 'node:net'
import { Writable } from 'node:stream'
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
