// Moves chunks between tiers: write-all on store (L1 now, L2/L4 in the
// background), waterfall reads with promotion into L1, deduplicated fetches.

import { FormatError } from '../core/errors.ts'
import { type ChunkHeader, decodeHeader } from '../core/format.ts'
import { type ChunkKey, fromHex } from '../core/keys.ts'
import { chunkBytes, type KvGeometry, layerSlabBytes } from '../core/layout.ts'
import {
  type ChunkCodecName,
  type ChunkIdentity,
  checkIdentity,
  maxObjectBytes,
  openLayerGroup,
} from './chunk-codec.ts'
import { CodecPool } from './codec-pool.ts'
import type { IoPriority } from './io-queue.ts'
import type { DiskTier } from './tiers/disk.ts'
import type { MemoryHandle, MemoryReservation, MemoryTier } from './tiers/memory.ts'
import type { RemoteTier } from './tiers/remote.ts'

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
  /** Chunks fetched from lower tiers at once per retrieve. @default 8 */
  fetchConcurrency?: number
  /** Layers per `?layers=a-b` request in retrieveLayers. @default ceil(layers / 4) */
  layersPerRequest?: number
  /** Where lossless/kvgate encoding and decoding run. @default a new CodecPool */
  codec?: CodecPool
}

/** A chunk tensor a reader may copy from until release(). */
export type ChunkHandle = MemoryHandle

export interface StoreOutcome {
  /** Chunks newly written to L1. */
  stored: number
  /** Chunks L1 held already. */
  present: number
  /** Chunks L1 could not take (full of pinned chunks); they still go to L2/L4. */
  skipped: number
}

export interface LayerBatch {
  layer: number
  /** Leading chunks whose slab for this layer is valid; never grows from one layer to the next. */
  chunks: number
  /** Layer slabs ([K|V][token][kvHead][headDim]) of chunks 0..chunks-1. Valid until the next iteration. */
  slabs: Uint8Array[]
}

export class StorageManager {
  readonly geometry: KvGeometry
  readonly chunkTokens: number
  readonly chunkBytes: number
  readonly memory: MemoryTier
  readonly disk: DiskTier | undefined
  readonly remote: RemoteTier | undefined
  readonly #nsId: Uint8Array
  readonly #diskCodec: 'raw' | 'lossless'
  readonly #remoteCodec: ChunkCodecName
  readonly #remoteQuality: number | undefined
  readonly #fetchConcurrency: number
  readonly #layersPerRequest: number
  readonly codec: CodecPool
  readonly #inflight = new Map<string, Promise<Uint8Array | 'resident' | undefined>>()
  readonly #background = new Set<Promise<unknown>>()

  constructor(opts: StorageManagerOptions) {
    this.geometry = opts.geometry
    this.chunkTokens = opts.chunkTokens
    this.chunkBytes = chunkBytes(opts.geometry, opts.chunkTokens)
    this.memory = opts.memory
    this.disk = opts.disk
    this.remote = opts.remote
    this.#nsId = opts.namespaceId
    this.#diskCodec = opts.diskCodec ?? 'raw'
    this.#remoteCodec = opts.remoteCodec ?? 'raw'
    this.#remoteQuality = opts.remoteQuality
    this.#fetchConcurrency = Math.max(1, opts.fetchConcurrency ?? 8)
    this.#layersPerRequest = Math.max(1, opts.layersPerRequest ?? Math.ceil(opts.geometry.layers / 4))
    this.codec = opts.codec ?? new CodecPool()
  }

  /** Bytes of chunk k's tensor (smaller for a partial tail chunk). */
  tensorBytes(k: ChunkKey): number {
    return k.end - k.start === this.chunkTokens ? this.chunkBytes : chunkBytes(this.geometry, k.end - k.start)
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

  /**
   * Write-all: each chunk goes into L1 now (`fill` writes its tensor into the
   * slot), then to L2 and L4 in the background. Chunks a tier holds already are skipped.
   */
  async store(
    keys: readonly ChunkKey[],
    fill: (i: number, dst: Uint8Array) => void | Promise<void>,
  ): Promise<StoreOutcome> {
    const out: StoreOutcome = { stored: 0, present: 0, skipped: 0 }
    const sources: { key: ChunkKey; handle: ChunkHandle }[] = []
    for (let i = 0; i < keys.length; i++) {
      const k = keys[i]!
      if (this.memory.has(k.hex)) {
        out.present++
        continue
      }
      const r = this.memory.reserve(k.hex, this.tensorBytes(k))
      if (r) {
        try {
          await fill(i, r.bytes)
        } catch (e) {
          r.abort()
          throw e
        }
        if (r.commit()) out.stored++
        const h = this.memory.peekPinned(k.hex)
        if (h) sources.push({ key: k, handle: h })
      } else {
        // L1 is full of pinned chunks: keep a private copy for the lower tiers.
        out.skipped++
        const tmp = new Uint8Array(this.tensorBytes(k))
        await fill(i, tmp)
        sources.push({ key: k, handle: { bytes: tmp, release: () => {} } })
      }
    }
    if (sources.length > 0) this.#track(this.#writeBehind(sources))
    return out
  }

  async #writeBehind(sources: { key: ChunkKey; handle: ChunkHandle }[]): Promise<void> {
    const { disk, remote } = this
    let remoteFrom = 0
    if (remote) {
      // One batched lookup: chunks the gateway holds (another node stored them) are not uploaded.
      const lk = await remote.lookup(
        sources.map((s) => s.key.hex),
        'background',
      )
      remoteFrom = lk.present
    }
    const jobs: Promise<unknown>[] = []
    for (let i = 0; i < sources.length; i++) {
      const { key, handle } = sources[i]!
      let refs = 1 + (disk ? 1 : 0) + (remote ? 1 : 0)
      const done = () => {
        if (--refs === 0) handle.release()
      }
      if (disk && !disk.has(key.hex)) {
        jobs.push(
          // Yield first so the caller's store() resolves before any encoding work starts.
          yieldToCaller()
            .then(() => this.codec.encode(this.#diskCodec, handle.bytes, this.#identity(key)))
            .then((obj) => disk.put(key.hex, obj))
            .catch(() => {
              disk.counters.errors++
            })
            .finally(done),
        )
      } else if (disk) done()
      if (remote && i >= remoteFrom && !remote.knownPresent(key.hex)) {
        remote.enqueue({
          hex: key.hex,
          bytesHint: handle.bytes.byteLength,
          encode: () =>
            this.codec.encode(this.#remoteCodec, handle.bytes, this.#identity(key), this.#remoteQuality),
          done,
        })
      } else if (remote) done()
      done()
    }
    await Promise.allSettled(jobs)
  }

  /**
   * The tier of each leading chunk that some tier holds, stopping at the first
   * chunk none holds. At most one gateway request (a batched lookup).
   */
  async lookup(keys: readonly ChunkKey[]): Promise<TierName[]> {
    const tiers: TierName[] = []
    let remoteUntil = -1
    for (let i = 0; i < keys.length; i++) {
      const hex = keys[i]!.hex
      if (this.memory.has(hex)) tiers.push('memory')
      else if (this.disk?.has(hex)) tiers.push('disk')
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

  /**
   * Makes chunk `k` readable: a pinned L1 handle, or (when L1 cannot take it) a
   * private tensor. Undefined when no tier could serve it intact.
   */
  async acquire(k: ChunkKey, priority: IoPriority = 'get'): Promise<ChunkHandle | undefined> {
    const h = this.memory.acquire(k.hex)
    if (h) return h
    let p = this.#inflight.get(k.hex)
    if (!p) {
      p = this.#fetch(k, priority).finally(() => this.#inflight.delete(k.hex))
      this.#inflight.set(k.hex, p)
    }
    const got = await p
    if (got === undefined) return undefined
    if (got === 'resident') {
      const again = this.memory.peekPinned(k.hex)
      if (again) return again
      // Evicted between promotion and now (tiny L1 under pressure): fetch once more.
      return this.acquire(k, priority)
    }
    return { bytes: got, release: () => {} }
  }

  /** Waterfall below L1: L2, then L4. Promotes what it finds into L1 (and L4 hits into L2). */
  async #fetch(k: ChunkKey, priority: IoPriority): Promise<Uint8Array | 'resident' | undefined> {
    const tokens = k.end - k.start
    if (this.disk?.has(k.hex)) {
      const got = await this.#fromDisk(k, tokens, priority)
      if (got) return got
    }
    if (this.remote && this.remote.breaker.state === 'closed') {
      const got = await this.#fromRemote(k, tokens)
      if (!got) return undefined
      const disk = this.disk
      if (disk && !disk.has(k.hex)) {
        const ref = got === 'resident' ? this.memory.peekPinned(k.hex) : { bytes: got, release: () => {} }
        if (ref) {
          this.#track(
            yieldToCaller()
              .then(() => this.codec.encode(this.#diskCodec, ref.bytes, this.#identity(k)))
              .then((obj) => disk.put(k.hex, obj, 'put'))
              .catch(() => {})
              .finally(() => ref.release()),
          )
        }
      }
      return got
    }
    return undefined
  }

  /**
   * L2 → L1. The file is read straight into the slot (O_DIRECT when the addon is
   * there); a raw object then already has its tensor at the slot's data offset,
   * so promotion costs the read and the CRC check, no copy.
   */
  async #fromDisk(
    k: ChunkKey,
    _tokens: number,
    priority: IoPriority,
  ): Promise<Uint8Array | 'resident' | undefined> {
    const disk = this.disk!
    const r = this.memory.reserve(k.hex, this.tensorBytes(k))
    const object = await disk.get(k.hex, priority, r?.slot)
    if (!object) {
      r?.abort()
      return undefined
    }
    let got: Uint8Array | 'resident' | undefined
    try {
      // DiskTier.get verified every CRC already; what is left is the identity check.
      const h = decodeHeader(object)
      checkIdentity(h, this.#identity(k))
      got = await this.#place(k, object, h, r)
    } catch {
      r?.abort()
    }
    if (got) return got
    // Whatever the failure (format, codec, a bug on hostile bytes), the chunk is a miss.
    disk.counters.corrupt++
    await disk.delete(k.hex)
    return undefined
  }

  /** L4 → L1: the body is read into the slot when it fits, like an L2 read. */
  async #fromRemote(k: ChunkKey, tokens: number): Promise<Uint8Array | 'resident' | undefined> {
    const remote = this.remote!
    const r = this.memory.reserve(k.hex, this.tensorBytes(k))
    const object = await remote.get(k.hex, undefined, r?.slot, {
      maxBytes: maxObjectBytes(this.geometry, tokens),
    })
    if (!object) {
      r?.abort()
      return undefined
    }
    let got: Uint8Array | 'resident' | undefined
    try {
      const h = await this.codec.verify(object)
      checkIdentity(h, this.#identity(k))
      got = await this.#place(k, object, h, r)
    } catch {
      r?.abort()
    }
    if (!got) remote.reportCorrupt(k.hex)
    return got
  }

  /**
   * Puts a verified object's tensor into the reservation (or a private buffer
   * when L1 had no slot). A raw object read into the slot at the header offset
   * is already in place; anything else is copied or decoded. Rejects on failure
   * (the caller aborts the reservation).
   */
  async #place(
    k: ChunkKey,
    object: Uint8Array,
    h: ChunkHeader,
    r: MemoryReservation | undefined,
  ): Promise<Uint8Array | 'resident'> {
    const size = this.tensorBytes(k)
    const inSlot =
      r !== undefined && object.buffer === r.slot.buffer && object.byteOffset === r.slot.byteOffset
    if (inSlot && h.codec === 'raw' && rawTensorAt(h, this.memory.dataOffset, size)) {
      r.commit()
      return 'resident'
    }
    // Decoding reads the object and writes the tensor: never both in one slot.
    const src = inSlot ? object.slice() : object
    const dst = r ? r.bytes : new Uint8Array(size)
    if (h.codec === 'raw') copyRawSections(h, src, dst, layerSlabBytes(this.geometry, k.end - k.start))
    else await this.codec.decodeInto(src, h.codec, dst)
    if (!r) return dst
    r.commit()
    return 'resident'
  }

  /**
   * Copies the longest servable prefix of chunks into `write(i, tensor)` and
   * returns how many leading chunks were served.
   */
  async retrieve(
    keys: readonly ChunkKey[],
    write: (i: number, tensor: Uint8Array) => void | Promise<void>,
    tiers?: readonly TierName[],
  ): Promise<number> {
    const avail = tiers ?? (await this.lookup(keys))
    const n = avail.length
    const ok = new Uint8Array(n)
    let next = 0
    let firstFail = n
    const worker = async () => {
      while (next < n) {
        const i = next++
        if (i >= firstFail) return
        const h = await this.acquire(keys[i]!)
        if (!h) {
          firstFail = Math.min(firstFail, i)
          return
        }
        try {
          await write(i, h.bytes)
          ok[i] = 1
        } finally {
          h.release()
        }
      }
    }
    await Promise.all(Array.from({ length: Math.min(this.#fetchConcurrency, n) }, worker))
    let served = 0
    while (served < n && ok[served] === 1) served++
    return served
  }

  /** Brings the available prefix into L1 at prefetch priority; resolves to the chunks resident. */
  async prefetch(keys: readonly ChunkKey[]): Promise<number> {
    const tiers = await this.lookup(keys)
    let resident = 0
    await Promise.all(
      tiers.map(async (_t, i) => {
        const h = await this.acquire(keys[i]!, 'prefetch')
        if (h) {
          resident++
          h.release()
        }
      }),
    )
    return resident
  }

  /**
   * Layer by layer over the available prefix. Local chunks are made resident
   * first; remote chunks are fetched as `?layers=a-b` groups, all requested up
   * front so transfer of later layers overlaps the caller's work on earlier ones.
   */
  async *retrieveLayers(keys: readonly ChunkKey[]): AsyncGenerator<LayerBatch> {
    const g = this.geometry
    const tiers = await this.lookup(keys)
    const held: ChunkHandle[] = []
    const remoteChunks: RemoteLayers[] = []
    // Per chunk: a function giving its slab for layer l (or undefined when it failed).
    const sources: ((l: number) => Promise<Uint8Array | undefined>)[] = []
    try {
      for (let i = 0; i < tiers.length; i++) {
        const k = keys[i]!
        if (tiers[i] !== 'remote' || this.memory.has(k.hex)) {
          const h = await this.acquire(k)
          if (!h) break
          held.push(h)
          const slabBytes = layerSlabBytes(g, k.end - k.start)
          sources.push(async (l) => h.bytes.subarray(l * slabBytes, (l + 1) * slabBytes))
        } else {
          if (!this.remote) break
          const rl = new RemoteLayers(this, k, this.#layersPerRequest)
          remoteChunks.push(rl)
          sources.push((l) => rl.layer(l))
        }
      }
      // Group-major order: every chunk's first layers are requested before anyone's
      // later layers, so layer 0 is complete after ~1/groups of the transfer.
      for (let first = 0; first < g.layers; first += this.#layersPerRequest) {
        for (const rl of remoteChunks) rl.request(first)
      }
      let valid = sources.length
      for (let l = 0; l < g.layers; l++) {
        const slabs = await Promise.all(sources.slice(0, valid).map((s) => s(l)))
        let n = 0
        while (n < slabs.length && slabs[n] !== undefined) n++
        valid = n
        yield { layer: l, chunks: valid, slabs: slabs.slice(0, valid) as Uint8Array[] }
      }
      for (const rl of remoteChunks) rl.finish()
    } finally {
      for (const rl of remoteChunks) rl.abort()
      for (const h of held) h.release()
    }
  }

  /** Remote fetch of one chunk's layer group, used by RemoteLayers. */
  async fetchLayerGroup(
    k: ChunkKey,
    first: number,
    last: number,
  ): Promise<Map<number, Uint8Array> | undefined> {
    const remote = this.remote
    if (!remote) return undefined
    const body = await remote.get(k.hex, [first, last])
    if (!body) return undefined
    try {
      const sub = openLayerGroup(body, first, last, this.#identity(k))
      const out = new Map<number, Uint8Array>()
      const slabs = await Promise.all(
        Array.from({ length: last - first + 1 }, (_, i) =>
          this.codec.decodeSection(sub.header, first + i, sub.section(first + i)),
        ),
      )
      for (const [i, s] of slabs.entries()) out.set(first + i, s)
      return out
    } catch {
      remote.reportCorrupt(k.hex)
      return undefined
    }
  }

  /** Waits for background writes to L2 and the L4 write-behind queue. */
  async flush(timeoutMs = 30_000): Promise<void> {
    const deadline = Date.now() + timeoutMs
    while (this.#background.size > 0 && Date.now() < deadline) {
      await Promise.race([
        Promise.allSettled([...this.#background]),
        sleep(Math.max(0, deadline - Date.now())),
      ])
    }
    await this.disk?.drain()
    await this.remote?.flush(Math.max(0, deadline - Date.now()))
  }
}

/** One remote chunk fetched as layer groups; decoded layers land in an L1 reservation when one is free. */
class RemoteLayers {
  readonly #groups = new Map<number, Promise<Map<number, Uint8Array> | undefined>>()
  readonly #reservation
  readonly #slab: number
  readonly #manager: StorageManager
  readonly #key: ChunkKey
  readonly #per: number
  #complete = true

  constructor(manager: StorageManager, key: ChunkKey, per: number) {
    this.#manager = manager
    this.#key = key
    this.#per = per
    this.#slab = layerSlabBytes(manager.geometry, key.end - key.start)
    this.#reservation = manager.memory.reserve(key.hex, manager.tensorBytes(key))
  }

  /** Starts the GET of the layer group beginning at `first`. */
  request(first: number): void {
    const last = Math.min(this.#manager.geometry.layers - 1, first + this.#per - 1)
    this.#groups.set(first, this.#manager.fetchLayerGroup(this.#key, first, last))
  }

  async layer(l: number): Promise<Uint8Array | undefined> {
    const group = await this.#groups.get(Math.floor(l / this.#per) * this.#per)
    const slab = group?.get(l)
    if (!slab) {
      this.#complete = false
      return undefined
    }
    if (!this.#reservation) return slab
    const dst = this.#reservation.bytes.subarray(l * this.#slab, (l + 1) * this.#slab)
    dst.set(slab)
    return dst
  }

  /** All layers arrived: publish the assembled tensor in L1 (promotion). */
  finish(): void {
    if (this.#complete && this.#reservation) this.#reservation.commit()
  }

  abort(): void {
    this.#reservation?.abort()
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

/** Lets the caller's continuation run before CPU-heavy background work starts. */
function yieldToCaller(): Promise<void> {
  return new Promise((r) => setImmediate(r))
}

function sleep(ms: number): Promise<void> {
  return new Promise((r) => setTimeout(r, ms).unref())
}
