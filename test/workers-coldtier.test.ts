// The cold tier in real workerd (Miniflare 4) on a local R2 bucket: use records flushed
// through waitUntil, the Cron Trigger's gc deleting an unused chain and keeping a used one,
// and the accounting it writes shown on /metrics.

import { mkdtempSync, readFileSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { Miniflare } from 'miniflare'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { buildWorker } from '../scripts/build-worker.ts'
import type { R2BucketLike } from '../src/gateway/stores/r2.ts'
import { makeChain, putInit } from './gateway-fixtures.ts'

const ROOT = join(import.meta.dirname, '..')
const wrangler = readFileSync(join(ROOT, 'wrangler.toml'), 'utf8')
const compatibilityDate = /^compatibility_date\s*=\s*"([^"]+)"/m.exec(wrangler)?.[1]
const crons = JSON.parse(/^crons\s*=\s*(\[[^\]]*\])/m.exec(wrangler)?.[1] ?? '[]') as string[]

let out: string
let mf: Miniflare
let base: string

beforeAll(async () => {
  out = mkdtempSync(join(tmpdir(), 'kvgate-workers-ct-'))
  const build = await buildWorker({ outdir: join(out, 'gateway') })
  mf = new Miniflare({
    modules: true,
    compatibilityDate,
    modulesRules: [{ type: 'CompiledWasm' as const, include: ['**/*.wasm'] }],
    modulesRoot: join(out, 'gateway'),
    scriptPath: build.script,
    r2Buckets: ['KVGATE_BUCKET'],
    bindings: {
      KVGATE_AUTH: 'disabled',
      KVGATE_PREFIX: 'kv',
      // Short enough for a test: a chain unused for 2 s is past retention.
      KVGATE_COLD_TIER: JSON.stringify({
        grace: '0s',
        condemnWait: '1s',
        usage: { flushInterval: '0s', maxDelay: '0s' },
        namespaces: { prod: { retention: '2s' } },
      }),
    },
  })
  base = (await mf.ready).toString().replace(/\/$/, '')
})

afterAll(async () => {
  await mf?.dispose()
  if (out) rmSync(out, { recursive: true, force: true })
})

interface ScheduledWorker {
  scheduled(opts: { cron?: string; scheduledTime?: Date }): Promise<{ outcome: string }>
}

const names = async (prefix: string) => {
  const bucket = (await mf.getR2Bucket('KVGATE_BUCKET')) as unknown as R2BucketLike
  return (await bucket.list({ prefix })).objects.map((o) => o.key)
}

describe('cold tier in workerd on R2', () => {
  it('wrangler.toml schedules gc', () => {
    expect(crons.length).toBe(1)
    expect(wrangler).toMatch(/^KVGATE_COLD_TIER = '\{.*\}'$/m)
  })

  it('the Cron Trigger deletes an unused chain, keeps a used one, and accounts for it', async () => {
    const used = makeChain(3)
    const unused = makeChain(3)
    for (const c of [...used, ...unused]) {
      const r = await fetch(`${base}/v1/ns/prod/chunks/${c.key}`, putInit(c.bytes))
      expect(r.status).toBe(201)
    }
    await new Promise((r) => setTimeout(r, 2500))
    const records = (await names('kv/_usage/prod/')).length
    const look = await fetch(`${base}/v1/ns/prod/lookup`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ keys: used.map((c) => c.key) }),
    })
    expect(await look.json()).toEqual({ present: 3 })
    // The flush runs in waitUntil after the response: wait for its record.
    for (let i = 0; i < 50 && (await names('kv/_usage/prod/')).length === records; i++)
      await new Promise((r) => setTimeout(r, 100))
    expect((await names('kv/_usage/prod/')).length).toBeGreaterThan(records)

    const worker = (await mf.getWorker()) as unknown as ScheduledWorker
    // Two phases: the first run condemns, the next one past condemnWait deletes.
    expect((await worker.scheduled({ cron: crons[0]!, scheduledTime: new Date() })).outcome).toBe('ok')
    expect((await names('kv/prod/')).length).toBe(6)
    expect((await names('kv/_coldtier/condemned/prod/')).length).toBe(1)
    await new Promise((r) => setTimeout(r, 1100))
    const res = await worker.scheduled({ cron: crons[0]!, scheduledTime: new Date() })
    expect(res.outcome).toBe('ok')
    expect(await names('kv/_coldtier/condemned/prod/')).toEqual([])
    const chunks = await names('kv/prod/')
    expect(used.every((c) => chunks.some((n) => n.endsWith(c.key)))).toBe(true)
    expect(unused.some((c) => chunks.some((n) => n.endsWith(c.key)))).toBe(false)
    expect(await names('kv/_usage/prod/')).toEqual([]) // compacted into the index
    expect((await names('kv/_coldtier/index/prod/')).length).toBe(1)
    const metrics = await (await fetch(`${base}/metrics`)).text()
    expect(metrics).toMatch(/^kvgate_namespace_stored_objects\{ns="prod"\} 3$/m)
    const bytes = used.reduce((s, c) => s + c.bytes.length, 0)
    expect(metrics).toContain(`kvgate_namespace_stored_bytes{ns="prod"} ${bytes}`)
    expect(metrics).toMatch(/^kvgate_namespace_storage_usd_per_month\{ns="prod"\} [0-9.e-]+$/m)
    // The deleted chain is a miss, never bytes.
    expect((await fetch(`${base}/v1/ns/prod/chunks/${unused[0]!.key}`)).status).toBe(404)
  })
})
