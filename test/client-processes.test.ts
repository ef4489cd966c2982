// Multi-process behaviour: a writer SIGKILLed in the middle of L2 writes leaves
// nothing corrupt behind, and several processes storing one prefix share one copy.

import { type ChildProcess, spawn } from 'node:child_process'
import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterEach, describe, expect, it } from 'vitest'
import { KVCache } from '../src/client/index.ts'
import { chunkBytes, MODEL_PRESETS } from '../src/core/layout.ts'
import { promptTokens, tensorFor } from './support/client-child.ts'
import { startFaultGateway } from './support/client-fault-gateway.ts'

const T = 64
const CB = chunkBytes(MODEL_PRESETS.stories260k, T)
const CHILD = join(import.meta.dirname, 'support', 'client-child.ts')

function child(mode: string, opts: object): ChildProcess {
  return spawn(process.execPath, ['--import', 'tsx', CHILD, mode, JSON.stringify(opts)], {
    stdio: ['ignore', 'pipe', 'pipe'],
  })
}

function output(p: ChildProcess): Promise<{ code: number | null; out: string; err: string }> {
  let out = ''
  let err = ''
  p.stdout?.on('data', (d) => {
    out += String(d)
  })
  p.stderr?.on('data', (d) => {
    err += String(d)
  })
  return new Promise((r) => p.on('exit', (code) => r({ code, out, err })))
}

const dirs: string[] = []
afterEach(() => {
  for (const d of dirs.splice(0)) rmSync(d, { recursive: true, force: true })
})

describe('client across processes', () => {
  it('after a SIGKILL in the middle of L2 writes, a restarted cache serves only intact chunks', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'kvgate-crash-'))
    dirs.push(dir)
    const p = child('store-loop', { dir, seed: 5 })
    const done = output(p)
    await new Promise<void>((resolve) => {
      p.stdout?.on('data', (d) => {
        if (String(d).includes('ready')) resolve()
      })
    })
    // Let it write for a while, then kill it without warning.
    await new Promise((r) => setTimeout(r, 700))
    p.kill('SIGKILL')
    const { code } = await done
    expect(code).toBeNull()

    const cache = await KVCache.open({
      model: 'stories260k',
      chunkTokens: T,
      memory: { bytes: 8 * CB },
      disk: { dir, bytes: 1 << 30 },
    })
    try {
      const disk = cache.stats().disk!
      expect(disk.files).toBeGreaterThan(2)
      const n = disk.files + 4
      const toks = promptTokens(n, 5)
      const into = new Uint8Array(n * CB)
      const mask = await cache.retrieve(toks, { into })
      const served = mask.reduce((a, b) => a + b, 0) / T
      expect(served).toBeGreaterThan(2)
      for (let i = 0; i < served; i++) {
        expect(Buffer.compare(into.subarray(i * CB, (i + 1) * CB), tensorFor(i, 5))).toBe(0)
      }
      expect(cache.stats().disk?.corrupt).toBe(0)
    } finally {
      await cache.close()
    }
  })

  it('three processes storing one prefix through one gateway leave one copy; a fourth node reads it', async () => {
    const gw = await startFaultGateway()
    try {
      const runs = await Promise.all(
        [0, 1, 2].map(() =>
          output(child('store-prefix', { url: gw.url, chunks: 4, seed: 9, lookupTimeoutMs: 10_000 })),
        ),
      )
      for (const r of runs) expect(r.code, r.err).toBe(0)
      const stats = runs.map(
        (r) => JSON.parse(r.out.trim().split('\n').pop()!) as { puts: number; errors: number },
      )
      expect(stats.every((s) => s.errors === 0)).toBe(true)
      expect(gw.objects.size).toBe(4)
      const reader = await KVCache.open({
        model: 'stories260k',
        chunkTokens: T,
        namespace: 'shared',
        memory: { bytes: 8 * CB },
        remote: { url: gw.url, codec: 'raw' },
      })
      try {
        const into = new Uint8Array(4 * CB)
        const mask = await reader.retrieve(promptTokens(4, 9), { into })
        expect(mask.reduce((a, b) => a + b, 0)).toBe(4 * T)
        for (let i = 0; i < 4; i++)
          expect(Buffer.compare(into.subarray(i * CB, (i + 1) * CB), tensorFor(i, 9))).toBe(0)
      } finally {
        await reader.close()
      }
    } finally {
      await gw.close()
    }
  })
})
