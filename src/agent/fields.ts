// Field checks for decoded requests: every value from the socket is validated
// before use, and a bad one is an ERR_INVALID_ARGUMENT naming the field.

import { AgentError } from './protocol.ts'

type Fields = Record<string, unknown>

function bad(name: string, want: string, v: unknown): never {
  const shown = typeof v === 'string' ? JSON.stringify(v.slice(0, 40)) : typeof v
  throw new AgentError('ERR_INVALID_ARGUMENT', `invalid ${name}: expected ${want}, got ${shown}`)
}

/**
 * A request's value as an error message shows it: JSON (NaN and infinities by name), clipped
 * to `max` characters. A refused field is echoed, never whole: a 16 MiB array would come back as
 * a larger answer (every connector reads it), and its string would be built for nothing.
 */
export function shown(v: unknown, max = 120): string {
  let text: string
  try {
    text =
      JSON.stringify(v, (_, x) => (typeof x === 'number' && !Number.isFinite(x) ? String(x) : x)) ?? String(v)
  } catch {
    text = String(v)
  }
  return text.length > max ? `${text.slice(0, max)}…` : text
}

export function int(m: Fields, name: string, min: number, max: number): number {
  const v = m[name]
  if (typeof v !== 'number' || !Number.isSafeInteger(v) || v < min || v > max)
    bad(name, `an integer in ${min}..${max}`, v)
  return v
}

export function optInt(m: Fields, name: string, min: number, max: number, dflt: number): number {
  return m[name] === undefined || m[name] === null ? dflt : int(m, name, min, max)
}

export function str(m: Fields, name: string, maxLen = 256): string {
  const v = m[name]
  if (typeof v !== 'string' || v.length === 0 || v.length > maxLen)
    bad(name, `a string of 1..${maxLen} characters`, v)
  return v
}

export function oneOf<T extends string>(m: Fields, name: string, allowed: readonly T[]): T {
  const v = m[name]
  if (typeof v !== 'string' || !(allowed as readonly string[]).includes(v)) bad(name, allowed.join(' | '), v)
  return v as T
}

export function intList(m: Fields, name: string, max: number, maxLen: number): number[] {
  const v = m[name]
  if (!Array.isArray(v) || v.length > maxLen) bad(name, `an array of at most ${maxLen} integers`, v)
  for (const x of v as unknown[]) {
    if (typeof x !== 'number' || !Number.isSafeInteger(x) || x < 0 || x > max)
      bad(`${name}[]`, `an integer in 0..${max}`, x)
  }
  return v as number[]
}

export function binList(m: Fields, name: string, len: number, maxLen: number): Uint8Array[] {
  const v = m[name]
  if (!Array.isArray(v) || v.length > maxLen) bad(name, `an array of at most ${maxLen} byte strings`, v)
  for (const x of v as unknown[]) {
    if (!(x instanceof Uint8Array) || x.length !== len) bad(`${name}[]`, `${len} bytes`, x)
  }
  return v as Uint8Array[]
}

export function map(m: Fields, name: string): Fields {
  const v = m[name]
  if (typeof v !== 'object' || v === null || Array.isArray(v) || v instanceof Uint8Array)
    bad(name, 'a map', v)
  return v as Fields
}

/**
 * The engine's chunk hashes as sent: an array of `HASH_BYTES`-byte bins, or (the packed
 * form) one bin of `HASH_BYTES`·n bytes, hash i at offset `HASH_BYTES`·i. The packed form
 * is one msgpack value, not n: no per-key object to decode, check or collect.
 */
export type Hashes = Uint8Array | readonly Uint8Array[]

/** Bytes of one engine block hash (sha256). */
export const HASH_BYTES = 32

export function hashes(m: Fields, name: string, maxKeys: number): Hashes {
  const v = m[name]
  if (!(v instanceof Uint8Array)) return binList(m, name, HASH_BYTES, maxKeys)
  if (v.length % HASH_BYTES !== 0 || v.length > maxKeys * HASH_BYTES) {
    throw new AgentError(
      'ERR_INVALID_ARGUMENT',
      `invalid ${name}: a packed bin must hold a multiple of ${HASH_BYTES} bytes, at most ${maxKeys} hashes; got ${v.length} bytes`,
    )
  }
  return v
}

/** How many hashes `h` holds. */
export function hashCount(h: Hashes): number {
  return h instanceof Uint8Array ? h.length / HASH_BYTES : h.length
}

/** `h` in bytes of its own (a request's bins may be views of a reused buffer). */
export function copyHashes(h: Hashes): Hashes {
  return h instanceof Uint8Array
    ? Uint8Array.prototype.slice.call(h)
    : h.map((x) => Uint8Array.prototype.slice.call(x))
}
