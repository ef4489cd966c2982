// One remote chunk fetched as `?layers=a-b` groups for retrieveLayers; its layers
// are decoded into an L1 reservation that is committed only once every layer arrived and verified.
// A group writes into the reservation only while it is unsettled, and settling waits for a
// write in progress (a copy off the JS thread) to end: a slot is never given back under a write.

import type { ChunkKey } from '../core/keys.ts'
import { type KvGeometry, layerSlabBytes } from '../core/layout.ts'
import type { ChunkReader } from './chunk-reader.ts'
import type { MemoryReservation, MemoryTier } from './tiers/memory.ts'
import type { RemoteTier } from './tiers/remote.ts'

export class RemoteLayers {
  readonly #groups = new Map<number, Promise<Map<number, Uint8Array> | undefined>>()
  /** Groups whose GET has ended (arrived or failed): their layers are had without waiting. */
  readonly #ended = new Set<number>()
  readonly #reservation: MemoryReservation | undefined
  readonly #slab: number
  readonly #layers: number
  readonly #per: number
  readonly #key: ChunkKey
  readonly #reader: ChunkReader
  readonly #remote: RemoteTier
  /** Layers decoded into the reservation and handed out; the chunk is complete only when all are. */
  readonly #filled: Uint8Array
  #filledCount = 0
  /** Groups writing into the reservation right now (between LayerTarget take and done). */
  #writing = 0
  /** settle() was called: done now, or when the writes in progress end. */
  #settleWanted = false

  constructor(
    o: { reader: ChunkReader; remote: RemoteTier; memory: MemoryTier; geometry: KvGeometry; per: number },
    key: ChunkKey,
    tensorBytes: number,
  ) {
    this.#reader = o.reader
    this.#remote = o.remote
    this.#layers = o.geometry.layers
    this.#per = o.per
    this.#key = key
    this.#slab = layerSlabBytes(o.geometry, key.end - key.start)
    this.#filled = new Uint8Array(o.geometry.layers)
    this.#reservation = o.memory.reserve(key.hex, tensorBytes)
  }

  /**
   * Starts the GET of the layer group beginning at `first`, decoded straight into its place in
   * the reservation when there is one (no copy of each layer on this thread afterwards).
   */
  request(first: number): void {
    const last = Math.min(this.#layers - 1, first + this.#per - 1)
    const r = this.#reservation
    const into = r
      ? {
          // Asked when the group's bytes are ready: its place, unless the chunk was settled meanwhile.
          take: (): Uint8Array | undefined => {
            if (r.settled || this.#settleWanted) return undefined
            this.#writing++
            return r.bytes.subarray(first * this.#slab, (last + 1) * this.#slab)
          },
          done: (): void => {
            this.#writing--
            if (this.#settleWanted && this.#writing === 0) this.#settleNow()
          },
        }
      : undefined
    const group = this.#reader.layerGroup(this.#remote, this.#key, first, last, into)
    void group.finally(() => this.#ended.add(first)).catch(() => {})
    this.#groups.set(first, group)
  }

  /** True when layer l's group has ended: layer(l) then answers without waiting on the gateway. */
  ended(l: number): boolean {
    return this.#ended.has(this.#groupOf(l))
  }

  #groupOf(l: number): number {
    return Math.floor(l / this.#per) * this.#per
  }

  /** Layer l's slab (in the reservation when there is one), or undefined when its group failed. */
  async layer(l: number): Promise<Uint8Array | undefined> {
    const group = await this.#groups.get(this.#groupOf(l))
    const slab = group?.get(l)
    if (!slab) return undefined
    const r = this.#reservation
    if (!r || r.settled || this.#settleWanted) return slab
    const dst = r.bytes.subarray(l * this.#slab, (l + 1) * this.#slab)
    // Decoded in place (request); a group decoded elsewhere (none today) is copied in.
    if (slab.buffer !== dst.buffer || slab.byteOffset !== dst.byteOffset) dst.set(slab)
    if (this.#filled[l] === 0) {
      this.#filled[l] = 1
      this.#filledCount++
    }
    return dst
  }

  /**
   * Settles the reservation: published in L1 only when every layer landed in it
   * (a chunk with a missing layer group, or whose later layers were never asked
   * for, is never made resident); aborted otherwise. Idempotent.
   */
  settle(): void {
    this.#settleWanted = true
    // Groups still on their way write elsewhere from now on (take answers undefined); one
    // writing into the reservation right now (a copy on the addon's pool, a few ms) is waited
    // for: the slot is never given back under a write.
    if (this.#writing === 0) this.#settleNow()
  }

  #settleNow(): void {
    const r = this.#reservation
    if (!r || r.settled) return
    if (this.#filledCount === this.#layers) r.commit()
    else r.abort()
  }
}
