//! kvgate lossy mode. Each layer's K and V are uniform-quantized with a step
//! derived from a target relative error (early layers get finer steps, chosen by
//! the caller), scaled per channel (K) or per token (V). Keys are predicted from
//! the previous token where that pays (token locality), residuals go through an
//! escape-bucket alphabet into rANS with per-channel-class tables.

use crate::bytes::{put_u32, put_varint, unzigzag, zigzag, BitReader, BitWriter, Reader};
use crate::half::{self, DT_BF16, DT_F16};
use crate::rans::{decode_block, encode_block};

pub const ALPHABET: usize = 64;
const DIRECT: u32 = 16;
const QMAX: i32 = 1 << 23;

const F_CHSCALE: u8 = 1;
const F_TOKSCALE: u8 = 2;
const F_MODES: u8 = 4;

pub struct StreamParams {
    /// Target relative RMS error of this stream.
    pub eps: f32,
    /// Per-channel step exponent (0 = one step for all channels).
    pub gamma_c: f32,
    /// Per-token step exponent.
    pub gamma_t: f32,
    /// Let channels be coded as deltas from the previous token.
    pub delta: bool,
    pub max_classes: usize,
}

fn scale_of(code: u8) -> f32 {
    (2.0f64).powf((code as f64 - 128.0) / 8.0) as f32
}

fn scale_code(ratio: f64, gamma: f32) -> u8 {
    if !(ratio > 0.0) || !ratio.is_finite() {
        return 128;
    }
    let v = (8.0 * gamma as f64 * ratio.log2()).round() + 128.0;
    v.max(0.0).min(255.0) as u8
}

#[inline(always)]
fn round_i(v: f32) -> i32 {
    let r = (v + if v >= 0.0 { 0.5 } else { -0.5 }) as i32;
    r.max(-QMAX).min(QMAX)
}

#[inline(always)]
fn symbolize(z: u32, bits: &mut BitWriter) -> u8 {
    if z < DIRECT {
        return z as u8;
    }
    let k = 31 - z.leading_zeros();
    bits.put(z, k - 1);
    (DIRECT + 2 * (k - 4) + ((z >> (k - 1)) & 1)) as u8
}

/// Encodes one T×C stream `x` (f32, row = token).
pub fn encode_stream(x: &[f32], t: usize, c: usize, p: &StreamParams, out: &mut Vec<u8>) {
    let mut ss = 0f64;
    let mut cnt = 0usize;
    for &v in x {
        if v.is_finite() {
            ss += (v as f64) * (v as f64);
            cnt += 1;
        }
    }
    let rms = if cnt > 0 {
        (ss / cnt as f64).sqrt()
    } else {
        0.0
    };
    let mut base = (p.eps as f64 * 12f64.sqrt() * rms) as f32;
    if !(base > 1e-30) || !base.is_finite() {
        base = 1.0;
    }
    let mut flags = 0u8;
    let mut ch_codes = vec![128u8; c];
    let mut tok_codes = vec![128u8; t];
    if p.gamma_c > 0.0 && rms > 0.0 {
        flags |= F_CHSCALE;
        for ch in 0..c {
            let mut s = 0f64;
            for tt in 0..t {
                let v = x[tt * c + ch];
                if v.is_finite() {
                    s += (v as f64) * (v as f64);
                }
            }
            ch_codes[ch] = scale_code((s / t as f64).sqrt() / rms, p.gamma_c);
        }
    }
    if p.gamma_t > 0.0 && rms > 0.0 {
        flags |= F_TOKSCALE;
        for tt in 0..t {
            let mut s = 0f64;
            for &v in &x[tt * c..(tt + 1) * c] {
                if v.is_finite() {
                    s += (v as f64) * (v as f64);
                }
            }
            tok_codes[tt] = scale_code((s / c as f64).sqrt() / rms, p.gamma_t);
        }
    }
    let inv_c: Vec<f32> = ch_codes
        .iter()
        .map(|&k| 1.0 / (base * scale_of(k)))
        .collect();
    let inv_t: Vec<f32> = tok_codes.iter().map(|&k| 1.0 / scale_of(k)).collect();
    let mut q = vec![0i32; t * c];
    for tt in 0..t {
        let it = inv_t[tt];
        let row = &x[tt * c..(tt + 1) * c];
        let qr = &mut q[tt * c..(tt + 1) * c];
        for ch in 0..c {
            let v = row[ch];
            qr[ch] = if v.is_nan() {
                0
            } else {
                round_i(v * inv_c[ch] * it)
            };
        }
    }
    // Channel prediction: delta from the previous token vs a constant centre.
    let mut delta = vec![false; c];
    let mut centers = vec![0i32; c];
    for ch in 0..c {
        let mut sum = 0i64;
        for tt in 0..t {
            sum += q[tt * c + ch] as i64;
        }
        let center = (sum as f64 / t as f64).round() as i32;
        centers[ch] = center;
        if p.delta && t > 1 {
            let mut cost_c = 0u64;
            let mut cost_d = 0u64;
            let q0 = q[ch];
            let mut prev = q0;
            for tt in 0..t {
                let v = q[tt * c + ch];
                cost_c += 32 - zigzag(v.wrapping_sub(center)).leading_zeros() as u64;
                let pd = if tt == 0 { q0 } else { prev };
                cost_d += 32 - zigzag(v.wrapping_sub(pd)).leading_zeros() as u64;
                prev = v;
            }
            if cost_d < cost_c {
                delta[ch] = true;
                centers[ch] = q0;
            }
        }
    }
    if delta.iter().any(|&d| d) {
        flags |= F_MODES;
    }
    let mut syms = vec![0u8; t * c];
    let mut bits = BitWriter::new();
    for tt in 0..t {
        for ch in 0..c {
            let v = q[tt * c + ch];
            let pred = if delta[ch] && tt > 0 {
                q[(tt - 1) * c + ch]
            } else {
                centers[ch]
            };
            syms[tt * c + ch] = symbolize(zigzag(v.wrapping_sub(pred)), &mut bits);
        }
    }
    out.extend_from_slice(&base.to_le_bytes());
    out.push(flags);
    if flags & F_CHSCALE != 0 {
        out.extend_from_slice(&ch_codes);
    }
    if flags & F_TOKSCALE != 0 {
        out.extend_from_slice(&tok_codes);
    }
    if flags & F_MODES != 0 {
        let mut m = vec![0u8; (c + 7) / 8];
        for ch in 0..c {
            if delta[ch] {
                m[ch / 8] |= 1 << (ch % 8);
            }
        }
        out.extend_from_slice(&m);
    }
    for &ctr in &centers {
        put_varint(out, zigzag(ctr));
    }
    let extra = bits.finish();
    put_u32(out, extra.len() as u32);
    out.extend_from_slice(&extra);
    encode_block(out, &syms, t, c, ALPHABET, p.max_classes);
}

#[inline(always)]
pub fn store(dst: &mut [u8], i: usize, dtype: u32, v: f32) {
    match dtype {
        DT_F16 => {
            let b = half::f32_to_f16(v).to_le_bytes();
            if let Some(d) = dst.get_mut(2 * i..2 * i + 2) {
                d.copy_from_slice(&b);
            }
        }
        DT_BF16 => {
            let b = half::f32_to_bf16(v).to_le_bytes();
            if let Some(d) = dst.get_mut(2 * i..2 * i + 2) {
                d.copy_from_slice(&b);
            }
        }
        _ => {
            if let Some(d) = dst.get_mut(4 * i..4 * i + 4) {
                d.copy_from_slice(&v.to_le_bytes());
            }
        }
    }
}

/// Decodes one stream into elements [offset, offset + T×C) of `dst`.
pub fn decode_stream(
    r: &mut Reader,
    t: usize,
    c: usize,
    dtype: u32,
    dst: &mut [u8],
    offset: usize,
    syms: &mut [u8],
) -> Option<()> {
    let base = r.f32()?;
    if !base.is_finite() {
        return None;
    }
    let flags = r.u8()?;
    if flags & !(F_CHSCALE | F_TOKSCALE | F_MODES) != 0 {
        return None;
    }
    let mut stepc = vec![base; c];
    if flags & F_CHSCALE != 0 {
        for (s, &k) in stepc.iter_mut().zip(r.take(c)?) {
            *s = base * scale_of(k);
        }
    }
    let mut mt = vec![1f32; t];
    if flags & F_TOKSCALE != 0 {
        for (s, &k) in mt.iter_mut().zip(r.take(t)?) {
            *s = scale_of(k);
        }
    }
    let mut delta = vec![false; c];
    if flags & F_MODES != 0 {
        let m = r.take((c + 7) / 8)?;
        for ch in 0..c {
            delta[ch] = m[ch / 8] & (1 << (ch % 8)) != 0;
        }
    }
    let mut centers = vec![0i32; c];
    for ctr in centers.iter_mut() {
        *ctr = unzigzag(r.varint()?);
    }
    let extra = r.block()?;
    decode_block(r, t, c, ALPHABET, syms)?;
    let mut bits = BitReader::new(extra);
    let mut prev = centers.clone();
    let mut o = offset;
    for tt in 0..t {
        let row = &syms[tt * c..(tt + 1) * c];
        let m = mt[tt];
        for ch in 0..c {
            let s = row[ch] as u32;
            let z = if s < DIRECT {
                s
            } else {
                let j = s - DIRECT;
                let k = j / 2 + 4;
                if k > 27 {
                    return None;
                }
                (1u32 << k) | ((j & 1) << (k - 1)) | bits.get(k - 1)
            };
            let pred = if delta[ch] { prev[ch] } else { centers[ch] };
            let qv = pred.wrapping_add(unzigzag(z));
            prev[ch] = qv;
            store(dst, o, dtype, qv as f32 * stepc[ch] * m);
            o += 1;
        }
    }
    if bits.overrun {
        return None;
    }
    Some(())
}

pub fn encode(
    x: &[f32],
    t: usize,
    c: usize,
    pk: &StreamParams,
    pv: &StreamParams,
    out: &mut Vec<u8>,
) {
    let n = t * c;
    let mut ks = Vec::new();
    encode_stream(&x[..n], t, c, pk, &mut ks);
    put_u32(out, ks.len() as u32);
    out.extend_from_slice(&ks);
    encode_stream(&x[n..2 * n], t, c, pv, out);
}

pub fn decode(input: &[u8], dtype: u32, t: usize, c: usize, dst: &mut [u8]) -> Option<()> {
    let eb = half::elem_bytes(dtype)?;
    let n = t * c;
    if dst.len() != 2 * n * eb {
        return None;
    }
    let mut syms = vec![0u8; n];
    let mut r = Reader::new(input);
    let mut rk = Reader::new(r.block()?);
    decode_stream(&mut rk, t, c, dtype, dst, 0, &mut syms)?;
    if rk.remaining() != 0 {
        return None;
    }
    decode_stream(&mut r, t, c, dtype, dst, n, &mut syms)?;
    if r.remaining() != 0 {
        return None;
    }
    Some(())
}
