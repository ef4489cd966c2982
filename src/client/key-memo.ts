// Remembers the chain keys of recently seen prompts, so a prompt that shares a
// prefix with one seen before hashes only its new chunks (tokens are compared, not re-hashed).

import { createHash } from 'node:crypto'
import { type ChunkKey, chainKeys, type KeyNamespace, toHex } from '../core/keys.ts'

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
    const t = tokens instanceof Uint32Array ? tokens : Uint32Array.from(tokens)
    if (full.length === 0 || (this.#ns.scheme ?? 'sha256-v1') !== 'sha256-v1') {
      const all = chainKeys(t, this.#ns, { includePartial: true })
      return [...full, all[all.length - 1]!]
    }
    return [...full, chunkKeyAfter(full[full.length - 1]!, t, full.length * c, t.length, full.length, true)]
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
      keys.push(...continueChain(t, bestChunks, this.#ns, keys))
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

/**
 * Keys of chunks `from`.. of `t`, continuing the chain from the known key of
 * chunk from-1. For the default 'sha256-v1' scheme this is core/keys.ts's
 * documented preimage (parent ‖ u32le(n) ‖ n × u32le(token)); a test checks it
 * against chainKeys. Other schemes recompute the whole chain.
 */
function continueChain(t: Uint32Array, from: number, ns: KeyNamespace, known: ChunkKey[]): ChunkKey[] {
  if ((ns.scheme ?? 'sha256-v1') !== 'sha256-v1') return chainKeys(t, ns).slice(from)
  const c = ns.chunkTokens
  const out: ChunkKey[] = []
  let parent = known[from - 1]!
  for (let i = from; i < t.length / c; i++) {
    const k = chunkKeyAfter(parent, t, i * c, (i + 1) * c, i, false)
    out.push(k)
    parent = k
  }
  return out
}

/** sha256-v1 key of tokens [start, end) chained after `parent` (partial when shorter than a chunk). */
function chunkKeyAfter(
  parent: ChunkKey,
  t: Uint32Array,
  start: number,
  end: number,
  index: number,
  partial: boolean,
): ChunkKey {
  const n = end - start
  const pre = new Uint8Array(36 + 4 * n)
  pre.set(parent.key, 0)
  const words = new Uint32Array(pre.buffer, 32, n + 1)
  words[0] = n
  words.set(t.subarray(start, end), 1)
  const key = new Uint8Array(createHash('sha256').update(pre).digest())
  return { index, start, end, partial, key, hex: toHex(key), parentHex: parent.hex }
}
