// The Worker's Cron Trigger ([triggers] crons in wrangler.toml): one gc pass over the R2
// bucket with the namespace policies from KVGATE_COLD_TIER, logged as one JSON line.

import { type GcReport, runGc } from '../../coldtier/gc.ts'
import { parseColdTier } from '../../coldtier/policy.ts'
import { ConfigError } from '../../core/errors.ts'
import { R2Store } from '../stores/r2.ts'
import type { WorkerEnv } from './workers.ts'

/** R2 Standard storage, $/GB-month (no egress fees). */
export const R2_PRICE_PER_GB_MONTH = 0.015

export async function scheduledGc(env: WorkerEnv, opts: { dryRun?: boolean } = {}): Promise<GcReport> {
  if (!env.KVGATE_BUCKET) throw new ConfigError('missing the KVGATE_BUCKET R2 binding (see wrangler.toml)')
  const config = parseColdTier(env.KVGATE_COLD_TIER, 'KVGATE_COLD_TIER')
  const report = await runGc({
    store: new R2Store(env.KVGATE_BUCKET),
    prefix: env.KVGATE_PREFIX ?? 'kv',
    config,
    dryRun: opts.dryRun ?? false,
    pricePerGBMonth: R2_PRICE_PER_GB_MONTH,
    // A Worker may hold 6 connections open at once.
    concurrency: 6,
  })
  console.log(
    JSON.stringify({
      msg: 'kvgate gc',
      run: report.run,
      requests: report.requests,
      errors: report.errors.slice(0, 20),
      namespaces: report.namespaces.map((n) => ({
        ns: n.ns,
        deleted: n.deleted,
        ...(n.deferred ? { deferred: n.deferred } : {}),
        kept: n.kept,
        listed: n.listed,
        monthlyUsd: n.monthlyUsdAfter,
      })),
    }),
  )
  return report
}
