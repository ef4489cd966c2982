// Agent benchmark (DESIGN §4, agent bar): save and load of a Llama-3.1-8B-shaped 32 MiB
// chunk's scattered paged blocks (block size 16, FlashAttention layout in /dev/shm) through
// a real `kvgate agent` process vs one memcpy of the same bytes; a 512-key lookup (a
// 128k-token prompt) over the socket with warm local tiers; agent CPU-seconds per GiB moved.

import { type ChildProcess, spawn } from 'node:child_process'
import { randomBytes } from 'node:crypto'
import {
  closeSync,
  ftruncateSync,
  mkdtempSync,
  openSync,
  readFileSync,
  rmSync,
  unlinkSync,
  writeSync,
} from 'node:fs'
import { connect, type Socket } from 'node:net'
import { loadavg } from 'node:os'
import { join } from 'node:path'
import { decodeBody, encodeFrame, FrameReader } from '../src/agent/protocol.ts'
import { machineLine, median, quantile, table, writeResult } from './lib/stats.ts'

const MiB = 1024 ** 2
const repeats = Number(process.env.KVGATE_BENCH_REPEATS ?? 15)
const dir = mkdtempSync(join('/tmp', 'kvgate-agent-bench-'))
const shmDir = process.env.KVGATE_BENCH_SHM ?? '/dev/shm'
const log = (s: string) => console.error(s)

type Msg = Record<string, unknown>

class Client {
  readonly #reader = new FrameReader(64 * MiB)
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

function startAgent(sock: string): Promise<ChildProcess> {
  const child = spawn(
    process.execPath,
    [
      // e.g. KVGATE_BENCH_AGENT_NODE_ARGS='--cpu-prof --cpu-prof-dir=/tmp/prof' to profile the agent.
      ...(process.env.KVGATE_BENCH_AGENT_NODE_ARGS ?? '').split(' ').filter(Boolean),
      '--import',
      'tsx',
      'src/cli/main.ts',
      'agent',
      '--socket',
      sock,
      '--chunk-tokens',
      '256',
    ],
    {
      env: { ...process.env, KVGATE_MEMORY_BYTES: '320MiB', KVGATE_DISK: 'off', KVGATE_REMOTE: 'off' },
      stdio: ['ignore', 'pipe', 'inherit'],
    },
  )
  return new Promise((resolve, reject) => {
    child.stdout!.once('data', () => resolve(child))
    child.once('exit', (c) => reject(new Error(`agent exited (${c})`)))
  })
}

/** utime + stime of a process in seconds (Linux /proc). */
function cpuSeconds(pid: number): number {
  const f = readFileSync(`/proc/${pid}/stat`, 'utf8')
  const rest = f.slice(f.lastIndexOf(')') + 2).split(' ')
  return (Number(rest[11]) + Number(rest[12])) / 100
}

async function time(fn: () => Promise<unknown>): Promise<number> {
  const t = performance.now()
  await fn()
  return performance.now() - t
}

function shuffled(n: number, seed: number): number[] {
  const a = Array.from({ length: n }, (_, i) => i)
  let x = seed
  for (let i = n - 1; i > 0; i--) {
    x = (x * 1103515245 + 12345) & 0x7fffffff
    const j = x % (i + 1)
    ;[a[i], a[j]] = [a[j]!, a[i]!]
  }
  return a
}

async function main() {
  const sock = join(dir, 'agent.sock')
  const agent = await startAgent(sock)
  const files: string[] = []
  try {
    // Llama-3.1-8B per GPU at TP 1: 32 layers × [2, blocks, 16, 8, 128] bf16; a 256-token chunk = 16 blocks × 32 KiB × 2 × 32 = 32 MiB.
    const layers = 32
    const numBlocks = 96
    const blockBytes = 16 * 8 * 128 * 2
    const layerBytes = 2 * numBlocks * blockBytes
    const kvPath = join(shmDir, `kvgate-bench-${process.pid}`)
    const fd = openSync(kvPath, 'w+', 0o600)
    // Touch every page, as an engine's allocated KV cache is: first-touch faults are not the copy's cost.
    const zeros = Buffer.alloc(layerBytes)
    for (let l = 0; l < layers; l++) writeSync(fd, zeros, 0, layerBytes, l * layerBytes)
    closeSync(fd)
    files.push(kvPath)
    const c = await Client.open(sock)
    await c.call('hello', {
      protocol: 1,
      model: 'meta-llama/Llama-3.1-8B',
      hashSeed: '0',
      geometry: { layout: 'flash-attn', dtype: 'bfloat16', layers, kvHeads: 8, headSize: 128, blockSize: 16 },
    })
    const tensors = Array.from({ length: layers }, (_, l) => ({
      kind: 'shm',
      path: kvPath,
      offset: l * layerBytes,
      shape: [2, numBlocks, 16, 8, 128],
    }))
    const { worker } = await c.call('register', { rank: 0, numBlocks, tensors })
    const chunkBytes = 32 * MiB
    const src = Buffer.alloc(chunkBytes, 7)
    const dst = Buffer.alloc(chunkBytes, 1)
    const save: number[] = []
    const load: number[] = []
    const memcpy: number[] = []
    let moved = 0
    const cpu0 = cpuSeconds(agent.pid!)
    for (let i = 0; i < repeats + 2; i++) {
      const order = shuffled(numBlocks, i + 1)
      const keys = [randomBytes(32)]
      const s = await time(() => c.call('save', { worker, keys, blockIds: order.slice(0, 16) }))
      const l = await time(() => c.call('load', { worker, keys, blockIds: order.slice(16, 32) }))
      const m = await time(async () => src.copy(dst))
      if (i >= 2) {
        save.push(s)
        load.push(l)
        memcpy.push(m)
        moved += 2 * chunkBytes
      }
    }
    const cpuPerGiB = (cpuSeconds(agent.pid!) - cpu0) / ((moved * (repeats + 2)) / repeats / 2 ** 30)

    // Lookup of 512 keys (a 128k-token prompt), all resident in L1 (a tiny geometry: only presence matters).
    const l2 = await Client.open(sock)
    const tinyPath = join(shmDir, `kvgate-bench-tiny-${process.pid}`)
    const tfd = openSync(tinyPath, 'w+', 0o600)
    ftruncateSync(tfd, 2 * 1024 * 16 * 1 * 8 * 2)
    closeSync(tfd)
    files.push(tinyPath)
    await l2.call('hello', {
      protocol: 1,
      model: 'bench/tiny',
      hashSeed: '0',
      geometry: { layout: 'flash-attn', dtype: 'float16', layers: 1, kvHeads: 1, headSize: 8, blockSize: 16 },
    })
    const r2 = await l2.call('register', {
      rank: 0,
      numBlocks: 1024,
      tensors: [{ kind: 'shm', path: tinyPath, offset: 0, shape: [2, 1024, 16, 1, 8] }],
    })
    const keys = Array.from({ length: 512 }, () => randomBytes(32))
    for (let i = 0; i < 512; i += 64) {
      await l2.call('save', {
        worker: r2.worker,
        keys: keys.slice(0, i + 64),
        blockIds: Array.from({ length: (i + 64) * 16 }, (_, b) => b % 1024),
        from: i,
      })
    }
    for (let i = 0; i < 20; i++) await l2.call('lookup', { keys })
    const lookups: number[] = []
    // Same-run baseline: an empty request's round trip over the same socket (transport and
    // scheduling alone), interleaved with the lookups.
    const pings: number[] = []
    let hit = 0
    for (let i = 0; i < 20 * repeats; i++) {
      lookups.push(await time(async () => (hit = (await l2.call('lookup', { keys })).chunks as number)))
      pings.push(await time(() => l2.call('ping')))
    }
    c.sock.destroy()
    l2.sock.destroy()

    const sMs = median(save)
    const lMs = median(load)
    const mMs = median(memcpy)
    const p50 = quantile(lookups, 0.5)
    const p99 = quantile(lookups, 0.99)
    const gbs = (ms: number) => (chunkBytes / ms / 1e6).toFixed(2)
    // Per repeat: memcpy time / operation time of that same repeat (interleaved A/B).
    const ratios = (op: number[]) => op.map((t, i) => memcpy[i]! / t)
    const spread = (xs: number[], digits: number) =>
      `${Math.min(...xs).toFixed(digits)} / ${median(xs).toFixed(digits)} / ${Math.max(...xs).toFixed(digits)}`
    console.log(
      table([
        [
          'operation (32 MiB, 16 scattered blocks × 32 layers × K,V)',
          'min / median / max ms',
          'GB/s (median)',
          'vs memcpy, per repeat min / median / max',
        ],
        ['save (engine shm → agent L1)', spread(save, 2), gbs(sMs), spread(ratios(save), 2)],
        ['load (agent L1 → engine shm)', spread(load, 2), gbs(lMs), spread(ratios(load), 2)],
        ['one memcpy of the same bytes (baseline)', spread(memcpy, 2), gbs(mMs), '1.00'],
      ]),
    )
    console.log(
      `lookup of 512 keys over the socket (${hit} present): p50 ${p50.toFixed(3)} ms, p99 ${p99.toFixed(3)} ms` +
        ` (same-run ping round trip: p50 ${quantile(pings, 0.5).toFixed(3)} ms, p99 ${quantile(pings, 0.99).toFixed(3)} ms)`,
    )
    console.log(`agent CPU: ${cpuPerGiB.toFixed(3)} CPU-s per GiB moved (save + load)`)
    const load1 = loadavg()[0]!.toFixed(1)
    console.log(`machine load average during the run: ${load1}`)
    const path = writeResult({
      name: 'agent',
      date: new Date().toISOString(),
      machine: `${await machineLine()}, load ${load1}`,
      bars: [
        {
          bar: 'agent save of a 32 MiB chunk of scattered paged blocks vs memcpy',
          figure: mMs / sMs,
          unit: 'x memcpy',
          baseline: mMs,
          baselineLabel: 'memcpy ms',
          ratio: mMs / sMs,
          target: '>= 0.8',
          met: mMs / sMs >= 0.8,
        },
        {
          bar: 'agent load of a 32 MiB chunk into scattered paged blocks vs memcpy',
          figure: mMs / lMs,
          unit: 'x memcpy',
          baseline: mMs,
          baselineLabel: 'memcpy ms',
          ratio: mMs / lMs,
          target: '>= 0.8',
          met: mMs / lMs >= 0.8,
        },
        {
          bar: 'lookup of a 128k-token prompt (512 keys) over the socket, warm, p99',
          figure: p99,
          unit: 'ms',
          target: '< 1',
          met: p99 < 1,
        },
      ],
      saveMs: sMs,
      loadMs: lMs,
      saveVsMemcpy: {
        min: Math.min(...ratios(save)),
        median: median(ratios(save)),
        max: Math.max(...ratios(save)),
      },
      loadVsMemcpy: {
        min: Math.min(...ratios(load)),
        median: median(ratios(load)),
        max: Math.max(...ratios(load)),
      },
      memcpyMs: mMs,
      lookupP50Ms: p50,
      lookupP99Ms: p99,
      pingP50Ms: quantile(pings, 0.5),
      pingP99Ms: quantile(pings, 0.99),
      agentCpuSecondsPerGiB: cpuPerGiB,
    })
    log(`wrote ${path}`)
  } finally {
    agent.kill('SIGTERM')
    for (const f of files) unlinkSync(f)
    rmSync(dir, { recursive: true, force: true })
  }
}

await main()
