// A small priority work queue with bounded concurrency: the disk tier runs its
// reads and writes through it so prefetches and reads never wait behind writes.

export type IoPriority = 'prefetch' | 'get' | 'put'

const ORDER: readonly IoPriority[] = ['prefetch', 'get', 'put']

interface Job {
  run: () => Promise<unknown>
  resolve: (v: unknown) => void
  reject: (e: unknown) => void
}

export class PriorityQueue {
  readonly #queues: Record<IoPriority, Job[]> = { prefetch: [], get: [], put: [] }
  readonly #concurrency: number
  #running = 0

  constructor(concurrency: number) {
    this.#concurrency = Math.max(1, concurrency)
  }

  get pending(): number {
    return this.#queues.prefetch.length + this.#queues.get.length + this.#queues.put.length
  }

  pendingOf(p: IoPriority): number {
    return this.#queues[p].length
  }

  /** Runs `fn` when a slot is free and no higher-priority job waits. */
  run<T>(priority: IoPriority, fn: () => Promise<T>): Promise<T> {
    return new Promise<T>((resolve, reject) => {
      this.#queues[priority].push({ run: fn, resolve: resolve as (v: unknown) => void, reject })
      this.#pump()
    })
  }

  #pump(): void {
    while (this.#running < this.#concurrency) {
      const job = this.#take()
      if (!job) return
      this.#running++
      job
        .run()
        .then(job.resolve, job.reject)
        .finally(() => {
          this.#running--
          this.#pump()
        })
    }
  }

  #take(): Job | undefined {
    for (const p of ORDER) {
      const j = this.#queues[p].shift()
      if (j) return j
    }
    return undefined
  }
}
