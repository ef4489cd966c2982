// An L4 key the agent's cache holds off as unservable (a newer writer's object: every read of it
// fails the same way) must end a lookup's matched prefix, over the agent's socket: counted
// present, the engine would plan a load of it that fails, and recompute anyway, every time for
// the whole hold.

import { randomBytes } from 'node:crypto'
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, expect, it } from 'vitest'
import { Agent, newSession } from '../src/agent/agent.ts'
import { AgentServer, resolveAgentConfig } from '../src/agent/index.ts'
import { crc32 } from '../src/core/checksum.ts'
import { AgentClient } from './support/agent-client.ts'
import { startFaultGateway } from './support/client-fault-gateway.ts'

const dir = mkdtempSync(join(tmpdir(), 'kvgate-held-'))
afterAll(() => rmSync(dir, { recursive: true, force: true }))

const geometry = {
  layout: 'flash-attn',
  dtype: 'float16',
  layers: 2,
  kvHeads: 1,
  headSize: 16,
  blockSize: 16,
}
const BLOCKS = 16
const LAYER_BYTES = 2 * BLOCKS * 16 * 16 * 2
const CHUNK_TOKENS = 32 // 2 blocks a chunk

function newAgent(remoteUrl: string): Agent {
  const cfg = resolveAgentConfig(
    { socket: join(dir, 'unused.sock'), chunkTokens: CHUNK_TOKENS, maxFrameBytes: 1 << 20 },
    { KVGATE_MEMORY_BYTES: '16MiB' },
  )
  return new Agent({
    chunkTokens: CHUNK_TOKENS,
    cache: {
      ...cfg.cache,
      native: false,
      remote: { url: remoteUrl, codec: 'raw', lookupTimeoutMs: 5000 },
      disk: false,
      codecWorkers: 0,
    },
    lookupDeadlineMs: 5000,
    copyThreads: 0,
    version: 'test',
  })
}

function tensors(path: string) {
  return Array.from({ length: geometry.layers }, (_, l) => ({
    kind: 'shm',
    path,
    offset: l * LAYER_BYTES,
    shape: [2, BLOCKS, 16, 1, 16],
  }))
}

/** `stored` with its format version raised and its header CRC right: what a newer kvgate writes. */
function newerWriter(stored: Uint8Array): Uint8Array {
  const b = stored.slice()
  const dv = new DataView(b.buffer)
  dv.setUint16(4, 3, true)
  const hb = dv.getUint32(8, true)
  dv.setUint32(hb - 4, crc32(b.subarray(0, hb - 4)), true)
  return b
}

it("a chunk held as unservable ends the agent's lookup before it, chunks after it included; counted in /metrics", async () => {
  const gw = await startFaultGateway()
  const writer = newAgent(gw.url)
  const reader = newAgent(gw.url) // its own (cold) L1: the chunks come from the gateway
  const srv = await AgentServer.listen(reader, {
    socketPath: join(dir, 'reader.sock'),
    maxFrameBytes: 1 << 20,
    metricsPort: 0,
  })
  const c = await AgentClient.open(join(dir, 'reader.sock'))
  const hello = { protocol: 1, model: 'm', hashSeed: '0', geometry }
  const ws = newSession(() => {})
  try {
    // Three chunks stored through the writer; chunk 1's object is then a newer writer's.
    const wpath = join(dir, 'writer-kv')
    writeFileSync(wpath, randomBytes(geometry.layers * LAYER_BYTES))
    writer.answer(ws, { id: 1, op: 'hello', ...hello })
    const w = (await writer.answer(ws, {
      id: 2,
      op: 'register',
      rank: 0,
      numBlocks: BLOCKS,
      tensors: tensors(wpath),
    })) as {
      worker: number
    }
    const keys = Buffer.concat([randomBytes(32), randomBytes(32), randomBytes(32)])
    const save = async (id: number, chunks: number) => {
      const blockIds = Array.from({ length: 2 * chunks }, (_, i) => i)
      await writer.answer(ws, {
        id,
        op: 'save',
        worker: w.worker,
        keys: keys.subarray(0, 32 * chunks),
        blockIds,
      })
      expect(await writer.answer(ws, { id: id + 1, op: 'flush' })).toEqual({})
    }
    await save(3, 1)
    const first = [...gw.objects.keys()]
    await save(5, 2)
    const second = [...gw.objects.keys()].filter((k) => !first.includes(k))
    expect(second).toHaveLength(1)
    await save(7, 3)
    expect(gw.objects.size).toBe(3)
    gw.objects.set(second[0]!, newerWriter(gw.objects.get(second[0]!)!))

    expect(await c.call('hello', hello)).toMatchObject({ ok: true })
    const rpath = join(dir, 'reader-kv')
    writeFileSync(rpath, randomBytes(geometry.layers * LAYER_BYTES))
    const { worker } = await c.call('register', { rank: 0, numBlocks: BLOCKS, tensors: tensors(rpath) })
    expect(await c.call('lookup', { keys })).toMatchObject({ ok: true, chunks: 3 })
    // The load meets chunk 1's object: this build cannot read it (the key is then held off).
    const blockIds = Array.from({ length: 6 }, (_, i) => i)
    const load = await c.call('load', { worker, keys, blockIds })
    expect(load).toMatchObject({ ok: true, chunks: 1 })
    expect(load.failedBlocks).toEqual([2, 3, 4, 5])
    // Held: the lookup stops before it, though the gateway holds chunks 1 and 2 (prefix semantics).
    for (let i = 0; i < 2; i++)
      expect(await c.call('lookup', { keys })).toMatchObject({ ok: true, chunks: 1 })
    const res = await fetch(`http://127.0.0.1:${srv.metricsPort}/metrics`)
    expect(await res.text()).toContain('kvgate_agent_lookup_unservable_stops_total 2\n')
  } finally {
    c.close()
    await srv.close()
    writer.endSession(ws)
    await writer.close()
    await gw.close()
  }
})
