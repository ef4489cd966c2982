// Agent counters and their Prometheus text (kvgate_agent_*), plus the tier counters of
// every KV space's cache summed, so one scrape shows what the engines got.

import type { KVCacheStats } from '../client/kv-cache.ts'

/** The last `size` durations of one kind of request, for quantiles (bounded memory, no histogram buckets to pick). */
export class LatencyWindow {
  readonly #ms: Float64Array
  #count = 0
  #sumMs = 0

  constructor(size = 1024) {
    this.#ms = new Float64Array(size)
  }

  add(ms: number): void {
    this.#ms[this.#count % this.#ms.length] = ms
    this.#count++
    this.#sumMs += ms
  }

  /** Quantile q of the window in ms (0 when empty). */
  quantile(q: number): number {
    const n = Math.min(this.#count, this.#ms.length)
    if (n === 0) return 0
    const sorted = this.#ms.slice(0, n).sort()
    return sorted[Math.min(n - 1, Math.floor(q * n))]!
  }

  /** Durations recorded since the start (the window holds the latest of them). */
  get count(): number {
    return this.#count
  }

  /** Their total in ms since the start (a Prometheus summary's _sum: rate(_sum)/rate(_count) is the mean). */
  get sumMs(): number {
    return this.#sumMs
  }
}

/** Requests whose time inside the agent is kept (stats agentMs, kvgate_agent_request_seconds). */
const TIMED_OPS = ['lookup', 'load', 'save'] as const
type TimedOp = (typeof TIMED_OPS)[number]

export class AgentMetrics {
  connections = 0
  workers = 0
  requests = 0
  badFrames = 0
  errors = new Map<string, number>()
  lookups = 0
  lookupChunks = 0
  lookupHitChunks = 0
  lookupDeadline = 0
  loads = 0
  loadErrors = 0
  /** Loads and saves the engine cancelled (they answered once their copies in flight landed). */
  loadsCancelled = 0
  savesCancelled = 0
  loadedChunks = 0
  loadedBytes = 0
  saves = 0
  saveErrors = 0
  savedChunks = 0
  savedBytes = 0
  /** Lookups, loads and saves whose keys came as one packed bin, and as an array of bins. */
  packedKeyRequests = 0
  arrayKeyRequests = 0
  /** Agent-side time of each lookup, load and save: frame decoded to answer encoded (no socket, no engine). */
  readonly #took = new Map<TimedOp, LatencyWindow>(TIMED_OPS.map((op) => [op, new LatencyWindow()]))

  /** Records a request's time inside the agent (ops other than lookup, load and save are not timed). */
  took(op: string, ms: number): void {
    this.#took.get(op as TimedOp)?.add(ms)
  }

  error(code: string): void {
    this.errors.set(code, (this.errors.get(code) ?? 0) + 1)
  }

  snapshot(): Record<string, unknown> {
    const { errors, ...rest } = Object.fromEntries(Object.entries(this)) as Record<string, unknown>
    // Per op over its latest 1024 requests (`samples` counts all of them).
    const agentMs = Object.fromEntries(
      [...this.#took].map(([op, t]) => [
        op,
        { p50: t.quantile(0.5), p99: t.quantile(0.99), samples: t.count },
      ]),
    )
    return { ...rest, errors: Object.fromEntries(this.errors), agentMs }
  }

  prometheus(caches: KVCacheStats[]): string {
    const lines: string[] = []
    const put = (name: string, type: 'counter' | 'gauge', help: string, values: [string, number][]) => {
      lines.push(`# HELP kvgate_agent_${name} ${help}`, `# TYPE kvgate_agent_${name} ${type}`)
      for (const [labels, v] of values) lines.push(`kvgate_agent_${name}${labels} ${v}`)
    }
    put('connections', 'gauge', 'Open engine connections.', [['', this.connections]])
    put('workers', 'gauge', 'Registered engine workers (TP ranks).', [['', this.workers]])
    put('requests_total', 'counter', 'Requests received.', [['', this.requests]])
    put('bad_frames_total', 'counter', 'Frames refused (undecodable, oversized, bad envelope).', [
      ['', this.badFrames],
    ])
    put(
      'errors_total',
      'counter',
      'Error answers by code.',
      [...this.errors].map(([c, n]) => [`{code="${c}"}`, n]),
    )
    put('lookups_total', 'counter', 'Lookups answered.', [['', this.lookups]])
    put('lookup_chunks_total', 'counter', 'Chunks asked for by lookups.', [['', this.lookupChunks]])
    put('lookup_hit_chunks_total', 'counter', 'Chunks lookups answered present.', [
      ['', this.lookupHitChunks],
    ])
    put(
      'lookup_deadline_total',
      'counter',
      'Lookups answered from local tiers because the gateway was slow.',
      [['', this.lookupDeadline]],
    )
    lines.push(
      '# HELP kvgate_agent_request_seconds Time inside the agent (decoded to answered), latest 1024 per op.',
      '# TYPE kvgate_agent_request_seconds summary',
    )
    for (const [op, t] of this.#took) {
      for (const q of [0.5, 0.99])
        lines.push(`kvgate_agent_request_seconds{op="${op}",quantile="${q}"} ${t.quantile(q) / 1000}`)
      lines.push(`kvgate_agent_request_seconds_sum{op="${op}"} ${t.sumMs / 1000}`)
      lines.push(`kvgate_agent_request_seconds_count{op="${op}"} ${t.count}`)
    }
    put('key_requests_total', 'counter', 'Lookups, loads and saves by the form of their keys.', [
      ['{form="packed"}', this.packedKeyRequests],
      ['{form="array"}', this.arrayKeyRequests],
    ])
    put('loads_total', 'counter', 'Loads finished.', [['', this.loads]])
    put('load_errors_total', 'counter', 'Loads that failed part-way (blocks reported to the engine).', [
      ['', this.loadErrors],
    ])
    put('loads_cancelled_total', 'counter', 'Loads the engine cancelled (past its load timeout).', [
      ['', this.loadsCancelled],
    ])
    put('saves_cancelled_total', 'counter', 'Saves the engine cancelled.', [['', this.savesCancelled]])
    put('loaded_bytes_total', 'counter', 'Bytes written into engine KV blocks.', [['', this.loadedBytes]])
    put('saves_total', 'counter', 'Saves finished.', [['', this.saves]])
    put('save_errors_total', 'counter', 'Saves that failed.', [['', this.saveErrors]])
    put('saved_bytes_total', 'counter', 'Bytes copied out of engine KV blocks.', [['', this.savedBytes]])
    const tier = (f: (c: KVCacheStats) => { hits: number; misses: number } | null, name: string) => {
      let hits = 0
      let misses = 0
      for (const c of caches) {
        const t = f(c)
        if (t) {
          hits += t.hits
          misses += t.misses
        }
      }
      return [
        [`{tier="${name}",result="hit"}`, hits],
        [`{tier="${name}",result="miss"}`, misses],
      ] as [string, number][]
    }
    put('tier_reads_total', 'counter', 'Chunk reads per tier, all KV spaces.', [
      ...tier((c) => c.memory, 'memory'),
      ...tier((c) => c.disk, 'disk'),
      ...tier((c) => c.remote, 'remote'),
    ])
    put(
      'lookup_unservable_stops_total',
      'counter',
      'Lookups (per KV space) whose matched prefix stopped before a chunk held as unservable (its reads kept failing).',
      [['', caches.reduce((a, c) => a + (c.remote?.unservableLookupStops ?? 0), 0)]],
    )
    put('memory_used_bytes', 'gauge', 'L1 bytes in use, all KV spaces.', [
      ['', caches.reduce((a, c) => a + c.memory.usedBytes, 0)],
    ])
    return `${lines.join('\n')}\n`
  }
}
