// What every route shares inside one gateway instance: the instrumented store,
// lookup engine, GET coalescer, header cache, limits and the status counters.

import { LRUCache } from 'lru-cache'
import type { FleetAccounting } from '../coldtier/accounting.ts'
import type { ChunkHeader } from '../core/format.ts'
import { isObjectPrefix } from '../core/keys.ts'
import { ChainLookup, type ChainLookupOptions } from './chain-lookup.ts'
import { GetCoalescer } from './coalesce.ts'
import { NEWER_FORMAT_ENTRIES, NEWER_FORMAT_TTL_MS, type Verified } from './heal.ts'
import { bodyHoldBytes, DEFAULT_MAX_HELD_BYTES, lookupHoldBytes, MemoryBudget } from './memory-budget.ts'
import { GatewayMetrics } from './metrics.ts'
import { instrumentStore } from './stores/instrumented.ts'
import type { ObjectStore } from './stores/types.ts'
import type { UsageRecorder } from './usage/recorder.ts'

export interface GatewayLimits {
  /** Largest chunk object accepted by PUT. @default 512 MiB */
  maxChunkBytes?: number
  /** Keys per lookup. @default 4096 */
  maxLookupKeys?: number
  /** Lookup request body bytes. @default 512 KiB */
  maxLookupBodyBytes?: number
  /** A PUT body that sends nothing for this long fails with 408. @default 30000 */
  bodyIdleTimeoutMs?: number
  /**
   * A PUT body slower than this (bytes/s, over bodyIdleTimeoutMs spent waiting on the
   * client) fails with 408: a trickle must not hold a connection for the whole request
   * timeout. 0 turns it off. @default 8192
   */
  bodyMinBytesPerSecond?: number
  /**
   * A GET reader that takes nothing for this long is cut off: its store stream (file
   * handle, S3 socket) is released and its connection closed. @default 30000
   */
  readerIdleTimeoutMs?: number
  /**
   * A GET reader that, over readerIdleTimeoutMs spent waiting on it, takes less than this
   * (bytes/s) is cut off the same way: a trickle that never quite idles would hold its store
   * stream (a file handle, an S3 socket; the S3 SDK's read-ahead is reserved in maxHeldBytes
   * while it is open) for as long as it likes. 0 turns it off. @default 65536
   */
  readerMinBytesPerSecond?: number
  /** Declared PUT body bytes in flight at once; above it PUTs get 503 ERR_BUSY. @default 1 GiB */
  maxInFlightBytes?: number
  /**
   * Bytes the gateway itself holds for requests at once: PUT read-ahead, multipart parts,
   * whole calibration bodies, coalesced GET buffers, the store's read-ahead of an open GET
   * stream (memory-budget.ts). A PUT that would pass it gets 503 ERR_BUSY; a GET streams
   * instead of buffering, and gets 503 ERR_BUSY when even its stream would pass it. Must fit what one
   * request holds. Workers set 48 MiB, Lambda half of what its memory leaves the runtime.
   * @default 256 MiB
   */
  maxHeldBytes?: number
  /** Stored-object verifications (POST …/verify, corrupt GETs) at once. @default 4 */
  maxConcurrentVerifies?: number
  /** Largest calibration object accepted by PUT …/calibrations/{sha256}. @default 16 MiB */
  maxCalibrationBytes?: number
  /**
   * Bytes of verified calibration bodies kept in memory per instance. A body larger than this
   * is streamed from the store (hashed on the way) and not kept; 0 keeps none. Workers set
   * 8 MiB: a whole isolate has 128 MB. @default 64 MiB
   */
  calibrationCacheBytes?: number
}

/**
 * 64 KiB/s (512 kbit/s) a response, judged over readerIdleTimeoutMs (30 s): a client on a
 * slow link is far above it (a 100 Mbit/s link carries some 200 such responses at once),
 * the socket buffers (several MiB) take a short response whole whatever the client's pace,
 * and the first window counts the burst that fills them. A reader under it holds a store
 * stream nearly for free; to hold the 1024 connections Node allows, it must take 64 MiB/s.
 */
export const DEFAULT_READER_MIN_BYTES_PER_SECOND = 64 * 1024

/** Bytes of decoded chunk headers kept for ?layers= (their bytes and decoded sections). */
export const HEADER_CACHE_BYTES = 8 * 1024 * 1024
/** What one decoded section entry costs on the JS heap (an object of three numbers), roughly. */
const DECODED_SECTION_BYTES = 64

/** Verified calibration bodies kept per instance where the runtime sets no smaller bound. */
export const DEFAULT_CALIBRATION_CACHE_BYTES = 64 * 1024 * 1024

export interface PresignOptions {
  /** Objects of at least this many bytes are answered with a 307 to a presigned URL. */
  minBytes: number
  /** @default 60 */
  expiresSeconds?: number
}

export interface RecentError {
  at: string
  method: string
  path: string
  status: number
  code: string
  message: string
}

export interface CachedHeader {
  header: ChunkHeader
  bytes: Uint8Array
  /** Size and ETag (where the store has one) of the object the header was read from. */
  size: number
  etag: string | undefined
  /**
   * When it was read (Date.now()): a HEAD, which reads nothing else of the object, answers from
   * it only while the presence it pairs with could be no staler (lookup.presenceTtlMs).
   */
  readAt: number
}

export interface GatewayState {
  store: ObjectStore
  rawStore: ObjectStore
  metrics: GatewayMetrics
  lookup: ChainLookup
  coalescer: GetCoalescer | undefined
  /** Decoded headers for ?layers=, tagged with the object version they came from. */
  headers: LRUCache<string, CachedHeader>
  /** Verified calibration bodies by object name (immutable: named by their SHA-256), bounded in bytes. */
  calibrations: LRUCache<string, Uint8Array>
  /**
   * Objects a verification found in a newer writer's format (name|size, heal.ts), kept
   * NEWER_FORMAT_TTL_MS: a GET of one is refused without verifying it again.
   */
  newerFormat: LRUCache<string, true>
  /** Verifications in flight by object name (deduplicated). */
  verifying: Map<string, Promise<Verified>>
  /** Declared bytes of the PUT bodies being received now. */
  inFlight: { bytes: number }
  /** Bytes held for requests now, bounded by limits.maxHeldBytes (reserve before holding). */
  memory: MemoryBudget
  limits: Required<GatewayLimits>
  presign: Required<PresignOptions> | undefined
  prefix: string
  storagePricePerGBMonth: number
  startedAt: number
  recentErrors: RecentError[]
  written: { objects: number; bytes: number }
  /** Use tracking for the cold tier (src/gateway/usage); undefined when turned off. */
  usage?: UsageRecorder
  /** Fleet-wide per-namespace accounting (src/coldtier/accounting.ts); undefined when off. */
  accounting?: FleetAccounting
}

export function createState(opts: {
  store: ObjectStore
  metrics?: GatewayMetrics
  limits?: GatewayLimits
  presign?: PresignOptions
  lookup?: ChainLookupOptions
  coalesce?: false | { maxBytes?: number; maxBufferedBytes?: number }
  prefix?: string
  storagePricePerGBMonth?: number
}): GatewayState {
  if (!opts?.store || typeof opts.store.get !== 'function')
    throw new TypeError('createGateway: options.store is required')
  const metrics = opts.metrics ?? new GatewayMetrics()
  const store = instrumentStore(opts.store, metrics)
  const limits: Required<GatewayLimits> = {
    maxChunkBytes: opts.limits?.maxChunkBytes ?? 512 * 1024 * 1024,
    maxLookupKeys: opts.limits?.maxLookupKeys ?? 4096,
    maxLookupBodyBytes: opts.limits?.maxLookupBodyBytes ?? 512 * 1024,
    bodyIdleTimeoutMs: opts.limits?.bodyIdleTimeoutMs ?? 30_000,
    bodyMinBytesPerSecond: opts.limits?.bodyMinBytesPerSecond ?? 8192,
    readerIdleTimeoutMs: opts.limits?.readerIdleTimeoutMs ?? 30_000,
    readerMinBytesPerSecond: opts.limits?.readerMinBytesPerSecond ?? DEFAULT_READER_MIN_BYTES_PER_SECOND,
    maxInFlightBytes: opts.limits?.maxInFlightBytes ?? 1024 ** 3,
    maxHeldBytes: opts.limits?.maxHeldBytes ?? DEFAULT_MAX_HELD_BYTES,
    maxConcurrentVerifies: opts.limits?.maxConcurrentVerifies ?? 4,
    maxCalibrationBytes: opts.limits?.maxCalibrationBytes ?? 16 * 1024 * 1024,
    calibrationCacheBytes: opts.limits?.calibrationCacheBytes ?? DEFAULT_CALIBRATION_CACHE_BYTES,
  }
  for (const k of Object.keys(opts.limits ?? {})) {
    if (!Object.hasOwn(limits, k)) throw new TypeError(`createGateway: unknown limits.${k}`)
  }
  for (const [k, v] of Object.entries(limits)) {
    const min =
      k === 'bodyMinBytesPerSecond' || k === 'readerMinBytesPerSecond' || k === 'calibrationCacheBytes'
        ? 0
        : 1
    if (!Number.isInteger(v) || v < min) throw new TypeError(`createGateway: invalid limits.${k}`)
  }
  // A request that could never fit would be refused forever: say so at start instead.
  assertFitsBudget(limits.maxHeldBytes, {
    'a calibration PUT (limits.maxCalibrationBytes, held whole)': limits.maxCalibrationBytes,
    'a chunk PUT of limits.maxChunkBytes (read-ahead and store parts)': bodyHoldBytes(
      limits.maxChunkBytes,
      opts.store,
    ),
    'a lookup of limits.maxLookupBodyBytes (body, text and parsed keys)': lookupHoldBytes(
      limits.maxLookupBodyBytes,
      limits.maxLookupKeys,
    ),
  })
  knownKeys(opts.presign, ['minBytes', 'expiresSeconds'], 'presign')
  knownKeys(opts.coalesce || undefined, ['maxBytes', 'maxBufferedBytes'], 'coalesce')
  if (opts.presign && (!Number.isInteger(opts.presign.minBytes) || opts.presign.minBytes < 0)) {
    throw new TypeError('createGateway: invalid presign.minBytes')
  }
  const presignSeconds = opts.presign?.expiresSeconds ?? 60
  if (!Number.isInteger(presignSeconds) || presignSeconds < 1 || presignSeconds > 7 * 24 * 3600)
    throw new TypeError('createGateway: presign.expiresSeconds must be 1..604800 (SigV4 limit)')
  const prefix = opts.prefix ?? 'kvgate'
  // objectName() refuses it too, but as a 400 on every request: refused here, at start.
  if (!isObjectPrefix(prefix)) {
    throw new TypeError(`createGateway: invalid prefix ${JSON.stringify(prefix)}`)
  }
  const memory = new MemoryBudget(limits.maxHeldBytes)
  metrics.extras.push(memory)
  return {
    store,
    rawStore: opts.store,
    metrics,
    lookup: new ChainLookup(store, metrics, opts.lookup),
    coalescer:
      opts.coalesce === false
        ? undefined
        : new GetCoalescer(
            opts.coalesce?.maxBytes ?? 8 * 1024 * 1024,
            opts.coalesce?.maxBufferedBytes,
            memory,
          ),
    // Bounded in bytes too: a header is up to ~1 MiB (65535 sections), decoded a JS object per
    // section; 10 000 of them could pass a Worker isolate's whole memory.
    headers: new LRUCache<string, CachedHeader>({
      max: 10_000,
      maxSize: HEADER_CACHE_BYTES,
      sizeCalculation: (e) => e.bytes.length + e.header.sections.length * DECODED_SECTION_BYTES,
    }),
    calibrations: new LRUCache<string, Uint8Array>({
      // lru-cache wants a positive bound; with 0 the routes put nothing in (they stream every body).
      maxSize: Math.max(1, limits.calibrationCacheBytes),
      sizeCalculation: (b) => Math.max(1, b.length),
    }),
    newerFormat: new LRUCache<string, true>({ max: NEWER_FORMAT_ENTRIES, ttl: NEWER_FORMAT_TTL_MS }),
    verifying: new Map(),
    inFlight: { bytes: 0 },
    memory,
    limits,
    presign:
      opts.presign && opts.store.presignGet
        ? { minBytes: opts.presign.minBytes, expiresSeconds: presignSeconds }
        : undefined,
    prefix,
    storagePricePerGBMonth: opts.storagePricePerGBMonth ?? 0.023,
    startedAt: Date.now(),
    recentErrors: [],
    written: { objects: 0, bytes: 0 },
  }
}

/** Throws on an option key `section` does not have (a typo would silently keep a default). */
export function knownKeys(section: object | undefined, keys: readonly string[], name: string): void {
  if (section === undefined || section === null) return
  for (const k of Object.keys(section))
    if (!keys.includes(k)) throw new TypeError(`createGateway: unknown option ${name ? `${name}.` : ''}${k}`)
}

/** Throws when one request's hold (by what it is) exceeds the budget `max`. */
export function assertFitsBudget(max: number, holds: Record<string, number>): void {
  for (const [what, bytes] of Object.entries(holds)) {
    if (bytes > max)
      throw new TypeError(
        `createGateway: limits.maxHeldBytes (${max}) is below the ${bytes} bytes ${what} holds: raise it or lower that limit`,
      )
  }
}
