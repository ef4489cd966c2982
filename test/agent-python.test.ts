// Runs the Python connector's suites (python/tests, pytest under Debian's /usr/bin/python3,
// which has python3-torch/msgpack/pytest/cbor2) so `npm test` covers the vLLM connector.

import { spawnSync } from 'node:child_process'
import { existsSync } from 'node:fs'
import { describe, expect, it } from 'vitest'

const PYTHON = '/usr/bin/python3'

function probe(): string | undefined {
  if (!existsSync(PYTHON)) return `${PYTHON} is absent`
  const r = spawnSync(PYTHON, ['-c', 'import torch, msgpack, pytest'], { encoding: 'utf8' })
  if (r.status !== 0)
    return `python3-torch / python3-msgpack / python3-pytest are not installed for ${PYTHON}: ${r.stderr.trim().split('\n').pop()}`
  return undefined
}

const missing = probe()
if (missing) console.warn(`skipping the Python connector suites: ${missing}`)

function pytest(file: string): void {
  const r = spawnSync(PYTHON, ['-m', 'pytest', '-q', '-p', 'no:cacheprovider', `python/tests/${file}`], {
    encoding: 'utf8',
    env: { ...process.env, PYTHONHASHSEED: '0', PYTHONDONTWRITEBYTECODE: '1' },
    timeout: 14 * 60_000,
  })
  const out = `${r.stdout}\n${r.stderr}`
  if (r.status !== 0) console.error(out.slice(-6000))
  expect(r.status, out.slice(-2000)).toBe(0)
  expect(out).toMatch(/\d+ passed/)
}

describe.skipIf(missing !== undefined)('kvgate_vllm (pytest)', () => {
  it(
    'block hashes = vLLM sha256_cbor = kvgate vllm-sha256-cbor keys',
    () => pytest('test_hashing.py'),
    120_000,
  )
  it(
    "the connector's agent client: who reads the socket, progress events, a dead agent",
    () => pytest('test_client.py'),
    120_000,
  )
  it(
    'the connector against a misbehaving agent: stalls, refusals, garbage answers, bounded state',
    () => pytest('test_faults.py'),
    5 * 60_000,
  )
  it('connector harness against real agents and a gateway', () => pytest('test_connector.py'), 15 * 60_000)
  it(
    "a load given up while its copy is stalled in the agent: the request's blocks are held until it lands",
    () => pytest('test_fence.py'),
    5 * 60_000,
  )
  it('real model: continuation after load', () => pytest('test_model.py'), 15 * 60_000)
})
