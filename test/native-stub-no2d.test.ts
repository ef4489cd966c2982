// copy2D against a libcudart without cudaMemcpy2DAsync (the stub built with
// -DKVGATE_STUB_NO_MEMCPY2D): every row is its own cudaMemcpyAsync, with the same bytes,
// the same checks and the same failure handling. Own file = own process (the loaded
// libcudart is fixed per process).

import { existsSync } from 'node:fs'
import { resolve } from 'node:path'
import { afterAll, beforeEach, describe, expect, it } from 'vitest'
import { nativePaths } from '../src/client/native.ts'
import { pattern, same } from './support/bytes.ts'
import { rejectsWith } from './support/native-errors.ts'

const NO2D = resolve(nativePaths.stubCudart, '../libcudart_stub_no2d.so')
process.env.KVGATE_CUDART = NO2D
const native = await import('../src/client/native.ts')
const { allocPinnedSync, cuda, freePinned, pinnedInfo } = native

const why = (() => {
  if (!existsSync(NO2D)) return `${NO2D} is not built (scripts/build-native.sh)`
  try {
    return cuda.status().available ? undefined : cuda.status().reason
  } catch (e) {
    return (e as Error).message
  }
})()

describe.skipIf(why !== undefined)('copy2D without cudaMemcpy2DAsync', () => {
  let baseline = -1
  beforeEach(() => {
    cuda.stubControl('reset')
    if (baseline < 0) baseline = cuda.stubControl('')
  })
  afterAll(() => {
    cuda.stubControl('reset')
    expect(cuda.stubControl('')).toBe(baseline)
  })

  it('is reported missing', () => {
    expect(cuda.status()).toMatchObject({ available: true, stub: true, memcpy2D: false })
  })

  it('issues one cudaMemcpyAsync per row, byte-exact both ways', async () => {
    const d = cuda.deviceAlloc(8192)
    const dev = pattern(8192, 4)
    await cuda.copyToDevice(dev, d)
    // 8 rows of 16 bytes, 48 apart on the device and 16 apart on the host; then one row of 100.
    const desc = new Float64Array([256, 0, 16, 8, 48, 16, 5000, 200, 100, 1, 0, 0])
    const host = new Uint8Array(400)
    const before = cuda.stubControl('calls=cudaMemcpyAsync@0')
    expect(await cuda.copy2D('d2h', host, d, desc)).toEqual({ descriptors: 2, issued: 9, bytes: 228 })
    expect(cuda.stubControl('calls=cudaMemcpyAsync@0') - before).toBe(9)
    for (let r = 0; r < 8; r++)
      expect(same(host.subarray(r * 16, r * 16 + 16), dev.subarray(256 + r * 48, 256 + r * 48 + 16))).toBe(
        true,
      )
    expect(same(host.subarray(200, 300), dev.subarray(5000, 5100))).toBe(true)
    expect(host.subarray(128, 200).every((v) => v === 0)).toBe(true)

    const fresh = pattern(400, 9)
    await cuda.copy2D('h2d', fresh, d, desc)
    const back = new Uint8Array(8192)
    await cuda.copyFromDevice(d, back)
    const want = dev.slice()
    for (let r = 0; r < 8; r++) want.set(fresh.subarray(r * 16, r * 16 + 16), 256 + r * 48)
    want.set(fresh.subarray(200, 300), 5000)
    expect(same(back, want)).toBe(true)
    cuda.deviceFree(d)
  })

  it('a row that fails midway rejects with ERR_CUDA and leaves the host buffer released', async () => {
    const d = cuda.deviceAlloc(8192)
    const p = allocPinnedSync(4096)
    cuda.stubControl('cudaMemcpyAsync=2@5*1') // the sixth row fails, once
    const e = await rejectsWith(
      cuda.copy2D('h2d', p.buffer, d, new Float64Array([0, 0, 16, 8, 48, 16])),
      'ERR_CUDA',
      /cudaMemcpyAsync failed: out of memory/,
    )
    expect(e.cudaError).toBe(2)
    expect(pinnedInfo(p.buffer)?.busy).toBe(0)
    freePinned(p.buffer)
    cuda.deviceFree(d)
  })
})
