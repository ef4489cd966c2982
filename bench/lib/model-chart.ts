// A hand-written horizontal bar chart (SVG) for bench/model.ts: one bar per row,
// measured figure next to its baseline. No dependencies, no scripts in the SVG.

const esc = (s: string) =>
  s.replace(/[&<>"]/g, (c) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;' })[c]!)

export interface ChartRow {
  label: string
  value: number
  /** Drawn lighter: a baseline measured in the same run. */
  baseline?: boolean
}

export function barChart(title: string, unit: string, rows: ChartRow[]): string {
  const w = 760
  const labelW = 300
  const rowH = 26
  const top = 40
  const h = top + rows.length * rowH + 20
  const max = Math.max(...rows.map((r) => r.value), 1e-9)
  const bars = rows
    .map((r, i) => {
      const y = top + i * rowH
      const bw = ((w - labelW - 110) * r.value) / max
      const fill = r.baseline ? '#b9c7d8' : '#2f6db5'
      return `<text x="${labelW - 8}" y="${y + 17}" text-anchor="end" font-size="12">${esc(r.label)}</text>
<rect x="${labelW}" y="${y + 4}" width="${bw.toFixed(1)}" height="${rowH - 8}" fill="${fill}"/>
<text x="${(labelW + bw + 6).toFixed(1)}" y="${y + 17}" font-size="12">${r.value.toPrecision(4)} ${esc(unit)}</text>`
    })
    .join('\n')
  return `<svg xmlns="http://www.w3.org/2000/svg" width="${w}" height="${h}" viewBox="0 0 ${w} ${h}" font-family="system-ui,sans-serif">
<text x="10" y="22" font-size="15" font-weight="600">${esc(title)}</text>
${bars}
</svg>
`
}
