// A GET client that reads at a set pace over a raw socket: paused whenever it is ahead of the
// pace, resumed when the pace catches up (a slow link, or a slow-loris reader), so the server
// sees the client's backpressure as a real one would send it.

import net from 'node:net'

export interface PacedGet {
  sock: net.Socket
  /** Every byte received (status line, headers, body) once the connection closes. */
  closed: Promise<Buffer>
}

/** GET `path` from `origin` (http://host:port) taking at most `rate` bytes/s. */
export function pacedGet(origin: string, path: string, rate: number): PacedGet {
  const u = new URL(origin)
  const sock = net.connect(Number(u.port), u.hostname)
  sock.on('error', () => {})
  const pieces: Buffer[] = []
  let got = 0
  let started = 0
  let timer: ReturnType<typeof setTimeout> | undefined
  sock.on('data', (d: Buffer) => {
    pieces.push(d)
    got += d.length
    started ||= Date.now()
    const ahead = (got * 1000) / rate - (Date.now() - started)
    if (ahead > 0) {
      sock.pause()
      timer = setTimeout(() => sock.resume(), ahead)
    }
  })
  const closed = new Promise<Buffer>((r) =>
    sock.on('close', () => {
      clearTimeout(timer)
      r(Buffer.concat(pieces))
    }),
  )
  sock.write(`GET ${path} HTTP/1.1\r\nhost: ${u.host}\r\nconnection: close\r\n\r\n`)
  return { sock, closed }
}

/** A whole HTTP/1.1 response: its head, and its body (a chunked one decoded; throws when malformed). */
export function splitResponse(raw: Buffer): { head: string; body: Buffer } {
  const end = raw.indexOf('\r\n\r\n')
  if (end < 0) throw new Error('no end of headers')
  const head = raw.subarray(0, end).toString()
  const rest = raw.subarray(end + 4)
  return { head, body: /^transfer-encoding:\s*chunked\s*$/im.test(head) ? dechunk(rest) : rest }
}

function dechunk(b: Buffer): Buffer {
  const out: Buffer[] = []
  for (let at = 0; ; ) {
    const eol = b.indexOf('\r\n', at)
    if (eol < 0) throw new Error('chunked body ends inside a size line')
    const n = Number.parseInt(b.subarray(at, eol).toString(), 16)
    if (!Number.isInteger(n)) throw new Error('bad chunk size')
    if (n === 0) return Buffer.concat(out)
    if (eol + 2 + n + 2 > b.length) throw new Error('chunked body ends inside a chunk')
    out.push(b.subarray(eol + 2, eol + 2 + n))
    at = eol + 2 + n + 2
  }
}
