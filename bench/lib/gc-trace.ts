// The garbage collections of a benchmark's child process, read from its `--trace-gc` lines on
// stdout: how many Mark-Compacts and Scavenges a phase brought, and the Mark-Compacts' pauses.
// Worker threads (the agent's codec pool) trace into the same stdout, each line naming its
// isolate: their collections stall no request on the main thread, so they are counted apart.

import type { Readable } from 'node:stream'

export interface GcCounts {
  /** The main thread's (the isolate that collected first: the process's, before any worker starts). */
  markCompacts: number
  scavenges: number
  /** Each Mark-Compact's final pause, ms. */
  markCompactMs: number[]
  /** Each Mark-Compact's longest incremental marking step before it (also on the main thread), ms. */
  markingStepMs: number[]
  /** Each Mark-Compact's reason as V8 gives it ("finalize incremental marking via task; …", "(reduce)" for the memory reducer's). */
  markCompactReasons: string[]
  /** Mark-Compacts of worker threads' isolates. */
  workerMarkCompacts: number
}

const empty = (): GcCounts => ({
  markCompacts: 0,
  scavenges: 0,
  markCompactMs: [],
  markingStepMs: [],
  markCompactReasons: [],
  workerMarkCompacts: 0,
})

/** Counts what `stdout` (a child run with --trace-gc) reports; `take()` returns the counts since the last take. */
export class GcTrace {
  #counts = empty()
  #partial = ''
  #mainIsolate: string | undefined
  readonly #other: (line: string) => void

  /** `other`: each line that is not a GC's (the child's own output). */
  constructor(stdout: Readable, other: (line: string) => void = () => {}) {
    this.#other = other
    stdout.setEncoding('utf8')
    stdout.on('data', (d: string) => {
      const lines = (this.#partial + d).split('\n')
      this.#partial = lines.pop()!
      for (const l of lines) this.#line(l)
    })
  }

  #line(l: string): void {
    // "[pid:0x…]  3997 ms: Mark-Compact 17.6 (33.0) -> 15.0 (33.5) MB, 2.70 / 0.01 ms  (+ 10.0 ms in 24 steps …"
    const gc = /^\[\d+:(0x[0-9a-f]+)\]\s+\d+ ms: (Mark-Compact|Scavenge|Minor Mark)/.exec(l)
    if (!gc) {
      this.#other(l)
      return
    }
    this.#mainIsolate ??= gc[1]
    const main = gc[1] === this.#mainIsolate
    if (gc[2] === 'Scavenge') {
      if (main) this.#counts.scavenges++
      return
    }
    if (gc[2] !== 'Mark-Compact') return
    if (!main) {
      this.#counts.workerMarkCompacts++
      return
    }
    const c = this.#counts
    c.markCompacts++
    c.markCompactMs.push(Number(/MB, ([\d.]+) \/ /.exec(l)?.[1] ?? 0))
    c.markingStepMs.push(Number(/biggest step ([\d.]+) ms/.exec(l)?.[1] ?? 0))
    const reduce = l.includes('Mark-Compact (reduce)') ? '(reduce) ' : ''
    c.markCompactReasons.push(reduce + (/current mu = [\d.]+\) (.*)$/.exec(l)?.[1]?.trim() ?? '?'))
  }

  take(): GcCounts {
    const c = this.#counts
    this.#counts = empty()
    return c
  }
}

/** "N Mark-Compacts (pause / longest marking step: a/b ms [reason], …), M Scavenges; K in worker threads". */
export function gcLine(c: GcCounts): string {
  const ms = c.markCompactMs.length
    ? ` (pause / longest marking step: ${c.markCompactMs.map((x, i) => `${x.toFixed(1)}/${c.markingStepMs[i]!.toFixed(1)} ms [${c.markCompactReasons[i]}]`).join(', ')})`
    : ''
  return `${c.markCompacts} Mark-Compacts${ms}, ${c.scavenges} Scavenges; worker threads' Mark-Compacts ${c.workerMarkCompacts}`
}
