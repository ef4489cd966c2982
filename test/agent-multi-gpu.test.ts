// Several engines on one node, one per GPU (or one with TP across GPUs), share one agent:
// each registration's tensors are opened, copied and closed on the engine's own device.
// Driven through the stub libcudart with two devices; the stub counts each call by the
// device current when it ran, and refuses copies issued from another device's context.
// (The stub's IPC handles work within one process, so engines and agent share this one.)

import { randomBytes } from 'node:crypto'
import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, beforeAll, beforeEach, describe, expect, it } from 'vitest'
import { nativePaths } from '../src/client/native.ts'
import { AgentClient, type Msg } from './support/agent-client.ts'
import { pattern, same } from './support/bytes.ts'

process.env.KVGATE_CUDART = nativePaths.stubCudart
process.env.KVGATE_STUB_DEVICES = '2'
const native = await import('../src/client/native.ts')
const { cuda } = native
const { resolveAgentConfig, startAgent } = await import('../src/agent/index.ts')
const { newSession } = await import('../src/agent/agent.ts')

const stub = (() => {
  try {
    return cuda.status().available ? undefined : cuda.status().reason
  } catch (e) {
    return (e as Error).message
  }
})()

const LAYERS = 2
const BLOCKS = 8
const BB = 16 * 2 * 8 * 2 // block 16 tokens × 2 heads × 8 dims × fp16
const LAYER_BYTES = 2 * BLOCKS * BB
const SHAPE = [2, BLOCKS, 16, 2, 8]

/** Successful `fn` calls the stub ran with `device` current. */
const calls = (fn: string, device: number) => cuda.stubControl(`calls=${fn}@${device}`)
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms))

async function until(what: string, cond: () => boolean) {
  for (let i = 0; i < 200 && !cond(); i++) await sleep(10)
  expect(cond(), what).toBe(true)
}

describe.skipIf(stub !== undefined)('agent on a node with several GPUs (stub libcudart, 2 devices)', () => {
  let dir: string
  let server: Awaited<ReturnType<typeof startAgent>>
  const sock = () => join(dir, 'a.sock')

  beforeAll(async () => {
    cuda.stubControl('reset')
    dir = mkdtempSync(join(tmpdir(), 'kvgate-agent-gpus-'))
    const cfg = resolveAgentConfig({ socket: sock(), chunkTokens: 32 }, { KVGATE_MEMORY_BYTES: '16MiB' })
    cfg.cache = { ...cfg.cache, remote: false, disk: false, codecWorkers: 0 }
    server = await startAgent(cfg, 'test')
  })

  afterAll(async () => {
    cuda.stubControl('reset')
    await server?.close()
    rmSync(dir, { recursive: true, force: true })
  })

  beforeEach(() => {
    cuda.stubControl('reset') // clears call counts and holds
    cuda.setDevice(0)
  })

  /** An engine's KV cache on `device` (allocated with that device current, as torch does). */
  async function kvOn(device: number, fill: boolean) {
    cuda.setDevice(device)
    try {
      const d = cuda.deviceAlloc(LAYERS * LAYER_BYTES)
      const host = fill ? pattern(LAYERS * LAYER_BYTES, 7 + device) : new Uint8Array(LAYERS * LAYER_BYTES)
      await cuda.copyToDevice(host, d)
      return { d, host, handle: cuda.ipcGetHandle(d), device }
    } finally {
      cuda.setDevice(0)
    }
  }

  /** The engines' geometry: FlashAttention, fp16, LAYERS layers of 2 heads × 8 on each of `world` ranks. */
  const geometry = (world: number) => ({
    layout: 'flash-attn',
    dtype: 'float16',
    layers: LAYERS,
    kvHeads: 2,
    headSize: 8,
    blockSize: 16,
    world,
  })

  async function hello(world = 1) {
    const c = await AgentClient.open(sock())
    const h = await c.call('hello', {
      protocol: 1,
      model: `gpus/test-${world}`,
      hashSeed: '0',
      geometry: geometry(world),
    })
    expect(h.ok).toBe(true)
    return c
  }

  const tensors = (handle: Uint8Array, where: Msg): Msg[] =>
    Array.from({ length: LAYERS }, (_, l) => ({
      kind: 'cuda-ipc',
      handle,
      offset: l * LAYER_BYTES,
      shape: SHAPE,
      ...where,
    }))

  async function engine(device: number, fill: boolean, where: Msg = { device }, rank = 0, world = 1) {
    const kv = await kvOn(device, fill)
    const c = await hello(world)
    const r = await c.call('register', { rank, numBlocks: BLOCKS, tensors: tensors(kv.handle, where) })
    expect(r).toMatchObject({ ok: true, device })
    return { ...kv, c, worker: r.worker }
  }

  const block = (buf: Uint8Array, l: number, side: number, blk: number) => {
    const o = l * LAYER_BYTES + (side * BLOCKS + blk) * BB
    return buf.subarray(o, o + BB)
  }

  async function readBack(kv: { d: bigint; device: number }) {
    const out = new Uint8Array(LAYERS * LAYER_BYTES)
    await cuda.copyFromDevice(kv.d, out, { device: kv.device })
    return out
  }

  function free(...kvs: { d: bigint }[]) {
    for (const kv of kvs) cuda.deviceFree(kv.d)
  }

  it('is set up with two stub devices with distinct PCI bus ids', () => {
    expect(cuda.deviceCount()).toBe(2)
    expect(cuda.pciBusId(0)).not.toBe(cuda.pciBusId(1))
  })

  it('an engine on GPU 1 saves and one on GPU 0 loads: each opened, copied and closed on its own GPU', async () => {
    const a = await engine(1, true)
    const b = await engine(0, false)
    expect([calls('cudaIpcOpenMemHandle', 1), calls('cudaIpcOpenMemHandle', 0)]).toEqual([1, 1])
    const keys = [randomBytes(32)]
    const copies = (): [number, number] => [calls('cudaMemcpyAsync', 0), calls('cudaMemcpyAsync', 1)]
    const [on0, on1] = copies()
    expect(await a.c.call('save', { worker: a.worker, keys, blockIds: [6, 1] })).toMatchObject({
      ok: true,
      stored: 1,
    })
    // The save's device→host copies ran on GPU 1 only (2 layers × 2 sides × 2 blocks)…
    expect(copies()).toEqual([on0, on1 + 8])
    expect(await b.c.call('load', { worker: b.worker, keys, blockIds: [0, 7] })).toMatchObject({
      ok: true,
      chunks: 1,
      failedBlocks: [],
    })
    // …and the load's host→device copies on GPU 0 only.
    expect(copies()[0]).toBeGreaterThan(on0)
    expect(copies()[1]).toBe(on1 + 8)
    const out = await readBack(b)
    for (let l = 0; l < LAYERS; l++)
      for (let side = 0; side < 2; side++) {
        expect(same(block(out, l, side, 0), block(a.host, l, side, 6))).toBe(true)
        expect(same(block(out, l, side, 7), block(a.host, l, side, 1))).toBe(true)
      }
    const mapped = cuda.stubControl('')
    a.c.close()
    b.c.close()
    await until('both IPC mappings closed', () => cuda.stubControl('') === mapped - 2)
    // Each closed on the device it was opened on (the stub refuses a close from another device).
    expect([calls('cudaIpcCloseMemHandle', 1), calls('cudaIpcCloseMemHandle', 0)]).toEqual([1, 1])
    free(a, b)
  })

  it('TP 2 across two GPUs: each rank registers on its GPU; both shards round-trip', async () => {
    const r0 = await engine(0, true, { device: 0 }, 0, 2)
    const r1 = await engine(1, true, { device: 1 }, 1, 2)
    const keys = [randomBytes(32)]
    for (const r of [r0, r1])
      expect(await r.c.call('save', { worker: r.worker, keys, blockIds: [2, 3] })).toMatchObject({
        stored: 1,
      })
    const l0 = await engine(0, false, { device: 0 }, 0, 2)
    const l1 = await engine(1, false, { device: 1 }, 1, 2)
    for (const l of [l0, l1])
      expect(await l.c.call('load', { worker: l.worker, keys, blockIds: [5, 4] })).toMatchObject({
        chunks: 1,
      })
    for (const [src, dst] of [
      [r0, l0],
      [r1, l1],
    ] as const) {
      const out = await readBack(dst)
      expect(same(block(out, 1, 1, 5), block(src.host, 1, 1, 2))).toBe(true)
      expect(same(block(out, 0, 0, 4), block(src.host, 0, 0, 3))).toBe(true)
    }
    expect([calls('cudaIpcOpenMemHandle', 0), calls('cudaIpcOpenMemHandle', 1)]).toEqual([2, 2])
    for (const e of [r0, r1, l0, l1]) e.c.close()
    await until(
      'mappings closed',
      () => calls('cudaIpcCloseMemHandle', 0) + calls('cudaIpcCloseMemHandle', 1) === 4,
    )
    free(r0, r1, l0, l1)
  })

  it('copies for one GPU do not wait for another GPU: a load on GPU 1 completes while GPU 0 is held', async () => {
    const a = await engine(0, true)
    const b = await engine(1, true)
    const keys = [randomBytes(32)]
    const other = [randomBytes(32)]
    expect((await a.c.call('save', { worker: a.worker, keys, blockIds: [0, 1] })).ok).toBe(true)
    expect((await b.c.call('save', { worker: b.worker, keys: other, blockIds: [0, 1] })).ok).toBe(true)
    const issued0 = calls('cudaMemcpyAsync', 0)
    cuda.stubControl('hold=0') // copies on device 0's streams wait
    let loaded0 = false
    const slow = a.c.call('load', { worker: a.worker, keys, blockIds: [4, 5] }).then((m) => {
      loaded0 = true
      return m
    })
    await until('the GPU-0 load issued its copies', () => calls('cudaMemcpyAsync', 0) > issued0)
    // Bounded, so that a GPU-1 load stuck behind GPU 0 fails here rather than at the test timeout.
    const fast = await Promise.race([
      b.c.call('load', { worker: b.worker, keys: other, blockIds: [6, 7] }),
      sleep(5000).then(() => ({ ok: 'stuck behind GPU 0' })),
    ])
    expect(fast).toMatchObject({ ok: true, chunks: 1, failedBlocks: [] })
    expect(loaded0).toBe(false)
    cuda.stubControl('release=0')
    expect(await slow).toMatchObject({ ok: true, chunks: 1, failedBlocks: [] })
    const out = await readBack(a)
    expect(same(block(out, 1, 0, 4), block(a.host, 1, 0, 0))).toBe(true)
    a.c.close()
    b.c.close()
    await until(
      'mappings closed',
      () => calls('cudaIpcCloseMemHandle', 0) + calls('cudaIpcCloseMemHandle', 1) === 2,
    )
    free(a, b)
  })

  it('pciBusId names the GPU whatever the engine numbers it: it wins over device', async () => {
    // The engine (CUDA_VISIBLE_DEVICES=1) calls it device 0; the agent sees it as device 1.
    const a = await engine(1, true, { device: 0, pciBusId: cuda.pciBusId(1).toLowerCase() })
    expect([calls('cudaIpcOpenMemHandle', 1), calls('cudaIpcOpenMemHandle', 0)]).toEqual([1, 0])
    expect((await a.c.call('save', { worker: a.worker, keys: [randomBytes(32)], blockIds: [0, 1] })).ok).toBe(
      true,
    )
    a.c.close()
    await until('mapping closed', () => calls('cudaIpcCloseMemHandle', 1) === 1)
    free(a)
  })

  it('a device the agent cannot use, or a malformed one, is refused with a typed error and nothing is mapped', async () => {
    const kv = await kvOn(1, true)
    const c = await hello()
    const before = cuda.stubControl('')
    const cases: [Msg, string, RegExp][] = [
      [{ device: 2 }, 'ERR_CUDA', /device 2 is not a GPU this agent can use.*2 device\(s\).*pciBusId/],
      [{ device: 1_000_000 }, 'ERR_CUDA', /not a GPU this agent can use/],
      [
        { pciBusId: '0000:99:00.0' },
        'ERR_CUDA',
        /no GPU with PCI bus id 0000:99:00\.0.*CUDA_VISIBLE_DEVICES/,
      ],
      [{ device: -1 }, 'ERR_INVALID_ARGUMENT', /device must be an integer >= 0/],
      [{ device: 1.5 }, 'ERR_INVALID_ARGUMENT', /device must be an integer/],
      [{ device: '1' }, 'ERR_INVALID_ARGUMENT', /device must be an integer/],
      [{ device: null }, 'ERR_INVALID_ARGUMENT', /device must be an integer/],
      [{ pciBusId: 7 }, 'ERR_INVALID_ARGUMENT', /pciBusId must be a PCI bus id/],
      [{ pciBusId: '' }, 'ERR_INVALID_ARGUMENT', /pciBusId/],
      [{ pciBusId: 'GPU-0f3a' }, 'ERR_INVALID_ARGUMENT', /pciBusId/],
      [{ pciBusId: `0000:10:00.0${'0'.repeat(5000)}` }, 'ERR_INVALID_ARGUMENT', /pciBusId/],
      [{ pciBusId: '0000:10:00.0\n' }, 'ERR_INVALID_ARGUMENT', /pciBusId/],
    ]
    for (const [where, code, message] of cases) {
      const r = await c.call('register', { rank: 0, numBlocks: BLOCKS, tensors: tensors(kv.handle, where) })
      expect(r.ok, JSON.stringify(where)).toBe(false)
      expect((r.error as Msg).code, JSON.stringify(where)).toBe(code)
      expect((r.error as Msg).message).toMatch(message)
    }
    expect(calls('cudaIpcOpenMemHandle', 0) + calls('cudaIpcOpenMemHandle', 1)).toBe(0)
    expect(cuda.stubControl('')).toBe(before)
    c.close()
    free(kv)
  })

  it('layers of one registration on two GPUs are refused; the first layer mapped is unmapped', async () => {
    const kv = await kvOn(0, true)
    const c = await hello()
    const before = cuda.stubControl('')
    const t = tensors(kv.handle, { device: 0 })
    t[1] = { ...t[1]!, device: 1 }
    const r = await c.call('register', { rank: 0, numBlocks: BLOCKS, tensors: t })
    expect(r.ok).toBe(false)
    expect(r.error).toMatchObject({ code: 'ERR_INVALID_ARGUMENT' })
    expect((r.error as Msg).message).toMatch(/tensors\[1\] is on device 1, earlier tensors on device 0/)
    expect(calls('cudaIpcOpenMemHandle', 0)).toBe(1)
    expect(calls('cudaIpcCloseMemHandle', 0)).toBe(1)
    expect(cuda.stubControl('')).toBe(before)
    c.close()
    free(kv)
  })

  it('a connection that closes while its register is in flight leaves nothing mapped', async () => {
    const kv = await kvOn(1, true)
    const agent = server.agent
    const s = newSession(() => {})
    await agent.handle(s, {
      id: 1,
      op: 'hello',
      protocol: 1,
      model: 'gpus/test-1',
      hashSeed: '0',
      geometry: geometry(1),
    })
    const workers = agent.metrics.workers
    const reg = agent.handle(s, {
      id: 2,
      op: 'register',
      rank: 0,
      numBlocks: BLOCKS,
      tensors: tensors(kv.handle, { device: 1 }),
    })
    // The socket's close: the registration has not answered yet (its IPC open is on the thread pool).
    agent.endSession(s)
    await expect(reg).rejects.toMatchObject({ code: 'ERR_CLOSED' })
    expect(calls('cudaIpcOpenMemHandle', 1)).toBe(1)
    await until('mapping closed', () => calls('cudaIpcCloseMemHandle', 1) === 1)
    expect(agent.metrics.workers).toBe(workers)
    free(kv)
  })

  it('without device or pciBusId, a registration is on device 0 (older connectors)', async () => {
    const a = await engine(0, true, {})
    expect(calls('cudaIpcOpenMemHandle', 0)).toBe(1)
    a.c.close()
    await until('mapping closed', () => calls('cudaIpcCloseMemHandle', 0) === 1)
    free(a)
  })
})
