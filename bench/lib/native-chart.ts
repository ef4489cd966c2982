// A tiny hand-written SVG chart for bench/native.ts: groups of horizontal bars
// (one group per comparison, figure beside its baseline), no dependencies.

export interface ChartBar {
  label: string
  value: number
  /** Baselines are drawn grey, figures blue. */
  baseline?: boolean
}

export interface ChartGroup {
  title: string
  unit: string
  bars: ChartBar[]
}

const esc = (s: string) => s.replace(/&/g, '&amp;').replace(/</g, '&lt;').replace(/>/g, '&gt;')

function fmt(v: number): string {
  return v >= 100 ? v.toFixed(0) : v >= 10 ? v.toFixed(1) : v.toFixed(2)
}

/** Renders groups stacked vertically; each group scales to its own maximum. */
export function groupedBarChart(title: string, groups: ChartGroup[]): string {
  const width = 760
  const labelW = 300
  const barH = 16
  const gap = 4
  const plotW = width - labelW - 90
  let y = 36
  const parts: string[] = [`<text x="10" y="22" font-size="15" font-weight="bold">${esc(title)}</text>`]
  for (const g of groups) {
    parts.push(
      `<text x="10" y="${y + 12}" font-size="13" font-weight="bold">${esc(g.title)} (${esc(g.unit)})</text>`,
    )
    y += 20
    const max = Math.max(...g.bars.map((b) => b.value), 1e-9)
    for (const b of g.bars) {
      const w = Math.max(1, (b.value / max) * plotW)
      parts.push(
        `<text x="${labelW - 6}" y="${y + 12}" font-size="11" text-anchor="end">${esc(b.label)}</text>`,
        `<rect x="${labelW}" y="${y}" width="${w.toFixed(1)}" height="${barH}" fill="${b.baseline ? '#9e9e9e' : '#3b78c4'}"/>`,
        `<text x="${(labelW + w + 4).toFixed(1)}" y="${y + 12}" font-size="11">${fmt(b.value)}</text>`,
      )
      y += barH + gap
    }
    y += 12
  }
  return `<svg xmlns="http://www.w3.org/2000/svg" width="${width}" height="${y}" viewBox="0 0 ${width} ${y}" font-family="sans-serif">\n<rect width="100%" height="100%" fill="white"/>\n${parts.join('\n')}\n</svg>\n`
}
