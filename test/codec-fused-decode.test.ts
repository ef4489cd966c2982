// The fused decode (wasm/src/lossy.rs FusedRows: rows of uniform-step fp16/bf16 streams
// reconstructed inside the SIMD rANS loop, one row behind, escapes expanded in the loop; one-plane
// latent sections take it, K/V sections decode both symbol blocks in one loop, then their rows)
// must accept, reject and decode exactly as the row-by-row path. A stream given a token-step block
// of code 128 (multiplier exactly 1.0) means the same values but takes the row-by-row path,
// so every section is decoded both ways, clean and under the same mutation of its rANS
// payload and escape bits: tiny T, the last row (finished after the loop), escape groups.

import { readFileSync } from 'node:fs'
import { describe, expect, it } from 'vitest'
import { f32ToF16 } from '../src/core/dtype.ts'

type Exports = Record<string, (...a: number[]) => number> & { memory: WebAssembly.Memory }

const wasm = readFileSync(new URL('../wasm/kvgate_codec.wasm', import.meta.url))
const ex = new WebAssembly.Instance(new WebAssembly.Module(wasm), {}).exports as Exports
const F_TOKSCALE = 2
const UNIT_SCALE_CODE = 128 // scale_of(128) = 2^0

let seed = 20261124
const rnd = () => {
  seed = (Math.imul(seed, 1103515245) + 12345) >>> 0
  return seed / 2 ** 32
}

const LATENT = 0x100

function encode(dt: number, t: number, c: number, eps: number, planes: number): Uint8Array {
  const n = planes * t * c
  const f = new Float32Array(n)
  const scale = Array.from({ length: c }, () => 0.05 + rnd() * (rnd() < 0.1 ? 20 : 2))
  for (let i = 0; i < n; i++) {
    const ch = i % c
    // Rare large outliers: escape symbols (extra bits) in some groups.
    const big = rnd() < 0.01 ? 400 : 1
    const fresh = scale[ch]! * (rnd() + rnd() + rnd() - 1.5) * big
    // Half the channels walk over tokens (delta-predicted channels).
    f[i] = ch % 2 === 0 && i % (t * c) >= c ? f[i - c]! + 0.01 * scale[ch]! * (rnd() - 0.5) : fresh
  }
  const u = new Uint16Array(n)
  const bits = new Uint32Array(f.buffer)
  for (let i = 0; i < n; i++) {
    const b = bits[i]!
    if (dt === 2) u[i] = b >>> 16
    else {
      const sign = (b >>> 16) & 0x8000
      const exp = ((b >>> 23) & 0xff) - 127 + 15
      u[i] = exp <= 0 ? sign : exp >= 31 ? sign | 0x7bff : sign | (exp << 10) | ((b >>> 13) & 0x3ff)
    }
  }
  const slab = new Uint8Array(u.buffer)
  const src = ex.kv_alloc!(slab.length)
  const par = ex.kv_alloc!(32)
  new Uint8Array(ex.memory.buffer, src, slab.length).set(slab)
  new Float32Array(ex.memory.buffer, par, 8).set([-eps / 5, eps, 0, 0, 1, 8, 0, 0])
  const len = ex.kv_encode!(2, src, planes === 1 ? dt | LATENT : dt, t, c, par)
  expect(len).toBeGreaterThan(0)
  const out = new Uint8Array(ex.memory.buffer, ex.kv_result_ptr!(), len).slice()
  ex.kv_result_clear!()
  ex.kv_free!(src, slab.length)
  ex.kv_free!(par, 32)
  return out
}

function decode(
  dt: number,
  t: number,
  c: number,
  planes: number,
  section: Uint8Array,
): { rc: number; out: Uint8Array } {
  const size = planes * t * c * 2
  const len = Math.max(1, section.length)
  const src = ex.kv_alloc!(len)
  const dst = ex.kv_alloc!(size)
  new Uint8Array(ex.memory.buffer, src, section.length).set(section)
  const rc = ex.kv_decode!(2, src, section.length, planes === 1 ? dt | LATENT : dt, t, c, dst)
  const out = new Uint8Array(ex.memory.buffer, dst, size).slice()
  ex.kv_free!(src, len)
  ex.kv_free!(dst, size)
  return { rc, out }
}

/** Offsets of the K and V streams' flags bytes (each stream starts with its f32 base); a latent
 * section is one stream without a length prefix. */
function flagOffsets(s: Uint8Array, planes: number): number[] {
  if (planes === 1) return [4]
  const klen = new DataView(s.buffer, s.byteOffset).getUint32(0, true)
  return [4 + 4, 4 + klen + 4]
}

/** The same section with a token-step block of multiplier 1.0 in every stream. */
function withUnitTokenSteps(s: Uint8Array, t: number, planes: number): Uint8Array {
  const codes = new Uint8Array(t).fill(UNIT_SCALE_CODE)
  if (planes === 1) {
    const out = new Uint8Array(s.length + t)
    out.set(s.subarray(0, 5))
    out[4] = s[4]! | F_TOKSCALE
    out.set(codes, 5)
    out.set(s.subarray(5), 5 + t)
    return out
  }
  const [fk, fv] = flagOffsets(s, planes) as [number, number]
  const out = new Uint8Array(s.length + 2 * t)
  let o = 0
  const put = (b: Uint8Array) => {
    out.set(b, o)
    o += b.length
  }
  put(s.subarray(0, fk + 1))
  out[fk] = s[fk]! | F_TOKSCALE
  put(codes)
  put(s.subarray(fk + 1, fv + 1))
  out[fv + t] = s[fv]! | F_TOKSCALE
  put(codes)
  put(s.subarray(fv + 1))
  new DataView(out.buffer).setUint32(0, new DataView(s.buffer, s.byteOffset).getUint32(0, true) + t, true)
  return out
}

describe('fused row decode (wasm) against the row-by-row path', () => {
  const shapes: [number, number][] = [
    [1, 8],
    [2, 8],
    [1, 16],
    [2, 16],
    [3, 24],
    [4, 32],
    [9, 64],
    [17, 64],
    [33, 128],
  ]
  const corpus: { dt: number; t: number; c: number; planes: number; s: Uint8Array }[] = []
  for (const planes of [2, 1])
    for (const [t, c] of shapes)
      for (const dt of [1, 2])
        for (const eps of [0.56, 0.14, 0.01])
          corpus.push({ dt, t, c, planes, s: encode(dt, t, c, eps, planes) })

  it('clean sections: the encoder writes uniform-step streams, and both paths decode them alike', () => {
    for (const { dt, t, c, planes, s } of corpus) {
      // No channel or token steps: the streams the fused path takes.
      for (const f of flagOffsets(s, planes)) expect(s[f]! & 3).toBe(0)
      const a = decode(dt, t, c, planes, s)
      const b = decode(dt, t, c, planes, withUnitTokenSteps(s, t, planes))
      expect(a.rc).toBe(0)
      expect(b.rc).toBe(0)
      expect(Buffer.compare(a.out, b.out)).toBe(0)
    }
  })

  it('mutated payloads and escape bits: the same accept/reject and the same bytes', () => {
    let accepted = 0
    let rejected = 0
    for (let i = 0; i < 6000; i++) {
      const { dt, t, c, planes, s: clean } = corpus[Math.floor(rnd() * corpus.length)]!
      const offsets = flagOffsets(clean, planes)
      const fv = offsets[offsets.length - 1]!
      // Everything but the K length and the streams' base and flags may change.
      const protectedAt = (p: number) => offsets.some((f) => p >= f - 4 && p <= f) || p < offsets[0]!
      let s = clean.slice()
      const kind = rnd()
      if (kind < 0.6) {
        for (let k = 1 + Math.floor(rnd() * 3); k > 0; k--) {
          const p = Math.floor(rnd() * s.length)
          if (!protectedAt(p)) s[p] = s[p]! ^ (1 << Math.floor(rnd() * 8))
        }
      } else if (kind < 0.8) {
        const p = Math.floor(rnd() * s.length)
        for (let j = p; j < Math.min(s.length, p + 1 + Math.floor(rnd() * 16)); j++)
          if (!protectedAt(j)) s[j] = Math.floor(rnd() * 256)
      } else {
        // Truncated V (or latent) stream (its rANS tail, escape bits).
        s = s.subarray(0, fv + 1 + Math.floor(rnd() * (s.length - fv - 1)))
      }
      const a = decode(dt, t, c, planes, s)
      const b = decode(dt, t, c, planes, withUnitTokenSteps(s, t, planes))
      if (a.rc !== b.rc || (a.rc === 0 && Buffer.compare(a.out, b.out) !== 0))
        expect.fail(`${t}x${c} dtype ${dt} planes ${planes}: fused rc ${a.rc}, row path rc ${b.rc}`)
      if (a.rc === 0) accepted++
      else rejected++
    }
    // Both outcomes were exercised.
    expect(accepted).toBeGreaterThan(300)
    expect(rejected).toBeGreaterThan(300)
  })
})

// The joint K/V loop (lossy.rs decode_layer) takes sections with at most one escape bit per
// symbol; the others decode one stream at a time (the fused loop above). Escape bits past the
// last one read are ignored, so the same section with V's escape block padded past that limit
// means the same values but takes the one-stream path: under the same mutation of the K
// stream and of V's payload, both must accept, reject and decode alike.
describe('joint K/V decode (wasm) against one stream at a time', () => {
  /** The stream starting at `p0`: the offset of its escape block's u32 length and the block's end. */
  function escapes(s: Uint8Array, p0: number, c: number): { at: number; end: number } {
    let p = p0 + 4 // base
    const flags = s[p++]!
    expect(flags & 3).toBe(0)
    if (flags & 4) p += Math.ceil(c / 8) // delta channel bits
    for (let i = 0; i < c; i++) while (s[p++]! & 0x80); // centres (varints)
    return { at: p, end: p + 4 + new DataView(s.buffer, s.byteOffset).getUint32(p, true) }
  }
  const vStart = (s: Uint8Array) => 4 + new DataView(s.buffer, s.byteOffset).getUint32(0, true)
  const shapes: [number, number][] = [
    [1, 8],
    [2, 16],
    [3, 24],
    [9, 64],
    [17, 64],
    [33, 128],
  ]
  const corpus: { dt: number; t: number; c: number; s: Uint8Array }[] = []
  for (const [t, c] of shapes)
    for (const dt of [1, 2])
      for (const eps of [0.56, 0.14]) {
        const s = encode(dt, t, c, eps, 2)
        const k = escapes(s, 4, c)
        const v = escapes(s, vStart(s), c)
        // Within the joint loop's limit (one escape bit per symbol, K and V together).
        if ((k.end - k.at - 4 + v.end - v.at - 4) * 8 <= 2 * t * c) corpus.push({ dt, t, c, s })
      }

  /** `s` with `pad` zero bytes after V's escape bits (past the joint loop's limit). */
  function padded(s: Uint8Array, c: number, pad: number) {
    const { at, end } = escapes(s, vStart(s), c)
    const out = new Uint8Array(s.length + pad)
    out.set(s.subarray(0, end))
    out.set(s.subarray(end), end + pad)
    new DataView(out.buffer).setUint32(at, end - at - 4 + pad, true)
    return { out, at, end }
  }
  const padOf = (t: number, c: number) => Math.ceil((2 * t * c) / 8) + 1

  it('the corpus takes the joint loop, and clean sections decode alike both ways', () => {
    expect(corpus.length).toBeGreaterThanOrEqual(20)
    for (const { dt, t, c, s } of corpus) {
      const a = decode(dt, t, c, 2, s)
      const b = decode(dt, t, c, 2, padded(s, c, padOf(t, c)).out)
      expect(a.rc).toBe(0)
      expect(b.rc).toBe(0)
      expect(Buffer.compare(a.out, b.out)).toBe(0)
    }
  })

  it('mutated K streams and V payloads: the same accept/reject and the same bytes', () => {
    let accepted = 0
    let rejected = 0
    for (let i = 0; i < 6000; i++) {
      const { dt, t, c, s: clean } = corpus[Math.floor(rnd() * corpus.length)]!
      const pad = padOf(t, c)
      const { out: cleanPadded, at, end } = padded(clean, c, pad)
      const map = (p: number) => (p < end ? p : p + pad)
      const v0 = vStart(clean)
      // Everything but the K length, K's base and flags and V's header up to its escape
      // block's length (which locate the padding) may change.
      const protectedAt = (p: number) => p <= 8 || (p >= v0 && p < at + 4)
      let a = clean.slice()
      let b = cleanPadded.slice()
      const kind = rnd()
      if (kind < 0.6) {
        for (let k = 1 + Math.floor(rnd() * 3); k > 0; k--) {
          const p = Math.floor(rnd() * a.length)
          if (protectedAt(p)) continue
          const bit = 1 << Math.floor(rnd() * 8)
          a[p] = a[p]! ^ bit
          b[map(p)] = b[map(p)]! ^ bit
        }
      } else if (kind < 0.8) {
        const p = Math.floor(rnd() * a.length)
        for (let j = p; j < Math.min(a.length, p + 1 + Math.floor(rnd() * 16)); j++)
          if (!protectedAt(j)) {
            const v = Math.floor(rnd() * 256)
            a[j] = v
            b[map(j)] = v
          }
      } else if (kind < 0.9) {
        // Bytes after K's stream inside its block (K length grown), or after V's.
        const extra = Uint8Array.from({ length: 1 + Math.floor(rnd() * 3) }, () => Math.floor(rnd() * 256))
        const grow = (x: Uint8Array, afterK: boolean) => {
          const at = afterK ? v0 : x.length
          const y = new Uint8Array(x.length + extra.length)
          y.set(x.subarray(0, at))
          y.set(extra, at)
          y.set(x.subarray(at), at + extra.length)
          if (afterK) new DataView(y.buffer).setUint32(0, v0 - 4 + extra.length, true)
          return y
        }
        const afterK = rnd() < 0.5
        a = grow(a, afterK)
        b = grow(b, afterK)
      } else {
        // Truncated V payload (the second stream's rANS block).
        const n = end + Math.floor(rnd() * (a.length - end))
        a = a.subarray(0, n)
        b = b.subarray(0, n + pad)
      }
      const da = decode(dt, t, c, 2, a)
      const db = decode(dt, t, c, 2, b)
      if (da.rc !== db.rc || (da.rc === 0 && Buffer.compare(da.out, db.out) !== 0))
        expect.fail(`${t}x${c} dtype ${dt}: joint rc ${da.rc}, one-stream rc ${db.rc}`)
      if (da.rc === 0) accepted++
      else rejected++
    }
    // Both outcomes were exercised.
    expect(accepted).toBeGreaterThan(300)
    expect(rejected).toBeGreaterThan(300)
  })
})

// fp16 output of uniform-step rows folds the 2^-112 exponent rebias into the step (recon8,
// uniform_step): exact only while every product is a normal f32, and a product that overflows
// f32 must still come out as Inf. Whatever the stream's base (a hostile one too), the fp16
// decode must be the fp16 rounding of the fp32 decode, element for element.
describe('fp16 decode against the fp32 decode of the same section', () => {
  const bases = [
    2 ** -14, // the smallest base the rebiased path takes
    2 ** -14 * (1 - 2 ** -24), // just below: the full conversion (subnormal outputs)
    2 ** -24,
    1e-3,
    -0.75,
    65504 / 7,
    3.4e38, // products of |q| ≥ 2 overflow f32 to Inf
    -3e38,
  ]
  const withBase = (s: Uint8Array, planes: number, base: number) => {
    const out = s.slice()
    const dv = new DataView(out.buffer)
    dv.setFloat32(planes === 1 ? 0 : 4, base, true)
    if (planes === 2) dv.setFloat32(4 + dv.getUint32(0, true), base, true)
    return out
  }

  it('every base: fp16 bits = f32ToF16 of the fp32 value (joint K/V rows and the fused latent loop)', () => {
    let inf = 0
    for (const planes of [2, 1])
      for (const [t, c] of [
        [9, 64],
        [3, 24],
      ] as const) {
        const clean = encode(1, t, c, 0.01, planes)
        for (const base of bases) {
          const s = withBase(clean, planes, base)
          const f32 = decode32(t, c, planes, s)
          const f16 = decode(1, t, c, planes, s)
          expect(f16.rc).toBe(0)
          const got = new Uint16Array(f16.out.buffer, f16.out.byteOffset, f16.out.length / 2)
          for (let i = 0; i < f32.length; i++) {
            const want = f32ToF16(f32[i]!)
            if (got[i] !== want)
              expect.fail(
                `${planes} planes ${t}x${c} base ${base}: element ${i} = ${f32[i]} → ${got[i]}, not ${want}`,
              )
            if ((want & 0x7fff) === 0x7c00) inf++
          }
        }
      }
    // The overflowing bases were exercised.
    expect(inf).toBeGreaterThan(100)
  })
})

function decode32(t: number, c: number, planes: number, section: Uint8Array): Float32Array {
  const size = planes * t * c * 4
  const src = ex.kv_alloc!(section.length)
  const dst = ex.kv_alloc!(size)
  new Uint8Array(ex.memory.buffer, src, section.length).set(section)
  const rc = ex.kv_decode!(2, src, section.length, planes === 1 ? 3 | LATENT : 3, t, c, dst)
  expect(rc).toBe(0)
  const out = new Float32Array(new Uint8Array(ex.memory.buffer, dst, size).slice().buffer)
  ex.kv_free!(src, section.length)
  ex.kv_free!(dst, size)
  return out
}
