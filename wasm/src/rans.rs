//! Static interleaved rANS (8 states, 11-bit probabilities (tables stay in L1), 16-bit renormalisation)
//! over "blocks": a T×C symbol matrix whose channels are grouped into classes,
//! each class with its own compact frequency table. Decode is table driven.

use crate::bytes::{put_u32, put_varint, Reader};

pub const PROB_BITS: u32 = 11;
pub const PROB_SCALE: u32 = 1 << PROB_BITS;
/// State lower bound; with 16-bit renormalisation a decode step reads at most one word.
const RANS_L: u32 = 1 << 16;
pub const MAX_CLASSES: usize = 8;
/// Interleaved states: enough independent chains to hide the table-lookup latency.
const LANES: usize = 8;

/// Scales raw counts to a table summing to PROB_SCALE with every present symbol
/// ≥ 1 and every frequency ≤ PROB_SCALE-1 (so it fits the 12-bit freq field of a decode entry).
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
    // A lone symbol would need freq PROB_SCALE; give a neighbour one slot instead.
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

/// Decode table: entry = symbol << 24 | (slot - start) << 11 | freq (`dec_entry`).
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
            dec[(pos + k) as usize] = dec_entry(s as u32, k, f);
        }
        pos += f;
    }
    if pos != PROB_SCALE {
        return None;
    }
    Some(())
}

/// A decode table entry: the symbol (< 256), the slot's offset in its run (< freq) and the
/// frequency (< PROB_SCALE), laid out so the decoders take freq and offset with the slot mask
/// (PROB_SCALE − 1, already in a register) and the symbol with one shift: fewer vector
/// constants live in the SIMD loops (V8 spilled them).
#[inline(always)]
fn dec_entry(sym: u32, offset: u32, freq: u32) -> u32 {
    (sym << 24) | (offset << PROB_BITS) | freq
}

/// A vector of `n` elements that the caller overwrites before reading.
/// Skips zeroing large scratch buffers (memset showed up at ~7% of encode time).
pub fn uninit_vec<T: Copy>(n: usize) -> Vec<T> {
    let mut v = Vec::with_capacity(n);
    // SAFETY: T is a plain number type (any bit pattern is valid) and every caller
    // writes each element it later reads.
    unsafe { v.set_len(n) };
    v
}

/// Encoder symbol with a reciprocal so the hot loop needs no division (ryg_rans),
/// packed in two words (`meta` = freq | rcp_shift << 12 | bias << 16): five
/// separate fields made LLVM hoist 40 loads per group of 8 and V8 spill them.
#[derive(Clone, Copy, Default)]
struct EncSym {
    rcp_freq: u32,
    meta: u32,
}

/// x_max = X_MAX_UNIT · freq: a state at or above it must shed 16 bits first.
const X_MAX_UNIT: u32 = (RANS_L >> PROB_BITS) << 16;

fn enc_sym(start: u32, freq: u32) -> EncSym {
    // freq ≤ PROB_SCALE − 1 (12 bits), shift ≤ 11 (4 bits), bias ≤ 2·PROB_SCALE (13 bits).
    if freq < 2 {
        EncSym {
            rcp_freq: !0u32,
            meta: freq | (start + PROB_SCALE - 1) << 16,
        }
    } else {
        let mut shift = 0u32;
        while freq > (1u32 << shift) {
            shift += 1;
        }
        let rcp = (((1u64 << (shift + 31)) + freq as u64 - 1) / freq as u64) as u32;
        EncSym {
            rcp_freq: rcp,
            meta: freq | (shift - 1) << 12 | start << 16,
        }
    }
}

/// One rANS encode step: returns the new state and whether the low 16 bits of
/// the old state must be written first.
///
/// `FIX`: apply the one-compare quotient correction. Only symbols with freq > 1024 can need
/// it (their states reach 2^31); `encode_block` leaves it out when no table has one.
#[inline(always)]
fn enc_step<const FIX: bool>(e: EncSym, xs: u32) -> (u32, bool) {
    let freq = e.meta & 0xfff;
    let big = xs >= X_MAX_UNIT * freq;
    let xs = if big { xs >> 16 } else { xs };
    let q = (((xs as u64) * (e.rcp_freq as u64)) >> 32) as u32 >> ((e.meta >> 12) & 0xf);
    // The reciprocal is exact only below 2^31 (ryg_rans' bound); states of symbols with
    // freq > 1024 reach up to 2^21·freq < 2^32, where it can overshoot x / freq by one
    // (a skewed table, e.g. coarse V steps, then coded a stream no decoder accepts).
    // q·freq ≤ 2^21·freq < 2^32 cannot overflow.
    let q = if FIX { q - (q * freq > xs) as u32 } else { q };
    (xs + (e.meta >> 16) + q * (PROB_SCALE - freq), big)
}

/// Cuts channels into `kmax` (a power of two ≤ 8, ≤ max_classes, ≤ C) equal
/// rank ranges by `rank` (an estimate of each channel's residual scale). Returns
/// kmax and each channel's finest class; coarser classes are `fine >> j`.
pub fn class_partition(rank: &[u32], c: usize, max_classes: usize) -> (usize, Vec<u8>) {
    let mut kmax = 1usize;
    while kmax * 2 <= max_classes.min(MAX_CLASSES).min(c.max(1)) {
        kmax *= 2;
    }
    let mut fine = vec![0u8; c];
    let rank = &rank[..c];
    let top = rank.iter().copied().max().unwrap_or(0) as usize;
    if top < 1 << 16 {
        // Ranks are small (sampled bit-length sums): a counting sort gives the order of the
        // sort below, by rank then channel (sorting was ~2.5 % of encode time).
        let mut at = vec![0u32; top + 2];
        for &r in rank {
            at[r as usize + 1] += 1;
        }
        for i in 1..at.len() {
            at[i] += at[i - 1];
        }
        for (ch, &r) in rank.iter().enumerate() {
            let pos = at[r as usize] as usize;
            at[r as usize] += 1;
            fine[ch] = ((pos * kmax) / c) as u8;
        }
        return (kmax, fine);
    }
    let mut order: Vec<(u32, usize)> = (0..c).map(|ch| (rank[ch], ch)).collect();
    order.sort_unstable();
    for (r, &(_, ch)) in order.iter().enumerate() {
        fine[ch] = ((r * kmax) / c.max(1)) as u8;
    }
    (kmax, fine)
}

/// Counts symbols per finest class (kmax × alphabet), for `encode_block`.
pub fn class_counts(syms: &[u8], fine: &[u8], kmax: usize, c: usize, alphabet: usize) -> Vec<u32> {
    let mut counts = vec![0u32; kmax * alphabet];
    let base: Vec<usize> = fine.iter().map(|&k| k as usize * alphabet).collect();
    for row in syms.chunks_exact(c) {
        for (&b, &sym) in base.iter().zip(row) {
            counts[b + sym as usize] += 1;
        }
    }
    counts
}

/// Tables chosen from the finest-class counts: the coded size in bytes (symbols plus
/// class map and tables), how many classes, and their tables.
pub struct ClassPlan {
    pub bytes: f64,
    pub k: usize,
    pub tables: Vec<Vec<u32>>,
}

/// Chooses k ∈ {1, 2, 4, …, kmax} classes by coded size (including table
/// bytes, and the class map unless `map_known`) from the finest-class counts.
pub fn plan_classes(
    kmax: usize,
    counts: &[u32],
    c: usize,
    alphabet: usize,
    map_known: bool,
) -> ClassPlan {
    let mut best: Option<ClassPlan> = None;
    let mut k = 1usize;
    while k <= kmax {
        let group = kmax / k;
        let mut tables = Vec::with_capacity(k);
        let mut bits = 0.0;
        let mut side = if k > 1 && !map_known { c } else { 0 };
        for cls in 0..k {
            let mut cnt = vec![0u64; alphabet];
            for f in cls * group..(cls + 1) * group {
                for (d, &v) in cnt
                    .iter_mut()
                    .zip(&counts[f * alphabet..(f + 1) * alphabet])
                {
                    *d += v as u64;
                }
            }
            let f = normalize(&cnt);
            bits += cost_bits(&cnt, &f);
            side += table_bytes(&f);
            tables.push(f);
        }
        let total = bits / 8.0 + side as f64;
        if best.as_ref().map_or(true, |b| total < b.bytes) {
            best = Some(ClassPlan {
                bytes: total,
                k,
                tables,
            });
        }
        k *= 2;
    }
    best.unwrap_or(ClassPlan {
        bytes: 0.0,
        k: 1,
        tables: vec![normalize(&[1])],
    })
}

/// Writes `nclass, [class per channel], tables` of a plan; returns each channel's class.
pub fn write_classes(out: &mut Vec<u8>, plan: &ClassPlan, fine: &[u8], kmax: usize) -> Vec<u8> {
    let shift = (kmax / plan.k).trailing_zeros();
    let class_of: Vec<u8> = fine.iter().map(|&f| f >> shift).collect();
    out.push(plan.tables.len() as u8);
    if plan.tables.len() > 1 {
        out.extend_from_slice(&class_of);
    }
    for f in &plan.tables {
        write_table(out, f);
    }
    class_of
}

/// Encodes a T×C symbol matrix (row major) into `out`, given the channels'
/// finest classes and the symbol counts per finest class (`class_counts`).
/// Channels are grouped into 1..kmax classes, each with its own table, chosen
/// by coded size.
pub fn encode_block(
    out: &mut Vec<u8>,
    syms: &[u8],
    fine: &[u8],
    kmax: usize,
    counts: &[u32],
    t: usize,
    c: usize,
    alphabet: usize,
) {
    let plan = plan_classes(kmax, counts, c, alphabet, false);
    let class_of = write_classes(out, &plan, fine, kmax);
    encode_symbols(out, syms, &class_of, &plan.tables, t, c, alphabet);
}

/// Codes a T×C symbol matrix with the given tables (class of each channel, one table
/// per class; every coded symbol has a frequency in its class): the payload block.
pub fn encode_symbols(
    out: &mut Vec<u8>,
    syms: &[u8],
    class_of: &[u8],
    tables: &[Vec<u32>],
    t: usize,
    c: usize,
    alphabet: usize,
) {
    let mut enc = vec![EncSym::default(); tables.len() * alphabet];
    for (cls, f) in tables.iter().enumerate() {
        let mut cum = 0u32;
        for (s, &v) in f.iter().enumerate() {
            if v > 0 {
                enc[cls * alphabet + s] = enc_sym(cum, v);
            }
            cum += v;
        }
    }
    let cbase: Vec<usize> = class_of.iter().map(|&k| k as usize * alphabet).collect();
    let n = t * c;
    // Worst case 12 bits per symbol plus state flush; u16 words written backwards.
    // (+ SIMD_ENC_SLACK: the SIMD encoder stores 16 bytes ending at its write position.)
    let cap = n + n / 2 + 16 + SIMD_ENC_SLACK;
    let mut buf: Vec<u16> = uninit_vec(cap);
    let mut p = cap;
    let mut x = [RANS_L; LANES];
    let bp = buf.as_mut_ptr();
    let ep = enc.as_ptr();
    let sp = syms.as_ptr();
    // Encode one symbol into state `$lane`. SAFETY: cbase[ch] + sym < enc.len()
    // (every coded symbol has an entry in its class), p ≥ 1 (cap covers the
    // worst case of one word per symbol) and i < n ≤ syms.len().
    macro_rules! put {
        ($lane:expr, $i:expr, $ch:expr) => {
            put!($lane, $i, $ch, |cc: usize| *cbase.get_unchecked(cc))
        };
        ($lane:expr, $i:expr, $ch:expr, $base:expr) => {{
            unsafe {
                let e = *ep.add($base($ch) + *sp.add($i) as usize);
                let xs = x[$lane];
                *bp.add(p - 1) = xs as u16;
                let (nx, big) = enc_step::<true>(e, xs);
                p -= big as usize;
                x[$lane] = nx;
            }
        }};
    }
    // Symbols beyond the last full group of LANES first (dynamic lanes), then
    // whole groups with fixed lanes so the states live in registers.
    let full = n - n % LANES;
    for i in (full..n).rev() {
        match i & (LANES - 1) {
            0 => put!(0, i, i % c),
            1 => put!(1, i, i % c),
            2 => put!(2, i, i % c),
            3 => put!(3, i, i % c),
            4 => put!(4, i, i % c),
            5 => put!(5, i, i % c),
            6 => put!(6, i, i % c),
            _ => put!(7, i, i % c),
        }
    }
    if c % LANES == 0 {
        // Pointers and local states (as in the decoder): fewer live registers, fewer V8 spills.
        macro_rules! groups {
            ($base:expr, $track:expr, $fix:expr) => {
                // SAFETY: as for `put!`; wp stays ≥ bp + (remaining symbols) since each
                // symbol writes at most one word and cap covers one word per symbol.
                unsafe {
                    let mut wp = bp.add(p);
                    let mut ip = sp.add(full);
                    let mut ch = full % c.max(1);
                    let (mut x0, mut x1, mut x2, mut x3) = (x[0], x[1], x[2], x[3]);
                    let (mut x4, mut x5, mut x6, mut x7) = (x[4], x[5], x[6], x[7]);
                    while ip > sp {
                        ip = ip.sub(LANES);
                        if $track {
                            ch = if ch == 0 { c - LANES } else { ch - LANES };
                        }
                        macro_rules! put8 {
                            ($xs:ident, $off:expr) => {{
                                let e = *ep.add($base(ch + $off) + *ip.add($off) as usize);
                                *wp.sub(1) = $xs as u16;
                                let (nx, big) = enc_step::<$fix>(e, $xs);
                                wp = wp.sub(big as usize);
                                $xs = nx;
                                // Keeps LLVM from hoisting all eight lanes' table loads
                                // (their live ranges made V8 spill); emits no instruction.
                                std::sync::atomic::compiler_fence(
                                    std::sync::atomic::Ordering::SeqCst,
                                );
                            }};
                        }
                        put8!(x7, 7);
                        put8!(x6, 6);
                        put8!(x5, 5);
                        put8!(x4, 4);
                        put8!(x3, 3);
                        put8!(x2, 2);
                        put8!(x1, 1);
                        put8!(x0, 0);
                    }
                    x = [x0, x1, x2, x3, x4, x5, x6, x7];
                    p = wp.offset_from(bp) as usize;
                }
            };
        }
        // Fine steps (the default levels) give no symbol a probability above 1/2.
        let fix = tables.iter().any(|f| f.iter().any(|&v| v > PROB_SCALE / 2));
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        let simd = !fix;
        #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
        let simd = false;
        if simd {
            #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
            {
                // Start and frequency of each (class, symbol), packed for one load per lane.
                // and 1 / frequency, so the hot loop multiplies instead of dividing.
                let mut fs = vec![0u32; tables.len() * alphabet];
                let mut rcp = vec![0f64; tables.len() * alphabet];
                for (cls, f) in tables.iter().enumerate() {
                    let mut cum = 0u32;
                    for (s, &v) in f.iter().enumerate() {
                        fs[cls * alphabet + s] = v | cum << 16;
                        if v > 0 {
                            rcp[cls * alphabet + s] = 1.0 / v as f64;
                        }
                        cum += v;
                    }
                }
                // SAFETY: as for `groups!` (every coded symbol's entry is inside `fs`);
                // p ≥ SIMD_ENC_SLACK + the words still to write (cap covers a word per symbol).
                p = unsafe {
                    if tables.len() == 1 {
                        simd_encode_groups::<false>(&mut x, syms, full, c, &cbase, &fs, &rcp, bp, p)
                    } else {
                        simd_encode_groups::<true>(&mut x, syms, full, c, &cbase, &fs, &rcp, bp, p)
                    }
                };
            }
        } else {
            match (tables.len() == 1, fix) {
                // One table: no per-channel class lookups.
                (true, true) => groups!(|_cc: usize| 0usize, false, true),
                (true, false) => groups!(|_cc: usize| 0usize, false, false),
                (false, true) => groups!(|cc: usize| *cbase.get_unchecked(cc), true, true),
                (false, false) => groups!(|cc: usize| *cbase.get_unchecked(cc), true, false),
            }
        }
    } else {
        let mut ch = if full > 0 { (full - 1) % c } else { 0 };
        for i in (0..full).rev() {
            match i & (LANES - 1) {
                0 => put!(0, i, ch),
                1 => put!(1, i, ch),
                2 => put!(2, i, ch),
                3 => put!(3, i, ch),
                4 => put!(4, i, ch),
                5 => put!(5, i, ch),
                6 => put!(6, i, ch),
                _ => put!(7, i, ch),
            }
            ch = if ch == 0 { c - 1 } else { ch - 1 };
        }
    }
    let words = cap - p;
    put_u32(out, (4 * LANES + 2 * words) as u32);
    for lane in 0..LANES {
        put_u32(out, x[lane]);
    }
    let words = &buf[p..];
    if cfg!(target_endian = "little") {
        // SAFETY: u16 has no padding; the words are little-endian in memory already.
        let bytes =
            unsafe { std::slice::from_raw_parts(words.as_ptr() as *const u8, words.len() * 2) };
        out.extend_from_slice(bytes);
    } else {
        for w in words {
            out.extend_from_slice(&w.to_le_bytes());
        }
    }
}

/// Words of slack below the encoder's output for the SIMD encoder's 16-byte stores.
const SIMD_ENC_SLACK: usize = 8;

/// Word compaction for the SIMD encoder: for each 4-bit mask of lanes that shed 16 bits
/// (bit j = lane j), the i8x16.swizzle that puts those lanes' low 16 bits, in lane order,
/// in the last bytes of the vector (stored so that they end at the write position).
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
const fn shed_shuffles() -> [[u8; 16]; 16] {
    let mut t = [[0x80u8; 16]; 16];
    let mut m = 0;
    while m < 16 {
        let cnt = (m & 1) + ((m >> 1) & 1) + ((m >> 2) & 1) + ((m >> 3) & 1);
        let mut k = 16 - 2 * cnt;
        let mut j = 0;
        while j < 4 {
            if (m >> j) & 1 == 1 {
                t[m][k] = 4 * j as u8;
                t[m][k + 1] = 4 * j as u8 + 1;
                k += 2;
            }
            j += 1;
        }
        m += 1;
    }
    t
}

#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
static SHED: [[u8; 16]; 16] = shed_shuffles();

/// Encodes the whole groups of LANES symbols before `full` (last group first) with the
/// 8 states in two i32x4 vectors: lanes 4–7 first, then 0–3, each vector writing the
/// words of its lanes that shed 16 bits in lane order below the previous ones: the word
/// order of the scalar encoder, so the bytes are identical. x / freq is an f64 product
/// with a tabled 1 / freq (`rcp`, exact as argued in `put!`; a division here cost a third of
/// the loop: the divider is on every state's dependency chain), so only tables without a
/// frequency above PROB_SCALE / 2 come here (their states stay below 2^31, as the signed
/// conversions and that argument need). Returns the new
/// write position (in words) and leaves the states in `x`.
///
/// SAFETY: `c % LANES == 0`, `full % LANES == 0`, `full ≤ syms.len()`, `cbase[ch] + sym` is
/// inside `fs` for every coded symbol, and `p ≥ SIMD_ENC_SLACK + full`.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn simd_encode_groups<const TRACK: bool>(
    x: &mut [u32; LANES],
    syms: &[u8],
    full: usize,
    c: usize,
    cbase: &[usize],
    fs: &[u32],
    rcp: &[f64],
    bp: *mut u16,
    p: usize,
) -> usize {
    use core::arch::wasm32::*;
    let sp = syms.as_ptr();
    let fp = fs.as_ptr();
    let rp = rcp.as_ptr();
    let cbp = cbase.as_ptr();
    let shed = SHED.as_ptr();
    let mut wp = bp.add(p);
    let mut ip = sp.add(full);
    let mut ch = full % c;
    let lo16 = u32x4_splat(0xffff);
    let one = u32x4_splat(1);
    let scale = u32x4_splat(PROB_SCALE);
    let magic_half = f64x2_splat(4503599627370495.5); // 2^52 − 1/2 (exact: ulp 1/2 below 2^52)
    let magic_hi = u32x4_splat(0x4330_0000); // 2^52's high word in every lane
    let mut xa = u32x4(x[0], x[1], x[2], x[3]);
    let mut xb = u32x4(x[4], x[5], x[6], x[7]);
    macro_rules! base {
        ($off:expr) => {
            if TRACK {
                *cbp.add(ch + $off)
            } else {
                0
            }
        };
    }
    // The packed entries of 4 lanes, and their reciprocals as two f64x2 (lanes 0–1, 2–3).
    macro_rules! gather {
        ($o:expr) => {{
            let i0 = base!($o) + *ip.add($o) as usize;
            let i1 = base!($o + 1) + *ip.add($o + 1) as usize;
            let i2 = base!($o + 2) + *ip.add($o + 2) as usize;
            let i3 = base!($o + 3) + *ip.add($o + 3) as usize;
            let e = v128_load32_zero(fp.add(i0));
            let e = v128_load32_lane::<1>(e, fp.add(i1));
            let e = v128_load32_lane::<2>(e, fp.add(i2));
            let e = v128_load32_lane::<3>(e, fp.add(i3));
            let rl = v128_load64_lane::<1>(
                v128_load64_zero(rp.add(i0) as *const u64),
                rp.add(i1) as *const u64,
            );
            let rh = v128_load64_lane::<1>(
                v128_load64_zero(rp.add(i2) as *const u64),
                rp.add(i3) as *const u64,
            );
            (e, rl, rh)
        }};
    }
    macro_rules! put {
        ($x:ident, $g:expr) => {{
            let (e, rl, rh) = $g;
            let freq = v128_and(e, lo16);
            // x ≥ 2^21·freq ⇔ x >> 21 > freq − 1 (small values: a signed compare).
            let big = i32x4_gt(u32x4_shr($x, 21), i32x4_sub(freq, one));
            let m = i32x4_bitmask(big) as usize & 15;
            let w = i8x16_swizzle($x, v128_load(shed.add(m) as *const v128));
            v128_store(wp.sub(8) as *mut v128, w);
            wp = wp.sub((m as u32).count_ones() as usize);
            let xs = v128_bitselect(u32x4_shr($x, 16), $x, big);
            // u32 → f64 as 2^52 + u (the u32 under the high word of 2^52: one unpack), minus
            // 2^52 − 1/2 gives x + 1/2 exactly; convert_low on the high half costs V8 a byte
            // shuffle with built constants. x / freq = floor((x + 1/2) · (1 / freq)): the
            // fraction of (x + 1/2) / freq lies in [1/(2 freq), 1 − 1/(2 freq)], at least 2^-11
            // from an integer (freq ≤ PROB_SCALE / 2 here), and the two roundings (1 / freq,
            // then the product) move a value below 2^31 by less than 2^31 · 2^-52 = 2^-21.
            let ql = f64x2_mul(
                f64x2_sub(i32x4_shuffle::<0, 4, 1, 5>(xs, magic_hi), magic_half),
                rl,
            );
            let qh = f64x2_mul(
                f64x2_sub(i32x4_shuffle::<2, 6, 3, 7>(xs, magic_hi), magic_half),
                rh,
            );
            // floor by adding 2^52 − 1/2 (no round instruction): the quotient is ≥ 32 (a state
            // is ≥ 2^16 before shedding and ≥ 2^21·freq when it sheds, so x ≥ 32·freq), the sum
            // lies in [2^52, 2^53), where f64 holds exactly the integers, and rounds to nearest
            // (checked for every freq ≤ 1024 on 3·10^8 states around multiples); the quotient's
            // fraction minus 1/2 stays more than 2^-12 inside (−1/2, 1/2), so the sum rounds
            // to 2^52 + floor and the integer lands in the low 32 bits (LLVM scalarises
            // i32x4.trunc_sat_f64x2_zero into eight checked conversions).
            let ql = f64x2_add(ql, magic_half);
            let qh = f64x2_add(qh, magic_half);
            let q = i32x4_shuffle::<0, 2, 4, 6>(ql, qh);
            // x' = (x / freq) · PROB_SCALE + x mod freq + start
            $x = i32x4_add(
                i32x4_add(xs, u32x4_shr(e, 16)),
                i32x4_mul(q, i32x4_sub(scale, freq)),
            );
        }};
    }
    while ip > sp {
        ip = ip.sub(LANES);
        if TRACK {
            ch = if ch == 0 { c - LANES } else { ch - LANES };
        }
        let eb = gather!(4);
        let ea = gather!(0);
        put!(xb, eb);
        put!(xa, ea);
    }
    *x = [
        u32x4_extract_lane::<0>(xa),
        u32x4_extract_lane::<1>(xa),
        u32x4_extract_lane::<2>(xa),
        u32x4_extract_lane::<3>(xa),
        u32x4_extract_lane::<0>(xb),
        u32x4_extract_lane::<1>(xb),
        u32x4_extract_lane::<2>(xb),
        u32x4_extract_lane::<3>(xb),
    ];
    wp.offset_from(bp) as usize
}

/// Decodes a block written by `encode_block` into `syms` (T×C). Never panics on
/// hostile input; a stream that does not end exactly where the encoder started
/// is rejected.
pub fn decode_block(
    r: &mut Reader,
    t: usize,
    c: usize,
    alphabet: usize,
    syms: &mut [u8],
) -> Option<()> {
    decode_block_with(r, t, c, alphabet, syms, &mut NoSink)
}

/// `decode_block` that runs `sink` inside the decode loop (see GroupSink).
pub fn decode_block_with<S: GroupSink>(
    r: &mut Reader,
    t: usize,
    c: usize,
    alphabet: usize,
    syms: &mut [u8],
    sink: &mut S,
) -> Option<()> {
    let (k, cbase, dec) = read_block_tables(r, c, alphabet)?;
    decode_symbols_with(r, t, c, k, &cbase, &dec, syms, sink)
}

/// A block's class map and tables (`encode_block`'s format up to the payload): the class
/// count, each channel's class base (class · PROB_SCALE) and the decode tables.
pub fn read_block_tables(
    r: &mut Reader,
    c: usize,
    alphabet: usize,
) -> Option<(usize, Vec<u32>, Vec<u32>)> {
    let k = r.u8()? as usize;
    if k == 0 || k > MAX_CLASSES {
        return None;
    }
    let mut cbase: Vec<u32> = vec![0; c];
    if k > 1 {
        let cls = r.take(c)?;
        for (d, &v) in cbase.iter_mut().zip(cls) {
            if v as usize >= k {
                return None;
            }
            *d = v as u32 * PROB_SCALE;
        }
    }
    // read_table fills every slot of each class (or fails).
    let mut dec: Vec<u32> = uninit_vec(k * PROB_SCALE as usize);
    for cls in 0..k {
        read_table(
            r,
            alphabet,
            &mut dec[cls * PROB_SCALE as usize..(cls + 1) * PROB_SCALE as usize],
        )?;
    }
    Some((k, cbase, dec))
}

/// Decode table entries of `f` (a validated table: sums to PROB_SCALE) into `dec`.
pub fn fill_table(f: &[u32], dec: &mut [u32]) {
    let mut pos = 0usize;
    for (s, &v) in f.iter().enumerate() {
        for k in 0..v {
            dec[pos + k as usize] = dec_entry(s as u32, k, v);
        }
        pos += v as usize;
    }
}

/// Decodes the payload block of `encode_symbols` given `k` classes, each channel's
/// class base (class · PROB_SCALE) and the decode tables (k · PROB_SCALE entries).
pub fn decode_symbols(
    r: &mut Reader,
    t: usize,
    c: usize,
    k: usize,
    cbase: &[u32],
    dec: &[u32],
    syms: &mut [u8],
) -> Option<()> {
    decode_symbols_with(r, t, c, k, cbase, dec, syms, &mut NoSink)
}

/// Work run inside the SIMD decode loop after each group of LANES symbols. The loop is
/// bound by its dependency chain (table lookup → multiply → renormalise, state by state),
/// which leaves issue slots idle: independent work placed in the same loop body (the
/// reconstruction of earlier symbols) runs in them almost for free.
///
/// `group` must call no function: V8 spills every vector live across a call site, and a
/// call anywhere in the loop body (even on a rare branch) costs that on every iteration.
/// The sink is Copy so that the loop keeps a local copy in registers.
pub trait GroupSink: Copy {
    /// One more group of LANES symbols is decoded: `syms` (the loop's own pointer to the
    /// symbol buffer) holds every symbol decoded so far. false rejects the block.
    ///
    /// # Safety
    /// `syms` points at the buffer being decoded, with all symbols so far written.
    unsafe fn group(&mut self, syms: *const u8) -> bool;
}

/// No work in the loop.
#[derive(Clone, Copy)]
pub struct NoSink;

impl GroupSink for NoSink {
    #[inline(always)]
    unsafe fn group(&mut self, _syms: *const u8) -> bool {
        true
    }
}

/// `decode_symbols` that runs `sink` in the SIMD decode loop (the loop may stop early, and
/// the scalar paths call no sink: the caller finishes whatever the sink did not do).
#[allow(clippy::too_many_arguments)]
pub fn decode_symbols_with<S: GroupSink>(
    r: &mut Reader,
    t: usize,
    c: usize,
    k: usize,
    cbase: &[u32],
    dec: &[u32],
    syms: &mut [u8],
    sink: &mut S,
) -> Option<()> {
    let (x, data) = payload_start(r, t, c, k, cbase, dec, syms)?;
    decode_from(x, data, 0, 0, t * c, c, k, cbase, dec, syms, sink)
}

/// Reads a payload block for `decode_from`: the initial states and the words after them
/// (arguments checked as decode_symbols_with documents).
fn payload_start<'a>(
    r: &mut Reader<'a>,
    t: usize,
    c: usize,
    k: usize,
    cbase: &[u32],
    dec: &[u32],
    syms: &[u8],
) -> Option<([u32; LANES], &'a [u8])> {
    if cbase.len() != c || dec.len() != k * PROB_SCALE as usize || k == 0 {
        return None;
    }
    let payload = r.block()?;
    let n = t.checked_mul(c)?;
    if syms.len() < n || c == 0 || payload.len() < 4 * LANES || (payload.len() - 4 * LANES) % 2 != 0
    {
        return None;
    }
    let mut x = [0u32; LANES];
    for lane in 0..LANES {
        let b = &payload[lane * 4..lane * 4 + 4];
        x[lane] = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
    Some((x, &payload[4 * LANES..]))
}

/// Decodes symbols `i0..n` of a payload whose first `i0` symbols are decoded (states `x`,
/// `p0` bytes of `data` read; `i0` a multiple of LANES, 0 without SIMD), then checks that the
/// stream ends exactly at the initial state and the payload end.
#[allow(clippy::too_many_arguments)]
fn decode_from<S: GroupSink>(
    mut x: [u32; LANES],
    data: &[u8],
    i0: usize,
    p0: usize,
    n: usize,
    c: usize,
    k: usize,
    cbase: &[u32],
    dec: &[u32],
    syms: &mut [u8],
    sink: &mut S,
) -> Option<()> {
    let len = data.len();
    if i0 % LANES != 0 || i0 > n || p0 > len || syms.len() < n || cbase.len() != c || c == 0 {
        return None;
    }
    let mut p = p0;
    let mask = PROB_SCALE - 1;
    // One table lookup and at most one 16-bit read per symbol. `base` < k·PROB_SCALE and
    // the slot is masked, so the index is always inside `dec`.
    macro_rules! step {
        ($lane:expr, $i:expr, $base:expr, $read:expr) => {{
            let xs = x[$lane];
            let e = dec[($base + (xs & mask)) as usize];
            syms[$i] = (e >> 24) as u8;
            let mut xs = (e & mask) * (xs >> PROB_BITS) + ((e >> PROB_BITS) & mask);
            if xs < RANS_L {
                xs = (xs << 16) | $read;
            }
            x[$lane] = xs;
        }};
    }
    let mut i = i0;
    let mut ch = i0 % c;
    if c % LANES == 0 {
        // Fast path: lanes line up with channels; the loop head guarantees the
        // next LANES symbols' reads (≤ LANES words) are inside `data`, so renormalisation
        // is branch-free (an unpredictable branch costs more than the read).
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        {
            if len >= SIMD_SLACK {
                // SAFETY: `dec` holds k·PROB_SCALE entries and every class base in `cbase` is
                // < k·PROB_SCALE (see simd_fast_loop); syms has n ≥ LANES·(groups) entries;
                // i ≤ n and p ≤ len (checked above).
                let (done, read, ok) = unsafe {
                    if k == 1 {
                        simd_fast_loop::<false, S>(&mut x, data, p, syms, i, n, c, dec, cbase, sink)
                    } else {
                        simd_fast_loop::<true, S>(&mut x, data, p, syms, i, n, c, dec, cbase, sink)
                    }
                };
                if !ok {
                    return None;
                }
                i = done;
                ch = i % c;
                p = read;
            }
        }
        #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
        if i0 == 0 {
            let _ = &sink;
            let dp = data.as_ptr();
            let sp = syms.as_mut_ptr();
            let tp = dec.as_ptr();
            let cbp = cbase.as_ptr();
            // Pointers instead of indices: fewer live registers (V8 spills the states otherwise).
            macro_rules! fast_loop {
                ($base:expr, $track:expr) => {
                    if len >= 2 * LANES {
                        // SAFETY: rp ≤ rlim keeps the next LANES words inside `data`; op < oend
                        // (oend = sp + n, n a multiple of LANES here) keeps the LANES stores inside
                        // `syms`; the table index is < k·PROB_SCALE (class base + masked slot).
                        unsafe {
                            let mut rp = dp;
                            let rlim = dp.add(len - 2 * LANES);
                            let mut op = sp;
                            let oend = sp.add(n);
                            let (mut x0, mut x1, mut x2, mut x3) = (x[0], x[1], x[2], x[3]);
                            let (mut x4, mut x5, mut x6, mut x7) = (x[4], x[5], x[6], x[7]);
                            while op < oend && rp <= rlim {
                                macro_rules! fast {
                                    ($xs:ident, $off:expr) => {{
                                        let e = *tp.add(($base($off) + ($xs & mask)) as usize);
                                        *op.add($off) = (e >> 24) as u8;
                                        let xs = (e & mask) * ($xs >> PROB_BITS)
                                            + ((e >> PROB_BITS) & mask);
                                        let w = u16::from_le((rp as *const u16).read_unaligned())
                                            as u32;
                                        let need = xs < RANS_L;
                                        // Two selects (cmov), no branch.
                                        $xs = if need { (xs << 16) | w } else { xs };
                                        rp = rp.add(if need { 2 } else { 0 });
                                    }};
                                }
                                fast!(x0, 0);
                                fast!(x1, 1);
                                fast!(x2, 2);
                                fast!(x3, 3);
                                fast!(x4, 4);
                                fast!(x5, 5);
                                fast!(x6, 6);
                                fast!(x7, 7);
                                op = op.add(LANES);
                                if $track {
                                    ch += LANES;
                                    if ch == c {
                                        ch = 0;
                                    }
                                }
                            }
                            x = [x0, x1, x2, x3, x4, x5, x6, x7];
                            i = op.offset_from(sp) as usize;
                            ch = i % c;
                            p = rp.offset_from(dp) as usize;
                        }
                    }
                };
            }
            if k == 1 {
                // One table: no per-channel class lookups (and no channel counter).
                fast_loop!(|_off: usize| 0u32, false);
            } else {
                fast_loop!(|off: usize| *cbp.add(ch + off), true);
            }
        }
    }
    // Careful tail: every read checked.
    while i < n {
        let b = cbase[ch];
        let mut bad = false;
        macro_rules! careful {
            ($lane:expr) => {
                step!($lane, i, b, {
                    if p + 2 <= len {
                        let w = u16::from_le_bytes([data[p], data[p + 1]]) as u32;
                        p += 2;
                        w
                    } else {
                        bad = true;
                        0
                    }
                })
            };
        }
        // Static lane indices everywhere keep the states in registers (a dynamic
        // index would force the whole array to memory, in the fast loop too).
        match i & (LANES - 1) {
            0 => careful!(0),
            1 => careful!(1),
            2 => careful!(2),
            3 => careful!(3),
            4 => careful!(4),
            5 => careful!(5),
            6 => careful!(6),
            _ => careful!(7),
        }
        if bad {
            return None;
        }
        i += 1;
        ch += 1;
        if ch == c {
            ch = 0;
        }
    }
    if p != len || x.iter().any(|&v| v != RANS_L) {
        return None;
    }
    Some(())
}

/// Bytes the SIMD decode loop may read past its position: two 16-byte loads, the second
/// up to 4 words (8 bytes) after the first.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
const SIMD_SLACK: usize = 24;

/// Renormalisation shuffles: for each 4-bit mask of the lanes whose state fell below RANS_L
/// (bit j = lane j), the i8x16.swizzle that moves the next words of the stream, in lane order,
/// into the low halves of those lanes (0x80 zeroes every other byte).
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
const fn renorm_shuffles() -> [[u8; 16]; 16] {
    let mut t = [[0x80u8; 16]; 16];
    let mut m = 0;
    while m < 16 {
        let mut k = 0u8;
        let mut j = 0;
        while j < 4 {
            if (m >> j) & 1 == 1 {
                t[m][4 * j] = 2 * k;
                t[m][4 * j + 1] = 2 * k + 1;
                k += 1;
            }
            j += 1;
        }
        m += 1;
    }
    t
}

#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
static RENORM: [[u8; 16]; 16] = renorm_shuffles();

/// The branch-free decode loop with the 8 states in two i32x4 vectors (lanes 0–3, 4–7).
/// A vector reads the words its lanes need in lane order, then the next vector reads its
/// words: the order of the scalar decoder, so the stream format is unchanged. Runs whole
/// groups of LANES symbols while both 16-byte word loads stay inside `data`; returns the
/// symbols decoded, the bytes of `data` consumed and false when the sink rejected a group;
/// leaves the states in `x`. Starts at symbol `i0` (a multiple of LANES, ≤ n) and byte `p0`
/// (≤ data.len()) of `data`.
///
/// SAFETY: `c % LANES == 0`, `n ≤ syms.len()`, `cbase.len() == c`, every `cbase` entry plus
/// PROB_SCALE − 1 is inside `dec` (decode_symbols' callers give class · PROB_SCALE, class < k,
/// and dec.len() == k · PROB_SCALE), and `data.len() ≥ SIMD_SLACK`.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn simd_fast_loop<const TRACK: bool, S: GroupSink>(
    x: &mut [u32; LANES],
    data: &[u8],
    p0: usize,
    syms: &mut [u8],
    i0: usize,
    n: usize,
    c: usize,
    dec: &[u32],
    cbase: &[u32],
    sink: &mut S,
) -> (usize, usize, bool) {
    use core::arch::wasm32::*;
    let dp = data.as_ptr();
    let rlim = dp.add(data.len() - SIMD_SLACK);
    let sp = syms.as_mut_ptr();
    let oend = sp.add(n);
    let tp = dec.as_ptr();
    let cbp = cbase.as_ptr();
    let shuf = RENORM.as_ptr();
    let mask = u32x4_splat(PROB_SCALE - 1);
    let zero = u32x4_splat(0);
    let mut xa = u32x4(x[0], x[1], x[2], x[3]);
    let mut xb = u32x4(x[4], x[5], x[6], x[7]);
    let mut rp = dp.add(p0);
    let mut op = sp.add(i0);
    let mut ch = i0 % c;
    let mut ok = true;
    // A local copy (Copy, address never taken) that LLVM keeps in locals, i.e. registers.
    let mut sk = *sink;
    // One table entry per lane: wasm has no gather, so extract each slot and load it into
    // its lane.
    macro_rules! gather {
        ($idx:expr) => {{
            let idx = $idx;
            let lo = v128_load32_zero(tp.add(u32x4_extract_lane::<0>(idx) as usize));
            let lo = v128_load32_lane::<1>(lo, tp.add(u32x4_extract_lane::<1>(idx) as usize));
            let hi = v128_load32_zero(tp.add(u32x4_extract_lane::<2>(idx) as usize));
            let hi = v128_load32_lane::<1>(hi, tp.add(u32x4_extract_lane::<3>(idx) as usize));
            i64x2_shuffle::<0, 2>(lo, hi)
        }};
    }
    // x = freq · (x >> 11) + bias, then the lanes below RANS_L take the next words.
    macro_rules! step {
        ($x:ident, $e:expr) => {{
            let e = $e;
            let xs = i32x4_add(
                i32x4_mul(v128_and(e, mask), u32x4_shr($x, PROB_BITS)),
                v128_and(u32x4_shr(e, PROB_BITS), mask),
            );
            // xs < 2^16 as "high half zero": LLVM turns a u32 compare (or shift + compare)
            // into i32x4 lt_u, which V8 lowers to four instructions (x64 has no unsigned compare).
            // The joint loop's multiply form of the select (simd_pair_loop) adds ~2 cycles to
            // this loop's dependency chain, which bounds it (q9 decode 0.91–0.97×).
            let need = i32x4_shr(i16x8_eq(xs, zero), 16);
            let m = i32x4_bitmask(need) as usize & 15;
            let w = i8x16_swizzle(
                v128_load(rp as *const v128),
                v128_load(shuf.add(m) as *const v128),
            );
            $x = v128_or(v128_bitselect(u32x4_shl(xs, 16), xs, need), w);
            rp = rp.add(2 * (m as u32).count_ones() as usize);
        }};
    }
    while op < oend && rp <= rlim {
        let (ia, ib) = (v128_and(xa, mask), v128_and(xb, mask));
        let (ia, ib) = if TRACK {
            (
                i32x4_add(ia, v128_load(cbp.add(ch) as *const v128)),
                i32x4_add(ib, v128_load(cbp.add(ch + 4) as *const v128)),
            )
        } else {
            (ia, ib)
        };
        let ea = gather!(ia);
        let eb = gather!(ib);
        // The symbols (top bytes) of the 8 entries; a two-vector byte shuffle costs V8 two
        // pshufb with constants built in registers.
        let s = u16x8_narrow_i32x4(u32x4_shr(ea, 24), u32x4_shr(eb, 24));
        let s = u8x16_narrow_i16x8(s, s);
        v128_store64_lane::<0>(s, op as *mut u64);
        step!(xa, ea);
        step!(xb, eb);
        op = op.add(LANES);
        if TRACK {
            ch += LANES;
            if ch == c {
                ch = 0;
            }
        }
        if !sk.group(sp) {
            ok = false;
            break;
        }
    }
    *x = [
        u32x4_extract_lane::<0>(xa),
        u32x4_extract_lane::<1>(xa),
        u32x4_extract_lane::<2>(xa),
        u32x4_extract_lane::<3>(xa),
        u32x4_extract_lane::<0>(xb),
        u32x4_extract_lane::<1>(xb),
        u32x4_extract_lane::<2>(xb),
        u32x4_extract_lane::<3>(xb),
    ];
    *sink = sk;
    (op.offset_from(sp) as usize, rp.offset_from(dp) as usize, ok)
}

/// One stream of `decode_symbols_pair`: its reader (at the payload block), class count,
/// class bases, decode tables and symbol buffer.
pub struct PairStream<'r, 'a, 'd> {
    pub r: &'r mut Reader<'a>,
    pub k: usize,
    pub cbase: &'d [u32],
    pub dec: &'d [u32],
    pub syms: &'d mut [u8],
}

/// Decodes two independent payload blocks of T×C symbols (a layer's K and V streams) with
/// their SIMD loops interleaved: one stream's loop is bound by its dependency chain (lookup →
/// multiply → renormalise), so two chains in one loop body run in each other's idle issue
/// slots (1.47× the symbols per second of one stream's loop on V8/x64). Each stream reads
/// its words in its own order, exactly as `decode_symbols` does; when one stream leaves the
/// joint loop (its words or symbols run out), each finishes alone.
pub fn decode_symbols_pair(t: usize, c: usize, a: PairStream, b: PairStream) -> Option<()> {
    let (mut xa, da) = payload_start(a.r, t, c, a.k, a.cbase, a.dec, a.syms)?;
    let (mut xb, db) = payload_start(b.r, t, c, b.k, b.cbase, b.dec, b.syms)?;
    let n = t * c;
    let (mut ia, mut pa, mut ib, mut pb) = (0, 0, 0, 0);
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    if c % LANES == 0 && da.len() >= SIMD_SLACK && db.len() >= SIMD_SLACK {
        // SAFETY: simd_fast_loop's conditions for each stream: payload_start checked the
        // bases' and tables' lengths and syms ≥ n; the bases are class · PROB_SCALE with
        // class < k (read_block_tables, payload_tables).
        let (i, p, q) = unsafe {
            simd_pair_loop(
                (&mut xa, da, &mut *a.syms, a.cbase, a.dec),
                (&mut xb, db, &mut *b.syms, b.cbase, b.dec),
                n,
                c,
            )
        };
        (ia, pa, ib, pb) = (i, p, i, q);
    }
    decode_from(
        xa,
        da,
        ia,
        pa,
        n,
        c,
        a.k,
        a.cbase,
        a.dec,
        a.syms,
        &mut NoSink,
    )?;
    decode_from(
        xb,
        db,
        ib,
        pb,
        n,
        c,
        b.k,
        b.cbase,
        b.dec,
        b.syms,
        &mut NoSink,
    )
}

/// One stream's loop state in `simd_pair_loop`: states, words, symbols, class bases, tables.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
type PairSide<'x, 'd> = (
    &'x mut [u32; LANES],
    &'d [u8],
    &'d mut [u8],
    &'d [u32],
    &'d [u32],
);

/// `simd_fast_loop` (with class bases) over two streams at once, while both have whole groups
/// and word slack left. Returns the symbols decoded (the same count in both) and the bytes
/// read from each stream's words; leaves the states in each side's `x`.
///
/// SAFETY: simd_fast_loop's conditions for each stream, with `n` and `c` shared.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[inline(always)]
unsafe fn simd_pair_loop(a: PairSide, b: PairSide, n: usize, c: usize) -> (usize, usize, usize) {
    use core::arch::wasm32::*;
    let shuf = RENORM.as_ptr();
    let mask = u32x4_splat(PROB_SCALE - 1);
    let zero = u32x4_splat(0);
    let (ax, bx) = (a.0, b.0);
    let (mut a0, mut a1) = (
        u32x4(ax[0], ax[1], ax[2], ax[3]),
        u32x4(ax[4], ax[5], ax[6], ax[7]),
    );
    let (mut b0, mut b1) = (
        u32x4(bx[0], bx[1], bx[2], bx[3]),
        u32x4(bx[4], bx[5], bx[6], bx[7]),
    );
    let (adp, bdp) = (a.1.as_ptr(), b.1.as_ptr());
    let (alim, blim) = (
        adp.add(a.1.len() - SIMD_SLACK),
        bdp.add(b.1.len() - SIMD_SLACK),
    );
    let (asp, bsp) = (a.2.as_mut_ptr(), b.2.as_mut_ptr());
    // Both streams' class bases, group by group (a's 8, then b's 8): one pointer for both.
    let mut bases: Vec<u32> = Vec::with_capacity(2 * c);
    for (ga, gb) in a.3.chunks_exact(LANES).zip(b.3.chunks_exact(LANES)) {
        bases.extend_from_slice(ga);
        bases.extend_from_slice(gb);
    }
    let cbp = bases.as_ptr();
    let (atp, btp) = (a.4.as_ptr(), b.4.as_ptr());
    let (mut arp, mut brp) = (adp, bdp);
    let mut j = 0usize;
    let mut ch = 0usize;
    macro_rules! gather {
        ($tp:ident, $idx:expr) => {{
            let idx = $idx;
            let lo = v128_load32_zero($tp.add(u32x4_extract_lane::<0>(idx) as usize));
            let lo = v128_load32_lane::<1>(lo, $tp.add(u32x4_extract_lane::<1>(idx) as usize));
            let hi = v128_load32_zero($tp.add(u32x4_extract_lane::<2>(idx) as usize));
            let hi = v128_load32_lane::<1>(hi, $tp.add(u32x4_extract_lane::<3>(idx) as usize));
            i64x2_shuffle::<0, 2>(lo, hi)
        }};
    }
    macro_rules! step {
        ($x:ident, $e:expr, $rp:ident) => {{
            let e = $e;
            let xs = i32x4_add(
                i32x4_mul(v128_and(e, mask), u32x4_shr($x, PROB_BITS)),
                v128_and(u32x4_shr(e, PROB_BITS), mask),
            );
            // The i16x8 eq's sign bit per lane is the need bit, and eq >> 16 is 0xffff in those
            // lanes, so xs + xs·(eq >> 16) is xs << 16 there and xs elsewhere: one multiply
            // instead of a shift, a sign-extending shift and a three-instruction bitselect. This
            // loop is bound by instructions, not by its chains (simd_fast_loop keeps the select).
            let eq = i16x8_eq(xs, zero);
            let m = i32x4_bitmask(eq) as usize & 15;
            let w = i8x16_swizzle(
                v128_load($rp as *const v128),
                v128_load(shuf.add(m) as *const v128),
            );
            $x = v128_or(i32x4_add(xs, i32x4_mul(xs, u32x4_shr(eq, 16))), w);
            $rp = $rp.add(2 * (m as u32).count_ones() as usize);
        }};
    }
    // One group of LANES symbols of one stream, as in simd_fast_loop (with class bases).
    macro_rules! group {
        ($x0:ident, $x1:ident, $rp:ident, $sp:ident, $cb:ident, $tp:ident) => {{
            let i0 = i32x4_add(v128_and($x0, mask), v128_load($cb as *const v128));
            let i1 = i32x4_add(v128_and($x1, mask), v128_load($cb.add(4) as *const v128));
            let e0 = gather!($tp, i0);
            let e1 = gather!($tp, i1);
            let s = u16x8_narrow_i32x4(u32x4_shr(e0, 24), u32x4_shr(e1, 24));
            let s = u8x16_narrow_i16x8(s, s);
            v128_store64_lane::<0>(s, $sp.add(ch) as *mut u64);
            step!($x0, e0, $rp);
            step!($x1, e1, $rp);
        }};
    }
    // A group reads at most 2·LANES bytes of each stream's words, so from position rp ≤ lim
    // at least (lim − rp) / 16 + 1 more groups keep every load inside the words: run that
    // many (up to the row's end) without testing the read positions, then look again.
    let safe = |rp: *const u8, lim: *const u8| -> usize {
        if rp > lim {
            0
        } else {
            lim.offset_from(rp) as usize / (2 * LANES) + 1
        }
    };
    while j < n {
        let groups = safe(arp, alim).min(safe(brp, blim)).min((c - ch) / LANES);
        if groups == 0 {
            break;
        }
        let stop = ch + groups * LANES;
        let (arow, brow) = (asp.add(j - ch), bsp.add(j - ch));
        while ch < stop {
            let (acb, bcb) = (cbp.add(2 * ch), cbp.add(2 * ch + LANES));
            group!(a0, a1, arp, arow, acb, atp);
            group!(b0, b1, brp, brow, bcb, btp);
            ch += LANES;
        }
        j += groups * LANES;
        if ch == c {
            ch = 0;
        }
    }
    macro_rules! put_back {
        ($x:expr, $v0:ident, $v1:ident) => {
            *$x = [
                u32x4_extract_lane::<0>($v0),
                u32x4_extract_lane::<1>($v0),
                u32x4_extract_lane::<2>($v0),
                u32x4_extract_lane::<3>($v0),
                u32x4_extract_lane::<0>($v1),
                u32x4_extract_lane::<1>($v1),
                u32x4_extract_lane::<2>($v1),
                u32x4_extract_lane::<3>($v1),
            ]
        };
    }
    put_back!(ax, a0, a1);
    put_back!(bx, b0, b1);
    (
        j,
        arp.offset_from(adp) as usize,
        brp.offset_from(bdp) as usize,
    )
}

/// Reads a table in `write_table`'s format as frequencies, validated as `read_table` does
/// (at most `max_syms` symbols, each below PROB_SCALE, summing to PROB_SCALE).
pub fn read_freqs(r: &mut Reader, max_syms: usize) -> Option<Vec<u32>> {
    let n = r.u8()? as usize + 1;
    if n > max_syms {
        return None;
    }
    let mut f = Vec::with_capacity(n);
    let mut pos: u32 = 0;
    for _ in 0..n {
        let v = r.varint()?;
        if v >= PROB_SCALE || pos + v > PROB_SCALE {
            return None;
        }
        f.push(v);
        pos += v;
    }
    if pos != PROB_SCALE {
        return None;
    }
    Some(f)
}
