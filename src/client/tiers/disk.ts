// L2: one chunk object per file under a directory (fan-out by the key's first
// byte), written temp + fsync + rename + directory fsync, indexed in memory and rebuilt on start.
// The directory may be shared (other processes, other models): only this instance's
// files count against its budget, and another process's in-flight temp files are left alone.

import { constants as fsc } from 'node:fs'
import { mkdir, open, readdir, rename, rm, stat, unlink } from 'node:fs/promises'
import { join } from 'node:path'
import { eachBounded } from '../../core/bounded-each.ts'
import { crc32Combine } from '../../core/checksum.ts'
import { FormatError, InvalidArgumentError, isKvgateError, KvgateError } from '../../core/errors.ts'
import {
  type ChunkHeader,
  DEFAULT_MAX_CHUNK_BYTES,
  decodeHeader,
  FORMAT_VERSION_CALIBRATED,
  readHeaderLength,
  verifyChunk,
} from '../../core/format.ts'
import { toHex } from '../../core/keys.ts'
import { InFlightLimit, type IoPriority, PriorityQueue } from '../io-queue.ts'
import type { CopyGate, ReadFileCrcResult } from '../native.ts'
import type { NativeModule } from '../native-api.ts'
import { since, TierCounters } from '../stats.ts'
import { beginTemp, endTemp, StaleTempWatch, TMP_PREFIX, tempWriter } from './temp-files.ts'

export interface DiskTierOptions {
  /** Directory holding the chunk files (created if missing). */
  dir: string
  /** Byte budget; least recently used files are deleted beyond it. */
  bytes: number
  /** Parallel file operations. @default 2 */
  concurrency?: number
  /** Native addon wrapper: reads go through its O_DIRECT path when `direct` allows. */
  native?: NativeModule | undefined
  /**
   * 'auto': O_DIRECT reads through the addon when the destination is 4 KiB
   * aligned (L1 slots are), bypassing the page cache; 'off': buffered reads (through the
   * addon when given, which keeps the pinned memory read into from being freed meanwhile).
   * @default 'auto'
   */
  direct?: 'auto' | 'off'
  /**
   * Full verification of an object read back (header, every section CRC, length) on
   * the buffered path. Objects read through the addon are verified with the same rules
   * by the addon's I/O threads instead (section CRCs computed as each range lands;
   * readFileCrc). @default verifyChunk
   */
  verify?: (object: Uint8Array) => ChunkHeader | Promise<ChunkHeader>
  /**
   * Which chunk files are this instance's (e.g. its namespace id): others in the
   * directory are neither indexed, counted against the budget, evicted nor deleted.
   * @default every valid chunk file
   */
  owns?: (header: ChunkHeader) => boolean
  /**
   * A temp file whose writer cannot be told from here (another host's, a live process's) is a
   * stopped writer's leftover, and deleted, once it stayed unchanged this long, timed by this
   * process's clock (never by its mtime: another clock). A dead writer's on this host is deleted
   * at start. @default 1 hour
   */
  staleTempMs?: number
  /**
   * A byte budget shared with other tiers (`kvgate agent`: every KV space's L2 directory):
   * replaces `bytes`; beyond it the least recently used file of any of them is deleted.
   */
  sharedBudget?: DiskBudget
  /**
   * Memory for the headers the index keeps (a read of an indexed file skips its header
   * read); files beyond it are read header first. ~0.7 KiB per 32-layer chunk file.
   * @default 64 MiB
   */
  indexedHeaderBytes?: number
}

/**
 * One L2 byte budget over several DiskTiers (each its own directory and chunks): eviction
 * takes the least recently used file among all of them, so a busy tier grows into an idle
 * one's share instead of each being capped at a fixed split.
 */
export class DiskBudget {
  readonly bytes: number
  used = 0
  /**
   * Bytes of writes in flight (evicted for, not yet renamed into place): counted by every
   * later eviction, or concurrent writes would each make room for themselves only and
   * together overshoot the budget.
   */
  reserved = 0
  readonly #tiers = new Set<DiskTier>()

  constructor(bytes: number) {
    if (!Number.isSafeInteger(bytes) || bytes < 1) throw new InvalidArgumentError('invalid disk budget')
    this.bytes = bytes
  }

  join(t: DiskTier): void {
    this.#tiers.add(t)
  }

  leave(t: DiskTier): void {
    this.#tiers.delete(t)
  }

  /** Open tiers counted in this budget. */
  get members(): number {
    return this.#tiers.size
  }

  /** The tier whose least recently used file is the oldest of all (undefined when none holds one). */
  oldest(): DiskTier | undefined {
    let best: DiskTier | undefined
    let at = Number.POSITIVE_INFINITY
    for (const t of this.#tiers) {
      const a = t.oldestUse()
      if (a !== undefined && a < at) {
        at = a
        best = t
      }
    }
    return best
  }
}

/** A monotonic clock in ms shared by every tier of a process (file times at start, then now). */
let lastUse = 0
function useTime(at = Date.now()): number {
  lastUse = Math.max(at, lastUse + 1e-3)
  return lastUse
}

export interface DiskTierStats {
  dir: string
  capacityBytes: number
  usedBytes: number
  files: number
  /**
   * Files removed at start: half-written temp files and objects that failed verification; and
   * temp files found then whose writer could not be told, once they stayed unchanged for staleTempMs.
   */
  recoveredDiscarded: number
  /** Files at start that belong to another instance (owns() said no): left alone, not counted. */
  foreignFiles: number
  /**
   * Files at start that could not be read (EIO, EMFILE, EACCES…), are not regular files, or
   * were to be discarded but could not be deleted (read-only directory): left in place, not indexed.
   */
  unreadableFiles: number
  /** Reads that went through O_DIRECT. */
  directReads: number
  /** Reads whose tensor the reading workers also copied, verified, into a caller's buffer (ReadSink). */
  sinkReads: number
  /** Memory held by the file headers the index keeps (reads of those files skip a header read). */
  indexedHeaderBytes: number
  /** Writes that failed (ENOSPC, EROFS, EACCES, ...); the chunk stays in the other tiers. */
  writeErrors: number
  lastWriteError: string | undefined
  /**
   * Files deleted after MAX_FAILED_READS (3) reads that failed with no verdict on their bytes
   * (decode traps, workers lost): each such read is also counted in `errors`.
   */
  unservableDropped: number
  queued: number
}

/**
 * A caller's buffer that a direct read also fills: the workers that read and
 * verify each section copy it there while it is still in their cache, so a
 * retrieve does not copy the chunk again on the JS thread. Only sections whose
 * CRC matched are copied, only while `gate` is open, and `copied` is set only
 * when the whole object verified and every tensor byte landed in `into`.
 */
export interface ReadSink {
  into: Uint8Array
  gate: CopyGate
  /** The file offset `into` starts at for this object, or undefined: copy nothing (not this chunk, not raw). */
  accept: (header: ChunkHeader) => number | undefined
  copied: boolean
}

/** A chunk file found at start, to be indexed. */
interface Found {
  hex: string
  bytes: number
  time: number
  /** Dropped for the older files once the scan holds more than the index may keep. */
  header: Uint8Array | undefined
}

/** What a start-up scan has found so far, and the memory its headers hold. */
interface Scan {
  found: Found[]
  /** The found files still holding their header (at most about twice the index's memory for them). */
  held: Found[]
  headerBytes: number
}

/** Files probed at once at start (each a few pool round trips: open, stat, read, close). */
const PROBES_IN_FLIGHT = 16
/** Temp files of writers that cannot be told watched at once (the rest wait for a later open): the memory bound. */
const MAX_WATCHED_TEMPS = 4096
/**
 * A temp file whose writer cannot be told is judged by this process's clock (StaleTempWatch),
 * not its mtime, except past this age: no clock is a week off and no chunk write takes a week,
 * while processes that restart more often than staleTempMs would otherwise never clear a dead
 * foreign writer's leftovers from a shared directory.
 */
const FOREIGN_TEMP_MAX_AGE_MS = 7 * 24 * 3_600_000
const FILE_RE = /^[0-9a-f]{64}\.kvc$/
const SUBDIR_RE = /^[0-9a-f]{2}$/
/**
 * Reads of one file that may fail with no verdict on its bytes (a decode that trapped, its
 * worker lost or hung) before the file is deleted: a file that fails so every time (a decoder
 * bug on its bytes) would otherwise stay, kept recent by the reads, and its chunk could never
 * be written to L2 again (a key indexed is not rewritten): a miss at every read, for good.
 */
const MAX_FAILED_READS = 3
/** Whether a chunk file's header (its magic checked) names a format version after this build's. */
function newerFormat(probe: Uint8Array): boolean {
  return (
    probe.byteLength >= 6 &&
    new DataView(probe.buffer, probe.byteOffset).getUint16(4, true) > FORMAT_VERSION_CALIBRATED
  )
}

/** Enough for the header of any chunk up to 1024 layers. */
const HEADER_PROBE_BYTES = 64 * 1024

interface FileEntry {
  bytes: number
  /** Last use (useTime): compares recency across the tiers of a shared budget. */
  used: number
  /**
   * The object's header as indexed (written here, or read at start): a read issues every
   * range (up to SEGMENTS_IN_FLIGHT) at once instead of reading the header first, and checks that the file still
   * starts with these bytes. Undefined: the read fetches the header from the file.
   */
  header?: Uint8Array | undefined
  /** Reads of this file its caller could not use, with no verdict on its bytes (see readFailed). */
  failedReads?: number
}

/** An object read back: `header` when it was verified while read (else the caller verifies it). */
interface VerifiedRead {
  bytes: Uint8Array
  header: ChunkHeader | undefined
}

/** The file no longer starts with the header it was indexed with (replaced since): read its own. */
class StaleHeader extends Error {}

/**
 * A copy of an object's header bytes (never a view: it must not keep the object's or a
 * probe's memory alive), or undefined when it has none that parses.
 */
function headerOf(object: Uint8Array): Uint8Array | undefined {
  try {
    const n = readHeaderLength(object)
    return n <= object.byteLength ? new Uint8Array(object.subarray(0, n)) : undefined
  } catch {
    return undefined
  }
}

/**
 * One read + CRC task on the libuv pool (a multiple of the 4 KiB O_DIRECT alignment). The
 * addon reads a task as 2 MiB pieces, a few in flight, verifying those that landed while the
 * next are read, so a task keeps the disk busy through its own CRC and copy; 16 MiB tasks
 * with that (two per 32 MiB chunk, on two of the pool's UV_THREADPOOL_SIZE threads) kept the
 * disk busier in a cold 8-chunk retrieve (95–96 % of the time, was 90 % with 8 MiB tasks read
 * by one pread each) and ran 4–5 % faster, A/B in one process.
 */
const SEGMENT_BYTES = 16 << 20
/** Segment reads in flight per object. */
const SEGMENTS_IN_FLIGHT = 4
/** First read of an object: one O_DIRECT block holds the header of up to 246 layers. */
const HEADER_READ_BYTES = 4096

/**
 * Where an object's reads start: about SEGMENT_BYTES each, cut at a section start
 * where one is aligned nearby (so most sections are read, verified and copied
 * whole by one worker), else at an aligned offset. A 32 MiB tensor behind a 4 KiB
 * header is two reads, both in flight at once, not two and a 4 KiB third that
 * waits for a JS turn and every read queued on the pool before the object completes.
 */
export function segmentStarts(header: ChunkHeader, size: number): number[] {
  const count = Math.max(1, Math.round(size / SEGMENT_BYTES))
  const starts = [0]
  for (let k = 1; k < count; k++) {
    const want = Math.ceil((size * k) / count)
    const section = header.sections.find((s) => s.offset >= want && s.offset % HEADER_READ_BYTES === 0)
    const at = section && section.offset - want < SEGMENT_BYTES / 2 ? section.offset : alignUp(want)
    if (at > starts.at(-1)! && at < size) starts.push(at)
  }
  return starts
}

function alignUp(n: number): number {
  return Math.ceil(n / HEADER_READ_BYTES) * HEADER_READ_BYTES
}

function equalPrefix(buf: Uint8Array, prefix: Uint8Array): boolean {
  for (let i = 0; i < prefix.length; i++) if (buf[i] !== prefix[i]) return false
  return true
}

export class DiskTier {
  readonly counters = new TierCounters()
  readonly dir: string
  readonly #budget: number
  readonly #queue: PriorityQueue
  /**
   * Segment reads in flight (issued to the addon, queued on or running in the libuv pool), over
   * every object read at once. A read gives its queue slot on once all its segments are issued
   * (PriorityQueue handOn): the next object's segments queue behind its last ones, so the pool's
   * threads never wait for the slowest segment of an object before the next object starts.
   * A demand read's segments are granted before waiting prefetches' (InFlightLimit first), but
   * are queued on the pool behind those already issued: it may wait for up to concurrency × 4
   * segments of prefetch (128 MiB with the default two slots; before the hand-on, the objects
   * holding the slots: 64 MiB of 32 MiB objects). Objects read at once, each holding its buffer
   * (an L1 slot): up to concurrency × 4 handed on (each still has a segment in flight) and the
   * concurrency holding slots, where one per slot was read before the hand-on.
   */
  readonly #segments: InFlightLimit
  /** Map order = recency (oldest first): re-inserted on every access. */
  readonly #index = new Map<string, FileEntry>()
  readonly #writing = new Map<string, Promise<boolean>>()
  /** The index entry each object get() served was read from (see discardCorrupt). */
  readonly #servedFrom = new WeakMap<Uint8Array, FileEntry>()
  #used = 0
  #discarded = 0
  #unservableDropped = 0
  #writeErrors = 0
  #lastWriteError: string | undefined
  #directReads = 0
  #sinkReads = 0
  #foreign = 0
  #unreadable = 0
  /** The addon for direct reads (undefined with direct: 'off'). */
  readonly #native: NativeModule | undefined
  /** The addon for any read into a caller's buffer (direct or not). */
  readonly #addon: NativeModule | undefined
  readonly #verify: (object: Uint8Array) => ChunkHeader | Promise<ChunkHeader>
  readonly #owns: (header: ChunkHeader) => boolean
  /** Temp files found at start whose writer cannot be told: deleted once unchanged for staleTempMs. */
  readonly #staleTemps: StaleTempWatch
  readonly #headerBudget: number
  /** Bytes of the headers the index holds (FileEntry.header), at most #headerBudget. */
  #headerBytes = 0

  /** One budget with other tiers, or this tier's own. */
  readonly #shared: DiskBudget
  /** Closed: no longer counted in (or evicted for) the shared budget. */
  #left = false
  /**
   * Closed: a read that fails from now on says nothing about the file (its owner may have
   * freed the buffer it read into, KVCache.close()): a miss, never a corrupt verdict.
   */
  #closed = false

  private constructor(opts: DiskTierOptions) {
    this.dir = opts.dir
    this.#budget = opts.sharedBudget?.bytes ?? opts.bytes
    this.#shared = opts.sharedBudget ?? new DiskBudget(opts.bytes)
    this.#shared.join(this)
    this.#native = opts.direct === 'off' ? undefined : opts.native
    this.#addon = opts.native
    this.#verify = opts.verify ?? verifyChunk
    this.#owns = opts.owns ?? (() => true)
    this.#staleTemps = new StaleTempWatch(opts.staleTempMs ?? 3_600_000, MAX_WATCHED_TEMPS, (p) =>
      this.#discard(p),
    )
    this.#headerBudget = opts.indexedHeaderBytes ?? 64 * 1024 * 1024
    this.#queue = new PriorityQueue(opts.concurrency ?? 2)
    this.#segments = new InFlightLimit((opts.concurrency ?? 2) * SEGMENTS_IN_FLIGHT)
  }

  /** Opens (creating) the directory and rebuilds the index from the files in it. */
  static async open(opts: DiskTierOptions): Promise<DiskTier> {
    if (typeof opts.dir !== 'string' || opts.dir.length === 0)
      throw new InvalidArgumentError('invalid disk.dir')
    if (opts.sharedBudget === undefined && (!Number.isSafeInteger(opts.bytes) || opts.bytes < 1))
      throw new InvalidArgumentError('invalid disk.bytes')
    const tier = new DiskTier(opts)
    try {
      await mkdir(opts.dir, { recursive: true })
      await tier.#rebuild()
    } catch (e) {
      // A tier that never opened leaves the shared budget it joined (and the bytes its
      // rebuild counted), or eviction would keep choosing from an index nobody serves.
      tier.close()
      throw e
    }
    return tier
  }

  #pathOf(hex: string): string {
    return join(this.dir, hex.slice(0, 2), `${hex}.kvc`)
  }

  async #rebuild(): Promise<void> {
    const scan: Scan = { found: [], held: [], headerBytes: 0 }
    for (const sub of await readdir(this.dir)) {
      if (!SUBDIR_RE.test(sub)) continue
      const subdir = join(this.dir, sub)
      let names: string[]
      try {
        names = await readdir(subdir)
      } catch {
        continue
      }
      // Several files probed at once: one at a time, each costs four pool round trips in a
      // row (open, stat, read, close) and a large directory takes minutes to open.
      // Settled whole: no probe (nor its rm) still runs after a failed open returns.
      await eachBounded(names, PROBES_IN_FLIGHT, (name) => this.#recover(subdir, sub, name, scan))
    }
    const found = scan.found.sort((a, b) => a.time - b.time)
    const entries = found.map((f) => {
      const entry: FileEntry = { bytes: f.bytes, used: f.time }
      this.#index.set(f.hex, entry)
      this.#addUsed(f.bytes)
      return entry
    })
    // Headers for the most recently used files first: those are the ones read next.
    for (let i = found.length - 1; i >= 0; i--) this.#keepHeader(entries[i]!, found[i]!.header)
    await this.#evictToBudget(0)
  }

  /** One directory entry at start: a stale temp file or a corrupt file is deleted, a chunk file indexed. */
  async #recover(subdir: string, sub: string, name: string, scan: Scan): Promise<void> {
    const path = join(subdir, name)
    if (name.startsWith(TMP_PREFIX)) {
      // A write that never reached its rename: its writer died, unless it is still running.
      const writer = await tempWriter(name)
      if (writer === 'gone' || (writer === undefined && (await olderThan(path, FOREIGN_TEMP_MAX_AGE_MS))))
        await this.#discard(path)
      else if (writer === undefined) await this.#staleTemps.watch(path)
      return
    }
    if (!FILE_RE.test(name) || !name.startsWith(sub)) return
    const hex = name.slice(0, 64)
    const ok = await this.#checkHeader(path, hex)
    if (ok === 'unreadable') {
      // An I/O error says nothing about the file: keep it, just do not serve it.
      this.#unreadable++
      return
    }
    if (ok === 'foreign') {
      this.#foreign++
      return
    }
    if (!ok) {
      await this.#discard(path)
      return
    }
    const f: Found = { hex, bytes: ok.bytes, time: ok.time, header: ok.header }
    scan.found.push(f)
    scan.held.push(f)
    scan.headerBytes += ok.header.byteLength
    // A directory of millions of files must not hold all their headers until the end of the
    // scan: past twice what the index keeps, only the newest files' headers are kept.
    if (scan.headerBytes > 2 * this.#headerBudget) keepNewestHeaders(scan, this.#headerBudget)
  }

  /**
   * Deletes a dead writer's temp file or a corrupt file found at start. One that cannot be
   * deleted (a read-only directory, a directory under that name) is left in place, counted
   * unreadable: it is not indexed either way, and it must not fail the tier's open.
   */
  async #discard(path: string): Promise<void> {
    try {
      await rm(path, { force: true })
      this.#discarded++
    } catch {
      this.#unreadable++
    }
  }

  /**
   * Cheap start-up check: header decodes, names this key, and the size is exact.
   * Sections are verified on read. 'unreadable' on an I/O error (the file may be
   * fine) or for anything but a regular file (left alone), 'foreign' for another instance's file, undefined when it is corrupt.
   */
  async #checkHeader(
    path: string,
    hex: string,
  ): Promise<{ bytes: number; time: number; header: Uint8Array } | 'unreadable' | 'foreign' | undefined> {
    let fh: Awaited<ReturnType<typeof open>> | undefined
    let probe: Buffer
    let st: Awaited<ReturnType<typeof stat>>
    try {
      // O_NONBLOCK: a FIFO (or device) under a chunk's name must not hold start-up (and a
      // pool thread) waiting for a writer; only a regular file can be a chunk.
      fh = await open(path, fsc.O_RDONLY | fsc.O_NONBLOCK)
      st = await fh.stat()
      if (!st.isFile()) return 'unreadable'
      probe = Buffer.allocUnsafe(Math.min(st.size, HEADER_PROBE_BYTES))
      await fh.read(probe, 0, probe.byteLength, 0)
    } catch {
      return 'unreadable'
    } finally {
      await fh?.close().catch(() => {})
    }
    let header: ChunkHeader
    try {
      // Any size the file has: a chunk larger than the gateway's default limit was written
      // (and is read back) here all the same; the size is checked against the header below.
      header = decodeHeader(probe, { maxBytes: Math.max(st.size, DEFAULT_MAX_CHUNK_BYTES) })
    } catch (e) {
      // A format newer than this build reads (a newer kvgate sharing the directory, a rolling
      // upgrade): no verdict on its bytes, left alone like another instance's file. A later
      // put of the key here writes over it.
      if (e instanceof FormatError && e.code === 'ERR_FORMAT_BAD_VERSION' && newerFormat(probe))
        return 'foreign'
      return undefined
    }
    if (header.totalBytes !== st.size || toHex(header.chainKey) !== hex) return undefined
    if (!this.#owns(header)) return 'foreign'
    return {
      bytes: st.size,
      time: Math.max(st.atimeMs, st.mtimeMs),
      header: new Uint8Array(probe.subarray(0, header.headerBytes)), // a copy (Buffer.slice is a view)
    }
  }

  has(hex: string): boolean {
    return this.#index.has(hex)
  }

  /** A gate for ReadSinks, or undefined when reads do not go through the addon (no sink then). */
  copyGate(): CopyGate | undefined {
    return this.#native ? new this.#native.CopyGate() : undefined
  }

  /**
   * Reads and verifies a chunk object. A missing or corrupt file is a miss (the
   * corrupt one is deleted); an I/O error is a miss too, counted in errors.
   * With a `sink`, a direct read into `into` also copies the verified tensor there (see ReadSink).
   */
  async get(
    hex: string,
    priority: IoPriority = 'get',
    into?: Uint8Array,
    sink?: ReadSink,
  ): Promise<Uint8Array | undefined> {
    const entry = this.#index.get(hex)
    if (!entry) {
      this.counters.misses++
      return undefined
    }
    // Touch now so a queued read is not evicted from under itself by recency.
    this.#index.delete(hex)
    entry.used = useTime()
    this.#index.set(hex, entry)
    const t0 = performance.now()
    const dst = into && into.byteLength >= entry.bytes ? into.subarray(0, entry.bytes) : undefined
    let bytes: Uint8Array | undefined
    try {
      const read = await this.#queue.run(priority, (handOn) =>
        this.#readFile(hex, entry, dst, sink, handOn, priority === 'get'),
      )
      const header = read && (read.header ?? (await this.#verify(read.bytes)))
      if (header && !this.#owns(header)) {
        // Another instance's object, written over this one under the key (a shared directory):
        // neither served nor deleted, and no longer indexed (or counted) here.
        if (this.#index.get(hex) === entry) this.#dropIndex(hex)
        if (sink) sink.copied = false
      } else bytes = read?.bytes
    } catch (e) {
      if (isKvgateError(e) && e.code.startsWith('ERR_FORMAT_')) {
        // After close() the bytes checked may not be the file's (KVCache.close() frees the L1
        // slot read into: it reads as empty): a miss, no verdict on the file.
        if (!this.#closed && !(await this.#reindexReplaced(hex, entry))) {
          this.counters.corrupt++
          // Only the file this read found: one evicted and written again meanwhile is intact.
          await this.#deleteEntry(hex, entry)
        }
      } else {
        // Not a verdict on the file (a closed codec pool, an addon error): a counted miss, the file stays.
        this.counters.errors++
      }
      bytes = undefined
    }
    if (!bytes) {
      this.counters.misses++
      return undefined
    }
    this.#servedFrom.set(bytes, entry)
    this.counters.hits++
    this.counters.bytesRead += bytes.byteLength
    this.counters.readLatency.record(since(t0))
    return bytes
  }

  /**
   * After a read that failed verification: whether the file is another writer's valid object
   * of another size under this key (a shared directory, another diskCodec), written temp +
   * rename since it was indexed. Then it is indexed as it is now (this read is a miss),
   * or dropped from the index if another instance owns it, and not deleted as corrupt.
   */
  async #reindexReplaced(hex: string, entry: FileEntry): Promise<boolean> {
    const now = await this.#checkHeader(this.#pathOf(hex), hex)
    if (now === 'foreign') {
      if (this.#index.get(hex) === entry) this.#dropIndex(hex)
      return true
    }
    if (typeof now !== 'object' || now.bytes === entry.bytes) return false
    if (this.#index.get(hex) === entry) {
      this.#addUsed(now.bytes - entry.bytes)
      entry.bytes = now.bytes
      this.#keepHeader(entry, now.header)
      await this.#evictToBudget(0)
    }
    return true
  }

  async #readFile(
    hex: string,
    entry: FileEntry,
    into: Uint8Array | undefined,
    sink: ReadSink | undefined,
    handOn: () => void,
    demand: boolean,
  ): Promise<VerifiedRead | undefined> {
    const size = entry.bytes
    // One buffer, one read call per pass: readFile() would read in 512 KiB pieces. `into` was
    // sized when the read was queued: a file re-indexed larger since (#reindexReplaced) gets its own.
    const buf = into && into.byteLength >= size ? into.subarray(0, size) : new Uint8Array(size)
    if (this.#native && buf.byteOffset % 4096 === 0) {
      try {
        try {
          return await this.#readVerifiedDirect(hex, buf, size, sink, entry.header, handOn, demand)
        } catch (e) {
          if (!(e instanceof StaleHeader)) throw e
          // Replaced since it was indexed: once more with the header the file has now,
          // which is then the one indexed.
          this.#keepHeader(entry, undefined)
          const read = await this.#readVerifiedDirect(hex, buf, size, sink, undefined, handOn, demand)
          if (read && this.#index.get(hex) === entry) this.#keepHeader(entry, headerOf(read.bytes))
          return read
        }
      } catch (e) {
        if (isKvgateError(e) && e.code.startsWith('ERR_FORMAT_')) throw e
        return this.#readError(hex, entry, e)
      }
    }
    const bytes = await this.#readBuffered(hex, entry, buf, size)
    return bytes ? { bytes, header: undefined } : undefined
  }

  /**
   * Reads through the addon with verification off this thread: the object in
   * SEGMENT_BYTES ranges, SEGMENTS_IN_FLIGHT at once (after a small header read when the index holds
   * no header for it), and the libuv worker
   * that read each range CRC-32s the section pieces in it (readFileCrc). Here only
   * the per-piece CRCs are joined (crc32Combine) and compared with the header's, so
   * every byte is verified before it is served while the JS thread stays free.
   * Throws FormatError on a corrupt object, like the verify pass it replaces.
   */
  async #readVerifiedDirect(
    hex: string,
    buf: Uint8Array,
    size: number,
    sink: ReadSink | undefined,
    indexed: Uint8Array | undefined,
    handOn: () => void,
    demand: boolean,
  ): Promise<VerifiedRead | undefined> {
    const native = this.#native!
    const path = this.#pathOf(hex)
    const maxBytes = Math.max(size, DEFAULT_MAX_CHUNK_BYTES)
    const headerCopy = indexed ?? (await this.#readHeader(path, buf, size))
    if (!headerCopy) return undefined
    const header = decodeHeader(headerCopy, { maxBytes })
    if (header.totalBytes !== size) {
      // The file's size is what the index holds: a header that disagrees is corrupt.
      throw new FormatError(
        'ERR_FORMAT_TRUNCATED',
        `file is ${size} bytes, its header says ${header.totalBytes}`,
      )
    }
    const sections = header.sections
    const crcs = new Uint32Array(sections.length)
    // Sections a worker verified and copied into the sink whole.
    const sinkAt = sink && !sink.gate.closed ? sink.accept(header) : undefined
    const copied = new Uint8Array(sinkAt === undefined ? 0 : sections.length)
    type Segment = { r: ReadFileCrcResult; off: number; length: number; first: number; count: number }
    let section = 0
    const starts = segmentStarts(header, size)
    const grants: { withdraw: () => void }[] = []
    let issued = 0
    // Set once a range failed or the read ended: a range granted its turn after that is not read
    // (a failed range's place goes to the next waiter, often this object's next range, which
    // would read, and copy into the caller's sink, bytes of an object already a miss).
    let abandoned = false
    const read = (k: number): Promise<Segment> => {
      const off = starts[k]!
      const end = starts[k + 1] ?? size
      const length = end - off
      // Sections overlapping [off, end), as offsets into this read.
      while (section < sections.length && sections[section]!.offset + sections[section]!.length <= off)
        section++
      const first = section
      const ranges: [number, number][] = []
      const expected: (number | undefined)[] = []
      for (let i = first; i < sections.length && sections[i]!.offset < end; i++) {
        const s = sections[i]!
        ranges.push([Math.max(s.offset, off) - off, Math.min(s.offset + s.length, end) - off])
        // Only a section read whole can be verified, hence copied, by the worker.
        expected.push(s.offset >= off && s.offset + s.length <= end ? s.crc32 : undefined)
      }
      const copyTo =
        sinkAt === undefined
          ? undefined
          : { into: sink!.into, fileOffset: sinkAt, expected, gate: sink!.gate }
      // Issued once a segment in flight over every read of this tier ends (#segments).
      const grant = this.#segments.take(demand)
      grants.push(grant)
      const segment = grant.ready
        .then((granted) => {
          if (!granted) throw new KvgateError('ERR_CLOSED', 'read abandoned')
          // After close() the buffer may be its owner's no more (KVCache.close() frees L1).
          if (this.#closed || abandoned) {
            grant.release()
            throw new KvgateError('ERR_CLOSED', this.#closed ? 'closed' : 'read abandoned')
          }
          if (++issued === starts.length) handOn()
          return native
            .readFileCrc(path, buf.subarray(off, end), ranges, { fileOffset: off, length, copyTo })
            .then(
              (r) => {
                grant.release()
                return r
              },
              (e: unknown) => {
                // Before the place is handed on: the waiter it wakes sees the object failed.
                abandoned = true
                grant.release()
                throw e
              },
            )
        })
        .then((r) => ({ r, off, length, first, count: ranges.length }))
      // Awaited in file order, so a later segment can fail first (a file gone: every read's open
      // fails, on pool threads, in any order): handled from the start, its error still seen where
      // it is awaited or settled below, never an unhandled rejection (which ends a Node process).
      segment.catch(() => {})
      return segment
    }
    const inflight: Promise<Segment>[] = []
    let next = 0
    const refill = () => {
      while (inflight.length < SEGMENTS_IN_FLIGHT && next < starts.length) inflight.push(read(next++))
    }
    refill()
    try {
      while (inflight.length > 0) {
        const { r, off, length, first, count } = await inflight.shift()!
        refill()
        if (r.direct) this.#directReads++
        if (r.bytes !== length) this.#checkLength(off + r.bytes, size)
        if (off === 0 && !equalPrefix(buf, headerCopy)) {
          // Not the header the index holds: the file was replaced since, read it afresh.
          if (indexed) throw new StaleHeader()
          // The file was replaced between the header read and this one: not one object.
          throw new FormatError('ERR_FORMAT_BAD_FIELD', 'header changed while the object was read')
        }
        // Segments are joined in file order: a section's pieces arrive one after the other.
        for (let k = 0; k < count; k++) {
          const i = first + k
          const s = sections[i]!
          const pieceLength = Math.min(s.offset + s.length, off + length) - Math.max(s.offset, off)
          crcs[i] = crc32Combine(crcs[i]!, r.crcs[k]!, pieceLength)
          if (r.copied[k] === 1) copied[i] = 1
        }
      }
      sections.forEach((s, i) => {
        if (crcs[i] !== s.crc32)
          throw new FormatError('ERR_FORMAT_CHECKSUM', `section ${i} checksum mismatch`)
      })
      if (sinkAt !== undefined) this.#finishSink(sink!, sinkAt, buf, copied, sections)
      return { bytes: buf, header }
    } finally {
      // Segments not issued yet never will be; never leave a read writing into `buf` after we
      // return (corrupt object, I/O error).
      abandoned = true
      for (const g of grants) g.withdraw()
      await Promise.allSettled(inflight)
    }
  }

  /**
   * The object verified: the sections no worker copied (split across reads) are
   * copied here, on this thread, while the gate is open (its owner still waits).
   */
  #finishSink(
    sink: ReadSink,
    at: number,
    buf: Uint8Array,
    copied: Uint8Array,
    sections: ChunkHeader['sections'],
  ): void {
    if (sink.gate.closed) return
    sections.forEach((s, i) => {
      if (copied[i] !== 1) sink.into.set(buf.subarray(s.offset, s.offset + s.length), s.offset - at)
    })
    sink.copied = true
    this.#sinkReads++
  }

  /**
   * The file's header bytes: one aligned block, a second read only for a header longer
   * than that. Throws ERR_FORMAT_TRUNCATED when the file is shorter than indexed.
   */
  async #readHeader(path: string, buf: Uint8Array, size: number): Promise<Uint8Array | undefined> {
    let got = await this.#readHead(path, buf, Math.min(size, HEADER_READ_BYTES))
    if (got < Math.min(size, HEADER_READ_BYTES)) this.#checkLength(got, size)
    const headerBytes = readHeaderLength(buf.subarray(0, got))
    if (headerBytes > got && got < size) {
      got = await this.#readHead(path, buf, Math.min(size, alignUp(headerBytes)))
    }
    return buf.slice(0, Math.min(got, headerBytes))
  }

  /** Reads the first `length` bytes of the file into `buf` (through the addon); resolves the bytes read. */
  async #readHead(path: string, buf: Uint8Array, length: number): Promise<number> {
    const r = await this.#native!.readFileDirect(path, buf.subarray(0, length), { length })
    return r.bytes
  }

  async #readBuffered(
    hex: string,
    entry: FileEntry,
    buf: Uint8Array,
    size: number,
  ): Promise<Uint8Array | undefined> {
    if (this.#addon) {
      // Buffered, through the addon all the same: it marks pinned memory (an L1 slot) busy while
      // the read runs, so L1 freed at close() (freePinned) refuses, the GC frees it after the
      // read, and no pread lands in freed or reused memory. (fs reads are invisible to it.)
      let got: number
      try {
        got = (await this.#addon.readFileDirect(this.#pathOf(hex), buf, { direct: 'off', length: size }))
          .bytes
      } catch (e) {
        return this.#readError(hex, entry, e)
      }
      this.#checkLength(got, size)
      return buf
    }
    let fh: Awaited<ReturnType<typeof open>> | undefined
    let off = 0
    try {
      // O_NONBLOCK: a FIFO put in the file's place reads as empty (a corrupt miss) instead
      // of blocking this queue slot and a pool thread until a writer opens it.
      fh = await open(this.#pathOf(hex), fsc.O_RDONLY | fsc.O_NONBLOCK)
      while (off < size) {
        const { bytesRead } = await fh.read(buf, off, size - off, off)
        if (bytesRead === 0) break
        off += bytesRead
      }
    } catch (e) {
      return this.#readError(hex, entry, e)
    } finally {
      await fh?.close()
    }
    this.#checkLength(off, size)
    return buf
  }

  /**
   * A file shorter than indexed is corrupt (a read ends short only at end of file; an I/O
   * error throws): get() counts it and deletes it, or it would stay on disk uncounted.
   */
  #checkLength(got: number, size: number): void {
    if (got !== size)
      throw new FormatError('ERR_FORMAT_TRUNCATED', `file is ${got} bytes, ${size} were indexed`)
  }

  #readError(hex: string, entry: FileEntry, e: unknown): undefined {
    const code = (e as { code?: string; syscode?: string }).syscode ?? (e as { code?: string }).code
    // Gone: the file this read looked for. One written under the key since is indexed anew.
    if (code !== 'ENOENT') this.counters.errors++
    else if (this.#index.get(hex) === entry) this.#dropIndex(hex)
    return undefined
  }

  /**
   * Writes a chunk object durably (temp, fsync, rename, directory fsync). Resolves false when
   * the chunk was present or the write failed (its directory fsync included); never rejects.
   */
  put(hex: string, object: Uint8Array, priority: IoPriority = 'put'): Promise<boolean> {
    if (this.#index.has(hex)) return Promise.resolve(false)
    const pending = this.#writing.get(hex)
    if (pending) return pending.then(() => false)
    if (object.byteLength > this.#budget) return Promise.resolve(false)
    const p = this.#queue
      .run(priority, () => this.#writeFile(hex, object))
      // The directory fsync runs outside the queue slot: concurrent ones share the
      // journal commit instead of holding the next write back.
      .then(async (r) => {
        if (!r.durable) return r.ok
        try {
          await r.durable
        } catch (e) {
          // Readable now but not known to survive a crash: not an acknowledged write.
          this.#writeFailed(e)
          return false
        }
        return r.ok
      })
      .catch(() => false) // closed: the write is dropped
      .finally(() => this.#writing.delete(hex))
    this.#writing.set(hex, p)
    return p
  }

  /** Writes temp + fsync + rename; `durable` settles once the directory entry is fsynced too. */
  async #writeFile(hex: string, object: Uint8Array): Promise<{ ok: boolean; durable?: Promise<void> }> {
    if (this.#index.has(hex)) return { ok: false }
    const t0 = performance.now()
    const subdir = join(this.dir, hex.slice(0, 2))
    const tmpName = beginTemp(hex)
    const tmp = join(subdir, tmpName)
    let fh: Awaited<ReturnType<typeof open>> | undefined
    let reserved = 0
    try {
      await this.#evictToBudget(object.byteLength)
      // No await since the eviction's last check: no other write slips in between.
      reserved = object.byteLength
      this.#shared.reserved += reserved
      // A new fan-out directory must itself survive a crash: fsync its parent once created.
      if ((await mkdir(subdir, { recursive: true })) !== undefined) await fsyncDir(this.dir)
      fh = await open(tmp, fsc.O_WRONLY | fsc.O_CREAT | fsc.O_EXCL, 0o644)
      let off = 0
      while (off < object.byteLength) {
        const { bytesWritten } = await fh.write(object, off, object.byteLength - off, off)
        off += bytesWritten
      }
      // Durable before visible: after a crash a renamed file is always complete.
      await fh.datasync()
      await fh.close()
      fh = undefined
      await rename(tmp, this.#pathOf(hex))
      this.#shared.reserved -= reserved
      reserved = 0
      const entry: FileEntry = { bytes: object.byteLength, used: useTime() }
      this.#index.set(hex, entry)
      this.#keepHeader(entry, headerOf(object))
      this.#addUsed(object.byteLength)
      this.counters.puts++
      this.counters.bytesWritten += object.byteLength
      this.counters.writeLatency.record(since(t0))
      // The rename is durable only once the directory entry is: fsync the directory.
      return { ok: true, durable: fsyncDir(subdir) }
    } catch (e) {
      this.#shared.reserved -= reserved
      this.#writeFailed(e)
      await fh?.close().catch(() => {})
      await unlink(tmp).catch(() => {})
      return { ok: false }
    } finally {
      endTemp(tmpName)
    }
  }

  #writeFailed(e: unknown): void {
    this.#writeErrors++
    this.counters.errors++
    this.#lastWriteError = `${(e as NodeJS.ErrnoException).code ?? 'ERR'}: ${(e as Error).message}`
  }

  async delete(hex: string): Promise<void> {
    if (!this.#dropIndex(hex)) return
    await unlink(this.#pathOf(hex)).catch(() => {})
  }

  /**
   * A caller found an object get() served to be corrupt (identity, a stream the codec refuses):
   * counted, and its file deleted only while the key is still indexed as the entry it was read
   * from. A verdict reached after an await applies to that file, not to one evicted and written
   * under the key since (intact: deleting it would lose a good chunk).
   */
  async discardCorrupt(hex: string, object: Uint8Array): Promise<void> {
    this.counters.corrupt++
    const entry = this.#servedFrom.get(object)
    if (entry) await this.#deleteEntry(hex, entry)
  }

  /**
   * A caller could not use an object get() served, for a reason that proves nothing about its
   * bytes (a decode that trapped or ran out of memory, its worker lost or hung): a counted
   * error, the file kept, up to MAX_FAILED_READS such reads of it; then it is deleted
   * (`unservableDropped`), as the file it was read from only (see discardCorrupt), so a later
   * store of the chunk can write it again.
   */
  async readFailed(hex: string, object: Uint8Array): Promise<void> {
    this.counters.errors++
    const entry = this.#servedFrom.get(object)
    if (!entry || this.#index.get(hex) !== entry) return
    entry.failedReads = (entry.failedReads ?? 0) + 1
    if (entry.failedReads < MAX_FAILED_READS) return
    this.#unservableDropped++
    await this.delete(hex)
  }

  /**
   * delete(), when the key is still indexed as `entry`: a read's verdict applies to the file it
   * read, not to one written under the key since (the read's file was evicted meanwhile).
   */
  async #deleteEntry(hex: string, entry: FileEntry): Promise<void> {
    if (this.#index.get(hex) === entry) await this.delete(hex)
  }

  /** Sets (or clears) an indexed file's header, within the memory for headers. */
  #keepHeader(entry: FileEntry, header: Uint8Array | undefined): void {
    this.#headerBytes -= entry.header?.byteLength ?? 0
    entry.header = undefined
    if (header && this.#headerBytes + header.byteLength <= this.#headerBudget) {
      entry.header = header
      this.#headerBytes += header.byteLength
    }
  }

  #dropIndex(hex: string): boolean {
    const e = this.#index.get(hex)
    if (!e) return false
    this.#keepHeader(e, undefined)
    this.#index.delete(hex)
    this.#addUsed(-e.bytes)
    return true
  }

  #addUsed(bytes: number): void {
    this.#used += bytes
    if (!this.#left) this.#shared.used += bytes
  }

  /** When this tier's least recently used file was last used (undefined when it holds none). */
  oldestUse(): number | undefined {
    for (const e of this.#index.values()) return e.used
    return undefined
  }

  /** The least recently used file here, when this tier holds one. */
  #evictOldest(): Promise<void> | undefined {
    const oldest = this.#index.keys().next().value as string | undefined
    if (oldest === undefined) return undefined
    this.counters.evictions++
    return this.delete(oldest)
  }

  /** Deletes least recently used files (of any tier sharing the budget) until `incoming` fits. */
  async #evictToBudget(incoming: number): Promise<void> {
    const b = this.#shared
    while (b.used + b.reserved + incoming > b.bytes) {
      const victim = b.oldest() ?? this
      const done = victim.#evictOldest()
      if (done === undefined) return
      await done
    }
  }

  /** Fails queued reads and writes (ERR_CLOSED inside: misses and dropped writes); running ones finish. */
  close(): void {
    this.#closed = true
    this.#queue.close()
    this.#staleTemps.close()
    // Its files stay on disk but leave the shared budget's count with it (a reopen counts them again).
    if (this.#left) return
    this.#left = true
    this.#shared.leave(this)
    this.#shared.used -= this.#used
  }

  /** Waits for queued writes (used by close() and tests). */
  async drain(): Promise<void> {
    while (this.#writing.size > 0) await Promise.allSettled([...this.#writing.values()])
  }

  stats(): DiskTierStats {
    return {
      dir: this.dir,
      capacityBytes: this.#budget,
      usedBytes: this.#used,
      files: this.#index.size,
      recoveredDiscarded: this.#discarded,
      foreignFiles: this.#foreign,
      unreadableFiles: this.#unreadable,
      directReads: this.#directReads,
      sinkReads: this.#sinkReads,
      indexedHeaderBytes: this.#headerBytes,
      writeErrors: this.#writeErrors,
      lastWriteError: this.#lastWriteError,
      unservableDropped: this.#unservableDropped,
      queued: this.#queue.pending,
    }
  }

  /** Size on disk of one chunk (for tests and the inspect command). */
  async fileBytes(hex: string): Promise<number | undefined> {
    try {
      return (await stat(this.#pathOf(hex))).size
    } catch {
      return undefined
    }
  }

  /** The header the index keeps for a file, if any (for tests and the inspect command). */
  indexedHeader(hex: string): Uint8Array | undefined {
    return this.#index.get(hex)?.header
  }

  pathOf(hex: string): string {
    return this.#pathOf(hex)
  }
}

/** Drops the headers of all but the most recently used files holding at most `budget` bytes of them. */
function keepNewestHeaders(scan: Scan, budget: number): void {
  scan.held.sort((a, b) => b.time - a.time)
  scan.headerBytes = 0
  let n = 0
  for (const f of scan.held) {
    if (scan.headerBytes + f.header!.byteLength > budget) break
    scan.headerBytes += f.header!.byteLength
    n++
  }
  for (const f of scan.held.splice(n)) f.header = undefined
}

/** fsync of a directory: makes the entries created or renamed in it durable. */
async function fsyncDir(dir: string): Promise<void> {
  const fh = await open(dir, 'r')
  try {
    await fh.sync()
  } finally {
    await fh.close()
  }
}

/** Whether the file's mtime is more than `ms` before this host's clock (false when it cannot be stat'ed). */
async function olderThan(path: string, ms: number): Promise<boolean> {
  try {
    return Date.now() - (await stat(path)).mtimeMs > ms
  } catch {
    return false
  }
}
