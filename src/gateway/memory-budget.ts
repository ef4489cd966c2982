// The bytes the gateway itself holds for requests at once: read-ahead queues, multipart
// parts, whole-held bodies (calibration PUTs), coalesced GET buffers. A request reserves
// what it will hold before it holds it; a reservation that would pass the limit is
// refused (PUTs answer 503 ERR_BUSY, GETs stream instead of buffering), so a busy
// gateway backs clients off instead of dying of OOM (a 128 MB Worker isolate).
// Declared bytes (Content-Length) are not memory: a 90 MiB chunk streams through a few
// MiB of read-ahead, and a 16 MiB calibration is held whole.

const MIB = 1024 * 1024

/**
 * A PUT body's read-ahead (verified-body.ts) plus the pieces in transit: one piece past
 * the queue's mark, one in the store's pump. Pieces are ≤ 64 KiB on Node and workerd;
 * the margin is generous so the reservation is an upper bound.
 */
export const BODY_HOLD_BYTES = 5 * MIB

/** Bytes a store holds to write a body of `size` bytes beyond the stream (ObjectStore.putHoldBytes). */
export interface HoldingStore {
  putHoldBytes?(size: number): number
}

/** What one streamed PUT of `size` bytes holds: read-ahead and the store's own buffers (parts). */
export function bodyHoldBytes(size: number, store: HoldingStore): number {
  return Math.min(size, BODY_HOLD_BYTES) + (store.putHoldBytes?.(size) ?? 0)
}

/** JSON values a lookup body may hold besides its keys ("sizes", fields kvgate ignores). */
export const LOOKUP_EXTRA_VALUES = 64

/**
 * V8 heap per JSON structural character (`{ [ , :`) of a parsed body, beyond its characters:
 * measured on Node 20 at 47–138 bytes (`{}` 47, a 64-hex key 88, objects with distinct
 * property names 138: each gets its own map). The lookup route refuses a body with more than
 * maxLookupKeys + LOOKUP_EXTRA_VALUES of them before parsing it.
 */
const LOOKUP_VALUE_BYTES = 256

/**
 * What one lookup holds while it is parsed: the body's bytes, the decoded text and the parsed
 * strings (about the body's size each), and the heap of its parsed values: at most
 * `maxKeys` + LOOKUP_EXTRA_VALUES structural characters (two per three bytes in a smaller
 * body: `[],[],…`). `bodyBytes` is its Content-Length, or the body cap when it declares none
 * (chunked): reserved before the first byte is read.
 */
export function lookupHoldBytes(bodyBytes: number, maxKeys: number): number {
  const values = Math.min(Math.floor((2 * bodyBytes) / 3) + 1, maxKeys + LOOKUP_EXTRA_VALUES)
  return 3 * bodyBytes + LOOKUP_VALUE_BYTES * values
}

/** A reservation: released once, whatever path ends it (release is idempotent). */
export interface MemoryLease {
  readonly bytes: number
  release(): void
}

export class MemoryBudget {
  #held = 0
  #peak = 0

  constructor(readonly limit: number) {
    if (!Number.isSafeInteger(limit) || limit < 1) throw new TypeError(`invalid memory budget ${limit}`)
  }

  /** Bytes reserved now. */
  get held(): number {
    return this.#held
  }

  /** The most bytes ever reserved at once (never above the limit). */
  get peak(): number {
    return this.#peak
  }

  /** A lease of `bytes`, or undefined when it would take the bytes held past the limit. */
  tryReserve(bytes: number): MemoryLease | undefined {
    if (!Number.isSafeInteger(bytes) || bytes < 0) throw new TypeError(`invalid reservation ${bytes}`)
    if (this.#held + bytes > this.limit) return undefined
    this.#held += bytes
    if (this.#held > this.#peak) this.#peak = this.#held
    let held = true
    return {
      bytes,
      release: () => {
        if (!held) return
        held = false
        this.#held -= bytes
      },
    }
  }

  /** Prometheus gauges (rendered with the gateway's metrics). */
  render(): string[] {
    const gauge = (name: string, help: string, v: number) => [
      `# HELP ${name} ${help}`,
      `# TYPE ${name} gauge`,
      `${name} ${v}`,
    ]
    return [
      ...gauge(
        'kvgate_held_bytes',
        'Bytes the gateway holds for requests now (read-ahead, parts, bodies)',
        this.#held,
      ),
      ...gauge('kvgate_held_bytes_peak', 'The most bytes held for requests at once since start', this.#peak),
      ...gauge(
        'kvgate_held_bytes_limit',
        'The bound on bytes held for requests (limits.maxHeldBytes)',
        this.limit,
      ),
    ]
  }
}

/** Node's default bound: a server process; configurable (maxHeldBytes, KVGATE_MAX_HELD_BYTES). */
export const DEFAULT_MAX_HELD_BYTES = 256 * MIB

/**
 * A Worker isolate has 128 MB (122 MiB) for everything. Of it: ~16 MiB for the runtime,
 * the bundle and the JS heap's own objects (the presence cache; the decoded header cache,
 * 8 MiB at most: HEADER_CACHE_BYTES), 8 MiB for the calibration cache, and the rest left as headroom for bytes released but not yet
 * collected (V8 frees ArrayBuffers at its next GC, not at release) — half of what remains.
 * 48 MiB admits three 16 MiB calibration PUTs, three multipart chunk PUTs (5 MiB read-ahead
 * + an 8 MiB part) or nine streamed ones at once; the next one gets 503 ERR_BUSY.
 */
export const WORKER_MAX_HELD_BYTES = 48 * MIB

/** Presence-cache entries in a Worker (~190 bytes each, measured: ~4 MiB of the isolate). */
export const WORKER_PRESENCE_ENTRIES = 20_000

/** What a Lambda runtime takes before the gateway holds anything: Node, the AWS SDK, the bundle. */
const LAMBDA_RUNTIME_BYTES = 96 * MIB

/**
 * A Lambda function's bound from its configured memory (AWS_LAMBDA_FUNCTION_MEMORY_SIZE, in
 * MiB): half of what the runtime leaves (the other half is GC headroom), at least 16 MiB.
 * 256 MB (the module's minimum) → 80 MiB; 1024 MB (its default) → 464 MiB.
 */
export function lambdaMaxHeldBytes(memoryMiB: number): number {
  return Math.max(16 * MIB, Math.floor((memoryMiB * MIB - LAMBDA_RUNTIME_BYTES) / 2))
}
