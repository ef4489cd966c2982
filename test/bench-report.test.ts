import { mkdtempSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { describe, expect, it } from 'vitest'
import { loadResults, renderReport } from '../bench/report.ts'

describe('benchmark report', () => {
  it('lists every bar with figure, baseline and verdict, embeds charts, skips junk files', () => {
    const dir = mkdtempSync(join(tmpdir(), 'kvgate-report-'))
    writeFileSync(
      join(dir, 'codec.json'),
      JSON.stringify({
        name: 'codec',
        date: '2026-11-21',
        machine: 'test box',
        bars: [
          {
            bar: 'decode speed',
            figure: 1.5,
            unit: 'GB/s',
            baseline: 3,
            baselineLabel: 'memcpy',
            ratio: 0.5,
            target: '≥ 1 GB/s',
            met: true,
          },
          { bar: 'ratio <script>', figure: 5.2, unit: '×', target: '≥ 6×', met: false },
          { bar: 'own target', figure: 1, unit: 'x', target: 'x', met: false, informational: true },
        ],
      }),
    )
    writeFileSync(join(dir, 'codec.svg'), '<svg id="codec-chart"></svg>')
    writeFileSync(join(dir, 'broken.json'), '{not json')
    const results = loadResults(dir)
    expect(results.map((r) => r.name)).toEqual(['codec'])
    const html = renderReport(results, dir)
    expect(html).toContain('<b>1 of 2</b> bars met')
    expect(html).toContain('Component targets')
    expect(html).toContain('own target')
    expect(html).toContain('decode speed')
    expect(html).toContain('memcpy')
    expect(html).toContain('class="no">not met')
    expect(html).toContain('id="codec-chart"')
    expect(html).not.toContain('<script>')
  })
})

describe('report ratio column', () => {
  it('is figure ÷ baseline for every bar, whatever ratio the benchmark stored', async () => {
    const { ratioOf } = await import('../bench/report.ts')
    const bar = { bar: 'b', unit: 'ms', target: 't', met: true }
    expect(ratioOf({ ...bar, figure: 2, baseline: 8, ratio: 4 })).toBe(0.25)
    expect(ratioOf({ ...bar, figure: 2 })).toBeUndefined()
    expect(ratioOf({ ...bar, figure: 2, baseline: 0 })).toBeUndefined()
  })
})

describe('chart labels', () => {
  it('wrap to the group width so neighbours never overlap', async () => {
    const { wrapLabel, barChart } = await import('../bench/lib/svg-chart.ts')
    const lines = wrapLabel('batched gather 512 × 64 KiB descriptors of a chunk', 12)
    expect(lines.length).toBeLessThanOrEqual(3)
    for (const l of lines) expect(l.length).toBeLessThanOrEqual(12)
    const svg = barChart({
      title: 't',
      categories: Array.from({ length: 8 }, (_, i) => `a rather long category label number ${i}`),
      series: [{ name: 's', values: [1, 2, 3, 4, 5, 6, 7, 8] }],
    })
    const groupChars = Math.floor((760 - 64 - 16) / 8 / 6.2)
    for (const m of svg.matchAll(/<tspan[^>]*>([^<]*)<\/tspan>/g))
      expect(m[1]!.length).toBeLessThanOrEqual(groupChars)
  })
})
