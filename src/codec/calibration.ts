// STAND-IN (branch calib-store): the contract's calibration API with a trivial
// payload the codec ignores, so the bucket/gateway/client side can be built and
// tested before codec-calib lands. The lead drops this commit at merge in favour
// of codec-calib's src/codec/calibration.ts. Layout (little-endian):
//   0 "KVCL" | 4 u16 version 1 | 6 u8 dtype code | 7 u8 0 | 8 u16 layers | 10 u16 kvHeads
//   | 12 u16 headDim | 14 u16 0 | 16 u32 sample count | 20 32-byte SHA-256 of the samples | 52 u32 CRC-32 of [0, 52)

import { crc32 } from '../core/checksum.ts'
import { CodecError, InvalidArgumentError } from '../core/errors.ts'
import { toHex } from '../core/keys.ts'
import {
  chunkBytes,
  DTYPE_CODES,
  type Dtype,
  dtypeFromCode,
  type KvGeometry,
  validateGeometry,
} from '../core/layout.ts'

export interface Calibration {
  /** SHA-256 hex of `bytes`. */
  readonly hash: string
  readonly bytes: Uint8Array
  readonly geometry: KvGeometry
  readonly dtype: Dtype
}

/** A chunk names a calibration that was not given (or another one was). */
export class CalibrationMissingError extends CodecError {
  readonly hash: string
  constructor(hash: string, message = `chunk needs calibration ${hash}`) {
    super(message)
    this.hash = hash
    this.name = 'CalibrationMissingError'
  }
}

const MAGIC = 0x4c43564b // "KVCL" little-endian
const BYTES = 56

type NodeCrypto = { createHash(alg: string): { update(b: Uint8Array): unknown; digest(): Uint8Array } }
function sha256(parts: readonly Uint8Array[]): Uint8Array {
  const proc = (globalThis as { process?: { getBuiltinModule?: (id: string) => unknown } }).process
  const c = proc?.getBuiltinModule?.('node:crypto') as NodeCrypto | undefined
  if (!c) throw new CodecError('the stand-in calibration needs node:crypto')
  const h = c.createHash('sha256')
  for (const p of parts) h.update(p)
  return new Uint8Array(h.digest())
}

export function buildCalibration(
  samples: Uint8Array[],
  meta: { geometry: KvGeometry; dtype: Dtype },
): Uint8Array {
  const g = validateGeometry(meta.geometry)
  if (!Array.isArray(samples) || samples.length === 0) throw new InvalidArgumentError('no samples')
  for (const s of samples) {
    if (!(s instanceof Uint8Array) || s.byteLength % chunkBytes(g, 1) !== 0)
      throw new InvalidArgumentError('a sample is not a whole number of tokens of this geometry')
  }
  const out = new Uint8Array(BYTES)
  const dv = new DataView(out.buffer)
  dv.setUint32(0, MAGIC, true)
  dv.setUint16(4, 1, true)
  out[6] = DTYPE_CODES[meta.dtype]
  dv.setUint16(8, g.layers, true)
  dv.setUint16(10, g.kvHeads, true)
  dv.setUint16(12, g.headDim, true)
  dv.setUint32(16, samples.length, true)
  out.set(sha256(samples), 20)
  dv.setUint32(52, crc32(out.subarray(0, 52)), true)
  return out
}

export function openCalibration(bytes: Uint8Array): Calibration {
  if (!(bytes instanceof Uint8Array) || bytes.byteLength !== BYTES)
    throw new CodecError('calibration object has the wrong length')
  const dv = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength)
  if (dv.getUint32(0, true) !== MAGIC) throw new CodecError('not a calibration object (bad magic)')
  if (dv.getUint16(4, true) !== 1) throw new CodecError('unknown calibration version')
  if (crc32(bytes.subarray(0, 52)) !== dv.getUint32(52, true))
    throw new CodecError('calibration checksum mismatch')
  const dtype = dtypeFromCode(bytes[6]!)
  if (dtype === undefined || bytes[7] !== 0 || dv.getUint16(14, true) !== 0)
    throw new CodecError('calibration header fields are invalid')
  let geometry: KvGeometry
  try {
    geometry = validateGeometry({
      layers: dv.getUint16(8, true),
      kvHeads: dv.getUint16(10, true),
      headDim: dv.getUint16(12, true),
      dtype,
    })
  } catch (e) {
    throw new CodecError(`calibration geometry: ${(e as Error).message}`)
  }
  const copy = bytes.slice()
  return { hash: toHex(sha256([copy])), bytes: copy, geometry, dtype }
}
