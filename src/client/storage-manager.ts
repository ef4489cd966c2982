// Policy of the tiers: what goes where. Write-all on store (L1 now, L2/L4 in the
// background for whatever each lacks), waterfall reads with promotion, deduplicated fetches.
// Moving bytes is plumbing elsewhere: ChunkReader (reads below L1), WriteBehind (writes below L1).

import { KvgateError } from '../core/errors.ts'
import { type ChunkKey, fromHex } from '../core/keys.ts'
import { chunkBytes, type KvGeometry, layerSlabBytes } from '../core/layout.ts'
import type { CalibrationStore } from './calibration-store.ts'
import type { ChunkCodecName, ChunkIdentity } from './chunk-codec.ts'
import { ChunkReader, type Placed, type TensorSink } from './chunk-reader.ts'
import { CodecPool } from './codec-pool.ts'
import type { IoPriority } from './io-queue.ts'
import { RemoteLayers } from './remote-layers.ts'
import type { DiskTier } from './tiers/disk.ts'
import type { MemoryHandle, MemoryTier } from './tiers/memory.ts'
import type { RemoteTier } from './tiers/remote.ts'
import { type HeldChunk, WriteBehind, type WriteBehindStats } from './write-behind.ts'

export type TierName = 'memory' | 'disk' | 'remote'

export interface StorageManagerOptions {
  geometry: KvGeometry
  chunkTokens: number
  namespaceId: Uint8Array
  memory: MemoryTier
  disk?: DiskTier | undefined
  remote?: RemoteTier | undefined
  /** How L2 files are encoded. @default 'raw' */
  diskCodec?: 'raw' | 'lossless'
  /** How chunks travel to L4. @default 'raw' */
  remoteCodec?: ChunkCodecName
  /** kvgate codec quality for L4 (1 smallest .. 9 closest). @default the codec's default */
  remoteQuality?: number
  /** Chunks fetched from lower tiers at once per retrieve or prefetch. @default 8 */
  fetchConcurrency?: number
  /** Layers per `?layers=a-b` request in retrieveLayers. @default ceil(layers / 4) */
  layersPerRequest?: number
  /** Where lossless/kvgate encoding and decoding run. @default a new CodecPool */
  codec?: CodecPool
  /** Bytes of chunks held for background L2/L4 writes at once; beyond, writes are shed (counted). @default 512 MiB */
  writeBehindBytes?: number
  /** L2 writes (encode + file write) running at once. @default 2 */
  diskWriteConcurrency?: number
  /** Default deadline of one retrieve, ms: past it the remaining chunks are a miss. @default 10000 */
  retrieveDeadlineMs?: number
  /** The namespace's calibration objects (lossy L4 encodes, v2 decodes); none: v2 objects are misses. */
  calibrations?: CalibrationStore | undefined
  /** Lossy L4 encodes use the namespace's calibration (remote.calibration not false). @default true */
  encodeCalibrated?: boolean
}

/** A chunk tensor a reader may copy from until release(). */
export type ChunkHandle = MemoryHandle

export interface StoreOutcome {
  /** Chunks newly written to L1. */
  stored: number
  /** Chunks L1 held already. */
  present: number
  /** Chunks L1 could not take (full of pinned chunks); they still go to L2/L4 within the write-behind budget. */
  skipped: number
}

/**
 * One layer of retrieveLayers. The contract: a chunk's KV is valid only if it is
 * covered in EVERY batch, and `chunks` never grows from one batch to the next, so
 * the batch of the last layer (`layer === layers - 1`) says what was served:
 * its `tokens` leading tokens (whole chunks) are valid, the caller recomputes the
 * rest. Slabs handed out for a chunk that a later batch drops are not valid KV.
 * Only chunks that arrived whole and verified are made resident in L1.
 */
export interface LayerBatch {
  layer: number
  /** Leading chunks whose slab for this layer (and every earlier one) is valid; never grows. */
  chunks: number
  /** Tokens those chunks cover (the end of chunk `chunks - 1`; 0 when none). */
  tokens: number
  /**
   * Layer slabs ([K|V][token][kvHead][headDim]) of chunks 0..chunks-1. Valid until the
   * generator finishes (its finally releases the pins and reservations behind them: after the
   * item past the last layer, on return(), or when it throws), so a caller may still copy an
   * earlier item's slabs while it asks for the next ones (the agent's threaded loads do).
   */
  slabs: Uint8Array[]
}

export interface RetrieveRun {
  /** Leading chunks written. */
  served: number
  /** True when the deadline cut the retrieve short. */
  timedOut: boolean
}

export class StorageManager {
  readonly geometry: KvGeometry
  readonly chunkTokens: number
  readonly chunkBytes: number
  readonly memory: MemoryTier
  readonly disk: DiskTier | undefined
  readonly remote: RemoteTier | undefined
  readonly codec: CodecPool
  readonly calibrations: CalibrationStore | undefined
  readonly retrieveDeadlineMs: number
  /** retrieveLayers runs cut short by the deadline (a chunk or layer group still awaited then). */
  layerRetrieveTimeouts = 0
  readonly #nsId: Uint8Array
  readonly #fetchConcurrency: number
  readonly #layersPerRequest: number
  readonly #reader: ChunkReader
  readonly #writes: WriteBehind
  readonly #inflight = new Map<string, Promise<Placed | undefined>>()
  readonly #background = new Set<Promise<unknown>>()
  #closed = false
  /**
   * Called on close(): operations waiting on a slow tier stop waiting. A set each Deadline
   * leaves when cleared, not a promise raced against: a race against a promise pending for
   * the cache's whole life kept every call's reaction (~2 KiB a retrieve) until close().
   */
  readonly #closing: CloseSignal

  constructor(opts: StorageManagerOptions) {
    this.geometry = opts.geometry
    this.chunkTokens = opts.chunkTokens
    this.chunkBytes = chunkBytes(opts.geometry, opts.chunkTokens)
    this.memory = opts.memory
    this.disk = opts.disk
    this.remote = opts.remote
    this.#nsId = opts.namespaceId
    this.#fetchConcurrency = Math.max(1, opts.fetchConcurrency ?? 8)
    this.#layersPerRequest = Math.max(1, opts.layersPerRequest ?? Math.ceil(opts.geometry.layers / 4))
    this.retrieveDeadlineMs = opts.retrieveDeadlineMs ?? 10_000
    this.#closing = new CloseSignal()
    this.codec = opts.codec ?? new CodecPool()
    this.calibrations = opts.calibrations
    this.#reader = new ChunkReader({
      geometry: opts.geometry,
      memory: opts.memory,
      codec: this.codec,
      tensorBytes: (k) => this.tensorBytes(k),
      identity: (k) => this.#identity(k),
      calibrations: opts.calibrations,
      closed: () => this.#closed,
    })
    this.#writes = new WriteBehind({
      disk: opts.disk,
      remote: opts.remote,
      codec: this.codec,
      diskCodec: opts.diskCodec ?? 'raw',
      remoteCodec: opts.remoteCodec ?? 'raw',
      remoteQuality: opts.remoteQuality,
      calibrations: opts.encodeCalibrated === false ? undefined : opts.calibrations,
      identity: (k) => this.#identity(k),
      maxBytes: opts.writeBehindBytes ?? 512 * 1024 * 1024,
      diskConcurrency: Math.max(1, opts.diskWriteConcurrency ?? 2),
    })
  }

  /** Bytes of chunk k's tensor (smaller for a partial tail chunk). */
  tensorBytes(k: ChunkKey): number {
    return k.end - k.start === this.chunkTokens ? this.chunkBytes : chunkBytes(this.geometry, k.end - k.start)
  }

  writeBehindStats(): WriteBehindStats {
    return this.#writes.stats()
  }

  #identity(k: ChunkKey): ChunkIdentity {
    return {
      geometry: this.geometry,
      tokens: k.end - k.start,
      chunkIndex: k.index,
      partial: k.partial,
      namespaceId: this.#nsId,
      chainKey: k.key,
      parentKey: fromHex(k.parentHex),
    }
  }

  #track<T>(p: Promise<T>): void {
    this.#background.add(p)
    void p.finally(() => this.#background.delete(p))
  }

  #checkOpen(): void {
    if (this.#closed) throw new KvgateError('ERR_CLOSED', 'KVCache is closed')
  }

  /**
   * Write-all: each chunk goes into L1 now (`fill` writes its tensor into the
   * slot), then to whichever of L2 and L4 lacks it, in the background. The L4
   * decision asks L4 (known present, or a lookup), never L1: an upload lost to a
   * gateway fault is retried by the next store of the same chunks.
   */
  async store(
    keys: readonly ChunkKey[],
    fill: (i: number, dst: Uint8Array) => void | Promise<void>,
  ): Promise<StoreOutcome> {
    const out: StoreOutcome = { stored: 0, present: 0, skipped: 0 }
    const wb = this.#writes
    // Everything held for the lower tiers; handed to the write-behind on success,
    // released on failure (a fill that throws part-way leaks no pin).
    const held: HeldChunk[] = []
    // This store's own chunks stay pinned until it returns, so a store larger than
    // L1 cannot evict its leading chunks to make room for its later ones.
    const own: MemoryHandle[] = []
    let handedOff = false
    try {
      for (let i = 0; i < keys.length; i++) {
        this.#checkOpen()
        const k = keys[i]!
        const resident = this.memory.peekPinned(k.hex)
        if (resident) {
          out.present++
          own.push(resident)
          if (wb.wanted(k.hex)) {
            const pin = this.memory.peekPinned(k.hex)
            const h = pin && wb.holdPinned(k, pin)
            if (h) held.push(h)
          }
          continue
        }
        const r = this.memory.reserve(k.hex, this.tensorBytes(k))
        if (r) {
          let pin: MemoryHandle | undefined
          try {
            await fill(i, r.bytes)
            this.#checkOpen()
            pin = r.commitPinned()
          } finally {
            r.abort() // no-op once committed
          }
          if (!pin) continue
          out.stored++
          own.push(pin)
          if (wb.active) {
            const again = this.memory.peekPinned(k.hex)
            const h = again && wb.holdPinned(k, again)
            if (h) held.push(h)
          }
        } else {
          // L1 is full of pinned chunks: a private copy for the lower tiers, within the budget.
          out.skipped++
          const h = wb.active ? wb.holdCopy(k, this.tensorBytes(k)) : undefined
          if (!h) continue
          held.push(h)
          await fill(i, h.bytes)
        }
      }
      if (held.length > 0) this.#track(wb.submit(held))
      handedOff = true
      return out
    } finally {
      if (!handedOff) for (const h of held) h.done()
      for (const p of own) p.release()
    }
  }

  /**
   * The tier of each leading chunk that some tier holds, stopping at the first
   * chunk none holds or that only L4 holds and this client holds off as unservable.
   * At most one gateway request (a batched lookup).
   */
  async lookup(keys: readonly ChunkKey[]): Promise<TierName[]> {
    const tiers: TierName[] = []
    let remoteUntil = -1
    for (let i = 0; i < keys.length; i++) {
      const hex = keys[i]!.hex
      if (this.memory.has(hex)) tiers.push('memory')
      else if (this.disk?.has(hex)) tiers.push('disk')
      // A key held as unservable: its GET would be skipped, so the prefix ends here, however
      // many chunks after it the gateway holds (the engine would plan a load that misses).
      else if (this.remote?.lookupStopsAt(hex)) break
      else if (i < remoteUntil) tiers.push('remote')
      else if (this.remote && remoteUntil < 0) {
        const { present } = await this.remote.lookup(keys.slice(i).map((k) => k.hex))
        remoteUntil = i + present
        if (present === 0) break
        tiers.push('remote')
      } else break
    }
    return tiers
  }

  /** lookup() before the owner's try: a failure clears the deadline (its timer and close listener). */
  async #lookupUnder(deadline: Deadline, keys: readonly ChunkKey[]): Promise<TierName[]> {
    try {
      return await this.lookup(keys)
    } catch (e) {
      deadline.clear()
      throw e
    }
  }

  /** The tiers of the leading chunks L1 or L2 hold (no gateway request). */
  #localTiers(keys: readonly ChunkKey[]): TierName[] {
    const tiers: TierName[] = []
    for (const k of keys) {
      if (this.memory.has(k.hex)) tiers.push('memory')
      else if (this.disk?.has(k.hex)) tiers.push('disk')
      else break
    }
    return tiers
  }

  /**
   * Makes chunk `k` readable: a pinned L1 handle, or (when L1 cannot take it) a
   * private tensor. Undefined when no tier could serve it intact. The caller owns
   * the handle and releases it exactly once.
   */
  async acquire(
    k: ChunkKey,
    priority: IoPriority = 'get',
    sink?: TensorSink,
  ): Promise<ChunkHandle | undefined> {
    // Two tries: a chunk promoted by a shared fetch can be evicted before this
    // waiter pins it (a tiny L1 under pressure); then it is fetched once more.
    for (let attempt = 0; attempt < 2; attempt++) {
      const h = this.memory.acquire(k.hex)
      if (h) return h
      let p = this.#inflight.get(k.hex)
      if (!p) {
        // A fetch already running for another reader serves this one too, without the sink.
        p = this.#fetch(k, priority, sink).finally(() => this.#inflight.delete(k.hex))
        this.#inflight.set(k.hex, p)
      }
      const got = await p
      if (got === undefined) return undefined
      if (got !== 'resident') return { bytes: got, release: () => {} }
      const again = this.memory.peekPinned(k.hex)
      if (again) return again
    }
    return undefined
  }

  /** Waterfall below L1: L2, then L4 (while its breaker is closed). L4 hits are also copied down to L2. */
  async #fetch(k: ChunkKey, priority: IoPriority, sink?: TensorSink): Promise<Placed | undefined> {
    if (this.disk?.has(k.hex)) {
      const got = await this.#reader.fromDisk(this.disk, k, priority, sink)
      if (got) return got
    }
    const remote = this.remote
    if (remote?.breaker.state !== 'closed') return undefined
    const got = await this.#reader.fromRemote(remote, k)
    if (got && this.disk && !this.disk.has(k.hex)) {
      const wb = this.#writes
      const pin = got === 'resident' ? this.memory.peekPinned(k.hex) : undefined
      const h = pin
        ? wb.holdPinned(k, pin)
        : typeof got !== 'string'
          ? wb.holdCopy(k, got.byteLength)
          : undefined
      if (h) {
        if (typeof got !== 'string') h.bytes.set(got)
        this.#track(wb.submit([h], false))
      }
    }
    return got
  }

  /**
   * Copies the longest servable prefix of chunks into `write(i, tensor)`. Past the
   * deadline no further chunk is waited for: the chunks not yet written are a
   * miss, fetches still running finish in the background (their reservations
   * settle there; a late chunk is promoted if intact, or dropped) and nothing is
   * written into the caller's buffer after this resolves.
   * `target(i)`, when given, is where write(i) would put chunk i's tensor (a plain
   * host buffer): an L2 read then copies each verified section there on the workers
   * that read it, and write(i) is skipped for a chunk they filled. Only verified
   * bytes of chunk i are copied there, but a chunk that then fails (a later section's
   * CRC) may leave some: like any byte outside the served prefix, they are not KV.
   */
  async retrieve(
    keys: readonly ChunkKey[],
    write: (i: number, tensor: Uint8Array, fetched: boolean) => void | Promise<void>,
    opts: {
      tiers?: readonly TierName[]
      deadlineMs?: number
      target?: (i: number) => Uint8Array | undefined
    } = {},
  ): Promise<RetrieveRun> {
    const deadlineMs = opts.deadlineMs ?? this.retrieveDeadlineMs
    // Closed before this returns: no copy into the caller's buffer runs or starts after.
    const gate = opts.target ? this.disk?.copyGate() : undefined
    // Stops the waiting at the deadline, or at close().
    const deadline = new Deadline(deadlineMs, this.#closing)
    const { expired } = deadline
    try {
      // A slow gateway lookup past the deadline still leaves the local prefix to serve.
      const avail = opts.tiers ?? (await Promise.race([this.lookup(keys), expired])) ?? this.#localTiers(keys)
      const n = avail.length
      const ok = new Uint8Array(n)
      let next = 0
      let firstFail = n
      let failed = false
      const worker = async () => {
        while (next < n && !failed && !this.#closed) {
          const i = next++
          if (i >= firstFail) return
          let h: ChunkHandle | undefined
          let sink: TensorSink | undefined
          // Not in L1 when asked: fetched from L2 or L4 for this read (a hint for write: such a
          // chunk's copy may leave this thread, an L1 hit's stays on it).
          const fetched = !this.memory.has(keys[i]!.hex)
          if (deadline.passed) {
            // Past the deadline nothing is waited for: only chunks L1 holds are still served.
            h = this.memory.acquire(keys[i]!.hex)
          } else {
            const known = this.remote?.knownPresent(keys[i]!.hex) ?? false
            const into = gate && opts.target!(i)
            sink = into ? { into, gate: gate!, copied: false } : undefined
            const pending = this.acquire(keys[i]!, 'get', sink)
            h = await Promise.race([pending, expired])
            if (!h && !deadline.passed) this.#forgetChainAfterMiss(keys, i, known)
            // A late arrival is released the moment it lands: nothing stays pinned.
            if (!h && deadline.passed)
              void pending.then(
                (late) => late?.release(),
                () => {},
              )
          }
          if (!h) {
            firstFail = Math.min(firstFail, i)
            return
          }
          try {
            if (this.#closed) return
            if (!sink?.copied) await write(i, h.bytes, fetched)
            ok[i] = 1
          } catch (e) {
            failed = true // the other workers stop too: none writes after this rejects
            throw e
          } finally {
            h.release()
          }
        }
      }
      // allSettled: every worker has stopped (no write into the caller's buffer runs) before this returns or throws.
      const results = await Promise.allSettled(
        Array.from({ length: Math.min(this.#fetchConcurrency, n) }, worker),
      )
      for (const r of results) if (r.status === 'rejected') throw r.reason
      this.#checkOpen()
      let served = 0
      while (served < n && ok[served] === 1) served++
      return { served, timedOut: deadline.timedOut }
    } finally {
      deadline.clear()
      gate?.close()
    }
  }

  /**
   * Chunk i of `keys` missed although L4 was believed to hold it (`knownBefore`), and that
   * belief is gone now (its GET answered 404, or the object failed verification): the GET
   * forgot that key only; the chain's later keys go too (contract C2), or the write-behind
   * would skip re-uploading them for the presence TTL. A read stops at this miss and never
   * asks the gateway for those keys (later chunks held locally are not asked for either), so
   * nothing else would forget them.
   */
  #forgetChainAfterMiss(keys: readonly ChunkKey[], i: number, knownBefore: boolean): void {
    const remote = this.remote
    if (!knownBefore || !remote || remote.knownPresent(keys[i]!.hex)) return
    remote.forgetFrom(
      keys.map((k) => k.hex),
      i,
    )
  }

  /**
   * Brings the available prefix into L1 at prefetch priority, at most
   * fetchConcurrency chunks at once, up to the first chunk no tier could serve;
   * resolves to the leading chunks resident (waiting at most retrieveDeadlineMs for them).
   */
  async prefetch(keys: readonly ChunkKey[]): Promise<number> {
    // Past retrieveDeadlineMs (a stuck L2 read) or at close() no chunk is waited for; reads
    // still running land in L1 in the background.
    const deadline = new Deadline(this.retrieveDeadlineMs, this.#closing)
    const { expired } = deadline
    const tiers = await this.#lookupUnder(deadline, keys)
    const ok = new Uint8Array(tiers.length)
    let next = 0
    // Chunks past a miss cannot be served (a prefix ends there): not asked for, as in retrieve().
    let firstMiss = tiers.length
    const worker = async () => {
      while (next < firstMiss && !this.#closed && !deadline.passed) {
        const i = next++
        const known = this.remote?.knownPresent(keys[i]!.hex) ?? false
        const pending = this.acquire(keys[i]!, 'prefetch')
        const h = await Promise.race([pending, expired])
        if (!h) {
          if (deadline.passed)
            void pending.then(
              (late) => late?.release(),
              () => {},
            )
          else {
            firstMiss = Math.min(firstMiss, i)
            this.#forgetChainAfterMiss(keys, i, known)
          }
          continue
        }
        // A private tensor (L1 had no slot) is not resident: nothing to keep.
        ok[i] = this.memory.has(keys[i]!.hex) ? 1 : 0
        h.release()
      }
    }
    try {
      await Promise.all(Array.from({ length: Math.min(this.#fetchConcurrency, tiers.length) }, worker))
    } finally {
      deadline.clear()
    }
    let resident = 0
    while (resident < ok.length && ok[resident] === 1) resident++
    return resident
  }

  /**
   * Layer by layer over the available prefix (see LayerBatch for the contract).
   * Local chunks are pinned first; remote chunks are fetched as `?layers=a-b`
   * groups, all requested up front so transfer of later layers overlaps the
   * caller's work on earlier ones. A remote chunk is committed to L1 only when
   * every one of its layers arrived and verified; every reservation and pin is
   * settled in the generator's finally, also when the caller stops early: only
   * then are the slabs of earlier items invalid. A local chunk not pinned within
   * retrieveDeadlineMs (a stuck L2 read) or by close() is a miss, like in retrieve(); so is a
   * remote layer group not arrived once this generator's waits for groups (not the caller's
   * work between items) add up to the deadline (a stuck gateway), from that layer on.
   */
  async *retrieveLayers(keys: readonly ChunkKey[]): AsyncGenerator<LayerBatch> {
    const g = this.geometry
    // Past it (or at close()) no local chunk is waited for: the prefix pinned so far is served.
    const started = performance.now()
    const deadline = new Deadline(this.retrieveDeadlineMs, this.#closing)
    const { expired } = deadline
    // Set when the deadline (not close(), not a failure) ended a wait: counted once per run.
    let cutShort = false
    const tiers = await this.#lookupUnder(deadline, keys)
    const held: ChunkHandle[] = []
    const remoteChunks: RemoteLayers[] = []
    // Index of each remote chunk in `keys`, and whether L4 was believed to hold it when asked for.
    const remoteAt: { i: number; known: boolean }[] = []
    // Per chunk: a function giving its slab for layer l (or undefined when it failed), waiting
    // for a remote layer group until `wait` expires.
    const sources: ((l: number, wait: Deadline) => Promise<Uint8Array | undefined>)[] = []
    // Local chunks are pinned in order, with up to fetchConcurrency of them being read
    // ahead (L2 reads in flight at once, as retrieve does, not one chunk at a time).
    const local = (i: number) => tiers[i] !== 'remote' || this.memory.has(keys[i]!.hex)
    const ahead = new Map<number, Promise<ChunkHandle | undefined>>()
    let issued = 0
    const readAhead = (upTo: number) => {
      for (; issued < tiers.length && issued <= upTo; issued++) {
        if (!local(issued)) continue
        const p = this.acquire(keys[issued]!)
        // Read ahead and awaited in order: one failing before its turn is handled here (its
        // error still surfaces where it is awaited), never an unhandled rejection.
        p.catch(() => {})
        ahead.set(issued, p)
      }
    }
    try {
      for (let i = 0; i < tiers.length; i++) {
        const k = keys[i]!
        readAhead(i + this.#fetchConcurrency - 1)
        const pending = ahead.get(i)
        if (pending) {
          ahead.delete(i)
          const h = await Promise.race([pending, expired])
          if (!h) {
            if (deadline.timedOut) cutShort = true
            // A late arrival is released the moment it lands: nothing stays pinned.
            void pending.then(
              (late) => late?.release(),
              () => {},
            )
            break
          }
          held.push(h)
          const slabBytes = layerSlabBytes(g, k.end - k.start)
          sources.push(async (l) => h.bytes.subarray(l * slabBytes, (l + 1) * slabBytes))
        } else {
          if (!this.remote) break
          const rl = new RemoteLayers(
            {
              reader: this.#reader,
              remote: this.remote,
              memory: this.memory,
              geometry: g,
              per: this.#layersPerRequest,
            },
            k,
            this.tensorBytes(k),
          )
          remoteChunks.push(rl)
          remoteAt.push({ i, known: this.remote.knownPresent(k.hex) })
          // A layer group still on its way when the wait ends (the budget below is spent, or
          // close()) is a miss: that chunk and the later ones drop out there. Groups that already
          // arrived are still served.
          sources.push(async (l, wait) => {
            if (rl.ended(l)) return rl.layer(l)
            const slab = await Promise.race([rl.layer(l), wait.expired])
            if (slab === undefined && !rl.ended(l) && wait.timedOut) cutShort = true
            return slab
          })
        }
      }
      // Group-major order: every chunk's first layers are requested before anyone's
      // later layers, so layer 0 is complete after ~1/groups of the transfer.
      for (let first = 0; first < g.layers; first += this.#layersPerRequest) {
        for (const rl of remoteChunks) rl.request(first)
      }
      let valid = sources.length
      // What is left of the deadline for the layer groups: spent only while this waits for
      // them, not while the caller works on a layer (a pipeline slower than the deadline but
      // fed in time is not cut short; a stuck gateway is, once the waits add up to it).
      let budget = Math.max(0, this.retrieveDeadlineMs - (performance.now() - started))
      for (let l = 0; l < g.layers; l++) {
        // After close() L1 may be freed under the slabs: the next step fails typed, never
        // with a TypeError from freed memory nor with a batch read from it.
        this.#checkOpen()
        let slabs: (Uint8Array | undefined)[]
        const t0 = performance.now()
        const wait = new Deadline(budget, this.#closing)
        try {
          slabs = await Promise.all(sources.slice(0, valid).map((s) => s(l, wait)))
        } catch (e) {
          this.#checkOpen()
          throw e
        } finally {
          wait.clear()
          budget = Math.max(0, budget - (performance.now() - t0))
        }
        this.#checkOpen()
        let n = 0
        while (n < slabs.length && slabs[n] !== undefined) n++
        valid = n
        yield {
          layer: l,
          chunks: valid,
          tokens: valid > 0 ? keys[valid - 1]!.end : 0,
          slabs: slabs.slice(0, valid) as Uint8Array[],
        }
      }
    } finally {
      deadline.clear()
      if (cutShort) this.layerRetrieveTimeouts++
      for (const rl of remoteChunks) rl.settle()
      // The first chunk whose layer groups met a 404 (or a corrupt object) forgets the chain from
      // there; groups still in flight when the caller stopped early forget their own key only.
      const gone = remoteAt.find(({ i, known }) => known && !this.remote!.knownPresent(keys[i]!.hex))
      if (gone) this.#forgetChainAfterMiss(keys, gone.i, true)
      for (const h of held) h.release()
      // Chunks read ahead past a miss (or past the caller stopping): released as they land.
      for (const p of ahead.values())
        void p.then(
          (h) => h?.release(),
          () => {},
        )
    }
  }

  /** Waits for background writes to L2 and the L4 write-behind queue. */
  async flush(timeoutMs = 30_000): Promise<void> {
    const deadline = Date.now() + timeoutMs
    const left = () => Math.max(0, deadline - Date.now())
    while (this.#background.size > 0 && left() > 0) {
      await Promise.race([Promise.allSettled([...this.#background]), sleep(left())])
    }
    await this.#writes.drain(left())
    await this.disk?.drain()
    await this.remote?.flush(left())
  }

  /** Refuses new work: operations in flight stop at their next step with ERR_CLOSED. */
  close(): void {
    this.#closed = true
    this.#closing.fire()
  }

  /** Drops L2 writes still queued (after close's flush ran out of time), releasing what they held. */
  dropQueuedWrites(): void {
    this.#writes.dropQueued()
  }
}

function sleep(ms: number): Promise<void> {
  return new Promise((r) => setTimeout(r, ms).unref())
}

/** close() for the waits in flight: each subscribes and unsubscribes (nothing is kept once a wait is done). */
class CloseSignal {
  readonly #listeners = new Set<() => void>()
  #fired = false

  /** Calls `f` at fire() (now, if it fired already); returns the unsubscribe. */
  subscribe(f: () => void): () => void {
    if (this.#fired) {
      f()
      return () => {}
    }
    this.#listeners.add(f)
    return () => this.#listeners.delete(f)
  }

  fire(): void {
    this.#fired = true
    for (const f of [...this.#listeners]) f()
    this.#listeners.clear()
  }
}

/**
 * A wait's end: `expired` resolves (undefined) at `ms` or at close(), whichever comes
 * first; `passed` from then on, `timedOut` when it was the time. `clear()` stops the timer
 * and leaves the close signal (every owner calls it in a `finally`).
 */
class Deadline {
  readonly expired: Promise<undefined>
  passed = false
  timedOut = false
  readonly #timer: NodeJS.Timeout
  readonly #leave: () => void

  constructor(ms: number, closing: CloseSignal) {
    let end!: () => void
    this.expired = new Promise<undefined>((resolve) => {
      end = () => {
        this.passed = true
        resolve(undefined)
      }
    })
    this.#timer = setTimeout(() => {
      this.timedOut = true
      this.#leave()
      end()
    }, ms)
    this.#leave = closing.subscribe(end)
  }

  clear(): void {
    clearTimeout(this.#timer)
    this.#leave()
  }
}
