// The addon's per-call device (ipcOpen / copyBatch / ipcClose / createStream `device`) and
// PCI bus id resolution, through the stub libcudart with two devices. The stub counts each
// call by the device current when it ran and refuses work issued from the wrong device.
// Own file = own process: the loaded libcudart and its device count are fixed per process.

import { afterAll, beforeEach, describe, expect, it } from 'vitest'
import { nativePaths } from '../src/client/native.ts'
import { pattern, same } from './support/bytes.ts'
import { rejectsWith } from './support/native-errors.ts'

process.env.KVGATE_CUDART = nativePaths.stubCudart
process.env.KVGATE_STUB_DEVICES = '2'
const native = await import('../src/client/native.ts')
const { cuda } = native

const calls = (fn: string, device: number) => cuda.stubControl(`calls=${fn}@${device}`)

/** A device allocation made with `device` current, filled with a pattern. */
async function allocOn(device: number, bytes: number) {
  cuda.setDevice(device)
  try {
    const d = cuda.deviceAlloc(bytes)
    const host = pattern(bytes, 3 + device)
    await cuda.copyToDevice(host, d)
    return { d, host }
  } finally {
    cuda.setDevice(0)
  }
}

beforeEach(() => {
  cuda.stubControl('reset')
  cuda.setDevice(0)
})
afterAll(() => {
  cuda.stubControl('reset')
})

describe('two stub devices', () => {
  it('are visible, each with its own PCI bus id that resolves back to it', () => {
    expect(cuda.status()).toMatchObject({ available: true, stub: true, deviceCount: 2 })
    const ids = [cuda.pciBusId(0), cuda.pciBusId(1)]
    expect(ids[0]).toMatch(/^0000:[0-9A-F]{2}:00\.0$/)
    expect(ids[1]).not.toBe(ids[0])
    for (const d of [0, 1]) {
      expect(cuda.deviceByPciBusId(ids[d]!)).toBe(d)
      expect(cuda.deviceByPciBusId(ids[d]!.toLowerCase())).toBe(d) // hex, either case
      expect(cuda.deviceByPciBusId(ids[d]!.slice(0, -2))).toBe(d) // domain:bus:device
      expect(cuda.deviceByPciBusId(ids[d]!.slice(5))).toBe(d) // bus:device.function
    }
    cuda.setDevice(1)
    expect(cuda.pciBusId()).toBe(ids[1]) // default: the setDevice choice
    cuda.setDevice(0)
  })

  it('unknown and malformed PCI bus ids are typed errors', async () => {
    await rejectsWith(
      () => cuda.deviceByPciBusId('0000:99:00.0'),
      'ERR_CUDA',
      /0000:99:00\.0.*cudaDeviceGetByPCIBusId/,
    )
    await rejectsWith(() => cuda.deviceByPciBusId('not-a-bus-id'), 'ERR_CUDA', /cudaDeviceGetByPCIBusId/)
    await rejectsWith(() => cuda.deviceByPciBusId(''), 'ERR_NATIVE', /1 to 63/)
    await rejectsWith(() => cuda.deviceByPciBusId('0'.repeat(64)), 'ERR_NATIVE', /1 to 63/)
    await rejectsWith(() => cuda.deviceByPciBusId(7 as unknown as string), 'ERR_NATIVE')
    await rejectsWith(() => cuda.pciBusId(2), 'ERR_NATIVE', /out of range \(2 device/)
    cuda.stubControl('cudaDeviceGetByPCIBusId=1*1')
    await rejectsWith(() => cuda.deviceByPciBusId(cuda.pciBusId(1)), 'ERR_CUDA', /invalid argument/)
  })

  it('ipcOpen, copies and ipcClose run on the device named; the stream used is that device’s', async () => {
    const { d, host } = await allocOn(1, 4096)
    const before = cuda.stubControl('')
    const p = await cuda.ipcOpen(cuda.ipcGetHandle(d), { device: 1 })
    expect([calls('cudaIpcOpenMemHandle', 0), calls('cudaIpcOpenMemHandle', 1)]).toEqual([0, 1])
    const out = new Uint8Array(4096)
    const copies1 = calls('cudaMemcpyAsync', 1)
    await cuda.copyFromDevice(p, out, { device: 1 })
    expect(same(out, host)).toBe(true)
    expect(calls('cudaMemcpyAsync', 1)).toBe(copies1 + 1)
    expect(calls('cudaMemcpyAsync', 0)).toBe(0)
    // Closing from another device's context is not this mapping: CUDA (and the stub) refuse it.
    await rejectsWith(cuda.ipcClose(p, { device: 0 }), 'ERR_CUDA', /cudaIpcCloseMemHandle/)
    await cuda.ipcClose(p, { device: 1 })
    expect(calls('cudaIpcCloseMemHandle', 1)).toBe(1)
    expect(cuda.stubControl('')).toBe(before) // the mapping is gone
    cuda.deviceFree(d)
  })

  it('a copy issued on the wrong device fails (the stub checks what a GPU context can reach)', async () => {
    const { d } = await allocOn(1, 256)
    await rejectsWith(
      cuda.copyFromDevice(d, new Uint8Array(256), { device: 0 }),
      'ERR_CUDA',
      /cudaMemcpyAsync/,
    )
    cuda.deviceFree(d)
  })

  it('without device, calls use the setDevice choice (as before)', async () => {
    const { d, host } = await allocOn(1, 512)
    cuda.setDevice(1)
    const p = await cuda.ipcOpen(cuda.ipcGetHandle(d))
    const out = new Uint8Array(512)
    await cuda.copyFromDevice(p, out)
    await cuda.ipcClose(p)
    cuda.setDevice(0)
    expect(same(out, host)).toBe(true)
    expect([calls('cudaIpcOpenMemHandle', 1), calls('cudaIpcCloseMemHandle', 1)]).toEqual([1, 1])
    cuda.deviceFree(d)
  })

  it('a stream belongs to its device: copies default to it, and another device is refused', async () => {
    const { d, host } = await allocOn(1, 1024)
    const s = cuda.createStream(1)
    const out = new Uint8Array(1024)
    await cuda.copyFromDevice(d, out, { stream: s }) // runs on device 1 although setDevice chose 0
    expect(same(out, host)).toBe(true)
    await rejectsWith(
      cuda.copyFromDevice(d, out, { stream: s, device: 0 }),
      'ERR_NATIVE',
      /stream belongs to device 1/,
    )
    cuda.destroyStream(s) // nothing was left marked in flight by the refused copy
    await rejectsWith(() => cuda.createStream(2), 'ERR_NATIVE', /out of range/)
    cuda.deviceFree(d)
  })

  it('device arguments are validated before anything is queued', async () => {
    const { d } = await allocOn(0, 256)
    const handle = cuda.ipcGetHandle(d)
    const live = cuda.stubControl('')
    for (const device of [2, 1024, -1, 1.5, Number.NaN, '0' as unknown as number]) {
      await rejectsWith(cuda.ipcOpen(handle, { device }), 'ERR_NATIVE')
      await rejectsWith(cuda.copyFromDevice(d, new Uint8Array(256), { device }), 'ERR_NATIVE')
      await rejectsWith(cuda.ipcClose(d, { device }), 'ERR_NATIVE')
    }
    // The raw binding checks the range itself (the wrapper's bound is 1024).
    const raw = native.loadNative().cuda
    expect(() => raw.ipcOpen(handle, 1, 2)).toThrow(/device 2 out of range \(2 device/)
    expect(() => raw.ipcOpen(handle, 1, 0.5)).toThrow(/out of range/)
    // Past int64 (was converted before its range check: undefined behaviour in C++).
    for (const device of [1e300, Number.POSITIVE_INFINITY, -1e300])
      expect(() => raw.ipcOpen(handle, 1, device)).toThrow(/out of range/)
    expect(() => raw.copy(2, new ArrayBuffer(8), 0, 8, new BigInt64Array([d, 0n, 8n]), 0n, 5)).toThrow(
      /out of range/,
    )
    expect(calls('cudaIpcOpenMemHandle', 0) + calls('cudaIpcOpenMemHandle', 1)).toBe(0)
    expect(calls('cudaMemcpyAsync', 0)).toBe(1) // allocOn's fill only
    expect(cuda.stubControl('')).toBe(live)
    cuda.deviceFree(d)
  })

  it('held copies on one device do not hold another device’s copies', async () => {
    const a = await allocOn(0, 256)
    const b = await allocOn(1, 256)
    cuda.stubControl('hold=0')
    let done0 = false
    const slow = cuda.copyFromDevice(a.d, new Uint8Array(256), { device: 0 }).then(() => {
      done0 = true
    })
    const out = new Uint8Array(256)
    // Bounded, so that a device-1 copy stuck behind device 0 fails here, not at the test timeout.
    const stuck = new Promise<string>((r) => setTimeout(() => r('stuck behind device 0'), 5000))
    expect(await Promise.race([cuda.copyFromDevice(b.d, out, { device: 1 }).then(() => 'done'), stuck])).toBe(
      'done',
    )
    expect(same(out, b.host)).toBe(true)
    expect(done0).toBe(false)
    cuda.stubControl('release=0')
    await slow
    cuda.deviceFree(a.d)
    cuda.deviceFree(b.d)
  })

  it('malformed stub control specs for the device features are refused', async () => {
    for (const spec of [
      'calls=foo',
      'calls=cudaMalloc',
      'calls=cudaMalloc@',
      'calls=cudaMalloc@x',
      'hold=x',
      'hold=',
      'release=-1',
    ])
      await rejectsWith(() => cuda.stubControl(spec), 'ERR_NATIVE', /rejected/)
  })
})
