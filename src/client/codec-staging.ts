// Shared staging memory of one codec worker: a job's input is copied into it and a decoded
// tensor comes back through it, so no job allocates (and page-faults in) chunk-sized buffers.

/** Sizes are rounded up to this, so inputs that vary a little (encoded objects) reuse one buffer. */
const GRAIN = 1 << 20

/**
 * Two growable SharedArrayBuffers, reused by every job of one worker. L1 slots
 * cannot be shared or transferred (they are pinned external memory), so one copy
 * in and one copy out on the calling thread remain; what goes is a fresh 32 MiB
 * buffer per job, whose page faults and zeroing cost as much CPU as the decode itself.
 * Holds the largest job it has seen (one chunk object and one chunk tensor) until its worker goes.
 */
export class CodecStaging {
  #input: SharedArrayBuffer | undefined
  #output: SharedArrayBuffer | undefined

  /** A copy of `bytes` in the input buffer. */
  input(bytes: Uint8Array): Uint8Array {
    this.#input = sized(this.#input, bytes.byteLength)
    const view = new Uint8Array(this.#input, 0, bytes.byteLength)
    view.set(bytes)
    return view
  }

  /** The first `n` bytes of the output buffer, for the worker to fill. */
  output(n: number): Uint8Array {
    this.#output = sized(this.#output, n)
    return new Uint8Array(this.#output, 0, n)
  }

  /** Bytes held (tests watch it stay at one job's size). */
  get bytes(): number {
    return (this.#input?.byteLength ?? 0) + (this.#output?.byteLength ?? 0)
  }
}

function sized(buf: SharedArrayBuffer | undefined, n: number): SharedArrayBuffer {
  if (buf && buf.byteLength >= n) return buf
  return new SharedArrayBuffer(Math.max(GRAIN, Math.ceil(n / GRAIN) * GRAIN))
}
