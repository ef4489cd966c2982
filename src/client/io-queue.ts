// A small priority work queue with bounded concurrency: the disk tier runs its
// reads and writes through it so demand reads never wait behind prefetches or writes.

import { KvgateError } from '../core/errors.ts'

/** 'get': a read an engine waits on; 'prefetch': a read ahead of need; 'put': a background write. */
export type IoPriority = 'prefetch' | 'get' | 'put'

/** Demand reads first: an engine blocks on them, nobody blocks on a prefetch. */
const ORDER: readonly IoPriority[] = ['get', 'prefetch', 'put']

interface Job {
  run: (handOn: () => void) => Promise<unknown>
  resolve: (v: unknown) => void
  reject: (e: unknown) => void
}

export class PriorityQueue {
  readonly #queues: Record<IoPriority, Job[]> = { prefetch: [], get: [], put: [] }
  readonly #running: Record<IoPriority, number> = { prefetch: 0, get: 0, put: 0 }
  /** Prefetches and writes running together at most (a slot stays for demand reads). */
  readonly #background: number
  readonly #concurrency: number
  #total = 0
  #closed = false

  /**
   * `concurrency` jobs at once. From three on, prefetches and writes together
   * take at most concurrency − 1, so a demand read arriving while they run finds
   * a slot at once; below, they may use every slot (with two, the second slot is
   * what overlaps one chunk's CRC with the next one's read) and demand reads
   * still go first in line.
   */
  constructor(concurrency: number) {
    this.#concurrency = Math.max(1, concurrency)
    this.#background = this.#concurrency >= 3 ? this.#concurrency - 1 : this.#concurrency
  }

  get pending(): number {
    return this.#queues.prefetch.length + this.#queues.get.length + this.#queues.put.length
  }

  pendingOf(p: IoPriority): number {
    return this.#queues[p].length
  }

  runningOf(p: IoPriority): number {
    return this.#running[p]
  }

  /**
   * Runs `fn` when a slot is free and no higher-priority job waits. Rejects ERR_CLOSED after close().
   * `fn` may call `handOn()` to give its slot to the next job before it settles (a read whose
   * every piece is issued: only waiting is left), bounding it by other means from then on.
   */
  run<T>(priority: IoPriority, fn: (handOn: () => void) => Promise<T>): Promise<T> {
    if (this.#closed) return Promise.reject(closed())
    return new Promise<T>((resolve, reject) => {
      this.#queues[priority].push({ run: fn, resolve: resolve as (v: unknown) => void, reject })
      this.#pump()
    })
  }

  /** Fails every queued job with ERR_CLOSED (running ones finish) and refuses new ones. */
  close(): void {
    this.#closed = true
    for (const p of ORDER) for (const j of this.#queues[p].splice(0)) j.reject(closed())
  }

  #pump(): void {
    while (this.#total < this.#concurrency) {
      const taken = this.#take()
      if (!taken) return
      const [p, job] = taken
      this.#total++
      this.#running[p]++
      let held = true
      const free = () => {
        if (!held) return
        held = false
        this.#total--
        this.#running[p]--
        // Not from inside fn's synchronous start (this loop is running): on the next microtask.
        queueMicrotask(() => this.#pump())
      }
      let settled: Promise<unknown>
      try {
        settled = job.run(free)
      } catch (e) {
        settled = Promise.reject(e)
      }
      settled.then(job.resolve, job.reject).finally(free)
    }
  }

  #take(): [IoPriority, Job] | undefined {
    const background = this.#running.prefetch + this.#running.put
    for (const p of ORDER) {
      if (p !== 'get' && background >= this.#background) continue
      const j = this.#queues[p].shift()
      if (j) return [p, j]
    }
    return undefined
  }
}

/**
 * At most `limit` things at once (file reads in flight), granted in the order asked for, those
 * asked for `first` (demand reads) before every other waiter. A grant still waited for can be
 * withdrawn (the read it was for is no longer wanted).
 */
export class InFlightLimit {
  readonly #limit: number
  #used = 0
  /** Waiters asked for `first`, then the others; each in the order asked. */
  readonly #waiting: [((granted: boolean) => void)[], ((granted: boolean) => void)[]] = [[], []]

  constructor(limit: number) {
    this.#limit = Math.max(1, limit)
  }

  get used(): number {
    return this.#used
  }

  /**
   * A grant: `ready` resolves true once it is held (then release() gives it back exactly once),
   * or false after withdraw() (nothing is held then). `first`: ahead of every waiter not asked
   * for first (a demand read does not wait for prefetches' ranges that asked before it).
   */
  take(first = false): { ready: Promise<boolean>; withdraw: () => void; release: () => void } {
    let state: 'waiting' | 'held' | 'done' = 'waiting'
    let wake: ((granted: boolean) => void) | undefined
    let ready: Promise<boolean>
    const line = this.#waiting[first ? 0 : 1]
    if (this.#used < this.#limit && this.#waiting[0].length + this.#waiting[1].length === 0) {
      this.#used++
      state = 'held'
      ready = Promise.resolve(true)
    } else {
      ready = new Promise<boolean>((resolve) => {
        wake = (granted) => {
          state = granted ? 'held' : 'done'
          resolve(granted)
        }
        line.push(wake)
      })
    }
    return {
      ready,
      withdraw: () => {
        if (state !== 'waiting' || !wake) return
        line.splice(line.indexOf(wake), 1)
        wake(false)
      },
      release: () => {
        if (state !== 'held') return
        state = 'done'
        const next = this.#waiting[0].shift() ?? this.#waiting[1].shift()
        if (next) next(true)
        else this.#used--
      },
    }
  }
}

function closed(): KvgateError {
  return new KvgateError('ERR_CLOSED', 'closed')
}
