// copyRows and copyRowsAsync of the native addon: 2-D row sets (a strided view's many small
// runs as a few sets) land exactly as a row-by-row copy in JS puts them, on the JS thread and
// across pool threads; a malformed, out-of-bounds, overlapping or huge set copies nothing; a
// mapped file that shrank fails the copy with the shrink error, the process lives.

import { randomBytes } from 'node:crypto'
import { mkdtempSync, rmSync, truncateSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, describe, expect, it } from 'vitest'
import {
  allocPinnedSync,
  copyRows,
  copyRowsAsync,
  copyRowsAvailable,
  fileMapStats,
  freePinned,
  mapFile,
  NativeError,
  unmapFile,
} from '../src/client/native.ts'

const dir = mkdtempSync(join(tmpdir(), 'kvgate-copy-rows-'))
afterAll(() => rmSync(dir, { recursive: true, force: true }))

const KiB = 1024
const MiB = 1 << 20

/** Row set [dst, src, width, height, dstPitch, srcPitch] applied row by row in JS. */
function applySet(dst: Uint8Array, src: Uint8Array, set: ArrayLike<number>): void {
  const [d, s, w, h, dp, sp] = [set[0]!, set[1]!, set[2]!, set[3]!, set[4]!, set[5]!]
  for (let r = 0; r < h; r++) dst.set(src.subarray(s + r * sp, s + r * sp + w), d + r * dp)
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

/**
 * Row sets shaped as the agent makes them and odder: a strided view's K and V sets (256 B rows
 * 512 B apart in the source, contiguous in the destination: the pair the addon copies
 * together), the load's reverse (streamed whole lines, K and V rows side by side in the
 * destination: a pair too), rows unaligned and of odd widths, rows
 * wider than half a grain (cut as runs), single rows, and empty sets.
 */
function sets(dstBytes: number, srcBytes: number, count: number): number[] {
  const out: number[] = []
  let d = 0 // destinations packed, so no two sets write the same byte
  const add = (w: number, h: number, dp: number, sp: number, s: number) => {
    if (d + (h - 1) * dp + w > dstBytes || s + (h - 1) * sp + w > srcBytes) return
    out.push(d, s, w, h, dp, sp)
    d += (h - 1) * dp + w
  }
  for (let i = 0; i < count; i++) {
    const s = Math.floor(Math.random() * (srcBytes / 2))
    switch (i % 7) {
      case 0: // a block's K then V: sources side by side, destinations apart
        add(256, 128, 256, 512, s - (s % 512))
        d += 64
        add(256, 128, 256, 512, s - (s % 512) + 256)
        break
      case 1: {
        // the load's shape: contiguous sources, strided whole lines, K and V rows side by side
        // in the destination (the pair the addon copies together), then a lone set
        const at = d + ((64 - (d % 64)) % 64)
        const src = s - (s % 64)
        if (at + 63 * 512 + 512 <= dstBytes && src + 2 * 64 * 256 <= srcBytes) {
          out.push(at, src, 256, 64, 512, 256, at + 256, src + 64 * 256, 256, 64, 512, 256)
          d = at + 64 * 512
        }
        add(256, 64, 512, 256, s - (s % 64))
        break
      }
      case 2: // odd widths and pitches, unaligned
        add(37, 100, 41, 1000, s + 3)
        break
      case 3: // rows wider than half a grain
        add(200 * KiB, 3, 200 * KiB + 5, 210 * KiB, s)
        break
      case 4: // one row
        add(5000, 1, 0, 0, s)
        break
      case 5: // both sides contiguous: one run
        add(1000, 9, 1000, 1000, s)
        break
      default: // empty
        out.push(d, s, 0, 7, 0, 0, d, s, 16, 0, 16, 16)
    }
  }
  return out
}

it('the loaded addon has copyRows and copyRowsAsync (else this suite tests nothing)', () => {
  expect(copyRowsAvailable()).toBe(true)
})

describe('copyRows', () => {
  it('moves exactly what a row-by-row copy moves, between views of any alignment', () => {
    for (const [dOff, sOff] of [
      [0, 0],
      [16, 3],
    ]) {
      const src = randomBytes(8 * MiB + 64).subarray(sOff)
      const pinned = allocPinnedSync(8 * MiB + 64).buffer
      const dst = new Uint8Array(pinned, dOff, 8 * MiB)
      dst.fill(0x5a)
      const want = Uint8Array.from(dst)
      const rows = Float64Array.from(sets(dst.length, src.length, 60))
      copyRows(dst, src, rows)
      for (let i = 0; i < rows.length; i += 6) applySet(want, src, rows.subarray(i, i + 6))
      expect(Buffer.from(dst).equals(want)).toBe(true)
      freePinned(pinned)
    }
  })

  it('a malformed, out-of-bounds, overlapping or huge set is refused before any byte moves', () => {
    const buf = new Uint8Array(64 * KiB)
    const dst = new Uint8Array(64 * KiB)
    const src = randomBytes(64 * KiB)
    const good = [0, 0, 256, 4, 256, 512]
    const bad: [number[], RegExp][] = [
      [[0, 0, 256, 4, 256], /sextuples/],
      [[0, 0, 256.5, 4, 256, 512], /six integers/],
      [[0, -1, 256, 4, 256, 512], /six integers/],
      [[0, Number.NaN, 256, 4, 256, 512], /six integers/],
      [[0, 0, 256, 4, 256, 2 ** 53], /six integers/],
      // The last row ends one byte past src.
      [[0, 64 * KiB - 3 * 512 - 255, 256, 4, 256, 512], /outside/],
      [[64 * KiB - 255, 0, 256, 1, 256, 256], /outside/],
      // 2^40 rows of one byte: the bounds refuse them, no product wraps.
      [[0, 0, 1, 2 ** 40, 1, 0], /outside/],
      [[0, 0, 2 ** 52, 2 ** 52, 2 ** 52, 2 ** 52], /outside/],
      [[0, 0, 256, 4, 255, 512], /closer than its width/],
    ]
    for (const [set, match] of bad) {
      expectNative(() => copyRows(dst, src, Float64Array.from([...good, ...set])), match)
      expect(dst.every((x) => x === 0)).toBe(true)
    }
    // One buffer: a set whose source and destination ranges overlap is refused, though its
    // rows interleave (rows copy in any order; the ranges are what is checked).
    buf.set(src)
    expectNative(() => copyRows(buf, buf, Float64Array.from([...good, 256, 0, 256, 4, 512, 512])), /overlap/)
    expect(Buffer.from(buf).equals(src)).toBe(true)
    // Ranges of one buffer apart: allowed.
    copyRows(buf, buf, Float64Array.from([32 * KiB, 0, 256, 4, 512, 512]))
    for (let r = 0; r < 4; r++) {
      const at = 32 * KiB + r * 512
      expect(Buffer.from(buf.subarray(at, at + 256)).equals(src.subarray(r * 512, r * 512 + 256))).toBe(true)
    }
    expectNative(() => copyRows(dst, src, [0, 0, 1, 1, 1, 1] as unknown as Float64Array), /Float64Array/)
  })
})

describe('copyRowsAsync', () => {
  for (const parts of [1, 2, 4]) {
    it(`${parts} part(s): several buffers, sets cut between rows into grains, land exactly`, async () => {
      const file = join(dir, `async-${parts}`)
      writeFileSync(file, randomBytes(16 * MiB))
      const map = mapFile(file, { writable: true })
      const mapped = new Uint8Array(map)
      const slab = new Uint8Array(12 * MiB).fill(7)
      const other = randomBytes(4 * MiB)
      const buffers = [slab, mapped, other]
      const want = buffers.map((b) => Uint8Array.from(b))
      // Into slab from the mapping (a save), into the mapping from `other` (a load).
      const rows: number[] = []
      const save = sets(slab.length, mapped.length, 80)
      for (let i = 0; i < save.length; i += 6)
        rows.push(0, save[i]!, 1, save[i + 1]!, ...save.slice(i + 2, i + 6))
      const load = sets(4 * MiB, other.length, 20)
      for (let i = 0; i < load.length; i += 6)
        rows.push(1, 12 * MiB + load[i]!, 2, load[i + 1]!, ...load.slice(i + 2, i + 6))
      await copyRowsAsync(buffers, Float64Array.from(rows), parts)
      for (let i = 0; i < rows.length; i += 8) {
        const r = rows.slice(i, i + 8)
        applySet(want[r[0]!]!, want[r[2]!]!, [r[1]!, r[3]!, r[4]!, r[5]!, r[6]!, r[7]!])
      }
      for (let b = 0; b < buffers.length; b++) expect(Buffer.from(buffers[b]!).equals(want[b]!)).toBe(true)
      unmapFile(map)
    })
  }

  it('a bad set (or buffer index) is refused synchronously before any byte moves', async () => {
    const a = new Uint8Array(64 * KiB)
    const b = randomBytes(64 * KiB)
    const good = [0, 0, 1, 0, 256, 4, 256, 512]
    const bad: [number[], RegExp][] = [
      [[0, 0, 1, 0, 256, 4, 256], /octuples/],
      [[2, 0, 1, 0, 256, 4, 256, 512], /names no buffer/],
      [[0, 0, 1.5, 0, 256, 4, 256, 512], /names no buffer/],
      [[0, 0, 1, 64 * KiB - 1024, 256, 4, 256, 512], /outside/],
      [[0, 0, 1, 0, 1, 2 ** 45, 1, 0], /outside/],
      [[0, 0, 1, 0, 256, 4, 128, 512], /closer than its width/],
      // Source and destination ranges of one buffer overlapping: rows would race.
      [[1, 1024, 1, 0, 256, 8, 256, 256], /overlap/],
    ]
    for (const [set, match] of bad) {
      expectNative(() => copyRowsAsync([a, b], Float64Array.from([...good, ...set]), 2), match)
      expect(a.every((x) => x === 0)).toBe(true)
    }
    for (const parts of [0, 65, 1.5])
      expect(() => copyRowsAsync([a, b], new Float64Array(0), parts)).toThrow(/parts/)
    await copyRowsAsync([a, b], new Float64Array([0, 0, 1, 0, 0, 9, 0, 0]), 4) // nothing to copy
    expect(a.every((x) => x === 0)).toBe(true)
  })

  it('a file truncated under its mapping fails the copy with the shrink error; the process lives and copies go on', async () => {
    const file = join(dir, 'shrinks')
    writeFileSync(file, randomBytes(8 * MiB))
    const map = mapFile(file, { writable: true })
    const into = new Uint8Array(4 * MiB)
    truncateSync(file, 4096)
    // A save of rows past the file's new end: 256 B rows 512 B apart from 1 MiB on.
    const save = new Float64Array([0, 0, 1, MiB, 256, 4096, 256, 512])
    await expect(copyRowsAsync([into, map], save, 2)).rejects.toMatchObject({
      code: 'ERR_NATIVE',
      syscode: 'EFAULT',
      message: expect.stringMatching(/shrank during the copy/),
    })
    expect(() => copyRows(into, map, new Float64Array([0, MiB, 256, 4096, 256, 512]))).toThrow(
      expect.objectContaining({
        syscode: 'EFAULT',
        message: expect.stringMatching(/shrank during the copy/),
      }),
    )
    // A load into the lost pages faults too.
    await expect(
      copyRowsAsync([map, into], new Float64Array([0, MiB, 1, 0, 256, 64, 512, 256]), 1),
    ).rejects.toThrow(/shrank during the copy/)
    // What is still mapped copies as before, and the mapping unmaps.
    copyRows(into, map, new Float64Array([0, 0, 256, 8, 256, 512]))
    expect(Buffer.from(into.subarray(0, 256)).equals(Buffer.from(new Uint8Array(map, 0, 256)))).toBe(true)
    const before = fileMapStats().mappings
    unmapFile(map)
    expect(fileMapStats().mappings).toBe(before - 1)
  })
})
