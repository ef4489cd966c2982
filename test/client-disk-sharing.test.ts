// L2 in a directory it does not own alone: other processes' temp files, other
// models' chunk files, I/O errors that are not corruption, and durable renames
// (the directory fsync). node:fs/promises is wrapped to inject errors and observe fsyncs.

import { spawn, spawnSync } from 'node:child_process'
import {
  appendFileSync,
  existsSync,
  mkdirSync,
  mkdtempSync,
  readdirSync,
  renameSync,
  rmSync,
  utimesSync,
  writeFileSync,
} from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { threadId, Worker } from 'node:worker_threads'
import { afterEach, describe, expect, it, vi } from 'vitest'
import { loadNative } from '../src/client/native-api.ts'
import { DiskTier } from '../src/client/tiers/disk.ts'
import { beginTemp, endTemp, StaleTempWatch } from '../src/client/tiers/temp-files.ts'
import { CodecError } from '../src/core/errors.ts'
import { encodeChunk } from '../src/core/format.ts'
import { MODEL_PRESETS } from '../src/core/layout.ts'

const io = vi.hoisted(() => ({
  /** open() of these paths fails with the errno code. */
  failOpen: new Map<string, string>(),
  /** Directories fsynced, in order. */
  syncedDirs: [] as string[],
  /** Awaited by every FileHandle.datasync before it runs (a write held between its data and its rename). */
  beforeDatasync: undefined as (() => Promise<void>) | undefined,
  /** Called once a FileHandle.read is issued (its buffer handed to the pool), before it settles. */
  onRead: undefined as (() => void) | undefined,
}))

vi.mock('node:fs/promises', async (importOriginal) => {
  const real = await importOriginal<typeof import('node:fs/promises')>()
  const open: typeof real.open = async (path, flags, mode) => {
    const code = io.failOpen.get(String(path))
    if (code) throw Object.assign(new Error(`${code}: injected`), { code })
    const fh = await real.open(path, flags, mode)
    const read = fh.read.bind(fh) as (...a: unknown[]) => Promise<unknown>
    fh.read = ((...a: unknown[]) => {
      const p = read(...a)
      io.onRead?.()
      return p
    }) as typeof fh.read
    const datasync = fh.datasync.bind(fh)
    fh.datasync = async () => {
      await io.beforeDatasync?.()
      return datasync()
    }
    if ((await fh.stat()).isDirectory()) {
      const sync = fh.sync.bind(fh)
      fh.sync = async () => {
        io.syncedDirs.push(String(path))
        return sync()
      }
    }
    return fh
  }
  return { ...real, open, default: { ...real, open } }
})

const g = MODEL_PRESETS.stories260k

function hexOf(n: number): string {
  return n.toString(16).padStart(64, '0')
}

function object(hex: string, ns = 0): Uint8Array {
  const slab = 2 * 4 * g.kvHeads * g.headDim * 2
  return encodeChunk(
    {
      codec: 'raw',
      codecVersion: 1,
      codecParams: new Uint8Array(0),
      geometry: g,
      tokens: 4,
      chunkIndex: 0,
      partial: false,
      namespaceId: new Uint8Array(16).fill(ns),
      chainKey: Buffer.from(hex, 'hex'),
      parentKey: new Uint8Array(32),
    },
    Array.from({ length: g.layers }, (_, l) => new Uint8Array(slab).fill(l)),
  )
}

const dirs: string[] = []
/** Whether this machine lets a test start a process in a new pid namespace (root, or user namespaces). */
function hasUnshare(): boolean {
  return spawnSync('unshare', ['--pid', '--fork', 'true']).status === 0
}

function tempDir(): string {
  const d = mkdtempSync(join(tmpdir(), 'kvgate-l2share-'))
  dirs.push(d)
  return d
}
afterEach(() => {
  io.beforeDatasync = undefined
  io.onRead = undefined
  io.failOpen.clear()
  io.syncedDirs.length = 0
  for (const d of dirs.splice(0)) rmSync(d, { recursive: true, force: true })
})

const ours = (h: { namespaceId: Uint8Array }) => h.namespaceId.every((b) => b === 0)

describe('DiskTier in a shared directory', () => {
  it("leaves a live writer's temp files alone at start, however old their mtime; removes a dead writer's", async () => {
    const dir = tempDir()
    mkdirSync(join(dir, '00'))
    // The parent process (the test runner) stands for another live writer on this host.
    const live = join(dir, '00', `.tmp-${hexOf(1)}-${process.ppid}-aaaa`)
    const old = join(dir, '00', `.tmp-${hexOf(2)}-${process.ppid}-bbbb`)
    const dead = join(dir, '00', `.tmp-${hexOf(3)}-${4_194_000}-cccc`)
    for (const p of [live, old, dead]) writeFileSync(p, 'partial')
    const twoHoursAgo = (Date.now() - 2 * 3600_000) / 1000
    utimesSync(old, twoHoursAgo, twoHoursAgo)
    const d = await DiskTier.open({ dir, bytes: 1 << 20 })
    expect(existsSync(live)).toBe(true)
    // Its mtime is a clock this process cannot trust (the next test): watched, not judged by it.
    expect(existsSync(old)).toBe(true)
    // 4194000 is above the default pid_max of most hosts: no such process.
    expect(existsSync(dead)).toBe(false)
    expect(d.stats().recoveredDiscarded).toBe(1)
    d.close()
  })

  it("a temp file whose writer cannot be told is deleted once unchanged for staleTempMs by this process's clock, never by its mtime (another clock, skewed)", async () => {
    const dir = tempDir()
    mkdirSync(join(dir, '00'))
    // This process's host tag, and another's: a writer there cannot be checked from here.
    const ownName = beginTemp(hexOf(20))
    endTemp(ownName)
    const host = /-h([0-9a-f]{8})-[0-9a-f]+$/.exec(ownName)![1]!
    const other = host === '00000000' ? '00000001' : '00000000'
    const name = (k: number) => join(dir, '00', `.tmp-${hexOf(k)}-4242-77-t0-h${other}-abcd`)
    // Written on a host whose clock is two hours behind this one's: in flight, and stopped.
    const inFlight = name(21)
    const stopped = name(22)
    const twoHoursAgo = (Date.now() - 2 * 3600_000) / 1000
    for (const p of [inFlight, stopped]) {
      writeFileSync(p, 'partial')
      utimesSync(p, twoHoursAgo, twoHoursAgo)
    }
    const periodMs = 300
    const d = await DiskTier.open({ dir, bytes: 1 << 20, staleTempMs: periodMs })
    try {
      expect(existsSync(inFlight)).toBe(true)
      expect(existsSync(stopped)).toBe(true)
      expect(d.stats().recoveredDiscarded).toBe(0)
      // The writer goes on writing for three periods: its file stays; the stopped one goes.
      const writing = setInterval(() => appendFileSync(inFlight, 'x'), 20)
      try {
        const until = Date.now() + 3 * periodMs
        while (Date.now() < until) {
          expect(existsSync(inFlight)).toBe(true)
          await new Promise((r) => setTimeout(r, 20))
        }
      } finally {
        clearInterval(writing)
      }
      expect(existsSync(stopped)).toBe(false)
      // Once it stopped changing for a whole period it is a leftover too.
      for (let i = 0; i < 200 && existsSync(inFlight); i++) await new Promise((r) => setTimeout(r, 20))
      expect(existsSync(inFlight)).toBe(false)
      expect(d.stats().recoveredDiscarded).toBe(2)
    } finally {
      d.close()
    }
    // A closed tier deletes nothing more.
    const left = name(23)
    writeFileSync(left, 'partial')
    const e = await DiskTier.open({ dir, bytes: 1 << 20, staleTempMs: 50 })
    e.close()
    await new Promise((r) => setTimeout(r, 200))
    expect(existsSync(left)).toBe(true)
  })

  it('a temp file watched after others is judged over a whole period of its own, not at their check', async () => {
    const dir = tempDir()
    const periodMs = 400
    const at = new Map<string, number>()
    const gone = new Map<string, number>()
    const w = new StaleTempWatch(periodMs, 16, async (p) => {
      gone.set(p, performance.now())
      rmSync(p)
    })
    try {
      const [a, b] = [join(dir, 'a'), join(dir, 'b')]
      for (const p of [a, b]) writeFileSync(p, 'partial')
      at.set(a, performance.now())
      await w.watch(a)
      // Found later (a long scan): its writer may be between two writes now, for less than a period.
      await new Promise((r) => setTimeout(r, 300))
      at.set(b, performance.now())
      await w.watch(b)
      for (let i = 0; i < 200 && gone.size < 2; i++) await new Promise((r) => setTimeout(r, 20))
      expect([...gone.keys()].sort()).toEqual([a, b])
      // Neither went before it was seen unchanged for a whole period (b went 100 ms after it was found).
      for (const [p, t] of gone) expect(t - at.get(p)!).toBeGreaterThanOrEqual(periodMs)
      expect(w.size).toBe(0)
    } finally {
      w.close()
    }
  })

  it("a staleTempMs past Node's timer limit (2^31 - 1 ms) is not a timer that fires at once", async () => {
    const dir = tempDir()
    const p = join(dir, 'a')
    writeFileSync(p, 'partial')
    const gone: string[] = []
    const w = new StaleTempWatch(2 ** 32, 16, async (q) => {
      gone.push(q)
    })
    try {
      await w.watch(p)
      await new Promise((r) => setTimeout(r, 200))
      expect(gone).toEqual([])
      expect(w.size).toBe(1)
    } finally {
      w.close()
    }
  })

  it("a fresh temp file named with this process's pid is a previous process's leftover (a container's pid 1), unless this process writes it", async () => {
    const dir = tempDir()
    mkdirSync(join(dir, '00'))
    // A write of this process (another tier on the directory) held between its data and its rename.
    const a = await DiskTier.open({ dir, bytes: 1 << 20 })
    // Left by a process that had this pid before (it crashed mid-write; the container restarted).
    const leftover = join(dir, '00', `.tmp-${hexOf(4)}-${process.pid}-dddd`)
    writeFileSync(leftover, 'partial')
    let release: (() => void) | undefined
    io.beforeDatasync = () =>
      new Promise<void>((r) => {
        release = r
      })
    const writing = a.put(hexOf(5), object(hexOf(5)))
    while (!release) await new Promise((r) => setTimeout(r, 1))
    io.beforeDatasync = undefined
    const b = await DiskTier.open({ dir, bytes: 1 << 20 })
    expect(existsSync(leftover)).toBe(false)
    expect(b.stats().recoveredDiscarded).toBe(1)
    release()
    expect(await writing).toBe(true)
    expect(existsSync(a.pathOf(hexOf(5)))).toBe(true)
  })

  it('a tier opened in one thread leaves alone the temp file another thread of this process is writing', async () => {
    const dir = tempDir()
    const hex = hexOf(6)
    const writer = new Worker(new URL('./support/l2-writer-thread.mjs', import.meta.url), {
      workerData: { dir, hex, object: object(hex) },
    })
    const answers: unknown[] = []
    const answered = new Promise<void>((resolve, reject) => {
      writer.on('message', (m) => {
        answers.push(m)
        if (typeof m === 'object') resolve()
      })
      writer.on('error', reject)
    })
    try {
      while (!answers.includes('holding')) await new Promise((r) => setTimeout(r, 5))
      const temps = readdirSync(join(dir, '00')).filter((n) => n.startsWith('.tmp-'))
      expect(temps).toHaveLength(1)
      // Opening here (the same pid, another thread's set of live writes) must not take it for a leftover.
      const d = await DiskTier.open({ dir, bytes: 1 << 20 })
      expect(existsSync(join(dir, '00', temps[0]!))).toBe(true)
      expect(d.stats().recoveredDiscarded).toBe(0)
      writer.postMessage('release')
      await answered
      expect(answers.at(-1)).toEqual({ ok: true })
      expect(existsSync(d.pathOf(hex))).toBe(true)
    } finally {
      await writer.terminate()
    }
  })

  it("temp files named with this pid: an earlier process's here are deleted; another thread's of this one, or another host's, are watched", async () => {
    const dir = tempDir()
    mkdirSync(join(dir, '00'))
    const a = await DiskTier.open({ dir, bytes: 1 << 20 })
    let release: (() => void) | undefined
    io.beforeDatasync = () =>
      new Promise<void>((r) => {
        release = r
      })
    const writing = a.put(hexOf(7), object(hexOf(7)))
    while (!release) await new Promise((r) => setTimeout(r, 1))
    io.beforeDatasync = undefined
    const [own] = readdirSync(join(dir, '00')).filter((n) => n.startsWith('.tmp-'))
    // .tmp-<hex>-<pid>-<start>-t<thread>-h<host>-<random>, as this thread names its writes.
    const [, pid, start, thread, host] = /-(\d+)-(\d+)-t(\d+)-h([0-9a-f]{8})-[0-9a-f]+$/.exec(own!)!
    expect([Number(pid), Number(thread)]).toEqual([process.pid, threadId])
    const path = (hex: string, s: string, t: string | number, h = host!) =>
      join(dir, '00', `.tmp-${hex}-${pid}-${s}-t${t}-h${h}-abcd`)
    const earlier = path(hexOf(8), `${Number(start) + 1}`, thread!)
    const thisThreadDone = path(hexOf(9), start!, thread!)
    const otherThread = path(hexOf(10), start!, threadId + 1000)
    const otherThreadOld = path(hexOf(11), start!, threadId + 1001)
    // Another host's (or container's) writer with this pid: nothing here says whether it lives.
    const otherHost = path(
      hexOf(12),
      `${Number(start) + 1}`,
      thread!,
      host === '00000000' ? '00000001' : '00000000',
    )
    // Past any clock skew (8 days): a dead foreign writer's, deleted at open.
    const otherHostAncient = path(hexOf(14), start!, thread!, host === '00000000' ? '00000001' : '00000000')
    for (const p of [earlier, thisThreadDone, otherThread, otherThreadOld, otherHost, otherHostAncient])
      writeFileSync(p, 'partial')
    const twoHoursAgo = (Date.now() - 2 * 3600_000) / 1000
    utimesSync(otherThreadOld, twoHoursAgo, twoHoursAgo)
    const eightDaysAgo = (Date.now() - 8 * 24 * 3600_000) / 1000
    utimesSync(otherHostAncient, eightDaysAgo, eightDaysAgo)
    const b = await DiskTier.open({ dir, bytes: 1 << 20 })
    expect(existsSync(join(dir, '00', own!))).toBe(true)
    expect(existsSync(earlier)).toBe(false)
    expect(existsSync(thisThreadDone)).toBe(false)
    expect(existsSync(otherThread)).toBe(true)
    expect(existsSync(otherThreadOld)).toBe(true) // watched (the test before): its mtime is not trusted
    expect(existsSync(otherHost)).toBe(true)
    expect(existsSync(otherHostAncient)).toBe(false)
    expect(b.stats().recoveredDiscarded).toBe(3)
    release()
    expect(await writing).toBe(true)
  })

  // A container sharing the directory whose hostname is this host's (Kubernetes hostNetwork,
  // `docker run --hostname`): its pids are another namespace's (its entrypoint is pid 1).
  it.skipIf(!hasUnshare())(
    "a live writer in another pid namespace with this hostname (a container's pid 1) keeps its temp file",
    async () => {
      const dir = tempDir()
      mkdirSync(join(dir, '00'))
      const tempFiles = new URL('../src/client/tiers/temp-files.ts', import.meta.url).href
      const code = `import(${JSON.stringify(tempFiles)}).then((m) => {
        const name = m.beginTemp(${JSON.stringify(hexOf(13))})
        require('node:fs').writeFileSync(require('node:path').join(${JSON.stringify(dir)}, '00', name), 'partial')
        console.log(name)
        setInterval(() => {}, 1000)
      })`
      const child = spawn(
        'unshare',
        ['--pid', '--kill-child', process.execPath, '--import', 'tsx', '-e', code],
        { stdio: ['ignore', 'pipe', 'inherit'] },
      )
      try {
        const name = await new Promise<string>((resolve, reject) => {
          let out = ''
          child.stdout.on('data', (b: Buffer) => {
            out += b.toString()
            if (out.includes('\n')) resolve(out.trim())
          })
          child.on('exit', (c) => reject(new Error(`writer exited (${c})`)))
        })
        // Its pid (1 there) is this namespace's init here, started at another time.
        expect(name).toMatch(/^\.tmp-[0-9a-f]{64}-1-\d+-t0-h[0-9a-f]{8}-[0-9a-f]+$/)
        const d = await DiskTier.open({ dir, bytes: 1 << 20 })
        expect(existsSync(join(dir, '00', name))).toBe(true)
        expect(d.stats().recoveredDiscarded).toBe(0)
      } finally {
        const exited = new Promise((r) => child.once('exit', r))
        // SIGKILL: unshare does not pass a SIGTERM on; its child dies with it (--kill-child).
        child.kill('SIGKILL')
        await exited
        child.stdout.destroy()
      }
    },
  )

  it('a chunk file of a newer format version (a newer kvgate sharing the directory) is left alone, not deleted as corrupt', async () => {
    const dir = tempDir()
    mkdirSync(join(dir, '00'))
    const newer = object(hexOf(0x12))
    new DataView(newer.buffer, newer.byteOffset).setUint16(4, 3, true)
    const path = join(dir, '00', `${hexOf(0x12)}.kvc`)
    writeFileSync(path, newer)
    const d = await DiskTier.open({ dir, bytes: 1 << 20 })
    expect(d.stats()).toMatchObject({ files: 0, foreignFiles: 1, recoveredDiscarded: 0 })
    expect(existsSync(path)).toBe(true)
    // Written over an indexed file of ours under the key: dropped from the index at the read, kept.
    const mine = object(hexOf(0x13))
    expect(await d.put(hexOf(0x13), mine)).toBe(true)
    const newer2 = new Uint8Array(mine)
    new DataView(newer2.buffer).setUint16(4, 3, true)
    writeFileSync(d.pathOf(hexOf(0x13)), newer2)
    expect(await d.get(hexOf(0x13))).toBeUndefined()
    expect(d.counters.corrupt).toBe(0)
    expect(d.has(hexOf(0x13))).toBe(false)
    expect(existsSync(d.pathOf(hexOf(0x13)))).toBe(true)
    // A damaged version field of this build's range (0) is corrupt as before.
    const bad = object(hexOf(0x14))
    new DataView(bad.buffer, bad.byteOffset).setUint16(4, 0, true)
    writeFileSync(join(dir, '00', `${hexOf(0x14)}.kvc`), bad)
    const d2 = await DiskTier.open({ dir, bytes: 1 << 20 })
    expect(d2.stats()).toMatchObject({ recoveredDiscarded: 1 })
    expect(existsSync(join(dir, '00', `${hexOf(0x14)}.kvc`))).toBe(false)
  })

  it("another namespace's files are not indexed, counted against the budget, evicted or deleted", async () => {
    const dir = tempDir()
    const mine = object(hexOf(0x10))
    const theirs = object(hexOf(0x11), 7)
    mkdirSync(join(dir, '00'))
    writeFileSync(join(dir, '00', `${hexOf(0x11)}.kvc`), theirs)
    const d = await DiskTier.open({ dir, bytes: mine.byteLength + 10, owns: ours })
    expect(d.stats()).toMatchObject({ files: 0, usedBytes: 0, foreignFiles: 1 })
    expect(d.has(hexOf(0x11))).toBe(false)
    // The whole budget is ours: a write fits without evicting (or deleting) their file.
    expect(await d.put(hexOf(0x10), mine)).toBe(true)
    expect(d.stats()).toMatchObject({ files: 1, usedBytes: mine.byteLength })
    expect(existsSync(join(dir, '00', `${hexOf(0x11)}.kvc`))).toBe(true)
  })

  it("a file of ours replaced by another namespace's object (same key) is neither served nor deleted, and leaves the index", async () => {
    const api = loadNative().api!
    for (const native of [undefined, api]) {
      const dir = tempDir()
      const d = await DiskTier.open({ dir, bytes: 1 << 20, owns: ours, native })
      const hex = hexOf(0x50)
      await d.put(hex, object(hex))
      // Another process (another model, the same vLLM block hash) writes the key: temp + rename.
      const theirs = object(hex, 1)
      writeFileSync(`${d.pathOf(hex)}.other`, theirs)
      renameSync(`${d.pathOf(hex)}.other`, d.pathOf(hex))
      expect(await d.get(hex), native ? 'addon' : 'buffered').toBeUndefined()
      expect(existsSync(d.pathOf(hex))).toBe(true)
      expect(d.has(hex)).toBe(false)
      expect(d.counters.corrupt).toBe(0)
      expect(d.stats().usedBytes).toBe(0)
    }
  })

  it('an I/O error at start (EIO, EMFILE) is not corruption: the file stays', async () => {
    const dir = tempDir()
    const d0 = await DiskTier.open({ dir, bytes: 1 << 20 })
    await d0.put(hexOf(0x20), object(hexOf(0x20)))
    const path = d0.pathOf(hexOf(0x20))
    io.failOpen.set(path, 'EIO')
    const d = await DiskTier.open({ dir, bytes: 1 << 20 })
    expect(d.stats()).toMatchObject({ files: 0, recoveredDiscarded: 0, unreadableFiles: 1 })
    expect(existsSync(path)).toBe(true)
    io.failOpen.clear()
    const d2 = await DiskTier.open({ dir, bytes: 1 << 20 })
    expect(await d2.get(hexOf(0x20))).toBeDefined()
  })

  it('a read or verify error that is not a format error is a counted miss, and the file stays', async () => {
    const dir = tempDir()
    let failVerify = false
    const d = await DiskTier.open({
      dir,
      bytes: 1 << 20,
      verify: async (b) => {
        if (failVerify) throw new CodecError('codec pool closed')
        const { verifyChunk } = await import('../src/core/format.ts')
        return verifyChunk(b)
      },
    })
    await d.put(hexOf(0x30), object(hexOf(0x30)))
    const path = d.pathOf(hexOf(0x30))
    io.failOpen.set(path, 'EMFILE')
    expect(await d.get(hexOf(0x30))).toBeUndefined()
    io.failOpen.clear()
    failVerify = true
    expect(await d.get(hexOf(0x30))).toBeUndefined()
    expect(d.counters).toMatchObject({ errors: 2, corrupt: 0 })
    expect(existsSync(path)).toBe(true)
    failVerify = false
    expect(await d.get(hexOf(0x30))).toBeDefined()
  })

  it("a buffered read (direct: 'off') into pinned L1 memory keeps it busy: freePinned refuses until the read ends", async () => {
    // KVCache.close() frees L1 once its operations stopped waiting; an L2 read they left running
    // must not pread into the freed (or by then reused) memory.
    const api = loadNative().api!
    const slot = new Uint8Array((await api.allocPinned(1 << 20)).buffer)
    const freedWhileReading: boolean[] = []
    const tryFree = () => {
      try {
        api.freePinned(slot.buffer)
        freedWhileReading.push(true)
      } catch {
        freedWhileReading.push(false)
      }
    }
    const native = {
      ...api,
      readFileDirect: (...a: Parameters<typeof api.readFileDirect>) => {
        const r = api.readFileDirect(...a)
        tryFree()
        return r
      },
    }
    const d = await DiskTier.open({ dir: tempDir(), bytes: 1 << 20, native, direct: 'off' })
    const o = object(hexOf(0x40))
    await d.put(hexOf(0x40), o)
    io.onRead = tryFree
    const got = await d.get(hexOf(0x40), 'get', slot)
    io.onRead = undefined
    expect(freedWhileReading.length).toBeGreaterThan(0)
    expect(freedWhileReading.every((freed) => !freed)).toBe(true)
    expect(got && Buffer.compare(Buffer.from(got), Buffer.from(o))).toBe(0)
    expect(d.stats().directReads).toBe(0)
    api.freePinned(slot.buffer)
  })

  it('fsyncs the directory after each rename (and the parent of a new fan-out directory)', async () => {
    const dir = tempDir()
    const d = await DiskTier.open({ dir, bytes: 1 << 20 })
    await d.put(hexOf(0x40), object(hexOf(0x40)))
    const sub = join(dir, '00')
    expect(io.syncedDirs).toEqual([dir, sub])
    io.syncedDirs.length = 0
    await d.put(hexOf(0x41), object(hexOf(0x41)))
    expect(io.syncedDirs).toEqual([sub])
  })

  it('a write whose directory fsync fails is not acknowledged (put resolves false), and counted', async () => {
    const dir = tempDir()
    const d = await DiskTier.open({ dir, bytes: 1 << 20 })
    await d.put(hexOf(0x40), object(hexOf(0x40)))
    // The rename is not known durable: a crash may lose it, so the write must not be reported done.
    io.failOpen.set(join(dir, '00'), 'EIO')
    expect(await d.put(hexOf(0x41), object(hexOf(0x41)))).toBe(false)
    expect(d.stats().writeErrors).toBe(1)
    expect(d.stats().lastWriteError).toMatch(/EIO/)
    // The file is intact on disk: still served now (a restart after a crash may not find it).
    expect(await d.get(hexOf(0x41))).toBeDefined()
    io.failOpen.clear()
    expect(await d.put(hexOf(0x42), object(hexOf(0x42)))).toBe(true)
  })
})
