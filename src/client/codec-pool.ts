// Runs the wasm codec (lossless / kvgate) on worker threads so encoding for the
// write-behind and decoding L4 hits never stall the inference thread's event loop.

import { availableParallelism } from 'node:os'
import { Worker } from 'node:worker_threads'
import { buildCalibration, type Calibration } from '../codec/calibration.ts'
import { MAX_WASM_SLAB_BYTES } from '../codec/wasm-instance.ts'
import { crc32 } from '../core/checksum.ts'
import {
  CodecError,
  CorruptStreamError,
  FormatError,
  type FormatErrorCode,
  InvalidArgumentError,
  KvgateError,
} from '../core/errors.ts'
import {
  type ChunkHeader,
  checkSectionCrcs,
  DEFAULT_MAX_CHUNK_BYTES,
  decodeHeader,
  verifyChunk,
} from '../core/format.ts'
import { type KvGeometry, layerSlabBytes } from '../core/layout.ts'
import { type CalibrationRef, decodeIntoWith, decodeSectionWith, encodeWith } from './calibrated-codec.ts'
import type { ChunkCodecName, ChunkIdentity } from './chunk-codec.ts'
import { CodecStaging } from './codec-staging.ts'
import type { CodecReply, CodecRequest } from './codec-worker.ts'
import { COPY_VIEWS_MIN_BYTES, copyViews, copyViewsReady } from './native.ts'

/** Objects from this size on are verified on two threads. */
const PARALLEL_VERIFY_BYTES = 4 * 1024 * 1024
/** Worker deaths within a minute after which a slot is not restarted (a crash loop, not bad luck). */
const MAX_RESTARTS_PER_MINUTE = 8
/**
 * Default job deadline: a floor plus the bytes a job moves at a pessimistic rate. On this
 * project's 2-core machine under load (two pools of two busy workers beside other work, load
 * average 5; docs/codec.md) the slowest codec job took 59 ms/MiB (a kvgate encode of random
 * bytes) and the slowest small one 23 ms; 250 ms/MiB is 4× that rate and the floor 400× that
 * job, so a busy machine does not fail a healthy job, and a hung one frees its caller in
 * seconds (a 32 MiB encode: 18 s, 9× the slowest seen).
 */
const DEFAULT_JOB_TIMEOUT = { floorMs: 10_000, msPerMiB: 250 }
/**
 * Building a calibration costs ~7× a codec job per byte (415 ms/MiB worst measured, 4 × 32 MiB
 * samples in 53 s), so its samples count 8× toward its deadline.
 */
const CALIBRATE_COST = 8
/** setTimeout's largest delay; a longer one fires at once. */
const MAX_TIMER_MS = 2 ** 31 - 1

/**
 * A worker died (exited, crashed, ran out of memory) while running this job.
 * Only that job fails; the worker is replaced. Not retried on the calling
 * thread: the input may be what killed it.
 */
export class CodecWorkerLostError extends CodecError {
  constructor(message: string) {
    super(message)
    this.name = 'CodecWorkerLostError'
  }
}

/**
 * A worker did not answer its job within the job's deadline (CodecPoolOptions.jobTimeout):
 * it is taken as hung (a codec stuck in a loop, a stalled thread), terminated and replaced.
 * A CodecWorkerLostError, so callers treat it as they treat a dead worker (a counted miss,
 * nothing deleted or reported corrupt): nothing is known about the bytes.
 */
export class CodecJobTimeoutError extends CodecWorkerLostError {
  constructor(message: string) {
    super(message)
    this.name = 'CodecJobTimeoutError'
  }
}

/**
 * A job could not be handed to a worker: its message could not be built (its staging buffer
 * could not be allocated) or posted (postMessage threw, e.g. a DataCloneError). Nothing was
 * sent or transferred, and nothing is known about the job's bytes. Only that job fails; the
 * worker takes the next one.
 */
export class CodecDispatchError extends CodecError {
  constructor(message: string, options: { cause?: unknown } = {}) {
    super(message, options)
    this.name = 'CodecDispatchError'
  }
}

/** The pool's queue is at its bound: the job was refused, nothing was done. */
export class CodecBusyError extends CodecError {
  constructor(message: string) {
    super(message)
    this.name = 'CodecBusyError'
  }
}

const CODEC_CODES = ['ERR_CODEC_MISMATCH', 'ERR_CALIBRATION_MISSING', 'ERR_CODEC_DTYPE'] as const

/** No worker can take jobs (all failed to start or kept dying): the job runs on the calling thread. */
class NoWorkers extends Error {}

export interface CodecPoolOptions {
  /** Jobs waiting for a worker (not counting one running per worker). @default 1024 */
  maxQueuedJobs?: number
  /** Worker entry module (tests inject one that misbehaves). @default ./codec-worker-entry.mjs */
  workerEntry?: URL
  /**
   * A worker idle this long lets go of its staging buffers (a chunk object and two
   * chunk tensors); the next job allocates them again. @default 10000
   */
  stagingIdleMs?: number
  /**
   * How long a worker may take to answer a job before it counts as hung: `floorMs` plus
   * `msPerMiB` for every MiB the job moves (input and output; a calibration's samples count
   * 8×). Past it the job fails with CodecJobTimeoutError and the worker is terminated and
   * replaced; jobs queued behind it run on the replacement. The clock starts when a worker
   * takes the job, not while it waits in the queue. @default { floorMs: 10000, msPerMiB: 250 }
   */
  jobTimeout?: { floorMs?: number; msPerMiB?: number }
  /**
   * A worker that has not finished loading after this long is given up (terminated, not
   * restarted), like one that failed to load: with none left, jobs run inline. A worker
   * started in ≤ 3 s with this project's tsx loader on a 2-core machine at load 8. @default 30000
   */
  workerStartTimeoutMs?: number
  /**
   * The largest chunk object an encode may return: what every reader takes (the decoder's and
   * the gateway's default limit). A coded object over it (a lossless chunk near the limit:
   * incompressible planes are stored as is, plus a flag byte each) is replaced by the raw
   * object, which KVCache.open checked fits; one that does not fit either is refused
   * (ERR_FORMAT_TOO_LARGE). Both counted (counts.rawFallbacks, counts.oversizedRefused).
   * @default 512 MiB (DEFAULT_MAX_CHUNK_BYTES)
   */
  maxObjectBytes?: number
}

/**
 * Where a layer group's slabs go when they are ready (a chunk's L1 reservation, back to back):
 * `take()` is asked at that moment and answers the place, or undefined when it is no longer
 * wanted (the slabs then go to new buffers); after a place was taken, `done()` is called once
 * the last byte landed. Between the two the owner must not give the place away.
 */
export interface LayerTarget {
  take(): Uint8Array | undefined
  done(): void
}

/** Distributive Omit, so each request variant keeps its own fields. */
type RequestBody = CodecRequest extends infer R ? (R extends CodecRequest ? Omit<R, 'id'> : never) : never

/**
 * A job: its message is built when a worker takes it (inputs are copied into
 * that worker's staging then, not while queued); `done` takes the worker's
 * answer on the calling thread, synchronously, while the worker's next job fills the other output buffer.
 */
interface Job {
  make: (staging: CodecStaging) => { msg: RequestBody; transfer: ArrayBuffer[] }
  done: (bytes: ArrayBuffer | null) => void
  reject: (e: Error) => void
}

interface Slot {
  worker: Worker
  /** The one job this worker runs, if any: a dying worker takes only its own job with it. */
  job: (Job & { id: number }) | undefined
  /** Fires when that job is past its deadline; cleared when it is answered or the worker goes. */
  deadline: ReturnType<typeof setTimeout> | undefined
  /** Fires if the worker has not loaded in time; cleared when it is ready or goes. */
  startDeadline: ReturnType<typeof setTimeout> | undefined
  /** Set once the worker is gone (error or exit), so the death is handled once. */
  dead: boolean
  /** The worker loaded its module; one that dies before this never started (no restart). */
  ready: boolean
  /** Shared buffers this worker's jobs go in and out through (dropped with the worker, or when idle). */
  staging: CodecStaging
  /** When its last job finished (performance.now()). */
  idleSince: number
}

/**
 * A few workers (default: cores − 1, at most 16; 0 = run inline), one job at a
 * time each, fed from a bounded queue where reads (decode, verify) go before
 * write-behind encodes. 'raw' never leaves the calling thread: it is a copy. If
 * workers cannot start (no tsx loader, sandbox) or keep dying, work runs inline
 * and `inline` says why.
 */
export class CodecPool {
  readonly #slots: Slot[] = []
  readonly #reads: Job[] = []
  readonly #writes: Job[] = []
  readonly #deaths: number[] = []
  #next = 1
  #closed = false
  /** Why the pool runs inline, if it does. */
  inline: string | undefined
  /** Jobs run on workers / inline; workers replaced after dying; jobs refused at the queue bound. */
  readonly counts = {
    workerJobs: 0,
    inlineJobs: 0,
    workersReplaced: 0,
    jobsLost: 0,
    jobsRefused: 0,
    /** Jobs whose worker did not answer in time (also counted lost). */
    jobsTimedOut: 0,
    /** Jobs whose message could not be built or posted (CodecDispatchError). */
    jobsUnsent: 0,
    /** Encodes whose coded object was over maxObjectBytes: the raw object was returned instead. */
    rawFallbacks: 0,
    /** Encodes refused: over maxObjectBytes even raw (nothing a reader would take to store). */
    oversizedRefused: 0,
  }

  readonly #size: number
  readonly #maxQueued: number
  readonly #entry: URL
  readonly #stagingIdleMs: number
  readonly #jobTimeout: { floorMs: number; msPerMiB: number }
  readonly #startTimeoutMs: number
  readonly #maxObjectBytes: number
  #releaseTimer: ReturnType<typeof setTimeout> | undefined
  #started = false
  /** Split large verifications across two threads (see verify()). */
  parallelVerify: boolean

  constructor(
    // An L4 hit is decode-bound (one core decodes ~0.7–0.9 GB/s of bf16), so the pool grows with
    // the node: every core but the inference thread's, capped where 16 busy workers' staging
    // (~74 MiB each for a Llama-3.1-8B chunk, released after stagingIdleMs idle) stays ~1.2 GiB.
    size = Math.min(16, Math.max(1, availableParallelism() - 1)),
    parallelVerify = availableParallelism() >= 4,
    opts: CodecPoolOptions = {},
  ) {
    this.#size = size
    this.parallelVerify = parallelVerify
    this.#maxQueued = opts.maxQueuedJobs ?? 1024
    // A JS entry that registers tsx itself: loader flags of this process do not
    // reliably reach worker threads (npx tsx, vitest).
    this.#entry = opts.workerEntry ?? new URL('./codec-worker-entry.mjs', import.meta.url)
    this.#stagingIdleMs = opts.stagingIdleMs ?? 10_000
    this.#jobTimeout = { ...DEFAULT_JOB_TIMEOUT, ...opts.jobTimeout }
    this.#startTimeoutMs = opts.workerStartTimeoutMs ?? 30_000
    this.#maxObjectBytes = opts.maxObjectBytes ?? DEFAULT_MAX_CHUNK_BYTES
    if (!Number.isSafeInteger(this.#maxObjectBytes) || this.#maxObjectBytes < 1)
      throw new TypeError(`maxObjectBytes must be a positive integer, got ${String(opts.maxObjectBytes)}`)
    const durations: [string, unknown][] = [
      ...Object.entries(this.#jobTimeout).map(([k, v]): [string, unknown] => [`jobTimeout.${k}`, v]),
      ['workerStartTimeoutMs', this.#startTimeoutMs],
    ]
    for (const [k, v] of durations) {
      if (typeof v !== 'number' || !(v >= 0) || !Number.isFinite(v))
        throw new TypeError(`${k} must be a finite number >= 0, got ${String(v)}`)
    }
    if (size <= 0) this.inline = 'codec workers disabled'
  }

  /**
   * Starts the workers now instead of on the first job. A worker takes tens of milliseconds
   * to load (hundreds under a TypeScript loader) and the first job waits for it: a cache that
   * will decode (an L4 tier, coded L2 files) warms the pool when it opens, so the first L4
   * hit of a freshly started node does not pay for it. Idempotent; a closed pool stays closed.
   */
  warm(): void {
    if (!this.#closed) this.#start()
  }

  /** Workers loaded and able to take a job (0 until the pool starts). */
  get readyWorkers(): number {
    return this.#slots.filter((s) => s.ready && !s.dead).length
  }

  /** Workers start on first use (or warm()): caches that only move raw chunks never pay for them. */
  #start(): void {
    if (this.#started) return
    this.#started = true
    if (this.#size <= 0) return
    try {
      for (let i = 0; i < this.#size; i++) this.#slots.push(this.#spawn())
    } catch (e) {
      this.inline = `codec workers unavailable: ${(e as Error).message}`
      for (const s of this.#slots) void s.worker.terminate()
      this.#slots.length = 0
    }
  }

  /** Bytes the workers' staging buffers hold (the largest jobs seen; tests watch it stay bounded). */
  get stagingBytes(): number {
    return this.#slots.reduce((a, s) => a + s.staging.bytes, 0)
  }

  #spawn(): Slot {
    const worker = new Worker(this.#entry, { execArgv: [] })
    worker.unref()
    const slot: Slot = {
      worker,
      job: undefined,
      deadline: undefined,
      startDeadline: undefined,
      dead: false,
      ready: false,
      staging: new CodecStaging(),
      idleSince: 0,
    }
    worker.on('message', (m: CodecReply) => this.#reply(slot, m))
    worker.on('error', (e) => this.#lost(slot, `codec worker failed: ${e.message}`))
    worker.on('exit', (code) => this.#lost(slot, `codec worker exited (code ${code})`))
    // Unref'd: a start that stalls fails the jobs waiting for it over to inline, but holds no
    // process open by itself (the worker does not either).
    const ms = Math.min(MAX_TIMER_MS, this.#startTimeoutMs)
    slot.startDeadline = setTimeout(() => {
      slot.startDeadline = undefined
      setImmediate(() => this.#stalled(slot, ms))
    }, ms)
    slot.startDeadline.unref()
    return slot
  }

  /** A worker did not load in time (a loader stuck): given up like one that failed to load. */
  #stalled(slot: Slot, ms: number): void {
    if (slot.dead || slot.ready) return
    this.#lost(slot, `codec worker did not start within ${ms} ms`)
    slot.worker.terminate().catch(() => {})
  }

  #reply(slot: Slot, m: CodecReply): void {
    if ('ready' in m) {
      slot.ready = true
      clearTimeout(slot.startDeadline)
      slot.startDeadline = undefined
      this.#dispatch()
      return
    }
    const job = slot.job
    if (!job || job.id !== m.id) return
    slot.job = undefined
    clearTimeout(slot.deadline)
    slot.deadline = undefined
    // The worker starts its next job first: this thread's copy-out of the result
    // (from the other output buffer, see CodecStaging) overlaps it.
    this.#dispatch()
    if ('error' in m) job.reject(workerError(m))
    else job.done(m.bytes)
    if (!slot.job) {
      slot.idleSince = performance.now()
      this.#armRelease()
    }
  }

  #armRelease(): void {
    if (this.#releaseTimer || this.#closed) return
    this.#releaseTimer = setTimeout(() => this.#releaseIdle(), this.#stagingIdleMs)
    this.#releaseTimer.unref()
  }

  /** Idle workers drop their staging (a burst of loads keeps it; a quiet pool holds none). */
  #releaseIdle(): void {
    this.#releaseTimer = undefined
    const now = performance.now()
    let holding = false
    for (const slot of this.#slots) {
      if (slot.job || slot.staging.bytes === 0) continue
      if (now - slot.idleSince >= this.#stagingIdleMs) slot.staging = new CodecStaging()
      else holding = true
    }
    if (holding) this.#armRelease()
  }

  /**
   * A job's deadline passed: its worker is taken as hung, the job fails with
   * CodecJobTimeoutError and the worker is terminated and replaced like a dead one.
   */
  #hung(slot: Slot, id: number, ms: number): void {
    if (slot.dead || slot.job?.id !== id) return
    this.counts.jobsTimedOut++
    this.#lost(slot, `codec worker did not answer within ${ms} ms`, CodecJobTimeoutError)
    // Interrupts a spinning thread too (JavaScript or wasm); its exit event finds the slot dead.
    slot.worker.terminate().catch(() => {})
  }

  /**
   * A worker is gone: its own job (if any) fails with CodecWorkerLostError (or `typed`) and a
   * new worker takes the slot, unless workers keep dying (then the slot is
   * dropped; with none left, queued jobs run inline).
   */
  #lost(
    slot: Slot,
    why: string,
    typed: new (why: string) => CodecWorkerLostError = CodecWorkerLostError,
  ): void {
    if (slot.dead) return
    slot.dead = true
    clearTimeout(slot.deadline)
    clearTimeout(slot.startDeadline)
    slot.deadline = slot.startDeadline = undefined
    const i = this.#slots.indexOf(slot)
    if (i >= 0) this.#slots.splice(i, 1)
    const job = slot.job
    slot.job = undefined
    if (job) {
      this.counts.jobsLost++
      job.reject(new typed(why))
    }
    if (this.#closed) return
    // A hung worker is always replaced and not counted toward the crash-loop cap: its deadline
    // (at least floorMs) already spaces such restarts, and the inline fallback the cap leads to
    // would run the next such job on the calling thread, where nothing could stop it.
    const hung = typed === CodecJobTimeoutError
    const now = performance.now()
    if (!hung) this.#deaths.push(now)
    while (this.#deaths.length > 0 && now - this.#deaths[0]! > 60_000) this.#deaths.shift()
    // A worker that never loaded (no loader, sandbox) would fail again: not restarted.
    if (slot.ready && (hung || this.#deaths.length <= MAX_RESTARTS_PER_MINUTE)) {
      try {
        this.#slots.splice(Math.max(0, i), 0, this.#spawn())
        this.counts.workersReplaced++
      } catch {
        // Cannot start another: carry on with the others.
      }
    }
    if (this.#slots.length === 0) {
      this.inline = slot.ready ? `codec workers keep failing: ${why}` : `codec workers unavailable: ${why}`
      for (const q of [this.#reads, this.#writes]) for (const j of q.splice(0)) j.reject(new NoWorkers())
    }
    this.#dispatch()
  }

  /** Hands queued jobs to idle workers, reads first. */
  #dispatch(): void {
    for (const slot of this.#slots) {
      // A worker whose next output buffer is still being copied out waits for that copy.
      if (slot.job || slot.dead || !slot.ready || slot.staging.nextOutputHeld) continue
      // A job that cannot be handed over fails alone and this slot takes the next one (moving
      // on left it idle with jobs queued until some other event).
      while (!slot.job) {
        const job = this.#reads.shift() ?? this.#writes.shift()
        if (!job) return
        this.#send(slot, job)
      }
    }
  }

  /**
   * Gives one job to an idle worker, or fails it with CodecDispatchError: its message cannot
   * be built (its staging not allocated) or cannot be sent. A postMessage that throws (a
   * DataCloneError: a value that cannot be cloned, an ArrayBuffer twice in the transfer list)
   * sends and transfers nothing, so the worker is still idle and the caller's buffers are still
   * its own. It runs in a worker's message handler too, where a throw would be an uncaught exception.
   */
  #send(slot: Slot, job: Job): void {
    const unsent = (what: string, e: unknown) => {
      this.counts.jobsUnsent++
      job.reject(
        new CodecDispatchError(`codec job could not be ${what}: ${(e as Error)?.message}`, { cause: e }),
      )
    }
    let made: { msg: RequestBody; transfer: ArrayBuffer[] }
    // An unsent job gives its output buffer back: otherwise the next job would take the one the
    // job that just answered is still being copied out of (#reply sends before it copies).
    const staging = slot.staging
    const turn = staging.turn
    try {
      made = job.make(staging)
    } catch (e) {
      staging.rewind(turn)
      unsent('handed to a worker', e)
      return
    }
    const id = this.#next++
    // Sized before posting: a calibration's samples are transferred (detached here) by it.
    const bytes = jobBytes(made.msg)
    try {
      slot.worker.postMessage({ ...made.msg, id } as CodecRequest, made.transfer)
    } catch (e) {
      staging.rewind(turn)
      unsent('sent to a worker', e)
      return
    }
    slot.job = { ...job, id }
    this.counts.workerJobs++
    this.#armDeadline(slot, id, bytes)
  }

  /**
   * Starts the clock on the job a worker just took. The timer keeps the process alive while
   * the job runs (a caller is waiting on it; the worker itself is unref'd so an idle pool holds
   * nothing). When it fires, the verdict waits one turn of the event loop (setImmediate runs
   * after the poll phase): an answer that arrived while this thread was blocked past the
   * deadline is taken first, so a stalled calling thread never fails a job its worker finished.
   */
  #armDeadline(slot: Slot, id: number, bytes: number): void {
    const { floorMs, msPerMiB } = this.#jobTimeout
    const ms = Math.min(MAX_TIMER_MS, Math.ceil(floorMs + (bytes / 2 ** 20) * msPerMiB))
    slot.deadline = setTimeout(() => {
      slot.deadline = undefined
      setImmediate(() => this.#hung(slot, id, ms))
    }, ms)
  }

  /**
   * Queues a job for a worker. Undefined when there are no workers (the caller
   * runs it inline); rejects with CodecBusyError at the queue bound, with
   * CodecWorkerLostError if its worker dies, with NoWorkers if every worker is gone first.
   */
  #post<T>(
    kind: 'read' | 'write',
    make: Job['make'],
    finish: (bytes: ArrayBuffer | null) => T,
  ): Promise<T> | undefined {
    this.#start()
    if (this.#closed || this.#slots.length === 0) return undefined
    if (this.#reads.length + this.#writes.length >= this.#maxQueued) {
      this.counts.jobsRefused++
      return Promise.reject(
        new CodecBusyError(
          `codec pool queue is full (${this.#maxQueued} jobs waiting for ${this.#slots.length} workers)`,
        ),
      )
    }
    return new Promise<T>((resolve, reject) => {
      const done = (bytes: ArrayBuffer | null) => {
        try {
          resolve(finish(bytes))
        } catch (e) {
          reject(e as Error)
        }
      }
      ;(kind === 'read' ? this.#reads : this.#writes).push({ make, done, reject })
      this.#dispatch()
    })
  }

  /**
   * Encodes one chunk tensor (copied into the worker's staging when it takes the job: L1 slots
   * are not transferable) into an object no larger than maxObjectBytes: a coded object over it
   * is replaced by the raw one, and one over it even raw is refused (FormatError
   * ERR_FORMAT_TOO_LARGE). Never an object a reader would refuse, then delete as corrupt.
   */
  async encode(
    codec: ChunkCodecName,
    tensor: Uint8Array,
    meta: ChunkIdentity,
    quality?: number,
    calibration?: Calibration,
  ): Promise<Uint8Array> {
    const coded = await this.#encodeAs(codec, tensor, meta, quality, calibration)
    if (coded.byteLength <= this.#maxObjectBytes) return coded
    const raw = codec === 'raw' ? coded : encodeWith(tensor, meta, 'raw', undefined, undefined)
    if (raw.byteLength <= this.#maxObjectBytes) {
      this.counts.rawFallbacks++
      return raw
    }
    this.counts.oversizedRefused++
    throw new FormatError(
      'ERR_FORMAT_TOO_LARGE',
      `chunk object of ${raw.byteLength} bytes (${codec}: ${coded.byteLength}) is over the ${this.#maxObjectBytes} bytes readers take`,
    )
  }

  async #encodeAs(
    codec: ChunkCodecName,
    tensor: Uint8Array,
    meta: ChunkIdentity,
    quality: number | undefined,
    calibration: Calibration | undefined,
  ): Promise<Uint8Array> {
    if (codec !== 'raw') {
      const p = this.#post(
        'write',
        (st) => ({
          msg: {
            op: 'encode',
            mode: codec,
            quality,
            tensor: st.input(tensor),
            meta,
            calibration: refOf(calibration),
          },
          transfer: [],
        }),
        transferred,
      )
      const out = p && (await p.catch(noWorkersToUndefined))
      if (out) return out
    }
    this.counts.inlineJobs++
    return encodeWith(tensor, meta, codec, quality, calibration)
  }

  /** Builds a calibration object from chunk tensors on a worker (samples are transferred: the caller's copies). */
  async buildCalibration(samples: Uint8Array[], geometry: KvGeometry): Promise<Uint8Array> {
    const p = this.#post(
      'write',
      () => {
        const bufs = samples.map((s) =>
          s.byteOffset === 0 && s.byteLength === s.buffer.byteLength
            ? (s.buffer as ArrayBuffer)
            : (s.slice().buffer as ArrayBuffer),
        )
        return { msg: { op: 'calibrate', samples: bufs, geometry }, transfer: bufs }
      },
      transferred,
    )
    const out = p && (await p.catch(noWorkersToUndefined))
    if (out) return out
    this.counts.inlineJobs++
    return buildCalibration(samples, { geometry, dtype: geometry.dtype })
  }

  /**
   * Verifies (every section CRC) and decodes a whole object into `dst` (one chunk
   * tensor); nothing is written to `dst` unless every section verified. `object`
   * may lie in the same memory as `dst` (an L4 body read into the L1 slot it decodes into).
   */
  async decodeInto(
    object: Uint8Array,
    codec: string,
    dst: Uint8Array,
    calibration?: Calibration,
  ): Promise<void> {
    if (codec !== 'raw') {
      let out: Uint8Array | undefined
      let staging: CodecStaging | undefined
      const p = this.#post(
        'read',
        (st) => {
          staging = st
          out = st.output(dst.byteLength)
          return {
            msg: { op: 'decode', object: st.input(object), out, calibration: refOf(calibration) },
            transfer: [],
          }
        },
        () => this.#copyOut(staging!, dst, out!),
      )
      if (p && (await p.then(() => true, noWorkersToUndefined))) return
    }
    this.counts.inlineJobs++
    decodeIntoWith(overlaps(object, dst) ? object.slice() : object, dst, calibration)
  }

  /**
   * A decoded tensor from a worker's staging into `dst`: on the addon's pool where it loads (32
   * MiB a chunk: on the calling thread this copy, with the one into the caller's buffer, was
   * most of that thread's time in a cold node's L4 load and capped the node's rate whatever its
   * cores), else here. The staging buffer is held until the copy ends (CodecStaging.hold).
   */
  #copyOut(staging: CodecStaging, dst: Uint8Array, out: Uint8Array): void | Promise<void> {
    if (out.byteLength < COPY_VIEWS_MIN_BYTES || !copyViewsReady()) {
      dst.set(out)
      return
    }
    const copy = copyViews(dst, out)
    staging.hold(out, copy)
    // Registered after hold's own reaction: the buffer is free again when this dispatches.
    const next = () => this.#dispatch()
    copy.then(next, next)
    return copy
  }

  /**
   * A `layers` job's slabs out of a worker's staging: one new buffer for the group, filled on the
   * addon's pool where it loads (see #copyOut), each layer a view of it.
   */
  #layersOut(
    staging: CodecStaging,
    out: Uint8Array,
    count: number,
    slab: number,
    into: Uint8Array | undefined,
  ): Uint8Array[] | Promise<Uint8Array[]> {
    const group = into ?? new Uint8Array(count * slab)
    const views = () => Array.from({ length: count }, (_, i) => group.subarray(i * slab, (i + 1) * slab))
    const copied = this.#copyOut(staging, group, out.subarray(0, count * slab))
    return copied ? copied.then(views) : views()
  }

  /** Decodes one CRC-checked layer section into a new layer slab. */
  async decodeSection(
    header: ChunkHeader,
    layer: number,
    section: Uint8Array,
    calibration?: Calibration,
  ): Promise<Uint8Array> {
    return (await this.decodeLayers(header, layer, [section], calibration))[0]!
  }

  /**
   * Decodes sections of layers first, first + 1, … (a `?layers=a-b` answer) into new layer
   * slabs: one worker job for the whole range. With `crcs` (the header's, one per section) the
   * sections are checked here, on the worker where there is one (ERR_FORMAT_CHECKSUM before
   * any is decoded), instead of by the caller on its own thread; without, they were checked.
   * With `into`, the slabs are written where it says when the bytes are ready (see LayerTarget)
   * and returned as views of that place.
   */
  async decodeLayers(
    header: ChunkHeader,
    first: number,
    sections: Uint8Array[],
    calibration?: Calibration,
    crcs?: number[],
    into?: LayerTarget,
  ): Promise<Uint8Array[]> {
    const slab = layerSlabBytes(header.geometry, header.tokens)
    /** Where the layers go: the target's place while it takes them (done() after), else new. */
    const place = (): Uint8Array | undefined => {
      const region = into?.take()
      if (region && region.byteLength < sections.length * slab) {
        into!.done()
        throw new InvalidArgumentError(
          `a layer target of ${region.byteLength} bytes for ${sections.length} layers of ${slab}`,
        )
      }
      return region
    }
    // A header's claim sizes the staging: what the codec would refuse is refused inline, before allocating.
    if (header.codec !== 'raw' && sections.length * slab <= MAX_WASM_SLAB_BYTES) {
      let out: Uint8Array | undefined
      let staging: CodecStaging | undefined
      const lengths = sections.map((s) => s.byteLength)
      const p = this.#post(
        'read',
        (st) => {
          staging = st
          out = st.output(sections.length * slab)
          const input = st.input(sections)
          const msg = {
            op: 'layers',
            header,
            first,
            sections: input,
            lengths,
            crcs,
            out,
            calibration: refOf(calibration),
          } as const
          return { msg, transfer: [] }
        },
        () => {
          const region = place()
          const slabs = this.#layersOut(staging!, out!, sections.length, slab, region)
          if (!region) return slabs
          if (!(slabs instanceof Promise)) {
            into!.done()
            return slabs
          }
          return slabs.finally(() => into!.done())
        },
      )
      const got = p && (await p.catch(noWorkersToUndefined))
      if (got) return got
    }
    this.counts.inlineJobs++
    if (crcs) {
      for (const [i, s] of sections.entries()) checkSectionCrcs(s, [s.byteLength], [crcs[i]!], first + i)
    }
    const region = place()
    try {
      return sections.map((s, i) =>
        decodeSectionWith(header, first + i, s, calibration, region?.subarray(i * slab, (i + 1) * slab)),
      )
    } finally {
      if (region) into!.done()
    }
  }

  /**
   * verifyChunk with the section CRCs split between this thread and a worker
   * (a copy of the second half goes over): CRC-32 runs at a few GB/s per core,
   * below a fast disk, so two cores keep L2/L4 reads I/O-bound. Small objects,
   * or no workers, verify inline. Throws FormatError like verifyChunk.
   */
  async verify(bytes: Uint8Array): Promise<ChunkHeader> {
    const h = decodeHeader(bytes)
    const secs = h.sections
    if (
      bytes.length !== h.totalBytes ||
      secs.length < 2 ||
      bytes.length < PARALLEL_VERIFY_BYTES ||
      this.#size <= 0
    ) {
      return verifyChunk(bytes)
    }
    const split = Math.ceil(secs.length / 2)
    const lo = secs[split]!.offset
    const last = secs[secs.length - 1]!
    const hi = last.offset + last.length
    if (hi > bytes.length || lo > hi) return verifyChunk(bytes)
    const ranges: number[] = []
    for (const s of secs.slice(split)) {
      if (s.offset < lo || s.offset + s.length > hi) return verifyChunk(bytes)
      ranges.push(s.offset - lo, s.length)
    }
    const remote = this.#post(
      'read',
      (st) => ({ msg: { op: 'crc', data: st.input(bytes.subarray(lo, hi)), ranges }, transfer: [] }),
      transferred,
    )
    // Settled below in every path; this keeps an early throw from leaving it unhandled.
    remote?.catch(() => {})
    for (let i = 0; i < split; i++) {
      const s = secs[i]!
      if (
        s.offset + s.length > bytes.length ||
        crc32(bytes.subarray(s.offset, s.offset + s.length)) !== s.crc32
      ) {
        throw new FormatError('ERR_FORMAT_CHECKSUM', `section ${i} checksum mismatch`)
      }
    }
    // A CRC is cheap to redo here: whatever happened to the worker half, check it inline.
    const packed = remote && (await remote.catch(() => undefined))
    if (!packed) return verifyChunk(bytes)
    const crcs = new Uint32Array(packed.buffer, packed.byteOffset, packed.byteLength / 4)
    for (let i = split; i < secs.length; i++) {
      if (crcs[i - split] !== secs[i]!.crc32)
        throw new FormatError('ERR_FORMAT_CHECKSUM', `section ${i} checksum mismatch`)
    }
    return h
  }

  async close(): Promise<void> {
    this.#closed = true
    clearTimeout(this.#releaseTimer)
    const closed = new KvgateError('ERR_CLOSED', 'codec pool closed')
    for (const q of [this.#reads, this.#writes]) for (const j of q.splice(0)) j.reject(closed)
    for (const s of this.#slots) {
      s.dead = true
      clearTimeout(s.deadline)
      clearTimeout(s.startDeadline)
      s.deadline = s.startDeadline = undefined
      const job = s.job
      s.job = undefined
      job?.reject(closed)
    }
    await Promise.allSettled(this.#slots.map((s) => s.worker.terminate()))
    this.#slots.length = 0
  }
}

/**
 * A worker's failed job as the error it was there: a verdict on the bytes (FormatError,
 * CorruptStreamError) stays one; anything else (a wasm trap, out of memory) is a plain
 * CodecError, which readers count as a failed read, never as corruption.
 */
function workerError(m: Extract<CodecReply, { error: string }>): CodecError | FormatError {
  if (!m.corrupt) {
    // Its code kept where it is a codec's (ERR_CALIBRATION_MISSING, ERR_CODEC_MISMATCH, …).
    const code = CODEC_CODES.find((c) => c === m.code)
    return new CodecError(m.error, code ? { code } : {})
  }
  if (m.code?.startsWith('ERR_FORMAT_')) return new FormatError(m.code as FormatErrorCode, m.error)
  return new CorruptStreamError(m.error)
}

/** A calibration as a worker message carries it (bytes, copied; small and rare). */
function refOf(c: Calibration | undefined): CalibrationRef | undefined {
  return c ? { hash: c.hash, bytes: c.bytes } : undefined
}

/** Bytes a job moves, what its deadline scales with: inputs and outputs (a calibration's samples weighted). */
function jobBytes(m: RequestBody): number {
  switch (m.op) {
    case 'encode':
      return m.tensor.byteLength
    case 'decode':
      return m.object.byteLength + m.out.byteLength
    case 'layers':
      return m.sections.byteLength + m.out.byteLength
    case 'calibrate':
      return CALIBRATE_COST * m.samples.reduce((a, b) => a + b.byteLength, 0)
    case 'crc':
      return m.data.byteLength
  }
}

/** A result the worker transferred (encode, CRCs, calibrations). */
function transferred(bytes: ArrayBuffer | null): Uint8Array {
  if (!bytes) throw new CodecError('codec worker sent no result')
  return new Uint8Array(bytes)
}

/** Whether two views share any byte (decoding one into the other would read what it wrote). */
function overlaps(a: Uint8Array, b: Uint8Array): boolean {
  return (
    a.buffer === b.buffer &&
    a.byteOffset < b.byteOffset + b.byteLength &&
    b.byteOffset < a.byteOffset + a.byteLength
  )
}

/** Jobs that never reached a worker (every worker gone) run on the calling thread instead. */
function noWorkersToUndefined(e: unknown): undefined {
  if (e instanceof NoWorkers) return undefined
  throw e
}
