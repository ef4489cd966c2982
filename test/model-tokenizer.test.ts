import { describe, expect, it } from 'vitest'
import {
  BOS_ID,
  EOS_ID,
  findSharedData,
  loadTokenizerFile,
  ModelError,
  parseTokenizer,
  type Tokenizer,
} from '../src/model/index.ts'
import { tokenizerBytes } from './model-fixtures.ts'

const bytePieces = Array.from(
  { length: 256 },
  (_, b) => `<0x${b.toString(16).toUpperCase().padStart(2, '0')}>`,
)

/** A small vocab: specials, bytes, then merges with chosen scores. */
function smallTokenizer(extra: [string, number][]): Tokenizer {
  const pieces = ['<unk>', '\n<s>\n', '\n</s>\n', ...bytePieces, ...extra.map(([p]) => p)]
  const scores = [0, 0, 0, ...bytePieces.map(() => 0), ...extra.map(([, s]) => s)]
  return parseTokenizer(tokenizerBytes(pieces, scores))
}

/** llama2.c run.c's merge loop, verbatim in spirit: rescan for the best pair each time. */
function naiveEncode(t: Tokenizer, text: string): number[] {
  const key = (id: number) => new TextDecoder('latin1').decode(t.pieces[id]!)
  const lookup = new Map<string, number>()
  for (let i = t.vocabSize - 1; i >= 0; i--) lookup.set(key(i), i)
  const bytes = new TextEncoder().encode(text)
  const toks = [BOS_ID]
  if (bytes.length) toks.push(lookup.get(' ')!)
  for (let i = 0; i < bytes.length; ) {
    let j = i + 1
    while (j < bytes.length && (bytes[j]! & 0xc0) === 0x80 && j - i < 4) j++
    const id = lookup.get(new TextDecoder('latin1').decode(bytes.subarray(i, j)))
    if (id !== undefined) toks.push(id)
    else for (let b = i; b < j; b++) toks.push(bytes[b]! + 3)
    i = j
  }
  for (;;) {
    let best = -1e10
    let bi = -1
    let bid = -1
    for (let i = 0; i + 1 < toks.length; i++) {
      const id = lookup.get(key(toks[i]!) + key(toks[i + 1]!))
      if (id !== undefined && t.scores[id]! > best) {
        best = t.scores[id]!
        bi = i
        bid = id
      }
    }
    if (bi < 0) break
    toks.splice(bi, 2, bid)
  }
  return toks
}

function expectModelError(fn: () => unknown, message: RegExp): void {
  expect(fn).toThrow(ModelError)
  expect(fn).toThrow(message)
}

describe('tokenizer (synthetic vocab)', () => {
  const t = smallTokenizer([
    [' ', -1],
    ['a', -1],
    ['b', -1],
    ['ab', -2],
    ['ba', -2],
    ['aba', -3],
    [' a', -5],
    ['é', -1],
  ])

  it('merges the best pair first and breaks ties leftmost', () => {
    // "bab": pairs "ba" and "ab" both score -2: the leftmost (ba) wins, leaving "ba"+"b".
    const ids = t.encode('bab', { bos: false })
    expect(ids.map((i) => t.decode([i]))).toEqual([' ', 'ba', 'b'])
    expect(t.encode('aba', { bos: false }).map((i) => t.decode([i]))).toEqual([' ', 'aba'])
  })

  it('matches the naive llama2.c merge loop on random strings', () => {
    let s = 3
    const rnd = () => {
      s = (Math.imul(s, 1103515245) + 12345) >>> 0
      return s >>> 8
    }
    const alphabet = ['a', 'b', ' ', 'é', 'x', '\u{1F600}']
    for (let n = 0; n < 300; n++) {
      const text = Array.from({ length: rnd() % 30 }, () => alphabet[rnd() % alphabet.length]).join('')
      expect(t.encode(text)).toEqual(naiveEncode(t, text))
    }
  })

  it('falls back to byte tokens and decodes them back to UTF-8', () => {
    const ids = t.encode('x\u{1F600}', { bos: false })
    // ' ' + 'x' as one byte token + 4 bytes of the emoji.
    expect(ids.slice(1)).toEqual([0x78 + 3, 0xf0 + 3, 0x9f + 3, 0x98 + 3, 0x80 + 3])
    expect(t.decode(ids)).toBe(' x\u{1F600}')
  })

  it('handles bos/eos flags and the empty string', () => {
    expect(t.encode('')).toEqual([BOS_ID])
    expect(t.encode('', { bos: false })).toEqual([])
    expect(t.encode('a', { eos: true }).at(-1)).toBe(EOS_ID)
    // The space after BOS is dropped on decode, like run.c.
    expect(t.decode(t.encode('a b'))).toBe('a b')
    expect(t.decode([BOS_ID, EOS_ID], { skipSpecial: false })).toBe('\n<s>\n\n</s>\n')
  })

  it('rejects out-of-range ids on decode', () => {
    expectModelError(() => t.decode([9999]), /outside 0\.\./)
    expectModelError(() => t.decode([-1]), /outside/)
  })
})

describe('tokenizer file parsing', () => {
  const pieces = ['<unk>', '\n<s>\n', '\n</s>\n', ...bytePieces, ' ']
  const good = tokenizerBytes(
    pieces,
    pieces.map(() => 0),
  )

  it('parses a valid file with and without an expected vocab size', () => {
    expect(parseTokenizer(good).vocabSize).toBe(260)
    expect(parseTokenizer(good, { vocabSize: 260 }).vocabSize).toBe(260)
  })

  it('rejects truncation anywhere', () => {
    expectModelError(() => parseTokenizer(good.subarray(0, 2)), /no header/)
    expectModelError(() => parseTokenizer(good.subarray(0, good.length - 1)), /truncated/)
    expectModelError(() => parseTokenizer(good.subarray(0, 10)), /truncated/)
    expectModelError(() => parseTokenizer(good, { vocabSize: 261 }), /truncated/)
  })

  it('rejects trailing bytes, bad lengths, bad scores and too small vocabs', () => {
    expectModelError(() => parseTokenizer(good, { vocabSize: 259 }), /trailing bytes/)
    const bad = good.slice()
    new DataView(bad.buffer).setInt32(8, 1000, true)
    expectModelError(() => parseTokenizer(bad), /token 0 has length 1000/)
    new DataView(bad.buffer).setInt32(8, -5, true)
    expectModelError(() => parseTokenizer(bad), /length -5/)
    const nan = good.slice()
    new DataView(nan.buffer).setFloat32(4, Number.NaN, true)
    expectModelError(() => parseTokenizer(nan), /non-finite score/)
    const hdr = good.slice()
    new DataView(hdr.buffer).setInt32(0, 0, true)
    expectModelError(() => parseTokenizer(hdr), /max_token_length 0/)
    expectModelError(() => parseTokenizer(tokenizerBytes(['a', 'b'], [0, 0])), /256 byte-fallback/)
  })

  it('never throws anything but ModelError on mutated bytes', () => {
    let s = 11
    const rnd = () => {
      s = (Math.imul(s, 1103515245) + 12345) >>> 0
      return s >>> 8
    }
    for (let i = 0; i < 300; i++) {
      const b = good.slice(0, rnd() % (good.length + 1))
      for (let k = 0; k < 4; k++) if (b.length) b[rnd() % b.length] = rnd() & 0xff
      try {
        parseTokenizer(b)
      } catch (e) {
        expect(e).toBeInstanceOf(ModelError)
      }
    }
  })
})

const data = findSharedData()
if (!data.paths) console.warn(`skipping tok512.bin tests: ${data.reason}`)

describe.skipIf(!data.paths)('tok512.bin', () => {
  const tok = () => loadTokenizerFile(data.paths!.tokenizer, 512)

  it('loads 512 tokens with byte pieces at 3..258 and the space word marker', () => {
    const t = tok()
    expect(t.vocabSize).toBe(512)
    expect(t.maxTokenLength).toBe(7)
    expect(new TextDecoder().decode(t.pieces[3 + 0x41])).toBe('<0x41>')
    expect(t.pieceId(' ')).toBeGreaterThan(258)
  })

  it('encodes a known sentence to known ids and decodes it back', () => {
    const t = tok()
    const text = 'Once upon a time, there was a little girl named Lily.'
    const ids = t.encode(text)
    expect(ids).toEqual([1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426])
    expect(t.decode(ids)).toBe(text)
  })

  it('matches the naive merge loop and round-trips arbitrary text', () => {
    const t = tok()
    const texts = [
      'Tom and Sue went to the park. They saw a big dog!',
      'naïve café — 東京 \u{1F600}\n\nnew paragraph\ttab',
      '   leading spaces and trailing   ',
      'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa',
    ]
    for (const text of texts) {
      const ids = t.encode(text)
      expect(ids).toEqual(naiveEncode(t, text))
      expect(t.decode(ids)).toBe(text)
    }
  })
})
