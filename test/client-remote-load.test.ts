// The L4 write queue under a normal burst of stores (a healthy gateway sheds
// nothing), and what the remote tier holds after many failed requests (nothing).

import { setFlagsFromString } from 'node:v8'
import { runInNewContext } from 'node:vm'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { KVCache } from '../src/client/index.ts'
import { RemoteTier } from '../src/client/tiers/remote.ts'
import { chunkBytes, MODEL_PRESETS } from '../src/core/layout.ts'
import { createGateway, MemoryStore } from '../src/gateway/index.ts'
import { type RunningGateway, serveGateway } from '../src/gateway/node.ts'
import { type FaultGateway, startFaultGateway } from './support/client-fault-gateway.ts'

const g = MODEL_PRESETS.stories260k
const T = 16
const CB = chunkBytes(g, T)

function tokens(n: number, seed: number): number[] {
  return Array.from({ length: n }, (_, i) => (i * 7 + seed * 131) % 512)
}
function kvFor(chunks: number, seed: number): Uint8Array {
  return Uint8Array.from({ length: chunks * CB }, (_, i) => ((i * 31 + seed) ^ (i >> 7)) & 255)
}

describe('a healthy gateway is not shed (finding 20)', () => {
  let gw: RunningGateway
  beforeAll(async () => {
    gw = await serveGateway(createGateway({ store: new MemoryStore() }), { port: 0 })
  })
  afterAll(async () => {
    await gw.close(100)
  })

  it('20 stores of 8 chunks without flush: all 160 uploads land, none shed, no warning', async () => {
    const warnings: string[] = []
    const onWarning = (w: Error & { code?: string }) => {
      if (w.code === 'KVGATE_REMOTE_SHED') warnings.push(w.message)
    }
    process.on('warning', onWarning)
    const c = await KVCache.open({
      model: 'stories260k',
      chunkTokens: T,
      memory: { bytes: 170 * CB },
      remote: { url: gw.url, codec: 'raw' },
    })
    try {
      for (let i = 0; i < 20; i++) await c.store(tokens(8 * T, 100 + i), kvFor(8, 100 + i))
      await c.flush()
      const s = c.stats().remote!
      expect(s.shedWrites).toBe(0)
      expect(s.puts).toBe(160)
      expect(s.errors).toBe(0)
      await new Promise((r) => setImmediate(r))
      expect(warnings).toEqual([])
    } finally {
      process.off('warning', onWarning)
      await c.close(100)
    }
  })
})

describe('chunks held in L1 reach L4 whole (README "Write-behind")', () => {
  it('a prompt far over remote.maxQueuedBytes that fits L1 is uploaded whole: pinned chunks cost no queue bytes', async () => {
    const gw = await serveGateway(createGateway({ store: new MemoryStore() }), { port: 0 })
    const c = await KVCache.open({
      model: 'stories260k',
      chunkTokens: T,
      memory: { bytes: 64 * CB },
      // The queue's byte bound is 4 chunks; the prompt is 32, all held (pinned) in L1.
      remote: { url: gw.url, codec: 'raw', maxQueuedBytes: 4 * CB, writeConcurrency: 2 },
    })
    try {
      await c.store(tokens(32 * T, 300), kvFor(32, 300))
      await c.flush()
      const s = c.stats().remote!
      expect(s.shedByReason).toEqual({ breaker: 0, queueFull: 0, closed: 0 })
      expect(s.puts).toBe(32)
      expect(c.stats().memory.livePins).toBe(0)
    } finally {
      await c.close(100)
      await gw.close(100)
    }
  })

  it('private copies (chunks L1 could not take) still count against the byte bound', async () => {
    const gw = await serveGateway(createGateway({ store: new MemoryStore() }), { port: 0 })
    const c = await KVCache.open({
      model: 'stories260k',
      chunkTokens: T,
      memory: { bytes: 2 * CB }, // one slot (a slot is page-rounded, with the header before the tensor)
      remote: { url: gw.url, codec: 'raw', maxQueuedBytes: 4 * CB, writeConcurrency: 1 },
    })
    try {
      // One chunk fits L1 (pinned by the store); the others are copies, 4 of them within the bound.
      await c.store(tokens(12 * T, 301), kvFor(12, 301))
      await c.flush()
      const s = c.stats().remote!
      expect(s.shedByReason.queueFull).toBeGreaterThan(0)
      expect(s.puts + s.shedByReason.queueFull).toBe(12)
    } finally {
      await c.close(100)
      await gw.close(100)
    }
  })
})

describe('failed requests leave nothing behind', () => {
  let fgw: FaultGateway
  beforeAll(async () => {
    fgw = await startFaultGateway()
  })
  afterAll(async () => {
    await fgw.close()
  })

  setFlagsFromString('--expose-gc')
  const gc = runInNewContext('gc') as () => void
  const settle = async () => {
    for (let i = 0; i < 3; i++) {
      await new Promise((r) => setTimeout(r, 20))
      gc()
    }
  }
  const count = (kind: string) => process.getActiveResourcesInfo().filter((k) => k === kind).length

  it('many failed GETs and PUTs (5xx, hung, oversized): timers, sockets and heap return to baseline', async () => {
    const hex = 'ab'.repeat(32)
    const obj = new Uint8Array(CB)
    // A breaker that never opens on errors, so every request runs its whole failure path.
    const r = new RemoteTier(
      {
        url: fgw.url,
        namespace: 'team-a',
        retries: 2,
        timeoutMs: 2000,
        breakerThreshold: 1e9,
        connections: 4,
      },
      { geometry: g, chunkTokens: T },
    )
    try {
      fgw.objects.set(hex, obj)
      await r.get(hex) // warm: connections and lazily created state exist before the baseline
      await settle()
      const base = {
        timers: count('Timeout'),
        sockets: count('TCPSocketWrap'),
        heap: process.memoryUsage().heapUsed,
      }

      fgw.faults.fail5xx = true
      for (let i = 0; i < 100; i++) {
        expect(await r.get(hex)).toBeUndefined()
        expect(await r.put(hex, obj)).toBe(false)
      }
      fgw.faults.fail5xx = false
      fgw.faults.oversize = 4 * 1024 * 1024
      fgw.faults.oversizeChunked = true
      for (let i = 0; i < 50; i++) expect(await r.get(hex)).toBeUndefined()
      fgw.faults.oversize = 0
      expect(r.stats().oversizedBodies).toBe(50)
      // Hung GETs: two open the breaker (finding 18); later ones are refused at once.
      const hung = new RemoteTier(
        { url: fgw.url, namespace: 'team-a', timeoutMs: 50, connections: 4 },
        { geometry: g, chunkTokens: T },
      )
      fgw.faults.hangGets = true
      for (let i = 0; i < 20; i++) expect(await hung.get(hex)).toBeUndefined()
      fgw.faults.hangGets = false
      expect(hung.stats().breakerOpenedByTimeouts).toBe(1)
      await hung.close(100)
      await settle()

      expect(count('Timeout')).toBeLessThanOrEqual(base.timers)
      expect(count('TCPSocketWrap')).toBeLessThanOrEqual(base.sockets + 4)
      // 50 oversized bodies of 4 MiB were refused at the cap, not buffered.
      expect(process.memoryUsage().heapUsed - base.heap).toBeLessThan(16 * 1024 * 1024)
      expect(r.stats().retries).toBeGreaterThanOrEqual(400)
    } finally {
      await r.close(100)
    }
  })
})
