// One L1 (and one L2 budget) for every KV space of an agent: TP ranks (and engines) of one chunk size share its
// budget and evict each other's chunks, and no space is ever served another space's bytes,
// even where their chain keys are equal (same model and hashes, another KV dtype).

import { randomBytes } from 'node:crypto'
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { type AgentServer, resolveAgentConfig, startAgent } from '../src/agent/index.ts'
import { headerBytesFor } from '../src/core/format.ts'
import { AgentClient, type Msg } from './support/agent-client.ts'

// 1 layer, 1 KV head of 8, blocks of 16 tokens, chunks of 32 tokens (2 blocks): a chunk
// tensor is 1 KiB and takes one 4 KiB L1 slot; 12 KiB of L1 is 3 slots for all spaces.
const NUM_BLOCKS = 12
const BLOCK = 16 * 8 * 2
const LAYER = 2 * NUM_BLOCKS * BLOCK
const SHAPE = [2, NUM_BLOCKS, 16, 1, 8]

let dir: string
let server: AgentServer

beforeAll(async () => {
  dir = mkdtempSync(join(tmpdir(), 'kvgate-agent-l1-'))
  const cfg = resolveAgentConfig(
    { socket: join(dir, 'a.sock'), chunkTokens: 32 },
    { KVGATE_MEMORY_BYTES: '12KiB' },
  )
  cfg.cache = { ...cfg.cache, remote: false, disk: false, codecWorkers: 0 }
  server = await startAgent(cfg, 'test')
})

afterAll(async () => {
  await server?.close()
  rmSync(dir, { recursive: true, force: true })
})

/** An engine worker: a KV tensor file of random bytes, registered over its own connection. */
async function engine(name: string, geometry: Msg, rank = 0, elementBytes = 2) {
  const path = join(dir, name)
  writeFileSync(path, randomBytes((LAYER / 2) * elementBytes))
  const c = await AgentClient.open(join(dir, 'a.sock'))
  const hello = await c.call('hello', {
    protocol: 1,
    model: 'test/shared-l1',
    hashSeed: '0',
    geometry: { layout: 'flash-attn', layers: 1, kvHeads: 1, headSize: 8, blockSize: 16, ...geometry },
  })
  expect(hello.ok).toBe(true)
  const r = await c.call('register', {
    rank,
    numBlocks: NUM_BLOCKS,
    tensors: [{ kind: 'shm', path, offset: 0, shape: SHAPE }],
  })
  expect(r.ok).toBe(true)
  return { c, path, worker: r.worker }
}

/** K and V of block b in a flash-attn layer tensor. */
function block(buf: Buffer, b: number): Buffer {
  return Buffer.concat([
    buf.subarray(b * BLOCK, (b + 1) * BLOCK),
    buf.subarray((NUM_BLOCKS + b) * BLOCK, (NUM_BLOCKS + b + 1) * BLOCK),
  ])
}

async function memoryStats(): Promise<{ resident: number; capacity: number[] }> {
  const c = await AgentClient.open(join(dir, 'a.sock'))
  const s = (await c.call('stats', { spaces: true })) as {
    spaceStats: { cache: { memory: { residentChunks: number; capacityBytes: number } } }[]
  }
  c.close()
  return {
    resident: s.spaceStats.reduce((n, sp) => n + sp.cache.memory.residentChunks, 0),
    capacity: s.spaceStats.map((sp) => sp.cache.memory.capacityBytes),
  }
}

describe('agent L1 shared across KV spaces', () => {
  it('TP ranks share one budget, evict each other, and each loads only its own bytes', async () => {
    const r0 = await engine('rank0', { dtype: 'float16', world: 2 }, 0)
    const r1 = await engine('rank1', { dtype: 'float16', world: 2 }, 1)
    // Both ranks save the same prompt (TP ranks share vLLM's block hashes): 3 chunks each.
    const keys = [randomBytes(32), randomBytes(32), randomBytes(32)]
    const src = [0, 1, 2, 3, 4, 5]
    expect(await r0.c.call('save', { worker: r0.worker, keys, blockIds: src })).toMatchObject({ stored: 3 })
    expect(await r1.c.call('save', { worker: r1.worker, keys, blockIds: src })).toMatchObject({ stored: 3 })
    // One budget of 3 slots for both spaces (per-space budgets would hold 6 chunks).
    const st = await memoryStats()
    expect(st.resident).toBe(3)
    expect(st.capacity).toEqual([12 * 1024, 12 * 1024])
    // Rank 1's chunks evicted rank 0's: a TP lookup needs every rank, so it finds none.
    expect(await r0.c.call('lookup', { keys })).toMatchObject({ chunks: 0 })
    // Rank 1 loads its own bytes, never rank 0's.
    const dst = [6, 7, 8, 9, 10, 11]
    expect(await r1.c.call('load', { worker: r1.worker, keys, blockIds: dst })).toMatchObject({
      chunks: 3,
      failedBlocks: [],
    })
    const A = readFileSync(r0.path)
    const B = readFileSync(r1.path)
    for (let i = 0; i < 6; i++) {
      expect(block(B, dst[i]!).equals(block(B, src[i]!))).toBe(true)
      expect(block(B, dst[i]!).equals(block(A, src[i]!))).toBe(false)
    }
    // Rank 0's load misses: every block reported failed, its blocks untouched.
    const before = readFileSync(r0.path)
    expect(await r0.c.call('load', { worker: r0.worker, keys, blockIds: dst })).toMatchObject({
      chunks: 0,
      failedBlocks: dst,
    })
    expect(readFileSync(r0.path).equals(before)).toBe(true)
    r0.c.close()
    r1.c.close()
  })

  it('equal chain keys in two spaces (same model and hashes, another KV dtype) never meet', async () => {
    // fp16 and bf16 chunks are the same size (one L1) and their chain keys are equal: only
    // the L1 scope keeps the bf16 engine from being served fp16 bytes.
    const f16 = await engine('f16', { dtype: 'float16' })
    const b16 = await engine('b16', { dtype: 'bfloat16' })
    const keys = [randomBytes(32)]
    expect(await f16.c.call('save', { worker: f16.worker, keys, blockIds: [0, 1] })).toMatchObject({
      stored: 1,
    })
    expect(await f16.c.call('lookup', { keys })).toMatchObject({ chunks: 1 })
    expect(await b16.c.call('lookup', { keys })).toMatchObject({ chunks: 0 })
    const before = readFileSync(b16.path)
    expect(await b16.c.call('load', { worker: b16.worker, keys, blockIds: [2, 3] })).toMatchObject({
      chunks: 0,
      failedBlocks: [2, 3],
    })
    expect(readFileSync(b16.path).equals(before)).toBe(true)
    f16.c.close()
    b16.c.close()
  })

  it('a space of another chunk size gets an L1 of its own', async () => {
    const before = (await memoryStats()).resident
    const wide = await engine('wide', { dtype: 'float32' }, 0, 4)
    const keys = [randomBytes(32)]
    expect(await wide.c.call('save', { worker: wide.worker, keys, blockIds: [0, 1] })).toMatchObject({
      stored: 1,
    })
    // Nothing of the fp16 spaces was evicted for it: its chunk went to another L1.
    expect((await memoryStats()).resident).toBe(before + 1)
    expect(await wide.c.call('load', { worker: wide.worker, keys, blockIds: [4, 5] })).toMatchObject({
      chunks: 1,
    })
    const W = readFileSync(wide.path)
    const kv = (b: number) =>
      Buffer.concat([
        W.subarray(b * 2 * BLOCK, (b + 1) * 2 * BLOCK),
        W.subarray((NUM_BLOCKS + b) * 2 * BLOCK, (NUM_BLOCKS + b + 1) * 2 * BLOCK),
      ])
    expect(kv(4).equals(kv(0))).toBe(true)
    expect(kv(5).equals(kv(1))).toBe(true)
    wide.c.close()
  })

  it('L2: every space keeps its own directory within one shared byte budget', async () => {
    // A second agent with L2 on: 3.5 chunk objects of disk for both ranks together.
    const object = headerBytesFor(1) + 1024
    const cfg = resolveAgentConfig(
      { socket: join(dir, 'disk.sock'), chunkTokens: 32 },
      {
        KVGATE_MEMORY_BYTES: '12KiB',
        KVGATE_DISK_DIR: join(dir, 'l2'),
        KVGATE_DISK_BYTES: String(Math.floor(3.5 * object)),
      },
    )
    cfg.cache = { ...cfg.cache, remote: false, codecWorkers: 0 }
    const agent = await startAgent(cfg, 'test')
    try {
      const open = async (rank: number) => {
        const path = join(dir, `disk-rank${rank}`)
        writeFileSync(path, randomBytes(LAYER))
        const c = await AgentClient.open(join(dir, 'disk.sock'))
        await c.call('hello', {
          protocol: 1,
          model: 'test/shared-l2',
          hashSeed: '0',
          geometry: {
            layout: 'flash-attn',
            dtype: 'float16',
            layers: 1,
            kvHeads: 1,
            headSize: 8,
            blockSize: 16,
            world: 2,
          },
        })
        const r = await c.call('register', {
          rank,
          numBlocks: NUM_BLOCKS,
          tensors: [{ kind: 'shm', path, offset: 0, shape: SHAPE }],
        })
        return { c, worker: r.worker }
      }
      const r0 = await open(0)
      const r1 = await open(1)
      const keys = [randomBytes(32), randomBytes(32), randomBytes(32)]
      const blockIds = [0, 1, 2, 3, 4, 5]
      await r0.c.call('save', { worker: r0.worker, keys, blockIds })
      expect((await r0.c.call('flush')).ok).toBe(true)
      await r1.c.call('save', { worker: r1.worker, keys, blockIds })
      expect((await r1.c.call('flush')).ok).toBe(true)
      const s = (await r0.c.call('stats', { spaces: true })) as {
        spaceStats: {
          cache: { disk: { dir: string; files: number; usedBytes: number; capacityBytes: number } }
        }[]
      }
      const disks = s.spaceStats.map((sp) => sp.cache.disk)
      expect(disks.length).toBe(2)
      expect(new Set(disks.map((d) => d.dir)).size).toBe(2) // a directory per space
      // One budget: 3 files in all (rank 1's evicted rank 0's oldest), not 3 per space.
      expect(disks.reduce((n, d) => n + d.files, 0)).toBe(3)
      expect(disks.reduce((n, d) => n + d.usedBytes, 0)).toBeLessThanOrEqual(3.5 * object)
      expect(disks.map((d) => d.files).sort()).toEqual([0, 3])
      r0.c.close()
      r1.c.close()
    } finally {
      await agent.close()
    }
  })
})
