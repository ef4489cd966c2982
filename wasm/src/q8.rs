//! q8 mode: plain symmetric 8-bit quantization with one f32 scale per token
//! (per K/V or latent row). A simple, fast baseline between raw and the entropy-coded modes.

use crate::bytes::Reader;
use crate::half;

pub fn encode(x: &[f32], t: usize, c: usize, planes: usize, out: &mut Vec<u8>) {
    for kv in 0..planes {
        let m = &x[kv * t * c..(kv + 1) * t * c];
        let mut scales = Vec::with_capacity(t);
        for row in m.chunks_exact(c) {
            let mut mx = 0f32;
            for &v in row {
                let a = v.abs();
                if a > mx && a.is_finite() {
                    mx = a;
                }
            }
            let s = if mx > 0.0 { mx / 127.0 } else { 1.0 };
            scales.push(s);
            out.extend_from_slice(&s.to_le_bytes());
        }
        for (row, &s) in m.chunks_exact(c).zip(&scales) {
            let inv = 1.0 / s;
            for &v in row {
                let y = v * inv;
                let q = (y + if y >= 0.0 { 0.5 } else { -0.5 }) as i32;
                out.push(q.max(-127).min(127) as i8 as u8);
            }
        }
    }
}

pub fn decode(
    input: &[u8],
    dtype: u32,
    t: usize,
    c: usize,
    planes: usize,
    dst: &mut [u8],
) -> Option<()> {
    let eb = half::elem_bytes(dtype)?;
    if input.len() != planes * (t * 4 + t * c) || dst.len() != planes * t * c * eb {
        return None;
    }
    let mut r = Reader::new(input);
    let mut o = 0usize;
    for _ in 0..planes {
        let mut scales = Vec::with_capacity(t);
        for _ in 0..t {
            scales.push(r.f32()?);
        }
        let q = r.take(t * c)?;
        // dtype dispatch outside the element loop (a per-element match costs ~3×).
        match dtype {
            half::DT_F16 => rows16(
                q,
                &scales,
                c,
                &mut dst[2 * o..2 * (o + t * c)],
                half::f32_to_f16,
            ),
            half::DT_BF16 => rows16(
                q,
                &scales,
                c,
                &mut dst[2 * o..2 * (o + t * c)],
                half::f32_to_bf16,
            ),
            _ => {
                let out = &mut dst[4 * o..4 * (o + t * c)];
                for ((row, &s), d) in q
                    .chunks_exact(c)
                    .zip(&scales)
                    .zip(out.chunks_exact_mut(4 * c))
                {
                    for (&b, e) in row.iter().zip(d.chunks_exact_mut(4)) {
                        e.copy_from_slice(&((b as i8) as f32 * s).to_le_bytes());
                    }
                }
            }
        }
        o += t * c;
    }
    Some(())
}

/// One K or V plane into 16-bit elements; generic so `conv` inlines.
fn rows16(q: &[u8], scales: &[f32], c: usize, out: &mut [u8], conv: impl Fn(f32) -> u16) {
    for ((row, &s), d) in q
        .chunks_exact(c)
        .zip(scales)
        .zip(out.chunks_exact_mut(2 * c))
    {
        for (&b, e) in row.iter().zip(d.chunks_exact_mut(2)) {
            e.copy_from_slice(&conv((b as i8) as f32 * s).to_le_bytes());
        }
    }
}
