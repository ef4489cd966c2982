// Leak checks for the native addon, apart from the unit suites: many
// allocate/free, collect, copy, fail and file-I/O cycles must leave RSS, live
// allocations, stub CUDA objects and file descriptors where they started.

import { mkdtempSync, readdirSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { setFlagsFromString } from 'node:v8'
import { runInNewContext } from 'node:vm'
import { Worker } from 'node:worker_threads'
import { afterAll, expect, it } from 'vitest'
import { nativePaths } from '../src/client/native.ts'

process.env.KVGATE_CUDART = nativePaths.stubCudart
const { allocPinned, allocPinnedSync, cuda, freePinned, nativeMemoryStats, readFileDirect } = await import(
  '../src/client/native.ts'
)

setFlagsFromString('--expose-gc')
const gc = runInNewContext('gc') as () => void
const MiB = 1 << 20
const rss = () => process.memoryUsage().rss
const openFds = () => readdirSync('/proc/self/fd').length

const dir = mkdtempSync(join(tmpdir(), 'kvgate-leak-'))
afterAll(() => rmSync(dir, { recursive: true, force: true }))

// External-buffer finalizers run on an immediate after the GC that found them.
async function collect(until: () => boolean): Promise<boolean> {
  for (let i = 0; i < 50; i++) {
    gc()
    await new Promise((r) => setImmediate(r))
    if (until()) return true
  }
  return until()
}

it('stub CUDA is loaded (else this suite measures nothing CUDA-side)', () => {
  expect(cuda.status().stub, cuda.status().reason).toBe(true)
})

it('allocate/free cycles keep RSS bounded and release every block', async () => {
  const start = nativeMemoryStats()
  const stubStart = cuda.stubControl('')
  const warm = await allocPinned(8 * MiB)
  freePinned(warm.buffer)
  const rss0 = rss()
  for (let i = 0; i < 300; i++) {
    const a = await allocPinned(8 * MiB, { cuda: i % 2 === 0 }) // cudaHostAlloc and mmap+mlock paths
    new Uint8Array(a.buffer)[i * 4096] = 1
    freePinned(a.buffer)
  }
  expect(nativeMemoryStats()).toEqual(start)
  expect(cuda.stubControl('')).toBe(stubStart)
  expect(rss() - rss0).toBeLessThan(64 * MiB) // 300 × 8 MiB went through
})

it('unreferenced pinned buffers are freed by their finalizers', async () => {
  const start = nativeMemoryStats().pinnedBlocks
  const rss0 = rss()
  for (let i = 0; i < 2000; i++) allocPinnedSync(256 << 10, { cuda: i % 2 === 0 }).buffer.byteLength
  expect(nativeMemoryStats().pinnedBlocks).toBeGreaterThan(start)
  expect(await collect(() => nativeMemoryStats().pinnedBlocks === start)).toBe(true)
  expect(rss() - rss0).toBeLessThan(96 * MiB) // 500 MiB was allocated in total
})

it('copy, batch, failure and device alloc cycles leave no stub objects or busy marks behind', async () => {
  const stubStart = cuda.stubControl('')
  const p = allocPinnedSync(MiB)
  const d = cuda.deviceAlloc(MiB)
  const desc = new BigInt64Array(256 * 3)
  for (let i = 0; i < 256; i++) {
    desc[i * 3] = BigInt(((i * 37) % 256) * 4096) // host offsets, scattered
    desc[i * 3 + 1] = d + BigInt(i * 4096)
    desc[i * 3 + 2] = 4096n
  }
  const rss0 = rss()
  for (let i = 0; i < 300; i++) {
    await cuda.copyBatch('h2d', p.buffer, desc)
    await cuda.copyBatch('d2h', new Uint8Array(p.buffer), new BigInt64Array([d, 0n, BigInt(MiB)]))
    const t = cuda.deviceAlloc(4096 + i)
    cuda.deviceFree(t)
  }
  cuda.stubControl('cudaMemcpyAsync=2')
  for (let i = 0; i < 300; i++) {
    await cuda.copyBatch('h2d', p.buffer, desc).then(
      () => expect.unreachable(),
      (e) => expect(e.code).toBe('ERR_CUDA'),
    )
  }
  cuda.stubControl('reset')
  const s = cuda.createStream()
  for (let i = 0; i < 100; i++) await cuda.copyToDevice(p.buffer, d, { stream: s })
  cuda.destroyStream(s)
  for (let i = 0; i < 100; i++) {
    const mapped = await cuda.ipcOpen(cuda.ipcGetHandle(d))
    await cuda.ipcClose(mapped)
  }
  expect(rss() - rss0).toBeLessThan(32 * MiB)
  freePinned(p.buffer)
  cuda.deviceFree(d)
  expect(cuda.stubControl('')).toBe(stubStart)
})

it('file I/O cycles (direct, fallback and failing) leak no descriptors', async () => {
  const path = join(dir, 'f')
  writeFileSync(path, new Uint8Array(3 * 4096 + 7))
  const b = allocPinnedSync(4 * 4096)
  const fds = openFds()
  for (let i = 0; i < 200; i++) {
    await readFileDirect(path, b.buffer)
    await readFileDirect('/dev/zero', b.buffer, { length: 4096 })
    await readFileDirect(join(dir, 'missing'), b.buffer).catch(() => {})
    await readFileDirect('/dev/zero', b.buffer, { length: 4096, direct: 'require' }).catch(() => {})
  }
  expect(openFds()).toBe(fds)
  freePinned(b.buffer)
})

it('worker threads that exit leave no pinned blocks or CUDA registrations behind', async () => {
  const stubStart = cuda.stubControl('')
  const code = `
    const n = require(${JSON.stringify(nativePaths.addon)})
    const keep = []
    for (let i = 0; i < 20; i++) keep.push(n.allocPinnedSync(1 << 20, { cuda: i % 2 === 0, lock: true, hugePages: true }))
    globalThis.rb = new ArrayBuffer(1 << 16)
    n.registerHost(globalThis.rb).then(() => require('node:worker_threads').parentPort.postMessage(n.memoryStats()))`
  for (let i = 0; i < 4; i++) {
    const w = new Worker(code, { eval: true })
    const stats = await new Promise<{ pinnedBlocks: number; registered: number }>((resolve, reject) => {
      w.once('message', resolve)
      w.once('error', reject)
    })
    expect(stats.registered).toBe(1)
    expect(stats.pinnedBlocks).toBeGreaterThanOrEqual(20)
    await w.terminate()
  }
  // Teardown runs the finalizers and unregisters the dead thread's buffers
  // (without that, CUDA kept freed memory registered: error 712 on reuse).
  expect(nativeMemoryStats()).toMatchObject({ pinnedBlocks: 0, registered: 0 })
  expect(cuda.stubControl('')).toBe(stubStart)
})
