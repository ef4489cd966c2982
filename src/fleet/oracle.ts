// The oracle the fleet simulation is judged against: it knows every chunk any
// node ever stored, so its hit count for a request is the longest stored prefix.

export class PrefixOracle {
  readonly #stored = new Set<string>()

  /** Leading chunks of `keys` that some node stored before (the best any cache could serve). */
  hits(keys: readonly string[]): number {
    let n = 0
    while (n < keys.length && this.#stored.has(keys[n]!)) n++
    return n
  }

  record(keys: readonly string[]): void {
    for (const k of keys) this.#stored.add(k)
  }

  get size(): number {
    return this.#stored.size
  }
}
