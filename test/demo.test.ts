// `kvgate demo` end to end: two node processes share KV through a gateway on the fs
// store (synthetic 8B-shaped KV always; the real model when ../shared/data is there),
// failure injection (gateway down), the checks themselves, and bad usage.

import { spawnSync } from 'node:child_process'
import { join } from 'node:path'
import { describe, expect, it, vi } from 'vitest'
import { run as demoCommand } from '../src/cli/commands/demo.ts'
import { checksFor, type DemoResult, runDemo } from '../src/demo/run.ts'
import type { ReaderReport, WriterReport } from '../src/demo/types.ts'
import { findSharedData } from '../src/model/index.ts'

const BIN = join(import.meta.dirname, '..', 'bin', 'kvgate.mjs')

function cli(args: string[], env: NodeJS.ProcessEnv = {}) {
  const r = spawnSync(process.execPath, [BIN, 'demo', ...args], {
    encoding: 'utf8',
    env: { ...process.env, ...env },
    timeout: 120_000,
  })
  return { code: r.status, stdout: r.stdout, stderr: r.stderr }
}

const shared = findSharedData()
if (!shared.paths) console.warn(`demo.test: real-model demo skipped — ${shared.reason}`)

describe('kvgate demo, synthetic Llama-3.1-8B-shaped KV', () => {
  it('lossless: node B (cold) gets byte-identical KV from L4 and recomputes only the tail', async () => {
    const steps: string[] = []
    const r = await runDemo({
      synthetic: true,
      codec: 'lossless',
      chunkTokens: 16,
      chunks: 3,
      onStep: (l) => steps.push(l),
    })
    expect(r.checks.filter((c) => !c.ok)).toEqual([])
    expect(r.ok).toBe(true)
    expect(r.mode).toBe('synthetic')
    expect(r.nodeB.verify).toMatchObject({ chunks: 3, identical: 3 })
    expect(r.nodeB.tiers).toEqual(['remote', 'remote', 'remote'])
    expect(r.nodeB.retrievedTokens).toBe(48)
    expect(r.nodeB.recomputedTokens).toBe(r.promptTokens - 48)
    // Two separate processes, neither of them this one.
    expect(new Set([r.nodeA.pid, r.nodeB.pid, process.pid]).size).toBe(3)
    expect(r.gateway.counters.puts.created).toBe(3)
    expect(r.nodeB.stats.remote?.hits).toBe(3)
    expect(r.compression.ratio).toBeGreaterThan(1)
    expect(steps.some((l) => l.startsWith('[2/5] node A'))).toBe(true)
    expect(steps.some((l) => l.startsWith('[4/5] node B'))).toBe(true)
  })

  it('CLI --json on a "fresh machine" (no model files, no native addon): synthetic KV, lossy default codec, exit 0', () => {
    const r = cli(['--chunk-tokens', '16', '--chunks', '2', '--json'], {
      KVGATE_NATIVE_PATH: '/nonexistent/kvgate_native.node',
      KVGATE_SHARED_DATA: '/nonexistent/shared-data',
    })
    expect(r.code, r.stderr).toBe(0)
    const j = JSON.parse(r.stdout) as DemoResult
    expect(j.ok).toBe(true)
    expect(j.mode).toBe('synthetic')
    expect(j.modeReason).toMatch(/KVGATE_SHARED_DATA/)
    expect(j.codec).toBe('kvgate')
    expect(j.nodeA.stats.native.loaded).toBe(false)
    expect(j.nodeB.stats.native.loaded).toBe(false)
    expect(j.nodeB.verify!.chunks).toBe(2)
    // Lossy: not identical, but close.
    expect(j.nodeB.verify!.identical).toBe(0)
    expect(j.nodeB.verify!.kRelErr).toBeLessThan(0.2)
    expect(j.nodeB.verify!.vRelErr).toBeLessThan(0.2)
    expect(j.compression.ratio).toBeGreaterThan(3)
    // Progress went to stderr.
    expect(r.stderr).toMatch(/\[1\/5\] gateway/)
  })

  it('failure injection: with the gateway down node B still completes from local tiers (recomputes)', async () => {
    const r = await runDemo({
      synthetic: true,
      codec: 'lossless',
      chunkTokens: 16,
      chunks: 2,
      gatewayDown: true,
    })
    expect(r.ok).toBe(true)
    expect(r.gateway.down).toBe(true)
    expect(r.nodeB.retrievedTokens).toBe(0)
    expect(r.nodeB.recomputedTokens).toBe(r.promptTokens)
    expect(r.nodeB.stats.remote!.errors).toBeGreaterThan(0)
    expect(r.nodeB.stats.remote!.hits).toBe(0)
  })
})

describe.skipIf(!shared.paths)('kvgate demo, real model (stories260K, TypeScript forward pass)', () => {
  it('lossless: node B continues token for token like node A, from 7 retrieved chunks + a 30-token tail', async () => {
    const r = await runDemo({ codec: 'lossless', continueTokens: 16 })
    expect(r.checks.filter((c) => !c.ok)).toEqual([])
    expect(r.mode).toBe('model')
    expect(r.chunkTokens).toBe(64)
    expect(r.nodeB.retrievedTokens).toBe(448)
    expect(r.nodeB.recomputedTokens).toBe(r.promptTokens - 448)
    expect(r.nodeB.recomputedTokens).toBeGreaterThan(0)
    expect(r.nodeA.continuation).toHaveLength(16)
    expect(r.nodeB.continuation).toEqual(r.nodeA.continuation)
    expect(r.nodeB.continuationText).toBe(r.nodeA.continuationText)
  })

  it('CLI default (lossy kvgate codec): exit 0, ≥ 99% teacher-forced agreement, prints both texts', () => {
    const r = cli([])
    expect(r.code, r.stderr + r.stdout).toBe(0)
    expect(r.stdout).toMatch(/node A continues: "/)
    expect(r.stdout).toMatch(/node B continues: "/)
    expect(r.stdout).toMatch(/PASS {2}next-token agreement/)
    expect(r.stdout).toMatch(/compression: .* smaller, kvgate/)
    expect(r.stdout).toMatch(/demo OK/)
  })
})

describe('demo checks and usage', () => {
  const writer = (continuation: number[]): WriterReport =>
    ({
      pid: 1,
      prefillMs: 1,
      prefillTokens: 100,
      storeMs: 1,
      flushMs: 1,
      storedChunks: 3,
      continuation,
      stats: { remote: { errors: 0 } },
    }) as unknown as WriterReport
  const reader = (over: Partial<ReaderReport>): ReaderReport =>
    ({
      pid: 2,
      tiers: ['remote', 'remote', 'remote'],
      lookupMs: 1,
      retrieveMs: 1,
      retrievedTokens: 96,
      importMs: 0,
      recomputedTokens: 4,
      recomputeMs: 1,
      continuation: [5, 6, 7],
      stats: { remote: { errors: 0 } },
      ...over,
    }) as unknown as ReaderReport
  const base = {
    source: { kind: 'model' as const, dir: '.', continueTokens: 3 },
    codec: 'lossless' as const,
    prompt: Array.from({ length: 100 }, (_, i) => i),
    fullChunks: 3,
    chunkTokens: 32,
    down: false,
  }

  it('fail when node B diverges, misses chunks or recomputes too much', () => {
    const ok = checksFor({ ...base, nodeA: writer([5, 6, 7]), nodeB: reader({}) })
    expect(ok.every((c) => c.ok)).toBe(true)
    const diverged = checksFor({
      ...base,
      nodeA: writer([5, 6, 7]),
      nodeB: reader({ continuation: [5, 6, 8] }),
    })
    expect(diverged.find((c) => c.name.startsWith('continuation identical'))?.ok).toBe(false)
    const partial = checksFor({
      ...base,
      nodeA: writer([5, 6, 7]),
      nodeB: reader({ tiers: ['remote', 'remote'], retrievedTokens: 64, recomputedTokens: 36 }),
    })
    expect(partial.filter((c) => !c.ok).map((c) => c.name)).toHaveLength(2)
    const lowAgreement = checksFor({
      ...base,
      codec: 'kvgate',
      nodeA: writer([5, 6, 7]),
      nodeB: reader({ agreement: { matched: 98, total: 100 } }),
    })
    expect(lowAgreement.find((c) => c.name.startsWith('next-token agreement'))?.ok).toBe(false)
    const wrongBytes = checksFor({
      ...base,
      source: { kind: 'synthetic', seed: 1 },
      nodeA: writer([]),
      nodeB: reader({ verify: { chunks: 3, identical: 2, kRelErr: 0, vRelErr: 0 } }),
    })
    expect(wrongBytes.find((c) => c.name.startsWith('retrieved KV byte-identical'))?.ok).toBe(false)
  })

  it('rejects bad options with exit 2 and a message', async () => {
    const errors: string[] = []
    const logs: string[] = []
    const err = vi.spyOn(console, 'error').mockImplementation((m: unknown) => void errors.push(String(m)))
    const log = vi.spyOn(console, 'log').mockImplementation((m: unknown) => void logs.push(String(m)))
    try {
      expect(await demoCommand(['--codec', 'zstd'])).toBe(2)
      expect(errors.pop()).toMatch(/invalid --codec 'zstd'/)
      expect(await demoCommand(['--model', '/nonexistent/model-dir'])).toBe(2)
      expect(errors.pop()).toMatch(/--model \/nonexistent\/model-dir/)
      expect(await demoCommand(['--chunk-tokens', '0'])).toBe(2)
      expect(errors.pop()).toMatch(/--chunk-tokens/)
      expect(await demoCommand(['--frobnicate'])).toBe(2)
      expect(await demoCommand(['extra'])).toBe(2)
      expect(await demoCommand(['--help'])).toBe(0)
      expect(logs.pop()).toMatch(/Usage: kvgate demo/)
    } finally {
      err.mockRestore()
      log.mockRestore()
    }
  })
})
