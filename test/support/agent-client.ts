// A minimal kvgate agent protocol client for tests: requests by id, events collected,
// answers without a known id (error frames for bad bytes) kept apart.

import { connect, type Socket } from 'node:net'
import { decodeBody, encodeFrame, FrameReader } from '../../src/agent/protocol.ts'

export type Msg = Record<string, unknown>

export class AgentClient {
  readonly sock: Socket
  readonly events: Msg[] = []
  readonly orphans: Msg[] = []
  readonly #reader = new FrameReader()
  readonly #waiting = new Map<unknown, (m: Msg) => void>()
  #next = 1
  closed = false

  private constructor(sock: Socket) {
    this.sock = sock
    sock.on('data', (d) => {
      for (const b of this.#reader.push(d)) {
        const m = decodeBody(b) as Msg
        if (m.event) this.events.push(m)
        else if (this.#waiting.has(m.id)) {
          this.#waiting.get(m.id)!(m)
          this.#waiting.delete(m.id)
        } else this.orphans.push(m)
      }
    })
    sock.on('close', () => {
      this.closed = true
    })
  }

  static open(path: string): Promise<AgentClient> {
    return new Promise((resolve, reject) => {
      const s = connect(path)
      s.once('connect', () => resolve(new AgentClient(s)))
      s.once('error', reject)
    })
  }

  call(op: string, fields: Msg = {}): Promise<Msg> {
    const id = this.#next++
    return new Promise((resolve) => {
      this.#waiting.set(id, resolve)
      this.sock.write(encodeFrame({ id, op, ...fields }))
    })
  }

  /** Writes raw bytes and waits for the next message without a known id. */
  async raw(bytes: Buffer): Promise<Msg> {
    const before = this.orphans.length
    this.sock.write(bytes)
    for (let i = 0; i < 200 && this.orphans.length === before; i++)
      await new Promise((r) => setTimeout(r, 10))
    return this.orphans[before]!
  }

  close(): void {
    this.sock.destroy()
  }
}
