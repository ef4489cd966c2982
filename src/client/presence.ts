// What this client believes the gateway holds ("known present in L4"): entries
// expire, and forgetting a key forgets every later key of the chains it was learned in.

/** One remembered key: when the belief expires and the keys learned right after it in a chain. */
interface Entry {
  expires: number
  next: string[] | undefined
}

/** Successors kept per key: prompts branch, but a few continuations cover real workloads. */
const MAX_SUCCESSORS = 8

/**
 * Bounded (oldest entries trimmed first) and time-limited: objects can vanish
 * behind the gateway (lifecycle expiry, an admin DELETE, a corrupt object
 * removed), so a belief is only trusted for `ttlMs`. Chain links let a 404 on
 * chunk i drop i and everything learned after it, which a later chunk's presence
 * was inferred from. A key trimmed or found expired takes the keys learned after
 * it along: its links go with it, so a later 404 on it (once a lookup re-learned
 * it) could no longer reach them. Dropping a belief only costs a lookup, and a
 * lookup asks the gateway from the first key not believed present anyway.
 */
export class PresenceSet {
  readonly #entries = new Map<string, Entry>()
  readonly #ttlMs: number
  readonly #max: number
  readonly #now: () => number

  constructor(ttlMs: number, max = 65_536, now: () => number = () => performance.now()) {
    this.#ttlMs = ttlMs
    this.#max = max
    this.#now = now
  }

  get size(): number {
    return this.#entries.size
  }

  has(hex: string): boolean {
    const e = this.#entries.get(hex)
    if (!e) return false
    if (e.expires > this.#now()) return true
    // Its links go with it, so the keys learned after it go too (see the class comment).
    this.forgetChainFrom(hex)
    return false
  }

  /**
   * Remembers `hexes` (consecutive keys of one chain) as present from index
   * `freshFrom` on, linked in order; keys before it are only linked (their belief
   * is not renewed: nobody confirmed them again).
   */
  rememberChain(hexes: readonly string[], freshFrom = 0): void {
    const expires = this.#now() + this.#ttlMs
    let prev: Entry | undefined
    for (const [i, hex] of hexes.entries()) {
      const old = this.#entries.get(hex)
      let e: Entry
      if (i < freshFrom) {
        if (!old) {
          prev = undefined
          continue
        }
        e = old
      } else {
        // Re-inserting moves the key to the young end of the trim order.
        this.#entries.delete(hex)
        e = { expires, next: old?.next }
        this.#entries.set(hex, e)
      }
      if (prev) {
        prev.next ??= []
        if (!prev.next.includes(hex)) {
          if (prev.next.length >= MAX_SUCCESSORS) prev.next.shift()
          prev.next.push(hex)
        }
      }
      prev = e
    }
    while (this.#entries.size > this.#max) {
      const first = this.#entries.keys().next().value as string
      this.forgetChainFrom(first)
    }
  }

  /** Forgets `hex` and every key learned after it in a chain (transitively). */
  forgetChainFrom(hex: string): number {
    let dropped = 0
    const stack = [hex]
    while (stack.length > 0) {
      const h = stack.pop()!
      const e = this.#entries.get(h)
      if (!e) continue
      this.#entries.delete(h)
      dropped++
      if (e.next) stack.push(...e.next)
    }
    return dropped
  }

  /** Forgets keys[index..] and whatever was learned after each of them. */
  forgetFrom(hexes: readonly string[], index: number): number {
    let dropped = 0
    for (let i = Math.max(0, index); i < hexes.length; i++) dropped += this.forgetChainFrom(hexes[i]!)
    return dropped
  }

  clear(): void {
    this.#entries.clear()
  }
}
