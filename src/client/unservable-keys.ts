// L4 keys whose objects keep failing to decode with no verdict on their bytes: held off for a
// while, so a deterministic failure (a decoder bug on those bytes) costs a miss, not a GET each time.

export interface UnservableKeysOptions {
  /** Failures of one key within windowMs that hold it off. @default 3 */
  failures?: number
  /** @default 10 minutes */
  windowMs?: number
  /** How long a held key's GETs are skipped; then it is tried again. @default 5 minutes */
  holdMs?: number
  /**
   * Failures of one key closer together than this count once: the layer groups of one
   * retrieveLayers, or every job a dying codec worker took along, are one event. @default 1000
   */
  burstMs?: number
  /** Keys tracked at once (the least recently failed goes first): the memory bound. @default 1024 */
  maxKeys?: number
}

interface Entry {
  failures: number
  /** When the first failure of this window was counted. */
  since: number
  /** When the last failure was counted (bursts count once). */
  last: number
  /** Held off until then (set once failures reached the limit). */
  until?: number
}

/**
 * Unlike an L2 file (deleted at its third such read), an L4 object is not this client's to
 * delete, and the gateway's verify would find its CRCs right: the key is held off locally
 * instead, for holdMs, after which a read tries it again (a newer build, a healed object).
 */
export class UnservableKeys {
  readonly #entries = new Map<string, Entry>()
  readonly #failures: number
  readonly #windowMs: number
  readonly #holdMs: number
  readonly #burstMs: number
  readonly #maxKeys: number

  constructor(o: UnservableKeysOptions = {}) {
    this.#failures = o.failures ?? 3
    this.#windowMs = o.windowMs ?? 10 * 60_000
    this.#holdMs = o.holdMs ?? 5 * 60_000
    this.#burstMs = o.burstMs ?? 1000
    this.#maxKeys = o.maxKeys ?? 1024
  }

  get size(): number {
    return this.#entries.size
  }

  /** True while `hex` is held off (its GETs skipped); an ended hold is forgotten. */
  held(hex: string, now: number): boolean {
    const e = this.#entries.get(hex)
    if (e?.until === undefined) return false
    if (now < e.until) return true
    this.#entries.delete(hex)
    return false
  }

  /** Counts a read of `hex` that failed with no verdict; true when this failure put it on hold. */
  failed(hex: string, now: number): boolean {
    let e = this.#entries.get(hex)
    if (e?.until !== undefined) return false // held already (a GET that started before the hold)
    if (e && now - e.last < this.#burstMs) return false
    if (!e || now - e.since >= this.#windowMs) e = { failures: 0, since: now, last: now }
    e.failures++
    e.last = now
    // Re-inserted: the map's order is the order of last failure, oldest first.
    this.#entries.delete(hex)
    this.#entries.set(hex, e)
    if (this.#entries.size > this.#maxKeys) this.#entries.delete(this.#entries.keys().next().value as string)
    if (e.failures < this.#failures) return false
    e.until = now + this.#holdMs
    return true
  }

  /**
   * Holds `hex` off at once, for holdMs: an object this build cannot read for a reason its
   * header states (a newer writer's format) fails the same way every time, so no second GET.
   * False (the hold unchanged) when it is held already: a GET that started before the hold, such
   * as another layer group of the same retrieveLayers, found the same object.
   */
  holdNow(hex: string, now: number): boolean {
    const e = this.#entries.get(hex)
    if (e?.until !== undefined && now < e.until) return false
    this.#entries.delete(hex)
    this.#entries.set(hex, { failures: this.#failures, since: now, last: now, until: now + this.#holdMs })
    if (this.#entries.size > this.#maxKeys) this.#entries.delete(this.#entries.keys().next().value as string)
    return true
  }

  clear(): void {
    this.#entries.clear()
  }
}
