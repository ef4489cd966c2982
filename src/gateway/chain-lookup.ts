// Finds how many leading chunks of a key chain are stored without one HEAD per
// key: chunk i present ⇒ earlier chunks almost surely present, so a k-ary search
// with concurrent probes pins the boundary in ~2 rounds, then one round verifies.
//
// Presence heals: every cached answer expires (objects vanish behind the gateway:
// lifecycle expiry, another instance's DELETE), a read that finds no object forgets
// that key and every later key of its chain, and remembers it absent for a while so
// the search cannot infer it present again from a later cached key.

import { LRUCache } from 'lru-cache'
import { isKeyHex } from '../core/keys.ts'
import type { GatewayMetrics } from './metrics.ts'
import type { ObjectStore } from './stores/types.ts'

export interface ChainLookupOptions {
  /** Positive cache entries (object name → size). @default 100000 */
  cacheEntries?: number
  /** Probes per search round: (fanout+1)^2 ≥ keys ⇒ 2 rounds. @default 24 */
  fanout?: number
  /** Store requests in flight per lookup. @default 256 */
  concurrency?: number
  /**
   * How long a cached presence (inferred by a lookup or seen by a HEAD/GET/PUT) and a
   * seen absence are trusted, in ms. @default 30000
   */
  presenceTtlMs?: number
  /**
   * After answering, HEAD up to this many keys the answer only inferred, earliest
   * first, in the background (lifecycle expiry removes a chain's oldest chunks first):
   * a missing one is forgotten with the rest of its chain. 0 turns it off. @default 8
   */
  verifyInferred?: number
}

export interface LookupResult {
  present: number
  /** Sizes of chunks 0..present-1 (empty when sizes were not asked for). */
  sizes: number[]
  storeRequests: number
  rounds: number
}

/**
 * Size of a chunk a lookup answered as present without a HEAD (below a probed
 * present key): present as far as lookups go, size unknown to everything else.
 */
const INFERRED = -1

/** One namespace's key chain: object names `${base}${key.slice(0, 2)}/${key}` (core/keys.ts objectName). */
export interface KeyChain {
  /** Everything before the shard folder, ending in `/`: `<prefix>/<ns>/`, or `<ns>/` without a prefix. */
  readonly base: string
  /** 64 lowercase hex characters each, validated by the caller. */
  readonly keys: readonly string[]
}

/** The object name of `key` under `base` (the layout objectName builds). */
export function chainName(base: string, key: string): string {
  return `${base}${key.slice(0, 2)}/${key}`
}

/** A chunk's object name split into its chain base and key; undefined for any other name. */
export function splitChainName(name: string): { base: string; key: string } | undefined {
  const n = name.length
  if (n < 68 || name.charCodeAt(n - 65) !== 47 || name.charCodeAt(n - 68) !== 47) return undefined
  const key = name.slice(n - 64)
  if (!isKeyHex(key) || name.slice(n - 67, n - 65) !== key.slice(0, 2)) return undefined
  return { base: name.slice(0, n - 67), key }
}

interface Entry {
  readonly base: string
  readonly key: string
  /** Object size, or INFERRED. */
  readonly size: number
  /** The key that followed this one in the last chain a lookup answered (chain order, for invalidation). */
  readonly next?: string
}

/** Bases (namespaces) with an id at once; past it the ids start over (old slots then miss: never wrong). */
const MAX_BASES = 4096
const KEY_BITS = 2 ** 40

// The caches are keyed by a number, a slot, not by object name: a Map probed with a
// freshly built 80-character name hashes and compares the whole string each time, about
// half of a warm 512-key lookup on a slow core. A slot is the base's id and 40 bits of the
// key; every entry keeps its base and key and is used only when both match, so two names
// sharing a slot cost a miss (a probe), never a wrong answer.
export class ChainLookup {
  readonly #store: ObjectStore
  readonly #metrics: GatewayMetrics
  readonly #cache: LRUCache<number, Entry>
  /** Names a read found missing: the search treats them as absent until they expire or are written. */
  readonly #absent: LRUCache<number, { base: string; key: string }>
  readonly #baseIds = new Map<string, number>()
  #nextBaseId = 0
  readonly #fanout: number
  readonly #concurrency: number
  readonly #verifyInferred: number
  /** How long a seen presence or absence is trusted (ms). */
  readonly presenceTtlMs: number
  /** Background HEADs in flight, by name (bounded: at most 8 × verifyInferred). */
  readonly #checking = new Set<string>()

  constructor(store: ObjectStore, metrics: GatewayMetrics, opts: ChainLookupOptions = {}) {
    const {
      cacheEntries = 100_000,
      fanout = 24,
      concurrency = 256,
      presenceTtlMs = 30_000,
      verifyInferred = 8,
    } = opts
    if (!Number.isInteger(cacheEntries) || cacheEntries < 1)
      throw new TypeError('invalid lookup cacheEntries')
    if (!Number.isInteger(fanout) || fanout < 2) throw new TypeError('invalid lookup fanout')
    if (!Number.isInteger(concurrency) || concurrency < 1) throw new TypeError('invalid lookup concurrency')
    if (!Number.isInteger(presenceTtlMs) || presenceTtlMs < 1)
      throw new TypeError('invalid lookup presenceTtlMs')
    if (!Number.isInteger(verifyInferred) || verifyInferred < 0)
      throw new TypeError('invalid lookup verifyInferred')
    this.#verifyInferred = verifyInferred
    this.presenceTtlMs = presenceTtlMs
    this.#store = store
    this.#metrics = metrics
    this.#cache = new LRUCache({ max: cacheEntries, ttl: presenceTtlMs })
    this.#absent = new LRUCache({ max: Math.min(cacheEntries, 10_000), ttl: presenceTtlMs })
    this.#fanout = fanout
    this.#concurrency = concurrency
  }

  #baseId(base: string): number {
    let id = this.#baseIds.get(base)
    if (id === undefined) {
      if (this.#baseIds.size >= MAX_BASES) this.#baseIds.clear()
      id = this.#nextBaseId++ % MAX_BASES
      this.#baseIds.set(base, id)
    }
    return id
  }

  static #slot(baseId: number, key: string): number {
    return baseId * KEY_BITS + Number.parseInt(key.slice(0, 10), 16)
  }

  /** The live entry of (base, key), or undefined (none, expired, or another name's in its slot). */
  #entry(slot: number, base: string, key: string, touch = true): Entry | undefined {
    const e = touch ? this.#cache.get(slot) : this.#cache.get(slot, { updateAgeOnGet: false })
    return e !== undefined && e.key === key && e.base === base ? e : undefined
  }

  /** Size of a stored object known from the store itself (never an inference), counting hit/miss. */
  cached(name: string): number | undefined {
    const at = splitChainName(name)
    const v = at && this.#entry(ChainLookup.#slot(this.#baseId(at.base), at.key), at.base, at.key)
    const known = v !== undefined && v.size !== INFERRED ? v.size : undefined
    this.#metrics.cache.inc({ result: known === undefined ? 'miss' : 'hit' })
    return known
  }

  /** The store just showed this object (PUT, HEAD, GET): its size, keeping its chain link. */
  remember(name: string, size: number): void {
    const at = splitChainName(name)
    if (at) this.#remember(this.#baseId(at.base), at.base, at.key, size)
  }

  #remember(baseId: number, base: string, key: string, size: number): void {
    const slot = ChainLookup.#slot(baseId, key)
    const gone = this.#absent.get(slot)
    if (gone !== undefined && gone.key === key && gone.base === base) this.#absent.delete(slot)
    const prev = this.#entry(slot, base, key, false)
    this.#cache.set(
      slot,
      prev?.next === undefined ? { base, key, size } : { base, key, size, next: prev.next },
    )
  }

  /** Forgets one object (a DELETE through this instance). */
  forget(name: string): void {
    const at = splitChainName(name)
    if (!at) return
    const slot = ChainLookup.#slot(this.#baseId(at.base), at.key)
    if (this.#entry(slot, at.base, at.key, false)) this.#cache.delete(slot)
  }

  /**
   * A read found no object under `name`: forget it and every later key of the chain
   * it was last seen in (lifecycle expiry removes a chain's oldest chunks, so the
   * rest of that prefix is unusable too), and treat it as absent for a while.
   */
  invalidateFrom(name: string): number {
    const at = splitChainName(name)
    if (!at) return 0
    const { base, key } = at
    const id = this.#baseId(base)
    let forgotten = 0
    let cur: string | undefined = key
    const seen = new Set<string>()
    while (cur !== undefined && !seen.has(cur)) {
      seen.add(cur)
      const slot = ChainLookup.#slot(id, cur)
      const e = this.#entry(slot, base, cur, false)
      if (e && this.#cache.delete(slot)) forgotten++
      cur = e?.next
    }
    this.#absent.set(ChainLookup.#slot(id, key), { base, key })
    this.#metrics.invalidations.inc({}, forgotten)
    return forgotten
  }

  #isAbsent(slot: number, base: string, key: string): boolean {
    const gone = this.#absent.get(slot)
    return gone !== undefined && gone.key === key && gone.base === base
  }

  /** Background HEADs still running (tests wait for them). */
  get checking(): number {
    return this.#checking.size
  }

  // Turns the earliest inferred presences of an answer into seen ones (or forgets
  // them and the rest of their chain), without holding up the answer.
  #checkInferred(chain: KeyChain, sizes: readonly (number | undefined)[], present: number): void {
    if (this.#verifyInferred === 0 || this.#checking.size >= 8 * this.#verifyInferred) return
    let budget = this.#verifyInferred
    for (let i = 0; i < present && budget > 0; i++) {
      if ((sizes[i] ?? INFERRED) !== INFERRED) continue
      const name = chainName(chain.base, chain.keys[i]!)
      if (this.#checking.has(name)) continue
      budget--
      this.#checking.add(name)
      this.#store
        .head(name)
        .then(
          (r) => {
            if (r) this.remember(name, r.size)
            else this.invalidateFrom(name)
          },
          () => {
            // A store fault says nothing about the object; the TTL still bounds the inference.
          },
        )
        .finally(() => this.#checking.delete(name))
    }
  }

  get cacheSize(): number {
    return this.#cache.size
  }

  /** The most presence entries kept (cacheEntries). */
  get cacheEntries(): number {
    return this.#cache.max
  }

  async lookup(chain: KeyChain, opts: { sizes?: boolean } = {}): Promise<LookupResult> {
    const wantSizes = opts.sizes ?? false
    const { base, keys } = chain
    const id = this.#baseId(base)
    const m = keys.length
    const slots = new Array<number>(m)
    const sizes = new Array<number | undefined>(m)
    let hits = 0
    for (let i = 0; i < m; i++) {
      const key = keys[i]!
      const slot = ChainLookup.#slot(id, key)
      slots[i] = slot
      const size = this.#entry(slot, base, key)?.size
      sizes[i] = size
      if (size !== undefined) hits++
    }
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
        const res = await Promise.all(wave.map((i) => this.#store.head(chainName(base, keys[i]!))))
        wave.forEach((i, j) => {
          const r = res[j]
          out.set(i, r !== undefined)
          if (r) {
            sizes[i] = r.size
            this.#remember(id, base, keys[i]!, r.size)
          }
        })
      }
      return out
    }

    // Search: the answer n lies in [lo, hi]; lo = leading cached run, hi = first key
    // a read recently found missing (no later cached key may infer it back).
    let hi = m
    if (this.#absent.size > 0) {
      for (let i = 0; i < m; i++) {
        if (this.#isAbsent(slots[i]!, base, keys[i]!)) {
          hi = i
          break
        }
      }
    }
    let lo = 0
    while (lo < hi && sizes[lo] !== undefined) lo++
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
    }
    // Remember what this answer claimed (a repeated lookup within the TTL is all
    // cache) and the chain order, so a miss on one key can forget the keys after it.
    // An entry that already says exactly this is left alone (the read above renewed
    // its recency; noUpdateTTL would have kept its age anyway).
    for (let i = 0; i < present; i++) {
      const key = keys[i]!
      const next = keys[i + 1]
      const size = sizes[i] ?? INFERRED
      const cur = this.#entry(slots[i]!, base, key, false)
      if (cur !== undefined && cur.size === size && cur.next === next) continue
      // noUpdateTTL: re-asking never extends a presence the store has not shown again.
      this.#cache.set(slots[i]!, next === undefined ? { base, key, size } : { base, key, size, next }, {
        noUpdateTTL: true,
      })
    }
    this.#checkInferred(chain, sizes, present)
    this.#metrics.lookupProbes.observe(storeRequests)
    this.#metrics.lookupRounds.observe(rounds)
    this.#metrics.lookupKeys.inc({ result: 'present' }, present)
    this.#metrics.lookupKeys.inc({ result: 'absent' }, m - present)
    return { present, sizes: wantSizes ? (sizes.slice(0, present) as number[]) : [], storeRequests, rounds }
  }
}
