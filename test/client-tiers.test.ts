// L1 (slots, LRU, pins), L2 (durable files, budget, restart recovery, disk
// faults) and the priority I/O queue, each tested on its own.

import { execFileSync } from 'node:child_process'
import {
  existsSync,
  mkdirSync,
  mkdtempSync,
  readdirSync,
  readFileSync,
  renameSync,
  rmSync,
  statSync,
  truncateSync,
  utimesSync,
  writeFileSync,
} from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterEach, describe, expect, it, type TestContext } from 'vitest'
import { InFlightLimit, PriorityQueue } from '../src/client/io-queue.ts'
import { CopyGate, nativeMemoryStats } from '../src/client/native.ts'
import { loadNative } from '../src/client/native-api.ts'
import { DiskBudget, DiskTier, type ReadSink, segmentStarts } from '../src/client/tiers/disk.ts'
import { MemoryTier } from '../src/client/tiers/memory.ts'
import { crc32 } from '../src/core/checksum.ts'
import { decodeHeader, encodeChunk } from '../src/core/format.ts'
import { toHex } from '../src/core/keys.ts'
import { MODEL_PRESETS } from '../src/core/layout.ts'

const g = MODEL_PRESETS.stories260k

function hexOf(n: number): string {
  return n.toString(16).padStart(64, '0')
}

/** A small raw chunk object whose chain key is `hex` and whose sections are filled with `fill`. */
/**
 * Runs `use` with `dir` bind-mounted read-only over itself, unmounted after; skips the test
 * where this process cannot mount (not root).
 */
async function whileReadOnly(dir: string, ctx: TestContext, use: () => Promise<void>): Promise<void> {
  try {
    execFileSync('mount', ['--bind', dir, dir], { stdio: 'ignore' })
    execFileSync('mount', ['-o', 'remount,ro,bind', dir], { stdio: 'ignore' })
  } catch {
    ctx.skip()
    return
  }
  try {
    await use()
  } finally {
    execFileSync('umount', [dir])
  }
}

/**
 * Runs `check` on a fresh tier once per read path: buffered, then through the addon into a
 * pinned slot (freed after, pass or fail).
 */
async function eachReadPath(
  options: { concurrency?: number },
  check: (d: DiskTier, slot: Uint8Array | undefined) => Promise<void>,
): Promise<void> {
  const n = loadNative()
  for (const native of [undefined, n.api]) {
    const d = await DiskTier.open({ dir: tempDir(), bytes: 1 << 30, native, ...options })
    const slot = native ? new Uint8Array((await native.allocPinned(1 << 20)).buffer) : undefined
    try {
      await check(d, slot)
    } finally {
      if (slot) native!.freePinned(slot.buffer)
    }
  }
}

function object(hex: string, fill: number, tokens = 4): Uint8Array {
  const slab = 2 * tokens * g.kvHeads * g.headDim * 2
  const sections = Array.from({ length: g.layers }, (_, l) => new Uint8Array(slab).fill((fill + l) & 255))
  return encodeChunk(
    {
      codec: 'raw',
      codecVersion: 1,
      codecParams: new Uint8Array(0),
      geometry: g,
      tokens,
      chunkIndex: 0,
      partial: false,
      namespaceId: new Uint8Array(16),
      chainKey: Buffer.from(hex, 'hex'),
      parentKey: new Uint8Array(32),
    },
    sections,
  )
}

const dirs: string[] = []
function tempDir(): string {
  const d = mkdtempSync(join(tmpdir(), 'kvgate-client-'))
  dirs.push(d)
  return d
}
afterEach(() => {
  for (const d of dirs.splice(0)) rmSync(d, { recursive: true, force: true })
})

describe('MemoryTier', () => {
  it('rejects a region smaller than one slot and reports unpinned fallback', async () => {
    await expect(MemoryTier.create({ bytes: 100, chunkBytes: 4096 })).rejects.toThrow(
      /smaller than one chunk slot/,
    )
    const m = await MemoryTier.create({ bytes: 3 * 4096, chunkBytes: 4000 })
    expect(m.stats().slots).toBe(3)
    expect(m.stats().pinnedKind).toBe('none')
    expect(m.stats().pinReason).toMatch(/native/)
  })

  it('allocates its region through the addon when it loads (pinned or with the reason why not)', async (ctx) => {
    const n = loadNative()
    if (!n.api) {
      ctx.skip()
      return
    }
    const m = await MemoryTier.create({ bytes: 4 * 65536, chunkBytes: 65536, dataOffset: 300, native: n.api })
    expect(m.slotBytes).toBe(69632) // header room + tensor, rounded to pages
    expect(['cuda', 'mlock', 'none']).toContain(m.stats().pinnedKind)
    expect(m.stats().pinReason).toBeTruthy()
    const r = m.reserve(hexOf(1), 65536)!
    expect(r.slot.byteOffset % 4096).toBe(0)
    expect(r.bytes.byteOffset - r.slot.byteOffset).toBe(300)
    r.abort()
    const before = nativeMemoryStats().pinnedBlocks
    m.dispose()
    expect(nativeMemoryStats().pinnedBlocks).toBe(before - 1)
  })

  it('evicts least recently used chunks when full and counts it', async () => {
    const m = await MemoryTier.create({ bytes: 2 * 4096, chunkBytes: 4096 })
    expect(m.put(hexOf(1), new Uint8Array(4096).fill(1))).toBe(true)
    expect(m.put(hexOf(2), new Uint8Array(4096).fill(2))).toBe(true)
    m.acquire(hexOf(1))?.release() // 1 is now most recent
    expect(m.put(hexOf(3), new Uint8Array(4096).fill(3))).toBe(true)
    expect(m.has(hexOf(2))).toBe(false)
    expect(m.has(hexOf(1))).toBe(true)
    const h = m.acquire(hexOf(3))!
    expect(h.bytes[0]).toBe(3)
    h.release()
    expect(m.counters.evictions).toBe(1)
  })

  it('never reuses or evicts a pinned slot: the reader keeps intact bytes; store skips when all slots are pinned', async () => {
    const m = await MemoryTier.create({ bytes: 2 * 4096, chunkBytes: 4096 })
    m.put(hexOf(1), new Uint8Array(4096).fill(1))
    m.put(hexOf(2), new Uint8Array(4096).fill(2))
    const a = m.acquire(hexOf(1))!
    const b = m.acquire(hexOf(2))!
    expect(m.stats().livePins).toBe(2)
    // Both pinned: nothing can be evicted, the put is skipped and both stay resident.
    expect(m.put(hexOf(3), new Uint8Array(4096).fill(3))).toBe(false)
    expect(m.stats().skippedFull).toBe(1)
    expect([m.has(hexOf(1)), m.has(hexOf(2))]).toEqual([true, true])
    expect(a.bytes.every((x) => x === 1)).toBe(true)
    expect(b.bytes.every((x) => x === 2)).toBe(true)
    a.release()
    // Only the unpinned chunk is evicted, although 1 is more recently used than 2.
    expect(m.put(hexOf(4), new Uint8Array(4096).fill(4))).toBe(true)
    expect([m.has(hexOf(1)), m.has(hexOf(2)), m.has(hexOf(4))]).toEqual([false, true, true])
    expect(b.bytes.every((x) => x === 2)).toBe(true)
    b.release()
    b.release() // double release is harmless
    expect(m.stats()).toMatchObject({ freeSlots: 0, livePins: 0, liveReservations: 0 })
  })

  it('reservations are invisible until commit and a duplicate commit returns the slot', async () => {
    const m = await MemoryTier.create({ bytes: 2 * 4096, chunkBytes: 4096 })
    const r1 = m.reserve(hexOf(7), 4096)!
    expect(m.has(hexOf(7))).toBe(false)
    const r2 = m.reserve(hexOf(7), 4096)!
    expect(m.stats().liveReservations).toBe(2)
    expect(r1.commit()).toBe(true)
    expect(r2.commit()).toBe(false)
    r1.abort() // settled already: a no-op, the committed chunk stays
    r2.abort()
    expect(m.has(hexOf(7))).toBe(true)
    expect(m.stats()).toMatchObject({ freeSlots: 1, liveReservations: 0 })
    // commitPinned publishes and pins in one step; on a resident key it pins the resident copy.
    const r3 = m.reserve(hexOf(7), 4096)!
    const pin = r3.commitPinned()!
    expect(pin.bytes.byteLength).toBe(4096)
    expect(m.stats()).toMatchObject({ freeSlots: 1, livePins: 1, liveReservations: 0 })
    pin.release()
    expect(() => m.reserve(hexOf(8), 5000)).toThrow(/does not fit/)
  })

  it("scoped views share one budget and one LRU but never each other's chunks", async () => {
    const pool = await MemoryTier.create({ bytes: 3 * 4096, chunkBytes: 4096 })
    const a = pool.scoped('rank0')
    const b = pool.scoped('rank1')
    expect(a.put(hexOf(1), new Uint8Array(4096).fill(0xa1))).toBe(true)
    // Another view never sees it, under the same chain key.
    expect(b.has(hexOf(1))).toBe(false)
    expect(b.acquire(hexOf(1))).toBeUndefined()
    expect(b.peekPinned(hexOf(1))).toBeUndefined()
    expect(pool.has(hexOf(1))).toBe(false)
    b.delete(hexOf(1)) // not b's: a keeps it
    expect(a.has(hexOf(1))).toBe(true)
    // While a reader holds a's chunk, b cannot store that key: skipped, a's bytes intact.
    const ha = a.acquire(hexOf(1))!
    expect(b.put(hexOf(1), new Uint8Array(4096).fill(0xb1))).toBe(false)
    expect(ha.bytes.every((x) => x === 0xa1)).toBe(true)
    expect([a.has(hexOf(1)), b.has(hexOf(1))]).toEqual([true, false])
    ha.release()
    // Unpinned, b's chunk replaces a's: one chunk per chain key, each view reads only its own.
    expect(b.put(hexOf(1), new Uint8Array(4096).fill(0xb1))).toBe(true)
    expect([a.has(hexOf(1)), b.has(hexOf(1))]).toEqual([false, true])
    const hb = b.acquire(hexOf(1))!
    expect(hb.bytes.every((x) => x === 0xb1)).toBe(true)
    hb.release()
    expect(pool.stats()).toMatchObject({ freeSlots: 2, livePins: 0, liveReservations: 0 })
    // A reservation commits under its own view only.
    const r = b.reserve(hexOf(2), 4096)!
    r.bytes.fill(0xb2)
    expect(r.commit()).toBe(true)
    expect([a.has(hexOf(2)), b.has(hexOf(2))]).toEqual([false, true])
    expect(a.put(hexOf(3), new Uint8Array(4096).fill(0xa3))).toBe(true)
    // One budget: the pool is full (3 slots); a's next chunk evicts the LRU chunk, b's 1.
    expect(pool.stats().freeSlots).toBe(0)
    b.acquire(hexOf(2))?.release()
    a.acquire(hexOf(3))?.release()
    expect(a.put(hexOf(4), new Uint8Array(4096).fill(0xa4))).toBe(true)
    expect(b.has(hexOf(1))).toBe(false)
    expect([b.has(hexOf(2)), a.has(hexOf(3)), a.has(hexOf(4))]).toEqual([true, true, true])
    expect(a.counters.evictions).toBe(1)
    expect(a.stats()).toMatchObject({ slots: 3, residentChunks: 2 })
    expect(b.stats()).toMatchObject({ slots: 3, residentChunks: 1 })
    // A view's clear and dispose drop its chunks only; the pool and the other view keep theirs.
    b.dispose()
    expect(b.has(hexOf(2))).toBe(false)
    expect([a.has(hexOf(3)), a.has(hexOf(4))]).toEqual([true, true])
    expect(pool.stats()).toMatchObject({ freeSlots: 1, livePins: 0, liveReservations: 0 })
    a.delete(hexOf(4))
    expect(a.has(hexOf(4))).toBe(false)
    // Scopes are names: empty or NUL-bearing ones are refused.
    expect(() => pool.scoped('')).toThrow(/scope/)
    expect(() => pool.scoped('a\0b')).toThrow(/scope/)
    // A nested scope is distinct from its parent and from a scope named like the joined name.
    const nested = a.scoped('x')
    nested.put(hexOf(9), new Uint8Array(4096).fill(9))
    expect([nested.has(hexOf(9)), a.has(hexOf(9)), pool.scoped('rank0x').has(hexOf(9))]).toEqual([
      true,
      false,
      false,
    ])
  })

  it('prefault: the region is resident from creation (through the addon or not)', async (ctx) => {
    const rss = () => Number(readFileSync('/proc/self/statm', 'utf8').split(' ')[1]) * 4096
    for (const native of [undefined, loadNative().api]) {
      if (native === undefined && loadNative().api === undefined) continue
      const bytes = 64 << 20
      const before = rss()
      const m = await MemoryTier.create({ bytes, chunkBytes: 1 << 20, native, prefault: true })
      // Most of the region counts in RSS before anything was written to it.
      expect(rss() - before).toBeGreaterThan(bytes * 0.75)
      if (native) expect(m.stats().pinReason).toMatch(m.stats().pinnedKind === 'none' ? /pre-faulted/ : /./)
      m.dispose()
    }
    if (!loadNative().api) ctx.skip()
  })
})

describe('DiskTier', () => {
  it('writes durable files, reads them back verified, and rebuilds its index on restart', async () => {
    const dir = tempDir()
    const d = await DiskTier.open({ dir, bytes: 1 << 20 })
    const obj = object(hexOf(0xab01), 9)
    expect(await d.put(hexOf(0xab01), obj)).toBe(true)
    expect(await d.put(hexOf(0xab01), obj)).toBe(false) // present: skipped
    expect(readdirSync(join(dir, '00'))).toEqual([`${hexOf(0xab01)}.kvc`])
    const d2 = await DiskTier.open({ dir, bytes: 1 << 20 })
    expect(d2.has(hexOf(0xab01))).toBe(true)
    expect(Buffer.compare(Buffer.from((await d2.get(hexOf(0xab01)))!), Buffer.from(obj))).toBe(0)
    expect(d2.stats().usedBytes).toBe(obj.byteLength)
  })

  it('a restart keeps a chunk file larger than 512 MiB (the default limit of objects from the gateway) indexed', async () => {
    // Written here and read back through the addon (which allows any size the index holds), such a
    // file must survive a restart too. Sparse: the header is real, the sections are holes.
    const dir = tempDir()
    const hex = hexOf(0xc0)
    const small = object(hex, 1)
    const h = decodeHeader(small)
    const last = h.sections.at(-1)!
    const total = 600 * 1024 * 1024
    const header = small.slice(0, h.headerBytes)
    const dv = new DataView(header.buffer)
    // The last section entry (offset u64, length u32, crc u32) grows to end at `total`.
    const entry = Buffer.from(header).findIndex(
      (_, i) =>
        i + 16 <= header.length - 4 &&
        dv.getBigUint64(i, true) === BigInt(last.offset) &&
        dv.getUint32(i + 8, true) === last.length &&
        dv.getUint32(i + 12, true) === last.crc32,
    )
    expect(entry).toBeGreaterThan(0)
    dv.setUint32(entry + 8, total - last.offset, true)
    dv.setBigUint64(16, BigInt(total), true)
    dv.setUint32(header.length - 4, crc32(header.subarray(0, header.length - 4)), true)
    expect(decodeHeader(header, { maxBytes: total }).totalBytes).toBe(total)
    mkdirSync(join(dir, hex.slice(0, 2)))
    const path = join(dir, hex.slice(0, 2), `${hex}.kvc`)
    writeFileSync(path, header)
    truncateSync(path, total)
    const d = await DiskTier.open({ dir, bytes: 1 << 30 })
    expect(d.stats().recoveredDiscarded).toBe(0)
    expect(existsSync(path)).toBe(true)
    expect(d.has(hex)).toBe(true)
    expect(d.stats().usedBytes).toBe(total)
  })

  it('discards temp files, truncated, corrupt and misnamed files on start', async () => {
    const dir = tempDir()
    mkdirSync(join(dir, '00'))
    const good = object(hexOf(1), 1)
    writeFileSync(join(dir, '00', `${hexOf(1)}.kvc`), good)
    writeFileSync(join(dir, '00', `.tmp-${hexOf(2)}-${deadPid()}-abcd`), good) // its writer is gone
    writeFileSync(join(dir, '00', `${hexOf(3)}.kvc`), good.subarray(0, good.byteLength - 10)) // truncated
    writeFileSync(join(dir, '00', `${hexOf(4)}.kvc`), object(hexOf(5), 1)) // header names another key
    const bad = object(hexOf(6), 1)
    bad[20] = (bad[20] ?? 0) ^ 1 // header checksum
    writeFileSync(join(dir, '00', `${hexOf(6)}.kvc`), bad)
    writeFileSync(join(dir, '00', `${hexOf(7)}.kvc`), new Uint8Array(0))
    const d = await DiskTier.open({ dir, bytes: 1 << 20 })
    expect(d.stats().files).toBe(1)
    expect(d.stats().recoveredDiscarded).toBe(5)
    expect(readdirSync(join(dir, '00'))).toEqual([`${hexOf(1)}.kvc`])
  })

  it('at start, a FIFO or other non-regular file with a chunk name is left alone: open does not block on it', async () => {
    const dir = tempDir()
    mkdirSync(join(dir, '00'))
    writeFileSync(join(dir, '00', `${hexOf(1)}.kvc`), object(hexOf(1), 1))
    // open(O_RDONLY) of a FIFO waits for a writer: without O_NONBLOCK the tier never opens
    // (and a libuv pool thread stays blocked for good).
    execFileSync('mkfifo', [join(dir, '00', `${hexOf(2)}.kvc`)])
    mkdirSync(join(dir, '00', `${hexOf(3)}.kvc`))
    const opened = await Promise.race([
      DiskTier.open({ dir, bytes: 1 << 20 }),
      new Promise<'blocked'>((r) => setTimeout(() => r('blocked'), 2000)),
    ])
    expect(opened).not.toBe('blocked')
    const d = opened as DiskTier
    expect(d.stats().files).toBe(1)
    expect(d.stats().unreadableFiles).toBe(2)
    expect(readdirSync(join(dir, '00')).sort()).toEqual([
      `${hexOf(1)}.kvc`,
      `${hexOf(2)}.kvc`,
      `${hexOf(3)}.kvc`,
    ])
  })

  it('at start, an entry that cannot be deleted (a directory named like a dead temp file) does not fail the open', async () => {
    const dir = tempDir()
    mkdirSync(join(dir, '00'))
    writeFileSync(join(dir, '00', `${hexOf(1)}.kvc`), object(hexOf(1), 1))
    // rm() of a directory (no recursive) throws EISDIR: the tier must still open.
    mkdirSync(join(dir, '00', `.tmp-${hexOf(2)}-${deadPid()}-abcd`))
    const d = await DiskTier.open({ dir, bytes: 1 << 20 })
    expect(d.stats().files).toBe(1)
    expect(d.stats().unreadableFiles).toBe(1)
    expect(await d.get(hexOf(1))).toBeDefined()
  })

  it('at start, a corrupt file on a read-only directory is left in place, not indexed, and the tier opens', async (ctx) => {
    const dir = tempDir()
    mkdirSync(join(dir, '00'))
    writeFileSync(join(dir, '00', `${hexOf(1)}.kvc`), object(hexOf(1), 1))
    writeFileSync(join(dir, '00', `${hexOf(2)}.kvc`), object(hexOf(2), 1).subarray(0, 100))
    await whileReadOnly(dir, ctx, async () => {
      const d = await DiskTier.open({ dir, bytes: 1 << 20 })
      expect(d.stats().files).toBe(1)
      expect(d.stats().unreadableFiles).toBe(1)
      expect(d.has(hexOf(2))).toBe(false)
      expect(await d.get(hexOf(1))).toBeDefined()
    })
  })

  it('treats a file corrupted after start as a miss and deletes it', async () => {
    const dir = tempDir()
    const d = await DiskTier.open({ dir, bytes: 1 << 20 })
    const obj = object(hexOf(9), 3)
    await d.put(hexOf(9), obj)
    const flipped = obj.slice()
    flipped[flipped.length - 1] = (flipped[flipped.length - 1] ?? 0) ^ 0xff
    writeFileSync(d.pathOf(hexOf(9)), flipped)
    expect(await d.get(hexOf(9))).toBeUndefined()
    expect(d.counters.corrupt).toBe(1)
    expect(d.has(hexOf(9))).toBe(false)
  })

  it('verifies large objects segment by segment while reading them through the addon', async () => {
    const dir = tempDir()
    const n = loadNative()
    expect(n.api, n.reason).toBeDefined()
    const d = await DiskTier.open({ dir, bytes: 1 << 30, native: n.api })
    const obj = object(hexOf(0x51), 7, 65536) // 40 MiB: read + verified in three segments
    const starts = segmentStarts(decodeHeader(obj), obj.byteLength)
    expect(starts.length).toBe(3)
    await d.put(hexOf(0x51), obj)
    expect(Buffer.compare(Buffer.from((await d.get(hexOf(0x51)))!), Buffer.from(obj))).toBe(0)
    expect(d.counters.hits).toBe(1)
    // A flip in the second segment, then a truncation: each is a counted miss, never bytes.
    const second = starts[1]! + 4096
    for (const [key, damage] of [
      [0x52, (b: Uint8Array) => b.with(second, b[second]! ^ 1)],
      [0x53, (b: Uint8Array) => b.subarray(0, b.length - 4096)],
    ] as const) {
      const fresh = object(hexOf(key), 7, 65536)
      await d.put(hexOf(key), fresh)
      writeFileSync(d.pathOf(hexOf(key)), damage(fresh))
      expect(await d.get(hexOf(key))).toBeUndefined()
      expect(d.has(hexOf(key))).toBe(false)
    }
    expect(d.counters.corrupt).toBe(2)
  })

  it('through the addon, a flip on either side of a range boundary, in a small object, or in the header is a counted miss', async () => {
    const dir = tempDir()
    const n = loadNative()
    expect(n.api, n.reason).toBeDefined()
    const d = await DiskTier.open({ dir, bytes: 1 << 30, native: n.api })
    const big = (key: number) => object(hexOf(key), 7, 65536) // ~40 MiB: three ranges
    const small = (key: number) => object(hexOf(key), 9, 64) // one range
    // Its sections are not 4 KiB aligned: the reads are cut inside sections.
    const cut = segmentStarts(decodeHeader(big(0)), big(0).byteLength)[1]!
    expect(decodeHeader(big(0)).sections.some((s) => s.offset < cut && s.offset + s.length > cut)).toBe(true)
    // An intact large object read into a pinned (L1-like) slot: exact bytes, verified on the pool.
    const slot = new Uint8Array((await n.api!.allocPinned(big(0x60).byteLength + 4096)).buffer)
    await d.put(hexOf(0x60), big(0x60))
    const got = await d.get(hexOf(0x60), 'get', slot)
    expect(got?.buffer).toBe(slot.buffer)
    expect(Buffer.compare(Buffer.from(got!), Buffer.from(big(0x60)))).toBe(0)
    const cases = [
      [0x61, big, cut - 1], // last byte of the first range (a section split across ranges)
      [0x62, big, cut], // first byte of the second range
      [0x63, small, -1], // last byte of a small object
      [0x64, small, 20], // inside the header (total length field)
      [0x65, big, -4096], // inside the tail block (unaligned O_DIRECT tail)
    ] as const
    for (const [key, make, at] of cases) {
      const fresh = make(key)
      await d.put(hexOf(key), fresh)
      const i = at < 0 ? fresh.length + at : at
      writeFileSync(d.pathOf(hexOf(key)), fresh.with(i, fresh[i]! ^ 0x10))
      expect(await d.get(hexOf(key), 'get', slot), `flip at ${i}`).toBeUndefined()
      expect(d.has(hexOf(key))).toBe(false)
    }
    expect(d.counters.corrupt).toBe(cases.length)
    expect(d.counters.errors).toBe(0)
    // No read is left running into the slot: it can be freed (a busy block refuses).
    n.api!.freePinned(slot.buffer)
  })

  it('through the addon, a file cut short (EIO-like short read) or gone is a miss that leaves the slot free', async () => {
    const dir = tempDir()
    const n = loadNative()
    const d = await DiskTier.open({ dir, bytes: 1 << 30, native: n.api })
    const obj = object(hexOf(0x70), 3, 65536)
    const second = segmentStarts(decodeHeader(obj), obj.byteLength)[1]!
    const slot = new Uint8Array((await n.api!.allocPinned(obj.byteLength + 4096)).buffer)
    for (const [key, cut] of [
      [0x70, obj.length - 1], // last range short
      [0x71, second - 100], // first range short, the later ones read nothing
      [0x72, 100], // inside the header read
    ] as const) {
      const o = object(hexOf(key), 3, 65536)
      await d.put(hexOf(key), o)
      writeFileSync(d.pathOf(hexOf(key)), o.subarray(0, cut))
      expect(await d.get(hexOf(key), 'get', slot)).toBeUndefined()
      expect(d.has(hexOf(key))).toBe(false)
    }
    expect(d.counters.corrupt).toBe(3)
    await d.put(hexOf(0x73), obj)
    rmSync(d.pathOf(hexOf(0x73)))
    expect(await d.get(hexOf(0x73), 'get', slot)).toBeUndefined()
    expect(d.has(hexOf(0x73))).toBe(false)
    n.api!.freePinned(slot.buffer)
  })

  it('through the addon, a file gone behind the index fails every segment read in flight, none as an unhandled rejection', async () => {
    // Segment reads run SEGMENTS_IN_FLIGHT at once and are awaited in file order: a later one failing
    // first (ENOENT comes back from each pool thread in any order) had no handler yet.
    const dir = tempDir()
    const n = loadNative()
    const d = await DiskTier.open({ dir, bytes: 1 << 30, native: n.api })
    const obj = object(hexOf(0x90), 3, 65536)
    expect(segmentStarts(decodeHeader(obj), obj.byteLength).length).toBeGreaterThan(1)
    const slot = new Uint8Array((await n.api!.allocPinned(obj.byteLength + 4096)).buffer)
    const unhandled: unknown[] = []
    const onUnhandled = (e: unknown) => unhandled.push(e)
    process.on('unhandledRejection', onUnhandled)
    try {
      for (let i = 0; i < 40; i++) {
        await d.put(hexOf(0x90), obj)
        rmSync(d.pathOf(hexOf(0x90)))
        expect(await d.get(hexOf(0x90), 'get', slot)).toBeUndefined()
        expect(d.has(hexOf(0x90))).toBe(false)
        await new Promise((r) => setImmediate(r))
      }
    } finally {
      process.off('unhandledRejection', onUnhandled)
      n.api!.freePinned(slot.buffer)
    }
    expect(unhandled).toEqual([])
    // A file gone is a plain miss (dropped from the index), neither corrupt nor an I/O error.
    expect(d.counters).toMatchObject({ misses: 40, corrupt: 0, errors: 0 })
  })

  it('a file found cut short at read is deleted, not only dropped from the index (it would sit on disk uncounted)', async () => {
    await eachReadPath({}, async (d, slot) => {
      for (const [key, cut] of [
        [0x80, 100], // inside the header
        [0x81, -1], // the last byte
      ] as const) {
        const o = object(hexOf(key), 3, 64)
        await d.put(hexOf(key), o)
        const path = d.pathOf(hexOf(key))
        writeFileSync(path, o.subarray(0, cut < 0 ? o.byteLength + cut : cut))
        expect(await d.get(hexOf(key), 'get', slot)).toBeUndefined()
        expect(d.has(hexOf(key))).toBe(false)
        expect(existsSync(path)).toBe(false)
      }
      expect(d.counters.corrupt).toBe(2)
      expect(d.stats().usedBytes).toBe(0)
    })
  })

  it('a file another writer replaced with a valid object of another size (same key) is re-indexed, not deleted as corrupt', async () => {
    await eachReadPath({}, async (d, slot) => {
      for (const [key, before, after] of [
        [0xa0, 64, 4], // now shorter than indexed
        [0xa1, 4, 64], // now longer
      ] as const) {
        const hex = hexOf(key)
        await d.put(hex, object(hex, 1, before))
        // Another process (another diskCodec, another chunk size) writes the key: temp + rename.
        const now = object(hex, 2, after)
        writeFileSync(`${d.pathOf(hex)}.other`, now)
        renameSync(`${d.pathOf(hex)}.other`, d.pathOf(hex))
        const first = await d.get(hex, 'get', slot)
        // Served as it is now, or a miss: never the bytes of both, never a deleted file.
        if (first) expect(Buffer.compare(Buffer.from(first), Buffer.from(now))).toBe(0)
        expect(existsSync(d.pathOf(hex))).toBe(true)
        expect(d.has(hex)).toBe(true)
        const again = await d.get(hex, 'get', slot)
        expect(again && Buffer.compare(Buffer.from(again), Buffer.from(now))).toBe(0)
      }
      expect(d.counters.corrupt).toBe(0)
      expect(d.stats().usedBytes).toBe(object(hexOf(1), 1, 4).byteLength + object(hexOf(1), 1, 64).byteLength)
    })
  })

  it('a chunk file replaced behind the index by a FIFO is a quick miss: the read neither blocks nor holds a queue slot', async () => {
    await eachReadPath({ concurrency: 1 }, async (d, slot) => {
      await d.put(hexOf(0x90), object(hexOf(0x90), 3, 64))
      await d.put(hexOf(0x91), object(hexOf(0x91), 4, 64))
      rmSync(d.pathOf(hexOf(0x90)))
      execFileSync('mkfifo', [d.pathOf(hexOf(0x90))])
      const got = await Promise.race([
        d.get(hexOf(0x90), 'get', slot),
        new Promise<'blocked'>((r) => setTimeout(() => r('blocked'), 2000)),
      ])
      // A read left waiting on the FIFO (without the fix) is unblocked: no pool thread lost for the run.
      if (got === 'blocked') writeFileSync(d.pathOf(hexOf(0x90)), '')
      expect(got).toBeUndefined()
      // The one queue slot is free again: the next chunk is served.
      expect(await d.get(hexOf(0x91), 'get', slot)).toBeDefined()
    })
  })

  it("a read's late verdict (corrupt, gone) on a file evicted and written again since leaves the new file indexed, counted and on disk", async () => {
    const hex = hexOf(0xb0)
    const obj = object(hex, 5, 64)
    const same = (got: Uint8Array | undefined) =>
      got !== undefined && Buffer.compare(Buffer.from(got), Buffer.from(obj)) === 0
    // Corrupt: the buffered path's verify (outside the queue slot) is held until the key is rewritten.
    let held: (() => void) | undefined
    let holdNext = false
    const d = await DiskTier.open({
      dir: tempDir(),
      bytes: 1 << 30,
      verify: async (b) => {
        if (holdNext) {
          holdNext = false
          await new Promise<void>((r) => {
            held = r
          })
        }
        const { verifyChunk } = await import('../src/core/format.ts')
        return verifyChunk(b)
      },
    })
    await d.put(hex, obj)
    writeFileSync(d.pathOf(hex), obj.with(obj.length - 9, obj[obj.length - 9]! ^ 1)) // same size, a flipped bit
    holdNext = true
    const late = d.get(hex)
    while (!held) await new Promise((r) => setTimeout(r, 1))
    await d.delete(hex) // evicted meanwhile, then stored again: an intact file under the key
    expect(await d.put(hex, obj)).toBe(true)
    held()
    expect(await late).toBeUndefined()
    expect(d.counters.corrupt).toBe(1)
    expect(existsSync(d.pathOf(hex))).toBe(true)
    expect(d.has(hex)).toBe(true)
    expect(d.stats().usedBytes).toBe(obj.byteLength)
    expect(same(await d.get(hex))).toBe(true)

    // Gone: through the addon, a read that found no file (the file evicted) reports it only
    // after the key was written again.
    const api = loadNative().api!
    let release: (() => void) | undefined
    let gateNext = false
    const native = {
      ...api,
      readFileCrc: async (...a: Parameters<typeof api.readFileCrc>) => {
        const r = api.readFileCrc(...a)
        if (!gateNext) return r
        gateNext = false
        r.catch(() => {})
        await new Promise<void>((ok) => {
          release = ok
        })
        return r
      },
    }
    const d2 = await DiskTier.open({ dir: tempDir(), bytes: 1 << 30, native })
    const slot = new Uint8Array((await api.allocPinned(1 << 20)).buffer)
    try {
      await d2.put(hex, obj)
      rmSync(d2.pathOf(hex))
      gateNext = true
      const gone = d2.get(hex, 'get', slot)
      while (!release) await new Promise((r) => setTimeout(r, 1))
      await d2.delete(hex)
      expect(await d2.put(hex, obj)).toBe(true)
      release()
      expect(await gone).toBeUndefined()
      expect(d2.has(hex)).toBe(true)
      expect(d2.stats().usedBytes).toBe(obj.byteLength)
      expect(same(await d2.get(hex, 'get', slot))).toBe(true)
    } finally {
      api.freePinned(slot.buffer)
    }
  })

  it("close() and the L1 slot freed under a read's verification (KVCache.close) leave the file: a miss, not corruption", async () => {
    const api = loadNative().api!
    for (const direct of ['off', 'auto'] as const) {
      const hex = hexOf(0xb1)
      const obj = object(hex, 6, 64)
      let held: (() => void) | undefined
      let d: DiskTier | undefined
      const slot = new Uint8Array((await api.allocPinned(1 << 20)).buffer)
      let freed = false
      // The buffered path verifies on the JS thread after the read; the direct path joins the
      // workers' CRCs there. Either way close() (then the slot freed) can land in between.
      const native =
        direct === 'auto'
          ? {
              ...api,
              readFileCrc: async (...a: Parameters<typeof api.readFileCrc>) => {
                const r = await api.readFileCrc(...a)
                await new Promise<void>((ok) => {
                  held = ok
                })
                return r
              },
            }
          : api
      d = await DiskTier.open({
        dir: tempDir(),
        bytes: 1 << 30,
        native,
        direct,
        // Not indexed: the direct read checks the header it read first against segment 0's.
        indexedHeaderBytes: 0,
        verify: async (b) => {
          await new Promise<void>((ok) => {
            held = ok
          })
          const { verifyChunk } = await import('../src/core/format.ts')
          return verifyChunk(b)
        },
      })
      await d.put(hex, obj)
      try {
        const reading = d.get(hex, 'get', slot)
        while (!held) await new Promise((r) => setTimeout(r, 1))
        // What KVCache.close() does: the disk tier closed, then L1's regions freed.
        d.close()
        api.freePinned(slot.buffer)
        freed = true
        held()
        expect(await reading).toBeUndefined()
        expect(existsSync(d.pathOf(hex)), direct).toBe(true)
        expect(d.counters.corrupt, direct).toBe(0)
      } finally {
        if (!freed) api.freePinned(slot.buffer)
      }
    }
  })

  it("through the addon, the next object's ranges are issued before the last range of the one before ends (its queue slot is handed on), at most concurrency × 4 ranges at once", async () => {
    const dir = tempDir()
    const api = loadNative().api!
    const events: string[] = []
    let inFlight = 0
    let most = 0
    const native = {
      ...api,
      readFileCrc: (...a: Parameters<typeof api.readFileCrc>) => {
        const name = `${a[0].slice(-6, -4)}@${a[3]?.fileOffset ?? 0}`
        events.push(`start ${name}`)
        most = Math.max(most, ++inFlight)
        return api.readFileCrc(...a).finally(() => {
          inFlight--
          events.push(`end ${name}`)
        })
      },
    }
    // One slot: without the hand-on, the second object would wait for every range of the first.
    const d = await DiskTier.open({ dir, bytes: 1 << 30, native, concurrency: 1 })
    const objs = [0xa1, 0xa2, 0xa3].map((k) => object(hexOf(k), k, 65536)) // three ranges each
    for (const [i, o] of objs.entries()) await d.put(hexOf(0xa1 + i), o)
    const slots = await Promise.all(
      objs.map(async (o) => new Uint8Array((await api.allocPinned(o.byteLength)).buffer)),
    )
    const got = await Promise.all(objs.map((_, i) => d.get(hexOf(0xa1 + i), 'get', slots[i])))
    for (const [i, g] of got.entries()) expect(Buffer.compare(Buffer.from(g!), Buffer.from(objs[i]!))).toBe(0)
    const firstEnds = events.lastIndexOf(
      `end a1@${segmentStarts(decodeHeader(objs[0]!), objs[0]!.byteLength).at(-1)}`,
    )
    expect(events.indexOf('start a2@0')).toBeLessThan(firstEnds)
    expect(most).toBeLessThanOrEqual(4)
    for (const s of slots) api.freePinned(s.buffer)
  })

  /**
   * A native module whose readFileCrc waits for the test: each call is listed (`obj@fileOffset`)
   * and runs the real read only once the test lets it (`go`) or fails without reading (`fail`).
   */
  const heldReads = (api: NonNullable<ReturnType<typeof loadNative>['api']>) => {
    const held: { name: string; go: () => Promise<void>; fail: (e: Error) => void }[] = []
    const native = {
      ...api,
      readFileCrc: (...a: Parameters<typeof api.readFileCrc>) =>
        new Promise<Awaited<ReturnType<typeof api.readFileCrc>>>((resolve, reject) => {
          held.push({
            name: `${a[0].slice(-6, -4)}@${a[3]?.fileOffset ?? 0}`,
            go: () => api.readFileCrc(...a).then(resolve, reject),
            fail: reject,
          })
        }),
    }
    const settle = async () => {
      for (let i = 0; i < 5; i++) await new Promise((r) => setImmediate(r))
    }
    return { held, native, settle }
  }

  it('through the addon, close() with ranges still waiting for their turn: none is issued after it, every read settles (a miss), nothing hangs', async () => {
    const api = loadNative().api!
    const { held, native, settle } = heldReads(api)
    // One slot: four ranges in flight over the tier, so the second object's last two wait.
    const d = await DiskTier.open({ dir: tempDir(), bytes: 1 << 30, native, concurrency: 1 })
    const objs = [0xb1, 0xb2].map((k) => object(hexOf(k), k, 65536)) // three ranges each
    for (const [i, o] of objs.entries()) await d.put(hexOf(0xb1 + i), o)
    const slots = await Promise.all(
      objs.map(async (o) => new Uint8Array((await api.allocPinned(o.byteLength)).buffer).fill(0xee)),
    )
    const gets = objs.map((_, i) => d.get(hexOf(0xb1 + i), 'get', slots[i]))
    await settle()
    expect(held.map((h) => h.name)).toEqual([
      'b1@0',
      expect.stringMatching(/^b1@/),
      expect.stringMatching(/^b1@/),
      'b2@0',
    ])
    d.close()
    for (const h of held.splice(0)) void h.go()
    const got = await Promise.race([Promise.all(gets), new Promise((r) => setTimeout(() => r('hang'), 5000))])
    expect(got).not.toBe('hang')
    expect((got as (Uint8Array | undefined)[])[1]).toBeUndefined()
    // The waiting ranges were never read (after close() the buffer may be its owner's no more).
    await settle()
    expect(held).toEqual([])
    for (const s of slots) api.freePinned(s.buffer)
  })

  it("through the addon, a range that fails stops its object's ranges still waiting for their turn: none is read, nothing reaches the caller's sink", async () => {
    const api = loadNative().api!
    const { held, native, settle } = heldReads(api)
    const d = await DiskTier.open({ dir: tempDir(), bytes: 1 << 30, native, concurrency: 1 })
    const objs = [0xc1, 0xc2].map((k) => object(hexOf(k), k, 65536)) // three ranges each
    for (const [i, o] of objs.entries()) await d.put(hexOf(0xc1 + i), o)
    const slots = await Promise.all(
      objs.map(async (o) => new Uint8Array((await api.allocPinned(o.byteLength)).buffer)),
    )
    const h = decodeHeader(objs[1]!)
    const sink: ReadSink = {
      into: new Uint8Array(objs[1]!.byteLength - h.headerBytes).fill(0xee),
      gate: new CopyGate(),
      copied: false,
      accept: (header) => header.headerBytes,
    }
    const first = d.get(hexOf(0xc1), 'get', slots[0])
    const second = d.get(hexOf(0xc2), 'get', slots[1], sink)
    await settle()
    // c1's three ranges and c2's first hold the four places; c2's other two wait.
    expect(held.map((x) => x.name).at(-1)).toBe('c2@0')
    held.pop()!.fail(new Error('EIO'))
    await settle()
    // Its place went to the next waiter, c2's second range: it must not be read.
    expect(held.map((x) => x.name)).not.toContainEqual(expect.stringMatching(/^c2@/))
    for (const x of held.splice(0)) void x.go()
    expect(await second).toBeUndefined()
    expect(Buffer.compare(Buffer.from((await first) ?? []), Buffer.from(objs[0]!))).toBe(0)
    await settle()
    for (const x of held.splice(0)) void x.go() // without the fix: c2's later ranges, read and copied
    await settle()
    await new Promise((r) => setTimeout(r, 200))
    expect(sink.copied).toBe(false)
    expect(sink.into.every((v) => v === 0xee)).toBe(true)
    for (const s of slots) api.freePinned(s.buffer)
  })

  it("through the addon, a demand read's ranges take the next free places before prefetched objects' ranges that waited longer", async () => {
    const api = loadNative().api!
    const { held, native, settle } = heldReads(api)
    // Two slots: eight ranges in flight over the tier.
    const d = await DiskTier.open({ dir: tempDir(), bytes: 1 << 30, native, concurrency: 2 })
    const keys = [0xd1, 0xd2, 0xd3, 0xd4, 0xd5]
    const objs = keys.map((k) => object(hexOf(k), k, 65536)) // three ranges each
    for (const [i, o] of objs.entries()) await d.put(hexOf(keys[i]!), o)
    const slots = await Promise.all(
      objs.map(async (o) => new Uint8Array((await api.allocPinned(o.byteLength)).buffer)),
    )
    // d1, d2 issued whole (slots handed on), d3 two of three, d4 holds a slot with three waiting.
    const prefetches = keys.slice(0, 4).map((k, i) => d.get(hexOf(k), 'prefetch', slots[i]))
    await settle()
    expect(held.length).toBe(8)
    const demand = d.get(hexOf(0xd5), 'get', slots[4])
    await settle()
    // A range ends: d3's last range takes its place, d3 hands its slot to the demand read.
    await held.shift()!.go()
    await settle()
    expect(held.at(-1)!.name).toMatch(/^d3@/)
    // The next place goes to the demand read, not to d4, which waited longer.
    await held.shift()!.go()
    await settle()
    expect(held.at(-1)!.name).toBe('d5@0')
    while (held.length > 0) {
      await held.shift()!.go()
      await settle()
    }
    const got = await Promise.all([...prefetches, demand])
    for (const [i, g] of got.entries()) expect(Buffer.compare(Buffer.from(g!), Buffer.from(objs[i]!))).toBe(0)
    for (const s of slots) api.freePinned(s.buffer)
  })

  it('through the addon, an indexed file is read without a header read first; one replaced since (same key) is read as it is now, not counted corrupt', async () => {
    const dir = tempDir()
    const n = loadNative()
    expect(n.api, n.reason).toBeDefined()
    const api = n.api!
    let headerReads = 0
    const native = {
      ...api,
      readFileDirect: (...a: Parameters<typeof api.readFileDirect>) => {
        headerReads++
        return api.readFileDirect(...a)
      },
    }
    const obj = object(hexOf(0x90), 4, 65536)
    const slot = new Uint8Array((await api.allocPinned(obj.byteLength + 4096)).buffer)
    const d = await DiskTier.open({ dir, bytes: 1 << 30, native })
    await d.put(hexOf(0x90), obj)
    const same = (got: Uint8Array | undefined, want: Uint8Array) =>
      got !== undefined && Buffer.compare(Buffer.from(got), Buffer.from(want)) === 0
    // Indexed by the write, then by a restart's rebuild: every range is read at once, no header read.
    expect(same(await d.get(hexOf(0x90), 'get', slot), obj)).toBe(true)
    const d2 = await DiskTier.open({ dir, bytes: 1 << 30, native })
    expect(same(await d2.get(hexOf(0x90), 'get', slot), obj)).toBe(true)
    expect(headerReads).toBe(0)
    // Another writer replaced the file (same key, same size, other bytes): served as it is
    // now, its tensor (not the indexed object's) in the sink, and indexed with its header.
    const other = object(hexOf(0x90), 200, 65536)
    writeFileSync(d2.pathOf(hexOf(0x90)), other)
    const h = decodeHeader(other)
    const sink: ReadSink = {
      into: new Uint8Array(other.byteLength - h.headerBytes).fill(0xee),
      gate: new CopyGate(),
      copied: false,
      accept: (header) => header.headerBytes,
    }
    expect(same(await d2.get(hexOf(0x90), 'get', slot, sink), other)).toBe(true)
    expect(sink.copied).toBe(true)
    expect(Buffer.compare(sink.into, other.subarray(h.headerBytes))).toBe(0)
    expect(headerReads).toBe(1)
    expect(same(await d2.get(hexOf(0x90), 'get', slot), other)).toBe(true)
    expect(headerReads).toBe(1)
    expect(d2.counters.corrupt).toBe(0)
    expect(d2.has(hexOf(0x90))).toBe(true)
    // Replaced by a damaged object: a counted corrupt miss, as any damaged file.
    writeFileSync(d2.pathOf(hexOf(0x90)), obj.with(obj.length - 5, obj[obj.length - 5]! ^ 1).with(20, 99))
    expect(await d2.get(hexOf(0x90), 'get', slot)).toBeUndefined()
    expect(d2.counters.corrupt).toBe(1)
    expect(d2.has(hexOf(0x90))).toBe(false)
    n.api!.freePinned(slot.buffer)
  })

  it('keeps indexed headers within indexedHeaderBytes: files beyond it are read header first; a deleted file frees its share', async () => {
    const dir = tempDir()
    const api = loadNative().api!
    let headerReads = 0
    const native = {
      ...api,
      readFileDirect: (...a: Parameters<typeof api.readFileDirect>) => {
        headerReads++
        return api.readFileDirect(...a)
      },
    }
    const one = decodeHeader(object(hexOf(0xa0), 1)).headerBytes
    const open = () => DiskTier.open({ dir, bytes: 1 << 30, native, indexedHeaderBytes: one + 100 })
    const d = await open()
    for (const k of [0xa0, 0xa1]) await d.put(hexOf(k), object(hexOf(k), k))
    expect(d.stats().indexedHeaderBytes).toBe(one)
    expect(await d.get(hexOf(0xa0))).toBeDefined()
    expect(headerReads).toBe(0)
    expect(await d.get(hexOf(0xa1))).toBeDefined()
    expect(headerReads).toBe(1)
    await d.delete(hexOf(0xa0))
    expect(d.stats().indexedHeaderBytes).toBe(0)
    await d.put(hexOf(0xa2), object(hexOf(0xa2), 2))
    expect(d.stats().indexedHeaderBytes).toBe(one)
    expect(await d.get(hexOf(0xa2))).toBeDefined()
    expect(headerReads).toBe(1)
    // A restart indexes two files within room for one header.
    const d2 = await open()
    expect(d2.stats()).toMatchObject({ files: 2, indexedHeaderBytes: one })
    // What is kept is a copy of the header alone, not a view holding the object or a read probe alive.
    for (const t of [d, d2])
      for (const k of [0xa1, 0xa2]) {
        const h = t.indexedHeader(hexOf(k))
        if (h) expect(h.buffer.byteLength).toBe(one)
      }
    expect([0xa1, 0xa2].filter((k) => d2.indexedHeader(hexOf(k)) !== undefined)).toHaveLength(1)
  })

  it('a restart keeps the headers of the most recently used files within indexedHeaderBytes (not of the coldest)', async () => {
    const dir = tempDir()
    const one = decodeHeader(object(hexOf(1), 1)).headerBytes
    const d = await DiskTier.open({ dir, bytes: 1 << 30 })
    const N = 40
    for (let k = 1; k <= N; k++) await d.put(hexOf(k), object(hexOf(k), k))
    // File k was last used k minutes after the first: file N is the most recent.
    const base = Date.now() / 1000 - 10 * N * 60
    for (let k = 1; k <= N; k++) utimesSync(d.pathOf(hexOf(k)), base + k * 60, base + k * 60)
    const d2 = await DiskTier.open({ dir, bytes: 1 << 30, indexedHeaderBytes: 3 * one + 10 })
    expect(d2.stats()).toMatchObject({ files: N, indexedHeaderBytes: 3 * one })
    const kept = Array.from({ length: N }, (_, i) => i + 1).filter(
      (k) => d2.indexedHeader(hexOf(k)) !== undefined,
    )
    expect(kept).toEqual([N - 2, N - 1, N])
  })

  describe("a read with a sink (the caller's buffer) copies verified sections only", () => {
    // ~40 MiB objects in three reads whose cuts fall inside sections: sections read whole
    // are copied by the workers, the split ones by the JS thread once all verified.
    const setup = async () => {
      const n = loadNative()
      expect(n.api, n.reason).toBeDefined()
      const d = await DiskTier.open({ dir: tempDir(), bytes: 1 << 30, native: n.api })
      const slot = new Uint8Array(
        (await n.api!.allocPinned(object(hexOf(0), 0, 65536).byteLength + 4096)).buffer,
      )
      return { d, slot, free: () => n.api!.freePinned(slot.buffer) }
    }
    const sinkFor = (obj: Uint8Array, gate = new CopyGate()): ReadSink => {
      const h = decodeHeader(obj)
      return {
        into: new Uint8Array(obj.byteLength - h.headerBytes).fill(0xee),
        gate,
        copied: false,
        accept: (header) => header.headerBytes,
      }
    }

    it('an intact object lands whole in the sink, verified; a closed gate copies nothing', async () => {
      const { d, slot, free } = await setup()
      const obj = object(hexOf(0x80), 5, 65536)
      const h = decodeHeader(obj)
      await d.put(hexOf(0x80), obj)
      const sink = sinkFor(obj)
      expect(await d.get(hexOf(0x80), 'get', slot, sink)).toBeDefined()
      expect(sink.copied).toBe(true)
      expect(Buffer.compare(sink.into, obj.subarray(h.headerBytes))).toBe(0)
      expect(d.stats().sinkReads).toBe(1)
      // The gate closed (its retrieve gave up): the read still serves L1, the sink stays untouched.
      const gate = new CopyGate()
      gate.close()
      const late = sinkFor(obj, gate)
      expect(await d.get(hexOf(0x80), 'get', slot, late)).toBeDefined()
      expect(late.copied).toBe(false)
      expect(late.into.every((v) => v === 0xee)).toBe(true)
      // accept() saying "not this chunk" copies nothing either.
      const refused = { ...sinkFor(obj), accept: () => undefined }
      expect(await d.get(hexOf(0x80), 'get', slot, refused)).toBeDefined()
      expect(refused.copied || refused.into.some((v) => v !== 0xee)).toBe(false)
      expect(d.stats().sinkReads).toBe(1)
      free()
    })

    it('a flip in a whole or a split section, or a read cut short mid-object, is a counted miss: the damaged section never reaches the sink, nothing stays held', async () => {
      const { d, slot, free } = await setup()
      const obj = object(hexOf(0x81), 6, 65536)
      const h = decodeHeader(obj)
      const cut = segmentStarts(h, obj.byteLength)[1]!
      const split = h.sections.findIndex((s) => s.offset < cut && s.offset + s.length > cut)
      const whole = h.sections.findIndex((s) => s.offset >= cut)
      expect(split).toBeGreaterThanOrEqual(0)
      expect(whole).toBeGreaterThan(split)
      const cases = [
        [
          0x82,
          whole,
          (o: Uint8Array) => o.with(h.sections[whole]!.offset + 9, o[h.sections[whole]!.offset + 9]! ^ 4),
        ],
        [0x83, split, (o: Uint8Array) => o.with(cut, o[cut]! ^ 4)],
        [0x84, whole, (o: Uint8Array) => o.subarray(0, h.sections[whole]!.offset + 100)],
      ] as const
      for (const [key, damaged, damage] of cases) {
        const o = object(hexOf(key), 6, 65536)
        await d.put(hexOf(key), o)
        writeFileSync(d.pathOf(hexOf(key)), damage(o))
        const sink = sinkFor(o)
        expect(await d.get(hexOf(key), 'get', slot, sink)).toBeUndefined()
        expect(sink.copied).toBe(false)
        const s = h.sections[damaged]!
        const inSink = sink.into.subarray(s.offset - h.headerBytes, s.offset - h.headerBytes + s.length)
        expect(
          inSink.every((v) => v === 0xee),
          `section ${damaged} of ${key.toString(16)}`,
        ).toBe(true)
        expect(d.has(hexOf(key))).toBe(false)
      }
      expect(d.counters.corrupt).toBe(cases.length)
      expect(d.stats().sinkReads).toBe(0)
      // No read or copy is left running: the slot can be freed (a busy block refuses).
      free()
    })
  })

  it('keeps within its byte budget by evicting the least recently used file', async () => {
    const dir = tempDir()
    const one = object(hexOf(1), 1).byteLength
    const d = await DiskTier.open({ dir, bytes: 2 * one + 10 })
    await d.put(hexOf(1), object(hexOf(1), 1))
    await d.put(hexOf(2), object(hexOf(2), 2))
    await d.get(hexOf(1))
    await d.put(hexOf(3), object(hexOf(3), 3))
    expect(d.has(hexOf(1))).toBe(true)
    expect(d.has(hexOf(2))).toBe(false)
    expect(d.stats().usedBytes).toBeLessThanOrEqual(2 * one + 10)
    expect(d.counters.evictions).toBe(1)
    // A restart with a smaller budget trims on open.
    const d2 = await DiskTier.open({ dir, bytes: one + 1 })
    expect(d2.stats().files).toBe(1)
  })

  it('concurrent writes stay within the budget: each one reserves its bytes before the next one evicts', async () => {
    const one = object(hexOf(1), 1).byteLength
    for (const concurrency of [2, 4]) {
      const dir = tempDir()
      const d = await DiskTier.open({ dir, bytes: 4 * one + 10, concurrency })
      let peak = 0
      const puts = Array.from({ length: 12 }, (_, i) =>
        d.put(hexOf(i + 1), object(hexOf(i + 1), i + 1)).then((ok) => {
          peak = Math.max(peak, d.stats().usedBytes)
          return ok
        }),
      )
      expect(await Promise.all(puts)).toEqual(Array(12).fill(true))
      expect(peak).toBeLessThanOrEqual(4 * one + 10)
      expect(d.stats().files).toBe(4)
      // A failed write (its fan-out directory is a file) gives its reservation back: had it
      // kept it, the next write would evict one more file than it needs.
      writeFileSync(join(dir, 'ab'), '')
      const failing = 'ab'.repeat(32)
      expect(await d.put(failing, object(failing, 9))).toBe(false)
      expect(d.stats().files).toBe(3)
      expect(await d.put(hexOf(99), object(hexOf(99), 9))).toBe(true)
      expect(d.stats().files).toBe(4)
      expect(d.counters.evictions).toBe(12 - 4 + 1)
    }
  })

  it('under a mix of writes, reads and files cut, replaced or deleted behind the index, the accounting matches the disk', async () => {
    const n = loadNative()
    let seed = 7
    const rnd = () => {
      seed = (seed * 1103515245 + 12345) & 0x7fffffff
      return seed / 0x7fffffff
    }
    const bytesOnDisk = (dir: string) =>
      readdirSync(dir)
        .flatMap((sub) => readdirSync(join(dir, sub)).map((f) => join(dir, sub, f)))
        .filter((f) => f.endsWith('.kvc'))
        .reduce((a, f) => a + statSync(f).size, 0)
    for (const native of [undefined, n.api]) {
      const budget = new DiskBudget(40 * object(hexOf(1), 1).byteLength)
      const dirs = [tempDir(), tempDir()]
      const tiers = await Promise.all(
        dirs.map((dir) => DiskTier.open({ dir, bytes: 1, sharedBudget: budget, native, concurrency: 3 })),
      )
      const ops: Promise<unknown>[] = []
      for (let i = 0; i < 600; i++) {
        const d = tiers[Math.floor(rnd() * 2)]!
        const k = 1 + Math.floor(rnd() * 80)
        const hex = hexOf(k)
        const path = d.pathOf(hex)
        const r = rnd()
        const tokens = rnd() < 0.5 ? 4 : 8
        if (r < 0.5) ops.push(d.put(hex, object(hex, k, tokens)))
        else if (r < 0.8) ops.push(d.get(hex))
        else if (r < 0.95) {
          // Behind the tier's back, to a file it holds (once nothing runs: no eviction races the check).
          await Promise.all(ops.splice(0))
          if (!existsSync(path)) continue
          if (r < 0.85) writeFileSync(path, readFileSync(path).subarray(0, 50))
          else if (r < 0.9) {
            writeFileSync(`${path}.x`, object(hex, 3, tokens))
            renameSync(`${path}.x`, path)
          } else rmSync(path)
        } else ops.push(d.delete(hex))
        if (i % 20 === 0) await Promise.all(ops.splice(0))
      }
      await Promise.all(ops)
      for (const d of tiers) await d.drain()
      // Every indexed file read once, so each tier has seen what happened to its files.
      for (const d of tiers) for (let k = 1; k <= 80; k++) if (d.has(hexOf(k))) await d.get(hexOf(k))
      const used = tiers.map((d) => d.stats().usedBytes)
      expect(budget.reserved).toBe(0)
      expect(budget.used).toBe(used[0]! + used[1]!)
      expect(used).toEqual(dirs.map(bytesOnDisk))
      expect(budget.used).toBeLessThanOrEqual(budget.bytes)
    }
  })

  it('tiers sharing one budget evict the least recently used file of any of them', async () => {
    const one = object(hexOf(1), 1).byteLength
    const budget = new DiskBudget(3 * one + 10)
    const a = await DiskTier.open({ dir: tempDir(), bytes: 1, sharedBudget: budget })
    const b = await DiskTier.open({ dir: tempDir(), bytes: 1, sharedBudget: budget })
    // The same chain key in two tiers is two files (their directories differ).
    expect(await a.put(hexOf(1), object(hexOf(1), 1))).toBe(true)
    expect(await b.put(hexOf(1), object(hexOf(1), 101))).toBe(true)
    expect(await a.put(hexOf(2), object(hexOf(2), 2))).toBe(true)
    expect(budget.used).toBe(3 * one)
    await a.get(hexOf(1)) // a's 1 is now the most recently used: b's 1 is the oldest of all
    // b's next write evicts b's own oldest only because it is the oldest overall; a's next, b's.
    expect(await b.put(hexOf(3), object(hexOf(3), 3))).toBe(true)
    expect([a.has(hexOf(1)), b.has(hexOf(1)), a.has(hexOf(2)), b.has(hexOf(3))]).toEqual([
      true,
      false,
      true,
      true,
    ])
    expect(await a.put(hexOf(4), object(hexOf(4), 4))).toBe(true)
    // a's 2 was the oldest then (a's 1 was read after it): evicted from a for a's own write.
    expect([a.has(hexOf(1)), a.has(hexOf(2)), b.has(hexOf(3)), a.has(hexOf(4))]).toEqual([
      true,
      false,
      true,
      true,
    ])
    await a.get(hexOf(1))
    await a.get(hexOf(4))
    // Now b's 3 is the oldest: a write to a evicts it from b (one budget, not a split).
    expect(await a.put(hexOf(5), object(hexOf(5), 5))).toBe(true)
    expect(b.has(hexOf(3))).toBe(false)
    expect(b.counters.evictions).toBe(2)
    expect(budget.used).toBe(3 * one)
    expect(a.stats().usedBytes + b.stats().usedBytes).toBe(3 * one)
    const got = await a.get(hexOf(1))
    expect(got && decodeHeader(got).chainKey[31]).toBe(1)
    // A closed tier leaves the budget: its files no longer count, nor are they evicted.
    b.close()
    b.close()
    expect(budget.used).toBe(3 * one)
    a.close()
    expect(budget.used).toBe(0)
    expect(() => new DiskBudget(0)).toThrow(/budget/)
  })

  it('a tier that fails to open leaves the shared budget it joined', async () => {
    const budget = new DiskBudget(1 << 20)
    const a = await DiskTier.open({ dir: tempDir(), bytes: 1, sharedBudget: budget })
    expect(budget.members).toBe(1)
    // Its directory cannot be made: a path under a regular file (ENOTDIR).
    const file = join(tempDir(), 'not-a-dir')
    writeFileSync(file, 'x')
    await expect(DiskTier.open({ dir: join(file, 'l2'), bytes: 1, sharedBudget: budget })).rejects.toThrow()
    expect(budget.members).toBe(1)
    expect(budget.used).toBe(0)
    a.close()
    expect(budget.members).toBe(0)
  })

  it('survives ENOSPC on a full filesystem: the write fails quietly and nothing partial is left', async (ctx) => {
    const dir = tempDir()
    try {
      execFileSync('mount', ['-t', 'tmpfs', '-o', 'size=64k', 'tmpfs', dir], { stdio: 'ignore' })
    } catch {
      ctx.skip()
      return
    }
    try {
      const d = await DiskTier.open({ dir, bytes: 1 << 30 })
      let ok = 0
      for (let i = 1; i <= 12; i++) if (await d.put(hexOf(i), object(hexOf(i), i, 64))) ok++
      expect(ok).toBeGreaterThan(0)
      expect(ok).toBeLessThan(12)
      expect(d.stats().writeErrors).toBe(12 - ok)
      expect(d.stats().lastWriteError).toMatch(/ENOSPC/)
      const d2 = await DiskTier.open({ dir, bytes: 1 << 30 })
      expect(d2.stats().files).toBe(ok)
      expect(d2.stats().recoveredDiscarded).toBe(0)
      for (let i = 1; i <= 12; i++) if (d2.has(hexOf(i))) expect(await d2.get(hexOf(i))).toBeDefined()
    } finally {
      execFileSync('umount', [dir])
    }
  })

  it('on a read-only directory, reads work and writes fail without throwing', async (ctx) => {
    const dir = tempDir()
    const d0 = await DiskTier.open({ dir, bytes: 1 << 20 })
    await d0.put(hexOf(1), object(hexOf(1), 1))
    await whileReadOnly(dir, ctx, async () => {
      const d = await DiskTier.open({ dir, bytes: 1 << 20 })
      expect(await d.get(hexOf(1))).toBeDefined()
      expect(await d.put(hexOf(2), object(hexOf(2), 2))).toBe(false)
      expect(d.stats().lastWriteError).toMatch(/EROFS/)
    })
  })
})

describe('PriorityQueue', () => {
  it('runs demand reads before prefetches before writes once a slot frees up', async () => {
    const q = new PriorityQueue(1)
    const order: string[] = []
    let open!: () => void
    const gate = new Promise<void>((r) => {
      open = r
    })
    const first = q.run('put', async () => {
      await gate
      order.push('first')
    })
    const jobs = [
      q.run('put', async () => void order.push('put')),
      q.run('prefetch', async () => void order.push('prefetch')),
      q.run('get', async () => void order.push('get')),
    ]
    expect(q.pending).toBe(3)
    open()
    await Promise.all([first, ...jobs])
    expect(order).toEqual(['first', 'get', 'prefetch', 'put'])
  })

  it('keeps a slot free of prefetches and writes for a demand read', async () => {
    const q = new PriorityQueue(3)
    let open!: () => void
    const gate = new Promise<void>((r) => {
      open = r
    })
    const background = [
      ...Array.from({ length: 4 }, () => q.run('prefetch', () => gate)),
      ...Array.from({ length: 4 }, () => q.run('put', () => gate)),
    ]
    // At most concurrency − 1 = 2 background jobs run; the third slot waits for a demand read.
    expect(q.runningOf('prefetch') + q.runningOf('put')).toBe(2)
    let got = false
    const demand = q.run('get', async () => {
      got = true
    })
    await demand
    expect(got).toBe(true)
    open()
    await Promise.all(background)
  })

  it('close() fails queued jobs with ERR_CLOSED and refuses new ones', async () => {
    const q = new PriorityQueue(1)
    let open!: () => void
    const running = q.run('get', () => new Promise<void>((r) => (open = r)))
    const queued = q.run('prefetch', async () => 1)
    q.close()
    await expect(queued).rejects.toMatchObject({ code: 'ERR_CLOSED' })
    await expect(q.run('get', async () => 1)).rejects.toMatchObject({ code: 'ERR_CLOSED' })
    open()
    await running
  })

  it('propagates a job failure to its caller only', async () => {
    const q = new PriorityQueue(2)
    await expect(q.run('get', async () => Promise.reject(new Error('boom')))).rejects.toThrow('boom')
    await expect(q.run('get', async () => 5)).resolves.toBe(5)
  })

  it("handOn() gives a running job's slot to the next one before it settles, once however often called", async () => {
    const q = new PriorityQueue(1)
    let open!: () => void
    const gate = new Promise<void>((r) => (open = r))
    const order: string[] = []
    const first = q.run('get', async (handOn) => {
      handOn()
      handOn() // a second call frees nothing more
      await gate
      order.push('first')
    })
    const second = q.run('get', async () => void order.push('second'))
    const third = q.run('get', async () => gate.then(() => void order.push('third')))
    const fourth = q.run('get', async () => void order.push('fourth'))
    await second // ran while the first still waits
    expect(order).toEqual(['second'])
    // The third holds the one slot: the fourth waits for it, not for the first.
    await new Promise((r) => setImmediate(r))
    expect(q.pending).toBe(1)
    open()
    await Promise.all([first, third, fourth])
    expect(order.slice(-1)).toEqual(['fourth'])
    expect(q.runningOf('get')).toBe(0)
  })

  it('a job that throws synchronously frees its slot and rejects its caller', async () => {
    const q = new PriorityQueue(1)
    await expect(
      q.run('get', () => {
        throw new Error('sync')
      }),
    ).rejects.toThrow('sync')
    await expect(q.run('get', async () => 7)).resolves.toBe(7)
  })
})

describe('InFlightLimit', () => {
  it('grants a waiter asked for first before the others that waited longer; withdrawn, it holds nothing', async () => {
    const l = new InFlightLimit(1)
    const held = l.take()
    const later = l.take()
    const first = l.take(true)
    const dropped = l.take(true)
    const order: string[] = []
    void later.ready.then((ok) => ok && order.push('later'))
    void first.ready.then((ok) => ok && order.push('first'))
    dropped.withdraw()
    expect(await dropped.ready).toBe(false)
    held.release()
    await new Promise((r) => setImmediate(r))
    expect(order).toEqual(['first'])
    first.release()
    await new Promise((r) => setImmediate(r))
    expect(order).toEqual(['first', 'later'])
    later.release()
    expect(l.used).toBe(0)
  })

  it('grants at most `limit` at once, in the order asked, each release handing its place on', async () => {
    const l = new InFlightLimit(2)
    const grants = Array.from({ length: 5 }, () => l.take())
    const got: number[] = []
    grants.forEach((g, i) => void g.ready.then((ok) => ok && got.push(i)))
    await Promise.resolve()
    await Promise.resolve()
    expect(got).toEqual([0, 1])
    expect(l.used).toBe(2)
    grants[1]!.release()
    grants[1]!.release() // once only: a second release frees nothing
    await new Promise((r) => setImmediate(r))
    expect(got).toEqual([0, 1, 2])
    expect(l.used).toBe(2)
    // A waiter withdrawn never holds a place, and the next waiter gets it.
    grants[3]!.withdraw()
    expect(await grants[3]!.ready).toBe(false)
    grants[3]!.release() // nothing held: no effect
    grants[0]!.release()
    expect(await grants[4]!.ready).toBe(true)
    expect(l.used).toBe(2)
    grants[2]!.release()
    grants[4]!.release()
    expect(l.used).toBe(0)
    // Withdrawing a grant already held changes nothing.
    const held = l.take()
    expect(await held.ready).toBe(true)
    held.withdraw()
    expect(l.used).toBe(1)
    held.release()
    expect(l.used).toBe(0)
  })
})

/** A pid no process has (the highest free one below the kernel's limit). */
function deadPid(): number {
  for (let pid = 4_000_000; pid > 1000; pid--) {
    try {
      process.kill(pid, 0)
    } catch (e) {
      if ((e as NodeJS.ErrnoException).code === 'ESRCH') return pid
    }
  }
  throw new Error('no free pid')
}

void toHex
