// kvgate agent over its real socket: framing, error frames that leave the agent up,
// and save → load through host shared memory for every vLLM layout.

import { randomBytes } from 'node:crypto'
import { mkdtempSync, readdirSync, readFileSync, rmSync, statSync, writeFileSync } from 'node:fs'
import { connect, Socket } from 'node:net'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { newSession } from '../src/agent/agent.ts'
import { hashCount, hashes } from '../src/agent/fields.ts'
import { Agent, AgentServer, resolveAgentConfig, startAgent } from '../src/agent/index.ts'
import { decodeBody, encodeFrame, FrameReader, ownBins } from '../src/agent/protocol.ts'
import { AgentClient as Client, type Msg } from './support/agent-client.ts'

let dir: string
let server: AgentServer

beforeAll(async () => {
  dir = mkdtempSync(join(tmpdir(), 'kvgate-agent-'))
  const cfg = resolveAgentConfig(
    { socket: join(dir, 'a.sock'), chunkTokens: 32, maxFrameBytes: 1 << 20, metricsPort: 0 },
    { KVGATE_MEMORY_BYTES: '64MiB' },
  )
  cfg.cache = { ...cfg.cache, native: false, remote: false, disk: false, codecWorkers: 0 }
  server = await startAgent(cfg, 'test')
})

afterAll(async () => {
  await server?.close()
  rmSync(dir, { recursive: true, force: true })
})

const hello = (layout: string, extra: Msg = {}) => ({
  protocol: 1,
  model: 'test/model',
  hashSeed: '0',
  geometry: { layout, dtype: 'float16', layers: 3, kvHeads: 2, headSize: 8, blockSize: 16, ...extra },
})

describe('agent socket', () => {
  it('is created mode 0600', () => {
    expect(statSync(join(dir, 'a.sock')).mode & 0o777).toBe(0o600)
  })

  it('answers bad frames with error frames and keeps serving', async () => {
    const c = await Client.open(join(dir, 'a.sock'))
    // msgpack for a bare integer: not a map.
    const notMap = Buffer.from([0, 0, 0, 1, 0x05])
    expect(await c.raw(notMap)).toMatchObject({ id: null, ok: false, error: { code: 'ERR_BAD_FRAME' } })
    // 0xc1 is never valid msgpack.
    expect(await c.raw(Buffer.from([0, 0, 0, 1, 0xc1]))).toMatchObject({ error: { code: 'ERR_BAD_FRAME' } })
    expect(await c.call('frobnicate')).toMatchObject({ ok: false, error: { code: 'ERR_UNKNOWN_OP' } })
    expect(await c.call('lookup', { keys: [] })).toMatchObject({ error: { code: 'ERR_HELLO_REQUIRED' } })
    expect(await c.call('hello', { ...hello('flash-attn'), protocol: 99 })).toMatchObject({
      error: { code: 'ERR_PROTOCOL_VERSION' },
    })
    expect(await c.call('hello', hello('flash-attn', { dtype: 'int4' }))).toMatchObject({
      error: { code: 'ERR_GEOMETRY_MISMATCH' },
    })
    // The refusal says what to change, and where.
    expect(await c.call('hello', hello('flash-attn', { blockSize: 24 }))).toMatchObject({
      error: {
        code: 'ERR_GEOMETRY_MISMATCH',
        message: expect.stringMatching(
          /not a whole number of 24-token blocks: start the agent with --chunk-tokens \(KVGATE_CHUNK_TOKENS\) a multiple of the engine's block size, e\.g\. \d+/,
        ),
      },
    })
    expect(await c.call('ping')).toMatchObject({ ok: true })
    // An oversized length cannot be resynchronised: an error frame, then this connection closes.
    const big = Buffer.alloc(4)
    big.writeUInt32BE(64 << 20)
    expect(await c.raw(big)).toMatchObject({ error: { code: 'ERR_FRAME_TOO_LARGE' } })
    for (let i = 0; i < 100 && !c.closed; i++) await new Promise((r) => setTimeout(r, 10))
    expect(c.closed).toBe(true)
    const d = await Client.open(join(dir, 'a.sock'))
    expect(await d.call('ping')).toMatchObject({ ok: true })
    const st = (await d.call('stats')) as Msg
    expect(st.badFrames).toBeGreaterThanOrEqual(3)
    d.close()
  })

  it('msgpack extension values (bigint, date, references, typed arrays) or deep nesting are ERR_BAD_FRAME naming the id, never ERR_INTERNAL', async () => {
    const c = await Client.open(join(dir, 'a.sock'))
    expect(await c.call('hello', hello('flash-attn'))).toMatchObject({ ok: true })
    const path = join(dir, 'kv-ext')
    writeFileSync(path, Buffer.alloc(2 * 8 * 16 * 2 * 8 * 2 * 3))
    // A request encoded with `MARK` strings, each replaced by raw msgpack bytes (values are
    // self-delimiting: the enclosing map and array counts stay right).
    const frame = (id: number, fields: Msg, raw: Buffer): Buffer => {
      const body = encodeFrame({ id, op: 'register', rank: 0, numBlocks: 8, ...fields }).subarray(4)
      const mark = encodeFrame('MARK').subarray(4)
      const at = body.indexOf(mark)
      expect(at).toBeGreaterThan(0)
      const out = Buffer.concat([body.subarray(0, at), raw, body.subarray(at + mark.length)])
      const len = Buffer.alloc(4)
      len.writeUInt32BE(out.length)
      return Buffer.concat([len, out])
    }
    const tensor = (shape: unknown, strides?: unknown) =>
      [0, 1, 2].map((l) => ({ kind: 'shm', path, offset: l * 4096, shape, strides }))
    const bigint = Buffer.from([0xd4, 0x42, 0x02]) // ext 0x42: the bigint 2n
    const date = Buffer.from([0xd6, 0xff, 0, 0, 0, 1]) // the timestamp extension
    const typed = Buffer.from([0xc7, 0x09, 0x74, 0x08, 0, 0, 0, 0, 0, 0, 0, 0x40]) // Float64Array [2]
    // A cycle through msgpackr's reference extensions: shape = [2, 8, 16, 2, <shape itself>].
    const cycle = Buffer.from([0xd6, 0x69, 0, 0, 0, 1, 0x95, 0x02, 0x08, 0x10, 0x02, 0xd6, 0x70, 0, 0, 0, 1])
    const deep = Buffer.concat([Buffer.alloc(40, 0x91), Buffer.from([0x01])])
    const cases: [string, Buffer][] = [
      ['bigint in shape', frame(901, { tensors: tensor([2, 'MARK', 16, 2, 8]) }, bigint)],
      [
        'bigint in strides',
        frame(902, { tensors: tensor([2, 8, 16, 2, 8], [256, 'MARK', 16, 8, 1]) }, bigint),
      ],
      ['date as shape', frame(903, { tensors: tensor('MARK') }, date)],
      ['typed array as shape', frame(904, { tensors: tensor('MARK') }, typed)],
      ['cyclic shape', frame(905, { tensors: tensor('MARK') }, cycle)],
      ['nested 40 deep', frame(906, { extra: 'MARK', tensors: [] }, deep)],
    ]
    for (const [what, bytes] of cases) {
      const r = await c.raw(bytes)
      expect(r, what).toMatchObject({ ok: false, error: { code: 'ERR_BAD_FRAME' } })
      // The id is named when the envelope could be read (the reference extensions are refused while decoding).
      if (what !== 'cyclic shape') expect(r.id, what).toBe(900 + cases.findIndex(([w]) => w === what) + 1)
    }
    expect(await c.call('ping')).toMatchObject({ ok: true })
    c.close()
  })

  it('a field a msgpackr client leaves undefined (its fixext 0, no extension a request can misuse) is absent, as nil is', async () => {
    const c = await Client.open(join(dir, 'a.sock'))
    expect(await c.call('hello', hello('flash-attn'))).toMatchObject({ ok: true })
    const path = join(dir, 'kv-undefined')
    writeFileSync(path, Buffer.alloc(2 * 8 * 16 * 2 * 8 * 2 * 3))
    // encodeFrame is msgpackr's: `strides: undefined` goes out as d4 00 00, not left out.
    expect(
      encodeFrame({ strides: undefined })
        .subarray(4)
        .includes(Buffer.from([0xd4, 0, 0])),
    ).toBe(true)
    const tensors = [0, 1, 2].map((l) => ({
      kind: 'shm',
      path,
      offset: l * 2 * 8 * 16 * 2 * 8 * 2,
      shape: [2, 8, 16, 2, 8],
      strides: undefined,
    }))
    const r = await c.call('register', { rank: 0, numBlocks: 8, tensors, pciBusId: undefined })
    expect(r).toMatchObject({ ok: true })
    expect(
      await c.call('lookup', { worker: r.worker, keys: [randomBytes(32)], timeoutMs: undefined }),
    ).toMatchObject({
      ok: true,
      chunks: 0,
    })
    c.close()
  })

  it('a client that goes on sending after an oversized length (its write side open) is answered once and closed; what it sends after is dropped', async () => {
    const c = connect({ path: join(dir, 'a.sock'), allowHalfOpen: true })
    await new Promise((r) => c.once('connect', r))
    const got: Msg[] = []
    const reader = new FrameReader()
    c.on('data', (d) => {
      for (const b of reader.push(d)) got.push(decodeBody(b) as Msg)
    })
    c.on('error', () => {})
    const closed = new Promise((r) => c.once('close', r))
    const big = Buffer.alloc(4)
    big.writeUInt32BE(64 << 20)
    const before = server.agent.metrics.badFrames
    c.write(big)
    // It keeps writing (frames the agent must no longer buffer behind the bad length, nor answer).
    const more = Buffer.alloc(256 * 1024)
    for (let i = 0; i < 20 && !c.destroyed; i++) {
      c.write(more)
      await new Promise((r) => setTimeout(r, 20))
    }
    await Promise.race([closed, new Promise((r) => setTimeout(r, 2000))])
    expect(c.destroyed).toBe(true)
    expect(got).toMatchObject([{ id: null, ok: false, error: { code: 'ERR_FRAME_TOO_LARGE' } }])
    expect(server.agent.metrics.badFrames).toBe(before + 1)
  })

  it('frames read before an oversized length in the same read are answered (at once and later ones) before the error and the close', async () => {
    const c = connect({ path: join(dir, 'a.sock') })
    await new Promise((r) => c.once('connect', r))
    const got: Msg[] = []
    const reader = new FrameReader()
    c.on('data', (d) => {
      for (const b of reader.push(d)) got.push(decodeBody(b) as Msg)
    })
    c.on('error', () => {})
    const closed = new Promise((r) => c.once('close', r))
    const big = Buffer.alloc(4)
    big.writeUInt32BE(64 << 20)
    // ping answers at once; stats and flush answer through a promise (a later tick).
    c.write(
      Buffer.concat([
        encodeFrame({ id: 1, op: 'ping' }),
        encodeFrame({ id: 2, op: 'stats' }),
        encodeFrame({ id: 3, op: 'flush' }),
        encodeFrame({ id: 4, op: 'ping' }),
        big,
      ]),
    )
    await Promise.race([closed, new Promise((r) => setTimeout(r, 3000))])
    expect(c.destroyed).toBe(true)
    const answered = got.filter((m) => m.id !== null)
    expect(answered.map((m) => m.id).sort()).toEqual([1, 2, 3, 4])
    expect(answered.every((m) => m.ok === true)).toBe(true)
    // The refusal is the last frame: nothing of this connection is answered after it.
    expect(got.at(-1)).toMatchObject({ id: null, ok: false, error: { code: 'ERR_FRAME_TOO_LARGE' } })
  })

  it('agentMs ends with the answer encoded: an answer sent at once is timed before its socket write', async () => {
    const c = await Client.open(join(dir, 'a.sock'))
    expect(await c.call('hello', hello('flash-attn'))).toMatchObject({ ok: true })
    await c.call('lookup', { keys: [randomBytes(32)] }) // opens the space: later lookups answer at once
    const log: string[] = []
    const metrics = server.agent.metrics
    const took = metrics.took
    const write = Socket.prototype.write
    metrics.took = (op: string, ms: number) => {
      log.push(`took ${op}`)
      took.call(metrics, op, ms)
    }
    Socket.prototype.write = function (this: Socket, ...a: unknown[]) {
      if (this !== c.sock) log.push('write')
      return (write as (...x: unknown[]) => boolean).apply(this, a)
    } as typeof write
    try {
      expect(await c.call('lookup', { keys: [randomBytes(32)] })).toMatchObject({ ok: true, chunks: 0 })
    } finally {
      Socket.prototype.write = write
      metrics.took = took
    }
    expect(log).toEqual(['took lookup', 'write'])
    c.close()
  })

  it('serves Prometheus metrics on loopback', async () => {
    const res = await fetch(`http://127.0.0.1:${server.metricsPort}/metrics`)
    expect(res.status).toBe(200)
    const text = await res.text()
    expect(text).toMatch(/^kvgate_agent_requests_total \d+$/m)
    expect(text).toMatch(/^kvgate_agent_bad_frames_total [1-9]\d*$/m)
    expect(text).toContain('kvgate_agent_errors_total{code="ERR_UNKNOWN_OP"} 1')
    expect((await fetch(`http://127.0.0.1:${server.metricsPort}/nope`)).status).toBe(404)
    // Time inside the agent per timed op (counted once answered; the packed-keys test checks the figures).
    expect(text).toMatch(/^kvgate_agent_request_seconds\{op="lookup",quantile="0.99"\} [\d.e-]+$/m)
    expect(text).toMatch(/^kvgate_agent_request_seconds_count\{op="lookup"\} \d+$/m)
    expect(text).toContain('kvgate_agent_request_seconds_count{op="save"}')
  })

  it('refuses a second agent on a live socket', async () => {
    const cfg = resolveAgentConfig({ socket: join(dir, 'a.sock') }, {})
    await expect(startAgent(cfg, 'test')).rejects.toThrow(/another agent/)
  })

  it('frames in one write are each answered once, by id, whether they answer at once or wait', async () => {
    const c = await Client.open(join(dir, 'a.sock'))
    const frames: Buffer[] = []
    const want: [number, Msg][] = [
      [1, { ok: true }], // ping: at once
      [2, { ok: true, connections: expect.any(Number) }], // stats: a promise
      [3, { ok: false, error: { code: 'ERR_UNKNOWN_OP' } }], // refused at once (thrown)
      [4, { ok: false, error: { code: 'ERR_HELLO_REQUIRED' } }], // lookup before hello
      [5, { ok: true, protocol: 1 }], // hello: at once
      [6, { ok: true, chunks: 0 }], // lookup after it: at once
      [7, { ok: true }], // flush: a promise
    ]
    const ops = ['ping', 'stats', 'frobnicate', 'lookup', 'hello', 'lookup', 'flush']
    const fields: Msg[] = [{}, {}, {}, { keys: [] }, hello('flash-attn'), { keys: [randomBytes(32)] }, {}]
    for (let i = 0; i < ops.length; i++) frames.push(encodeFrame({ id: i + 1, op: ops[i], ...fields[i] }))
    frames.push(Buffer.from([0, 0, 0, 1, 0x05])) // not a map: an error frame without an id
    const got = new Map<unknown, Msg[]>()
    const reader = new FrameReader()
    const all = new Promise<void>((resolve) => {
      c.sock.on('data', (d) => {
        for (const b of reader.push(d)) {
          const m = decodeBody(b) as Msg
          got.set(m.id, [...(got.get(m.id) ?? []), m])
        }
        if (got.size === want.length + 1) resolve()
      })
    })
    c.sock.write(Buffer.concat(frames))
    await all
    for (const [id, m] of want) {
      expect(got.get(id)).toHaveLength(1)
      expect(got.get(id)![0]).toMatchObject(m)
    }
    expect(got.get(null)).toMatchObject([{ ok: false, error: { code: 'ERR_BAD_FRAME' } }])
    expect(await c.call('ping')).toMatchObject({ ok: true })
    c.close()
  })

  it('a client that sends without reading its answers: the agent stops reading it, then answers every request once it reads', async () => {
    const path = join(dir, 'unread.sock')
    const agent = new Agent({ chunkTokens: 32, cache: {}, lookupDeadlineMs: 250, version: 't' })
    const srv = await AgentServer.listen(agent, {
      socketPath: path,
      maxFrameBytes: 1 << 20,
      maxUnsentBytes: 64 * 1024,
    })
    const sock = connect(path)
    await new Promise((r) => sock.once('connect', r))
    sock.pause() // reads nothing: every answer stays in the agent's socket
    const n = 100_000 // ~2 MB of pings, ~1.7 MB of answers: far past 64 KiB and the kernel's socket buffers
    sock.write(Buffer.concat(Array.from({ length: n }, (_, i) => encodeFrame({ id: i + 1, op: 'ping' }))))
    // The agent reads until its unsent answers pass the bound, then waits: the count stops short of n.
    let seen = -1
    for (let i = 0; i < 400 && agent.metrics.requests !== seen && agent.metrics.requests < n; i++) {
      seen = agent.metrics.requests
      await new Promise((r) => setTimeout(r, 100))
    }
    expect(agent.metrics.requests).toBeLessThan(n)
    // Once the client reads, the agent reads on: every request answered exactly once, in order.
    const reader = new FrameReader()
    let next = 1
    const all = new Promise<void>((resolve, reject) => {
      sock.on('data', (d) => {
        for (const b of reader.push(d)) {
          const m = decodeBody(b) as Msg
          if (m.id !== next || m.ok !== true)
            reject(new Error(`answer ${JSON.stringify(m)} where id ${next} was due`))
          next++
        }
        if (next > n) resolve()
      })
    })
    sock.resume()
    await all
    expect(agent.metrics.requests).toBe(n)
    sock.destroy()
    await srv.close()
  }, 60_000)

  it('answer(): ping, hello, poll and a local lookup are plain bodies (no promise); a refusal throws at once', async () => {
    const agent = server.agent
    const s = newSession(() => {})
    expect(agent.answer(s, { id: 1, op: 'ping' })).toEqual({})
    expect(() => agent.answer(s, { id: 2, op: 'lookup', keys: [] })).toThrow(/hello/)
    await expect(agent.handle(s, { id: 2, op: 'lookup', keys: [] })).rejects.toMatchObject({
      code: 'ERR_HELLO_REQUIRED',
    })
    expect(agent.answer(s, { id: 3, op: 'hello', ...hello('flash-attn') })).toMatchObject({ protocol: 1 })
    expect(agent.answer(s, { id: 4, op: 'poll', ids: [9] })).toEqual({
      states: { '9': { state: 'unknown' } },
    })
    // The space opens with the first lookup (a promise); once open, a lookup the local tiers answer is a body.
    await agent.answer(s, { id: 5, op: 'lookup', keys: [randomBytes(32)] })
    const r = agent.answer(s, { id: 6, op: 'lookup', keys: [randomBytes(32)] })
    expect(r).not.toBeInstanceOf(Promise)
    expect(r).toMatchObject({ chunks: 0, source: 'all' })
    expect(() => agent.answer(s, { id: 7, op: 'frobnicate' })).toThrow(/unknown op/)
    expect(agent.answer(s, { id: 8, op: 'stats' })).toBeInstanceOf(Promise)
    agent.endSession(s)
  })

  it('lookup of unknown keys is 0 and a load of them reports every block failed', async () => {
    const c = await Client.open(join(dir, 'a.sock'))
    // Its pid: the connector checks the pidfd it opened from the socket names this process.
    expect(await c.call('hello', hello('flash-attn'))).toMatchObject({
      ok: true,
      blocksPerChunk: 2,
      pid: process.pid,
    })
    const path = join(dir, 'kv-miss')
    writeFileSync(path, Buffer.alloc(2 * 8 * 16 * 2 * 8 * 2 * 3))
    const tensors = [0, 1, 2].map((l) => ({
      kind: 'shm',
      path,
      offset: l * 2 * 8 * 16 * 2 * 8 * 2,
      shape: [2, 8, 16, 2, 8],
    }))
    const r = await c.call('register', { rank: 0, numBlocks: 8, tensors })
    expect(r).toMatchObject({ ok: true })
    const keys = [randomBytes(32)]
    expect(await c.call('lookup', { keys })).toMatchObject({ ok: true, chunks: 0, tokens: 0 })
    const load = await c.call('load', { worker: r.worker, keys, blockIds: [3, 5] })
    expect(load).toMatchObject({ ok: true, chunks: 0, failedBlocks: [3, 5] })
    expect(readFileSync(path).every((b) => b === 0)).toBe(true)
    expect(await c.call('load', { worker: r.worker, keys, blockIds: [3, 8] })).toMatchObject({
      error: { code: 'ERR_INVALID_ARGUMENT' },
    })
    expect(await c.call('load', { worker: 99, keys, blockIds: [3, 4] })).toMatchObject({
      error: { code: 'ERR_NOT_REGISTERED' },
    })
    c.close()
  })

  it('a block id twice among the blocks a load fills or a save stores is ERR_INVALID_ARGUMENT before any copy; repeats a load skips (null blocks) or a save does not store are not', async () => {
    const c = await Client.open(join(dir, 'a.sock'))
    expect(await c.call('hello', hello('flash-attn'))).toMatchObject({ ok: true, blocksPerChunk: 2 })
    const path = join(dir, 'kv-dup')
    const layer = 2 * 8 * 16 * 2 * 8 * 2
    writeFileSync(path, randomBytes(layer * 3))
    const tensors = [0, 1, 2].map((l) => ({ kind: 'shm', path, offset: l * layer, shape: [2, 8, 16, 2, 8] }))
    const { worker } = await c.call('register', { rank: 0, numBlocks: 8, tensors })
    const keys = Buffer.concat([randomBytes(32), randomBytes(32)])
    // Two saves of one chunk each: the same block as both halves of a chunk would store it twice.
    for (const blockIds of [
      [1, 1, 2, 3],
      [1, 2, 3, 1],
    ]) {
      expect(await c.call('save', { worker, keys, blockIds })).toMatchObject({
        ok: false,
        error: { code: 'ERR_INVALID_ARGUMENT', message: expect.stringMatching(/block 1 .*twice/) },
      })
    }
    expect(await c.call('lookup', { keys })).toMatchObject({ ok: true, chunks: 0 })
    // Chunks before `from` are only the chain: their block ids are not read.
    expect(await c.call('save', { worker, keys, blockIds: [1, 1, 2, 3], from: 1 })).toMatchObject({
      ok: true,
    })
    expect(await c.call('save', { worker, keys, blockIds: [4, 5, 2, 3] })).toMatchObject({
      ok: true,
      stored: 1,
    })
    const before = readFileSync(path)
    // A load writing one block from two places: racing copies, whichever lands last wins.
    expect(await c.call('load', { worker, keys, blockIds: [6, 7, 7, 4] })).toMatchObject({
      ok: false,
      error: { code: 'ERR_INVALID_ARGUMENT', message: expect.stringMatching(/block 7 .*twice/) },
    })
    expect(readFileSync(path).equals(before)).toBe(true)
    // vLLM's null block repeated in the blocks the engine already holds (skipped): loaded.
    expect(await c.call('load', { worker, keys, blockIds: [0, 0, 6, 7], skipBlocks: 2 })).toMatchObject({
      ok: true,
      chunks: 2,
      failedBlocks: [],
    })
    c.close()
  })

  it('a connection holds at most 8 registrations and 4096 tensors (open files, mappings): past them ERR_LIMIT, nothing opened; another connection registers', async () => {
    const fds = () => readdirSync('/proc/self/fd').length
    const layer = 2 * 8 * 16 * 2 * 8 * 2
    const path = join(dir, 'kv-cap')
    writeFileSync(path, Buffer.alloc(layer * 3))
    const tensors = [0, 1, 2].map((l) => ({ kind: 'shm', path, offset: l * layer, shape: [2, 8, 16, 2, 8] }))
    const c = await Client.open(join(dir, 'a.sock'))
    expect(await c.call('hello', hello('flash-attn'))).toMatchObject({ ok: true })
    // Sent at once: registrations in flight count too.
    const all = await Promise.all(
      Array.from({ length: 10 }, () => c.call('register', { rank: 0, numBlocks: 8, tensors })),
    )
    expect(all.filter((r) => r.ok).length).toBe(8)
    const open = fds()
    const refused = await c.call('register', { rank: 0, numBlocks: 8, tensors })
    expect(refused).toMatchObject({
      ok: false,
      error: { code: 'ERR_LIMIT', message: expect.stringMatching(/8 registrations/) },
    })
    expect(all.filter((r) => !r.ok)).toEqual([
      expect.objectContaining({ error: expect.objectContaining({ code: 'ERR_LIMIT' }) }),
      expect.objectContaining({ error: expect.objectContaining({ code: 'ERR_LIMIT' }) }),
    ])
    expect(fds()).toBe(open)
    const d = await Client.open(join(dir, 'a.sock'))
    expect(await d.call('hello', hello('flash-attn'))).toMatchObject({ ok: true })
    expect(await d.call('register', { rank: 0, numBlocks: 8, tensors })).toMatchObject({ ok: true })
    c.close()
    d.close()
    // Tensors: a 1024-layer model registers 4 times on one connection (4096 files), not 5.
    const big = join(dir, 'kv-cap-big')
    const small = 2 * 1 * 1 * 1 * 1 * 2 // [2, 1 block, 1 token, 1 head, 1 dim] of fp16
    writeFileSync(big, Buffer.alloc(small * 1024))
    const many = Array.from({ length: 1024 }, (_, l) => ({
      kind: 'shm',
      path: big,
      offset: l * small,
      shape: [2, 1, 1, 1, 1],
    }))
    const e = await Client.open(join(dir, 'a.sock'))
    const geometry = { layers: 1024, kvHeads: 1, headSize: 1, blockSize: 1 }
    const h = await e.call('hello', { ...hello('flash-attn', geometry), model: 'test/deep' })
    expect(h).toMatchObject({ ok: true })
    for (let i = 0; i < 4; i++)
      expect(await e.call('register', { rank: 0, numBlocks: 1, tensors: many })).toMatchObject({ ok: true })
    expect(await e.call('register', { rank: 0, numBlocks: 1, tensors: many })).toMatchObject({
      ok: false,
      error: { code: 'ERR_LIMIT', message: expect.stringMatching(/4096 tensors/) },
    })
    e.close()
  })

  it('packed keys: a bin that is not 32·n bytes (or holds too many) is an error frame, in every op', async () => {
    const c = await Client.open(join(dir, 'a.sock'))
    expect(await c.call('hello', hello('flash-attn'))).toMatchObject({ ok: true })
    const path = join(dir, 'kv-packed')
    writeFileSync(path, Buffer.alloc(2 * 8 * 16 * 2 * 8 * 2 * 3))
    const tensors = [0, 1, 2].map((l) => ({
      kind: 'shm',
      path,
      offset: l * 2 * 8 * 16 * 2 * 8 * 2,
      shape: [2, 8, 16, 2, 8],
    }))
    const { worker } = await c.call('register', { rank: 0, numBlocks: 8, tensors })
    const bad = [randomBytes(31), randomBytes(33), randomBytes(65), randomBytes(1)]
    for (const keys of bad) {
      for (const [op, extra] of [
        ['lookup', {}],
        ['load', { worker, blockIds: [1, 2] }],
        ['save', { worker, blockIds: [1, 2] }],
      ] as const) {
        const r = await c.call(op, { keys, ...extra })
        expect(r, `${op} with ${keys.length} bytes`).toMatchObject({
          ok: false,
          error: { code: 'ERR_INVALID_ARGUMENT', message: expect.stringMatching(/multiple of 32 bytes/) },
        })
      }
    }
    // More hashes than the op takes (the frame limit of this agent is below 65 536 keys).
    expect(() => hashes({ keys: Buffer.alloc(96) }, 'keys', 2)).toThrow(/at most 2 hashes/)
    expect(hashCount(hashes({ keys: Buffer.alloc(64) }, 'keys', 2))).toBe(2)
    // Empty is zero keys, as an empty array is.
    expect(await c.call('lookup', { keys: Buffer.alloc(0) })).toMatchObject({ ok: true, chunks: 0 })
    // A packed save and load move the same bytes the array form does (block ids 1,2 -> 5,6).
    writeFileSync(path, randomBytes(2 * 8 * 16 * 2 * 8 * 2 * 3))
    const keys = randomBytes(32)
    expect(await c.call('save', { worker, keys, blockIds: [1, 2] })).toMatchObject({ ok: true, stored: 1 })
    expect(await c.call('load', { worker, keys: [keys], blockIds: [5, 6] })).toMatchObject({
      ok: true,
      chunks: 1,
    })
    const kv = readFileSync(path)
    const block = 16 * 2 * 8 * 2
    for (let l = 0; l < 3; l++)
      for (let side = 0; side < 2; side++)
        for (const [from, to] of [
          [1, 5],
          [2, 6],
        ] as const) {
          const at = (b: number) => l * 2 * 8 * block + (side * 8 + b) * block
          expect(kv.subarray(at(to), at(to) + block).equals(kv.subarray(at(from), at(from) + block))).toBe(
            true,
          )
        }
    const st = (await c.call('stats')) as Msg
    expect(st.packedKeyRequests).toBeGreaterThan(0)
    const agentMs = st.agentMs as Record<string, { p50: number; p99: number; samples: number }>
    for (const op of ['lookup', 'load', 'save']) {
      expect(agentMs[op]!.samples, op).toBeGreaterThan(0)
      expect(agentMs[op]!.p99).toBeGreaterThanOrEqual(agentMs[op]!.p50)
      expect(agentMs[op]!.p50).toBeGreaterThan(0)
    }
    expect(await c.call('ping')).toMatchObject({ ok: true })
    c.close()
  })

  for (const layout of ['flash-attn', 'flashinfer', 'mla'] as const) {
    it(`${layout}: save from some blocks, load into others, bytes equal`, async () => {
      const numBlocks = 12
      const heads = layout === 'mla' ? 1 : 2
      const head = layout === 'mla' ? 16 : 8
      const sides = layout === 'mla' ? 1 : 2
      const bb = 16 * heads * head * 2
      const layerBytes = sides * numBlocks * bb
      const shape =
        layout === 'flash-attn'
          ? [2, numBlocks, 16, heads, head]
          : layout === 'flashinfer'
            ? [numBlocks, 2, 16, heads, head]
            : [numBlocks, 16, head]
      const engine = async (name: string, fill: boolean) => {
        const path = join(dir, `${layout}-${name}`)
        writeFileSync(path, fill ? randomBytes(3 * layerBytes) : Buffer.alloc(3 * layerBytes))
        const c = await Client.open(join(dir, 'a.sock'))
        const g = hello(layout, { kvHeads: heads, headSize: head })
        expect(await c.call('hello', { ...g, model: `m-${layout}` })).toMatchObject({ ok: true })
        const tensors = [0, 1, 2].map((l) => ({ kind: 'shm', path, offset: l * layerBytes, shape }))
        const r = await c.call('register', { rank: 0, numBlocks, tensors })
        expect(r.ok).toBe(true)
        return { c, path, worker: r.worker }
      }
      const blockAt = (buf: Buffer, layer: number, side: number, b: number) => {
        const off =
          layout === 'flash-attn'
            ? (side * numBlocks + b) * bb
            : layout === 'flashinfer'
              ? (b * 2 + side) * bb
              : b * bb
        return buf.subarray(layer * layerBytes + off, layer * layerBytes + off + bb)
      }
      const a = await engine('a', true)
      const keys = [randomBytes(32), randomBytes(32)]
      const src = [7, 2, 9, 0]
      const saved = await a.c.call('save', { worker: a.worker, keys, blockIds: src })
      expect(saved).toMatchObject({ ok: true, chunks: 2, stored: 2 })
      const b = await engine('b', false)
      expect(await b.c.call('lookup', { keys })).toMatchObject({ chunks: 2, tokens: 64 })
      // The packed form (one bin of 32·n bytes) names the same chunks.
      const packed = Buffer.concat(keys)
      expect(await b.c.call('lookup', { keys: packed })).toMatchObject({ chunks: 2, tokens: 64 })
      expect(await b.c.call('lookup', { keys: packed.subarray(0, 32) })).toMatchObject({ chunks: 1 })
      expect(await b.c.call('lookup', { keys: Buffer.concat([randomBytes(32), packed]) })).toMatchObject({
        chunks: 0,
      })
      const dst = [1, 11, 4, 5]
      const loaded = await b.c.call('load', { worker: b.worker, keys, blockIds: dst })
      expect(loaded).toMatchObject({ ok: true, chunks: 2, failedBlocks: [] })
      // Progress names growing layer prefixes (copies may finish out of order: a prefix can
      // grow by several layers at once), ending with every layer, before the answer.
      const progress = b.c.events.filter((e) => e.event === 'load-progress').map((e) => e.layers as number)
      expect(progress.length).toBeGreaterThanOrEqual(1)
      expect(progress.length).toBeLessThanOrEqual(3)
      expect(progress).toEqual([...progress].sort((x, y) => x - y))
      expect(new Set(progress).size).toBe(progress.length)
      expect(progress.at(-1)).toBe(3)
      const A = readFileSync(a.path)
      const B = readFileSync(b.path)
      for (let layer = 0; layer < 3; layer++)
        for (let side = 0; side < sides; side++)
          for (let i = 0; i < 4; i++) {
            expect(blockAt(B, layer, side, dst[i]!).equals(blockAt(A, layer, side, src[i]!))).toBe(true)
          }
      // Blocks nobody loaded into stay untouched.
      expect(blockAt(B, 0, 0, 3).every((x) => x === 0)).toBe(true)
      a.c.close()
      b.c.close()
    })
  }

  it("vLLM's per-layer views that cannot be copied right are ERR_LAYOUT at register, nothing held; a right one then registers", async () => {
    // [blocks, heads, block_size, K|V] views (vLLM from 0.26), NHD pages, 3 layers in one file.
    const numBlocks = 6
    const C = 2 * 8
    const page = 2 * 16 * C * 2
    const path = join(dir, 'views')
    writeFileSync(path, Buffer.alloc(3 * numBlocks * page))
    const c = await Client.open(join(dir, 'a.sock'))
    expect(
      await c.call('hello', { ...hello('flash-attn', { kvHeads: 2, headSize: 8 }), model: 'm-views' }),
    ).toMatchObject({
      ok: true,
    })
    const nhd = [16 * 2 * C, C, 2 * C, 1]
    const view = (l: number, over: Msg = {}) => ({
      kind: 'shm',
      path,
      offset: l * numBlocks * page,
      shape: [numBlocks, 2, 16, C],
      strides: nhd,
      ...over,
    })
    const refused = async (tensors: Msg[], why: RegExp) => {
      const r = await c.call('register', { rank: 0, numBlocks, tensors })
      expect(r).toMatchObject({ ok: false, error: { code: 'ERR_LAYOUT' } })
      expect((r.error as { message: string }).message).toMatch(why)
    }
    // Two heads on one place; K|V not contiguous; a layer unlike the others; a layer running
    // past the file; a shape whose block size is no divisor of 16; heads the hello did not say.
    await refused([view(0, { strides: [16 * 2 * C, 0, 2 * C, 1] }), view(1), view(2)], /overlap/)
    await refused([view(0, { strides: [16 * 2 * C, C, 2 * C, 2] }), view(1), view(2)], /contiguous run/)
    await refused([view(0), view(1, { strides: [16 * 2 * C, 16 * C, C, 1] }), view(2)], /laid out alike/)
    await refused([view(0), view(1), view(3)], /bytes; the tensor needs/)
    await refused([view(0, { shape: [numBlocks * 3, 2, 5, C] }), view(1), view(2)], /has shape/)
    await refused([view(0, { shape: [numBlocks, 4, 16, C] }), view(1), view(2)], /has shape/)
    // Nothing of the refused ones is held: 8 registrations still fit on this connection.
    for (let i = 0; i < 8; i++)
      expect(
        await c.call('register', { rank: 0, numBlocks, tensors: [0, 1, 2].map((l) => view(l)) }),
      ).toMatchObject({
        ok: true,
        blocksPerChunk: 2,
      })
    c.close()
  })
})

describe('FrameReader', () => {
  const framed = (body: Buffer) => {
    const len = Buffer.alloc(4)
    len.writeUInt32BE(body.length)
    return Buffer.concat([len, body])
  }
  // Bodies of every size class: empty, small, and past the first capacity of a spanning body (64 KiB).
  const bodies = [0, 1, 3, 4, 5, 100, 65_535, 65_536, 65_537, 300_000].map((n) => randomBytes(n))
  const stream = Buffer.concat(bodies.map(framed))

  it('any cut of the stream into reads gives back exactly the frames', () => {
    let seed = 7
    const rand = (n: number) => {
      seed = (seed * 1103515245 + 12345) >>> 0
      return seed % n
    }
    const cuts: [string, () => number][] = [
      ['1-byte reads', () => 1],
      ['2-byte reads', () => 2],
      ['3-byte reads', () => 3],
      ['random reads up to 16', () => 1 + rand(16)],
      ['random reads up to 100 000', () => 1 + rand(100_000)],
      ['one read', () => stream.length],
    ]
    for (const [what, next] of cuts) {
      const reader = new FrameReader(1 << 20)
      const got: Buffer[] = []
      for (let at = 0; at < stream.length; ) {
        const n = Math.min(next(), stream.length - at)
        // Each read its own buffer, as a socket's are.
        got.push(...reader.push(Buffer.from(stream.subarray(at, at + n))))
        at += n
      }
      expect(got.length, what).toBe(bodies.length)
      for (let i = 0; i < bodies.length; i++)
        expect(got[i]!.equals(bodies[i]!), `${what}: body ${i}`).toBe(true)
      expect(reader.error).toBeUndefined()
    }
  })

  it('holds no read once push returns: a frame spanning reads is copied, not kept as one buffer per read', () => {
    // A frame trickled in 1-byte reads was held as 1-byte Buffers (some 250 bytes each: gigabytes
    // for one 16 MiB frame). Reads overwritten after push show whether the reader kept them.
    const body = randomBytes(5000)
    const bytes = framed(body)
    const reader = new FrameReader()
    const got: Buffer[] = []
    for (let i = 0; i < bytes.length; i++) {
      const read = Buffer.from([bytes[i]!])
      got.push(...reader.push(read))
      read[0] = read[0]! ^ 0xff
    }
    expect(got).toHaveLength(1)
    expect(got[0]!.equals(body)).toBe(true)
  })

  it('reuse: reads into one buffer, any cut, the bodies of each push intact until the next push (the buffer a spanning frame was assembled in is reused only after)', () => {
    let seed = 3
    const rand = (n: number) => {
      seed = (seed * 1103515245 + 12345) >>> 0
      return (seed >>> 8) % n
    }
    // Small frames too, so that one push completes a spanning frame, then holds whole ones, then starts another.
    const small = Array.from({ length: 200 }, (_, i) => randomBytes(1 + ((i * 37) % 300)))
    const all = [...bodies, ...small, ...bodies.slice(0, 6)]
    const bytes = Buffer.concat(all.map(framed))
    for (const max of [7, 64, 700, 70_000]) {
      const reader = new FrameReader(1 << 20, { reuse: true })
      const read = Buffer.alloc(70_000)
      let i = 0
      for (let at = 0; at < bytes.length; ) {
        const n = Math.min(1 + rand(max), bytes.length - at)
        bytes.copy(read, 0, at, at + n)
        at += n
        const got = reader.push(read.subarray(0, n))
        // Compared once push has returned, as the server decodes them: none overwritten by a later one.
        for (const b of got) {
          expect(b.equals(all[i]!), `reads up to ${max}: body ${i}`).toBe(true)
          i++
        }
        read.fill(0xee)
      }
      expect(i).toBe(all.length)
    }
  })

  it('ownBins: every bin of a request, in maps and arrays at any depth, becomes bytes of its own', () => {
    const frame = randomBytes(96)
    const msg = {
      id: 1,
      op: 'register',
      keys: frame.subarray(0, 32),
      list: [frame.subarray(32, 48), 5, { handle: frame.subarray(48, 64), deep: [[frame.subarray(64, 96)]] }],
    }
    const want = structuredClone({
      keys: [...msg.keys],
      a: [...frame.subarray(32, 48)],
      h: [...frame.subarray(48, 64)],
    })
    ownBins(msg)
    frame.fill(0)
    expect([...msg.keys]).toEqual(want.keys)
    expect([...(msg.list[0] as Buffer)]).toEqual(want.a)
    const nested = msg.list[2] as { handle: Buffer; deep: Buffer[][] }
    expect([...nested.handle]).toEqual(want.h)
    expect(nested.deep[0]![0]!.every((b) => b === 0)).toBe(false)
    expect(Buffer.isBuffer(msg.keys)).toBe(true)
    expect(msg.list[1]).toBe(5)
  })

  it('an oversized length: the frames before it, then ERR_FRAME_TOO_LARGE, then nothing', () => {
    const reader = new FrameReader(1000)
    const big = Buffer.alloc(4)
    big.writeUInt32BE(1001)
    const got = reader.push(Buffer.concat([framed(bodies[5]!), framed(bodies[0]!), big.subarray(0, 2)]))
    expect(got.map((b) => b.length)).toEqual([100, 0])
    expect(reader.error).toBeUndefined()
    expect(reader.push(Buffer.concat([big.subarray(2), framed(bodies[1]!)]))).toEqual([])
    expect(reader.error?.code).toBe('ERR_FRAME_TOO_LARGE')
    expect(reader.push(framed(bodies[1]!))).toEqual([])
    // A length of exactly the limit is a frame.
    const at = new FrameReader(100)
    expect(at.push(framed(bodies[5]!)).map((b) => b.length)).toEqual([100])
  })
})

describe('agent configuration', () => {
  it('flags over env over file; unknown agent keys and bad values are errors', async () => {
    const file = join(dir, 'agent.yaml')
    writeFileSync(file, 'agent:\n  lookupDeadlineMs: 40\n  metricsPort: 9100\nmemory:\n  bytes: 64MiB\n')
    const c = resolveAgentConfig(
      { config: file, socket: join(dir, 'x.sock') },
      { KVGATE_AGENT_METRICS_PORT: '9200' },
    )
    expect(c).toMatchObject({
      lookupDeadlineMs: 40,
      metricsPort: 9200,
      socket: join(dir, 'x.sock'),
      chunkTokens: 256,
    })
    expect(c.cache).toMatchObject({ memory: { bytes: 64 * 2 ** 20 } })
    writeFileSync(file, 'agent:\n  socketPath: /tmp/x\n')
    expect(() => resolveAgentConfig({ config: file }, {})).toThrow(/agent.socketPath: unknown key/)
    expect(() => resolveAgentConfig({ lookupDeadlineMs: -1 }, {})).toThrow(/--lookup-deadline-ms/)
    expect(() => resolveAgentConfig({ socket: 'x'.repeat(200) }, {})).toThrow(/socket/)
    // The limit is in bytes: 60 two-byte characters are 120 bytes, past sun_path.
    expect(() => resolveAgentConfig({ socket: `/tmp/${'é'.repeat(60)}` }, {})).toThrow(
      /expected a path of 1\.\.107 bytes/,
    )
    // copyThreads: min(cores, 4) by default; 0 (on the event loop) .. 64; flag over env over file.
    expect(resolveAgentConfig({ socket: join(dir, 'x.sock') }, {}).copyThreads).toBeGreaterThanOrEqual(1)
    expect(resolveAgentConfig({ socket: join(dir, 'x.sock') }, {}).copyThreads).toBeLessThanOrEqual(4)
    writeFileSync(file, 'agent:\n  copyThreads: 3\n')
    expect(resolveAgentConfig({ config: file, socket: join(dir, 'x.sock') }, {}).copyThreads).toBe(3)
    const env = { KVGATE_AGENT_COPY_THREADS: '0' }
    expect(resolveAgentConfig({ config: file, socket: join(dir, 'x.sock') }, env).copyThreads).toBe(0)
    expect(
      resolveAgentConfig({ config: file, socket: join(dir, 'x.sock'), copyThreads: 7 }, env).copyThreads,
    ).toBe(7)
    for (const bad of ['-1', '65', 'two', '1.5'])
      expect(() =>
        resolveAgentConfig({ socket: join(dir, 'x.sock') }, { KVGATE_AGENT_COPY_THREADS: bad }),
      ).toThrow(/KVGATE_AGENT_COPY_THREADS/)
    // An agent made without resolveAgentConfig (embedded) refuses them too, rather than failing every copy.
    const core = { chunkTokens: 256, cache: {}, lookupDeadlineMs: 250, version: 'test' }
    for (const bad of [-1, 65, 1.5, Number.NaN])
      expect(() => new Agent({ ...core, copyThreads: bad })).toThrow(/copyThreads/)
    expect(new Agent({ ...core, copyThreads: 0 }).options.copyThreads).toBe(0)
  })

  it('a bad value names where it came from: the flag, the KVGATE_* variable or the file key', async () => {
    const file = join(dir, 'agent-where.yaml')
    const sock = join(dir, 'x.sock')
    expect(() => resolveAgentConfig({ socket: sock }, { KVGATE_AGENT_COPY_THREADS: '-1' })).toThrow(
      "KVGATE_AGENT_COPY_THREADS: expected an integer in 0..64, got '-1'",
    )
    expect(() => resolveAgentConfig({ socket: sock }, { KVGATE_AGENT_METRICS_PORT: 'http' })).toThrow(
      "KVGATE_AGENT_METRICS_PORT: expected an integer in 0..65535, got 'http'",
    )
    writeFileSync(file, 'agent:\n  lookupDeadlineMs: soon\n')
    expect(() => resolveAgentConfig({ config: file, socket: sock }, {})).toThrow(
      `${file}: agent.lookupDeadlineMs: expected an integer in 0..60000, got 'soon'`,
    )
    writeFileSync(file, 'agent:\n  sockt: /tmp/x\n')
    expect(() => resolveAgentConfig({ config: file }, {})).toThrow(
      `${file}: agent.sockt: unknown key (did you mean 'socket'?)`,
    )
    // A typo of the section itself: the top level's valid keys include agent.
    writeFileSync(file, 'agnet:\n  socket: /tmp/x\n')
    expect(() => resolveAgentConfig({ config: file }, {})).toThrow(
      new RegExp(`${file}: agnet: unknown key \\(did you mean 'agent'\\?\\); valid keys here: .*, agent$`),
    )
    // chunkTokens from the client's settings: the variable or the file's top-level key, by name.
    expect(() => resolveAgentConfig({ socket: sock }, { KVGATE_CHUNK_TOKENS: '0' })).toThrow(
      'KVGATE_CHUNK_TOKENS: expected an integer in 1..1048576, got 0',
    )
    writeFileSync(file, 'chunkTokens: 0\n')
    expect(() => resolveAgentConfig({ config: file, socket: sock }, {})).toThrow(
      `${file}: chunkTokens: expected an integer in 1..1048576, got 0`,
    )
    // The CLI: the flag as typed, exit 2, one line.
    const { main, reportFailure } = await import('../src/cli/main.ts')
    const err = console.error
    let out = ''
    console.error = (s: string) => {
      out += `${s}\n`
    }
    try {
      const code = await main(['agent', '--socket', sock, '--chunk-tokens', 'abc']).catch((e: unknown) =>
        reportFailure(e, 'agent'),
      )
      expect(code).toBe(2)
    } finally {
      console.error = err
    }
    expect(out.trim()).toBe(
      "kvgate agent: --chunk-tokens: expected an integer in 1..1048576, got 'abc' [ERR_CONFIG]",
    )
  })

  it('kvgate agent --help', async () => {
    const { main } = await import('../src/cli/main.ts')
    const log = console.log
    let out = ''
    console.log = (s: string) => {
      out += s
    }
    try {
      expect(await main(['agent', '--help'])).toBe(0)
    } finally {
      console.log = log
    }
    expect(out).toContain('--socket PATH')
    expect(out).toContain('docs/vllm.md')
  })
})
