// `kvgate inspect <file>`: prints a chunk object's header, its layer index and
// whether every checksum holds — the first thing to run on a suspicious L2 file.

import { closeSync, fstatSync, openSync, readSync, writeFileSync } from 'node:fs'
import { crc32 } from '../../core/checksum.ts'
import { isKvgateError } from '../../core/errors.ts'
import { type ChunkHeader, decodeHeader, encodeChunk, readHeaderLength } from '../../core/format.ts'
import { chainKeys, fromHex, namespaceId, toHex } from '../../core/keys.ts'
import { chunkBytes, dtypeBytes, layerSlabBytes, MODEL_PRESETS } from '../../core/layout.ts'
import { parseCommandArgs } from '../args.ts'

const HELP = `Usage: kvgate inspect <file> [--json]
       kvgate inspect --write-sample <file>

Prints a chunk object's header, layer index and checksum status. Exits 0 when
the object is intact, 1 when any check fails.

Options:
  --json                 print the report as JSON
  --write-sample <file>  write a small valid chunk object (raw codec) to <file>
  -h, --help             show this help`

export interface InspectReport {
  ok: boolean
  bytes: number
  error?: { code: string; message: string }
  header?: Omit<ChunkHeader, 'namespaceId' | 'chainKey' | 'parentKey' | 'codecParams' | 'sections'> & {
    namespaceId: string
    chainKey: string
    parentKey: string
    codecParams: string
  }
  sections?: { layer: number; offset: number; length: number; crc32: string; ok: boolean }[]
  rawBytes?: number
  ratio?: number
}

/**
 * `bytes`: the object, or the file's first bytes when it is longer than its header says;
 * `fileBytes`: the file's whole length (default: bytes.length).
 */
export function inspectBytes(bytes: Uint8Array, fileBytes = bytes.length): InspectReport {
  let h: ChunkHeader
  try {
    h = decodeHeader(bytes)
  } catch (e) {
    if (!isKvgateError(e)) throw e
    return { ok: false, bytes: fileBytes, error: { code: e.code, message: e.message } }
  }
  const sections = h.sections.map((s, layer) => {
    const end = s.offset + s.length
    const ok = end <= bytes.length && crc32(bytes.subarray(s.offset, end)) === s.crc32
    return { layer, offset: s.offset, length: s.length, crc32: s.crc32.toString(16).padStart(8, '0'), ok }
  })
  const lengthOk = fileBytes === h.totalBytes && bytes.length === h.totalBytes
  const { namespaceId, chainKey, parentKey, codecParams, sections: _s, ...rest } = h
  const rawBytes = chunkBytes(h.geometry, h.tokens)
  return {
    ok: lengthOk && sections.every((s) => s.ok),
    bytes: fileBytes,
    ...(lengthOk
      ? {}
      : {
          error: {
            code: 'ERR_FORMAT_TRUNCATED',
            message: `file is ${fileBytes} bytes, header says ${h.totalBytes}`,
          },
        }),
    header: {
      ...rest,
      namespaceId: toHex(namespaceId),
      chainKey: toHex(chainKey),
      parentKey: toHex(parentKey),
      codecParams: toHex(codecParams),
    },
    sections,
    rawBytes,
    ratio: rawBytes / h.totalBytes,
  }
}

function printReport(path: string, r: InspectReport): void {
  console.log(`${path}: ${r.bytes} bytes — ${r.ok ? 'OK' : 'DAMAGED'}`)
  if (r.error) console.log(`  error: ${r.error.code}: ${r.error.message}`)
  const h = r.header
  if (!h || !r.sections) return
  const g = h.geometry
  console.log(
    `  format v${h.formatVersion}, header ${h.headerBytes} bytes, codec ${h.codec} v${h.codecVersion} (params ${h.codecParams})`,
  )
  console.log(
    g.latent === true
      ? `  geometry ${g.layers} layers × latent ${g.headDim} (MLA: one latent plane per layer, no V), ${g.dtype} (${dtypeBytes(g.dtype)} B), ${h.tokens} tokens${h.partial ? ' (partial chunk)' : ''}`
      : `  geometry ${g.layers} layers × ${g.kvHeads} kv heads × ${g.headDim} dims, ${g.dtype} (${dtypeBytes(g.dtype)} B), ${h.tokens} tokens${h.partial ? ' (partial chunk)' : ''}`,
  )
  console.log(`  chunk #${h.chunkIndex}  key ${h.chainKey}`)
  console.log(`  parent     ${h.parentKey}`)
  console.log(`  namespace  ${h.namespaceId}`)
  // v2: the sections decode only with this calibration object (GET /v1/ns/{ns}/calibrations/{hash}).
  if (h.calibration) console.log(`  calibration ${h.calibration}`)
  console.log(`  raw KV ${r.rawBytes} bytes, stored ${h.totalBytes} bytes (ratio ${r.ratio?.toFixed(2)}×)`)
  console.log('  layer      offset      length  crc32     status')
  for (const s of r.sections) {
    console.log(
      `  ${String(s.layer).padStart(5)} ${String(s.offset).padStart(11)} ${String(s.length).padStart(11)}  ${s.crc32}  ${s.ok ? 'ok' : 'BAD'}`,
    )
  }
}

/** Enough for any header (at most ~16 KiB at MAX_LAYERS). */
const HEADER_PROBE_BYTES = 64 * 1024

/** Fills `buf` from `at` with the file's next bytes; the length filled (less at the file's end). */
function readInto(fd: number, buf: Uint8Array, at: number): number {
  while (at < buf.length) {
    const got = readSync(fd, buf, at, Math.min(buf.length - at, 1 << 30), null)
    if (got === 0) break
    at += got
  }
  return at
}

/**
 * A chunk file read no further than its header says it holds (plus one byte, to tell a longer
 * one): a file that is no chunk object (a disk image, /dev/zero) is judged by its first bytes,
 * never read whole. `fileBytes` is its length (a regular file's size, else what was read).
 */
function readChunkFile(path: string): { bytes: Uint8Array; fileBytes: number } {
  const fd = openSync(path, 'r')
  try {
    const st = fstatSync(fd)
    const probe = new Uint8Array(HEADER_PROBE_BYTES)
    const got = readInto(fd, probe, 0)
    let want = got
    try {
      want = decodeHeader(probe.subarray(0, readHeaderLength(probe.subarray(0, got)))).totalBytes + 1
    } catch {
      // No header to go by: inspectBytes reports why from the probe.
    }
    if (st.isFile()) want = Math.min(want, st.size + 1)
    let bytes = probe.subarray(0, got)
    if (want > got && got === HEADER_PROBE_BYTES) {
      const all = new Uint8Array(want)
      all.set(probe)
      bytes = all.subarray(0, readInto(fd, all, got))
    }
    return { bytes, fileBytes: st.isFile() ? st.size : bytes.length }
  } finally {
    closeSync(fd)
  }
}

/** A small valid chunk object of the stories260k geometry: raw codec, real chain key. */
export function sampleChunkObject(): Uint8Array {
  const p = MODEL_PRESETS.stories260k
  const tokens = Array.from({ length: 32 }, (_, i) => (i * 37 + 1) % 512)
  const ns = { modelId: p.modelId, geometry: p, chunkTokens: 16 }
  const keys = chainKeys(tokens, ns)
  const k = keys[1]!
  const sections = Array.from({ length: p.layers }, (_, layer) => {
    const s = new Uint8Array(layerSlabBytes(p, 16))
    for (let i = 0; i < s.length; i++) s[i] = (i * 31 + layer * 7) & 0xff
    return s
  })
  return encodeChunk(
    {
      codec: 'raw',
      codecVersion: 1,
      codecParams: new Uint8Array(0),
      geometry: p,
      tokens: 16,
      chunkIndex: k.index,
      partial: false,
      namespaceId: fromHex(namespaceId(ns)),
      chainKey: k.key,
      parentKey: fromHex(k.parentHex),
    },
    sections,
  )
}

export async function run(argv: string[]): Promise<number> {
  const { values, positionals, help } = parseCommandArgs(
    argv,
    {
      json: { type: 'boolean' },
      'write-sample': { type: 'string' },
    },
    { positionals: true },
  )
  if (help) {
    console.log(HELP)
    return 0
  }
  if (values['write-sample']) {
    const bytes = sampleChunkObject()
    writeFileSync(values['write-sample'], bytes)
    console.log(`wrote a ${bytes.length}-byte sample chunk object to ${values['write-sample']}`)
    return 0
  }
  if (positionals.length !== 1) {
    console.error('kvgate inspect: give exactly one file (see --help)')
    return 2
  }
  const path = positionals[0]!
  let file: { bytes: Uint8Array; fileBytes: number }
  try {
    file = readChunkFile(path)
  } catch (e) {
    console.error(`kvgate inspect: cannot read ${path}: ${(e as Error).message}`)
    return 2
  }
  const report = inspectBytes(file.bytes, file.fileBytes)
  if (values.json) console.log(JSON.stringify(report, null, 2))
  else printReport(path, report)
  return report.ok ? 0 : 1
}
