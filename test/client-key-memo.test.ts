// The client's key memo must give exactly the keys core/keys.ts computes, for
// repeated, extended, truncated and diverging prompts, while hashing less.

import { describe, expect, it } from 'vitest'
import { KeyMemo } from '../src/client/key-memo.ts'
import { chainKeys, type KeyNamespace } from '../src/core/keys.ts'
import { MODEL_PRESETS } from '../src/core/layout.ts'

const g = MODEL_PRESETS.stories260k
const ns: KeyNamespace = { modelId: g.modelId, geometry: g, chunkTokens: 8 }
const prompt = (n: number, seed: number) => Array.from({ length: n }, (_, i) => (i * 17 + seed) % 500)
const hexes = (ks: { hex: string }[]) => ks.map((k) => k.hex)

describe('KeyMemo', () => {
  it('matches chainKeys for every kind of prefix relation', () => {
    const m = new KeyMemo(ns)
    const base = prompt(80, 1)
    const cases = [
      base,
      base, // repeat
      base.slice(0, 43), // truncated (partial tail ignored)
      [...base, ...prompt(37, 2)], // extended
      [...base.slice(0, 40), ...prompt(40, 3)], // diverges at chunk 5
      [...base.slice(0, 44), 999, ...base.slice(45)], // diverges mid-chunk 5
      prompt(64, 4), // unrelated
      Uint32Array.from(base), // typed array
      prompt(5, 1), // shorter than a chunk
    ]
    for (const t of cases) expect(hexes(m.keys(t))).toEqual(hexes(chainKeys(t, ns)))
    // Token ranges and parents are right too.
    const ks = m.keys([...base.slice(0, 40), ...prompt(40, 3)])
    const ref = chainKeys([...base.slice(0, 40), ...prompt(40, 3)], ns)
    expect(ks.map((k) => [k.index, k.start, k.end, k.parentHex])).toEqual(
      ref.map((k) => [k.index, k.start, k.end, k.parentHex]),
    )
  })

  it('includePartial adds the tail key exactly as chainKeys does', () => {
    const m = new KeyMemo(ns)
    for (const t of [
      prompt(83, 9),
      prompt(83, 9),
      prompt(5, 9),
      prompt(80, 9),
      [...prompt(40, 9), 1, 2, 3],
    ]) {
      expect(hexes(m.keys(t, true))).toEqual(hexes(chainKeys(t, ns, { includePartial: true })))
      const last = m.keys(t, true).at(-1)
      expect(last?.partial).toBe(t.length % 8 !== 0)
    }
  })

  it('hashes only the new chunks of a prompt that extends or repeats a known one', () => {
    const m = new KeyMemo(ns)
    const base = prompt(800, 5)
    m.keys(base)
    expect(m.stats.hashed).toBe(100)
    m.keys(base)
    expect(m.stats.reused).toBe(100)
    expect(m.stats.hashed).toBe(100)
    m.keys([...base, ...prompt(80, 6)])
    expect(m.stats.hashed).toBe(110)
  })

  it('forgets old prompts beyond its token budget', () => {
    const m = new KeyMemo(ns, 100)
    m.keys(prompt(80, 7))
    m.keys(prompt(80, 8))
    expect(m.stats.entries).toBe(1)
    m.keys(prompt(80, 7))
    expect(m.stats.reused).toBe(0)
  })
})
