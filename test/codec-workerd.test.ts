import { readFileSync } from 'node:fs'
import { join } from 'node:path'
import { fileURLToPath } from 'node:url'
import { build } from 'esbuild'
import { Miniflare } from 'miniflare'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { buildCalibration, decodeChunk, encodeChunk, openCalibration } from '../src/codec/node.ts'

// The workerd loader in real workerd (Miniflare's binary): Workers cannot compile
// wasm from bytes, so the bundle imports the .wasm as a module, as wrangler does.
const root = join(fileURLToPath(import.meta.url), '..', '..')

const WORKER = `
import { buildCalibration, decodeChunk, encodeChunk, initCodec, isCodecReady, openCalibration } from './src/codec/workerd.ts'
import wasm from './wasm/kvgate_codec.wasm'
export default {
  async fetch() {
    initCodec(wasm) // idempotent: the loader already did it
    const g = { layers: 2, kvHeads: 2, headDim: 8, dtype: 'fp16' }
    const tokens = 40
    const n = g.layers * 2 * tokens * 16
    const f = new Float32Array(n)
    for (let i = 0; i < n; i++) f[i] = Math.sin(i * 0.3) * 2
    const u16 = new Uint16Array(n)
    const dv = new DataView(new ArrayBuffer(4))
    for (let i = 0; i < n; i++) { dv.setFloat32(0, f[i]); const b = dv.getUint32(0); u16[i] = ((b >>> 16) & 0x8000) | (((((b >>> 23) & 0xff) - 112) & 0x1f) << 10) | ((b >>> 13) & 0x3ff) }
    const tensor = new Uint8Array(u16.buffer)
    const meta = { geometry: g, tokens, chunkIndex: 0, partial: false, namespaceId: new Uint8Array(16), chainKey: new Uint8Array(32), parentKey: new Uint8Array(32) }
    const out = {}
    for (const mode of ['lossless', 'kvgate', 'q8']) {
      const obj = encodeChunk(tensor, meta, { mode })
      const back = decodeChunk(obj)
      let same = back.length === tensor.length
      for (let i = 0; same && i < back.length; i++) same = back[i] === tensor[i]
      out[mode] = { bytes: obj.length, raw: tensor.length, exact: same }
    }
    const hex = (b) => Array.from(b, (x) => x.toString(16).padStart(2, '0')).join('')
    const same = {}
    for (const quality of [1, 5, 9]) {
      const obj = encodeChunk(tensor, meta, { mode: 'kvgate', quality })
      same[quality] = { obj: hex(obj), back: hex(decodeChunk(obj)) }
    }
    let rejected = ''
    try { decodeChunk(new Uint8Array(100)) } catch (e) { rejected = e.code }
    // A calibration built here (no node:crypto in this worker) and a chunk coded with it.
    const half = tensor.subarray(0, tensor.length / 2)
    const calBytes = buildCalibration([tensor, half], { geometry: g, dtype: 'fp16' })
    const cal = openCalibration(calBytes)
    const calObj = encodeChunk(tensor, meta, { mode: 'kvgate', calibration: cal })
    let missing = ''
    try { decodeChunk(calObj) } catch (e) { missing = e.code }
    const calibrated = { bytes: hex(calBytes), hash: cal.hash, obj: hex(calObj), back: hex(decodeChunk(calObj, { calibration: cal })), missing }
    return Response.json({ ready: isCodecReady(), out, rejected, tensor: hex(tensor), same, calibrated })
  },
}
`

let mf: Miniflare | undefined

beforeAll(async () => {
  const bundle = await build({
    stdin: { contents: WORKER, resolveDir: root, loader: 'ts', sourcefile: 'worker.ts' },
    bundle: true,
    format: 'esm',
    write: false,
    platform: 'neutral',
    // Keep every .wasm import as a module import of one file, as wrangler does.
    plugins: [
      {
        name: 'wasm-module',
        setup(b) {
          b.onResolve({ filter: /\.wasm$/ }, () => ({ path: './kvgate_codec.wasm', external: true }))
        },
      },
    ],
  })
  mf = new Miniflare({
    modules: [
      { type: 'ESModule', path: 'worker.mjs', contents: bundle.outputFiles[0]!.text },
      {
        type: 'CompiledWasm',
        path: 'kvgate_codec.wasm',
        contents: readFileSync(join(root, 'wasm', 'kvgate_codec.wasm')),
      },
    ],
    compatibilityDate: '2025-01-01',
  })
})

afterAll(async () => {
  await mf?.dispose()
})

describe('codec in workerd', () => {
  it('loads the wasm as a module and round-trips chunks byte-identically to Node; hostile bytes get a typed error', async () => {
    const res = await mf!.dispatchFetch('http://localhost/')
    const body = (await res.json()) as {
      ready: boolean
      out: Record<string, { bytes: number; raw: number; exact: boolean }>
      rejected: string
      tensor: string
      same: Record<string, { obj: string; back: string }>
      calibrated: { bytes: string; hash: string; obj: string; back: string; missing: string }
    }
    expect(body.ready).toBe(true)
    // Identical bytes in Node and workerd: the encoded object and the decoded tensor, per level.
    const tensor = new Uint8Array(Buffer.from(body.tensor, 'hex'))
    const meta = {
      geometry: { layers: 2, kvHeads: 2, headDim: 8, dtype: 'fp16' as const },
      tokens: 40,
      chunkIndex: 0,
      partial: false,
      namespaceId: new Uint8Array(16),
      chainKey: new Uint8Array(32),
      parentKey: new Uint8Array(32),
    }
    for (const quality of [1, 5, 9]) {
      const obj = encodeChunk(tensor, meta, { mode: 'kvgate', quality })
      expect(Buffer.from(obj).toString('hex')).toBe(body.same[quality]!.obj)
      expect(Buffer.from(decodeChunk(obj)).toString('hex')).toBe(body.same[quality]!.back)
    }
    expect(body.out.lossless!.exact).toBe(true)
    expect(body.out.kvgate!.exact).toBe(false)
    expect(body.out.kvgate!.bytes).toBeLessThan(body.out.kvgate!.raw / 2)
    expect(body.out.q8!.bytes).toBeLessThan(body.out.q8!.raw)
    expect(body.rejected).toMatch(/^ERR_FORMAT/)
    // Calibration: the same object, hash, calibrated chunk and decoded tensor in both runtimes.
    const half = tensor.subarray(0, tensor.length / 2)
    const calBytes = buildCalibration([tensor, half], { geometry: meta.geometry, dtype: 'fp16' })
    const cal = openCalibration(calBytes)
    const calObj = encodeChunk(tensor, meta, { mode: 'kvgate', calibration: cal })
    expect(Buffer.from(calBytes).toString('hex')).toBe(body.calibrated.bytes)
    expect(cal.hash).toBe(body.calibrated.hash)
    expect(Buffer.from(calObj).toString('hex')).toBe(body.calibrated.obj)
    expect(Buffer.from(decodeChunk(calObj, { calibration: cal })).toString('hex')).toBe(body.calibrated.back)
    expect(body.calibrated.missing).toBe('ERR_CALIBRATION_MISSING')
  })
})
