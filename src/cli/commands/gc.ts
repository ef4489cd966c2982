// `kvgate gc`: one cold-tier pass over the gateway's bucket (retention by last use, LRU
// quotas from chain tails, use-record compaction, accounting), with --dry-run and a summary.

import { type GcProgress, type GcReport, type NamespaceReport, runGc } from '../../coldtier/gc.ts'
import { isNamespaceName } from '../../core/keys.ts'
import {
  resolveServeConfig,
  type ServeSettings,
  settingsFromEnv,
  settingsFromFile,
} from '../../gateway/config.ts'
import { parseCommandArgs } from '../args.ts'
import { openStore } from './serve.ts'

const HELP = `Usage: kvgate gc [options]

One garbage-collection pass over the gateway's bucket, with the gateway's own config:
  - folds the gateways' use records into each namespace's chain index (compaction);
  - deletes chains not used within the namespace's retention;
  - evicts least-recently-used chains while a namespace is over its byte quota;
  - in two phases: a run condemns, a run at least the gateways' maxDelay (+ margin) later
    deletes what is still unused, so uses gateways had not flushed yet save their chunks;
  - always from a chain's tail: chunk i never goes while chunk i+1 of its chain stays;
  - deletes chunks left behind a missing chunk (a hole) once older than the grace period;
  - keeps anything read or written within the grace period;
  - writes the per-namespace accounting the gateways show on /metrics and /.
Safe to run from a timer, twice at once, and beside live traffic. See docs/cold-tier.md.

Options:
  -c, --config FILE     the gateway's YAML config (store, prefix, coldTier) (env: KVGATE_CONFIG)
      --store KIND      fs | s3 [fs]   (and --dir, --prefix, --s3-bucket, --s3-endpoint, --s3-region
      --dir DIR          as for kvgate serve; KVGATE_* variables apply too)
      --prefix P
      --s3-bucket NAME
      --s3-endpoint URL
      --s3-region REGION
      --namespace NS    only this namespace (repeatable); others are still accounted
      --dry-run         plan and report; write and delete nothing
      --price USD       $/GB-month for cost figures [0.023, S3 Standard]
      --concurrency N   store requests in flight [16]
      --json            print the report as JSON on stdout
  -q, --quiet           no progress lines on stderr
  -h, --help

Exit status: 0 done, 1 done with errors (listed in the summary), 2 bad usage.`

export async function run(argv: string[]): Promise<number> {
  const { values, help } = parseCommandArgs(argv, {
    config: { type: 'string', short: 'c' },
    store: { type: 'string' },
    dir: { type: 'string' },
    prefix: { type: 'string' },
    's3-bucket': { type: 'string' },
    's3-endpoint': { type: 'string' },
    's3-region': { type: 'string' },
    namespace: { type: 'string', multiple: true },
    'dry-run': { type: 'boolean' },
    price: { type: 'string' },
    concurrency: { type: 'string' },
    json: { type: 'boolean' },
    quiet: { type: 'boolean', short: 'q' },
  })
  if (help) {
    console.log(HELP)
    return 0
  }
  const flags: ServeSettings = {}
  const map: [string, keyof ServeSettings][] = [
    ['store', 'store'],
    ['dir', 'dir'],
    ['prefix', 'prefix'],
    ['s3-bucket', 's3Bucket'],
    ['s3-endpoint', 's3Endpoint'],
    ['s3-region', 's3Region'],
  ]
  for (const [flag, key] of map) {
    const v = (values as Record<string, unknown>)[flag]
    if (v !== undefined) (flags as Record<string, unknown>)[key] = v
  }
  // Plain decimals only: Number() would also take '' (0), 'Infinity', '0x10' and '1e1'.
  const decimal = (v: string | undefined, re: RegExp) =>
    v !== undefined && re.test(v) ? Number(v) : Number.NaN
  const price = values.price === undefined ? 0.023 : decimal(values.price, /^\d+(\.\d+)?$/)
  const concurrency = values.concurrency === undefined ? 16 : decimal(values.concurrency, /^\d+$/)
  if (!Number.isFinite(price))
    return usageError('--price must be a non-negative number of $/GB-month, e.g. 0.023')
  if (!Number.isInteger(concurrency) || concurrency < 1 || concurrency > 1024)
    return usageError('--concurrency must be an integer in 1..1024')
  const namespaces = values.namespace as unknown as string[] | undefined
  // A name no namespace can have selects nothing: a pass that quietly does nothing.
  const badNs = namespaces?.find((ns) => !isNamespaceName(ns))
  if (badNs !== undefined)
    return usageError(
      `--namespace '${badNs}' is not a namespace name (1-63 characters of a-z 0-9 . _ -, starting with a letter or digit)`,
    )
  const file = values.config ?? process.env.KVGATE_CONFIG
  const config = resolveServeConfig(file ? settingsFromFile(file) : {}, settingsFromEnv(process.env), flags)
  // A memory store is empty in a fresh process: a pass over it would report an empty bucket.
  if (config.store.kind === 'memory')
    return usageError('the memory store holds nothing between processes: gc runs on the fs or s3 store')
  const quiet = values.quiet === true
  const store = await openStore(config)
  try {
    const report = await runGc({
      store,
      prefix: config.prefix,
      config: config.coldTier,
      dryRun: values['dry-run'] === true,
      pricePerGBMonth: price,
      concurrency,
      ...(namespaces ? { namespaces } : {}),
      onProgress: quiet ? undefined : progressLine,
    })
    if (values.json) console.log(JSON.stringify(report, null, 2))
    else console.log(summary(report))
    return report.errors.length > 0 ? 1 : 0
  } finally {
    await store.close?.()
  }
}

function usageError(message: string): number {
  console.error(`kvgate gc: ${message}. Run with --help for usage.`)
  return 2
}

function progressLine(p: GcProgress): void {
  const line =
    p.phase === 'list'
      ? `listed ${p.objects} objects`
      : p.phase === 'records'
        ? `${p.ns}: read ${p.done}/${p.total} use records and indexes (${p.records} use records folded)`
        : p.phase === 'headers'
          ? `${p.ns}: read ${p.done}/${p.total} headers`
          : p.phase === 'delete'
            ? `${p.ns}: deleted ${p.done}/${p.total}`
            : `${p.report.ns}: done`
  process.stderr.write(`kvgate gc: ${line}\n`)
}

function bytes(n: number): string {
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB']
  let i = 0
  let v = n
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024
    i++
  }
  return `${v.toFixed(i === 0 ? 0 : 1)} ${units[i]}`
}

function duration(ms: number): string {
  return ms >= 60_000
    ? `${(ms / 60_000).toFixed(ms % 60_000 === 0 ? 0 : 1)} min`
    : `${Math.round(ms / 1000)} s`
}

function policyText(r: NamespaceReport): string {
  const p = r.policy
  if (!p) return 'no policy (kept)'
  const parts: string[] = []
  if (p.retentionMs !== undefined) parts.push(`retention ${(p.retentionMs / 86_400_000).toFixed(2)} d`)
  if (p.quotaBytes !== undefined) parts.push(`quota ${bytes(p.quotaBytes)}`)
  return parts.join(', ') || 'no limits'
}

export function summary(r: GcReport): string {
  const lines = [
    `kvgate gc ${r.dryRun ? '(dry run: nothing deleted) ' : ''}run ${r.run} at ${new Date(r.at).toISOString()}`,
  ]
  for (const n of r.namespaces) {
    const verb = r.dryRun ? 'would delete' : 'deleted'
    const condemn = r.dryRun ? 'would condemn' : 'condemned'
    lines.push(
      `  ${n.ns}: ${policyText(n)}`,
      `    listed   ${n.listed.objects} objects, ${bytes(n.listed.bytes)} ($${n.monthlyUsdBefore.toFixed(2)}/month)` +
        (n.incremental
          ? `; incremental accounting said ${n.incremental.objects} objects, ${bytes(n.incremental.bytes)}`
          : ''),
      `    ${verb.padEnd(8)} ${n.deleted.objects} objects, ${bytes(n.deleted.bytes)} (retention ${n.deleted.retention}, quota ${n.deleted.quota}, behind a hole ${n.deleted.orphan})` +
        (n.alreadyGone ? `, ${n.alreadyGone} already gone` : '') +
        (n.failed ? `, ${n.failed} FAILED` : '') +
        (n.deferred ? `; nothing deleted by policy, left to the next run: ${n.deferred}` : ''),
      `    ${condemn.padEnd(8)} ${n.condemned.objects} objects, ${bytes(n.condemned.bytes)} (deleted by a run ${duration(r.condemnWaitMs)} or more after the first to condemn them, if still unused)` +
        (n.saved ? `; ${n.saved} condemned earlier saved by a use or a new chunk` : '') +
        (n.condemnedSkipped ? `; ${n.condemnedSkipped} condemned lists skipped` : ''),
      `    kept     ${n.kept.objects} objects, ${bytes(n.kept.bytes)} ($${n.monthlyUsdAfter.toFixed(2)}/month) in ${n.chains} chains` +
        (n.protectedByGrace ? `; ${n.protectedByGrace} kept by the grace period` : '') +
        (n.overQuotaBytes ? `; still ${bytes(n.overQuotaBytes)} over quota (recently used)` : ''),
      `    folded   ${n.usageRecords} use records; ${n.headerReads} header reads${n.unreadable ? `, ${n.unreadable} unreadable` : ''}` +
        (n.corruptRecords
          ? `; ${n.corruptRecords} corrupt records or indexes (their uses unknown: every chunk taken as used when they were written, by retention; kept until that is past it)`
          : ''),
    )
  }
  if (r.namespaces.length === 0) lines.push('  no namespaces found')
  const q = r.requests
  lines.push(`  store requests: ${q.list} LIST, ${q.get} GET, ${q.put} PUT, ${q.delete} DELETE`)
  for (const e of r.errors.slice(0, 20)) lines.push(`  error: ${e}`)
  if (r.errors.length > 20) lines.push(`  … ${r.errors.length - 20} more errors`)
  return lines.join('\n')
}
