// Turns a PUT request body into a stream the store consumes while ChunkVerifier
// checks it: bytes are verified before they are passed on, so a bad header, a bad
// section CRC, a key that disagrees with the path or a short body errors the
// stream before the store can complete the object.

import { FormatError, InvalidKeyError, KvgateError } from '../core/errors.ts'
import { type ChunkHeader, ChunkVerifier } from '../core/format.ts'
import { toHex } from '../core/keys.ts'

const READ_AHEAD_BYTES = 4 * 1024 * 1024

export interface VerifiedBody {
  stream: ReadableStream<Uint8Array>
  /** The verification (or client) failure that ended the stream, if any. */
  failure(): unknown
  /** The decoded header once the stream completed. */
  header(): ChunkHeader | undefined
  bytes(): number
  /**
   * Ends the body for good (the store failed, the request is over): stops the idle
   * watchdog, cancels the source and drops the read-ahead queue. Idempotent; the
   * route calls it in `finally`, so no failure path keeps a timer or buffers alive.
   */
  release(reason?: unknown): void
  /**
   * Reads and drops the rest of the body (the store answered "exists" without taking
   * it), so the client, which may close after sending, reads the answer. Bounded by
   * Content-Length and the idle timeout.
   */
  drain(): Promise<void>
}

/** Where body pieces come from: a web stream's reader or any async iterator (Node's IncomingMessage). */
export interface PieceSource {
  read(): Promise<{ done: boolean; value?: Uint8Array }>
  cancel(reason?: unknown): Promise<void>
}

export function streamSource(stream: ReadableStream<Uint8Array>): PieceSource {
  const reader = stream.getReader()
  return {
    read: () => reader.read(),
    cancel: (reason) => reader.cancel(reason),
  }
}

export function iteratorSource(it: AsyncIterator<Uint8Array>): PieceSource {
  return {
    read: () => it.next() as Promise<{ done: boolean; value?: Uint8Array }>,
    cancel: async (reason) => {
      await it.return?.(reason)
    },
  }
}

export interface VerifiedBodyOptions {
  keyHex: string
  size: number
  maxBytes: number
  idleTimeoutMs: number
  /**
   * A client that, over a window of idleTimeoutMs spent waiting on it, sends less than
   * this many bytes per second (a trickle that never quite stalls) fails with 408. 0 = off.
   */
  minBytesPerSecond?: number
  /** 32 hex: the namespace id the header must carry (a namespace named by its id). */
  namespaceIdHex?: string
}

export function verifiedBody(reader: PieceSource, opts: VerifiedBodyOptions): VerifiedBody {
  const verifier = new ChunkVerifier({ maxBytes: opts.maxBytes })
  let failure: unknown
  let header: ChunkHeader | undefined
  let checkedHeader = false
  let ended = false
  let sourceDone = false
  let sourceCancelled = false
  let controller: ReadableStreamDefaultController<Uint8Array> | undefined
  // One watchdog per body instead of a timer per piece: it re-arms itself for the
  // time left since the last piece and fires only after a real stall. The pending
  // read's reject is held only while that read is outstanding (a promise raced
  // against a never-settling one would keep every piece it ever resolved with).
  let lastPiece = Date.now()
  let abortRead: ((e: unknown) => void) | undefined
  let watchdog: ReturnType<typeof setTimeout> | undefined
  // Time spent waiting on the client and bytes it sent since the last rate check.
  let waitedMs = 0
  let windowBytes = 0
  const minRate = opts.minBytesPerSecond ?? 0
  const stalled = (why: string) =>
    abortRead?.(new KvgateError('ERR_TIMEOUT', `request body ${why}`, { status: 408 }))
  const arm = (ms: number) => {
    watchdog = setTimeout(() => {
      watchdog = undefined
      if (ended) return
      // Only a read the client leaves unanswered counts; a store that is slow to pull does not.
      const idle = abortRead ? Date.now() - lastPiece : 0
      if (idle >= opts.idleTimeoutMs) return stalled(`stalled for ${opts.idleTimeoutMs} ms`)
      const waited = waitedMs + idle
      if (minRate > 0 && waited >= opts.idleTimeoutMs) {
        // Judged only while a read waits on the client (otherwise the store sets the pace).
        if (abortRead && (windowBytes * 1000) / waited < minRate)
          return stalled(`arrives slower than ${minRate} bytes/s`)
        waitedMs = 0
        windowBytes = 0
      }
      arm(opts.idleTimeoutMs - idle)
    }, ms)
  }
  arm(opts.idleTimeoutMs)
  const cancelSource = (reason: unknown) => {
    if (sourceDone || sourceCancelled) return
    sourceCancelled = true
    reader.cancel(reason).catch(() => {})
  }
  const end = (reason?: unknown) => {
    if (ended) return
    ended = true
    clearTimeout(watchdog)
    watchdog = undefined
    if (reason !== undefined) cancelSource(reason)
  }
  const fail = (e: unknown, c: ReadableStreamDefaultController<Uint8Array>) => {
    failure ??= e
    end(e)
    try {
      c.error(failure)
    } catch {
      // already closed or errored
    }
  }
  const readWithDeadline = () =>
    new Promise<{ done: boolean; value?: Uint8Array }>((resolve, reject) => {
      lastPiece = Date.now()
      abortRead = reject
      reader.read().then((r) => {
        windowBytes += r.value?.length ?? 0
        resolve(r)
      }, reject)
    }).finally(() => {
      abortRead = undefined
      waitedMs += Date.now() - lastPiece
    })
  const stream = new ReadableStream<Uint8Array>(
    {
      start(c) {
        controller = c
      },
      async pull(c) {
        try {
          const { done, value } = await readWithDeadline()
          if (done) sourceDone = true
          if (ended) return
          if (done || !value) {
            header = verifier.finish()
            end()
            c.close()
            return
          }
          verifier.push(value)
          const h = verifier.header
          // A store may commit a PUT once Content-Length bytes arrived (S3, R2), before this
          // stream's end where finish() would fail: the piece that completes the body must not
          // pass unless the header is whole, or a body ending inside its header could be stored.
          if (!h && verifier.bytesSeen >= opts.size) {
            throw new FormatError(
              'ERR_FORMAT_TRUNCATED',
              `body ends after ${verifier.bytesSeen} bytes, inside its header`,
            )
          }
          if (h && !checkedHeader) {
            checkedHeader = true
            const bodyKey = toHex(h.chainKey)
            if (bodyKey !== opts.keyHex) {
              throw new InvalidKeyError(`chunk header says key ${bodyKey}, the path says ${opts.keyHex}`)
            }
            if (opts.namespaceIdHex !== undefined && toHex(h.namespaceId) !== opts.namespaceIdHex) {
              throw new FormatError(
                'ERR_FORMAT_BAD_FIELD',
                `chunk header says namespace id ${toHex(h.namespaceId)}, the path says ${opts.namespaceIdHex}`,
              )
            }
            if (h.totalBytes !== opts.size) {
              throw new FormatError(
                'ERR_FORMAT_BAD_FIELD',
                `chunk header declares ${h.totalBytes} bytes, Content-Length is ${opts.size}`,
              )
            }
          }
          c.enqueue(value)
        } catch (e) {
          if (ended && failure === undefined) return
          fail(
            e instanceof KvgateError
              ? e
              : new KvgateError('ERR_INVALID_ARGUMENT', `request body failed: ${(e as Error).message}`, {
                  status: 400,
                  cause: e,
                }),
            c,
          )
        }
      },
      // The store gave up on the body: the route decides whether the rest is drained or dropped.
      cancel() {
        end()
      },
    },
    // Read ahead of the store upload so a client burst and an S3 stall overlap
    // instead of alternating (bounded: a few MiB per request).
    new ByteLengthQueuingStrategy({ highWaterMark: READ_AHEAD_BYTES }),
  )
  return {
    stream,
    failure: () => failure,
    header: () => header,
    bytes: () => verifier.bytesSeen,
    release(reason) {
      const why = reason ?? new KvgateError('ERR_INTERNAL', 'request ended before its body', { status: 500 })
      end()
      cancelSource(why)
      abortRead?.(why)
      // Erroring the stream drops whatever the read-ahead queue still holds.
      try {
        controller?.error(why)
      } catch {
        // already closed or errored
      }
    },
    async drain() {
      end()
      // The same pace as the body had to keep (request-body.ts readPromptly): a trickle would
      // otherwise hold its admission (declared bytes in flight) for as long as it likes.
      const started = Date.now()
      let drained = 0
      while (!sourceDone && !sourceCancelled) {
        const now = Date.now()
        const slow = minRate > 0 ? started + (drained * 1000) / minRate : Number.POSITIVE_INFINITY
        const due = Math.max(started + opts.idleTimeoutMs, slow)
        const why =
          now + opts.idleTimeoutMs <= due
            ? `stalled for ${opts.idleTimeoutMs} ms`
            : `arrives slower than ${minRate} bytes/s`
        let timer: ReturnType<typeof setTimeout> | undefined
        const stalled = new Promise<never>((_, reject) => {
          timer = setTimeout(
            () => reject(new KvgateError('ERR_TIMEOUT', `request body ${why}`, { status: 408 })),
            Math.max(0, Math.min(now + opts.idleTimeoutMs, due) - now),
          )
        })
        try {
          // A read the stream's pull left pending is answered first (reads queue in order).
          const r = await Promise.race([reader.read(), stalled])
          if (r.done) sourceDone = true
          else drained += r.value?.length ?? 0
        } catch (e) {
          cancelSource(e)
          throw e
        } finally {
          clearTimeout(timer)
        }
      }
    },
  }
}
