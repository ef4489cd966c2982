// The quantized levels and residuals of kvgate chunks, taken from the codec's own path: a
// chunk is encoded, each stream's head (step, prediction modes, centres) and block (classes,
// tables, payload) is parsed from its section, and the levels are the decoded values divided
// by the step (decode + requantise). Used by bench/codec-context.ts to measure what other
// entropy models of the same residuals would cost (wasm/README.md has the stream format).

import { decodeChunk, encodeChunk, type LayerTargets } from '../../src/codec/node.ts'
import { decodeElements } from '../../src/core/dtype.ts'
import { decodeHeader, headerBytesFor, sectionOf } from '../../src/core/format.ts'
import type { KvGeometry } from '../../src/core/layout.ts'
import { chunkInfo } from './chunk-info.ts'

/** Symbols below this are direct zigzag residuals; above, escapes (wasm/README.md). */
export const DIRECT = 64
export const ALPHABET = 108

export interface StreamLevels {
  t: number
  c: number
  step: number
  /** T×C quantized levels. */
  q: Int32Array
  /** T×C residuals from the codec's prediction (delta channels: previous token; else the centre). */
  r: Int32Array
  delta: boolean[]
  classOf: Uint8Array
  classes: number
  /** The stream's own frequency tables (one per class, 11-bit). */
  tables: number[][]
  /** Bytes of the stream as coded: head (step, flags, modes, centres), escape bits, tables + class map, rANS payload. */
  headBytes: number
  escapeBytes: number
  tableBytes: number
  payloadBytes: number
}

export interface ChunkStreams {
  objectBytes: number
  /** streams[layer][0 = K, 1 = V] */
  streams: StreamLevels[][]
}

class Reader {
  pos = 0
  constructor(readonly b: Uint8Array) {}
  u8(): number {
    return this.b[this.pos++]!
  }
  u32(): number {
    const v = new DataView(this.b.buffer, this.b.byteOffset + this.pos, 4).getUint32(0, true)
    this.pos += 4
    return v
  }
  f32(): number {
    const v = new DataView(this.b.buffer, this.b.byteOffset + this.pos, 4).getFloat32(0, true)
    this.pos += 4
    return v
  }
  leb(): number {
    let v = 0
    let s = 0
    for (;;) {
      const x = this.u8()
      v += (x & 127) * 2 ** s
      if (x < 128) return v
      s += 7
    }
  }
}

export const zigzag = (v: number) => (v >= 0 ? 2 * v : -2 * v - 1)
const unzigzag = (z: number) => (z & 1 ? -(z + 1) / 2 : z / 2)

/** Codec symbol of a zigzag residual and its raw escape bits. */
export function symbolOf(z: number): { sym: number; extra: number } {
  if (z < DIRECT) return { sym: z, extra: 0 }
  const k = 31 - Math.clz32(z)
  return { sym: DIRECT + 2 * (k - 6) + ((z >>> (k - 1)) & 1), extra: k - 1 }
}

/** Parses one uncalibrated stream and its levels from the decoded values `x` (T×C). */
function parseStream(
  s: Uint8Array,
  t: number,
  c: number,
  x: Float32Array,
): { levels: StreamLevels; end: number } {
  const rd = new Reader(s)
  const step = rd.f32()
  const flags = rd.u8()
  if (flags & 3 || flags & 8) throw new Error(`stream flags ${flags}: only uniform uncalibrated streams`)
  const delta = new Array<boolean>(c).fill(false)
  if (flags & 4) {
    const m = s.subarray(rd.pos, rd.pos + Math.ceil(c / 8))
    rd.pos += m.length
    for (let ch = 0; ch < c; ch++) delta[ch] = ((m[ch >> 3]! >> (ch & 7)) & 1) === 1
  }
  const centres: number[] = []
  for (let ch = 0; ch < c; ch++) centres.push(unzigzag(rd.leb()))
  const headBytes = rd.pos
  const esc = rd.u32()
  rd.pos += esc
  const tablesAt = rd.pos
  const k = rd.u8()
  const classOf = new Uint8Array(c)
  if (k > 1) for (let ch = 0; ch < c; ch++) classOf[ch] = rd.u8()
  const tables: number[][] = []
  for (let i = 0; i < k; i++) {
    const n = rd.u8() + 1
    const f: number[] = []
    for (let j = 0; j < n; j++) f.push(rd.leb())
    tables.push(f)
  }
  const tableBytes = rd.pos - tablesAt
  const payload = rd.u32()
  rd.pos += payload
  const q = new Int32Array(t * c)
  const r = new Int32Array(t * c)
  const inv = 1 / step
  for (let i = 0; i < t * c; i++) q[i] = Math.round(x[i]! * inv)
  for (let tt = 0; tt < t; tt++) {
    for (let ch = 0; ch < c; ch++) {
      const i = tt * c + ch
      const pred = delta[ch] && tt > 0 ? q[i - c]! : centres[ch]!
      r[i] = q[i]! - pred
    }
  }
  return {
    levels: {
      t,
      c,
      step,
      q,
      r,
      delta,
      classOf,
      classes: k,
      tables,
      headBytes,
      escapeBytes: 4 + esc,
      tableBytes,
      payloadBytes: 4 + payload,
    },
    end: rd.pos,
  }
}

/**
 * Encodes `tensor` (fp16 chunk) with kvgate at `targets` and parses every stream's levels.
 * With one target per layer, each layer is coded as a one-layer chunk (objectBytes sums them).
 */
export function chunkStreams(
  tensor: Uint8Array,
  g: KvGeometry,
  tokens: number,
  targets: LayerTargets | LayerTargets[],
): ChunkStreams {
  if (Array.isArray(targets)) {
    const slab = tensor.length / g.layers
    const parts = targets.map((t, l) =>
      chunkStreams(tensor.subarray(l * slab, (l + 1) * slab), { ...g, layers: 1 }, tokens, t),
    )
    return {
      // One header for all layers, as a whole-chunk object has.
      objectBytes:
        parts.reduce((a, p) => a + p.objectBytes, 0) -
        g.layers * headerBytesFor(1) +
        headerBytesFor(g.layers),
      streams: parts.map((p) => p.streams[0]!),
    }
  }
  const meta = chunkInfo(g, tokens, 0)
  const obj = encodeChunk(tensor, meta, { mode: 'kvgate', errorTargets: targets })
  const dec = decodeElements(decodeChunk(obj), g.dtype)
  const h = decodeHeader(obj)
  const c = g.kvHeads * g.headDim
  const plane = tokens * c
  const streams: StreamLevels[][] = []
  for (let l = 0; l < g.layers; l++) {
    const sec = sectionOf(obj, h, l)
    const kLen = new DataView(sec.buffer, sec.byteOffset, 4).getUint32(0, true)
    const kS = parseStream(
      sec.subarray(4, 4 + kLen),
      tokens,
      c,
      dec.subarray(2 * l * plane, (2 * l + 1) * plane),
    )
    if (kS.end !== kLen) throw new Error(`K stream parse ended at ${kS.end} of ${kLen}`)
    const vBytes = sec.subarray(4 + kLen)
    const vS = parseStream(vBytes, tokens, c, dec.subarray((2 * l + 1) * plane, (2 * l + 2) * plane))
    if (vS.end !== vBytes.length) throw new Error(`V stream parse ended at ${vS.end} of ${vBytes.length}`)
    streams.push([kS.levels, vS.levels])
  }
  return { objectBytes: obj.byteLength, streams }
}
