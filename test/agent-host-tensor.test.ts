// The agent's host shared-memory tensors: mapped and pread/pwrite copies give the same
// bytes, bad runs and shrunk files are errors (never partial copies or a SIGBUS), and a
// registration's mappings are released when its connection ends or the agent closes.

import { randomBytes } from 'node:crypto'
import {
  closeSync,
  ftruncateSync,
  mkdtempSync,
  openSync,
  readFileSync,
  readSync,
  rmSync,
  statSync,
  truncateSync,
  writeFileSync,
} from 'node:fs'
import { connect, type Socket } from 'node:net'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, describe, expect, it } from 'vitest'
import { type Agent, newSession, type Session } from '../src/agent/agent.ts'
import { HostCopier, HostTensor } from '../src/agent/host-tensor.ts'
import { resolveAgentConfig, startAgent } from '../src/agent/index.ts'
import { decodeBody, encodeFrame, FrameReader } from '../src/agent/protocol.ts'
import { fileMapStats, nativeMemoryStats } from '../src/client/native.ts'
import { loadNative } from '../src/client/native-api.ts'
import {
  LLAMA_BLOCK_BYTES,
  LLAMA_BLOCKS,
  LLAMA_GEOMETRY,
  LLAMA_LAYER_BYTES,
  LLAMA_LAYERS,
} from './support/llama-blocks.ts'

const dir = mkdtempSync(join(tmpdir(), 'kvgate-host-tensor-'))
afterAll(() => rmSync(dir, { recursive: true, force: true }))
const native = loadNative().api

function shm(name: string, bytes: Uint8Array): string {
  const p = join(dir, name)
  writeFileSync(p, bytes)
  return p
}

it('the addon is loaded (else the mapped path is not tested)', () => {
  expect(native?.mapFileAvailable(), loadNative().reason).toBe(true)
})

describe('HostTensor', () => {
  const OFF = 100 // an unaligned tensor offset inside the file
  const BYTES = 64 * 1024
  // Scattered runs, two of them adjacent on both sides (merged into one copy).
  const runs = [8192, 0, 4096, 12288, 4096, 4096, 0, 8192, 1000, 60000, 9192, 536]

  // The addon's one-call copy as 3-D row sets and as runs (an addon that predates copyRows),
  // the mapping with one Buffer#copy per run (an addon that predates copyRuns), and
  // pread/pwrite (no addon).
  const modes = [
    { name: 'mapped, copyPlanes', mapped: true, api: native },
    { name: 'mapped, copyRuns', mapped: true, api: native && { ...native, copyRowsAvailable: () => false } },
    {
      name: 'mapped, Buffer#copy',
      mapped: true,
      api: native && { ...native, copyRunsAvailable: () => false, copyRowsAvailable: () => false },
    },
    { name: 'pread/pwrite', mapped: false, api: undefined },
  ]
  for (const { name, mapped, api } of modes) {
    it(`${name}: gather and scatter move exactly the runs`, () => {
      const data = randomBytes(OFF + BYTES + 50)
      const p = shm(`t-${name.replace(/\W/g, '-')}`, data)
      const t = new HostTensor(p, OFF, BYTES, api)
      expect(t.mapped).toBe(mapped)
      const host = new Uint8Array(9728)
      t.gather(runs, host)
      for (let i = 0; i < runs.length; i += 3) {
        const [at, h, n] = [runs[i]!, runs[i + 1]!, runs[i + 2]!]
        expect(Buffer.from(host.subarray(h, h + n)).equals(data.subarray(OFF + at, OFF + at + n))).toBe(true)
      }
      const fresh = Uint8Array.from(host, (x) => x ^ 0x5a)
      t.scatter(fresh, runs)
      const back = readFileSync(p)
      const want = Buffer.from(data)
      for (let i = 0; i < runs.length; i += 3) {
        const [at, h, n] = [runs[i]!, runs[i + 1]!, runs[i + 2]!]
        want.set(fresh.subarray(h, h + n), OFF + at)
      }
      expect(back.equals(want)).toBe(true) // written runs changed, nothing else did
      t.close()
      expect(() => t.gather(runs, host)).toThrow(expect.objectContaining({ code: 'ERR_CLOSED' }))
      t.close() // idempotent
    })
  }

  // A vLLM NHD view's runs: 256 B per token and head, K and V halves of 512 B, blocks apart.
  const strided: number[] = []
  for (const side of [0, 1])
    for (const [j, block] of [5, 2, 3].entries())
      for (let r = 0; r < 16; r++)
        strided.push(block * 8192 + r * 512 + side * 256, (side * 3 + j) * 4096 + r * 256, 256)
  for (const { name, mapped, api } of modes) {
    it(`${name}: a strided view's runs (one 2-D row set per block side) move exactly`, () => {
      const data = randomBytes(OFF + BYTES)
      const p = shm(`strided-${name.replace(/\W/g, '-')}`, data)
      const t = new HostTensor(p, OFF, BYTES, api)
      expect(t.mapped).toBe(mapped)
      const host = new Uint8Array(6 * 4096 + 64).fill(0xab)
      t.gather(strided, host)
      const want = new Uint8Array(host.length).fill(0xab)
      for (let i = 0; i < strided.length; i += 3)
        want.set(data.subarray(OFF + strided[i]!, OFF + strided[i]! + 256), strided[i + 1]!)
      expect(Buffer.from(host).equals(want)).toBe(true)
      const fresh = randomBytes(host.length)
      t.scatter(fresh, Object.freeze(strided.slice()))
      const back = Buffer.from(data)
      for (let i = 0; i < strided.length; i += 3)
        back.set(fresh.subarray(strided[i + 1]!, strided[i + 1]! + 256), OFF + strided[i]!)
      expect(readFileSync(p).equals(back)).toBe(true) // those rows changed, nothing between them
      t.close()
    })
  }

  for (const { name, api } of modes.filter((m) => m.name !== 'mapped, Buffer#copy')) {
    it(`${name}: runs outside the tensor or the buffer are errors, not clamped copies or the neighbour's bytes`, () => {
      // The file holds more than the tensor (the next layer's bytes, here 0xee) after it.
      const file = new Uint8Array(BYTES + 4096).fill(0xee, BYTES)
      const p = shm(`bad-runs-${name.replace(/\W/g, '-')}`, file)
      const t = new HostTensor(p, 0, BYTES, api)
      const host = new Uint8Array(4096)
      expect(() => t.gather([BYTES - 10, 0, 20], host)).toThrow(
        expect.objectContaining({ code: 'ERR_INVALID_ARGUMENT' }),
      )
      expect(host.every((x) => x === 0)).toBe(true)
      expect(() => t.scatter(host, [0, 4000, 200])).toThrow(
        expect.objectContaining({ code: 'ERR_INVALID_ARGUMENT' }),
      )
      expect(() => t.scatter(host, [BYTES - 10, 0, 20])).toThrow(
        expect.objectContaining({ code: 'ERR_INVALID_ARGUMENT' }),
      )
      expect(Buffer.from(readFileSync(p)).equals(Buffer.from(file))).toBe(true)
      t.close()
    })
  }

  it('mapped: a file truncated under the mapping is ERR_IO, not a SIGBUS', () => {
    const p = shm('shrinks', new Uint8Array(BYTES))
    const t = new HostTensor(p, 0, BYTES, native)
    truncateSync(p, 4096)
    expect(() => t.gather([8192, 0, 4096], new Uint8Array(4096))).toThrow(
      expect.objectContaining({ code: 'ERR_IO' }),
    )
    t.close()
  })

  it('a tensor larger than one mapping (4 GiB) is copied with pread/pwrite, not refused', () => {
    // A sparse file: a layer of 70 000 blocks of 32 KiB (K and V) is 4.27 GiB.
    const bytes = 2 * 70_000 * 32 * 1024
    expect(bytes).toBeGreaterThan(native!.MAX_PINNED_BYTES)
    const p = join(dir, 'over-4g')
    const fd = openSync(p, 'w')
    try {
      ftruncateSync(fd, OFF + bytes)
    } finally {
      closeSync(fd)
    }
    const t = new HostTensor(p, OFF, bytes, native)
    try {
      expect(t.mapped).toBe(false)
      expect(HostCopier.for([t], native, 2)).toBeUndefined()
      // A run past 4 GiB, written and read back through the tensor and through the file.
      const at = bytes - 32 * 1024
      const data = randomBytes(32 * 1024)
      t.scatter(data, [at, 0, data.length])
      const back = new Uint8Array(data.length)
      t.gather([at, 0, data.length], back)
      expect(Buffer.from(back).equals(data)).toBe(true)
      const raw = Buffer.alloc(data.length)
      const rfd = openSync(p, 'r')
      try {
        readSync(rfd, raw, 0, raw.length, OFF + at)
      } finally {
        closeSync(rfd)
      }
      expect(raw.equals(data)).toBe(true)
    } finally {
      t.close()
      rmSync(p)
    }
  })

  it('pread/pwrite: a file the engine shrank is ERR_IO before any copy; a write does not grow it back', () => {
    const p = shm('shrinks-unmapped', new Uint8Array(BYTES))
    const t = new HostTensor(p, 0, BYTES, undefined)
    truncateSync(p, 4096)
    expect(() => t.scatter(new Uint8Array(4096).fill(7), [8192, 0, 4096])).toThrow(
      expect.objectContaining({ code: 'ERR_IO' }),
    )
    expect(statSync(p).size).toBe(4096)
    expect(() => t.gather([0, 0, 4096], new Uint8Array(4096))).toThrow(
      expect.objectContaining({ code: 'ERR_IO' }),
    )
    t.close()
  })

  it('close releases the mapping; a failed open holds nothing', () => {
    const start = fileMapStats().mappings
    const t = new HostTensor(shm('release', new Uint8Array(BYTES)), 0, BYTES, native)
    expect(fileMapStats().mappings).toBe(start + 1)
    t.close()
    expect(fileMapStats().mappings).toBe(start)
    expect(() => new HostTensor(join(dir, 'absent'), 0, BYTES, native)).toThrow(
      expect.objectContaining({ code: 'ERR_IO' }),
    )
    expect(fileMapStats().mappings).toBe(start)
  })
})

describe('HostCopier (threaded copies of every layer at once)', () => {
  const LAYER = 256 * 1024
  const runs = [8192, 0, 4096, 12288, 4096, 4096, 0, 8192, 1000, 200_000, 9192, 50_000]
  const SLAB = 59_192

  // The addon's 3-D row sets and its runs (an addon that predates copyRowsAsync).
  const forms = [
    { form: 'copyPlanesAsync', api: native },
    { form: 'copyRunsAsync', api: native && { ...native, copyRowsAvailable: () => false } },
  ]
  // Runs of the first kind, and a strided view's (256 B rows 512 B apart, K then V).
  const stridedRuns: number[] = []
  for (const side of [0, 1])
    for (const [j, block] of [6, 1].entries())
      for (let r = 0; r < 64; r++)
        stridedRuns.push(block * 32768 + r * 512 + side * 256, (side * 2 + j) * 16384 + r * 256, 256)
  const runSets = [
    { kind: 'scattered', runs, slab: SLAB },
    { kind: 'strided', runs: Object.freeze(stridedRuns), slab: 4 * 16384 },
  ]
  for (const threads of [1, 3])
    for (const { form, api } of forms)
      for (const { kind, runs, slab: SLAB } of runSets)
        it(`${threads} thread(s), ${form}, ${kind} runs: gatherChunk and scatterLayers move what gather and scatter move`, async () => {
          const data = randomBytes(3 * LAYER)
          const p = shm(`copier-${threads}-${form}-${kind}`, data)
          const layers = [0, 1, 2].map((l) => new HostTensor(p, l * LAYER, LAYER, api))
          const copier = HostCopier.for(layers, api, threads)!
          expect(copier.threads).toBe(threads)
          const chunk = new Uint8Array(3 * SLAB + 10)
          await copier.gatherChunk(runs, chunk, SLAB)
          for (let l = 0; l < 3; l++) {
            const want = new Uint8Array(SLAB)
            layers[l]!.gather(runs, want)
            expect(Buffer.from(chunk.subarray(l * SLAB, (l + 1) * SLAB)).equals(want)).toBe(true)
          }
          expect(chunk.subarray(3 * SLAB).every((x) => x === 0)).toBe(true)
          const fresh = randomBytes(SLAB)
          await copier.scatterLayers([{ layer: 1, chunks: 1, slabs: [fresh] }], [runs])
          const back = readFileSync(p)
          const want = Buffer.from(data)
          for (let i = 0; i < runs.length; i += 3)
            want.set(fresh.subarray(runs[i + 1]!, runs[i + 1]! + runs[i + 2]!), LAYER + runs[i]!)
          expect(back.equals(want)).toBe(true) // layer 1's runs changed, nothing else did
          for (const t of layers) t.close()
        })

  it('scatterLayers: several layers and chunks in one call, each chunk through its own runs, only the first `chunks` of a layer', async () => {
    const data = randomBytes(3 * LAYER)
    const p = shm('copier-group', data)
    const layers = [0, 1, 2].map((l) => new HostTensor(p, l * LAYER, LAYER, native))
    const copier = HostCopier.for(layers, native, 2)!
    const runsByChunk = [
      [0, 0, 4096, 40_000, 4096, 8192],
      [100_000, 0, 12_288],
    ]
    const slab = (x: number) => new Uint8Array(12_288).fill(x)
    await copier.scatterLayers(
      [
        { layer: 0, chunks: 2, slabs: [slab(1), slab(2)] },
        { layer: 2, chunks: 1, slabs: [slab(3), slab(4)] }, // chunk 1 dropped at this layer
      ],
      runsByChunk,
    )
    const want = Buffer.from(data)
    want.fill(1, 0, 4096)
    want.fill(1, 40_000, 48_192)
    want.fill(2, 100_000, 112_288)
    want.fill(3, 2 * LAYER, 2 * LAYER + 4096)
    want.fill(3, 2 * LAYER + 40_000, 2 * LAYER + 48_192)
    expect(readFileSync(p).equals(want)).toBe(true)
    for (const t of layers) t.close()
  })

  it('scatterLayers: a layer of 65 536 chunks (the most a load names) is copied, though one native call takes at most 65 536 buffers', async () => {
    const CHUNKS = 65_536
    const data = randomBytes(CHUNKS)
    const p = shm('copier-many', data)
    const layers = [new HostTensor(p, 0, CHUNKS, native)]
    const copier = HostCopier.for(layers, native, 2)!
    // Chunk c's one-byte slab lands at tensor byte c: the layer's mapping and 65 536 slabs.
    const slabs = Array.from({ length: CHUNKS }, (_, c) => new Uint8Array([(c * 7 + 1) & 0xff]))
    const runsByChunk = Array.from({ length: CHUNKS }, (_, c) => [c, 0, 1])
    await copier.scatterLayers([{ layer: 0, chunks: CHUNKS, slabs }], runsByChunk)
    const back = readFileSync(p)
    expect(back.every((x, c) => x === ((c * 7 + 1) & 0xff))).toBe(true)
    // A later call that cannot start: the answer waits for the call already running.
    let first: Promise<void> | undefined
    let firstDone = false
    const once =
      (copy: NonNullable<typeof native>['copyRunsAsync']) =>
      (...[b, r, t]: Parameters<NonNullable<typeof native>['copyRunsAsync']>) => {
        if (first) throw new Error('cannot start')
        first = copy(b, r, t).then(() => {
          firstDone = true
        })
        return first
      }
    const failing = HostCopier.for(
      layers,
      native && {
        ...native,
        copyRunsAsync: once(native.copyRunsAsync),
        copyPlanesAsync: once(native.copyPlanesAsync),
      },
      2,
    )!
    await expect(
      failing.scatterLayers([{ layer: 0, chunks: CHUNKS, slabs }], runsByChunk).catch((e) => {
        expect(firstDone).toBe(true)
        throw e
      }),
    ).rejects.toThrow('cannot start')
    layers[0]!.close()
  })

  it('bad runs, a short chunk tensor and a shrunk file are errors before any byte moves', async () => {
    const p = shm('copier-bad', new Uint8Array(2 * LAYER))
    const layers = [0, 1].map((l) => new HostTensor(p, l * LAYER, LAYER, native))
    const copier = HostCopier.for(layers, native, 2)!
    const chunk = new Uint8Array(2 * 8192)
    const code = (code: string) => expect.objectContaining({ code })
    expect(() => copier.gatherChunk([LAYER - 10, 0, 20], chunk, 8192)).toThrow(code('ERR_INVALID_ARGUMENT'))
    expect(() => copier.gatherChunk([0, 8000, 400], chunk, 8192)).toThrow(code('ERR_INVALID_ARGUMENT'))
    expect(() => copier.gatherChunk([0, 0, 4096], chunk.subarray(0, 8192), 8192)).toThrow(
      code('ERR_INVALID_ARGUMENT'),
    )
    const one = (runs: number[]) => copier.scatterLayers([{ layer: 1, chunks: 1, slabs: [chunk] }], [runs])
    expect(() => one([LAYER, 0, 1])).toThrow(code('ERR_INVALID_ARGUMENT'))
    truncateSync(p, LAYER + 4096)
    expect(() => one([0, 0, 4096])).toThrow(code('ERR_IO'))
    expect(chunk.every((x) => x === 0)).toBe(true)
    for (const t of layers) t.close()
    expect(() => copier.gatherChunk([0, 0, 16], chunk, 8192)).toThrow(code('ERR_CLOSED'))
  })

  it('sizes are checked once per file, against the furthest tensor in it: a file shrunk only under its last layer, or a second file shrunk, fails every copy that names them before any byte moves', async () => {
    // Layers 0 and 1 in file A, layer 2 in file B.
    const a = shm('copier-files-a', randomBytes(2 * LAYER))
    const b = shm('copier-files-b', randomBytes(LAYER))
    const layers = [
      new HostTensor(a, 0, LAYER, native),
      new HostTensor(a, LAYER, LAYER, native),
      new HostTensor(b, 0, LAYER, native),
    ]
    const copier = HostCopier.for(layers, native, 2)!
    const chunk = new Uint8Array(3 * SLAB)
    const code = (code: string) => expect.objectContaining({ code })
    const slab = () => ({ chunks: 1, slabs: [randomBytes(SLAB)] })
    await copier.gatherChunk(runs, chunk, SLAB)
    // A still holds layer 0, not layer 1: the one check of A is against layer 1's end.
    truncateSync(a, LAYER + 4096)
    chunk.fill(0)
    expect(() => copier.gatherChunk(runs, chunk, SLAB)).toThrow(code('ERR_IO'))
    expect(() => copier.scatterLayers([{ layer: 0, ...slab() }], [runs])).toThrow(code('ERR_IO'))
    expect(chunk.every((x) => x === 0)).toBe(true)
    // B is whole: a copy of its layer alone goes on.
    await copier.scatterLayers([{ layer: 2, ...slab() }], [runs])
    writeFileSync(a, randomBytes(2 * LAYER))
    const aWhole = readFileSync(a)
    truncateSync(b, LAYER - 1)
    expect(() => copier.gatherChunk(runs, chunk, SLAB)).toThrow(code('ERR_IO'))
    expect(() =>
      copier.scatterLayers(
        [
          { layer: 0, ...slab() },
          { layer: 2, ...slab() },
        ],
        [runs],
      ),
    ).toThrow(code('ERR_IO'))
    expect(readFileSync(a).equals(aWhole)).toBe(true) // nothing landed in A either
    await copier.scatterLayers([{ layer: 1, ...slab() }], [runs]) // A alone is whole again
    expect(readFileSync(a).equals(aWhole)).toBe(false)
    for (const t of layers) t.close()
    expect(() => copier.scatterLayers([{ layer: 1, ...slab() }], [runs])).toThrow(code('ERR_CLOSED'))
  })

  it('a file the engine shrinks while the threaded copy runs: ERR_IO for that save or load, the agent lives on', async () => {
    const p = shm('copier-shrinks-during', new Uint8Array(2 * LAYER).fill(5))
    const layers = [0, 1].map((l) => new HostTensor(p, l * LAYER, LAYER, native))
    // The size checks pass; the engine truncates between them and the pool threads' copy.
    const shrinking = {
      ...native!,
      copyRunsAsync: (...a: Parameters<NonNullable<typeof native>['copyRunsAsync']>) => {
        truncateSync(p, 4096)
        return native!.copyRunsAsync(...a)
      },
      copyPlanesAsync: (...a: Parameters<NonNullable<typeof native>['copyPlanesAsync']>) => {
        truncateSync(p, 4096)
        return native!.copyPlanesAsync(...a)
      },
    }
    const copier = HostCopier.for(layers, shrinking, 2)!
    const chunk = new Uint8Array(2 * SLAB)
    const code = (code: string) =>
      expect.objectContaining({ code, message: expect.stringMatching(/shrank during a copy/) })
    await expect(copier.gatherChunk(runs, chunk, SLAB)).rejects.toThrow(code('ERR_IO'))
    writeFileSync(p, new Uint8Array(2 * LAYER).fill(5))
    await expect(
      copier.scatterLayers([{ layer: 1, chunks: 1, slabs: [randomBytes(SLAB)] }], [runs]),
    ).rejects.toThrow(code('ERR_IO'))
    for (const t of layers) t.close()
  })

  it('is only made for mapped host tensors with an addon that has copyRunsAsync', () => {
    const p = shm('copier-none', new Uint8Array(LAYER))
    const mapped = new HostTensor(p, 0, LAYER, native)
    const unmapped = new HostTensor(p, 0, LAYER, undefined)
    expect(HostCopier.for([mapped], native, 2)).toBeDefined()
    expect(HostCopier.for([mapped, unmapped], native, 2)).toBeUndefined()
    expect(
      HostCopier.for([mapped], native && { ...native, copyRunsAsyncAvailable: () => false }, 2),
    ).toBeUndefined()
    mapped.close()
    unmapped.close()
  })
})

type Msg = Record<string, unknown>

function client(path: string): Promise<{ call(op: string, f?: Msg): Promise<Msg>; sock: Socket }> {
  return new Promise((resolve, reject) => {
    const sock = connect(path)
    const reader = new FrameReader()
    const waiting = new Map<unknown, (m: Msg) => void>()
    let next = 1
    sock.on('data', (d) => {
      for (const b of reader.push(d)) {
        const m = decodeBody(b) as Msg
        if (!m.event) waiting.get(m.id)?.(m)
      }
    })
    sock.once('error', reject)
    sock.once('connect', () =>
      resolve({
        sock,
        call: (op, f = {}) =>
          new Promise((r) => {
            const id = next++
            waiting.set(id, r)
            sock.write(encodeFrame({ id, op, ...f }))
          }),
      }),
    )
  })
}

describe('agent: registration lifetimes', () => {
  it('mappings are released when the connection ends, and by the agent close', async () => {
    const cfg = resolveAgentConfig(
      { socket: join(dir, 'l.sock'), chunkTokens: 32, maxFrameBytes: 1 << 20, metricsPort: 0 },
      { KVGATE_MEMORY_BYTES: '16MiB' },
    )
    cfg.cache = { ...cfg.cache, native: false, remote: false, disk: false, codecWorkers: 0 }
    const server = await startAgent(cfg, 'test')
    const start = fileMapStats().mappings
    const layer = 2 * 8 * 16 * 2 * 8 * 2
    const path = shm('engine', new Uint8Array(3 * layer))
    const register = async () => {
      const c = await client(join(dir, 'l.sock'))
      const hello = { protocol: 1, model: 'm', hashSeed: '0' }
      const geometry = {
        layout: 'flash-attn',
        dtype: 'float16',
        layers: 3,
        kvHeads: 2,
        headSize: 8,
        blockSize: 16,
      }
      expect(await c.call('hello', { ...hello, geometry })).toMatchObject({ ok: true })
      const tensors = [0, 1, 2].map((l) => ({
        kind: 'shm',
        path,
        offset: l * layer,
        shape: [2, 8, 16, 2, 8],
      }))
      expect(await c.call('register', { rank: 0, numBlocks: 8, tensors })).toMatchObject({ ok: true })
      // A re-registration maps its own tensors; both are held until the connection ends.
      expect(await c.call('register', { rank: 0, numBlocks: 8, tensors })).toMatchObject({ ok: true })
      return c
    }
    try {
      const a = await register()
      expect(fileMapStats().mappings).toBe(start + 6)
      a.sock.destroy()
      for (let i = 0; i < 200 && fileMapStats().mappings !== start; i++)
        await new Promise((r) => setTimeout(r, 5))
      expect(fileMapStats().mappings).toBe(start)
      await register() // left open: the agent's close must release it
      expect(fileMapStats().mappings).toBe(start + 6)
    } finally {
      await server.close()
    }
    expect(fileMapStats().mappings).toBe(start)
  })

  // Llama-like blocks (32 KiB) so a save's copy is still running when the connection or the agent goes.
  const LAYERS = LLAMA_LAYERS
  const big = LLAMA_GEOMETRY
  const BLOCK = LLAMA_BLOCK_BYTES
  const BLOCKS = LLAMA_BLOCKS
  const LAYER_BYTES = LLAMA_LAYER_BYTES

  async function bigAgent(name: string, native: boolean, copyThreads = 2) {
    const cfg = resolveAgentConfig(
      { socket: join(dir, `${name}.sock`), chunkTokens: 256, maxFrameBytes: 1 << 20 },
      { KVGATE_MEMORY_BYTES: '64MiB' },
    )
    cfg.cache = { ...cfg.cache, native, remote: false, disk: false, codecWorkers: 0 }
    cfg.copyThreads = copyThreads
    const server = await startAgent(cfg, 'test')
    const path = shm(`${name}-kv`, randomBytes(LAYERS * LAYER_BYTES))
    const open = async () => {
      const c = await client(join(dir, `${name}.sock`))
      expect(await c.call('hello', { protocol: 1, model: 'm', hashSeed: '0', geometry: big })).toMatchObject({
        ok: true,
      })
      const tensors = Array.from({ length: LAYERS }, (_, l) => ({
        kind: 'shm',
        path,
        offset: l * LAYER_BYTES,
        shape: [2, BLOCKS, 16, 8, 128],
      }))
      const r = await c.call('register', { rank: 0, numBlocks: BLOCKS, tensors })
      expect(r).toMatchObject({ ok: true })
      return { c, worker: r.worker as number }
    }
    return { server, path, open }
  }

  /**
   * A session driven directly (no socket, so nothing ends it but the test): hello, then the
   * tensors of `path` registered. `s` may come with hooks set (peerClosed).
   */
  async function directSession(agent: Agent, path: string, s: Session = newSession(() => {})) {
    expect(
      agent.answer(s, { id: 1, op: 'hello', protocol: 1, model: 'm', hashSeed: '0', geometry: big }),
    ).toMatchObject({ protocol: 1 })
    const tensors = Array.from({ length: LAYERS }, (_, l) => ({
      kind: 'shm',
      path,
      offset: l * LAYER_BYTES,
      shape: [2, BLOCKS, 16, 8, 128],
    }))
    const r = await agent.answer(s, { id: 2, op: 'register', rank: 0, numBlocks: BLOCKS, tensors })
    return { s, worker: r.worker as number }
  }

  it('an agent closed during a save releases the mappings and the pinned L1 only after the copy (no fault, no leak)', async () => {
    const maps = fileMapStats().mappings
    const pinned = nativeMemoryStats().pinnedBytes
    const { server, open } = await bigAgent('close-mid-save', true)
    const { c, worker } = await open()
    const keys = [0, 1, 2].map(() => randomBytes(32))
    const blockIds = Array.from({ length: 48 }, (_, i) => (i * 7) % BLOCKS)
    void c.call('save', { worker, keys, blockIds })
    await new Promise((r) => setImmediate(r)) // the save is in the agent, its copy queued
    await server.close() // must wait for the copy before unmapping and freeing L1
    expect(fileMapStats().mappings).toBe(maps)
    expect(nativeMemoryStats().pinnedBytes).toBe(pinned)
  })

  it('a connection ending and then the agent closing during loads: every mapping and the pinned L1 are released after the copies', async () => {
    const maps = fileMapStats().mappings
    const pinned = nativeMemoryStats().pinnedBytes
    const { server, open } = await bigAgent('end-mid-load', true)
    const a = await open()
    const keys = Buffer.concat([0, 1].map(() => randomBytes(32)))
    const blockIds = Array.from({ length: 32 }, (_, i) => i)
    expect(await a.c.call('save', { worker: a.worker, keys, blockIds })).toMatchObject({
      ok: true,
      stored: 2,
    })
    const b = await open()
    void b.c.call('load', { worker: b.worker, keys, blockIds: blockIds.map((i) => i + 16) })
    await new Promise((r) => setImmediate(r))
    b.c.sock.destroy() // the load's copies may still be running
    for (let i = 0; i < 400 && fileMapStats().mappings !== maps + LAYERS; i++)
      await new Promise((r) => setTimeout(r, 5))
    expect(fileMapStats().mappings).toBe(maps + LAYERS) // only a's registration is left
    void a.c.call('load', { worker: a.worker, keys, blockIds: blockIds.map((i) => i + 16) })
    await new Promise((r) => setImmediate(r))
    await server.close() // waits for a's load before unmapping and freeing L1
    expect(fileMapStats().mappings).toBe(maps)
    expect(nativeMemoryStats().pinnedBytes).toBe(pinned)
  })

  it('an id reused while its request is in flight: the one that ends first leaves the other pending in poll', async () => {
    const { server, path } = await bigAgent('id-reuse', true)
    try {
      const { s, worker } = await directSession(server.agent, path)
      const src = Array.from({ length: 48 }, (_, i) => (i * 7) % BLOCKS)
      // A save of three chunks copies on the pool threads; a load of unknown keys ends at once.
      const keys = Buffer.concat([0, 1, 2].map(() => randomBytes(32)))
      const save = server.agent.answer(s, { id: 9, op: 'save', worker, keys, blockIds: src })
      const unknown = Buffer.concat([0, 1, 2].map(() => randomBytes(32)))
      const load = server.agent.answer(s, { id: 9, op: 'load', worker, keys: unknown, blockIds: src })
      expect(await load).toMatchObject({ chunks: 0 })
      expect(server.agent.answer(s, { id: 10, op: 'poll', ids: [9] })).toEqual({
        states: { '9': { state: 'pending', op: 'save', layers: 0 } },
      })
      expect(await save).toMatchObject({ stored: 3 })
      expect(server.agent.answer(s, { id: 11, op: 'poll', ids: [9] })).toEqual({
        states: { '9': { state: 'unknown' } },
      })
      server.agent.endSession(s)
    } finally {
      await server.close()
    }
  })

  for (const threads of [2, 0]) {
    it(`${threads} copy threads: once the connection is gone no save copies out of, and no load writes into, the engine's blocks (the engine may reuse them)`, async () => {
      const { server, path, open } = await bigAgent(`ended-${threads}`, false, threads)
      const agent = server.agent
      // A session driven directly, so that it ends before any copy can start (a socket's
      // close event comes in a later turn of the loop).
      const session = () => directSession(agent, path)
      try {
        const src = Array.from({ length: 48 }, (_, i) => (i * 7) % BLOCKS)
        const gone = Buffer.concat([0, 1, 2].map(() => randomBytes(32)))
        const a = await session()
        const save = agent.answer(a.s, { id: 3, op: 'save', worker: a.worker, keys: gone, blockIds: src })
        agent.endSession(a.s)
        await expect(save).rejects.toMatchObject({ code: 'ERR_CLOSED' })
        const b = await open()
        // Without copy threads chunk 0 is copied inside answer(), before the end: it is kept.
        expect(await b.c.call('lookup', { keys: gone })).toMatchObject({
          ok: true,
          chunks: threads === 0 ? 1 : 0,
        })
        // Stored while connected; then a load whose connection ends at once writes nothing.
        const kept = Buffer.concat([0, 1].map(() => randomBytes(32)))
        expect(
          await b.c.call('save', { worker: b.worker, keys: kept, blockIds: src.slice(0, 32) }),
        ).toMatchObject({ ok: true, stored: 2 })
        const before = readFileSync(path)
        const c = await session()
        const dst = Array.from({ length: 32 }, (_, i) => (i * 5 + 3) % BLOCKS)
        const load = agent.answer(c.s, { id: 4, op: 'load', worker: c.worker, keys: kept, blockIds: dst })
        agent.endSession(c.s)
        expect(await load).toMatchObject({ chunks: 0, failedBlocks: dst })
        expect(readFileSync(path).equals(before)).toBe(true)
        b.c.sock.destroy()
      } finally {
        await server.close()
      }
    })
  }

  it("a save's copy that ends after the engine closed is not kept, though the close event has not reached the agent yet", async () => {
    const { server, path } = await bigAgent('peer-closed', false, 2)
    const agent = server.agent
    try {
      const s = newSession(() => {})
      let gone = false
      // What server.ts wires to the kernel (POLLRDHUP on the socket): here the engine closes
      // while the copy runs and the agent's JS has seen no close event (s.ended stays false).
      s.peerClosed = () => gone
      const { worker } = await directSession(agent, path, s)
      const keys = Buffer.concat([0, 1, 2].map(() => randomBytes(32)))
      const blockIds = Array.from({ length: 48 }, (_, i) => (i * 7) % BLOCKS)
      const save = agent.answer(s, { id: 3, op: 'save', worker, keys, blockIds })
      gone = true
      await expect(save).rejects.toMatchObject({ code: 'ERR_CLOSED' })
      expect(s.ended).toBe(false)
      const { s: other } = await directSession(agent, path)
      expect(await agent.answer(other, { id: 3, op: 'lookup', keys })).toMatchObject({ chunks: 0 })
      agent.endSession(s)
      agent.endSession(other)
    } finally {
      await server.close()
    }
  })

  it('the server asks the kernel whether the engine closed: true at once, before the close event', async () => {
    const { server } = await bigAgent('peer-wired', false, 2)
    const sessions: Session[] = []
    const answer = server.agent.answer.bind(server.agent)
    server.agent.answer = (s, m) => {
      sessions.push(s)
      return answer(s, m)
    }
    try {
      const c = await client(join(dir, 'peer-wired.sock'))
      expect(await c.call('ping')).toMatchObject({ ok: true })
      const s = sessions[0]!
      expect(s.peerClosed).toBeTypeOf('function')
      expect(s.peerClosed!()).toBe(false)
      c.sock.destroy()
      expect(s.peerClosed!()).toBe(true)
      expect(s.ended).toBe(false)
    } finally {
      await server.close()
    }
  })

  // 0: the copies on the agent's event loop (copyThreads 0), the path without the addon's copyRunsAsync.
  for (const threads of [2, 0]) {
    it(`${threads} copy threads: a connection ending during a save: what a later lookup finds loads exactly the saved bytes`, async () => {
      const maps = fileMapStats().mappings
      const { server, path, open } = await bigAgent(`end-mid-save-${threads}`, false, threads)
      try {
        const a = await open()
        const keys = Buffer.concat([0, 1, 2].map(() => randomBytes(32))) // packed keys
        const src = Array.from({ length: 48 }, (_, i) => (i * 7) % BLOCKS)
        void a.c.call('save', { worker: a.worker, keys, blockIds: src })
        await new Promise((r) => setImmediate(r))
        a.c.sock.destroy()
        for (let i = 0; i < 400 && fileMapStats().mappings !== maps; i++)
          await new Promise((r) => setTimeout(r, 5))
        expect(fileMapStats().mappings).toBe(maps) // released once the copy ended
        const before = readFileSync(path)
        const b = await open()
        const found = (await b.c.call('lookup', { keys })) as { chunks: number }
        const dst = Array.from({ length: 48 }, (_, i) => (i * 7 + 3) % BLOCKS).slice(0, found.chunks * 16)
        const loaded = await b.c.call('load', {
          worker: b.worker,
          keys: keys.subarray(0, found.chunks * 32),
          blockIds: dst,
        })
        expect(loaded).toMatchObject({ ok: true, chunks: found.chunks, failedBlocks: [] })
        const after = readFileSync(path)
        for (let l = 0; l < LAYERS; l++)
          for (let side = 0; side < 2; side++)
            for (let i = 0; i < dst.length; i++) {
              const at = (id: number) => l * LAYER_BYTES + (side * BLOCKS + id) * BLOCK
              expect(
                after
                  .subarray(at(dst[i]!), at(dst[i]!) + BLOCK)
                  .equals(before.subarray(at(src[i]!), at(src[i]!) + BLOCK)),
              ).toBe(true)
            }
        b.c.sock.destroy()
      } finally {
        await server.close()
      }
    })
  }
})
