// A tiny hand-made SVG bar chart for bench/client.ts: one horizontal bar per
// figure, its target as a tick, green when the bar is met.

export interface ChartBar {
  label: string
  /** The measured ratio or value, in the same unit as target. */
  value: number
  target: number
  /** true: higher is better (ratios); false: lower is better (latencies). */
  higherIsBetter: boolean
  note: string
}

function esc(s: string): string {
  return s.replace(/&/g, '&amp;').replace(/</g, '&lt;').replace(/>/g, '&gt;')
}

export function barChartSvg(title: string, bars: readonly ChartBar[]): string {
  const W = 760
  const rowH = 46
  const left = 250
  const plotW = W - left - 40
  const H = 50 + rowH * bars.length
  const parts = [
    `<svg xmlns="http://www.w3.org/2000/svg" width="${W}" height="${H}" font-family="sans-serif" font-size="12">`,
    `<rect width="${W}" height="${H}" fill="white"/>`,
    `<text x="10" y="22" font-size="15" font-weight="bold">${esc(title)}</text>`,
  ]
  bars.forEach((b, i) => {
    const y = 40 + i * rowH
    const max = Math.max(b.value, b.target) * 1.15 || 1
    const w = (Math.max(0, b.value) / max) * plotW
    const tx = left + (b.target / max) * plotW
    const met = b.higherIsBetter ? b.value >= b.target : b.value < b.target
    parts.push(
      `<text x="10" y="${y + 16}">${esc(b.label)}</text>`,
      `<rect x="${left}" y="${y + 4}" width="${w.toFixed(1)}" height="18" fill="${met ? '#3a9d5d' : '#d0573f'}"/>`,
      `<line x1="${tx.toFixed(1)}" x2="${tx.toFixed(1)}" y1="${y}" y2="${y + 26}" stroke="black" stroke-dasharray="3,2"/>`,
      `<text x="${left}" y="${y + 38}" fill="#444">${esc(b.note)}</text>`,
    )
  })
  parts.push('</svg>')
  return `${parts.join('\n')}\n`
}
