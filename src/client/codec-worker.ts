// Worker thread of the client's codec pool: runs wasm encode/decode off the
// inference thread. Inputs arrive in the pool's shared staging buffers (see codec-staging.ts);
// decoded tensors go back the same way, encoded objects as transferred ArrayBuffers; errors as strings.

import { parentPort } from 'node:worker_threads'
import { buildCalibration } from '../codec/calibration.ts'
import { crc32 } from '../core/checksum.ts'
import { type ErrorCode, isKvgateError, provesCorrupt } from '../core/errors.ts'
import { type ChunkHeader, checkSectionCrcs } from '../core/format.ts'
import type { KvGeometry } from '../core/layout.ts'
import {
  type CalibrationRef,
  decodeIntoWith,
  decodeSectionWith,
  encodeWith,
  openRef,
} from './calibrated-codec.ts'
import type { ChunkIdentity } from './chunk-codec.ts'

export type CodecRequest =
  | {
      id: number
      op: 'encode'
      mode: 'lossless' | 'kvgate'
      quality: number | undefined
      tensor: Uint8Array
      meta: ChunkIdentity
      calibration?: CalibrationRef | undefined
    }
  /** Verifies and decodes a whole object into `out` (shared memory: the reply carries no bytes). */
  | {
      id: number
      op: 'decode'
      object: Uint8Array
      out: Uint8Array
      calibration?: CalibrationRef | undefined
    }
  /** Decodes the sections of layers first, first + 1, … (one after another in `sections`) into `out`, slab after slab. */
  | {
      id: number
      op: 'layers'
      header: ChunkHeader
      first: number
      sections: Uint8Array
      lengths: number[]
      /**
       * The header's CRC-32 of each section, when they were not checked before the job: every
       * one is checked here before any is decoded (ERR_FORMAT_CHECKSUM, a verdict on the bytes).
       */
      crcs?: number[] | undefined
      out: Uint8Array
      calibration?: CalibrationRef | undefined
    }
  /** Builds a calibration object from chunk tensors (the policy's samples, transferred). */
  | { id: number; op: 'calibrate'; samples: ArrayBuffer[]; geometry: KvGeometry }
  /** CRC-32 of ranges [offset, length, offset, length, …] of `data`; the reply packs them as u32. */
  | { id: number; op: 'crc'; data: Uint8Array; ranges: number[] }

export type CodecReply =
  /** `bytes`: the result, transferred; null when it was written into the request's `out`. */
  | { id: number; bytes: ArrayBuffer | null }
  /**
   * The job failed. `corrupt`: the codec proved the bytes bad (a FormatError or a
   * CorruptStreamError, with its `code`); otherwise (a trap, out of memory) nothing is known of them.
   */
  | { id: number; error: string; code?: ErrorCode | undefined; corrupt?: boolean }
  /** Sent once the module loaded: the pool hands jobs only to workers that got this far. */
  | { ready: true }

function own(b: Uint8Array): ArrayBuffer {
  return b.byteOffset === 0 && b.byteLength === b.buffer.byteLength
    ? (b.buffer as ArrayBuffer)
    : (b.slice().buffer as ArrayBuffer)
}

function run(m: CodecRequest): Uint8Array | null {
  switch (m.op) {
    case 'encode':
      return encodeWith(m.tensor, m.meta, m.mode, m.quality, openRef(m.calibration))
    case 'decode':
      decodeIntoWith(m.object, m.out, openRef(m.calibration))
      return null
    case 'calibrate':
      return buildCalibration(
        m.samples.map((b) => new Uint8Array(b)),
        { geometry: m.geometry, dtype: m.geometry.dtype },
      )
    case 'layers': {
      const slab = m.out.byteLength / m.lengths.length
      if (m.crcs) checkSectionCrcs(m.sections, m.lengths, m.crcs, m.first)
      const calibration = openRef(m.calibration)
      let at = 0
      m.lengths.forEach((n, i) => {
        const section = m.sections.subarray(at, at + n)
        decodeSectionWith(
          m.header,
          m.first + i,
          section,
          calibration,
          m.out.subarray(i * slab, (i + 1) * slab),
        )
        at += n
      })
      return null
    }
    case 'crc': {
      const crcs = new Uint32Array(m.ranges.length / 2)
      for (let i = 0; i < crcs.length; i++) {
        const off = m.ranges[2 * i]!
        crcs[i] = crc32(m.data.subarray(off, off + m.ranges[2 * i + 1]!))
      }
      return new Uint8Array(crcs.buffer)
    }
  }
}

parentPort?.on('message', (m: CodecRequest) => {
  try {
    const out = run(m)
    const bytes = out && own(out)
    parentPort!.postMessage({ id: m.id, bytes } satisfies CodecReply, bytes ? [bytes] : [])
  } catch (e) {
    // Errors cross as strings: the verdict on the bytes goes with them, or a trap (out of
    // memory) would read as a corrupt stream on the calling thread and delete a good file.
    parentPort!.postMessage({
      id: m.id,
      error: (e as Error).message,
      code: isKvgateError(e) ? e.code : undefined,
      corrupt: provesCorrupt(e),
    } satisfies CodecReply)
  }
})

parentPort?.postMessage({ ready: true } satisfies CodecReply)
