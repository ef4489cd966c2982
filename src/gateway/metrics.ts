// A small Prometheus registry (counters, histograms with labels) rendered as text
// exposition format; hand-written so the gateway stays runtime-neutral (workerd, Lambda).

type Labels = Record<string, string>

/** A Prometheus label value: backslash, line feed and double quote escaped (the exposition format). */
export const escapeLabel = (v: string) => v.replace(/\\/g, '\\\\').replace(/\n/g, '\\n').replace(/"/g, '\\"')
function labelKey(labels: Labels): string {
  const keys = Object.keys(labels).sort()
  return keys.map((k) => `${k}="${escapeLabel(labels[k]!)}"`).join(',')
}

export class Counter {
  readonly #values = new Map<string, number>()
  constructor(
    readonly name: string,
    readonly help: string,
  ) {}
  inc(labels: Labels = {}, by = 1): void {
    const k = labelKey(labels)
    this.#values.set(k, (this.#values.get(k) ?? 0) + by)
  }
  /** Sum over series matching every given label. */
  value(labels: Labels = {}): number {
    const want = Object.entries(labels).map(([k, v]) => `${k}="${escapeLabel(v)}"`)
    let sum = 0
    for (const [k, v] of this.#values) if (want.every((w) => k.split(',').includes(w))) sum += v
    return sum
  }
  render(): string[] {
    const out = [`# HELP ${this.name} ${this.help}`, `# TYPE ${this.name} counter`]
    for (const [k, v] of this.#values) out.push(`${this.name}${k ? `{${k}}` : ''} ${v}`)
    return out
  }
}

export class Histogram {
  readonly #series = new Map<string, { counts: number[]; sum: number; count: number }>()
  constructor(
    readonly name: string,
    readonly help: string,
    readonly buckets: readonly number[],
  ) {}
  observe(value: number, labels: Labels = {}): void {
    const k = labelKey(labels)
    let s = this.#series.get(k)
    if (!s) {
      s = { counts: this.buckets.map(() => 0), sum: 0, count: 0 }
      this.#series.set(k, s)
    }
    for (let i = 0; i < this.buckets.length; i++) if (value <= this.buckets[i]!) s.counts[i]!++
    s.sum += value
    s.count++
  }
  /** Observations and their sum over all series (status page). */
  totals(): { count: number; sum: number } {
    let count = 0
    let sum = 0
    for (const s of this.#series.values()) {
      count += s.count
      sum += s.sum
    }
    return { count, sum }
  }
  render(): string[] {
    const out = [`# HELP ${this.name} ${this.help}`, `# TYPE ${this.name} histogram`]
    for (const [k, s] of this.#series) {
      const sep = k ? `${k},` : ''
      this.buckets.forEach((b, i) => {
        out.push(`${this.name}_bucket{${sep}le="${b}"} ${s.counts[i]}`)
      })
      out.push(`${this.name}_bucket{${sep}le="+Inf"} ${s.count}`)
      out.push(`${this.name}_sum${k ? `{${k}}` : ''} ${s.sum}`)
      out.push(`${this.name}_count${k ? `{${k}}` : ''} ${s.count}`)
    }
    return out
  }
}

const LATENCY_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30]

/** Every metric the gateway exports. One instance per gateway (pass your own to share). */
export class GatewayMetrics {
  readonly requests = new Counter('kvgate_http_requests_total', 'HTTP requests by route, method and status')
  readonly requestSeconds = new Histogram(
    'kvgate_http_request_seconds',
    'HTTP request latency by route',
    LATENCY_BUCKETS,
  )
  readonly bytesIn = new Counter('kvgate_http_bytes_in_total', 'Chunk bytes received (PUT bodies)')
  readonly bytesOut = new Counter('kvgate_http_bytes_out_total', 'Chunk bytes sent (GET bodies)')
  readonly storeOps = new Counter('kvgate_store_ops_total', 'Object store operations by op and outcome')
  readonly storeSeconds = new Histogram(
    'kvgate_store_op_seconds',
    'Object store operation latency by op',
    LATENCY_BUCKETS,
  )
  readonly lookupProbes = new Histogram(
    'kvgate_lookup_store_requests',
    'Store requests per lookup',
    [0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096],
  )
  readonly lookupRounds = new Histogram(
    'kvgate_lookup_rounds',
    'Sequential store round trips per lookup',
    [0, 1, 2, 3, 4, 6, 8, 12],
  )
  readonly lookupKeys = new Counter('kvgate_lookup_keys_total', 'Keys asked (result=present|absent)')
  readonly cache = new Counter('kvgate_cache_total', 'Positive cache lookups by result (hit|miss)')
  readonly coalesced = new Counter(
    'kvgate_get_coalesced_total',
    'GETs served from another in-flight store GET',
  )
  readonly puts = new Counter('kvgate_chunk_puts_total', 'Chunk PUTs by result (created|exists|rejected)')
  readonly redirects = new Counter('kvgate_get_redirects_total', 'GETs answered with a presigned redirect')
  readonly errors = new Counter('kvgate_errors_total', 'Error responses by code')
  readonly invalidations = new Counter(
    'kvgate_presence_invalidated_total',
    'Cached presences forgotten because a read found the object (or an earlier one of its chain) missing, or an admin DELETE removed it',
  )
  readonly corruptReads = new Counter(
    'kvgate_corrupt_reads_total',
    'GET responses aborted because the stored bytes failed verification (layers=true for ?layers=)',
  )
  readonly corrupt = new Counter(
    'kvgate_corrupt_objects_total',
    'Stored objects verified corrupt and deleted so the next writer replaces them (by=get|verify)',
  )
  readonly verifies = new Counter(
    'kvgate_verify_total',
    'Object verifications by verdict (ok|corrupt|missing)',
  )
  readonly readersCutOff = new Counter(
    'kvgate_get_readers_cut_off_total',
    'GET responses cut off, their store stream released, because the reader idled (reason=idle) or took less than readerMinBytesPerSecond (reason=slow)',
  )
  readonly busy = new Counter(
    'kvgate_busy_total',
    'Requests refused with 503 ERR_BUSY because the in-flight byte or buffer bound was reached',
  )
  readonly calibrations = new Counter(
    'kvgate_calibration_ops_total',
    'Calibration requests by op (put|get|current) and result (created|exists|hit|missing|corrupt)',
  )
  /** Metrics other modules register (use tracking, cold-tier accounting), rendered after these. */
  readonly extras: { render(): string[] }[] = []

  render(): string {
    const all = [
      this.requests,
      this.requestSeconds,
      this.bytesIn,
      this.bytesOut,
      this.storeOps,
      this.storeSeconds,
      this.lookupProbes,
      this.lookupRounds,
      this.lookupKeys,
      this.cache,
      this.coalesced,
      this.readersCutOff,
      this.puts,
      this.redirects,
      this.errors,
      this.invalidations,
      this.corruptReads,
      this.corrupt,
      this.verifies,
      this.busy,
      this.calibrations,
      ...this.extras,
    ]
    return `${all.flatMap((m) => m.render()).join('\n')}\n`
  }
}
