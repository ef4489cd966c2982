// Renders a demo result for people: per-tier traffic of both nodes, compression,
// the prefill work node B skipped, both continuations, and the checks.

import type { KVCacheStats } from '../client/index.ts'
import { type DemoResult, fmtBytes, fmtMs } from './run.ts'

function tierRows(s: KVCacheStats): [string, string][] {
  const rows: [string, string][] = []
  const m = s.memory
  rows.push([
    'L1 memory',
    `${m.hits} hits, ${fmtBytes(m.bytesRead)} read, ${fmtBytes(m.bytesWritten)} written`,
  ])
  const d = s.disk
  if (d)
    rows.push([
      'L2 disk',
      `${d.hits} hits, ${fmtBytes(d.bytesRead)} read, ${fmtBytes(d.bytesWritten)} written`,
    ])
  const r = s.remote
  if (r) {
    const lat =
      (r.readLatency.count > 0 ? `, GET p50 ${fmtMs(r.readLatency.p50Ms)}` : '') +
      (r.lookupLatency.count > 0 ? `, lookup p50 ${fmtMs(r.lookupLatency.p50Ms)}` : '')
    rows.push([
      'L4 gateway',
      `${r.hits} hits, ${fmtBytes(r.bytesRead)} read${lat}; ${r.puts} PUTs, ${fmtBytes(r.bytesWritten)} written` +
        (r.errors > 0 ? `; ${r.errors} errors absorbed (breaker ${r.breaker})` : ''),
    ])
  }
  return rows
}

export function renderDemo(r: DemoResult): string {
  const out: string[] = []
  const a = r.nodeA
  const b = r.nodeB
  out.push('')
  out.push(
    r.mode === 'model'
      ? `model: ${r.model.modelId} (TypeScript forward pass), ${r.chunkTokens}-token chunks, codec ${r.codec}`
      : `synthetic ${r.model.modelId}-shaped KV (${r.modeReason ?? 'no model'}), ${r.chunkTokens}-token chunks, codec ${r.codec}`,
  )
  const nat = a.stats.native
  out.push(
    nat.loaded
      ? 'L1 is pinned host memory from the native addon'
      : 'L1 is plain memory: the native addon is not loaded (npx kvgate build-native builds it; --json says why)',
  )
  out.push('')
  const w = 12
  const rowsA = tierRows(a.stats)
  const rowsB = tierRows(b.stats)
  out.push(`${'tier'.padEnd(w)}node A (writer)`)
  for (const [t, v] of rowsA) out.push(`${t.padEnd(w)}${v}`)
  out.push(`${'tier'.padEnd(w)}node B (cold reader)`)
  for (const [t, v] of rowsB) out.push(`${t.padEnd(w)}${v}`)
  out.push('')
  if (r.compression.storedBytes > 0) {
    out.push(
      `compression: ${fmtBytes(r.compression.rawBytes)} of KV → ${fmtBytes(r.compression.storedBytes)} in L4 (${r.compression.ratio.toFixed(2)}× smaller, ${r.codec})`,
    )
  }
  const pct = r.promptTokens > 0 ? ((100 * r.saved.tokens) / r.promptTokens).toFixed(0) : '0'
  const how = r.mode === 'model' ? 'computing them' : 'generating them (synthetic KV stands in for prefill)'
  out.push(
    `prefill saved: ${r.saved.tokens} of ${r.promptTokens} tokens (${pct}%); node A spent ${fmtMs(r.saved.prefillMs)} ${how}, node B ${fmtMs(r.saved.fetchMs)} fetching them`,
  )
  out.push(
    `node B recomputed ${b.recomputedTokens} tokens (${b.retrievedTokens > 0 ? 'the partial tail' : 'the whole prompt'}) in ${fmtMs(b.recomputeMs)}; ready to decode after ${fmtMs(r.saved.fetchMs + b.recomputeMs)} vs ${fmtMs(a.prefillMs)} for node A's full ${r.mode === 'model' ? 'prefill' : 'KV generation'} (both processes warmed up first)`,
  )
  if (r.mode === 'model') {
    out.push('')
    const p = r.promptText ?? ''
    out.push(
      `prompt (${r.promptTokens} tokens): "${p.length > 90 ? `${p.slice(0, 40)} … ${p.slice(-45)}` : p}"`,
    )
    out.push(`node A continues: "${oneLine(a.continuationText ?? '')}"`)
    out.push(`node B continues: "${oneLine(b.continuationText ?? '')}"`)
  }
  out.push('')
  for (const c of r.checks) out.push(`${c.ok ? 'PASS' : 'FAIL'}  ${c.name} — ${c.detail}`)
  out.push('')
  out.push(`${r.ok ? 'demo OK' : 'demo FAILED'} in ${fmtMs(r.totalMs)}`)
  return out.join('\n')
}

function oneLine(s: string): string {
  return s.replace(/\s+/g, ' ').trim()
}
