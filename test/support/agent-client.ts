// A minimal kvgate agent protocol client for tests: requests by id, events collected.

import { connect, type Socket } from 'node:net'
import { decodeBody, encodeFrame, FrameReader } from '../../src/agent/protocol.ts'

export type Msg = Record<string, unknown>

export class AgentClient {
  readonly sock: Socket
  readonly events: Msg[] = []
  readonly #reader = new FrameReader()
  readonly #waiting = new Map<unknown, (m: Msg) => void>()
  #next = 1

  private constructor(sock: Socket) {
    this.sock = sock
    sock.on('data', (d) => {
      for (const b of this.#reader.push(d)) {
        const m = decodeBody(b) as Msg
        if (m.event) this.events.push(m)
        else {
          this.#waiting.get(m.id)?.(m)
          this.#waiting.delete(m.id)
        }
      }
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

  close(): void {
    this.sock.destroy()
  }
}
