// Reads of an accepted engine connection into one buffer of its own, reused by every read.
//
// By default Node hands each read to JS as a Buffer of its own memory (an ArrayBuffer of the
// read's size, outside V8's heap). A 512-key lookup is one 16 KiB read: some 16,000 requests a
// second of them piled up external memory faster than the agent's small JS garbage filled the
// young generation, and V8 collected it with Mark-Compacts (0–8 per 16,000 requests, 3–40 ms
// each, the lookups' p99). Reading into a reused buffer allocates nothing per read.

import type { Socket } from 'node:net'

/** Bytes of a connection's read buffer: a 512-key lookup (16 KiB) and a few answers' worth of requests per read. */
export const READ_BUFFER_BYTES = 64 * 1024

type OnBytes = (bytes: Buffer) => void

/**
 * The Node majors whose `net.js` / `stream_base_commons.js` were read for the fields below and
 * whose CI ran test/agent-read-buffer.test.ts: another major (a later one may keep the field
 * names with another meaning) reads with 'data' events, the public path, costing only speed.
 */
const PRIVATE_ONREAD_MAJORS = [20]
export const PRIVATE_ONREAD_CHECKED = PRIVATE_ONREAD_MAJORS.includes(
  Number(process.versions.node.split('.')[0]),
)

interface UserBufferHandle {
  useUserBuffer?: (buf: Uint8Array) => void
}

/**
 * Calls `onBytes` with each read of `sock`, a view of `buffer` valid until `onBytes` returns
 * (the next read overwrites it): whatever is kept must be copied. `sock` must not have started
 * reading (a server's socket with `pauseOnConnect`); this resumes it.
 *
 * Node offers this as `net.Socket`'s `onread: { buffer, callback }` option, but not for a
 * server's accepted sockets: the two fields that option sets are set here by their
 * descriptions (Node 20 `net.js`; other majors: see PRIVATE_ONREAD_MAJORS). Where this Node has no such fields, reads come as
 * 'data' events (a Buffer each, as before); returns whether the reused buffer is in use.
 */
export function readInto(sock: Socket, buffer: Buffer, onBytes: OnBytes): boolean {
  if (!PRIVATE_ONREAD_CHECKED) {
    sock.on('data', onBytes)
    sock.resume()
    return false
  }
  const handle = (sock as unknown as { _handle?: UserBufferHandle })._handle
  const own = Object.getOwnPropertySymbols(sock)
  const kBuffer = own.find((s) => s.description === 'kBuffer')
  const kBufferCb = own.find((s) => s.description === 'kBufferCb')
  const fields = sock as unknown as Record<symbol, unknown>
  const usable =
    typeof handle?.useUserBuffer === 'function' &&
    kBuffer !== undefined &&
    kBufferCb !== undefined &&
    fields[kBuffer] === null &&
    fields[kBufferCb] === null
  if (usable) {
    fields[kBuffer] = buffer
    fields[kBufferCb] = (n: number) => {
      onBytes(buffer.subarray(0, n))
    }
    handle!.useUserBuffer!(buffer)
  } else sock.on('data', onBytes)
  sock.resume()
  return usable
}
