// Shared staging memory of one codec worker: a job's input is copied into it and a decoded
// tensor comes back through it, so no job allocates (and page-faults in) chunk-sized buffers.

/** Sizes are rounded up to this, so inputs that vary a little (encoded objects) reuse one buffer. */
const GRAIN = 1 << 20

/**
 * SharedArrayBuffers reused by every job of one worker. L1 slots cannot be
 * shared or transferred (they are pinned external memory), so one copy in and
 * one copy out remain (the copy out on the addon's pool where it loads, see hold);
 * what goes is a fresh 32 MiB buffer per job, whose page faults and zeroing cost as
 * much CPU as the decode itself.
 * Outputs alternate between two buffers: the calling thread copies one job's
 * tensor out while the worker decodes the next into the other (the copy is ~15 %
 * of a decode). Holds the largest job it has seen (one chunk object, two chunk
 * tensors) until its worker goes or idles (CodecPoolOptions.stagingIdleMs).
 */
export class CodecStaging {
  #input: SharedArrayBuffer | undefined
  readonly #outputs: (SharedArrayBuffer | undefined)[] = [undefined, undefined]
  /** A copy out of each output buffer still running off the calling thread (see hold). */
  readonly #held: (object | undefined)[] = [undefined, undefined]
  #turn = 0

  /** A copy of `bytes` (of the parts one after another) in the input buffer. */
  input(bytes: Uint8Array | readonly Uint8Array[]): Uint8Array {
    const parts = bytes instanceof Uint8Array ? [bytes] : bytes
    const n = parts.reduce((a, p) => a + p.byteLength, 0)
    this.#input = sized(this.#input, n)
    const view = new Uint8Array(this.#input, 0, n)
    let at = 0
    for (const p of parts) {
      view.set(p, at)
      at += p.byteLength
    }
    return view
  }

  /**
   * The first `n` bytes of the output buffer the previous job did not use, for
   * the worker to fill: valid until the job after next takes it.
   */
  output(n: number): Uint8Array {
    const i = this.#turn
    this.#turn ^= 1
    const buf = sized(this.#outputs[i], n)
    this.#outputs[i] = buf
    return new Uint8Array(buf, 0, n)
  }

  /**
   * Marks the output buffer `view` lies in as being copied out (on the addon's pool, not the
   * calling thread) until `copy` settles. The job after next would take that buffer: the pool
   * hands this worker no job while `nextOutputHeld` (a worker writing into a buffer still being
   * copied out of would put the next chunk's bytes into this one's copy).
   */
  hold(view: Uint8Array, copy: Promise<unknown>): void {
    const i = this.#outputs.indexOf(view.buffer as SharedArrayBuffer)
    if (i < 0) return
    const token = {}
    this.#held[i] = token
    const clear = () => {
      if (this.#held[i] === token) this.#held[i] = undefined
    }
    copy.then(clear, clear)
  }

  /** Whether the output buffer the next output() takes is still being copied out of. */
  get nextOutputHeld(): boolean {
    return this.#held[this.#turn] !== undefined
  }

  /** Which output buffer the next output() takes (the pool notes it before it builds a job's message). */
  get turn(): number {
    return this.#turn
  }

  /**
   * Gives back the output buffer a job took and never used: its message could not be built or
   * posted. The next job then takes that buffer again, not the other one, which the job before
   * is still being copied out of (the pool sends the next job before that copy).
   */
  rewind(turn: number): void {
    this.#turn = turn & 1
  }

  /** Bytes held (tests watch it stay at one job's size). */
  get bytes(): number {
    return this.#outputs.reduce((a, b) => a + (b?.byteLength ?? 0), this.#input?.byteLength ?? 0)
  }
}

function sized(buf: SharedArrayBuffer | undefined, n: number): SharedArrayBuffer {
  if (buf && buf.byteLength >= n) return buf
  return new SharedArrayBuffer(Math.max(GRAIN, Math.ceil(n / GRAIN) * GRAIN))
}
