// The binary form of use records (what gateways append), of gc's chain index (what gc
// compacts them into) and of gc's condemned lists (chunks a run found deletable, deleted only
// by a later run): uses (key, time) and links (key, parent, size, time), CRC-checked.

import { crc32 } from '../core/checksum.ts'
import { FormatError } from '../core/errors.ts'
import { fromHex, toHex } from '../core/keys.ts'

const MAGIC = 0x5547564b // 'KVGU' little-endian
const VERSION = 1
const HEAD = 24
const USE_BYTES = 40
const LINK_BYTES = 80

export type RecordKind = 'usage' | 'index' | 'condemned'
// 'condemned' (3) lives under its own prefix, which a gc older than the kind never lists.
const KIND_CODE: Record<RecordKind, number> = { usage: 1, index: 2, condemned: 3 }

/** Bytes of a record with `uses` uses and no links (a condemned list's size bound). */
export const recordBytes = (uses: number) => HEAD + uses * USE_BYTES + 4

/**
 * The parent a link names for the first chunk of a chain (header chunkIndex 0): its header's
 * parent is the namespace seed, never a stored chunk, so "parent not listed" means a root
 * here, not a hole. Gateways and gc both write it; a gc or gateway older than it wrote the
 * seed, which reads as an unlisted parent and costs gc one header read to tell apart.
 */
export const ROOT_PARENT = '0'.repeat(64)

/**
 * A chunk read (by lookup or GET) at `at` ms: it and every chunk before it in its chain were
 * used. In a condemned list: the chunk and when a gc run first found it deletable.
 */
export interface UseEntry {
  key: string
  at: number
}

/** A chunk's parent in its chain (from the header the gateway verified on PUT, or a header read by gc). */
export interface LinkEntry {
  key: string
  parent: string
  size: number
  at: number
}

export interface UsageBatch {
  kind: RecordKind
  /** When the batch was written (ms since epoch). */
  at: number
  uses: UseEntry[]
  links: LinkEntry[]
}

export function encodeBatch(b: UsageBatch): Uint8Array {
  const out = new Uint8Array(HEAD + b.uses.length * USE_BYTES + b.links.length * LINK_BYTES + 4)
  const dv = new DataView(out.buffer)
  dv.setUint32(0, MAGIC, true)
  dv.setUint16(4, VERSION, true)
  dv.setUint16(6, KIND_CODE[b.kind], true)
  dv.setFloat64(8, b.at, true)
  dv.setUint32(16, b.uses.length, true)
  dv.setUint32(20, b.links.length, true)
  let at = HEAD
  for (const u of b.uses) {
    out.set(fromHex(u.key), at)
    dv.setFloat64(at + 32, u.at, true)
    at += USE_BYTES
  }
  for (const l of b.links) {
    out.set(fromHex(l.key), at)
    out.set(fromHex(l.parent), at + 32)
    dv.setFloat64(at + 64, l.size, true)
    dv.setFloat64(at + 72, l.at, true)
    at += LINK_BYTES
  }
  dv.setUint32(at, crc32(out.subarray(0, at)), true)
  return out
}

/** Parses a batch; throws FormatError on anything but an intact one (gc then skips it). */
export function decodeBatch(bytes: Uint8Array): UsageBatch {
  if (bytes.length < HEAD + 4) throw new FormatError('ERR_FORMAT_TRUNCATED', 'use record is too short')
  const dv = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength)
  if (dv.getUint32(0, true) !== MAGIC)
    throw new FormatError('ERR_FORMAT_BAD_MAGIC', 'not a kvgate use record')
  if (dv.getUint16(4, true) !== VERSION)
    throw new FormatError('ERR_FORMAT_BAD_VERSION', `use record version ${dv.getUint16(4, true)}`)
  const code = dv.getUint16(6, true)
  const kind = (Object.keys(KIND_CODE) as RecordKind[]).find((k) => KIND_CODE[k] === code)
  if (!kind) throw new FormatError('ERR_FORMAT_BAD_FIELD', `use record kind ${code}`)
  const nUses = dv.getUint32(16, true)
  const nLinks = dv.getUint32(20, true)
  const end = HEAD + nUses * USE_BYTES + nLinks * LINK_BYTES
  if (end + 4 !== bytes.length) throw new FormatError('ERR_FORMAT_TRUNCATED', 'use record length mismatch')
  if (crc32(bytes.subarray(0, end)) !== dv.getUint32(end, true))
    throw new FormatError('ERR_FORMAT_CHECKSUM', 'use record checksum mismatch')
  // A CRC only proves the bytes arrived as written: times and sizes are checked too, since a
  // NaN time would make a chunk compare neither older nor newer than its parent in gc's plan.
  const batchAt = time(dv.getFloat64(8, true))
  const uses: UseEntry[] = []
  const links: LinkEntry[] = []
  let at = HEAD
  for (let i = 0; i < nUses; i++, at += USE_BYTES) {
    uses.push({ key: toHex(bytes.subarray(at, at + 32)), at: time(dv.getFloat64(at + 32, true)) })
  }
  for (let i = 0; i < nLinks; i++, at += LINK_BYTES) {
    const size = dv.getFloat64(at + 64, true)
    if (!Number.isSafeInteger(size) || size < 0)
      throw new FormatError('ERR_FORMAT_BAD_FIELD', `use record link size ${size}`)
    links.push({
      key: toHex(bytes.subarray(at, at + 32)),
      parent: toHex(bytes.subarray(at + 32, at + 64)),
      size,
      at: time(dv.getFloat64(at + 72, true)),
    })
  }
  return { kind, at: batchAt, uses, links }
}

function time(t: number): number {
  if (!Number.isFinite(t)) throw new FormatError('ERR_FORMAT_BAD_FIELD', `use record time ${t}`)
  return t
}
