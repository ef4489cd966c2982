// `cancel`: an engine that gave up on a load (or save) learns when nothing of it can touch its
// blocks any more. The cancelled request starts no copy after the cancel and answers only
// once the copies it had started landed; other requests of the connection carry on.
// Also how a threaded load groups its layers into copies (counted through the same gate).

import { randomBytes } from 'node:crypto'
import { closeSync, mkdtempSync, openSync, readFileSync, rmSync, writeFileSync, writeSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, describe, expect, it, vi } from 'vitest'
import { Agent, loadCopyLayers, newSession, type Session } from '../src/agent/agent.ts'
import { AgentServer, resolveAgentConfig } from '../src/agent/index.ts'
import { KVCache } from '../src/client/kv-cache.ts'
import { loadNative } from '../src/client/native-api.ts'
import { AgentClient } from './support/agent-client.ts'
import { startFaultGateway } from './support/client-fault-gateway.ts'
import {
  LLAMA_BLOCK_BYTES,
  LLAMA_BLOCKS,
  LLAMA_GEOMETRY,
  LLAMA_LAYER_BYTES,
  LLAMA_LAYERS,
} from './support/llama-blocks.ts'

const dir = mkdtempSync(join(tmpdir(), 'kvgate-cancel-'))
afterAll(() => rmSync(dir, { recursive: true, force: true }))

const LAYERS = LLAMA_LAYERS
const geometry = LLAMA_GEOMETRY
const BLOCK = LLAMA_BLOCK_BYTES
const BLOCKS = LLAMA_BLOCKS
const LAYER_BYTES = LLAMA_LAYER_BYTES
const BPC = 16 // 256-token chunks of 16-token blocks

/** The copy gate (AgentCoreOptions.copyGate): counts copies started, holds them while closed. */
class Gate {
  started = 0
  #open = true
  #waiters: (() => void)[] = []
  /** Runs (synchronously) when a copy starts, with the count so far. */
  onStart: ((n: number) => void) | undefined
  readonly fn = (): Promise<void> => {
    this.started++
    this.onStart?.(this.started)
    if (this.#open) return Promise.resolve()
    return new Promise((r) => this.#waiters.push(r))
  }
  close(): void {
    this.#open = false
  }
  open(): void {
    this.#open = true
    for (const w of this.#waiters.splice(0)) w()
  }
}

async function setup(name: string, threads: number, remoteUrl?: string) {
  const gate = new Gate()
  const cfg = resolveAgentConfig(
    { socket: join(dir, `${name}.sock`), chunkTokens: 256, maxFrameBytes: 1 << 20 },
    { KVGATE_MEMORY_BYTES: '64MiB' },
  )
  const agent = new Agent({
    chunkTokens: 256,
    cache: {
      ...cfg.cache,
      native: false,
      remote: remoteUrl ? { url: remoteUrl, codec: 'raw' } : false,
      disk: false,
      codecWorkers: 0,
    },
    lookupDeadlineMs: 1000,
    copyThreads: threads,
    copyGate: gate.fn,
    version: 'test',
  })
  const path = join(dir, `${name}-kv`)
  writeFileSync(path, randomBytes(LAYERS * LAYER_BYTES))
  const events: Record<string, unknown>[] = []
  const s = newSession((e) => events.push(e))
  const hello = agent.answer(s, { id: 1, op: 'hello', protocol: 1, model: 'm', hashSeed: '0', geometry })
  expect(hello).toMatchObject({ protocol: 1, features: ['cancel'] })
  const tensors = Array.from({ length: LAYERS }, (_, l) => ({
    kind: 'shm',
    path,
    offset: l * LAYER_BYTES,
    shape: [2, BLOCKS, 16, 8, 128],
  }))
  const r = await agent.answer(s, { id: 2, op: 'register', rank: 0, numBlocks: BLOCKS, tensors })
  return { agent, gate, s, worker: r.worker as number, path, events }
}

/**
 * Until restored: every load's layer `l` (l > 0, a multiple of `every`) reaches the agent a turn
 * of the event loop after layer l - 1, as layer groups fetched from a gateway do (a load of
 * chunks in L1 gets every layer in one turn).
 */
function layersOverTurns(every: number) {
  const real = KVCache.prototype.retrieveLayersKeys
  return vi.spyOn(KVCache.prototype, 'retrieveLayersKeys').mockImplementation(function (this: KVCache, keys) {
    const inner = real.call(this, keys)
    return (async function* () {
      try {
        for (;;) {
          const next = await inner.next()
          if (next.done) return
          if (next.value.layer > 0 && next.value.layer % every === 0)
            await new Promise((r) => setImmediate(r))
          yield next.value
        }
      } finally {
        await inner.return(undefined)
      }
    })()
  })
}

/** Block `b`'s K bytes of layer `l` in the engine's file. */
function blockBytes(file: Buffer, l: number, b: number): Buffer {
  return file.subarray(l * LAYER_BYTES + b * BLOCK, l * LAYER_BYTES + (b + 1) * BLOCK)
}

const settledWithin = async (p: Promise<unknown>, ms: number) => {
  let done = false
  void p.then(
    () => {
      done = true
    },
    () => {
      done = true
    },
  )
  await new Promise((r) => setTimeout(r, ms))
  return done
}

it('the addon is loaded (else the threaded copier is not what runs)', () => {
  expect(loadNative().api?.copyRunsAsyncAvailable(), loadNative().reason).toBe(true)
})

describe('cancel', () => {
  for (const threads of [2, 0]) {
    it(`${threads} copy threads: a cancelled load starts no copy after the cancel and answers only once its stalled copy landed; another load of the connection is unaffected`, async () => {
      const { agent, gate, s, worker, path } = await setup(`load-${threads}`, threads)
      // Threaded: layers in pairs a turn apart, so the load is several copies (an L1 load is one).
      const turns = threads > 0 ? layersOverTurns(2) : undefined
      try {
        const src = Array.from({ length: 2 * BPC }, (_, i) => i)
        const keys = Buffer.concat([randomBytes(32), randomBytes(32)])
        expect(await agent.answer(s, { id: 3, op: 'save', worker, keys, blockIds: src })).toMatchObject({
          stored: 2,
        })
        const stored = readFileSync(path)
        // The engine reuses every block meanwhile: what a load lands is told from what was there.
        const fd = openSync(path, 'r+')
        writeSync(fd, randomBytes(stored.length), 0, stored.length, 0)
        closeSync(fd)
        const a = src.map((i) => i + BPC) // 16..47
        const b = src.slice(0, BPC) // chunk 0 only, into blocks 0..15 (none of a's)
        gate.started = 0
        gate.close()
        let cancelled: unknown
        // The engine's timeout fires while the load's first copy is stalled on its thread.
        gate.onStart = (n) => {
          if (n === 1) cancelled = agent.answer(s, { id: 5, op: 'cancel', ids: [4, 999] })
        }
        const loadA = agent.answer(s, { id: 4, op: 'load', worker, keys, blockIds: a }) as Promise<
          Record<string, unknown>
        >
        expect(await settledWithin(loadA, 100)).toBe(false) // its copy is in flight: no answer yet
        expect(cancelled).toEqual({ cancelled: [4] }) // 999 was not in flight
        expect(gate.started).toBe(1) // 8 (threaded: 2 layers a copy) or 32 copies without the cancel
        gate.onStart = undefined
        // The connection carries on: lookups answer, and a load started now loads every block.
        expect(await agent.answer(s, { id: 6, op: 'lookup', keys })).toMatchObject({ chunks: 2 })
        const loadB = agent.answer(s, {
          id: 7,
          op: 'load',
          worker,
          keys: keys.subarray(0, 32),
          blockIds: b,
        }) as Promise<Record<string, unknown>>
        expect(await settledWithin(loadA, 50)).toBe(false)
        gate.open()
        const ansA = await loadA
        expect(ansA).toMatchObject({ chunks: 0, failedBlocks: a })
        expect(String(ansA.error)).toMatch(/cancelled/)
        expect(gate.started).toBeGreaterThan(1) // b's copies
        const ansB = await loadB
        expect(ansB).toMatchObject({ chunks: 1, failedBlocks: [], error: null })
        const after = readFileSync(path)
        for (let l = 0; l < LAYERS; l++)
          for (let i = 0; i < b.length; i++)
            expect(blockBytes(after, l, b[i]!).equals(blockBytes(stored, l, src[i]!))).toBe(true)
        // What landed of a: exactly its one copy started before the cancel, which landed later
        // (threaded: layers 0 and 1 of both chunks; on the event loop: chunk 0 of layer 0).
        const landed = Array.from(
          { length: LAYERS },
          (_, l) => a.filter((x, i) => blockBytes(after, l, x).equals(blockBytes(stored, l, src[i]!))).length,
        )
        const want = threads > 0 ? [32, 32] : [16]
        expect(landed).toEqual([...want, ...Array(LAYERS - want.length).fill(0)])
        const stats = (await agent.stats()) as Record<string, number>
        expect(stats.loadsCancelled).toBe(1)
        expect(stats.loadErrors).toBe(0)
      } finally {
        turns?.mockRestore()
        agent.endSession(s)
        await agent.close()
      }
    })
  }

  it('a cancelled save answers ERR_CANCELLED once its copy landed, and the chunk copied after the cancel is not stored', async () => {
    const { agent, gate, s, worker } = await setup('save', 2)
    try {
      const keys = Buffer.concat([randomBytes(32), randomBytes(32)])
      gate.close()
      gate.onStart = (n) => {
        if (n === 1) agent.answer(s, { id: 4, op: 'cancel', ids: [3] })
      }
      const save = agent.answer(s, {
        id: 3,
        op: 'save',
        worker,
        keys,
        blockIds: Array.from({ length: 32 }, (_, i) => i),
      })
      expect(await settledWithin(save as Promise<unknown>, 100)).toBe(false)
      gate.open()
      await expect(save).rejects.toMatchObject({ code: 'ERR_CANCELLED' })
      expect(gate.started).toBe(1)
      expect(await agent.answer(s, { id: 5, op: 'lookup', keys })).toMatchObject({ chunks: 0 })
      expect((await agent.stats()) as Record<string, number>).toMatchObject({
        savesCancelled: 1,
        saveErrors: 0,
      })
    } finally {
      agent.endSession(s)
      await agent.close()
    }
  })

  it('a cancelled load waiting for chunks from a gateway that does not answer answers at once: nothing was copied', async () => {
    const gw = await startFaultGateway()
    const a = await setup('fetch-a', 2, gw.url)
    const b = await setup('fetch-b', 2, gw.url) // its own (cold) L1: the chunks come from the gateway
    try {
      const keys = Buffer.concat([randomBytes(32), randomBytes(32)])
      const blockIds = Array.from({ length: 2 * BPC }, (_, i) => i)
      expect(
        await a.agent.answer(a.s, { id: 3, op: 'save', worker: a.worker, keys, blockIds }),
      ).toMatchObject({
        stored: 2,
      })
      expect(await a.agent.answer(a.s, { id: 4, op: 'flush' })).toEqual({})
      expect(gw.objects.size).toBe(2)
      gw.faults.hangGets = true
      const before = readFileSync(b.path)
      const load = b.agent.answer(b.s, { id: 5, op: 'load', worker: b.worker, keys, blockIds }) as Promise<
        Record<string, unknown>
      >
      expect(await settledWithin(load, 200)).toBe(false) // waiting for the gateway
      expect(b.agent.answer(b.s, { id: 6, op: 'cancel', ids: [5] })).toEqual({ cancelled: [5] })
      expect(await settledWithin(load, 500)).toBe(true)
      expect(await load).toMatchObject({ chunks: 0, failedBlocks: blockIds })
      expect(b.gate.started).toBe(0)
      expect(readFileSync(b.path).equals(before)).toBe(true)
    } finally {
      gw.faults.hangGets = false
      for (const x of [a, b]) {
        x.agent.endSession(x.s)
        await x.agent.close()
      }
      await gw.close()
    }
  })

  it('malformed ids are ERR_INVALID_ARGUMENT; ids not in flight are answered as such', async () => {
    const { agent, s } = await setup('bad', 2)
    const ask = (ids: unknown) => () => agent.answer(s as Session, { id: 9, op: 'cancel', ids })
    try {
      for (const bad of [undefined, 'x', [-1], [1.5], ['1'], Array(4097).fill(1)])
        expect(ask(bad)).toThrow(expect.objectContaining({ code: 'ERR_INVALID_ARGUMENT' }))
      expect(ask([])()).toEqual({ cancelled: [] })
      expect(ask([1, 2, 3])()).toEqual({ cancelled: [] })
    } finally {
      agent.endSession(s)
      await agent.close()
    }
  })

  it("an agent closing (SIGTERM) closes no connection while a copy of its loads may still land: the engine takes that close as every load's fence", async () => {
    const gate = new Gate()
    const agent = new Agent({
      chunkTokens: 256,
      cache: { native: false, remote: false, disk: false, codecWorkers: 0 },
      lookupDeadlineMs: 1000,
      copyThreads: 0, // copies one at a time on the event loop: the close cancels those not begun
      copyGate: gate.fn,
      version: 'test',
    })
    const socketPath = join(dir, 'closing.sock')
    const srv = await AgentServer.listen(agent, { socketPath, maxFrameBytes: 1 << 20 })
    const path = join(dir, 'closing-kv')
    writeFileSync(path, randomBytes(LAYERS * LAYER_BYTES))
    const c = await AgentClient.open(socketPath)
    let closing: Promise<void> | undefined
    try {
      expect(await c.call('hello', { protocol: 1, model: 'm', hashSeed: '0', geometry })).toMatchObject({
        ok: true,
      })
      const tensors = Array.from({ length: LAYERS }, (_, l) => ({
        kind: 'shm',
        path,
        offset: l * LAYER_BYTES,
        shape: [2, BLOCKS, 16, 8, 128],
      }))
      const { worker } = await c.call('register', { rank: 0, numBlocks: BLOCKS, tensors })
      const keys = Buffer.concat([randomBytes(32), randomBytes(32)])
      const src = Array.from({ length: 2 * BPC }, (_, i) => i)
      expect(await c.call('save', { worker, keys, blockIds: src })).toMatchObject({ ok: true, stored: 2 })
      gate.started = 0
      gate.close()
      const load = c.call('load', { worker, keys, blockIds: src.map((i) => i + BPC) })
      for (let i = 0; i < 200 && gate.started === 0; i++) await new Promise((r) => setTimeout(r, 5))
      expect(gate.started).toBe(1) // its first copy is stalled
      closing = srv.close()
      // While that copy may still land, the engine sees no close (it would free the blocks).
      expect(await settledWithin(closing, 150)).toBe(false)
      expect(c.closed).toBe(false)
      gate.open()
      // The load is answered (every block failed: the close cancelled it), then the connection closes.
      expect(await load).toMatchObject({ ok: true, chunks: 0, failedBlocks: src.map((i) => i + BPC) })
      await closing
      for (let i = 0; i < 200 && !c.closed; i++) await new Promise((r) => setTimeout(r, 5))
      expect(c.closed).toBe(true)
      expect(gate.started).toBe(1) // no copy started after the close began
    } finally {
      gate.open()
      c.close()
      await (closing ?? srv.close())
    }
  })
})

describe('threaded load: copies by the layers ready together', () => {
  /** Saves 2 chunks from blocks 0..31 and loads them into blocks 47..16; checks every byte landed. */
  async function loadTwoChunks(x: Awaited<ReturnType<typeof setup>>) {
    const src = Array.from({ length: 2 * BPC }, (_, i) => i)
    const dst = src.map((i) => BLOCKS - 1 - i) // 47..16: distinct, some over the saved blocks
    const keys = Buffer.concat([randomBytes(32), randomBytes(32)])
    expect(
      await x.agent.answer(x.s, { id: 3, op: 'save', worker: x.worker, keys, blockIds: src }),
    ).toMatchObject({
      stored: 2,
    })
    const stored = readFileSync(x.path)
    x.gate.started = 0
    x.events.length = 0
    const ans = await x.agent.answer(x.s, { id: 4, op: 'load', worker: x.worker, keys, blockIds: dst })
    expect(ans).toMatchObject({ chunks: 2, failedBlocks: [], error: null })
    const after = readFileSync(x.path)
    for (let l = 0; l < LAYERS; l++)
      for (let i = 0; i < dst.length; i++)
        expect(blockBytes(after, l, dst[i]!).equals(blockBytes(stored, l, src[i]!))).toBe(true)
    return x.events.filter((e) => e.event === 'load-progress' && e.id === 4).map((e) => e.layers as number)
  }

  it('one copy names at most 60 000 buffers however many chunks a load has (as the fixed groups did); a group waits for an eighth of the layers', () => {
    expect(loadCopyLayers(32, 1)).toEqual({ minLayers: 4, maxLayers: 30_000 })
    expect(loadCopyLayers(32, 2000)).toEqual({ minLayers: 4, maxLayers: 29 })
    expect(loadCopyLayers(32, 65_535)).toEqual({ minLayers: 1, maxLayers: 1 })
    for (const chunks of [1, 2, 1000, 7499, 7500, 30_000, 65_535]) {
      const { minLayers, maxLayers } = loadCopyLayers(80, chunks)
      expect(minLayers).toBeGreaterThanOrEqual(1)
      expect(minLayers).toBeLessThanOrEqual(maxLayers)
      expect(maxLayers === 1 || maxLayers * (chunks + 1) <= 60_000).toBe(true)
    }
  })

  it('chunks in L1: every layer in one copy, its progress one event naming them all', async () => {
    const x = await setup('groups-l1', 2)
    try {
      const progress = await loadTwoChunks(x)
      expect(x.gate.started).toBe(1) // 8 copies of 2 layers before: 16 pool jobs on 2 cores
      expect(progress).toEqual([LAYERS])
    } finally {
      x.agent.endSession(x.s)
      await x.agent.close()
    }
  })

  it('layers arriving over several turns (fetched groups): a copy per arrival once a group is full, progress naming each prefix landed', async () => {
    const x = await setup('groups-turns', 2)
    const turns = layersOverTurns(4)
    try {
      const progress = await loadTwoChunks(x)
      // 4 layers a turn, groups of at least ⌈16 / 8⌉ = 2: each turn's 4 layers go in one copy.
      expect(x.gate.started).toBe(LAYERS / 4)
      expect(progress.length).toBeGreaterThanOrEqual(1)
      expect(progress).toEqual([...new Set(progress)].sort((a, b) => a - b))
      expect(progress.every((n) => n % 4 === 0)).toBe(true) // a prefix of whole copies
      expect(progress.at(-1)).toBe(LAYERS)
    } finally {
      turns.mockRestore()
      x.agent.endSession(x.s)
      await x.agent.close()
    }
  })

  /**
   * Until restored: a load's layers 0..3 come in one turn and layer 4 only once `release` is
   * called; `atStall` runs (synchronously) as the generator reaches layer 4.
   */
  function stallAtLayer4(atStall: () => void) {
    const real = KVCache.prototype.retrieveLayersKeys
    const stall = { release: () => {}, reached: false }
    const spy = vi.spyOn(KVCache.prototype, 'retrieveLayersKeys').mockImplementation(function (
      this: KVCache,
      keys,
    ) {
      const inner = real.call(this, keys)
      return (async function* () {
        try {
          for (;;) {
            const next = await inner.next()
            if (next.done) return
            if (next.value.layer === 4) {
              stall.reached = true
              atStall()
              await new Promise<void>((r) => (stall.release = r))
            }
            yield next.value
          }
        } finally {
          await inner.return(undefined)
        }
      })()
    })
    return { spy, stall }
  }

  async function savedChunk(x: Awaited<ReturnType<typeof setup>>) {
    const src = Array.from({ length: BPC }, (_, i) => i)
    const keys = randomBytes(32)
    expect(
      await x.agent.answer(x.s, { id: 3, op: 'save', worker: x.worker, keys, blockIds: src }),
    ).toMatchObject({
      stored: 1,
    })
    x.gate.started = 0
    return { keys, dst: src.map((i) => i + BPC), before: readFileSync(x.path) }
  }

  it('a cancel while a full group waits for the end of its turn: that group is never copied, and the load answers without waiting for the layers to come', async () => {
    const x = await setup('groups-cancel', 2)
    // The engine's cancel comes as the load reaches layer 4: layers 0..3 wait, not yet copied.
    const { spy, stall } = stallAtLayer4(() => x.agent.answer(x.s, { id: 5, op: 'cancel', ids: [4] }))
    try {
      const { keys, dst, before } = await savedChunk(x)
      const load = x.agent.answer(x.s, {
        id: 4,
        op: 'load',
        worker: x.worker,
        keys,
        blockIds: dst,
      }) as Promise<Record<string, unknown>>
      expect(await settledWithin(load, 300)).toBe(true) // layer 4 never came
      const ans = await load
      expect(ans).toMatchObject({ chunks: 0, failedBlocks: dst })
      expect(String(ans.error)).toMatch(/cancelled/)
      expect(stall.reached).toBe(true)
      expect(x.gate.started).toBe(0) // before: layers 0..1 and 2..3 were copied as each pair came
      expect(readFileSync(x.path).equals(before)).toBe(true)
      stall.release()
    } finally {
      spy.mockRestore()
      x.agent.endSession(x.s)
      await x.agent.close()
    }
  })

  it('the connection closing while a full group waits for the end of its turn: no copy starts, and the load ends without waiting for the layers to come', async () => {
    const x = await setup('groups-closed', 2)
    // The close is seen (endSession) in the turn the group filled in (a close callback before
    // the turn's end): the group's copy is refused there, and the fetch of layer 4 left behind.
    const { spy, stall } = stallAtLayer4(() => x.agent.endSession(x.s))
    try {
      const { keys, dst, before } = await savedChunk(x)
      const load = x.agent.answer(x.s, {
        id: 4,
        op: 'load',
        worker: x.worker,
        keys,
        blockIds: dst,
      }) as Promise<Record<string, unknown>>
      expect(await settledWithin(load, 300)).toBe(true)
      expect(await load).toMatchObject({ chunks: 0, failedBlocks: dst })
      expect(x.gate.started).toBe(0)
      expect(readFileSync(x.path).equals(before)).toBe(true)
      stall.release()
    } finally {
      spy.mockRestore()
      await x.agent.close()
    }
  })
})
