// KvSpace.keys: the memo that makes warm lookups cheap must give exactly the keys a fresh
// derivation gives (vLLM hash + key tag → sha256, parent chain), whatever came before.

import { hash, randomBytes } from 'node:crypto'
import { afterAll, expect, it } from 'vitest'
import { KvSpace, keyTag, type SpaceDescriptor } from '../src/agent/space.ts'

const d: SpaceDescriptor = {
  model: 'm',
  world: 1,
  hashSeed: '0',
  layout: 'flash-attn',
  dtype: 'fp16',
  layers: 1,
  kvHeads: 1,
  headSize: 8,
  blockSize: 16,
} as SpaceDescriptor
const space = await KvSpace.open(d, null, {
  chunkTokens: 32,
  memory: { bytes: 1 << 20 },
  native: false,
  remote: false,
  disk: false,
  codecWorkers: 0,
} as never)
afterAll(() => space.close())

function fresh(h: Uint8Array): string {
  const tag = keyTag(d, null)
  const input = new Uint8Array(32 + tag.length)
  input.set(h, 0)
  input.set(tag, 32)
  return hash('sha256', input, 'hex')
}

it('memoized keys equal fresh derivations at any position, parent and prefix collision', () => {
  const a = randomBytes(32)
  const b = randomBytes(32)
  // Same first 6 bytes as a: the memo's bucket, told apart by the rest.
  const twin = Buffer.concat([a.subarray(0, 6), randomBytes(26)])
  const orders = [
    [a, b, twin],
    [twin, a],
    [b, a, twin, a],
    [a, b, twin],
  ]
  for (const hashes of orders) {
    const keys = space.keys(hashes)
    let parent = '0'.repeat(64)
    keys.forEach((k, i) => {
      expect(k.hex).toBe(fresh(hashes[i]!))
      expect(Buffer.from(k.key).toString('hex')).toBe(k.hex)
      expect(k).toMatchObject({
        index: i,
        start: i * 32,
        end: (i + 1) * 32,
        parentHex: parent,
        partial: false,
      })
      parent = k.hex
    })
  }
  // The caller's bytes are a view of a request frame: changing them later changes nothing.
  const c = randomBytes(32)
  const before = space.keys([c])[0]!.hex
  c[31]! ^= 1
  expect(space.keys([c])[0]!.hex).toBe(fresh(c))
  expect(space.keys([c])[0]!.hex).not.toBe(before)
  expect(() => space.keys([randomBytes(31)])).toThrow(
    expect.objectContaining({ code: 'ERR_INVALID_ARGUMENT' }),
  )
})

it('packed hashes (one bin of 32·n bytes) give the keys the array form gives; a reused buffer changes nothing memoized', () => {
  const hashes = [randomBytes(32), randomBytes(32), randomBytes(32)]
  const packed = Buffer.concat(hashes)
  expect(space.keys(packed).map((k) => k.hex)).toEqual(space.keys(hashes).map((k) => k.hex))
  expect(space.keys(packed).map((k) => k.hex)).toEqual(hashes.map(fresh))
  // The same frame buffer rewritten with other hashes that share each memo bucket (same first bytes).
  const before = space.keys(packed).map((k) => k.hex)
  for (let i = 0; i < 3; i++) packed[i * 32 + 31]! ^= 0xff
  const now = [0, 1, 2].map((i) => packed.subarray(i * 32, i * 32 + 32))
  expect(space.keys(packed).map((k) => k.hex)).toEqual(now.map(fresh))
  expect(space.keys(hashes).map((k) => k.hex)).toEqual(before)
  expect(space.keys(Buffer.alloc(0))).toEqual([])
})

it('packed hashes at an odd offset of a frame, differing in one byte of any word, are told apart', () => {
  // The memo compares 4-byte words read through a DataView of the request frame (the bin is a view at any offset).
  const a = randomBytes(32)
  const twins = Array.from({ length: 32 }, (_, i) => {
    const t = Buffer.from(a)
    t[i]! ^= 1 << (i % 8)
    return t
  })
  const hashes = [a, ...twins, a]
  const frame = Buffer.concat([Buffer.alloc(7), ...hashes, Buffer.alloc(3)])
  const packed = frame.subarray(7, 7 + 32 * hashes.length)
  expect(space.keys(packed).map((k) => k.hex)).toEqual(hashes.map(fresh))
  expect(space.keys(hashes).map((k) => k.hex)).toEqual(hashes.map(fresh))
  expect(new Set(hashes.slice(0, -1).map(fresh)).size).toBe(33)
})

it('localPrefix counts the leading hashes whose chunks L1 holds, in either form', async () => {
  const hashes = [randomBytes(32), randomBytes(32), randomBytes(32)]
  const keys = space.keys(hashes)
  expect(space.localPrefix(Buffer.concat(hashes))).toBe(0)
  await space.cache.storeKeys(keys.slice(0, 2), () => {})
  expect(space.localPrefix(Buffer.concat(hashes))).toBe(2)
  expect(space.localPrefix(hashes)).toBe(2)
  expect(space.localPrefix(Buffer.concat([hashes[1]!, hashes[0]!]))).toBe(2) // presence is per key
  expect(space.localPrefix(Buffer.concat([hashes[2]!, hashes[0]!]))).toBe(0)
})

it('the hash that followed one last time is compared whole: another after the same hash, differing in one byte of any word, is told apart', () => {
  const a = randomBytes(32)
  const b = randomBytes(32)
  for (let i = 0; i < 32; i++) {
    // [a, b] first: b is what followed a, the first hash the memo compares the next one to.
    expect(space.keys([a, b])[1]!.hex).toBe(fresh(b))
    const t = Buffer.from(b)
    t[i]! ^= 1 << (i % 8)
    expect(space.keys(Buffer.concat([a, t]))[1]!.hex).toBe(fresh(t))
  }
})

it('localPrefix sees a chunk leave L1 at once (cleared, evicted), though a warm lookup skips the index', async () => {
  const hashes = Array.from({ length: 4 }, () => randomBytes(32))
  const packed = Buffer.concat(hashes)
  await space.cache.storeKeys(space.keys(hashes), () => {})
  expect(space.localPrefix(packed)).toBe(4)
  expect(space.localPrefix(packed)).toBe(4) // memoized presence
  space.cache.clearMemory()
  expect(space.localPrefix(packed)).toBe(0)
  await space.cache.storeKeys(space.keys(hashes), () => {})
  expect(space.localPrefix(packed)).toBe(4)
  // Other chunks past L1's slots evict these (least recently used first).
  const slots = space.cache.stats().memory.slots
  const others = Array.from({ length: slots }, () => randomBytes(32))
  for (let i = 0; i < others.length; i += 64)
    await space.cache.storeKeys(space.keys(others.slice(i, i + 64)), () => {})
  expect(space.localPrefix(packed)).toBe(0)
  expect(space.localPrefix(hashes)).toBe(0)
})

it('localPrefix after one chunk left L1: the others still count, that one does not', async () => {
  const hashes = Array.from({ length: 4 }, () => randomBytes(32))
  const packed = Buffer.concat(hashes)
  const keys = space.keys(hashes)
  space.cache.clearMemory()
  // The last chunk stored first: the least recently used, the one eviction takes.
  await space.cache.storeKeys(keys.slice(3), () => {})
  await space.cache.storeKeys(keys.slice(0, 3), () => {})
  expect(space.localPrefix(packed)).toBe(4)
  const slots = space.cache.stats().memory.slots
  const others = Array.from({ length: slots - 3 }, () => randomBytes(32))
  for (let i = 0; i < others.length; i += 64)
    await space.cache.storeKeys(space.keys(others.slice(i, i + 64)), () => {})
  expect(space.localPrefix(packed)).toBe(3)
  expect(space.localPrefix(Buffer.concat(hashes.slice(0, 3)))).toBe(3)
  expect(space.localPrefix(Buffer.concat([hashes[3]!]))).toBe(0)
})
