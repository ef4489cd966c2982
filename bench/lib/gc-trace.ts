// The garbage collections of a benchmark's child process, read from its `--trace-gc` lines on
// stdout: how many Mark-Compacts and Scavenges a phase brought, and the Mark-Compacts' pauses.

import type { Readable } from 'node:stream'

export interface GcCounts {
  markCompacts: number
  scavenges: number
  /** Each Mark-Compact's final pause, ms. */
  markCompactMs: number[]
  /** Each Mark-Compact's longest incremental marking step before it (also on the main thread), ms. */
  markingStepMs: number[]
  /** Each Mark-Compact's reason as V8 gives it ("finalize incremental marking via task; …", "idle task", …). */
  markCompactReasons: string[]
}

/** Counts what `stdout` (a child run with --trace-gc) reports; `take()` returns the counts since the last take. */
export class GcTrace {
  #counts: GcCounts = {
    markCompacts: 0,
    scavenges: 0,
    markCompactMs: [],
    markingStepMs: [],
    markCompactReasons: [],
  }
  #partial = ''
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
    const mc = / Mark-Compact .*?MB, ([\d.]+) \/ /.exec(l)
    if (mc) {
      this.#counts.markCompacts++
      this.#counts.markCompactMs.push(Number(mc[1]))
      this.#counts.markingStepMs.push(Number(/biggest step ([\d.]+) ms/.exec(l)?.[1] ?? 0))
      this.#counts.markCompactReasons.push(/current mu = [\d.]+\) (.*)$/.exec(l)?.[1]?.trim() ?? '?')
    } else if (/ms: Scavenge /.test(l)) this.#counts.scavenges++
    else if (!/ms: (Mark-Compact|Scavenge|Minor Mark)/.test(l)) this.#other(l)
  }

  take(): GcCounts {
    const c = this.#counts
    this.#counts = {
      markCompacts: 0,
      scavenges: 0,
      markCompactMs: [],
      markingStepMs: [],
      markCompactReasons: [],
    }
    return c
  }
}

/** "N Mark-Compacts (pause / longest marking step: a/b ms [reason], …), M Scavenges". */
export function gcLine(c: GcCounts): string {
  const ms = c.markCompactMs.length
    ? ` (pause / longest marking step: ${c.markCompactMs.map((x, i) => `${x.toFixed(1)}/${c.markingStepMs[i]!.toFixed(1)} ms [${c.markCompactReasons[i]}]`).join(', ')})`
    : ''
  return `${c.markCompacts} Mark-Compacts${ms}, ${c.scavenges} Scavenges`
}
