// The native addon against a real GPU: the same checks as the stub suite
// where they make sense, plus CUDA IPC across two processes. Skips with the
// probe's reason when no GPU is usable (test/gpu/run.sh runs it on purpose).

import { spawn } from 'node:child_process'
import { describe, expect, it } from 'vitest'
import {
  allocPinnedSync,
  cuda,
  freePinned,
  nativeAvailable,
  nativePaths,
  registerHost,
  unregisterHost,
} from '../../src/client/native.ts'
import { pattern, same } from '../support/bytes.ts'

const status = nativeAvailable() ? cuda.status() : undefined
const usable = status?.available === true && !status.stub
const why =
  status === undefined ? 'addon not built' : status.stub ? 'the stub libcudart is loaded' : status.reason
if (!usable) {
  if (process.env.KVGATE_GPU_REQUIRED === '1') throw new Error(`a GPU was required: ${why}`)
  console.log(`test/gpu: skipped — no usable GPU (${why})`)
}

describe.skipIf(!usable)('native addon on a real GPU', () => {
  it('allocates CUDA-pinned memory and round-trips 64 MiB through the device', async () => {
    cuda.setDevice(0)
    const n = 64 << 20
    const src = allocPinnedSync(n)
    expect(src.kind).toBe('cuda')
    new Uint8Array(src.buffer).set(pattern(n, 3))
    const d = cuda.deviceAlloc(n)
    await cuda.copyToDevice(src.buffer, d)
    const dst = allocPinnedSync(n)
    await cuda.copyFromDevice(d, dst.buffer)
    expect(same(new Uint8Array(dst.buffer), new Uint8Array(src.buffer))).toBe(true)
    freePinned(src.buffer)
    freePinned(dst.buffer)
    cuda.deviceFree(d)
  })

  it('batched gather/scatter of paged blocks, device-to-device, on a created stream', async () => {
    const blockBytes = 16 * 1024
    const blocks = 256
    const pool = cuda.deviceAlloc(blocks * blockBytes)
    const poolData = pattern(blocks * blockBytes, 8)
    await cuda.copyToDevice(poolData, pool)
    const ids = Array.from({ length: 64 }, (_, i) => (i * 97) % blocks)
    const desc = new BigInt64Array(ids.length * 3)
    ids.forEach((id, i) => {
      desc.set([pool + BigInt(id * blockBytes), BigInt(i * blockBytes), BigInt(blockBytes)], i * 3)
    })
    const s = cuda.createStream()
    const chunk = allocPinnedSync(ids.length * blockBytes)
    await cuda.copyBatch('d2h', chunk.buffer, desc, { stream: s })
    const c = new Uint8Array(chunk.buffer)
    ids.forEach((id, i) => {
      const want = poolData.subarray(id * blockBytes, (id + 1) * blockBytes)
      expect(same(c.subarray(i * blockBytes, (i + 1) * blockBytes), want)).toBe(true)
    })
    const other = cuda.deviceAlloc(blockBytes)
    await cuda.copyDeviceToDevice(pool + BigInt(5 * blockBytes), other, blockBytes, { stream: s })
    const out = new Uint8Array(blockBytes)
    await cuda.copyFromDevice(other, out)
    expect(same(out, poolData.subarray(5 * blockBytes, 6 * blockBytes))).toBe(true)
    cuda.destroyStream(s)
    freePinned(chunk.buffer)
    cuda.deviceFree(other)
    cuda.deviceFree(pool)
  })

  it('strided copies (copy2D): a packed K/V block gathered and scattered with cudaMemcpy2DAsync', async () => {
    expect(cuda.status().memcpy2D).toBe(true)
    // One block of [16 tokens, 8 heads, 2 × 128] bf16: K rows of 256 B, 512 B apart on the device.
    const rows = 16 * 8
    const w = 256
    const blockBytes = rows * 2 * w
    const d = cuda.deviceAlloc(4 * blockBytes)
    const dev = pattern(4 * blockBytes, 12)
    await cuda.copyToDevice(dev, d)
    const at = 2 * blockBytes
    const host = allocPinnedSync(2 * rows * w)
    const desc = new Float64Array([at, 0, w, rows, 2 * w, w, at + w, rows * w, w, rows, 2 * w, w])
    expect(await cuda.copy2D('d2h', host.buffer, d, desc)).toEqual({
      descriptors: 2,
      issued: 2,
      bytes: 2 * rows * w,
    })
    const h = new Uint8Array(host.buffer)
    for (let side = 0; side < 2; side++)
      for (let r = 0; r < rows; r++) {
        const o = at + r * 2 * w + side * w
        expect(
          same(h.subarray((side * rows + r) * w, (side * rows + r + 1) * w), dev.subarray(o, o + w)),
        ).toBe(true)
      }
    h.set(pattern(2 * rows * w, 13))
    await cuda.copy2D('h2d', host.buffer, d, desc, { device: 0 })
    const back = new Uint8Array(4 * blockBytes)
    await cuda.copyFromDevice(d, back)
    const want = dev.slice()
    for (let side = 0; side < 2; side++)
      for (let r = 0; r < rows; r++)
        want.set(h.subarray((side * rows + r) * w, (side * rows + r + 1) * w), at + r * 2 * w + side * w)
    expect(same(back, want)).toBe(true)
    freePinned(host.buffer)
    cuda.deviceFree(d)
  })

  it('registers a JS buffer and copies from it', async () => {
    const buf = pattern(1 << 20, 4)
    await registerHost(buf)
    const d = cuda.deviceAlloc(1 << 20)
    await cuda.copyToDevice(buf, d)
    const out = new Uint8Array(1 << 20)
    await cuda.copyFromDevice(d, out)
    expect(same(out, buf)).toBe(true)
    unregisterHost(buf)
    cuda.deviceFree(d)
  })

  it('errors from the real runtime are ERR_CUDA with its message', async () => {
    const e = (() => {
      try {
        cuda.deviceAlloc(2 ** 52)
      } catch (err) {
        return err as { code: string; cudaError?: number; message: string }
      }
    })()
    expect(e?.code).toBe('ERR_CUDA')
    expect(e?.cudaError).toBe(2)
    await expect(cuda.ipcOpen(new Uint8Array(64))).rejects.toMatchObject({ code: 'ERR_CUDA' })
  })

  it('opens another process’s allocation through a CUDA IPC handle', async () => {
    // The exporter: allocates, fills, prints its handle, waits for "done".
    const script = `
      const n = require(${JSON.stringify(nativePaths.addon)});
      const c = n.cuda; c.setDevice(0);
      const d = c.malloc(1 << 20);
      const host = new Uint8Array(1 << 20); for (let i = 0; i < host.length; i++) host[i] = (i * 31) & 255;
      c.copy(1, host.buffer, 0, host.length, new BigInt64Array([0n, d, BigInt(host.length)]), 0n).then(() => {
        process.stdout.write(Buffer.from(c.ipcGetHandle(d)).toString('hex') + '\\n');
        process.stdin.once('data', () => { c.free(d); process.exit(0) });
      });`
    const child = spawn(process.execPath, ['-e', script], { stdio: ['pipe', 'pipe', 'inherit'] })
    const hex = await new Promise<string>((resolve, reject) => {
      let acc = ''
      child.stdout.on('data', (b) => {
        acc += b
        if (acc.includes('\n')) resolve(acc.trim())
      })
      child.on('exit', (code) => reject(new Error(`exporter exited ${code}`)))
    })
    const ptr = await cuda.ipcOpen(new Uint8Array(Buffer.from(hex, 'hex')))
    const out = new Uint8Array(1 << 20)
    await cuda.copyFromDevice(ptr, out)
    expect(out.every((v, i) => v === ((i * 31) & 255))).toBe(true)
    await cuda.ipcClose(ptr)
    child.stdin.write('done\n')
    await new Promise((r) => child.on('exit', r))
  })
})
