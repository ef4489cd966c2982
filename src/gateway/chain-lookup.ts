// Finds how many leading chunks of a key chain are stored without one HEAD per
// key: chunk i present ⇒ earlier chunks almost surely present, so a k-ary search
// with concurrent probes pins the boundary in ~2 rounds, then one round verifies.

import { LRUCache } from 'lru-cache'
import type { GatewayMetrics } from './metrics.ts'
import type { ObjectStore } from './stores/types.ts'

export interface ChainLookupOptions {
  /** Positive cache entries (object name → size). Absent results are never cached. @default 100000 */
  cacheEntries?: number
  /** Probes per search round: (fanout+1)^2 ≥ keys ⇒ 2 rounds. @default 24 */
  fanout?: number
  /** Store requests in flight per lookup. @default 256 */
  concurrency?: number
}

export interface LookupResult {
  present: number
  /** Sizes of chunks 0..present-1 (empty when sizes were not asked for). */
  sizes: number[]
  storeRequests: number
  rounds: number
}

/**
 * Cache value of a chunk a lookup answered as present without a HEAD (below a
 * probed present key): present as far as lookups go, size unknown to everything else.
 */
const INFERRED = -1

export class ChainLookup {
  readonly #store: ObjectStore
  readonly #metrics: GatewayMetrics
  readonly #cache: LRUCache<string, number>
  readonly #fanout: number
  readonly #concurrency: number

  constructor(store: ObjectStore, metrics: GatewayMetrics, opts: ChainLookupOptions = {}) {
    const { cacheEntries = 100_000, fanout = 24, concurrency = 256 } = opts
    if (!Number.isInteger(cacheEntries) || cacheEntries < 1)
      throw new TypeError('invalid lookup cacheEntries')
    if (!Number.isInteger(fanout) || fanout < 2) throw new TypeError('invalid lookup fanout')
    if (!Number.isInteger(concurrency) || concurrency < 1) throw new TypeError('invalid lookup concurrency')
    this.#store = store
    this.#metrics = metrics
    this.#cache = new LRUCache({ max: cacheEntries })
    this.#fanout = fanout
    this.#concurrency = concurrency
  }

  /** Known size of a stored object (cache only), counting hit/miss. */
  cached(name: string): number | undefined {
    const v = this.#cache.get(name)
    const known = v !== undefined && v !== INFERRED ? v : undefined
    this.#metrics.cache.inc({ result: known === undefined ? 'miss' : 'hit' })
    return known
  }

  remember(name: string, size: number): void {
    this.#cache.set(name, size)
  }

  forget(name: string): void {
    this.#cache.delete(name)
  }

  get cacheSize(): number {
    return this.#cache.size
  }

  async lookup(names: readonly string[], opts: { sizes?: boolean } = {}): Promise<LookupResult> {
    const wantSizes = opts.sizes ?? false
    const m = names.length
    const sizes: (number | undefined)[] = names.map((n) => this.#cache.get(n))
    let hits = 0
    for (const s of sizes) if (s !== undefined) hits++
    this.#metrics.cache.inc({ result: 'hit' }, hits)
    this.#metrics.cache.inc({ result: 'miss' }, m - hits)
    let storeRequests = 0
    let rounds = 0

    // HEADs a set of indices concurrently (waves of `concurrency`); records sizes.
    const probe = async (idx: number[]): Promise<Map<number, boolean>> => {
      const out = new Map<number, boolean>()
      for (let w = 0; w < idx.length; w += this.#concurrency) {
        const wave = idx.slice(w, w + this.#concurrency)
        rounds++
        storeRequests += wave.length
        const res = await Promise.all(wave.map((i) => this.#store.head(names[i]!)))
        wave.forEach((i, j) => {
          const r = res[j]
          out.set(i, r !== undefined)
          if (r) {
            sizes[i] = r.size
            this.#cache.set(names[i]!, r.size)
          }
        })
      }
      return out
    }

    // Search: the answer n lies in [lo, hi]; lo = leading cached run.
    let lo = 0
    while (lo < m && sizes[lo] !== undefined) lo++
    let hi = m
    while (lo < hi) {
      const span = hi - lo
      const picks = new Set<number>()
      if (span <= this.#fanout) for (let i = lo; i < hi; i++) picks.add(i)
      else
        for (let j = 0; j < this.#fanout; j++)
          picks.add(lo + Math.round((j * (span - 1)) / (this.#fanout - 1)))
      const unknown = [...picks].filter((i) => sizes[i] === undefined).sort((a, b) => a - b)
      const known = [...picks].filter((i) => sizes[i] !== undefined)
      const res = await probe(unknown)
      for (const i of known) res.set(i, true)
      let firstAbsent = hi
      for (const [i, ok] of res) if (!ok && i < firstAbsent) firstAbsent = i
      hi = firstAbsent
      let newLo = lo
      for (const [i, ok] of res) if (ok && i < hi && i + 1 > newLo) newLo = i + 1
      // A present key just below the first absent one pins the boundary exactly.
      lo = newLo
      if (span <= this.#fanout) lo = hi
    }
    let present = lo

    // Verify: every chunk below the boundary whose size we do not know yet. A hole
    // (an evicted middle chunk) truncates the answer there.
    if (wantSizes) {
      const missing: number[] = []
      for (let i = 0; i < present; i++) if (sizes[i] === undefined || sizes[i] === INFERRED) missing.push(i)
      if (missing.length > 0) {
        const res = await probe(missing)
        for (const i of missing) if (!res.get(i) && i < present) present = i
      }
    } else {
      // Remember what this answer already claimed, so the next lookup of the chain
      // needs no store request at all (a warm lookup is all cache).
      for (let i = 0; i < present; i++) if (sizes[i] === undefined) this.#cache.set(names[i]!, INFERRED)
    }
    this.#metrics.lookupProbes.observe(storeRequests)
    this.#metrics.lookupRounds.observe(rounds)
    this.#metrics.lookupKeys.inc({ result: 'present' }, present)
    this.#metrics.lookupKeys.inc({ result: 'absent' }, m - present)
    return { present, sizes: wantSizes ? (sizes.slice(0, present) as number[]) : [], storeRequests, rounds }
  }
}
