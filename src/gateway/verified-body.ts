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

export function verifiedBody(
  reader: PieceSource,
  opts: { keyHex: string; size: number; maxBytes: number; idleTimeoutMs: number },
): VerifiedBody {
  const verifier = new ChunkVerifier({ maxBytes: opts.maxBytes })
  let failure: unknown
  let header: ChunkHeader | undefined
  let checkedHeader = false
  // One watchdog per body instead of a timer per piece: it re-arms itself for
  // the time left since the last piece and fires only after a real stall.
  let lastPiece = Date.now()
  let reading = false
  let watchdog: ReturnType<typeof setTimeout> | undefined
  let stall!: (e: unknown) => void
  const stalled = new Promise<never>((_, reject) => {
    stall = reject
  })
  stalled.catch(() => {}) // observed through the race below; never unhandled
  const arm = (ms: number) => {
    watchdog = setTimeout(() => {
      // Only a read the client leaves unanswered counts; a store that is slow to pull does not.
      const idle = reading ? Date.now() - lastPiece : 0
      if (idle >= opts.idleTimeoutMs) {
        stall(
          new KvgateError('ERR_TIMEOUT', `request body stalled for ${opts.idleTimeoutMs} ms`, {
            status: 408,
          }),
        )
      } else arm(opts.idleTimeoutMs - idle)
    }, ms)
  }
  arm(opts.idleTimeoutMs)
  const disarm = () => clearTimeout(watchdog)
  const fail = (e: unknown, c: ReadableStreamDefaultController<Uint8Array>) => {
    failure ??= e
    disarm()
    reader.cancel(e).catch(() => {})
    c.error(failure)
  }
  const readWithDeadline = async () => {
    reading = true
    lastPiece = Date.now()
    try {
      return await Promise.race([reader.read(), stalled])
    } finally {
      reading = false
    }
  }
  const stream = new ReadableStream<Uint8Array>(
    {
      async pull(c) {
        try {
          const { done, value } = await readWithDeadline()
          if (done || !value) {
            header = verifier.finish()
            disarm()
            c.close()
            return
          }
          verifier.push(value)
          const h = verifier.header
          if (h && !checkedHeader) {
            checkedHeader = true
            const bodyKey = toHex(h.chainKey)
            if (bodyKey !== opts.keyHex) {
              throw new InvalidKeyError(`chunk header says key ${bodyKey}, the path says ${opts.keyHex}`)
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
      cancel(reason) {
        disarm()
        reader.cancel(reason).catch(() => {})
      },
    },
    // Read ahead of the store upload so a client burst and an S3 stall overlap
    // instead of alternating (bounded: a few MiB per request).
    new ByteLengthQueuingStrategy({ highWaterMark: READ_AHEAD_BYTES }),
  )
  return { stream, failure: () => failure, header: () => header, bytes: () => verifier.bytesSeen }
}
