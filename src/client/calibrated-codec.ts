// The codec calls with a calibration (contracts: encodeChunk's options.calibration;
// decodeChunk / decodeChunkInto / decodeSection take `{ calibration }`), in one
// place for the pool and its workers. Worker messages carry the calibration's bytes;
// each thread opens a hash once and keeps a few.

import { type Calibration, openCalibration } from '../codec/calibration.ts'
import { decodeChunkInto, decodeSection, encodeChunk } from '../codec/node.ts'
import type { ChunkHeader } from '../core/format.ts'
import type { ChunkIdentity } from './chunk-codec.ts'

/** What crosses to a worker: the object's bytes (its hash is re-derived there by openCalibration). */
export interface CalibrationRef {
  hash: string
  bytes: Uint8Array
}

const opened = new Map<string, Calibration>()
const MAX_OPENED = 8

/** The Calibration for a reference: this thread's own, or opened (and validated) now. */
export function openRef(ref: CalibrationRef | Calibration | undefined): Calibration | undefined {
  if (!ref) return undefined
  if ('geometry' in ref) return ref
  let c = opened.get(ref.hash)
  if (!c) {
    c = openCalibration(ref.bytes)
    if (opened.size >= MAX_OPENED) opened.delete(opened.keys().next().value as string)
    opened.set(c.hash, c)
  }
  return c
}

type WithCalibration = { calibration?: Calibration }

export function encodeWith(
  tensor: Uint8Array,
  meta: ChunkIdentity,
  mode: 'raw' | 'lossless' | 'kvgate',
  quality: number | undefined,
  calibration: Calibration | undefined,
): Uint8Array {
  return encodeChunk(tensor, meta, { mode, quality, ...(calibration ? { calibration } : {}) })
}

// Until codec-calib lands the decoders ignore the extra argument (the stand-in calibration
// changes nothing); the lead checks these calls against the merged signatures.
const decodeIntoC = decodeChunkInto as (o: Uint8Array, out: Uint8Array, opts?: WithCalibration) => ChunkHeader
const decodeSectionC = decodeSection as (
  h: ChunkHeader,
  layer: number,
  section: Uint8Array,
  out?: Uint8Array,
  opts?: WithCalibration,
) => Uint8Array

export function decodeIntoWith(
  object: Uint8Array,
  dst: Uint8Array,
  calibration: Calibration | undefined,
): void {
  decodeIntoC(object, dst, calibration ? { calibration } : undefined)
}

export function decodeSectionWith(
  header: ChunkHeader,
  layer: number,
  section: Uint8Array,
  calibration: Calibration | undefined,
  out?: Uint8Array,
): Uint8Array {
  return decodeSectionC(header, layer, section, out, calibration ? { calibration } : undefined)
}
