import { describe, expect, it } from 'vitest'
import { PrefixOracle } from '../src/fleet/oracle.ts'
import { PRICES, requestCost, storageCostPerMonth } from '../src/fleet/pricing.ts'
import { Rng, Zipf } from '../src/fleet/rng.ts'
import { generateWorkload } from '../src/fleet/workload.ts'

describe('fleet workload', () => {
  it('is deterministic for a seed and different for another', () => {
    const a = generateWorkload({ seed: 7, requests: 50 })
    const b = generateWorkload({ seed: 7, requests: 50 })
    const c = generateWorkload({ seed: 8, requests: 50 })
    expect(a.requests.map((r) => [r.node, Array.from(r.tokens)])).toEqual(
      b.requests.map((r) => [r.node, Array.from(r.tokens)]),
    )
    expect(a.requests.map((r) => r.tokens.length)).not.toEqual(c.requests.map((r) => r.tokens.length))
  })
  it('follow-ups extend their conversation; nodes only serve after they join', () => {
    const w = generateWorkload({ seed: 1, requests: 300, initialNodes: 2, joiningNodes: 2 })
    expect(w.joinAt).toEqual([0, 0, 100, 200])
    const last = new Map<number, Uint32Array>()
    let followUps = 0
    for (const r of w.requests) {
      expect(w.joinAt[r.node]!).toBeLessThanOrEqual(r.seq)
      const prev = last.get(r.conversation)
      if (r.kind === 'follow-up') {
        followUps++
        expect(prev).toBeDefined()
        expect(Array.from(r.tokens.subarray(0, prev!.length))).toEqual(Array.from(prev!))
        expect(r.tokens.length).toBeGreaterThan(prev!.length)
      }
      last.set(r.conversation, r.tokens)
    }
    expect(followUps).toBeGreaterThan(50)
    expect(new Set(w.requests.filter((r) => r.seq >= 200).map((r) => r.node))).toContain(3)
  })
  it('rejects nonsense options', () => {
    expect(() => generateWorkload({ requests: 0 })).toThrow(/requests/)
    expect(() => generateWorkload({ initialNodes: 0 })).toThrow(/initial node/)
    expect(() => generateWorkload({ continueProbability: 2 })).toThrow(/probability/)
    expect(() => generateWorkload({ zipf: Number.NaN })).toThrow(/zipf/)
  })
})

describe('rng and zipf', () => {
  it('zipf favours low ranks roughly as 1/rank^s', () => {
    const rng = new Rng(3)
    const z = new Zipf(10, 1)
    const counts = new Array(10).fill(0)
    for (let i = 0; i < 20000; i++) counts[z.sample(rng)]++
    expect(counts[0] / counts[1]).toBeGreaterThan(1.7)
    expect(counts[0] / counts[1]).toBeLessThan(2.3)
    expect(counts[9]).toBeGreaterThan(0)
  })
  it('floats stay in [0,1) and ints in range', () => {
    const rng = new Rng(9)
    for (let i = 0; i < 10000; i++) {
      const f = rng.float()
      expect(f >= 0 && f < 1).toBe(true)
      const n = rng.int(7)
      expect(Number.isInteger(n) && n >= 0 && n < 7).toBe(true)
    }
  })
})

describe('oracle and prices', () => {
  it('counts the longest stored prefix only', () => {
    const o = new PrefixOracle()
    o.record(['a', 'b', 'd'])
    expect(o.hits(['a', 'b', 'c', 'd'])).toBe(2)
    expect(o.hits(['x', 'a'])).toBe(0)
    expect(o.size).toBe(3)
  })
  it('prices requests and storage at list price', () => {
    const p = PRICES['s3-standard']
    expect(requestCost({ put: 1000, get: 1000, head: 0, list: 0 }, p)).toBeCloseTo(0.0054, 6)
    expect(storageCostPerMonth(1e12, p)).toBeCloseTo(23, 6)
  })
})
