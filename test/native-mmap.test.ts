// mapFile/unmapFile of the native addon: bytes round-trip through the file both ways,
// bad arguments and out-of-file ranges are typed errors, unmapped buffers refuse reuse,
// and mappings dropped by unmapFile or the GC leave RSS, mappings and fds where they started.

import { closeSync, mkdtempSync, openSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { setFlagsFromString } from 'node:v8'
import { runInNewContext } from 'node:vm'
import { afterAll, describe, expect, it } from 'vitest'
import {
  fileMapStats,
  mapFile,
  mapFileAvailable,
  NativeError,
  readFileDirect,
  unmapFile,
} from '../src/client/native.ts'

setFlagsFromString('--expose-gc')
const gc = runInNewContext('gc') as () => void
const MiB = 1 << 20
const dir = mkdtempSync(join(tmpdir(), 'kvgate-mmap-'))
afterAll(() => rmSync(dir, { recursive: true, force: true }))
const openFds = () => readdirSync('/proc/self/fd').length

function file(name: string, bytes: Uint8Array): string {
  const p = join(dir, name)
  writeFileSync(p, bytes)
  return p
}

function pattern(n: number, seed = 1): Uint8Array {
  const b = new Uint8Array(n)
  for (let i = 0; i < n; i++) b[i] = (i * 31 + seed) & 0xff
  return b
}

function nativeError(f: () => unknown, match: RegExp): NativeError {
  try {
    f()
  } catch (e) {
    expect(e).toBeInstanceOf(NativeError)
    expect((e as NativeError).code).toBe('ERR_NATIVE')
    expect((e as Error).message).toMatch(match)
    return e as NativeError
  }
  throw new Error('expected a NativeError')
}

async function collect(until: () => boolean): Promise<boolean> {
  for (let i = 0; i < 50; i++) {
    gc()
    await new Promise((r) => setImmediate(r))
    if (until()) return true
  }
  return until()
}

it('the loaded addon has mapFile (else this suite tests nothing)', () => {
  expect(mapFileAvailable()).toBe(true)
})

describe('round trip', () => {
  it('a writable mapping reads the file and its stores reach the file (unaligned offset)', () => {
    const data = pattern(3 * 4096 + 100)
    const p = file('rw', data)
    const ab = mapFile(p, { offset: 4096 + 7, length: 5000, writable: true })
    expect(ab.byteLength).toBe(5000)
    const v = new Uint8Array(ab)
    expect(Buffer.from(v).equals(Buffer.from(data.subarray(4103, 9103)))).toBe(true)
    v.fill(0xab, 10, 20)
    const back = readFileSync(p)
    expect(back.subarray(4113, 4123).every((x) => x === 0xab)).toBe(true)
    expect(back[4112]).toBe(data[4112])
    expect(back[4123]).toBe(data[4123])
    // Another process's (here: a write through the fd) change is seen through the mapping.
    const fd = openSync(p, 'r+')
    try {
      writeFileSync(fd, new Uint8Array([1, 2, 3]))
    } finally {
      closeSync(fd)
    }
    const again = mapFile(p, { length: 3 })
    expect([...new Uint8Array(again)]).toEqual([1, 2, 3])
    unmapFile(again)
    unmapFile(ab)
  })

  it('a read-only mapping is private: stores never reach the file', () => {
    const data = pattern(8192, 5)
    const p = file('ro', data)
    const ab = mapFile(p)
    expect(ab.byteLength).toBe(8192)
    new Uint8Array(ab).fill(0)
    expect(Buffer.from(readFileSync(p)).equals(Buffer.from(data))).toBe(true)
    unmapFile(ab)
  })
})

describe('bad arguments', () => {
  const p = file('bounds', pattern(10_000))

  it('ranges past the end of the file are refused', () => {
    nativeError(() => mapFile(p, { offset: 10_000 }), /offset 10000 is not inside/)
    nativeError(() => mapFile(p, { offset: 9_000, length: 1_001 }), /length must be in \[1, 1000\]/)
    nativeError(() => mapFile(p, { length: 0 }), /length must be in/)
    expect(mapFile(p, { offset: 9_000, length: 1_000 }).byteLength).toBe(1000)
  })

  it('bad shapes, unknown options, missing files and non-files are typed errors', () => {
    nativeError(() => mapFile('', {}), /path must be a non-empty string/)
    nativeError(() => mapFile(7 as unknown as string), /path must be/)
    nativeError(() => mapFile(p, { offset: -1 }), /offset must be in/)
    nativeError(() => mapFile(p, { offset: 1.5 }), /offset must be an integer/)
    nativeError(() => mapFile(p, { writable: 'yes' as unknown as boolean }), /writable must be a boolean/)
    nativeError(() => mapFile(p, { size: 3 } as never), /unknown mapFile option 'size'/)
    nativeError(() => mapFile(p, null as never), /options must be an object/)
    const missing = nativeError(() => mapFile(join(dir, 'nope')), /ENOENT/)
    expect(missing.syscode).toBe('ENOENT')
    nativeError(() => mapFile(dir), /not a regular file/)
    nativeError(() => unmapFile(new ArrayBuffer(8)), /not a file mapping/)
    nativeError(() => unmapFile('x' as unknown as ArrayBuffer), /expects the ArrayBuffer/)
  })
})

describe('lifetime', () => {
  it('unmapFile detaches; using the buffer again is a typed error', async () => {
    const p = file('unmap', pattern(4096))
    const start = fileMapStats()
    const ab = mapFile(p, { writable: true })
    expect(fileMapStats().mappings).toBe(start.mappings + 1)
    unmapFile(ab)
    expect(fileMapStats()).toEqual(start)
    expect(ab.byteLength).toBe(0)
    nativeError(() => unmapFile(ab), /already unmapped/)
    await expect(readFileDirect(p, ab)).rejects.toMatchObject({
      code: 'ERR_NATIVE',
      message: expect.stringMatching(/unmapped with unmapFile/),
    })
  })

  it('unreferenced mappings are unmapped by their finalizer', async () => {
    const p = file('gc', pattern(MiB))
    // Earlier tests' dropped mappings go first, so the count below is this test's alone.
    expect(await collect(() => fileMapStats().mappings === 0)).toBe(true)
    const start = 0
    ;(() => {
      for (let i = 0; i < 20; i++) new Uint8Array(mapFile(p))[i] = 1
    })()
    expect(fileMapStats().mappings).toBe(start + 20)
    expect(await collect(() => fileMapStats().mappings === start)).toBe(true)
    expect(fileMapStats().mappedBytes).toBe(0)
  })

  it('many map/unmap cycles keep RSS, mappings and fds bounded', () => {
    const p = file('cycles', new Uint8Array(16 * MiB))
    const start = fileMapStats()
    const fds = openFds()
    const warm = mapFile(p, { writable: true })
    new Uint8Array(warm).fill(1)
    unmapFile(warm)
    const rss0 = process.memoryUsage().rss
    for (let i = 0; i < 200; i++) {
      const ab = mapFile(p, { writable: i % 2 === 0 })
      const v = new Uint8Array(ab)
      for (let j = 0; j < v.length; j += 4096) v[j] = i // touch every page (private ones copy)
      unmapFile(ab)
    }
    expect(fileMapStats()).toEqual(start)
    expect(openFds()).toBe(fds)
    expect(process.memoryUsage().rss - rss0).toBeLessThan(64 * MiB) // 200 × 16 MiB went through
  })
})
