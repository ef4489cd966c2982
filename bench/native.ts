// Benchmark of the native addon: pinned allocation vs Buffer.allocUnsafe,
// batched host copies (stub CUDA) vs one memcpy, O_DIRECT vs buffered reads.
// `node --import tsx --expose-gc bench/native.ts` (or `npm run bench -- native`).

import { mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { readFile } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { setFlagsFromString } from 'node:v8'
import { runInNewContext } from 'node:vm'
import { nativePaths } from '../src/client/native.ts'
import { machineLine, median, RESULTS_DIR, table, writeResult } from './lib/stats.ts'
import { figureChart, stackSvgs } from './lib/svg-chart.ts'

// Copies go through the stub libcudart: "device" memory is host memory, so
// the figure is the batched path's own overhead over a plain memcpy.
if (process.env.KVGATE_BENCH_REAL_CUDA !== '1') process.env.KVGATE_CUDART = nativePaths.stubCudart
const { allocPinned, allocPinnedSync, cuda, evictFileCache, freePinned, readFileDirect, writeFileDirect } =
  await import('../src/client/native.ts')

const gc: () => void =
  (globalThis as { gc?: () => void }).gc ??
  (() => {
    setFlagsFromString('--expose-gc')
    return runInNewContext('gc') as () => void
  })()

const MiB = 1 << 20
const maxMiB = Number(process.env.KVGATE_BENCH_MAX_MIB ?? 1024)
const ms = (t0: number) => performance.now() - t0
const gbps = (bytes: number, millis: number) => bytes / 1e9 / (millis / 1e3)

// ---- 1. allocation ---------------------------------------------------------
interface AllocRow {
  mib: number
  pinnedMs: number
  kind: string
  allocUnsafeMs: number
  allocUnsafeFillMs: number
}
const allocRows: AllocRow[] = []
let pinnedReason = ''
for (const mib of [32, 128, 512, 1024].filter((m) => m <= maxMiB)) {
  const bytes = mib * MiB
  const repeats = mib >= 512 ? 3 : 7
  const pinned: number[] = []
  const unsafe: number[] = []
  const unsafeFill: number[] = []
  let kind = ''
  for (let i = 0; i < repeats + 1; i++) {
    let t = performance.now()
    const a = await allocPinned(bytes, { cuda: false }) // mmap + mlock: the L1 path without a GPU
    const p = ms(t)
    kind = a.kind
    pinnedReason = a.reason
    freePinned(a.buffer)
    t = performance.now()
    if (Buffer.allocUnsafe(bytes).length !== bytes) throw new Error('short allocation') // dropped at once
    const u = ms(t)
    gc()
    t = performance.now()
    if (Buffer.allocUnsafe(bytes).fill(0).length !== bytes) throw new Error('short allocation') // touches every page
    const uf = ms(t)
    gc()
    if (i === 0) continue // warm-up
    pinned.push(p)
    unsafe.push(u)
    unsafeFill.push(uf)
  }
  allocRows.push({
    mib,
    pinnedMs: median(pinned),
    kind,
    allocUnsafeMs: median(unsafe),
    allocUnsafeFillMs: median(unsafeFill),
  })
}
console.log(
  '\n1. Allocation, median ms (pinned = allocPinned({cuda:false}): mmap + mlock, off the JS thread)',
)
console.log(`   pinned kind: ${pinnedReason}`)
console.log(
  table([
    ['MiB', 'allocPinned', 'kind', 'Buffer.allocUnsafe', 'allocUnsafe + fill(0)', 'pinned / (unsafe+fill)'],
    ...allocRows.map((r) => [
      r.mib,
      r.pinnedMs.toFixed(2),
      r.kind,
      r.allocUnsafeMs.toFixed(3),
      r.allocUnsafeFillMs.toFixed(2),
      (r.pinnedMs / r.allocUnsafeFillMs).toFixed(2),
    ]),
  ]),
)

// ---- 2. copies -------------------------------------------------------------
const status = cuda.status()
const CHUNK = 32 * MiB // one 256-token chunk of Llama-3.1-8B bf16 KV
const copyRepeats = 15
interface CopyRow {
  blockKiB: number
  descriptors: number
  /** One memcpy of 32 MiB timed in the same repeats as this row. */
  memcpyGBs: number
  gatherGBs: number
  scatterGBs: number
  jsGatherGBs: number
}
const copyRows: CopyRow[] = []
let memcpyGBs = 0
if (status.available) {
  const poolBytes = 2 * CHUNK
  const pool = cuda.deviceAlloc(poolBytes)
  const hostPool = new Uint8Array(poolBytes)
  for (let i = 0; i < poolBytes; i += 4096) hostPool[i] = i >>> 12
  await cuda.copyToDevice(hostPool, pool)
  const chunk = allocPinnedSync(CHUNK)
  const dst = new Uint8Array(chunk.buffer)

  const src = hostPool.subarray(0, CHUNK)
  // The memcpy baseline is timed inside every repeat below, beside the figure,
  // so load from other processes hits both alike.
  const memcpyAll: number[] = []

  // Llama-3.1-8B, 16-token pages: a K or V page of one layer is 16 × 8 heads ×
  // 128 × 2 B = 32 KiB, so a chunk is 32 layers × 2 × 16 pages = 1024 blocks.
  for (const blockKiB of [4, 32, 256, CHUNK / 1024]) {
    const block = blockKiB * 1024
    const n = CHUNK / block
    // Every other pool slot: no two blocks adjacent on the device side, so no
    // descriptor merging flatters the figure (except the one-block case).
    const gather = new BigInt64Array(n * 3)
    const scatter = new BigInt64Array(n * 3)
    for (let i = 0; i < n; i++) {
      const slot = BigInt(((2 * i) % (poolBytes / block)) * block)
      gather.set([pool + slot, BigInt(i * block), BigInt(block)], i * 3)
      scatter.set([BigInt(i * block), pool + slot, BigInt(block)], i * 3)
    }
    const g: number[] = []
    const s: number[] = []
    const js: number[] = []
    const mc: number[] = []
    for (let i = 0; i < copyRepeats + 2; i++) {
      let t = performance.now()
      dst.set(src)
      const mt = ms(t)
      t = performance.now()
      await cuda.copyBatch('d2h', chunk.buffer, gather)
      const gt = ms(t)
      t = performance.now()
      await cuda.copyBatch('h2d', chunk.buffer, scatter)
      const st = ms(t)
      t = performance.now()
      for (let b = 0; b < n; b++) {
        const off = ((2 * b) % (poolBytes / block)) * block
        dst.set(hostPool.subarray(off, off + block), b * block)
      }
      const jt = ms(t)
      if (i < 2) continue
      mc.push(mt)
      g.push(gt)
      s.push(st)
      js.push(jt)
    }
    memcpyAll.push(...mc)
    copyRows.push({
      blockKiB,
      descriptors: n,
      memcpyGBs: gbps(CHUNK, median(mc)),
      gatherGBs: gbps(CHUNK, median(g)),
      scatterGBs: gbps(CHUNK, median(s)),
      jsGatherGBs: gbps(CHUNK, median(js)),
    })
  }
  memcpyGBs = gbps(CHUNK, median(memcpyAll))
  freePinned(chunk.buffer)
  cuda.deviceFree(pool)
  console.log(`\n2. Host copies of a 32 MiB chunk, median of ${copyRepeats}, GB/s (CUDA: ${status.library})`)
  console.log('   baseline: one memcpy (TypedArray.set) of 32 MiB, timed in the same repeats as each row')
  console.log(
    table([
      [
        'block',
        'descriptors',
        'memcpy',
        'batched gather d2h',
        'batched scatter h2d',
        'JS gather (set per block)',
        'gather / memcpy',
      ],
      ...copyRows.map((r) => [
        `${r.blockKiB} KiB`,
        r.descriptors,
        r.memcpyGBs.toFixed(2),
        r.gatherGBs.toFixed(2),
        r.scatterGBs.toFixed(2),
        r.jsGatherGBs.toFixed(2),
        (r.gatherGBs / r.memcpyGBs).toFixed(2),
      ]),
    ]),
  )
} else {
  console.log(`\n2. Host copies: skipped, CUDA unavailable (${status.reason}); run scripts/build-native.sh`)
}

// ---- 3. file reads ---------------------------------------------------------
const dir = mkdtempSync(join(tmpdir(), 'kvgate-bench-native-'))
const file = join(dir, 'chunk.bin')
let dropCaches = 'echo 3 > /proc/sys/vm/drop_caches: '
try {
  writeFileSync('/proc/sys/vm/drop_caches', '3')
  dropCaches += 'done once; each cold run also evicts the file with POSIX_FADV_DONTNEED'
} catch (e) {
  dropCaches += `not permitted (${(e as NodeJS.ErrnoException).code}); cold runs use POSIX_FADV_DONTNEED on the file instead`
}
const ioRepeats = 7
const buf = allocPinnedSync(CHUNK)
const data = new Uint8Array(buf.buffer)
for (let i = 0; i < CHUNK; i += 512) data[i] = i & 255
const w = await writeFileDirect(file, data, { fsync: true })
const io = {
  direct: [] as number[],
  bufferedCold: [] as number[],
  bufferedWarm: [] as number[],
  nodeWarm: [] as number[],
}
let directUsed = w.direct
for (let i = 0; i < ioRepeats + 1; i++) {
  await evictFileCache(file)
  let t = performance.now()
  const r = await readFileDirect(file, buf.buffer, { direct: 'auto' })
  const d = ms(t)
  directUsed &&= r.direct
  await evictFileCache(file)
  t = performance.now()
  await readFileDirect(file, buf.buffer, { direct: 'off' })
  const bc = ms(t)
  t = performance.now()
  await readFileDirect(file, buf.buffer, { direct: 'off' })
  const bw = ms(t)
  t = performance.now()
  await readFile(file)
  const nw = ms(t)
  if (i === 0) continue
  io.direct.push(d)
  io.bufferedCold.push(bc)
  io.bufferedWarm.push(bw)
  io.nodeWarm.push(nw)
}
freePinned(buf.buffer)
rmSync(dir, { recursive: true, force: true })
const ioGBs = {
  direct: gbps(CHUNK, median(io.direct)),
  bufferedCold: gbps(CHUNK, median(io.bufferedCold)),
  bufferedWarm: gbps(CHUNK, median(io.bufferedWarm)),
  nodeWarm: gbps(CHUNK, median(io.nodeWarm)),
}
console.log(`\n3. Reading a 32 MiB file (${tmpdir()}), median of ${ioRepeats}, GB/s`)
console.log(`   ${dropCaches}`)
console.log(`   O_DIRECT used: ${directUsed}${w.direct ? '' : ` (${w.reason})`}`)
console.log(
  table([
    ['path', 'GB/s', 'vs buffered cold'],
    [
      'readFileDirect O_DIRECT (cold by nature)',
      ioGBs.direct.toFixed(2),
      (ioGBs.direct / ioGBs.bufferedCold).toFixed(2),
    ],
    ['readFileDirect buffered, cold (after DONTNEED)', ioGBs.bufferedCold.toFixed(2), '1.00'],
    [
      'readFileDirect buffered, warm page cache',
      ioGBs.bufferedWarm.toFixed(2),
      (ioGBs.bufferedWarm / ioGBs.bufferedCold).toFixed(2),
    ],
    [
      'node fs.readFile, warm page cache',
      ioGBs.nodeWarm.toFixed(2),
      (ioGBs.nodeWarm / ioGBs.bufferedCold).toFixed(2),
    ],
  ]),
)

// ---- results ---------------------------------------------------------------
const row32 = copyRows.find((r) => r.blockKiB === 32)
const bars = []
if (row32) {
  bars.push({
    bar: 'Batched gather of a 32 MiB chunk as 1024 × 32 KiB blocks (stub CUDA) vs one memcpy',
    figure: row32.gatherGBs,
    unit: 'GB/s',
    baseline: row32.memcpyGBs,
    baselineLabel: 'TypedArray.set of 32 MiB, same repeats',
    ratio: row32.gatherGBs / row32.memcpyGBs,
    target: '≥ 0.8× memcpy (the L1 bar’s shape)',
    met: row32.gatherGBs / row32.memcpyGBs >= 0.8,
    informational: true,
  })
}
bars.push({
  bar: 'O_DIRECT read of a 32 MiB file vs buffered cold read of the same file',
  figure: ioGBs.direct,
  unit: 'GB/s',
  baseline: ioGBs.bufferedCold,
  baselineLabel: 'buffered read after POSIX_FADV_DONTNEED',
  ratio: ioGBs.direct / ioGBs.bufferedCold,
  target: '≥ 0.8× raw sequential read (L2 bar)',
  met: ioGBs.direct / ioGBs.bufferedCold >= 0.8,
  informational: true,
})
const path = writeResult({
  name: 'native',
  date: new Date().toISOString(),
  machine: await machineLine(),
  cuda: { library: status.library, available: status.available, stub: status.stub },
  allocation: { rows: allocRows, pinnedReason },
  copies: { chunkBytes: CHUNK, memcpyGBs, rows: copyRows },
  io: { fileBytes: CHUNK, gbps: ioGBs, directUsed, dropCaches },
  bars,
})
const lastAlloc = allocRows[allocRows.length - 1]
const svg = stackSvgs([
  ...(lastAlloc
    ? [
        figureChart(`Allocation of ${lastAlloc.mib} MiB`, 'ms (lower is better)', [
          { label: `allocPinned (${lastAlloc.kind})`, value: lastAlloc.pinnedMs },
          { label: 'Buffer.allocUnsafe + fill(0)', value: lastAlloc.allocUnsafeFillMs, baseline: true },
          { label: 'Buffer.allocUnsafe (pages untouched)', value: lastAlloc.allocUnsafeMs, baseline: true },
        ]),
      ]
    : []),
  figureChart('Host copy of a 32 MiB chunk (stub CUDA)', 'GB/s', [
    { label: 'memcpy (TypedArray.set)', value: memcpyGBs, baseline: true },
    ...copyRows.map((r) => ({
      label: `batched gather ${r.descriptors} × ${r.blockKiB} KiB`,
      value: r.gatherGBs,
    })),
    ...copyRows.map((r) => ({
      label: `JS gather ${r.descriptors} × ${r.blockKiB} KiB`,
      value: r.jsGatherGBs,
      baseline: true,
    })),
  ]),
  figureChart('Read a 32 MiB file', 'GB/s', [
    { label: 'O_DIRECT', value: ioGBs.direct },
    { label: 'buffered, cold', value: ioGBs.bufferedCold, baseline: true },
    { label: 'buffered, warm', value: ioGBs.bufferedWarm, baseline: true },
  ]),
])
writeFileSync(join(RESULTS_DIR, 'native.svg'), svg)
console.log(`\nwrote ${path} and ${join(RESULTS_DIR, 'native.svg')}`)
