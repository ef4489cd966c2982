// Agent benchmark (DESIGN §4, agent bar): save and load of a Llama-3.1-8B-shaped 32 MiB
// chunk's scattered paged blocks (block size 16, FlashAttention layout in /dev/shm) through
// real `kvgate agent` processes copying on their event loop, with 1 thread and with N
// (KVGATE_BENCH_COPY_THREADS, default min(cores, 4)), interleaved with one memcpy of the same
// bytes; a 512-key lookup (a 128k-token prompt) over the socket with warm local tiers, keys as
// an array of bins and packed, round trip and time inside the agent; agent CPU-seconds per GiB moved.
// KVGATE_BENCH_KV_LAYOUT: flash-attn (vLLM ≤ 0.25, default), LBNHC (vLLM ≥ 0.29's default: K and
// V of each token's head side by side, so a run of 256 B per head and token) or LBHNC.

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
  writeFileSync,
} from 'node:fs'
import { loadavg } from 'node:os'
import { join } from 'node:path'
import { defaultCopyThreads } from '../src/agent/config.ts'
import { loadNative } from '../src/client/native-api.ts'
import { benchKvLayout, Client, createLlama8BKv, registerLlama8B, shuffled } from './lib/agent-client.ts'
import { type GcCounts, GcTrace, gcLine } from './lib/gc-trace.ts'
import { machineLine, median, quantile, table, writeResult } from './lib/stats.ts'

const MiB = 1024 ** 2
const repeats = Number(process.env.KVGATE_BENCH_REPEATS ?? 15)
const dir = mkdtempSync(join('/tmp', 'kvgate-agent-bench-'))
const shmDir = process.env.KVGATE_BENCH_SHM ?? '/dev/shm'
const log = (s: string) => console.error(s)
const kvLayout = benchKvLayout()

type Quantiles = { p50: number; p99: number }
type ConnectorLookup =
  | {
      hit: number
      n: number
      lookup: Quantiles
      ping: Quantiles
      lookupHop: Quantiles
      pingHop: Quantiles
      bare: Quantiles
    }
  | { skipped: string }

/** bench/lib/agent_lookup.py with Debian's python3 (torch-free: it imports only the connector's client). */
function connectorLookup(sock: string, packed: Buffer): Promise<ConnectorLookup> {
  const keysFile = join(dir, 'lookup-keys.hex')
  writeFileSync(keysFile, packed.toString('hex'))
  const python = process.env.KVGATE_PYTHON ?? '/usr/bin/python3'
  return new Promise((resolve) => {
    const child = spawn(python, ['bench/lib/agent_lookup.py', sock, 'python', '3000', keysFile], {
      stdio: ['ignore', 'pipe', 'pipe'],
    })
    let out = ''
    let err = ''
    child.stdout.on('data', (d) => (out += d))
    child.stderr.on('data', (d) => (err += d))
    // Bounded: a stuck client must not hold the benchmark (3,000 lookups take ~2 s).
    const timer = setTimeout(() => child.kill('SIGKILL'), 120_000)
    child.on('error', (e) => resolve({ skipped: `${python}: ${e.message}` }))
    child.on('close', (code) => {
      clearTimeout(timer)
      if (code !== 0) return resolve({ skipped: `${python} exited ${code}: ${err.trim().split('\n').pop()}` })
      try {
        resolve(JSON.parse(out) as ConnectorLookup)
      } catch {
        resolve({ skipped: `unreadable output: ${out.slice(0, 200)}` })
      }
    })
  })
}

/** An agent; with `gc`, run with --trace-gc and its collections counted (`gc.trace`). */
function startAgent(sock: string, copyThreads: number, gc?: { trace?: GcTrace }): Promise<ChildProcess> {
  const child = spawn(
    process.execPath,
    [
      // e.g. KVGATE_BENCH_AGENT_NODE_ARGS='--cpu-prof --cpu-prof-dir=/tmp/prof' to profile the agent.
      ...(process.env.KVGATE_BENCH_AGENT_NODE_ARGS ?? '').split(' ').filter(Boolean),
      ...(gc ? ['--trace-gc'] : []),
      '--import',
      'tsx',
      'src/cli/main.ts',
      'agent',
      '--socket',
      sock,
      '--chunk-tokens',
      '256',
      '--copy-threads',
      String(copyThreads),
    ],
    {
      env: { ...process.env, KVGATE_MEMORY_BYTES: '320MiB', KVGATE_DISK: 'off', KVGATE_REMOTE: 'off' },
      stdio: ['ignore', 'pipe', 'inherit'],
    },
  )
  return new Promise((resolve, reject) => {
    // Ready once it prints its {"socket", …} line (GC lines may come first).
    if (gc) gc.trace = new GcTrace(child.stdout!, (l) => l.startsWith('{') && resolve(child))
    else child.stdout!.once('data', () => resolve(child))
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

/** One agent under test: its process, connection and registered worker. */
interface Subject {
  label: string
  agent: ChildProcess
  c: Client
  worker: number
  save: number[]
  load: number[]
}

async function main() {
  // The same agent copying on its event loop, with 1 thread and with N (the default split), interleaved per repeat.
  const n = Number(process.env.KVGATE_BENCH_COPY_THREADS ?? defaultCopyThreads())
  // 0: the copy on the agent's event loop, as before copies were threaded (the same-run baseline).
  const threads = n === 1 ? [0, 1] : [0, 1, n]
  const agents: ChildProcess[] = []
  const files: string[] = []
  try {
    // Llama-3.1-8B per GPU at TP 1 (bench/lib/agent-client.ts createLlama8BKv).
    const {
      path: kvPath,
      layers,
      numBlocks,
      layerBytes,
    } = createLlama8BKv(join(shmDir, `kvgate-bench-${process.pid}`))
    files.push(kvPath)
    // The lookups first, on an agent of their own (configured as the main one) running alone:
    // the copy phase's agents, idle after 32 MiB saves and loads, collect their garbage seconds
    // later (30-80 ms bursts of CPU each), which on a small host became the lookups' tail.
    const sock = join(dir, 'agent-lookup.sock')
    // Its collections are counted per phase: Mark-Compacts were the lookups' tail (--trace-gc).
    const gc: { trace?: GcTrace } = {}
    const lookupAgent = await startAgent(sock, threads[threads.length - 1]!, gc)
    agents.push(lookupAgent)
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
    // Each form of `keys` (an array of 32-byte bins; one packed bin of 32·n bytes) in a phase
    // of LOOKUP_WINDOW lookups, so the agent's own window of lookup times (stats
    // agentMs.lookup: frame decoded to answer encoded) then holds that phase alone.
    const packed = Buffer.concat(keys)
    const LOOKUP_WINDOW = 1024
    const phases: {
      form: string
      keys: unknown
      rtt: number[]
      agentP50: number
      agentP99: number
      gc: GcCounts
    }[] = []
    // Same-run baseline: an empty request's round trip over the same socket (transport and
    // scheduling alone), interleaved with the lookups.
    const pings: number[] = []
    let hit = 0
    for (const [form, k] of [
      ['array of 512 bins', keys],
      ['one packed bin', packed],
    ] as const) {
      for (let i = 0; i < 20; i++) await l2.call('lookup', { keys: k })
      gc.trace!.take()
      const rtt: number[] = []
      for (let i = 0; i < LOOKUP_WINDOW; i++) {
        rtt.push(await time(async () => (hit = (await l2.call('lookup', { keys: k })).chunks as number)))
        if (i % 2 === 0) pings.push(await time(() => l2.call('ping')))
      }
      const st = ((await l2.call('stats')).agentMs as Record<string, { p50: number; p99: number }>).lookup!
      phases.push({ form, keys: k, rtt, agentP50: st.p50, agentP99: st.p99, gc: gc.trace!.take() })
    }
    const lookups = phases[1]!.rtt
    // The engine's own path: vLLM's connector (python/kvgate_vllm: the caller reads its answer, or its reader thread and futures)
    // against the same agent and keys, and the machine's floor for any socket round trip.
    const connector = await connectorLookup(sock, packed)
    const connectorGc = gc.trace!.take()
    l2.sock.destroy()
    await new Promise((resolve) => {
      const stuck = setTimeout(() => lookupAgent.kill('SIGKILL'), 10_000)
      lookupAgent.once('exit', () => resolve(clearTimeout(stuck)))
      lookupAgent.kill('SIGTERM')
    })

    const subjects: Subject[] = []
    for (const t of threads) {
      const agent = await startAgent(join(dir, `agent-${t}.sock`), t)
      agents.push(agent)
      const c = await Client.open(join(dir, `agent-${t}.sock`))
      const worker = await registerLlama8B(c, kvPath, layers, numBlocks, layerBytes, kvLayout)
      subjects.push({
        label: t === 0 ? 'on the event loop' : `${t} copy thread${t === 1 ? '' : 's'}`,
        agent,
        c,
        worker,
        save: [],
        load: [],
      })
    }
    const chunkBytes = 32 * MiB
    const src = Buffer.alloc(chunkBytes, 7)
    const dst = Buffer.alloc(chunkBytes, 1)
    const memcpy: number[] = []
    const memcpyThreads: number[] = []
    const copyAsync = loadNative().api?.copyRunsAsync
    const oneRun = new Float64Array([0, 0, 1, 0, chunkBytes])
    let moved = 0
    const last = subjects[subjects.length - 1]!
    const cpu0 = cpuSeconds(last.agent.pid!)
    for (let i = 0; i < repeats + 2; i++) {
      const order = shuffled(numBlocks, i + 1)
      const keys = [randomBytes(32)]
      const m = await time(async () => src.copy(dst))
      // The same bytes on the agents' thread count: the addon's threaded copy of one run (the
      // agent's own primitive, unscattered). Not the bar's baseline: how much of "vs memcpy" is
      // the second thread.
      const mt = copyAsync ? await time(() => copyAsync([dst, src], oneRun, Math.max(1, n))) : Number.NaN
      for (const sub of subjects) {
        const { c, worker } = sub
        const s = await time(() => c.call('save', { worker, keys, blockIds: order.slice(0, 16) }))
        const l = await time(() => c.call('load', { worker, keys, blockIds: order.slice(16, 32) }))
        if (i >= 2) {
          sub.save.push(s)
          sub.load.push(l)
        }
      }
      if (i >= 2) {
        memcpy.push(m)
        memcpyThreads.push(mt)
        moved += 2 * chunkBytes
      }
    }
    // Time inside each agent (frame decoded to answer encoded): the rest of a round trip is the socket and scheduling.
    const inside = new Map<Subject, Record<string, { p50: number; p99: number }>>()
    for (const sub of subjects)
      inside.set(sub, (await sub.c.call('stats')).agentMs as Record<string, { p50: number; p99: number }>)
    const cpuPerGiB = (cpuSeconds(last.agent.pid!) - cpu0) / ((moved * (repeats + 2)) / repeats / 2 ** 30)
    for (const sub of subjects) sub.c.sock.destroy()
    const save = last.save
    const load = last.load

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
          `operation (32 MiB, 16 scattered blocks × 32 layers × K,V; ${kvLayout})`,
          'min / median / max ms',
          'GB/s (median)',
          'vs memcpy, per repeat min / median / max',
          'inside the agent p50 ms',
        ],
        ...subjects.flatMap((sub) => [
          [
            `save (engine shm → agent L1), ${sub.label}`,
            spread(sub.save, 2),
            gbs(median(sub.save)),
            spread(ratios(sub.save), 2),
            inside.get(sub)!.save!.p50.toFixed(2),
          ],
          [
            `load (agent L1 → engine shm), ${sub.label}`,
            spread(sub.load, 2),
            gbs(median(sub.load)),
            spread(ratios(sub.load), 2),
            inside.get(sub)!.load!.p50.toFixed(2),
          ],
        ]),
        ['one memcpy of the same bytes (baseline)', spread(memcpy, 2), gbs(mMs), '1.00', ''],
        ...(copyAsync
          ? [
              [
                `the same bytes in one run on ${n} threads (the addon's copy; not the baseline)`,
                spread(memcpyThreads, 2),
                gbs(median(memcpyThreads)),
                spread(ratios(memcpyThreads), 2),
                '',
              ],
            ]
          : []),
      ]),
    )
    if (copyAsync) {
      // Per repeat: that threaded copy's time / the operation's time, for the agent on n threads.
      const vsThreads = (op: number[]) => op.map((t, i) => memcpyThreads[i]! / t)
      console.log(
        `${last.label} vs the same bytes in one run on ${n} threads, per repeat min / median / max: save ${spread(vsThreads(last.save), 2)}, load ${spread(vsThreads(last.load), 2)}`,
      )
    }
    for (const ph of phases) {
      console.log(
        `lookup of 512 keys (${ph.form}, ${hit} present): round trip p50 ${quantile(ph.rtt, 0.5).toFixed(3)} ms,` +
          ` p99 ${quantile(ph.rtt, 0.99).toFixed(3)} ms; inside the agent p50 ${ph.agentP50.toFixed(3)} ms, p99 ${ph.agentP99.toFixed(3)} ms;` +
          ` the agent's GCs meanwhile: ${gcLine(ph.gc)}`,
      )
    }
    console.log(
      `same-run ping round trip: p50 ${quantile(pings, 0.5).toFixed(3)} ms, p99 ${quantile(pings, 0.99).toFixed(3)} ms`,
    )
    if ('skipped' in connector)
      console.log(`lookup through the Python connector: skipped (${connector.skipped})`)
    else
      console.log(
        `lookup of 512 keys through the Python connector (kvgate_vllm.AgentClient, ${connector.hit} present):` +
          ` p50 ${connector.lookup.p50.toFixed(3)} ms, p99 ${connector.lookup.p99.toFixed(3)} ms;` +
          ` its ping p50 ${connector.ping.p50.toFixed(3)}, p99 ${connector.ping.p99.toFixed(3)} ms;` +
          ` same-run baseline, in alternate blocks each answer through the client's reader thread to a Future: lookup p50 ${connector.lookupHop.p50.toFixed(3)}, p99 ${connector.lookupHop.p99.toFixed(3)} ms, ping p50 ${connector.pingHop.p50.toFixed(3)}, p99 ${connector.pingHop.p99.toFixed(3)} ms;` +
          ` bare Unix-socket ping-pong between two processes beside each lookup (the machine's floor) p50 ${connector.bare.p50.toFixed(3)}, p99 ${connector.bare.p99.toFixed(3)} ms;` +
          ` the agent's GCs meanwhile (${connector.n} lookups and ${connector.n} through the reader thread, pings between): ${gcLine(connectorGc)}`,
      )
    console.log(`agent CPU: ${cpuPerGiB.toFixed(3)} CPU-s per GiB moved (save + load)`)
    const load1 = loadavg()[0]!.toFixed(1)
    console.log(`machine load average during the run: ${load1}`)
    const layoutTag = kvLayout === 'flash-attn' ? '' : ` (vLLM ${kvLayout} views)`
    const path = writeResult({
      name: kvLayout === 'flash-attn' ? 'agent' : `agent-${kvLayout}`,
      date: new Date().toISOString(),
      machine: `${await machineLine()}, load ${load1}`,
      bars: [
        {
          bar: `agent save of a 32 MiB chunk of scattered paged blocks vs memcpy${layoutTag}`,
          figure: mMs / sMs,
          unit: 'x memcpy',
          baseline: mMs,
          baselineLabel: 'memcpy ms',
          ratio: mMs / sMs,
          target: '>= 0.8',
          met: mMs / sMs >= 0.8,
        },
        {
          bar: `agent load of a 32 MiB chunk into scattered paged blocks vs memcpy${layoutTag}`,
          figure: mMs / lMs,
          unit: 'x memcpy',
          baseline: mMs,
          baselineLabel: 'memcpy ms',
          ratio: mMs / lMs,
          target: '>= 0.8',
          met: mMs / lMs >= 0.8,
        },
        // The engine's path (vLLM's connector client) when python3 ran it; else the bench's Node client.
        'skipped' in connector
          ? {
              bar: 'lookup of a 128k-token prompt (512 keys, packed) over the socket, warm, p99 (Node client)',
              figure: p99,
              unit: 'ms',
              target: '< 1',
              met: p99 < 1,
            }
          : {
              bar: 'lookup of a 128k-token prompt (512 keys, packed) over the socket through the Python connector, warm, p99',
              figure: connector.lookup.p99,
              unit: 'ms',
              baseline: connector.bare.p99,
              baselineLabel: 'bare socket ping-pong p99 ms, same run',
              target: '< 1',
              met: connector.lookup.p99 < 1,
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
      threadedCopyMs: copyAsync ? median(memcpyThreads) : null,
      lookupP50Ms: p50,
      lookupP99Ms: p99,
      lookups: phases.map((ph) => ({
        form: ph.form,
        p50Ms: quantile(ph.rtt, 0.5),
        p99Ms: quantile(ph.rtt, 0.99),
        agentP50Ms: ph.agentP50,
        agentP99Ms: ph.agentP99,
        agentGc: ph.gc,
      })),
      pingP50Ms: quantile(pings, 0.5),
      pingP99Ms: quantile(pings, 0.99),
      connectorLookup: connector,
      connectorLookupAgentGc: connectorGc,
      agentCpuSecondsPerGiB: cpuPerGiB,
    })
    log(`wrote ${path}`)
  } finally {
    for (const agent of agents) agent.kill('SIGTERM')
    for (const f of files) unlinkSync(f)
    rmSync(dir, { recursive: true, force: true })
  }
}

await main()
