// Seeded PRNG for simulations: xoshiro128** seeded through splitmix32, so a
// fleet run with the same seed replays the same workload on any machine.

export class Rng {
  #s: Uint32Array

  constructor(seed: number) {
    let x = seed >>> 0
    const next = () => {
      x = (x + 0x9e3779b9) >>> 0
      let z = x
      z = Math.imul(z ^ (z >>> 16), 0x85ebca6b) >>> 0
      z = Math.imul(z ^ (z >>> 13), 0xc2b2ae35) >>> 0
      return (z ^ (z >>> 16)) >>> 0
    }
    this.#s = Uint32Array.of(next(), next(), next(), next())
  }

  /** Uniform 32-bit unsigned integer. */
  u32(): number {
    const s = this.#s
    const r = Math.imul(((Math.imul(s[1]!, 5) << 7) | (Math.imul(s[1]!, 5) >>> 25)) >>> 0, 9) >>> 0
    const t = (s[1]! << 9) >>> 0
    s[2]! ^= s[0]!
    s[3]! ^= s[1]!
    s[1]! ^= s[2]!
    s[0]! ^= s[3]!
    s[2]! ^= t
    s[3] = ((s[3]! << 11) | (s[3]! >>> 21)) >>> 0
    return r
  }

  /** Uniform in [0, 1). */
  float(): number {
    return this.u32() / 2 ** 32
  }

  /** Uniform integer in [0, n). */
  int(n: number): number {
    return Math.floor(this.float() * n)
  }
}

/** Samples ranks 0..n-1 with probability ∝ 1/(rank+1)^s (document popularity). */
export class Zipf {
  readonly #cdf: Float64Array

  constructor(n: number, s: number) {
    this.#cdf = new Float64Array(n)
    let sum = 0
    for (let i = 0; i < n; i++) {
      sum += 1 / (i + 1) ** s
      this.#cdf[i] = sum
    }
    for (let i = 0; i < n; i++) this.#cdf[i]! /= sum
  }

  sample(rng: Rng): number {
    const u = rng.float()
    let lo = 0
    let hi = this.#cdf.length - 1
    while (lo < hi) {
      const mid = (lo + hi) >> 1
      if (this.#cdf[mid]! < u) lo = mid + 1
      else hi = mid
    }
    return lo
  }
}
