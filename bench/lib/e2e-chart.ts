// Hand-written SVG charts for the fleet benchmark (no shared chart helper on main):
// a line chart of series over x, and a horizontal bar chart, stacked into one SVG.

const COLORS = ['#4e79a7', '#e15759', '#59a14f', '#f28e2b', '#76b7b2', '#b07aa1']
const esc = (s: string) => s.replace(/[&<>"]/g, (c) => `&#${c.charCodeAt(0)};`)

export interface Series {
  label: string
  points: { x: number; y: number }[]
  dashed?: boolean
}

export interface Panel {
  svg: string
  height: number
}

/** Lines over a shared x axis; y from 0 to yMax (e.g. 1 for rates). */
export function linePanel(
  title: string,
  xLabel: string,
  yLabel: string,
  series: Series[],
  yMax?: number,
): Panel {
  const W = 720
  const H = 220
  const left = 56
  const top = 34
  const right = 170
  const xs = series.flatMap((s) => s.points.map((p) => p.x))
  const xMin = Math.min(...xs, 0)
  const xMax = Math.max(...xs, 1)
  const top_ = yMax ?? Math.max(1e-9, ...series.flatMap((s) => s.points.map((p) => p.y)))
  const px = (x: number) => left + ((x - xMin) / (xMax - xMin || 1)) * (W - left - right)
  const py = (y: number) => top + H - (y / top_) * H
  const parts: string[] = []
  for (let i = 0; i <= 4; i++) {
    const y = (top_ * i) / 4
    parts.push(`<line x1="${left}" y1="${py(y)}" x2="${W - right}" y2="${py(y)}" stroke="#eee"/>`)
    const label = yMax === 1 ? `${(y * 100).toFixed(0)}%` : y.toPrecision(3)
    parts.push(`<text x="${left - 6}" y="${py(y) + 4}" font-size="10" text-anchor="end">${label}</text>`)
  }
  series.forEach((s, i) => {
    const color = COLORS[i % COLORS.length]!
    const d = s.points
      .map((p, j) => `${j === 0 ? 'M' : 'L'}${px(p.x).toFixed(1)},${py(p.y).toFixed(1)}`)
      .join(' ')
    parts.push(
      `<path d="${d}" fill="none" stroke="${color}" stroke-width="2"${s.dashed ? ' stroke-dasharray="5,4"' : ''}/>`,
    )
    const ly = top + 14 + i * 18
    parts.push(
      `<line x1="${W - right + 14}" y1="${ly - 4}" x2="${W - right + 34}" y2="${ly - 4}" stroke="${color}" stroke-width="2"${s.dashed ? ' stroke-dasharray="5,4"' : ''}/>`,
    )
    parts.push(`<text x="${W - right + 40}" y="${ly}" font-size="11">${esc(s.label)}</text>`)
  })
  parts.push(`<line x1="${left}" y1="${top + H}" x2="${W - right}" y2="${top + H}" stroke="#999"/>`)
  parts.push(`<text x="${left}" y="${top + H + 14}" font-size="10">${xMin}</text>`)
  parts.push(`<text x="${W - right}" y="${top + H + 14}" font-size="10" text-anchor="end">${xMax}</text>`)
  parts.push(
    `<text x="${(left + W - right) / 2}" y="${top + H + 28}" font-size="11" text-anchor="middle">${esc(xLabel)}</text>`,
  )
  parts.push(
    `<text x="12" y="${top + H / 2}" font-size="11" transform="rotate(-90 12 ${top + H / 2})" text-anchor="middle">${esc(yLabel)}</text>`,
  )
  parts.push(`<text x="${left}" y="20" font-size="14" font-weight="600">${esc(title)}</text>`)
  return { svg: parts.join('\n'), height: top + H + 40 }
}

/** Horizontal bars with their values printed (`format` turns a value into text). */
export function barPanel(
  title: string,
  bars: { label: string; value: number }[],
  format: (v: number) => string,
): Panel {
  const left = 170
  const barH = 20
  const gap = 8
  const top = 34
  const width = 420
  const max = Math.max(1e-9, ...bars.map((b) => b.value))
  const parts: string[] = [`<text x="10" y="20" font-size="14" font-weight="600">${esc(title)}</text>`]
  bars.forEach((b, i) => {
    const y = top + i * (barH + gap)
    const w = (b.value / max) * width
    parts.push(`<text x="${left - 8}" y="${y + 14}" font-size="11" text-anchor="end">${esc(b.label)}</text>`)
    parts.push(
      `<rect x="${left}" y="${y}" width="${w.toFixed(1)}" height="${barH}" fill="${COLORS[i % COLORS.length]}"/>`,
    )
    parts.push(`<text x="${left + w + 6}" y="${y + 14}" font-size="11">${esc(format(b.value))}</text>`)
  })
  return { svg: parts.join('\n'), height: top + bars.length * (barH + gap) + 10 }
}

/** Stacks panels vertically into one SVG document. */
export function stackPanels(panels: Panel[], width = 720): string {
  let y = 0
  const groups = panels.map((p) => {
    const g = `<g transform="translate(0 ${y})">\n${p.svg}\n</g>`
    y += p.height + 16
    return g
  })
  return `<svg xmlns="http://www.w3.org/2000/svg" width="${width}" height="${y}" viewBox="0 0 ${width} ${y}" font-family="sans-serif">
${groups.join('\n')}
</svg>
`
}
