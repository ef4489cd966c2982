// Reads the gateway's Prometheus text (/metrics) back into numbers: object-store
// operations by kind (what S3 bills) and chunk PUT outcomes, for the demo and fleet reports.

import type { RequestCounts } from './pricing.ts'

export interface GatewayCounters {
  /** Store operations by op (get, head, put, list, delete), every outcome included. */
  storeOps: RequestCounts & { delete: number }
  /** Chunk PUTs by result: created (a new object), exists (another node stored it first), rejected. */
  puts: { created: number; exists: number; rejected: number }
  bytesIn: number
  bytesOut: number
}

/** Parses `name{labels} value` samples; lines it does not understand are skipped. */
export function parseSamples(
  text: string,
): { name: string; labels: Record<string, string>; value: number }[] {
  const out: { name: string; labels: Record<string, string>; value: number }[] = []
  for (const line of text.split('\n')) {
    if (line === '' || line.startsWith('#')) continue
    const m = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$/.exec(line)
    if (!m) continue
    const labels: Record<string, string> = {}
    for (const l of (m[2] ?? '').matchAll(/([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g)) {
      labels[l[1]!] = l[2]!.replace(/\\(.)/g, (_, c: string) => (c === 'n' ? '\n' : c))
    }
    const value = Number(m[3])
    if (Number.isFinite(value)) out.push({ name: m[1]!, labels, value })
  }
  return out
}

export function gatewayCounters(text: string): GatewayCounters {
  const c: GatewayCounters = {
    storeOps: { get: 0, head: 0, put: 0, list: 0, delete: 0 },
    puts: { created: 0, exists: 0, rejected: 0 },
    bytesIn: 0,
    bytesOut: 0,
  }
  for (const s of parseSamples(text)) {
    if (s.name === 'kvgate_store_ops_total') {
      const op = s.labels.op as keyof GatewayCounters['storeOps']
      if (op in c.storeOps) c.storeOps[op] += s.value
    } else if (s.name === 'kvgate_chunk_puts_total') {
      const r = s.labels.result as keyof GatewayCounters['puts']
      if (r in c.puts) c.puts[r] += s.value
    } else if (s.name === 'kvgate_http_bytes_in_total') c.bytesIn += s.value
    else if (s.name === 'kvgate_http_bytes_out_total') c.bytesOut += s.value
  }
  return c
}

/** Fetches and parses a gateway's /metrics. */
export async function fetchGatewayCounters(baseUrl: string): Promise<GatewayCounters> {
  const r = await fetch(`${baseUrl.replace(/\/+$/, '')}/metrics`, { signal: AbortSignal.timeout(10_000) })
  if (!r.ok) throw new Error(`GET ${baseUrl}/metrics: HTTP ${r.status}`)
  return gatewayCounters(await r.text())
}

/** b − a, field by field. */
export function diffCounters(b: GatewayCounters, a: GatewayCounters): GatewayCounters {
  const sub = <T extends object>(x: T, y: T): T => {
    const yy = y as Record<string, number>
    return Object.fromEntries(
      Object.entries(x as Record<string, number>).map(([k, v]) => [k, v - (yy[k] ?? 0)]),
    ) as T
  }
  return {
    storeOps: sub(b.storeOps, a.storeOps),
    puts: sub(b.puts, a.puts),
    bytesIn: b.bytesIn - a.bytesIn,
    bytesOut: b.bytesOut - a.bytesOut,
  }
}
