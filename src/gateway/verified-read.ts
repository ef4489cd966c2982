// Checks what a GET serves while it streams out of the store: a whole object through
// ChunkVerifier (header, every section CRC, exact length, chain key, namespace id),
// a layer subset through its sections' CRCs. A failed check errors the response, so
// the client sees a failed body, never a complete wrong one.

import { crc32 } from '../core/checksum.ts'
import { FormatError, InvalidKeyError, KvgateError, StoreError } from '../core/errors.ts'
import { type ChunkHeader, ChunkVerifier } from '../core/format.ts'
import { toHex } from '../core/keys.ts'

/**
 * Incremental check over the bytes of one response. push() and finish() throw on a bad object;
 * finish() may settle first what a bad object needs (a delete) before the response fails.
 */
export interface StreamCheck {
  push(bytes: Uint8Array): void
  finish(): void | Promise<void>
}

/** The whole object: format, checksums, exact length and identity (key, namespace id). */
export function objectCheck(opts: {
  keyHex: string
  namespaceIdHex?: string
  maxBytes: number
}): StreamCheck & {
  header(): ChunkHeader | undefined
  /** True until the object's header has decoded (a failure before it is the header's). */
  headerUndecoded(): boolean
} {
  const v = new ChunkVerifier({ maxBytes: opts.maxBytes })
  let checked = false
  let done: ChunkHeader | undefined
  return {
    push(bytes) {
      v.push(bytes)
      const h = v.header
      if (h && !checked) {
        checked = true
        checkIdentity(h, opts)
      }
    },
    finish() {
      done = v.finish()
    },
    header: () => done,
    headerUndecoded: () => v.header === undefined,
  }
}

export function checkIdentity(h: ChunkHeader, opts: { keyHex: string; namespaceIdHex?: string }): void {
  const key = toHex(h.chainKey)
  if (key !== opts.keyHex)
    throw new InvalidKeyError(`stored chunk says key ${key}, its name says ${opts.keyHex}`)
  if (opts.namespaceIdHex !== undefined && toHex(h.namespaceId) !== opts.namespaceIdHex) {
    throw new FormatError(
      'ERR_FORMAT_BAD_FIELD',
      `stored chunk says namespace id ${toHex(h.namespaceId)}, its namespace is ${opts.namespaceIdHex}`,
    )
  }
}

/** Sections first..last (contiguous from the first one's offset): each one's CRC. */
export function sectionsCheck(header: ChunkHeader, first: number, last: number): StreamCheck {
  let section = first
  let inSection = 0
  let crc = 0
  const close = () => {
    for (let s = header.sections[section]; s && section <= last && inSection === s.length; ) {
      if (crc !== s.crc32)
        throw new FormatError('ERR_FORMAT_CHECKSUM', `section ${section} checksum mismatch`)
      section++
      inSection = 0
      crc = 0
      s = header.sections[section]
    }
  }
  return {
    push(bytes) {
      let input = bytes
      close()
      while (input.length > 0) {
        const s = header.sections[section]
        if (!s || section > last)
          throw new FormatError('ERR_FORMAT_BAD_FIELD', 'store sent more bytes than the layers span')
        const take = Math.min(s.length - inSection, input.length)
        crc = crc32(input.subarray(0, take), crc)
        inSection += take
        input = input.subarray(take)
        close()
      }
    },
    finish() {
      close()
      if (section <= last)
        throw new FormatError('ERR_FORMAT_TRUNCATED', `layers end inside section ${section}`)
    },
  }
}

/**
 * A byte range: its bytes are the client's to check, its length is ours. A store body that
 * ends short (fs: a file truncated under the read) or runs long fails the response instead
 * of ending it quietly off its Content-Length (a client would wait on the kept-alive socket).
 */
export function lengthCheck(length: number): StreamCheck {
  let seen = 0
  return {
    push(bytes) {
      seen += bytes.length
      if (seen > length) throw new StoreError(`the store sent more than the ${length} bytes of the range`)
    },
    finish() {
      if (seen !== length) throw new StoreError(`the store sent ${seen} of the ${length} bytes of the range`)
    },
  }
}

export interface CheckedStreamOptions {
  /** Called once with the check's failure (a corrupt stored object). */
  onCorrupt(e: unknown): void
  /** A reader that pulls nothing for this long is cut off and the store stream released. 0 = never. */
  idleTimeoutMs: number
  /**
   * A reader that, over a window of idleTimeoutMs spent waiting on it (not on the store), takes
   * less than this many bytes per second is cut off too: a trickle that never quite idles would
   * otherwise hold the store stream (S3 read-ahead, a file handle) as long as it likes. 0 = off.
   */
  minBytesPerSecond?: number
  /** Called when the reader was cut off (idle or slow); true when it closed the connection. */
  onCutOff?(why: 'idle' | 'slow'): boolean
  /** Called once when the stream ends, however (read out, failed, cancelled, cut off). */
  onEnd?(): void
}

/** A store body being read: a stream's reader, or one whose front was read already (resumedReader). */
export type PieceReader = Pick<ReadableStreamDefaultReader<Uint8Array>, 'read' | 'cancel'>

/**
 * `head`'s pieces, then the rest of `reader`: a body whose front was read already (a header
 * looked at before answering), handed on without another stream between the store and the
 * client (one more hop per piece: an S3 socket's pieces are 16–64 KiB).
 */
export function resumedReader(head: Uint8Array[], reader: PieceReader): PieceReader {
  let next = 0
  return {
    read() {
      if (next >= head.length) return reader.read()
      const value = head[next]!
      head[next++] = EMPTY
      return Promise.resolve({ done: false, value })
    },
    cancel: (reason) => reader.cancel(reason),
  }
}

const EMPTY = new Uint8Array(0)

/**
 * `src` passed through `check`. One piece is held back until the next read (or the
 * end) proves it sound, so a failure found at the end (short object) still arrives
 * before the client has the whole body. Cancel, idle and slow cut-offs release `src`.
 */
export function checkedStream(
  src: ReadableStream<Uint8Array> | PieceReader,
  check: StreamCheck | undefined,
  opts: CheckedStreamOptions,
): ReadableStream<Uint8Array> {
  const reader = src instanceof ReadableStream ? src.getReader() : src
  let held: Uint8Array | undefined
  let ended = false
  let inStoreRead = false
  let lastPull = Date.now()
  let controller: ReadableStreamDefaultController<Uint8Array> | undefined
  let watchdog: ReturnType<typeof setTimeout> | undefined
  // The rate window, as verified-body.ts keeps it for a PUT: time spent waiting on the
  // reader (a store read in progress is the store's time) and the bytes it took meanwhile.
  const minRate = opts.minBytesPerSecond ?? 0
  let windowStart = Date.now()
  let storeMs = 0
  let storeReadSince = 0
  let windowBytes = 0
  // The last piece given the reader since the window began: taken whole at once, it is read
  // out over the time after, into the next window (see the verdict below).
  let lastOut = 0
  const end = (reason?: unknown) => {
    if (ended) return
    ended = true
    clearTimeout(watchdog)
    held = undefined
    opts.onEnd?.()
    if (reason !== undefined) reader.cancel(reason).catch(() => {})
  }
  const cutOff = (why: 'idle' | 'slow') => {
    const e = new KvgateError(
      'ERR_TIMEOUT',
      why === 'idle'
        ? `reader idle for ${opts.idleTimeoutMs} ms`
        : `reader takes less than ${minRate} bytes/s`,
      { status: 408 },
    )
    end(e)
    // With the connection closed the adapter cancels this stream as a client gone away;
    // otherwise fail the stream so whoever reads it next learns why.
    if (opts.onCutOff?.(why)) return
    try {
      controller?.error(e)
    } catch {
      // already closed
    }
  }
  const arm = (ms: number) => {
    watchdog = setTimeout(() => {
      watchdog = undefined
      if (ended) return
      const now = Date.now()
      // Waiting on the store is the store's business (it has its own timeouts).
      const idle = inStoreRead ? 0 : now - lastPull
      if (idle >= opts.idleTimeoutMs) return cutOff('idle')
      let next = opts.idleTimeoutMs - idle
      if (minRate > 0) {
        const waited = now - windowStart - storeMs - (inStoreRead ? now - storeReadSince : 0)
        // Judged only while the stream waits on the reader (during a store read the store sets
        // the pace): a window that ends in one is judged once the read is over, looked at every
        // eighth of a window meanwhile rather than in a tight loop.
        if (waited >= opts.idleTimeoutMs && !inStoreRead) {
          if ((windowBytes * 1000) / waited < minRate) return cutOff('slow')
          windowStart = now
          storeMs = 0
          // Pieces are counted when given, so a window of a reader that keeps the rate may hold
          // one piece fewer than it read (a 1 MiB piece read at 66 KiB/s spans half a 30 s
          // window): the piece given last before it began counts in it too, once.
          windowBytes = lastOut
          lastOut = 0
        } else next = Math.min(next, Math.max(opts.idleTimeoutMs - waited, opts.idleTimeoutMs / 8))
      }
      arm(next)
    }, ms)
  }
  if (opts.idleTimeoutMs > 0) arm(opts.idleTimeoutMs)
  return new ReadableStream<Uint8Array>({
    start(c) {
      controller = c
    },
    async pull(c) {
      lastPull = Date.now()
      try {
        for (;;) {
          inStoreRead = true
          storeReadSince = Date.now()
          let r: ReadableStreamReadResult<Uint8Array>
          try {
            r = await reader.read()
          } finally {
            inStoreRead = false
            lastPull = Date.now()
            storeMs += lastPull - storeReadSince
          }
          if (ended) return
          if (r.done) {
            try {
              await check?.finish()
            } catch (e) {
              opts.onCorrupt(e)
              throw e
            }
            if (held) c.enqueue(held)
            end()
            c.close()
            return
          }
          // An empty read is not a piece: held back, it would let the real last piece through
          // before the end proves it (the client then has every byte of a bad object).
          if (r.value.length === 0) continue
          try {
            check?.push(r.value)
          } catch (e) {
            opts.onCorrupt(e)
            throw e
          }
          const out = held
          held = r.value
          if (out) {
            windowBytes += out.length
            lastOut = out.length
            c.enqueue(out)
            return
          }
        }
      } catch (e) {
        if (ended) return
        end(e)
        c.error(e)
      }
    },
    cancel(reason) {
      end(reason ?? new Error('response cancelled'))
    },
  })
}
