// Builds report.html (in the results directory) from the JSON results and SVG charts the
// benchmarks wrote: for each bar (docs/benchmarks.md), the figure, the baseline measured in the same run, and the verdict.

import { existsSync, readdirSync, readFileSync, writeFileSync } from 'node:fs'
import { join } from 'node:path'
import { fileURLToPath } from 'node:url'
import { type BarResult, type BenchResult, RESULTS_DIR } from './lib/stats.ts'

const esc = (s: unknown) =>
  String(s).replace(/[&<>"]/g, (c) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;' })[c]!)

function fmt(n: number | undefined): string {
  if (n === undefined || !Number.isFinite(n)) return '—'
  const a = Math.abs(n)
  return a >= 100 ? n.toFixed(0) : a >= 1 ? n.toFixed(2) : n.toPrecision(3)
}

export function loadResults(dir = RESULTS_DIR): BenchResult[] {
  if (!existsSync(dir)) return []
  return readdirSync(dir)
    .filter((f) => f.endsWith('.json'))
    .sort()
    .flatMap((f) => {
      try {
        const r = JSON.parse(readFileSync(join(dir, f), 'utf8')) as BenchResult
        return typeof r.name === 'string' ? [{ ...r, bars: Array.isArray(r.bars) ? r.bars : [] }] : []
      } catch {
        return []
      }
    })
}

/**
 * The ratio column has one meaning: figure ÷ baseline, both in the bar's unit. (Benchmarks
 * used to store their own ratios, some inverted; the stored value is kept in the raw result only.)
 */
export function ratioOf(b: BarResult): number | undefined {
  return b.baseline !== undefined && b.baseline !== 0 && Number.isFinite(b.figure / b.baseline)
    ? b.figure / b.baseline
    : undefined
}

function barRow(b: BarResult, bench: string): string {
  const verdict = b.met ? '<td class="ok">met</td>' : '<td class="no">not met</td>'
  return `<tr><td>${esc(bench)}</td><td>${esc(b.bar)}</td><td class="n">${fmt(b.figure)} ${esc(b.unit)}</td>
<td class="n">${b.baseline === undefined ? '—' : `${fmt(b.baseline)} <span class="dim">${esc(b.baselineLabel ?? '')}</span>`}</td>
<td class="n">${ratioOf(b) === undefined ? '—' : `${fmt(ratioOf(b))}×`}</td><td>${esc(b.target)}</td>${verdict}</tr>`
}

export function renderReport(results: BenchResult[], dir = RESULTS_DIR): string {
  const design = (b: BarResult) => b.informational !== true
  const rows = results.flatMap((r) => r.bars.filter(design).map((b) => barRow(b, r.name)))
  const infoRows = results.flatMap((r) => r.bars.filter((b) => !design(b)).map((b) => barRow(b, r.name)))
  const met = results.flatMap((r) => r.bars.filter(design)).filter((b) => b.met).length
  const total = results.flatMap((r) => r.bars.filter(design)).length
  const sections = results
    .map((r) => {
      const svg = join(dir, `${r.name}.svg`)
      const chart = existsSync(svg) ? readFileSync(svg, 'utf8') : ''
      return `<section><h2>${esc(r.name)}</h2><p class="dim">${esc(r.date)} · ${esc(r.machine)}</p>${chart}
<details><summary>raw result</summary><pre>${esc(JSON.stringify(r, null, 2))}</pre></details></section>`
    })
    .join('\n')
  return `<!doctype html><html><head><meta charset="utf-8"><title>kvgate benchmark report</title>
<style>body{font:14px/1.45 system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;width:100%}td,th{border-bottom:1px solid #ddd;padding:4px 6px;text-align:left;vertical-align:top}
.n{text-align:right;white-space:nowrap}.ok{color:#0a7d28;font-weight:600}.no{color:#b3261e;font-weight:600}.dim{color:#777;font-size:12px}
section{margin-top:2em}pre{max-height:300px;overflow:auto;background:#f6f6f6;padding:8px}svg{max-width:100%;height:auto}</style></head><body>
<h1>kvgate benchmark report</h1>
<p><b>${met} of ${total}</b> bars met. Each figure and its baseline were measured in the same run on the same machine
(ratios and medians of repeats: these machines are noisy). The bars and what they mean: docs/benchmarks.md.</p>
<table><thead><tr><th>bench</th><th>bar</th><th>figure</th><th>baseline (same run)</th><th>figure ÷ baseline</th><th>target</th><th>verdict</th></tr></thead>
<tbody>${rows.join('\n')}</tbody></table>
${
  infoRows.length > 0
    ? `<h3>Component targets (set by the project, not DESIGN.md bars)</h3>
<table><thead><tr><th>bench</th><th>measure</th><th>figure</th><th>baseline (same run)</th><th>figure ÷ baseline</th><th>target</th><th>verdict</th></tr></thead>
<tbody>${infoRows.join('\n')}</tbody></table>`
    : ''
}
${sections}
</body></html>`
}

export function writeReport(dir = RESULTS_DIR): string {
  const path = join(dir, 'report.html')
  writeFileSync(path, renderReport(loadResults(dir), dir))
  return path
}

if (process.argv[1] === fileURLToPath(import.meta.url)) console.log(writeReport())
