// A tiny dependency-free SVG chart writer for benchmark reports: grouped bar
// charts and line charts, with reference lines (bars/targets) and escaped labels.

import { mkdirSync, writeFileSync } from 'node:fs'
import { join } from 'node:path'
import { RESULTS_DIR } from './stats.ts'

export const PALETTE = [
  '#4e79a7',
  '#f28e2b',
  '#59a14f',
  '#e15759',
  '#76b7b2',
  '#edc948',
  '#b07aa1',
  '#9c755f',
]

export interface Series {
  name: string
  values: readonly number[]
  color?: string
}

export interface RefLine {
  value: number
  label: string
  color?: string
}

export interface BarChartOptions {
  title: string
  /** One group of bars per category. */
  categories: readonly string[]
  /** One bar per series in every group (NaN / missing = no bar). */
  series: readonly Series[]
  yLabel?: string
  /** Horizontal lines, e.g. a target. */
  refLines?: readonly RefLine[]
  /** Write the value above each bar. @default true */
  labels?: boolean
  width?: number
  height?: number
  /** Digits in value labels. @default 2 */
  digits?: number
}

export interface LineSeries {
  name: string
  points: readonly (readonly [number, number])[]
  color?: string
}

export interface LineChartOptions {
  title: string
  series: readonly LineSeries[]
  xLabel?: string
  yLabel?: string
  refLines?: readonly RefLine[]
  width?: number
  height?: number
}

export function escapeXml(s: string): string {
  return s.replace(/[<>&"']/g, (ch) => `&#${ch.charCodeAt(0)};`)
}

/** "Nice" axis ticks (1, 2, 5 × 10^k) covering [lo, hi]. */
export function niceTicks(lo: number, hi: number, count = 5): number[] {
  if (!Number.isFinite(lo) || !Number.isFinite(hi)) return [0, 1]
  if (hi <= lo) hi = lo + 1
  const raw = (hi - lo) / count
  const mag = 10 ** Math.floor(Math.log10(raw))
  const step = ([1, 2, 5, 10].find((m) => m * mag >= raw) ?? 10) * mag
  const out: number[] = []
  for (let v = Math.floor(lo / step) * step; v <= hi + step * 1e-9; v += step)
    out.push(Number(v.toPrecision(12)))
  if (out[out.length - 1]! < hi) out.push(Number((out[out.length - 1]! + step).toPrecision(12)))
  return out
}

function fmt(v: number, digits: number): string {
  if (Math.abs(v) >= 1000) return v.toFixed(0)
  return v.toFixed(digits)
}

interface Frame {
  left: number
  top: number
  plotW: number
  plotH: number
  y: (v: number) => number
  parts: string[]
  ticks: number[]
}

function frame(
  title: string,
  width: number,
  height: number,
  yMin: number,
  yMax: number,
  yLabel: string | undefined,
  legend: { name: string; color: string }[],
): Frame {
  const left = 64
  const top = 40 + 16 * Math.ceil(legend.length / 4)
  const plotW = width - left - 16
  const plotH = height - top - 56
  const ticks = niceTicks(yMin, yMax)
  const lo = ticks[0]!
  const hi = ticks[ticks.length - 1]!
  const y = (v: number) => top + plotH - ((v - lo) / (hi - lo || 1)) * plotH
  const parts: string[] = [
    `<svg xmlns="http://www.w3.org/2000/svg" width="${width}" height="${height}" viewBox="0 0 ${width} ${height}" font-family="sans-serif" font-size="11">`,
    `<rect width="${width}" height="${height}" fill="#fff"/>`,
    `<text x="${width / 2}" y="18" text-anchor="middle" font-size="14" font-weight="bold">${escapeXml(title)}</text>`,
  ]
  legend.forEach((l, i) => {
    const lx = left + (i % 4) * Math.floor(plotW / 4)
    const ly = 30 + 16 * Math.floor(i / 4)
    parts.push(
      `<rect x="${lx}" y="${ly}" width="10" height="10" fill="${l.color}"/>`,
      `<text x="${lx + 14}" y="${ly + 9}">${escapeXml(l.name)}</text>`,
    )
  })
  for (const t of ticks) {
    const ty = y(t).toFixed(1)
    parts.push(
      `<line x1="${left}" x2="${left + plotW}" y1="${ty}" y2="${ty}" stroke="#ddd"/>`,
      `<text x="${left - 6}" y="${ty}" text-anchor="end" dominant-baseline="middle">${escapeXml(String(t))}</text>`,
    )
  }
  parts.push(`<line x1="${left}" x2="${left}" y1="${top}" y2="${top + plotH}" stroke="#333"/>`)
  if (yLabel) {
    parts.push(
      `<text transform="translate(14 ${top + plotH / 2}) rotate(-90)" text-anchor="middle">${escapeXml(yLabel)}</text>`,
    )
  }
  return { left, top, plotW, plotH, y, parts, ticks }
}

function refLines(f: Frame, lines: readonly RefLine[] | undefined): void {
  for (const r of lines ?? []) {
    const ry = f.y(r.value).toFixed(1)
    const color = r.color ?? '#c00'
    f.parts.push(
      `<line x1="${f.left}" x2="${f.left + f.plotW}" y1="${ry}" y2="${ry}" stroke="${color}" stroke-dasharray="6 3"/>`,
      `<text x="${f.left + f.plotW - 4}" y="${Number(ry) - 4}" text-anchor="end" fill="${color}">${escapeXml(r.label)}</text>`,
    )
  }
}

/** Splits a label into lines of at most `width` characters (words kept whole when they fit), at most 3 lines. */
export function wrapLabel(label: string, width: number): string[] {
  const lines: string[] = []
  let cur = ''
  for (const word of label.split(/\s+/)) {
    if (cur && cur.length + 1 + word.length > width) {
      lines.push(cur)
      cur = word
    } else cur = cur ? `${cur} ${word}` : word
  }
  if (cur) lines.push(cur)
  if (lines.length > 3)
    lines.splice(
      2,
      lines.length - 2,
      `${lines
        .slice(2)
        .join(' ')
        .slice(0, width - 1)}…`,
    )
  return lines.map((l) => (l.length > width ? `${l.slice(0, width - 1)}…` : l))
}

export interface FigureRow {
  label: string
  value: number
  /** A baseline measured in the same run (drawn in its own colour). */
  baseline?: boolean
}

/** One bar per row, figures and same-run baselines in two colours: the common bench chart. */
export function figureChart(
  title: string,
  yLabel: string,
  rows: readonly FigureRow[],
  refLines?: readonly RefLine[],
): string {
  return barChart({
    title,
    yLabel,
    categories: rows.map((r) => r.label),
    series: [
      { name: 'kvgate', values: rows.map((r) => (r.baseline ? Number.NaN : r.value)) },
      {
        name: 'baseline (same run)',
        values: rows.map((r) => (r.baseline ? r.value : Number.NaN)),
        color: '#9a9a9a',
      },
    ],
    ...(refLines ? { refLines } : {}),
    width: Math.max(760, rows.length * 110),
  })
}

/** A grouped bar chart as SVG text. */
export function barChart(opts: BarChartOptions): string {
  const width = opts.width ?? 760
  const height = opts.height ?? 380
  const digits = opts.digits ?? 2
  const all = opts.series.flatMap((s) => s.values.filter((v) => Number.isFinite(v)))
  for (const r of opts.refLines ?? []) all.push(r.value)
  const yMax = Math.max(0, ...all) * 1.08
  const yMin = Math.min(0, ...all)
  const legend = opts.series.map((s, i) => ({ name: s.name, color: s.color ?? PALETTE[i % PALETTE.length]! }))
  const f = frame(opts.title, width, height, yMin, yMax, opts.yLabel, legend)
  const groupW = f.plotW / Math.max(1, opts.categories.length)
  const barW = Math.max(2, (groupW * 0.8) / Math.max(1, opts.series.length))
  const zero = f.y(Math.max(yMin, Math.min(0, f.ticks[f.ticks.length - 1]!)))
  opts.categories.forEach((cat, ci) => {
    const gx = f.left + ci * groupW + groupW * 0.1
    opts.series.forEach((s, si) => {
      const v = s.values[ci]
      if (v === undefined || !Number.isFinite(v)) return
      const x = gx + si * barW
      const yv = f.y(v)
      const top = Math.min(yv, zero)
      f.parts.push(
        `<rect x="${x.toFixed(1)}" y="${top.toFixed(1)}" width="${(barW - 1).toFixed(1)}" height="${Math.abs(zero - yv).toFixed(1)}" fill="${legend[si]!.color}"><title>${escapeXml(`${s.name} / ${cat}: ${v}`)}</title></rect>`,
      )
      if (opts.labels ?? true) {
        f.parts.push(
          `<text x="${(x + barW / 2).toFixed(1)}" y="${(top - 3).toFixed(1)}" text-anchor="middle" font-size="9">${escapeXml(fmt(v, digits))}</text>`,
        )
      }
    })
    // Wrapped to the group's width (at most 3 lines) so neighbouring labels never overlap.
    const cx = (f.left + ci * groupW + groupW / 2).toFixed(1)
    const lines = wrapLabel(cat, Math.max(4, Math.floor(groupW / 6.2)))
    f.parts.push(
      `<text x="${cx}" y="${f.top + f.plotH + 16}" text-anchor="middle">${lines
        .map((l, i) => `<tspan x="${cx}" dy="${i === 0 ? 0 : 12}">${escapeXml(l)}</tspan>`)
        .join('')}</text>`,
    )
  })
  f.parts.push(`<line x1="${f.left}" x2="${f.left + f.plotW}" y1="${zero}" y2="${zero}" stroke="#333"/>`)
  refLines(f, opts.refLines)
  f.parts.push('</svg>')
  return `${f.parts.join('\n')}\n`
}

/** A line chart (x numeric) as SVG text. */
export function lineChart(opts: LineChartOptions): string {
  const width = opts.width ?? 760
  const height = opts.height ?? 380
  const xs = opts.series.flatMap((s) => s.points.map((p) => p[0]))
  const ys = opts.series.flatMap((s) => s.points.map((p) => p[1]))
  for (const r of opts.refLines ?? []) ys.push(r.value)
  const legend = opts.series.map((s, i) => ({ name: s.name, color: s.color ?? PALETTE[i % PALETTE.length]! }))
  const f = frame(opts.title, width, height, Math.min(0, ...ys), Math.max(...ys) * 1.05, opts.yLabel, legend)
  const xt = niceTicks(Math.min(...xs), Math.max(...xs))
  const x0 = xt[0]!
  const x1 = xt[xt.length - 1]!
  const x = (v: number) => f.left + ((v - x0) / (x1 - x0 || 1)) * f.plotW
  for (const t of xt) {
    f.parts.push(
      `<text x="${x(t).toFixed(1)}" y="${f.top + f.plotH + 16}" text-anchor="middle">${escapeXml(String(t))}</text>`,
    )
  }
  if (opts.xLabel) {
    f.parts.push(
      `<text x="${f.left + f.plotW / 2}" y="${f.top + f.plotH + 36}" text-anchor="middle">${escapeXml(opts.xLabel)}</text>`,
    )
  }
  opts.series.forEach((s, i) => {
    const pts = s.points.map((p) => `${x(p[0]).toFixed(1)},${f.y(p[1]).toFixed(1)}`)
    f.parts.push(
      `<polyline fill="none" stroke="${legend[i]!.color}" stroke-width="2" points="${pts.join(' ')}"/>`,
    )
    for (const p of s.points) {
      f.parts.push(
        `<circle cx="${x(p[0]).toFixed(1)}" cy="${f.y(p[1]).toFixed(1)}" r="3" fill="${legend[i]!.color}"><title>${escapeXml(`${s.name}: (${p[0]}, ${p[1]})`)}</title></circle>`,
      )
    }
  })
  refLines(f, opts.refLines)
  f.parts.push('</svg>')
  return `${f.parts.join('\n')}\n`
}

/** Writes `svg` to bench/results/<name>.svg (or an absolute path); returns the path. */
export function writeSvg(name: string, svg: string): string {
  const path = name.startsWith('/') ? name : join(RESULTS_DIR, `${name}.svg`)
  mkdirSync(RESULTS_DIR, { recursive: true })
  writeFileSync(path, svg)
  return path
}

/** Several charts stacked vertically in one SVG (each keeps its own size). */
export function stackSvgs(svgs: readonly string[]): string {
  let y = 0
  let w = 0
  const parts: string[] = []
  for (const s of svgs) {
    const m = /width="(\d+)" height="(\d+)"/.exec(s)
    const sw = Number(m?.[1] ?? 760)
    const sh = Number(m?.[2] ?? 380)
    parts.push(
      `<g transform="translate(0 ${y})">${s.replace(/^<svg[^>]*>/, '').replace(/<\/svg>\s*$/, '')}</g>`,
    )
    y += sh
    w = Math.max(w, sw)
  }
  return `<svg xmlns="http://www.w3.org/2000/svg" width="${w}" height="${y}" viewBox="0 0 ${w} ${y}" font-family="sans-serif" font-size="11">\n${parts.join('\n')}\n</svg>\n`
}
