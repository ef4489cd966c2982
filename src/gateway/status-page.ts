// The operator's glance at `/`: store, objects and bytes, monthly storage cost
// estimate, request and hit rates, store latency, and the most recent errors.

import type { GatewayState } from './context.ts'

const esc = (s: string) => s.replace(/[&<>"']/g, (ch) => `&#${ch.charCodeAt(0)};`)

function fmtBytes(n: number): string {
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB']
  let i = 0
  let v = n
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024
    i++
  }
  return `${v.toFixed(i === 0 ? 0 : 1)} ${units[i]}`
}

/** '3 d 4 h', '2 h 5 min', '42 s': uptime a person reads at a glance. */
export function fmtDuration(seconds: number): string {
  const s = Math.max(0, Math.round(seconds))
  const d = Math.floor(s / 86400)
  const h = Math.floor((s % 86400) / 3600)
  const m = Math.floor((s % 3600) / 60)
  if (d > 0) return `${d} d ${h} h`
  if (h > 0) return `${h} h ${m} min`
  if (m > 0) return `${m} min ${s % 60} s`
  return `${s} s`
}

/** Stores billed per GB-month (a list price applies); fs and memory have none. */
const PRICED_STORES = new Set(['s3', 'r2'])

const pct = (a: number, b: number) => (b === 0 ? '–' : `${((100 * a) / b).toFixed(1)}%`)

export interface StatusSnapshot {
  store: string
  objects: number | undefined
  bytes: number | undefined
  writtenObjects: number
  writtenBytes: number
  monthlyStorageUsd: number | undefined
  uptimeSeconds: number
  requests: number
  errors: number
  lookupKeys: number
  lookupPresent: number
  cacheHits: number
  cacheMisses: number
  coalescedGets: number
  putsCreated: number
  putsExisting: number
  bytesIn: number
  bytesOut: number
  storeOps: number
  storeMeanMs: number
  /** GET bodies aborted for bad stored bytes, and objects verified corrupt and deleted. */
  corruptReads: number
  corruptDeleted: number
  /** Cached presences forgotten because a read found an object missing. */
  presenceInvalidated: number
  /** Requests refused (503 ERR_BUSY) at the in-flight bounds. */
  busy: number
  recentErrors: GatewayState['recentErrors']
  /** Fleet-wide per namespace (gc's last listing + creations since), with monthly cost. */
  namespaces: { ns: string; objects: number; bytes: number; monthlyUsd: number }[]
  /** When gc's listing behind `namespaces` ran (ms); undefined before the first gc. */
  accountingAt: number | undefined
}

type StoreStats = { at: number; value: { objects: number; bytes: number } | undefined }
/** Per gateway: one module-wide entry showed one gateway's store on every other's page in a process. */
let statsCache = new WeakMap<GatewayState, StoreStats>()

export async function snapshot(state: GatewayState): Promise<StatusSnapshot> {
  const m = state.metrics
  // Counting a store can mean walking it: at most once a minute.
  let stats = statsCache.get(state)
  if (!stats || Date.now() - stats.at > 60_000) {
    stats = {
      at: Date.now(),
      value: state.store.stats ? await state.store.stats().catch(() => undefined) : undefined,
    }
    statsCache.set(state, stats)
  }
  await state.accounting?.refresh()
  const st = stats.value
  const bytesForCost = st?.bytes ?? state.written.bytes
  const storeLat = m.storeSeconds.totals()
  return {
    store: state.store.kind,
    objects: st?.objects,
    bytes: st?.bytes,
    writtenObjects: state.written.objects,
    writtenBytes: state.written.bytes,
    monthlyStorageUsd: PRICED_STORES.has(state.store.kind)
      ? (bytesForCost / 1e9) * state.storagePricePerGBMonth
      : undefined,
    uptimeSeconds: Math.round((Date.now() - state.startedAt) / 1000),
    requests: m.requests.value(),
    errors: m.errors.value(),
    lookupKeys: m.lookupKeys.value(),
    lookupPresent: m.lookupKeys.value({ result: 'present' }),
    cacheHits: m.cache.value({ result: 'hit' }),
    cacheMisses: m.cache.value({ result: 'miss' }),
    coalescedGets: m.coalesced.value(),
    putsCreated: m.puts.value({ result: 'created' }),
    putsExisting: m.puts.value({ result: 'exists' }),
    bytesIn: m.bytesIn.value(),
    bytesOut: m.bytesOut.value(),
    storeOps: storeLat.count,
    storeMeanMs: storeLat.count ? (1000 * storeLat.sum) / storeLat.count : 0,
    corruptReads: m.corruptReads.value(),
    corruptDeleted: m.corrupt.value(),
    presenceInvalidated: m.invalidations.value(),
    busy: m.busy.value(),
    recentErrors: state.recentErrors,
    namespaces: Object.entries(state.accounting?.totals() ?? {}).map(([ns, t]) => ({
      ns,
      ...t,
      monthlyUsd: (t.bytes / 1e9) * state.storagePricePerGBMonth,
    })),
    accountingAt: state.accounting?.snapshotAt,
  }
}

/** Resets the cached store count (tests, after bulk changes). */
export function resetStatusCache(): void {
  statsCache = new WeakMap()
}

// The gateway keeps this many (middleware/errors.ts MAX_RECENT).
const MAX_SHOWN = 20

export function renderStatusPage(s: StatusSnapshot, price: number): string {
  const row = (k: string, v: string) => `<tr><th>${esc(k)}</th><td>${esc(v)}</td></tr>`
  const errors = s.recentErrors
    .slice()
    .reverse()
    .map(
      (e) =>
        `<tr><td>${esc(e.at)}</td><td>${esc(e.method)} ${esc(e.path)}</td><td>${e.status}</td><td>${esc(e.code)}</td><td>${esc(e.message)}</td></tr>`,
    )
    .join('')
  return `<!doctype html><html><head><meta charset="utf-8"><title>kvgate gateway</title>
<style>body{font:14px system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse;margin-bottom:1.5em}
th,td{text-align:left;padding:3px 12px;border-bottom:1px solid #ddd}th{font-weight:600;color:#555}</style></head><body>
<h1>kvgate gateway</h1>
<h2>Storage</h2><table>
${row('store', s.store)}
${row('objects', s.objects === undefined ? 'n/a for this store' : String(s.objects))}
${row('bytes', s.bytes === undefined ? 'n/a for this store' : fmtBytes(s.bytes))}
${row('written since start', `${s.writtenObjects} objects, ${fmtBytes(s.writtenBytes)}`)}
${
  s.monthlyStorageUsd === undefined
    ? ''
    : row(
        'est. storage cost / month',
        `$${s.monthlyStorageUsd.toFixed(2)} at $${price}/GB-month list price${s.bytes === undefined ? ' (bytes written since start)' : ''}`,
      )
}
</table>
<h2>Namespaces (fleet-wide${s.accountingAt === undefined ? ': no gc run yet, this instance only' : `, gc listing of ${new Date(s.accountingAt).toISOString()} + creations since`})</h2>
${s.namespaces.length ? `<table><tr><th>namespace</th><th>objects</th><th>bytes</th><th>$ / month</th></tr>${s.namespaces.map((n) => `<tr><td>${esc(n.ns)}</td><td>${n.objects}</td><td>${esc(fmtBytes(n.bytes))}</td><td>$${n.monthlyUsd.toFixed(2)}</td></tr>`).join('')}</table>` : '<p>none</p>'}
<h2>Traffic</h2><table>
${row('uptime', fmtDuration(s.uptimeSeconds))}
${row('requests', String(s.requests))}
${row('error answers (4xx and 5xx)', String(s.errors))}
${row('lookup hit rate (keys present)', `${pct(s.lookupPresent, s.lookupKeys)} of ${s.lookupKeys}`)}
${row('positive cache hit rate', `${pct(s.cacheHits, s.cacheHits + s.cacheMisses)}`)}
${row('chunk PUTs', `${s.putsCreated} created, ${s.putsExisting} already present`)}
${row('coalesced GETs', String(s.coalescedGets))}
${row('bytes in / out', `${fmtBytes(s.bytesIn)} / ${fmtBytes(s.bytesOut)}`)}
${row('store ops', `${s.storeOps}, mean ${s.storeMeanMs.toFixed(1)} ms`)}
${row('corrupt objects', `${s.corruptReads} corrupt reads, ${s.corruptDeleted} objects deleted for re-upload`)}
${row('presences forgotten after a miss', String(s.presenceInvalidated))}
${row('refused busy (503)', String(s.busy))}
</table>
<h2>Recent server errors</h2>
<p>5xx answers and timeouts, newest first (the last ${MAX_SHOWN}); client errors (4xx) are counted above, not listed.</p>
${errors ? `<table><tr><th>time</th><th>request</th><th>status</th><th>code</th><th>message</th></tr>${errors}</table>` : '<p>none</p>'}
</body></html>`
}
