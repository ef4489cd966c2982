// copyRunsAsync of the native addon: scattered runs between several buffers, split across
// pool threads, land exactly as one in-order copy would put them; bad runs copy nothing;
// and the buffers it uses outlive the copy (an unmapFile or freePinned meanwhile waits or
// is refused, never a fault or a write into freed memory).

import { spawnSync } from 'node:child_process'
import { randomBytes } from 'node:crypto'
import {
  closeSync,
  constants,
  mkdtempSync,
  openSync,
  promises,
  rmSync,
  truncateSync,
  writeFileSync,
} from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, describe, expect, it } from 'vitest'
import {
  allocPinnedSync,
  copyRuns,
  copyRunsAsync,
  copyRunsAsyncAvailable,
  fileMapStats,
  freePinned,
  mapFile,
  NativeError,
  unmapFile,
} from '../src/client/native.ts'

const dir = mkdtempSync(join(tmpdir(), 'kvgate-copy-async-'))
afterAll(() => rmSync(dir, { recursive: true, force: true }))

const MiB = 1 << 20

/** What copyRunsAsync must produce: the runs applied in order, in JS. */
function reference(buffers: Uint8Array[], runs: Float64Array): void {
  for (let i = 0; i < runs.length; i += 5) {
    const [db, d, sb, s, n] = [runs[i]!, runs[i + 1]!, runs[i + 2]!, runs[i + 3]!, runs[i + 4]!]
    buffers[db]!.set(buffers[sb]!.subarray(s, s + n), d)
  }
}

function bytesOf(b: ArrayBuffer | Uint8Array): Uint8Array {
  return b instanceof Uint8Array ? b : new Uint8Array(b)
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

it('the loaded addon has copyRunsAsync (else this suite tests nothing)', () => {
  expect(copyRunsAsyncAvailable()).toBe(true)
})

describe('copyRunsAsync', () => {
  it('scattered runs between a mapping, pinned memory and a view land as an in-order copy would put them, for every split', async () => {
    const file = join(dir, 'engine')
    writeFileSync(file, randomBytes(4 * MiB + 123))
    const map = mapFile(file, { offset: 123, writable: true })
    const pinned = allocPinnedSync(2 * MiB).buffer
    const backing = new Uint8Array(3 * MiB)
    const view = backing.subarray(777, 777 + 2 * MiB) // a view with a byte offset
    try {
      // Distinct destination ranges (small, 4 KiB-multiple and odd sizes), from anywhere.
      const runs: number[] = []
      const used = new Set<string>()
      let x = 12345
      const rnd = (n: number) => {
        x = (x * 1103515245 + 12345) & 0x7fffffff
        return x % n
      }
      const sizes = [1, 63, 4096, 4097, 32 * 1024, 100_000, 300_000]
      for (let i = 0; i < 40; i++) {
        const n = sizes[i % sizes.length]!
        const db = 1 + rnd(2) // into the pinned buffer or the view
        const slot = rnd(Math.floor((2 * MiB) / 300_000))
        if (used.has(`${db}:${slot}`)) continue
        used.add(`${db}:${slot}`)
        runs.push(db, slot * 300_000, 0, rnd(4 * MiB - n), n)
      }
      const r = new Float64Array(runs)
      for (const parts of [1, 2, 3, 4, 8]) {
        const seed = randomBytes(2 * MiB)
        bytesOf(pinned).set(seed)
        view.set(seed)
        const want = [new Uint8Array(map).slice(), Uint8Array.from(seed), Uint8Array.from(seed)]
        reference(want, r)
        await copyRunsAsync([map, pinned, view], r, parts)
        expect(Buffer.from(bytesOf(pinned)).equals(want[1]!), `parts ${parts}`).toBe(true)
        expect(Buffer.from(view).equals(want[2]!), `parts ${parts}`).toBe(true)
        // Nothing outside the view moved.
        expect(backing.subarray(0, 777).every((b) => b === 0)).toBe(true)
        expect(backing.subarray(777 + 2 * MiB).every((b) => b === 0)).toBe(true)
      }
    } finally {
      unmapFile(map)
      freePinned(pinned)
    }
  })

  it('parts queued behind busy pool threads: every byte lands, and the parts that run after their copy settled (no grain left) touch nothing', async () => {
    const pool = Number(process.env.UV_THREADPOOL_SIZE ?? 4)
    expect(pool).toBeLessThanOrEqual(16) // else blocking all but one costs too many FIFOs
    // All but one pool thread blocked in open() of a FIFO without a writer (no CPU spent).
    const fifos = Array.from({ length: pool - 1 }, (_, i) => join(dir, `fifo-${i}`))
    for (const f of fifos) expect(spawnSync('mkfifo', [f]).status).toBe(0)
    const blocked = fifos.map((f) => promises.open(f, 'r'))
    const src = randomBytes(8 * MiB)
    const dst = new Uint8Array(8 * MiB)
    try {
      await new Promise((r) => setTimeout(r, 100)) // the opens hold their threads
      // As many parts as the pool has threads: one of them can run now.
      const copy = copyRunsAsync([dst, src], new Float64Array([0, 0, 1, 0, 8 * MiB]), pool)
      let settled = false
      void copy.then(() => {
        settled = true
      })
      for (let i = 0; i < 100 && !settled; i++) await new Promise((r) => setTimeout(r, 20))
      // The one free thread takes every grain (the others' parts, when they run, find none).
      expect(settled).toBe(true)
      await copy
      expect(Buffer.from(dst).equals(src)).toBe(true)
      // A second copy through the same buffers while parts of the first may still be queued.
      const again = randomBytes(8 * MiB)
      await copyRunsAsync([dst, again], new Float64Array([0, 0, 1, 0, 8 * MiB]), pool)
      expect(Buffer.from(dst).equals(again)).toBe(true)
    } finally {
      // A writer for each FIFO lets its open return; the parts still queued then find nothing left.
      for (const f of fifos) closeSync(openSync(f, constants.O_WRONLY | constants.O_NONBLOCK))
      for (const h of await Promise.all(blocked)) await h.close()
    }
  })

  it('refuses bad runs and arguments before any byte moves', async () => {
    const a = new Uint8Array(8192)
    const b = new Uint8Array(8192).fill(9)
    const bad: [number[], RegExp][] = [
      [[0, 8000, 1, 0, 200], /outside/], // past the destination
      [[0, 0, 1, 8100, 100], /outside/], // past the source
      [[2, 0, 1, 0, 10], /names no buffer/], // no such buffer
      [[0, 0.5, 1, 0, 10], /outside/], // not an integer
      [[0, Number.NaN, 1, 0, 10], /outside/],
      [[0, -1, 1, 0, 10], /outside/],
      [[0, 0, 0, 10, 20], /overlaps itself/],
    ]
    for (const [run, match] of bad) {
      // A good run first: it must not have been copied either.
      expectNative(() => copyRunsAsync([a, b], new Float64Array([0, 0, 1, 0, 4096, ...run]), 2), match)
      expect(a.every((x) => x === 0)).toBe(true)
    }
    expectNative(() => copyRunsAsync([a, b], new Float64Array([0, 0, 1, 0]), 1), /quintuples/)
    expectNative(() => copyRunsAsync([], new Float64Array(0), 1), /1 to 65536/)
    expectNative(() => copyRunsAsync([a, 7 as unknown as Uint8Array], new Float64Array(0), 1), /buffers\[1\]/)
    expectNative(() => copyRunsAsync([a, b], [0, 0, 1, 0, 1] as unknown as Float64Array, 1), /Float64Array/)
    for (const parts of [0, 65, 1.5]) {
      expectNative(() => copyRunsAsync([a, b], new Float64Array(0), parts), /parts/)
    }
    // Nothing to copy resolves at once.
    await copyRunsAsync([a, b], new Float64Array([0, 0, 1, 0, 0]), 4)
    expect(a.every((x) => x === 0)).toBe(true)
  })

  it('unmapFile during a copy defers the munmap to the copy’s end: the copy completes intact', async () => {
    const file = join(dir, 'unmapped-during')
    const data = randomBytes(64 * MiB)
    writeFileSync(file, data)
    const before = fileMapStats()
    const map = mapFile(file, { writable: true })
    const dst = new Uint8Array(64 * MiB)
    // Many runs so the copy is still going when unmapFile runs on this thread.
    const runs = new Float64Array(1024 * 5)
    for (let i = 0; i < 1024; i++) runs.set([0, i * 65536, 1, (1023 - i) * 65536, 65536], i * 5)
    const copying = copyRunsAsync([dst, map], runs, 2)
    unmapFile(map)
    expect(map.byteLength).toBe(0) // detached at once for JS
    await copying
    for (let i = 0; i < 1024; i += 97) {
      const at = (1023 - i) * 65536
      expect(
        Buffer.from(dst.subarray(i * 65536, (i + 1) * 65536)).equals(data.subarray(at, at + 65536)),
      ).toBe(true)
    }
    expect(fileMapStats()).toEqual(before) // unmapped once the copy ended
  })

  it('freePinned is refused while a copy uses the buffer, and works after', async () => {
    const pinned = allocPinnedSync(32 * MiB).buffer
    const src = new Uint8Array(32 * MiB).fill(3)
    const runs = new Float64Array(512 * 5)
    for (let i = 0; i < 512; i++) runs.set([0, i * 65536, 1, i * 65536, 65536], i * 5)
    const copying = copyRunsAsync([pinned, src], runs, 2)
    expectNative(() => freePinned(pinned), /in use/)
    await copying
    expect(bytesOf(pinned).every((b) => b === 3)).toBe(true)
    freePinned(pinned)
  })

  it('a file truncated under its mapping fails the copy with a typed error; the process lives and copies go on', async () => {
    for (const writable of [false, true]) {
      const file = join(dir, `shrinks-${writable}`)
      writeFileSync(file, randomBytes(8 * MiB))
      const map = mapFile(file, { writable })
      const into = new Uint8Array(4 * MiB)
      const ok = new Uint8Array(64 * 1024).fill(9)
      // The engine shrinks its file: every page past 4 KiB is gone from the mapping.
      truncateSync(file, 4096)
      const runs = new Float64Array([1, 0, 0, 2 * MiB, 2 * MiB, 1, 2 * MiB, 2, 0, ok.length])
      await expect(copyRunsAsync([map, into, ok], runs, 4)).rejects.toMatchObject({
        code: 'ERR_NATIVE',
        syscode: 'EFAULT',
        message: expect.stringMatching(/shrank during the copy/),
      })
      const out = new Uint8Array(4096)
      expect(() => copyRuns(out, map, new Float64Array([0, 5 * MiB, 4096]))).toThrow(/shrank during the copy/)
      // Writing into the lost pages faults too (a load into a shrunk engine tensor).
      await expect(
        copyRunsAsync([map, ok], new Float64Array([0, 6 * MiB, 1, 0, ok.length]), 1),
      ).rejects.toThrow(NativeError)
      // What is still mapped copies as before, and the mapping unmaps.
      copyRuns(out, map, new Float64Array([0, 0, 4096]))
      await copyRunsAsync([into, ok], new Float64Array([0, 0, 1, 0, ok.length]), 2)
      expect(into.subarray(0, ok.length).every((b) => b === 9)).toBe(true)
      unmapFile(map)
    }
    expect(fileMapStats().mappings).toBe(0)
  })

  it('a SIGBUS sent to the process (kill -BUS) still kills it once the guard is installed', () => {
    const file = join(dir, 'sent-bus')
    writeFileSync(file, randomBytes(64 * 1024))
    const script = [
      `import { copyRunsAsync, mapFile } from ${JSON.stringify(new URL('../src/client/native.ts', import.meta.url).pathname)}`,
      `const map = mapFile(${JSON.stringify(file)})`,
      'await copyRunsAsync([new Uint8Array(8), map], new Float64Array([0, 0, 1, 0, 8]), 1)', // installs the guard
      "process.kill(process.pid, 'SIGBUS')",
      "setTimeout(() => console.log('survived'), 200)",
    ]
    expectKilledBySigbus(script)
  })

  it('a SIGBUS outside a guarded copy still kills the process, as it did before the guard was installed', () => {
    const file = join(dir, 'shrinks-outside')
    writeFileSync(file, randomBytes(2 * MiB))
    const script = [
      `import { copyRunsAsync, mapFile } from ${JSON.stringify(new URL('../src/client/native.ts', import.meta.url).pathname)}`,
      `import { truncateSync } from 'node:fs'`,
      `const map = mapFile(${JSON.stringify(file)})`,
      'const out = new Uint8Array(8)',
      'await copyRunsAsync([out, map], new Float64Array([0, 0, 1, 0, 8]), 1)', // installs the guard
      `truncateSync(${JSON.stringify(file)}, 0)`,
      'console.log(new Uint8Array(map)[MiB_SPOT])'.replace('MiB_SPOT', String(MiB)),
      "console.log('survived')",
    ]
    expectKilledBySigbus(script)
  })
})

/** Runs `lines` as an ES module in a child process, which must die of SIGBUS before it prints 'survived'. */
function expectKilledBySigbus(lines: string[]): void {
  const r = spawnSync(process.execPath, ['--import', 'tsx', '--input-type=module', '-e', lines.join('\n')], {
    encoding: 'utf8',
    timeout: 60_000,
  })
  expect(r.stdout).not.toContain('survived')
  expect(r.signal).toBe('SIGBUS')
}
