// vLLM ≥ 0.26's per-layer [B, H, N, K|V] views of one host allocation (NHD and HND pages)
// through a real agent socket, on the event loop and on copy threads: a save then a load into
// other blocks puts exactly the saved blocks' bytes there (the host copies' 2-D row sets), and
// no other byte of the allocation changes.

import { randomBytes } from 'node:crypto'
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, expect, it } from 'vitest'
import { resolveAgentConfig, startAgent } from '../src/agent/index.ts'
import { fileMapStats } from '../src/client/native.ts'
import { loadNative } from '../src/client/native-api.ts'
import { AgentClient } from './support/agent-client.ts'

const dir = mkdtempSync(join(tmpdir(), 'kvgate-strided-'))
afterAll(() => rmSync(dir, { recursive: true, force: true }))

// 3 layers, 4 KV heads of 64 (bf16): a token's head is 128 B of K and 128 of V, side by side.
const LAYERS = 3
const HEADS = 4
const HEAD = 64
const TOKENS = 16
const BLOCKS = 24
const C = 2 * HEAD // elements of one token's head: K | V
const BLOCK_BYTES = HEADS * TOKENS * C * 2
// Layers a page apart with padding between (a view into a larger allocation).
const LAYER_STRIDE = BLOCKS * BLOCK_BYTES + 4096
const GEOMETRY = {
  layout: 'flash-attn',
  dtype: 'bfloat16',
  layers: LAYERS,
  kvHeads: HEADS,
  headSize: HEAD,
  blockSize: TOKENS,
}
const STRIDES = {
  LBNHC: [TOKENS * HEADS * C, C, HEADS * C, 1], // NHD pages (vLLM's default)
  LBHNC: [HEADS * TOKENS * C, TOKENS * C, C, 1], // HND pages
}

it('the addon is loaded (else these copies are pread/pwrite, not the row sets)', () => {
  expect(loadNative().api?.copyRowsAvailable(), loadNative().reason).toBe(true)
})

for (const layout of ['LBNHC', 'LBHNC'] as const)
  for (const threads of [0, 1, 2])
    it(`${layout}, ${threads} copy thread(s): saved blocks load into other blocks byte for byte; nothing else changes`, async () => {
      const name = `${layout}-${threads}`
      const cfg = resolveAgentConfig(
        { socket: join(dir, `${name}.sock`), chunkTokens: 64, maxFrameBytes: 1 << 20 },
        { KVGATE_MEMORY_BYTES: '16MiB' },
      )
      cfg.cache = { ...cfg.cache, remote: false, disk: false, codecWorkers: 0 }
      cfg.copyThreads = threads
      const maps = fileMapStats().mappings
      const server = await startAgent(cfg, 'test')
      const path = join(dir, `${name}-kv`)
      writeFileSync(path, randomBytes(LAYERS * LAYER_STRIDE))
      try {
        const c = await AgentClient.open(join(dir, `${name}.sock`))
        expect(
          await c.call('hello', { protocol: 1, model: 'm', hashSeed: '0', geometry: GEOMETRY }),
        ).toMatchObject({
          ok: true,
        })
        const tensors = Array.from({ length: LAYERS }, (_, l) => ({
          kind: 'shm',
          path,
          offset: l * LAYER_STRIDE,
          shape: [BLOCKS, HEADS, TOKENS, C],
          strides: STRIDES[layout],
        }))
        const r = await c.call('register', { rank: 0, numBlocks: BLOCKS, tensors })
        expect(r).toMatchObject({ ok: true })
        const worker = r.worker as number
        // 3 chunks of 4 blocks, scattered; loaded into 12 other blocks.
        const keys = Buffer.concat([0, 1, 2].map(() => randomBytes(32)))
        const src = [5, 0, 17, 9, 2, 23, 11, 6, 14, 20, 3, 8]
        const dst = [1, 22, 4, 13, 19, 7, 16, 10, 21, 12, 15, 18]
        expect(await c.call('save', { worker, keys, blockIds: src })).toMatchObject({ ok: true, stored: 3 })
        const before = readFileSync(path)
        expect(await c.call('load', { worker, keys, blockIds: dst })).toMatchObject({
          ok: true,
          chunks: 3,
          failedBlocks: [],
        })
        const after = readFileSync(path)
        // A block's elements are one region of the layer in both orders (B is outermost).
        const want = Buffer.from(before)
        for (let l = 0; l < LAYERS; l++)
          for (let i = 0; i < src.length; i++) {
            const at = (b: number) => l * LAYER_STRIDE + b * BLOCK_BYTES
            want.set(before.subarray(at(src[i]!), at(src[i]!) + BLOCK_BYTES), at(dst[i]!))
          }
        expect(after.equals(want)).toBe(true)
        expect(after.equals(before)).toBe(false) // the load wrote something
        c.close()
      } finally {
        await server.close()
      }
      expect(fileMapStats().mappings).toBe(maps)
    })
