import { readFileSync } from 'node:fs'
import { describe, expect, it } from 'vitest'
import {
  assertKeyHex,
  assertNamespaceName,
  cborEncode,
  chainKeys,
  chainKeysAsync,
  fromHex,
  isKeyHex,
  isNamespaceName,
  type KeyNamespace,
  namespaceId,
  objectName,
  toHex,
} from '../src/core/keys.ts'

interface VectorCase {
  name: string
  namespace: KeyNamespace
  tokens: number[]
  includePartial: boolean
  namespaceId: string
  keys: string[]
}

const vectors = JSON.parse(readFileSync(new URL('./vectors/keys.json', import.meta.url), 'utf8')) as {
  cases: VectorCase[]
}
const tiny: KeyNamespace = {
  modelId: 'm',
  geometry: { layers: 5, kvHeads: 4, headDim: 8, dtype: 'fp16' },
  chunkTokens: 4,
}

describe('key test vectors (derived independently in Python)', () => {
  it('has vectors for both schemes', () => {
    const schemes = new Set(vectors.cases.map((c) => c.namespace.scheme ?? 'sha256-v1'))
    expect([...schemes].sort()).toEqual(['sha256-v1', 'vllm-sha256-cbor'])
  })
  for (const c of vectors.cases) {
    it(`sync: ${c.name}`, () => {
      const keys = chainKeys(c.tokens, c.namespace, { includePartial: c.includePartial })
      expect(keys.map((k) => k.hex)).toEqual(c.keys)
      expect(namespaceId(c.namespace)).toBe(c.namespaceId)
    })
    it(`WebCrypto: ${c.name}`, async () => {
      const keys = await chainKeysAsync(c.tokens, c.namespace, { includePartial: c.includePartial })
      expect(keys.map((k) => k.hex)).toEqual(c.keys)
    })
  }
})

describe('chainKeys', () => {
  it('chains: each key names its parent and token range', () => {
    const keys = chainKeys([1, 2, 3, 4, 5, 6, 7, 8, 9], tiny, { includePartial: true })
    expect(keys.map((k) => [k.start, k.end, k.partial])).toEqual([
      [0, 4, false],
      [4, 8, false],
      [8, 9, true],
    ])
    expect(keys[1]!.parentHex).toBe(keys[0]!.hex)
    expect(keys[2]!.parentHex).toBe(keys[1]!.hex)
  })
  it('a shared prefix gives shared keys; a different token changes every later key', () => {
    const a = chainKeys([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], tiny)
    const b = chainKeys([1, 2, 3, 4, 5, 6, 7, 9, 9, 10, 11, 12], tiny)
    expect(b[0]!.hex).toBe(a[0]!.hex)
    expect(b[1]!.hex).not.toBe(a[1]!.hex)
    expect(b[2]!.hex).not.toBe(a[2]!.hex)
  })
  it('Uint32Array and number[] inputs give the same keys', () => {
    const t = [5, 6, 7, 8, 9, 10, 11, 12]
    expect(chainKeys(Uint32Array.from(t), tiny).map((k) => k.hex)).toEqual(
      chainKeys(t, tiny).map((k) => k.hex),
    )
  })
  it('every namespace field changes the seed', () => {
    const base = namespaceId(tiny)
    const variants: KeyNamespace[] = [
      { ...tiny, modelId: 'n' },
      { ...tiny, chunkTokens: 8 },
      { ...tiny, geometry: { ...tiny.geometry, layers: 6 } },
      { ...tiny, geometry: { ...tiny.geometry, kvHeads: 2 } },
      { ...tiny, geometry: { ...tiny.geometry, headDim: 16 } },
      { ...tiny, geometry: { ...tiny.geometry, dtype: 'bf16' } },
      { ...tiny, hashSeed: 'x' },
      { ...tiny, scheme: 'vllm-sha256-cbor', hashSeed: '' },
    ]
    const ids = variants.map(namespaceId)
    expect(new Set([base, ...ids]).size).toBe(variants.length + 1)
  })
  it('is the same in a fresh process (no per-process randomness)', async () => {
    const { execFileSync } = await import('node:child_process')
    const code = `import('./src/core/keys.ts').then(m => process.stdout.write(m.chainKeys([1,2,3,4,5,6,7,8], ${JSON.stringify(tiny)}).map(k => k.hex).join(',')))`
    const out = execFileSync(process.execPath, ['--import', 'tsx', '-e', code], { encoding: 'utf8' })
    expect(out).toBe(
      chainKeys([1, 2, 3, 4, 5, 6, 7, 8], tiny)
        .map((k) => k.hex)
        .join(','),
    )
  })
  it('resumes a chain after a known key with the same results, for both schemes', async () => {
    const t = Array.from({ length: 23 }, (_, i) => (i * 7919) % 1000)
    for (const ns of [tiny, { ...tiny, scheme: 'vllm-sha256-cbor' as const, hashSeed: '0' }]) {
      const all = chainKeys(t, ns, { includePartial: true })
      for (const cut of [0, 2, 4]) {
        const rest = chainKeys(t, ns, { includePartial: true, after: all[cut]! })
        expect(rest).toEqual(all.slice(cut + 1))
        expect(await chainKeysAsync(t, ns, { includePartial: true, after: all[cut]! })).toEqual(
          all.slice(cut + 1),
        )
      }
    }
    expect(() => chainKeys(t, tiny, { after: { index: -1, key: new Uint8Array(32), hex: '' } })).toThrow(
      /after/,
    )
    expect(() => chainKeys(t, tiny, { after: { index: 0, key: new Uint8Array(8), hex: '' } })).toThrow(
      /after/,
    )
  })
  it('rejects bad tokens and namespaces with clear errors', () => {
    expect(() => chainKeys([1, -1, 2, 3], tiny)).toThrow(/token 1 is -1/)
    expect(() => chainKeys([1, 2.5, 2, 3], tiny)).toThrow(/token 1/)
    expect(() => chainKeys([1, 2 ** 32, 2, 3], tiny)).toThrow(/token 1/)
    expect(() => chainKeys([1, Number.NaN], tiny)).toThrow(/token 1/)
    expect(() => chainKeys('1234' as unknown as number[], tiny)).toThrow(/tokens/)
    expect(() => chainKeys([1], { ...tiny, chunkTokens: 0 })).toThrow(/chunkTokens/)
    expect(() => chainKeys([1], { ...tiny, modelId: '' })).toThrow(/modelId/)
    expect(() =>
      chainKeys([1], { ...tiny, geometry: { ...tiny.geometry, dtype: 'int8' as 'fp16' } }),
    ).toThrow(/dtype/)
    expect(() => chainKeys([1], { ...tiny, scheme: 'md5' as 'sha256-v1' })).toThrow(/scheme/)
    expect(() => chainKeys([1], { ...tiny, scheme: 'vllm-sha256-cbor' })).toThrow(/PYTHONHASHSEED/)
  })
})

describe('canonical CBOR', () => {
  it('uses the shortest head for each integer width', () => {
    const hex = (v: Parameters<typeof cborEncode>[0]) => toHex(Uint8Array.from(cborEncode(v)))
    expect(hex(0)).toBe('00')
    expect(hex(23)).toBe('17')
    expect(hex(24)).toBe('1818')
    expect(hex(256)).toBe('190100')
    expect(hex(65536)).toBe('1a00010000')
    expect(hex(2 ** 32)).toBe('1b0000000100000000')
    expect(hex(-1)).toBe('20')
    expect(hex(null)).toBe('f6')
    expect(hex('a')).toBe('6161')
    expect(hex(new Uint8Array([1, 2]))).toBe('420102')
    expect(hex([1, [2]])).toBe('82018102')
  })
})

describe('validation of keys, namespaces and object names', () => {
  const key = 'ab'.repeat(32)
  it('a key scheme is one of the two, never a name every object has (toString, constructor)', () => {
    for (const scheme of ['toString', 'constructor', '__proto__', 'hasOwnProperty', 'md5']) {
      const ns = { ...tiny, scheme } as unknown as KeyNamespace
      expect(() => chainKeys([1, 2, 3, 4], ns), scheme).toThrow(
        `unknown key scheme '${scheme}': sha256-v1 or vllm-sha256-cbor`,
      )
      expect(() => namespaceId(ns), scheme).toThrow(expect.objectContaining({ code: 'ERR_INVALID_ARGUMENT' }))
    }
  })
  it('accepts exactly 64 lowercase hex', () => {
    expect(isKeyHex(key)).toBe(true)
    for (const bad of [
      'AB'.repeat(32),
      'ab'.repeat(31),
      `${key}0`,
      `../${key.slice(3)}`,
      '',
      42,
      null,
      `${key.slice(0, 63)}g`,
    ]) {
      expect(isKeyHex(bad)).toBe(false)
      expect(() => assertKeyHex(bad)).toThrow(
        expect.objectContaining({ code: 'ERR_INVALID_KEY', status: 400 }),
      )
    }
  })
  it('accepts sane namespace names only', () => {
    for (const ok of ['default', 'team-a', 'a', 'x.y_z', '0']) expect(isNamespaceName(ok)).toBe(true)
    for (const bad of ['', '..', 'a..b', '.hidden', 'A', 'a/b', 'a%2fb', 'a'.repeat(64), ' a', 'a\n', '-a']) {
      expect(isNamespaceName(bad)).toBe(false)
      expect(() => assertNamespaceName(bad)).toThrow(
        expect.objectContaining({ code: 'ERR_INVALID_NAMESPACE' }),
      )
    }
  })
  it('builds fan-out object names and refuses path tricks', () => {
    expect(objectName('kv', 'default', key)).toBe(`kv/default/ab/${key}`)
    expect(objectName('', 'default', key)).toBe(`default/ab/${key}`)
    expect(() => objectName('../etc', 'default', key)).toThrow()
    expect(() => objectName('a//b', 'default', key)).toThrow()
    expect(() => objectName('kv', '..', key)).toThrow()
    expect(() => objectName('kv', 'default', '../../x')).toThrow()
  })
  it('hex round-trips', () => {
    const b = Uint8Array.from({ length: 256 }, (_, i) => i)
    expect(fromHex(toHex(b))).toEqual(b)
    // Exactly Node's lowercase hex for every byte value, of a view at an offset too, and empty.
    expect(toHex(b)).toBe(Buffer.from(b).toString('hex'))
    expect(toHex(b.subarray(3, 40))).toBe(Buffer.from(b.subarray(3, 40)).toString('hex'))
    expect(toHex(new Uint8Array(0))).toBe('')
    expect(() => fromHex('abc')).toThrow()
    expect(() => fromHex('zz')).toThrow()
  })
})
