// Cold-tier configuration: per-namespace retention and byte quota, gc's grace period
// and the gateways' use-record batching, parsed from YAML/JSON and validated (unknown keys are errors).

import { parseByteSize } from '../core/config-check.ts'
import { ConfigError } from '../core/errors.ts'
import { isNamespaceName } from '../core/keys.ts'

export interface NamespacePolicy {
  /** Delete chains not used (read or written) for this long (ms). Undefined: keep forever. */
  retentionMs?: number
  /** Keep at most this many bytes, evicting least-recently-used chains from their tails. */
  quotaBytes?: number
}

export interface UsageOptions {
  /**
   * Flush a batch once it is this old and holds ≥ 100 hits (the ≤ 1 request per 100 hits bound).
   * @default 60000
   */
  flushIntervalMs: number
  /** Flush a non-empty batch once it is this old, whatever its hits: the most an instance death loses. @default 300000 */
  maxDelayMs: number
  /** Distinct keys buffered per instance before an early flush; twice this is the hard memory cap. @default 20000 */
  maxKeys: number
}

export interface ColdTierConfig {
  /** Policies by namespace; '*' applies to namespaces not listed. Unlisted without '*': accounted, never deleted. */
  namespaces: Record<string, NamespacePolicy>
  /** Chunks read or written this recently are never deleted, whatever the policy says. @default 600000 (10 min) */
  graceMs: number
  usage: UsageOptions
  /**
   * How long a chunk gc condemned waits before a later run may delete it (at least
   * usage.maxDelayMs). @default condemnWaitMs(usage)
   */
  condemnWaitMs?: number
  /** false turns use tracking off on this gateway. @default true */
  tracking: boolean
}

export const DEFAULT_USAGE: UsageOptions = { flushIntervalMs: 60_000, maxDelayMs: 300_000, maxKeys: 20_000 }

export const DEFAULT_COLD_TIER: ColdTierConfig = {
  namespaces: {},
  graceMs: 600_000,
  usage: DEFAULT_USAGE,
  tracking: true,
}

const UNIT_MS: Record<string, number> = { ms: 1, s: 1000, m: 60_000, h: 3_600_000, d: 86_400_000 }

/** `30d`, `12h`, `10m`, `90s`, `500ms`, or a number of seconds. */
export function parseDuration(what: string, v: unknown): number {
  if (typeof v === 'number' && Number.isFinite(v) && v >= 0) return v * 1000
  const m = typeof v === 'string' ? /^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$/.exec(v) : null
  if (!m)
    throw new ConfigError(`${what} must be a duration like 30d, 12h, 10m or 90s, got ${JSON.stringify(v)}`)
  return Number(m[1]) * UNIT_MS[m[2]!]!
}

/**
 * `500GiB`, `2TB`, `1.5 TiB`, `8M`, or a number of bytes: the gateway's byte sizes
 * (parseByteSize), so a quota reads like maxChunkBytes and stays an exact integer.
 */
export function parseBytes(what: string, v: unknown): number {
  const n = parseByteSize(v)
  if (n === undefined)
    throw new ConfigError(`${what} must be a size like 500GiB or 2TB, got ${JSON.stringify(v)}`)
  return n
}

function mapping(what: string, v: unknown, allowed: readonly string[]): Record<string, unknown> {
  if (v === null || typeof v !== 'object' || Array.isArray(v))
    throw new ConfigError(`${what} must be a mapping`)
  for (const k of Object.keys(v)) {
    if (!allowed.includes(k))
      throw new ConfigError(`${what}: unknown key ${JSON.stringify(k)} (known: ${allowed.join(', ')})`)
  }
  return v as Record<string, unknown>
}

/**
 * Parses the `coldTier` section:
 * `{ grace: 10m, tracking: true, usage: { flushInterval: 60s, maxDelay: 5m, maxKeys: 20000 },
 *    namespaces: { prod: { retention: 30d, quota: 500GiB }, '*': { retention: 90d } } }`.
 * A string is parsed as JSON (the KVGATE_COLD_TIER variable).
 */
export function parseColdTier(raw: unknown, what = 'coldTier'): ColdTierConfig {
  if (raw === undefined || raw === null || raw === '') return DEFAULT_COLD_TIER
  if (typeof raw === 'string') {
    try {
      raw = JSON.parse(raw)
    } catch (e) {
      throw new ConfigError(`${what} is not valid JSON`, { cause: e })
    }
  }
  const o = mapping(what, raw, ['grace', 'condemnWait', 'tracking', 'usage', 'namespaces'])
  const usage = { ...DEFAULT_USAGE }
  if (o.usage !== undefined) {
    const u = mapping(`${what}.usage`, o.usage, ['flushInterval', 'maxDelay', 'maxKeys'])
    if (u.flushInterval !== undefined)
      usage.flushIntervalMs = parseDuration(`${what}.usage.flushInterval`, u.flushInterval)
    if (u.maxDelay !== undefined) usage.maxDelayMs = parseDuration(`${what}.usage.maxDelay`, u.maxDelay)
    if (u.maxKeys !== undefined) {
      if (!Number.isSafeInteger(u.maxKeys) || (u.maxKeys as number) < 1 || (u.maxKeys as number) > 1_000_000)
        throw new ConfigError(`${what}.usage.maxKeys must be an integer in 1..1000000`)
      usage.maxKeys = u.maxKeys as number
    }
    if (usage.maxDelayMs < usage.flushIntervalMs)
      throw new ConfigError(`${what}.usage.maxDelay must be at least flushInterval`)
  }
  if (o.tracking !== undefined && typeof o.tracking !== 'boolean')
    throw new ConfigError(`${what}.tracking must be true or false`)
  const namespaces: Record<string, NamespacePolicy> = {}
  if (o.namespaces !== undefined) {
    const n = mapping(`${what}.namespaces`, o.namespaces, Object.keys(o.namespaces as object))
    for (const [ns, p] of Object.entries(n)) {
      if (ns !== '*' && !isNamespaceName(ns))
        throw new ConfigError(`${what}.namespaces: invalid namespace ${JSON.stringify(ns)}`)
      const q = mapping(`${what}.namespaces.${ns}`, p, ['retention', 'quota'])
      const policy: NamespacePolicy = {}
      if (q.retention !== undefined)
        policy.retentionMs = parseDuration(`${what}.namespaces.${ns}.retention`, q.retention)
      if (q.quota !== undefined) policy.quotaBytes = parseBytes(`${what}.namespaces.${ns}.quota`, q.quota)
      namespaces[ns] = policy
    }
  }
  const graceMs = o.grace === undefined ? DEFAULT_COLD_TIER.graceMs : parseDuration(`${what}.grace`, o.grace)
  for (const [ns, p] of Object.entries(namespaces)) {
    if (p.retentionMs !== undefined && p.retentionMs < graceMs)
      throw new ConfigError(
        `${what}.namespaces.${ns}.retention is shorter than the grace period (${graceMs} ms)`,
      )
  }
  let condemnWait: number | undefined
  if (o.condemnWait !== undefined) {
    condemnWait = parseDuration(`${what}.condemnWait`, o.condemnWait)
    // Shorter, a use a gateway still buffers when the condemning run lists can be missed again.
    if (condemnWait < usage.maxDelayMs)
      throw new ConfigError(`${what}.condemnWait is shorter than usage.maxDelay (${usage.maxDelayMs} ms)`)
  }
  return {
    namespaces,
    graceMs,
    usage,
    ...(condemnWait === undefined ? {} : { condemnWaitMs: condemnWait }),
    tracking: (o.tracking as boolean | undefined) ?? true,
  }
}

/**
 * How long a chunk gc condemned waits before a later run may delete it: long enough that every
 * use a gateway made before the condemning run is in a record the deleting run lists. A use is
 * flushed within maxDelay of the batch's first entry, plus one period of the Node flush timer
 * (a quarter of the shorter interval), plus the PUT itself and the clock difference between the
 * hosts of two gc runs: one minute for those two.
 */
export function condemnWaitMs(usage: UsageOptions): number {
  return usage.maxDelayMs + Math.max(250, Math.min(usage.flushIntervalMs, usage.maxDelayMs) / 4) + 60_000
}

/** The policy that applies to a namespace: its own, else '*', else none (keep everything). */
export function policyFor(cfg: ColdTierConfig, ns: string): NamespacePolicy | undefined {
  // Own keys only: a namespace may be named `constructor`, which every plain object has.
  const own = (k: string) => (Object.hasOwn(cfg.namespaces, k) ? cfg.namespaces[k] : undefined)
  return own(ns) ?? own('*')
}
