// Cold L2 reads, A/B in one process: this tree's KVCache against another tree's
// (KVGATE_AB_OTHER, e.g. /work/main: its own src and addon), every variant once per
// round (the trees' order alternating), page cache dropped before each. Prints
// min/median/max GB/s, the ratio to raw4, CPU-s/GiB (process) and the share of the time the
// device had a request in flight (`busy`, from /sys/dev/block/M:m/stat io_ticks; where
// the scratch directory's device has no such file, absent) per variant.
//   KVGATE_AB_OTHER=/work/main KVGATE_BENCH_REPEATS=15 node --import tsx bench/l2-ab.ts
// KVGATE_AB_ONLY picks variants (comma-separated; default retrieve,prefetch,layers,raw4):
//   retrieve    KVCache.retrieve into a plain buffer (workers copy verified sections: the sink)
//   retrieveJs  the same into a SharedArrayBuffer view (copied on the JS thread after verifying)
//   prefetch    L2 → L1 only;  layers: retrieveLayers (L2 → L1, slabs handed out)
//   tier        DiskTier.get of the 8 chunks at once into pinned slots (read + CRC, no copy)
//   tierSink    the same with a sink into the caller's buffer (read + CRC + worker copy)
//   seg1..seg6  N readers of 8 MiB O_DIRECT pieces, no CRC (how deep a queue the disk needs)
//   raw4        four files at once, one read call each (bench/client.ts's usual baseline)

import { mkdtempSync, readdirSync, readFileSync, rmSync, statSync } from 'node:fs'
import { loadavg } from 'node:os'
import { join } from 'node:path'
import { KVCache } from '../src/client/index.ts'
import { allocPinned, evictFileCache, readFileDirect } from '../src/client/native.ts'
import { loadNative } from '../src/client/native-api.ts'
import { DiskTier } from '../src/client/tiers/disk.ts'
import { chunkBytes, MODEL_PRESETS } from '../src/core/layout.ts'
import { median } from './lib/stats.ts'

const repeats = Number(process.env.KVGATE_BENCH_REPEATS ?? 15)
const other = process.env.KVGATE_AB_OTHER
const scratch = mkdtempSync(join(process.env.KVGATE_BENCH_DIR ?? '/var/tmp', 'kvgate-l2-ab-'))
const g = MODEL_PRESETS['llama-3.1-8b']
const cb = chunkBytes(g, 256)
const N = 8
const bytes = N * cb
const toks = Uint32Array.from({ length: N * 256 }, (_, i) => (i * 2654435761 + 3 * 97) % 128256)

type Cache = KVCache
const open = (K: typeof KVCache, dir: string) =>
  K.open({
    model: 'llama-3.1-8b',
    chunkTokens: 256,
    memory: { bytes: (N + 1) * (cb + 8192) },
    disk: { dir, bytes: 4 * 1024 ** 3, concurrency: Number(process.env.KVGATE_BENCH_DISK_CONCURRENCY ?? 2) },
  })

const dir = join(scratch, 'l2')
{
  const w = await open(KVCache, dir)
  const kv = new Uint8Array(bytes)
  for (let i = 0; i < kv.length; i += 4096) kv[i] = i >>> 12
  await w.store(toks, kv)
  await w.flush()
  await w.close()
}
const files: string[] = []
for (const sub of readdirSync(dir)) for (const f of readdirSync(join(dir, sub))) files.push(join(dir, sub, f))
const drop = async () => {
  for (const f of files) await evictFileCache(f)
}

const caches: [string, Cache][] = [['this', await open(KVCache, dir)]]
if (other) {
  const mod = (await import(join(other, 'src/client/index.ts'))) as { KVCache: typeof KVCache }
  caches.push(['other', await open(mod.KVCache, dir)])
}
const into = new Uint8Array(bytes).fill(1)
// A SharedArrayBuffer view: the addon cannot write there, so retrieve copies on the JS thread.
const intoShared = new Uint8Array(new SharedArrayBuffer(bytes)).fill(1)
// The disk tier alone (read + CRC on the pool), with and without a sink copying into `into`.
const tier = await DiskTier.open({ dir, bytes: 4 * 1024 ** 3, native: loadNative().api })
const keys = caches[0]![1].keys(toks) as { hex: string }[]
const slots = await Promise.all(keys.map(async () => new Uint8Array((await allocPinned(cb + 8192)).buffer)))
const rawBufs = await Promise.all(
  [0, 1, 2, 3].map(async () => new Uint8Array((await allocPinned(cb + 8192)).buffer)),
)

// The block device under the scratch directory (a partition has its own stat file).
const dev = statSync(scratch).dev
const devStat = `/sys/dev/block/${Math.floor(dev / 256) % 4096}:${(dev % 256) + Math.floor(dev / 1048576) * 256}/stat`
/** Milliseconds the device had I/O in flight (io_ticks), or undefined where it cannot be read. */
const ioTicks = (): number | undefined => {
  try {
    return Number(readFileSync(devStat, 'utf8').trim().split(/\s+/)[9])
  } catch {
    return undefined
  }
}
const res = new Map<string, { ms: number[]; cpu: number[]; busy: number[] }>()
async function run(name: string, fn: () => Promise<unknown>) {
  await drop()
  const c = process.cpuUsage()
  const busy0 = ioTicks()
  const t = performance.now()
  await fn()
  const ms = performance.now() - t
  const busy1 = ioTicks()
  const d = process.cpuUsage(c)
  const r = res.get(name) ?? { ms: [], cpu: [], busy: [] }
  r.ms.push(ms)
  r.cpu.push((d.user + d.system) / 1e6)
  if (busy0 !== undefined && busy1 !== undefined) r.busy.push((busy1 - busy0) / ms)
  res.set(name, r)
}
const only = (process.env.KVGATE_AB_ONLY ?? 'retrieve,prefetch,layers,raw4').split(',')
const load0 = loadavg()[0]
for (let r = 0; r < repeats; r++) {
  // Alternate which tree goes first each round.
  const order = r % 2 === 0 ? caches : [...caches].reverse()
  for (const [tag, c] of order) {
    if (only.includes('retrieve'))
      await run(`retrieve ${tag}`, async () => {
        c.clearMemory()
        const m = await c.retrieve(toks, { into })
        if (m[m.length - 1] !== 1) throw new Error(`${tag}: retrieve missed`)
      })
    if (only.includes('retrieveJs'))
      await run(`retrieveJs ${tag}`, async () => {
        c.clearMemory()
        const m = await c.retrieve(toks, { into: intoShared })
        if (m[m.length - 1] !== 1) throw new Error(`${tag}: retrieve missed`)
      })
    if (only.includes('prefetch'))
      await run(`prefetch ${tag}`, async () => {
        c.clearMemory()
        if ((await c.prefetch(toks)).tokens !== N * 256) throw new Error(`${tag}: prefetch missed`)
      })
    if (only.includes('layers'))
      await run(`layers ${tag}`, async () => {
        c.clearMemory()
        let last = 0
        for await (const b of c.retrieveLayers(toks)) last = b.chunks
        if (last !== N) throw new Error('layers missed')
      })
  }
  for (const sink of [false, true]) {
    if (!only.includes(sink ? 'tierSink' : 'tier')) continue
    await run(sink ? 'tierSink' : 'tier', async () => {
      const gate = tier.copyGate()!
      try {
        const got = await Promise.all(
          keys.map((k, i) =>
            tier.get(
              k.hex,
              'get',
              slots[i],
              sink
                ? {
                    into: into.subarray(i * cb, (i + 1) * cb),
                    gate,
                    copied: false,
                    accept: (h) => h.headerBytes,
                  }
                : undefined,
            ),
          ),
        )
        if (got.some((g) => !g)) throw new Error('tier missed')
      } finally {
        gate.close()
      }
    })
  }
  for (const w of [1, 2, 3, 4, 6]) {
    if (!only.includes(`seg${w}`)) continue
    // w workers reading the files in 8 MiB pieces (as the tier's segments): how deep a
    // queue of 8 MiB reads the disk needs.
    const seg = 8 << 20
    const pieces = files
      .flatMap((f) => [0, 1, 2, 3, 4].map((k) => [f, k * seg] as const))
      .filter(([, o]) => o < cb)
    await run(`seg${w}`, async () => {
      let next = 0
      await Promise.all(
        Array.from({ length: w }, async (_, j) => {
          while (next < pieces.length) {
            const [f, o] = pieces[next++]!
            await readFileDirect(f, rawBufs[j % 4]!.subarray(0, seg), {
              direct: 'require',
              fileOffset: o,
              length: Math.min(seg, cb + 8192 - o),
            })
          }
        }),
      )
    })
  }
  if (only.includes('raw4'))
    await run('raw4', async () => {
      let next = 0
      await Promise.all(
        [0, 1, 2, 3].map(async (w) => {
          while (next < files.length) await readFileDirect(files[next++]!, rawBufs[w]!, { direct: 'require' })
        }),
      )
    })
}
const raw = res.get('raw4') ? median(res.get('raw4')!.ms) : undefined
const out: Record<string, unknown> = { repeats, load: [load0, loadavg()[0]] }
for (const [name, r] of res) {
  const gbs = r.ms.map((t) => bytes / t / 1e6).sort((a, b) => a - b)
  out[name] = {
    min: +gbs[0]!.toFixed(2),
    median: +median(gbs).toFixed(2),
    max: +gbs.at(-1)!.toFixed(2),
    vsRaw4: raw ? +(raw / median(r.ms)).toFixed(3) : undefined,
    cpuSPerGiB: +(median(r.cpu) / (bytes / 1024 ** 3)).toFixed(3),
    busy: r.busy.length > 0 ? +median(r.busy).toFixed(2) : undefined,
  }
}
console.log(JSON.stringify(out, null, 1))
for (const [, c] of caches) await c.close()
rmSync(scratch, { recursive: true, force: true })
