// The agent's operations: hello, register, lookup, load, save, poll, stats. Transport-free
// (server.ts feeds it decoded requests per connection); owns the KV spaces and their caches.

import { CodecPool } from '../client/codec-pool.ts'
import type { KVCacheOptions } from '../client/config.ts'
import { loadNative } from '../client/native-api.ts'
import type { DiskBudget } from '../client/tiers/disk.ts'
import type { MemoryTier } from '../client/tiers/memory.ts'
import type { ChunkKey } from '../core/keys.ts'
import type { Dtype } from '../core/layout.ts'
import { defaultCopyThreads, MAX_COPY_THREADS } from './config.ts'
import { DeviceTensor, IpcMappings, resolveDevice } from './device-tensor.ts'
import {
  blockBytes,
  chunkRuns,
  ENGINE_LAYOUTS,
  type EngineGeometry,
  type LayerView,
  layerView,
  sides,
} from './engine-layout.ts'
import {
  binList,
  copyHashes,
  type Hashes,
  hashCount,
  hashes as hashList,
  int,
  intList,
  map,
  oneOf,
  optInt,
  shown,
  str,
} from './fields.ts'
import { HostCopier, HostTensor, type KvTensor, type LayerSlabs } from './host-tensor.ts'
import { AgentMetrics } from './metrics.ts'
import { AgentError, PROTOCOL_VERSION, type Request } from './protocol.ts'
import {
  agentL1Shape,
  checkSpaceCodec,
  createAgentDiskBudget,
  createAgentL1,
  KvSpace,
  type SpaceCacheOptions,
  type SpaceDescriptor,
  spaceId,
} from './space.ts'

const VLLM_DTYPES: Record<string, Dtype> = {
  float16: 'fp16',
  fp16: 'fp16',
  bfloat16: 'bf16',
  bf16: 'bf16',
  float32: 'fp32',
  fp32: 'fp32',
  // vLLM's --kv-cache-dtype fp8 is e4m3 (its tensors are often uint8: the format comes from here).
  fp8: 'fp8e4m3',
  fp8_e4m3: 'fp8e4m3',
  float8_e4m3fn: 'fp8e4m3',
  fp8_e5m2: 'fp8e5m2',
  float8_e5m2: 'fp8e5m2',
}
/** What a load's wait for its next layer gives when that layer was not ready by the end of the turn. */
const TURN_ENDED = Symbol('turn ended')
/** Operations beyond protocol 1's first set, named in hello's answer (a connector uses them only when named). */
const AGENT_FEATURES = ['cancel']
const MAX_KEYS = 1 << 16
const MAX_BLOCKS = 1 << 24
const MAX_WORLD = 64
/**
 * Registrations one connection may hold (in flight included): an engine's connection registers
 * one TP rank, once. Each holds an open file and a mapping per layer (shm) or IPC mappings, never
 * released before the connection ends: a client registering in a loop would exhaust the
 * agent's descriptors and address space for every engine.
 */
const MAX_REGISTRATIONS = 8
/** Tensors (per layer: an open file and a mapping) one connection's registrations may hold. */
const MAX_CONNECTION_TENSORS = 4096
/** A load reports its progress in about this many steps (one threaded copy each). */
const LOAD_PROGRESS_STEPS = 8
/** Buffers a load's copy is sized to name at most (one layer of more chunks is one copy, which HostCopier cuts into calls within the addon's 65 536). */
const MAX_COPY_BUFFERS = 60_000

/**
 * How a threaded load of `chunks` chunks copies `layers` layers: a group is copied once it holds
 * `minLayers` (about an eighth of the model) and the next layer is not ready, and one copy names
 * at most `maxLayers`, so that its buffers (each layer's mapping and a slab per chunk) and runs
 * stay within MAX_COPY_BUFFERS: layers ready together past that go in several copies.
 */
export function loadCopyLayers(layers: number, chunks: number): { minLayers: number; maxLayers: number } {
  const maxLayers = Math.max(1, Math.floor(MAX_COPY_BUFFERS / (chunks + 1)))
  return { minLayers: Math.min(Math.ceil(layers / LOAD_PROGRESS_STEPS), maxLayers), maxLayers }
}

export interface AgentCoreOptions {
  chunkTokens: number
  /** Cache options every space shares (memory.bytes: the one L1 of all spaces; disk under a per-space subdirectory; remote). */
  cache: Omit<KVCacheOptions, 'model' | 'keyScheme' | 'hashSeed' | 'chunkTokens'>
  /** Lookups answer from local tiers after this long when the gateway is slow. */
  lookupDeadlineMs: number
  /** When set, a hello for another model is refused. */
  model?: string
  /** Threads one host-memory save or load copies with; 0: on the event loop. @default min(cores, 4) */
  copyThreads?: number
  /**
   * Test hook: a load's or save's copy, once started, first waits for this (a copy stalled on a
   * thread: it still lands, later). Tests of cancellation and fences only; undefined in service.
   */
  copyGate?: () => Promise<void>
  version: string
}

/** One registered engine worker (one TP rank): its layer tensors. */
interface Worker {
  space: KvSpace
  geometry: EngineGeometry
  /** Where a block's KV lies in each layer's tensor (the same in every layer). */
  view: LayerView
  rank: number
  numBlocks: number
  layers: KvTensor[]
  /** Batched, threaded copies when every layer is a mapped host tensor (else each layer's gather/scatter). */
  copier: HostCopier | undefined
  /** Releases what the registration holds (files, IPC mappings). */
  release(): Promise<void>
  /** Loads and saves still copying: the registration is released only after them. */
  inflight: Set<Promise<unknown>>
}

/** A load's or save's progress, for poll. */
interface Progress {
  op: string
  layers: number
  /** An earlier request in flight under the same id (a client bug), reported again once this one ends. */
  under: Progress | undefined
  /** Set by `cancel`: no copy of this request starts after it; its answer still waits for those in flight. */
  cancelled: boolean
  /** Settles when `cancel` names this request: a load waiting for its chunks stops waiting. */
  onCancel: Promise<void>
  cancel(): void
}

/** What the agent keeps per connection. */
export interface Session {
  descriptor: SpaceDescriptor | undefined
  workers: Map<number, Worker>
  nextWorker: number
  /** Progress of in-flight loads/saves by request id, for poll. */
  progress: Map<number, Progress>
  /** Sends an unsolicited event frame (load progress). */
  event(message: Record<string, unknown>): void
  /** The connection closed (endSession): a register still in flight releases what it mapped. */
  ended: boolean
  /** Registrations of this connection, held or in flight, and their tensors (MAX_REGISTRATIONS). */
  registrations: number
  tensors: number
  /**
   * Whether the engine closed the connection, asked of the kernel (server.ts): true turns
   * before the socket's close event reaches JS. Undefined: only `ended` is known.
   */
  peerClosed?: () => boolean
}

/**
 * Operations whose handler reads the request's bins before `answer` returns, or copies them
 * before it waits: the server hands them their bins as views of the connection's read buffer
 * (which the next read overwrites) and copies every other operation's. A lookup's 16 KiB of
 * packed keys copied per request would be the allocation the reused buffer removes.
 */
export const BINS_READ_AT_ONCE: ReadonlySet<string> = new Set(['lookup'])

export function newSession(event: Session['event']): Session {
  return {
    descriptor: undefined,
    workers: new Map(),
    nextWorker: 1,
    progress: new Map(),
    event,
    ended: false,
    registrations: 0,
    tensors: 0,
  }
}

export class Agent {
  readonly options: AgentCoreOptions
  readonly metrics = new AgentMetrics()
  readonly #spaces = new Map<string, Promise<KvSpace>>()
  /** The spaces of #spaces that finished opening, for lookups that need no await. */
  readonly #openSpaces = new Map<string, KvSpace>()
  /**
   * A session's spaces (by rank) once all are open, for its lookups: their ids are a
   * JSON.stringify and a fresh string's hash each, a tenth of a warm lookup. Open spaces
   * stay open until close(), which every request checks first.
   */
  readonly #lookupSpaces = new WeakMap<SpaceDescriptor, KvSpace[]>()
  /** L1 by slot shape (agentL1Shape): one budget and one LRU for the spaces of one chunk size (each sees only its chunks). */
  readonly #l1 = new Map<string, Promise<MemoryTier>>()
  /** L2 budget of every space; null when L2 is off. */
  #disk: DiskBudget | null | undefined
  /**
   * The codec workers of every space, made with the first: a pool per space (every TP rank,
   * every model) started min(16, cores − 1) threads each, 128 for a TP-8 engine, all decoding
   * at once on the same cores with ~74 MiB of staging each on 8B chunks.
   */
  #codec: CodecPool | undefined
  /** Every registration not yet released, on any connection: close() releases what sessions left. */
  readonly #workers = new Set<Worker>()
  #prefetching = 0
  #closed = false

  constructor(options: AgentCoreOptions) {
    // resolveAgentConfig checks it too; an embedder's value would otherwise fail every save and load.
    const t = options.copyThreads
    if (t !== undefined && !(Number.isInteger(t) && t >= 0 && t <= MAX_COPY_THREADS)) {
      throw new AgentError(
        'ERR_INVALID_ARGUMENT',
        `invalid copyThreads: expected an integer in 0..${MAX_COPY_THREADS}, got ${String(t)}`,
      )
    }
    this.options = options
  }

  /** Runs one request; resolves to the response body (without id/ok). */
  async handle(s: Session, req: Request): Promise<Record<string, unknown>> {
    return this.answer(s, req)
  }

  /**
   * Runs one request: the response body (without id/ok) or, for an operation that waits
   * (register, load, save, stats, flush, a lookup that asks the gateway), a promise of it.
   * Throws an AgentError for a request refused at once. The server answers a synchronous
   * body in the same tick, without a promise, its microtasks and a tick for the write:
   * ping, hello, poll and a warm lookup are most of an engine's requests.
   */
  answer(s: Session, req: Request): Record<string, unknown> | Promise<Record<string, unknown>> {
    if (this.#closed) throw new AgentError('ERR_CLOSED', 'the agent is shutting down')
    switch (req.op) {
      case 'hello':
        return this.#hello(s, req)
      case 'register':
        return this.#register(s, req)
      case 'lookup':
        return this.#lookup(s, req)
      case 'load':
        return this.#tracked(s, req, (w) => this.#load(s, w, req))
      case 'save':
        return this.#tracked(s, req, (w) => this.#save(s, w, req))
      case 'poll':
        return this.#poll(s, req)
      case 'cancel':
        return this.#cancel(s, req)
      case 'stats':
        return this.stats(req.spaces === true)
      case 'ping':
        return {}
      case 'flush':
        return this.#flush(req)
      default:
        throw new AgentError('ERR_UNKNOWN_OP', `unknown op '${req.op.slice(0, 40)}'`)
    }
  }

  #hello(s: Session, m: Request): Record<string, unknown> {
    const protocol = int(m, 'protocol', 0, 0xffff)
    if (protocol !== PROTOCOL_VERSION) {
      throw new AgentError(
        'ERR_PROTOCOL_VERSION',
        `protocol ${protocol} is not supported: this agent speaks ${PROTOCOL_VERSION}`,
      )
    }
    const model = str(m, 'model', 200)
    if (this.options.model !== undefined && model !== this.options.model) {
      throw new AgentError('ERR_MODEL_MISMATCH', `this agent serves '${this.options.model}', not '${model}'`)
    }
    const g = map(m, 'geometry')
    const layout = oneOf(g, 'layout', ENGINE_LAYOUTS)
    const dtypeName = str(g, 'dtype', 32)
    const dtype = VLLM_DTYPES[dtypeName]
    if (dtype === undefined) {
      throw new AgentError(
        'ERR_GEOMETRY_MISMATCH',
        `KV dtype '${dtypeName}' is not supported (float16, bfloat16, float32, float8_e4m3fn, float8_e5m2)`,
      )
    }
    const d: SpaceDescriptor = {
      model,
      layout,
      dtype,
      layers: int(g, 'layers', 1, 1024),
      kvHeads: layout === 'mla' ? 1 : int(g, 'kvHeads', 1, 1024),
      headSize: int(g, 'headSize', 1, 4096),
      blockSize: int(g, 'blockSize', 1, 4096),
      world: optInt(g, 'world', 1, MAX_WORLD, 1),
      hashSeed: str(m, 'hashSeed', 256),
    }
    if (layout === 'mla' && g.kvHeads !== undefined && g.kvHeads !== 1) {
      throw new AgentError('ERR_GEOMETRY_MISMATCH', 'MLA has one latent tensor per layer: kvHeads must be 1')
    }
    if (this.options.chunkTokens % d.blockSize !== 0) {
      throw new AgentError(
        'ERR_GEOMETRY_MISMATCH',
        `the agent's chunk of ${this.options.chunkTokens} tokens is not a whole number of ${d.blockSize}-token blocks: ` +
          `start the agent with --chunk-tokens (KVGATE_CHUNK_TOKENS) a multiple of the engine's block size, e.g. ${d.blockSize * Math.max(1, Math.round(this.options.chunkTokens / d.blockSize))}`,
      )
    }
    checkSpaceCodec(d, this.#cacheOptions())
    if (s.descriptor && JSON.stringify(s.descriptor) !== JSON.stringify(d)) {
      throw new AgentError(
        'ERR_GEOMETRY_MISMATCH',
        'a connection serves one engine geometry; reconnect to change it',
      )
    }
    s.descriptor = d
    return {
      protocol: PROTOCOL_VERSION,
      agent: this.options.version,
      features: AGENT_FEATURES,
      chunkTokens: this.options.chunkTokens,
      blocksPerChunk: this.options.chunkTokens / d.blockSize,
      // This process's pid (in its own pid namespace): the connector checks that the pidfd it
      // opened from the socket's peer credentials names the process answering, not one that
      // only called listen() (a socket handed over, inherited by a child, socket-activated).
      pid: process.pid,
    }
  }

  #descriptor(s: Session): SpaceDescriptor {
    if (!s.descriptor) throw new AgentError('ERR_HELLO_REQUIRED', 'send hello before other operations')
    return s.descriptor
  }

  /**
   * The L1 of every space whose chunks have this size: made when the first of them opens.
   * Spaces of one chunk size (every TP rank of a model, every engine of that model on
   * this node) share its budget and its LRU; another chunk size gets an L1 of its own,
   * since a fixed-size slot would waste most of itself on a smaller chunk.
   */
  #sharedL1(d: SpaceDescriptor): Promise<MemoryTier> {
    const size = agentL1Shape(d, this.options.chunkTokens)
    let p = this.#l1.get(size)
    if (!p) {
      const made = createAgentL1(d, this.#cacheOptions())
      this.#l1.set(size, made)
      made.catch(() => {
        if (this.#l1.get(size) === made) this.#l1.delete(size)
      })
      p = made
    }
    return p
  }

  /** The one L2 budget of every space (made with the first; each space keeps its own subdirectory). */
  #diskBudget(d: SpaceDescriptor): DiskBudget | undefined {
    if (this.#disk === undefined) this.#disk = createAgentDiskBudget(d, this.#cacheOptions()) ?? null
    return this.#disk ?? undefined
  }

  #codecPool(): CodecPool {
    this.#codec ??= new CodecPool(this.options.cache.codecWorkers)
    return this.#codec
  }

  #cacheOptions(): SpaceCacheOptions {
    return { ...this.options.cache, chunkTokens: this.options.chunkTokens }
  }

  /** The shard a rank's KV belongs to: its rank for non-MLA TP, null (one shared copy) otherwise. */
  #shard(d: SpaceDescriptor, rank: number): number | null {
    return d.layout === 'mla' || d.world === 1 ? null : rank
  }

  /** The space of `rank`'s shard: per rank for non-MLA TP, one shared space otherwise. */
  #space(d: SpaceDescriptor, rank: number): Promise<KvSpace> {
    const r = this.#shard(d, rank)
    const id = spaceId(d, r)
    let p = this.#spaces.get(id)
    if (!p) {
      // A request that began before close() (a register awaiting its IPC mappings) must not open
      // a space close() no longer sees: its L1, disk budget and codec pool would stay open.
      if (this.#closed) return Promise.reject(new AgentError('ERR_CLOSED', 'the agent is shutting down'))
      p = this.#sharedL1(d).then((l1) =>
        KvSpace.open(d, r, this.#cacheOptions(), l1, this.#diskBudget(d), this.#codecPool()),
      )
      p.then(
        (sp) => {
          if (this.#spaces.get(id) === p) this.#openSpaces.set(id, sp)
        },
        () => {},
      )
      this.#spaces.set(id, p)
      // A space that failed to open is not cached: the next request tries again.
      p.catch(() => this.#spaces.delete(id))
    }
    return p
  }

  /** A registration within the connection's bounds (counted from its start: those in flight count). */
  #register(s: Session, m: Request): Promise<Record<string, unknown>> {
    const d = this.#descriptor(s)
    if (s.registrations >= MAX_REGISTRATIONS)
      throw new AgentError(
        'ERR_LIMIT',
        `this connection holds ${MAX_REGISTRATIONS} registrations, the most one may: an engine registers once per connection`,
      )
    if (s.tensors + d.layers > MAX_CONNECTION_TENSORS)
      throw new AgentError(
        'ERR_LIMIT',
        `this connection holds ${s.tensors} of its ${MAX_CONNECTION_TENSORS} tensors; ${d.layers} more would pass it`,
      )
    s.registrations++
    s.tensors += d.layers
    const p = this.#mapRegistration(s, m, d)
    // A refused or failed registration holds nothing: its share of the bounds comes back.
    p.catch(() => {
      s.registrations--
      s.tensors -= d.layers
    })
    return p
  }

  async #mapRegistration(s: Session, m: Request, d: SpaceDescriptor): Promise<Record<string, unknown>> {
    const rank = int(m, 'rank', 0, d.world - 1)
    const numBlocks = int(m, 'numBlocks', 1, MAX_BLOCKS)
    const g: EngineGeometry = d
    // Every layer's view has the same strides (its runs are computed once per chunk for all).
    let view: LayerView | undefined
    const list = m.tensors
    if (!Array.isArray(list) || list.length !== d.layers) {
      throw new AgentError('ERR_GEOMETRY_MISMATCH', `register needs one tensor per layer (${d.layers})`)
    }
    const hosts: HostTensor[] = []
    let ipc: IpcMappings | undefined
    let released: Promise<void> | undefined
    // Once: a session's end and the agent's close may both release a registration.
    const release = () => {
      released ??= (async () => {
        for (const h of hosts) h.close()
        await ipc?.close()
      })()
      return released
    }
    // Host tensors are mapped once here when the addon can (else pread/pwrite per run).
    const hostNative = loadNative().api
    const layers: KvTensor[] = []
    let space: KvSpace
    try {
      for (let i = 0; i < list.length; i++) {
        const t = list[i] as Record<string, unknown>
        if (typeof t !== 'object' || t === null)
          throw new AgentError('ERR_INVALID_ARGUMENT', `tensors[${i}] is not a map`)
        const kind = oneOf(t, 'kind', ['shm', 'cuda-ipc'] as const)
        const v = layerView(g, numBlocks, t.shape, t.strides, `tensors[${i}]`)
        if (view !== undefined && JSON.stringify(v) !== JSON.stringify(view))
          throw new AgentError(
            'ERR_LAYOUT',
            `tensors[${i}] has shape ${shown(t.shape)} and strides ${shown(t.strides)}, unlike tensors[0]: every layer of a registration must be laid out alike`,
          )
        view = v
        const want = v.span
        const offset = optInt(t, 'offset', 0, Number.MAX_SAFE_INTEGER, 0)
        if (kind === 'shm') {
          const h = new HostTensor(str(t, 'path', 4096), offset, want, hostNative)
          hosts.push(h)
          layers.push(h)
        } else {
          const native = loadNative()
          if (!native.api)
            throw new AgentError('ERR_CUDA', `the native addon is not loaded: ${native.reason}`)
          const st = native.api.cuda.status()
          if (!st.available)
            throw new AgentError('ERR_CUDA', `CUDA is not available to the agent: ${st.reason}`)
          const [handle] = binList({ h: [t.handle] }, 'h', 64, 1)
          // Where the tensor's storage ends in the allocation (the connector sends it; older ones
          // do not): the agent cannot ask CUDA an allocation's size, and a tensor claimed past its
          // storage would have copies write into whatever else the engine keeps on the GPU.
          // nil is absent, as for every optional field (optInt would give its default, 0).
          if (t.storageEnd !== undefined && t.storageEnd !== null) {
            const end = optInt(t, 'storageEnd', 0, Number.MAX_SAFE_INTEGER, 0)
            if (offset + want > end)
              throw new AgentError(
                'ERR_INVALID_ARGUMENT',
                `tensors[${i}] (${want} bytes at offset ${offset}) runs past its storage, which ends at byte ${end} of the allocation`,
              )
          }
          // The engine's GPU, in this agent's numbering; checked before anything is mapped.
          const device = resolveDevice(native.api, t, `tensors[${i}]`)
          if (ipc && ipc.device !== device)
            throw new AgentError(
              'ERR_INVALID_ARGUMENT',
              `tensors[${i}] is on device ${device}, earlier tensors on device ${ipc.device}: a registration (one TP rank) is one GPU`,
            )
          ipc ??= new IpcMappings(native.api, device)
          layers.push(new DeviceTensor(native.api, device, await ipc.map(handle!), offset, want))
        }
      }
      space = await this.#space(d, rank)
    } catch (e) {
      await release()
      throw e
    }
    // The connection (or the agent) closed while this registration was mapping: nothing would
    // release it later (endSession / close saw no worker yet), so it must not become one.
    if (s.ended || this.#closed) {
      await release()
      throw new AgentError('ERR_CLOSED', 'the connection closed while register was in flight')
    }
    const id = s.nextWorker++
    const threads = this.options.copyThreads ?? defaultCopyThreads()
    const copier = threads > 0 ? HostCopier.for(layers, hostNative, threads) : undefined
    const worker: Worker = {
      space,
      geometry: g,
      view: view!,
      rank,
      numBlocks,
      layers,
      copier,
      release,
      inflight: new Set(),
    }
    s.workers.set(id, worker)
    this.#workers.add(worker)
    this.metrics.workers++
    return {
      worker: id,
      chunkTokens: this.options.chunkTokens,
      blocksPerChunk: space.blocksPerChunk,
      device: ipc?.device ?? null,
    }
  }

  #lookup(s: Session, m: Request): Record<string, unknown> | Promise<Record<string, unknown>> {
    const d = this.#descriptor(s)
    const hashes = this.#hashes(m)
    const deadline = optInt(m, 'deadlineMs', 0, 60_000, this.options.lookupDeadlineMs)
    const asked = hashCount(hashes)
    // Fast path, without a promise, a timer or a key object: the spaces are open and the
    // local tiers answer for every space (they hold every key, or there is no gateway to ask).
    const world = d.layout === 'mla' ? 1 : d.world
    let chunks = asked
    let final = true
    const spaces = this.#openLookupSpaces(d, world)
    for (let r = 0; r < world && final; r++) {
      const sp = spaces?.[r]
      if (sp === undefined) final = false
      else {
        const local = sp.localPrefix(hashes)
        if (local < asked && sp.cache.hasRemote) final = false
        if (local < chunks) chunks = local
      }
    }
    if (final) return this.#lookedUp(asked, chunks, 'all')
    const ranks = Array.from({ length: world }, (_, r) => r)
    // Copied before the wait: the request's bins are views of its connection's read buffer (BINS_READ_AT_ONCE).
    return this.#lookupAll(d, copyHashes(hashes), ranks, deadline)
  }

  /** The spaces of `d`'s ranks when every one is open (a lookup needs no await), else undefined. */
  #openLookupSpaces(d: SpaceDescriptor, world: number): KvSpace[] | undefined {
    const known = this.#lookupSpaces.get(d)
    if (known !== undefined) return known
    const spaces: KvSpace[] = []
    for (let r = 0; r < world; r++) {
      const sp = this.#openSpaces.get(spaceId(d, this.#shard(d, r)))
      if (sp === undefined) return undefined
      spaces.push(sp)
    }
    this.#lookupSpaces.set(d, spaces)
    return spaces
  }

  /** The request's `keys` in either form; counts the forms (an engine still sending arrays runs an older connector). */
  #hashes(m: Request): Hashes {
    const h = hashList(m, 'keys', MAX_KEYS)
    if (h instanceof Uint8Array) this.metrics.packedKeyRequests++
    else this.metrics.arrayKeyRequests++
    return h
  }

  #lookedUp(asked: number, chunks: number, source: string): Record<string, unknown> {
    this.metrics.lookups++
    this.metrics.lookupChunks += asked
    this.metrics.lookupHitChunks += chunks
    return { chunks, tokens: chunks * this.options.chunkTokens, source }
  }

  /** A lookup that may ask the gateway: answered from the local tiers past `deadline`. */
  async #lookupAll(
    d: SpaceDescriptor,
    hashes: Hashes,
    ranks: number[],
    deadline: number,
  ): Promise<Record<string, unknown>> {
    const spaces = await Promise.all(ranks.map((r) => this.#space(d, r)))
    const keys = spaces.map((sp) => sp.keys(hashes))
    const full = Promise.all(spaces.map((sp, i) => sp.cache.lookupKeys(keys[i]!)))
    let timer: NodeJS.Timeout | undefined
    const late = new Promise<'late'>((resolve) => {
      timer = setTimeout(() => resolve('late'), deadline)
    })
    let source = 'all'
    let tiers: string[][]
    try {
      const got = await Promise.race([full, late])
      if (got === 'late') {
        source = 'local'
        this.metrics.lookupDeadline++
        full.catch(() => {})
        tiers = await Promise.all(spaces.map((sp, i) => sp.cache.lookupKeys(keys[i]!, { localOnly: true })))
      } else tiers = got
    } finally {
      clearTimeout(timer)
    }
    const chunks = Math.min(...tiers.map((t) => t.length))
    if (chunks > 0 && tiers.some((t) => t.slice(0, chunks).includes('remote'))) {
      for (let i = 0; i < spaces.length; i++) this.#prefetch(spaces[i]!, keys[i]!.slice(0, chunks))
    }
    return this.#lookedUp(hashCount(hashes), chunks, source)
  }

  /** Brings a remote hit toward L1 before the load asks for it (bounded, best effort). */
  #prefetch(space: KvSpace, keys: ChunkKey[]): void {
    if (this.#prefetching >= 4) return
    this.#prefetching++
    space.cache
      .prefetchKeys(keys)
      .catch(() => {})
      .finally(() => {
        this.#prefetching--
      })
  }

  #worker(s: Session, m: Request): Worker {
    const id = int(m, 'worker', 1, Number.MAX_SAFE_INTEGER)
    const w = s.workers.get(id)
    if (!w) throw new AgentError('ERR_NOT_REGISTERED', `worker ${id} is not registered on this connection`)
    return w
  }

  #blocks(w: Worker, m: Request, chunks: number): number[] {
    const ids = intList(m, 'blockIds', w.numBlocks - 1, MAX_BLOCKS)
    if (ids.length !== chunks * w.space.blocksPerChunk) {
      throw new AgentError(
        'ERR_INVALID_ARGUMENT',
        `blockIds has ${ids.length} entries; ${chunks} chunks of ${w.space.blocksPerChunk} blocks need ${chunks * w.space.blocksPerChunk}`,
      )
    }
    return ids
  }

  /**
   * Fills the engine's blocks from the stored chunks, layer by layer (an event
   * per finished layer). Answers the blocks it could not fill: the engine recomputes them.
   */
  #tracked(
    s: Session,
    m: Request,
    op: (w: Worker) => Promise<Record<string, unknown>>,
  ): Promise<Record<string, unknown>> {
    const w = this.#worker(s, m)
    const p = op(w)
    w.inflight.add(p)
    void p.then(
      () => w.inflight.delete(p),
      () => w.inflight.delete(p),
    )
    return p
  }

  async #load(s: Session, w: Worker, m: Request): Promise<Record<string, unknown>> {
    const hashes = this.#hashes(m)
    const count = hashCount(hashes)
    const ids = this.#blocks(w, m, count)
    const skip = optInt(m, 'skipBlocks', 0, ids.length, 0)
    distinctBlocks(ids, skip, w.numBlocks)
    const g = w.geometry
    const bpc = w.space.blocksPerChunk
    const keys = w.space.keys(hashes)
    const prog = beginProgress(s, m.id, 'load')
    let served = count
    let bytes = 0
    let failure: string | undefined
    // Each chunk's runs are the same in every layer (offsets inside one layer's slab).
    const runsByChunk: ArrayLike<number>[] = []
    // And each chunk's bytes per layer, summed once (a strided view's chunk is 4,096 runs).
    const bytesByChunk: number[] = []
    // Built for the chunks a layer serves, once it is served: not for chunks the tiers do not
    // hold. Built up front, a load of 65,536 keys (present or not) cost a strided view ~100 KB
    // and ~0.1 ms of the event loop per chunk (GBs and seconds) before the first chunk was found.
    const runsFor = (chunks: number) => {
      for (let c = runsByChunk.length; c < chunks; c++) {
        const runs = chunkRuns(g, w.view, ids, c * bpc, bpc, skip)
        runsByChunk.push(runs)
        let n = 0
        for (let r = 2; r < runs.length; r += 3) n += runs[r]!
        bytesByChunk.push(n)
      }
    }
    // Threaded copies of a group of layers run while the next layers are fetched: one native
    // call and one progress event per group (at least an eighth of the model), not per layer.
    // A full group waits for the end of the event loop's turn: layers that are ready together
    // (every layer of chunks in L1, of a chunk read whole from L2) go in one call. Eight calls
    // of 2 parts each (16 jobs on libuv's pool of 4) and the loop launching them between the
    // copies oversubscribed 2 cores, a descheduled part finishing last: an L1 load took 1.1-1.5x
    // the one call's time (bench/agent-ab.ts under load). Remote layer groups still copy as they
    // land. Their slabs stay valid until the generator finishes (LayerBatch.slabs: L1 handles,
    // reservations and fetched groups are held until its finally), and we finish it only after every copy
    // settled: the last layer waits for them, and every other exit waits in `finally` before
    // return(). Only a generator that throws finishes on its own with copies in flight; the
    // load then fails every block (served = 0) and still answers only once they settled.
    const copies = new CopySet()
    const done = new Uint8Array(g.layers)
    const { minLayers: perGroup, maxLayers: perCopy } = loadCopyLayers(g.layers, count)
    let group: LayerSlabs[] = []
    const it = w.space.cache.retrieveLayersKeys(keys)
    /** The generator still has a fetch running (a cancel stopped waiting for it): finished in the background. */
    let abandoned = false
    try {
      const seen = new Set<number>()
      // One event per copy landed (its layers at once), not per layer: each is a frame the
      // engine's reader thread wakes for (a 32-layer load sent 32 events, not the ~8 documented).
      const finished = (layers: readonly number[]) => {
        for (const l of layers) done[l] = 1
        let n = prog.layers
        while (n < g.layers && done[n] === 1) n++
        if (n === prog.layers) return
        prog.layers = n
        s.event({ event: 'load-progress', id: m.id, layers: n })
      }
      // A cancelled load does not wait for chunks still being fetched (a slow gateway): its
      // answer, the engine's fence, needs only the copies already started to land.
      const cancelled = prog.onCancel.then(() => undefined)
      // Once per turn, shared by every wait of that turn.
      let turn: Promise<typeof TURN_ENDED> | undefined
      const turnEnded = () =>
        (turn ??= new Promise((resolve) =>
          setImmediate(() => {
            turn = undefined
            resolve(TURN_ENDED)
          }),
        ))
      const copyGroup = (copier: HostCopier) => {
        // The engine counts a load whose connection closed (or that it cancelled) as failed and
        // recomputes (or reuses) its blocks: no copy into them starts after the close.
        mayCopy(s, prog)
        const ready = group
        group = []
        for (let i = 0; i < ready.length; i += perCopy) {
          const slabs = ready.slice(i, i + perCopy)
          const p = copies.add(this.#gated(() => copier.scatterLayers(slabs, runsByChunk)) as Promise<void>)
          void p.then(
            () => finished(slabs.map((e) => e.layer)),
            () => {},
          )
        }
      }
      for (;;) {
        const pending = it.next()
        let next = await Promise.race(
          w.copier && group.length >= perGroup ? [pending, cancelled, turnEnded()] : [pending, cancelled],
        )
        if (next === TURN_ENDED) {
          // The next layer is not ready in this turn: the full group goes now. One that may not
          // (a cancel or the close came meanwhile) leaves the fetch to finish in the background.
          try {
            copyGroup(w.copier!)
          } catch (e) {
            pending.catch(() => {})
            abandoned = true
            throw e
          }
          next = await Promise.race([pending, cancelled])
        }
        if (next === undefined) {
          pending.catch(() => {})
          abandoned = true
          mayCopy(s, prog)
        }
        if (next === undefined || next.done) break
        const batch = next.value
        served = Math.min(served, batch.chunks)
        runsFor(batch.chunks)
        seen.add(batch.layer)
        const copier = w.copier
        if (copier) {
          group.push({ layer: batch.layer, chunks: batch.chunks, slabs: batch.slabs })
          for (let c = 0; c < batch.chunks; c++) bytes += bytesByChunk[c]!
          if (batch.layer !== g.layers - 1) continue
          copyGroup(copier)
          await copies.settled()
          continue
        }
        const t = w.layers[batch.layer]!
        for (let c = 0; c < batch.chunks; c++) {
          mayCopy(s, prog)
          const runs = runsByChunk[c]!
          const copying = this.#gated(() => t.scatter(batch.slabs[c]!, runs))
          if (copying) await copying // a host tensor copies synchronously: no await per chunk
          bytes += bytesByChunk[c]!
        }
        finished([batch.layer])
      }
      await copies.settled()
      if (seen.size < g.layers) served = 0
    } catch (e) {
      served = 0
      failure = (e as Error).message
      if (prog.cancelled) this.metrics.loadsCancelled++
      else this.metrics.loadErrors++
    } finally {
      // Nothing may still write the engine's blocks once the answer names the failed ones.
      await copies.settled().catch(() => {})
      // Its fetch touches no engine memory: a cancelled load answers without waiting for it.
      const ended = it.return(undefined).catch(() => {})
      if (!abandoned) await ended
      endProgress(s, m.id, prog)
    }
    const failed: number[] = []
    for (let b = Math.max(skip, served * bpc); b < ids.length; b++) failed.push(ids[b]!)
    this.metrics.loads++
    this.metrics.loadedBytes += bytes
    this.metrics.loadedChunks += served
    return {
      chunks: served,
      tokens: served * this.options.chunkTokens,
      failedBlocks: failed,
      error: failure ?? null,
    }
  }

  /** Copies the engine's blocks out into the cache; answers once nothing reads engine memory any more. */
  async #save(s: Session, w: Worker, m: Request): Promise<Record<string, unknown>> {
    const hashes = this.#hashes(m)
    const count = hashCount(hashes)
    const ids = this.#blocks(w, m, count)
    const g = w.geometry
    const bpc = w.space.blocksPerChunk
    const bb = blockBytes(g)
    // Keys always start at chunk 0 (chain identity); `from` skips chunks the engine loaded from us.
    const from = optInt(m, 'from', 0, count, 0)
    distinctBlocks(ids, from * bpc, w.numBlocks)
    const keys = w.space.keys(hashes).slice(from)
    const prog = beginProgress(s, m.id, 'save')
    try {
      const slab = sides(g) * bpc * bb // one layer of the chunk tensor
      const out = await w.space.cache.storeKeys(keys, async (k, dst) => {
        // Once the connection is gone the engine counts this save as ended and may reuse the
        // blocks: a copy not yet begun does not begin, and one that ended after the close is
        // not kept (a throw here aborts the chunk's slot; chunks copied before stay stored).
        // A cancelled save likewise (the engine releases its blocks once it has the answer).
        mayCopy(s, prog)
        const runs = chunkRuns(g, w.view, ids, (k + from) * bpc, bpc, 0)
        // Every layer in one threaded copy; storeKeys commits the L1 slot only after it
        // settled (and aborts it if the agent closed meanwhile).
        const copier = w.copier
        if (copier) await this.#gated(() => copier.gatherChunk(runs, dst, slab))
        else
          for (let layer = 0; layer < g.layers; layer++) {
            const copying = this.#gated(() =>
              w.layers[layer]!.gather(runs, dst.subarray(layer * slab, (layer + 1) * slab)),
            )
            if (copying) await copying
          }
        mayCopy(s, prog)
      })
      this.metrics.saves++
      this.metrics.savedChunks += out.stored + out.skipped
      this.metrics.savedBytes += (out.stored + out.skipped) * bpc * bb * sides(g) * g.layers
      return { chunks: out.chunks, stored: out.stored, present: out.present, skipped: out.skipped }
    } catch (e) {
      if (prog.cancelled) this.metrics.savesCancelled++
      else this.metrics.saveErrors++
      throw e instanceof AgentError ? e : new AgentError('ERR_IO', `save failed: ${(e as Error).message}`)
    } finally {
      endProgress(s, m.id, prog)
    }
  }

  /** Waits for background writes to L2 and the gateway (tests, orderly shutdown of an engine). */
  async #flush(m: Request): Promise<Record<string, unknown>> {
    const timeout = optInt(m, 'timeoutMs', 0, 600_000, 30_000)
    const spaces = await Promise.allSettled([...this.#spaces.values()])
    await Promise.all(
      spaces.map((r) => (r.status === 'fulfilled' ? r.value.cache.flush(timeout) : undefined)),
    )
    return {}
  }

  #poll(s: Session, m: Request): Record<string, unknown> {
    const ids = intList(m, 'ids', Number.MAX_SAFE_INTEGER, 4096)
    const states: Record<string, unknown> = {}
    for (const id of ids) {
      const p = s.progress.get(id)
      states[String(id)] = p ? { state: 'pending', op: p.op, layers: p.layers } : { state: 'unknown' }
    }
    return { states }
  }

  /**
   * Cancels loads and saves of this connection by request id: none starts another copy, and
   * each still answers (a load: every block not loaded is failed; a save: ERR_CANCELLED), only
   * once the copies it started have landed. That answer is the engine's fence: after it nothing
   * of that request touches the engine's blocks. Answers the ids that were in flight.
   */
  #cancel(s: Session, m: Request): Record<string, unknown> {
    const ids = intList(m, 'ids', Number.MAX_SAFE_INTEGER, 4096)
    const found: number[] = []
    for (const id of ids) {
      let p = s.progress.get(id)
      if (p) found.push(id)
      // Every request under that id (one reused while in flight, a client bug): none may copy on.
      for (; p !== undefined; p = p.under) p.cancel()
    }
    return { cancelled: found }
  }

  /** A copy through the test hook's gate (AgentCoreOptions.copyGate), else at once. */
  #gated<T>(copy: () => T | Promise<T>): T | Promise<T> {
    const gate = this.options.copyGate
    return gate ? gate().then(copy) : copy()
  }

  /**
   * Before the agent itself closes a connection (it is shutting down): an engine takes the agent
   * closing its connection as the fence of every load on it (as when the agent dies) and may then
   * free their blocks. So every load and save of the session is cancelled (no copy starts after
   * this) and this resolves only once the copies they started have landed.
   */
  async quiesce(s: Session): Promise<void> {
    for (const first of s.progress.values())
      for (let p: Progress | undefined = first; p; p = p.under) p.cancel()
    await Promise.allSettled([...s.workers.values()].flatMap((w) => [...w.inflight]))
  }

  /** Releases what a closed connection registered. */
  endSession(s: Session): void {
    s.ended = true
    for (const w of s.workers.values()) {
      void this.#release(w)
      this.metrics.workers--
    }
    s.workers.clear()
  }

  /** Agent counters; with `spaces`, each KV space's cache stats too (tiers, gateway errors, shed writes). */
  async stats(detail = false): Promise<Record<string, unknown>> {
    const base = { ...this.metrics.snapshot(), spaces: this.#spaces.size }
    if (!detail) return base
    const spaces = await Promise.allSettled([...this.#spaces.values()])
    return {
      ...base,
      spaceStats: spaces.flatMap((r) =>
        r.status === 'fulfilled' ? [{ id: r.value.id, cache: r.value.cache.stats() }] : [],
      ),
    }
  }

  async metricsText(): Promise<string> {
    const spaces = await Promise.allSettled([...this.#spaces.values()])
    const caches = spaces.flatMap((r) => (r.status === 'fulfilled' ? [r.value.cache.stats()] : []))
    return this.metrics.prometheus(caches)
  }

  /** An IPC mapping or a host-tensor mapping must outlive every copy through it. */
  async #release(w: Worker): Promise<void> {
    await Promise.allSettled([...w.inflight])
    this.#workers.delete(w)
    await w.release()
  }

  async close(): Promise<void> {
    this.#closed = true
    await Promise.all([...this.#workers].map((w) => this.#release(w)))
    const spaces = await Promise.allSettled([...this.#spaces.values()])
    this.#spaces.clear()
    this.#openSpaces.clear()
    await Promise.all(spaces.map((r) => (r.status === 'fulfilled' ? r.value.close() : undefined)))
    await this.#codec?.close()
    const l1 = [...this.#l1.values()]
    this.#l1.clear()
    await Promise.allSettled(l1.map((p) => p.then((t) => t.dispose())))
  }
}

/**
 * Starts a load's or save's progress under its request id. Ids are unique among a connection's
 * requests in flight; one reused anyway (a client bug) hides the earlier request's progress
 * until it ends, and neither request's end forgets the other's.
 */
function beginProgress(s: Session, id: number, op: string): Progress {
  let cancel = () => {}
  const onCancel = new Promise<void>((resolve) => {
    cancel = resolve
  })
  const prog: Progress = {
    op,
    layers: 0,
    under: s.progress.get(id),
    cancelled: false,
    onCancel,
    cancel() {
      prog.cancelled = true
      cancel()
    },
  }
  s.progress.set(id, prog)
  return prog
}

/** Forgets an ended load's or save's progress (only its own: see beginProgress). */
function endProgress(s: Session, id: number, prog: Progress): void {
  let cur = s.progress.get(id)
  if (cur === prog) {
    if (prog.under) s.progress.set(id, prog.under)
    else s.progress.delete(id)
    return
  }
  for (; cur !== undefined; cur = cur.under) {
    if (cur.under === prog) {
      cur.under = prog.under
      return
    }
  }
}

/**
 * Throws once the session's connection closed: its engine no longer waits on its copies and
 * may already reuse their blocks. The kernel's view counts: a save whose copy ended after the
 * engine closed must not be kept even when the close event has not reached JS yet.
 */
function notEnded(s: Session): void {
  if (s.ended || s.peerClosed?.() === true)
    throw new AgentError('ERR_CLOSED', 'the connection closed: the engine may reuse its blocks')
}

/**
 * Refuses a block id named twice among `ids[from..]` (the blocks a load fills or a save stores):
 * an engine bug. A load would race two copies into one block (whichever lands last wins), a save
 * would store one block's KV as two positions'. Leading blocks a load skips (vLLM's null block,
 * repeated) or a save does not store (the chain) are not copied: repeats there are fine.
 */
/**
 * Throws unless `ids[from..]` (block ids below `numBlocks`, checked by the caller) are distinct.
 * A long list is checked against a bitmap of the registration's blocks: a Set of the millions of
 * ids a 16 MiB frame holds held the event loop ~1 s per million (every engine's lookups with it).
 */
export function distinctBlocks(ids: readonly number[], from: number, numBlocks: number): void {
  const twice = (b: number, i: number) =>
    new AgentError(
      'ERR_INVALID_ARGUMENT',
      `blockIds names block ${b} twice (at ${ids.indexOf(b, from)} and ${i}): each block it copies must be distinct`,
    )
  if (ids.length - from <= 4096) {
    const seen = new Set<number>()
    for (let i = from; i < ids.length; i++) {
      const b = ids[i]!
      if (seen.has(b)) throw twice(b, i)
      seen.add(b)
    }
    return
  }
  const seen = new Uint8Array(Math.ceil(numBlocks / 8))
  for (let i = from; i < ids.length; i++) {
    const b = ids[i]!
    const bit = 1 << (b & 7)
    if (seen[b >>> 3]! & bit) throw twice(b, i)
    seen[b >>> 3]! |= bit
  }
}

/** Throws when a copy of this request may not start: its connection closed, or the engine cancelled it. */
function mayCopy(s: Session, prog: Progress): void {
  notEnded(s)
  if (prog.cancelled)
    throw new AgentError('ERR_CANCELLED', `the engine cancelled this ${prog.op}: it may reuse its blocks`)
}

/** Copies in flight: `settled()` waits for every one, then rejects with the first failure. */
class CopySet {
  readonly #pending = new Set<Promise<void>>()
  #error: unknown

  add(p: Promise<void>): Promise<void> {
    const tracked = p.then(
      () => {
        this.#pending.delete(tracked)
      },
      (e) => {
        this.#pending.delete(tracked)
        this.#error ??= e
        throw e
      },
    )
    tracked.catch(() => {})
    this.#pending.add(tracked)
    return tracked
  }

  async settled(): Promise<void> {
    while (this.#pending.size > 0) await Promise.allSettled([...this.#pending])
    if (this.#error !== undefined) throw this.#error
  }
}
