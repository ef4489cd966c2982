//! kvgate KV codec, compiled to wasm32-unknown-unknown with raw `extern "C"`
//! exports and no imports. One call codes one layer section (K then V).
//!
//! ABI (all sizes in bytes, pointers into this module's memory):
//! - `kv_alloc(n) -> ptr`, `kv_free(ptr, n)`: buffers owned by the caller.
//! - `kv_encode(mode, src, dtype, t, c, params) -> len | <0`: encodes the layer
//!   slab at `src` (2·t·c elements of `dtype`); the result stays in an internal
//!   buffer read with `kv_result_ptr()` until the next encode or `kv_result_clear()`.
//! - `kv_decode(mode, src, len, dtype, t, c, dst) -> 0 | <0`: decodes a section
//!   into the slab at `dst` (2·t·c elements). Hostile input returns an error code;
//!   it never reads or writes outside the given buffers.
//! - `kv_encode_cal` / `kv_decode_cal`: kvgate mode against one layer's calibration
//!   blob (`cal`, `cal_len`; see `lossy::parse_layer_cal`); `kv_cal_check(cal, cal_len, c)`
//!   validates a blob; `kv_stats` leaves per-channel symbol counts (u32, K then V,
//!   c × `kv_alphabet()` each) in the result buffer, for building calibrations.
//! - `kv_set_rd_lambda(λ)`: rate-distortion rounding for the kvgate encodes that follow
//!   (`lossy::rd_round`; 0, the default: nearest rounding). Decoding is unaffected.
//! - `dtype | LATENT` (every entry point that takes a dtype): the slab is one t·c
//!   plane, an MLA latent `[token][latent]`, instead of K then V. Each mode codes it as
//!   it codes K alone (lossless: its byte planes; q8: its rows; kvgate: one stream with
//!   K's parameters and K's calibration); `kv_stats` then leaves c × `kv_alphabet()` counts.

pub mod bytes;
pub mod half;
pub mod lossless;
pub mod lossy;
pub mod q8;
pub mod rans;

use std::cell::{Cell, RefCell};

pub const MODE_LOSSLESS: u32 = 1;
pub const MODE_KVGATE: u32 = 2;
pub const MODE_Q8: u32 = 4;

/// OR-ed into a dtype code: the slab is one t·c plane (MLA latent), not K then V.
pub const LATENT: u32 = 0x100;

pub const ERR_ARGS: i32 = -1;
pub const ERR_CORRUPT: i32 = -2;

/// Codec version; bump whenever the section format changes.
pub const VERSION: u32 = 1;

thread_local! {
    static RESULT: RefCell<Vec<u8>> = RefCell::new(Vec::new());
    static RD_LAMBDA: Cell<f32> = Cell::new(0.0);
}

#[no_mangle]
pub extern "C" fn kv_version() -> u32 {
    VERSION
}

#[no_mangle]
pub extern "C" fn kv_alloc(n: usize) -> *mut u8 {
    let mut v: Vec<u8> = Vec::with_capacity(n.max(1));
    let p = v.as_mut_ptr();
    std::mem::forget(v);
    p
}

/// # Safety
/// `p` must come from `kv_alloc(n)` with the same `n`.
#[no_mangle]
pub unsafe extern "C" fn kv_free(p: *mut u8, n: usize) {
    if !p.is_null() {
        drop(Vec::from_raw_parts(p, 0, n.max(1)));
    }
}

/// Sets the λ of rate-distortion rounding (lossy::rd_round, squared steps per bit) for the
/// kvgate encodes that follow; 0 (the default), negative or non-finite: nearest rounding.
/// A separate call, not a ninth f32 of `params`, so that callers written for 8 keep coding
/// exactly as before; the TypeScript wrapper sets it around each encode and clears it.
#[no_mangle]
pub extern "C" fn kv_set_rd_lambda(lambda: f32) {
    let l = if lambda.is_finite() && lambda > 0.0 {
        lambda
    } else {
        0.0
    };
    RD_LAMBDA.with(|c| c.set(l));
}

#[no_mangle]
pub extern "C" fn kv_result_ptr() -> *const u8 {
    RESULT.with(|r| r.borrow().as_ptr())
}

#[no_mangle]
pub extern "C" fn kv_result_clear() {
    RESULT.with(|r| *r.borrow_mut() = Vec::new());
}

/// The element dtype and the planes (1 latent, 2 K and V) a dtype argument names.
fn split_dtype(dtype: u32) -> Option<(u32, usize)> {
    match dtype & !0xff {
        0 => Some((dtype, 2)),
        LATENT => Some((dtype & 0xff, 1)),
        _ => None,
    }
}

fn slab_elems(t: u32, c: u32, planes: usize) -> Option<usize> {
    (t as usize).checked_mul(c as usize)?.checked_mul(planes)
}

fn stream_params(p: &[f32], rd_lambda: f32) -> Option<(lossy::StreamParams, lossy::StreamParams)> {
    let pk = lossy::StreamParams {
        eps: p[0],
        gamma_c: p[2],
        gamma_t: 0.0,
        delta: p[4] != 0.0,
        max_classes: p[5] as usize,
        levels_c: p[6],
        levels_t: 0.0,
        rd_lambda,
    };
    let pv = lossy::StreamParams {
        eps: p[1],
        gamma_c: 0.0,
        gamma_t: p[3],
        delta: false,
        max_classes: p[5] as usize,
        levels_c: 0.0,
        levels_t: p[7],
        rd_lambda,
    };
    if !((pk.eps != 0.0 || pk.levels_c > 0.0) && (pv.eps > 0.0 || pv.levels_t != 0.0)) {
        return None;
    }
    Some((pk, pv))
}

/// Encodes one layer slab. `params` points at 8 f32 (kvgate mode only):
/// [epsK, epsV, gammaK, gammaV, deltaK, maxClasses, levelsK, levelsV]. With
/// levelsK > 0, K steps are per channel (range / levelsK); with levelsV > 0, V
/// steps are per token (2·max|v| / levelsV); with levelsV < 0, one V step, the
/// mean over tokens of 2·max|v| / |levelsV|; otherwise eps·√12·rms (scaled by gamma;
/// epsK < 0: |epsK|·√12·the channel-centred rms, one step for every channel). Uniform-step
/// streams use rate-distortion rounding when `kv_set_rd_lambda` set a λ.
///
/// # Safety
/// `src` must hold 2·t·c elements of `dtype`; `params` 8 f32 (kvgate mode).
#[no_mangle]
pub unsafe extern "C" fn kv_encode(
    mode: u32,
    src: *const u8,
    dtype: u32,
    t: u32,
    c: u32,
    params: *const f32,
) -> i32 {
    encode_with(mode, src, dtype, t, c, params, &[])
}

/// `kv_encode` in kvgate mode against a layer's calibration blob.
///
/// # Safety
/// As `kv_encode`; `cal` must hold `cal_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kv_encode_cal(
    src: *const u8,
    dtype: u32,
    t: u32,
    c: u32,
    params: *const f32,
    cal: *const u8,
    cal_len: u32,
) -> i32 {
    if cal_len == 0 {
        return ERR_ARGS;
    }
    let blob = std::slice::from_raw_parts(cal, cal_len as usize);
    encode_with(MODE_KVGATE, src, dtype, t, c, params, blob)
}

unsafe fn encode_with(
    mode: u32,
    src: *const u8,
    dtype: u32,
    t: u32,
    c: u32,
    params: *const f32,
    blob: &[u8],
) -> i32 {
    let (dtype, planes) = match split_dtype(dtype) {
        Some(d) => d,
        None => return ERR_ARGS,
    };
    let eb = match half::elem_bytes(dtype) {
        Some(e) => e,
        None => return ERR_ARGS,
    };
    let n = match slab_elems(t, c, planes) {
        Some(n) if n > 0 => n,
        _ => return ERR_ARGS,
    };
    let (t, c) = (t as usize, c as usize);
    let input = std::slice::from_raw_parts(src, n * eb);
    let mut out = Vec::with_capacity(n * eb / 3 + 64);
    match mode {
        MODE_LOSSLESS => lossless::encode(input, eb, t, c, planes, &mut out),
        MODE_KVGATE | MODE_Q8 => {
            if !half::has_float_conversion(dtype) {
                return ERR_ARGS; // fp8 is stored byte-exact (raw or lossless), never re-quantised
            }
            let cal = if blob.is_empty() {
                None
            } else {
                match lossy::parse_layer_cal(blob, c) {
                    Some(p) => Some(p),
                    None => return ERR_ARGS,
                }
            };
            let mut x: Vec<f32> = rans::uninit_vec(n);
            half::load(input, dtype, &mut x);
            if mode == MODE_Q8 {
                q8::encode(&x, t, c, planes, &mut out);
            } else {
                let rd = RD_LAMBDA.with(|l| l.get());
                let (pk, pv) = match stream_params(std::slice::from_raw_parts(params, 8), rd) {
                    Some(p) => p,
                    None => return ERR_ARGS,
                };
                lossy::encode(
                    &mut x,
                    t,
                    c,
                    planes,
                    &pk,
                    &pv,
                    cal.as_ref().map(|(k, v)| (k, v)),
                    &mut out,
                );
            }
        }
        _ => return ERR_ARGS,
    }
    if out.len() > i32::MAX as usize {
        return ERR_ARGS;
    }
    let len = out.len() as i32;
    RESULT.with(|r| *r.borrow_mut() = out);
    len
}

/// Symbols of the lossy alphabet (the stride of `kv_stats`' counts).
#[no_mangle]
pub extern "C" fn kv_alphabet() -> u32 {
    lossy::ALPHABET as u32
}

/// Per-channel symbol counts of a layer slab coded with `params` (kvgate mode):
/// 2·c·ALPHABET u32 (K then V) in the result buffer; returns its length in bytes.
///
/// # Safety
/// As `kv_encode`.
#[no_mangle]
pub unsafe extern "C" fn kv_stats(
    src: *const u8,
    dtype: u32,
    t: u32,
    c: u32,
    params: *const f32,
) -> i32 {
    let (dtype, planes) = match split_dtype(dtype) {
        Some(d) => d,
        None => return ERR_ARGS,
    };
    let eb = match half::elem_bytes(dtype) {
        Some(e) => e,
        None => return ERR_ARGS,
    };
    if !half::has_float_conversion(dtype) {
        return ERR_ARGS; // statistics are of float values; fp8 is never coded lossy
    }
    let n = match slab_elems(t, c, planes) {
        Some(n) if n > 0 => n,
        _ => return ERR_ARGS,
    };
    let (t, c) = (t as usize, c as usize);
    let (pk, pv) = match stream_params(std::slice::from_raw_parts(params, 8), 0.0) {
        Some(p) => p,
        None => return ERR_ARGS,
    };
    let input = std::slice::from_raw_parts(src, n * eb);
    let mut x: Vec<f32> = rans::uninit_vec(n);
    half::load(input, dtype, &mut x);
    let mut counts = vec![0u32; planes * c * lossy::ALPHABET];
    lossy::stats(&mut x, t, c, planes, &pk, &pv, &mut counts);
    let mut out = Vec::with_capacity(counts.len() * 4);
    for v in counts {
        out.extend_from_slice(&v.to_le_bytes());
    }
    if out.len() > i32::MAX as usize {
        return ERR_ARGS;
    }
    let len = out.len() as i32;
    RESULT.with(|r| *r.borrow_mut() = out);
    len
}

/// 0 when `cal` is a well-formed layer calibration blob for `c` channels, else < 0.
///
/// # Safety
/// `cal` must hold `cal_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kv_cal_check(cal: *const u8, cal_len: u32, c: u32) -> i32 {
    let blob = std::slice::from_raw_parts(cal, cal_len as usize);
    match lossy::check_layer_cal(blob, c as usize) {
        Some(()) => 0,
        None => ERR_CORRUPT,
    }
}

/// Decodes one section into the slab at `dst` (2·t·c elements of `dtype`).
///
/// # Safety
/// `src` must hold `len` bytes and `dst` 2·t·c elements of `dtype`.
#[no_mangle]
pub unsafe extern "C" fn kv_decode(
    mode: u32,
    src: *const u8,
    len: u32,
    dtype: u32,
    t: u32,
    c: u32,
    dst: *mut u8,
) -> i32 {
    decode_with(mode, src, len, dtype, t, c, dst, &[])
}

/// `kv_decode` in kvgate mode against a layer's calibration blob.
///
/// # Safety
/// As `kv_decode`; `cal` must hold `cal_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kv_decode_cal(
    src: *const u8,
    len: u32,
    dtype: u32,
    t: u32,
    c: u32,
    dst: *mut u8,
    cal: *const u8,
    cal_len: u32,
) -> i32 {
    if cal_len == 0 {
        return ERR_ARGS;
    }
    let blob = std::slice::from_raw_parts(cal, cal_len as usize);
    decode_with(MODE_KVGATE, src, len, dtype, t, c, dst, blob)
}

#[allow(clippy::too_many_arguments)]
unsafe fn decode_with(
    mode: u32,
    src: *const u8,
    len: u32,
    dtype: u32,
    t: u32,
    c: u32,
    dst: *mut u8,
    blob: &[u8],
) -> i32 {
    let (dtype, planes) = match split_dtype(dtype) {
        Some(d) => d,
        None => return ERR_ARGS,
    };
    let eb = match half::elem_bytes(dtype) {
        Some(e) => e,
        None => return ERR_ARGS,
    };
    let n = match slab_elems(t, c, planes) {
        Some(n) if n > 0 => n,
        _ => return ERR_ARGS,
    };
    let (tu, cu) = (t as usize, c as usize);
    let input = std::slice::from_raw_parts(src, len as usize);
    let out = std::slice::from_raw_parts_mut(dst, n * eb);
    if mode != MODE_LOSSLESS && !half::has_float_conversion(dtype) {
        return ERR_ARGS;
    }
    let ok = match mode {
        MODE_LOSSLESS => lossless::decode(input, eb, tu, cu, planes, out),
        MODE_KVGATE => {
            if blob.is_empty() {
                lossy::decode(input, dtype, tu, cu, planes, out, None)
            } else {
                match lossy::parse_layer_cal(blob, cu) {
                    Some((k, v)) => {
                        lossy::decode(input, dtype, tu, cu, planes, out, Some((&k, &v)))
                    }
                    None => return ERR_CORRUPT,
                }
            }
        }
        MODE_Q8 => q8::decode(input, dtype, tu, cu, planes, out),
        _ => return ERR_ARGS,
    };
    match ok {
        Some(()) => 0,
        None => ERR_CORRUPT,
    }
}
