// The agent's latency windows: quantiles over the latest `size` durations only (bounded
// memory), 0 when nothing was recorded, and only the timed ops are kept.

import { expect, it } from 'vitest'
import { AgentMetrics, LatencyWindow } from '../src/agent/metrics.ts'

it('LatencyWindow: quantiles of the latest size durations, older ones forgotten', () => {
  const w = new LatencyWindow(4)
  expect(w.quantile(0.5)).toBe(0)
  for (const ms of [100, 100, 100, 100]) w.add(ms)
  expect(w.quantile(0.99)).toBe(100)
  for (const ms of [1, 2, 3, 4]) w.add(ms) // the four 100s drop out
  expect(w.quantile(0.5)).toBe(3)
  expect(w.quantile(0.99)).toBe(4)
  expect(w.quantile(0)).toBe(1)
  expect(w.count).toBe(8)
})

it('AgentMetrics.took keeps lookup, load and save; other ops are not timed', () => {
  const m = new AgentMetrics()
  m.took('lookup', 0.25)
  m.took('save', 4)
  m.took('ping', 99)
  const s = m.snapshot() as { agentMs: Record<string, { p50: number; samples: number }> }
  expect(Object.keys(s.agentMs).sort()).toEqual(['load', 'lookup', 'save'])
  expect(s.agentMs.lookup).toMatchObject({ p50: 0.25, samples: 1 })
  expect(s.agentMs.save).toMatchObject({ p50: 4, samples: 1 })
  expect(s.agentMs.load).toMatchObject({ p50: 0, samples: 0 })
  expect(m.prometheus([])).toContain('kvgate_agent_request_seconds{op="save",quantile="0.5"} 0.004')
})

it('kvgate_agent_request_seconds is a whole summary: _sum and _count of every request, not of the window', () => {
  const m = new AgentMetrics()
  for (let i = 0; i < 1500; i++) m.took('lookup', 2) // past the 1024-sample window
  m.took('load', 250)
  const text = m.prometheus([])
  expect(text).toContain('kvgate_agent_request_seconds_sum{op="lookup"} 3\n')
  expect(text).toContain('kvgate_agent_request_seconds_count{op="lookup"} 1500\n')
  expect(text).toContain('kvgate_agent_request_seconds_sum{op="load"} 0.25\n')
  expect(text).toContain('kvgate_agent_request_seconds_sum{op="save"} 0\n')
})
