// Remembers the chain keys of recently seen prompts, so a prompt that shares a
// prefix with one seen before hashes only its new chunks (tokens are compared, not re-hashed).

import { type ChunkKey, chainKeys, type KeyNamespace } from '../core/keys.ts'

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
  /** first chunk hex → memos starting with that chunk, most recent last. */
  readonly #byFirst = new Map<string, Memo[]>()
  #order: Memo[] = []
  #tokens = 0
  readonly stats: KeyMemoStats = { reused: 0, hashed: 0, entries: 0 }

  /** @param maxTokens tokens remembered in total (4 bytes each + keys). */
  constructor(ns: KeyNamespace, maxTokens = 4 << 20) {
    this.#ns = ns
    this.#chunk = ns.chunkTokens
    this.#maxTokens = maxTokens
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
      keys.push(...chainKeys(t, this.#ns, { after: keys[bestChunks - 1]! }))
    } else {
      keys = chainKeys(t, this.#ns)
    }
    this.stats.reused += best ? Math.min(bestChunks, full) : 0
    this.stats.hashed += full - (best ? Math.min(bestChunks, full) : 0)
    if (!best || bestChunks < full) this.#remember(head.hex, { tokens: t.slice(), keys })
    else this.#touch(best)
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
