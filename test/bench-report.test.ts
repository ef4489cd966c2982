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
