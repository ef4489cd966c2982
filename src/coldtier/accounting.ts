// Fleet-wide bytes and objects per namespace: gc writes a snapshot from its listing
// (the reconciliation), gateways add what they created since; /metrics, the status page and gc show it.

import { isNamespaceName } from '../core/keys.ts'
import type { GatewayMetrics } from '../gateway/metrics.ts'
import { Counter, escapeLabel } from '../gateway/metrics.ts'
import { collectAtMost, type ObjectStore } from '../gateway/stores/types.ts'
import type { UsageRecorder } from '../gateway/usage/recorder.ts'
import { accountingPrefix, runObjectName } from './names.ts'

export interface NamespaceTotals {
  objects: number
  bytes: number
}

/** What gc writes after a run: the listing's totals per namespace, less what it deleted. */
export interface AccountingSnapshot {
  /** When the listing started (ms). */
  at: number
  source: 'listing'
  namespaces: Record<string, NamespaceTotals>
}

export function snapshotName(prefix: string, at: number, run: string): string {
  return runObjectName(accountingPrefix(prefix), at, run, '.json')
}

/**
 * The largest snapshot read (~100 bytes per namespace: 16 MiB is ~150k namespaces). gc writes
 * them; one larger is not gc's and is never held whole, in a Worker least of all.
 */
export const MAX_SNAPSHOT_BYTES = 16 << 20

export function parseSnapshot(bytes: Uint8Array): AccountingSnapshot | undefined {
  try {
    const s = JSON.parse(new TextDecoder().decode(bytes)) as AccountingSnapshot
    if (!Number.isFinite(s?.at) || typeof s.namespaces !== 'object' || s.namespaces === null) return undefined
    // Namespace names become metric labels and status-page rows: only names a namespace can have.
    for (const [ns, t] of Object.entries(s.namespaces))
      if (!isNamespaceName(ns) || !isCount(t?.bytes) || !isCount(t?.objects)) return undefined
    return s
  } catch {
    return undefined
  }
}

const isCount = (v: unknown): v is number => Number.isSafeInteger(v) && (v as number) >= 0

/** A snapshot object's bytes, at most MAX_SNAPSHOT_BYTES (undefined: gone or larger). */
export async function readSnapshotBytes(store: ObjectStore, name: string): Promise<Uint8Array | undefined> {
  const obj = await store.get(name)
  if (!obj) return undefined
  return collectAtMost(obj.body, MAX_SNAPSHOT_BYTES)
}

/** The newest snapshot in the bucket (one LIST of a few names + one GET), or undefined. */
export async function readLatestSnapshot(
  store: ObjectStore,
  prefix: string,
): Promise<AccountingSnapshot | undefined> {
  const names: string[] = []
  let cursor: string | undefined
  do {
    const page = await store.list(accountingPrefix(prefix), cursor ? { cursor } : {})
    for (const e of page.entries) names.push(e.name)
    cursor = page.cursor
  } while (cursor)
  names.sort()
  for (let i = names.length - 1; i >= 0; i--) {
    // Gone (a concurrent gc deleted it between list and get), too large or not a snapshot: the one before.
    const bytes = await readSnapshotBytes(store, names[i]!)
    const s = bytes && parseSnapshot(bytes)
    if (s) return s
  }
  return undefined
}

class GaugeSet {
  constructor(
    readonly name: string,
    readonly help: string,
    readonly values: () => [Record<string, string>, number][],
  ) {}
  render(): string[] {
    const out = [`# HELP ${this.name} ${this.help}`, `# TYPE ${this.name} gauge`]
    for (const [labels, v] of this.values()) {
      const l = Object.entries(labels)
        .map(([k, x]) => `${k}="${escapeLabel(x)}"`)
        .join(',')
      out.push(`${this.name}${l ? `{${l}}` : ''} ${v}`)
    }
    return out
  }
}

/** A gateway's view: the latest snapshot (re-read at most every refreshMs) + this instance's creations since. */
export class FleetAccounting {
  readonly #store: ObjectStore
  readonly #prefix: string
  readonly #usage: UsageRecorder | undefined
  readonly #refreshMs: number
  readonly pricePerGBMonth: number
  #snapshot: AccountingSnapshot | undefined
  #readAt = -Infinity
  #reading: Promise<void> | undefined
  readonly refreshFailures = new Counter(
    'kvgate_accounting_refresh_failures_total',
    'Failed reads of the accounting snapshot',
  )

  constructor(
    store: ObjectStore,
    prefix: string,
    metrics: GatewayMetrics,
    opts: { pricePerGBMonth: number; usage?: UsageRecorder; refreshMs?: number },
  ) {
    this.#store = store
    this.#prefix = prefix
    this.#usage = opts.usage
    this.#refreshMs = opts.refreshMs ?? 300_000
    this.pricePerGBMonth = opts.pricePerGBMonth
    const rows = (f: (t: NamespaceTotals) => number) => () =>
      Object.entries(this.totals()).map(([ns, t]) => [{ ns }, f(t)] as [Record<string, string>, number])
    metrics.extras.push(
      new GaugeSet(
        'kvgate_namespace_stored_bytes',
        'Bytes stored per namespace (gc snapshot + creations since)',
        rows((t) => t.bytes),
      ),
      new GaugeSet(
        'kvgate_namespace_stored_objects',
        'Chunk objects stored per namespace',
        rows((t) => t.objects),
      ),
      new GaugeSet(
        'kvgate_namespace_storage_usd_per_month',
        "Monthly storage cost per namespace at the store's list price",
        rows((t) => (t.bytes / 1e9) * this.pricePerGBMonth),
      ),
      new GaugeSet(
        'kvgate_accounting_snapshot_age_seconds',
        'Age of the gc snapshot the figures start from',
        () => (this.#snapshot ? [[{}, Math.round((Date.now() - this.#snapshot.at) / 1000)]] : []),
      ),
      this.refreshFailures,
    )
  }

  /** Re-reads the snapshot when stale; never throws (a failure keeps the previous view). */
  refresh(): Promise<void> {
    if (Date.now() - this.#readAt < this.#refreshMs) return Promise.resolve()
    this.#reading ??= readLatestSnapshot(this.#store, this.#prefix)
      .then((s) => {
        this.#snapshot = s ?? this.#snapshot
        this.#readAt = Date.now()
        // Creations the snapshot's listing counted are never read again: let them go.
        if (this.#snapshot) this.#usage?.pruneCreatedBefore(this.#snapshot.at)
      })
      .catch(() => {
        this.refreshFailures.inc()
        this.#readAt = Date.now() // retry after refreshMs, not on every scrape
      })
      .finally(() => {
        this.#reading = undefined
      })
    return this.#reading
  }

  get snapshotAt(): number | undefined {
    return this.#snapshot?.at
  }

  /** Per-namespace totals: snapshot + creations this instance saw after the snapshot's listing. */
  totals(): Record<string, NamespaceTotals> {
    const out: Record<string, NamespaceTotals> = {}
    for (const [ns, t] of Object.entries(this.#snapshot?.namespaces ?? {})) out[ns] = { ...t }
    const since = this.#snapshot?.at ?? -Infinity
    for (const [ns, seconds] of this.#usage?.createdBySecond ?? []) {
      for (const [second, c] of seconds) {
        // A second straddling the listing counts whole: reconciled by the next gc.
        if (second + 1000 <= since) continue
        // Own keys only: a namespace named `constructor` would find (and add to) Object itself.
        const t = (Object.hasOwn(out, ns) ? out[ns] : undefined) ?? { objects: 0, bytes: 0 }
        out[ns] = t
        t.bytes += c.bytes
        t.objects += c.objects
      }
    }
    return out
  }
}

export function monthlyUsd(bytes: number, pricePerGBMonth: number): number {
  return (bytes / 1e9) * pricePerGBMonth
}
