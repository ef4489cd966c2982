import { describe, expect, it } from 'vitest'
import { barChart, escapeXml, lineChart, niceTicks, stackSvgs } from '../bench/lib/svg-chart.ts'

describe('bench/lib/svg-chart', () => {
  it('draws one rect per finite bar, escapes labels and marks reference lines', () => {
    const svg = barChart({
      title: 'ratio <vs> "fp16" & co',
      categories: ['a', 'b', 'c'],
      series: [
        { name: 'x', values: [1, 2, Number.NaN] },
        { name: 'y', values: [3, 4, 5] },
      ],
      refLines: [{ value: 6, label: 'target 6×' }],
    })
    expect(svg.startsWith('<svg')).toBe(true)
    expect(svg.trim().endsWith('</svg>')).toBe(true)
    // 1 background + 2 legend swatches + 5 bars
    expect(svg.match(/<rect /g)?.length).toBe(8)
    expect(svg).toContain('ratio &#60;vs&#62; &#34;fp16&#34; &#38; co')
    expect(svg).not.toContain('<vs>')
    expect(svg).toContain('stroke-dasharray')
    expect(svg).toContain('target 6×')
  })

  it('draws lines with a point per sample', () => {
    const svg = lineChart({
      title: 'speed',
      series: [
        {
          name: 's',
          points: [
            [1, 2],
            [2, 3],
            [3, 1],
          ],
        },
      ],
      xLabel: 'level',
    })
    expect(svg.match(/<circle /g)?.length).toBe(3)
    expect(svg).toContain('<polyline')
  })

  it('nice ticks cover the range with 1/2/5 steps', () => {
    expect(niceTicks(0, 9.3)).toEqual([0, 2, 4, 6, 8, 10])
    const t = niceTicks(0.013, 0.41)
    expect(t[0]).toBeLessThanOrEqual(0.013)
    expect(t[t.length - 1]).toBeGreaterThanOrEqual(0.41)
    expect(escapeXml(`<'&">`)).toBe('&#60;&#39;&#38;&#34;&#62;')
  })

  it('stacks charts into one document', () => {
    const a = barChart({ title: 'a', categories: ['x'], series: [{ name: 's', values: [1] }], height: 200 })
    const s = stackSvgs([a, a])
    expect(s.match(/<svg/g)?.length).toBe(1)
    expect(s).toContain('height="400"')
  })
})
