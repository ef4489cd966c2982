// llama2.c's tokenizer (tokenizer.bin format): byte-level BPE that merges the
// highest-scoring adjacent pair first, with <0xHH> byte fallback. Runtime-neutral.
//
// File: int32 max_token_len, then per token: float32 score, int32 byte length, bytes.
// Encoding follows llama2.c run.c `encode` exactly (dummy-prefix space, UTF-8 code
// points looked up whole, else one token per byte at id byte+3, then greedy merges
// with ties broken leftmost) but in O(n log n) with a heap instead of rescanning.

import { ModelError } from './model-error.ts'

export const BOS_ID = 1
export const EOS_ID = 2
/** Byte b (0..255) encodes as token b + BYTE_OFFSET when no piece covers it. */
export const BYTE_OFFSET = 3

export interface ParseTokenizerOptions {
  /** Expected token count (the model's vocab_size); when omitted, read to the end. */
  vocabSize?: number
}

export interface EncodeOptions {
  /** Prepend BOS (id 1). @default true */
  bos?: boolean
  /** Append EOS (id 2). @default false */
  eos?: boolean
}

export interface DecodeOptions {
  /** Drop BOS/EOS pieces (their text is "\n<s>\n" / "\n</s>\n"). @default true */
  skipSpecial?: boolean
}

const MAX_TOKEN_LEN = 1024
const MAX_VOCAB = 1 << 20
const BYTE_PIECE = /^<0x([0-9A-Fa-f]{2})>$/

// Pieces are looked up by "binary strings" (one char per byte), which keeps UTF-8
// fragments and raw bytes distinct and lets a Map do the lookup.
function binary(bytes: Uint8Array): string {
  let s = ''
  for (let i = 0; i < bytes.length; i++) s += String.fromCharCode(bytes[i]!)
  return s
}

const utf8 = new TextEncoder()

export class Tokenizer {
  readonly vocabSize: number
  readonly maxTokenLength: number
  readonly scores: Float32Array
  /** Raw bytes of each piece (as stored; byte tokens are the text "<0xHH>"). */
  readonly pieces: readonly Uint8Array[]
  readonly #ids = new Map<string, number>()
  readonly #keys: string[]
  /** Bytes a piece decodes to (byte tokens resolved to their single byte). */
  readonly #decoded: Uint8Array[]

  constructor(pieces: Uint8Array[], scores: Float32Array, maxTokenLength: number) {
    if (pieces.length !== scores.length) throw new ModelError('tokenizer: pieces and scores differ in length')
    this.vocabSize = pieces.length
    this.maxTokenLength = maxTokenLength
    this.scores = scores
    this.pieces = pieces
    this.#keys = pieces.map(binary)
    // First occurrence wins for duplicate pieces.
    for (let i = this.#keys.length - 1; i >= 0; i--) this.#ids.set(this.#keys[i]!, i)
    this.#decoded = this.#keys.map((k, i) => {
      const m = BYTE_PIECE.exec(k)
      return m ? Uint8Array.of(Number.parseInt(m[1]!, 16)) : pieces[i]!
    })
  }

  /** Token id of a piece given as text, or -1. */
  pieceId(piece: string): number {
    return this.#ids.get(binary(utf8.encode(piece))) ?? -1
  }

  /** Encodes text to token ids the way llama2.c does. */
  encode(text: string, opts: EncodeOptions = {}): number[] {
    if (typeof text !== 'string') throw new ModelError('tokenizer: encode expects a string')
    const { bos = true, eos = false } = opts
    const bytes = utf8.encode(text)
    const tokens: number[] = []
    if (bos) tokens.push(BOS_ID)
    if (bytes.length > 0) {
      const prefix = this.#ids.get(' ')
      if (prefix === undefined)
        throw new ModelError('tokenizer: vocabulary has no " " piece for the dummy prefix')
      tokens.push(prefix)
    }
    // One code point at a time (at most 4 bytes, like run.c), byte fallback otherwise.
    let i = 0
    while (i < bytes.length) {
      let j = i + 1
      while (j < bytes.length && (bytes[j]! & 0xc0) === 0x80 && j - i < 4) j++
      const id = this.#ids.get(binary(bytes.subarray(i, j)))
      if (id !== undefined) tokens.push(id)
      else for (let b = i; b < j; b++) tokens.push(bytes[b]! + BYTE_OFFSET)
      i = j
    }
    const merged = this.#merge(tokens)
    if (eos) merged.push(EOS_ID)
    return merged
  }

  /** Greedy BPE: repeatedly merge the best-scoring adjacent pair (leftmost on ties). */
  #merge(tokens: number[]): number[] {
    const n = tokens.length
    if (n < 2) return tokens
    const id = Int32Array.from(tokens)
    const next = new Int32Array(n)
    const prev = new Int32Array(n)
    const version = new Uint32Array(n)
    for (let i = 0; i < n; i++) {
      next[i] = i + 1 < n ? i + 1 : -1
      prev[i] = i - 1
    }
    const heap = new PairHeap()
    const consider = (left: number): void => {
      if (left < 0) return
      const right = next[left]!
      if (right < 0) return
      const m = this.#ids.get(this.#keys[id[left]!]! + this.#keys[id[right]!]!)
      // run.c starts its best score at -1e10: pieces scored at or below never merge.
      if (m === undefined || !(this.scores[m]! > -1e10)) return
      heap.push(this.scores[m]!, left, right, m, version[left]!, version[right]!)
    }
    for (let i = 0; i + 1 < n; i++) consider(i)
    while (heap.size > 0) {
      const e = heap.pop()
      const { left, right } = e
      // Stale entries: a side was merged away or rewritten since the pair was pushed.
      if (next[left] !== right || version[left] !== e.vLeft || version[right] !== e.vRight) continue
      id[left] = e.merged
      version[left]!++
      version[right]!++ // `right` is dead; any pair naming it is now stale.
      const after = next[right]!
      next[left] = after
      if (after >= 0) prev[after] = left
      consider(prev[left]!)
      consider(left)
    }
    const out: number[] = []
    for (let i = 0; i >= 0; i = next[i]!) out.push(id[i]!)
    return out
  }

  /** Bytes of token `id` when it follows `prev` (run.c drops the space after BOS). */
  pieceBytes(prev: number, id: number): Uint8Array {
    const b = this.#decoded[id]
    if (b === undefined) throw new ModelError(`tokenizer: token id ${id} is outside 0..${this.vocabSize - 1}`)
    return prev === BOS_ID && b[0] === 0x20 ? b.subarray(1) : b
  }

  /** UTF-8 bytes of a token sequence. */
  decodeBytes(ids: ArrayLike<number>, opts: DecodeOptions = {}): Uint8Array {
    const { skipSpecial = true } = opts
    const parts: Uint8Array[] = []
    let total = 0
    let prev = -1
    for (let i = 0; i < ids.length; i++) {
      const t = ids[i]!
      if (!(skipSpecial && (t === BOS_ID || t === EOS_ID))) {
        const p = this.pieceBytes(prev, t)
        parts.push(p)
        total += p.length
      }
      prev = t
    }
    const out = new Uint8Array(total)
    let o = 0
    for (const p of parts) {
      out.set(p, o)
      o += p.length
    }
    return out
  }

  /** Text of a token sequence (invalid UTF-8 from stray byte tokens becomes U+FFFD). */
  decode(ids: ArrayLike<number>, opts: DecodeOptions = {}): string {
    return new TextDecoder().decode(this.decodeBytes(ids, opts))
  }
}

/** Max-heap of candidate merges by (score desc, left position asc). */
class PairHeap {
  #score: number[] = []
  #left: number[] = []
  #right: number[] = []
  #merged: number[] = []
  #vl: number[] = []
  #vr: number[] = []
  size = 0

  #before(a: number, b: number): boolean {
    const sa = this.#score[a]!
    const sb = this.#score[b]!
    return sa > sb || (sa === sb && this.#left[a]! < this.#left[b]!)
  }

  #swap(a: number, b: number): void {
    for (const arr of [this.#score, this.#left, this.#right, this.#merged, this.#vl, this.#vr]) {
      const t = arr[a]!
      arr[a] = arr[b]!
      arr[b] = t
    }
  }

  push(score: number, left: number, right: number, merged: number, vl: number, vr: number): void {
    let i = this.size++
    this.#score[i] = score
    this.#left[i] = left
    this.#right[i] = right
    this.#merged[i] = merged
    this.#vl[i] = vl
    this.#vr[i] = vr
    while (i > 0) {
      const p = (i - 1) >> 1
      if (!this.#before(i, p)) break
      this.#swap(i, p)
      i = p
    }
  }

  pop(): { left: number; right: number; merged: number; vLeft: number; vRight: number } {
    const top = {
      left: this.#left[0]!,
      right: this.#right[0]!,
      merged: this.#merged[0]!,
      vLeft: this.#vl[0]!,
      vRight: this.#vr[0]!,
    }
    const last = --this.size
    if (last > 0) {
      this.#swap(0, last)
      let i = 0
      for (;;) {
        const l = 2 * i + 1
        const r = l + 1
        let m = i
        if (l < last && this.#before(l, m)) m = l
        if (r < last && this.#before(r, m)) m = r
        if (m === i) break
        this.#swap(i, m)
        i = m
      }
    }
    return top
  }
}

/** Parses tokenizer.bin bytes. Throws ModelError on a truncated or malformed file. */
export function parseTokenizer(bytes: Uint8Array, opts: ParseTokenizerOptions = {}): Tokenizer {
  if (!(bytes instanceof Uint8Array)) throw new ModelError('tokenizer: expected bytes (Uint8Array)')
  const { vocabSize } = opts
  if (vocabSize !== undefined && (!Number.isInteger(vocabSize) || vocabSize < 1 || vocabSize > MAX_VOCAB)) {
    throw new ModelError(`tokenizer: vocabSize ${vocabSize} outside 1..${MAX_VOCAB}`)
  }
  const dv = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength)
  if (bytes.byteLength < 4) throw new ModelError(`tokenizer truncated: ${bytes.byteLength} bytes, no header`)
  const maxLen = dv.getInt32(0, true)
  if (maxLen < 1 || maxLen > MAX_TOKEN_LEN) {
    throw new ModelError(
      `tokenizer: max_token_length ${maxLen} outside 1..${MAX_TOKEN_LEN} (not a tokenizer.bin?)`,
    )
  }
  const pieces: Uint8Array[] = []
  const scores: number[] = []
  let off = 4
  while (vocabSize === undefined ? off < bytes.byteLength : pieces.length < vocabSize) {
    if (pieces.length >= MAX_VOCAB) throw new ModelError(`tokenizer: more than ${MAX_VOCAB} tokens`)
    const i = pieces.length
    if (off + 8 > bytes.byteLength) {
      throw new ModelError(`tokenizer truncated at token ${i} (offset ${off} of ${bytes.byteLength} bytes)`)
    }
    const score = dv.getFloat32(off, true)
    const len = dv.getInt32(off + 4, true)
    if (!Number.isFinite(score)) throw new ModelError(`tokenizer: token ${i} has a non-finite score`)
    if (len < 0 || len > maxLen) {
      throw new ModelError(`tokenizer: token ${i} has length ${len}, outside 0..max_token_length ${maxLen}`)
    }
    off += 8
    if (off + len > bytes.byteLength) {
      throw new ModelError(`tokenizer truncated in token ${i}'s bytes (needs ${len} at offset ${off})`)
    }
    pieces.push(bytes.slice(off, off + len))
    scores.push(score)
    off += len
  }
  if (off !== bytes.byteLength) {
    throw new ModelError(`tokenizer: ${bytes.byteLength - off} trailing bytes after ${pieces.length} tokens`)
  }
  if (pieces.length <= BYTE_OFFSET + 255) {
    throw new ModelError(
      `tokenizer: ${pieces.length} tokens cannot hold the 256 byte-fallback tokens at ids 3..258`,
    )
  }
  return new Tokenizer(pieces, Float32Array.from(scores), maxLen)
}
