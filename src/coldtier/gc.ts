// One gc pass over a bucket: list it once, fold use records and the previous chain index
// into last-use times, find parents (index, records, else a ranged header read), plan by
// retention and quota, then delete in two phases: a run condemns what its plan picks (a
// create-only list under _coldtier/condemned/) and deletes, from chain tails inward, only
// what an earlier run condemned at least condemnWaitMs ago and this plan still picks, so
// every use made before the condemning run is seen first. Chunks whose parent is gone (a
// hole) are deleted at once with their descendants. Then it writes a new index and an
// accounting snapshot (create-only, named per run) and deletes the objects it folded.
//
// Safe to run twice at once and beside live traffic: every write is a new create-only
// object, deletes are idempotent, a chunk is deleted only after every deeper victim of its
// chain is gone, and anything read or written within the grace period is kept.

import { eachBounded } from '../core/bounded-each.ts'
import { ConfigError, FormatError } from '../core/errors.ts'
import {
  DEFAULT_MAX_CHUNK_BYTES,
  decodeHeader,
  HEADER_PREFIX_BYTES,
  readHeaderLength,
} from '../core/format.ts'
import { isObjectPrefix, objectName, toHex } from '../core/keys.ts'
import { collectAtMost, type ObjectStore, type StoreEntry } from '../gateway/stores/types.ts'
import {
  type AccountingSnapshot,
  type NamespaceTotals,
  parseSnapshot,
  readSnapshotBytes,
  snapshotName,
} from './accounting.ts'
import { type ChunkNode, plan, settle } from './chain-graph.ts'
import { classify, condemnedPrefix, indexPrefix, randomId, runObjectName, runObjectTime } from './names.ts'
import { type ColdTierConfig, condemnWaitMs, type NamespacePolicy, policyFor } from './policy.ts'
import {
  decodeBatch,
  encodeBatch,
  type LinkEntry,
  ROOT_PARENT,
  recordBytes,
  type UseEntry,
} from './records.ts'

const HEADER_PROBE_BYTES = 4096

/**
 * The largest use record or chain index gc reads (each is read whole). An index is ~120
 * bytes per chunk, so this is ~9 million chunks in one namespace: past the memory one run
 * holds for a namespace anyway. A larger object is reported and left in place.
 */
export const MAX_RECORD_BYTES = 1 << 30

export type GcProgress =
  | { phase: 'list'; objects: number }
  /** Use records and indexes read (done of total); `records`: use records folded so far. */
  | { phase: 'records'; ns: string; records: number; done: number; total: number }
  | { phase: 'headers'; ns: string; done: number; total: number }
  | { phase: 'delete'; ns: string; done: number; total: number }
  | { phase: 'namespace'; report: NamespaceReport }

export interface GcOptions {
  store: ObjectStore
  /** Object name prefix (the gateway's). */
  prefix: string
  config: ColdTierConfig
  /** Plan and report only: nothing is written or deleted. */
  dryRun?: boolean
  /** Only these namespaces (others are still listed and accounted). */
  namespaces?: string[]
  /** @default Date.now() */
  now?: number
  /**
   * How long a condemned chunk waits before a later run may delete it.
   * @default config.condemnWaitMs, else condemnWaitMs(config.usage): the gateways' maxDelay plus margins
   */
  condemnWaitMs?: number
  /** Store requests in flight. @default 16 */
  concurrency?: number
  /** $/GB-month for the cost figures. @default 0.023 */
  pricePerGBMonth?: number
  onProgress?: (p: GcProgress) => void
}

export interface NamespaceReport {
  ns: string
  policy: NamespacePolicy | undefined
  /** What the listing found (the reconciliation). */
  listed: NamespaceTotals
  /** The previous snapshot plus creations recorded since: the incremental figure, to compare. */
  incremental: NamespaceTotals | undefined
  /**
   * Deleted (or, dry run, to delete) by reason: retention and quota (condemned by an earlier
   * run), orphan (its parent was gone: a hole, with its descendants).
   */
  deleted: { objects: number; bytes: number; retention: number; quota: number; orphan: number }
  /** Planned for deletion but not yet condemned long enough: left (or, dry run, to leave) condemned for a later run. */
  condemned: NamespaceTotals
  /** Condemned by an earlier run but no longer planned (a use or a new child since): not deleted. */
  saved: number
  /** Condemned lists skipped: corrupt, oversized or of a newer format (nothing is deleted by them). */
  condemnedSkipped: number
  /** Deletes that found the object already gone (another gc run, lifecycle). */
  alreadyGone: number
  /** Deletes that failed; their ancestors were kept (tail-first). */
  failed: number
  /** Why this run deleted nothing in the namespace and left it to the next run (its view was incomplete). */
  deferred: string | undefined
  kept: NamespaceTotals
  protectedByGrace: number
  overQuotaBytes: number
  chains: number
  headerReads: number
  unreadable: number
  usageRecords: number
  /**
   * Use records and indexes that failed their checks (CRC, length, fields): the uses they held
   * are unknown, so every listed chunk counts as used by retention at the latest time they
   * could carry (usesUpTo); kept until that is past retention. Deletes by retention wait
   * longer, never come early; the quota goes by the known uses.
   */
  corruptRecords: number
  monthlyUsdBefore: number
  monthlyUsdAfter: number
}

export interface GcReport {
  run: string
  at: number
  dryRun: boolean
  /** How long this run's condemnations wait before a later run may delete them. */
  condemnWaitMs: number
  namespaces: NamespaceReport[]
  requests: Record<'list' | 'get' | 'head' | 'put' | 'delete', number>
  errors: string[]
}

interface NsListing {
  chunks: StoreEntry[]
  usage: StoreEntry[]
  index: StoreEntry[]
  condemned: StoreEntry[]
}

export async function runGc(opts: GcOptions): Promise<GcReport> {
  const now = opts.now ?? Date.now()
  const started = Date.now()
  const concurrency = opts.concurrency ?? 16
  // The gateway refuses such a prefix at start; gc would list nothing and write under it.
  if (!isObjectPrefix(opts.prefix)) throw new ConfigError(`gc: invalid prefix ${JSON.stringify(opts.prefix)}`)
  // Below 1, eachBounded starts no call at all: records, headers and deletes silently skipped.
  if (!Number.isInteger(concurrency) || concurrency < 1)
    throw new ConfigError(`gc: concurrency must be an integer ≥ 1, got ${concurrency}`)
  const price = opts.pricePerGBMonth ?? 0.023
  const dry = opts.dryRun ?? false
  const run = randomId()
  const requests = { list: 0, get: 0, head: 0, put: 0, delete: 0 }
  const errors: string[] = []
  const store = countingStore(opts.store, requests)
  const progress = opts.onProgress ?? (() => {})
  const wait = opts.condemnWaitMs ?? opts.config.condemnWaitMs ?? condemnWaitMs(opts.config.usage)

  // 1. One listing of everything under the prefix.
  const byNs = new Map<string, NsListing>()
  const selected = (ns: string) => !opts.namespaces || opts.namespaces.includes(ns)
  const others = new Map<string, NamespaceTotals>()
  const nsOf = (ns: string) => {
    let l = byNs.get(ns)
    if (!l) {
      l = { chunks: [], usage: [], index: [], condemned: [] }
      byNs.set(ns, l)
    }
    return l
  }
  const snapshots: string[] = []
  const base = opts.prefix === '' ? '' : `${opts.prefix}/`
  let cursor: string | undefined
  let listed = 0
  do {
    // S3 and R2 answer at most 1,000 names a page anyway; fs and memory stores walk all
    // their names per page, so larger pages keep a big local store from going quadratic.
    const page = await store.list(base, { limit: 10_000, ...(cursor ? { cursor } : {}) })
    for (const e of page.entries) {
      const c = classify(opts.prefix, e.name)
      if (
        (c.kind === 'chunk' || c.kind === 'usage' || c.kind === 'index' || c.kind === 'condemned') &&
        !selected(c.ns)
      ) {
        // Namespaces this run does not collect are only accounted: their sizes, not their entries.
        const o = others.get(c.ns) ?? { objects: 0, bytes: 0 }
        if (c.kind === 'chunk') others.set(c.ns, { objects: o.objects + 1, bytes: o.bytes + e.size })
        else others.set(c.ns, o)
      } else if (c.kind === 'chunk') nsOf(c.ns).chunks.push(e)
      else if (c.kind === 'usage') nsOf(c.ns).usage.push(e)
      else if (c.kind === 'index') nsOf(c.ns).index.push(e)
      else if (c.kind === 'condemned') nsOf(c.ns).condemned.push(e)
      else if (c.kind === 'accounting') snapshots.push(e.name)
    }
    listed += page.entries.length
    progress({ phase: 'list', objects: listed })
    cursor = page.cursor
  } while (cursor)
  // This run's condemnations date from the end of its listing, not its start: a use made while
  // the listing ran (a big bucket lists for minutes) may be missing from the records it listed,
  // and the deleting run, at least condemnWait later, must see it (docs/cold-tier.md, race 1).
  // Whole seconds: less than one is within condemnWait's margin for clocks.
  const condemnAt = now + Math.max(0, Math.floor((Date.now() - started) / 1000) * 1000)

  snapshots.sort()
  let previous: AccountingSnapshot | undefined
  for (let i = snapshots.length - 1; i >= 0 && !previous; i--) {
    const bytes = await readSnapshotBytes(store, snapshots[i]!)
    previous = bytes ? parseSnapshot(bytes) : undefined
  }

  const reports: NamespaceReport[] = []
  const totals: Record<string, NamespaceTotals> = Object.fromEntries(others)
  for (const [ns, l] of [...byNs].sort(([a], [b]) => (a < b ? -1 : 1))) {
    const listedTotals = sum(l.chunks)
    const r = await gcNamespace(ns, l, listedTotals)
    reports.push(r)
    progress({ phase: 'namespace', report: r })
    totals[ns] = r.kept
  }

  // 4. The reconciled accounting: this listing less what this run deleted.
  if (!dry) {
    const snap: AccountingSnapshot = { at: now, source: 'listing', namespaces: totals }
    const bytes = new TextEncoder().encode(JSON.stringify(snap))
    try {
      await store.putIfAbsent(snapshotName(opts.prefix, now, run), bytes, bytes.length)
      await eachBounded(snapshots, concurrency, (n) => store.delete(n))
    } catch (e) {
      errors.push(`accounting snapshot: ${(e as Error).message}`)
    }
  }
  return { run, at: now, dryRun: dry, condemnWaitMs: wait, namespaces: reports, requests, errors }

  async function gcNamespace(
    ns: string,
    l: NsListing,
    listedTotals: NamespaceTotals,
  ): Promise<NamespaceReport> {
    const policy = policyFor(opts.config, ns)
    // Uses and links are kept for listed chunks only: records name chunks deleted since (by gc,
    // lifecycle, a gateway's heal), and those would grow the maps past the namespace's size.
    const listedKeys = new Set(l.chunks.map((e) => e.name.slice(e.name.lastIndexOf('/') + 1)))
    const lastUse = new Map<string, number>()
    const parents = new Map<string, string>()
    const folded: string[] = []
    let createdSince: NamespaceTotals = { objects: 0, bytes: 0 }
    const createdKeys = new Set<string>()
    const since = previous?.at ?? Infinity
    // A use after `now` (a gateway's clock ahead, a hostile record) counts as now: kept at
    // its face value it would pin the chain past every retention, and the index would carry it on.
    const touch = (key: string, at: number) => {
      if (!listedKeys.has(key)) return
      const t = Math.min(at, now)
      if (!(t <= (lastUse.get(key) ?? -Infinity))) lastUse.set(key, t)
    }
    const fold = (uses: UseEntry[], links: LinkEntry[], counts: boolean) => {
      for (const u of uses) touch(u.key, u.at)
      for (const k of links) {
        if (listedKeys.has(k.key)) parents.set(k.key, k.parent)
        touch(k.key, k.at)
        // Once a key: a flush retried after a PUT that landed but failed to answer writes the
        // same links again under the next name.
        if (counts && k.at >= since && !createdKeys.has(k.key)) {
          createdKeys.add(k.key)
          createdSince = { objects: createdSince.objects + 1, bytes: createdSince.bytes + k.size }
        }
      }
    }
    // 2. Previous indexes (more than one after concurrent runs: merged) and the use records.
    let records = 0
    let vanished = 0
    let newer = 0
    let oversized = 0
    /** For each corrupt record or index: the latest use it could hold. */
    const lost: number[] = []
    const foldRecord = async ({ name, size }: StoreEntry): Promise<void> => {
      if (size > MAX_RECORD_BYTES) {
        // Its uses stay unknown: kept, and nothing is deleted by a view that lacks them.
        oversized++
        errors.push(`${name}: ${size} bytes is more than the ${MAX_RECORD_BYTES} gc reads`)
        return
      }
      const bytes = await readListed(store, name, size)
      if (!bytes) {
        // Folded and deleted by a concurrent run since the listing: its uses are in that run's
        // index, which this run did not list, so this run must not delete by what it knows.
        vanished++
        return
      }
      if (bytes === 'larger') {
        // Rewritten since the listing (records are create-only: not by kvgate): what it says
        // now is unknown, so it is kept and nothing is deleted by a view that lacks it.
        oversized++
        errors.push(`${name}: longer than the ${size} bytes listed; not read`)
        return
      }
      try {
        const b = decodeBatch(bytes)
        if (b.kind === 'condemned')
          throw new FormatError('ERR_FORMAT_BAD_FIELD', 'a condemned list among use records')
        fold(
          b.uses,
          b.kind === 'index' ? b.links.map((x) => ({ ...x, at: -Infinity })) : b.links,
          b.kind === 'usage',
        )
        if (b.kind === 'usage') records++
      } catch (e) {
        // A newer format (gateways upgraded before gc) holds uses this build cannot read: keep
        // it for an upgraded gc and delete nothing by a view that lacks them.
        if (e instanceof FormatError && e.code === 'ERR_FORMAT_BAD_VERSION') {
          errors.push(`${name}: ${(e as Error).message}`)
          newer++
          return
        }
        // A corrupt one cannot be read again, but its uses must not be dropped (an index holds
        // every chain's last use up to its run: without them gc would delete used chains a
        // retention early). What its listed name says is trusted: no use in it is later than
        // usesUpTo(name), for every listed chunk (plan: retention counts it, the quota does
        // not). It stays, read again by each run, until that bound is past the retention: the
        // bound cannot go into the rebuilt index as every chunk's use without erasing the order
        // the quota evicts by. One whose name says no time (not kvgate's, or a future hour)
        // would pin every chunk for good: it counts for this run only.
        const said = usesUpTo(opts.prefix, name, Number.POSITIVE_INFINITY)
        const upTo = Math.min(said, now)
        lost.push(upTo)
        // A use record of the current hour is bounded by that hour's end.
        const dated = said <= now + 3_600_000
        errors.push(
          `${name}: ${(e as Error).message}; its uses are unknown: every listed chunk counts as used at ${new Date(upTo).toISOString()} by retention${dated ? '' : ' (this run only: it says no time)'}`,
        )
        if (dated && policy?.retentionMs !== undefined && upTo >= now - policy.retentionMs) return
      }
      folded.push(name)
    }
    const toRead = [...l.index, ...l.usage]
    let read = 0
    await eachBounded(toRead, concurrency, async (e) => {
      await foldRecord(e)
      // Many records (one per gateway instance per flush) read for minutes: say how far.
      if (++read % 100 === 0 && read < toRead.length)
        progress({ phase: 'records', ns, records, done: read, total: toRead.length })
    })
    progress({ phase: 'records', ns, records, done: read, total: toRead.length })
    // The latest use a corrupt record could hold, for every listed chunk: retention counts it
    // and the rebuilt index keeps it, the quota does not (see plan): a record that fails its
    // checks at every run (a broken gateway) would otherwise keep every chunk within the grace
    // period and the namespace would grow past its quota for good. One pass, after all records.
    let unknownUsesUpTo = -Infinity
    for (const t of lost) if (t > unknownUsesUpTo) unknownUsesUpTo = Math.min(t, now)

    // 3. Nodes from the listing; parents not yet known come from a ranged header read.
    const nodes = new Map<string, ChunkNode>()
    for (const e of l.chunks) {
      const key = e.name.slice(e.name.lastIndexOf('/') + 1)
      nodes.set(key, {
        key,
        size: e.size,
        parent: parents.get(key),
        lastUse: lastUse.get(key),
        modified: e.modified,
        depth: 0,
        effective: 0,
      })
    }
    const unknown = [...nodes.values()].filter((n) => !parents.has(n.key))
    let headerReads = 0
    let unreadable = 0
    // Header reads the store failed (not a corrupt header): such a chunk's parent is unknown,
    // so any victim could be its ancestor and deleting it could leave a hole.
    let unresolved = 0
    /** Chunks whose parent this run read from the header itself (ROOT_PARENT for a chain's first). */
    const fromHeader = new Set<string>()
    const readHeader = async (n: ChunkNode): Promise<boolean> => {
      const p = await readParent(store, objectName(opts.prefix, ns, n.key), n.size)
      headerReads++
      if (p === undefined) {
        nodes.delete(n.key) // gone since the listing
        return false
      }
      n.parent = p
      parents.set(n.key, p)
      fromHeader.add(n.key)
      return true
    }
    let headersDone = 0
    await eachBounded(unknown, concurrency, async (n) => {
      try {
        await readHeader(n)
      } catch (e) {
        if (e instanceof FormatError)
          unreadable++ // a corrupt object: its own chain (the verify endpoint deals with corruption)
        else {
          if (unresolved++ === 0) errors.push(`header ${ns}/${n.key}: ${(e as Error).message}`)
        }
      }
      if (++headersDone % 100 === 0 || headersDone === unknown.length)
        progress({ phase: 'headers', ns, done: headersDone, total: unknown.length })
    })

    // 4. Holes: a chunk older than the grace period whose parent is not listed and is not the
    // namespace seed (chunk 0's parent) sits behind a missing chunk: lookups infer that chunk
    // present from it and the GET 404s. It goes now, with its descendants (they are behind
    // the same hole: deleting them cannot make a new one). Younger chunks may be uploads whose
    // parents have not landed yet. A link's parent is the header's, so telling a first chunk
    // from a hole costs one header read (once: the index keeps ROOT_PARENT), and a HEAD makes
    // sure the parent was not written again since the listing.
    // A namespace with no policy is never deleted from, holes included.
    const graceCut = now - opts.config.graceMs
    const suspects = [...nodes.values()].filter(
      (n) =>
        policy !== undefined &&
        n.parent !== undefined &&
        n.parent !== ROOT_PARENT &&
        !nodes.has(n.parent) &&
        n.modified !== undefined &&
        n.modified < graceCut,
    )
    const orphans: ChunkNode[] = []
    await eachBounded(suspects, concurrency, async (n) => {
      try {
        if (!fromHeader.has(n.key) && !(await readHeader(n))) return
        if (n.parent === ROOT_PARENT || nodes.has(n.parent!)) return
        if (await store.head(objectName(opts.prefix, ns, n.parent!))) return
        orphans.push(n)
      } catch (e) {
        // Not known to be a hole: kept, and the next run looks again.
        if (e instanceof FormatError) unreadable++
        else errors.push(`hole check ${ns}/${n.key}: ${(e as Error).message}`)
      }
    })
    const children = new Map<string, ChunkNode[]>()
    for (const n of nodes.values()) {
      if (n.parent === undefined) continue
      const c = children.get(n.parent)
      if (c) c.push(n)
      else children.set(n.parent, [n])
    }
    const swept = new Map<string, ChunkNode>()
    for (const stack = [...orphans]; stack.length > 0; ) {
      const n = stack.pop()!
      if (swept.has(n.key)) continue
      swept.set(n.key, n)
      stack.push(...(children.get(n.key) ?? []))
    }
    const live = new Map([...nodes].filter(([k]) => !swept.has(k)))
    settle(swept, now)
    settle(live, now)
    const p = plan(live, policy, now, opts.config.graceMs, unknownUsesUpTo)

    // 5. Condemned lists from earlier runs: a chunk's earliest condemnation that still applies
    // to the object listed now (one written after it was condemned is a new object).
    const condemnedAt = new Map<string, number>()
    const condemnedFolded: string[] = []
    let condemnedSkipped = 0
    // A run condemns only chunks it lists; some may have gone since (lifecycle, an admin). A
    // list longer than twice this listing (plus slack) is not read: memory stays within what
    // the index holds anyway, and dropping a condemnation only delays a delete.
    const maxCondemnedBytes = Math.min(MAX_RECORD_BYTES, recordBytes(2 * l.chunks.length + 10_000))
    await eachBounded(l.condemned, concurrency, async ({ name, size }) => {
      if (size > maxCondemnedBytes) {
        condemnedSkipped++
        condemnedFolded.push(name)
        return
      }
      const bytes = await readListed(store, name, size)
      // Folded by a concurrent run: that run's own list carries what it still condemns.
      if (!bytes) return
      if (bytes === 'larger') {
        // Not the list the listing showed: dropped, like an oversized one (only delays a delete).
        condemnedSkipped++
        errors.push(`${name}: longer than the ${size} bytes listed; not read`)
        condemnedFolded.push(name)
        return
      }
      try {
        const b = decodeBatch(bytes)
        if (b.kind !== 'condemned' || b.links.length > 0)
          throw new FormatError('ERR_FORMAT_BAD_FIELD', `a ${b.kind} record among condemned lists`)
        for (const u of b.uses) {
          const n = live.get(u.key)
          // A time after this run's own condemnation time counts as that (it cannot shorten the
          // wait, and a concurrent run that listed later condemned as of then); one before the
          // object was written condemned an earlier object of that key.
          const t = Math.min(u.at, condemnAt)
          if (!n || n.modified === undefined || !(t > n.modified)) continue
          if (!(t >= (condemnedAt.get(u.key) ?? Infinity))) condemnedAt.set(u.key, t)
        }
      } catch (e) {
        condemnedSkipped++
        errors.push(`${name}: ${(e as Error).message}`)
        // Written by a newer gc: kept for it. Anything else unreadable is dropped: a lost
        // condemnation only means the chunk is condemned again and deleted a run later.
        if (e instanceof FormatError && e.code === 'ERR_FORMAT_BAD_VERSION') return
      }
      condemnedFolded.push(name)
    })

    let deferred: string | undefined
    if (unresolved > 0) {
      deferred = `${unresolved} header reads failed`
      errors.push(`${ns}: ${deferred}; nothing deleted by policy in this namespace this run`)
    } else if (oversized > 0) deferred = `${oversized} use records or indexes too large to read`
    else if (newer > 0) deferred = `${newer} use records or indexes of a newer format (upgrade kvgate gc)`
    else if (vanished > 0) deferred = `${vanished} use records or indexes were folded by a concurrent gc run`
    // An incomplete view decides nothing: no deletes by policy, no condemnations (the lists
    // stay as they are). Holes still go: that needs no uses.
    if (deferred !== undefined) p.victims = []

    // 6. Two phases: what the plan picks and an earlier run condemned at least `wait` ago goes
    // now; the rest of the plan is condemned (keeping an earlier time) for a later run. A
    // chunk is due only if every listed child is due too, so deletes stay tail-first.
    const due = new Set<string>()
    for (const v of p.victims) {
      const t = condemnedAt.get(v.node.key)
      if (t !== undefined && t <= now - wait) due.add(v.node.key)
    }
    const walked = new Set<string>()
    for (const n of live.values()) {
      if (due.has(n.key)) continue
      for (let a = n.parent; a !== undefined && !walked.has(a); a = live.get(a)?.parent) {
        walked.add(a)
        due.delete(a)
      }
    }
    const planned = new Set(p.victims.map((v) => v.node.key))
    let saved = 0
    if (deferred === undefined) for (const k of condemnedAt.keys()) if (!planned.has(k)) saved++
    const condemned = { objects: 0, bytes: 0 }
    const condemnations: UseEntry[] = []
    for (const v of p.victims) {
      if (due.has(v.node.key)) continue
      condemned.objects++
      condemned.bytes += v.node.size
      condemnations.push({ key: v.node.key, at: condemnedAt.get(v.node.key) ?? condemnAt })
    }
    const victims: { node: ChunkNode; reason: 'retention' | 'quota' | 'orphan' }[] = [
      ...p.victims.filter((v) => due.has(v.node.key)),
      ...[...swept.values()].map((node) => ({ node, reason: 'orphan' as const })),
    ]
    // Deepest first. Swept chunks and planned ones are in different trees, each with its own depths.
    victims.sort((a, b) => b.node.depth - a.node.depth)

    // The new list goes first: a crash after it loses nothing; the old lists go last.
    let listWritten = false
    if (!dry && deferred === undefined) {
      try {
        if (condemnations.length > 0) {
          const bytes = encodeBatch({ kind: 'condemned', at: now, uses: condemnations, links: [] })
          await store.putIfAbsent(
            runObjectName(condemnedPrefix(opts.prefix, ns), now, run),
            bytes,
            bytes.length,
          )
        }
        listWritten = true
      } catch (e) {
        // The old lists stay (their condemnations still count); this run's new ones wait a run.
        errors.push(`condemned ${ns}: ${(e as Error).message}`)
      }
    }

    const deleted = { objects: 0, bytes: 0, retention: 0, quota: 0, orphan: 0 }
    let alreadyGone = 0
    let failed = 0
    const gone = new Set<string>()
    if (dry) {
      for (const v of victims) {
        deleted.objects++
        deleted.bytes += v.node.size
        deleted[v.reason]++
        gone.add(v.node.key)
      }
    } else {
      // Deepest first, one depth at a time: chunk i goes only after chunk i+1 is gone.
      const blocked = new Set<string>()
      let done = 0
      for (let i = 0; i < victims.length; ) {
        const depth = victims[i]!.node.depth
        let j = i
        while (j < victims.length && victims[j]!.node.depth === depth) j++
        await eachBounded(victims.slice(i, j), concurrency, async (v) => {
          if (blocked.has(v.node.key)) return
          try {
            const existed = await store.delete(objectName(opts.prefix, ns, v.node.key))
            if (existed) {
              deleted.objects++
              deleted.bytes += v.node.size
              deleted[v.reason]++
            } else alreadyGone++
            gone.add(v.node.key)
          } catch (e) {
            failed++
            errors.push(`delete ${ns}/${v.node.key}: ${(e as Error).message}`)
            // Its ancestors stay: deleting them would leave this chunk behind a hole.
            for (let a = v.node.parent; a !== undefined && !blocked.has(a); a = nodes.get(a)?.parent)
              blocked.add(a)
          }
          if (++done % 100 === 0 || done === victims.length)
            progress({ phase: 'delete', ns, done, total: victims.length })
        })
        i = j
      }
      if (listWritten)
        await eachBounded(condemnedFolded, concurrency, (n) => store.delete(n)).catch((e) => {
          errors.push(`condemned ${ns}: ${(e as Error).message}`)
        })
    }
    const kept = { objects: 0, bytes: 0 }
    for (const n of nodes.values()) {
      if (gone.has(n.key)) continue
      kept.objects++
      kept.bytes += n.size
    }

    // Compaction: the new index holds what survives; then the folded objects go.
    if (!dry) {
      const survivors = [...nodes.values()].filter((n) => !gone.has(n.key))
      const uses: UseEntry[] = []
      const links: LinkEntry[] = []
      for (const n of survivors) {
        const t = lastUse.get(n.key)
        if (t !== undefined) uses.push({ key: n.key, at: t })
        const parent = parents.get(n.key)
        if (parent !== undefined) links.push({ key: n.key, parent, size: n.size, at: 0 })
      }
      const bytes = encodeBatch({ kind: 'index', at: now, uses, links })
      try {
        await store.putIfAbsent(runObjectName(indexPrefix(opts.prefix, ns), now, run), bytes, bytes.length)
        await eachBounded(folded, concurrency, (n) => store.delete(n))
      } catch (e) {
        // Records stay and are folded again next run (idempotent: max of times).
        errors.push(`index ${ns}: ${(e as Error).message}`)
      }
    }
    const prev = previous && Object.hasOwn(previous.namespaces, ns) ? previous.namespaces[ns] : undefined
    return {
      ns,
      policy,
      listed: listedTotals,
      incremental: previous
        ? {
            objects: (prev?.objects ?? 0) + createdSince.objects,
            bytes: (prev?.bytes ?? 0) + createdSince.bytes,
          }
        : undefined,
      deleted,
      condemned,
      saved,
      condemnedSkipped,
      alreadyGone,
      failed,
      deferred,
      kept,
      protectedByGrace: p.protectedByGrace,
      overQuotaBytes: p.overQuotaBytes,
      chains: p.roots,
      headerReads,
      unreadable,
      usageRecords: records,
      corruptRecords: lost.length,
      monthlyUsdBefore: (listedTotals.bytes / 1e9) * price,
      monthlyUsdAfter: (kept.bytes / 1e9) * price,
    }
  }
}

/**
 * The latest use a record or index can hold, from its listed name: an index is named by its
 * run's time (uses capped at it), a use record by the UTC hour its gateway flushed it in (its
 * uses were made before that flush); `now` when the name says neither.
 */
export function usesUpTo(prefix: string, name: string, now: number): number {
  const c = classify(prefix, name)
  if (c.kind === 'index') {
    const t = runObjectTime(name)
    return Number.isFinite(t) ? Math.min(t, now) : now
  }
  const hour = c.kind === 'usage' ? /\/(\d{4})(\d{2})(\d{2})(\d{2})\/[^/]+$/.exec(name) : null
  if (!hour) return now
  const [y, mo, d, h] = hour.slice(1).map(Number) as [number, number, number, number]
  const start = Date.UTC(y, mo - 1, d, h)
  return Number.isFinite(start) ? Math.min(start + 3_600_000, now) : now
}

function sum(entries: StoreEntry[]): NamespaceTotals {
  let bytes = 0
  for (const e of entries) bytes += e.size
  return { objects: entries.length, bytes }
}

/**
 * A listed record's bytes (undefined: gone since the listing). Read only up to the size the
 * listing gave: a body that runs past it is not the object listed ('larger'), and an object
 * rewritten in between must not be held whole, whatever its size.
 */
async function readListed(
  store: ObjectStore,
  name: string,
  listedSize: number,
): Promise<Uint8Array | 'larger' | undefined> {
  const obj = await store.get(name)
  if (!obj) return undefined
  // A store that lists no size (0) is bounded by what gc reads at all.
  return (await collectAtMost(obj.body, listedSize > 0 ? listedSize : MAX_RECORD_BYTES)) ?? 'larger'
}

/**
 * The parent key from a ranged read of the header (ROOT_PARENT for the first chunk of a chain);
 * undefined when the object is gone.
 */
async function readParent(store: ObjectStore, name: string, listedSize: number): Promise<string | undefined> {
  const first = await store.get(name, { range: { offset: 0, length: HEADER_PROBE_BYTES } })
  if (!first) return undefined
  let bytes: Uint8Array = new Uint8Array(await new Response(first.body).arrayBuffer())
  if (bytes.length < HEADER_PREFIX_BYTES)
    throw new FormatError('ERR_FORMAT_TRUNCATED', 'too short for a chunk header')
  const headerBytes = readHeaderLength(bytes)
  if (headerBytes > bytes.length) {
    // Only the header (at most ~16 KiB at MAX_LAYERS), never the whole chunk (up to GiBs).
    const rest = await store.get(name, { range: { offset: 0, length: headerBytes } })
    if (!rest) return undefined
    const more = await collectAtMost(rest.body, headerBytes)
    if (!more) throw new Error(`the store answered more than the ${headerBytes} bytes asked for`)
    bytes = more
  }
  // The bound a gateway GET verifies against: a chunk the store holds (a gateway whose
  // maxChunkBytes passes the format's 512 MiB default took it) is not unreadable for its size.
  const h = decodeHeader(bytes.subarray(0, headerBytes), {
    maxBytes: Math.max(DEFAULT_MAX_CHUNK_BYTES, listedSize),
  })
  return h.chunkIndex === 0 ? ROOT_PARENT : toHex(h.parentKey)
}

function countingStore(store: ObjectStore, c: GcReport['requests']): ObjectStore {
  return {
    kind: store.kind,
    get(n, o) {
      c.get++
      return store.get(n, o)
    },
    head(n) {
      c.head++
      return store.head(n)
    },
    putIfAbsent(n, b, s) {
      c.put++
      return store.putIfAbsent(n, b, s)
    },
    delete(n) {
      c.delete++
      return store.delete(n)
    },
    list(p, o) {
      c.list++
      return store.list(p, o)
    },
  }
}
