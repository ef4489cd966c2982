//! Static interleaved rANS (4 states, 12-bit probabilities, byte renormalisation)
//! over "blocks": a T×C symbol matrix whose channels are grouped into classes,
//! each class with its own compact frequency table. Decode is table driven.

use crate::bytes::{put_u32, put_varint, Reader};

pub const PROB_BITS: u32 = 12;
pub const PROB_SCALE: u32 = 1 << PROB_BITS;
const RANS_L: u32 = 1 << 23;
pub const MAX_CLASSES: usize = 8;
const LANES: usize = 4;

/// Scales raw counts to a table summing to PROB_SCALE with every present symbol
/// ≥ 1 and every frequency ≤ PROB_SCALE-1 (so it fits the 12-bit decode entry).
pub fn normalize(counts: &[u64]) -> Vec<u32> {
    let mut n = counts.len();
    while n > 0 && counts[n - 1] == 0 {
        n -= 1;
    }
    let total: u64 = counts.iter().sum();
    let mut f = vec![0u32; n.max(2)];
    if total == 0 {
        f[0] = PROB_SCALE - 1;
        f[1] = 1;
        return f;
    }
    for i in 0..n {
        if counts[i] > 0 {
            let v = (counts[i] as u128 * PROB_SCALE as u128 / total as u128) as u32;
            f[i] = v.max(1);
        }
    }
    // A lone symbol would need freq 4096; give a neighbour one slot instead.
    let present = f.iter().filter(|&&v| v > 0).count();
    if present == 1 {
        let i = f.iter().position(|&v| v > 0).unwrap_or(0);
        let j = if i == 0 { 1 } else { i - 1 };
        f[j] = 1;
    }
    let mut sum: i64 = f.iter().map(|&v| v as i64).sum();
    while sum != PROB_SCALE as i64 {
        // Adjust the largest entry; when it cannot absorb the deficit, shave others.
        let (imax, _) = f
            .iter()
            .enumerate()
            .max_by_key(|(_, &v)| v)
            .unwrap_or((0, &0));
        let diff = PROB_SCALE as i64 - sum;
        if diff > 0 {
            f[imax] += diff as u32;
            sum += diff;
        } else {
            let can = f[imax] as i64 - 1;
            let take = can.min(-diff);
            if take <= 0 {
                break;
            }
            f[imax] -= take as u32;
            sum -= take;
        }
    }
    for v in f.iter_mut() {
        if *v >= PROB_SCALE {
            *v = PROB_SCALE - 1;
        }
    }
    f
}

/// Approximate cost in bits of coding `counts` with `freqs`.
pub fn cost_bits(counts: &[u64], freqs: &[u32]) -> f64 {
    let mut bits = 0.0;
    for (i, &c) in counts.iter().enumerate() {
        if c > 0 {
            let f = freqs.get(i).copied().unwrap_or(1).max(1) as f64;
            bits += c as f64 * (PROB_BITS as f64 - f.log2());
        }
    }
    bits
}

pub fn write_table(out: &mut Vec<u8>, f: &[u32]) {
    // symbol count then one varint per symbol: tiny for lossy alphabets (~20 symbols).
    out.push((f.len() - 1) as u8);
    for &v in f {
        put_varint(out, v);
    }
}

fn table_bytes(f: &[u32]) -> usize {
    1 + f
        .iter()
        .map(|&v| if v < 128 { 1 } else { 2 })
        .sum::<usize>()
}

/// Decode table: entry = freq << 20 | (slot - start) << 8 | symbol.
pub fn read_table(r: &mut Reader, max_syms: usize, dec: &mut [u32]) -> Option<()> {
    let n = r.u8()? as usize + 1;
    if n > max_syms {
        return None;
    }
    let mut pos: u32 = 0;
    for s in 0..n {
        let f = r.varint()?;
        if f >= PROB_SCALE || pos + f > PROB_SCALE {
            return None;
        }
        for k in 0..f {
            dec[(pos + k) as usize] = (f << 20) | (k << 8) | s as u32;
        }
        pos += f;
    }
    if pos != PROB_SCALE {
        return None;
    }
    Some(())
}

/// Encodes a T×C symbol matrix (row major) into `out`.
/// Channels are grouped into up to `max_classes` classes chosen by cost.
pub fn encode_block(
    out: &mut Vec<u8>,
    syms: &[u8],
    t: usize,
    c: usize,
    alphabet: usize,
    max_classes: usize,
) {
    // Per-channel histograms.
    let mut hist = vec![0u64; c * alphabet];
    for row in syms.chunks_exact(c).take(t) {
        for (ch, &s) in row.iter().enumerate() {
            hist[ch * alphabet + s as usize] += 1;
        }
    }
    // Order channels by their mean symbol (a proxy for residual scale).
    let mut order: Vec<(u64, usize)> = (0..c)
        .map(|ch| {
            let h = &hist[ch * alphabet..(ch + 1) * alphabet];
            let mut m = 0u64;
            for (s, &n) in h.iter().enumerate() {
                m += n * s as u64;
            }
            (m, ch)
        })
        .collect();
    order.sort();
    let mut best: Option<(f64, usize, Vec<u8>, Vec<Vec<u32>>)> = None;
    let mut k = 1usize;
    while k <= max_classes.min(MAX_CLASSES).min(c.max(1)) {
        let mut class_of = vec![0u8; c];
        for (rank, &(_, ch)) in order.iter().enumerate() {
            class_of[ch] = ((rank * k) / c.max(1)) as u8;
        }
        let mut tables = Vec::new();
        let mut bits = 0.0;
        let mut side = if k > 1 { c } else { 0 };
        for cls in 0..k {
            let mut counts = vec![0u64; alphabet];
            for ch in 0..c {
                if class_of[ch] as usize == cls {
                    for s in 0..alphabet {
                        counts[s] += hist[ch * alphabet + s];
                    }
                }
            }
            let f = normalize(&counts);
            bits += cost_bits(&counts, &f);
            side += table_bytes(&f);
            tables.push(f);
        }
        let total = bits / 8.0 + side as f64;
        if best.as_ref().map_or(true, |b| total < b.0) {
            best = Some((total, k, class_of, tables));
        }
        k *= 2;
    }
    let (_, k, class_of, tables) = match best {
        Some(b) => b,
        None => return,
    };
    out.push(k as u8);
    if k > 1 {
        out.extend_from_slice(&class_of);
    }
    for f in &tables {
        write_table(out, f);
    }
    // Cumulative starts per class.
    let mut enc: Vec<Vec<(u32, u32)>> = Vec::with_capacity(k);
    for f in &tables {
        let mut cum = 0u32;
        let mut e = Vec::with_capacity(f.len());
        for &v in f {
            e.push((cum, v));
            cum += v;
        }
        enc.push(e);
    }
    let n = t * c;
    let cap = n * 2 + 64;
    let mut buf = vec![0u8; cap];
    let mut p = cap;
    let mut x = [RANS_L; LANES];
    for i in (0..n).rev() {
        let s = syms[i] as usize;
        let cls = class_of[i % c] as usize;
        let (start, freq) = enc[cls][s];
        let lane = i & (LANES - 1);
        let mut xs = x[lane];
        let x_max = ((RANS_L >> PROB_BITS) << 8) * freq;
        while xs >= x_max {
            p -= 1;
            buf[p] = xs as u8;
            xs >>= 8;
        }
        x[lane] = ((xs / freq) << PROB_BITS) + (xs % freq) + start;
    }
    for lane in (0..LANES).rev() {
        p -= 4;
        buf[p..p + 4].copy_from_slice(&x[lane].to_le_bytes());
    }
    put_u32(out, (cap - p) as u32);
    out.extend_from_slice(&buf[p..]);
}

/// Decodes a block written by `encode_block` into `syms` (T×C). Never panics on
/// hostile input: reads past the payload yield zeros and fail the final check.
pub fn decode_block(
    r: &mut Reader,
    t: usize,
    c: usize,
    alphabet: usize,
    syms: &mut [u8],
) -> Option<()> {
    let k = r.u8()? as usize;
    if k == 0 || k > MAX_CLASSES {
        return None;
    }
    let mut class_of: Vec<usize> = vec![0; c];
    if k > 1 {
        let cls = r.take(c)?;
        for (d, &v) in class_of.iter_mut().zip(cls) {
            if v as usize >= k {
                return None;
            }
            *d = v as usize * PROB_SCALE as usize;
        }
    }
    let mut dec = vec![0u32; k * PROB_SCALE as usize];
    for cls in 0..k {
        read_table(
            r,
            alphabet,
            &mut dec[cls * PROB_SCALE as usize..(cls + 1) * PROB_SCALE as usize],
        )?;
    }
    let payload = r.block()?;
    let n = t * c;
    if syms.len() < n {
        return None;
    }
    if payload.len() < 4 * LANES {
        return None;
    }
    let mut x = [0u32; LANES];
    for lane in 0..LANES {
        let b = &payload[lane * 4..lane * 4 + 4];
        x[lane] = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
    let data = &payload[4 * LANES..];
    let mut p = 0usize;
    let mask = PROB_SCALE - 1;
    // Hot loop: one table lookup per symbol, at most two renorm bytes.
    macro_rules! step {
        ($lane:expr, $i:expr, $base:expr) => {{
            let xs = x[$lane];
            let e = unsafe_get(&dec, $base + (xs & mask) as usize);
            syms[$i] = e as u8;
            let mut xs = (e >> 20) * (xs >> PROB_BITS) + ((e >> 8) & 0xfff);
            while xs < RANS_L {
                let b = match data.get(p) {
                    Some(b) => *b as u32,
                    None => return None,
                };
                p += 1;
                xs = (xs << 8) | b;
            }
            x[$lane] = xs;
        }};
    }
    if k == 1 {
        let mut i = 0;
        while i + LANES <= n {
            step!(0, i, 0);
            step!(1, i + 1, 0);
            step!(2, i + 2, 0);
            step!(3, i + 3, 0);
            i += LANES;
        }
        while i < n {
            step!(i & 3, i, 0);
            i += 1;
        }
    } else {
        let mut i = 0;
        for _ in 0..t {
            for ch in 0..c {
                let base = class_of[ch];
                step!(i & 3, i, base);
                i += 1;
            }
        }
    }
    // An honest stream ends exactly where the encoder started.
    if p != data.len() || x.iter().any(|&v| v != RANS_L) {
        return None;
    }
    Some(())
}

#[inline(always)]
fn unsafe_get(t: &[u32], i: usize) -> u32 {
    // i is masked to < PROB_SCALE plus a class base < k*PROB_SCALE = t.len().
    match t.get(i) {
        Some(v) => *v,
        None => 0,
    }
}
