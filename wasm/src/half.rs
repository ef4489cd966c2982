//! fp16 / bf16 / fp32 element conversions (round to nearest even), matching
//! src/core/dtype.ts so a chunk decodes to the same bits in every runtime.

pub const DT_F16: u32 = 1;
pub const DT_BF16: u32 = 2;
pub const DT_F32: u32 = 3;

pub fn elem_bytes(dtype: u32) -> Option<usize> {
    match dtype {
        DT_F16 | DT_BF16 => Some(2),
        DT_F32 => Some(4),
        _ => None,
    }
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

/// Reads `n` elements of `dtype` from `src` as f32.
pub fn load(src: &[u8], dtype: u32, out: &mut [f32]) {
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
