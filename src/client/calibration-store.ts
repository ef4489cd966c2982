// The client's view of its namespace's calibration objects (DESIGN §2.9,
// docs/calibration.md): fetch by hash (SHA-256 verified, a small in-memory LRU,
// persisted in a directory beside L2 so a restarted node decodes offline), the
// namespace's current one (a short TTL, refreshed in the background: the
// inference path never waits for it; unknown = encode without), publishing
// (create-only; the first stored wins and everyone adopts it), and the policy
// that builds one from the first full chunks stored in a namespace that has none.

import { createHash } from 'node:crypto'
import { constants as fsc } from 'node:fs'
import { mkdir, open, rename, rm, writeFile } from 'node:fs/promises'
import { join } from 'node:path'
import { LRUCache } from 'lru-cache'
import type { Calibration } from '../codec/calibration.ts'
import { type KvGeometry, sameGeometry } from '../core/layout.ts'

/** The gateway side of calibrations (RemoteTier implements it); null = "has none", undefined = unreachable. */
export interface CalibrationRemote {
  getCalibration(hash: string, maxBytes: number): Promise<Uint8Array | null | undefined>
  /** HEAD: whether the gateway holds it (undefined: unreachable). */
  hasCalibration(hash: string): Promise<boolean | undefined>
  /** `fresh`: read the stored pointer itself, past every cache (gateway instances keep it 60 s). */
  currentCalibration(opts?: { fresh?: boolean }): Promise<string | null | undefined>
  /** True: stored (or already there); 'refused': never for these bytes (size cap, scope); false: unreachable. */
  putCalibration(hash: string, bytes: Uint8Array): Promise<boolean | 'refused'>
  setCurrentCalibration(hash: string): Promise<string | undefined>
}

/**
 * The codec's calibration functions (src/codec/calibration.ts), injected so tests and runtimes
 * can choose. `build` may run elsewhere (the KVCache runs it on a codec worker: it reads every
 * sample, tens of MiB for a large model, and must not hold up the inference thread).
 */
export interface CalibrationCodec {
  build(
    samples: Uint8Array[],
    meta: { geometry: KvGeometry; dtype: KvGeometry['dtype'] },
  ): Uint8Array | Promise<Uint8Array>
  open(bytes: Uint8Array): Calibration
}

export interface CalibrationPolicy {
  /**
   * Full chunks this node stores in a namespace with no current calibration before it
   * builds one from their raw KV and publishes it; 0 never builds (it still adopts one). @default 4
   */
  calibrateAfter: number
  /** How long a known current calibration (or "none") is trusted before it is asked again, ms. @default 30000 */
  currentTtlMs: number
  /** Calibrations kept in memory. @default 8 */
  cacheEntries: number
  /** Largest calibration object fetched. @default 16 MiB (the gateway's default cap) */
  maxBytes: number
  /**
   * Bytes of sample chunks held while waiting to build (outside every other budget): the build
   * takes at most this many bytes of chunks, at least one. @default 256 MiB (8 Llama-3.1-8B chunks)
   */
  maxSampleBytes: number
}

export const DEFAULT_CALIBRATION_POLICY: CalibrationPolicy = {
  calibrateAfter: 4,
  currentTtlMs: 30_000,
  cacheEntries: 8,
  maxBytes: 16 * 1024 * 1024,
  maxSampleBytes: 256 * 1024 * 1024,
}

export interface CalibrationStoreOptions extends Partial<CalibrationPolicy> {
  codec: CalibrationCodec
  geometry: KvGeometry
  remote?: CalibrationRemote | undefined
  /** Directory the objects are persisted in (`<L2 dir>/calibrations`); none: memory only. */
  dir?: string | undefined
}

export interface CalibrationStats {
  /** The current calibration's hash as this node knows it (undefined: none or not known yet). */
  current: string | undefined
  /** Objects read from the persisted directory, fetched from the gateway. */
  loaded: number
  fetched: number
  /** Chunks that named a calibration this node could not get: served as misses. */
  misses: number
  /** Objects that failed their checks (hash, codec validation), from disk or the gateway. */
  rejected: number
  /** Calibrations this node built, and how many of them became the namespace's. */
  built: number
  won: number
  /** Times another node's calibration was adopted. */
  adopted: number
  /** Times this node put the current calibration back after finding it gone from the bucket. */
  restored: number
}

const HASH = /^[0-9a-f]{64}$/
/**
 * A calibration the gateway did not have is not asked for again for this long: an L2 file or
 * a chain of chunks naming it would otherwise cost one gateway GET per read.
 */
const MISSING_TTL_MS = 5000
const MAX_MISSING = 256

const sha256Hex = (b: Uint8Array) => createHash('sha256').update(b).digest('hex')

export class CalibrationStore {
  readonly #o: CalibrationPolicy
  readonly #codec: CalibrationCodec
  readonly #geometry: KvGeometry
  readonly #remote: CalibrationRemote | undefined
  readonly #dir: string | undefined
  readonly #cache: LRUCache<string, Calibration>
  readonly #loading = new Map<string, Promise<Calibration | undefined>>()
  /** Hashes the gateway answered 404 (or invalid bytes) for, with when. */
  readonly #missing = new Map<string, number>()
  /**
   * Hashes of sound calibrations of another geometry (another model's, in a shared directory or
   * namespace): never this cache's, whatever asks. Without this, a current pointer naming one
   * made each encode read, hash and open its file again.
   */
  readonly #foreign = new Set<string>()
  /** Current: a hash, null (the namespace has none) or undefined (not known); when it was learnt. */
  #current: { hash: string | null; at: number } | undefined
  #refreshing: Promise<void> | undefined
  /**
   * A calibration this node found removed on purpose (its object gone, the stored pointer no
   * longer naming it): a gateway's cached pointer may name it for another minute.
   */
  #removed: string | undefined
  #samples: Uint8Array[] = []
  #building: Promise<void> | undefined
  /** The gateway refused a calibration this node built for good: building another is wasted work. */
  #refused = false
  #closed = false
  readonly #stats = {
    loaded: 0,
    fetched: 0,
    misses: 0,
    rejected: 0,
    built: 0,
    won: 0,
    adopted: 0,
    restored: 0,
  }

  constructor(opts: CalibrationStoreOptions) {
    this.#o = {
      calibrateAfter: opts.calibrateAfter ?? DEFAULT_CALIBRATION_POLICY.calibrateAfter,
      currentTtlMs: opts.currentTtlMs ?? DEFAULT_CALIBRATION_POLICY.currentTtlMs,
      cacheEntries: opts.cacheEntries ?? DEFAULT_CALIBRATION_POLICY.cacheEntries,
      maxBytes: opts.maxBytes ?? DEFAULT_CALIBRATION_POLICY.maxBytes,
      maxSampleBytes: opts.maxSampleBytes ?? DEFAULT_CALIBRATION_POLICY.maxSampleBytes,
    }
    this.#codec = opts.codec
    this.#geometry = opts.geometry
    this.#remote = opts.remote
    this.#dir = opts.dir
    this.#cache = new LRUCache({ max: Math.max(1, this.#o.cacheEntries) })
  }

  /** A calibration already in memory (no I/O). */
  peek(hash: string): Calibration | undefined {
    return this.#cache.get(hash)
  }

  /**
   * Calibration `hash`: memory, else the persisted directory, else the gateway
   * (verified: its SHA-256 is its name, and the codec accepts it; then persisted).
   * Undefined when none of them has a valid one.
   */
  async get(hash: string): Promise<Calibration | undefined> {
    if (!HASH.test(hash) || this.#foreign.has(hash)) return undefined
    const hit = this.#cache.get(hash)
    if (hit) return hit
    let p = this.#loading.get(hash)
    if (!p) {
      p = this.#load(hash).finally(() => this.#loading.delete(hash))
      this.#loading.set(hash, p)
    }
    return p
  }

  /** For a chunk that names `hash`: the calibration, or undefined counted as a miss. */
  async forDecode(hash: string): Promise<Calibration | undefined> {
    const c = await this.get(hash)
    if (!c) this.#stats.misses++
    return c
  }

  async #load(hash: string): Promise<Calibration | undefined> {
    const local = await this.#readPersisted(hash)
    if (local) {
      this.#stats.loaded++
      this.#cache.set(hash, local)
      return local
    }
    if (!this.#remote || this.#closed || this.#foreign.has(hash)) return undefined
    const missedAt = this.#missing.get(hash)
    if (missedAt !== undefined && performance.now() - missedAt < MISSING_TTL_MS) return undefined
    const bytes = await this.#remote.getCalibration(hash, this.#o.maxBytes)
    if (bytes === undefined) return undefined // unreachable: ask again next time
    const c = bytes === null ? undefined : this.#accept(hash, bytes)
    if (!c) {
      this.#missing.delete(hash)
      this.#missing.set(hash, performance.now())
      if (this.#missing.size > MAX_MISSING) this.#missing.delete(this.#missing.keys().next().value as string)
      return undefined
    }
    this.#missing.delete(hash)
    this.#stats.fetched++
    this.#cache.set(hash, c)
    await this.#persist(c)
    return c
  }

  /** Bytes that are calibration `hash` and that the codec accepts for this geometry, opened; else undefined. */
  #accept(hash: string, bytes: Uint8Array): Calibration | undefined {
    const c = this.#check(hash, bytes)
    return typeof c === 'string' ? undefined : c
  }

  /**
   * #accept, telling damaged bytes (not their name) from bytes that are their name but that this
   * build cannot use: 'unopened' (a format it does not read, e.g. a newer build's) or 'foreign'
   * (a sound calibration of another model).
   */
  #check(hash: string, bytes: Uint8Array): Calibration | 'damaged' | 'unopened' | 'foreign' {
    if (sha256Hex(bytes) !== hash) {
      this.#stats.rejected++
      return 'damaged'
    }
    let c: Calibration
    try {
      c = this.#codec.open(bytes)
    } catch {
      // Not remembered as never usable: opening can fail for want of memory too.
      this.#stats.rejected++
      return 'unopened'
    }
    const g = c.geometry
    const want = this.#geometry
    if (!sameGeometry({ ...g, dtype: c.dtype }, want)) {
      this.#stats.rejected++
      this.#foreign.add(hash)
      if (this.#foreign.size > MAX_MISSING)
        this.#foreign.delete(this.#foreign.values().next().value as string)
      return 'foreign'
    }
    return c
  }

  async #readPersisted(hash: string): Promise<Calibration | undefined> {
    if (!this.#dir) return undefined
    const path = join(this.#dir, `${hash}.kvcl`)
    const bytes = await this.#readBounded(path)
    if (!bytes) return undefined
    const c = this.#check(hash, bytes)
    // A damaged file is dropped, so the gateway's copy replaces it. One that is its name belongs
    // to another process sharing this L2 directory (another model's, a newer build's): kept.
    if (c === 'damaged') await rm(path, { force: true }).catch(() => {})
    return typeof c === 'string' ? undefined : c
  }

  /**
   * A regular file of at most maxBytes (what this node accepts from the gateway), read whole;
   * anything else under the name is left alone and not read. O_NONBLOCK: a FIFO there would
   * hold every decode naming this calibration (and a pool thread) waiting for a writer.
   */
  async #readBounded(path: string): Promise<Uint8Array | undefined> {
    let fh: Awaited<ReturnType<typeof open>> | undefined
    try {
      fh = await open(path, fsc.O_RDONLY | fsc.O_NONBLOCK)
      const st = await fh.stat()
      if (!st.isFile() || st.size > this.#o.maxBytes) return undefined
      const bytes = new Uint8Array(st.size)
      let off = 0
      while (off < bytes.byteLength) {
        const { bytesRead } = await fh.read(bytes, off, bytes.byteLength - off, off)
        if (bytesRead === 0) break
        off += bytesRead
      }
      // Shorter than it was (truncated under us): its hash cannot match; damaged.
      return bytes.subarray(0, off)
    } catch {
      return undefined
    } finally {
      await fh?.close().catch(() => {})
    }
  }

  async #persist(c: Calibration): Promise<void> {
    if (!this.#dir) return
    try {
      await mkdir(this.#dir, { recursive: true })
      const tmp = join(this.#dir, `.tmp-${c.hash}-${process.pid}`)
      await writeFile(tmp, c.bytes)
      await rename(tmp, join(this.#dir, `${c.hash}.kvcl`))
    } catch {
      // Persisting only saves a later fetch: a full or read-only disk is not an error here.
    }
  }

  /**
   * The calibration to encode with now, if this node knows the namespace's and has
   * it in memory. Never waits: a stale or unknown answer starts a background
   * refresh, and meanwhile chunks are encoded without (v1 objects stay valid).
   */
  current(): Calibration | undefined {
    const cur = this.#current
    if (!cur || performance.now() - cur.at >= this.#o.currentTtlMs) void this.refresh()
    if (!cur?.hash) return undefined
    const c = this.#cache.get(cur.hash)
    if (!c) void this.get(cur.hash)
    return c
  }

  /** Asks the gateway for the current calibration and loads it; one request at a time. */
  refresh(): Promise<void> {
    if (!this.#remote || this.#closed) return Promise.resolve()
    this.#refreshing ??= (async () => {
      try {
        const hash = await this.#remote!.currentCalibration()
        if (hash === undefined) return // unreachable: keep what we knew
        if (hash !== null && hash === this.#removed) {
          // Adopted again only once its object is back (an operator put it back on purpose);
          // until then what the stored pointer said stands, and nothing is encoded with it.
          if ((await this.#remote!.hasCalibration(hash)) !== true) {
            this.#current = { hash: this.#current?.hash ?? null, at: performance.now() }
            return
          }
          this.#removed = undefined
        }
        this.#current = { hash, at: performance.now() }
        if (hash) {
          this.#samples = [] // calibrated by someone: samples are no longer needed
          await this.#loadCurrent(hash)
        }
      } finally {
        this.#refreshing = undefined
      }
    })()
    return this.#refreshing
  }

  /**
   * Loads the current calibration. One this node already holds is checked against
   * the bucket (a HEAD per refresh) and put back if it is gone (lost behind the
   * gateway) while the stored pointer still names it: without it every other node's
   * decodes of chunks coded with it would miss. The pointer is read fresh first: an
   * operator removes a calibration by deleting the pointer, then the objects, and a
   * gateway's cached pointer must not bring back what they deleted (docs/calibration.md).
   * The PUT is create-only and verified by hash.
   */
  async #loadCurrent(hash: string): Promise<void> {
    const held = this.#cache.get(hash) ?? (await this.#readPersisted(hash))
    if (!held) {
      await this.get(hash)
      return
    }
    this.#cache.set(hash, held)
    if ((await this.#remote!.hasCalibration(hash)) !== false) return
    const stored = await this.#remote!.currentCalibration({ fresh: true })
    if (stored === undefined) return // unreachable: the next refresh asks again
    if (stored !== hash) {
      // Deleted on purpose (or replaced): stop encoding with it; chunks coded with it were removed too.
      this.#removed = hash
      this.#current = { hash: stored, at: performance.now() }
      return
    }
    if ((await this.#remote!.putCalibration(hash, held.bytes)) === true) this.#stats.restored++
  }

  /**
   * The policy's input: a full chunk this node stored (raw KV in the chunk tensor
   * layout). Until the namespace is known to be calibrated the first
   * `calibrateAfter` are copied (never more); once the gateway said it has none,
   * one is built from them, published and the winner adopted.
   */
  observe(tensor: Uint8Array): void {
    if (this.#closed || this.#refused || this.#o.calibrateAfter <= 0 || !this.#remote || this.#building)
      return
    if (this.#current?.hash) return // calibrated
    if (this.#samples.length < this.#sampleCount(tensor.byteLength)) this.#samples.push(tensor.slice())
    if (this.#current === undefined) void this.refresh().then(() => this.#maybeBuild())
    else this.#maybeBuild()
  }

  #maybeBuild(): void {
    if (this.#closed || this.#building || this.#current?.hash !== null) return
    const first = this.#samples[0]
    if (!first || this.#samples.length < this.#sampleCount(first.byteLength)) return
    const samples = this.#samples
    this.#samples = []
    this.#building = this.#buildAndPublish(samples).finally(() => {
      this.#building = undefined
    })
  }

  /** Chunks to sample: `calibrateAfter`, fewer where they would hold more than maxSampleBytes. */
  #sampleCount(chunkBytes: number): number {
    return Math.min(this.#o.calibrateAfter, Math.max(1, Math.floor(this.#o.maxSampleBytes / chunkBytes)))
  }

  async #buildAndPublish(samples: Uint8Array[]): Promise<void> {
    let bytes: Uint8Array
    try {
      bytes = await this.#codec.build(samples, { geometry: this.#geometry, dtype: this.#geometry.dtype })
    } catch {
      this.#stats.rejected++
      return
    }
    this.#stats.built++
    await this.publish(bytes)
  }

  /**
   * Stores `bytes` as a calibration (create-only) and proposes it as the namespace's
   * current one; adopts whichever the gateway answers (ours, or the earlier winner).
   * Returns the adopted calibration, or undefined when the gateway could not be reached.
   */
  async publish(bytes: Uint8Array): Promise<Calibration | undefined> {
    const remote = this.#remote
    if (!remote || this.#closed) return undefined
    const hash = sha256Hex(bytes)
    const mine = this.#accept(hash, bytes)
    if (!mine) return undefined
    this.#cache.set(hash, mine)
    await this.#persist(mine)
    const stored = await remote.putCalibration(hash, mine.bytes)
    if (stored === 'refused') {
      // Another build gives an object of about the same size, for the same gateway: refused too.
      this.#refused = true
      this.#samples = []
    }
    if (stored !== true) return undefined
    const winner = await remote.setCurrentCalibration(hash)
    if (!winner) return undefined
    if (winner === hash) this.#stats.won++
    else this.#stats.adopted++
    const adopted = winner === hash ? mine : await this.get(winner)
    this.#current = { hash: winner, at: performance.now() }
    return adopted
  }

  stats(): CalibrationStats {
    return { current: this.#current?.hash ?? undefined, ...this.#stats }
  }

  /** Waits for a background refresh or build in progress (tests, close). */
  async settled(): Promise<void> {
    await Promise.all([this.#refreshing, this.#building, ...this.#loading.values()])
  }

  close(): void {
    this.#closed = true
    this.#samples = []
  }
}
