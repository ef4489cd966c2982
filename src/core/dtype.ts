// Element conversions between float32 and the 16-bit KV dtypes (fp16, bf16).
// Runtime-neutral and allocation-free in the loops: the model, the codec tests
// and synthetic KV all go through these, so rounding is the same everywhere.

import { CodecError, InvalidArgumentError } from './errors.ts'
import { type Dtype, isFp8 } from './layout.ts'

const f32 = new Float32Array(1)
const u32 = new Uint32Array(f32.buffer)

/** float32 → bf16 bits, round to nearest even (NaN stays NaN). */
export function f32ToBf16(x: number): number {
  f32[0] = x
  const b = u32[0]!
  if ((b & 0x7fffffff) > 0x7f800000) return ((b >>> 16) | 0x40) & 0xffff
  return ((b + 0x7fff + ((b >>> 16) & 1)) >>> 16) & 0xffff
}

export function bf16ToF32(h: number): number {
  u32[0] = (h & 0xffff) << 16
  return f32[0]!
}

/** float32 → IEEE fp16 bits, round to nearest even, overflow → ±Inf. */
export function f32ToF16(x: number): number {
  f32[0] = x
  const b = u32[0]!
  const sign = (b >>> 16) & 0x8000
  const exp = (b >>> 23) & 0xff
  let mant = b & 0x7fffff
  if (exp === 0xff) return sign | 0x7c00 | (mant ? 0x200 : 0)
  let e = exp - 127 + 15
  if (e >= 0x1f) return sign | 0x7c00
  if (e <= 0) {
    if (e < -10) return sign
    mant |= 0x800000
    const shift = 14 - e
    const half = 1 << (shift - 1)
    const rest = mant & ((1 << shift) - 1)
    let m = mant >>> shift
    if (rest > half || (rest === half && m & 1)) m++
    return sign | m
  }
  let m = mant >>> 13
  const rest = mant & 0x1fff
  if (rest > 0x1000 || (rest === 0x1000 && m & 1)) {
    m++
    if (m === 0x400) {
      m = 0
      e++
      if (e >= 0x1f) return sign | 0x7c00
    }
  }
  return sign | (e << 10) | m
}

export function f16ToF32(h: number): number {
  const sign = h & 0x8000 ? -1 : 1
  const exp = (h >>> 10) & 0x1f
  const mant = h & 0x3ff
  if (exp === 0) return sign * mant * 2 ** -24
  if (exp === 0x1f) return mant ? Number.NaN : sign * Number.POSITIVE_INFINITY
  return sign * (1 + mant / 1024) * 2 ** (exp - 15)
}

/** fp8 KV is only ever moved as bytes (see isFp8): a conversion asked for is a caller's bug. */
function noFloatConversion(dtype: Dtype): void {
  if (isFp8(dtype))
    throw new CodecError(`${dtype} elements are not converted: fp8 KV is stored as raw bytes`, {
      code: 'ERR_CODEC_DTYPE',
    })
}

/** Encodes float32 values as `dtype` little-endian bytes. */
export function encodeElements(values: ArrayLike<number>, dtype: Dtype, out?: Uint8Array): Uint8Array {
  noFloatConversion(dtype)
  const n = values.length
  const size = dtype === 'fp32' ? 4 : 2
  const bytes = out ?? new Uint8Array(n * size)
  // A view over `out`'s buffer would write past its end, into whatever the buffer holds next.
  if (bytes.byteLength < n * size)
    throw new InvalidArgumentError(`${n} ${dtype} values need ${n * size} bytes, out has ${bytes.byteLength}`)
  // Typed-array views need an aligned start: `out` may be any caller buffer (a Node Buffer
  // slice, a layer inside a packed slot). Encoded aside and copied in, as decodeElements reads.
  if (bytes.byteOffset % size !== 0) {
    bytes.set(encodeElements(values, dtype))
    return bytes
  }
  if (dtype === 'fp32') {
    new Float32Array(bytes.buffer, bytes.byteOffset, n).set(values)
    return bytes
  }
  const u16 = new Uint16Array(bytes.buffer, bytes.byteOffset, n)
  const conv = dtype === 'bf16' ? f32ToBf16 : f32ToF16
  for (let i = 0; i < n; i++) u16[i] = conv(values[i]!)
  return bytes
}

/** Decodes `dtype` little-endian bytes into float32 values. */
export function decodeElements(bytes: Uint8Array, dtype: Dtype, out?: Float32Array): Float32Array {
  noFloatConversion(dtype)
  const size = dtype === 'fp32' ? 4 : 2
  const n = Math.floor(bytes.byteLength / size)
  const res = out ?? new Float32Array(n)
  if (dtype === 'fp32') {
    // Copy through a fresh buffer: `bytes` may not be 4-byte aligned.
    res.set(new Float32Array(bytes.slice(0, n * 4).buffer))
    return res
  }
  const u16 =
    bytes.byteOffset % 2 === 0
      ? new Uint16Array(bytes.buffer, bytes.byteOffset, n)
      : new Uint16Array(bytes.slice().buffer, 0, n)
  const conv = dtype === 'bf16' ? bf16ToF32 : f16ToF32
  for (let i = 0; i < n; i++) res[i] = conv(u16[i]!)
  return res
}
