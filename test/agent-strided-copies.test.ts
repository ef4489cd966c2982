// The agent's GPU copies as strided (2-D) copies: run lists compressed into descriptors
// (src/agent/strided-copies.ts) and moved by the addon's copy2D through the stub libcudart,
// byte for byte what the runs describe, for vLLM's packed K/V layouts (NHD, HND), the old
// one-run-per-block layouts and lists that fit no pattern. Own file = own process (the
// loaded libcudart is fixed per process).

import { afterAll, beforeEach, describe, expect, it } from 'vitest'
import { nativePaths } from '../src/client/native.ts'
import { pattern, same } from './support/bytes.ts'
import { rejectsWith } from './support/native-errors.ts'

process.env.KVGATE_CUDART = nativePaths.stubCudart
const native = await import('../src/client/native.ts')
const { allocPinnedSync, cuda, freePinned, pinnedInfo } = native
const { DeviceTensor } = await import('../src/agent/device-tensor.ts')
const { MIN_ROWS, STRIDED_FIELDS, stridedCopies } = await import('../src/agent/strided-copies.ts')

const stub = (() => {
  try {
    return cuda.status().available ? undefined : cuda.status().reason
  } catch (e) {
    return (e as Error).message
  }
})()

/** Descriptors as rows of 6 numbers, for readable assertions. */
function rows(d: Float64Array): number[][] {
  const out: number[][] = []
  for (let i = 0; i < d.length; i += STRIDED_FIELDS) out.push([...d.subarray(i, i + STRIDED_FIELDS)])
  return out
}

// One layer of a packed engine KV: N tokens per block, H KV heads of D elements of E bytes,
// K and V side by side in the last dimension ([.., 2·D]).
const N = 16
const H = 4
const D = 8
const E = 2
const DE = D * E
const BLOCK = N * H * 2 * DE // one block of one layer (K and V)
const NUM_BLOCKS = 12

type Packed = 'nhd' | 'hnd'

/**
 * The runs ([tensorOffset, hostOffset, bytes]) of a chunk of `ids` in host order: the chunk
 * tensor is [K|V][token][head][dim]; the engine's is [blocks, N, H, 2D] (NHD) or [blocks, H, N, 2D] (HND).
 */
function packedRuns(layout: Packed, ids: readonly number[]): number[] {
  const runs: number[] = []
  for (let side = 0; side < 2; side++)
    ids.forEach((id, j) => {
      for (let t = 0; t < N; t++)
        for (let h = 0; h < H; h++) {
          const inBlock = layout === 'nhd' ? (t * H + h) * 2 * DE : (h * N + t) * 2 * DE
          const host = (((side * ids.length + j) * N + t) * H + h) * DE
          runs.push(id * BLOCK + inBlock + side * DE, host, DE)
        }
    })
  return runs
}

/** The old layouts' runs: one per block and side (FlashAttention [2, blocks, ..] or FlashInfer [blocks, 2, ..]). */
function blockRuns(layout: 'flash-attn' | 'flashinfer', ids: readonly number[], bb: number): number[] {
  const runs: number[] = []
  for (let side = 0; side < 2; side++)
    ids.forEach((id, j) => {
      const at = layout === 'flash-attn' ? (side * NUM_BLOCKS + id) * bb : (id * 2 + side) * bb
      runs.push(at, (side * ids.length + j) * bb, bb)
    })
  return runs
}

/** What copyBatch issues for the same runs: zero-length dropped, runs contiguous on both sides merged. */
function mergedRuns(runs: readonly number[]): number[][] {
  const out: number[][] = []
  for (let i = 0; i < runs.length; i += 3) {
    const [t, h, w] = [runs[i]!, runs[i + 1]!, runs[i + 2]!]
    if (w === 0) continue
    const last = out[out.length - 1]
    if (last && last[0]! + last[2]! === t && last[1]! + last[2]! === h) last[2]! += w
    else out.push([t, h, w])
  }
  return out.map(([t, h, w]) => [t!, h!, w!, 1, w!, w!])
}

/** Every row the descriptors cover, as [tensorOffset, hostOffset, width], in issue order. */
function expand(d: Float64Array): number[][] {
  const out: number[][] = []
  for (const [t, h, w, height, pt, ph] of rows(d))
    for (let r = 0; r < height!; r++) out.push([t! + r * pt!, h! + r * ph!, w!])
  return out
}

/** The merged runs, split into the rows of their widths (for comparing what is covered, not how). */
function covered(runs: readonly number[]): string[] {
  return mergedRuns(runs)
    .map(([t, h, w]) => `${t}:${h}:${w}`)
    .sort()
}

describe('stridedCopies (run lists → 2-D descriptors)', () => {
  it('NHD packed: the K (or V) of one block is one 2-D copy of N·H rows', () => {
    const d = rows(stridedCopies(packedRuns('nhd', [9])))
    expect(d).toEqual([
      [9 * BLOCK, 0, DE, N * H, 2 * DE, DE],
      [9 * BLOCK + DE, N * H * DE, DE, N * H, 2 * DE, DE],
    ])
    // Blocks that are not neighbours: two copies per block; neighbours (3, 4, 5) continue one copy.
    expect(rows(stridedCopies(packedRuns('nhd', [9, 2, 5, 0]))).length).toBe(2 * 4)
    const joined = rows(stridedCopies(packedRuns('nhd', [3, 4, 5, 8])))
    expect(joined.map((r) => r[3])).toEqual([3 * N * H, N * H, 3 * N * H, N * H])
  })

  it('HND packed: per head, one 2-D copy of N rows (tensor pitch 2·D·e, host pitch H·D·e)', () => {
    const d = rows(stridedCopies(packedRuns('hnd', [7])))
    expect(d).toHaveLength(2 * H)
    for (let side = 0; side < 2; side++)
      for (let h = 0; h < H; h++)
        expect(d[side * H + h]).toEqual([
          7 * BLOCK + h * N * 2 * DE + side * DE,
          side * N * H * DE + h * DE,
          DE,
          N,
          2 * DE,
          H * DE,
        ])
    expect(rows(stridedCopies(packedRuns('hnd', [9, 2, 5, 0])))).toHaveLength(2 * 4 * H)
  })

  it('covers exactly the rows of the runs, in any layout', () => {
    for (const runs of [
      packedRuns('nhd', [9, 2, 5, 0]),
      packedRuns('nhd', [3, 4, 5, 8]),
      packedRuns('hnd', [9, 2, 5, 0]),
      packedRuns('hnd', [0, 1, 2, 3]),
      blockRuns('flashinfer', [0, 1, 2, 3], 512),
    ]) {
      const split = expand(stridedCopies(runs))
        .map(([t, h, w]) => `${t}:${h}:${w}`)
        .sort()
      expect(split).toEqual(covered(runs))
    }
  })

  it('old one-run-per-block layouts: the height-1 merged runs copyBatch issues', () => {
    for (const ids of [
      [6, 1],
      [4, 5],
      [0, 7],
      [0, 1, 2, 3],
      [11, 3, 8, 2, 9],
      [2, 3, 7, 8],
    ]) {
      const runs = blockRuns('flash-attn', ids, 512)
      expect(rows(stridedCopies(runs))).toEqual(mergedRuns(runs))
    }
    // FlashInfer with ids that are not evenly spaced: the same.
    const runs = blockRuns('flashinfer', [5, 1, 8, 2], 512)
    expect(rows(stridedCopies(runs))).toEqual(mergedRuns(runs))
  })

  it('old layouts whose blocks are evenly spaced (FlashInfer, consecutive ids) become 2-D copies', () => {
    // K of block i at i·2·bb: rows a pitch of 2·bb apart, like a packed layout's heads.
    const d = rows(stridedCopies(blockRuns('flashinfer', [0, 1, 2, 3], 512)))
    expect(d).toEqual([
      [0, 0, 512, 4, 1024, 512],
      [512, 4 * 512, 512, 4, 1024, 512],
    ])
  })

  it('a mixed list: broken patterns, negative deltas and overlapping pitches stay height 1', () => {
    const runs = [
      // A pattern broken midway (rows 0..2 at pitch 32, then the pitch changes to 48).
      0, 0, 16, 32, 16, 16, 64, 32, 16, 112, 48, 16, 160, 64, 16, 208, 80, 16,
      // Negative deltas (descending tensor offsets).
      1000, 100, 16, 968, 116, 16, 936, 132, 16,
      // Tensor pitch < width (overlapping rows): 32-byte runs 16 apart.
      2000, 200, 32, 2016, 232, 32, 2032, 264, 32,
      // Host pitch < width.
      3000, 300, 32, 3064, 316, 32, 3128, 332, 32,
      // Contiguous on both sides (merged), and a zero-length run between.
      4000, 400, 16, 4016, 416, 0, 4016, 416, 16,
    ]
    expect(rows(stridedCopies(runs))).toEqual([
      [0, 0, 16, 3, 32, 16],
      [112, 48, 16, 3, 48, 16],
      [1000, 100, 16, 1, 16, 16],
      [968, 116, 16, 1, 16, 16],
      [936, 132, 16, 1, 16, 16],
      [2000, 200, 32, 1, 32, 32],
      [2016, 232, 32, 1, 32, 32],
      [2032, 264, 32, 1, 32, 32],
      [3000, 300, 32, 1, 32, 32],
      [3064, 316, 32, 1, 32, 32],
      [3128, 332, 32, 1, 32, 32],
      [4000, 400, 32, 1, 32, 32],
    ])
  })

  it(`a list where only some runs fit; two rows a pitch apart stay two copies (MIN_ROWS ${MIN_ROWS})`, () => {
    const block = packedRuns('nhd', [2]).slice(0, N * H * 3) // the K of one block
    const runs = [5000, 0, 8, ...block.map((v, i) => (i % 3 === 1 ? v + 8 : v)), 9000, 8 + N * H * DE, 64]
    expect(rows(stridedCopies(runs))).toEqual([
      [5000, 0, 8, 1, 8, 8],
      [2 * BLOCK, 8, DE, N * H, 2 * DE, DE],
      [9000, 8 + N * H * DE, 64, 1, 64, 64],
    ])
    expect(rows(stridedCopies([0, 0, 16, 64, 16, 16]))).toEqual([
      [0, 0, 16, 1, 16, 16],
      [64, 16, 16, 1, 16, 16],
    ])
    // A pitch of 2^31 or more is not a 2-D copy.
    const far = 2 ** 31
    expect(rows(stridedCopies([0, 0, 16, far, 16, 16, 2 * far, 32, 16])).map((r) => r[3])).toEqual([1, 1, 1])
  })

  it('malformed runs are kept alone and unmerged (the addon refuses them); a ragged list throws', () => {
    expect(rows(stridedCopies([0, 0, 10, 10, 10, -5]))).toEqual([
      [0, 0, 10, 1, 10, 10],
      [10, 10, -5, 1, -5, -5],
    ])
    expect(rows(stridedCopies([0, 0, 0.5, 0.5, 0.5, 0.5]))).toHaveLength(2)
    expect(rows(stridedCopies([-16, 0, 16, 0, 16, 16, 16, 32, 16, 32, 48, 16]))[0]).toEqual([
      -16, 0, 16, 1, 16, 16,
    ])
    expect(() => stridedCopies([0, 0])).toThrow(RangeError)
  })
})

describe.skipIf(stub !== undefined)('DeviceTensor gather / scatter as 2-D copies (stub libcudart)', () => {
  let baseline = 0
  const calls = (fn: string) => cuda.stubControl(`calls=${fn}@0`)

  beforeEach(() => {
    cuda.stubControl('reset')
    if (baseline === 0) baseline = cuda.stubControl('')
  })
  afterAll(() => {
    cuda.stubControl('reset')
    expect(cuda.stubControl('')).toBe(baseline) // no device memory, host pinning or mapping left
  })

  /** An engine layer tensor in device memory at an offset into its allocation, and its bytes mirrored here. */
  async function engine(bytes: number, offset = 4096) {
    const base = cuda.deviceAlloc(offset + bytes)
    const all = pattern(offset + bytes, 31)
    await cuda.copyToDevice(all, base)
    return {
      base,
      mirror: all.subarray(offset),
      tensor: new DeviceTensor(native, 0, base, offset, bytes),
      async read() {
        const out = new Uint8Array(offset + bytes)
        await cuda.copyFromDevice(base, out)
        return out.subarray(offset)
      },
    }
  }

  /** What the runs give applied one by one, in order: the reference. */
  function gatherRef(runs: readonly number[], src: Uint8Array, host: Uint8Array) {
    for (let i = 0; i < runs.length; i += 3)
      host.set(src.subarray(runs[i]!, runs[i]! + runs[i + 2]!), runs[i + 1]!)
  }
  function scatterRef(runs: readonly number[], host: Uint8Array, dst: Uint8Array) {
    for (let i = 0; i < runs.length; i += 3)
      dst.set(host.subarray(runs[i + 1]!, runs[i + 1]! + runs[i + 2]!), runs[i]!)
  }

  /** Gathers and scatters `runs` through a DeviceTensor; asserts byte equality with the reference both ways. */
  async function roundTrip(runs: number[], tensorBytes: number, hostBytes: number) {
    const e = await engine(tensorBytes)
    const pinned = allocPinnedSync(hostBytes + 512)
    const host = new Uint8Array(pinned.buffer, 256, hostBytes) // a view, as the agent passes a layer's slab
    host.set(pattern(hostBytes, 3))
    const want = host.slice()
    gatherRef(runs, e.mirror, want)
    await e.tensor.gather(runs, host)
    expect(same(host, want)).toBe(true)
    const fresh = pattern(hostBytes, 77)
    host.set(fresh)
    const dev = e.mirror.slice()
    scatterRef(runs, fresh, dev)
    await e.tensor.scatter(host, runs)
    expect(same(await e.read(), dev)).toBe(true)
    expect(pinnedInfo(pinned.buffer)?.busy).toBe(0)
    freePinned(pinned.buffer)
    cuda.deviceFree(e.base)
  }

  it('reports cudaMemcpy2DAsync present', () => {
    expect(cuda.status().memcpy2D).toBe(true)
  })

  it('NHD packed: byte-exact both ways, with 2 × blocks 2-D copies and no 1-D ones', async () => {
    const ids = [9, 2, 5, 0]
    const runs = packedRuns('nhd', ids)
    expect(runs.length / 3).toBe(2 * ids.length * N * H)
    await roundTrip(runs, NUM_BLOCKS * BLOCK, ids.length * BLOCK)
    // Both directions: gather then scatter.
    expect(calls('cudaMemcpy2DAsync')).toBe(2 * (2 * ids.length))
    // The only 1-D copies were the test's own fill and read-back.
    expect(calls('cudaMemcpyAsync')).toBe(2)
  })

  it('NHD packed with neighbouring blocks: fewer 2-D copies still', async () => {
    await roundTrip(packedRuns('nhd', [3, 4, 5, 8]), NUM_BLOCKS * BLOCK, 4 * BLOCK)
    expect(calls('cudaMemcpy2DAsync')).toBe(2 * 4)
  })

  it('HND packed: byte-exact both ways, one 2-D copy per head, block and side', async () => {
    const ids = [9, 2, 5, 0]
    await roundTrip(packedRuns('hnd', ids), NUM_BLOCKS * BLOCK, ids.length * BLOCK)
    expect(calls('cudaMemcpy2DAsync')).toBe(2 * (2 * ids.length * H))
  })

  it('old layouts: the copies copyBatch issues (1-D, merged), no 2-D ones', async () => {
    const bb = 512
    for (const ids of [
      [6, 1],
      [4, 5],
      [11, 3, 8, 2, 9],
    ]) {
      cuda.stubControl('reset')
      const runs = blockRuns('flash-attn', ids, bb)
      await roundTrip(runs, 2 * NUM_BLOCKS * bb, 2 * ids.length * bb)
      expect(calls('cudaMemcpy2DAsync')).toBe(0)
      expect(calls('cudaMemcpyAsync')).toBe(2 + 2 * mergedRuns(runs).length)
    }
  })

  it('a mixed list, and one where only some runs fit: byte-exact in order (overlapping runs too)', async () => {
    const mixed = [
      ...[0, 0, 16, 32, 16, 16, 64, 32, 16, 112, 48, 16, 160, 64, 16, 208, 80, 16],
      ...[1000, 100, 16, 968, 116, 16, 936, 132, 16],
      ...[2000, 200, 32, 2016, 232, 32, 2032, 264, 32],
      // Host rows overlap: later runs overwrite earlier ones (gather), as copies in order do.
      ...[3000, 300, 32, 3064, 316, 32, 3128, 332, 32],
      ...[4000, 400, 16, 4016, 416, 0, 4016, 416, 16],
    ]
    await roundTrip(mixed, 8192, 512)
    expect(calls('cudaMemcpy2DAsync')).toBe(2 * 2)
    const block = packedRuns('nhd', [2]).slice(0, N * H * 3)
    const some = [5000, 0, 8, ...block.map((v, i) => (i % 3 === 1 ? v + 8 : v)), 9000, 8 + N * H * DE, 64]
    cuda.stubControl('reset')
    await roundTrip(some, NUM_BLOCKS * BLOCK, 8 + N * H * DE + 64)
    expect(calls('cudaMemcpy2DAsync')).toBe(2)
    expect(calls('cudaMemcpyAsync')).toBe(2 + 2 * 2)
  })

  it('an injected cudaMemcpy2DAsync failure rejects with ERR_CUDA and leaves the host buffer released', async () => {
    const ids = [9, 2, 5, 0]
    const e = await engine(NUM_BLOCKS * BLOCK)
    const pinned = allocPinnedSync(ids.length * BLOCK)
    cuda.stubControl('cudaMemcpy2DAsync=2@3*1') // the fourth 2-D copy of the gather fails, once
    const err = await rejectsWith(
      e.tensor.gather(packedRuns('nhd', ids), new Uint8Array(pinned.buffer)),
      'ERR_CUDA',
      /cudaMemcpy2DAsync failed: out of memory/,
    )
    expect(err.cudaError).toBe(2)
    expect(err.syscall).toBe('cudaMemcpy2DAsync')
    expect(pinnedInfo(pinned.buffer)?.busy).toBe(0)
    freePinned(pinned.buffer) // released: freeing it succeeds
    // The rule was used up: the next copies succeed.
    const again = allocPinnedSync(ids.length * BLOCK)
    await e.tensor.scatter(new Uint8Array(again.buffer), packedRuns('nhd', ids))
    freePinned(again.buffer)
    cuda.deviceFree(e.base)
  })

  it('runs past the tensor (inside its allocation) are ERR_INVALID_ARGUMENT before any byte moves, both ways', async () => {
    const e = await engine(8192)
    // The registered tensor is the allocation's first 4 KiB past the offset: the rest is the engine's.
    const tensor = new DeviceTensor(native, 0, e.base, 4096, 4096)
    for (const runs of [
      [4096 - 16, 0, 17],
      [0, 0, 16, 4096, 16, 16],
      packedRuns('nhd', [0]).map((x, i) => (i % 3 === 0 ? x + 4096 - BLOCK + 2 : x)),
    ]) {
      const slab = new Uint8Array(2 * BLOCK).fill(9)
      for (const copy of [() => tensor.scatter(slab, runs), () => tensor.gather(runs, slab)])
        await expect(copy()).rejects.toMatchObject({ code: 'ERR_INVALID_ARGUMENT' })
      expect(same(await e.read(), e.mirror)).toBe(true)
      expect(slab.every((b) => b === 9)).toBe(true)
    }
    cuda.deviceFree(e.base)
  })

  it('malformed runs are refused before any byte moves', async () => {
    const e = await engine(8192)
    const host = new Uint8Array(1024).fill(9)
    for (const runs of [
      [0, 0, 16, 32, 16, -16],
      [0, 0, 16, 32, 1020, 16],
      [0, 0, 16, 0.5, 16, 16],
      [0, 0, 16, Number.NaN, 16, 16],
    ]) {
      await rejectsWith(e.tensor.scatter(host, runs), 'ERR_NATIVE', /descriptor 1/)
      expect(same(await e.read(), e.mirror)).toBe(true)
    }
    cuda.deviceFree(e.base)
  })
})

describe.skipIf(stub !== undefined)('cuda.copy2D (stub libcudart)', () => {
  it('refuses malformed descriptors before anything is queued', async () => {
    const d = cuda.deviceAlloc(4096)
    await cuda.copyToDevice(new Uint8Array(4096).fill(7), d)
    const host = new Uint8Array(1024).fill(1)
    const untouched = async () => {
      const out = new Uint8Array(4096)
      await cuda.copyFromDevice(d, out)
      expect(out.every((v) => v === 7)).toBe(true) // the valid first descriptor did not run
    }
    const ok = [0, 0, 16, 4, 32, 16] // rows 0..3: host [0, 64), device [0, 112)
    const bad: [number[], RegExp][] = [
      [[0, 976, 16, 4, 32, 16], /descriptor 1: host rows \[976, \+64\) run outside the 1024-byte host range/],
      [[0, -1, 16, 1, 16, 16], /descriptor 1: host offset must be a non-negative safe integer/],
      [[0.5, 0, 16, 1, 16, 16], /descriptor 1: device offset/],
      [[0, 0, Number.NaN, 1, 16, 16], /descriptor 1: width/],
      [[0, 0, 16, 2, 8, 16], /descriptor 1: pitches must be at least the width/], // device pitch < width
      [[0, 0, 16, 2, 16, 8], /descriptor 1: pitches must be at least the width/], // host pitch < width
      [[0, 0, 16, 2, 2 ** 31, 16], /below 2\^31/],
      [[0, 0, 16, 0, 16, 16], /descriptor 1: height must be 1/],
      [[0, 0, 16, 2 ** 31, 16, 16], /descriptor 1: height must be 1/],
    ]
    for (const [desc, msg] of bad) {
      await rejectsWith(cuda.copy2D('h2d', host, d, new Float64Array([...ok, ...desc])), 'ERR_NATIVE', msg)
      await untouched()
    }
    await rejectsWith(
      cuda.copy2D('h2d', host, 2n ** 64n - 4096n, new Float64Array([...ok, 2 ** 53 - 1, 0, 16, 1, 16, 16])),
      'ERR_NATIVE',
      /descriptor 1: device rows run past the end of the address space/,
    )
    await rejectsWith(cuda.copy2D('h2d', host, d, new Float64Array(5)), 'ERR_NATIVE', /6-tuples/)
    await rejectsWith(
      cuda.copy2D('h2d', host, d, [0, 0, 1, 1, 1, 1] as unknown as Float64Array),
      'ERR_NATIVE',
      /Float64Array/,
    )
    await rejectsWith(cuda.copy2D('d2d' as 'h2d', host, d, new Float64Array(6)), 'ERR_NATIVE', /direction/)
    await rejectsWith(cuda.copy2D('h2d', host, 0n, new Float64Array(6)), 'ERR_NATIVE', /device base/)
    await rejectsWith(cuda.copy2D('h2d', null as never, d, new Float64Array(6)), 'ERR_NATIVE')
    // The raw binding re-checks everything itself (C++ does not trust JS).
    const raw = native.loadNative().cuda
    expect(() =>
      raw.copy2D(1, host.buffer, 0, 1024, d, new Float64Array([0, 1000, 16, 2, 16, 16]), 0n),
    ).toThrow(/outside/)
    expect(() => raw.copy2D(3 as 1, host.buffer, 0, 1024, d, new Float64Array(6), 0n)).toThrow(/direction/)
    expect(() => raw.copy2D(1, host.buffer, 1000, 100, d, new Float64Array(6), 0n)).toThrow(
      /outside the buffer/,
    )
    // A device range the runtime rejects (rows past the allocation) is an ERR_CUDA error.
    const e = await rejectsWith(
      cuda.copy2D('h2d', host, d, new Float64Array([4000, 0, 16, 4, 32, 16])),
      'ERR_CUDA',
      /invalid argument/,
    )
    expect(e.cudaError).toBe(1)
    await untouched()
    cuda.deviceFree(d)
  })

  it('answers descriptors, calls issued and bytes; height 1 and zero widths as copyBatch', async () => {
    cuda.stubControl('reset')
    const d = cuda.deviceAlloc(4096)
    const host = pattern(1024, 8)
    const r = await cuda.copy2D(
      'h2d',
      host,
      d,
      new Float64Array([0, 0, 16, 4, 32, 16, 1000, 100, 50, 1, 0, 0, 2000, 0, 0, 3, 0, 0]),
    )
    expect(r).toEqual({ descriptors: 3, issued: 2, bytes: 4 * 16 + 50 })
    expect([
      cuda.stubControl('calls=cudaMemcpy2DAsync@0'),
      cuda.stubControl('calls=cudaMemcpyAsync@0'),
    ]).toEqual([1, 1])
    const out = new Uint8Array(4096)
    await cuda.copyFromDevice(d, out)
    for (let row = 0; row < 4; row++)
      expect(same(out.subarray(row * 32, row * 32 + 16), host.subarray(row * 16, row * 16 + 16))).toBe(true)
    expect(same(out.subarray(1000, 1050), host.subarray(100, 150))).toBe(true)
    cuda.deviceFree(d)
  })
})
