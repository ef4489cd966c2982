// The one place that touches the wasm codec's raw exports and pointers. It
// copies bytes in and out, frees in `finally`, rebuilds memory views on every
// call (memory.grow detaches them) and replaces the instance after a trap.

import { CodecError, CorruptStreamError } from '../core/errors.ts'
import { dtypeBytes, dtypeFromCode } from '../core/layout.ts'

interface CodecExports {
  memory: WebAssembly.Memory
  kv_version(): number
  kv_alloc(n: number): number
  kv_free(p: number, n: number): void
  kv_result_ptr(): number
  kv_result_clear(): void
  kv_encode(mode: number, src: number, dtype: number, t: number, c: number, params: number): number
  kv_decode(mode: number, src: number, len: number, dtype: number, t: number, c: number, dst: number): number
  kv_encode_cal(
    src: number,
    dtype: number,
    t: number,
    c: number,
    params: number,
    cal: number,
    calLen: number,
  ): number
  kv_decode_cal(
    src: number,
    len: number,
    dtype: number,
    t: number,
    c: number,
    dst: number,
    cal: number,
    calLen: number,
  ): number
  kv_stats(src: number, dtype: number, t: number, c: number, params: number): number
  kv_cal_check(cal: number, calLen: number, c: number): number
  kv_alphabet(): number
  /** Rate-distortion rounding's λ for the encodes that follow (0: nearest); builds before it lack it. */
  kv_set_rd_lambda?(lambda: number): void
}

/** Section encodings implemented in wasm (numbers are the crate's MODE_* constants). */
export const WASM_MODES = { lossless: 1, kvgate: 2, q8: 4 } as const
export type WasmMode = keyof typeof WASM_MODES

/**
 * OR-ed into a dtype code: the slab is one t×c plane, an MLA latent `[token][latent]`,
 * instead of K then V (each mode codes it as it codes K alone; wasm/src/lib.rs).
 */
export const WASM_LATENT = 0x100
/** kv_decode's answer for a section it refuses (wasm/src/lib.rs ERR_CORRUPT); ERR_ARGS is -1. */
const WASM_ERR_CORRUPT = -2

/** The crate version this wrapper speaks; the chunk header carries it as codecVersion. */
export const WASM_CODEC_VERSION = 1

/** Largest layer slab handed to wasm at once (keeps memory.grow bounded). */
export const MAX_WASM_SLAB_BYTES = 512 * 1024 * 1024

const EXPORTS = [
  'memory',
  'kv_version',
  'kv_alloc',
  'kv_free',
  'kv_result_ptr',
  'kv_result_clear',
  'kv_encode',
  'kv_decode',
] as const
/** Calibration entry points: checked when first used, so a module without them still codes v1. */
const CALIBRATION_EXPORTS = [
  'kv_encode_cal',
  'kv_decode_cal',
  'kv_stats',
  'kv_cal_check',
  'kv_alphabet',
] as const

/**
 * Bytes of the layer slab wasm reads (encode) or writes (decode) for these arguments: it
 * takes the buffer's length from them, not from the buffer, so a buffer of another length
 * would be read or written past its end, inside the instance's heap.
 */
function slabBytes(dtypeCode: number, t: number, c: number, given: number): number {
  const dtype = dtypeFromCode(dtypeCode & 0xff)
  const ok =
    dtype !== undefined &&
    (dtypeCode & ~(0xff | WASM_LATENT)) === 0 &&
    [t, c].every((x) => Number.isInteger(x) && x >= 1 && x <= 0xffffffff)
  const n = ok ? ((dtypeCode & WASM_LATENT) !== 0 ? 1 : 2) * t * c * dtypeBytes(dtype) : Number.NaN
  if (n !== given)
    throw new CodecError(
      `layer slab of ${given} bytes does not hold ${t} tokens × ${c} channels of dtype code ${dtypeCode}`,
    )
  return n
}

/**
 * A layer calibration blob codes kvgate sections only, and is never empty: the calibrated
 * entry points take no mode (they code kvgate whatever the caller asked for), and an empty
 * blob would silently select the uncalibrated ones.
 */
function checkCalibrationMode(mode: WasmMode, cal: Uint8Array | undefined): void {
  if (cal !== undefined && (mode !== 'kvgate' || cal.byteLength === 0))
    throw new CodecError(
      `a calibration codes non-empty kvgate sections only, not ${mode} (${cal.byteLength} bytes)`,
    )
}

function requireCalibration(ex: CodecExports): CodecExports {
  for (const name of CALIBRATION_EXPORTS) {
    if (typeof (ex as unknown as Record<string, unknown>)[name] !== 'function')
      throw new CodecError(`wasm module lacks export '${name}': this codec build cannot use calibrations`)
  }
  return ex
}

function instantiate(module: WebAssembly.Module): CodecExports {
  const inst = new WebAssembly.Instance(module, {})
  const ex = inst.exports as Record<string, unknown>
  for (const name of EXPORTS) {
    if (!(name in ex)) throw new CodecError(`wasm module lacks export '${name}': not the kvgate codec`)
  }
  const exports = ex as unknown as CodecExports
  const v = exports.kv_version()
  if (v !== WASM_CODEC_VERSION) {
    throw new CodecError(`wasm codec version ${v}, wrapper expects ${WASM_CODEC_VERSION}`, {
      code: 'ERR_CODEC_MISMATCH',
    })
  }
  return exports
}

/** Layer-section encoder/decoder over one wasm instance (recreated after a trap). */
export class WasmCodec {
  readonly #module: WebAssembly.Module
  #ex: CodecExports

  constructor(module: WebAssembly.Module) {
    this.#module = module
    this.#ex = instantiate(module)
  }

  /** Bytes of linear memory right now (tests watch it stay bounded). */
  get memoryBytes(): number {
    return this.#ex.memory.buffer.byteLength
  }

  /** Runs `fn` against the current instance; a trap discards the instance. */
  #guard<T>(what: string, fn: (ex: CodecExports) => T): T {
    const ex = this.#ex
    try {
      return fn(ex)
    } catch (e) {
      if (e instanceof WebAssembly.RuntimeError || e instanceof RangeError) {
        // The instance's state is unknown after a trap: start from a fresh one.
        this.#ex = instantiate(this.#module)
        throw new CodecError(`codec ${what} failed inside wasm: ${(e as Error).message}`, { cause: e })
      }
      throw e
    }
  }

  #alloc(ex: CodecExports, n: number): number {
    const p = ex.kv_alloc(n)
    if (p === 0) throw new CodecError(`wasm allocation of ${n} bytes failed`)
    return p
  }

  /**
   * Encodes one layer slab (K then V, `t`×`c` elements each; one plane with `dtypeCode | WASM_LATENT`).
   * `rdLambda` > 0 (kvgate): rate-distortion rounding with that λ (params.ts RD_LAMBDA).
   */
  encodeSection(
    mode: WasmMode,
    slab: Uint8Array,
    dtypeCode: number,
    t: number,
    c: number,
    params?: Float32Array,
    cal?: Uint8Array,
    rdLambda = 0,
  ): Uint8Array {
    slabBytes(dtypeCode, t, c, slab.byteLength)
    checkCalibrationMode(mode, cal)
    return this.#run(slab, params, cal, 'encode', (ex, src, par, calp, calLen) => {
      const setRd = ex.kv_set_rd_lambda
      if (rdLambda > 0 && typeof setRd !== 'function')
        throw new CodecError(
          "wasm module lacks export 'kv_set_rd_lambda': this codec build cannot round for rate",
        )
      // Set around this one call only: the next encode (any caller) starts at nearest rounding.
      setRd?.(rdLambda)
      try {
        return calLen > 0
          ? requireCalibration(ex).kv_encode_cal(src, dtypeCode, t, c, par, calp, calLen)
          : ex.kv_encode(WASM_MODES[mode], src, dtypeCode, t, c, par)
      } finally {
        setRd?.(0)
      }
    })
  }

  /**
   * Per-channel symbol counts of a layer slab coded with kvgate `params`: K then V,
   * c × alphabet each (the latent alone with WASM_LATENT; calibration builds).
   */
  symbolCounts(slab: Uint8Array, dtypeCode: number, t: number, c: number, params: Float32Array): Uint32Array {
    slabBytes(dtypeCode, t, c, slab.byteLength)
    const b = this.#run(slab, params, undefined, 'stats', (ex, src, par) =>
      requireCalibration(ex).kv_stats(src, dtypeCode, t, c, par),
    )
    return new Uint32Array(b.buffer, b.byteOffset, b.byteLength / 4)
  }

  /** Symbols of the kvgate lossy alphabet. */
  get alphabet(): number {
    return requireCalibration(this.#ex).kv_alphabet()
  }

  /** True when `cal` is a well-formed layer calibration blob for `c` channels. */
  checkLayerCalibration(cal: Uint8Array, c: number): boolean {
    return this.#guard('calibration check', (ex) => {
      let p = 0
      try {
        p = this.#alloc(ex, cal.byteLength)
        new Uint8Array(ex.memory.buffer, p, cal.byteLength).set(cal)
        return requireCalibration(ex).kv_cal_check(p, cal.byteLength, c) === 0
      } finally {
        if (this.#ex === ex && p) ex.kv_free(p, cal.byteLength)
      }
    })
  }

  /** Copies slab, params and calibration in, runs `call`, returns a copy of the result buffer. */
  #run(
    slab: Uint8Array,
    params: Float32Array | undefined,
    cal: Uint8Array | undefined,
    what: string,
    call: (ex: CodecExports, src: number, par: number, cal: number, calLen: number) => number,
  ): Uint8Array {
    if (slab.byteLength > MAX_WASM_SLAB_BYTES)
      throw new CodecError(`layer slab of ${slab.byteLength} bytes is too large`)
    const calLen = cal?.byteLength ?? 0
    return this.#guard(what, (ex) => {
      let src = 0
      let par = 0
      let calp = 0
      try {
        src = this.#alloc(ex, slab.byteLength)
        par = this.#alloc(ex, 32)
        if (cal && calLen > 0) {
          calp = this.#alloc(ex, calLen)
          new Uint8Array(ex.memory.buffer, calp, calLen).set(cal)
        }
        new Uint8Array(ex.memory.buffer, src, slab.byteLength).set(slab)
        const pv = new Float32Array(8)
        if (params) pv.set(params.subarray(0, 8))
        new Uint8Array(ex.memory.buffer, par, 32).set(new Uint8Array(pv.buffer))
        const n = call(ex, src, par, calp, calLen)
        if (n < 0) throw new CodecError(`wasm ${what} rejected its arguments (${n})`)
        const out = new Uint8Array(ex.memory.buffer, ex.kv_result_ptr(), n).slice()
        ex.kv_result_clear()
        return out
      } finally {
        if (this.#ex === ex) {
          if (src) ex.kv_free(src, slab.byteLength)
          if (par) ex.kv_free(par, 32)
          if (calp) ex.kv_free(calp, calLen)
        }
      }
    })
  }

  /**
   * Decodes one section into `out` (the layer slab, 2·t·c elements of the dtype; t·c with WASM_LATENT).
   * Throws CorruptStreamError for a corrupt section (the instance stays usable); a trap, a failed
   * allocation (out of memory) or arguments wasm refuses are a plain CodecError: nothing is
   * known about the section then.
   */
  decodeSection(
    mode: WasmMode,
    section: Uint8Array,
    dtypeCode: number,
    t: number,
    c: number,
    out: Uint8Array,
    cal?: Uint8Array,
  ): void {
    if (out.byteLength > MAX_WASM_SLAB_BYTES)
      throw new CodecError(`layer slab of ${out.byteLength} bytes is too large`)
    slabBytes(dtypeCode, t, c, out.byteLength)
    checkCalibrationMode(mode, cal)
    const calLen = cal?.byteLength ?? 0
    this.#guard('decode', (ex) => {
      let src = 0
      let dst = 0
      let calp = 0
      try {
        src = this.#alloc(ex, section.byteLength)
        dst = this.#alloc(ex, out.byteLength)
        if (cal && calLen > 0) {
          calp = this.#alloc(ex, calLen)
          new Uint8Array(ex.memory.buffer, calp, calLen).set(cal)
        }
        new Uint8Array(ex.memory.buffer, src, section.byteLength).set(section)
        const rc =
          calLen > 0
            ? requireCalibration(ex).kv_decode_cal(
                src,
                section.byteLength,
                dtypeCode,
                t,
                c,
                dst,
                calp,
                calLen,
              )
            : ex.kv_decode(WASM_MODES[mode], src, section.byteLength, dtypeCode, t, c, dst)
        // ERR_ARGS (-1): this call's arguments (a mode the dtype has no float conversion for),
        // no verdict on the section: only ERR_CORRUPT (-2) is.
        if (rc === WASM_ERR_CORRUPT)
          throw new CorruptStreamError(`corrupt ${mode} section (wasm decode returned ${rc})`)
        if (rc !== 0)
          throw new CodecError(`wasm decode refused its arguments (${rc}): ${mode}, dtype code ${dtypeCode}`)
        out.set(new Uint8Array(ex.memory.buffer, dst, out.byteLength))
      } finally {
        if (this.#ex === ex) {
          if (src) ex.kv_free(src, section.byteLength)
          if (dst) ex.kv_free(dst, out.byteLength)
          if (calp) ex.kv_free(calp, calLen)
        }
      }
    })
  }
}
