// The agent's host shared-memory tensors: mapped and pread/pwrite copies give the same
// bytes, bad runs and shrunk files are errors (never partial copies or a SIGBUS), and a
// registration's mappings are released when its connection ends or the agent closes.

import { randomBytes } from 'node:crypto'
import { mkdtempSync, readFileSync, rmSync, truncateSync, writeFileSync } from 'node:fs'
import { connect, type Socket } from 'node:net'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, describe, expect, it } from 'vitest'
import { HostTensor } from '../src/agent/host-tensor.ts'
import { resolveAgentConfig, startAgent } from '../src/agent/index.ts'
import { decodeBody, encodeFrame, FrameReader } from '../src/agent/protocol.ts'
import { fileMapStats } from '../src/client/native.ts'
import { loadNative } from '../src/client/native-api.ts'

const dir = mkdtempSync(join(tmpdir(), 'kvgate-host-tensor-'))
afterAll(() => rmSync(dir, { recursive: true, force: true }))
const native = loadNative().api

function shm(name: string, bytes: Uint8Array): string {
  const p = join(dir, name)
  writeFileSync(p, bytes)
  return p
}

it('the addon is loaded (else the mapped path is not tested)', () => {
  expect(native?.mapFileAvailable(), loadNative().reason).toBe(true)
})

describe('HostTensor', () => {
  const OFF = 100 // an unaligned tensor offset inside the file
  const BYTES = 64 * 1024
  // Scattered runs, two of them adjacent on both sides (merged into one copy).
  const runs = [8192, 0, 4096, 12288, 4096, 4096, 0, 8192, 1000, 60000, 9192, 536]

  // The addon's one-call copy, the mapping with one Buffer#copy per run (an addon that
  // predates copyRuns), and pread/pwrite (no addon).
  const modes = [
    { name: 'mapped, copyRuns', mapped: true, api: native },
    {
      name: 'mapped, Buffer#copy',
      mapped: true,
      api: native && { ...native, copyRunsAvailable: () => false },
    },
    { name: 'pread/pwrite', mapped: false, api: undefined },
  ]
  for (const { name, mapped, api } of modes) {
    it(`${name}: gather and scatter move exactly the runs`, () => {
      const data = randomBytes(OFF + BYTES + 50)
      const p = shm(`t-${name.replace(/\W/g, '-')}`, data)
      const t = new HostTensor(p, OFF, BYTES, api)
      expect(t.mapped).toBe(mapped)
      const host = new Uint8Array(9728)
      t.gather(runs, host)
      for (let i = 0; i < runs.length; i += 3) {
        const [at, h, n] = [runs[i]!, runs[i + 1]!, runs[i + 2]!]
        expect(Buffer.from(host.subarray(h, h + n)).equals(data.subarray(OFF + at, OFF + at + n))).toBe(true)
      }
      const fresh = Uint8Array.from(host, (x) => x ^ 0x5a)
      t.scatter(fresh, runs)
      const back = readFileSync(p)
      const want = Buffer.from(data)
      for (let i = 0; i < runs.length; i += 3) {
        const [at, h, n] = [runs[i]!, runs[i + 1]!, runs[i + 2]!]
        want.set(fresh.subarray(h, h + n), OFF + at)
      }
      expect(back.equals(want)).toBe(true) // written runs changed, nothing else did
      t.close()
      expect(() => t.gather(runs, host)).toThrow(expect.objectContaining({ code: 'ERR_CLOSED' }))
      t.close() // idempotent
    })
  }

  it('mapped: runs outside the tensor or the buffer are errors, not clamped copies', () => {
    const p = shm('bad-runs', new Uint8Array(BYTES))
    const t = new HostTensor(p, 0, BYTES, native)
    const host = new Uint8Array(4096)
    expect(() => t.gather([BYTES - 10, 0, 20], host)).toThrow(
      expect.objectContaining({ code: 'ERR_INVALID_ARGUMENT' }),
    )
    expect(() => t.scatter(host, [0, 4000, 200])).toThrow(
      expect.objectContaining({ code: 'ERR_INVALID_ARGUMENT' }),
    )
    expect(readFileSync(p).every((x) => x === 0)).toBe(true)
    t.close()
  })

  it('mapped: a file truncated under the mapping is ERR_IO, not a SIGBUS', () => {
    const p = shm('shrinks', new Uint8Array(BYTES))
    const t = new HostTensor(p, 0, BYTES, native)
    truncateSync(p, 4096)
    expect(() => t.gather([8192, 0, 4096], new Uint8Array(4096))).toThrow(
      expect.objectContaining({ code: 'ERR_IO' }),
    )
    t.close()
  })

  it('close releases the mapping; a failed open holds nothing', () => {
    const start = fileMapStats().mappings
    const t = new HostTensor(shm('release', new Uint8Array(BYTES)), 0, BYTES, native)
    expect(fileMapStats().mappings).toBe(start + 1)
    t.close()
    expect(fileMapStats().mappings).toBe(start)
    expect(() => new HostTensor(join(dir, 'absent'), 0, BYTES, native)).toThrow(
      expect.objectContaining({ code: 'ERR_IO' }),
    )
    expect(fileMapStats().mappings).toBe(start)
  })
})

type Msg = Record<string, unknown>

function client(path: string): Promise<{ call(op: string, f?: Msg): Promise<Msg>; sock: Socket }> {
  return new Promise((resolve, reject) => {
    const sock = connect(path)
    const reader = new FrameReader()
    const waiting = new Map<unknown, (m: Msg) => void>()
    let next = 1
    sock.on('data', (d) => {
      for (const b of reader.push(d)) {
        const m = decodeBody(b) as Msg
        if (!m.event) waiting.get(m.id)?.(m)
      }
    })
    sock.once('error', reject)
    sock.once('connect', () =>
      resolve({
        sock,
        call: (op, f = {}) =>
          new Promise((r) => {
            const id = next++
            waiting.set(id, r)
            sock.write(encodeFrame({ id, op, ...f }))
          }),
      }),
    )
  })
}

describe('agent: registration lifetimes', () => {
  it('mappings are released when the connection ends, and by the agent close', async () => {
    const cfg = resolveAgentConfig(
      { socket: join(dir, 'l.sock'), chunkTokens: 32, maxFrameBytes: 1 << 20, metricsPort: 0 },
      { KVGATE_MEMORY_BYTES: '16MiB' },
    )
    cfg.cache = { ...cfg.cache, native: false, remote: false, disk: false, codecWorkers: 0 }
    const server = await startAgent(cfg, 'test')
    const start = fileMapStats().mappings
    const layer = 2 * 8 * 16 * 2 * 8 * 2
    const path = shm('engine', new Uint8Array(3 * layer))
    const register = async () => {
      const c = await client(join(dir, 'l.sock'))
      const hello = { protocol: 1, model: 'm', hashSeed: '0' }
      const geometry = {
        layout: 'flash-attn',
        dtype: 'float16',
        layers: 3,
        kvHeads: 2,
        headSize: 8,
        blockSize: 16,
      }
      expect(await c.call('hello', { ...hello, geometry })).toMatchObject({ ok: true })
      const tensors = [0, 1, 2].map((l) => ({
        kind: 'shm',
        path,
        offset: l * layer,
        shape: [2, 8, 16, 2, 8],
      }))
      expect(await c.call('register', { rank: 0, numBlocks: 8, tensors })).toMatchObject({ ok: true })
      // A re-registration maps its own tensors; both are held until the connection ends.
      expect(await c.call('register', { rank: 0, numBlocks: 8, tensors })).toMatchObject({ ok: true })
      return c
    }
    try {
      const a = await register()
      expect(fileMapStats().mappings).toBe(start + 6)
      a.sock.destroy()
      for (let i = 0; i < 200 && fileMapStats().mappings !== start; i++)
        await new Promise((r) => setTimeout(r, 5))
      expect(fileMapStats().mappings).toBe(start)
      await register() // left open: the agent's close must release it
      expect(fileMapStats().mappings).toBe(start + 6)
    } finally {
      await server.close()
    }
    expect(fileMapStats().mappings).toBe(start)
  })
})
