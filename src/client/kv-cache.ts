// KVCache: the client library's public face. Cuts token sequences into chained
// chunk keys and drives the storage manager across L1 (memory), L2 (disk) and L4 (gateway).

import { join } from 'node:path'
import { openCalibration } from '../codec/calibration.ts'
import { InvalidArgumentError, KvgateError } from '../core/errors.ts'
import { headerBytesFor } from '../core/format.ts'
import { type ChunkKey, fromHex, type KeyNamespace, namespaceId } from '../core/keys.ts'
import { chunkBytes, dtypeBytes, kvPlanes, type ModelPreset, rowElements } from '../core/layout.ts'
import { type CalibrationStats, CalibrationStore } from './calibration-store.ts'
import type { ChunkCodecName } from './chunk-codec.ts'
import { CodecPool } from './codec-pool.ts'
import { type KVCacheOptions, type ResolvedOptions, resolveOptions } from './config.ts'
import { copyChunkFromGpu, copyChunkToGpu, type GpuBuffer, isGpuBuffer, validateGpuBuffer } from './gpu.ts'
import { KeyMemo, type KeyMemoStats } from './key-memo.ts'
import { loadNative, type NativeModule } from './native-api.ts'
import {
  type LatencySummary,
  LatencyWindow,
  prometheusText,
  since,
  type TierCounterSnapshot,
} from './stats.ts'
import { type LayerBatch, StorageManager, type TierName } from './storage-manager.ts'
import { type DiskBudget, DiskTier, type DiskTierStats } from './tiers/disk.ts'
import { MemoryTier, type MemoryTierStats, type Resident } from './tiers/memory.ts'
import { RemoteTier, type RemoteTierStats } from './tiers/remote.ts'
import type { WriteBehindStats } from './write-behind.ts'

/** Token ids: a plain array or a typed array of non-negative integers < 2^32. */
export type Tokens = ArrayLike<number>

export interface StoreResult {
  /** Full chunks in the token sequence (a trailing partial chunk is not stored). */
  chunks: number
  /** Chunks newly written to L1. */
  stored: number
  /** Chunks L1 already held (nothing copied). */
  present: number
  /** Chunks L1 could not take (all slots pinned); they still went to L2/L4. */
  skipped: number
}

export interface LookupResult {
  /** Tokens available as a prefix (a multiple of chunkTokens). */
  tokens: number
  /** The tier holding each chunk of that prefix. */
  chunks: { index: number; key: string; tier: TierName }[]
}

export interface RetrieveOptions {
  /**
   * Where the KV goes: a host buffer of at least (full chunks × chunk tensor
   * bytes), chunk tensors back to back (the layout `store` takes), or a GPU buffer.
   */
  into: Uint8Array | GpuBuffer
  /** Host buffer layout, as in StoreOptions. @default 'chunks' */
  layout?: KvLayout
  /** Also retrieve the trailing partial chunk (if it was stored with includePartial). @default false */
  includePartial?: boolean
  /**
   * Deadline of this retrieve, ms (default: the cache's retrieveDeadlineMs). Past
   * it the chunks not yet written are a miss (the mask says which tokens were
   * served) so the engine recomputes them instead of waiting on a stuck tier.
   */
  deadlineMs?: number
}

/**
 * 'chunks': chunk tensors back to back, full chunks only. 'sequence': one tensor
 * for the whole token sequence, [layer][K|V][token][kvHead][headDim] over all
 * tokens.length tokens (a forward pass's layout); the partial tail is ignored.
 */
export type KvLayout = 'chunks' | 'sequence'

export interface StoreOptions {
  /** Layout of a host `kv`. @default 'chunks' */
  layout?: KvLayout
  /**
   * Also store the trailing partial chunk (its key covers exactly those tokens,
   * so it only hits for a prompt that ends the same way). @default false
   */
  includePartial?: boolean
}

export interface KVCacheStats {
  model: string
  chunkTokens: number
  chunkBytes: number
  namespace: string
  native: { loaded: boolean; reason: string | undefined }
  memory: TierCounterSnapshot & MemoryTierStats
  disk: (TierCounterSnapshot & DiskTierStats) | null
  /** Chunks held for background L2/L4 writes, and those shed past the budget. */
  writeBehind: WriteBehindStats
  remote:
    | (TierCounterSnapshot & RemoteTierStats & { codec: ChunkCodecName; quality: number | undefined })
    | null
  operations: { store: LatencySummary; lookup: LatencySummary; retrieve: LatencySummary }
  /** Retrieves (retrieve and retrieveLayers) cut short by their deadline (the rest of their chunks were misses). */
  retrieveTimeouts: number
  /** Tokens served by retrieve() / asked for by retrieve(). */
  retrievedTokens: number
  requestedTokens: number
  /** Chain keys reused from recent prompts vs hashed. */
  keyMemo: KeyMemoStats
  /**
   * Codec jobs on worker threads vs the calling thread (and why inline, if so), workers loaded
   * and ready, and the pool's failures: jobs lost with their worker, timed out (a hung worker),
   * refused, not sent.
   */
  codec: { inline: string | undefined; readyWorkers: number } & CodecPool['counts']
  /** The namespace's calibration objects (docs/calibration.md); null without L2 or L4. */
  calibration: CalibrationStats | null
}

const MAX_TOKENS = 1 << 24

/** Tiers a cache uses instead of its own (`kvgate agent`: one L1 budget for every KV space). */
export interface SharedTiers {
  /**
   * L1 to use: a scoped view (MemoryTier#scoped) of a tier the caller owns. Its slots must
   * fit this cache's chunks; close() drops this cache's chunks from it and frees nothing.
   */
  memory?: MemoryTier
  /** L2 byte budget shared with other caches' disk tiers (each keeps its own directory). */
  diskBudget?: DiskBudget
  /**
   * Codec workers to run this cache's jobs on: a pool the caller owns and closes (`codecWorkers`
   * is then unused, and close() leaves the pool running). One pool for every cache of a process
   * keeps its threads at one per core, however many caches decode at once.
   */
  codec?: CodecPool
}

/**
 * A tiered KV cache for one model geometry and chunk size. Gateway faults never
 * reach the caller: they degrade to local tiers and show up in stats().
 */
export class KVCache {
  readonly model: ModelPreset
  readonly chunkTokens: number
  readonly chunkBytes: number
  readonly namespace: string
  readonly #memo: KeyMemo
  readonly #manager: StorageManager
  readonly #native: NativeModule | undefined
  readonly #nativeReason: string | undefined
  readonly #remoteCodec: ChunkCodecName
  /** False when the codec pool came from SharedTiers: its owner closes it. */
  readonly #ownsCodec: boolean
  readonly #quality: number | undefined
  readonly #ops = { store: new LatencyWindow(), lookup: new LatencyWindow(), retrieve: new LatencyWindow() }
  #retrievedTokens = 0
  #requestedTokens = 0
  #retrieveTimeouts = 0
  #closed = false
  /** Operations in flight: close() waits for them before freeing L1. */
  readonly #ops_inflight = new Set<Promise<unknown>>()

  private constructor(
    o: ResolvedOptions,
    manager: StorageManager,
    native: { api: NativeModule | undefined; reason: string | undefined },
    remoteCodec: ChunkCodecName,
    ownsCodec: boolean,
  ) {
    this.#ownsCodec = ownsCodec
    this.model = o.model
    this.chunkTokens = o.chunkTokens
    this.chunkBytes = chunkBytes(o.model, o.chunkTokens)
    this.namespace = o.namespace
    this.#memo = new KeyMemo(
      {
        modelId: o.model.modelId,
        geometry: o.model,
        chunkTokens: o.chunkTokens,
        scheme: o.keyScheme,
        hashSeed: o.hashSeed,
      },
      undefined,
      // The addon's one-call chain (a 512-chunk prompt: ~0.4 ms instead of 512 JS hash calls).
      native.api ? native.api.sha256V1Chain : undefined,
    )
    this.#manager = manager
    this.#native = native.api
    this.#nativeReason = native.reason
    this.#remoteCodec = remoteCodec
    this.#quality = o.remote ? o.remote.quality : undefined
  }

  /** Validates options (InvalidArgumentError), allocates L1, rebuilds the L2 index, connects L4 lazily. */
  static async open(options: KVCacheOptions, shared: SharedTiers = {}): Promise<KVCache> {
    const o = resolveOptions(options)
    const native = o.native ? loadNative() : { api: undefined, reason: 'disabled by options.native = false' }
    const g = o.model
    const memory =
      shared.memory ??
      (await MemoryTier.create({
        bytes: o.memory.bytes,
        chunkBytes: chunkBytes(g, o.chunkTokens),
        // Room for the chunk header in front of each tensor: raw L2 files and L4 bodies are read straight into slots.
        dataOffset: headerBytesFor(g.layers),
        native: native.api,
        nativeReason: native.reason,
      }))
    const codec = shared.codec ?? new CodecPool(o.codecWorkers)
    // Chunks from L4 (any writer's codec) and coded L2 files are decoded on the pool's workers:
    // start them while the caller is still setting up, not on its first hit.
    if (o.remote || (o.disk && o.disk.storeAs !== 'raw')) codec.warm()
    // What this open acquired, released if a later step throws: a cache that never opened is
    // nobody's to close, and its L2 tier would stay counted (and evicted for) in a shared budget.
    const opened: { disk?: DiskTier; remote?: RemoteTier; calibrations?: CalibrationStore } = {}
    try {
      return await KVCache.#assemble(o, shared, native, memory, codec, opened)
    } catch (e) {
      opened.calibrations?.close()
      opened.disk?.close()
      await opened.remote?.close(0).catch(() => {})
      if (!shared.codec) await codec.close().catch(() => {})
      if (!shared.memory) memory.dispose()
      throw e
    }
  }

  /** open()'s steps after L1: each tier it opens is recorded in `opened` as soon as it exists. */
  static async #assemble(
    o: ResolvedOptions,
    shared: SharedTiers,
    native: { api: NativeModule | undefined; reason: string | undefined },
    memory: MemoryTier,
    codec: CodecPool,
    opened: { disk?: DiskTier; remote?: RemoteTier; calibrations?: CalibrationStore },
  ): Promise<KVCache> {
    const g = o.model
    if (memory.dataOffset + chunkBytes(g, o.chunkTokens) > memory.slotBytes) {
      throw new InvalidArgumentError(
        `a chunk of ${chunkBytes(g, o.chunkTokens)} bytes does not fit the shared L1's slots of ${memory.slotBytes} bytes`,
      )
    }
    const ns: KeyNamespace = {
      modelId: g.modelId,
      geometry: g,
      chunkTokens: o.chunkTokens,
      scheme: o.keyScheme,
      hashSeed: o.hashSeed,
    }
    const nsId = fromHex(namespaceId(ns))
    const disk = o.disk
      ? await DiskTier.open({
          ...o.disk,
          native: native.api,
          verify: (b) => codec.verify(b),
          // Another model, namespace or chunk size sharing the directory is not ours to count or evict.
          owns: (h) => equalBytes(h.namespaceId, nsId),
          sharedBudget: shared.diskBudget,
        })
      : undefined
    opened.disk = disk
    const remoteCodec: ChunkCodecName = o.remote ? o.remote.codec : 'raw'
    const remote = o.remote
      ? new RemoteTier({ ...o.remote, namespace: o.namespace }, { geometry: g, chunkTokens: o.chunkTokens })
      : undefined
    opened.remote = remote
    const diskCodec = o.disk ? o.disk.storeAs : 'raw'
    // Objects naming a calibration can come from L4 or (after a restart) L2: the store
    // fetches from the gateway and keeps its objects beside L2 to decode offline.
    const calib = o.remote ? o.remote.calibration : false
    const calibrations =
      remote || disk
        ? new CalibrationStore({
            // Built on a codec worker: it reads every sample and must not stall the calling thread.
            codec: { build: (samples) => codec.buildCalibration(samples, g), open: openCalibration },
            geometry: g,
            remote,
            dir: o.disk ? join(o.disk.dir, 'calibrations') : undefined,
            // Building one makes sense only where lossy chunks are encoded with it.
            calibrateAfter: calib && remoteCodec === 'kvgate' ? calib.after : 0,
            ...(calib ? { currentTtlMs: calib.currentTtlMs, cacheEntries: calib.cacheEntries } : {}),
          })
        : undefined
    opened.calibrations = calibrations
    const manager = new StorageManager({
      geometry: g,
      chunkTokens: o.chunkTokens,
      namespaceId: nsId,
      memory,
      disk,
      remote,
      diskCodec,
      remoteCodec,
      remoteQuality: o.remote ? o.remote.quality : undefined,
      fetchConcurrency: o.fetchConcurrency,
      layersPerRequest: o.layersPerRequest,
      codec,
      writeBehindBytes: o.writeBehindBytes,
      retrieveDeadlineMs: o.retrieveDeadlineMs,
      calibrations,
      encodeCalibrated: calib !== false,
    })
    return new KVCache(o, manager, native, remoteCodec, !shared.codec)
  }

  #open(): void {
    if (this.#closed) throw closedError()
  }

  /**
   * Runs one public operation, tracked so close() can wait for it before freeing
   * L1: an operation that close() overtakes fails with ERR_CLOSED, whatever step it was at.
   */
  async #op<T>(fn: () => Promise<T>): Promise<T> {
    this.#open()
    const p = fn()
    this.#ops_inflight.add(p)
    try {
      const v = await p
      if (this.#closed) throw closedError()
      return v
    } catch (e) {
      if (this.#closed) throw closedError()
      throw e
    } finally {
      this.#ops_inflight.delete(p)
    }
  }

  /**
   * The chained keys of the full chunks of `tokens` (validated), and of the
   * trailing partial chunk with `includePartial`. Prompts sharing a prefix with
   * a recent one reuse its keys: only new chunks are hashed.
   */
  keys(tokens: Tokens, includePartial = false): ChunkKey[] {
    return this.#memo.keys(tokenArray(tokens), includePartial === true)
  }

  /** Byte offset of chunk i in the 'chunks' layout and its tensor size. */
  #span(keys: readonly ChunkKey[]): { offsets: number[]; total: number } {
    const offsets: number[] = []
    let total = 0
    for (const k of keys) {
      offsets.push(total)
      total += this.#manager.tensorBytes(k)
    }
    return { offsets, total }
  }

  /**
   * Stores the KV of every full chunk of `tokens` (and of the trailing partial
   * chunk with `includePartial`). `kv` is host bytes in the 'chunks' layout
   * (chunk tensors [layer][K|V][token][kvHead][headDim] back to back, exactly
   * that long), the 'sequence' layout, or a GPU buffer. Resolves once L1 holds
   * the chunks; L2 and L4 are written in the background.
   */
  store(tokens: Tokens, kv: Uint8Array | GpuBuffer, options: StoreOptions = {}): Promise<StoreResult> {
    return this.#op(() => this.#store(tokens, kv, options))
  }

  async #store(tokens: Tokens, kv: Uint8Array | GpuBuffer, options: StoreOptions): Promise<StoreResult> {
    const t0 = performance.now()
    const keys = this.keys(tokens, options.includePartial)
    const layout = checkLayout(options)
    let fill: (i: number, dst: Uint8Array) => void | Promise<void>
    if (layout === 'sequence' && !isGpuBuffer(kv)) {
      const seq = this.#sequence('kv', kv, tokens.length)
      fill = (i, dst) => seq.gather(keys[i]!, dst)
    } else if (isGpuBuffer(kv)) {
      this.#gpuFullChunksOnly(keys)
      validateGpuBuffer(kv, this.model, this.chunkTokens, keys.length)
      const native = this.#native
      fill = (i, dst) => copyChunkFromGpu(native, kv, this.model, this.chunkTokens, i, dst)
    } else {
      const bytes = asBytes('kv', kv)
      const { offsets, total } = this.#span(keys)
      if (bytes.byteLength !== total) {
        throw new InvalidArgumentError(
          `invalid kv: ${bytes.byteLength} bytes, expected ${total} (${keys.length} chunk tensors of ${this.chunkBytes} bytes` +
            `${options.includePartial ? ', the last one partial' : '; a trailing partial chunk is not stored unless includePartial'})`,
        )
      }
      fill = (i, dst) => dst.set(bytes.subarray(offsets[i]!, offsets[i]! + dst.byteLength))
    }
    const out = await this.#manager.store(keys, fill)
    this.#ops.store.record(since(t0))
    return { chunks: keys.length, ...out }
  }

  #gpuFullChunksOnly(keys: readonly ChunkKey[]): void {
    if (keys.some((k) => k.partial)) {
      throw new InvalidArgumentError(
        'includePartial is not supported with GPU buffers yet: store full chunks only',
      )
    }
  }

  /**
   * A whole-sequence tensor ([layer][K|V][token 0..n)[kvHead][headDim], what a
   * forward pass produces) seen as chunks: gather/scatter one chunk's rows.
   */
  #sequence(
    name: string,
    v: unknown,
    n: number,
  ): { gather(k: ChunkKey, dst: Uint8Array): void; scatter(k: ChunkKey, src: Uint8Array): void } {
    const bytes = asBytes(name, v)
    const g = this.model
    const row = rowElements(g) * dtypeBytes(g.dtype)
    const want = kvPlanes(g) * g.layers * n * row
    if (bytes.byteLength !== want) {
      throw new InvalidArgumentError(
        `invalid ${name}: ${bytes.byteLength} bytes, a sequence tensor of ${n} tokens is ${want} ([layer][K|V][token][kvHead][headDim])`,
      )
    }
    const each = (k: ChunkKey, f: (seqOff: number, chunkOff: number, run: number) => void) => {
      const run = (k.end - k.start) * row
      for (let side = 0; side < kvPlanes(g) * g.layers; side++)
        f(side * n * row + k.start * row, side * run, run)
    }
    return {
      gather: (k, dst) => each(k, (so, co, run) => dst.set(bytes.subarray(so, so + run), co)),
      scatter: (k, src) => each(k, (so, co, run) => bytes.set(src.subarray(co, co + run), so)),
    }
  }

  /**
   * How many leading tokens some tier holds, and which tier holds each chunk
   * (the partial tail chunk counts with `includePartial`). Never throws on gateway faults.
   */
  lookup(tokens: Tokens, options: { includePartial?: boolean } = {}): Promise<LookupResult> {
    return this.#op(() => this.#lookup(tokens, options))
  }

  async #lookup(tokens: Tokens, options: { includePartial?: boolean }): Promise<LookupResult> {
    const t0 = performance.now()
    const keys = this.keys(tokens, options.includePartial)
    const tiers = await this.#manager.lookup(keys)
    this.#ops.lookup.record(since(t0))
    return {
      tokens: tiers.length > 0 ? keys[tiers.length - 1]!.end : 0,
      chunks: tiers.map((tier, index) => ({ index, key: keys[index]!.hex, tier })),
    }
  }

  /**
   * Copies the longest available prefix into `into` and returns the mask of
   * served tokens, LMCache's convention: a Uint8Array of tokens.length where
   * mask[t] = 1 when token t's KV was written to `into`, else 0. Served tokens
   * always form a prefix of whole chunks (plus the partial tail chunk with
   * `includePartial`, when it was stored); the caller recomputes the rest.
   */
  retrieve(tokens: Tokens, options: RetrieveOptions): Promise<Uint8Array> {
    return this.#op(() => this.#retrieve(tokens, options))
  }

  async #retrieve(tokens: Tokens, options: RetrieveOptions): Promise<Uint8Array> {
    const t0 = performance.now()
    if (typeof options !== 'object' || options === null || options.into === undefined) {
      throw new InvalidArgumentError('retrieve needs { into }: a host buffer or a GPU buffer')
    }
    const keys = this.keys(tokens, options.includePartial)
    const into = options.into
    if (options.deadlineMs !== undefined) checkInt('deadlineMs', options.deadlineMs, 1, 3_600_000)
    const layout = checkLayout(options)
    let write: (i: number, tensor: Uint8Array, fetched: boolean) => void | Promise<void>
    let target: ((i: number) => Uint8Array) | undefined
    if (layout === 'sequence' && !isGpuBuffer(into)) {
      const seq = this.#sequence('into', into, tokens.length)
      write = (i, t) => seq.scatter(keys[i]!, t)
    } else if (isGpuBuffer(into)) {
      this.#gpuFullChunksOnly(keys)
      validateGpuBuffer(into, this.model, this.chunkTokens, keys.length)
      const native = this.#native
      write = (i, t) => copyChunkToGpu(native, into, this.model, this.chunkTokens, i, t)
    } else {
      const bytes = asBytes('into', into)
      const { offsets, total } = this.#span(keys)
      if (bytes.byteLength < total) {
        throw new InvalidArgumentError(
          `invalid into: ${bytes.byteLength} bytes, need ${total} (${keys.length} chunk tensors of up to ${this.chunkBytes} bytes)`,
        )
      }
      // An L1 hit is a plain copy on this thread: measured here, a copy on the addon's pool
      // (copyHost) made an L1 retrieve 0.75–0.81× memcpy instead of 0.86–0.90×. A chunk fetched
      // from L4 is copied on the pool: a cold node's L4 load is bound by this thread otherwise
      // (it also takes the HTTP bodies and their copies into L1), whatever the node's cores.
      const native = this.#native?.copyViewsReady() ? this.#native : undefined
      write = (i, t, fetched) => {
        const at = offsets[i]!
        if (fetched && native && t.byteLength >= native.COPY_VIEWS_MIN_BYTES)
          return native.copyViews(bytes.subarray(at, at + t.byteLength), t)
        bytes.set(t, at)
      }
      // Chunks read from L2 are copied here by the workers that verify them, while in cache.
      if (bytes.buffer instanceof ArrayBuffer)
        target = (i) => bytes.subarray(offsets[i]!, offsets[i]! + this.#manager.tensorBytes(keys[i]!))
    }
    const deadlineMs =
      options.deadlineMs === undefined ? undefined : checkInt('deadlineMs', options.deadlineMs, 1, 3_600_000)
    const { served, timedOut } = await this.#manager.retrieve(keys, write, { deadlineMs, target })
    if (timedOut) this.#retrieveTimeouts++
    const servedTokens = served > 0 ? keys[served - 1]!.end : 0
    const mask = new Uint8Array(tokens.length)
    mask.fill(1, 0, servedTokens)
    this.#requestedTokens += tokens.length
    this.#retrievedTokens += servedTokens
    this.#ops.retrieve.record(since(t0))
    return mask
  }

  /**
   * Layer by layer over the available prefix: each item holds one layer's slab
   * ([K|V][token][kvHead][headDim]) for each served chunk, valid until the
   * generator finishes (run to its end, return()ed, or thrown), not only until the
   * next item. Remote chunks arrive through `?layers=a-b` range requests, so the
   * transfer of later layers overlaps the caller's work on earlier ones.
   * `chunks` never grows between items: if a remote chunk fails midway, later
   * items cover fewer chunks. The last item's `tokens` are the tokens served
   * (valid in every layer); the caller recomputes the rest (see LayerBatch).
   */
  retrieveLayers(tokens: Tokens, options: { includePartial?: boolean } = {}): AsyncGenerator<LayerBatch> {
    this.#open()
    const keys = this.keys(tokens, options.includePartial)
    return this.#manager.retrieveLayers(keys)
  }

  // Engine integration (`kvgate agent`): the same operations over chain keys the caller
  // derived itself (vLLM's block hashes), for engines that hash their own prompts.

  /** Tiers of the leading chunks of `keys`; `localOnly` answers from L1/L2 without asking the gateway. */
  async lookupKeys(keys: readonly ChunkKey[], options: { localOnly?: boolean } = {}): Promise<TierName[]> {
    this.#open()
    if (options.localOnly !== true) return this.#op(() => this.#manager.lookup(keys))
    const m = this.#manager
    const tiers: TierName[] = []
    for (const k of keys) {
      if (m.memory.has(k.hex)) tiers.push('memory')
      else if (m.disk?.has(k.hex)) tiers.push('disk')
      else break
    }
    return tiers
  }

  /** Leading chunks of `keys` that L1 or L2 holds, synchronously (what lookupKeys answers with localOnly). */
  localPrefixKeys(keys: readonly ChunkKey[]): number {
    this.#open()
    const m = this.#manager
    let n = 0
    while (n < keys.length && (m.memory.has(keys[n]!.hex) || m.disk?.has(keys[n]!.hex) === true)) n++
    return n
  }

  /** Whether L1 or L2 holds the chunk with this key id (localPrefixKeys for one key, by its hex). */
  hasLocal(hex: string): boolean {
    this.#open()
    const m = this.#manager
    return m.memory.has(hex) || m.disk?.has(hex) === true
  }

  /** MemoryTier.resident of L1: its chunk for this key id, in L1 while `indexed` is true. */
  memoryResident(hex: string): Resident | undefined {
    this.#open()
    return this.#manager.memory.resident(hex)
  }

  /** MemoryTier.removals of L1 (throws ERR_CLOSED once the cache closed, as every local probe does). */
  get memoryRemovals(): number {
    this.#open()
    return this.#manager.memory.removals
  }

  /** Whether a gateway tier is configured (a lookup past the local tiers may ask it). */
  get hasRemote(): boolean {
    return this.#manager.remote !== undefined
  }

  /** store() over caller-derived keys: `fill(i, dst)` writes chunk i's tensor. Resolves once L1 (or a private copy) holds them. */
  storeKeys(
    keys: readonly ChunkKey[],
    fill: (i: number, dst: Uint8Array) => void | Promise<void>,
  ): Promise<StoreResult> {
    // Tracked like store(): close() frees L1 only after the fill (an engine's copy into it) ended.
    return this.#op(async () => ({ chunks: keys.length, ...(await this.#manager.store(keys, fill)) }))
  }

  /** retrieveLayers() over caller-derived keys. */
  retrieveLayersKeys(keys: readonly ChunkKey[]): AsyncGenerator<LayerBatch> {
    this.#open()
    return this.#manager.retrieveLayers(keys)
  }

  /** prefetch() over caller-derived keys; resolves to the chunks resident in L1. */
  prefetchKeys(keys: readonly ChunkKey[]): Promise<number> {
    return this.#op(() => this.#manager.prefetch(keys))
  }

  /** Brings the available prefix into L1 ahead of a retrieve. Resolves to the tokens now resident in L1. */
  prefetch(tokens: Tokens, options: { includePartial?: boolean } = {}): Promise<{ tokens: number }> {
    return this.#op(async () => {
      const keys = this.keys(tokens, options.includePartial)
      const n = await this.#manager.prefetch(keys)
      return { tokens: n > 0 ? keys[n - 1]!.end : 0 }
    })
  }

  /**
   * Drops every chunk from L1 (lower tiers keep theirs), e.g. to free memory for
   * a model reload. Chunks being copied right now keep their slots until released.
   */
  clearMemory(): void {
    this.#open()
    this.#manager.memory.clear()
  }

  /** Waits for background writes to L2 and L4 (bounded by `timeoutMs`). */
  async flush(timeoutMs = 30_000): Promise<void> {
    await this.#manager.flush(timeoutMs)
  }

  stats(): KVCacheStats {
    const m = this.#manager
    return {
      model: this.model.modelId,
      chunkTokens: this.chunkTokens,
      chunkBytes: this.chunkBytes,
      namespace: this.namespace,
      native: { loaded: this.#native !== undefined, reason: this.#nativeReason },
      memory: { ...m.memory.counters.snapshot(), ...m.memory.stats() },
      disk: m.disk ? { ...m.disk.counters.snapshot(), ...m.disk.stats() } : null,
      writeBehind: m.writeBehindStats(),
      remote: m.remote
        ? {
            ...m.remote.counters.snapshot(),
            ...m.remote.stats(),
            codec: this.#remoteCodec,
            quality: this.#quality,
          }
        : null,
      operations: {
        store: this.#ops.store.summary(),
        lookup: this.#ops.lookup.summary(),
        retrieve: this.#ops.retrieve.summary(),
      },
      retrieveTimeouts: this.#retrieveTimeouts + this.#manager.layerRetrieveTimeouts,
      retrievedTokens: this.#retrievedTokens,
      requestedTokens: this.#requestedTokens,
      keyMemo: { ...this.#memo.stats },
      codec: { inline: m.codec.inline, readyWorkers: m.codec.readyWorkers, ...m.codec.counts },
      calibration: m.calibrations?.stats() ?? null,
    }
  }

  /** stats() as Prometheus text (for a /metrics endpoint of the embedding process). */
  metrics(): string {
    const s = this.stats()
    const tiers: [string, TierCounterSnapshot][] = [['memory', s.memory]]
    if (s.disk) tiers.push(['disk', s.disk])
    if (s.remote) tiers.push(['remote', s.remote])
    const per = (f: (t: TierCounterSnapshot) => number) =>
      tiers.map(([tier, t]) => ({ labels: { tier }, value: f(t) }))
    const lat = (q: 'p50Ms' | 'p99Ms') =>
      tiers.map(([tier, t]) => ({
        labels: { tier, quantile: q === 'p50Ms' ? '0.5' : '0.99' },
        value: t.readLatency[q] / 1000,
      }))
    return prometheusText([
      {
        name: 'hits_total',
        help: 'Chunk reads served by the tier.',
        type: 'counter',
        values: per((t) => t.hits),
      },
      {
        name: 'misses_total',
        help: 'Chunk reads the tier could not serve.',
        type: 'counter',
        values: per((t) => t.misses),
      },
      {
        name: 'read_bytes_total',
        help: 'Bytes read from the tier.',
        type: 'counter',
        values: per((t) => t.bytesRead),
      },
      {
        name: 'written_bytes_total',
        help: 'Bytes written to the tier.',
        type: 'counter',
        values: per((t) => t.bytesWritten),
      },
      {
        name: 'evictions_total',
        help: 'Chunks evicted from the tier.',
        type: 'counter',
        values: per((t) => t.evictions),
      },
      {
        name: 'errors_total',
        help: 'Failures hidden from the caller.',
        type: 'counter',
        values: per((t) => t.errors),
      },
      {
        name: 'corrupt_total',
        help: 'Objects that failed verification.',
        type: 'counter',
        values: per((t) => t.corrupt),
      },
      {
        name: 'read_latency_seconds',
        help: 'Chunk read latency quantiles (recent window; L4: GETs, not lookups).',
        type: 'gauge',
        values: [...lat('p50Ms'), ...lat('p99Ms')],
      },
      {
        name: 'remote_lookup_latency_seconds',
        help: 'Gateway lookup round-trip quantiles (recent window).',
        type: 'gauge',
        values: s.remote
          ? (['p50Ms', 'p99Ms'] as const).map((q) => ({
              labels: { quantile: q === 'p50Ms' ? '0.5' : '0.99' },
              value: s.remote!.lookupLatency[q] / 1000,
            }))
          : [],
      },
      {
        name: 'remote_unservable_held_total',
        help: 'L4 keys put on hold as unservable (their reads kept failing, or a newer writer): misses for a while.',
        type: 'counter',
        values: [{ value: s.remote?.unservableHeld ?? 0 }],
      },
      {
        name: 'remote_lookup_unservable_stops_total',
        help: 'Lookups whose matched prefix stopped before a chunk held as unservable.',
        type: 'counter',
        values: [{ value: s.remote?.unservableLookupStops ?? 0 }],
      },
      {
        name: 'shed_writes_total',
        help: 'Uploads dropped by the write-behind queue.',
        type: 'counter',
        values: [{ value: s.remote?.shedWrites ?? 0 }],
      },
      {
        name: 'calibration_misses_total',
        help: 'Chunks that named a calibration object this node could not get (served as misses).',
        type: 'counter',
        values: [{ value: s.calibration?.misses ?? 0 }],
      },
      {
        name: 'breaker_open',
        help: '1 when the gateway circuit breaker is open or half-open.',
        type: 'gauge',
        values: [{ value: s.remote && s.remote.breaker !== 'closed' ? 1 : 0 }],
      },
      {
        name: 'memory_used_bytes',
        help: 'L1 bytes in use.',
        type: 'gauge',
        values: [{ value: s.memory.usedBytes }],
      },
      {
        name: 'disk_used_bytes',
        help: 'L2 bytes in use.',
        type: 'gauge',
        values: [{ value: s.disk?.usedBytes ?? 0 }],
      },
      {
        name: 'write_behind_shed_total',
        help: 'Stored chunks not written to L2/L4 because the write-behind byte budget was spent.',
        type: 'counter',
        values: [{ value: s.writeBehind.shedWrites }],
      },
      {
        name: 'write_behind_held_bytes',
        help: 'Bytes of stored chunks held for background L2/L4 writes.',
        type: 'gauge',
        values: [{ value: s.writeBehind.heldBytes }],
      },
      {
        name: 'retrieve_timeouts_total',
        help: 'Retrieves (retrieve and retrieveLayers) cut short by their deadline (the rest of their chunks were misses).',
        type: 'counter',
        values: [{ value: s.retrieveTimeouts }],
      },
      {
        name: 'retrieved_tokens_total',
        help: 'Tokens served by retrieve().',
        type: 'counter',
        values: [{ value: s.retrievedTokens }],
      },
    ])
  }

  /**
   * Flushes background writes (up to `flushMs`), closes connections and frees
   * the pinned L1 memory. Slabs handed out by retrieveLayers are invalid afterwards.
   */
  async close(flushMs = 5000): Promise<void> {
    if (this.#closed) return
    // Operations in flight see ERR_CLOSED at their next step; L1 is freed only
    // after they stopped (a copy into freed pinned memory would be a crash, not an error).
    this.#closed = true
    this.#manager.close()
    await Promise.race([Promise.allSettled([...this.#ops_inflight]), sleepUnref(Math.max(flushMs, 1000))])
    await this.#manager.flush(flushMs)
    this.#manager.dropQueuedWrites()
    this.#manager.disk?.close()
    this.#manager.calibrations?.close()
    await this.#manager.remote?.close(0)
    if (this.#ownsCodec) await this.#manager.codec.close()
    this.#manager.memory.dispose()
  }
}

function closedError(): KvgateError {
  return new KvgateError('ERR_CLOSED', 'KVCache is closed')
}

function checkInt(name: string, v: unknown, min: number, max: number): number {
  if (typeof v !== 'number' || !Number.isSafeInteger(v) || v < min || v > max)
    throw new InvalidArgumentError(`invalid ${name}: expected an integer in ${min}..${max}, got ${String(v)}`)
  return v
}

function equalBytes(a: Uint8Array, b: Uint8Array): boolean {
  return a.byteLength === b.byteLength && a.every((x, i) => x === b[i])
}

function sleepUnref(ms: number): Promise<void> {
  return new Promise((r) => setTimeout(r, ms).unref())
}

function checkLayout(o: { layout?: unknown }): KvLayout {
  const l = o.layout ?? 'chunks'
  if (l !== 'chunks' && l !== 'sequence')
    throw new InvalidArgumentError(`invalid layout '${String(l)}' (chunks or sequence)`)
  return l
}

function asBytes(name: string, v: unknown): Uint8Array {
  if (v instanceof Uint8Array) return v
  if (ArrayBuffer.isView(v)) return new Uint8Array(v.buffer, v.byteOffset, v.byteLength)
  throw new InvalidArgumentError(
    `invalid ${name}: expected a Uint8Array (or another ArrayBufferView) or a GPU buffer`,
  )
}

/**
 * Eager token validation and conversion in one pass: array-like of integers in
 * 0..2^32-1, at most 16M tokens. Returns a Uint32Array (the input itself when it is one).
 */
export function tokenArray(tokens: unknown): Uint32Array {
  if (tokens instanceof Uint32Array) {
    if (tokens.length > MAX_TOKENS)
      throw new InvalidArgumentError(`too many tokens: ${tokens.length} > ${MAX_TOKENS}`)
    return tokens
  }
  if (tokens instanceof Uint16Array || tokens instanceof Uint8Array) {
    if (tokens.length > MAX_TOKENS)
      throw new InvalidArgumentError(`too many tokens: ${tokens.length} > ${MAX_TOKENS}`)
    return Uint32Array.from(tokens)
  }
  if (!Array.isArray(tokens) && !(tokens instanceof Int32Array)) {
    throw new InvalidArgumentError('invalid tokens: expected an array or Uint32Array of token ids')
  }
  const n = tokens.length
  if (n > MAX_TOKENS) throw new InvalidArgumentError(`too many tokens: ${n} > ${MAX_TOKENS}`)
  const out = new Uint32Array(n)
  for (let i = 0; i < n; i++) {
    const t = tokens[i] as unknown
    // `t >>> 0 === t` holds exactly for integers in 0..2^32-1 (rejects NaN, floats, negatives, non-numbers).
    if (typeof t !== 'number' || t >>> 0 !== t) {
      throw new InvalidArgumentError(
        `invalid token at index ${i}: ${String(t)} (expected an integer id in 0..2^32-1)`,
      )
    }
    out[i] = t
  }
  return out
}
