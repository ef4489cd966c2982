// The client's key memo must give exactly the keys core/keys.ts computes, for
// repeated, extended, truncated and diverging prompts, while hashing less.

import { readFileSync } from 'node:fs'
import { describe, expect, it } from 'vitest'
import { KeyMemo } from '../src/client/key-memo.ts'
import { loadNative } from '../src/client/native-api.ts'
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

describe('the addon’s one-call sha256-v1 chain', () => {
  const native = loadNative().api
  const vectors = JSON.parse(readFileSync(new URL('./vectors/keys.json', import.meta.url), 'utf8')) as {
    cases: {
      name: string
      namespace: KeyNamespace
      tokens: number[]
      includePartial: boolean
      keys: string[]
    }[]
  }

  it('gives the independently derived key vectors (test/vectors/keys.json) through the memo', (ctx) => {
    if (!native) return ctx.skip(`no native addon: ${loadNative().reason}`)
    let checked = 0
    for (const v of vectors.cases) {
      if ((v.namespace.scheme ?? 'sha256-v1') !== 'sha256-v1') continue
      let calls = 0
      const m = new KeyMemo(v.namespace, undefined, (...a) => {
        calls++
        return native.sha256V1Chain(...a)
      })
      expect(hexes(m.keys(v.tokens, v.includePartial)), v.name).toEqual(v.keys)
      if (Math.floor(v.tokens.length / v.namespace.chunkTokens) > 1) expect(calls, v.name).toBe(1)
      checked++
    }
    expect(checked).toBeGreaterThan(3)
  })

  it('equals chainKeys field for field: new, repeated, extended and diverging prompts', (ctx) => {
    if (!native) return ctx.skip(`no native addon: ${loadNative().reason}`)
    const m = new KeyMemo(ns, undefined, native.sha256V1Chain)
    const base = prompt(200, 5)
    for (const t of [
      base,
      base,
      [...base, ...prompt(41, 6)],
      [...base.slice(0, 77), ...prompt(90, 7)],
      prompt(9, 2),
    ]) {
      const got = m.keys(t, true)
      const ref = chainKeys(t, ns, { includePartial: true })
      expect(got.map((k) => ({ ...k, key: Buffer.from(k.key).toString('hex') }))).toEqual(
        ref.map((k) => ({ ...k, key: Buffer.from(k.key).toString('hex') })),
      )
    }
  })

  it('a hasher that declines (no addon) falls back to chainKeys; other schemes never call it', () => {
    let calls = 0
    const declines = () => {
      calls++
      return undefined
    }
    const t = prompt(64, 3)
    expect(hexes(new KeyMemo(ns, undefined, declines).keys(t))).toEqual(hexes(chainKeys(t, ns)))
    expect(calls).toBe(1)
    const vns: KeyNamespace = { ...ns, scheme: 'vllm-sha256-cbor', hashSeed: '0' }
    expect(hexes(new KeyMemo(vns, undefined, declines).keys(t))).toEqual(hexes(chainKeys(t, vns)))
    expect(calls).toBe(1)
  })

  it('refuses arguments that do not fit, before hashing anything', (ctx) => {
    if (!native) return ctx.skip(`no native addon: ${loadNative().reason}`)
    const key = new Uint8Array(32)
    const toks = new Uint32Array(16)
    expect(() => native.sha256V1Chain(new Uint8Array(31), toks, 8, 2)).toThrow(/32-byte/)
    expect(() => native.sha256V1Chain(key, toks, 8, 3)).toThrow(/fit/)
    expect(() => native.sha256V1Chain(key, toks, 0, 1)).toThrow(/chunkTokens/)
    expect(() => native.sha256V1Chain(key, toks, 8.5, 1)).toThrow(/chunkTokens/)
    expect(() => native.sha256V1Chain(key, Array.from(toks) as unknown as Uint32Array, 8, 2)).toThrow(
      /Uint32Array/,
    )
    expect(native.sha256V1Chain(key, toks, 8, 0)).toEqual(new Uint8Array(0))
  })
})
