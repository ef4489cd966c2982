// The native addon without CUDA: loader errors, pinned memory, misuse, and
// O_DIRECT file I/O with its buffered fallback. CUDA is pinned to a missing
// library here; the stub-driven CUDA path is in native-stub.test.ts.

import { spawnSync } from 'node:child_process'
import { existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, describe, expect, it } from 'vitest'
import { pattern, same } from './support/bytes.ts'
import { rejectsWith } from './support/native-errors.ts'

// Before anything probes CUDA (the choice is per process).
process.env.KVGATE_CUDART = '/nonexistent/kvgate-test/libcudart.so'
delete process.env.KVGATE_NATIVE_PATH

const native = await import('../src/client/native.ts')
const {
  allocPinned,
  allocPinnedSync,
  cuda,
  freePinned,
  nativeMemoryStats,
  pinnedInfo,
  readFileCrc,
  readFileDirect,
  writeFileDirect,
} = native
const { crc32 } = await import('../src/core/checksum.ts')
const { randomBytes } = await import('node:crypto')

const dir = mkdtempSync(join(tmpdir(), 'kvgate-native-'))
afterAll(() => rmSync(dir, { recursive: true, force: true }))

// toEqual walks typed arrays element by element (seconds per MiB): compare bytes.

describe('loader', () => {
  it('loads the built addon (run scripts/build-native.sh if this fails)', () => {
    // Fails with the loader's own message, which names the build command.
    expect(native.loadNative().abiVersion).toBe(native.NATIVE_ABI_VERSION)
  })

  it('throws one actionable ERR_NATIVE error naming every path tried and the build command', () => {
    const bogus = join(dir, 'not-an-addon.node')
    writeFileSync(bogus, 'definitely not ELF')
    const script = `import('./src/client/native.ts').then((m) => { try { m.loadNative(); console.log('LOADED') } catch (e) { console.log(JSON.stringify({ code: e.code, message: e.message, again: (() => { try { m.loadNative() } catch (e2) { return e2 === e } })() })) } })`
    const r = spawnSync(process.execPath, ['--import', 'tsx', '-e', script], {
      cwd: join(import.meta.dirname, '..'),
      env: { ...process.env, KVGATE_NATIVE_PATH: bogus },
      encoding: 'utf8',
    })
    const out = JSON.parse(r.stdout.trim().split('\n').pop()!)
    expect(out.code).toBe('ERR_NATIVE')
    expect(out.message).toContain(bogus)
    expect(out.message).toMatch(/ELF|invalid|too short/)
    expect(out.message).toContain('build-native.sh')
    expect(out.again).toBe(true)
  })

  it('lists only the override when KVGATE_NATIVE_PATH is set', () => {
    process.env.KVGATE_NATIVE_PATH = '/x/y.node'
    try {
      expect(native.nativeCandidates()).toEqual(['/x/y.node'])
    } finally {
      delete process.env.KVGATE_NATIVE_PATH
    }
    expect(native.nativeCandidates()[0]).toBe(native.nativePaths.addon)
  })
})

describe('CUDA unavailable', () => {
  it('reports available=false with the dlopen reason', () => {
    const s = cuda.status()
    expect(s.available).toBe(false)
    expect(cuda.available).toBe(false)
    expect(s.reason).toContain('/nonexistent/kvgate-test/libcudart.so')
    expect(s.library).toBe('')
  })

  it('every GPU call is an ERR_CUDA error carrying the reason, not a crash', async () => {
    await rejectsWith(() => cuda.deviceAlloc(1024), 'ERR_CUDA', /not available.*nonexistent/)
    await rejectsWith(() => cuda.setDevice(0), 'ERR_CUDA')
    await rejectsWith(() => cuda.createStream(), 'ERR_CUDA')
    await rejectsWith(cuda.copyToDevice(new Uint8Array(8), 4096n), 'ERR_CUDA')
    await rejectsWith(cuda.ipcOpen(new Uint8Array(64)), 'ERR_CUDA')
    await rejectsWith(native.registerHost(new Uint8Array(4096)), 'ERR_CUDA')
    await rejectsWith(() => cuda.stubControl(''), 'ERR_NATIVE', /not kvgate's test stub/)
  })

  // Each probe is per process: these run the addon in child processes.
  const probe = (env: Record<string, string>) => {
    const r = spawnSync(
      process.execPath,
      [
        '-e',
        `console.log(JSON.stringify(require(${JSON.stringify(native.nativePaths.addon)}).cuda.probe()))`,
      ],
      { env: { ...process.env, ...env }, encoding: 'utf8' },
    )
    expect(r.status, r.stderr).toBe(0)
    return JSON.parse(r.stdout) as { available: boolean; reason: string; deviceCount: number }
  }

  it('a libcudart whose cudaGetDeviceCount answers 35 (no driver) is unavailable with that reason', () => {
    const s = probe({
      KVGATE_CUDART: native.nativePaths.stubCudart,
      KVGATE_STUB_FAIL: 'cudaGetDeviceCount=35',
    })
    expect(s.available).toBe(false)
    expect(s.reason).toMatch(/insufficient.*cudaErrorInsufficientDriver = 35/)
  })

  it('zero devices is unavailable with the runtime reason', () => {
    const s = probe({ KVGATE_CUDART: native.nativePaths.stubCudart, KVGATE_STUB_DEVICES: '0' })
    expect(s.available).toBe(false)
    expect(s.reason).toMatch(/no CUDA-capable device/)
  })

  it('the system libcudart (if any) without a GPU reports why instead of failing', () => {
    if (existsSync('/dev/nvidiactl')) return // a GPU machine: covered by test/gpu
    const s = probe({ KVGATE_CUDART: '' })
    expect(s.available).toBe(false)
    expect(s.reason.length).toBeGreaterThan(10)
  })
})

describe('pinned memory', () => {
  it('allocates zeroed, writable memory and says which kind and why', async () => {
    const a = await allocPinned(1 << 20)
    expect(a.buffer.byteLength).toBe(1 << 20)
    expect(['mlock', 'none']).toContain(a.kind)
    expect(a.reason).toMatch(/CUDA unavailable/)
    if (a.kind === 'none') expect(a.reason).toMatch(/mlock failed/)
    const u = new Uint8Array(a.buffer)
    expect(u.every((v) => v === 0)).toBe(true)
    u.set(pattern(u.length))
    expect(same(u, pattern(u.length))).toBe(true)
    expect(pinnedInfo(a.buffer)).toMatchObject({ kind: a.kind, bytes: 1 << 20, busy: 0 })
    freePinned(a.buffer)
  })

  it('reports locking not requested, and huge pages on large allocations', () => {
    const a = allocPinnedSync(4 << 20, { lock: false })
    expect(a.kind).toBe('none')
    expect(a.reason).toMatch(/locking not requested/)
    const thp = '/sys/kernel/mm/transparent_hugepage/enabled'
    if (existsSync(thp) && !readFileSync(thp, 'utf8').includes('[never]')) expect(a.hugePages).toBe(true)
    freePinned(a.buffer)
    const small = allocPinnedSync(4096, { hugePages: true })
    expect(small.hugePages).toBe(false)
    freePinned(small.buffer)
  })

  it('free detaches the buffer; further use is a typed error', async () => {
    const before = nativeMemoryStats()
    const a = allocPinnedSync(64 << 10)
    const view = new Uint8Array(a.buffer, 100, 10)
    expect(nativeMemoryStats().pinnedBlocks).toBe(before.pinnedBlocks + 1)
    freePinned(a.buffer)
    expect(nativeMemoryStats()).toEqual(before)
    expect(a.buffer.byteLength).toBe(0)
    expect(view.length).toBe(0)
    expect(view[0]).toBeUndefined()
    expect(pinnedInfo(a.buffer)).toBeNull()
    await rejectsWith(() => freePinned(a.buffer), 'ERR_NATIVE', /already freed/)
    await rejectsWith(readFileDirect(join(dir, 'x'), a.buffer), 'ERR_NATIVE', /freed/)
    await rejectsWith(writeFileDirect(join(dir, 'x'), view), 'ERR_NATIVE', /freed/)
    await rejectsWith(cuda.copyToDevice(view, 4096n), 'ERR_NATIVE', /freed/)
  })

  it('rejects bad sizes and non-pinned buffers', async () => {
    for (const bad of [0, -1, 1.5, Number.NaN, 2 ** 32 + 1, 2 ** 60, '1' as unknown as number]) {
      await rejectsWith(allocPinned(bad), 'ERR_NATIVE')
      await rejectsWith(() => allocPinnedSync(bad), 'ERR_NATIVE')
    }
    await rejectsWith(() => freePinned(new ArrayBuffer(16)), 'ERR_NATIVE', /not a pinned allocation/)
    await rejectsWith(() => freePinned(new Uint8Array(16) as unknown as ArrayBuffer), 'ERR_NATIVE')
    await rejectsWith(allocPinned(16, null as unknown as object), 'ERR_NATIVE')
    expect(pinnedInfo(new ArrayBuffer(8))).toBeNull()
  })

  it('the raw binding refuses bad sizes too (C++ does not trust a bypassed wrapper)', () => {
    const raw = native.loadNative()
    const o = { cuda: true, lock: true, hugePages: true }
    expect(() => raw.allocPinnedSync(-5, o)).toThrow(/non-negative safe integer/)
    expect(() => raw.allocPinnedSync(0, o)).toThrow(/at least 1/)
    expect(() => raw.allocPinnedSync(2 ** 62, o)).toThrow(/safe integer/)
    expect(() => raw.allocPinnedSync(2 ** 40, o)).toThrow(/exceeds 4294967296/)
    // One byte over Node's external-buffer limit once crashed (a double free).
    expect(() => raw.allocPinnedSync(2 ** 32 + 4096, { ...o, lock: false })).toThrow(/exceeds/)
    expect(nativeMemoryStats().pinnedBlocks).toBe(0)
  })
})

describe('file I/O (O_DIRECT with fallback)', () => {
  it('round-trips aligned and unaligned lengths through O_DIRECT on a real filesystem', async () => {
    for (const n of [64 << 10, (64 << 10) + 123, 100]) {
      const src = allocPinnedSync(n + 4096)
      const data = pattern(n, n)
      new Uint8Array(src.buffer).set(data)
      const path = join(dir, `rt-${n}`)
      const w = await writeFileDirect(path, new Uint8Array(src.buffer, 0, n), { fsync: true })
      expect(w.bytes).toBe(n)
      // tmpfs on old kernels rejects O_DIRECT; then the reason says so.
      if (!w.direct) expect(w.reason).toMatch(/EINVAL/)
      expect(same(readFileSync(path), data)).toBe(true)

      const dst = allocPinnedSync(n + 4096)
      const r = await readFileDirect(path, dst.buffer)
      expect(r.bytes).toBe(n)
      expect(r.direct).toBe(w.direct)
      expect(same(new Uint8Array(dst.buffer, 0, n), data)).toBe(true)
      expect(new Uint8Array(dst.buffer, n, 16).every((v) => v === 0)).toBe(true)
      freePinned(src.buffer)
      freePinned(dst.buffer)
    }
  })

  it('reads a range at an aligned offset, short at EOF, empty past it', async () => {
    const data = pattern(3 * 4096 + 500, 7)
    const path = join(dir, 'range')
    writeFileSync(path, data)
    const b = allocPinnedSync(16384)
    const r = await readFileDirect(path, b.buffer, { fileOffset: 4096, length: 5000, direct: 'require' })
    expect(r).toMatchObject({ bytes: 5000, direct: true })
    expect(same(new Uint8Array(b.buffer, 0, 5000), data.subarray(4096, 9096))).toBe(true)
    const tail = await readFileDirect(path, b.buffer, { fileOffset: 8192, length: 8192 })
    expect(tail.bytes).toBe(data.length - 8192)
    expect(same(new Uint8Array(b.buffer, 0, tail.bytes), data.subarray(8192))).toBe(true)
    expect((await readFileDirect(path, b.buffer, { fileOffset: 1 << 20 })).bytes).toBe(0)
    freePinned(b.buffer)
  })

  it('writes at an offset without truncating', async () => {
    const path = join(dir, 'offset')
    writeFileSync(path, new Uint8Array(16384).fill(1))
    const b = allocPinnedSync(4096)
    new Uint8Array(b.buffer).fill(9)
    const w = await writeFileDirect(path, b.buffer, { fileOffset: 8192 })
    expect(w.bytes).toBe(4096)
    const back = readFileSync(path)
    expect(back.length).toBe(16384)
    expect(back[8191]).toBe(1)
    expect(back[8192]).toBe(9)
    expect(back[12287]).toBe(9)
    expect(back[12288]).toBe(1)
    freePinned(b.buffer)
  })

  it('misaligned requests: auto falls back to buffered and says why; require is an error', async () => {
    const data = pattern(10000, 3)
    const path = join(dir, 'mis')
    writeFileSync(path, data)
    const b = allocPinnedSync(20000)
    const shifted = new Uint8Array(b.buffer, 1, 12000)
    const r = await readFileDirect(path, shifted)
    expect(r).toMatchObject({ bytes: 10000, direct: false })
    expect(r.reason).toMatch(/misaligned.*address % 4096 = 1/)
    expect(same(shifted.subarray(0, 10000), data)).toBe(true)
    await rejectsWith(readFileDirect(path, shifted, { direct: 'require' }), 'ERR_NATIVE', /misaligned/)
    await rejectsWith(
      writeFileDirect(join(dir, 'mis2'), shifted, { direct: 'require' }),
      'ERR_NATIVE',
      /misaligned/,
    )
    await rejectsWith(
      readFileDirect(path, b.buffer, { fileOffset: 100, direct: 'require' }),
      'ERR_NATIVE',
      /misaligned.*file offset/,
    )
    const off = await readFileDirect(path, b.buffer, { direct: 'off' })
    expect(off).toMatchObject({ bytes: 10000, direct: false, reason: 'buffered I/O requested' })
    freePinned(b.buffer)
  })

  it('a file that rejects O_DIRECT (EINVAL) falls back to buffered, or fails under require', async () => {
    const b = allocPinnedSync(8192)
    new Uint8Array(b.buffer).fill(0xaa)
    const r = await readFileDirect('/dev/zero', b.buffer, { length: 8192 })
    expect(r).toMatchObject({ bytes: 8192, direct: false })
    expect(r.reason).toMatch(/rejected O_DIRECT \(EINVAL\)/)
    expect(new Uint8Array(b.buffer).every((v) => v === 0)).toBe(true)
    const e = await rejectsWith(
      readFileDirect('/dev/zero', b.buffer, { length: 4096, direct: 'require' }),
      'ERR_NATIVE',
    )
    expect(e.syscode).toBe('EINVAL')
    const w = await writeFileDirect('/dev/null', b.buffer)
    expect(w).toMatchObject({ bytes: 8192, direct: false })
    await rejectsWith(readFileDirect('/dev/zero', b.buffer), 'ERR_NATIVE', /not a regular file/)
    freePinned(b.buffer)
  })

  it('bad requests are typed errors', async () => {
    const b = allocPinnedSync(4096)
    const big = join(dir, 'big')
    writeFileSync(big, new Uint8Array(10000))
    await rejectsWith(readFileDirect(big, b.buffer), 'ERR_NATIVE', /do not fit/)
    await rejectsWith(readFileDirect(big, b.buffer, { length: 4097 }), 'ERR_NATIVE')
    const e = await rejectsWith(readFileDirect(join(dir, 'missing'), b.buffer), 'ERR_NATIVE', /ENOENT/)
    expect(e.syscode).toBe('ENOENT')
    await rejectsWith(readFileDirect(dir, b.buffer, { direct: 'off' }), 'ERR_NATIVE', /EISDIR|regular/)
    await rejectsWith(writeFileDirect(join(dir, 'no/such/dir/f'), b.buffer), 'ERR_NATIVE', /ENOENT/)
    await rejectsWith(readFileDirect('a\0b', b.buffer), 'ERR_NATIVE', /NUL/)
    await rejectsWith(readFileDirect('', b.buffer), 'ERR_NATIVE')
    await rejectsWith(readFileDirect(big, b.buffer, { direct: 'sometimes' as 'auto' }), 'ERR_NATIVE')
    await rejectsWith(readFileDirect(big, b.buffer, { fileOffset: -1 }), 'ERR_NATIVE')
    await rejectsWith(readFileDirect(big, 'buffer' as unknown as ArrayBuffer), 'ERR_NATIVE')
    await rejectsWith(readFileDirect(big, new Uint8Array(new SharedArrayBuffer(8))), 'ERR_NATIVE', /Shared/)
    freePinned(b.buffer)
  })

  it('evicts a file from the page cache (and reports a missing file)', async () => {
    const path = join(dir, 'evict')
    writeFileSync(path, pattern(1 << 20, 5))
    await native.evictFileCache(path)
    const b = allocPinnedSync(1 << 20)
    expect((await readFileDirect(path, b.buffer, { direct: 'off' })).bytes).toBe(1 << 20)
    expect(same(new Uint8Array(b.buffer), pattern(1 << 20, 5))).toBe(true)
    freePinned(b.buffer)
    const e = await rejectsWith(native.evictFileCache(join(dir, 'nope')), 'ERR_NATIVE')
    expect(e.syscode).toBe('ENOENT')
  })

  it('works on plain JS buffers too (buffered when unaligned)', async () => {
    const path = join(dir, 'plain')
    const data = pattern(5000, 11)
    const w = await writeFileDirect(path, Buffer.from(data))
    expect(w.bytes).toBe(5000)
    const into = Buffer.alloc(6000)
    const r = await readFileDirect(path, into)
    expect(r.bytes).toBe(5000)
    expect(same(into.subarray(0, 5000), data)).toBe(true)
  })
})

describe('readFileCrc: CRC-32 of ranges on the worker that read them', () => {
  it('equals core/checksum crc32 for random bytes: whole, unaligned, empty and tail ranges, direct and buffered', async () => {
    for (const n of [100, 4096, 64 << 10, (1 << 20) + 4097, (3 << 20) + 123]) {
      const data = randomBytes(n)
      const path = join(dir, `crc-${n}`)
      writeFileSync(path, data)
      const ranges: [number, number][] = [
        [0, n],
        [0, 0],
        [n, n],
        [1, Math.min(n, 64)],
        [3, n - 5],
        [Math.max(0, n - 63), n], // shorter than one SIMD block
        [Math.floor(n / 3), Math.floor(n / 3) + 17],
        [Math.floor(n / 2) + 1, n],
      ]
      for (const direct of ['auto', 'off'] as const) {
        const b = allocPinnedSync(n + 4096)
        const r = await readFileCrc(path, b.buffer, ranges, { direct })
        expect(r.bytes).toBe(n)
        expect(same(new Uint8Array(b.buffer, 0, n), data)).toBe(true)
        expect([...r.crcs]).toEqual(ranges.map(([a, z]) => crc32(data.subarray(a, z))))
        freePinned(b.buffer)
      }
    }
  })

  it('a direct read of many 2 MiB pieces (a few in flight, verified as they land): CRCs and copies as a whole read; a flip is not copied; a read past the end is cut', async () => {
    const MiB = 1 << 20
    const n = 11 * MiB + 4096 + 300 // more pieces than are in flight at once, an unaligned tail
    const data = randomBytes(n)
    const path = join(dir, 'crc-pieces')
    writeFileSync(path, data)
    // In order, as DiskTier asks: 1 MiB sections from an unaligned start, so most cross a piece's end.
    const ranges: [number, number][] = []
    for (let a = 700; a < n; a += MiB) ranges.push([a, Math.min(n, a + MiB)])
    const flipped = 5 // a range in the middle whose expected CRC is wrong (as a flipped byte would make it)
    const crcOf = ([a, z]: [number, number]) => crc32(data.subarray(a, z))
    const b = allocPinnedSync(n + 4096)
    const dst = new Uint8Array(n).fill(0xab)
    const gate = new native.CopyGate()
    const r = await readFileCrc(path, b.buffer, ranges, {
      copyTo: {
        into: dst,
        fileOffset: 0,
        expected: ranges.map((x, i) => (i === flipped ? (crcOf(x) ^ 1) >>> 0 : crcOf(x))),
        gate,
      },
    })
    expect(r.direct).toBe(true)
    expect(r.bytes).toBe(n)
    expect(same(new Uint8Array(b.buffer, 0, n), data)).toBe(true)
    expect([...r.crcs]).toEqual(ranges.map(crcOf))
    expect([...r.copied]).toEqual(ranges.map((_, i) => (i === flipped ? 0 : 1)))
    for (const [i, [a, z]] of ranges.entries()) {
      if (i === flipped) expect(dst.subarray(a, z).every((v) => v === 0xab)).toBe(true)
      else expect(Buffer.compare(dst.subarray(a, z), data.subarray(a, z)), `range ${i}`).toBe(0)
    }
    // Asked for more than the file holds: the piece at the end comes back short, the later ones
    // empty; the read is cut at the end of the file and so are the ranges.
    const big = allocPinnedSync(16 * MiB)
    const past: [number, number][] = [
      [0, 4 * MiB],
      [4 * MiB, 16 * MiB],
    ]
    const cut = await readFileCrc(path, big.buffer, past, { length: 16 * MiB })
    expect(cut.bytes).toBe(n)
    expect(same(new Uint8Array(big.buffer, 0, n), data)).toBe(true)
    expect([...cut.crcs]).toEqual([crc32(data.subarray(0, 4 * MiB)), crc32(data.subarray(4 * MiB))])
    gate.close()
    freePinned(b.buffer)
    freePinned(big.buffer)
  })

  it('equals crc32 for every length around the 64- and 256-byte SIMD block boundaries, at unaligned starts', async () => {
    const data = randomBytes(3 * 4096)
    const path = join(dir, 'crc-blocks')
    writeFileSync(path, data)
    const ranges: [number, number][] = []
    for (const base of [48, 64, 240, 256, 496, 512, 1024, 4096])
      for (let len = base - 17; len <= base + 17; len++)
        for (const start of [0, 1, 7, 16, 31]) ranges.push([start, start + len])
    const b = allocPinnedSync(data.length)
    const r = await readFileCrc(path, b.buffer, ranges)
    expect(r.bytes).toBe(data.length)
    expect([...r.crcs]).toEqual(ranges.map(([a, z]) => crc32(data.subarray(a, z))))
    freePinned(b.buffer)
  })

  it('ranges are offsets into the read at fileOffset; a range past a short read is cut at its end', async () => {
    const data = randomBytes(5 * 4096 + 300)
    const path = join(dir, 'crc-range')
    writeFileSync(path, data)
    const b = allocPinnedSync(4 * 4096)
    const r = await readFileCrc(
      path,
      b.buffer,
      [
        [0, 4096],
        [10, 8000],
        [4096, 4 * 4096],
      ],
      { fileOffset: 2 * 4096, length: 4 * 4096 },
    )
    const read = data.subarray(2 * 4096) // 3 blocks + 300 bytes: short
    expect(r.bytes).toBe(read.length)
    expect([...r.crcs]).toEqual([
      crc32(read.subarray(0, 4096)),
      crc32(read.subarray(10, 8000)),
      crc32(read.subarray(4096)), // cut at bytes
    ])
    freePinned(b.buffer)
  })

  it('refuses ranges outside the buffer or reversed, with ERR_NATIVE, before any I/O', async () => {
    const path = join(dir, 'crc-bad')
    writeFileSync(path, randomBytes(8192))
    const b = allocPinnedSync(8192)
    await rejectsWith(readFileCrc(path, b.buffer, [[0, 8193]]), 'ERR_NATIVE', /ranges\[0\]\[1\]/)
    await rejectsWith(readFileCrc(path, b.buffer, [[10, 5]]), 'ERR_NATIVE', /ranges\[0\]\[1\]/)
    await rejectsWith(readFileCrc(path, b.buffer, [[-1, 5]]), 'ERR_NATIVE', /ranges\[0\]\[0\]/)
    await rejectsWith(readFileCrc(path, b.buffer, [[0.5, 5]]), 'ERR_NATIVE')
    await rejectsWith(readFileCrc(path, b.buffer, [[1, 2, 3] as unknown as [number, number]]), 'ERR_NATIVE')
    // The raw binding checks too: a worker never CRCs outside the buffer.
    const raw = native.loadNative()
    expect(() => raw.readFileCrc(path, b.buffer, 0, 8192, 0, -1, 1, Float64Array.from([0, 9000]))).toThrow(
      /within the buffer/,
    )
    expect(() => raw.readFileCrc(path, b.buffer, 0, 8192, 0, -1, 1, Float64Array.from([0]))).toThrow(/pairs/)
    freePinned(b.buffer) // not left busy by any of the refusals
  })

  it('copyTo: copies a range read whole only when its CRC is the expected one, within the destination, while the gate is open', async () => {
    const data = randomBytes(6 * 4096 + 100)
    const path = join(dir, 'crc-copy')
    writeFileSync(path, data)
    const b = allocPinnedSync(data.length + 4096)
    // Read from file offset 4096; the destination holds file bytes [4096 + 50, ...).
    const read = data.subarray(4096)
    const ranges: [number, number][] = [
      [50, 5000], // expected CRC right: copied
      [5000, 9000], // expected CRC wrong: not copied
      [9000, 12000], // no expectation: not copied
      [12000, read.length], // right CRC, but ends past the destination: not copied
      [20, 40], // starts before the destination: not copied
    ]
    const dst = new Uint8Array(read.length - 50 - 10).fill(0xab)
    const crcOf = ([a, z]: [number, number]) => crc32(read.subarray(a, z))
    const copyTo = (gate: InstanceType<typeof native.CopyGate>) => ({
      into: dst,
      fileOffset: 4096 + 50,
      expected: [
        crcOf(ranges[0]!),
        (crcOf(ranges[1]!) ^ 1) >>> 0,
        undefined,
        crcOf(ranges[3]!),
        crcOf(ranges[4]!),
      ],
      gate,
    })
    const gate = new native.CopyGate()
    const r = await readFileCrc(path, b.buffer, ranges, { fileOffset: 4096, copyTo: copyTo(gate) })
    expect([...r.crcs]).toEqual(ranges.map(crcOf))
    expect([...r.copied]).toEqual([1, 0, 0, 0, 0])
    expect(Buffer.compare(dst.subarray(0, 5000 - 50), read.subarray(50, 5000))).toBe(0)
    expect(dst.subarray(5000 - 50).every((v) => v === 0xab)).toBe(true)
    // Closed: the same read copies nothing.
    gate.close()
    dst.fill(0xab)
    const late = await readFileCrc(path, b.buffer, ranges, { fileOffset: 4096, copyTo: copyTo(gate) })
    expect([...late.copied]).toEqual([0, 0, 0, 0, 0])
    expect(dst.every((v) => v === 0xab)).toBe(true)
    // Malformed copy requests are refused before any I/O.
    await rejectsWith(
      readFileCrc(path, b.buffer, ranges, { copyTo: { ...copyTo(new native.CopyGate()), expected: [1] } }),
      'ERR_NATIVE',
      /one entry per range/,
    )
    await rejectsWith(
      readFileCrc(path, b.buffer, ranges, { copyTo: { ...copyTo(gate), gate: {} as never } }),
      'ERR_NATIVE',
      /CopyGate/,
    )
    await rejectsWith(
      readFileCrc(path, b.buffer, ranges, {
        copyTo: { ...copyTo(gate), expected: [2 ** 32, undefined, undefined, undefined, undefined] },
      }),
      'ERR_NATIVE',
      /expected\[0\]/,
    )
    await rejectsWith(
      readFileCrc(path, b.buffer, ranges, {
        copyTo: { ...copyTo(gate), into: new Uint8Array(new SharedArrayBuffer(16)) },
      }),
      'ERR_NATIVE',
      /SharedArrayBuffer/,
    )
    const raw = native.loadNative()
    // The binding itself, past the wrapper's checks: one section copied, `expected` CRCs and the gate vary.
    const rawRead = (expected: number[], gateHandle: unknown) =>
      raw.readFileCrc(
        path,
        b.buffer,
        0,
        8192,
        0,
        -1,
        1,
        Float64Array.from([0, 10]),
        new ArrayBuffer(8),
        0,
        8,
        0,
        Float64Array.from(expected),
        gateHandle,
      )
    expect(() => rawRead([0.5], gate.handle)).toThrow(/CRC-32 or -1/)
    expect(() => rawRead([-1], {})).toThrow(/newCopyGate/)
    // A pinned destination with a read buffer refused after it (detached): not left busy either.
    const gone = new ArrayBuffer(8192)
    structuredClone(gone, { transfer: [gone] })
    const pinnedDst = allocPinnedSync(8192)
    expect(() =>
      raw.readFileCrc(
        path,
        gone,
        0,
        0,
        0,
        -1,
        1,
        new Float64Array(0),
        pinnedDst.buffer,
        0,
        8,
        0,
        new Float64Array(0),
        gate.handle,
      ),
    ).toThrow(/detached/)
    expect(() => freePinned(pinnedDst.buffer)).not.toThrow()
    freePinned(b.buffer) // not left busy by the reads or the refusals
  })

  it('a failed read (missing file, a directory) rejects and leaves the buffer free', async () => {
    const b = allocPinnedSync(8192)
    await rejectsWith(readFileCrc(join(dir, 'no-such-file'), b.buffer, [[0, 10]]), 'ERR_NATIVE', /ENOENT/)
    await rejectsWith(readFileCrc(dir, b.buffer, [[0, 10]], { length: 4096 }), 'ERR_NATIVE', /EISDIR/)
    expect(() => freePinned(b.buffer)).not.toThrow()
  })
})

describe('copyHost: host copies on the pool', () => {
  it('copies exact bytes between pinned and plain buffers at offsets, and leaves both free after', async () => {
    const src = allocPinnedSync(3 << 20)
    const data = randomBytes(3 << 20)
    new Uint8Array(src.buffer).set(data)
    const plain = new Uint8Array((4 << 20) + 7)
    await native.copyHost(plain.subarray(7, 7 + (2 << 20)), new Uint8Array(src.buffer, 4096, 2 << 20))
    expect(same(plain.subarray(7, 7 + (2 << 20)), data.subarray(4096, 4096 + (2 << 20)))).toBe(true)
    expect(plain[6]).toBe(0)
    expect(plain[7 + (2 << 20)]).toBe(0)
    const dst = allocPinnedSync(3 << 20)
    await native.copyHost(dst.buffer, src.buffer)
    expect(same(new Uint8Array(dst.buffer), data)).toBe(true)
    freePinned(src.buffer)
    freePinned(dst.buffer)
  })

  it('refuses a source larger than the destination, a freed or shared buffer, with ERR_NATIVE', async () => {
    const b = allocPinnedSync(8192)
    await rejectsWith(native.copyHost(new Uint8Array(10), new Uint8Array(11)), 'ERR_NATIVE', /does not fit/)
    await rejectsWith(
      native.copyHost(new Uint8Array(new SharedArrayBuffer(16)), new Uint8Array(8)),
      'ERR_NATIVE',
    )
    freePinned(b.buffer)
    await rejectsWith(native.copyHost(new Uint8Array(8192), b.buffer), 'ERR_NATIVE', /freed/)
  })
})

describe('copyViews: copies out of shared staging on the pool', () => {
  it('copies exact bytes between shared, pinned and plain views at offsets, touching nothing else', async () => {
    const data = randomBytes(3 << 20)
    // A codec worker's staging (SharedArrayBuffer) into a pinned L1 slot at an offset.
    const shared = new Uint8Array(new SharedArrayBuffer(4 << 20))
    shared.set(data, 5)
    const slot = allocPinnedSync(4 << 20)
    const dst = new Uint8Array(slot.buffer, 4096, 3 << 20)
    expect(pinnedInfo(slot.buffer)).toMatchObject({ busy: 0 })
    const copy = native.copyViews(dst, shared.subarray(5, 5 + (3 << 20)))
    // The slot is busy while the copy runs: freePinned refuses instead of freeing memory in use.
    expect(pinnedInfo(slot.buffer)).toMatchObject({ busy: 1 })
    expect(() => freePinned(slot.buffer)).toThrow(/in use/)
    await copy
    expect(pinnedInfo(slot.buffer)).toMatchObject({ busy: 0 })
    expect(same(dst, data)).toBe(true)
    const whole = new Uint8Array(slot.buffer)
    expect(whole.subarray(0, 4096).every((b) => b === 0)).toBe(true)
    expect(whole.subarray(4096 + (3 << 20)).every((b) => b === 0)).toBe(true)
    // Pinned into plain, a small copy (memmove path), a plain one into shared.
    const plain = new Uint8Array((3 << 20) + 9)
    await native.copyViews(plain.subarray(9), dst)
    expect(same(plain.subarray(9), data)).toBe(true)
    expect(plain.subarray(0, 9).every((b) => b === 0)).toBe(true)
    const small = new Uint8Array(new SharedArrayBuffer(100))
    await native.copyViews(small.subarray(1, 11), plain.subarray(9, 19))
    expect([...small.subarray(1, 11)]).toEqual([...data.subarray(0, 10)])
    expect(small[0]).toBe(0)
    expect(small[11]).toBe(0)
    freePinned(slot.buffer)
  })

  it('overlapping views of one buffer copy as memmove', async () => {
    const buf = pattern(6 << 20, 4)
    const want = Uint8Array.from(buf)
    want.copyWithin(1000, 0, 5 << 20)
    await native.copyViews(buf.subarray(1000, 1000 + (5 << 20)), buf.subarray(0, 5 << 20))
    expect(same(buf, want)).toBe(true)
  })

  it('refuses what does not fit, non-Uint8Arrays and freed buffers, leaving nothing busy', async () => {
    const b = allocPinnedSync(8192)
    await rejectsWith(
      native.copyViews(new Uint8Array(b.buffer, 0, 10), new Uint8Array(11)),
      'ERR_NATIVE',
      /does not fit/,
    )
    await rejectsWith(
      native.copyViews(new Uint16Array(8) as unknown as Uint8Array, new Uint8Array(8)),
      'ERR_NATIVE',
    )
    await rejectsWith(
      native.copyViews(new Uint8Array(8), new ArrayBuffer(8) as unknown as Uint8Array),
      'ERR_NATIVE',
    )
    // The raw binding refuses too (no JS check in front of it): nothing left busy.
    expect(() => native.loadNative().copyViews(new Uint8Array(b.buffer, 0, 4), new Uint8Array(5))).toThrow(
      /does not fit/,
    )
    expect(pinnedInfo(b.buffer)).toMatchObject({ busy: 0 })
    const view = new Uint8Array(b.buffer)
    freePinned(b.buffer)
    await rejectsWith(native.copyViews(view, new Uint8Array(0)), 'ERR_NATIVE', /freed/)
    await rejectsWith(native.copyViews(new Uint8Array(8), view), 'ERR_NATIVE', /freed/)
  })
})

describe('copyRuns: scattered runs in one call', () => {
  const { copyRuns } = native

  it('copies exactly the runs (streamed and small, unaligned, into typed-array views) and nothing else', () => {
    const src = pattern(300_000, 3)
    const backing = new Uint8Array(300_100).fill(0xee)
    const dst = backing.subarray(7, 300_007) // an unaligned view: offsets are relative to it
    // [dst, src, bytes]: large runs (non-temporal path) at odd offsets, small ones, an empty one.
    const runs = [
      0, 100_000, 65_536, 65_537, 1, 40_000, 200_001, 3, 17, 250_000, 250_001, 4_096, 110_000, 0, 0,
    ]
    copyRuns(dst, src, Float64Array.from(runs))
    const want = new Uint8Array(300_100).fill(0xee)
    for (let i = 0; i < runs.length; i += 3) {
      want.set(src.subarray(runs[i + 1]!, runs[i + 1]! + runs[i + 2]!), 7 + runs[i]!)
    }
    expect(same(backing, want)).toBe(true)
    // An ArrayBuffer works as either side too.
    const ab = new ArrayBuffer(8192)
    copyRuns(ab, src, Float64Array.from([0, 5, 8192]))
    expect(same(new Uint8Array(ab), src.subarray(5, 8197))).toBe(true)
  })

  it('overlapping runs within one buffer copy as memmove', () => {
    const buf = pattern(64 << 10, 9)
    const want = Uint8Array.from(buf)
    want.copyWithin(100, 0, 32 << 10)
    copyRuns(buf, buf, Float64Array.from([100, 0, 32 << 10]))
    expect(same(buf, want)).toBe(true)
  })

  it('a bad run or argument copies nothing and throws ERR_NATIVE', async () => {
    const src = pattern(16_384, 5)
    const dst = new Uint8Array(16_384)
    const bad: number[][] = [
      [0, 0, 16_385], // past both ends
      [8192, 0, 8193], // past dst
      [0, 8192, 8193], // past src
      [-1, 0, 10],
      [0, 0.5, 10],
      [Number.NaN, 0, 1],
      [0, 0, Number.POSITIVE_INFINITY],
      [0, 0, 2 ** 60],
      [0, 0, 4096, 1], // not triples
    ]
    for (const runs of bad) {
      // A good run first: it must not have been copied when a later one is refused.
      await rejectsWith(() => copyRuns(dst, src, Float64Array.from([0, 0, 8192, ...runs])), 'ERR_NATIVE')
      expect(dst.every((x) => x === 0)).toBe(true)
    }
    await rejectsWith(() => copyRuns(dst, src, [0, 0, 1] as unknown as Float64Array), 'ERR_NATIVE')
    await rejectsWith(() => copyRuns(dst, 'x' as unknown as Uint8Array, new Float64Array(3)), 'ERR_NATIVE')
    const raw = native.loadNative()
    // The addon checks for itself (a bypassed wrapper): wrong array type, non-buffers.
    expect(() => raw.copyRuns!(dst, src, new Float32Array(3) as unknown as Float64Array)).toThrow(
      /Float64Array/,
    )
    expect(() => raw.copyRuns!({} as Uint8Array, src, new Float64Array(3))).toThrow(/dst/)
    expect(() => raw.copyRuns!(dst, src, Float64Array.from([0, 0, 16_385]))).toThrow(/outside/)
    // A detached buffer is empty: any byte of a run is outside it.
    const gone = new ArrayBuffer(64)
    structuredClone(gone, { transfer: [gone] })
    await rejectsWith(() => copyRuns(gone, src, Float64Array.from([0, 0, 1])), 'ERR_NATIVE')
    expect(dst.every((x) => x === 0)).toBe(true)
  })
})

describe('socketPeerClosed (POLLRDHUP)', () => {
  it('sees a peer close at once, with unread data queued, before the close event reaches JS', async () => {
    const { createServer, connect } = await import('node:net')
    const path = join(dir, 'peer.sock')
    let accepted!: (s: import('node:net').Socket) => void
    const serverSide = new Promise<import('node:net').Socket>((r) => (accepted = r))
    const server = createServer((s) => accepted(s))
    await new Promise<void>((r) => server.listen(path, r))
    try {
      const client = connect(path)
      await new Promise<void>((r) => client.once('connect', () => r()))
      const s = await serverSide
      const fd = (s as unknown as { _handle: { fd: number } })._handle.fd
      expect(fd).toBeGreaterThanOrEqual(0)
      expect(native.socketPeerClosed(fd)).toBe(false)
      s.pause() // nothing read: the data stays queued ahead of the close
      await new Promise<void>((r) => client.write(Buffer.alloc(4096, 7), () => r()))
      expect(native.socketPeerClosed(fd)).toBe(false)
      let ended = false
      s.on('end', () => (ended = true))
      s.on('close', () => (ended = true))
      client.destroy()
      // Same turn of the loop: the kernel knows, JS does not yet.
      expect(native.socketPeerClosed(fd)).toBe(true)
      expect(ended).toBe(false)
      s.destroy()
    } finally {
      await new Promise<void>((r) => server.close(() => r()))
    }
  })

  it('an fd that is no socket or not open: never throws', () => {
    expect(native.socketPeerClosed(2 ** 30)).toBe(true) // POLLNVAL: no such fd, nothing to wait for
    expect(native.socketPeerClosed(-1)).toBeUndefined()
    expect(native.socketPeerClosed(Number.NaN)).toBeUndefined()
    expect(() => native.loadNative().peerClosed!(1.5)).toThrow(/non-negative integer/)
  })
})
