// Chunk objects and gateway instances for the gateway suites: real chunk bytes
// from core encodeChunk (codec 'raw'), random chain keys, an app on a memory store.

import { encodeChunk } from '../src/core/format.ts'
import { toHex } from '../src/core/keys.ts'
import type { KvGeometry } from '../src/core/layout.ts'

export interface TestChunk {
  key: string
  bytes: Uint8Array
}

let counter = 0

/** A valid raw chunk of `layers` sections of `sectionBytes` each, with a fresh chain key. */
export function makeChunk(
  opts: {
    layers?: number
    sectionBytes?: number
    parent?: string
    key?: string
    namespaceId?: string
    /** Position in its chain (header chunkIndex). @default 0 */
    index?: number
  } = {},
): TestChunk {
  const layers = opts.layers ?? 4
  const sectionBytes = opts.sectionBytes ?? 256
  const geometry: KvGeometry = { layers, kvHeads: 1, headDim: 64, dtype: 'fp16' }
  const chainKey = opts.key
    ? Uint8Array.from(Buffer.from(opts.key, 'hex'))
    : crypto.getRandomValues(new Uint8Array(32))
  const seed = ++counter
  const sections = Array.from({ length: layers }, (_, l) => {
    const s = new Uint8Array(sectionBytes)
    // Cheap, distinct, position-dependent content (so range mistakes show).
    for (let i = 0; i < s.length; i++) s[i] = (i * 31 + l * 7 + seed) & 0xff
    return s
  })
  const bytes = encodeChunk(
    {
      codec: 'raw',
      codecVersion: 1,
      codecParams: new Uint8Array(0),
      geometry,
      tokens: 1,
      chunkIndex: opts.index ?? 0,
      partial: false,
      namespaceId: opts.namespaceId
        ? Uint8Array.from(Buffer.from(opts.namespaceId, 'hex'))
        : new Uint8Array(16),
      chainKey,
      parentKey: opts.parent ? Uint8Array.from(Buffer.from(opts.parent, 'hex')) : new Uint8Array(32),
    },
    sections,
  )
  return { key: toHex(chainKey), bytes }
}

/** A chain of n chunks (keys in chain order). */
export function makeChain(n: number, opts: { layers?: number; sectionBytes?: number } = {}): TestChunk[] {
  const out: TestChunk[] = []
  for (let i = 0; i < n; i++) out.push(makeChunk({ ...opts, parent: out[i - 1]?.key, index: i }))
  return out
}

export function putInit(bytes: Uint8Array, token?: string): RequestInit {
  return {
    method: 'PUT',
    body: bytes as Uint8Array<ArrayBuffer>,
    headers: {
      'content-type': 'application/octet-stream',
      'content-length': String(bytes.length),
      ...(token ? { authorization: `Bearer ${token}` } : {}),
    },
  }
}
