// Background writes of stored chunks to L2 and L4. A chunk held for a lower tier is a pin on its
// L1 slot (no extra memory: L1 bounds these) or a private copy (counted against the byte budget; past it, shed).

import type { ChunkKey } from '../core/keys.ts'
import type { CalibrationStore } from './calibration-store.ts'
import type { ChunkCodecName, ChunkIdentity } from './chunk-codec.ts'
import type { CodecPool } from './codec-pool.ts'
import type { DiskTier } from './tiers/disk.ts'
import type { MemoryHandle } from './tiers/memory.ts'
import type { RemoteTier } from './tiers/remote.ts'

export interface WriteBehindOptions {
  disk: DiskTier | undefined
  remote: RemoteTier | undefined
  codec: CodecPool
  diskCodec: 'raw' | 'lossless'
  remoteCodec: ChunkCodecName
  remoteQuality: number | undefined
  identity: (k: ChunkKey) => ChunkIdentity
  /** The namespace's calibration (lossy L4 encodes use the current one) and its build policy. */
  calibrations?: CalibrationStore | undefined
  /**
   * Bytes of private copies held for background writes at once (chunks L1 could not take).
   * Pinned L1 chunks cost no memory beyond L1 and are not counted: L1's size bounds them, so a
   * prompt larger than this budget still reaches L2/L4 when L1 holds it.
   */
  maxBytes: number
  /** L2 encodes + writes running at once: the only encoded copies alive. */
  diskConcurrency: number
}

export interface WriteBehindStats {
  /** Bytes of private copies held for background writes now (the budgeted memory). */
  heldBytes: number
  /** Bytes of L1 chunks pinned for background writes now (inside L1, not extra memory). */
  pinnedBytes: number
  maxBytes: number
  /** Chunks not written to L2/L4 because the budget was spent (counted, never silent). */
  shedWrites: number
  /** L2 writes waiting for their turn. */
  queuedDiskWrites: number
}

/**
 * The bytes of one chunk held until its last lower-tier write is done: a pin on
 * the L1 chunk or a private copy. Reference counted; the budget and the pin are
 * returned exactly once, when the count reaches zero.
 */
export class HeldChunk {
  readonly key: ChunkKey
  readonly bytes: Uint8Array
  /** A pin on the L1 chunk (no memory beyond L1), not a private copy. */
  readonly pinned: boolean
  #refs = 1
  readonly #release: () => void

  constructor(key: ChunkKey, bytes: Uint8Array, release: () => void, pinned = false) {
    this.key = key
    this.bytes = bytes
    this.pinned = pinned
    this.#release = release
  }

  /** One more user (a tier write); each calls done() once. */
  hold(): () => void {
    this.#refs++
    let once = false
    return () => {
      if (once) return
      once = true
      this.done()
    }
  }

  /** Drops the creator's reference (or a hold's). */
  done(): void {
    if (this.#refs <= 0) return
    if (--this.#refs === 0) this.#release()
  }
}

export class WriteBehind {
  readonly #o: WriteBehindOptions
  readonly #diskQueue: { held: HeldChunk; done: () => void }[] = []
  readonly #running = new Set<Promise<void>>()
  readonly #idle: (() => void)[] = []
  /** Chunks queued or being written per tier: a repeated store does not queue them twice. */
  readonly #toDisk = new Set<string>()
  readonly #toRemote = new Set<string>()
  #held = 0
  #pinned = 0
  #shed = 0

  constructor(o: WriteBehindOptions) {
    this.#o = o
  }

  /** True when some lower tier exists (otherwise nothing is ever held). */
  get active(): boolean {
    return this.#o.disk !== undefined || this.#o.remote !== undefined
  }

  /** Whether chunk `hex` still has to reach some lower tier. */
  wanted(hex: string): boolean {
    const { disk, remote } = this.#o
    return (
      (disk !== undefined && !disk.has(hex) && !this.#toDisk.has(hex)) ||
      (remote !== undefined && !remote.knownPresent(hex) && !this.#toRemote.has(hex))
    )
  }

  /**
   * Keeps a pin on an L1 chunk for the lower tiers; released when the writes are done.
   * Never shed: the pin costs no memory beyond L1.
   */
  holdPinned(key: ChunkKey, pin: MemoryHandle): HeldChunk {
    const n = pin.bytes.byteLength
    this.#pinned += n
    return new HeldChunk(
      key,
      pin.bytes,
      () => {
        this.#pinned -= n
        pin.release()
      },
      true,
    )
  }

  /** A private buffer for a chunk L1 could not take, or undefined (shed) past the budget. */
  holdCopy(key: ChunkKey, bytes: number): HeldChunk | undefined {
    if (!this.#admit(bytes)) return undefined
    return new HeldChunk(key, new Uint8Array(bytes), () => {
      this.#held -= bytes
    })
  }

  #admit(bytes: number): boolean {
    // One chunk is always admitted when nothing is held: a budget below one chunk still writes.
    if (this.#held > 0 && this.#held + bytes > this.#o.maxBytes) {
      this.#shed++
      return false
    }
    this.#held += bytes
    return true
  }

  /**
   * Sends held chunks to the tiers lacking them (L2 if it has no file, L4 unless
   * the gateway is known or found to hold it), then drops the caller's references.
   * `toRemote` false: L2 only (an L4 hit being copied down).
   */
  async submit(chunks: HeldChunk[], toRemote = true): Promise<void> {
    const { disk, remote } = this.#o
    try {
      for (const c of chunks)
        if (disk && !disk.has(c.key.hex) && !this.#toDisk.has(c.key.hex)) this.#queueDisk(c)
      if (!remote || !toRemote) return
      const calibrations = this.#o.remoteCodec === 'kvgate' ? this.#o.calibrations : undefined
      // The calibration policy samples full chunks this node stores (copied only while it needs samples).
      if (calibrations)
        for (const c of chunks) if (!this.#o.identity(c.key).partial) calibrations.observe(c.bytes)
      const todo = chunks.filter((c) => !remote.knownPresent(c.key.hex) && !this.#toRemote.has(c.key.hex))
      if (todo.length === 0) return
      // One batched lookup: the leading chunks the gateway holds (another node stored them) are skipped.
      // 'background': off the prefill path, with the chunk deadline and retries, so a burst of
      // stores that slows the gateway's answers does not read as a failing gateway and shed uploads.
      const { present } = await remote.lookup(
        todo.map((c) => c.key.hex),
        'background',
      )
      for (const c of todo.slice(present)) {
        const hex = c.key.hex
        if (this.#toRemote.has(hex)) continue
        this.#toRemote.add(hex)
        const release = c.hold()
        const done = () => {
          this.#toRemote.delete(hex)
          release()
        }
        remote.enqueue({
          hex: c.key.hex,
          // A pinned L1 chunk holds no memory beyond L1 while queued: it never fills the
          // queue's byte bound (a prompt that fits L1 reaches L4 whole); a private copy does.
          bytesHint: c.pinned ? 0 : c.bytes.byteLength,
          encode: () =>
            this.#o.codec.encode(
              this.#o.remoteCodec,
              c.bytes,
              this.#o.identity(c.key),
              this.#o.remoteQuality,
              // Asked at encode time, never waited for: unknown or not loaded yet = a v1 object.
              calibrations?.current(),
            ),
          done,
        })
      }
    } finally {
      for (const c of chunks) c.done()
    }
  }

  #queueDisk(c: HeldChunk): void {
    const hex = c.key.hex
    this.#toDisk.add(hex)
    const release = c.hold()
    const done = () => {
      this.#toDisk.delete(hex)
      release()
    }
    this.#diskQueue.push({ held: c, done })
    this.#pump()
  }

  #pump(): void {
    while (this.#running.size < this.#o.diskConcurrency && this.#diskQueue.length > 0) {
      const job = this.#diskQueue.shift()!
      const p = this.#writeDisk(job.held).finally(() => {
        job.done()
        this.#running.delete(p)
        this.#pump()
        if (this.#running.size === 0 && this.#diskQueue.length === 0)
          for (const f of this.#idle.splice(0)) f()
      })
      this.#running.add(p)
    }
  }

  async #writeDisk(c: HeldChunk): Promise<void> {
    const disk = this.#o.disk!
    if (disk.has(c.key.hex)) return
    // Yield first so the caller's store() resolves before any encoding work starts.
    await new Promise((r) => setImmediate(r))
    try {
      // Encoded only now, at this write's turn: at most diskConcurrency encoded copies exist.
      const obj = await this.#o.codec.encode(this.#o.diskCodec, c.bytes, this.#o.identity(c.key))
      await disk.put(c.key.hex, obj)
    } catch {
      disk.counters.errors++
    }
  }

  /** Resolves when the L2 queue is empty (L4 has its own flush), or after `timeoutMs`. */
  drain(timeoutMs: number): Promise<void> {
    if (this.#running.size === 0 && this.#diskQueue.length === 0) return Promise.resolve()
    return new Promise<void>((resolve) => {
      const t = setTimeout(resolve, timeoutMs)
      t.unref()
      this.#idle.push(() => {
        clearTimeout(t)
        resolve()
      })
    })
  }

  /** Drops queued (not started) L2 writes, counted as shed: used by close(). */
  dropQueued(): void {
    for (const job of this.#diskQueue.splice(0)) {
      this.#shed++
      job.done()
    }
    if (this.#running.size === 0) for (const f of this.#idle.splice(0)) f()
  }

  stats(): WriteBehindStats {
    return {
      heldBytes: this.#held,
      pinnedBytes: this.#pinned,
      maxBytes: this.#o.maxBytes,
      shedWrites: this.#shed,
      queuedDiskWrites: this.#diskQueue.length,
    }
  }
}
