// Plumbing of reads below L1: an L2 file or an L4 body into an L1 reservation (or
// a private buffer when L1 has no slot), verified and decoded; the reservation is always settled here.

import type { Calibration } from '../codec/calibration.ts'
import { FormatError, isKvgateError, provesCorrupt } from '../core/errors.ts'
import { type ChunkHeader, decodeHeader, namesNewerFeature } from '../core/format.ts'
import type { ChunkKey } from '../core/keys.ts'
import { type KvGeometry, layerSlabBytes } from '../core/layout.ts'
import type { CalibrationStore } from './calibration-store.ts'
import { type ChunkIdentity, checkIdentity, maxObjectBytes, openLayerGroup } from './chunk-codec.ts'
import { CodecBusyError, type CodecPool, type LayerTarget } from './codec-pool.ts'
import type { IoPriority } from './io-queue.ts'
import type { CopyGate } from './native.ts'
import type { DiskTier, ReadSink } from './tiers/disk.ts'
import type { MemoryReservation, MemoryTier } from './tiers/memory.ts'
import type { RemoteTier } from './tiers/remote.ts'

/** 'resident': committed to L1 under its key; a Uint8Array: a private tensor (L1 had no free slot). */
export type Placed = 'resident' | Uint8Array

/**
 * Where a retrieve wants chunk k's tensor (its part of the caller's buffer): an L2
 * read fills it on the workers that verify it (ReadSink); `copied` says it did.
 */
export interface TensorSink {
  into: Uint8Array
  gate: CopyGate
  copied: boolean
}

export interface ChunkReaderOptions {
  geometry: KvGeometry
  memory: MemoryTier
  codec: CodecPool
  tensorBytes: (k: ChunkKey) => number
  /** Every identity field a chunk object must carry (namespace, parent, index, chain key, geometry). */
  identity: (k: ChunkKey) => ChunkIdentity
  /** Where calibrations named by format-v2 objects come from; none: such objects are misses. */
  calibrations?: CalibrationStore | undefined
  /**
   * True once the owner closed: a failure after that (its L1 freed, its pool closed under a
   * decode) says nothing about the object's bytes, so nothing is deleted or reported.
   */
  closed?: () => boolean
}

/** A valid object names a calibration this node cannot get: a miss, not corruption (nothing is deleted or reported). */
class CalibrationUnavailable extends Error {}

/**
 * A failure that says nothing about the object's bytes: its calibration cannot be had, the
 * codec pool's queue was full (load, not damage), or the pool closed under the job (close()
 * during a retrieve). Such a chunk is a plain miss; deleting the L2 file or reporting the L4
 * object as corrupt would throw good data away under load or at shutdown.
 */
function notAboutTheBytes(e: unknown): boolean {
  return (
    e instanceof CalibrationUnavailable ||
    e instanceof CodecBusyError ||
    (isKvgateError(e) && e.code === 'ERR_CLOSED')
  )
}

/**
 * A decode that failed without a verdict on the bytes (provesCorrupt is false: its worker died,
 * hung, trapped or ran out of memory, it could not be handed to one): nothing is known about
 * the object's bytes, so it is a counted read error and a miss, as for L2; not reported
 * corrupt (the gateway would re-read and re-verify it for nothing). A key that fails so again
 * and again is held off for a while (RemoteTier.readFailed: misses without the GET).
 */
function remoteReadFailed(remote: RemoteTier, hex: string): undefined {
  remote.readFailed(hex)
  return undefined
}

/**
 * An object under an intact header that names what a newer kvgate writes (a format version,
 * flag, codec or dtype this build does not know: a rolling upgrade): not corruption. A counted
 * miss (newerObjects), its key held off for a while (no GET per read); not reported to the gateway,
 * and its chain is not forgotten (it is stored).
 */
function newerObject(remote: RemoteTier, hex: string): undefined {
  remote.newerObject(hex)
  return undefined
}

export class ChunkReader {
  readonly #o: ChunkReaderOptions

  constructor(o: ChunkReaderOptions) {
    this.#o = o
  }

  /**
   * L2 → L1. The file is read straight into the slot (O_DIRECT when the addon is
   * there); a raw object then already has its tensor at the slot's data offset,
   * so promotion costs the read and the CRC check, no copy. A file that verifies
   * but is not this chunk (format, identity) is counted corrupt and deleted.
   */
  async fromDisk(
    disk: DiskTier,
    k: ChunkKey,
    priority: IoPriority,
    sink?: TensorSink,
  ): Promise<Placed | undefined> {
    const size = this.#o.tensorBytes(k)
    const r = this.#o.memory.reserve(k.hex, size)
    try {
      // The sink is filled only from a raw object of this chunk read into the slot: the
      // case where the slot is committed as read, so the copy is the only one made.
      const read: ReadSink | undefined =
        sink && r && sink.into.byteLength === size
          ? {
              into: sink.into,
              gate: sink.gate,
              copied: false,
              accept: (h) =>
                rawTensorAt(h, this.#o.memory.dataOffset, size) && isIdentity(h, this.#o.identity(k))
                  ? h.headerBytes
                  : undefined,
            }
          : undefined
      const object = await disk.get(k.hex, priority, r?.slot, read)
      if (!object) return undefined
      try {
        // DiskTier.get verified every CRC already; what is left is the identity check.
        const h = decodeHeader(object)
        checkIdentity(h, this.#o.identity(k))
        const placed = await this.#place(k, object, h, r)
        if (sink && read?.copied) sink.copied = true
        return placed
      } catch (e) {
        if (notAboutTheBytes(e) || this.#o.closed?.()) return undefined
        // Every CRC of the file passed: only a verdict on the bytes (format, identity, a stream
        // the codec refuses) deletes it. A decode that failed otherwise (its worker died, hung,
        // trapped or ran out of memory, it could not be handed to one) is a failed read,
        // counted, and the file is kept (up to a few such reads: see DiskTier.readFailed). One
        // this build cannot read (a newer codec version, a dtype or calibration it does not
        // take: another process's in a shared directory) is kept for good.
        if (!provesCorrupt(e)) {
          if (isKvgateError(e) && e.code !== 'ERR_CODEC') disk.counters.errors++
          else await disk.readFailed(k.hex, object)
          return undefined
        }
        // Only the file this read found (the decode awaited: it may have been evicted and
        // written again under the key meanwhile, intact).
        await disk.discardCorrupt(k.hex, object)
        return undefined
      }
    } finally {
      r?.abort() // no-op after a commit
    }
  }

  /** L4 → L1: the body is read into the slot when it fits, like an L2 read. */
  async fromRemote(remote: RemoteTier, k: ChunkKey): Promise<Placed | undefined> {
    const r = this.#o.memory.reserve(k.hex, this.#o.tensorBytes(k))
    try {
      const object = await remote.get(k.hex, undefined, r?.slot, {
        maxBytes: maxObjectBytes(this.#o.geometry, k.end - k.start),
      })
      if (!object) return undefined
      try {
        // A coded object is verified by the decode job itself (every section CRC before any
        // output): one worker job per chunk instead of a verify job and a decode job.
        const head = decodeHeader(object)
        const h = head.codec === 'raw' ? await this.#o.codec.verify(object) : head
        checkIdentity(h, this.#o.identity(k))
        return await this.#place(k, object, h, r)
      } catch (e) {
        if (notAboutTheBytes(e) || this.#o.closed?.()) return undefined
        if (namesNewerFeature(object)) return newerObject(remote, k.hex)
        if (!provesCorrupt(e)) return remoteReadFailed(remote, k.hex)
        // Counted, no longer believed present, and reported to the gateway's verify endpoint.
        remote.reportCorrupt(k.hex)
        return undefined
      }
    } finally {
      r?.abort()
    }
  }

  /**
   * Puts a verified object's tensor into the reservation (committing it) or a
   * private buffer when L1 had no slot. A raw object read into the slot at the
   * header offset is already in place; anything else is copied or decoded.
   * Rejects on failure (the caller's finally aborts the reservation).
   */
  async #place(
    k: ChunkKey,
    object: Uint8Array,
    h: ChunkHeader,
    r: MemoryReservation | undefined,
  ): Promise<Placed> {
    const size = this.#o.tensorBytes(k)
    const inSlot =
      r !== undefined && object.buffer === r.slot.buffer && object.byteOffset === r.slot.byteOffset
    if (inSlot && h.codec === 'raw' && rawTensorAt(h, this.#o.memory.dataOffset, size)) {
      r.commit()
      return 'resident'
    }
    const dst = r ? r.bytes : new Uint8Array(size)
    // Copying sections reads the object and writes the tensor: never both in one slot.
    // (decodeInto copies the object out of the slot itself.)
    if (h.codec === 'raw')
      copyRawSections(
        h,
        inSlot ? object.slice() : object,
        dst,
        layerSlabBytes(this.#o.geometry, k.end - k.start),
      )
    else await this.#o.codec.decodeInto(object, h.codec, dst, await this.#calibration(h))
    if (!r) return dst
    r.commit()
    return 'resident'
  }

  /**
   * One chunk's layers first..last through `?layers=a-b`, verified and decoded (where `into`
   * says, when given: see LayerTarget); undefined on any failure.
   */
  async layerGroup(
    remote: RemoteTier,
    k: ChunkKey,
    first: number,
    last: number,
    into?: LayerTarget,
  ): Promise<Map<number, Uint8Array> | undefined> {
    const body = await remote.get(k.hex, [first, last])
    if (!body) return undefined
    try {
      const sub = openLayerGroup(body, first, last, this.#o.identity(k))
      if (sub.whole) remote.answeredWhole()
      const calibration = await this.#calibration(sub.header)
      // Sections go unchecked to the decode job, which checks their CRCs (on a codec worker:
      // on this thread they were ~6 ms of an 8B chunk's ~25 ms of main-thread time).
      const layers = Array.from({ length: last - first + 1 }, (_, i) => first + i)
      const slabs = await this.#o.codec.decodeLayers(
        sub.header,
        first,
        layers.map((l) => sub.unchecked(l)),
        calibration,
        layers.map((l) => sub.header.sections[l]!.crc32),
        into,
      )
      const out = new Map<number, Uint8Array>()
      for (const [i, s] of slabs.entries()) out.set(first + i, s)
      return out
    } catch (e) {
      if (notAboutTheBytes(e) || this.#o.closed?.()) return undefined
      if (namesNewerFeature(body)) return newerObject(remote, k.hex)
      if (!provesCorrupt(e)) return remoteReadFailed(remote, k.hex)
      remote.reportCorrupt(k.hex)
      return undefined
    }
  }

  /** The calibration a v2 object names (undefined for v1); throws CalibrationUnavailable when it cannot be had. */
  async #calibration(h: ChunkHeader): Promise<Calibration | undefined> {
    if (h.calibration === undefined) return undefined
    const c = await this.#o.calibrations?.forDecode(h.calibration)
    if (!c) throw new CalibrationUnavailable(h.calibration)
    return c
  }
}

function isIdentity(h: ChunkHeader, id: ChunkIdentity): boolean {
  try {
    checkIdentity(h, id)
    return true
  } catch {
    return false
  }
}

/** True when a raw object's sections are contiguous right after a header of `offset` bytes. */
function rawTensorAt(h: ChunkHeader, offset: number, size: number): boolean {
  if (h.headerBytes !== offset || h.totalBytes !== offset + size || h.sections[0]?.offset !== offset)
    return false
  return h.sections.every(
    (s, i) => i === 0 || s.offset === h.sections[i - 1]!.offset + h.sections[i - 1]!.length,
  )
}

/**
 * A verified raw object's sections are the layer slabs: copy them out without
 * a second CRC pass (the caller verified every section).
 */
function copyRawSections(h: ChunkHeader, object: Uint8Array, dst: Uint8Array, slab: number): void {
  h.sections.forEach((s, l) => {
    if (s.length !== slab)
      throw new FormatError('ERR_FORMAT_BAD_FIELD', `raw section ${l} is ${s.length} bytes, expected ${slab}`)
    dst.set(object.subarray(s.offset, s.offset + s.length), l * slab)
  })
}
