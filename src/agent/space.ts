// A KV space: one model geometry (and TP rank, for non-MLA models) as the agent stores it.
// Owns the KVCache of that space and turns vLLM block hashes into kvgate chunk keys.

import { createHash, hash } from 'node:crypto'
import { join } from 'node:path'
import type { CodecPool } from '../client/codec-pool.ts'
import { type KVCacheOptions, resolveOptions } from '../client/config.ts'
import { KVCache } from '../client/kv-cache.ts'
import { loadNative } from '../client/native-api.ts'
import { DiskBudget } from '../client/tiers/disk.ts'
import { MemoryTier, type Resident } from '../client/tiers/memory.ts'
import { InvalidArgumentError, KvgateError } from '../core/errors.ts'
import { headerBytesFor } from '../core/format.ts'
import type { ChunkKey } from '../core/keys.ts'
import { chunkBytes } from '../core/layout.ts'
import { type EngineGeometry, storageGeometry } from './engine-layout.ts'
import { HASH_BYTES, type Hashes, hashCount } from './fields.ts'
import { AgentError } from './protocol.ts'

/** What a hello announces: the engine's model, per-rank geometry and hashing. */
export interface SpaceDescriptor extends EngineGeometry {
  model: string
  /** Tensor-parallel world size. */
  world: number
  /** vLLM's PYTHONHASHSEED (NONE_HASH = sha256_cbor of it). */
  hashSeed: string
}

const ZERO_KEY = '0'.repeat(64)
const MAX_DERIVED = 1 << 16

function sha256(b: Uint8Array): Buffer {
  return hash('sha256', b, 'buffer') as unknown as Buffer
}

/**
 * How an MLA space's chunks are stored: 'latent' chunks (one plane per layer). Builds
 * before it stored them as K/V split slabs under `true` here and key tag v1; the two never
 * share an L2 directory, an L1 scope or a key (and a header check refuses the other's bytes).
 */
const MLA_STORAGE = 'latent'

/** The space id: every field that makes stored bytes differ. `rank` is null for MLA (one shared copy). */
export function spaceId(d: SpaceDescriptor, rank: number | null): string {
  return JSON.stringify([
    d.model,
    d.layout === 'mla' ? MLA_STORAGE : false,
    d.dtype,
    d.layers,
    d.kvHeads,
    d.headSize,
    d.blockSize,
    d.hashSeed,
    rank === null ? 'shared' : `${rank}/${d.world}`,
  ])
}

/** The agent's cache options for every space (chunkTokens fixed by the agent). */
export type SpaceCacheOptions = Omit<KVCacheOptions, 'model' | 'keyScheme' | 'hashSeed'> & {
  chunkTokens: number
}

function checkChunk(d: SpaceDescriptor, chunkTokens: number): void {
  if (chunkTokens % d.blockSize !== 0) {
    throw new AgentError(
      'ERR_GEOMETRY_MISMATCH',
      `the agent's chunkTokens ${chunkTokens} is not a multiple of the engine's block size ${d.blockSize}`,
    )
  }
}

/** A short stable name of a space: its L2 subdirectory and its L1 scope. */
function spaceTag(id: string): string {
  return createHash('sha256').update(id).digest('hex').slice(0, 16)
}

function cacheOptions(d: SpaceDescriptor, rank: number | null, base: SpaceCacheOptions): KVCacheOptions {
  const suffix = rank === null ? '' : `#tp${rank}of${d.world}`
  return {
    ...base,
    model: { modelId: `${d.model}${suffix}`.slice(0, 256), ...storageGeometry(d) },
    keyScheme: 'vllm-sha256-cbor',
    hashSeed: d.hashSeed,
    disk: base.disk ? { ...base.disk, dir: join(base.disk.dir, spaceTag(spaceId(d, rank))) } : false,
  }
}

/**
 * What one chunk of this geometry needs in an L1 slot (header room, tensor): spaces that
 * agree on both share an L1.
 */
export function agentL1Shape(d: SpaceDescriptor, chunkTokens: number): string {
  return `${headerBytesFor(d.layers)}+${chunkBytes(storageGeometry(d), chunkTokens)}`
}

/**
 * The agent's one L2 budget for every space (each keeps its own subdirectory): `disk.bytes`
 * in all, undefined when L2 is off.
 */
export function createAgentDiskBudget(d: SpaceDescriptor, base: SpaceCacheOptions): DiskBudget | undefined {
  const o = resolveOptions(cacheOptions(d, null, base))
  return o.disk ? new DiskBudget(o.disk.bytes) : undefined
}

/**
 * Refuses at hello what no space of this geometry could store: fp8 KV with a lossy gateway
 * codec (fp8 is stored byte for byte; the lossless codec is its default).
 */
export function checkSpaceCodec(d: SpaceDescriptor, base: SpaceCacheOptions): void {
  try {
    resolveOptions(cacheOptions(d, null, base))
  } catch (e) {
    if (e instanceof KvgateError && e.code === 'ERR_CODEC_DTYPE')
      throw new AgentError('ERR_GEOMETRY_MISMATCH', e.message)
    // Anything else is reported where the space opens (register), as before.
  }
}

/**
 * The agent's one L1 for the KV spaces of one chunk size (every TP rank, every engine of a
 * model): `memory.bytes` in all, slots sized for chunks of geometry `d`, pages faulted in now (an
 * agent lives long: the first copy into a slot should not pay for faults).
 */
export async function createAgentL1(d: SpaceDescriptor, base: SpaceCacheOptions): Promise<MemoryTier> {
  checkChunk(d, base.chunkTokens)
  const o = resolveOptions(cacheOptions(d, null, base))
  const native = o.native ? loadNative() : { api: undefined, reason: 'disabled by options.native = false' }
  return MemoryTier.create({
    bytes: o.memory.bytes,
    chunkBytes: chunkBytes(o.model, o.chunkTokens),
    dataOffset: headerBytesFor(o.model.layers),
    native: native.api,
    nativeReason: native.reason,
    prefault: true,
  })
}

/**
 * What an object key mixes into vLLM's block hash (docs/vllm.md, "Keys"). v2 is MLA stored
 * as latent chunks: the split-slab objects of v1 MLA spaces are never looked up.
 */
export function keyTag(d: SpaceDescriptor, rank: number | null): Uint8Array {
  const shard = rank === null ? '' : `tp${rank}/${d.world}`
  const version = d.layout === 'mla' ? 'v2' : 'v1'
  return new TextEncoder().encode(`kvgate:vllm:${version}\0${d.model}\0${shard}`)
}

interface Derived {
  /**
   * The vLLM hash as 8 int32 (little-endian reads), fields of this object rather than an
   * Int32Array: a warm lookup then reads one object per key, not three (array, buffer, bytes).
   */
  w0: number
  w1: number
  w2: number
  w3: number
  w4: number
  w5: number
  w6: number
  w7: number
  key: Uint8Array
  hex: string
  /** Another hash with the same first 30 bits. */
  next: Derived | undefined
  /** The last ChunkKey built from it (position and parent checked before reuse). */
  chunk?: ChunkKey | undefined
  /** Its chunk as L1 last held it (KVCache.memoryResident): still there while `indexed`. */
  resident: Resident | undefined
  /** KVCache.memoryRemovals when `resident` was last seen there (-1: never). */
  residentAt: number
  /** The hash that came after this one in the last request that had one: prompts come back in order. */
  follow: Derived | undefined
}

/** Whether `d`'s hash equals the 32 bytes of `v` at `at`: 8 reads, not 32 (a third of a warm 512-key lookup's time). */
function sameHash(d: Derived, v: DataView, at: number): boolean {
  return (
    d.w7 === v.getInt32(at + 28, true) &&
    d.w6 === v.getInt32(at + 24, true) &&
    d.w5 === v.getInt32(at + 20, true) &&
    d.w4 === v.getInt32(at + 16, true) &&
    d.w3 === v.getInt32(at + 12, true) &&
    d.w2 === v.getInt32(at + 8, true) &&
    d.w1 === v.getInt32(at + 4, true) &&
    d.w0 === v.getInt32(at, true)
  )
}

/** A DataView over the bytes of `h` (one per request for packed hashes). */
function viewOf(h: Uint8Array): DataView {
  return new DataView(h.buffer, h.byteOffset, h.byteLength)
}

export class KvSpace {
  readonly id: string
  readonly descriptor: SpaceDescriptor
  /** null for MLA (every rank reads one copy) or TP 1. */
  readonly rank: number | null
  readonly cache: KVCache
  readonly blocksPerChunk: number
  /** vLLM hash (32 bytes) followed by the key tag: the input of one key derivation. */
  readonly #input: Uint8Array
  /** Derived keys by the vLLM hash's first 30 bits (a small integer: no hex string per lookup), chained. */
  readonly #derived = new Map<number, Derived>()
  /** Scratch for a hash of the array form of `keys`, and its view. */
  readonly #one = new Uint8Array(HASH_BYTES)
  readonly #oneView = viewOf(this.#one)
  #derivedCount = 0

  private constructor(id: string, d: SpaceDescriptor, rank: number | null, cache: KVCache) {
    const tag = keyTag(d, rank)
    this.#input = new Uint8Array(32 + tag.length)
    this.#input.set(tag, 32)
    this.id = id
    this.descriptor = d
    this.rank = rank
    this.cache = cache
    this.blocksPerChunk = cache.chunkTokens / d.blockSize
  }

  /**
   * Opens the space's cache. With `l1`, its L1 is a view of that tier (the agent's one
   * budget for every space), scoped by the space id so spaces never read each other's chunks.
   */
  static async open(
    d: SpaceDescriptor,
    rank: number | null,
    base: SpaceCacheOptions,
    l1?: MemoryTier,
    diskBudget?: DiskBudget,
    codec?: CodecPool,
  ): Promise<KvSpace> {
    checkChunk(d, base.chunkTokens)
    const id = spaceId(d, rank)
    const tag = spaceTag(id)
    const options = cacheOptions(d, rank, base)
    let cache: KVCache
    try {
      cache = await KVCache.open(options, { memory: l1?.scoped(tag), diskBudget, codec })
    } catch (e) {
      if (e instanceof InvalidArgumentError && l1) {
        throw new AgentError(
          'ERR_GEOMETRY_MISMATCH',
          `this engine's chunks do not fit the agent's L1, whose slots were sized by the first engine geometry: ${e.message}`,
        )
      }
      throw e
    }
    return new KvSpace(id, d, rank, cache)
  }

  /**
   * Chunk keys from the engine's chunk hashes (vLLM's block hash of each chunk's last
   * block). vLLM's hashes cover tokens only, so the model and, for non-MLA TP, the
   * rank's shard are mixed in: another model (or shard) never reads these bytes.
   */
  keys(hashes: Hashes): ChunkKey[] {
    const ct = this.cache.chunkTokens
    const n = hashCount(hashes)
    const out: ChunkKey[] = new Array(n)
    let parent = ZERO_KEY
    const packed = hashes instanceof Uint8Array ? viewOf(hashes) : undefined
    let d: Derived | undefined
    for (let i = 0; i < n; i++) {
      d = this.#deriveAt(hashes, packed, i, d)
      // The same prompt comes back at the same position after the same parent: its
      // (frozen) ChunkKey is reused rather than rebuilt for every request.
      let c = d.chunk
      if (c === undefined || c.index !== i || c.parentHex !== parent) {
        c = Object.freeze({
          index: i,
          start: i * ct,
          end: (i + 1) * ct,
          key: d.key,
          hex: d.hex,
          parentHex: parent,
          partial: false,
        })
        d.chunk = c
      }
      out[i] = c
      parent = d.hex
    }
    return out
  }

  /**
   * Leading hashes whose chunks L1 or L2 holds (a warm lookup): no ChunkKey or array per
   * request, only the memoized derivations (presence is by key, whatever the parent).
   */
  localPrefix(hashes: Hashes): number {
    const n = hashCount(hashes)
    const packed = hashes instanceof Uint8Array ? viewOf(hashes) : undefined
    const cache = this.cache
    // Throws once the cache closed, as hasLocal would: the memo below answers without it.
    const removals = cache.memoryRemovals
    let i = 0
    let d: Derived | undefined
    for (; i < n; i++) {
      d = this.#deriveAt(hashes, packed, i, d)
      // No chunk left L1 since this one was seen there: one compare on the memo object.
      if (d.residentAt === removals) continue
      // Some did (saves into a full L1 evict): still this one's entry, else the index.
      const r = d.resident?.indexed === true ? d.resident : cache.memoryResident(d.hex)
      d.resident = r
      if (r !== undefined) d.residentAt = removals
      else if (!cache.hasLocal(d.hex)) break
    }
    return i
  }

  /** Hash i of either form, derived (packed hashes are read in place through `packed`, their one view); `prev`: hash i − 1's. */
  #deriveAt(hashes: Hashes, packed: DataView | undefined, i: number, prev: Derived | undefined): Derived {
    if (packed !== undefined) return this.#derive(packed, i * HASH_BYTES, prev)
    const h = (hashes as readonly Uint8Array[])[i]
    if (!(h instanceof Uint8Array) || h.length !== HASH_BYTES)
      throw new AgentError('ERR_INVALID_ARGUMENT', `hash ${i} is not ${HASH_BYTES} bytes`)
    // Copied into one scratch hash and its view: no DataView per key.
    this.#one.set(h, 0)
    return this.#derive(this.#oneView, 0, prev)
  }

  /**
   * Memoized: a 128k-token prompt is 512 keys, and the same prompts come back (lookup,
   * load, save). A hit costs a 32-byte compare with the hash that followed `prev` last
   * time, else a numeric Map lookup and a compare: the hex id per key it replaced was most
   * of a warm 512-key lookup's CPU, the Map lookup half of what was left.
   */
  #derive(v: DataView, at: number, prev: Derived | undefined): Derived {
    const f = prev?.follow
    if (f !== undefined && sameHash(f, v, at)) return f
    const d = this.#lookupOrDerive(v, at)
    if (prev !== undefined) prev.follow = d
    return d
  }

  #lookupOrDerive(v: DataView, at: number): Derived {
    // 30 bits: a small integer (no heap number per key, the fastest Map key); the chain
    // below tells apart hashes that share them.
    const id = v.getInt32(at, true) & 0x3fffffff
    const head = this.#derived.get(id)
    for (let d = head; d !== undefined; d = d.next) if (sameHash(d, v, at)) return d
    // Copies (a view would keep the request frame alive): the hash's words, and its bytes
    // into the derivation's input.
    for (let k = 0; k < HASH_BYTES; k++) this.#input[k] = v.getUint8(at + k)
    const key = new Uint8Array(sha256(this.#input))
    const hex = Buffer.from(key.buffer, key.byteOffset, 32).toString('hex')
    const d: Derived = {
      w0: v.getInt32(at, true),
      w1: v.getInt32(at + 4, true),
      w2: v.getInt32(at + 8, true),
      w3: v.getInt32(at + 12, true),
      w4: v.getInt32(at + 16, true),
      w5: v.getInt32(at + 20, true),
      w6: v.getInt32(at + 24, true),
      w7: v.getInt32(at + 28, true),
      key,
      hex,
      next: head,
      chunk: undefined,
      resident: undefined,
      residentAt: -1,
      follow: undefined,
    }
    if (this.#derivedCount >= MAX_DERIVED) {
      // Forgotten, and unreachable from what comes next: no memo returns a forgotten one
      // (their `follow`s are cut), so none of the new ones points back into them.
      for (const head of this.#derived.values())
        for (let x: Derived | undefined = head; x !== undefined; x = x.next) x.follow = undefined
      this.#derived.clear()
      this.#derivedCount = 0
      d.next = undefined
    }
    this.#derived.set(id, d)
    this.#derivedCount++
    return d
  }

  close(): Promise<void> {
    return this.cache.close()
  }
}
