// copyPlanes and copyPlanesAsync of the native addon: 3-D row sets (an HND view's block side,
// each head's tokens in the engine and each token's heads in the chunk, as one set) land exactly
// as a plane-by-plane, row-by-row copy in JS puts them, on the JS thread and across pool threads;
// a malformed, out-of-bounds or self-overlapping set copies nothing; a mapped file that shrank
// fails the copy with the shrink error.

import { randomBytes } from 'node:crypto'
import { mkdtempSync, rmSync, truncateSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, describe, expect, it } from 'vitest'
import {
  allocPinnedSync,
  copyPlanes,
  copyPlanesAsync,
  copyRowsAvailable,
  freePinned,
  mapFile,
  NativeError,
  unmapFile,
} from '../src/client/native.ts'

const dir = mkdtempSync(join(tmpdir(), 'kvgate-copy-planes-'))
afterAll(() => rmSync(dir, { recursive: true, force: true }))

const KiB = 1024
const MiB = 1 << 20
const F = 9

/** Set [dst, src, width, height, dstPitch, srcPitch, planes, dstPlanePitch, srcPlanePitch] applied row by row in JS. */
function applySet(dst: Uint8Array, src: Uint8Array, set: ArrayLike<number>): void {
  const [d, s, w, h, dp, sp, n, dpp, spp] = Array.from({ length: F }, (_, k) => set[k]!)
  for (let q = 0; q < n!; q++)
    for (let r = 0; r < h!; r++) {
      const from = s! + q * spp! + r * sp!
      dst.set(src.subarray(from, from + w!), d! + q * dpp! + r * dp!)
    }
}

function expectNative(f: () => unknown, match: RegExp): void {
  try {
    f()
  } catch (e) {
    expect(e).toBeInstanceOf(NativeError)
    expect((e as Error).message).toMatch(match)
    return
  }
  throw new Error('expected a NativeError')
}

/** Bytes from a set's first destination byte past its last (its rows may interleave: a bounding range). */
function dstExtent(w: number, h: number, dp: number, n: number, dpp: number): number {
  return (n - 1) * dpp + (h - 1) * dp + w
}

/**
 * 3-D sets shaped as the agent makes them and odder: an HND block side's K and V saved (heads
 * 8 KiB apart and tokens 512 B apart in the source, token-major and contiguous in the
 * destination: the pair the addon copies together, plane by plane), the load's reverse (each
 * token's 256 B between two heads' rows in the destination), unaligned odd widths, planes wider
 * than half a grain, planes of one row and of contiguous rows (they fold into 2-D sets), one
 * plane, and empty sets. Destinations are packed (no two sets write one byte).
 */
function sets(dstBytes: number, srcBytes: number, count: number): number[] {
  const out: number[] = []
  let d = 0
  const add = (
    w: number,
    h: number,
    dp: number,
    sp: number,
    n: number,
    dpp: number,
    spp: number,
    s: number,
  ) => {
    const at = d
    const ext = dstExtent(w, h, dp, n, dpp)
    if (at + ext > dstBytes || s + (n - 1) * spp + (h - 1) * sp + w > srcBytes) return undefined
    out.push(at, s, w, h, dp, sp, n, dpp, spp)
    d += ext
    return at
  }
  const room = (ext: number, s: number) => s + ext <= srcBytes
  for (let i = 0; i < count; i++) {
    const s = Math.floor(Math.random() * (srcBytes / 2))
    switch (i % 8) {
      case 0: {
        // HND save: K then V of one block side (64 KiB: 8 heads × 16 tokens × 512 B)
        const blk = s - (s % 64)
        if (!room(64 * KiB, blk)) break
        d += (16 - (d % 16)) % 16
        add(256, 8, 256, 8192, 16, 2048, 512, blk)
        add(256, 8, 256, 8192, 16, 2048, 512, blk + 256)
        break
      }
      case 1: {
        // HND load: token-major K and V sources, each token's K|V 512 B in a head's 8 KiB row
        const at = d + ((64 - (d % 64)) % 64)
        const src = s - (s % 64)
        if (at + 64 * KiB > dstBytes || !room(64 * KiB, src)) break
        out.push(at, src, 256, 8, 8192, 256, 16, 512, 2048)
        out.push(at + 256, src + 32 * KiB, 256, 8, 8192, 256, 16, 512, 2048)
        d = at + 64 * KiB
        break
      }
      case 2: // odd widths and pitches, unaligned; planes one after another
        add(37, 5, 41, 1000, 7, 300, 7001, s + 3)
        break
      case 3: // planes wider than half a grain (cut as rows)
        add(70 * KiB, 2, 70 * KiB + 3, 72 * KiB, 2, 2 * 70 * KiB + 3, 150 * KiB, s)
        break
      case 4: // planes of one row (a 2-D set over the planes), and planes of contiguous rows
        add(100, 1, 0, 0, 9, 100, 333, s + 1)
        add(64, 4, 64, 64, 5, 256, 1024, s)
        break
      case 5: // one plane
        add(256, 6, 512, 256, 1, 0, 0, s)
        break
      case 6: // planes interleaved in the destination with odd sizes
        add(24, 6, 200, 48, 7, 25, 300, s + 5)
        break
      default: // empty
        out.push(d, s, 0, 7, 0, 0, 3, 0, 0, d, s, 16, 4, 16, 16, 0, 0, 0)
    }
  }
  return out
}

it('the loaded addon has copyPlanes and copyPlanesAsync (else this suite tests nothing)', () => {
  expect(copyRowsAvailable()).toBe(true)
})

describe('copyPlanes', () => {
  it('moves exactly what a plane-by-plane, row-by-row copy moves, between views of any alignment', () => {
    for (const [dOff, sOff] of [
      [0, 0],
      [16, 3],
      [16, 0],
    ]) {
      const src = randomBytes(8 * MiB + 64).subarray(sOff)
      const pinned = allocPinnedSync(8 * MiB + 64).buffer
      const dst = new Uint8Array(pinned, dOff, 8 * MiB)
      dst.fill(0x5a)
      const want = Uint8Array.from(dst)
      const all = Float64Array.from(sets(dst.length, src.length, 80))
      copyPlanes(dst, src, all)
      for (let i = 0; i < all.length; i += F) applySet(want, src, all.subarray(i, i + F))
      expect(Buffer.from(dst).equals(want)).toBe(true)
      freePinned(pinned)
    }
  })

  it('a malformed, out-of-bounds or self-overlapping set is refused before any byte moves', () => {
    const dst = new Uint8Array(64 * KiB)
    const src = randomBytes(64 * KiB)
    const good = [0, 0, 256, 8, 256, 8192, 4, 2048, 512]
    const bad: [number[], RegExp][] = [
      [[0, 0, 256, 4, 256, 512, 2, 1024], /nonuples/],
      [[0, 0, 256, 4, 256, 512, 2.5, 1024, 0], /nine integers/],
      [[0, 0, 256, 4, 256, 512, 2, -1, 0], /nine integers/],
      [[0, 0, 256, 4, 256, 512, 2, 1024, Number.NaN], /nine integers/],
      // The last plane's last row ends one byte past src (and dst).
      [[0, 0, 256, 8, 256, 8192, 2, 2048, 7937], /outside/],
      [[0, 0, 256, 2, 256, 256, 2, 64 * KiB - 511, 0], /outside/],
      // 2^40 planes of one byte: the bounds refuse them, no product wraps.
      [[0, 0, 1, 1, 1, 1, 2 ** 40, 1, 0], /outside/],
      [[0, 0, 1, 2, 2 ** 51, 0, 2 ** 51, 2 ** 51, 0], /outside/],
      // Planes that overlap in dst: closer than a plane, and not between two rows.
      [[0, 0, 256, 4, 256, 512, 2, 768, 2048], /closer than its width/],
      // Between two rows, but the last plane reaches the next row.
      [[0, 0, 256, 4, 1024, 256, 5, 256, 1024], /closer than its width/],
      // Planes of one row closer than the width.
      [[0, 0, 256, 1, 0, 0, 4, 255, 256], /closer than its width/],
    ]
    for (const [set, match] of bad) {
      expectNative(() => copyPlanes(dst, src, Float64Array.from([...good, ...set])), match)
      expect(dst.every((x) => x === 0)).toBe(true)
    }
    // Planes between two rows that fit are allowed: 4 planes of 256 B in 1 KiB rows.
    copyPlanes(dst, src, Float64Array.from([0, 0, 256, 4, 1024, 256, 4, 256, 1024]))
    const want = new Uint8Array(64 * KiB)
    applySet(want, src, [0, 0, 256, 4, 1024, 256, 4, 256, 1024])
    expect(Buffer.from(dst).equals(want)).toBe(true)
    // One buffer: source and destination ranges that overlap through the planes are refused.
    const buf = Uint8Array.from(src)
    expectNative(
      () => copyPlanes(buf, buf, Float64Array.from([16 * KiB, 0, 256, 2, 256, 256, 40, 512, 512])),
      /overlap/,
    )
    expect(Buffer.from(buf).equals(src)).toBe(true)
    expectNative(
      () => copyPlanes(dst, src, [0, 0, 1, 1, 1, 1, 1, 0, 0] as unknown as Float64Array),
      /Float64Array/,
    )
  })
})

describe('copyPlanesAsync', () => {
  for (const parts of [1, 2, 4]) {
    it(`${parts} part(s): several buffers, sets cut between planes into grains, land exactly`, async () => {
      const file = join(dir, `async-${parts}`)
      writeFileSync(file, randomBytes(16 * MiB))
      const map = mapFile(file, { writable: true })
      const mapped = new Uint8Array(map)
      const slab = new Uint8Array(12 * MiB + 16).fill(7).subarray(16)
      const other = randomBytes(4 * MiB)
      const buffers = [slab, mapped, other]
      const want = buffers.map((b) => Uint8Array.from(b))
      // Into slab from the mapping (a save), into the mapping from `other` (a load).
      const all: number[] = []
      const save = sets(slab.length, mapped.length, 120)
      for (let i = 0; i < save.length; i += F)
        all.push(0, save[i]!, 1, save[i + 1]!, ...save.slice(i + 2, i + F))
      const load = sets(4 * MiB, other.length, 40)
      for (let i = 0; i < load.length; i += F)
        all.push(1, 12 * MiB + load[i]!, 2, load[i + 1]!, ...load.slice(i + 2, i + F))
      await copyPlanesAsync(buffers, Float64Array.from(all), parts)
      for (let i = 0; i < all.length; i += F + 2) {
        const r = all.slice(i, i + F + 2)
        applySet(want[r[0]!]!, want[r[2]!]!, [r[1]!, r[3]!, ...r.slice(4)])
      }
      for (let b = 0; b < buffers.length; b++) expect(Buffer.from(buffers[b]!).equals(want[b]!)).toBe(true)
      unmapFile(map)
    })
  }

  it('a bad set (or buffer index) is refused synchronously before any byte moves', async () => {
    const a = new Uint8Array(64 * KiB)
    const b = randomBytes(64 * KiB)
    const good = [0, 0, 1, 0, 256, 8, 256, 8192, 4, 2048, 512]
    const bad: [number[], RegExp][] = [
      [[0, 0, 1, 0, 256, 4, 256, 512, 2, 1024], /11-tuples/],
      [[2, 0, 1, 0, 256, 4, 256, 512, 2, 1024, 0], /names no buffer/],
      [[0, 0, 1, 0, 256, 4, 256, 512, 2, 1024, 63 * KiB], /outside/],
      [[0, 0, 1, 0, 1, 1, 1, 1, 2 ** 45, 1, 0], /outside/],
      [[0, 0, 1, 0, 256, 4, 256, 512, 2, 512, 2048], /closer than its width/],
      // Source and destination ranges of one buffer overlapping: rows would race.
      [[1, 1024, 1, 0, 256, 2, 256, 256, 4, 512, 512], /overlap/],
    ]
    for (const [set, match] of bad) {
      expectNative(() => copyPlanesAsync([a, b], Float64Array.from([...good, ...set]), 2), match)
      expect(a.every((x) => x === 0)).toBe(true)
    }
    for (const parts of [0, 65, 1.5])
      expect(() => copyPlanesAsync([a, b], new Float64Array(0), parts)).toThrow(/parts/)
    await copyPlanesAsync([a, b], new Float64Array([0, 0, 1, 0, 16, 9, 16, 16, 0, 0, 0]), 4) // nothing to copy
    expect(a.every((x) => x === 0)).toBe(true)
  })

  it('a file truncated under its mapping fails the copy with the shrink error; the process lives', async () => {
    const file = join(dir, 'shrinks')
    writeFileSync(file, randomBytes(8 * MiB))
    const map = mapFile(file, { writable: true })
    const into = new Uint8Array(4 * MiB)
    truncateSync(file, 4096)
    // An HND save's shape from 1 MiB on, past the file's new end.
    const save = new Float64Array([0, 0, 1, MiB, 256, 8, 256, 8192, 16, 2048, 512])
    await expect(copyPlanesAsync([into, map], save, 2)).rejects.toMatchObject({
      code: 'ERR_NATIVE',
      syscode: 'EFAULT',
      message: expect.stringMatching(/shrank during the copy/),
    })
    expect(() => copyPlanes(into, map, new Float64Array([0, MiB, 256, 8, 256, 8192, 16, 2048, 512]))).toThrow(
      expect.objectContaining({ syscode: 'EFAULT' }),
    )
    // What is still mapped copies as before.
    copyPlanes(into, map, new Float64Array([0, 0, 256, 2, 256, 1024, 2, 512, 256]))
    const want = new Uint8Array(4 * MiB)
    applySet(want, new Uint8Array(map), [0, 0, 256, 2, 256, 1024, 2, 512, 256])
    expect(Buffer.from(into.subarray(0, 1024)).equals(Buffer.from(want.subarray(0, 1024)))).toBe(true)
    unmapFile(map)
  })
})
