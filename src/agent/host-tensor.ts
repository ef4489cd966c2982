// An engine's KV tensor in host shared memory (a /dev/shm file the engine maps as a
// torch tensor): the agent reads and writes block runs with positioned I/O on one fd.

import { closeSync, fstatSync, openSync, readSync, writeSync } from 'node:fs'
import { AgentError } from './protocol.ts'

/**
 * A registered engine KV tensor. Runs are [tensorOffset, hostOffset, bytes] triples;
 * `gather` copies tensor → host, `scatter` host → tensor.
 */
export interface KvTensor {
  gather(runs: readonly number[], host: Uint8Array): void | Promise<void>
  scatter(host: Uint8Array, runs: readonly number[]): void | Promise<void>
}

export class HostTensor implements KvTensor {
  readonly path: string
  readonly offset: number
  readonly bytes: number
  #fd: number | undefined

  constructor(path: string, offset: number, bytes: number) {
    if (typeof path !== 'string' || path.length === 0 || path.includes('\0'))
      throw new AgentError('ERR_INVALID_ARGUMENT', 'invalid tensor path')
    let fd: number
    try {
      fd = openSync(path, 'r+')
    } catch (e) {
      throw new AgentError('ERR_IO', `cannot open ${path}: ${(e as Error).message}`)
    }
    try {
      const st = fstatSync(fd)
      if (!st.isFile()) throw new AgentError('ERR_INVALID_ARGUMENT', `${path} is not a regular file`)
      if (st.size < offset + bytes) {
        throw new AgentError(
          'ERR_LAYOUT',
          `${path} is ${st.size} bytes; the tensor needs ${bytes} bytes at offset ${offset}`,
        )
      }
    } catch (e) {
      closeSync(fd)
      throw e
    }
    this.path = path
    this.offset = offset
    this.bytes = bytes
    this.#fd = fd
  }

  #fdOrThrow(): number {
    if (this.#fd === undefined) throw new AgentError('ERR_CLOSED', `tensor ${this.path} is closed`)
    return this.#fd
  }

  /** Copies `dst.length` bytes from tensor offset `at` into `dst`. */
  read(at: number, dst: Uint8Array): void {
    const fd = this.#fdOrThrow()
    let done = 0
    while (done < dst.length) {
      const n = readSync(fd, dst, done, dst.length - done, this.offset + at + done)
      if (n <= 0) throw new AgentError('ERR_IO', `short read from ${this.path} at ${this.offset + at + done}`)
      done += n
    }
  }

  /** Copies `src` into the tensor at offset `at`. */
  write(at: number, src: Uint8Array): void {
    const fd = this.#fdOrThrow()
    let done = 0
    while (done < src.length) {
      done += writeSync(fd, src, done, src.length - done, this.offset + at + done)
    }
  }

  gather(runs: readonly number[], host: Uint8Array): void {
    forMerged(runs, (t, h, n) => this.read(t, host.subarray(h, h + n)))
  }

  scatter(host: Uint8Array, runs: readonly number[]): void {
    forMerged(runs, (t, h, n) => this.write(t, host.subarray(h, h + n)))
  }

  close(): void {
    if (this.#fd !== undefined) closeSync(this.#fd)
    this.#fd = undefined
  }
}

/** Runs adjacent on both sides (consecutive block ids, as vLLM often allocates) become one syscall. */
function forMerged(
  runs: readonly number[],
  f: (tensorAt: number, hostAt: number, bytes: number) => void,
): void {
  let i = 0
  while (i < runs.length) {
    const t = runs[i]!
    const h = runs[i + 1]!
    let n = runs[i + 2]!
    i += 3
    while (i < runs.length && runs[i] === t + n && runs[i + 1] === h + n) {
      n += runs[i + 2]!
      i += 3
    }
    f(t, h, n)
  }
}
