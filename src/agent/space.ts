// A KV space: one model geometry (and TP rank, for non-MLA models) as the agent stores it.
// Owns the KVCache of that space and turns vLLM block hashes into kvgate chunk keys.

import { createHash, hash } from 'node:crypto'
import { join } from 'node:path'
import type { KVCacheOptions } from '../client/config.ts'
import { KVCache } from '../client/kv-cache.ts'
import type { ChunkKey } from '../core/keys.ts'
import { type EngineGeometry, storageGeometry } from './engine-layout.ts'
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

/** The space id: every field that makes stored bytes differ. `rank` is null for MLA (one shared copy). */
export function spaceId(d: SpaceDescriptor, rank: number | null): string {
  return JSON.stringify([
    d.model,
    d.layout === 'mla',
    d.dtype,
    d.layers,
    d.kvHeads,
    d.headSize,
    d.blockSize,
    d.hashSeed,
    rank === null ? 'shared' : `${rank}/${d.world}`,
  ])
}

/** What an object key mixes into vLLM's block hash (docs/vllm.md, "Keys"). */
export function keyTag(d: SpaceDescriptor, rank: number | null): Uint8Array {
  const shard = rank === null ? '' : `tp${rank}/${d.world}`
  return new TextEncoder().encode(`kvgate:vllm:v1\0${d.model}\0${shard}`)
}

interface Derived {
  hash: Uint8Array
  key: Uint8Array
  hex: string
  /** Another hash with the same first 6 bytes. */
  next: Derived | undefined
  /** The last ChunkKey built from it (position and parent checked before reuse). */
  chunk?: ChunkKey | undefined
}

function sameHash(a: Uint8Array, b: Uint8Array): boolean {
  for (let i = 31; i >= 6; i--) if (a[i] !== b[i]) return false
  return true
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
  /** Derived keys by the vLLM hash's first 6 bytes (a number: no hex string per lookup), chained. */
  readonly #derived = new Map<number, Derived>()
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

  static async open(
    d: SpaceDescriptor,
    rank: number | null,
    base: Omit<KVCacheOptions, 'model' | 'keyScheme' | 'hashSeed'> & { chunkTokens: number },
  ): Promise<KvSpace> {
    if (base.chunkTokens % d.blockSize !== 0) {
      throw new AgentError(
        'ERR_GEOMETRY_MISMATCH',
        `the agent's chunkTokens ${base.chunkTokens} is not a multiple of the engine's block size ${d.blockSize}`,
      )
    }
    const id = spaceId(d, rank)
    const tag = createHash('sha256').update(id).digest('hex').slice(0, 16)
    const suffix = rank === null ? '' : `#tp${rank}of${d.world}`
    const cache = await KVCache.open({
      ...base,
      model: { modelId: `${d.model}${suffix}`.slice(0, 256), ...storageGeometry(d) },
      keyScheme: 'vllm-sha256-cbor',
      hashSeed: d.hashSeed,
      disk: base.disk ? { ...base.disk, dir: join(base.disk.dir, tag) } : false,
    })
    return new KvSpace(id, d, rank, cache)
  }

  /**
   * Chunk keys from the engine's chunk hashes (vLLM's block hash of each chunk's last
   * block). vLLM's hashes cover tokens only, so the model and, for non-MLA TP, the
   * rank's shard are mixed in: another model (or shard) never reads these bytes.
   */
  keys(hashes: readonly Uint8Array[]): ChunkKey[] {
    const ct = this.cache.chunkTokens
    const out: ChunkKey[] = []
    let parent = ZERO_KEY
    for (let i = 0; i < hashes.length; i++) {
      const h = hashes[i]!
      if (!(h instanceof Uint8Array) || h.length !== 32)
        throw new AgentError('ERR_INVALID_ARGUMENT', `hash ${i} is not 32 bytes`)
      const d = this.#derive(h)
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
      out.push(c)
      parent = d.hex
    }
    return out
  }

  /**
   * Memoized: a 128k-token prompt is 512 keys, and the same prompts come back (lookup,
   * load, save). A hit costs a numeric Map lookup and a 32-byte compare: the hex id per
   * key it replaced was most of a warm 512-key lookup's CPU.
   */
  #derive(h: Uint8Array): Derived {
    const id = h[0]! + h[1]! * 2 ** 8 + h[2]! * 2 ** 16 + h[3]! * 2 ** 24 + h[4]! * 2 ** 32 + h[5]! * 2 ** 40
    const head = this.#derived.get(id)
    for (let d = head; d !== undefined; d = d.next) if (sameHash(d.hash, h)) return d
    this.#input.set(h, 0)
    const key = new Uint8Array(sha256(this.#input))
    const hex = Buffer.from(key.buffer, key.byteOffset, 32).toString('hex')
    // The hash is copied: the caller's bytes are a view of a request frame.
    const d: Derived = { hash: Uint8Array.from(h), key, hex, next: head }
    if (this.#derivedCount >= MAX_DERIVED) {
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
