// Batches which chunks a gateway instance served (lookup hits, GETs) and created (PUT
// parent links) into one create-only use record per namespace per flush: no write per hit.
//
// Each instance writes only its own uniquely named records (<instance>-<seq>), so many
// instances (Node, Workers isolates, Lambda environments) never read-modify-write a shared
// object. A flush is due when the batch is flushIntervalMs old and holds ≥ 100 hits (≤ 1 PUT
// per 100 hits), or maxDelayMs old whatever its hits (the most a dead instance loses), or
// holds maxKeys keys; memory is capped at 2 × maxKeys keys (beyond it uses are dropped, counted).

import { randomId, usageRecordName } from '../../coldtier/names.ts'
import { DEFAULT_USAGE, type UsageOptions } from '../../coldtier/policy.ts'
import { encodeBatch, type LinkEntry } from '../../coldtier/records.ts'
import type { GatewayMetrics } from '../metrics.ts'
import { Counter } from '../metrics.ts'
import type { ObjectStore } from '../stores/types.ts'

/** Hits a batch should carry before the interval alone may flush it (≤ 1 request per this many hits). */
export const HITS_PER_FLUSH = 100

/** Namespaces whose creations an instance accounts between gc snapshots. */
const MAX_ACCOUNTED_NAMESPACES = 1000
/**
 * Creation buckets (one per namespace and busy second) held across all namespaces: ~85 bytes of
 * heap each, so ~2 MiB. Per namespace alone (an hour of seconds) 1,000 busy namespaces held
 * 3.6 million (~300 MiB), past a Worker isolate's 128 MB. Past it the oldest buckets fold.
 */
const MAX_ACCOUNTED_BUCKETS = 24_000
/** Per namespace: an hour of busy seconds. */
const MAX_BUCKETS_PER_NAMESPACE = 3600

interface Batch {
  uses: Map<string, number>
  links: Map<string, LinkEntry>
}

export interface UsageRecorderOptions extends Partial<UsageOptions> {
  /** Clock (tests move it). @default Date.now */
  now?: () => number
}

export class UsageRecorder {
  readonly #store: ObjectStore
  readonly #prefix: string
  readonly #opts: UsageOptions
  readonly #now: () => number
  #batches = new Map<string, Batch>()
  #keys = 0
  #hits = 0
  #since: number | undefined
  #instance: string | undefined
  #seq = 0
  #flushing: Promise<void> | undefined
  #timer: ReturnType<typeof setInterval> | undefined
  /** Created bytes/objects per namespace by second (ms), for the accounting view between gc runs. */
  readonly createdBySecond = new Map<string, Map<number, { bytes: number; objects: number }>>()
  #buckets = 0
  readonly hitsTotal = new Counter(
    'kvgate_usage_hits_total',
    'Chunk hits seen by use tracking (lookup-present chunks + GETs)',
  )
  readonly flushes = new Counter('kvgate_usage_flushes_total', 'Use-record PUTs by result (ok|failed)')
  readonly dropped = new Counter('kvgate_usage_dropped_total', 'Uses dropped because the buffer was full')

  constructor(
    store: ObjectStore,
    prefix: string,
    metrics: GatewayMetrics | undefined,
    opts: UsageRecorderOptions = {},
  ) {
    this.#store = store
    this.#prefix = prefix
    this.#opts = {
      flushIntervalMs: opts.flushIntervalMs ?? DEFAULT_USAGE.flushIntervalMs,
      maxDelayMs: opts.maxDelayMs ?? DEFAULT_USAGE.maxDelayMs,
      maxKeys: opts.maxKeys ?? DEFAULT_USAGE.maxKeys,
    }
    for (const [k, v] of Object.entries(this.#opts))
      if (!Number.isFinite(v) || v < 0) throw new TypeError(`invalid usage ${k}`)
    this.#now = opts.now ?? Date.now
    metrics?.extras.push(this.hitsTotal, this.flushes, this.dropped)
  }

  get options(): Readonly<UsageOptions> {
    return this.#opts
  }

  /** Keys buffered now (bounded by 2 × maxKeys). */
  get bufferedKeys(): number {
    return this.#keys
  }

  /** A chain used up to `tail` (a lookup's last present key, a GET, a re-PUT): `hits` chunk hits of it. */
  use(ns: string, tail: string, hits = 1): void {
    if (hits > 0) {
      this.#hits += hits
      this.hitsTotal.inc({}, hits)
    }
    const b = this.#batch(ns, !this.#batches.get(ns)?.uses.has(tail))
    if (!b) {
      this.dropped.inc()
      return
    }
    b.uses.set(tail, this.#now())
    this.#afterAdd()
  }

  /** A chunk created by this instance, with its parent from the verified header. */
  created(ns: string, key: string, parent: string, size: number): void {
    const now = this.#now()
    let m = this.createdBySecond.get(ns)
    // Namespaces past the cap go unaccounted until the next gc snapshot: memory stays bounded.
    if (!m && this.createdBySecond.size < MAX_ACCOUNTED_NAMESPACES) {
      m = new Map()
      this.createdBySecond.set(ns, m)
    }
    if (m) this.#account(m, now, size)
    const b = this.#batch(ns, !this.#batches.get(ns)?.links.has(key))
    if (!b) {
      this.dropped.inc()
      return
    }
    b.links.set(key, { key, parent, size, at: now })
    b.uses.delete(key) // the link's time is its use
    this.#afterAdd()
  }

  #account(m: Map<number, { bytes: number; objects: number }>, now: number, size: number): void {
    const second = now - (now % 1000)
    let c = m.get(second)
    if (!c) {
      c = { bytes: 0, objects: 0 }
      m.set(second, c)
      this.#buckets++
    }
    c.bytes += size
    c.objects++
    // Bounded: past an hour of busy seconds in a namespace, or past the buckets all namespaces
    // may hold, the oldest bucket folds into the next one, so older creations get coarser times
    // (gc's next snapshot makes them exact again).
    if (m.size > MAX_BUCKETS_PER_NAMESPACE) this.#fold(m)
    if (this.#buckets > MAX_ACCOUNTED_BUCKETS) {
      // This namespace's own oldest first; one down to a single bucket folds the largest one's.
      if (m.size >= 2) this.#fold(m)
      else {
        let largest: Map<number, { bytes: number; objects: number }> | undefined
        for (const x of this.createdBySecond.values()) if (x.size > (largest?.size ?? 1)) largest = x
        if (largest) this.#fold(largest)
      }
    }
  }

  /** Folds a namespace's oldest bucket into its next one (the map keeps insertion order: oldest first). */
  #fold(m: Map<number, { bytes: number; objects: number }>): void {
    const it = m.entries()
    const [oldest, o] = it.next().value!
    const [next, n] = it.next().value!
    m.delete(oldest)
    m.set(next, { bytes: n.bytes + o.bytes, objects: n.objects + o.objects })
    this.#buckets--
  }

  /** Bucket count across namespaces (tests watch it stay bounded). */
  get accountedBuckets(): number {
    return this.#buckets
  }

  /**
   * Drops creation buckets a gc snapshot taken at `at` already counts (accounting reads only
   * seconds ending after it): without this they stayed until folded, never read again.
   */
  pruneCreatedBefore(at: number): void {
    for (const [ns, m] of this.createdBySecond) {
      for (const second of m.keys()) {
        if (second + 1000 > at) break // later seconds follow: the map is in time order
        m.delete(second)
        this.#buckets--
      }
      if (m.size === 0) this.createdBySecond.delete(ns)
    }
  }

  #batch(ns: string, adds: boolean): Batch | undefined {
    if (adds && this.#keys >= 2 * this.#opts.maxKeys) return undefined
    let b = this.#batches.get(ns)
    if (!b) {
      b = { uses: new Map(), links: new Map() }
      this.#batches.set(ns, b)
    }
    if (adds) this.#keys++
    this.#since ??= this.#now()
    return b
  }

  #afterAdd(): void {
    if (this.#keys >= this.#opts.maxKeys && !this.#flushing) void this.flush().catch(() => {})
  }

  /** The flush in flight, if any (never rejects): Lambda awaits it before its environment freezes. */
  get pending(): Promise<void> | undefined {
    return this.#flushing?.catch(() => {})
  }

  /** Whether a flush is due now (see the module comment). */
  due(): boolean {
    if (this.#since === undefined || this.#flushing) return false
    const age = this.#now() - this.#since
    return (
      this.#keys >= this.#opts.maxKeys ||
      age >= this.#opts.maxDelayMs ||
      (age >= this.#opts.flushIntervalMs && this.#hits >= HITS_PER_FLUSH)
    )
  }

  /** Flushes if due; the promise (or undefined) lets Workers hand it to waitUntil. */
  flushIfDue(): Promise<void> | undefined {
    return this.due() ? this.flush().catch(() => {}) : undefined
  }

  /**
   * Writes one record per namespace with what is buffered now (waiting first for a flush in
   * flight, so everything used before the call is written when it resolves). A failed PUT puts
   * its entries back (newer times win), still under the memory cap.
   */
  async flush(): Promise<void> {
    if (this.#flushing) await this.#flushing.catch(() => {})
    if (this.#flushing) return this.flush()
    if (this.#keys === 0) return
    this.#flushing = this.#write().finally(() => {
      this.#flushing = undefined
    })
    return this.#flushing
  }

  async #write(): Promise<void> {
    const batches = this.#batches
    this.#batches = new Map()
    this.#keys = 0
    this.#hits = 0
    this.#since = undefined
    this.#instance ??= randomId()
    let failure: unknown
    for (const [ns, b] of batches) {
      const at = this.#now()
      const bytes = encodeBatch({
        kind: 'usage',
        at,
        uses: [...b.uses].map(([key, t]) => ({ key, at: t })),
        links: [...b.links.values()],
      })
      const name = usageRecordName(this.#prefix, ns, at, this.#instance, ++this.#seq)
      try {
        await this.#store.putIfAbsent(name, bytes, bytes.length)
        this.flushes.inc({ result: 'ok' })
      } catch (e) {
        failure ??= e
        this.flushes.inc({ result: 'failed' })
        this.#restore(ns, b)
      }
    }
    if (failure) throw failure
  }

  #restore(ns: string, old: Batch): void {
    // Links first (a chunk's parent and creation), then uses; each entry without room is
    // counted, and the rest still go back (one already buffered takes no room).
    for (const l of old.links.values()) {
      const b = this.#batch(ns, !this.#batches.get(ns)?.links.has(l.key))
      if (!b) this.dropped.inc()
      else if (!b.links.has(l.key)) b.links.set(l.key, l)
    }
    for (const [key, t] of old.uses) {
      const b = this.#batch(ns, !this.#batches.get(ns)?.uses.has(key))
      if (!b) this.dropped.inc()
      else b.uses.set(key, Math.max(t, b.uses.get(key) ?? 0))
    }
  }

  /** Node: flush on a timer even without traffic (unref'd: never keeps the process alive). */
  start(): void {
    if (this.#timer) return
    const every = Math.max(250, Math.min(this.#opts.flushIntervalMs, this.#opts.maxDelayMs) / 4)
    this.#timer = setInterval(() => void this.flushIfDue(), every)
    ;(this.#timer as { unref?: () => void }).unref?.()
  }

  /** Stops the timer and writes what is buffered (graceful shutdown). */
  async close(): Promise<void> {
    if (this.#timer) clearInterval(this.#timer)
    this.#timer = undefined
    await this.flush()
  }
}
