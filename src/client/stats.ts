// Counters and latency summaries the client reports through stats() and the
// Prometheus text exposition. Cheap enough to update on every chunk.

/**
 * Latency summary over the most recent `capacity` samples (a ring buffer):
 * p50/p99 reflect current behaviour, not the whole process lifetime.
 */
export class LatencyWindow {
  readonly #samples: Float64Array
  #next = 0
  #filled = 0
  #count = 0
  #sum = 0

  constructor(capacity = 1024) {
    this.#samples = new Float64Array(capacity)
  }

  record(ms: number): void {
    this.#samples[this.#next] = ms
    this.#next = (this.#next + 1) % this.#samples.length
    if (this.#filled < this.#samples.length) this.#filled++
    this.#count++
    this.#sum += ms
  }

  /** Milliseconds at quantile q (0..1) of the window; 0 when empty. */
  quantile(q: number): number {
    if (this.#filled === 0) return 0
    const sorted = this.#samples.slice(0, this.#filled).sort()
    const i = Math.min(this.#filled - 1, Math.max(0, Math.ceil(q * this.#filled) - 1))
    return sorted[i]!
  }

  summary(): LatencySummary {
    return { count: this.#count, sumMs: this.#sum, p50Ms: this.quantile(0.5), p99Ms: this.quantile(0.99) }
  }
}

export interface LatencySummary {
  /** Samples recorded since start. */
  count: number
  sumMs: number
  p50Ms: number
  p99Ms: number
}

/** Per-tier counters; every tier owns one and stats() snapshots it. */
export class TierCounters {
  hits = 0
  misses = 0
  bytesRead = 0
  bytesWritten = 0
  puts = 0
  evictions = 0
  /** Failures of this tier (I/O, HTTP, corrupt objects); the caller never saw them. */
  errors = 0
  /** Objects that failed verification and were treated as misses (and dropped where possible). */
  corrupt = 0
  readonly readLatency = new LatencyWindow()
  readonly writeLatency = new LatencyWindow()

  snapshot(): TierCounterSnapshot {
    return {
      hits: this.hits,
      misses: this.misses,
      bytesRead: this.bytesRead,
      bytesWritten: this.bytesWritten,
      puts: this.puts,
      evictions: this.evictions,
      errors: this.errors,
      corrupt: this.corrupt,
      readLatency: this.readLatency.summary(),
      writeLatency: this.writeLatency.summary(),
    }
  }
}

export interface TierCounterSnapshot {
  hits: number
  misses: number
  bytesRead: number
  bytesWritten: number
  puts: number
  evictions: number
  errors: number
  corrupt: number
  readLatency: LatencySummary
  writeLatency: LatencySummary
}

/** Milliseconds since `t0` (from performance.now()). */
export function since(t0: number): number {
  return performance.now() - t0
}

/**
 * Prometheus text exposition (version 0.0.4) of a flat list of samples. Names are
 * prefixed `kvgate_client_`; labels come from the sample.
 */
export function prometheusText(
  samples: {
    name: string
    help: string
    type: 'counter' | 'gauge'
    values: { labels?: Record<string, string>; value: number }[]
  }[],
): string {
  const lines: string[] = []
  for (const s of samples) {
    const name = `kvgate_client_${s.name}`
    lines.push(`# HELP ${name} ${s.help}`, `# TYPE ${name} ${s.type}`)
    for (const v of s.values) {
      const labels = v.labels
        ? `{${Object.entries(v.labels)
            .map(([k, x]) => `${k}="${x.replace(/\\/g, '\\\\').replace(/"/g, '\\"').replace(/\n/g, '\\n')}"`)
            .join(',')}}`
        : ''
      lines.push(`${name}${labels} ${Number.isFinite(v.value) ? v.value : 0}`)
    }
  }
  return `${lines.join('\n')}\n`
}
