// An engine's KV tensor in host shared memory (a /dev/shm file the engine maps as a
// torch tensor): the agent maps it once and copies block runs as memory, else pread/pwrite.

import { closeSync, fstatSync, openSync, readSync, writeSync } from 'node:fs'
import type { NativeModule } from '../client/native-api.ts'
import { type CopyRows, forMerged, PLANE_FIELDS, rowsInside, rowsOf } from './copy-rows.ts'
import { AgentError } from './protocol.ts'

/**
 * A registered engine KV tensor. Runs are [tensorOffset, hostOffset, bytes] triples;
 * `gather` copies tensor → host, `scatter` host → tensor.
 */
export interface KvTensor {
  gather(runs: ArrayLike<number>, host: Uint8Array): void | Promise<void>
  scatter(host: Uint8Array, runs: ArrayLike<number>): void | Promise<void>
}

export class HostTensor implements KvTensor {
  readonly path: string
  readonly offset: number
  readonly bytes: number
  /** The file's identity (device and inode) when opened: tensors of one file share its size check (HostCopier). */
  readonly file: string
  #fd: number | undefined
  /** The tensor's bytes through a MAP_SHARED mapping (one per registration), when the addon has mapFile. */
  #map: Buffer | undefined
  #mapped: ArrayBuffer | undefined
  #native: NativeModule | undefined
  /** The addon copies a layer's runs in one call (else one Buffer#copy per run). */
  #copyRuns: NativeModule['copyRuns'] | undefined
  /** The addon copies a layer's runs as 3-D row sets (a strided view's 4,096 runs as a few sets). */
  #copyRows: NativeModule['copyPlanes'] | undefined
  /** Runs in the addon's [dst, src, bytes] order, reused: copies are synchronous. */
  #scratch = new Float64Array(0)

  /**
   * With `native` (an addon that has mapFile) the tensor is mapped; else every copy is a syscall.
   * A tensor larger than one mapping can be (MAX_PINNED_BYTES, 4 GiB: one external ArrayBuffer in
   * Node 20) is copied with syscalls too, rather than its registration refused.
   */
  constructor(path: string, offset: number, bytes: number, native?: NativeModule) {
    if (typeof path !== 'string' || path.length === 0 || path.includes('\0'))
      throw new AgentError('ERR_INVALID_ARGUMENT', 'invalid tensor path')
    let fd: number
    try {
      fd = openSync(path, 'r+')
    } catch (e) {
      throw new AgentError('ERR_IO', `cannot open ${path}: ${(e as Error).message}`)
    }
    let file: string
    try {
      // bigint: an inode past 2^53 (overlayfs xino puts a layer id in its top bits) would round
      // as a number, and two files would share one size check (HostCopier).
      const st = fstatSync(fd, { bigint: true })
      if (!st.isFile()) throw new AgentError('ERR_INVALID_ARGUMENT', `${path} is not a regular file`)
      file = `${st.dev}:${st.ino}`
      if (Number(st.size) < offset + bytes) {
        throw new AgentError(
          'ERR_LAYOUT',
          `${path} is ${st.size} bytes; the tensor needs ${bytes} bytes at offset ${offset}`,
        )
      }
    } catch (e) {
      closeSync(fd)
      throw e
    }
    this.path = path
    this.offset = offset
    this.bytes = bytes
    this.file = file
    this.#fd = fd
    if (native?.mapFileAvailable() && bytes <= native.MAX_PINNED_BYTES) {
      try {
        const ab = native.mapFile(path, { offset, length: bytes, writable: true })
        this.#map = Buffer.from(ab)
        this.#mapped = ab
        this.#native = native
        if (native.copyRunsAvailable()) this.#copyRuns = native.copyRuns
        if (native.copyRowsAvailable()) this.#copyRows = native.copyPlanes
      } catch (e) {
        closeSync(fd)
        throw new AgentError('ERR_IO', `cannot map ${path}: ${(e as Error).message}`)
      }
    }
  }

  /** Whether copies go through the mapping (else pread/pwrite). */
  get mapped(): boolean {
    return this.#map !== undefined
  }

  /**
   * The mapping, after checking the file still holds the tensor: touching pages an engine
   * truncated away would kill the agent (SIGBUS); one fstat per copy turns that into an error.
   */
  #mapOrThrow(): Buffer | undefined {
    return this.checkedMap()
  }

  /**
   * The mapping (undefined when unmapped reads/writes are used), after the size check of
   * {@link #mapOrThrow}. Unmapped copies are checked too: a pwrite past a shrunk file's end
   * would grow the engine's file back (in /dev/shm: memory) with bytes nobody reads.
   */
  checkedMap(): Buffer | undefined {
    this.checkSize(this.offset + this.bytes)
    return this.#map
  }

  /** Throws ERR_IO unless the file still holds `end` bytes (ERR_CLOSED once closed): one fstat. */
  checkSize(end: number): void {
    if (fstatSync(this.#fdOrThrow()).size < end) {
      throw new AgentError('ERR_IO', `${this.path} shrank below the registered tensor`)
    }
  }

  /** The mapping without the size check (the caller made it for the whole file: HostCopier); ERR_CLOSED once closed. */
  openMap(): Buffer | undefined {
    this.#fdOrThrow()
    return this.#map
  }

  #fdOrThrow(): number {
    if (this.#fd === undefined) throw new AgentError('ERR_CLOSED', `tensor ${this.path} is closed`)
    return this.#fd
  }

  /** Copies `dst.length` bytes from tensor offset `at` into `dst`. */
  read(at: number, dst: Uint8Array): void {
    const fd = this.#fdOrThrow()
    let done = 0
    while (done < dst.length) {
      const n = readSync(fd, dst, done, dst.length - done, this.offset + at + done)
      if (n <= 0) throw new AgentError('ERR_IO', `short read from ${this.path} at ${this.offset + at + done}`)
      done += n
    }
  }

  /** Copies `src` into the tensor at offset `at`. */
  write(at: number, src: Uint8Array): void {
    const fd = this.#fdOrThrow()
    let done = 0
    while (done < src.length) {
      done += writeSync(fd, src, done, src.length - done, this.offset + at + done)
    }
  }

  gather(runs: ArrayLike<number>, host: Uint8Array): void {
    const map = this.#mapOrThrow()
    if (map !== undefined && this.#copyRows) {
      this.#copyRows(host, map, checkedRows(runs, this.bytes, host.length).toSlab)
      return
    }
    // pread too: `subarray` clamps a run past the buffer, and the file goes on past the tensor.
    checkRuns(runs, this.bytes, host.length)
    if (map === undefined) {
      forMerged(runs, (t, h, n) => this.read(t, host.subarray(h, h + n)))
      return
    }
    if (this.#copyRuns) {
      this.#copyRuns(host, map, this.#ordered(runs, 1, 0))
      return
    }
    // Buffer#copy: a memmove with offsets, no view allocated per run.
    const dst = Buffer.from(host.buffer, host.byteOffset, host.byteLength)
    forMerged(runs, (t, h, n) => map.copy(dst, h, t, t + n))
  }

  scatter(host: Uint8Array, runs: ArrayLike<number>): void {
    const map = this.#mapOrThrow()
    if (map !== undefined && this.#copyRows) {
      this.#copyRows(map, host, checkedRows(runs, this.bytes, host.length).toTensor)
      return
    }
    checkRuns(runs, this.bytes, host.length)
    if (map === undefined) {
      forMerged(runs, (t, h, n) => this.write(t, host.subarray(h, h + n)))
      return
    }
    if (this.#copyRuns) {
      this.#copyRuns(map, host, this.#ordered(runs, 0, 1))
      return
    }
    const src = Buffer.from(host.buffer, host.byteOffset, host.byteLength)
    forMerged(runs, (t, h, n) => src.copy(map, t, h, h + n))
  }

  /** `runs` ([tensor, host, bytes]) as the addon's [dst, src, bytes]: `dst`/`src` pick the fields. */
  #ordered(runs: ArrayLike<number>, dst: 0 | 1, src: 0 | 1): Float64Array {
    if (this.#scratch.length !== runs.length) this.#scratch = new Float64Array(runs.length)
    const out = this.#scratch
    for (let i = 0; i < runs.length; i += 3) {
      out[i] = runs[i + dst]!
      out[i + 1] = runs[i + src]!
      out[i + 2] = runs[i + 2]!
    }
    return out
  }

  /** Unmaps and closes; later copies throw ERR_CLOSED. Idempotent. */
  close(): void {
    const ab = this.#mapped
    this.#map = undefined
    this.#mapped = undefined
    if (ab !== undefined) this.#native?.unmapFile(ab)
    if (this.#fd !== undefined) closeSync(this.#fd)
    this.#fd = undefined
  }
}

type CopyRunsAsync = NativeModule['copyRunsAsync']
type CopyRowsAsync = NativeModule['copyPlanesAsync']

/** One layer of a load: the slabs of its first `chunks` chunks. */
export interface LayerSlabs {
  layer: number
  chunks: number
  slabs: readonly Uint8Array[]
}

/**
 * Copies between an engine's mapped layer tensors and the agent's chunk tensors with the
 * addon's copyRunsAsync: off the JS thread (lookups and other engines' requests are
 * answered meanwhile) and split across `threads` pool threads. A save's whole chunk (every
 * layer) is one call; a load's group of layers (every chunk) is one call. The native call holds the buffers
 * (references, pinned-block and mapping busy marks) until its promise settles, and its
 * promise only settles once every byte moved: the caller's await is the one place that
 * says when the L1 slot and the engine's blocks are free again.
 */
export class HostCopier {
  readonly threads: number
  readonly #tensors: HostTensor[]
  /**
   * Per file the tensors lie in, one of them and the end of the furthest: a copy checks each
   * file's size once (an engine's layers often share one file: 32 fstats were ~0.07 ms of a save).
   */
  readonly #files: { tensor: HostTensor; end: number; checked: number }[]
  /** Index in #files of each layer's file. */
  readonly #fileOf: number[]
  /** Numbers one copy's checks (#files[i].checked: the copy that last checked file i). */
  #copies = 0
  readonly #copy: CopyRunsAsync
  /** The addon's 3-D form, when it has one: a chunk's runs as a few row sets per layer. */
  readonly #copyRows: CopyRowsAsync | undefined
  #scratch = new Float64Array(0)

  private constructor(
    tensors: HostTensor[],
    copy: CopyRunsAsync,
    copyRows: CopyRowsAsync | undefined,
    threads: number,
  ) {
    this.#tensors = tensors
    this.#copy = copy
    this.#copyRows = copyRows
    this.threads = threads
    const index = new Map<string, number>()
    this.#files = []
    this.#fileOf = tensors.map((t) => {
      let i = index.get(t.file)
      if (i === undefined) {
        i = this.#files.push({ tensor: t, end: 0, checked: 0 }) - 1
        index.set(t.file, i)
      }
      const f = this.#files[i]!
      f.end = Math.max(f.end, t.offset + t.bytes)
      return i
    })
  }

  /**
   * Before a copy: the files of `layers` (all: undefined) still hold their tensors, one fstat
   * per file (touching pages an engine truncated away would fault; the addon's guard turns that
   * into an error, this into one before any byte moves).
   */
  #checkFiles(layers?: readonly LayerSlabs[]): void {
    const copy = ++this.#copies
    const n = layers === undefined ? this.#tensors.length : layers.length
    for (let i = 0; i < n; i++) {
      const f = this.#files[this.#fileOf[layers === undefined ? i : layers[i]!.layer]!]!
      if (f.checked === copy) continue
      f.checked = copy
      f.tensor.checkSize(f.end)
    }
  }

  /** Tensor `layer`'s mapping, checked open (the sizes by #checkFiles). */
  #map(layer: number): Buffer {
    return this.#tensors[layer]!.openMap()!
  }

  /** A copier for `layers` when every one is a mapped host tensor and the addon has copyRunsAsync. */
  static for(
    layers: readonly KvTensor[],
    native: NativeModule | undefined,
    threads: number,
  ): HostCopier | undefined {
    if (!native?.copyRunsAsyncAvailable()) return undefined
    const hosts: HostTensor[] = []
    for (const t of layers) {
      if (!(t instanceof HostTensor) || !t.mapped) return undefined
      hosts.push(t)
    }
    return new HostCopier(
      hosts,
      native.copyRunsAsync,
      native.copyRowsAvailable() ? native.copyPlanesAsync : undefined,
      threads,
    )
  }

  #runs(n: number): Float64Array {
    if (this.#scratch.length < n) this.#scratch = new Float64Array(n)
    return this.#scratch.length === n ? this.#scratch : this.#scratch.subarray(0, n)
  }

  /**
   * Every layer's blocks into one chunk tensor: layer l's runs ([tensor, slab, bytes])
   * land in `dst[l * slab ...]`. Checked before any byte moves; one native call.
   */
  gatherChunk(runs: ArrayLike<number>, dst: Uint8Array, slab: number): Promise<void> {
    const layers = this.#tensors.length
    if (dst.length < layers * slab) {
      throw new AgentError(
        'ERR_INVALID_ARGUMENT',
        `chunk tensor of ${dst.length} bytes is short of ${layers} slabs`,
      )
    }
    this.#checkFiles()
    const buffers: Uint8Array[] = [dst]
    if (this.#copyRows) {
      const sets = rowsOf(runs)
      const rows = sets.toSlab
      const out = this.#runs((rows.length / PLANE_FIELDS) * (PLANE_FIELDS + 2) * layers)
      let o = 0
      for (let l = 0; l < layers; l++) {
        const t = this.#tensors[l]!
        const map = this.#map(l)
        checkRows(sets, runs, t.bytes, slab)
        buffers.push(map)
        for (let i = 0; i < rows.length; i += PLANE_FIELDS) {
          out[o++] = 0
          out[o++] = l * slab + rows[i]!
          out[o++] = l + 1
          for (let k = 1; k < PLANE_FIELDS; k++) out[o++] = rows[i + k]!
        }
      }
      return this.#copied(this.#copyRows(buffers, out, this.threads))
    }
    const out = this.#runs((runs.length / 3) * 5 * layers)
    let o = 0
    for (let l = 0; l < layers; l++) {
      const t = this.#tensors[l]!
      const map = this.#map(l)
      checkRuns(runs, t.bytes, slab)
      buffers.push(map)
      for (let i = 0; i < runs.length; i += 3) {
        out[o++] = 0
        out[o++] = l * slab + runs[i + 1]!
        out[o++] = l + 1
        out[o++] = runs[i]!
        out[o++] = runs[i + 2]!
      }
    }
    return this.#copied(this.#copy(buffers, out, this.threads))
  }

  /**
   * A copy that faulted because an engine shrank its file while the copy ran (the addon's
   * SIGBUS guard: errno EFAULT) is the engine's I/O failure, like a shrink seen before the copy.
   */
  #copied(copy: Promise<void>): Promise<void> {
    return copy.catch((e: unknown) => {
      if ((e as { syscode?: unknown }).syscode !== 'EFAULT') throw e
      const paths = [...new Set(this.#tensors.map((t) => t.path))].join(', ')
      throw new AgentError(
        'ERR_IO',
        `an engine KV file shrank during a copy, or its filesystem is full (${paths}): ${(e as Error).message}`,
      )
    })
  }

  /**
   * Layer slabs into the engine's blocks, several layers in one call: for each entry, chunk
   * c's slab goes through `runsByChunk[c]` ([tensor, slab, bytes]) into that layer's tensor.
   */
  scatterLayers(group: readonly LayerSlabs[], runsByChunk: readonly ArrayLike<number>[]): Promise<void> {
    this.#checkFiles(group)
    const copyRows = this.#copyRows
    // With the 3-D form: each chunk's runs as row sets, made once for every layer of the group.
    const sets: CopyRows[] = []
    const setsOf = (c: number) => (sets[c] ??= rowsOf(runsByChunk[c]!))
    let n = 0
    for (const g of group)
      for (let c = 0; c < g.chunks; c++)
        n += copyRows
          ? (setsOf(c).toTensor.length / PLANE_FIELDS) * (PLANE_FIELDS + 2)
          : (runsByChunk[c]!.length / 3) * 5
    const out = this.#runs(n)
    // One native call names at most ADDON_MAX_BUFFERS buffers, and a layer of a load's most
    // chunks names one more (its mapping): such a group is cut into several calls, every
    // run checked before the first one starts.
    const calls: { buffers: Uint8Array[]; runs: Float64Array }[] = []
    let buffers: Uint8Array[] = []
    let from = 0
    let o = 0
    const cut = () => {
      calls.push({ buffers, runs: out.subarray(from, o) })
      buffers = []
      from = o
    }
    for (const g of group) {
      const t = this.#tensors[g.layer]!
      const map = this.#map(g.layer)
      if (buffers.length + 2 > ADDON_MAX_BUFFERS) cut()
      let mapAt = buffers.length
      buffers.push(map)
      for (let c = 0; c < g.chunks; c++) {
        const runs = runsByChunk[c]!
        const slab = g.slabs[c]!
        if (copyRows) checkRows(setsOf(c), runs, t.bytes, slab.length)
        else checkRuns(runs, t.bytes, slab.length)
        if (buffers.length === ADDON_MAX_BUFFERS) {
          cut()
          mapAt = 0
          buffers.push(map)
        }
        const slabAt = buffers.length
        buffers.push(slab)
        if (copyRows) {
          const rows = setsOf(c).toTensor
          for (let i = 0; i < rows.length; i += PLANE_FIELDS) {
            out[o++] = mapAt
            out[o++] = rows[i]!
            out[o++] = slabAt
            for (let k = 1; k < PLANE_FIELDS; k++) out[o++] = rows[i + k]!
          }
          continue
        }
        for (let i = 0; i < runs.length; i += 3) {
          out[o++] = mapAt
          out[o++] = runs[i]!
          out[o++] = slabAt
          out[o++] = runs[i + 1]!
          out[o++] = runs[i + 2]!
        }
      }
    }
    cut()
    const copy = copyRows ?? this.#copy
    if (calls.length === 1) return this.#copied(copy(calls[0]!.buffers, calls[0]!.runs, this.threads))
    return this.#copied(allCopies(calls.map((k) => () => copy(k.buffers, k.runs, this.threads))))
  }
}

/** Buffers one copyRunsAsync call may name (the addon refuses more). */
const ADDON_MAX_BUFFERS = 65_536

/**
 * Starts every copy and settles once all of them did (rejecting with the first failure):
 * never while one still runs, even when a later one cannot start (then after the started ones).
 */
async function allCopies(starts: (() => Promise<void>)[]): Promise<void> {
  const started: Promise<void>[] = []
  let failure: { e: unknown } | undefined
  for (const start of starts) {
    try {
      started.push(start())
    } catch (e) {
      failure = { e }
      break
    }
  }
  const settled = await Promise.allSettled(started)
  if (failure) throw failure.e
  for (const r of settled) if (r.status === 'rejected') throw r.reason
}

/**
 * Buffer#copy clamps a range that runs past either end instead of failing: a run the
 * engine computed wrongly must be an error, as a short pread is, never a partial copy.
 */
function checkRuns(runs: ArrayLike<number>, tensorBytes: number, hostBytes: number): void {
  for (let i = 0; i < runs.length; i += 3) {
    const t = runs[i]!
    const h = runs[i + 1]!
    const n = runs[i + 2]!
    if (!(t >= 0 && h >= 0 && n >= 0 && t + n <= tensorBytes && h + n <= hostBytes)) {
      throw new AgentError(
        'ERR_INVALID_ARGUMENT',
        `run [${t}, ${h}, ${n}] is outside the tensor or the buffer`,
      )
    }
  }
}

/**
 * The row sets of `runs` after checkRuns' checks: O(1) per layer from the sets' bounds, and
 * checkRuns itself (its error names the bad run) when they fail.
 */
function checkedRows(runs: ArrayLike<number>, tensorBytes: number, hostBytes: number): CopyRows {
  const sets = rowsOf(runs)
  checkRows(sets, runs, tensorBytes, hostBytes)
  return sets
}

function checkRows(sets: CopyRows, runs: ArrayLike<number>, tensorBytes: number, hostBytes: number): void {
  if (rowsInside(sets, tensorBytes, hostBytes)) return
  checkRuns(runs, tensorBytes, hostBytes)
  // checkRuns passes what the sets' bounds refuse only for a run that is not a number.
  throw new AgentError('ERR_INVALID_ARGUMENT', 'a run is outside the tensor or the buffer')
}
