// A tiny hand-written SVG grouped bar chart for the gateway benchmark (no
// shared chart helper on main yet): groups of labelled bars with values.

export interface ChartGroup {
  label: string
  bars: { label: string; value: number }[]
}

const COLORS = ['#4e79a7', '#f28e2b', '#59a14f', '#e15759']
const esc = (s: string) => s.replace(/[&<>"]/g, (c) => `&#${c.charCodeAt(0)};`)

export function barChartSvg(title: string, unit: string, groups: ChartGroup[]): string {
  const barW = 36
  const gap = 28
  const h = 240
  const top = 40
  const left = 50
  const max = Math.max(1e-9, ...groups.flatMap((g) => g.bars.map((b) => b.value)))
  let x = left
  const parts: string[] = []
  const legend = new Map<string, string>()
  for (const g of groups) {
    const start = x
    g.bars.forEach((b, i) => {
      const color = COLORS[i % COLORS.length]!
      legend.set(b.label, color)
      const bh = (b.value / max) * h
      parts.push(`<rect x="${x}" y="${top + h - bh}" width="${barW}" height="${bh}" fill="${color}"/>`)
      parts.push(
        `<text x="${x + barW / 2}" y="${top + h - bh - 4}" font-size="10" text-anchor="middle">${b.value.toFixed(0)}</text>`,
      )
      x += barW
    })
    parts.push(
      `<text x="${(start + x) / 2}" y="${top + h + 16}" font-size="11" text-anchor="middle">${esc(g.label)}</text>`,
    )
    x += gap
  }
  const width = x + 160
  let ly = top
  for (const [label, color] of legend) {
    parts.push(`<rect x="${x}" y="${ly}" width="12" height="12" fill="${color}"/>`)
    parts.push(`<text x="${x + 18}" y="${ly + 10}" font-size="11">${esc(label)}</text>`)
    ly += 18
  }
  return `<svg xmlns="http://www.w3.org/2000/svg" width="${width}" height="${top + h + 40}" font-family="sans-serif">
<text x="${left}" y="20" font-size="14" font-weight="600">${esc(title)}</text>
<text x="8" y="${top + h / 2}" font-size="11" transform="rotate(-90 8 ${top + h / 2})">${esc(unit)}</text>
<line x1="${left - 4}" y1="${top + h}" x2="${x}" y2="${top + h}" stroke="#999"/>
${parts.join('\n')}
</svg>
`
}
