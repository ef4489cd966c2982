// The fleet simulation on the fs store: node processes behind one gateway reach the
// oracle's hit rate, late joiners get L4 hits, retrieved chunks verify, N writers of
// one prefix store one object per chunk; a node whose gateway is down keeps serving.

import { mkdtempSync, rmSync } from 'node:fs'
import { createServer } from 'node:net'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, describe, expect, it } from 'vitest'
import type { KVCacheStats } from '../src/client/index.ts'
import { chainKeys } from '../src/core/keys.ts'
import { MODEL_PRESETS } from '../src/core/layout.ts'
import { forkWorker } from '../src/demo/worker.ts'
import { chunkContent, verifyChunk } from '../src/fleet/content.ts'
import { diffCounters, gatewayCounters, parseSamples } from '../src/fleet/gateway-metrics.ts'
import type { RequestReport } from '../src/fleet/node.ts'
import { runFleet } from '../src/fleet/run.ts'
import { FsStore } from '../src/gateway/node.ts'

const dirs: string[] = []
afterAll(() => {
  for (const d of dirs) rmSync(d, { recursive: true, force: true })
})
function tmp(name: string): string {
  const d = mkdtempSync(join(tmpdir(), `kvgate-${name}-`))
  dirs.push(d)
  return d
}

const g = MODEL_PRESETS.stories260k
const ns = { modelId: g.modelId, geometry: g, chunkTokens: 16 }

describe('fleet simulation (fs store)', () => {
  it('60 requests over 3 nodes: hit rate within 5% of the oracle, joiners hit L4, everything verifies', async () => {
    const store = await new FsStore({ root: tmp('fleet-store'), fsync: false }).open()
    const lines: string[] = []
    const r = await runFleet({
      store,
      storeLabel: 'fs',
      chunkTokens: 16,
      memoryBytes: 64 * 1024,
      workload: {
        seed: 7,
        requests: 60,
        initialNodes: 2,
        joiningNodes: 1,
        systemPrompts: 2,
        systemPromptTokens: 64,
        documents: 8,
        documentTokens: 128,
        turnTokens: 32,
      },
      writerChunks: 4,
      onProgress: (l) => lines.push(l),
    })
    const t = r.totals
    expect(t.requests).toBe(60)
    expect(t.chunks).toBeGreaterThan(300)
    expect(t.oracleHitRate).toBeGreaterThan(0.3)
    expect(Math.abs(t.hitRate - t.oracleHitRate)).toBeLessThanOrEqual(0.05)
    // No cache can beat the oracle: served ≤ oracle request by request.
    for (const q of r.requests) expect(q.served).toBeLessThanOrEqual(q.oracle)
    expect(t.badChunks).toBe(0)
    expect(t.byTier.memory + t.byTier.disk + t.byTier.remote).toBe(t.served)
    // L1 is tiny here (64 KiB = 3 chunks), so L2 serves too.
    expect(t.byTier.disk).toBeGreaterThan(0)
    const joiner = r.nodes[2]!
    expect(joiner.joinAt).toBe(30)
    expect(joiner.requests).toBeGreaterThan(0)
    expect(joiner.byTier.remote).toBeGreaterThan(0)
    // Its first request found nothing local: whatever it got came from L4.
    const first = r.requests.find((q) => q.node === 2)!
    expect(first.byTier.memory + first.byTier.disk).toBe(0)
    expect(first.served).toBe(first.oracle)
    // S3-style traffic came from the gateway's own counters.
    expect(r.gateway.storeOps.put).toBe(r.cost.storedObjects)
    expect(r.gateway.storeOps.get).toBe(t.byTier.remote)
    expect(r.cost.requestDollars).toBeGreaterThan(0)
    expect(r.cost.perThousandPrefixHits).toBeCloseTo((r.cost.requestDollars / t.prefixHits) * 1000, 9)
    expect(r.prefill.savedTokens).toBe(t.served * 16)
    // Three nodes stored one 4-chunk prefix at once: one object per chunk.
    expect(r.writers.objectsCreated).toBe(4)
    expect(r.writers.createdAtGateway).toBe(4)
    expect(r.writers.objectsPerChunk).toBe(1)
    expect(lines.some((l) => /node 2 .*joins at request 30/.test(l))).toBe(true)
  })
})

describe('fleet node with its gateway down (failure injection)', () => {
  it('serves every request, from local tiers, and counts the L4 failures', async () => {
    // A port nobody listens on.
    const port = await new Promise<number>((resolve) => {
      const s = createServer().listen(0, '127.0.0.1', () => {
        const p = (s.address() as { port: number }).port
        s.close(() => resolve(p))
      })
    })
    const node = await forkWorker(new URL('../src/fleet/node.ts', import.meta.url))
    try {
      await node.call('open', {
        url: `http://127.0.0.1:${port}`,
        namespace: 'down',
        model: g,
        chunkTokens: 16,
        codec: 'lossless',
        memoryBytes: 1 << 20,
        diskDir: join(tmp('fleet-down'), 'l2'),
        diskBytes: 1 << 24,
        lookupTimeoutMs: 200,
      })
      const tokens = Array.from({ length: 80 }, (_, i) => (i * 13) % 500)
      const a = await node.call<RequestReport>('request', { tokens })
      expect(a).toMatchObject({ chunks: 5, served: 0, badChunks: 0 })
      const b = await node.call<RequestReport>('request', { tokens: [...tokens, 1, 2, 3] })
      expect(b).toMatchObject({ chunks: 5, served: 5, badChunks: 0 })
      expect(b.byTier).toEqual({ memory: 5, disk: 0, remote: 0 })
      const s = await node.call<KVCacheStats>('stats')
      expect(s.remote!.errors).toBeGreaterThan(0)
      expect(s.remote!.hits).toBe(0)
      expect(s.remote!.puts).toBe(0)
    } finally {
      await node.close()
    }
  })
})

describe('fleet content and gateway metrics parsing', () => {
  it('chunk content is a function of the chain key; a wrong chunk fails verification', () => {
    const keys = chainKeys(
      Array.from({ length: 48 }, (_, i) => i + 3),
      ns,
    )
    const a = chunkContent(g, keys[0]!)
    expect(Buffer.compare(a, chunkContent(g, keys[0]!))).toBe(0)
    expect(verifyChunk(g, keys[0]!, a, true)).toBe(true)
    const other = chunkContent(g, keys[1]!)
    expect(verifyChunk(g, keys[0]!, other, true)).toBe(false)
    expect(verifyChunk(g, keys[0]!, other, false)).toBe(false)
    const flipped = a.slice()
    flipped[100]! ^= 1
    expect(verifyChunk(g, keys[0]!, flipped, true)).toBe(false)
    expect(verifyChunk(g, keys[0]!, a.subarray(1), true)).toBe(false)
  })

  it('reads store ops and PUT outcomes from /metrics text, skipping garbage lines', () => {
    const text = [
      '# HELP kvgate_store_ops_total x',
      'kvgate_store_ops_total{op="get",result="ok",store="s3"} 5',
      'kvgate_store_ops_total{op="get",result="absent",store="s3"} 2',
      'kvgate_store_ops_total{op="head",result="ok",store="s3"} 7',
      'kvgate_store_ops_total{op="put",result="created",store="s3"} 3',
      'kvgate_store_ops_total{op="weird",result="ok",store="s3"} 99',
      'kvgate_chunk_puts_total{result="created"} 3',
      'kvgate_chunk_puts_total{result="exists"} 4',
      'kvgate_http_bytes_in_total 1000',
      'kvgate_store_ops_total{op="list"} NaN',
      'garbage line {{{',
      'kvgate_store_ops_total{op="list",path="a\\"b"} 1',
      '',
    ].join('\n')
    const c = gatewayCounters(text)
    expect(c.storeOps).toEqual({ get: 7, head: 7, put: 3, list: 1, delete: 0 })
    expect(c.puts).toEqual({ created: 3, exists: 4, rejected: 0 })
    expect(c.bytesIn).toBe(1000)
    expect(parseSamples('x{a="1"} 2').at(0)).toEqual({ name: 'x', labels: { a: '1' }, value: 2 })
    const d = diffCounters(c, gatewayCounters('kvgate_store_ops_total{op="get"} 4'))
    expect(d.storeOps.get).toBe(3)
    expect(d.puts.exists).toBe(4)
  })
})
