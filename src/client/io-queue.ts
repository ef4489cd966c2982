// A small priority work queue with bounded concurrency: the disk tier runs its
// reads and writes through it so demand reads never wait behind prefetches or writes.

import { KvgateError } from '../core/errors.ts'

/** 'get': a read an engine waits on; 'prefetch': a read ahead of need; 'put': a background write. */
export type IoPriority = 'prefetch' | 'get' | 'put'

/** Demand reads first: an engine blocks on them, nobody blocks on a prefetch. */
const ORDER: readonly IoPriority[] = ['get', 'prefetch', 'put']

interface Job {
  run: () => Promise<unknown>
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

  /** Runs `fn` when a slot is free and no higher-priority job waits. Rejects ERR_CLOSED after close(). */
  run<T>(priority: IoPriority, fn: () => Promise<T>): Promise<T> {
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
      job
        .run()
        .then(job.resolve, job.reject)
        .finally(() => {
          this.#total--
          this.#running[p]--
          this.#pump()
        })
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

function closed(): KvgateError {
  return new KvgateError('ERR_CLOSED', 'closed')
}
