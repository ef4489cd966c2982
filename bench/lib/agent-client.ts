// A minimal kvgate agent client for the benchmarks: one Unix-socket connection, requests
// answered by id (progress events ignored); an error answer throws with its code.

import { closeSync, openSync, writeSync } from 'node:fs'
import { connect, type Socket } from 'node:net'
import { decodeBody, encodeFrame, FrameReader } from '../../src/agent/protocol.ts'

export type Msg = Record<string, unknown>

const MAX_FRAME = 64 * 1024 ** 2

export class Client {
  readonly #reader = new FrameReader(MAX_FRAME)
  readonly #waiting = new Map<number, (m: Msg) => void>()
  #next = 1
  constructor(readonly sock: Socket) {
    sock.on('data', (d) => {
      for (const b of this.#reader.push(d)) {
        const m = decodeBody(b) as Msg
        if (typeof m.id === 'number' && !m.event) {
          this.#waiting.get(m.id)?.(m)
          this.#waiting.delete(m.id)
        }
      }
    })
  }
  static open(path: string): Promise<Client> {
    return new Promise((resolve, reject) => {
      const s = connect(path)
      s.once('connect', () => resolve(new Client(s)))
      s.once('error', reject)
    })
  }
  async call(op: string, fields: Msg = {}): Promise<Msg> {
    const id = this.#next++
    const p = new Promise<Msg>((resolve) => this.#waiting.set(id, resolve))
    this.sock.write(encodeFrame({ id, op, ...fields }))
    const m = await p
    if (!m.ok) throw new Error(`${op}: ${JSON.stringify(m.error)}`)
    return m
  }
}

/** A permutation of 0..n-1 from `seed` (an LCG's Fisher–Yates): block ids scattered as a paged engine's are, each once. */
export function shuffled(n: number, seed: number): number[] {
  const a = Array.from({ length: n }, (_, i) => i)
  let x = seed
  for (let i = n - 1; i > 0; i--) {
    x = (x * 1103515245 + 12345) & 0x7fffffff
    const j = x % (i + 1)
    ;[a[i], a[j]] = [a[j]!, a[i]!]
  }
  return a
}

/**
 * How the bench engine lays out its KV: vLLM ≤ 0.25's FlashAttention tensors, or vLLM ≥ 0.29's
 * per-layer [B, H, N, K|V] views of one allocation in its default (LBNHC: NHD pages) or HND
 * (LBHNC) order. The same bytes per layer in every one.
 */
export type BenchKvLayout = 'flash-attn' | 'LBNHC' | 'LBHNC'
export const BENCH_KV_LAYOUTS: readonly BenchKvLayout[] = ['flash-attn', 'LBNHC', 'LBHNC']

/** KVGATE_BENCH_KV_LAYOUT (default flash-attn), or an error naming the choices. */
export function benchKvLayout(): BenchKvLayout {
  const v = (process.env.KVGATE_BENCH_KV_LAYOUT ?? 'flash-attn') as BenchKvLayout
  if (!BENCH_KV_LAYOUTS.includes(v))
    throw new Error(`KVGATE_BENCH_KV_LAYOUT must be one of ${BENCH_KV_LAYOUTS.join(', ')}, got ${v}`)
  return v
}

/**
 * Says hello as a Llama-3.1-8B engine (bf16, block size 16, 8 KV heads of 128 at TP 1) and
 * registers `layers` layer tensors of `numBlocks` blocks laid end to end in the shm file
 * `kvPath`, as `layout` says; returns the worker id.
 */
export async function registerLlama8B(
  c: Client,
  kvPath: string,
  layers: number,
  numBlocks: number,
  layerBytes: number,
  layout: BenchKvLayout = 'flash-attn',
): Promise<number> {
  await c.call('hello', {
    protocol: 1,
    model: 'meta-llama/Llama-3.1-8B',
    hashSeed: '0',
    geometry: { layout: 'flash-attn', dtype: 'bfloat16', layers, kvHeads: 8, headSize: 128, blockSize: 16 },
  })
  const C = 2 * 128
  const view =
    layout === 'flash-attn'
      ? { shape: [2, numBlocks, 16, 8, 128] }
      : {
          shape: [numBlocks, 8, 16, C],
          strides: layout === 'LBNHC' ? [16 * 8 * C, C, 8 * C, 1] : [8 * 16 * C, 16 * C, C, 1],
        }
  const tensors = Array.from({ length: layers }, (_, l) => ({
    kind: 'shm',
    path: kvPath,
    offset: l * layerBytes,
    ...view,
  }))
  const { worker } = await c.call('register', { rank: 0, numBlocks, tensors })
  return worker as number
}

/** A Llama-3.1-8B engine's KV cache at TP 1 in one shm file: what registerLlama8B registers. */
export interface Llama8BKv {
  path: string
  layers: number
  numBlocks: number
  layerBytes: number
}

/**
 * Creates `path` as 32 layers × [2, 96 blocks, 16, 8, 128] bf16 laid end to end (a 256-token
 * chunk = 16 blocks × 32 KiB × 2 × 32 = 32 MiB), every page touched, as an engine's allocated KV
 * cache is: first-touch faults are not the copy's cost.
 */
export function createLlama8BKv(path: string): Llama8BKv {
  const layers = 32
  const numBlocks = 96
  const blockBytes = 16 * 8 * 128 * 2
  const layerBytes = 2 * numBlocks * blockBytes
  const fd = openSync(path, 'w+', 0o600)
  try {
    const zeros = Buffer.alloc(layerBytes)
    for (let l = 0; l < layers; l++) writeSync(fd, zeros, 0, layerBytes, l * layerBytes)
  } finally {
    closeSync(fd)
  }
  return { path, layers, numBlocks, layerBytes }
}
