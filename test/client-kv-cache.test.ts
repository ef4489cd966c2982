// KVCache end to end over the tiers: validation, waterfall and promotion,
// layer-wise retrieval, eviction under pressure, config layers and metrics.

import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterEach, describe, expect, it, vi } from 'vitest'
import { CodecPool } from '../src/client/codec-pool.ts'
import { optionsFromEnvironment, parseBytes, resolveOptions } from '../src/client/config.ts'
import { KVCache } from '../src/client/index.ts'
import { DiskTier } from '../src/client/tiers/disk.ts'
import { chainKeys } from '../src/core/keys.ts'
import { chunkBytes, layerSlabBytes, MODEL_PRESETS } from '../src/core/layout.ts'

const T = 16
const CB = chunkBytes(MODEL_PRESETS.stories260k, T)

function tokens(n: number, seed = 1): number[] {
  return Array.from({ length: n }, (_, i) => (i * 7 + seed * 131) % 512)
}

function kvFor(chunks: number, seed = 1): Uint8Array {
  const out = new Uint8Array(chunks * CB)
  let x = seed * 2654435761
  for (let i = 0; i < out.length; i++) {
    x = (x * 1103515245 + 12345) >>> 0
    out[i] = x >>> 24
  }
  return out
}

const sum = (m: Uint8Array) => m.reduce((a, b) => a + b, 0)

/** XORs `mask` into one byte of a chunk's L2 file, at `at(file length)`. */
function flipL2Byte(dir: string, hex: string, at: (length: number) => number, mask: number): void {
  const path = join(dir, hex.slice(0, 2), `${hex}.kvc`)
  const b = readFileSync(path)
  const i = at(b.length)
  b[i] = (b[i] ?? 0) ^ mask
  writeFileSync(path, b)
}
const dirs: string[] = []
const caches: KVCache[] = []
function tempDir(): string {
  const d = mkdtempSync(join(tmpdir(), 'kvgate-kvc-'))
  dirs.push(d)
  return d
}
async function open(opts: Partial<Parameters<typeof KVCache.open>[0]> = {}): Promise<KVCache> {
  const c = await KVCache.open({ model: 'stories260k', chunkTokens: T, memory: { bytes: 64 * CB }, ...opts })
  caches.push(c)
  return c
}
afterEach(async () => {
  // Every test ends with every L1 reservation and pin settled (background writes included).
  for (const c of caches) {
    await c.flush()
    const m = c.stats().memory
    expect({ reservations: m.liveReservations, pins: m.livePins }).toEqual({ reservations: 0, pins: 0 })
  }
  for (const c of caches.splice(0)) await c.close()
  for (const d of dirs.splice(0)) rmSync(d, { recursive: true, force: true })
})

describe('KVCache options', () => {
  it('rejects bad options eagerly with the option named', async () => {
    await expect(KVCache.open({ model: 'nope' as never })).rejects.toThrow(/unknown model preset 'nope'/)
    await expect(KVCache.open({ model: 'stories260k', chunkTokens: 0 })).rejects.toThrow(
      /invalid chunkTokens/,
    )
    await expect(KVCache.open({ model: 'stories260k', chunkTokens: 1.5 })).rejects.toThrow(
      /invalid chunkTokens/,
    )
    await expect(KVCache.open({ model: 'stories260k', namespace: '../x' })).rejects.toThrow(
      /invalid namespace/,
    )
    await expect(KVCache.open({ model: 'stories260k', memory: { bytes: 10 } })).rejects.toThrow(
      /smaller than one chunk/,
    )
    await expect(KVCache.open({ model: 'stories260k', disk: { dir: '' } })).rejects.toThrow(/disk.dir/)
    await expect(
      KVCache.open({ model: 'stories260k', disk: { dir: '/tmp/x', storeAs: 'zip' as never } }),
    ).rejects.toThrow(/storeAs/)
    await expect(
      KVCache.open({ model: 'stories260k', disk: { dir: '/tmp/x', direct: 'yes' as never } }),
    ).rejects.toThrow(/disk.direct/)
    await expect(KVCache.open({ model: 'stories260k', remote: { url: 'ftp://x' } })).rejects.toThrow(
      /remote.url/,
    )
    await expect(
      KVCache.open({ model: 'stories260k', remote: { url: 'http://x', codec: 'gzip' as never } }),
    ).rejects.toThrow(/remote.codec/)
    await expect(
      KVCache.open({ model: 'stories260k', remote: { url: 'http://x', quality: 0 } }),
    ).rejects.toThrow(/remote.quality/)
    await expect(KVCache.open({ model: 'stories260k', memroy: {} } as never)).rejects.toThrow(
      /unknown option memroy/,
    )
    // A chunk over the 512 MiB every reader accepts would be stored and then dropped as corrupt.
    const big = { modelId: 'm/big', layers: 128, kvHeads: 16, headDim: 128, dtype: 'fp16' as const }
    await expect(KVCache.open({ model: big, chunkTokens: 1024, native: false })).rejects.toThrow(
      /chunkTokens: a chunk of 1024 tokens of m\/big is 1073741824 bytes, over the 512 MiB .* use chunkTokens ≤ 511/,
    )
    await expect(
      KVCache.open({ model: { modelId: 'm', layers: 0, kvHeads: 1, headDim: 1, dtype: 'fp16' } }),
    ).rejects.toThrow(/layers/)
  })

  it('validates tokens, kv and into on every call', async () => {
    const c = await open()
    await expect(c.store([1, -2, 3], new Uint8Array(0))).rejects.toThrow(/token at index 1/)
    await expect(c.store([1, 2.5], new Uint8Array(0))).rejects.toThrow(/token at index 1/)
    await expect(c.store('abc' as never, new Uint8Array(0))).rejects.toThrow(/invalid tokens/)
    await expect(c.store(tokens(T), new Uint8Array(CB - 1))).rejects.toThrow(
      /expected 10240 \(1 chunk tensors/,
    )
    await expect(c.store(tokens(T), 'x' as never)).rejects.toThrow(/invalid kv/)
    await expect(c.retrieve(tokens(2 * T), { into: new Uint8Array(CB) })).rejects.toThrow(/invalid into/)
    await expect(c.retrieve(tokens(T), {} as never)).rejects.toThrow(/into/)
    await expect(c.store(tokens(T), { kind: 'device', pointer: 0n })).rejects.toThrow(/pointer/)
  })

  it('takes the write-behind, deadline, presence and upload options from the file and from env', () => {
    const dir = tempDir()
    const file = join(dir, 'kvgate.yaml')
    writeFileSync(
      file,
      'model: stories260k\nwriteBehindBytes: 64MiB\nretrieveDeadlineMs: 500\nremote:\n  url: http://gw:8080\n  presenceTtlMs: 5000\n  uploadMinBytes: 8MiB\n',
    )
    const fromFile = resolveOptions(optionsFromEnvironment({ KVGATE_CLIENT_CONFIG: file }) as never)
    expect(fromFile).toMatchObject({
      writeBehindBytes: 64 * 1024 ** 2,
      retrieveDeadlineMs: 500,
      remote: { presenceTtlMs: 5000, uploadMinBytes: 8 * 1024 ** 2 },
    })
    const env = {
      KVGATE_CLIENT_CONFIG: file,
      KVGATE_WRITE_BEHIND_BYTES: '1GiB',
      KVGATE_RETRIEVE_DEADLINE_MS: '2000',
      KVGATE_REMOTE_PRESENCE_TTL_MS: '60000',
      KVGATE_REMOTE_UPLOAD_MIN_BYTES: '16MiB',
    }
    expect(resolveOptions(optionsFromEnvironment(env) as never)).toMatchObject({
      writeBehindBytes: 1024 ** 3,
      retrieveDeadlineMs: 2000,
      remote: { presenceTtlMs: 60_000, uploadMinBytes: 16 * 1024 ** 2 },
    })
    expect(() => optionsFromEnvironment({ KVGATE_REMOTE_PRESENCE_TTL_MS: '1m' })).toThrow(
      /KVGATE_REMOTE_PRESENCE_TTL_MS/,
    )
    expect(() => optionsFromEnvironment({ KVGATE_REMOTE_UPLOAD_MIN_BYTES: 'big' })).toThrow(
      /KVGATE_REMOTE_UPLOAD_MIN_BYTES/,
    )
  })

  it('merges env over the YAML file and parses sizes', () => {
    const dir = tempDir()
    const file = join(dir, 'kvgate.yaml')
    writeFileSync(
      file,
      'model: llama-3.1-8b\nchunkTokens: 128\nmemory:\n  bytes: 2GiB\ndisk:\n  dir: /var/cache/kvgate\n  bytes: 100GB\nremote:\n  url: http://gw:8080\n',
    )
    const o = optionsFromEnvironment(
      {
        KVGATE_CLIENT_CONFIG: file,
        KVGATE_CHUNK_TOKENS: '256',
        KVGATE_REMOTE_TOKEN: 'tok',
        KVGATE_MEMORY_BYTES: '512MiB',
      },
      undefined,
    )
    const r = resolveOptions(o as never)
    expect(r.chunkTokens).toBe(256)
    expect(r.memory.bytes).toBe(512 * 1024 ** 2)
    expect(r.disk !== false && r.disk.bytes).toBe(100e9)
    expect(r.remote !== false && r.remote.url).toBe('http://gw:8080')
    expect(r.remote !== false && r.remote.token).toBe('tok')
    expect(optionsFromEnvironment({ KVGATE_CLIENT_CONFIG: file, KVGATE_DISK: 'off' }).disk).toBe(false)
    expect(() => optionsFromEnvironment({ KVGATE_CHUNK_TOKENS: '12abc' })).toThrow(/KVGATE_CHUNK_TOKENS/)
    expect(() => optionsFromEnvironment({ KVGATE_CLIENT_CONFIG: join(dir, 'missing.yaml') })).toThrow(
      /cannot read config/,
    )
    expect(parseBytes('x', '1k')).toBe(1024)
    expect(parseBytes('x', '1kB')).toBe(1000)
    expect(() => parseBytes('x', 'lots')).toThrow(/byte size/)
  })

  it('KVGATE_DISK and KVGATE_REMOTE take on/off only: a typo does not leave a tier on silently', () => {
    for (const off of ['off', 'false']) {
      expect(optionsFromEnvironment({ KVGATE_DISK: off, KVGATE_DISK_DIR: '/d' }).disk).toBe(false)
      expect(optionsFromEnvironment({ KVGATE_REMOTE: off, KVGATE_REMOTE_URL: 'http://gw' }).remote).toBe(
        false,
      )
    }
    for (const on of ['on', 'true']) {
      expect(optionsFromEnvironment({ KVGATE_DISK: on, KVGATE_DISK_DIR: '/d' }).disk).toEqual({ dir: '/d' })
      expect(optionsFromEnvironment({ KVGATE_REMOTE: on, KVGATE_REMOTE_URL: 'http://gw' }).remote).toEqual({
        url: 'http://gw',
      })
    }
    for (const typo of ['0', 'no', 'disabled', 'OFF ']) {
      expect(() => optionsFromEnvironment({ KVGATE_DISK: typo, KVGATE_DISK_DIR: '/d' })).toThrow(
        /KVGATE_DISK\b.*on or off/,
      )
      expect(() => optionsFromEnvironment({ KVGATE_REMOTE: typo, KVGATE_REMOTE_URL: 'http://gw' })).toThrow(
        /KVGATE_REMOTE\b.*on or off/,
      )
    }
  })

  it('defaults work on one machine: memory only, no disk, no gateway', () => {
    const r = resolveOptions({ model: 'stories260k' })
    expect(r.chunkTokens).toBe(256)
    expect(r.disk).toBe(false)
    expect(r.remote).toBe(false)
    expect(r.memory.bytes).toBeGreaterThanOrEqual(chunkBytes(MODEL_PRESETS.stories260k, 256))
  })
})

describe('KVCache codec workers', () => {
  const until = async (ok: () => boolean) => {
    const end = Date.now() + 20_000
    while (!ok() && Date.now() < end) await new Promise((r) => setTimeout(r, 10))
  }

  it('a cache with an L4 tier or coded L2 files loads its codec workers at open, before any hit', async () => {
    // The gateway is never reached: the workers load at open, not on the first L4 hit.
    const withRemote = await open({ codecWorkers: 1, remote: { url: 'http://127.0.0.1:9' } })
    const withLossless = await open({ codecWorkers: 1, disk: { dir: tempDir(), storeAs: 'lossless' } })
    await until(
      () => withRemote.stats().codec.readyWorkers === 1 && withLossless.stats().codec.readyWorkers === 1,
    )
    expect(withRemote.stats().codec).toMatchObject({ readyWorkers: 1, workerJobs: 0, inlineJobs: 0 })
    expect(withLossless.stats().codec).toMatchObject({ readyWorkers: 1, workerJobs: 0, inlineJobs: 0 })
  })

  it("caches given one pool (SharedTiers.codec) run on it and leave it to its owner: one set of workers, closes don't end it", async () => {
    const pool = new CodecPool(1)
    try {
      const remote = { url: 'http://127.0.0.1:9' }
      const a = await KVCache.open(
        { model: 'stories260k', chunkTokens: T, memory: { bytes: 8 * CB }, codecWorkers: 3, remote },
        { codec: pool },
      )
      const b = await KVCache.open(
        { model: 'stories260k', chunkTokens: T, memory: { bytes: 8 * CB }, remote },
        { codec: pool },
      )
      await until(() => pool.readyWorkers === 1)
      // One worker for both (codecWorkers: 3 is the owner's to decide, not a's).
      expect(a.stats().codec.readyWorkers).toBe(1)
      expect(b.stats().codec.readyWorkers).toBe(1)
      const meta = {
        geometry: MODEL_PRESETS.stories260k,
        tokens: T,
        chunkIndex: 0,
        partial: false,
        namespaceId: new Uint8Array(16),
        chainKey: new Uint8Array(32),
        parentKey: new Uint8Array(32),
      }
      await pool.encode('lossless', kvFor(1), meta)
      expect(a.stats().codec.workerJobs).toBe(1)
      expect(b.stats().codec.workerJobs).toBe(1)
      await a.close()
      await b.close()
      // Still the owner's and still working after both caches closed.
      expect(pool.readyWorkers).toBe(1)
      await pool.encode('lossless', kvFor(1), meta)
      expect(pool.counts.workerJobs).toBe(2)
    } finally {
      await pool.close()
    }
  })

  it('a cache that moves only raw chunks (L1, raw L2) starts no codec worker', async () => {
    const c = await open({ codecWorkers: 1, disk: { dir: tempDir() } })
    await c.store(tokens(2 * T), kvFor(2))
    await c.flush()
    await new Promise((r) => setTimeout(r, 300))
    expect(c.stats().codec).toMatchObject({ readyWorkers: 0, workerJobs: 0 })
  })
})

describe('KVCache key schemes', () => {
  it("keyScheme 'vllm-sha256-cbor' keys chunks exactly as vLLM's block hash, memo or not", async () => {
    const p = MODEL_PRESETS.stories260k
    const ns = {
      modelId: p.modelId,
      geometry: p,
      chunkTokens: T,
      scheme: 'vllm-sha256-cbor' as const,
      hashSeed: '0',
    }
    const c = await open({ keyScheme: 'vllm-sha256-cbor', hashSeed: '0' })
    const a = Array.from({ length: 3 * T + 5 }, (_, i) => (i * 31) % 500)
    const b = [...a.slice(0, 2 * T), ...Array.from({ length: T + 3 }, (_, i) => i)] // shares 2 chunks with a
    for (const tokens of [a, b, a]) {
      expect(c.keys(tokens, true).map((k) => k.hex)).toEqual(
        chainKeys(tokens, ns, { includePartial: true }).map((k) => k.hex),
      )
    }
    const v1 = await open()
    expect(v1.keys(a)[0]!.hex).not.toBe(c.keys(a)[0]!.hex)
    await expect(open({ keyScheme: 'vllm-sha256-cbor' })).rejects.toThrow(/PYTHONHASHSEED/)
    await expect(open({ keyScheme: 'md5' as never })).rejects.toThrow(/invalid keyScheme/)
    expect(optionsFromEnvironment({ KVGATE_KEY_SCHEME: 'vllm-sha256-cbor' }).keyScheme).toBe(
      'vllm-sha256-cbor',
    )
  })
})

describe('KVCache over L1 and L2', () => {
  it('stores full chunks, looks them up and retrieves exact bytes with a prefix mask', async () => {
    const c = await open()
    const toks = tokens(3 * T + 5) // trailing partial chunk is not stored
    const kv = kvFor(3)
    expect(await c.store(toks, kv)).toEqual({ chunks: 3, stored: 3, present: 0, skipped: 0 })
    expect((await c.store(toks, kv)).present).toBe(3)
    const lk = await c.lookup(toks)
    expect(lk.tokens).toBe(3 * T)
    expect(lk.chunks.map((x) => x.tier)).toEqual(['memory', 'memory', 'memory'])
    const into = new Uint8Array(3 * CB)
    const mask = await c.retrieve(toks, { into })
    expect(mask.length).toBe(toks.length)
    expect(Array.from(mask.subarray(0, 3 * T)).every((m) => m === 1)).toBe(true)
    expect(Array.from(mask.subarray(3 * T)).every((m) => m === 0)).toBe(true)
    expect(Buffer.compare(into, kv)).toBe(0)
    // A different continuation shares only the first chunk.
    const other = [...toks.slice(0, T), ...tokens(2 * T, 9)]
    expect((await c.lookup(other)).tokens).toBe(T)
    expect((await c.retrieve(other, { into })).reduce((a, b) => a + b, 0)).toBe(T)
    // Same tokens, other model geometry or seed: no hit (keys cover the namespace).
    const c2 = await open({ hashSeed: 'other' })
    expect((await c2.lookup(toks)).tokens).toBe(0)
  })

  it('chunks of 1 MiB and more: exact bytes from L2 (pool-verified) and L1 (pool-copied) into plain, offset and shared buffers', async () => {
    const BT = 2048 // 1.25 MiB chunk tensors: the copy into `into` runs on the addon's pool
    const BCB = chunkBytes(MODEL_PRESETS.stories260k, BT)
    expect(BCB).toBeGreaterThanOrEqual(1 << 20)
    const dir = tempDir()
    const cfg = { chunkTokens: BT, memory: { bytes: 8 * BCB }, disk: { dir, bytes: 1 << 26 } }
    const c = await open(cfg)
    const toks = tokens(3 * BT, 4)
    const big = new Uint8Array(3 * BCB)
    for (let i = 0; i < big.length; i++) big[i] = (i * 2654435761) >>> 27
    expect((await c.store(toks, big)).stored).toBe(3)
    await c.flush()
    await c.close()
    const c2 = await open(cfg)
    expect((await c2.lookup(toks)).chunks.map((x) => x.tier)).toEqual(['disk', 'disk', 'disk'])
    // Cold: L2 → L1 → a view at an odd offset of a larger buffer; the bytes around it untouched.
    const wide = new Uint8Array(3 * BCB + 11)
    expect((await c2.retrieve(toks, { into: wide.subarray(5, 5 + 3 * BCB) })).every((m) => m === 1)).toBe(
      true,
    )
    expect(Buffer.compare(wide.subarray(5, 5 + 3 * BCB), big)).toBe(0)
    expect(
      wide.subarray(0, 5).every((v) => v === 0) && wide.subarray(5 + 3 * BCB).every((v) => v === 0),
    ).toBe(true)
    expect(c2.stats().disk?.hits).toBe(3)
    // Warm (L1) into a SharedArrayBuffer view: copied on this thread, same bytes.
    const shared = new Uint8Array(new SharedArrayBuffer(3 * BCB))
    expect((await c2.retrieve(toks, { into: shared })).every((m) => m === 1)).toBe(true)
    expect(Buffer.compare(shared, big)).toBe(0)
  })

  it('waterfall: an L1 miss is served from L2 and promoted; a restart keeps L2', async () => {
    const dir = tempDir()
    const c = await open({ disk: { dir, bytes: 1 << 24 } })
    const toks = tokens(4 * T)
    const kv = kvFor(4, 3)
    await c.store(toks, kv)
    await c.flush()
    expect(c.stats().disk?.files).toBe(4)
    await c.close()
    const c2 = await open({ disk: { dir, bytes: 1 << 24 } })
    const lk = await c2.lookup(toks)
    expect(lk.chunks.map((x) => x.tier)).toEqual(['disk', 'disk', 'disk', 'disk'])
    const into = new Uint8Array(4 * CB)
    expect((await c2.retrieve(toks, { into })).every((m) => m === 1)).toBe(true)
    expect(Buffer.compare(into, kv)).toBe(0)
    expect((await c2.lookup(toks)).chunks.every((x) => x.tier === 'memory')).toBe(true)
    const s = c2.stats()
    expect(s.disk?.hits).toBe(4)
    expect(s.memory.residentChunks).toBe(4)
  })

  it('under memory pressure evicts L1 but still serves everything from L2', async () => {
    const dir = tempDir()
    const c = await open({ memory: { bytes: 2 * CB + 4096 }, disk: { dir, bytes: 1 << 24 } })
    const toks = tokens(6 * T, 5)
    const kv = kvFor(6, 5)
    // A store's own chunks stay pinned until it returns, so the ones that do not
    // fit are skipped by L1 (not blocked, and not evicting the leading ones) and
    // still reach L2 from a private copy.
    const r = await c.store(toks, kv)
    expect(r).toMatchObject({ stored: 2, skipped: 4 })
    await c.flush()
    expect(c.stats().memory.residentChunks).toBe(2)
    expect((await c.lookup(toks)).chunks.slice(0, 2).map((x) => x.tier)).toEqual(['memory', 'memory'])
    expect(c.stats().memory.skippedFull).toBe(r.skipped)
    expect(c.stats().disk?.files).toBe(6)
    const into = new Uint8Array(6 * CB)
    expect((await c.retrieve(toks, { into })).every((m) => m === 1)).toBe(true)
    expect(Buffer.compare(into, kv)).toBe(0)
  })

  it('a corrupt L2 file is never served: the chunk becomes a miss', async () => {
    const dir = tempDir()
    const c = await open({ disk: { dir, bytes: 1 << 24 } })
    const toks = tokens(2 * T, 7)
    await c.store(toks, kvFor(2, 7))
    await c.flush()
    await c.close()
    const c2 = await open({ disk: { dir, bytes: 1 << 24 } })
    const keys = c2.keys(toks)
    flipL2Byte(dir, keys[1]!.hex, (n) => n - 100, 1)
    const into = new Uint8Array(2 * CB)
    const mask = await c2.retrieve(toks, { into })
    expect(mask.reduce((a, x) => a + x, 0)).toBe(T)
    expect(Buffer.compare(into.subarray(0, CB), kvFor(2, 7).subarray(0, CB))).toBe(0)
    expect(c2.stats().disk?.corrupt).toBeGreaterThanOrEqual(1)
  })

  describe('cold L2 retrieve: the reading workers copy verified sections into `into`', () => {
    const BT = 32768 // ~20 MiB chunk tensors: each L2 object is two ranges (16 + 4 MiB) read as 2 MiB pieces, a few in flight
    const BCB = chunkBytes(MODEL_PRESETS.stories260k, BT)
    const big = (n: number, seed: number) => {
      const b = new Uint8Array(n * BCB)
      for (let i = 0; i < b.length; i += 997) b[i] = (i * seed) >>> 13
      return b
    }
    const stored = async (n: number, seed: number) => {
      const dir = tempDir()
      const cfg = {
        chunkTokens: BT,
        memory: { bytes: (n + 1) * BCB + (1 << 20) },
        disk: { dir, bytes: 1 << 30 },
      }
      const w = await open(cfg)
      const toks = tokens(n * BT, seed)
      await w.store(toks, big(n, seed))
      await w.flush()
      await w.close()
      return { dir, toks, c: await open(cfg) }
    }

    it("exact bytes through the workers' copy; a CRC mismatch mid-object is a counted miss that leaves nothing in L1", async () => {
      const { dir, toks, c } = await stored(3, 3)
      const keys = c.keys(toks)
      flipL2Byte(dir, keys[1]!.hex, (n) => Math.floor(n / 2) + 12345, 1) // inside a section of the second range
      const into = new Uint8Array(3 * BCB).fill(0xee)
      const mask = await c.retrieve(toks, { into })
      expect(sum(mask)).toBe(BT)
      expect(Buffer.compare(into.subarray(0, BCB), big(3, 3).subarray(0, BCB))).toBe(0)
      const s = c.stats()
      expect(s.disk?.corrupt).toBe(1)
      expect(s.disk?.sinkReads).toBeGreaterThanOrEqual(1)
      expect((await c.lookup(toks)).chunks.map((x) => x.tier)).toEqual(['memory'])
      // A SharedArrayBuffer `into` cannot take the workers' copy: the same bytes, copied here.
      const { toks: t2, c: c2 } = await stored(2, 5)
      const shared = new Uint8Array(new SharedArrayBuffer(2 * BCB))
      expect(sum(await c2.retrieve(t2, { into: shared }))).toBe(2 * BT)
      expect(Buffer.compare(shared, big(2, 5))).toBe(0)
      expect(c2.stats().disk?.sinkReads).toBe(0)
    })

    it('past the deadline nothing more lands in `into`, though the reads finish and promote', async () => {
      const { toks, c } = await stored(4, 7)
      const into = new Uint8Array(4 * BCB).fill(0xee)
      const mask = await c.retrieve(toks, { into, deadlineMs: 1 })
      expect(sum(mask)).toBeLessThan(4 * BT)
      const after = into.slice()
      // Wait for every read that was started to end (hit or miss), then look again.
      for (let i = 0; i < 500; i++) {
        const d = c.stats().disk!
        if (d.hits + d.misses >= 4) break
        await new Promise((r) => setTimeout(r, 10))
      }
      expect(c.stats().disk!.hits).toBe(4)
      expect(Buffer.compare(into, after)).toBe(0)
    })
  })

  it("layout 'sequence': a forward pass's whole-prompt tensor goes in and comes back", async () => {
    const c = await open()
    const g = MODEL_PRESETS.stories260k
    const row = g.kvHeads * g.headDim * 2
    const n = 2 * T + 5
    const toks = tokens(n, 17)
    const seq = new Uint8Array(2 * g.layers * n * row).map((_, i) => (i * 7 + (i >> 8)) & 255)
    await expect(c.store(toks, seq.subarray(1), { layout: 'sequence' })).rejects.toThrow(
      /sequence tensor of 37 tokens/,
    )
    await expect(c.store(toks, seq, { layout: 'rows' as never })).rejects.toThrow(/invalid layout/)
    expect((await c.store(toks, seq, { layout: 'sequence' })).stored).toBe(2)
    // Chunk layout, element by element: chunk ch, layer l, side k, token t is sequence row (2l+k)·n + ch·T + t.
    const chunks = new Uint8Array(2 * CB)
    expect(sum(await c.retrieve(toks, { into: chunks }))).toBe(2 * T)
    for (let ch = 0; ch < 2; ch++) {
      for (let l = 0; l < g.layers; l++) {
        for (let k = 0; k < 2; k++) {
          for (let t = 0; t < T; t++) {
            const from = ((2 * l + k) * n + ch * T + t) * row
            const to = ch * CB + ((2 * l + k) * T + t) * row
            expect(Buffer.compare(chunks.subarray(to, to + row), seq.subarray(from, from + row))).toBe(0)
          }
        }
      }
    }
    const back = new Uint8Array(seq.length)
    expect(sum(await c.retrieve(toks, { into: back, layout: 'sequence' }))).toBe(2 * T)
    for (let r = 0; r < 2 * g.layers; r++) {
      const a = r * n * row
      expect(Buffer.compare(back.subarray(a, a + 2 * T * row), seq.subarray(a, a + 2 * T * row))).toBe(0)
      expect(back.subarray(a + 2 * T * row, a + n * row).every((x) => x === 0)).toBe(true) // tail not served
    }
  })

  it('includePartial stores and serves the trailing partial chunk; without it the tail stays unserved', async () => {
    const dir = tempDir()
    const c = await open({ disk: { dir, bytes: 1 << 24 } })
    const g = MODEL_PRESETS.stories260k
    const n = 2 * T + 5
    const toks = tokens(n, 19)
    const tail = chunkBytes(g, 5)
    const kv = kvFor(3, 19).subarray(0, 2 * CB + tail)
    await expect(c.store(toks, kv)).rejects.toThrow(/not stored unless includePartial/)
    expect(await c.store(toks, kv, { includePartial: true })).toMatchObject({ chunks: 3, stored: 3 })
    expect((await c.lookup(toks)).tokens).toBe(2 * T)
    const lk = await c.lookup(toks, { includePartial: true })
    expect(lk.tokens).toBe(n)
    expect(lk.chunks).toHaveLength(3)
    const into = new Uint8Array(2 * CB + tail)
    expect(sum(await c.retrieve(toks, { into, includePartial: true }))).toBe(n)
    expect(Buffer.compare(into, kv)).toBe(0)
    // Another ending of the same prefix matches only the full chunks.
    const other = [...toks.slice(0, 2 * T), 7, 7, 7, 7, 7]
    expect((await c.lookup(other, { includePartial: true })).tokens).toBe(2 * T)
    // Through L2: a restarted cache serves the partial chunk from disk, into the sequence layout too.
    await c.flush()
    await c.close()
    const c2 = await open({ disk: { dir, bytes: 1 << 24 } })
    const row = g.kvHeads * g.headDim * 2
    const seq = new Uint8Array(2 * g.layers * n * row)
    expect(sum(await c2.retrieve(toks, { into: seq, layout: 'sequence', includePartial: true }))).toBe(n)
    const chunks = new Uint8Array(2 * CB + tail)
    await c2.retrieve(toks, { into: chunks, includePartial: true })
    expect(Buffer.compare(chunks, kv)).toBe(0)
    const layers: number[] = []
    for await (const b of c2.retrieveLayers(toks, { includePartial: true })) {
      expect(b.chunks).toBe(3)
      expect(b.slabs[2]!.byteLength).toBe(layerSlabBytes(g, 5))
      layers.push(b.layer)
    }
    expect(layers).toHaveLength(g.layers)
  })

  it('retrieveLayers reads L2 chunks ahead (several in flight); past a corrupt one it serves the prefix and releases what it read ahead', async () => {
    const dir = tempDir()
    const c = await open({ disk: { dir, bytes: 1 << 24 } })
    const toks = tokens(4 * T, 9)
    const kv = kvFor(4, 9)
    await c.store(toks, kv)
    await c.flush()
    await c.close()
    const c2 = await open({ disk: { dir, bytes: 1 << 24 } })
    const keys = c2.keys(toks)
    flipL2Byte(dir, keys[1]!.hex, (n) => n - 7, 2)
    const g = MODEL_PRESETS.stories260k
    const slab = layerSlabBytes(g, T)
    let layers = 0
    for await (const batch of c2.retrieveLayers(toks)) {
      expect(batch.chunks).toBe(1)
      expect(Buffer.compare(batch.slabs[0]!, kv.subarray(batch.layer * slab, (batch.layer + 1) * slab))).toBe(
        0,
      )
      layers++
    }
    expect(layers).toBe(g.layers)
    // Chunks 2 and 3 were read while chunk 1 was: once those reads land, nothing stays pinned.
    for (let i = 0; i < 500 && c2.stats().disk!.hits + c2.stats().disk!.corrupt < 4; i++)
      await new Promise((r) => setTimeout(r, 5))
    expect(c2.stats().disk).toMatchObject({ hits: 3, corrupt: 1 })
    expect(c2.stats().memory.livePins).toBe(0)
  })

  it('retrieveLayers and prefetch: an L2 read stuck past retrieveDeadlineMs is a miss (the prefix before it is served), and what it holds is released when it lands', async () => {
    const dir = tempDir()
    const c = await open({ disk: { dir, bytes: 1 << 24 } })
    const toks = tokens(3 * T, 31)
    const kv = kvFor(3, 31)
    await c.store(toks, kv)
    await c.flush()
    await c.close()
    const c2 = await open({ disk: { dir, bytes: 1 << 24 }, retrieveDeadlineMs: 200 })
    const stuck = c2.keys(toks)[1]!.hex
    // A disk that never answers for chunk 1 (a hung device, a dead network filesystem).
    const stuckReads: (() => void)[] = []
    const get = DiskTier.prototype.get
    const spy = vi.spyOn(DiskTier.prototype, 'get').mockImplementation(function (
      this: DiskTier,
      hex,
      ...rest
    ) {
      if (hex !== stuck) return get.call(this, hex, ...rest)
      return new Promise<Uint8Array | undefined>((r) => stuckReads.push(() => r(undefined)))
    })
    try {
      const t0 = Date.now()
      const served = await Promise.race([
        (async () => {
          let chunks = -1
          for await (const b of c2.retrieveLayers(toks)) chunks = b.chunks
          return chunks
        })(),
        new Promise<'hung'>((r) => setTimeout(() => r('hung'), 3000)),
      ])
      expect(served).toBe(1)
      expect(Date.now() - t0).toBeLessThan(2500)
      // prefetch() too: it resolves with the resident prefix instead of waiting on the stuck read.
      const c3 = await open({ disk: { dir, bytes: 1 << 24 }, retrieveDeadlineMs: 200 })
      const fetched = await Promise.race([
        c3.prefetch(toks),
        new Promise<'hung'>((r) => setTimeout(() => r('hung'), 3000)),
      ])
      expect(fetched).toEqual({ tokens: T })
    } finally {
      for (const unstick of stuckReads) unstick()
      spy.mockRestore()
    }
    for (const c of [c2, ...caches.slice(-1)])
      for (let i = 0; i < 200 && c.stats().memory.liveReservations + c.stats().memory.livePins > 0; i++)
        await new Promise((r) => setTimeout(r, 5))
  })

  it("retrieveLayers: an item's slabs stay valid until the generator finishes, not only until the next item (L1 churned, L2 chunks, L1 full)", async () => {
    // The agent's threaded load copies a group of layers while it asks for the next ones:
    // it relies on every slab handed out staying intact until the generator's finally.
    const dir = tempDir()
    const g = MODEL_PRESETS.stories260k
    const slab = layerSlabBytes(g, T)
    const c = await open({ disk: { dir, bytes: 1 << 24 } })
    const toks = tokens(3 * T, 21)
    const kv = kvFor(3, 21)
    await c.store(toks, kv)
    await c.flush()
    await c.close()
    // Three slots: chunk 0 in L1, chunks 1 and 2 read from L2 (one into L1, one private: L1 full).
    const c2 = await open({ disk: { dir, bytes: 1 << 24 }, memory: { bytes: 3 * (CB + 8192) } })
    await c2.retrieve(toks.slice(0, T), { into: new Uint8Array(CB) })
    const kept: { layer: number; slabs: Uint8Array[] }[] = []
    let other = 100
    for await (const b of c2.retrieveLayers(toks)) {
      expect(b.chunks).toBe(3)
      kept.push({ layer: b.layer, slabs: b.slabs })
      // Between items: stores that want L1 slots (evicting whatever is not pinned).
      await c2.store(tokens(T, other), kvFor(1, other++))
      // Every slab of every earlier item still holds its chunk's bytes.
      for (const k of kept)
        for (let i = 0; i < 3; i++) {
          const want = kv.subarray(i * CB + k.layer * slab, i * CB + (k.layer + 1) * slab)
          expect(Buffer.compare(k.slabs[i]!, want)).toBe(0)
        }
    }
    expect(kept).toHaveLength(g.layers)
    expect(c2.stats().memory.skippedFull).toBeGreaterThan(0)
  })

  it('retrieveLayers yields every layer of every chunk in order', async () => {
    const c = await open()
    const toks = tokens(2 * T, 11)
    const kv = kvFor(2, 11)
    await c.store(toks, kv)
    const slab = layerSlabBytes(MODEL_PRESETS.stories260k, T)
    const seen: number[] = []
    for await (const b of c.retrieveLayers(toks)) {
      seen.push(b.layer)
      expect(b.chunks).toBe(2)
      for (let i = 0; i < 2; i++) {
        const want = kv.subarray(i * CB + b.layer * slab, i * CB + (b.layer + 1) * slab)
        expect(Buffer.compare(b.slabs[i]!, want)).toBe(0)
      }
    }
    expect(seen).toEqual([0, 1, 2, 3, 4])
  })

  it('prefetch moves L2 chunks into L1; stats and Prometheus text report per tier', async () => {
    const dir = tempDir()
    const c = await open({ disk: { dir, bytes: 1 << 24 } })
    const toks = tokens(3 * T, 13)
    await c.store(toks, kvFor(3, 13))
    await c.flush()
    await c.close()
    const c2 = await open({ disk: { dir, bytes: 1 << 24 } })
    expect((await c2.prefetch(toks)).tokens).toBe(3 * T)
    expect((await c2.lookup(toks)).chunks.every((x) => x.tier === 'memory')).toBe(true)
    const text = c2.metrics()
    expect(text).toMatch(/kvgate_client_hits_total\{tier="disk"\} 3/)
    expect(text).toMatch(/# TYPE kvgate_client_breaker_open gauge/)
  })

  it('throws ERR_CLOSED after close', async () => {
    const c = await open()
    await c.close()
    await expect(c.lookup(tokens(T))).rejects.toMatchObject({ code: 'ERR_CLOSED' })
  })
})
