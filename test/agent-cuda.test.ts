// The agent's CUDA IPC path, driven through the stub libcudart (native/test-stub): an engine's
// KV in "device" memory is saved through IPC handles and loaded into another allocation.
// (The stub's IPC handles work within one process, so engine and agent share this one.)

import { randomBytes } from 'node:crypto'
import { mkdtempSync, rmSync } from 'node:fs'
import { connect } from 'node:net'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { nativePaths } from '../src/client/native.ts'
import { pattern, same } from './support/bytes.ts'

process.env.KVGATE_CUDART = nativePaths.stubCudart
const native = await import('../src/client/native.ts')
const { cuda } = native
const { Agent, resolveAgentConfig, startAgent } = await import('../src/agent/index.ts')
const { newSession } = await import('../src/agent/agent.ts')
const { decodeBody, encodeFrame, FrameReader } = await import('../src/agent/protocol.ts')

type Msg = Record<string, unknown>
const stub = (() => {
  try {
    return cuda.status().available ? undefined : cuda.status().reason
  } catch (e) {
    return (e as Error).message
  }
})()

async function client(path: string) {
  const sock = connect(path)
  await new Promise((r) => sock.once('connect', r))
  const reader = new FrameReader()
  const waiting = new Map<number, (m: Msg) => void>()
  sock.on('data', (d) => {
    for (const b of reader.push(d)) {
      const m = decodeBody(b) as Msg
      if (!m.event) waiting.get(m.id as number)?.(m)
    }
  })
  let next = 1
  return {
    sock,
    call(op: string, f: Msg = {}): Promise<Msg> {
      const id = next++
      const p = new Promise<Msg>((r) => waiting.set(id, r))
      sock.write(encodeFrame({ id, op, ...f }))
      return p
    },
  }
}

const LAYERS = 2
const BLOCKS = 8
const BB = 16 * 2 * 8 * 2 // block 16 tokens × 2 heads × 8 dims × fp16
const LAYER_BYTES = 2 * BLOCKS * BB
/** The engine geometry every hello here gives (flash-attn, 2 layers of 2 KV heads of 8, blocks of 16). */
const GEOMETRY = {
  layout: 'flash-attn',
  dtype: 'float16',
  layers: LAYERS,
  kvHeads: 2,
  headSize: 8,
  blockSize: 16,
}

describe.skipIf(stub !== undefined)('agent CUDA IPC path (stub libcudart)', () => {
  let dir: string
  let server: Awaited<ReturnType<typeof startAgent>>

  beforeAll(async () => {
    cuda.stubControl('reset')
    dir = mkdtempSync(join(tmpdir(), 'kvgate-agent-cuda-'))
    const cfg = resolveAgentConfig(
      { socket: join(dir, 'a.sock'), chunkTokens: 32 },
      { KVGATE_MEMORY_BYTES: '16MiB' },
    )
    cfg.cache = { ...cfg.cache, remote: false, disk: false, codecWorkers: 0 }
    server = await startAgent(cfg, 'test')
  })

  afterAll(async () => {
    await server?.close()
    rmSync(dir, { recursive: true, force: true })
  })

  /** A connection that said hello as this test's engine (2 layers of 2 KV heads of 8, blocks of 16). */
  async function connect() {
    const c = await client(join(dir, 'a.sock'))
    const hello = await c.call('hello', {
      protocol: 1,
      model: 'cuda/test',
      hashSeed: '0',
      geometry: GEOMETRY,
    })
    expect(hello.ok).toBe(true)
    return c
  }

  async function engine(fill: boolean) {
    // One allocation for both layers (vLLM-like): the agent must map the handle once.
    const d = cuda.deviceAlloc(LAYERS * LAYER_BYTES)
    const host = fill ? pattern(LAYERS * LAYER_BYTES, 5) : new Uint8Array(LAYERS * LAYER_BYTES)
    await cuda.copyToDevice(host, d)
    const c = await connect()
    const handle = cuda.ipcGetHandle(d)
    const r = await c.call('register', {
      rank: 0,
      numBlocks: BLOCKS,
      tensors: Array.from({ length: LAYERS }, (_, l) => ({
        kind: 'cuda-ipc',
        handle,
        offset: l * LAYER_BYTES,
        shape: [2, BLOCKS, 16, 2, 8],
      })),
    })
    expect(r).toMatchObject({ ok: true })
    return { d, host, c, worker: r.worker }
  }

  it('saves from one engine allocation and loads into another, bytes equal; mappings released', async () => {
    const a = await engine(true)
    const before = cuda.stubControl('')
    const b = await engine(false)
    // One allocation + one IPC mapping: the two layers share the handle, mapped once.
    expect(cuda.stubControl('')).toBe(before + 2)
    const keys = [randomBytes(32)]
    expect(await a.c.call('save', { worker: a.worker, keys, blockIds: [6, 1] })).toMatchObject({
      ok: true,
      stored: 1,
    })
    expect(await b.c.call('load', { worker: b.worker, keys, blockIds: [0, 7] })).toMatchObject({
      ok: true,
      chunks: 1,
      failedBlocks: [],
    })
    const out = new Uint8Array(LAYERS * LAYER_BYTES)
    await cuda.copyFromDevice(b.d, out)
    const at = (buf: Uint8Array, l: number, side: number, blk: number) => {
      const o = l * LAYER_BYTES + (side * BLOCKS + blk) * BB
      return buf.subarray(o, o + BB)
    }
    for (let l = 0; l < LAYERS; l++)
      for (let side = 0; side < 2; side++) {
        expect(same(at(out, l, side, 0), at(a.host, l, side, 6))).toBe(true)
        expect(same(at(out, l, side, 7), at(a.host, l, side, 1))).toBe(true)
        expect(at(out, l, side, 3).every((x) => x === 0)).toBe(true)
      }
    const mapped = cuda.stubControl('')
    a.c.sock.destroy()
    b.c.sock.destroy()
    for (let i = 0; i < 100 && cuda.stubControl('') !== mapped - 2; i++)
      await new Promise((r) => setTimeout(r, 10))
    expect(cuda.stubControl('')).toBe(mapped - 2) // the agent closed both IPC mappings
    cuda.deviceFree(a.d)
    cuda.deviceFree(b.d)
  })

  it('a tensor claimed past the end of its storage (storageEnd) is refused before anything is mapped', async () => {
    const d = cuda.deviceAlloc(LAYERS * LAYER_BYTES)
    const c = await connect()
    const handle = cuda.ipcGetHandle(d)
    const tensors = (storageEnd: number | null) =>
      Array.from({ length: LAYERS }, (_, l) => ({
        kind: 'cuda-ipc',
        handle,
        offset: l * LAYER_BYTES,
        storageEnd,
        shape: [2, BLOCKS, 16, 2, 8],
      }))
    const mapped = cuda.stubControl('')
    // The last layer's tensor ends one byte past the storage.
    const r = await c.call('register', {
      rank: 0,
      numBlocks: BLOCKS,
      tensors: tensors(LAYERS * LAYER_BYTES - 1),
    })
    expect(r).toMatchObject({ ok: false, error: { code: 'ERR_INVALID_ARGUMENT' } })
    expect(String((r.error as { message: string }).message)).toMatch(
      new RegExp(`tensors\\[${LAYERS - 1}\\].*runs past its storage`),
    )
    expect(cuda.stubControl('')).toBe(mapped) // nothing left mapped
    // Exactly at the end: accepted.
    expect(
      await c.call('register', { rank: 0, numBlocks: BLOCKS, tensors: tensors(LAYERS * LAYER_BYTES) }),
    ).toMatchObject({
      ok: true,
    })
    // nil is an absent storageEnd, as it is for every optional field (it was taken as 0: every
    // tensor refused as running past a storage ending at byte 0).
    const nil = await c.call('register', { rank: 0, numBlocks: BLOCKS, tensors: tensors(null) })
    expect(nil).toMatchObject({ ok: true })
    c.sock.destroy()
    for (let i = 0; i < 100 && cuda.stubControl('') !== mapped; i++)
      await new Promise((r) => setTimeout(r, 10))
    expect(cuda.stubControl('')).toBe(mapped)
    cuda.deviceFree(d)
  })

  it('an agent closed while a cuda-ipc register maps its handle opens no space after close (nor an L1 or a codec pool)', async () => {
    const cfg = resolveAgentConfig(
      { socket: join(dir, 'unused.sock'), chunkTokens: 32 },
      { KVGATE_MEMORY_BYTES: '4MiB' },
    )
    const cache = { ...cfg.cache, remote: false as const, disk: false as const, codecWorkers: 0 }
    const agent = new Agent({ chunkTokens: 32, cache, lookupDeadlineMs: 250, version: 't' })
    const s = newSession(() => {})
    const hello = await agent.answer(s, {
      id: 1,
      op: 'hello',
      protocol: 1,
      model: 'cuda/close',
      hashSeed: '0',
      geometry: GEOMETRY,
    })
    expect(hello).toMatchObject({ protocol: 1 })
    const d = cuda.deviceAlloc(LAYERS * LAYER_BYTES)
    const handle = cuda.ipcGetHandle(d)
    const tensors = Array.from({ length: LAYERS }, (_, l) => ({
      kind: 'cuda-ipc',
      handle,
      offset: l * LAYER_BYTES,
      shape: [2, BLOCKS, 16, 2, 8],
    }))
    // register awaits the handle's mapping; close() runs meanwhile and finds no space to close.
    const reg = Promise.resolve()
      .then(() => agent.answer(s, { id: 2, op: 'register', rank: 0, numBlocks: BLOCKS, tensors }))
      .catch((e: unknown) => e)
    await Promise.resolve()
    await agent.close()
    expect(await reg).toMatchObject({ code: 'ERR_CLOSED' })
    // A space opened after close() would hold its L1 and the codec pool for good.
    expect((await agent.stats()).spaces).toBe(0)
    cuda.deviceFree(d)
  })

  it('a failing device copy fails the load: every block is reported', async () => {
    const a = await engine(true)
    const keys = [randomBytes(32)]
    expect((await a.c.call('save', { worker: a.worker, keys, blockIds: [2, 3] })).ok).toBe(true)
    cuda.stubControl('cudaMemcpyAsync=2*1') // the next device copy fails, once
    const r = await a.c.call('load', { worker: a.worker, keys, blockIds: [4, 5] })
    expect(r).toMatchObject({ ok: true, chunks: 0, failedBlocks: [4, 5] })
    expect(r.error).toMatch(/cudaMemcpyAsync|CUDA/i)
    const mapped = cuda.stubControl('')
    a.c.sock.destroy()
    for (let i = 0; i < 100 && cuda.stubControl('') !== mapped - 1; i++)
      await new Promise((r) => setTimeout(r, 10))
    expect(cuda.stubControl('')).toBe(mapped - 1) // its IPC mapping closed
    cuda.deviceFree(a.d)
  })
})
