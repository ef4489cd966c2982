// Request bodies the gateway reads whole (calibration PUTs, lookups) at the pace a chunk
// PUT's streamed body must keep (verified-body.ts): they are reserved in the memory budget
// before the first byte, so a client that stalls or trickles must not hold that
// reservation for the whole request timeout (Node: 5 min; a Worker: as long as the socket).

import { KvgateError } from '../core/errors.ts'
import { concatPieces } from './stores/types.ts'

export interface BodyPace {
  /** A body that sends nothing for this long fails with 408. */
  bodyIdleTimeoutMs: number
  /** A body slower than this on average (bytes/s), once bodyIdleTimeoutMs has passed, fails with 408. 0 = off. */
  bodyMinBytesPerSecond: number
}

/**
 * The whole body: exactly `size` bytes (an Error otherwise), or at most `max` (undefined
 * past it, the body cancelled). 408 ERR_TIMEOUT when it stalls or trickles (BodyPace).
 */
export function readPromptly(
  body: ReadableStream<Uint8Array>,
  limit: { size: number },
  pace: BodyPace,
): Promise<Uint8Array>
export function readPromptly(
  body: ReadableStream<Uint8Array>,
  limit: { max: number },
  pace: BodyPace,
): Promise<Uint8Array | undefined>
export async function readPromptly(
  body: ReadableStream<Uint8Array>,
  limit: { size: number } | { max: number },
  pace: BodyPace,
): Promise<Uint8Array | undefined> {
  const { bodyIdleTimeoutMs: idleMs, bodyMinBytesPerSecond: minRate } = pace
  const exact = 'size' in limit ? new Uint8Array(limit.size) : undefined
  const cap = 'size' in limit ? limit.size : limit.max
  const pieces: Uint8Array[] = []
  const reader = body.getReader()
  const started = Date.now()
  let at = 0
  let timer: ReturnType<typeof setTimeout> | undefined
  try {
    for (;;) {
      const now = Date.now()
      // The next piece is due before the body idles, and before its average falls below minRate.
      const slow = minRate > 0 ? started + (at * 1000) / minRate : Number.POSITIVE_INFINITY
      const due = Math.max(started + idleMs, slow)
      const late = new Promise<never>((_, reject) => {
        timer = setTimeout(
          () =>
            reject(
              new KvgateError(
                'ERR_TIMEOUT',
                now + idleMs <= due
                  ? `request body stalled for ${idleMs} ms`
                  : `request body arrives slower than ${minRate} bytes/s`,
                { status: 408 },
              ),
            ),
          Math.max(0, Math.min(now + idleMs, due) - now),
        )
      })
      const { done, value } = await Promise.race([reader.read(), late])
      clearTimeout(timer)
      if (done) break
      if (at + value.length > cap) {
        if (exact) throw new Error(`body is longer than the declared ${cap} bytes`)
        await reader.cancel().catch(() => {})
        return undefined
      }
      if (exact) exact.set(value, at)
      else pieces.push(value)
      at += value.length
    }
  } catch (e) {
    clearTimeout(timer)
    await reader.cancel(e).catch(() => {})
    throw e
  }
  if (exact) {
    if (at !== exact.length) throw new Error(`body ended at ${at} of ${exact.length} bytes`)
    return exact
  }
  return concatPieces(pieces, at)
}
