// L1: chunk tensors in one pinned host region, carved into fixed-size slots (one
// per chunk), indexed by an LRU keyed on chain key; pins keep in-use slots alive.

import { LRUCache } from 'lru-cache'
import { InvalidArgumentError } from '../../core/errors.ts'
import { type NativeApi, pinnedView } from '../native-api.ts'
import { since, TierCounters } from '../stats.ts'

/** A pinned view of a resident chunk; call release() when done copying. */
export interface MemoryHandle {
  readonly bytes: Uint8Array
  release(): void
}

/** A slot reserved for an asynchronous fill (decode, GPU copy); invisible until commit(). */
export interface MemoryReservation {
  /** The slot, `length` bytes long. */
  readonly bytes: Uint8Array
  /** Publishes the chunk under its key. Returns false when the key was resident already. */
  commit(): boolean
  /** Returns the slot without publishing. */
  abort(): void
}

export interface MemoryTierOptions {
  /** Bytes of the region. @default 1 GiB at the KVCache level */
  bytes: number
  /** Bytes of one slot (one full chunk tensor; rounded up to 4 KiB here). */
  slotBytes: number
  /** Native addon (pinned allocation); ordinary memory when absent or failing. */
  native?: NativeApi | undefined
  /** Why the addon is absent, reported in stats. */
  nativeReason?: string | undefined
}

interface Entry {
  slot: number
  length: number
  refs: number
  /** In the LRU index (visible to readers). */
  indexed: boolean
}

export interface MemoryTierStats {
  capacityBytes: number
  usedBytes: number
  slots: number
  freeSlots: number
  residentChunks: number
  pinned: boolean
  pinReason: string | undefined
  /** Stores skipped because every slot was pinned or reserved. */
  skippedFull: number
}

const PAGE = 4096

export class MemoryTier {
  readonly counters = new TierCounters()
  readonly slotBytes: number
  readonly #region: Uint8Array
  readonly #pinned: boolean
  readonly #pinReason: string | undefined
  readonly #free: number[] = []
  readonly #slots: number
  readonly #index: LRUCache<string, Entry>
  #skippedFull = 0

  constructor(opts: MemoryTierOptions) {
    const { bytes, slotBytes } = opts
    if (!Number.isSafeInteger(slotBytes) || slotBytes < 1) throw new InvalidArgumentError('invalid slotBytes')
    this.slotBytes = Math.ceil(slotBytes / PAGE) * PAGE
    if (!Number.isSafeInteger(bytes) || bytes < this.slotBytes) {
      throw new InvalidArgumentError(
        `invalid memory.bytes: ${String(bytes)} is smaller than one chunk slot (${this.slotBytes} bytes)`,
      )
    }
    this.#slots = Math.floor(bytes / this.slotBytes)
    const size = this.#slots * this.slotBytes
    const region = allocateRegion(size, opts.native, opts.nativeReason)
    this.#region = region.bytes
    this.#pinned = region.pinned
    this.#pinReason = region.reason
    // Low slots first: keeps the touched part of the region small when lightly used.
    for (let s = this.#slots - 1; s >= 0; s--) this.#free.push(s)
    this.#index = new LRUCache<string, Entry>({
      max: this.#slots,
      dispose: (entry) => {
        entry.indexed = false
        if (entry.refs === 0) this.#free.push(entry.slot)
      },
    })
  }

  /** True when the chunk is resident (does not touch recency or counters). */
  has(hex: string): boolean {
    return this.#index.has(hex)
  }

  /** Pins a resident chunk and marks it recently used; undefined on a miss. */
  acquire(hex: string): MemoryHandle | undefined {
    const entry = this.#index.get(hex)
    if (!entry) {
      this.counters.misses++
      return undefined
    }
    this.counters.hits++
    this.counters.bytesRead += entry.length
    return this.#pin(entry)
  }

  /** Like acquire() but without counting a hit or miss (internal reads: write-behind, promotion). */
  peekPinned(hex: string): MemoryHandle | undefined {
    const entry = this.#index.peek(hex)
    return entry ? this.#pin(entry) : undefined
  }

  #pin(entry: Entry): MemoryHandle {
    entry.refs++
    let released = false
    const start = entry.slot * this.slotBytes
    return {
      bytes: this.#region.subarray(start, start + entry.length),
      release: () => {
        if (released) return
        released = true
        entry.refs--
        if (entry.refs === 0 && !entry.indexed) this.#free.push(entry.slot)
      },
    }
  }

  /**
   * Reserves a slot for `length` bytes, evicting unpinned LRU chunks if needed.
   * Never blocks: when everything is pinned it returns undefined and counts a skip.
   */
  reserve(hex: string, length: number): MemoryReservation | undefined {
    if (length > this.slotBytes || length < 1) {
      throw new InvalidArgumentError(`chunk of ${length} bytes does not fit an L1 slot of ${this.slotBytes}`)
    }
    const slot = this.#allocSlot()
    if (slot === undefined) {
      this.#skippedFull++
      return undefined
    }
    const entry: Entry = { slot, length, refs: 0, indexed: false }
    let done = false
    const start = slot * this.slotBytes
    return {
      bytes: this.#region.subarray(start, start + length),
      commit: () => {
        if (done) return false
        done = true
        if (this.#index.has(hex)) {
          this.#free.push(slot)
          return false
        }
        entry.indexed = true
        this.#index.set(hex, entry)
        this.counters.puts++
        this.counters.bytesWritten += length
        return true
      },
      abort: () => {
        if (done) return
        done = true
        this.#free.push(slot)
      },
    }
  }

  /** Copies `bytes` in under `hex`. False when skipped (full of pins) or already resident. */
  put(hex: string, bytes: Uint8Array): boolean {
    if (this.#index.has(hex)) return false
    const t0 = performance.now()
    const r = this.reserve(hex, bytes.byteLength)
    if (!r) return false
    r.bytes.set(bytes)
    const ok = r.commit()
    this.counters.writeLatency.record(since(t0))
    return ok
  }

  delete(hex: string): void {
    this.#index.delete(hex)
  }

  #allocSlot(): number | undefined {
    const free = this.#free.pop()
    if (free !== undefined) return free
    // Evict from the LRU end. A pinned victim leaves the index now but keeps its
    // slot until its last reader releases it, so eviction can need several pops.
    let budget = this.#index.size
    while (budget-- > 0) {
      const victim = this.#index.pop()
      if (!victim) break
      this.counters.evictions++
      const slot = this.#free.pop()
      if (slot !== undefined) return slot
    }
    return undefined
  }

  stats(): MemoryTierStats {
    return {
      capacityBytes: this.#slots * this.slotBytes,
      usedBytes: (this.#slots - this.#free.length) * this.slotBytes,
      slots: this.#slots,
      freeSlots: this.#free.length,
      residentChunks: this.#index.size,
      pinned: this.#pinned,
      pinReason: this.#pinReason,
      skippedFull: this.#skippedFull,
    }
  }

  clear(): void {
    this.#index.clear()
  }
}

function allocateRegion(
  size: number,
  native: NativeApi | undefined,
  nativeReason: string | undefined,
): { bytes: Uint8Array; pinned: boolean; reason: string | undefined } {
  if (native?.allocPinned) {
    try {
      const v = pinnedView(native.allocPinned(size))
      if (v && v.bytes.byteLength >= size) {
        return { bytes: v.bytes.subarray(0, size), pinned: v.pinned, reason: v.pinned ? undefined : v.reason }
      }
      nativeReason = 'allocPinned returned an unusable buffer'
    } catch (e) {
      nativeReason = `allocPinned failed: ${(e as Error).message}`
    }
  }
  return {
    bytes: new Uint8Array(new ArrayBuffer(size)),
    pinned: false,
    reason: nativeReason ?? 'native addon not loaded: ordinary (pageable) memory',
  }
}
