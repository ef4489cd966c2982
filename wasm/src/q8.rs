//! q8 mode: plain symmetric 8-bit quantization with one f32 scale per token
//! (per K/V row). A simple, fast baseline between raw and the entropy-coded modes.

use crate::bytes::Reader;
use crate::half;

pub fn encode(x: &[f32], t: usize, c: usize, out: &mut Vec<u8>) {
    for kv in 0..2 {
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

pub fn decode(input: &[u8], dtype: u32, t: usize, c: usize, dst: &mut [u8]) -> Option<()> {
    let eb = half::elem_bytes(dtype)?;
    if input.len() != 2 * (t * 4 + t * c) || dst.len() != 2 * t * c * eb {
        return None;
    }
    let mut r = Reader::new(input);
    let mut o = 0usize;
    for _ in 0..2 {
        let mut scales = Vec::with_capacity(t);
        for _ in 0..t {
            scales.push(r.f32()?);
        }
        let q = r.take(t * c)?;
        for (row, &s) in q.chunks_exact(c).zip(&scales) {
            for &b in row {
                let v = (b as i8) as f32 * s;
                crate::lossy::store(dst, o, dtype, v);
                o += 1;
            }
        }
    }
    Some(())
}
