// The agent bar's two figures, A/B in one run: this tree's `kvgate agent` against another
// tree's (KVGATE_AB_OTHER, e.g. /work/main: its own src, addon and Python client), each tree
// driven by its own client. Absolute figures move with the machine's load; the same-run
// ratio between the trees is what a change is judged by.
//   KVGATE_AB_OTHER=/work/main node --import tsx bench/agent-ab.ts
// 1. Lookups of 512 packed keys (a 128k-token prompt, all in L1) through each tree's own
//    Python connector client (bench/lib/agent_lookup_ab.py, the engine's path): KVGATE_AB_ROUNDS
//    rounds of KVGATE_AB_LOOKUPS (default 6 × 1500), each a Python process in which the two
//    agents' lookups alternate one by one (each followed by a ping; a bare Unix-socket
//    ping-pong per pair: the machine's floor). p50 / p99 / p99.9 per round and pooled.
// 2. Save and load of a Llama-3.1-8B 32 MiB chunk's 16 scattered blocks (as bench/agent.ts),
//    per repeat one memcpy of the same bytes, then each tree's save and load (order alternating).
//    KVGATE_BENCH_KV_LAYOUT=LBNHC|LBHNC: vLLM 0.26+'s packed K/V views instead of FlashAttention tensors.

import { type ChildProcess, spawn } from 'node:child_process'
import { randomBytes } from 'node:crypto'
import { closeSync, ftruncateSync, mkdtempSync, openSync, rmSync, unlinkSync, writeFileSync } from 'node:fs'
import { loadavg } from 'node:os'
import { join, resolve } from 'node:path'
import { benchKvLayout, Client, createLlama8BKv, registerLlama8B, shuffled } from './lib/agent-client.ts'
import { type GcCounts, GcTrace, gcLine } from './lib/gc-trace.ts'
import { median, quantile, table } from './lib/stats.ts'

const other = process.env.KVGATE_AB_OTHER
if (!other) throw new Error('set KVGATE_AB_OTHER to the other tree (e.g. /work/main)')
const trees = [
  { label: 'this tree', root: resolve('.') },
  { label: `other (${other})`, root: resolve(other) },
]
const rounds = Number(process.env.KVGATE_AB_ROUNDS ?? 6)
// The engine's KV layout for the save/load phase (bench/agent.ts): both trees must serve it
// (vLLM's packed views are served from the thirteenth session on).
const kvLayout = benchKvLayout()
const perRound = Number(process.env.KVGATE_AB_LOOKUPS ?? 1500)
const repeats = Number(process.env.KVGATE_BENCH_REPEATS ?? 20)
const python = process.env.KVGATE_PYTHON ?? '/usr/bin/python3'
const dir = mkdtempSync(join('/tmp', 'kvgate-agent-ab-'))
const shmDir = process.env.KVGATE_BENCH_SHM ?? '/dev/shm'
const MiB = 1024 ** 2

/** An agent of the tree at `root`; with `gc`, run with --trace-gc and its collections counted (`gc.trace`). */
function startAgent(root: string, sock: string, gc?: { trace?: GcTrace }): Promise<ChildProcess> {
  const child = spawn(
    process.execPath,
    [
      ...(gc ? ['--trace-gc'] : []),
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
      cwd: root,
      env: { ...process.env, KVGATE_MEMORY_BYTES: '320MiB', KVGATE_DISK: 'off', KVGATE_REMOTE: 'off' },
      stdio: ['ignore', 'pipe', 'inherit'],
    },
  )
  return new Promise((res, rej) => {
    // Ready once it prints its {"socket", …} line (GC lines may come first).
    if (gc) gc.trace = new GcTrace(child.stdout!, (l) => l.startsWith('{') && res(child))
    else child.stdout!.once('data', () => res(child))
    child.once('exit', (c) => rej(new Error(`agent in ${root} exited (${c})`)))
  })
}

function stop(agent: ChildProcess): Promise<void> {
  return new Promise((res) => {
    if (agent.exitCode !== null) return res()
    const stuck = setTimeout(() => agent.kill('SIGKILL'), 10_000)
    agent.once('exit', () => res(clearTimeout(stuck)))
    agent.kill('SIGTERM')
  })
}

type Block = { hit: number; lookup: number[]; ping: number[]; bare: number[] }

/** One round: both agents through their trees' clients, interleaved lookup by lookup. */
function lookupRound(
  subjects: readonly { root: string; sock: string }[],
  keysFile: string,
): Promise<Block[]> {
  return new Promise((res, rej) => {
    const child = spawn(
      python,
      [
        join(resolve('.'), 'bench/lib/agent_lookup_ab.py'),
        String(perRound),
        keysFile,
        ...subjects.flatMap((s) => [s.sock, join(s.root, 'python/kvgate_vllm/client.py')]),
      ],
      { stdio: ['ignore', 'pipe', 'pipe'] },
    )
    let out = ''
    let err = ''
    child.stdout.on('data', (d) => (out += d))
    child.stderr.on('data', (d) => (err += d))
    const timer = setTimeout(() => child.kill('SIGKILL'), 300_000)
    child.on('error', rej)
    child.on('close', (code) => {
      clearTimeout(timer)
      if (code !== 0) return rej(new Error(`${python} exited ${code}: ${err.trim()}`))
      const r = JSON.parse(out) as {
        hits: number[]
        agents: { lookup: number[]; ping: number[] }[]
        bare: number[]
      }
      res(r.agents.map((a, i) => ({ hit: r.hits[i]!, ...a, bare: r.bare })))
    })
  })
}

const spread = (xs: number[], d = 3) =>
  `${Math.min(...xs).toFixed(d)} / ${median(xs).toFixed(d)} / ${Math.max(...xs).toFixed(d)}`

async function main() {
  const agents: ChildProcess[] = []
  const files: string[] = []
  try {
    // --- lookups
    const tinyPath = join(shmDir, `kvgate-ab-tiny-${process.pid}`)
    const tfd = openSync(tinyPath, 'w+', 0o600)
    ftruncateSync(tfd, 2 * 1024 * 16 * 1 * 8 * 2)
    closeSync(tfd)
    files.push(tinyPath)
    const keys = Array.from({ length: 512 }, () => randomBytes(32))
    const keysFile = join(dir, 'keys.hex')
    writeFileSync(keysFile, Buffer.concat(keys).toString('hex'))
    const lookupSubjects = []
    for (const [i, t] of trees.entries()) {
      const sock = join(dir, `lookup-${i}.sock`)
      const gc: { trace?: GcTrace } = {}
      const agent = await startAgent(t.root, sock, gc)
      agents.push(agent)
      const c = await Client.open(sock)
      await c.call('hello', {
        protocol: 1,
        model: 'bench/tiny',
        hashSeed: '0',
        geometry: {
          layout: 'flash-attn',
          dtype: 'float16',
          layers: 1,
          kvHeads: 1,
          headSize: 8,
          blockSize: 16,
        },
      })
      const r = await c.call('register', {
        rank: 0,
        numBlocks: 1024,
        tensors: [{ kind: 'shm', path: tinyPath, offset: 0, shape: [2, 1024, 16, 1, 8] }],
      })
      for (let k = 0; k < 512; k += 64)
        await c.call('save', {
          worker: r.worker,
          keys: keys.slice(0, k + 64),
          blockIds: Array.from({ length: (k + 64) * 16 }, (_, b) => b % 1024),
          from: k,
        })
      lookupSubjects.push({
        ...t,
        agent,
        c,
        sock,
        gc: gc.trace!,
        blocks: [] as Block[],
        gcs: [] as GcCounts[],
      })
    }
    for (let r = 0; r < rounds; r++) {
      for (const sub of lookupSubjects) sub.gc.take()
      const got = await lookupRound(lookupSubjects, keysFile)
      lookupSubjects.forEach((sub, k) => {
        sub.blocks.push(got[k]!)
        sub.gcs.push(sub.gc.take())
      })
    }
    for (const sub of lookupSubjects) {
      sub.c.sock.destroy()
      await stop(sub.agent)
    }
    const q = (b: Block[], f: 'lookup' | 'ping' | 'bare', p: number) => b.map((x) => quantile(x[f], p))
    const all = (b: Block[], f: 'lookup' | 'ping' | 'bare') => b.flatMap((x) => x[f])
    console.log(
      `lookup of 512 packed keys through each tree's Python connector client: ${rounds} rounds of ${perRound}, ms (per round min / median / max; all rounds pooled)`,
    )
    const rows: (string | number)[][] = [['tree', 'what', 'p50', 'p99', 'p99.9', 'pooled p50 / p99 / p99.9']]
    for (const sub of lookupSubjects) {
      for (const f of ['lookup', 'ping', 'bare'] as const) {
        const pooled = all(sub.blocks, f)
        rows.push([
          sub.label,
          f === 'bare' ? 'bare socket ping-pong' : f,
          spread(q(sub.blocks, f, 0.5)),
          spread(q(sub.blocks, f, 0.99)),
          spread(q(sub.blocks, f, 0.999)),
          `${quantile(pooled, 0.5).toFixed(3)} / ${quantile(pooled, 0.99).toFixed(3)} / ${quantile(pooled, 0.999).toFixed(3)}`,
        ])
      }
    }
    console.log(table(rows))
    const [a, b] = lookupSubjects
    const ratio = (p: number) =>
      a!.blocks.map((x, i) => quantile(x.lookup, p) / quantile(b!.blocks[i]!.lookup, p))
    for (const sub of lookupSubjects)
      console.log(
        `${sub.label}: the agent's GCs per round (${perRound} lookups and pings each): ${sub.gcs.map(gcLine).join(' | ')}`,
      )
    console.log(
      `lookup this/other per round (min / median / max): p50 ${spread(ratio(0.5), 2)}, p99 ${spread(ratio(0.99), 2)}, p99.9 ${spread(ratio(0.999), 2)}; hits ${a!.blocks[0]!.hit}, ${b!.blocks[0]!.hit}`,
    )

    // --- save / load vs memcpy
    const {
      path: kvPath,
      layers,
      numBlocks,
      layerBytes,
    } = createLlama8BKv(join(shmDir, `kvgate-ab-${process.pid}`))
    files.push(kvPath)
    const copySubjects = []
    for (const [i, t] of trees.entries()) {
      const sock = join(dir, `copy-${i}.sock`)
      const agent = await startAgent(t.root, sock)
      agents.push(agent)
      const c = await Client.open(sock)
      const worker = await registerLlama8B(c, kvPath, layers, numBlocks, layerBytes, kvLayout)
      copySubjects.push({ ...t, c, worker, save: [] as number[], load: [] as number[] })
    }
    const chunkBytes = 32 * MiB
    const src = Buffer.alloc(chunkBytes, 7)
    const dst = Buffer.alloc(chunkBytes, 1)
    const memcpy: number[] = []
    for (let i = 0; i < repeats + 2; i++) {
      const order = shuffled(numBlocks, i + 1)
      const ks = [randomBytes(32)]
      let t = performance.now()
      src.copy(dst)
      const m = performance.now() - t
      for (const sub of i % 2 === 0 ? copySubjects : [...copySubjects].reverse()) {
        t = performance.now()
        await sub.c.call('save', { worker: sub.worker, keys: ks, blockIds: order.slice(0, 16) })
        const s = performance.now() - t
        t = performance.now()
        await sub.c.call('load', { worker: sub.worker, keys: ks, blockIds: order.slice(16, 32) })
        const l = performance.now() - t
        if (i >= 2) {
          sub.save.push(m / s)
          sub.load.push(m / l)
        }
      }
      if (i >= 2) memcpy.push(m)
    }
    for (const sub of copySubjects) sub.c.sock.destroy()
    console.log(
      table([
        ['tree', 'save vs memcpy (per repeat) min / median / max', 'load vs memcpy min / median / max'],
        ...copySubjects.map((s) => [s.label, spread(s.save, 2), spread(s.load, 2)]),
        ['memcpy ms', spread(memcpy, 2), ''],
      ]),
    )
    console.log(`machine load average during the run: ${loadavg()[0]!.toFixed(1)}`)
  } finally {
    for (const agent of agents) agent.kill('SIGTERM')
    for (const f of files) unlinkSync(f)
    rmSync(dir, { recursive: true, force: true })
  }
}

await main()
