// Shared pieces of kvgate's configuration schemas (valibot, runs in Node and workerd): byte
// sizes with units, and one ConfigError per problem that names the path and the nearest valid key.

import * as v from 'valibot'
import { ConfigError } from './errors.ts'

/** Parses '512MiB', '10 GB', '4096', 4096 into bytes; undefined when it is not a byte size. */
export function parseByteSize(input: unknown): number | undefined {
  if (typeof input === 'number') return Number.isSafeInteger(input) && input >= 0 ? input : undefined
  if (typeof input !== 'string') return undefined
  const m = /^\s*(\d+(?:\.\d+)?)\s*(b|k|kb|kib|m|mb|mib|g|gb|gib|t|tb|tib)?\s*$/i.exec(input)
  if (!m) return undefined
  const unit = (m[2] ?? 'b').toLowerCase()
  const pow = { b: 0, k: 1, m: 2, g: 3, t: 4 }[unit[0] as 'b' | 'k' | 'm' | 'g' | 't']
  // kB/MB/GB/TB are decimal (disk vendors); k/M/G/T and KiB/MiB/... binary.
  const base = /^[kmgt]b$/.test(unit) ? 1000 : 1024
  const n = Math.round(Number(m[1]) * base ** pow)
  return Number.isSafeInteger(n) ? n : undefined
}

/** A byte size: an integer, or a string with a unit ('512MiB', '10GB'), within [min, max]. */
export function byteSize(min = 0, max = Number.MAX_SAFE_INTEGER) {
  return v.pipe(
    v.union([v.number(), v.string()], 'expected a byte size such as 4096, 512MiB or 10GB'),
    v.transform((x) => parseByteSize(x) ?? Number.NaN),
    v.check((n) => !Number.isNaN(n), 'expected a byte size such as 4096, 512MiB or 10GB'),
    v.minValue(min, `must be at least ${min} bytes`),
    v.maxValue(max, `must be at most ${max} bytes`),
  )
}

/** An integer in [min, max], also from a string of digits (env vars, flags). */
export function intLike(min: number, max: number) {
  return v.pipe(
    v.union(
      [v.number(), v.pipe(v.string(), v.regex(/^\s*\d+\s*$/, 'expected an integer'))],
      'expected an integer',
    ),
    v.transform((x) => Number(x)),
    v.integer('expected an integer'),
    v.minValue(min, `expected an integer in ${min}..${max}`),
    v.maxValue(max, `expected an integer in ${min}..${max}`),
  )
}

/** A boolean, also from true/false/yes/no/on/off/1/0 strings. */
export const boolLike = v.pipe(
  v.union(
    [v.boolean(), v.picklist(['1', '0', 'true', 'false', 'yes', 'no', 'on', 'off'])],
    'expected true or false',
  ),
  v.transform((x) => x === true || x === '1' || x === 'true' || x === 'yes' || x === 'on'),
)

function distance(a: string, b: string): number {
  const d = Array.from({ length: b.length + 1 }, (_, i) => i)
  for (let i = 1; i <= a.length; i++) {
    let prev = d[0]!
    d[0] = i
    for (let j = 1; j <= b.length; j++) {
      const cur = d[j]!
      d[j] = Math.min(
        d[j]! + 1,
        d[j - 1]! + 1,
        prev + (a[i - 1]!.toLowerCase() === b[j - 1]!.toLowerCase() ? 0 : 1),
      )
      prev = cur
    }
  }
  return d[b.length]!
}

/** The valid key closest to `key`, when one is close enough to be a likely typo. */
export function nearestKey(key: string, valid: readonly string[]): string | undefined {
  let best: string | undefined
  let bestD = Number.POSITIVE_INFINITY
  for (const k of valid) {
    const dist = distance(key, k)
    if (dist < bestD) {
      best = k
      bestD = dist
    }
  }
  return best !== undefined && bestD <= Math.max(2, Math.floor(key.length / 3)) ? best : undefined
}

function issuePath(issue: v.BaseIssue<unknown>): string {
  return (issue.path ?? []).map((p) => String(p.key)).join('.')
}

/** Valid keys of the object schema at `path` (for "did you mean"). */
function keysAt(schema: v.GenericSchema, path: readonly string[]): string[] {
  let s = schema as unknown as {
    type?: string
    entries?: Record<string, v.GenericSchema>
    wrapped?: v.GenericSchema
    options?: v.GenericSchema[]
    pipe?: v.GenericSchema[]
  }
  for (const part of [...path, '']) {
    while (s && s.entries === undefined) {
      if (s.type === 'lazy')
        s = (s as unknown as { getter(x: unknown): typeof s }).getter({}) // the object branch
      else if (s.wrapped) s = s.wrapped as typeof s
      else if (s.pipe && s.pipe[0] !== (s as unknown)) s = s.pipe[0] as typeof s
      else if (s.options)
        s = (s.options.find((o) => (o as { entries?: unknown }).entries) ?? s.options[0]) as typeof s
      else return []
    }
    if (!s?.entries) return []
    if (part === '') return Object.keys(s.entries)
    s = s.entries[part] as typeof s
  }
  return []
}

/**
 * A union's failure as the failures of the option that got furthest (`remote: { tokne }`
 * reports the unknown key, not "expected false or an object").
 */
function specific(issue: v.BaseIssue<unknown>): v.BaseIssue<unknown>[] {
  if (issue.type !== 'union' || !issue.issues?.length) return [issue]
  const subs = issue.issues.flatMap(specific)
  const depth = (i: v.BaseIssue<unknown>) => i.path?.length ?? 0
  const deepest = Math.max(...subs.map(depth))
  return deepest > depth(issue) ? subs.filter((i) => depth(i) === deepest) : [issue]
}

/**
 * Checks `input` against `schema`; on failure throws one ConfigError listing each problem as
 * `<where>: <path>: <message>`, with the nearest valid key for unknown ones.
 */
export function parseConfig<S extends v.GenericSchema>(
  schema: S,
  input: unknown,
  where: string,
): v.InferOutput<S> {
  // abortPipeEarly: a value that is not a byte size is one problem, not also "at least" and
  // "at most" ones for the NaN it became.
  const r = v.safeParse(schema, input, { abortPipeEarly: true })
  if (r.success) return r.output
  const lines = r.issues.flatMap(specific).map((issue) => {
    const path = issuePath(issue)
    const at = path ? `${where}: ${path}` : where
    // A strict object's issue is either a key it does not know (expected 'never') or a value
    // that is not a mapping at all (`presign: 5`, an empty `store:`): only the first is a typo.
    if (issue.kind === 'schema' && issue.type === 'strict_object' && issue.expected !== 'never') {
      const keys = keysAt(
        schema,
        (issue.path ?? []).map((p) => String(p.key)),
      )
      return `${at}: expected a mapping, got ${issue.received}${keys.length ? `; valid keys here: ${keys.join(', ')}` : ''}`
    }
    if (issue.kind === 'schema' && issue.type === 'strict_object' && issue.input !== undefined) {
      const parent = (issue.path ?? []).slice(0, -1).map((p) => String(p.key))
      const key = String(issue.path?.at(-1)?.key ?? '')
      const valid = keysAt(schema, parent)
      const near = nearestKey(key, valid)
      return `${at}: unknown key${near ? ` (did you mean '${near}'?)` : ''}; valid keys here: ${valid.join(', ')}`
    }
    return `${at}: ${issue.message}`
  })
  throw new ConfigError(lines.join('\n'))
}
