// A deterministic prefix-sharing workload for the fleet simulation: a few system
// prompts, a pool of documents with Zipf popularity (RAG), and multi-turn
// conversations that extend their own prefix; nodes join mid-run (autoscaling).

import { InvalidArgumentError } from '../core/errors.ts'
import { Rng, Zipf } from './rng.ts'

export interface WorkloadOptions {
  seed: number
  /** Requests in the whole run. */
  requests: number
  /** Nodes at the start. */
  initialNodes: number
  /** Nodes that join later, evenly spread over the run (cold L1/L2). */
  joiningNodes: number
  systemPrompts: number
  systemPromptTokens: number
  documents: number
  documentTokens: number
  /** Zipf exponent of document popularity. */
  zipf: number
  /** Probability that a request continues an open conversation instead of starting one. */
  continueProbability: number
  turnTokens: number
  vocab: number
}

export const DEFAULT_WORKLOAD: WorkloadOptions = {
  seed: 42,
  requests: 400,
  initialNodes: 2,
  joiningNodes: 2,
  systemPrompts: 3,
  systemPromptTokens: 512,
  documents: 40,
  documentTokens: 1024,
  zipf: 1.1,
  continueProbability: 0.4,
  turnTokens: 192,
  vocab: 32000,
}

export interface FleetRequest {
  /** Sequence number in the run. */
  seq: number
  /** Node that serves it (a node that has joined by then). */
  node: number
  tokens: Uint32Array
  kind: 'new-conversation' | 'follow-up'
  conversation: number
}

export interface Workload {
  options: WorkloadOptions
  requests: FleetRequest[]
  /** Request seq at which node n joins (0 for initial nodes). */
  joinAt: number[]
}

function randomTokens(rng: Rng, n: number, vocab: number): Uint32Array {
  const t = new Uint32Array(n)
  for (let i = 0; i < n; i++) t[i] = 3 + rng.int(vocab - 3)
  return t
}

function concat(parts: Uint32Array[]): Uint32Array {
  const out = new Uint32Array(parts.reduce((n, p) => n + p.length, 0))
  let o = 0
  for (const p of parts) {
    out.set(p, o)
    o += p.length
  }
  return out
}

export function validateWorkload(o: WorkloadOptions): WorkloadOptions {
  for (const [k, v] of Object.entries(o)) {
    if (typeof v !== 'number' || !Number.isFinite(v) || v < 0)
      throw new InvalidArgumentError(`workload ${k} must be a non-negative number`)
  }
  if (o.initialNodes < 1) throw new InvalidArgumentError('workload needs at least one initial node')
  if (o.requests < 1 || o.systemPrompts < 1 || o.documents < 1) {
    throw new InvalidArgumentError('workload needs requests, system prompts and documents')
  }
  if (o.continueProbability > 1) throw new InvalidArgumentError('continueProbability is a probability')
  if (o.vocab < 4) throw new InvalidArgumentError('vocab must be at least 4')
  return o
}

export function generateWorkload(options: Partial<WorkloadOptions> = {}): Workload {
  const o = validateWorkload({ ...DEFAULT_WORKLOAD, ...options })
  const rng = new Rng(o.seed)
  const system = Array.from({ length: o.systemPrompts }, () =>
    randomTokens(rng, o.systemPromptTokens, o.vocab),
  )
  const docs = Array.from({ length: o.documents }, () => randomTokens(rng, o.documentTokens, o.vocab))
  const zipf = new Zipf(o.documents, o.zipf)
  const totalNodes = o.initialNodes + o.joiningNodes
  const joinAt = Array.from({ length: totalNodes }, (_, n) =>
    n < o.initialNodes ? 0 : Math.floor(((n - o.initialNodes + 1) * o.requests) / (o.joiningNodes + 1)),
  )
  // A conversation sticks to no node: follow-ups land wherever the balancer puts
  // them, which is exactly when a shared tier pays off.
  const open: { id: number; tokens: Uint32Array }[] = []
  const requests: FleetRequest[] = []
  let conversations = 0
  for (let seq = 0; seq < o.requests; seq++) {
    const active = joinAt.filter((j) => j <= seq).length
    const node = rng.int(active)
    if (open.length > 0 && rng.float() < o.continueProbability) {
      const c = open[rng.int(open.length)]!
      c.tokens = concat([c.tokens, randomTokens(rng, o.turnTokens, o.vocab)])
      requests.push({ seq, node, tokens: c.tokens, kind: 'follow-up', conversation: c.id })
    } else {
      const id = conversations++
      const tokens = concat([
        system[rng.int(o.systemPrompts)]!,
        docs[zipf.sample(rng)]!,
        randomTokens(rng, o.turnTokens, o.vocab),
      ])
      open.push({ id, tokens })
      if (open.length > 32) open.shift()
      requests.push({ seq, node, tokens, kind: 'new-conversation', conversation: id })
    }
  }
  return { options: o, requests, joinAt }
}
