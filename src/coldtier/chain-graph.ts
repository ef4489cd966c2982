// The chunks of one namespace as a forest of chains (parent links from headers or use
// records), and the deletion plan over it: retention by last use, then a byte quota by
// LRU, always from the tails: a chunk's effective last use is the latest of its own and
// of every chunk after it in any chain, so a kept chunk's ancestors are always kept.

export interface ChunkNode {
  key: string
  size: number
  /** Parent chunk's key when known and listed; undefined for a root or unknown parent. */
  parent: string | undefined
  /** Latest known read (ms), from use records or the index. */
  lastUse: number | undefined
  /** When the object was written (ms); undefined when the store does not say (treated as now). */
  modified: number | undefined
  depth: number
  /** max(own touch, every descendant's effective): monotone along a chain toward its root. */
  effective: number
}

export interface Plan {
  /** Victims in deletion order: deepest first (by depth, then retention before quota). */
  victims: { node: ChunkNode; reason: 'retention' | 'quota' }[]
  /** Past retention but read or written within the grace period. */
  protectedByGrace: number
  /** Bytes still over quota after eviction: the rest was touched within the grace period. */
  overQuotaBytes: number
  roots: number
}

/** Fills depth and effective in place; parents that are not in `nodes` become roots. */
export function settle(nodes: Map<string, ChunkNode>, now: number): void {
  for (const n of nodes.values()) {
    if (n.parent !== undefined && !nodes.has(n.parent)) n.parent = undefined
    n.effective = Math.max(n.lastUse ?? -Infinity, n.modified ?? now)
    n.depth = -1
  }
  for (const n of nodes.values()) {
    if (n.depth >= 0) continue
    // Walk up to a node with a known depth (or a root), then assign on the way down.
    const path: ChunkNode[] = []
    const seen = new Set<string>()
    let cur: ChunkNode | undefined = n
    while (cur && cur.depth < 0 && !seen.has(cur.key)) {
      seen.add(cur.key)
      path.push(cur)
      cur = cur.parent === undefined ? undefined : nodes.get(cur.parent)
    }
    let d = cur && cur.depth >= 0 ? cur.depth + 1 : 0
    // A cycle (impossible with hash chains, possible with forged headers) is cut at its entry.
    if (cur && cur.depth < 0) path[path.length - 1]!.parent = undefined
    for (let i = path.length - 1; i >= 0; i--) path[i]!.depth = d++
  }
  const byDepth = [...nodes.values()].sort((a, b) => b.depth - a.depth)
  for (const n of byDepth) {
    if (n.parent === undefined) continue
    const p = nodes.get(n.parent)!
    if (n.effective > p.effective) p.effective = n.effective
  }
}

export function plan(
  nodes: Map<string, ChunkNode>,
  policy: { retentionMs?: number; quotaBytes?: number } | undefined,
  now: number,
  graceMs: number,
  /**
   * The latest use of every chunk that records gc could not read may hold (corrupt ones): a
   * chunk is past retention only when past it too (a delete may come late, never early). The
   * quota goes by the known uses: unknown ones as recent as now would keep every chunk within
   * the grace period, and records that fail at every run would let the namespace grow for good.
   */
  unknownUsesUpTo = -Infinity,
): Plan {
  const graceCut = now - graceMs
  const victims: Plan['victims'] = []
  let protectedByGrace = 0
  let overQuotaBytes = 0
  let roots = 0
  for (const n of nodes.values()) if (n.parent === undefined) roots++
  if (!policy) return { victims, protectedByGrace, overQuotaBytes, roots }
  const keep: ChunkNode[] = []
  const retentionCut = policy.retentionMs === undefined ? -Infinity : now - policy.retentionMs
  for (const n of nodes.values()) {
    const effective = Math.max(n.effective, unknownUsesUpTo)
    if (effective < retentionCut) {
      if (effective < graceCut) victims.push({ node: n, reason: 'retention' })
      else {
        protectedByGrace++
        keep.push(n)
      }
    } else keep.push(n)
  }
  if (policy.quotaBytes !== undefined) {
    let total = 0
    for (const n of keep) total += n.size
    // LRU order; among equal times the deeper chunk first, so a parent never precedes its child.
    keep.sort((a, b) => a.effective - b.effective || b.depth - a.depth)
    for (const n of keep) {
      if (total <= policy.quotaBytes) break
      // Sorted by time: everything from here on was touched within the grace period.
      if (n.effective >= graceCut) break
      victims.push({ node: n, reason: 'quota' })
      total -= n.size
    }
    overQuotaBytes = Math.max(0, total - policy.quotaBytes)
  }
  victims.sort((a, b) => b.node.depth - a.node.depth)
  return { victims, protectedByGrace, overQuotaBytes, roots }
}
