//! Lossless mode: each layer's K and V are split into byte planes (one per
//! element byte) and every plane is rANS coded with per-channel-class tables;
//! a plane that does not compress is stored raw.

use crate::bytes::Reader;
use crate::rans::{class_counts, class_partition, decode_block, encode_block};

fn encode_plane(out: &mut Vec<u8>, plane: &[u8], t: usize, c: usize) {
    let mut sums = vec![0u32; c];
    for row in plane.chunks_exact(c) {
        for (s, &b) in sums.iter_mut().zip(row) {
            *s += b as u32;
        }
    }
    let (kmax, fine) = class_partition(&sums, c, 8);
    let counts = class_counts(plane, &fine, kmax, c, 256);
    let mut coded = Vec::new();
    encode_block(&mut coded, plane, &fine, kmax, &counts, t, c, 256);
    if coded.len() < plane.len() {
        out.push(1);
        out.extend_from_slice(&coded);
    } else {
        out.push(0);
        out.extend_from_slice(plane);
    }
}

/// `src` is one layer slab (K then V, or one latent plane: `planes` × T×C elements,
/// `eb` bytes per element).
pub fn encode(src: &[u8], eb: usize, t: usize, c: usize, planes: usize, out: &mut Vec<u8>) {
    let n = t * c;
    let mut plane = vec![0u8; n];
    for kv in 0..planes {
        let half = &src[kv * n * eb..(kv + 1) * n * eb];
        for b in 0..eb {
            for (i, p) in plane.iter_mut().enumerate() {
                *p = half[i * eb + b];
            }
            encode_plane(out, &plane, t, c);
        }
    }
}

pub fn decode(
    input: &[u8],
    eb: usize,
    t: usize,
    c: usize,
    planes: usize,
    dst: &mut [u8],
) -> Option<()> {
    let n = t * c;
    if dst.len() != planes * n * eb {
        return None;
    }
    let mut r = Reader::new(input);
    let mut plane = vec![0u8; n];
    for kv in 0..planes {
        for b in 0..eb {
            match r.u8()? {
                0 => plane.copy_from_slice(r.take(n)?),
                1 => decode_block(&mut r, t, c, 256, &mut plane)?,
                _ => return None,
            }
            let half = &mut dst[kv * n * eb..(kv + 1) * n * eb];
            for (i, &p) in plane.iter().enumerate() {
                half[i * eb + b] = p;
            }
        }
    }
    if r.remaining() != 0 {
        return None;
    }
    Some(())
}
