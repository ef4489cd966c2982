// Circuit breaker for the remote tier: after repeated failures calls fail fast
// (the inference path falls back to local tiers) while a background probe waits for recovery.

export type BreakerState = 'closed' | 'open' | 'half-open'

export interface CircuitBreakerOptions {
  /** Consecutive failures that open the circuit. @default 5 */
  failureThreshold?: number
  /** Wait before the first probe after opening; doubles per failed probe up to maxCooldownMs. @default 1000 */
  cooldownMs?: number
  /** @default 30000 */
  maxCooldownMs?: number
  /** Resolves true when the service answers again (e.g. GET /healthz). */
  probe: () => Promise<boolean>
}

export class CircuitBreaker {
  #state: BreakerState = 'closed'
  #failures = 0
  #cooldown: number
  readonly #baseCooldown: number
  readonly #maxCooldown: number
  readonly #threshold: number
  readonly #probe: () => Promise<boolean>
  #timer: NodeJS.Timeout | undefined
  #closed = false
  /** Times the circuit opened. */
  opened = 0
  /** Calls refused while open. */
  rejected = 0

  constructor(opts: CircuitBreakerOptions) {
    this.#threshold = opts.failureThreshold ?? 5
    this.#baseCooldown = opts.cooldownMs ?? 1000
    this.#maxCooldown = Math.max(this.#baseCooldown, opts.maxCooldownMs ?? 30_000)
    this.#cooldown = this.#baseCooldown
    this.#probe = opts.probe
  }

  get state(): BreakerState {
    return this.#state
  }

  /** True when a call may go out now; counts a rejection otherwise. */
  allow(): boolean {
    if (this.#state === 'closed') return true
    this.rejected++
    return false
  }

  success(): void {
    this.#failures = 0
    if (this.#state !== 'closed') this.#close()
  }

  failure(): void {
    if (this.#state !== 'closed') return
    this.#failures++
    if (this.#failures >= this.#threshold) this.#open()
  }

  #open(): void {
    this.#state = 'open'
    this.opened++
    this.#schedule()
  }

  #close(): void {
    this.#state = 'closed'
    this.#failures = 0
    this.#cooldown = this.#baseCooldown
    if (this.#timer) clearTimeout(this.#timer)
    this.#timer = undefined
  }

  #schedule(): void {
    if (this.#closed) return
    if (this.#timer) clearTimeout(this.#timer)
    this.#timer = setTimeout(() => void this.#runProbe(), this.#cooldown)
    // A breaker must never keep the process alive.
    this.#timer.unref()
  }

  async #runProbe(): Promise<void> {
    this.#timer = undefined
    if (this.#closed || this.#state === 'closed') return
    this.#state = 'half-open'
    let ok = false
    try {
      ok = await this.#probe()
    } catch {
      ok = false
    }
    if (this.#closed) return
    if (ok) {
      this.#close()
    } else {
      this.#state = 'open'
      this.#cooldown = Math.min(this.#maxCooldown, this.#cooldown * 2)
      this.#schedule()
    }
  }

  /** Stops background probes. */
  dispose(): void {
    this.#closed = true
    if (this.#timer) clearTimeout(this.#timer)
    this.#timer = undefined
  }
}
