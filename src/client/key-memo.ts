// Remembers the chain keys of recently seen prompts, so a prompt that shares a
// prefix with one seen before hashes only its new chunks (tokens are compared, not re-hashed).

import { type ChunkKey, chainKeys, type KeyNamespace } from '../core/keys.ts'

/**
 * The sha256-v1 keys of `chunks` full chunks of `tokens` chained from `parent`, 32 bytes each
 * (the addon's one-call chain), or undefined to fall back to hashing in JS.
 */
export type V1ChainHasher = (
  parent: Uint8Array,
  tokens: Uint32Array,
  chunkTokens: number,
  chunks: number,
) => Uint8Array | undefined

interface Memo {
  tokens: Uint32Array
  keys: ChunkKey[]
}

export interface KeyMemoStats {
  /** Chunks whose key came from the memo. */
  reused: number
  /** Chunks hashed. */
  hashed: number
  entries: number
}

/**
 * A small LRU of (tokens, keys) indexed by the first chunk's key. Identical
 * tokens in chunks 0..m-1 imply identical keys 0..m-1 (each key chains over
 * everything before it), so only chunks from the first difference on are hashed.
 */
export class KeyMemo {
  readonly #ns: KeyNamespace
  readonly #chunk: number
  readonly #maxTokens: number
  readonly #v1Chain: V1ChainHasher | undefined
  /** first chunk hex → memos starting with that chunk, most recent last. */
  readonly #byFirst = new Map<string, Memo[]>()
  #order: Memo[] = []
  #tokens = 0
  readonly stats: KeyMemoStats = { reused: 0, hashed: 0, entries: 0 }

  /**
   * @param maxTokens tokens remembered in total (4 bytes each + keys).
   * @param v1Chain hashes a sha256-v1 chain in one call (the addon); other schemes, or none, hash in JS.
   */
  constructor(ns: KeyNamespace, maxTokens = 4 << 20, v1Chain?: V1ChainHasher) {
    this.#ns = ns
    this.#chunk = ns.chunkTokens
    this.#maxTokens = maxTokens
    this.#v1Chain = (ns.scheme ?? 'sha256-v1') === 'sha256-v1' ? v1Chain : undefined
  }

  /**
   * Chain keys of the full chunks of `tokens` (validated by the caller), plus
   * the trailing partial chunk's key with `includePartial`.
   */
  keys(tokens: ArrayLike<number>, includePartial = false): ChunkKey[] {
    const full = this.#fullKeys(tokens)
    const c = this.#chunk
    const tail = tokens.length - full.length * c
    if (!includePartial || tail === 0) return full
    const after = full[full.length - 1]
    const rest = chainKeys(tokens, this.#ns, { includePartial: true, ...(after ? { after } : {}) })
    return [...full, rest[rest.length - 1]!]
  }

  #fullKeys(tokens: ArrayLike<number>): ChunkKey[] {
    const c = this.#chunk
    const full = Math.floor(tokens.length / c)
    if (full === 0) return []
    const t =
      tokens instanceof Uint32Array
        ? tokens.subarray(0, full * c)
        : Uint32Array.from({ length: full * c }, (_, i) => tokens[i]!)
    const first = chainKeys(t.subarray(0, c), this.#ns)
    const head = first[0]!
    let best: Memo | undefined
    let bestChunks = 0
    for (const m of this.#byFirst.get(head.hex) ?? []) {
      const n = commonChunks(t, m.tokens, c)
      if (n > bestChunks) {
        best = m
        bestChunks = n
      }
    }
    let keys: ChunkKey[]
    if (best && bestChunks >= full) {
      keys = best.keys.slice(0, full)
    } else if (best && bestChunks > 0) {
      // Hash the rest from the last shared key: chainKeys over the whole prefix
      // would redo the shared part, so continue the chain by hand.
      keys = best.keys.slice(0, bestChunks)
      keys.push(...this.#after(t, keys[bestChunks - 1]!))
    } else {
      keys = [head, ...this.#after(t, head)]
    }
    this.stats.reused += best ? Math.min(bestChunks, full) : 0
    this.stats.hashed += full - (best ? Math.min(bestChunks, full) : 0)
    if (!best || bestChunks < full) this.#remember(head.hex, { tokens: t.slice(), keys })
    else this.#touch(best)
    return keys
  }

  /** Keys of the full chunks of `t` after `after` (its chain continued). */
  #after(t: Uint32Array, after: ChunkKey): ChunkKey[] {
    const c = this.#chunk
    const from = after.index + 1
    const chunks = Math.floor(t.length / c) - from
    if (chunks <= 0) return []
    const out = this.#v1Chain?.(after.key, t.subarray(from * c, (from + chunks) * c), c, chunks)
    if (!out) return chainKeys(t, this.#ns, { after })
    const hex = Buffer.from(out.buffer, out.byteOffset, out.byteLength).toString('hex')
    const keys: ChunkKey[] = new Array(chunks)
    let parentHex = after.hex
    for (let i = 0; i < chunks; i++) {
      const h = hex.slice(64 * i, 64 * i + 64)
      const index = from + i
      // The field order of keys.ts's chunkKey: one object shape for every key.
      keys[i] = {
        index,
        start: index * c,
        end: index * c + c,
        key: out.slice(32 * i, 32 * i + 32),
        hex: h,
        parentHex,
        partial: false,
      }
      parentHex = h
    }
    return keys
  }

  #remember(first: string, m: Memo): void {
    const list = this.#byFirst.get(first) ?? []
    list.push(m)
    this.#byFirst.set(first, list)
    this.#order.push(m)
    this.#tokens += m.tokens.length
    while (this.#tokens > this.#maxTokens && this.#order.length > 1) {
      const old = this.#order.shift()!
      this.#tokens -= old.tokens.length
      const k = old.keys[0]!.hex
      const l = this.#byFirst.get(k)!.filter((x) => x !== old)
      if (l.length === 0) this.#byFirst.delete(k)
      else this.#byFirst.set(k, l)
    }
    this.stats.entries = this.#order.length
  }

  #touch(m: Memo): void {
    const i = this.#order.indexOf(m)
    if (i >= 0 && i !== this.#order.length - 1) {
      this.#order.splice(i, 1)
      this.#order.push(m)
    }
  }
}

/** Leading full chunks on which a and b agree. */
function commonChunks(a: Uint32Array, b: Uint32Array, c: number): number {
  const n = Math.floor(Math.min(a.length, b.length) / c)
  const ab = Buffer.from(a.buffer, a.byteOffset, n * c * 4)
  const bb = Buffer.from(b.buffer, b.byteOffset, n * c * 4)
  if (ab.equals(bb)) return n
  // Binary search on chunk count for the first differing chunk.
  let lo = 0
  let hi = n
  while (lo < hi) {
    const mid = (lo + hi + 1) >> 1
    if (ab.subarray(0, mid * c * 4).equals(bb.subarray(0, mid * c * 4))) lo = mid
    else hi = mid - 1
  }
  return lo
}
