// Node stream fast path for chunk bodies (the NativeIo the routes may use): the
// request body goes socket → verifying Transform → S3 upload, and a stored object
// goes S3 socket → response socket, as Node streams with pipe backpressure.

import type { IncomingMessage, ServerResponse } from 'node:http'
import { Readable, Transform, type TransformCallback } from 'node:stream'
import { RESPONSE_ALREADY_SENT } from '@hono/node-server/utils/response'
import type { NativeIo } from '../env.ts'
import { asBodyError, type BodyCheck, bodyStalled } from '../verified-body.ts'

// Pieces arrive as the socket delivers them (≤ 64 KiB); this much may queue
// between the client and the S3 upload so neither side's burst stalls the other.
const BODY_BUFFER_BYTES = 1024 * 1024

interface NodeEnv {
  incoming?: IncomingMessage
  outgoing?: ServerResponse
}

export const nodeIo: NativeIo = {
  requestBody(env, check, idleTimeoutMs) {
    const incoming = (env as NodeEnv).incoming
    if (!incoming || incoming.readableDidRead || incoming.readableEnded) return undefined
    return verifyingBody(incoming, check, idleTimeoutMs)
  },
  send(env, status, headers, body) {
    const outgoing = (env as NodeEnv).outgoing
    if (!outgoing || !(body instanceof Readable))
      throw new TypeError('nodeIo.send needs a Node response and Readable')
    outgoing.writeHead(status, headers)
    body.on('error', (e) => outgoing.destroy(e))
    // A client that goes away must release the S3 socket too.
    outgoing.once('close', () => {
      if (!body.readableEnded) body.destroy()
    })
    body.pipe(outgoing)
    return RESPONSE_ALREADY_SENT
  },
}

function verifyingBody(
  incoming: IncomingMessage,
  check: BodyCheck,
  idleTimeoutMs: number,
): { body: Readable; failure(): unknown } {
  let failure: unknown
  let lastPiece = Date.now()
  let watchdog: ReturnType<typeof setTimeout> | undefined
  const body = new Transform({
    readableHighWaterMark: BODY_BUFFER_BYTES,
    writableHighWaterMark: BODY_BUFFER_BYTES,
    transform(piece: Buffer, _enc: BufferEncoding, cb: TransformCallback) {
      lastPiece = Date.now()
      try {
        check.push(piece)
      } catch (e) {
        cb(e as Error)
        return
      }
      cb(null, piece)
    },
    flush(cb: TransformCallback) {
      clearTimeout(watchdog)
      try {
        check.finish()
      } catch (e) {
        cb(e as Error)
        return
      }
      cb()
    },
  })
  const fail = (e: unknown) => {
    failure ??= asBodyError(e)
    clearTimeout(watchdog)
    // The request itself stays open: the adapter drains it after the error answer.
    incoming.unpipe(body)
    body.destroy(failure as Error)
  }
  body.on('error', (e) => {
    failure ??= asBodyError(e)
    clearTimeout(watchdog)
    incoming.unpipe(body)
  })
  incoming.once('error', fail)
  // A client gone mid-body: without this the upload would wait for bytes that never come.
  incoming.once('aborted', () => fail(new Error('client closed the connection')))
  incoming.once('end', () => clearTimeout(watchdog))
  // One watchdog per body: only time spent waiting on the client counts (the
  // request is flowing); a store that is slow to take bytes pauses it.
  const arm = (ms: number) => {
    watchdog = setTimeout(() => {
      if (incoming.readableFlowing === false) lastPiece = Date.now()
      const idle = Date.now() - lastPiece
      if (idle >= idleTimeoutMs) fail(bodyStalled(idleTimeoutMs))
      else arm(idleTimeoutMs - idle)
    }, ms)
    watchdog.unref?.()
  }
  arm(idleTimeoutMs)
  incoming.pipe(body)
  return { body, failure: () => failure }
}
