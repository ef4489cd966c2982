//! kvgate lossy mode. Each layer's K and V are uniform-quantized with a step
//! derived from a target relative error (early layers get finer steps, chosen by
//! the caller), optionally scaled per channel (K) or per token (V). Keys are
//! predicted from the previous token where that pays (token locality); residuals
//! go through an escape-bucket alphabet into rANS with per-channel-class tables.

use crate::bytes::{put_u32, put_varint, unzigzag, zigzag, BitReader, BitWriter, Reader};
use crate::half::{self, DT_BF16, DT_F16};
use crate::rans::{
    class_partition, decode_symbols_pair, decode_symbols_with, encode_symbols, fill_table,
    plan_classes, read_block_tables, read_freqs, uninit_vec, write_classes, write_table, GroupSink,
    NoSink, PairStream, MAX_CLASSES, PROB_BITS, PROB_SCALE,
};
use std::cell::RefCell;
use std::rc::Rc;

/// Symbols 0..DIRECT are zigzag residuals; above, (bucket, extra raw bits).
const DIRECT: u32 = 64;
const DIRECT_BITS: u32 = 6;
const MAX_K: u32 = 27;
pub const ALPHABET: usize = (DIRECT + 2 * (MAX_K - DIRECT_BITS) + 2) as usize;
/// Largest |q|; ≤ 2^22 so the SIMD path can round with the 1.5·2^23 trick.
const QMAX: i32 = 1 << 22;

/// Internal output kind: fp16 where no value can be an fp16 subnormal or NaN.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
const DT_F16_NORMAL: u32 = 101;

const F_CHSCALE: u8 = 1;
const F_TOKSCALE: u8 = 2;
const F_MODES: u8 = 4;
/// Coded against a calibration (DESIGN §2.9): centres are offsets from the calibrated
/// channel means and the block starts with a table-set byte (IN_CHUNK_TABLES: its own).
const F_CAL: u8 = 8;
const IN_CHUNK_TABLES: u8 = 0xff;
/// The chunk's own tables over the calibration's classes (merged to 2^j of them): no class map.
const IN_CHUNK_TABLES_CAL_CLASSES: u8 = 0xfe;

/// One stream's calibration (per namespace, per layer): channel means, the channels'
/// classes, and table sets (one table per class each) for a ladder of step sizes; the
/// encoder picks the set that codes the chunk smallest, or its own tables.
pub struct StreamCal<'a> {
    pub k: usize,
    pub means: Vec<f32>,
    pub class_of: &'a [u8],
    offsets: Vec<u32>,
    area: &'a [u8],
}

impl<'a> StreamCal<'a> {
    /// Parses `k, nsets, c·f32 means, c class bytes, nsets·u32 offsets, sets` (tables
    /// are read on demand by `set`). Hostile bytes give None.
    pub fn parse(r: &mut Reader<'a>, c: usize) -> Option<Self> {
        let k = r.u8()? as usize;
        if k == 0 || k > MAX_CLASSES || !k.is_power_of_two() {
            return None;
        }
        let nsets = r.u8()? as usize;
        if nsets >= IN_CHUNK_TABLES_CAL_CLASSES as usize {
            return None;
        }
        let mut means = Vec::with_capacity(c);
        for _ in 0..c {
            let m = r.f32()?;
            if !m.is_finite() {
                return None;
            }
            means.push(m);
        }
        let class_of = r.take(c)?;
        if class_of.iter().any(|&v| v as usize >= k) {
            return None;
        }
        let mut offsets = Vec::with_capacity(nsets + 1);
        for _ in 0..=nsets {
            offsets.push(r.u32()?);
        }
        let len = *offsets.last()? as usize;
        if offsets.windows(2).any(|w| w[0] > w[1]) || offsets[0] != 0 {
            return None;
        }
        let area = r.take(len)?;
        Some(StreamCal {
            k,
            means,
            class_of,
            offsets,
            area,
        })
    }

    pub fn sets(&self) -> usize {
        self.offsets.len() - 1
    }

    /// The bytes of table set `g` (unvalidated).
    fn set_bytes(&self, g: usize) -> Option<&'a [u8]> {
        if g >= self.sets() {
            return None;
        }
        self.area
            .get(self.offsets[g] as usize..self.offsets[g + 1] as usize)
    }

    /// Table set `g`: `k` validated tables over the lossy alphabet.
    pub fn set(&self, g: usize) -> Option<Vec<Vec<u32>>> {
        let bytes = self.set_bytes(g)?;
        let mut r = Reader::new(bytes);
        let mut tables = Vec::with_capacity(self.k);
        for _ in 0..self.k {
            tables.push(read_freqs(&mut r, ALPHABET)?);
        }
        if r.remaining() != 0 {
            return None;
        }
        Some(tables)
    }
}

/// Decode tables of recently used calibrated table sets, keyed by their bytes (and class
/// count), so a stale entry cannot match. A small stream (a 64-token chunk of a small model:
/// 2,048 symbols) otherwise spends longer filling 8 × 2,048 table entries than decoding.
const DEC_CACHE_ENTRIES: usize = 16;

thread_local! {
    static DEC_CACHE: RefCell<Vec<(Vec<u8>, Rc<Vec<u32>>)>> = RefCell::new(Vec::new());
}

/// Decode tables (k · PROB_SCALE entries) of set `g`, built or reused.
fn set_decode_tables(k: &StreamCal, g: usize) -> Option<Rc<Vec<u32>>> {
    let bytes = k.set_bytes(g)?;
    let same =
        |key: &[u8]| key.len() == bytes.len() + 1 && key[0] as usize == k.k && &key[1..] == bytes;
    let hit = DEC_CACHE.with(|c| {
        let mut c = c.borrow_mut();
        let i = c.iter().position(|(key, _)| same(key))?;
        let e = c.remove(i);
        let d = e.1.clone();
        c.push(e);
        Some(d)
    });
    if hit.is_some() {
        return hit;
    }
    let tables = k.set(g)?;
    let mut dec: Vec<u32> = uninit_vec(k.k * PROB_SCALE as usize);
    for (cls, f) in tables.iter().enumerate() {
        fill_table(f, &mut dec[cls * PROB_SCALE as usize..]);
    }
    let d = Rc::new(dec);
    DEC_CACHE.with(|c| {
        let mut c = c.borrow_mut();
        if c.len() >= DEC_CACHE_ENTRIES {
            c.remove(0);
        }
        let mut key = Vec::with_capacity(bytes.len() + 1);
        key.push(k.k as u8);
        key.extend_from_slice(bytes);
        c.push((key, d.clone()));
    });
    Some(d)
}

/// A layer's calibration blob: `u32 len, K stream calibration, V stream calibration`.
pub fn parse_layer_cal(bytes: &[u8], c: usize) -> Option<(StreamCal, StreamCal)> {
    let mut r = Reader::new(bytes);
    let mut rk = Reader::new(r.block()?);
    let k = StreamCal::parse(&mut rk, c)?;
    let v = StreamCal::parse(&mut r, c)?;
    if rk.remaining() != 0 || r.remaining() != 0 {
        return None;
    }
    Some((k, v))
}

/// Validates every table of a layer's calibration blob.
pub fn check_layer_cal(bytes: &[u8], c: usize) -> Option<()> {
    let (k, v) = parse_layer_cal(bytes, c)?;
    for s in [&k, &v] {
        for g in 0..s.sets() {
            s.set(g)?;
        }
    }
    Some(())
}

const MAX_EG_ORDER: u32 = 24;

/// Bits of `z` as an exp-Golomb code of order `o`.
fn eg_bits(z: u32, o: u32) -> u64 {
    let v = z as u64 + (1u64 << o);
    let n = 64 - v.leading_zeros() as u64;
    2 * (n - 1) + 1 - o as u64
}

/// Exp-Golomb of order `o`, LSB first: (n − 1 − o) zeros, a one, the low n − 1 bits of z + 2^o.
fn put_eg(bw: &mut BitWriter, z: u32, o: u32) {
    let v = z as u64 + (1u64 << o);
    let n = 64 - v.leading_zeros();
    bw.put(0, n - 1 - o);
    bw.put(1, 1);
    let low = n - 1;
    let lv = v & ((1u64 << low) - 1);
    bw.put(lv as u32, low.min(32));
    if low > 32 {
        bw.put((lv >> 32) as u32, low - 32);
    }
}

/// Reads `put_eg`'s code; None when the prefix or the value is out of range.
fn get_eg(br: &mut BitReader, o: u32) -> Option<u32> {
    let mut m = 0u32;
    while br.get(1) == 0 {
        m += 1;
        if m > 32 - o || br.overrun {
            return None;
        }
    }
    let low = m + o;
    let mut lv = br.get(low.min(32)) as u64;
    if low > 32 {
        lv |= (br.get(low - 32) as u64) << 32;
    }
    let v = (1u64 << low) | lv;
    let z = v - (1u64 << o);
    if z > u32::MAX as u64 {
        return None;
    }
    Some(z as u32)
}

/// The quantized centre a calibrated channel mean predicts (encoder and decoder alike).
#[inline]
fn cal_centre(mean: f32, step: f32) -> i32 {
    let m = mean / step;
    if m.is_finite() {
        (m.round() as i32).max(-QMAX).min(QMAX)
    } else {
        0
    }
}

/// Bits to code `counts` (per class × alphabet) with `tables`; infinite when a counted
/// symbol has no frequency.
fn set_cost(counts: &[u32], tables: &[Vec<u32>]) -> f64 {
    let mut bits = 0.0;
    for (cls, f) in tables.iter().enumerate() {
        for (s, &n) in counts[cls * ALPHABET..(cls + 1) * ALPHABET]
            .iter()
            .enumerate()
        {
            if n > 0 {
                let v = f.get(s).copied().unwrap_or(0);
                if v == 0 {
                    return f64::INFINITY;
                }
                bits += n as f64 * (PROB_BITS as f64 - (v as f64).log2());
            }
        }
    }
    bits
}

pub struct StreamParams {
    /// Target relative RMS error of this stream (< 0: relative to the channel-centred RMS).
    pub eps: f32,
    /// Per-channel step exponent (0 = one step for all channels).
    pub gamma_c: f32,
    /// Per-token step exponent.
    pub gamma_t: f32,
    /// Let channels be coded as deltas from the previous token.
    pub delta: bool,
    pub max_classes: usize,
    /// When > 0: per-channel steps = (channel range over the chunk's tokens) / levels
    /// (KIVI/CacheGen-style per-channel quantization, entropy coded). Overrides eps.
    pub levels_c: f32,
    /// When > 0: per-token steps = 2·max|x_t| / levels (per-token quantization).
    /// When < 0: one step for the whole stream, the mean over tokens of
    /// 2·max|x_t| / |levels| (per-token quantization's error without its per-token side
    /// information; uniform steps are what an entropy coder wants).
    pub levels_t: f32,
    /// Rate-distortion rounding (uniform steps only; 0: round to nearest): the
    /// Lagrangian λ in squared steps per bit (see `rd_round`).
    pub rd_lambda: f32,
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
fn bitlen(z: u32) -> u32 {
    32 - z.leading_zeros()
}

/// Encodes one T×C stream `x` (f32, row = token). `x` is scratch: it is
/// quantized in place (the i32 levels overwrite the floats, so the stream's
/// working set stays within L2).
///
/// With `cal`, the channels' classes, centres and (when they code smaller) tables come
/// from the calibration. With `stats` (c × ALPHABET), nothing is written: the symbol
/// counts per channel over every row are added there (calibration builds).
pub fn encode_stream(
    x: &mut [f32],
    t: usize,
    c: usize,
    p: &StreamParams,
    cal: Option<&StreamCal>,
    stats: Option<&mut [u32]>,
    out: &mut Vec<u8>,
) {
    // Pass 1: statistics (row sums of squares and max |x|, channel sums, squares, min, max).
    let mut ch_sum = vec![0f32; c];
    let mut ch_ss = vec![0f32; c];
    let mut ch_min = vec![f32::INFINITY; c];
    let mut ch_max = vec![f32::NEG_INFINITY; c];
    let mut row_ss = vec![0f64; t];
    let mut row_max = vec![0f32; t];
    let ranges = p.levels_c > 0.0;
    for tt in 0..t {
        let row = &x[tt * c..(tt + 1) * c];
        let (rs, rm) = row_stats(
            row,
            &mut ch_sum,
            &mut ch_ss,
            &mut ch_min,
            &mut ch_max,
            ranges,
        );
        row_ss[tt] = rs as f64;
        row_max[tt] = rm;
    }
    let total: f64 = row_ss.iter().sum();
    let rms = (total / (t * c) as f64).sqrt();
    let by_levels = p.levels_c > 0.0 || p.levels_t > 0.0;
    let mut base = if p.levels_t < 0.0 {
        let mean_max = row_max.iter().map(|&m| m as f64).sum::<f64>() / t as f64;
        (2.0 * mean_max / -p.levels_t as f64).max(rms * 1e-3) as f32
    } else if by_levels {
        rms as f32
    } else if p.eps < 0.0 {
        // Relative to the channel-centred RMS: a constant offset per channel moves every
        // logit of a query equally and cancels in softmax, so only K's variation around
        // its channel means matters to attention (and the error no longer depends on
        // how large those offsets or the chunk's range are).
        let mut css = 0f64;
        for ch in 0..c {
            let s = ch_sum[ch] as f64;
            css += (ch_ss[ch] as f64 - s * s / t as f64).max(0.0);
        }
        let crms = (css / (t * c) as f64).sqrt().max(rms * 1e-4);
        (-p.eps as f64 * 12f64.sqrt() * crms) as f32
    } else {
        (p.eps as f64 * 12f64.sqrt() * rms) as f32
    };
    if !(base > 1e-30) || !base.is_finite() {
        base = 1.0;
    }
    let mut flags = 0u8;
    let mut ch_codes = vec![128u8; c];
    let mut tok_codes = vec![128u8; t];
    if p.levels_c > 0.0 {
        flags |= F_CHSCALE;
        for ch in 0..c {
            let step = (ch_max[ch] - ch_min[ch]) as f64 / p.levels_c as f64;
            ch_codes[ch] = scale_code(step.max(rms * 1e-3) / base as f64, 1.0);
        }
    } else if p.gamma_c > 0.0 && rms > 0.0 {
        flags |= F_CHSCALE;
        for ch in 0..c {
            ch_codes[ch] = scale_code((ch_ss[ch] as f64 / t as f64).sqrt() / rms, p.gamma_c);
        }
    }
    if p.levels_t > 0.0 {
        flags |= F_TOKSCALE;
        for tt in 0..t {
            let step = 2.0 * row_max[tt] as f64 / p.levels_t as f64;
            tok_codes[tt] = scale_code(step.max(rms * 1e-3) / base as f64, 1.0);
        }
    } else if p.gamma_t > 0.0 && rms > 0.0 {
        flags |= F_TOKSCALE;
        for tt in 0..t {
            tok_codes[tt] = scale_code((row_ss[tt] / c as f64).sqrt() / rms, p.gamma_t);
        }
    }
    // Rate-distortion rounding moves some levels one step towards their prediction, which
    // raises the error; the step shrinks so that the error stays the nearest rounding's
    // (a trial quantization measures by how much), and the bytes saved are net.
    let mut rd =
        p.rd_lambda > 0.0 && p.rd_lambda.is_finite() && flags & (F_CHSCALE | F_TOKSCALE) == 0;
    let mut xf: Vec<f32> = Vec::new();
    let mut theta: Vec<f32> = Vec::new();
    if rd {
        match rd_step(x, t, c, base, &ch_sum, p.delta && t > 1, p.rd_lambda) {
            Some((b, th)) => {
                base = b;
                theta = th;
                xf = x.to_vec();
            }
            None => rd = false,
        }
    }
    // Steps exactly as the decoder will compute them.
    let step_c: Vec<f32> = ch_codes.iter().map(|&k| base * scale_of(k)).collect();
    let inv_c: Vec<f32> = step_c.iter().map(|&s| 1.0 / s).collect();
    let inv_t: Vec<f32> = tok_codes.iter().map(|&k| 1.0 / scale_of(k)).collect();
    // Pass 2: quantize. Without channel steps every inverse step is 1/base.
    let uniform_c = flags & F_CHSCALE == 0;
    for tt in 0..t {
        quantize_row(&mut x[tt * c..(tt + 1) * c], &inv_c, uniform_c, inv_t[tt]);
    }
    // SAFETY: f32 and i32 have the same size and alignment and every bit pattern
    // is a valid i32; quantize_row left the i32 levels in place of the floats, and
    // `x` is not used as floats again.
    let q: &[i32] = unsafe { std::slice::from_raw_parts(x.as_ptr() as *const i32, t * c) };
    let try_delta = p.delta && t > 1;
    let (delta, centers, rank) = predictions(q, t, c, &ch_sum, &inv_c, try_delta);
    if rd {
        // SAFETY: as for `q` above; `q` is not used again.
        let q = unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr() as *mut i32, t * c) };
        rd_round(q, &xf, t, c, inv_c[0], &delta, &centers, &theta);
    }
    // SAFETY: as above.
    let q: &[i32] = unsafe { std::slice::from_raw_parts(x.as_ptr() as *const i32, t * c) };
    let (kmax, fine) = match cal {
        Some(k) => (k.k, k.class_of.to_vec()),
        None => class_partition(&rank, c, p.max_classes),
    };
    if delta.iter().any(|&d| d) {
        flags |= F_MODES;
    }
    // Pass 3: residual symbols, symbol counts per class, escape bits.
    let mut syms: Vec<u8> = uninit_vec(t * c);
    let mut counts = vec![0u32; kmax * ALPHABET];
    let ka = kmax * ALPHABET;
    let mut counts4 = vec![0u32; 4 * ka];
    let fbase: Vec<usize> = fine.iter().map(|&k| k as usize * ALPHABET).collect();
    let mut bits = BitWriter::new();
    let mut pred = centers.clone();
    let dmask: Vec<i32> = delta.iter().map(|&d| if d { -1 } else { 0 }).collect();
    // Large streams count symbols on every 4th row only: counting was ~10% of encode
    // time; the sampled tables cost ~0.25% in size on an 8B chunk (2 rows: 0.11%).
    // Every direct symbol up to its class's largest and every escape seen still
    // gets a count, so each coded symbol has a frequency.
    let count_stride = if t >= 16 && t * c >= 1 << 16 { 4 } else { 1 };
    let mut ch_max = vec![0u8; c];
    // Escape symbols (rare, all coded in the scalar loop) are recorded exactly.
    let mut esc_seen = vec![false; ka];
    for tt in 0..t {
        let qr = &q[tt * c..(tt + 1) * c];
        let sr = &mut syms[tt * c..(tt + 1) * c];
        let done = row_symbols_fast(
            qr,
            &mut pred,
            &centers,
            &dmask,
            sr,
            &mut Escapes {
                bits: &mut bits,
                fbase: &fbase,
                seen: &mut esc_seen,
            },
        );
        for ch in done..c {
            let v = qr[ch];
            let z = zigzag(v.wrapping_sub(pred[ch]));
            // Delta channels predict from this token next time; constant ones keep the centre.
            pred[ch] = (v & dmask[ch]) | (centers[ch] & !dmask[ch]);
            sr[ch] = escape_symbol(z, ch, &mut bits, &fbase, &mut esc_seen) as u8;
        }
        if count_stride > 1 {
            max_into(&mut ch_max, sr);
            if tt % count_stride != 0 {
                continue;
            }
        }
        // Four sub-histograms (channel mod 4): consecutive increments of one
        // counter would otherwise wait on each other through memory.
        let mut j = 0;
        // SAFETY: j + 3 < c = fbase.len() = sr.len(); fbase[·] ≤ (kmax − 1)·ALPHABET and
        // every symbol < ALPHABET, so each index is < 4·ka = counts4.len().
        unsafe {
            let cp = counts4.as_mut_ptr();
            while j + 4 <= c {
                *cp.add(*fbase.get_unchecked(j) + *sr.get_unchecked(j) as usize) += 1;
                *cp.add(ka + *fbase.get_unchecked(j + 1) + *sr.get_unchecked(j + 1) as usize) += 1;
                *cp.add(
                    2 * ka + *fbase.get_unchecked(j + 2) + *sr.get_unchecked(j + 2) as usize,
                ) += 1;
                *cp.add(
                    3 * ka + *fbase.get_unchecked(j + 3) + *sr.get_unchecked(j + 3) as usize,
                ) += 1;
                j += 4;
            }
        }
        for j in j..c {
            counts4[fbase[j] + sr[j] as usize] += 1;
        }
    }
    if let Some(st) = stats {
        for row in syms.chunks_exact(c) {
            for (ch, &sym) in row.iter().enumerate() {
                st[ch * ALPHABET + sym as usize] += 1;
            }
        }
        return;
    }
    for (i, d) in counts.iter_mut().enumerate() {
        *d = (counts4[i] + counts4[ka + i] + counts4[2 * ka + i] + counts4[3 * ka + i])
            * count_stride as u32;
    }
    if count_stride > 1 {
        let mut class_max = vec![0u8; kmax];
        for (ch, &m) in ch_max.iter().enumerate() {
            let k = fine[ch] as usize;
            if m > class_max[k] {
                class_max[k] = m;
            }
        }
        // Direct symbols up to the class's largest, and every escape seen.
        for (k, &m) in class_max.iter().enumerate() {
            let top = (m as usize).min(DIRECT as usize - 1);
            for v in &mut counts[k * ALPHABET..=k * ALPHABET + top] {
                if *v == 0 {
                    *v = 1;
                }
            }
        }
        for (v, &seen) in counts.iter_mut().zip(&esc_seen) {
            if seen && *v == 0 {
                *v = 1;
            }
        }
    }
    let plan = plan_classes(kmax, &counts, c, ALPHABET, cal.is_some());
    // The calibrated table set that codes this chunk smallest, if it beats the chunk's own
    // tables (over the calibrated classes, no class map): a chunk unlike the calibration
    // samples keeps its own tables.
    let mut chosen: Option<(usize, Vec<Vec<u32>>)> = None;
    if let Some(k) = cal {
        flags |= F_CAL;
        let mut best = plan.bytes;
        for g in 0..k.sets() {
            if let Some(tables) = k.set(g) {
                let bytes = set_cost(&counts, &tables) / 8.0;
                if bytes < best {
                    best = bytes;
                    chosen = Some((g, tables));
                }
            }
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
    match cal {
        Some(k) => {
            // Offsets from the calibrated centres, exp-Golomb coded with the order that
            // codes them smallest (most are a few steps; a byte each was ~3 % of a
            // 64-token chunk).
            let zs: Vec<u32> = (0..c)
                .map(|ch| zigzag(centers[ch].wrapping_sub(cal_centre(k.means[ch], step_c[ch]))))
                .collect();
            let order = (0..=MAX_EG_ORDER)
                .min_by_key(|&o| zs.iter().map(|&z| eg_bits(z, o)).sum::<u64>())
                .unwrap_or(0);
            let mut bw = BitWriter::new();
            for &z in &zs {
                put_eg(&mut bw, z, order);
            }
            let b = bw.finish();
            out.push(order as u8);
            put_varint(out, b.len() as u32);
            out.extend_from_slice(&b);
        }
        None => {
            for &ctr in &centers {
                put_varint(out, zigzag(ctr));
            }
        }
    }
    let extra = bits.finish();
    put_u32(out, extra.len() as u32);
    out.extend_from_slice(&extra);
    match (cal, chosen) {
        (Some(k), Some((g, tables))) => {
            out.push(g as u8);
            encode_symbols(out, &syms, k.class_of, &tables, t, c, ALPHABET);
        }
        (Some(_), None) => {
            out.push(IN_CHUNK_TABLES_CAL_CLASSES);
            let shift = (kmax / plan.k).trailing_zeros();
            let class_of: Vec<u8> = fine.iter().map(|&f| f >> shift).collect();
            out.push(plan.k as u8);
            for f in &plan.tables {
                write_table(out, f);
            }
            encode_symbols(out, &syms, &class_of, &plan.tables, t, c, ALPHABET);
        }
        (None, _) => {
            let class_of = write_classes(out, &plan, &fine, kmax);
            encode_symbols(out, &syms, &class_of, &plan.tables, t, c, ALPHABET);
        }
    }
}

/// Residuals (zigzag) below this get a rate from the stream's histogram; a level whose
/// residual would reach it (an escape symbol) keeps its nearest rounding.
const RD_SYMBOLS: usize = 256;

/// The thresholds of rate-distortion rounding (RDOQ, as H.264/HEVC encoders do), per
/// residual symbol, from the levels `q` (nearest rounding) of a uniform-step stream: each
/// level becomes the nearest one or the next one towards its prediction (the centre, or a
/// delta channel's previous level as re-rounded), whichever costs less in error² (steps²) +
/// λ · bits, the bits of a residual from this histogram of nearest-rounded residuals. With u
/// = how far past the nearest level's magnitude the value lies (−½..½), moving one step
/// down costs (u + 1)² − u² = 2u + 1 in error and saves the bits between the two residuals,
/// so a value moves iff u < θ[z] = (λ·Δbits − 1) / 2.
fn rd_thresholds(
    q: &[i32],
    t: usize,
    c: usize,
    delta: &[bool],
    centers: &[i32],
    lambda: f32,
) -> Vec<f32> {
    // Four sub-histograms (channel mod 4): consecutive increments of one counter would
    // otherwise wait on each other through memory. The last bin gathers the residuals too
    // large for a rate (they keep their level); a delta channel's first residual is 0.
    let mut hist4 = [[0u32; RD_SYMBOLS]; 4];
    let mut prev = centers.to_vec();
    for row in q.chunks_exact(c).take(t) {
        for (ch, ((&v, p), (&d, &ctr))) in row
            .iter()
            .zip(prev.iter_mut())
            .zip(delta.iter().zip(centers))
            .enumerate()
        {
            let pred = if d { *p } else { ctr };
            let z = (zigzag(v.wrapping_sub(pred)) as usize).min(RD_SYMBOLS - 1);
            hist4[ch & 3][z & (RD_SYMBOLS - 1)] += 1;
            *p = v;
        }
    }
    // Add-one counts: every symbol has a rate.
    let hist: Vec<f64> = (0..RD_SYMBOLS)
        .map(|z| 1.0 + hist4.iter().map(|h| h[z] as f64).sum::<f64>())
        .collect();
    let n: f64 = hist.iter().sum();
    let bits: Vec<f64> = hist.iter().map(|&h| -(h / n).log2()).collect();
    // One step towards the prediction turns zigzag z into z − 2 (±1 into 0); residual 0 and
    // the last bin never move.
    let mut theta = vec![f32::NEG_INFINITY; RD_SYMBOLS];
    for z in 1..RD_SYMBOLS - 1 {
        let lo = z.saturating_sub(2);
        theta[z] = ((lambda as f64 * (bits[z] - bits[lo]) - 1.0) / 2.0) as f32;
    }
    theta
}

/// Applies `rd_thresholds`' thresholds to the nearest levels `q` of `xf` × `inv`, row by
/// row (a delta channel's prediction is the previous row's chosen level). Returns the
/// squared error (steps²) of nearest rounding and of the levels chosen.
#[allow(clippy::too_many_arguments)]
fn rd_round(
    q: &mut [i32],
    xf: &[f32],
    t: usize,
    c: usize,
    inv: f32,
    delta: &[bool],
    centers: &[i32],
    theta: &[f32],
) -> (f64, f64) {
    let dmask: Vec<i32> = delta.iter().map(|&d| if d { -1 } else { 0 }).collect();
    let mut prev = centers.to_vec();
    let (mut dn, mut moved) = (0f64, 0f64);
    // Row by row: a delta channel's prediction is the previous row's chosen level.
    for (row, xr) in q.chunks_exact_mut(c).zip(xf.chunks_exact(c)).take(t) {
        let (done, mut row_dn, mut row_moved) =
            rd_row_fast(row, xr, &mut prev, centers, &dmask, &theta, inv);
        for ch in done..c {
            let qn = row[ch];
            let e0 = xr[ch] * inv - qn as f32;
            // Clamped, NaN and ±Inf values keep their level and stay out of the errors.
            let ok = e0.abs() <= 0.5;
            let e = if ok { e0 } else { 0.0 };
            row_dn += e * e;
            let dm = dmask[ch];
            let pred = (prev[ch] & dm) | (centers[ch] & !dm);
            let r = qn.wrapping_sub(pred);
            let z = (zigzag(r) as usize).min(RD_SYMBOLS - 1);
            let u = if r > 0 { e } else { -e };
            let mv = ok & (u < theta[z]);
            let v = if mv { qn - r.signum() } else { qn };
            row_moved += if mv { 2.0 * u + 1.0 } else { 0.0 };
            row[ch] = v;
            prev[ch] = v;
        }
        dn += row_dn as f64;
        moved += row_moved as f64;
    }
    (dn, dn + moved)
}

/// `rd_round`'s decisions for one row, 4 channels at a time (the scalar loop does the
/// rest); returns the channels done and their squared error and error added (steps²).
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
fn rd_row_fast(
    row: &mut [i32],
    xr: &[f32],
    prev: &mut [i32],
    centers: &[i32],
    dmask: &[i32],
    theta: &[f32],
    inv: f32,
) -> (usize, f32, f32) {
    use core::arch::wasm32::*;
    let c = row
        .len()
        .min(xr.len())
        .min(prev.len())
        .min(centers.len())
        .min(dmask.len());
    if theta.len() < RD_SYMBOLS {
        return (0, 0.0, 0.0);
    }
    let vinv = f32x4_splat(inv);
    let half = f32x4_splat(0.5);
    let one = f32x4_splat(1.0);
    let top = i32x4_splat(RD_SYMBOLS as i32 - 1);
    let (mut acc_dn, mut acc_mv) = (f32x4_splat(0.0), f32x4_splat(0.0));
    let mut ch = 0;
    // SAFETY: ch + 4 ≤ c bounds every slice; each theta index is ≤ RD_SYMBOLS − 1 <
    // theta.len().
    unsafe {
        while ch + 4 <= c {
            let qn = v128_load(row.as_ptr().add(ch) as *const v128);
            let x = v128_load(xr.as_ptr().add(ch) as *const v128);
            let e0 = f32x4_sub(f32x4_mul(x, vinv), f32x4_convert_i32x4(qn));
            // NaN compares false: clamped, NaN and ±Inf values keep their level.
            let ok = f32x4_le(f32x4_abs(e0), half);
            let e = v128_and(e0, ok);
            acc_dn = f32x4_add(acc_dn, f32x4_mul(e, e));
            let dm = v128_load(dmask.as_ptr().add(ch) as *const v128);
            let pred = v128_bitselect(
                v128_load(prev.as_ptr().add(ch) as *const v128),
                v128_load(centers.as_ptr().add(ch) as *const v128),
                dm,
            );
            let r = i32x4_sub(qn, pred);
            let z = v128_xor(i32x4_shl(r, 1), i32x4_shr(r, 31));
            let z = u32x4_min(z, top);
            let th = f32x4(
                *theta.get_unchecked(u32x4_extract_lane::<0>(z) as usize),
                *theta.get_unchecked(u32x4_extract_lane::<1>(z) as usize),
                *theta.get_unchecked(u32x4_extract_lane::<2>(z) as usize),
                *theta.get_unchecked(u32x4_extract_lane::<3>(z) as usize),
            );
            let pos = i32x4_gt(r, i32x4_splat(0));
            let u = v128_bitselect(e, f32x4_neg(e), pos);
            let mv = v128_and(ok, f32x4_lt(u, th));
            // Residual 0 never moves (theta[0] = −∞), so the step is ±1 where it does.
            let step = v128_bitselect(i32x4_splat(1), i32x4_splat(-1), pos);
            let v = i32x4_sub(qn, v128_and(step, mv));
            acc_mv = f32x4_add(acc_mv, v128_and(f32x4_add(f32x4_add(u, u), one), mv));
            v128_store(row.as_mut_ptr().add(ch) as *mut v128, v);
            v128_store(prev.as_mut_ptr().add(ch) as *mut v128, v);
            ch += 4;
        }
    }
    let sum = |v: v128| {
        f32x4_extract_lane::<0>(v)
            + f32x4_extract_lane::<1>(v)
            + f32x4_extract_lane::<2>(v)
            + f32x4_extract_lane::<3>(v)
    };
    (ch, sum(acc_dn), sum(acc_mv))
}

#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
fn rd_row_fast(
    _row: &mut [i32],
    _xr: &[f32],
    _prev: &mut [i32],
    _centers: &[i32],
    _dmask: &[i32],
    _theta: &[f32],
    _inv: f32,
) -> (usize, f32, f32) {
    (0, 0.0, 0.0)
}

/// Channels the trial quantization of `rd_step` samples: every RD_TRIAL_STRIDE-th of a
/// wide stream (each channel is its own prediction chain, so a subset of channels is a
/// faithful sample; the error rise it measures is a ratio, not a sum).
const RD_TRIAL_STRIDE: usize = 8;

/// The largest error rise (trial error with rate-distortion rounding / nearest rounding's)
/// that `rd_step` corrects for; smooth densities give 1.0–1.3 (1.28 at 8× q1's error).
const RD_MAX_RISE: f64 = 2.0;

/// The step at which rate-distortion rounding gives the error that nearest rounding gives
/// at `base`: a trial quantization at `base` (on a sample of the channels) measures the
/// rise, and for a density smooth at the scale of a step the error scales with the step, so
/// the step shrinks by the square root of the rise. None when the trial moves no level
/// (high rates: the bits between neighbouring residuals are too few to pay for any error)
/// or the rise exceeds RD_MAX_RISE.
fn rd_step(
    xf: &[f32],
    t: usize,
    c: usize,
    base: f32,
    ch_sum: &[f32],
    try_delta: bool,
    lambda: f32,
) -> Option<(f32, Vec<f32>)> {
    let stride = if c >= 8 * RD_TRIAL_STRIDE {
        RD_TRIAL_STRIDE
    } else {
        1
    };
    let m = (c + stride - 1) / stride;
    let inv = 1.0 / base;
    let mut yf = vec![0f32; t * m];
    for tt in 0..t {
        for j in 0..m {
            yf[tt * m + j] = xf[tt * c + j * stride];
        }
    }
    let sums: Vec<f32> = (0..m).map(|j| ch_sum[j * stride]).collect();
    let inv_m = vec![inv; m];
    let mut y = yf.clone();
    for row in y.chunks_exact_mut(m) {
        quantize_row(row, &inv_m, true, 1.0);
    }
    // SAFETY: as in encode_stream: quantize_row left the i32 levels' bits in `y`.
    let q = unsafe { std::slice::from_raw_parts_mut(y.as_mut_ptr() as *mut i32, t * m) };
    let (delta, centers, _) = predictions(q, t, m, &sums, &inv_m, try_delta);
    let theta = rd_thresholds(q, t, m, &delta, &centers, lambda);
    let (dn, dr) = rd_round(q, &yf, t, m, inv, &delta, &centers, &theta);
    // A rise beyond RD_MAX_RISE says the density is not smooth at the scale of a step (values
    // on the step grid: nearest rounding's error ~0 while rare levels still move), so the
    // square-root correction does not hold: followed, it shrank the step without bound and
    // clamped levels at QMAX. Nearest rounding then.
    if !(dr > dn && dn > 0.0 && dr <= RD_MAX_RISE * dn) {
        return None;
    }
    let b = (base as f64 * (dn / dr).sqrt()) as f32;
    if b > 1e-30 && b.is_finite() {
        Some((b, theta))
    } else {
        None
    }
}

/// Channel prediction from the levels `q`: delta from the previous token vs a constant centre
/// (the channel mean in levels), decided on (up to) 64 sampled token pairs. Returns the
/// delta flags, the centres (a delta channel's is its first level) and each channel's
/// sampled residual cost (bit lengths), which also ranks channels for the entropy coder's
/// classes, so the symbol pass can count per class directly.
fn predictions(
    q: &[i32],
    t: usize,
    c: usize,
    ch_sum: &[f32],
    inv_c: &[f32],
    try_delta: bool,
) -> (Vec<bool>, Vec<i32>, Vec<u32>) {
    let mut delta = vec![false; c];
    let mut centers: Vec<i32> = (0..c)
        .map(|ch| {
            let m = ch_sum[ch] / t as f32 * inv_c[ch];
            if m.is_finite() {
                (m.round() as i32).max(-QMAX).min(QMAX)
            } else {
                0
            }
        })
        .collect();
    let stride = (t / 64).max(1);
    let mut cost_c = vec![0u32; c];
    let mut cost_d = vec![0u32; c];
    let mut tt = if try_delta { 1 } else { 0 };
    while tt < t {
        let cur = &q[tt * c..(tt + 1) * c];
        for ch in 0..c {
            cost_c[ch] += bitlen(zigzag(cur[ch].wrapping_sub(centers[ch])));
        }
        if try_delta {
            let prev = &q[(tt - 1) * c..tt * c];
            for ch in 0..c {
                cost_d[ch] += bitlen(zigzag(cur[ch].wrapping_sub(prev[ch])));
            }
        }
        tt += stride;
    }
    let mut rank = cost_c.clone();
    if try_delta {
        for ch in 0..c {
            if cost_d[ch] < cost_c[ch] {
                delta[ch] = true;
                centers[ch] = q[ch];
                rank[ch] = cost_d[ch];
            }
        }
    }
    (delta, centers, rank)
}

/// `mx[i] = max(mx[i], row[i])`.
fn max_into(mx: &mut [u8], row: &[u8]) {
    let n = mx.len().min(row.len());
    let mut i = 0;
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    unsafe {
        use core::arch::wasm32::*;
        // SAFETY: i + 16 ≤ n bounds both slices.
        while i + 16 <= n {
            let p = mx.as_mut_ptr().add(i) as *mut v128;
            let r = v128_load(row.as_ptr().add(i) as *const v128);
            v128_store(p, u8x16_max(v128_load(p), r));
            i += 16;
        }
    }
    for i in i..n {
        if row[i] > mx[i] {
            mx[i] = row[i];
        }
    }
}

/// Adds one row to the channel statistics; returns (Σx², max|x|) of the row.
/// Non-finite values count as 0.
fn row_stats(
    row: &[f32],
    sum: &mut [f32],
    ss: &mut [f32],
    mn: &mut [f32],
    mx: &mut [f32],
    ranges: bool,
) -> (f32, f32) {
    let c = row.len();
    let mut rs = 0f32;
    let mut rm = 0f32;
    let mut ch = 0;
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    unsafe {
        use core::arch::wasm32::*;
        let inf = f32x4_splat(f32::INFINITY);
        let mut vrs = f32x4_splat(0.0);
        let mut vrm = f32x4_splat(0.0);
        // SAFETY: ch + 4 ≤ c = row.len() = every per-channel slice's length.
        while ch + 4 <= c {
            let v = v128_load(row.as_ptr().add(ch) as *const v128);
            let a = f32x4_abs(v);
            let ok = f32x4_lt(a, inf);
            let v = v128_and(v, ok);
            let a = v128_and(a, ok);
            let v2 = f32x4_mul(v, v);
            let ps = sum.as_mut_ptr().add(ch) as *mut v128;
            v128_store(ps, f32x4_add(v128_load(ps), v));
            let pq = ss.as_mut_ptr().add(ch) as *mut v128;
            v128_store(pq, f32x4_add(v128_load(pq), v2));
            vrs = f32x4_add(vrs, v2);
            vrm = f32x4_pmax(vrm, a);
            if ranges {
                let pn = mn.as_mut_ptr().add(ch) as *mut v128;
                v128_store(pn, f32x4_pmin(v128_load(pn), v));
                let px = mx.as_mut_ptr().add(ch) as *mut v128;
                v128_store(px, f32x4_pmax(v128_load(px), v));
            }
            ch += 4;
        }
        rs += f32x4_extract_lane::<0>(vrs)
            + f32x4_extract_lane::<1>(vrs)
            + f32x4_extract_lane::<2>(vrs)
            + f32x4_extract_lane::<3>(vrs);
        for l in [
            f32x4_extract_lane::<0>(vrm),
            f32x4_extract_lane::<1>(vrm),
            f32x4_extract_lane::<2>(vrm),
            f32x4_extract_lane::<3>(vrm),
        ] {
            if l > rm {
                rm = l;
            }
        }
    }
    for ch in ch..c {
        let v = row[ch];
        let v = if v.is_finite() { v } else { 0.0 };
        sum[ch] += v;
        ss[ch] += v * v;
        rs += v * v;
        // Plain compares: f32::max/min become libm calls in wasm.
        let a = v.abs();
        if a > rm {
            rm = a;
        }
        if ranges {
            if v < mn[ch] {
                mn[ch] = v;
            }
            if v > mx[ch] {
                mx[ch] = v;
            }
        }
    }
    (rs, rm)
}

/// Symbol of zigzag residual `z` of channel `ch`; a large one writes its extra bits and
/// is recorded as seen in the channel's class (so its table gives it a frequency).
#[inline(always)]
fn escape_symbol(
    z: u32,
    ch: usize,
    bits: &mut BitWriter,
    fbase: &[usize],
    seen: &mut [bool],
) -> u32 {
    if z < DIRECT {
        return z;
    }
    let k = 31 - z.leading_zeros();
    bits.put(z, k - 1);
    let s = DIRECT + 2 * (k - DIRECT_BITS) + ((z >> (k - 1)) & 1);
    seen[fbase[ch] + s as usize] = true;
    s
}

/// Where the symbol pass writes escapes: extra bits in row order, escape symbols seen per class.
struct Escapes<'a> {
    bits: &'a mut BitWriter,
    fbase: &'a [usize],
    seen: &'a mut [bool],
}

/// Residual symbols of one row, 16 channels at a time (a group holding an escape finishes
/// its symbols one by one, in row order), then 4 at a time while they are all direct;
/// returns how many channels it did. Updates the predictions.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
fn row_symbols_fast(
    q: &[i32],
    pred: &mut [i32],
    centers: &[i32],
    dmask: &[i32],
    out: &mut [u8],
    esc: &mut Escapes,
) -> usize {
    use core::arch::wasm32::*;
    let c = q.len();
    let lim = u32x4_splat(DIRECT);
    let mut ch = 0;
    // SAFETY: ch + 16 ≤ c (then ch + 4 ≤ c), and every slice here has c elements.
    unsafe {
        // 16 channels per step while all are direct: one test, one 16-byte store.
        while ch + 16 <= c {
            let mut z = [u32x4_splat(0); 4];
            let mut ok = u32x4_splat(!0);
            for h in 0..4 {
                let b = ch + 4 * h;
                let r = i32x4_sub(
                    v128_load(q.as_ptr().add(b) as *const v128),
                    v128_load(pred.as_ptr().add(b) as *const v128),
                );
                z[h] = v128_xor(i32x4_shl(r, 1), i32x4_shr(r, 31));
                ok = v128_and(ok, u32x4_lt(z[h], lim));
            }
            for h in 0..4 {
                let b = ch + 4 * h;
                let pp = pred.as_mut_ptr().add(b) as *mut v128;
                let v = v128_load(q.as_ptr().add(b) as *const v128);
                let dm = v128_load(dmask.as_ptr().add(b) as *const v128);
                let cv = v128_load(centers.as_ptr().add(b) as *const v128);
                v128_store(pp, v128_bitselect(v, cv, dm));
            }
            if u32x4_all_true(ok) {
                // z < 64 in every lane: the saturating narrows are exact.
                let b = u8x16_narrow_i16x8(
                    i16x8_narrow_i32x4(z[0], z[1]),
                    i16x8_narrow_i32x4(z[2], z[3]),
                );
                v128_store(out.as_mut_ptr().add(ch) as *mut v128, b);
            } else {
                let mut zs = [0u32; 16];
                for h in 0..4 {
                    v128_store(zs.as_mut_ptr().add(4 * h) as *mut v128, z[h]);
                }
                for (j, &zj) in zs.iter().enumerate() {
                    out[ch + j] = escape_symbol(zj, ch + j, esc.bits, esc.fbase, esc.seen) as u8;
                }
            }
            ch += 16;
        }
        while ch + 4 <= c {
            let v = v128_load(q.as_ptr().add(ch) as *const v128);
            let pp = pred.as_mut_ptr().add(ch) as *mut v128;
            let r = i32x4_sub(v, v128_load(pp));
            let z = v128_xor(i32x4_shl(r, 1), i32x4_shr(r, 31));
            if !u32x4_all_true(u32x4_lt(z, lim)) {
                break;
            }
            let dm = v128_load(dmask.as_ptr().add(ch) as *const v128);
            let cv = v128_load(centers.as_ptr().add(ch) as *const v128);
            v128_store(pp, v128_bitselect(v, cv, dm));
            let b = u8x16_narrow_i16x8(i16x8_narrow_i32x4(z, z), i16x8_narrow_i32x4(z, z));
            let w = i32x4_extract_lane::<0>(b) as u32;
            core::ptr::copy_nonoverlapping(w.to_le_bytes().as_ptr(), out.as_mut_ptr().add(ch), 4);
            ch += 4;
        }
    }
    ch
}

#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
fn row_symbols_fast(
    _q: &[i32],
    _pred: &mut [i32],
    _centers: &[i32],
    _dmask: &[i32],
    _out: &mut [u8],
    _esc: &mut Escapes,
) -> usize {
    0
}

/// Quantizes one row in place: on return `x` holds the i32 levels' bits.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
fn quantize_row(x: &mut [f32], inv_c: &[f32], uniform: bool, it: f32) {
    use core::arch::wasm32::*;
    let c = x.len().min(inv_c.len());
    let lim = f32x4_splat(QMAX as f32);
    let nlim = f32x4_splat(-(QMAX as f32));
    // `unit`: the token multiplier is 1, so the per-channel inverse steps apply
    // as they are; otherwise the channel steps are all equal (V) and fold into vt.
    let unit = it == 1.0;
    if !unit && !uniform {
        for i in 0..c {
            x[i] = f32::from_bits(quantize_one(x[i] * inv_c[i] * it) as u32);
        }
        return;
    }
    let vt = f32x4_splat(if unit {
        1.0
    } else {
        inv_c.first().copied().unwrap_or(1.0) * it
    });
    let magic = f32x4_splat(12582912.0);
    let mut ch = 0;
    while ch + 4 <= c {
        unsafe {
            let v = v128_load(x.as_ptr().add(ch) as *const v128);
            // K: per-channel steps, no token multiplier; V: one step times the token's.
            let s = if unit {
                f32x4_mul(v, v128_load(inv_c.as_ptr().add(ch) as *const v128))
            } else {
                f32x4_mul(v, vt)
            };
            // NaN compares false against itself: zero it; ±Inf clamps (pmin/pmax are
            // single instructions, unlike NaN-propagating min/max).
            let s = v128_and(s, f32x4_eq(s, s));
            let s = f32x4_pmax(nlim, f32x4_pmin(lim, s));
            // Adding 1.5·2^23 rounds to an integer (ties to even) in the low mantissa
            // bits; cheaper than nearest + trunc_sat, exact for |s| ≤ 2^22.
            let r = f32x4_add(s, magic);
            v128_store(x.as_mut_ptr().add(ch) as *mut v128, i32x4_sub(r, magic));
        }
        ch += 4;
    }
    for i in ch..c {
        x[i] = f32::from_bits(quantize_one(x[i] * inv_c[i] * it) as u32);
    }
}

#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
fn quantize_row(x: &mut [f32], inv_c: &[f32], _uniform: bool, it: f32) {
    for i in 0..x.len() {
        x[i] = f32::from_bits(quantize_one(x[i] * inv_c[i] * it) as u32);
    }
}

#[inline(always)]
fn quantize_one(v: f32) -> i32 {
    if v.is_nan() {
        return 0;
    }
    let lim = QMAX as f32;
    let r = if v > lim {
        lim
    } else if v < -lim {
        -lim
    } else {
        v
    };
    // Round half to even, as f32x4.nearest does in the SIMD path.
    let f = r.floor();
    let d = r - f;
    let fi = f as i32;
    if d > 0.5 || (d == 0.5 && fi & 1 != 0) {
        fi + 1
    } else {
        fi
    }
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

struct RowCtx<'a> {
    step: &'a [f32],
    centers: &'a [i32],
    dmask: &'a [i32],
}

/// Scalar reconstruction of one row (handles escapes); returns false on a bad symbol.
fn row_scalar(
    ctx: &RowCtx,
    row: &[u8],
    m: f32,
    prev: &mut [i32],
    bits: &mut BitReader,
    dtype: u32,
    dst: &mut [u8],
    o: usize,
) -> bool {
    for ch in 0..row.len() {
        let s = row[ch] as u32;
        let z = if s < DIRECT {
            s
        } else {
            let j = s - DIRECT;
            let k = j / 2 + DIRECT_BITS;
            if k > MAX_K {
                return false;
            }
            (1u32 << k) | ((j & 1) << (k - 1)) | bits.get(k - 1)
        };
        let dm = ctx.dmask[ch];
        let pred = (prev[ch] & dm) | (ctx.centers[ch] & !dm);
        let qv = pred.wrapping_add(unzigzag(z));
        prev[ch] = qv;
        store(dst, o + ch, dtype, qv as f32 * ctx.step[ch] * m);
    }
    true
}

/// Expands a row's symbols to zigzag residuals in `z` (escape symbols take their extra
/// bits from `bits`, in row order, exactly as `row_scalar` reads them); false on a bad symbol.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
fn row_residuals(row: &[u8], z: &mut [u32], bits: &mut BitReader) -> bool {
    use core::arch::wasm32::*;
    let c = row.len().min(z.len());
    let lim = u8x16_splat(DIRECT as u8);
    let mut escape = |i: usize, z: &mut [u32]| -> bool {
        let j = row[i] as u32 - DIRECT;
        let k = j / 2 + DIRECT_BITS;
        if k > MAX_K {
            return false;
        }
        z[i] = (1u32 << k) | ((j & 1) << (k - 1)) | bits.get(k - 1);
        true
    };
    let mut i = 0;
    while i + 16 <= c {
        // SAFETY: i + 16 ≤ c bounds the 16-byte load from `row` and the 16 stores into `z`.
        let mut mask = unsafe {
            let v = v128_load(row.as_ptr().add(i) as *const v128);
            let w0 = u16x8_extend_low_u8x16(v);
            let w1 = u16x8_extend_high_u8x16(v);
            let zp = z.as_mut_ptr().add(i) as *mut v128;
            v128_store(zp, u32x4_extend_low_u16x8(w0));
            v128_store(zp.add(1), u32x4_extend_high_u16x8(w0));
            v128_store(zp.add(2), u32x4_extend_low_u16x8(w1));
            v128_store(zp.add(3), u32x4_extend_high_u16x8(w1));
            u8x16_bitmask(u8x16_ge(v, lim))
        };
        while mask != 0 {
            if !escape(i + mask.trailing_zeros() as usize, z) {
                return false;
            }
            mask &= mask - 1;
        }
        i += 16;
    }
    for i in i..c {
        z[i] = row[i] as u32;
        if z[i] >= DIRECT && !escape(i, z) {
            return false;
        }
    }
    true
}

#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
mod simd {
    use core::arch::wasm32::*;

    /// True when every symbol of the row is a direct residual (no escape bits).
    #[inline(always)]
    pub fn row_direct(row: &[u8]) -> bool {
        let mut i = 0;
        // One running max, one test at the end: escapes are rare.
        let mut m = u8x16_splat(0);
        while i + 16 <= row.len() {
            // SAFETY: i + 16 ≤ row.len().
            m = u8x16_max(m, unsafe { v128_load(row.as_ptr().add(i) as *const v128) });
            i += 16;
        }
        u8x16_all_true(u8x16_lt(m, u8x16_splat(super::DIRECT as u8)))
            && row[i..].iter().all(|&s| (s as u32) < super::DIRECT)
    }

    /// f32x4 → fp16 bits (RNE, overflow → Inf, NaN → quiet NaN), in i32 lanes.
    #[inline(always)]
    pub fn f32x4_to_f16(f: v128) -> v128 {
        let sign = v128_and(f, u32x4_splat(0x8000_0000));
        // |f| as bits is in 0..2^31, so signed compares and min are exact.
        let a = v128_xor(f, sign);
        // Normal range: rebias the exponent and round to nearest even at bit 13.
        let odd = v128_and(u32x4_shr(a, 13), u32x4_splat(1));
        let norm = i32x4_add(
            i32x4_add(
                a,
                u32x4_splat(((15u32.wrapping_sub(127)) << 23).wrapping_add(0xfff)),
            ),
            odd,
        );
        // Too large (and Inf) saturate to Inf with one min; NaN keeps a quiet bit.
        let o = i32x4_min(u32x4_shr(norm, 13), i32x4_splat(0x7c00));
        let nan = i32x4_gt(a, i32x4_splat(255 << 23));
        let o = v128_or(o, v128_and(nan, u32x4_splat(0x0200)));
        // Subnormal results: the FP add of a magic constant rounds exactly.
        let small = i32x4_lt(a, i32x4_splat(113 << 23));
        let magic = u32x4_splat(((127 - 15) + (23 - 10) + 1) << 23);
        let o_small = i32x4_sub(f32x4_add(a, magic), magic);
        let o = v128_bitselect(o_small, o, small);
        v128_or(o, u32x4_shr(sign, 16))
    }

    /// f32x4 → fp16 bits for values that are 0 or ≥ 2^-14 in magnitude (no fp16
    /// subnormal results) and not NaN: scaling by 2^-112 rebiases the exponent
    /// exactly, then one integer add rounds to nearest even at bit 13 (a carry
    /// into the exponent is right) and one min saturates overflow to Inf.
    #[inline(always)]
    pub fn f32x4_to_f16_normal(f: v128) -> v128 {
        let a = v128_and(f, u32x4_splat(0x7fff_ffff));
        let s = f32x4_mul(a, f32x4_splat(f32::from_bits((127 - 112) << 23)));
        let odd = v128_and(u32x4_shr(s, 13), u32x4_splat(1));
        let r = u32x4_shr(i32x4_add(i32x4_add(s, u32x4_splat(0xfff)), odd), 13);
        let r = i32x4_min(r, i32x4_splat(0x7c00));
        v128_or(r, v128_and(u32x4_shr(f, 16), u32x4_splat(0x8000)))
    }

    /// `f32x4_to_f16_normal` of f · 2^112 for `s` = f · 2^-112 already scaled (recon8 folds
    /// the 2^-112 into a uniform step: exact, since every nonzero |f| is ≥ 2^-14, so both
    /// products are normal f32 and scaling by a power of two commutes with their rounding; a
    /// product that would overflow to Inf is a finite s ≥ 2^16 here, which saturates to Inf alike).
    #[inline(always)]
    pub fn f32x4_scaled_to_f16(s: v128) -> v128 {
        let a = v128_and(s, u32x4_splat(0x7fff_ffff));
        let odd = v128_and(u32x4_shr(a, 13), u32x4_splat(1));
        let r = u32x4_shr(i32x4_add(i32x4_add(a, u32x4_splat(0xfff)), odd), 13);
        let r = i32x4_min(r, i32x4_splat(0x7c00));
        v128_or(r, v128_and(u32x4_shr(s, 16), u32x4_splat(0x8000)))
    }

    #[inline(always)]
    pub fn f32x4_to_bf16(f: v128) -> v128 {
        // Finite inputs only (the decoder's products are finite unless the stream is hostile).
        let lsb = v128_and(u32x4_shr(f, 16), u32x4_splat(1));
        u32x4_shr(i32x4_add(i32x4_add(f, u32x4_splat(0x7fff)), lsb), 16)
    }
}

/// The residuals of 8 zigzag values (two u32x4), for recon8.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[inline(always)]
fn residuals8(z: [core::arch::wasm32::v128; 2]) -> [core::arch::wasm32::v128; 2] {
    use core::arch::wasm32::*;
    let one = u32x4_splat(1);
    let r = |z: v128| v128_xor(u32x4_shr(z, 1), i32x4_neg(v128_and(z, one)));
    [r(z[0]), r(z[1])]
}

/// The residuals of 8 direct symbols (zigzag values < 64, as u16x8), for recon8: unzigzagged
/// in 16-bit lanes, 8 at a time, then sign-extended.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[inline(always)]
fn direct_residuals8(w: core::arch::wasm32::v128) -> [core::arch::wasm32::v128; 2] {
    use core::arch::wasm32::*;
    let r = v128_xor(u16x8_shr(w, 1), i16x8_neg(v128_and(w, u16x8_splat(1))));
    [i32x4_extend_low_i16x8(r), i32x4_extend_high_i16x8(r)]
}

/// The uniform step recon8 takes for output DT: for DT_F16_NORMAL the step times 2^-112 (exact:
/// the step is ≥ 2^-14 in magnitude there, so the product is a normal f32), else the step.
#[inline(always)]
fn uniform_step<const DT: u32>(s: f32) -> f32 {
    if DT == DT_F16_NORMAL {
        // 2^-112: rebiases an f32 exponent to fp16's (simd::f32x4_to_f16_normal).
        s * f32::from_bits((127 - 112) << 23)
    } else {
        s
    }
}

/// Reconstructs 8 channels from their residuals (`r`, two i32x4; see `residuals8`) and writes them
/// at `out` as DT: the prediction (the previous token's q where `dmask` is set, else the
/// centre) plus the residual, times the step (`vs`, `uniform_step`'s value, or per channel
/// from `step` unless UNIFORM). Updates `prev` when DELTA.
///
/// SAFETY: `centers`, `dmask`, `prev` and (unless UNIFORM) `step` have 8 elements, and
/// `out` 8 elements of DT.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[inline(always)]
unsafe fn recon8<const DELTA: bool, const UNIFORM: bool, const DT: u32>(
    r: [core::arch::wasm32::v128; 2],
    centers: *const i32,
    dmask: *const i32,
    prev: *mut i32,
    step: *const f32,
    vs: core::arch::wasm32::v128,
    out: *mut u8,
) {
    use core::arch::wasm32::*;
    let mut outv = [vs; 2];
    for h in 0..2 {
        let b = 4 * h;
        let r = r[h];
        let cv = v128_load(centers.add(b) as *const v128);
        let qv = if DELTA {
            let dm = v128_load(dmask.add(b) as *const v128);
            let pv = v128_load(prev.add(b) as *const v128);
            let qv = i32x4_add(v128_bitselect(pv, cv, dm), r);
            v128_store(prev.add(b) as *mut v128, qv);
            qv
        } else {
            i32x4_add(cv, r)
        };
        let sc = if UNIFORM {
            vs
        } else {
            v128_load(step.add(b) as *const v128)
        };
        outv[h] = f32x4_mul(f32x4_convert_i32x4(qv), sc);
    }
    let p = out;
    if DT == DT_BF16 {
        let v = u16x8_narrow_i32x4(simd::f32x4_to_bf16(outv[0]), simd::f32x4_to_bf16(outv[1]));
        v128_store(p as *mut v128, v);
    } else if DT == DT_F16 {
        let v = u16x8_narrow_i32x4(simd::f32x4_to_f16(outv[0]), simd::f32x4_to_f16(outv[1]));
        v128_store(p as *mut v128, v);
    } else if DT == DT_F16_NORMAL && UNIFORM {
        // `vs` is the step · 2^-112 (F16_SCALE).
        let v = u16x8_narrow_i32x4(
            simd::f32x4_scaled_to_f16(outv[0]),
            simd::f32x4_scaled_to_f16(outv[1]),
        );
        v128_store(p as *mut v128, v);
    } else if DT == DT_F16_NORMAL {
        let v = u16x8_narrow_i32x4(
            simd::f32x4_to_f16_normal(outv[0]),
            simd::f32x4_to_f16_normal(outv[1]),
        );
        v128_store(p as *mut v128, v);
    } else {
        v128_store(p as *mut v128, outv[0]);
        v128_store(p.add(16) as *mut v128, outv[1]);
    }
}

/// SIMD reconstruction of the direct-symbol part of a row (8 channels at a time);
/// returns how many channels it wrote. Specialised on whether any channel is
/// delta-predicted, whether the step is one scalar (V: per-token steps) or per
/// channel (K), and the output dtype, so the inner loop carries no branches.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
fn row_fast<const DELTA: bool, const UNIFORM: bool, const DT: u32, const Z: bool>(
    ctx: &RowCtx,
    step: &[f32],
    s0: f32,
    row: &[u8],
    zrow: &[u32],
    prev: &mut [i32],
    dst: &mut [u8],
    o: usize,
) -> usize {
    use core::arch::wasm32::*;
    let c = if Z { zrow.len() } else { row.len() };
    let eb = if DT == DT_F16 || DT == DT_BF16 || DT == DT_F16_NORMAL {
        2
    } else {
        4
    };
    if dst.len() < (o + c) * eb
        || step.len() < c
        || prev.len() < c
        || ctx.centers.len() < c
        || ctx.dmask.len() < c
    {
        return 0;
    }
    let vs = f32x4_splat(uniform_step::<DT>(s0));
    let mut ch = 0;
    // SAFETY: ch + 8 ≤ c bounds every per-channel slice (all ≥ c long) and the
    // output (checked above).
    let (pp, dp) = (prev.as_mut_ptr(), dst.as_mut_ptr());
    unsafe {
        let group = |ch: usize| {
            let sv = if Z {
                let zp = zrow.as_ptr().add(ch) as *const v128;
                residuals8([v128_load(zp), v128_load(zp.add(1))])
            } else {
                direct_residuals8(u16x8_extend_low_u8x16(v128_load64_zero(
                    row.as_ptr().add(ch) as *const u64,
                )))
            };
            recon8::<DELTA, UNIFORM, DT>(
                sv,
                ctx.centers.as_ptr().add(ch),
                ctx.dmask.as_ptr().add(ch),
                pp.add(ch),
                step.as_ptr().add(ch),
                vs,
                dp.add((o + ch) * eb),
            );
        };
        // Two groups per iteration: the loop's own instructions (one induction variable per
        // array, V8's stack check) cost as much as a third of a group.
        while ch + 16 <= c {
            group(ch);
            group(ch + 8);
            ch += 16;
        }
        if ch + 8 <= c {
            group(ch);
            ch += 8;
        }
    }
    ch
}

#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[allow(clippy::too_many_arguments)]
fn row_fast_any<const Z: bool>(
    ctx: &RowCtx,
    step: &[f32],
    s0: f32,
    row: &[u8],
    zrow: &[u32],
    prev: &mut [i32],
    dtype: u32,
    dst: &mut [u8],
    o: usize,
    delta: bool,
    uniform: bool,
) -> usize {
    macro_rules! go {
        ($d:expr, $u:expr) => {
            match dtype {
                DT_F16 => row_fast::<$d, $u, DT_F16, Z>(ctx, step, s0, row, zrow, prev, dst, o),
                DT_F16_NORMAL => {
                    row_fast::<$d, $u, DT_F16_NORMAL, Z>(ctx, step, s0, row, zrow, prev, dst, o)
                }
                DT_BF16 => row_fast::<$d, $u, DT_BF16, Z>(ctx, step, s0, row, zrow, prev, dst, o),
                _ => row_fast::<$d, $u, 3, Z>(ctx, step, s0, row, zrow, prev, dst, o),
            }
        };
    }
    match (delta, uniform) {
        (true, true) => go!(true, true),
        (true, false) => go!(true, false),
        (false, true) => go!(false, true),
        (false, false) => go!(false, false),
    }
}

/// Decodes a stream's symbol block (after its centres and escape bits): the chunk's own
/// tables, or a calibration's.
fn decode_payload<S: GroupSink>(
    r: &mut Reader,
    t: usize,
    c: usize,
    syms: &mut [u8],
    cal: Option<&StreamCal>,
    sink: &mut S,
) -> Option<()> {
    let (k, cbase, dec) = payload_tables(r, c, cal)?;
    decode_symbols_with(r, t, c, k, &cbase, &dec, syms, sink)
}

/// A stream's block up to its payload: class count, class bases and decode tables (the
/// chunk's own, or a calibration's set).
fn payload_tables(
    r: &mut Reader,
    c: usize,
    cal: Option<&StreamCal>,
) -> Option<(usize, Vec<u32>, Rc<Vec<u32>>)> {
    match cal {
        Some(k) => {
            let g = r.u8()?;
            if g == IN_CHUNK_TABLES {
                let (n, cbase, dec) = read_block_tables(r, c, ALPHABET)?;
                Some((n, cbase, Rc::new(dec)))
            } else if g == IN_CHUNK_TABLES_CAL_CLASSES {
                let n = r.u8()? as usize;
                if n == 0 || n > k.k || !n.is_power_of_two() {
                    return None;
                }
                let shift = (k.k / n).trailing_zeros();
                let mut dec: Vec<u32> = uninit_vec(n * PROB_SCALE as usize);
                for cls in 0..n {
                    let f = read_freqs(r, ALPHABET)?;
                    fill_table(&f, &mut dec[cls * PROB_SCALE as usize..]);
                }
                let cbase: Vec<u32> = k
                    .class_of
                    .iter()
                    .map(|&v| (v >> shift) as u32 * PROB_SCALE)
                    .collect();
                Some((n, cbase, Rc::new(dec)))
            } else {
                let dec = set_decode_tables(k, g as usize)?;
                let cbase: Vec<u32> = k.class_of.iter().map(|&v| v as u32 * PROB_SCALE).collect();
                Some((k.k, cbase, dec))
            }
        }
        None => {
            let (n, cbase, dec) = read_block_tables(r, c, ALPHABET)?;
            Some((n, cbase, Rc::new(dec)))
        }
    }
}

/// Reconstructs the rows of a uniform-step stream inside the rANS decode loop: after each
/// group of 8 symbols is decoded, the same 8 channels of the previous row are expanded
/// (escape bits read in row order, as `row_residuals` does) and written as DT. Whatever the
/// loop left (the last row, the careful tail) is finished here.
///
/// SAFETY (of the sink): `c % 8 == 0`; `centers`, `dmask`, `prev` have c elements and
/// `out` n elements of DT (checked by `decode_fused`); group() is called once per decoded
/// group, so the group it expands (one row behind) is always decoded.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[derive(Clone, Copy)]
struct FusedRows<'b, const DELTA: bool, const DT: u32> {
    c: usize,
    /// Next symbol (a multiple of 8) to reconstruct, and its channel.
    j: usize,
    ch: usize,
    /// Groups still to decode before the first row is complete.
    skip: usize,
    vs: core::arch::wasm32::v128,
    centers: *const i32,
    dmask: *const i32,
    prev: *mut i32,
    out: *mut u8,
    /// A pointer (not a reference) keeps the sink Copy, so the decode loop can hold it in
    /// registers; only the escape path touches the reader.
    bits: *mut BitReader<'b>,
}

#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
impl<'b, const DELTA: bool, const DT: u32> FusedRows<'b, DELTA, DT> {
    /// Reconstructs the 8 symbols at `j`; false on a bad escape symbol.
    #[inline(always)]
    unsafe fn next(&mut self, syms: *const u8) -> bool {
        use core::arch::wasm32::*;
        let (j, ch) = (self.j, self.ch);
        let b = v128_load64_zero(syms.add(j) as *const u64);
        let w = u16x8_extend_low_u8x16(b);
        // The upper 8 bytes are zero, so only this group's symbols can be escapes. Symbols
        // are < 128: a signed compare (one instruction; unsigned ones take V8 four).
        let esc = u8x16_bitmask(i8x16_gt(b, i8x16_splat(DIRECT as i8 - 1))) as u32;
        let mut z = [u32x4_extend_low_u16x8(w), u32x4_extend_high_u16x8(w)];
        if esc != 0 {
            match escape_group(syms.add(j), esc, self.bits, z) {
                Some(v) => z = v,
                None => return false,
            }
        }
        let r = residuals8(z);
        recon8::<DELTA, true, DT>(
            r,
            self.centers.add(ch),
            self.dmask.add(ch),
            self.prev.add(ch),
            core::ptr::null(),
            self.vs,
            self.out.add(j * 2),
        );
        self.j = j + 8;
        self.ch = if ch + 8 == self.c { 0 } else { ch + 8 };
        true
    }
}

/// The zigzag residuals `z` of a group of 8 symbols at `syms` with its escape symbols (lanes
/// `esc`) expanded from the escape bits, read in lane order; None on a bad escape symbol.
///
/// Inlined, with the bit reader, into the decode loop: a call there costs more than the
/// code (GroupSink). SAFETY: `syms` has 8 symbols and `bits` points at a live reader.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[inline(always)]
unsafe fn escape_group(
    syms: *const u8,
    mut esc: u32,
    bits: *mut BitReader,
    z: [core::arch::wasm32::v128; 2],
) -> Option<[core::arch::wasm32::v128; 2]> {
    use core::arch::wasm32::*;
    let mut a = [0u32; 8];
    v128_store(a.as_mut_ptr() as *mut v128, z[0]);
    v128_store(a.as_mut_ptr().add(4) as *mut v128, z[1]);
    while esc != 0 {
        let i = esc.trailing_zeros() as usize;
        let jj = *syms.add(i) as u32 - DIRECT;
        let k = jj / 2 + DIRECT_BITS;
        if k > MAX_K {
            return None;
        }
        a[i] = (1u32 << k) | ((jj & 1) << (k - 1)) | (*bits).get(k - 1);
        esc &= esc - 1;
    }
    Some([
        v128_load(a.as_ptr() as *const v128),
        v128_load(a.as_ptr().add(4) as *const v128),
    ])
}

#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
impl<'b, const DELTA: bool, const DT: u32> GroupSink for FusedRows<'b, DELTA, DT> {
    #[inline(always)]
    unsafe fn group(&mut self, syms: *const u8) -> bool {
        if self.skip > 0 {
            self.skip -= 1;
            return true;
        }
        self.next(syms)
    }
}

/// Decodes the symbol block of a uniform-step stream with its rows reconstructed in the
/// decode loop (FusedRows), into elements [offset, offset + T×C) of `dst` (DT: bf16 or
/// fp16 without subnormal outputs).
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[allow(clippy::too_many_arguments)]
fn decode_fused<const DELTA: bool, const DT: u32>(
    r: &mut Reader,
    t: usize,
    c: usize,
    base: f32,
    centers: &[i32],
    dmask: &[i32],
    prev: &mut [i32],
    bits: &mut BitReader,
    dst: &mut [u8],
    offset: usize,
    syms: &mut [u8],
    cal: Option<&StreamCal>,
) -> Option<()> {
    let n = t * c;
    if c % 8 != 0
        || centers.len() != c
        || dmask.len() != c
        || prev.len() != c
        || syms.len() < n
        || dst.len() < (offset + n) * 2
    {
        return None;
    }
    let mut sink = FusedRows::<DELTA, DT> {
        c,
        j: 0,
        ch: 0,
        skip: c / 8,
        vs: core::arch::wasm32::f32x4_splat(uniform_step::<DT>(base)),
        centers: centers.as_ptr(),
        dmask: dmask.as_ptr(),
        prev: prev.as_mut_ptr(),
        // SAFETY: offset + n elements of 2 bytes fit in dst (checked above).
        out: unsafe { dst.as_mut_ptr().add(offset * 2) },
        bits: bits as *mut BitReader,
    };
    decode_payload(r, t, c, syms, cal, &mut sink)?;
    // SAFETY: every symbol is decoded now; j < n keeps the group inside syms and out.
    unsafe {
        while sink.j < n {
            if !sink.next(syms.as_ptr()) {
                return None;
            }
        }
    }
    Some(())
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
    cal: Option<&StreamCal>,
) -> Option<()> {
    let StreamHead {
        base,
        flags,
        cal,
        step,
        mt,
        dmask,
        centers,
        extra,
    } = read_head(r, t, c, cal)?;
    let mut bits = BitReader::new(extra);
    let mut prev = centers.clone();
    let any_delta = dmask.iter().any(|&d| d != 0);
    // Streams without channel or token steps (what the encoder writes) decoded to fp16 (no
    // subnormal outputs) or bf16: each row is reconstructed inside the rANS loop while the next
    // row's symbols are decoded (FusedRows). Same arithmetic, same order of escape bits.
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    if let Some(kind) = fused_kind(base, flags, dtype, c) {
        macro_rules! fused {
            ($delta:expr, $dt:expr) => {
                decode_fused::<$delta, $dt>(
                    r, t, c, base, &centers, &dmask, &mut prev, &mut bits, dst, offset, syms, cal,
                )?
            };
        }
        match (any_delta, kind) {
            (true, DT_BF16) => fused!(true, DT_BF16),
            (false, DT_BF16) => fused!(false, DT_BF16),
            (true, _) => fused!(true, DT_F16_NORMAL),
            (false, _) => fused!(false, DT_F16_NORMAL),
        }
        if bits.overrun {
            return None;
        }
        return Some(());
    }
    decode_rows(
        r, t, c, dtype, dst, offset, syms, base, flags, cal, &step, &mt, &dmask, &centers,
        &mut prev, &mut bits, any_delta,
    )
}

/// A stream's header, up to its symbol block.
struct StreamHead<'a, 'k> {
    base: f32,
    flags: u8,
    cal: Option<&'k StreamCal<'k>>,
    step: Vec<f32>,
    mt: Vec<f32>,
    dmask: Vec<i32>,
    centers: Vec<i32>,
    /// The escape bits.
    extra: &'a [u8],
}

/// The fused decode's output kind for a stream with this header (DT_F16_NORMAL or DT_BF16),
/// or None when it takes the two-pass path.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
fn fused_kind(base: f32, flags: u8, dtype: u32, c: usize) -> Option<u32> {
    let uniform = flags & (F_CHSCALE | F_TOKSCALE) == 0;
    let kind = if dtype == DT_F16 && base.abs() >= f32::from_bits((127 - 14) << 23) {
        DT_F16_NORMAL
    } else {
        dtype
    };
    if uniform && c % 8 == 0 && (kind == DT_F16_NORMAL || kind == DT_BF16) {
        Some(kind)
    } else {
        None
    }
}

fn read_head<'a, 'k>(
    r: &mut Reader<'a>,
    t: usize,
    c: usize,
    cal: Option<&'k StreamCal<'k>>,
) -> Option<StreamHead<'a, 'k>> {
    let base = r.f32()?;
    if !base.is_finite() {
        return None;
    }
    let flags = r.u8()?;
    if flags & !(F_CHSCALE | F_TOKSCALE | F_MODES | F_CAL) != 0 {
        return None;
    }
    // A calibrated stream needs its calibration (the caller checked the chunk names it).
    let cal = if flags & F_CAL != 0 { Some(cal?) } else { None };
    let mut step = vec![base; c];
    if flags & F_CHSCALE != 0 {
        for (s, &k) in step.iter_mut().zip(r.take(c)?) {
            *s = base * scale_of(k);
        }
    }
    let mut mt = vec![1f32; t];
    if flags & F_TOKSCALE != 0 {
        for (s, &k) in mt.iter_mut().zip(r.take(t)?) {
            *s = scale_of(k);
        }
    }
    let mut dmask = vec![0i32; c];
    if flags & F_MODES != 0 {
        let m = r.take((c + 7) / 8)?;
        for ch in 0..c {
            if m[ch / 8] & (1 << (ch % 8)) != 0 {
                dmask[ch] = -1;
            }
        }
    }
    let mut centers = vec![0i32; c];
    match cal {
        Some(k) => {
            let order = r.u8()? as u32;
            if order > MAX_EG_ORDER {
                return None;
            }
            let n = r.varint()? as usize;
            let mut br = BitReader::new(r.take(n)?);
            for (ch, ctr) in centers.iter_mut().enumerate() {
                let z = get_eg(&mut br, order)?;
                *ctr = unzigzag(z).wrapping_add(cal_centre(k.means[ch], step[ch]));
            }
            if br.overrun {
                return None;
            }
        }
        None => {
            for ctr in centers.iter_mut() {
                *ctr = unzigzag(r.varint()?);
            }
        }
    }
    let extra = r.block()?;
    Some(StreamHead {
        base,
        flags,
        cal,
        step,
        mt,
        dmask,
        centers,
        extra,
    })
}

/// The two-pass decode of a stream (symbols, then rows) after its header.
#[allow(clippy::too_many_arguments)]
fn decode_rows(
    r: &mut Reader,
    t: usize,
    c: usize,
    dtype: u32,
    dst: &mut [u8],
    offset: usize,
    syms: &mut [u8],
    base: f32,
    flags: u8,
    cal: Option<&StreamCal>,
    step: &[f32],
    mt: &[f32],
    dmask: &[i32],
    centers: &[i32],
    prev: &mut Vec<i32>,
    bits: &mut BitReader,
    any_delta: bool,
) -> Option<()> {
    decode_payload(r, t, c, syms, cal, &mut NoSink)?;
    reconstruct_rows(
        t, c, dtype, dst, offset, syms, base, flags, step, mt, dmask, centers, prev, bits,
        any_delta,
    )
}

/// The rows of a stream from its decoded symbols (the second pass).
#[allow(clippy::too_many_arguments)]
fn reconstruct_rows(
    t: usize,
    c: usize,
    dtype: u32,
    dst: &mut [u8],
    offset: usize,
    syms: &[u8],
    base: f32,
    flags: u8,
    step: &[f32],
    mt: &[f32],
    dmask: &[i32],
    centers: &[i32],
    prev: &mut Vec<i32>,
    bits: &mut BitReader,
    any_delta: bool,
) -> Option<()> {
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    let mut scaled = vec![
        0f32;
        if flags & F_CHSCALE != 0 && flags & F_TOKSCALE != 0 {
            c
        } else {
            0
        }
    ];
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    let mut zrow: Vec<u32> = vec![0; c];
    let ctx = RowCtx {
        step: &step,
        centers: &centers,
        dmask: &dmask,
    };
    // The cheaper fp16 conversion is exact when every nonzero output is ≥ 2^-14
    // (|q| ≥ 1, so the row's smallest step decides) and no step is Inf or NaN.
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    let (min_step, steps_finite) = {
        let mut mn = f32::INFINITY;
        let mut fin = true;
        for &s in step {
            let a = s.abs();
            fin &= a.is_finite();
            if a < mn {
                mn = a;
            }
        }
        (mn, fin && mt.iter().all(|m| m.is_finite()))
    };
    for tt in 0..t {
        let row = &syms[tt * c..(tt + 1) * c];
        let o = offset + tt * c;
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        {
            // Steps for this row: one scalar when there are no channel steps,
            // else per channel (times the token multiplier when there is one).
            let m = mt[tt];
            let uniform = flags & F_CHSCALE == 0;
            let rstep: &[f32] = if uniform || m == 1.0 {
                &step
            } else {
                for (d, &s) in scaled.iter_mut().zip(step.iter()) {
                    *d = s * m;
                }
                &scaled
            };
            let fast16 = dtype == DT_F16
                && steps_finite
                && min_step * m >= f32::from_bits((127 - 14) << 23)
                && (base * m).is_finite();
            let kind = if fast16 { DT_F16_NORMAL } else { dtype };
            // Rows without escapes go straight to the SIMD path. Fine steps on wide rows put
            // escapes (symbols with extra bits, read in row order) in most rows: those rows are
            // first expanded to zigzag residuals (escapes patched in row order), then take the
            // same SIMD path. Rows with a token step multiplier keep the scalar path when they
            // hold an escape: the fast path rounds q·(step·m), the scalar one (q·step)·m, and
            // decoded bits must not depend on where an escape falls.
            let all_direct = simd::row_direct(row);
            if !all_direct && m != 1.0 {
                if !row_scalar(&ctx, row, m, prev, bits, dtype, dst, o) {
                    return None;
                }
                continue;
            }
            let done = if all_direct {
                row_fast_any::<false>(
                    &ctx,
                    rstep,
                    base * m,
                    row,
                    &[],
                    prev,
                    kind,
                    dst,
                    o,
                    any_delta,
                    uniform,
                )
            } else {
                if !row_residuals(row, &mut zrow, bits) {
                    return None;
                }
                row_fast_any::<true>(
                    &ctx,
                    rstep,
                    base * m,
                    &[],
                    &zrow,
                    prev,
                    kind,
                    dst,
                    o,
                    any_delta,
                    uniform,
                )
            };
            // The last c mod 8 channels (and all of a row the SIMD path declined).
            for ch in done..c {
                let z = if all_direct { row[ch] as u32 } else { zrow[ch] };
                let dm = dmask[ch];
                let pred = (prev[ch] & dm) | (centers[ch] & !dm);
                let qv = pred.wrapping_add(unzigzag(z));
                prev[ch] = qv;
                store(dst, o + ch, dtype, qv as f32 * step[ch] * m);
            }
            continue;
        }
        // Only the build without SIMD gets here: the SIMD block above always continues.
        #[allow(unreachable_code)]
        if !row_scalar(&ctx, row, mt[tt], prev, bits, dtype, dst, o) {
            return None;
        }
    }
    if bits.overrun {
        return None;
    }
    Some(())
}

/// A layer's K then V (headers read): both tables, then both symbol blocks in one SIMD loop
/// (rans::decode_symbols_pair: two independent dependency chains), then each stream's rows
/// (the two-pass reconstruction of `decode_stream`). Same arithmetic, same escape-bit order
/// and the same checks per stream as decoding K, then V, with `decode_stream`; any failure
/// rejects the section. (Reconstructing both streams' rows inside the joint loop, as the
/// single-stream path does, made V8 spill: wasm/README.md.)
#[allow(clippy::too_many_arguments)]
fn decode_layer(
    mut rk: Reader,
    hk: StreamHead,
    rv: &mut Reader,
    hv: StreamHead,
    dtype: u32,
    t: usize,
    c: usize,
    dst: &mut [u8],
    syms: &mut [u8],
) -> Option<()> {
    let n = t * c;
    let (kk, cbk, deck) = payload_tables(&mut rk, c, hk.cal)?;
    let (kv, cbv, decv) = payload_tables(rv, c, hv.cal)?;
    let mut syms_v: Vec<u8> = uninit_vec(syms.len());
    decode_symbols_pair(
        t,
        c,
        PairStream {
            r: &mut rk,
            k: kk,
            cbase: &cbk,
            dec: &deck,
            syms: &mut *syms,
        },
        PairStream {
            r: rv,
            k: kv,
            cbase: &cbv,
            dec: &decv,
            syms: &mut syms_v,
        },
    )?;
    if rk.remaining() != 0 {
        return None;
    }
    for (h, sy, off) in [(&hk, &*syms, 0), (&hv, &syms_v[..], n)] {
        let mut bits = BitReader::new(h.extra);
        let mut prev = h.centers.clone();
        let any_delta = h.dmask.iter().any(|&d| d != 0);
        reconstruct_rows(
            t, c, dtype, dst, off, sy, h.base, h.flags, &h.step, &h.mt, &h.dmask, &h.centers,
            &mut prev, &mut bits, any_delta,
        )?;
    }
    Some(())
}

/// K then V (a u32-length-prefixed K stream, then V), or with `planes` 1 an MLA latent
/// alone: one stream, coded with K's parameters and calibration, no prefix.
#[allow(clippy::too_many_arguments)]
pub fn encode(
    x: &mut [f32],
    t: usize,
    c: usize,
    planes: usize,
    pk: &StreamParams,
    pv: &StreamParams,
    cal: Option<(&StreamCal, &StreamCal)>,
    out: &mut Vec<u8>,
) {
    let n = t * c;
    if planes == 1 {
        encode_stream(&mut x[..n], t, c, pk, cal.map(|p| p.0), None, out);
        return;
    }
    let mut ks = Vec::new();
    encode_stream(&mut x[..n], t, c, pk, cal.map(|p| p.0), None, &mut ks);
    put_u32(out, ks.len() as u32);
    out.extend_from_slice(&ks);
    encode_stream(&mut x[n..2 * n], t, c, pv, cal.map(|p| p.1), None, out);
}

/// Per-channel symbol counts of K then V (each c × ALPHABET), or of the latent alone
/// (`planes` 1), as `encode` would code them.
pub fn stats(
    x: &mut [f32],
    t: usize,
    c: usize,
    planes: usize,
    pk: &StreamParams,
    pv: &StreamParams,
    out: &mut [u32],
) {
    let n = t * c;
    let (ok, ov) = out.split_at_mut(c * ALPHABET);
    let mut sink = Vec::new();
    encode_stream(&mut x[..n], t, c, pk, None, Some(ok), &mut sink);
    if planes == 1 {
        return;
    }
    encode_stream(&mut x[n..2 * n], t, c, pv, None, Some(ov), &mut sink);
}

pub fn decode(
    input: &[u8],
    dtype: u32,
    t: usize,
    c: usize,
    planes: usize,
    dst: &mut [u8],
    cal: Option<(&StreamCal, &StreamCal)>,
) -> Option<()> {
    let eb = half::elem_bytes(dtype)?;
    let n = t * c;
    if dst.len() != planes * n * eb {
        return None;
    }
    // decode_block writes every symbol before anything reads one.
    let mut syms: Vec<u8> = uninit_vec(n);
    let mut r = Reader::new(input);
    if planes == 1 {
        decode_stream(&mut r, t, c, dtype, dst, 0, &mut syms, cal.map(|p| p.0))?;
        return if r.remaining() == 0 { Some(()) } else { None };
    }
    let kin = r.block()?;
    let mut rk = Reader::new(kin);
    let mut rv = r.clone();
    let hk = read_head(&mut rk, t, c, cal.map(|p| p.0))?;
    let hv = read_head(&mut rv, t, c, cal.map(|p| p.1))?;
    // Escape-heavy streams (fine steps: ~4.5 escape bits per K symbol at q9, 0.07 at q5) decode
    // faster one at a time in the fused loop, which expands escapes inside it (the row pass
    // after the joint loop lost 12 % at q9): the joint loop takes sections with at most one
    // escape bit per symbol.
    if (hk.extra.len() as u64 + hv.extra.len() as u64) * 8 <= 2 * n as u64 {
        decode_layer(rk, hk, &mut rv, hv, dtype, t, c, dst, &mut syms)?;
        return if rv.remaining() == 0 { Some(()) } else { None };
    }
    let mut rk = Reader::new(kin);
    decode_stream(&mut rk, t, c, dtype, dst, 0, &mut syms, cal.map(|p| p.0))?;
    if rk.remaining() != 0 {
        return None;
    }
    decode_stream(&mut r, t, c, dtype, dst, n, &mut syms, cal.map(|p| p.1))?;
    if r.remaining() != 0 {
        return None;
    }
    Some(())
}
