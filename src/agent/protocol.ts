// The agent's wire protocol (docs/agent-protocol.md): length-prefixed msgpack frames
// over a Unix socket, request ids, out-of-order answers, and stable error codes.

import { Packr, RESET_BUFFER_MODE } from 'msgpackr'

/** Bumped on any incompatible change; a hello with another version is refused. */
export const PROTOCOL_VERSION = 1
/** Default bound on one frame's body; larger frames are refused and the connection closed. */
export const DEFAULT_MAX_FRAME_BYTES = 16 * 1024 * 1024
/** Bytes of the big-endian u32 length in front of every frame. */
export const FRAME_PREFIX_BYTES = 4

/** Stable error codes of the protocol. Never renamed: connectors branch on them. */
export const AGENT_ERROR_CODES = [
  'ERR_BAD_FRAME',
  'ERR_FRAME_TOO_LARGE',
  'ERR_UNKNOWN_OP',
  'ERR_INVALID_ARGUMENT',
  'ERR_PROTOCOL_VERSION',
  'ERR_HELLO_REQUIRED',
  'ERR_MODEL_MISMATCH',
  'ERR_GEOMETRY_MISMATCH',
  'ERR_NOT_REGISTERED',
  'ERR_LAYOUT',
  'ERR_UNKNOWN_REQUEST',
  'ERR_BUSY',
  'ERR_IO',
  'ERR_CUDA',
  'ERR_CLOSED',
  'ERR_INTERNAL',
  'ERR_CANCELLED',
  'ERR_LIMIT',
] as const

export type AgentErrorCode = (typeof AGENT_ERROR_CODES)[number]

/** An error that crosses the socket as `{ id, ok: false, error: { code, message } }`. */
export class AgentError extends Error {
  readonly code: AgentErrorCode
  constructor(code: AgentErrorCode, message: string) {
    super(message)
    this.name = 'AgentError'
    this.code = code
  }
}

// One Packr for the process: plain maps (no records/structures) so any msgpack library reads the
// frames. Its reference extensions (0x69/0x70) are off: they would build cyclic values from a frame.
const packr = new Packr({
  useRecords: false,
  mapsAsObjects: true,
  int64AsType: 'number',
  structuredClone: false,
})

/** Nesting a request may have (request → tensors → tensor → shape is 4); deeper is not a request. */
export const MAX_REQUEST_DEPTH = 16

/** Encodes one message as a frame: u32 BE length + msgpack body. */
export function encodeFrame(message: unknown): Buffer {
  // Packed at the start of packr's one buffer each time (RESET_BUFFER_MODE), then copied out: by
  // default each pack goes on after the last and a full buffer is left to the GC (an 8 KiB
  // ArrayBuffer per ~150 answers).
  const body = packr.pack(message, RESET_BUFFER_MODE)
  const out = Buffer.allocUnsafe(FRAME_PREFIX_BYTES + body.length)
  out.writeUInt32BE(body.length, 0)
  body.copy(out, FRAME_PREFIX_BYTES)
  return out
}

export function decodeBody(body: Uint8Array): unknown {
  return packr.unpack(body)
}

/** Capacity a frame body spanning reads starts with; it doubles up to the frame's length. */
const FIRST_BODY_BYTES = 64 * 1024
/** Largest body buffer a reusing reader keeps for the next frame spanning reads (a larger one is collected). */
export const SPARE_BODY_BYTES = 256 * 1024

/**
 * Cuts a byte stream into frame bodies. Holds at most one partial frame, in one buffer at
 * most twice the bytes received of it (and never past its length): memory per connection is
 * bounded by `maxFrameBytes` whatever the reads' sizes. A frame trickled in 1-byte reads
 * was held as one Buffer per read, some 250 bytes each: gigabytes for one 16 MiB frame.
 */
export class FrameReader {
  readonly #max: number
  /** A length prefix split across reads: its first `#headHave` bytes. */
  readonly #head = Buffer.alloc(FRAME_PREFIX_BYTES)
  #headHave = 0
  /** The body of a frame spanning reads, `#bodyLength` bytes in all, `#bodyHave` of them received. */
  #body: Buffer | undefined
  #bodyLength = 0
  #bodyHave = 0
  /**
   * With `reuse`: the buffer of a frame that spanned reads, free for the next one (`#spare`)
   * once the push that handed it out (`#lent`: its body may be undecoded until then) is over.
   */
  #spare: Buffer | undefined
  #lent: Buffer | undefined
  readonly #reuse: boolean
  /** Set once an oversized length was met: the stream cannot be resynchronised after it. */
  error: AgentError | undefined

  /**
   * `reuse`: a frame spanning reads is assembled in the buffer the last one was (when it fits
   * and is at most {@link SPARE_BODY_BYTES}), so a body is valid only until the next push; for
   * a reader whose bodies are decoded at once, and whose chunks are themselves reused.
   */
  constructor(maxFrameBytes = DEFAULT_MAX_FRAME_BYTES, options: { reuse?: boolean } = {}) {
    this.#max = maxFrameBytes
    this.#reuse = options.reuse === true
  }

  /**
   * Feeds bytes; returns the complete bodies (those inside `chunk` are views of it). On an
   * oversized length it returns the bodies complete before it (valid requests the peer sent
   * first, to be answered) and sets `error` (ERR_FRAME_TOO_LARGE); every later push returns
   * nothing and holds nothing.
   */
  push(chunk: Buffer): Buffer[] {
    const out: Buffer[] = []
    if (this.error) return out
    if (this.#lent !== undefined) {
      this.#spare = this.#lent
      this.#lent = undefined
    }
    let at = 0
    while (at < chunk.length) {
      if (this.#body === undefined) {
        let len: number
        if (this.#headHave === 0 && chunk.length - at >= FRAME_PREFIX_BYTES) {
          len = chunk.readUInt32BE(at)
          at += FRAME_PREFIX_BYTES
        } else {
          const n = Math.min(FRAME_PREFIX_BYTES - this.#headHave, chunk.length - at)
          chunk.copy(this.#head, this.#headHave, at, at + n)
          this.#headHave += n
          at += n
          if (this.#headHave < FRAME_PREFIX_BYTES) break
          this.#headHave = 0
          len = this.#head.readUInt32BE(0)
        }
        if (len > this.#max) {
          this.#spare = undefined
          this.#lent = undefined
          this.error = new AgentError(
            'ERR_FRAME_TOO_LARGE',
            `frame of ${len} bytes exceeds the limit of ${this.#max}`,
          )
          return out
        }
        if (chunk.length - at >= len) {
          out.push(chunk.subarray(at, at + len))
          at += len
          continue
        }
        const spare = this.#spare
        this.#spare = undefined
        const first = Math.min(len, Math.max(FIRST_BODY_BYTES, 2 * (chunk.length - at)))
        // A reusing reader's first one fits any frame up to FIRST_BODY_BYTES, however small this one.
        this.#body =
          spare !== undefined && spare.length >= first
            ? spare
            : Buffer.allocUnsafe(this.#reuse ? Math.max(first, FIRST_BODY_BYTES) : first)
        this.#bodyLength = len
        this.#bodyHave = 0
      }
      const n = Math.min(this.#bodyLength - this.#bodyHave, chunk.length - at)
      if (this.#bodyHave + n > this.#body.length) {
        const grown = Buffer.allocUnsafe(
          Math.min(this.#bodyLength, Math.max(2 * this.#body.length, this.#bodyHave + n)),
        )
        this.#body.copy(grown, 0, 0, this.#bodyHave)
        this.#body = grown
      }
      chunk.copy(this.#body, this.#bodyHave, at, at + n)
      this.#bodyHave += n
      at += n
      if (this.#bodyHave === this.#bodyLength) {
        out.push(this.#body.subarray(0, this.#bodyLength))
        if (this.#reuse && this.#body.length <= SPARE_BODY_BYTES) this.#lent = this.#body
        this.#body = undefined
      }
    }
    return out
  }
}

/** A request as it arrives: `id` (a non-negative integer) and `op` are required. */
export interface Request {
  id: number
  op: string
  [field: string]: unknown
}

/** Validates the envelope of a decoded frame; returns the id when one can be read (for the error frame). */
export function checkEnvelope(msg: unknown): Request {
  if (typeof msg !== 'object' || msg === null || Array.isArray(msg)) {
    throw new AgentError('ERR_BAD_FRAME', 'a frame must hold a map')
  }
  const m = msg as Record<string, unknown>
  if (typeof m.id !== 'number' || !Number.isSafeInteger(m.id) || m.id < 0) {
    throw new AgentError('ERR_BAD_FRAME', 'a request needs an integer id >= 0')
  }
  if (typeof m.op !== 'string') throw new AgentError('ERR_BAD_FRAME', 'a request needs a string op')
  checkPlain(m, 0)
  return m as Request
}

/**
 * Replaces every bin in `msg` (a request that passed {@link checkEnvelope}) with a copy: the
 * decoder's bins are views of the frame, and a reused read buffer's bytes are the next
 * request's once this one's synchronous handling returns.
 */
export function ownBins(msg: Record<string, unknown> | unknown[]): void {
  if (Array.isArray(msg)) {
    for (let i = 0; i < msg.length; i++) {
      const x = msg[i]
      if (x instanceof Uint8Array) msg[i] = Buffer.from(x)
      else if (x !== null && typeof x === 'object') ownBins(x as Record<string, unknown>)
    }
    return
  }
  for (const k of Object.keys(msg)) {
    const x = msg[k]
    if (x instanceof Uint8Array) msg[k] = Buffer.from(x)
    else if (x !== null && typeof x === 'object') ownBins(x as Record<string, unknown>)
  }
}

/**
 * A request holds msgpack's own types only: nil (and msgpackr's undefined), booleans, numbers,
 * strings, bins, arrays and maps. msgpackr decodes extension types into bigints, Dates, typed arrays, Sets, RegExps and
 * Errors, which no field takes and which field checks do not expect (JSON.stringify throws on a
 * bigint): such a frame is ERR_BAD_FRAME, as an undecodable one is, not ERR_INTERNAL.
 */
function checkPlain(v: unknown, depth: number): void {
  if (depth > MAX_REQUEST_DEPTH)
    throw new AgentError('ERR_BAD_FRAME', `a request nests deeper than ${MAX_REQUEST_DEPTH} levels`)
  if (Array.isArray(v)) {
    for (const x of v)
      if (x !== null && typeof x === 'object') checkPlain(x, depth + 1)
      else checkScalar(x)
    return
  }
  if (v instanceof Uint8Array && (Buffer.isBuffer(v) || v.constructor === Uint8Array)) return
  if (v !== null && typeof v === 'object') {
    if (Object.getPrototypeOf(v) !== Object.prototype) notPlain(v)
    for (const x of Object.values(v))
      if (x !== null && typeof x === 'object') checkPlain(x, depth + 1)
      else checkScalar(x)
    return
  }
  checkScalar(v)
}

function checkScalar(v: unknown): void {
  const t = typeof v
  // undefined: msgpackr (this module's encoder, the usual Node one) writes a field left
  // undefined as fixext 0, not as nil; field checks read it as absent, as they read nil.
  if (v !== null && v !== undefined && t !== 'number' && t !== 'string' && t !== 'boolean') notPlain(v)
}

function notPlain(v: unknown): never {
  const what = typeof v === 'object' ? ((v as object).constructor?.name ?? 'an object') : typeof v
  throw new AgentError(
    'ERR_BAD_FRAME',
    `a request holds a msgpack extension value (${what}); the protocol uses plain msgpack types only`,
  )
}
