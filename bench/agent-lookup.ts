// A warm 512-key lookup inside the agent, in-process: the request path an engine's lookup
// takes once read (frame body decoded, envelope checked, Agent.answer, answer encoded),
// no socket. With KVGATE_AB_OTHER (another tree, e.g. /work/main) both trees' agents run in
// this process, interleaved per round (the trees' order alternating): min / median / max µs.
//   KVGATE_AB_OTHER=/work/main node --import tsx bench/agent-lookup.ts
// KVGATE_BENCH_CHURN=1: L1 full, and before each lookup a save of one new chunk evicts
// another (an engine's agent: saves into a full L1 between its lookups); only the lookup is timed.

import { randomBytes } from 'node:crypto'
import { closeSync, ftruncateSync, openSync, unlinkSync } from 'node:fs'
import { resolve } from 'node:path'

const roots = [resolve('.'), ...(process.env.KVGATE_AB_OTHER ? [resolve(process.env.KVGATE_AB_OTHER)] : [])]
const churn = process.env.KVGATE_BENCH_CHURN === '1'
const perRound = Number(process.env.KVGATE_BENCH_LOOKUPS ?? (churn ? 300 : 3000))
const rounds = Number(process.env.KVGATE_BENCH_REPEATS ?? 11)
const keys = Array.from({ length: 512 }, () => randomBytes(32))
const packed = Buffer.concat(keys)
const tinyPath = `${process.env.KVGATE_BENCH_SHM ?? '/dev/shm'}/kvgate-lookup-bench-${process.pid}`

type Subject = { root: string; run: () => void; evictOne: () => Promise<unknown>; us: number[] }

async function subject(root: string): Promise<Subject> {
  const { Agent, newSession } = await import(`${root}/src/agent/agent.ts`)
  const P = await import(`${root}/src/agent/protocol.ts`)
  const agent = new Agent({
    chunkTokens: 256,
    cache: { memory: { bytes: 64 << 20 }, disk: false, remote: false },
    lookupDeadlineMs: 250,
    version: 'bench',
    copyThreads: 0,
  })
  const s = newSession(() => {})
  let id = 1
  const call = async (op: string, f: Record<string, unknown>) => agent.answer(s, { id: id++, op, ...f })
  const blockIds = (n: number) => Array.from({ length: n * 16 }, (_, b) => b % 1024)
  await call('hello', {
    protocol: 1,
    model: 'bench/tiny',
    hashSeed: '0',
    geometry: { layout: 'flash-attn', dtype: 'float16', layers: 1, kvHeads: 1, headSize: 8, blockSize: 16 },
  })
  const r = await call('register', {
    rank: 0,
    numBlocks: 1024,
    tensors: [{ kind: 'shm', path: tinyPath, offset: 0, shape: [2, 1024, 16, 1, 8] }],
  })
  const slots = (
    (await call('stats', { spaces: true })) as { spaceStats: { cache: { memory: { slots: number } } }[] }
  ).spaceStats[0]?.cache.memory.slots
  if (churn) {
    // Fill L1 but for the prompt's 512 chunks, which come last (the most recently used).
    for (let left = (slots ?? 0) - 512; left > 0; left -= 64) {
      const n = Math.min(64, left)
      await call('save', {
        worker: r.worker,
        keys: Array.from({ length: n }, () => randomBytes(32)),
        blockIds: blockIds(n),
      })
    }
  }
  for (let i = 0; i < 512; i += 64)
    await call('save', { worker: r.worker, keys: keys.slice(0, i + 64), blockIds: blockIds(i + 64), from: i })
  const evictOne = () => call('save', { worker: r.worker, keys: [randomBytes(32)], blockIds: blockIds(1) })
  // As the server sees a request: a view of the bytes read.
  const body = P.encodeFrame({ id: 7, op: 'lookup', keys: packed }).subarray(4)
  const run = () => {
    const req = P.checkEnvelope(P.decodeBody(body))
    const out = agent.answer(s, req)
    if (out instanceof Promise || out.chunks !== 512) throw new Error('not a warm lookup of 512 present keys')
    P.encodeFrame({ id: req.id, ok: true, ...out })
  }
  for (let i = 0; i < 3000; i++) run() // warm-up: optimized code, as in a long-running agent
  return { root, run, evictOne, us: [] }
}

const fd = openSync(tinyPath, 'w+', 0o600)
ftruncateSync(fd, 2 * 1024 * 16 * 8 * 2)
closeSync(fd)
try {
  const subjects: Subject[] = []
  for (const root of roots) subjects.push(await subject(root))
  for (let r = 0; r < rounds; r++) {
    for (const sub of r % 2 === 0 ? subjects : [...subjects].reverse()) {
      let ms = 0
      if (churn) {
        for (let i = 0; i < perRound; i++) {
          await sub.evictOne()
          const t = performance.now()
          sub.run()
          ms += performance.now() - t
        }
      } else {
        const t = performance.now()
        for (let i = 0; i < perRound; i++) sub.run()
        ms = performance.now() - t
      }
      sub.us.push((ms / perRound) * 1000)
    }
  }
  for (const sub of subjects) {
    const xs = [...sub.us].sort((a, b) => a - b)
    console.log(
      `${sub.root}: warm 512-key lookup in-process${churn ? ', one chunk evicted before each' : ''}, µs min / median / max ${xs[0]!.toFixed(1)} / ${xs[xs.length >> 1]!.toFixed(1)} / ${xs[xs.length - 1]!.toFixed(1)} (${rounds} rounds of ${perRound})`,
    )
  }
} finally {
  unlinkSync(tinyPath)
}
process.exit(0) // the agents' L1s and timers: nothing else to wait for
