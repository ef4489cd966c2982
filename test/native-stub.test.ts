// The whole CUDA path driven through the stub libcudart (native/test-stub):
// device memory, async and batched copies, streams, IPC, registration, and
// injected CUDA errors surfacing as typed ERR_CUDA errors. Own file = own
// process: the loaded libcudart is fixed per process.

import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, beforeEach, describe, expect, it } from 'vitest'
import { nativePaths } from '../src/client/native.ts'
import { pattern, same } from './support/bytes.ts'
import { rejectsWith } from './support/native-errors.ts'

process.env.KVGATE_CUDART = nativePaths.stubCudart

const native = await import('../src/client/native.ts')
const { allocPinnedSync, cuda, freePinned, pinnedInfo } = native

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms))

// The stub's live allocations at the start: every test must leave it there.
let baseline = 0
beforeEach(() => {
  cuda.stubControl('reset')
})
afterAll(() => {
  cuda.stubControl('reset')
})

describe('stub CUDA', () => {
  it('is loaded through KVGATE_CUDART and available', () => {
    const s = cuda.status()
    expect(s, `stub not usable: ${s.reason} — run scripts/build-native.sh`).toMatchObject({
      available: true,
      stub: true,
      deviceCount: 1,
      reason: '',
    })
    expect(s.library).toBe(nativePaths.stubCudart)
    expect(cuda.deviceCount()).toBe(1)
    baseline = cuda.stubControl('')
  })

  it('setDevice validates the ordinal', async () => {
    cuda.setDevice(0)
    expect(cuda.getDevice()).toBe(0)
    await rejectsWith(() => cuda.setDevice(3), 'ERR_NATIVE', /out of range/)
    await rejectsWith(() => cuda.setDevice(-1), 'ERR_NATIVE')
  })

  it('pinned memory comes from cudaHostAlloc and is released on free', () => {
    const before = cuda.stubControl('')
    const a = allocPinnedSync(1 << 20)
    expect(a.kind).toBe('cuda')
    expect(a.reason).toMatch(/cudaHostAlloc/)
    expect(new Uint8Array(a.buffer).every((v) => v === 0)).toBe(true)
    expect(cuda.stubControl('')).toBe(before + 1)
    freePinned(a.buffer)
    expect(cuda.stubControl('')).toBe(before)
  })

  it('a failing cudaHostAlloc falls back to mmap and says why', () => {
    cuda.stubControl('cudaHostAlloc=2')
    const a = allocPinnedSync(1 << 16)
    expect(a.kind).not.toBe('cuda')
    expect(a.reason).toMatch(/cudaHostAlloc failed: out of memory \(cudaErrorMemoryAllocation = 2\)/)
    freePinned(a.buffer)
  })

  it('device alloc/free, with out-of-memory and double free as ERR_CUDA', async () => {
    const d = cuda.deviceAlloc(4096)
    expect(typeof d).toBe('bigint')
    expect(d).not.toBe(0n)
    const oom = await rejectsWith(() => cuda.deviceAlloc(2 ** 31), 'ERR_CUDA', /out of memory/)
    expect(oom.cudaError).toBe(2)
    expect(oom.syscall).toBe('cudaMalloc')
    cuda.deviceFree(d)
    const df = await rejectsWith(() => cuda.deviceFree(d), 'ERR_CUDA', /invalid argument/)
    expect(df.cudaError).toBe(1)
    await rejectsWith(() => cuda.deviceAlloc(-1), 'ERR_NATIVE')
    await rejectsWith(() => cuda.deviceAlloc(0), 'ERR_NATIVE')
    await rejectsWith(() => cuda.deviceFree(0n), 'ERR_NATIVE')
    await rejectsWith(() => cuda.deviceFree(5 as unknown as bigint), 'ERR_NATIVE')
  })
})

describe('copies', () => {
  it('round-trips host→device→host for pinned and plain buffers and views', async () => {
    const n = 256 << 10
    const d = cuda.deviceAlloc(n)
    const pinned = allocPinnedSync(n)
    const data = pattern(n, 5)
    new Uint8Array(pinned.buffer).set(data)
    const r = await cuda.copyToDevice(pinned.buffer, d)
    expect(r).toEqual({ descriptors: 1, issued: 1, bytes: n })
    const back = new Uint8Array(n + 64)
    const view = back.subarray(32, 32 + n) // a view with an offset into its buffer
    await cuda.copyFromDevice(d, view)
    expect(same(view, data)).toBe(true)
    expect(back[31]).toBe(0)
    expect(back[32 + n]).toBe(0)
    expect(pinnedInfo(pinned.buffer)?.busy).toBe(0)
    freePinned(pinned.buffer)
    cuda.deviceFree(d)
  })

  it('device-to-device copies', async () => {
    const a = cuda.deviceAlloc(8192)
    const b = cuda.deviceAlloc(8192)
    const data = pattern(8192, 9)
    await cuda.copyToDevice(data, a)
    await cuda.copyDeviceToDevice(a + 100n, b, 5000)
    const out = new Uint8Array(5000)
    await cuda.copyFromDevice(b, out)
    expect(same(out, data.subarray(100, 5100))).toBe(true)
    cuda.deviceFree(a)
    cuda.deviceFree(b)
  })

  it('gathers a paged KV chunk from scattered device blocks and scatters it back (batched)', async () => {
    // A paged cache: 64 blocks of 16 tokens × 512 B in a device pool; one
    // chunk's 16 blocks live at a shuffled set of block ids, per layer.
    const blockBytes = 16 * 512
    const poolBlocks = 64
    const pool = cuda.deviceAlloc(poolBlocks * blockBytes)
    const poolData = pattern(poolBlocks * blockBytes, 21)
    await cuda.copyToDevice(poolData, pool)
    const ids = [7, 3, 50, 51, 52, 9, 0, 63, 12, 13, 40, 2, 33, 34, 35, 36]
    const desc = new BigInt64Array(ids.length * 3)
    ids.forEach((id, i) => {
      desc[i * 3] = pool + BigInt(id * blockBytes)
      desc[i * 3 + 1] = BigInt(i * blockBytes)
      desc[i * 3 + 2] = BigInt(blockBytes)
    })
    const chunk = allocPinnedSync(ids.length * blockBytes)
    const g = await cuda.copyBatch('d2h', chunk.buffer, desc)
    expect(g.descriptors).toBe(16)
    // 50,51,52 and 12,13 and 33..36 are adjacent on both sides: merged.
    expect(g.issued).toBe(16 - 2 - 1 - 3)
    expect(g.bytes).toBe(16 * blockBytes)
    const c = new Uint8Array(chunk.buffer)
    ids.forEach((id, i) => {
      expect(
        same(
          c.subarray(i * blockBytes, (i + 1) * blockBytes),
          poolData.subarray(id * blockBytes, (id + 1) * blockBytes),
        ),
      ).toBe(true)
    })
    // Scatter a new chunk into other blocks (h2d: src = host offset, dst = device).
    const fresh = pattern(ids.length * blockBytes, 99)
    c.set(fresh)
    const targets = ids.map((id) => (id + 17) % poolBlocks)
    const sdesc = new BigInt64Array(targets.length * 3)
    targets.forEach((id, i) => {
      sdesc[i * 3] = BigInt(i * blockBytes)
      sdesc[i * 3 + 1] = pool + BigInt(id * blockBytes)
      sdesc[i * 3 + 2] = BigInt(blockBytes)
    })
    await cuda.copyBatch('h2d', chunk.buffer, sdesc)
    const after = new Uint8Array(poolBlocks * blockBytes)
    await cuda.copyFromDevice(pool, after)
    targets.forEach((id, i) => {
      expect(
        same(
          after.subarray(id * blockBytes, (id + 1) * blockBytes),
          fresh.subarray(i * blockBytes, (i + 1) * blockBytes),
        ),
      ).toBe(true)
    })
    const untouched = [...Array(poolBlocks).keys()].find((b) => !targets.includes(b))!
    expect(
      same(
        after.subarray(untouched * blockBytes, (untouched + 1) * blockBytes),
        poolData.subarray(untouched * blockBytes, (untouched + 1) * blockBytes),
      ),
    ).toBe(true)
    freePinned(chunk.buffer)
    cuda.deviceFree(pool)
  })

  it('host offsets in descriptors are relative to the view given', async () => {
    const d = cuda.deviceAlloc(4096)
    const host = pattern(8192, 4)
    const view = host.subarray(1000, 3000)
    await cuda.copyBatch('h2d', view, new BigInt64Array([10n, d, 100n]))
    const out = new Uint8Array(100)
    await cuda.copyFromDevice(d, out)
    expect(same(out, host.subarray(1010, 1110))).toBe(true)
    cuda.deviceFree(d)
  })

  it('rejects bad descriptors before any byte moves', async () => {
    const d = cuda.deviceAlloc(4096)
    await cuda.copyToDevice(new Uint8Array(4096).fill(7), d)
    const host = new Uint8Array(4096).fill(1)
    const check = async () => {
      const out = new Uint8Array(4096)
      await cuda.copyFromDevice(d, out)
      expect(out.every((v) => v === 7)).toBe(true) // the valid first descriptor did not run
    }
    const bad: [string, bigint[], RegExp][] = [
      ['past the end', [0n, d, 16n, 4090n, d + 16n, 7n], /descriptor 1: host range \[4090, \+7\) is outside/],
      ['negative offset', [0n, d, 16n, -1n, d + 16n, 1n], /descriptor 1/],
      ['negative length', [0n, d, 16n, 0n, d + 16n, -5n], /negative length/],
      ['huge length', [0n, d, 16n, 0n, d, 2n ** 62n], /outside/],
      ['null device pointer', [0n, d, 16n, 0n, 0n, 1n], /null device pointer/],
    ]
    for (const [, triples, msg] of bad) {
      await rejectsWith(cuda.copyBatch('h2d', host, new BigInt64Array(triples)), 'ERR_NATIVE', msg)
      await check()
    }
    await rejectsWith(cuda.copyBatch('h2d', host, new BigInt64Array([0n, d])), 'ERR_NATIVE', /triples/)
    await rejectsWith(cuda.copyBatch('h2d', host, [0n, d, 1n] as unknown as BigInt64Array), 'ERR_NATIVE')
    await rejectsWith(cuda.copyBatch('h2d', null, new BigInt64Array([0n, d, 1n])), 'ERR_NATIVE')
    await rejectsWith(cuda.copyBatch('d2d', host, new BigInt64Array([d, d, 1n])), 'ERR_NATIVE')
    await rejectsWith(cuda.copyBatch('x2y' as 'h2d', host, new BigInt64Array(3)), 'ERR_NATIVE')
    await rejectsWith(cuda.copyToDevice(host, -4n), 'ERR_NATIVE')
    // The raw binding re-checks host ranges itself (C++ does not trust JS).
    const raw = native.loadNative().cuda
    expect(() => raw.copy(1, host.buffer, 0, 4096, new BigInt64Array([4000n, d, 200n]), 0n)).toThrow(
      /outside/,
    )
    expect(() => raw.copy(1, host.buffer, 4000, 200, new BigInt64Array([0n, d, 1n]), 0n)).toThrow(
      /outside the buffer/,
    )
    // A device range the runtime rejects is an ERR_CUDA error (the stub checks like CUDA does).
    const e = await rejectsWith(
      cuda.copyBatch('h2d', host, new BigInt64Array([0n, d + 4000n, 200n])),
      'ERR_CUDA',
      /invalid argument/,
    )
    expect(e.cudaError).toBe(1)
    cuda.deviceFree(d)
  })

  it('copies complete off the JS thread; the buffer is busy (not freeable) meanwhile', async () => {
    const d = cuda.deviceAlloc(4096)
    const p = allocPinnedSync(4096)
    cuda.stubControl('delay_us=300000')
    let done = false
    const copy = cuda.copyToDevice(p.buffer, d).then(() => {
      done = true
    })
    await sleep(20) // timers run: the JS thread is free while the copy waits
    expect(done).toBe(false)
    expect(pinnedInfo(p.buffer)?.busy).toBe(1)
    await rejectsWith(() => freePinned(p.buffer), 'ERR_NATIVE', /in use by 1 pending/)
    await copy
    expect(pinnedInfo(p.buffer)?.busy).toBe(0)
    freePinned(p.buffer)
    cuda.deviceFree(d)
  })

  it('streams: copies on a created stream; destroy refuses while busy and rejects unknown handles', async () => {
    const s = cuda.createStream()
    const d = cuda.deviceAlloc(4096)
    const data = pattern(4096, 2)
    await cuda.copyToDevice(data, d, { stream: s })
    const out = new Uint8Array(4096)
    await cuda.copyFromDevice(d, out, { stream: s })
    expect(same(out, data)).toBe(true)
    cuda.stubControl('delay_us=200000')
    const pending = cuda.copyToDevice(data, d, { stream: s })
    await rejectsWith(() => cuda.destroyStream(s), 'ERR_NATIVE', /in flight/)
    await pending
    cuda.destroyStream(s)
    await rejectsWith(() => cuda.destroyStream(s), 'ERR_NATIVE', /unknown stream/)
    await rejectsWith(cuda.copyToDevice(data, d, { stream: s }), 'ERR_NATIVE', /unknown stream/)
    await rejectsWith(cuda.copyToDevice(data, d, { stream: 12345n as never }), 'ERR_NATIVE', /unknown stream/)
    cuda.deviceFree(d)
  })
})

describe('injected CUDA errors', () => {
  it('become ERR_CUDA errors with the CUDA error string, and leave nothing busy', async () => {
    const d = cuda.deviceAlloc(1 << 16)
    const p = allocPinnedSync(1 << 16)
    const desc = new BigInt64Array([0n, d, 100n, 200n, d + 1000n, 100n, 400n, d + 3000n, 100n])
    cuda.stubControl('cudaMemcpyAsync=2@1*1') // the second memcpy of the batch fails once
    const e = await rejectsWith(
      cuda.copyBatch('h2d', p.buffer, desc),
      'ERR_CUDA',
      /cudaMemcpyAsync failed: out of memory/,
    )
    expect(e.cudaError).toBe(2)
    expect(pinnedInfo(p.buffer)?.busy).toBe(0)
    expect((await cuda.copyBatch('h2d', p.buffer, desc)).issued).toBe(3) // the rule was used up

    cuda.stubControl('cudaEventSynchronize=1')
    await rejectsWith(
      cuda.copyToDevice(p.buffer, d),
      'ERR_CUDA',
      /cudaEventSynchronize failed: invalid argument \(cudaErrorInvalidValue = 1\)/,
    )
    cuda.stubControl('reset,cudaSetDevice=101')
    await rejectsWith(cuda.copyToDevice(p.buffer, d), 'ERR_CUDA', /invalid device ordinal/)
    cuda.stubControl('reset,cudaEventCreateWithFlags=2,cudaEventCreate=2')
    await cuda.copyToDevice(p.buffer, d) // falls back to a stream sync
    cuda.stubControl('reset')
    await cuda.copyToDevice(p.buffer, d)
    freePinned(p.buffer)
    cuda.deviceFree(d)
  })

  it('malformed control specs are refused', async () => {
    await rejectsWith(() => cuda.stubControl('nonsense'), 'ERR_NATIVE')
    await rejectsWith(() => cuda.stubControl('cudaMalloc=x'), 'ERR_NATIVE')
  })
})

describe('host registration', () => {
  it('registers and unregisters a JS buffer; misuse is typed', async () => {
    const before = cuda.stubControl('')
    const buf = new Uint8Array(1 << 16)
    await native.registerHost(buf)
    expect(cuda.stubControl('')).toBe(before + 1)
    expect(native.nativeMemoryStats().registered).toBe(1)
    await rejectsWith(native.registerHost(buf), 'ERR_NATIVE', /already registered/)
    native.unregisterHost(buf)
    expect(cuda.stubControl('')).toBe(before)
    await rejectsWith(() => native.unregisterHost(buf), 'ERR_NATIVE', /not registered/)
    await rejectsWith(native.registerHost(new Uint8Array(0)), 'ERR_NATIVE')

    cuda.stubControl('cudaHostRegister=712')
    const e = await rejectsWith(native.registerHost(buf), 'ERR_CUDA', /already mapped/)
    expect(e.cudaError).toBe(712)
    cuda.stubControl('reset')
    await native.registerHost(buf) // the failed attempt left no record
    native.unregisterHost(buf)
  })

  it('freeing a registered pinned buffer unregisters it', async () => {
    const before = cuda.stubControl('')
    cuda.stubControl('cudaHostAlloc=2') // an mmap block, which CUDA accepts for registration
    const p = allocPinnedSync(1 << 16)
    cuda.stubControl('reset')
    await native.registerHost(p.buffer)
    expect(pinnedInfo(p.buffer)?.registered).toBe(true)
    freePinned(p.buffer)
    expect(cuda.stubControl('')).toBe(before)
    expect(native.nativeMemoryStats().registered).toBe(0)
  })
})

describe('IPC handles', () => {
  it('opens a handle to a device pointer, copies through it, closes it', async () => {
    const d = cuda.deviceAlloc(8192)
    const data = pattern(8192, 77)
    await cuda.copyToDevice(data, d)
    const h = cuda.ipcGetHandle(d)
    expect(h).toBeInstanceOf(Uint8Array)
    expect(h.byteLength).toBe(64)
    const before = cuda.stubControl('')
    const mapped = await cuda.ipcOpen(h)
    expect(cuda.stubControl('')).toBe(before + 1)
    const out = new Uint8Array(8192)
    await cuda.copyFromDevice(mapped, out)
    expect(same(out, data)).toBe(true)
    await cuda.ipcClose(mapped)
    expect(cuda.stubControl('')).toBe(before)
    const e = await rejectsWith(cuda.ipcClose(mapped), 'ERR_CUDA', /cudaIpcCloseMemHandle/)
    expect(e.cudaError).toBe(1)
    cuda.deviceFree(d)
  })

  it('bad handles are typed errors', async () => {
    await rejectsWith(
      cuda.ipcOpen(new Uint8Array(64)),
      'ERR_CUDA',
      /cudaIpcOpenMemHandle failed: invalid argument/,
    )
    await rejectsWith(cuda.ipcOpen(new Uint8Array(63)), 'ERR_NATIVE', /64-byte/)
    await rejectsWith(cuda.ipcOpen(new Uint16Array(32) as unknown as Uint8Array), 'ERR_NATIVE')
    const d = cuda.deviceAlloc(64)
    const h = cuda.ipcGetHandle(d)
    cuda.deviceFree(d)
    await rejectsWith(cuda.ipcOpen(h), 'ERR_CUDA', /invalid resource handle/) // stale handle
    await rejectsWith(() => cuda.ipcGetHandle(12345n), 'ERR_CUDA')
    await rejectsWith(cuda.ipcClose(0n), 'ERR_NATIVE')
  })
})

describe('bookkeeping', () => {
  it('the tests above left no stub allocations, registrations or IPC mappings behind', () => {
    expect(cuda.stubControl('')).toBe(baseline)
    expect(native.nativeMemoryStats()).toMatchObject({ registered: 0 })
  })
})

// Last: it leaks whatever random calls allocate.
describe('hostile calls', () => {
  it('the raw binding survives random arguments (typed throws or rejections, never a crash)', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'kvgate-fuzz-'))
    const raw = native.loadNative() as unknown as Record<string, unknown> & { cuda: Record<string, unknown> }
    const values = () => [
      undefined,
      null,
      -1,
      0,
      1,
      4096,
      1.5,
      2 ** 53,
      Number.NaN,
      join(dir, 'f'),
      {},
      [],
      new ArrayBuffer(8),
      new Uint8Array(8),
      new Uint8Array(64),
      1n,
      -1n,
      0n,
      2n ** 64n,
      new BigInt64Array(3),
      new BigInt64Array([0n, 8n, 8n]),
      { cuda: true, lock: 1, hugePages: 'y' },
    ]
    const fns: [string, (...a: unknown[]) => unknown][] = []
    for (const [k, v] of Object.entries(raw)) if (typeof v === 'function') fns.push([k, v as never])
    for (const [k, v] of Object.entries(raw.cuda))
      if (typeof v === 'function' && k !== 'stubControl') fns.push([k, v as never])
    let seed = 12345
    const next = (m: number) => {
      seed = (seed * 1103515245 + 12345) >>> 0
      return (seed >>> 8) % m
    }
    const pending: Promise<unknown>[] = []
    let threw = 0
    for (let i = 0; i < 3000; i++) {
      const [, f] = fns[next(fns.length)]!
      const vs = values()
      const args = Array.from({ length: next(9) }, () => vs[next(vs.length)])
      try {
        const r = f(...args)
        if (r instanceof Promise) pending.push(r.catch((e) => expect(e.code).toMatch(/^ERR_(NATIVE|CUDA)$/)))
      } catch (e) {
        threw++
        expect((e as Error).message.length).toBeGreaterThan(0)
      }
    }
    await Promise.all(pending)
    expect(threw).toBeGreaterThan(1000)
    rmSync(dir, { recursive: true, force: true })
  })
})
