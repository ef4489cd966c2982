//! fp16 / bf16 / fp32 element conversions (round to nearest even), matching
//! src/core/dtype.ts so a chunk decodes to the same bits in every runtime.

pub const DT_F16: u32 = 1;
pub const DT_BF16: u32 = 2;
pub const DT_F32: u32 = 3;
/// fp8 (float8_e4m3fn, float8_e5m2): stored as raw bytes, lossless mode only.
pub const DT_F8E4M3: u32 = 4;
pub const DT_F8E5M2: u32 = 5;

pub fn elem_bytes(dtype: u32) -> Option<usize> {
    match dtype {
        DT_F16 | DT_BF16 => Some(2),
        DT_F32 => Some(4),
        DT_F8E4M3 | DT_F8E5M2 => Some(1),
        _ => None,
    }
}

/// Whether the lossy modes (which convert elements to f32) take this dtype.
pub fn has_float_conversion(dtype: u32) -> bool {
    matches!(dtype, DT_F16 | DT_BF16 | DT_F32)
}

#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    let h = h as u32;
    let sign = (h & 0x8000) << 16;
    let exp = (h >> 10) & 0x1f;
    let mant = h & 0x3ff;
    if exp == 0 {
        let v = mant as f32 * (1.0 / 16777216.0);
        return if sign != 0 { -v } else { v };
    }
    if exp == 0x1f {
        return f32::from_bits(sign | 0x7f80_0000 | (mant << 13));
    }
    f32::from_bits(sign | ((exp + 112) << 23) | (mant << 13))
}

#[inline(always)]
pub fn f32_to_f16(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32;
    let mant = b & 0x7f_ffff;
    if exp == 0xff {
        return sign | 0x7c00 | if mant != 0 { 0x200 } else { 0 };
    }
    let e = exp - 127 + 15;
    if e >= 0x1f {
        return sign | 0x7c00;
    }
    if e <= 0 {
        if e < -10 {
            return sign;
        }
        let m = mant | 0x80_0000;
        let shift = (14 - e) as u32;
        let half = 1u32 << (shift - 1);
        let rest = m & ((1u32 << shift) - 1);
        let mut r = m >> shift;
        if rest > half || (rest == half && (r & 1) != 0) {
            r += 1;
        }
        return sign | r as u16;
    }
    // Normal: rounding may carry into the exponent, which is exactly right.
    let v = ((e as u32) << 10) | (mant >> 13);
    let rest = mant & 0x1fff;
    let r = if rest > 0x1000 || (rest == 0x1000 && (v & 1) != 0) {
        v + 1
    } else {
        v
    };
    if r >= 0x7c00 {
        return sign | 0x7c00;
    }
    sign | r as u16
}

#[inline(always)]
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

#[inline(always)]
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if (b & 0x7fff_ffff) > 0x7f80_0000 {
        return (((b >> 16) | 0x40) & 0xffff) as u16;
    }
    (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// Reads `out.len()` elements of `dtype` from `src` as f32.
pub fn load(src: &[u8], dtype: u32, out: &mut [f32]) {
    let done = load_simd(src, dtype, out);
    let (src, out) = (
        &src[done * elem_bytes(dtype).unwrap_or(4)..],
        &mut out[done..],
    );
    match dtype {
        DT_F16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f16_to_f32(u16::from_le_bytes([c[0], c[1]]));
            }
        }
        DT_BF16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = bf16_to_f32(u16::from_le_bytes([c[0], c[1]]));
            }
        }
        _ => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
    }
}

/// SIMD widening of 8 elements at a time; returns how many were converted.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
fn load_simd(src: &[u8], dtype: u32, out: &mut [f32]) -> usize {
    use core::arch::wasm32::*;
    let n = out.len().min(src.len() / elem_bytes(dtype).unwrap_or(4));
    if dtype != DT_F16 && dtype != DT_BF16 {
        return 0;
    }
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 ≤ n bounds both the 16 source bytes and the 8 outputs.
        unsafe {
            let h = v128_load(src.as_ptr().add(2 * i) as *const v128);
            let lo = u32x4_extend_low_u16x8(h);
            let hi = u32x4_extend_high_u16x8(h);
            let (a, b) = if dtype == DT_BF16 {
                (u32x4_shl(lo, 16), u32x4_shl(hi, 16))
            } else {
                (f16x4_to_f32(lo), f16x4_to_f32(hi))
            };
            v128_store(out.as_mut_ptr().add(i) as *mut v128, a);
            v128_store(out.as_mut_ptr().add(i + 4) as *mut v128, b);
        }
        i += 8;
    }
    i
}

#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
fn load_simd(_src: &[u8], _dtype: u32, _out: &mut [f32]) -> usize {
    0
}

/// fp16 bits (in u32 lanes) → f32, exact for normals, subnormals, Inf and NaN:
/// shift the magnitude into f32 position and multiply by 2^112 (an exact power
/// of two that rebiases the exponent and normalises subnormals), then force the
/// exponent to all ones where the half was Inf/NaN.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[inline(always)]
fn f16x4_to_f32(h: core::arch::wasm32::v128) -> core::arch::wasm32::v128 {
    use core::arch::wasm32::*;
    let sign = u32x4_shl(v128_and(h, u32x4_splat(0x8000)), 16);
    let em = u32x4_shl(v128_and(h, u32x4_splat(0x7fff)), 13);
    let v = f32x4_mul(em, f32x4_splat(f32::from_bits((127 + 112) << 23))); // 2^112
    let infnan = f32x4_ge(v, f32x4_splat(65536.0));
    let v = v128_or(v, v128_and(infnan, u32x4_splat(0x7f80_0000)));
    v128_or(v, sign)
}
