// Worker thread of the client's codec pool: runs wasm encode/decode off the
// inference thread. Messages carry transferred ArrayBuffers; errors come back as strings.

import { parentPort } from 'node:worker_threads'
import { buildCalibration } from '../codec/calibration.ts'
import { crc32 } from '../core/checksum.ts'
import type { ChunkHeader } from '../core/format.ts'
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
      tensor: ArrayBuffer
      meta: ChunkIdentity
      calibration?: CalibrationRef | undefined
    }
  | { id: number; op: 'decode'; object: ArrayBuffer; size: number; calibration?: CalibrationRef | undefined }
  | {
      id: number
      op: 'section'
      header: ChunkHeader
      layer: number
      section: ArrayBuffer
      calibration?: CalibrationRef | undefined
    }
  /** Builds a calibration object from chunk tensors (the policy's samples). */
  | { id: number; op: 'calibrate'; samples: ArrayBuffer[]; geometry: KvGeometry }
  /** CRC-32 of ranges [offset, length, offset, length, …] of `data`; the reply packs them as u32. */
  | { id: number; op: 'crc'; data: ArrayBuffer; ranges: number[] }

export type CodecReply =
  | { id: number; bytes: ArrayBuffer }
  | { id: number; error: string }
  /** Sent once the module loaded: the pool hands jobs only to workers that got this far. */
  | { ready: true }

function own(b: Uint8Array): ArrayBuffer {
  return b.byteOffset === 0 && b.byteLength === b.buffer.byteLength
    ? (b.buffer as ArrayBuffer)
    : (b.slice().buffer as ArrayBuffer)
}

parentPort?.on('message', (m: CodecRequest) => {
  try {
    let out: Uint8Array
    if (m.op === 'encode')
      out = encodeWith(new Uint8Array(m.tensor), m.meta, m.mode, m.quality, openRef(m.calibration))
    else if (m.op === 'decode') {
      out = new Uint8Array(m.size)
      decodeIntoWith(new Uint8Array(m.object), out, openRef(m.calibration))
    } else if (m.op === 'calibrate') {
      const samples = m.samples.map((b) => new Uint8Array(b))
      out = buildCalibration(samples, { geometry: m.geometry, dtype: m.geometry.dtype })
    } else if (m.op === 'crc') {
      const data = new Uint8Array(m.data)
      const crcs = new Uint32Array(m.ranges.length / 2)
      for (let i = 0; i < crcs.length; i++) {
        const off = m.ranges[2 * i]!
        crcs[i] = crc32(data.subarray(off, off + m.ranges[2 * i + 1]!))
      }
      out = new Uint8Array(crcs.buffer)
    } else out = decodeSectionWith(m.header, m.layer, new Uint8Array(m.section), openRef(m.calibration))
    const bytes = own(out)
    parentPort!.postMessage({ id: m.id, bytes } satisfies CodecReply, [bytes])
  } catch (e) {
    parentPort!.postMessage({ id: m.id, error: (e as Error).message } satisfies CodecReply)
  }
})

parentPort?.postMessage({ ready: true } satisfies CodecReply)
