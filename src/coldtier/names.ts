// Where the cold tier keeps its own objects beside the chunks: use records, chain
// indexes and accounting snapshots, under `_` names no namespace can take. The
// namespaces' calibration objects live there too, so gc (which deletes only what
// classify() calls a chunk) never takes one.

import { isKeyHex, isNamespaceName } from '../core/keys.ts'

const join = (prefix: string, rest: string) => (prefix === '' ? rest : `${prefix}/${rest}`)

/** `<prefix>/_usage/<ns>/`: every gateway instance's use records for one namespace. */
export const usagePrefix = (prefix: string, ns: string) => join(prefix, `_usage/${ns}/`)

/** `<prefix>/_usage/<ns>/<yyyymmddhh>/<instance>-<seq>`: unique per instance, so never overwritten. */
export function usageRecordName(
  prefix: string,
  ns: string,
  at: number,
  instance: string,
  seq: number,
): string {
  const d = new Date(at)
  const hour = `${d.getUTCFullYear()}${pad(d.getUTCMonth() + 1)}${pad(d.getUTCDate())}${pad(d.getUTCHours())}`
  return `${usagePrefix(prefix, ns)}${hour}/${instance}-${String(seq).padStart(8, '0')}`
}

/** `<prefix>/_coldtier/index/<ns>/`: gc's compacted chain index, one create-only object per run. */
export const indexPrefix = (prefix: string, ns: string) => join(prefix, `_coldtier/index/${ns}/`)

/**
 * `<prefix>/_coldtier/condemned/<ns>/`: chunks a gc run found deletable, one create-only object
 * per run; only a run at least the condemning wait later deletes them (docs/cold-tier.md).
 */
export const condemnedPrefix = (prefix: string, ns: string) => join(prefix, `_coldtier/condemned/${ns}/`)

/** `<prefix>/_coldtier/accounting/`: per-namespace bytes and objects, one create-only object per run. */
export const accountingPrefix = (prefix: string) => join(prefix, '_coldtier/accounting/')

/** A run's object name: time first (13 digits) so names sort by time. */
export const runObjectName = (dir: string, at: number, run: string, ext = '') =>
  `${dir}${String(Math.floor(at)).padStart(13, '0')}-${run}${ext}`

/** The time a run object name carries, or NaN. */
export function runObjectTime(name: string): number {
  const m = /\/(\d{13})-[0-9a-z]+(?:\.json)?$/.exec(name)
  return m ? Number(m[1]) : Number.NaN
}

/** `<prefix>/_calibration/<ns>/`: the namespace's calibration objects and its current pointer (docs/calibration.md). */
export const calibrationPrefix = (prefix: string, ns: string) => join(prefix, `_calibration/${ns}/`)

/** `<prefix>/_calibration/<ns>/<sha256>`: a calibration object, named by the SHA-256 of its bytes. */
export const calibrationObjectName = (prefix: string, ns: string, hash: string) =>
  `${calibrationPrefix(prefix, ns)}${hash}`

/** `<prefix>/_calibration/<ns>/current`: `{"hash": …}`, create-only: the first stored calibration wins. */
export const currentCalibrationName = (prefix: string, ns: string) =>
  `${calibrationPrefix(prefix, ns)}current`

export type BucketObjectKind =
  | { kind: 'chunk'; ns: string; key: string }
  | { kind: 'calibration'; ns: string }
  | { kind: 'usage'; ns: string }
  | { kind: 'index'; ns: string }
  | { kind: 'condemned'; ns: string }
  | { kind: 'accounting' }
  | { kind: 'other' }

/** Classifies a listed name (relative to the prefix); anything unexpected is 'other' and left alone. */
export function classify(prefix: string, name: string): BucketObjectKind {
  const base = prefix === '' ? '' : `${prefix}/`
  if (!name.startsWith(base)) return { kind: 'other' }
  const parts = name.slice(base.length).split('/')
  if (
    parts.length === 3 &&
    isNamespaceName(parts[0]) &&
    isKeyHex(parts[2]) &&
    // Exactly objectName()'s shard: gc deletes by objectName(), so any other name listed for
    // the key (`ab/`, `abc/`, ``) would lend its size and age to the real object.
    parts[1] === parts[2]!.slice(0, 2)
  )
    return { kind: 'chunk', ns: parts[0]!, key: parts[2]! }
  if (parts[0] === '_usage' && parts.length === 4 && isNamespaceName(parts[1]))
    return { kind: 'usage', ns: parts[1]! }
  if (parts[0] === '_coldtier' && parts[1] === 'index' && parts.length === 4 && isNamespaceName(parts[2]))
    return { kind: 'index', ns: parts[2]! }
  if (parts[0] === '_coldtier' && parts[1] === 'condemned' && parts.length === 4 && isNamespaceName(parts[2]))
    return { kind: 'condemned', ns: parts[2]! }
  if (parts[0] === '_coldtier' && parts[1] === 'accounting' && parts.length === 3)
    return { kind: 'accounting' }
  if (parts[0] === '_calibration' && parts.length === 3 && isNamespaceName(parts[1]))
    return { kind: 'calibration', ns: parts[1]! }
  return { kind: 'other' }
}

function pad(n: number): string {
  return String(n).padStart(2, '0')
}

/** 16 random hex characters: an instance or run id (called inside a request: workerd refuses randomness at load). */
export function randomId(): string {
  const b = new Uint8Array(8)
  crypto.getRandomValues(b)
  return Array.from(b, (x) => x.toString(16).padStart(2, '0')).join('')
}
