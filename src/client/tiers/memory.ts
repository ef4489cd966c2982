// L1: chunk tensors in pinned host regions, carved into fixed-size slots (one
// per chunk), indexed by an LRU keyed on chain key; pins keep in-use slots alive.
// Every pin and reservation is an object settled exactly once (release / commit or
// abort, both idempotent); live ones are counted so tests can assert none leak.

import { LRUCache } from 'lru-cache'
import { InvalidArgumentError } from '../../core/errors.ts'
import type { NativeModule } from '../native-api.ts'
import { since, TierCounters } from '../stats.ts'

/** A pinned view of a resident chunk; call release() when done copying (idempotent). */
export interface MemoryHandle {
  readonly bytes: Uint8Array
  release(): void
}

/**
 * A slot reserved for an asynchronous fill (decode, GPU copy, file read); invisible until commit().
 * Its owner settles it exactly once: commit() (or commitPinned()) on success, abort() otherwise;
 * calling abort() in a `finally` after a commit is a no-op, so `try { fill; commit } finally { abort }`
 * is the one shape that can never leak a slot.
 */
export interface MemoryReservation {
  /** Where the chunk tensor goes: `length` bytes at the slot's data offset. */
  readonly bytes: Uint8Array
  /**
   * The whole slot, 4 KiB aligned: a raw chunk object read here (O_DIRECT) puts
   * its tensor exactly at `bytes` when the data offset equals the header size.
   */
  readonly slot: Uint8Array
  /**
   * Publishes the chunk under its key. Returns false when the key was resident already (or,
   * for a scoped view, another view's chunk under it is pinned: this one is not stored).
   */
  commit(): boolean
  /**
   * Publishes the chunk and pins it in one step (no window where it could be evicted):
   * a pin on this chunk, or on the copy that was resident already.
   */
  commitPinned(): MemoryHandle | undefined
  /** Returns the slot without publishing (no-op once settled). */
  abort(): void
  /** True once committed or aborted. */
  readonly settled: boolean
}

export interface MemoryTierOptions {
  /** Bytes for L1 in total. */
  bytes: number
  /** Bytes of one chunk tensor. */
  chunkBytes: number
  /**
   * Bytes reserved in front of the tensor in each slot (the chunk header size),
   * so a raw L2 object can be read straight into a slot. @default 0
   */
  dataOffset?: number
  /** Native addon wrapper (pinned allocation); ordinary memory when absent or failing. */
  native?: NativeModule | undefined
  /** Why the addon is absent, reported in stats. */
  nativeReason?: string | undefined
  /**
   * Fault every page in at creation when the memory cannot be locked (a long-lived
   * agent): the first copy into a slot then runs at memory speed. @default false
   */
  prefault?: boolean
}

interface Entry {
  slot: number
  length: number
  refs: number
  /** In the LRU index (visible to readers). */
  indexed: boolean
  /** The view (see MemoryTier#scoped) whose chunk this is: other views treat it as absent. */
  scope: string
}

/** A chunk MemoryTier.resident found: in L1 while `indexed` is true. */
export interface Resident {
  readonly indexed: boolean
}

export interface MemoryTierStats {
  capacityBytes: number
  usedBytes: number
  slots: number
  freeSlots: number
  residentChunks: number
  /** 'cuda' (cudaHostAlloc), 'mlock', or 'none' (pageable memory). */
  pinnedKind: 'cuda' | 'mlock' | 'none'
  pinReason: string | undefined
  /** Stores skipped because every slot was pinned or reserved. */
  skippedFull: number
  /** Reservations not yet committed or aborted (0 when idle: anything else is a leak). */
  liveReservations: number
  /** Pins not yet released (0 when idle: anything else is a leak). */
  livePins: number
}

const PAGE = 4096
/** Node 20 caps one external ArrayBuffer at 4 GiB: bigger L1s use several regions. */
const MAX_REGION = 2 ** 32

/** What every view of one L1 shares: the regions, the free slots and one LRU over all keys. */
interface SlotPool {
  readonly regions: Uint8Array[]
  readonly slotsPerRegion: number
  readonly slots: number
  readonly kind: MemoryTierStats['pinnedKind']
  readonly pinReason: string | undefined
  readonly free: number[]
  readonly index: LRUCache<string, Entry>
  /** Set when the regions came from the addon (and can be freed through it). */
  native: NativeModule | undefined
  skippedFull: number
  liveReservations: number
  livePins: number
  /** Chunks that left the index (evicted, deleted, replaced, cleared): every way out runs its dispose. */
  removals: number
}

export class MemoryTier {
  readonly counters = new TierCounters()
  readonly slotBytes: number
  readonly dataOffset: number
  readonly #pool: SlotPool
  /**
   * This view's scope (see scoped()): the pool is indexed by chain key alone, and an
   * entry of another scope under the same key is absent to this view. Views of one pool
   * never see each other's chunks, but share its budget and evict each other's LRU chunks.
   * (A scope in the key itself cost a second hash lookup per key: a third of a lookup.)
   */
  readonly #scope: string
  /** The view that allocated the pool: only it frees the regions. */
  readonly #owner: boolean

  private constructor(slotBytes: number, dataOffset: number, pool: SlotPool, scope: string, owner: boolean) {
    this.slotBytes = slotBytes
    this.dataOffset = dataOffset
    this.#pool = pool
    this.#scope = scope
    this.#owner = owner
  }

  /** This view's entry for `hex` (no recency change), undefined when absent or another view's. */
  #peek(hex: string): Entry | undefined {
    const e = this.#pool.index.peek(hex)
    return e !== undefined && e.scope === this.#scope ? e : undefined
  }

  static #newPool(
    regions: Uint8Array[],
    slotsPerRegion: number,
    slots: number,
    kind: MemoryTierStats['pinnedKind'],
    reason: string | undefined,
  ): SlotPool {
    const free: number[] = []
    // Low slots first: keeps the touched part of the region small when lightly used.
    for (let s = slots - 1; s >= 0; s--) free.push(s)
    const pool: SlotPool = {
      regions,
      slotsPerRegion,
      slots,
      kind,
      pinReason: reason,
      free,
      index: new LRUCache<string, Entry>({
        max: slots,
        dispose: (entry) => {
          pool.removals++
          entry.indexed = false
          if (entry.refs === 0) free.push(entry.slot)
        },
      }),
      native: undefined,
      skippedFull: 0,
      liveReservations: 0,
      livePins: 0,
      removals: 0,
    }
    return pool
  }

  /**
   * A view of this L1 whose chunks belong to `scope`: another KV space sharing the
   * agent's one L1 budget. Its chunks are invisible to other views; eviction is one LRU
   * over every view. One chain key holds one chunk at a time: a view storing a key that
   * another view holds replaces that chunk (or, while it is pinned, is skipped), which
   * only spaces with equal chain keys (same model and hashes, another geometry) ever do.
   * The view's counters are its own; capacity and pins are the pool's. Disposing a view
   * drops its chunks only; the pool's owner frees the memory.
   */
  scoped(scope: string): MemoryTier {
    if (typeof scope !== 'string' || scope.length === 0 || scope.includes('\0'))
      throw new InvalidArgumentError('invalid L1 scope')
    return new MemoryTier(this.slotBytes, this.dataOffset, this.#pool, `${this.#scope}${scope}\0`, false)
  }

  /** Sizes the slots and allocates the regions (pinned through the addon when it loads). */
  static async create(opts: MemoryTierOptions): Promise<MemoryTier> {
    const { bytes, chunkBytes } = opts
    const dataOffset = opts.dataOffset ?? 0
    if (!Number.isSafeInteger(chunkBytes) || chunkBytes < 1)
      throw new InvalidArgumentError('invalid chunk size')
    if (!Number.isSafeInteger(dataOffset) || dataOffset < 0)
      throw new InvalidArgumentError('invalid dataOffset')
    const slotBytes = Math.ceil((dataOffset + chunkBytes) / PAGE) * PAGE
    if (slotBytes > MAX_REGION)
      throw new InvalidArgumentError(`a chunk of ${chunkBytes} bytes is too large for L1`)
    if (!Number.isSafeInteger(bytes) || bytes < slotBytes) {
      throw new InvalidArgumentError(
        `invalid memory.bytes: ${String(bytes)} is smaller than one chunk slot (${slotBytes} bytes)`,
      )
    }
    const slots = Math.floor(bytes / slotBytes)
    const slotsPerRegion = Math.floor(MAX_REGION / slotBytes)
    const regions: Uint8Array[] = []
    const native: boolean[] = []
    let kind: MemoryTierStats['pinnedKind'] = 'cuda'
    let reason: string | undefined = opts.nativeReason ?? 'native addon not loaded'
    for (let left = slots; left > 0; left -= slotsPerRegion) {
      const size = Math.min(left, slotsPerRegion) * slotBytes
      const r = await allocateRegion(size, opts.native, opts.prefault === true)
      regions.push(r.bytes)
      native.push(r.fromAddon)
      if (r.kind === 'none' || (r.kind === 'mlock' && kind === 'cuda')) kind = r.kind
      if (regions.length === 1 || r.kind === 'none') reason = r.reason
    }
    if (!opts.native) kind = 'none'
    const pool = MemoryTier.#newPool(regions, slotsPerRegion, slots, kind, reason)
    if (opts.native && native.every((n) => n)) pool.native = opts.native
    return new MemoryTier(slotBytes, dataOffset, pool, '', true)
  }

  #slotView(slot: number): Uint8Array {
    const p = this.#pool
    const r = p.regions[Math.floor(slot / p.slotsPerRegion)]!
    const start = (slot % p.slotsPerRegion) * this.slotBytes
    return r.subarray(start, start + this.slotBytes)
  }

  #dataView(slot: number, length: number): Uint8Array {
    return this.#slotView(slot).subarray(this.dataOffset, this.dataOffset + length)
  }

  /** True when the chunk is resident (does not touch recency or counters). */
  has(hex: string): boolean {
    return this.#peek(hex) !== undefined
  }

  /**
   * has() that the caller can keep: this view's chunk for `hex`, whose `indexed` stays true
   * exactly as long as that chunk stays in L1 (every way out of the index runs its dispose,
   * which clears it; a chunk stored again is another entry). A warm lookup of 512 keys then
   * reads one flag per key, not the LRU index (a quarter of its time).
   */
  resident(hex: string): Resident | undefined {
    return this.#peek(hex)
  }

  /**
   * Changes whenever a chunk leaves this L1 (any view's): while it is unchanged, every
   * resident() found is still resident without reading it (one number for all of them).
   */
  get removals(): number {
    return this.#pool.removals
  }

  /** Pins a resident chunk and marks it recently used; undefined on a miss. */
  acquire(hex: string): MemoryHandle | undefined {
    // get() marks the entry recently used: only this view's, never another view's.
    const entry = this.#peek(hex) && this.#pool.index.get(hex)
    if (!entry) {
      this.counters.misses++
      return undefined
    }
    this.counters.hits++
    this.counters.bytesRead += entry.length
    return this.#pin(entry)
  }

  /** Like acquire() without counting a hit or miss or touching recency (write-behind, promotion). */
  peekPinned(hex: string): MemoryHandle | undefined {
    const entry = this.#peek(hex)
    return entry ? this.#pin(entry) : undefined
  }

  #pin(entry: Entry): MemoryHandle {
    const pool = this.#pool
    entry.refs++
    pool.livePins++
    let released = false
    return {
      bytes: this.#dataView(entry.slot, entry.length),
      release: () => {
        if (released) return
        released = true
        pool.livePins--
        entry.refs--
        if (entry.refs === 0 && !entry.indexed) pool.free.push(entry.slot)
      },
    }
  }

  /**
   * Reserves a slot for `length` bytes, evicting unpinned LRU chunks if needed.
   * Never blocks: when everything is pinned it returns undefined and counts a skip.
   */
  reserve(hex: string, length: number): MemoryReservation | undefined {
    if (length < 1 || this.dataOffset + length > this.slotBytes) {
      throw new InvalidArgumentError(`chunk of ${length} bytes does not fit an L1 slot of ${this.slotBytes}`)
    }
    const pool = this.#pool
    const scope = this.#scope
    const slot = this.#allocSlot()
    if (slot === undefined) {
      pool.skippedFull++
      return undefined
    }
    const entry: Entry = { slot, length, refs: 0, indexed: false, scope }
    pool.liveReservations++
    let done = false
    const settle = (): boolean => {
      if (done) return false
      done = true
      pool.liveReservations--
      return true
    }
    const publish = (): Entry | undefined => {
      if (!settle()) return undefined
      const resident = pool.index.peek(hex)
      if (resident?.scope === scope) {
        pool.free.push(slot)
        return resident
      }
      if (resident) {
        // Another view's chunk under this chain key: replaced, unless a reader holds it.
        if (resident.refs > 0) {
          pool.free.push(slot)
          return undefined
        }
        pool.index.delete(hex)
      }
      entry.indexed = true
      pool.index.set(hex, entry)
      this.counters.puts++
      this.counters.bytesWritten += length
      return entry
    }
    return {
      bytes: this.#dataView(slot, length),
      slot: this.#slotView(slot),
      commit: () => {
        if (done) return false
        return publish() === entry
      },
      commitPinned: () => {
        const e = publish()
        return e ? this.#pin(e) : undefined
      },
      abort: () => {
        if (settle()) pool.free.push(slot)
      },
      get settled() {
        return done
      },
    }
  }

  /** Copies `bytes` in under `hex`. False when skipped (full of pins) or already resident. */
  put(hex: string, bytes: Uint8Array): boolean {
    if (this.has(hex)) return false
    const t0 = performance.now()
    const r = this.reserve(hex, bytes.byteLength)
    if (!r) return false
    r.bytes.set(bytes)
    const ok = r.commit()
    this.counters.writeLatency.record(since(t0))
    return ok
  }

  delete(hex: string): void {
    if (this.#peek(hex)) this.#pool.index.delete(hex)
  }

  #allocSlot(): number | undefined {
    const pool = this.#pool
    const free = pool.free.pop()
    if (free !== undefined) return free
    // Evict the least recently used chunk nobody holds. Pinned chunks stay: evicting
    // one frees no slot until its reader is done, and it would empty L1 for nothing
    // (a store larger than L1 pinning its own chunks used to wipe L1 that way).
    let victim: string | undefined
    for (const key of pool.index.rkeys()) {
      if (pool.index.peek(key)!.refs === 0) {
        victim = key
        break
      }
    }
    if (victim === undefined) return undefined
    this.counters.evictions++
    pool.index.delete(victim)
    return pool.free.pop()
  }

  stats(): MemoryTierStats {
    const p = this.#pool
    return {
      capacityBytes: p.slots * this.slotBytes,
      usedBytes: (p.slots - p.free.length) * this.slotBytes,
      slots: p.slots,
      freeSlots: p.free.length,
      residentChunks: this.#owner ? p.index.size : this.#keys().length,
      pinnedKind: p.kind,
      pinReason: p.pinReason,
      skippedFull: p.skippedFull,
      liveReservations: p.liveReservations,
      livePins: p.livePins,
    }
  }

  /** This view's keys in the pool (a scoped view; the owner's view is the whole index). */
  #keys(): string[] {
    const out: string[] = []
    for (const [k, e] of this.#pool.index.entries()) if (e.scope === this.#scope) out.push(k)
    return out
  }

  /** Drops this view's chunks (all of them, for the pool's own view). */
  clear(): void {
    if (this.#owner) this.#pool.index.clear()
    else for (const k of this.#keys()) this.#pool.index.delete(k)
  }

  /**
   * Empties the index and returns pinned regions to the addon now rather than
   * at garbage collection. Views handed out earlier read as empty afterwards.
   * A scoped view only drops its own chunks: the pool lives until its owner is disposed.
   */
  dispose(): void {
    this.clear()
    if (!this.#owner) return
    const p = this.#pool
    if (!p.native) return
    for (const r of p.regions) {
      try {
        p.native.freePinned(r.buffer as ArrayBuffer)
      } catch {
        // Busy (an addon copy still runs) or not a pinned buffer: the GC frees it later.
      }
    }
  }
}

async function allocateRegion(
  size: number,
  native: NativeModule | undefined,
  prefault: boolean,
): Promise<{
  bytes: Uint8Array
  kind: MemoryTierStats['pinnedKind']
  reason: string | undefined
  fromAddon: boolean
}> {
  let reason = 'native addon not loaded: ordinary (pageable) memory'
  if (native) {
    try {
      const a = await native.allocPinned(size, { prefault })
      return { bytes: new Uint8Array(a.buffer), kind: a.kind, reason: a.reason, fromAddon: true }
    } catch (e) {
      reason = `allocPinned failed (${(e as Error).message}): ordinary (pageable) memory`
    }
  }
  const bytes = new Uint8Array(new ArrayBuffer(size))
  // Without the addon, touching one byte per page faults the (zeroed) pages in all the same.
  if (prefault) for (let i = 0; i < size; i += PAGE) bytes[i] = 0
  return { bytes, kind: 'none', reason, fromAddon: false }
}
