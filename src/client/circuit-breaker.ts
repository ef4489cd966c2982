// Circuit breaker for the remote tier: after repeated failures (or a few hung
// requests) calls fail fast, the inference path falls back to local tiers, and a probe waits for recovery.

export type BreakerState = 'closed' | 'open' | 'half-open'

export interface CircuitBreakerOptions {
  /** Consecutive failures that open the circuit. @default 5 */
  failureThreshold?: number
  /** Wait before the first probe after opening; doubles per failed probe up to maxCooldownMs. @default 1000 */
  cooldownMs?: number
  /** @default 30000 */
  maxCooldownMs?: number
  /**
   * Timeouts within `timeoutWindowMs` that open the circuit even when other
   * calls succeed in between: a gateway that answers lookups but hangs on GETs
   * must not cost every caller a full deadline. @default 2
   */
  timeoutThreshold?: number
  /** @default 60000 */
  timeoutWindowMs?: number
  /** Resolves true when the service answers again (e.g. GET /healthz). */
  probe: () => Promise<boolean>
  /** Clock (tests). @default performance.now */
  now?: () => number
}

export class CircuitBreaker {
  #state: BreakerState = 'closed'
  #failures = 0
  #cooldown: number
  readonly #baseCooldown: number
  readonly #maxCooldown: number
  readonly #threshold: number
  readonly #probe: () => Promise<boolean>
  readonly #timeoutThreshold: number
  readonly #timeoutWindow: number
  readonly #now: () => number
  /** When recent timeouts happened (at most timeoutThreshold kept). */
  readonly #timeouts: number[] = []
  #closedAt = Number.NEGATIVE_INFINITY
  #timer: NodeJS.Timeout | undefined
  #closed = false
  /** Times the circuit opened. */
  opened = 0
  /** Calls refused while open. */
  rejected = 0
  /** Times the circuit opened because of hung calls. */
  openedByTimeouts = 0

  constructor(opts: CircuitBreakerOptions) {
    this.#threshold = opts.failureThreshold ?? 5
    this.#baseCooldown = opts.cooldownMs ?? 1000
    this.#maxCooldown = Math.max(this.#baseCooldown, opts.maxCooldownMs ?? 30_000)
    this.#cooldown = this.#baseCooldown
    this.#probe = opts.probe
    this.#timeoutThreshold = Math.max(1, opts.timeoutThreshold ?? 2)
    this.#timeoutWindow = opts.timeoutWindowMs ?? 60_000
    this.#now = opts.now ?? (() => performance.now())
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

  /**
   * A call that hit its deadline: a failure, and also one of the timeouts that
   * open the circuit within the window whatever succeeded in between.
   */
  timeout(): void {
    if (this.#state !== 'closed') return
    const now = this.#now()
    this.#timeouts.push(now)
    while (this.#timeouts.length > 0 && now - this.#timeouts[0]! > this.#timeoutWindow) this.#timeouts.shift()
    if (this.#timeouts.length >= this.#timeoutThreshold) {
      this.openedByTimeouts++
      this.#open()
      return
    }
    this.failure()
  }

  #open(): void {
    this.#state = 'open'
    this.opened++
    this.#timeouts.length = 0
    // Opening again soon after a recovery (a flapping or half-hung service): back off further.
    this.#cooldown =
      this.#now() - this.#closedAt < this.#maxCooldown
        ? Math.min(this.#maxCooldown, this.#cooldown * 2)
        : this.#baseCooldown
    this.#schedule()
  }

  #close(): void {
    this.#state = 'closed'
    this.#failures = 0
    this.#closedAt = this.#now()
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
