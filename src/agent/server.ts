// The agent's listeners: the engine socket (Unix domain, mode 0600, one session per
// connection, answers in completion order) and the optional loopback /metrics port.

import { chmodSync, lstatSync, unlinkSync } from 'node:fs'
import { createServer as createHttpServer, type Server as HttpServer } from 'node:http'
import { connect, createServer, type Server, type Socket } from 'node:net'
import { loadNative } from '../client/native-api.ts'
import { type Agent, BINS_READ_AT_ONCE, newSession, type Session } from './agent.ts'
import { AgentError, checkEnvelope, decodeBody, encodeFrame, FrameReader, ownBins } from './protocol.ts'
import { READ_BUFFER_BYTES, readInto } from './socket-reads.ts'

/** In-flight requests per connection; more are answered ERR_BUSY. */
export const MAX_INFLIGHT = 1024
/**
 * Answers a connection may leave unsent before the agent stops reading its requests: an
 * engine that sends without reading (a stuck reader thread) would otherwise grow the
 * agent's write buffer without bound, since answered requests are no longer in flight.
 */
export const MAX_UNSENT_BYTES = 4 * 1024 * 1024

export interface ListenOptions {
  socketPath: string
  maxFrameBytes: number
  /** Loopback port for GET /metrics and /healthz; undefined = off, 0 = any free port. */
  metricsPort?: number
  /** Bound on a connection's unsent answers before its requests are no longer read. @default MAX_UNSENT_BYTES */
  maxUnsentBytes?: number
}

export class AgentServer {
  readonly agent: Agent
  readonly socketPath: string
  #server: Server | undefined
  #http: HttpServer | undefined
  /** Open connections and their sessions. */
  readonly #sockets = new Map<Socket, Session>()
  metricsPort: number | undefined

  constructor(agent: Agent, socketPath: string) {
    this.agent = agent
    this.socketPath = socketPath
  }

  static async listen(agent: Agent, o: ListenOptions): Promise<AgentServer> {
    const s = new AgentServer(agent, o.socketPath)
    await removeStaleSocket(o.socketPath)
    // Paused: a connection's reads go to a buffer of its own from the first (readInto).
    const server = createServer({ pauseOnConnect: true }, (sock) =>
      s.#connection(sock, o.maxFrameBytes, o.maxUnsentBytes ?? MAX_UNSENT_BYTES),
    )
    // The socket file is created 0600 (umask) so no other user can connect even briefly.
    const old = process.umask(0o177)
    try {
      await new Promise<void>((resolve, reject) => {
        server.once('error', reject)
        server.listen(o.socketPath, () => {
          server.off('error', reject)
          resolve()
        })
      })
    } finally {
      process.umask(old)
    }
    chmodSync(o.socketPath, 0o600)
    s.#server = server
    if (o.metricsPort !== undefined) {
      const http = createHttpServer((req, res) => {
        if (req.method === 'GET' && req.url === '/metrics') {
          agent.metricsText().then(
            (t) => res.writeHead(200, { 'content-type': 'text/plain; version=0.0.4' }).end(t),
            () => res.writeHead(500).end(),
          )
        } else if (req.method === 'GET' && req.url === '/healthz') {
          res.writeHead(200, { 'content-type': 'application/json' }).end('{"ok":true}')
        } else res.writeHead(404).end()
      })
      await new Promise<void>((resolve, reject) => {
        http.once('error', reject)
        http.listen(o.metricsPort, '127.0.0.1', () => resolve())
      })
      const addr = http.address()
      s.metricsPort = typeof addr === 'object' && addr ? addr.port : undefined
      s.#http = http
    }
    return s
  }

  #connection(sock: Socket, maxFrameBytes: number, maxUnsentBytes: number): void {
    const m = this.agent.metrics
    m.connections++
    // Every read lands in one buffer and its frames are decoded before the next: a frame's
    // bytes are the next read's once its request's synchronous handling returns (request()).
    const reader = new FrameReader(maxFrameBytes, { reuse: true })
    // Frames produced in one tick (a load's per-layer events when the copies are synchronous,
    // the answers to a batch of requests) leave in one write: each write to the socket is a
    // syscall and a wake-up of the engine's reader. While a read's frames are handled
    // (`reading`) the read itself decides: its synchronous answers leave before it returns.
    let corked = false
    let reading = false
    const uncork = () => {
      corked = false
      sock.uncork()
    }
    const write = (frame: Buffer) => {
      if (sock.destroyed) return
      if (!corked && !reading) {
        corked = true
        sock.cork()
        process.nextTick(uncork)
      }
      sock.write(frame)
    }
    const send = (msg: Record<string, unknown>) => {
      if (!sock.destroyed) write(encodeFrame(msg))
    }
    // A request's time inside the agent ends with its answer encoded (stats agentMs): the write
    // of an answer sent at once is a syscall on the socket, not the agent's time.
    const answered = (req: { id: number; op: string }, t0: number, body: Record<string, unknown>) => {
      const frame = encodeFrame({ id: req.id, ok: true, ...body })
      m.took(req.op, performance.now() - t0)
      write(frame)
    }
    const session = newSession((ev) => send(ev))
    this.#sockets.set(sock, session)
    // The socket's fd (a pipe handle's, on Unix): the kernel knows the engine closed before
    // the close event reaches this loop, and a save's copy that ended after it is not kept.
    const fd = (sock as unknown as { _handle?: { fd?: number } })._handle?.fd
    const peerClosed = loadNative().api?.socketPeerClosed
    if (peerClosed && typeof fd === 'number' && fd >= 0 && peerClosed(fd) !== undefined)
      session.peerClosed = () => sock.destroyed || peerClosed(fd) === true
    let inflight = 0
    const fail = (id: number | null, e: unknown) => {
      const err =
        e instanceof AgentError ? e : new AgentError('ERR_INTERNAL', (e as Error)?.message ?? String(e))
      m.error(err.code)
      send({ id, ok: false, error: { code: err.code, message: err.message } })
    }
    // Set once a bad length was read: bytes after it (a client whose write side stays open) are
    // dropped, not framed again, and the connection closes once its requests are answered.
    let unframed = false
    const closeWhenAnswered = () => {
      if (inflight > 0 || sock.destroyed || sock.writableEnded) return
      // Answer once, last, then close this connection only (once the answers are flushed:
      // a half-open client would otherwise keep it).
      fail(null, reader.error)
      sock.end(() => sock.destroy())
    }
    const onBytes = (chunk: Buffer) => {
      if (unframed) return
      const bodies = reader.push(chunk)
      // One frame: its answer is one write now. Several: their answers (those ready now)
      // leave in one corked write when this handler returns, not a tick later.
      const batch = bodies.length > 1 && !corked
      if (batch) sock.cork()
      reading = true
      try {
        for (const body of bodies) request(body)
      } finally {
        reading = false
        if (batch) sock.uncork()
      }
      // A bad length cannot be resynchronised. The requests framed before it in this read are
      // valid: each is answered (those that wait, once they settle) before the refusal.
      if (reader.error) {
        unframed = true
        m.badFrames++
        closeWhenAnswered()
        return
      }
      // Backpressure: past the bound, read nothing more until the engine has read its answers
      // ('drain': the buffer emptied). Answers still in flight (at most MAX_INFLIGHT) are sent meanwhile.
      if (!sock.isPaused() && sock.writableNeedDrain && sock.writableLength >= maxUnsentBytes) {
        sock.pause()
        sock.once('drain', () => sock.resume())
      }
    }
    const request = (body: Buffer) => {
      const t0 = performance.now()
      let req: ReturnType<typeof checkEnvelope>
      try {
        const msg = decodeBody(body)
        try {
          req = checkEnvelope(msg)
        } catch (e) {
          const id = (msg as { id?: unknown })?.id
          m.badFrames++
          fail(typeof id === 'number' && Number.isSafeInteger(id) ? id : null, e)
          return
        }
      } catch (e) {
        m.badFrames++
        fail(null, new AgentError('ERR_BAD_FRAME', `undecodable frame: ${(e as Error).message}`))
        return
      }
      // The request's bins are views of the read buffer: an operation that may keep one past
      // answer() gets copies (a lookup reads its keys at once, or copies them before it waits).
      if (!BINS_READ_AT_ONCE.has(req.op)) ownBins(req)
      m.requests++
      if (inflight >= MAX_INFLIGHT) {
        fail(req.id, new AgentError('ERR_BUSY', `more than ${MAX_INFLIGHT} requests in flight`))
        return
      }
      let out: ReturnType<Agent['answer']>
      try {
        out = this.agent.answer(session, req)
      } catch (e) {
        fail(req.id, e)
        return
      }
      if (!(out instanceof Promise)) {
        answered(req, t0, out)
        return
      }
      inflight++
      out
        .then(
          (body) => answered(req, t0, body),
          (e) => fail(req.id, e),
        )
        .finally(() => {
          inflight--
          if (unframed) closeWhenAnswered()
        })
    }
    readInto(sock, Buffer.allocUnsafeSlow(READ_BUFFER_BYTES), onBytes)
    sock.on('error', () => {})
    sock.on('close', () => {
      m.connections--
      this.#sockets.delete(sock)
      this.agent.endSession(session)
    })
  }

  async close(): Promise<void> {
    // An engine takes this agent closing its connection as every load's fence (as when it dies):
    // a connection closes only once its loads and saves, cancelled here, had their copies land.
    // Its requests not yet read are not (the engine fails them at the close).
    const stopped = new Promise<void>((r) => (this.#server ? this.#server.close(() => r()) : r()))
    await Promise.all(
      [...this.#sockets].map(async ([sock, session]) => {
        sock.pause()
        await this.agent.quiesce(session)
        // Their answers leave first (an engine that does not read gets the close a second later).
        await new Promise<void>((r) => {
          const t = setTimeout(r, 1000)
          sock.end(() => {
            clearTimeout(t)
            r()
          })
        })
        sock.destroy()
      }),
    )
    await Promise.all([stopped, new Promise<void>((r) => (this.#http ? this.#http.close(() => r()) : r()))])
    try {
      unlinkSync(this.socketPath)
    } catch {}
    await this.agent.close()
  }
}

/** A socket file left by a dead agent is removed; one a live agent answers on is an error. */
async function removeStaleSocket(path: string): Promise<void> {
  let st: ReturnType<typeof lstatSync>
  try {
    st = lstatSync(path)
  } catch {
    return
  }
  if (!st.isSocket()) throw new AgentError('ERR_INVALID_ARGUMENT', `${path} exists and is not a socket`)
  const live = await new Promise<boolean>((resolve) => {
    const c = connect(path)
    c.once('connect', () => {
      c.destroy()
      resolve(true)
    })
    c.once('error', () => resolve(false))
  })
  if (live) throw new AgentError('ERR_INVALID_ARGUMENT', `another agent is listening on ${path}`)
  unlinkSync(path)
}
