// The codec pool must give the same bytes on worker threads as inline, report
// codec errors as errors, and fall back to inline work when workers are off.

import { readFileSync } from 'node:fs'
import { afterAll, describe, expect, it } from 'vitest'
import { CodecPool, CodecWorkerLostError } from '../src/client/codec-pool.ts'
import { CodecStaging } from '../src/client/codec-staging.ts'
import { decodeChunk, encodeChunk } from '../src/codec/node.ts'
import { CorruptStreamError, provesCorrupt } from '../src/core/errors.ts'
import { decodeHeader, verifyChunk } from '../src/core/format.ts'
import { chunkBytes, layerSlabBytes, MODEL_PRESETS } from '../src/core/layout.ts'
import { metaFor, syntheticKv, tensorOf } from './codec-fixtures.ts'

const g = MODEL_PRESETS.stories260k
const tensor = tensorOf(syntheticKv(g, 32, 3), g.dtype)
const meta = metaFor(g, 32)
const pools: CodecPool[] = []
afterAll(async () => {
  for (const p of pools) await p.close()
})

describe('CodecPool', () => {
  it.each([1, 0])('with %i workers: encode and decode match the codec called directly', async (workers) => {
    const pool = new CodecPool(workers)
    pools.push(pool)
    for (const mode of ['lossless', 'kvgate'] as const) {
      const obj = await pool.encode(mode, tensor, meta)
      expect(Buffer.compare(obj, encodeChunk(tensor, meta, { mode }))).toBe(0)
      const out = new Uint8Array(chunkBytes(g, 32))
      await pool.decodeInto(obj, mode, out)
      expect(Buffer.compare(out, decodeChunk(obj))).toBe(0)
      const h = decodeHeader(obj)
      const s = h.sections[2]!
      const slab = await pool.decodeSection(h, 2, obj.subarray(s.offset, s.offset + s.length))
      expect(Buffer.compare(slab, out.subarray(2 * layerSlabBytes(g, 32), 3 * layerSlabBytes(g, 32)))).toBe(0)
    }
    if (workers > 0) expect(pool.counts.workerJobs).toBeGreaterThan(0)
    else expect(pool.counts.workerJobs).toBe(0)
  })

  it('warm() loads the workers before any job (a pool never warmed loads none); a warmed pool still codes', async () => {
    const cold = new CodecPool(2)
    const warm = new CodecPool(2)
    pools.push(cold, warm)
    warm.warm()
    warm.warm() // idempotent: still two workers
    const until = Date.now() + 20_000
    while (warm.readyWorkers < 2 && Date.now() < until) await new Promise((r) => setTimeout(r, 10))
    expect(warm.readyWorkers).toBe(2)
    expect(cold.readyWorkers).toBe(0)
    expect(warm.counts.workerJobs).toBe(0)
    const obj = await warm.encode('kvgate', tensor, meta)
    expect(Buffer.compare(obj, encodeChunk(tensor, meta, { mode: 'kvgate' }))).toBe(0)
    expect(warm.counts).toMatchObject({ workerJobs: 1, inlineJobs: 0 })
    expect(warm.readyWorkers).toBe(2)
  })

  it('warm() after close() starts nothing', async () => {
    const pool = new CodecPool(1)
    await pool.close()
    pool.warm()
    await new Promise((r) => setTimeout(r, 50))
    expect(pool.readyWorkers).toBe(0)
  })

  it('a job that cannot be handed to a worker (its staging cannot be made) fails alone: the next one still runs', async () => {
    const pool = new CodecPool(1)
    pools.push(pool)
    const obj = encodeChunk(tensor, meta, { mode: 'lossless' })
    // Both queue before the worker is ready; the first one's message cannot be built (as when
    // its staging buffer cannot be allocated): the worker, then idle, must take the second.
    const unbuildable = {
      get hash(): string {
        throw new RangeError('Array buffer allocation failed')
      },
    }
    const bad = pool.decodeInto(obj, 'lossless', new Uint8Array(chunkBytes(g, 32)), unbuildable as never)
    const out = new Uint8Array(chunkBytes(g, 32))
    const good = pool.decodeInto(obj, 'lossless', out)
    await expect(bad).rejects.toThrow(/allocation failed/)
    // Typed as the pool's failure, not the bytes': a reader keeps the object (counted error, not corrupt).
    await expect(bad).rejects.toMatchObject({ name: 'CodecDispatchError', code: 'ERR_CODEC' })
    const bound = new Promise<'stuck'>((r) => setTimeout(() => r('stuck'), 5000).unref())
    expect(await Promise.race([good.then(() => 'done'), bound])).toBe('done')
    expect(Buffer.compare(out, decodeChunk(obj))).toBe(0)
  })

  it('a job that could not be sent does not hand the next one the output buffer a finished job is still being copied out of', async () => {
    // One worker; three decodes queue before it is ready. A runs; B's message cannot be built
    // after it took an output buffer; C is sent as A's answer arrives, while A's tensor is
    // copied out of its staging. The worker scribbles on C's output first, from the end: were
    // it A's buffer, A's result would end in 0xa5 bytes.
    const scribbling = new URL('./support/scribbling-codec-worker.mjs', import.meta.url)
    const pool = new CodecPool(1, false, { workerEntry: scribbling })
    pools.push(pool)
    const big = { layers: 32, kvHeads: 8, headDim: 128, dtype: 'bf16' as const }
    const zeros = new Uint8Array(chunkBytes(big, 64)) // 8 MiB: the copy-out takes a while
    const objA = encodeChunk(zeros, metaFor(big, 64), { mode: 'lossless' })
    const objC = encodeChunk(
      zeros.map((_, i) => i & 0x7f),
      metaFor(big, 64),
      { mode: 'lossless' },
    )
    const unbuildable = {
      get hash(): string {
        throw new RangeError('Array buffer allocation failed')
      },
    }
    const dstA = new Uint8Array(zeros.byteLength).fill(1)
    const dstC = new Uint8Array(zeros.byteLength)
    const a = pool.decodeInto(objA, 'lossless', dstA)
    const b = pool.decodeInto(objA, 'lossless', new Uint8Array(zeros.byteLength), unbuildable as never)
    const c = pool.decodeInto(objC, 'lossless', dstC)
    // B fails while A's tensor is still being copied out (on the addon's pool): its rejection
    // is awaited from the start, not after A.
    const bFails = expect(b).rejects.toMatchObject({ name: 'CodecDispatchError' })
    await a
    await bFails
    await c
    expect(pool.counts.jobsUnsent).toBe(1)
    expect(dstA.findIndex((v) => v !== 0)).toBe(-1)
    expect(Buffer.compare(dstC, decodeChunk(objC))).toBe(0)
  })

  it('passes the kvgate quality through to the worker', async () => {
    const pool = new CodecPool(1)
    pools.push(pool)
    const small = await pool.encode('kvgate', tensor, meta, 1)
    const close = await pool.encode('kvgate', tensor, meta, 9)
    expect(Buffer.compare(small, encodeChunk(tensor, meta, { mode: 'kvgate', quality: 1 }))).toBe(0)
    expect(small.byteLength).toBeLessThan(close.byteLength)
  })

  it.each([1, 0])(
    'verify (%i workers) accepts what verifyChunk accepts and rejects every corruption',
    async (workers) => {
      const pool = new CodecPool(workers)
      pools.push(pool)
      const big = { layers: 8, kvHeads: 8, headDim: 128, dtype: 'fp16' as const }
      const t = new Uint8Array(chunkBytes(big, 256)).map((_, i) => (i * 31) >>> 3)
      const obj = encodeChunk(t, metaFor(big, 256), { mode: 'raw' })
      expect(obj.byteLength).toBeGreaterThan(4 * 1024 * 1024) // takes the two-thread path
      expect((await pool.verify(obj)).totalBytes).toBe(verifyChunk(obj).totalBytes)
      const h = decodeHeader(obj)
      for (const layer of [0, 3, 4, 7]) {
        const bad = obj.slice()
        const s = h.sections[layer]!
        bad[s.offset + s.length - 1]! ^= 1
        await expect(pool.verify(bad)).rejects.toMatchObject({ code: 'ERR_FORMAT_CHECKSUM' })
      }
      await expect(pool.verify(obj.subarray(0, obj.length - 1))).rejects.toMatchObject({
        code: 'ERR_FORMAT_TRUNCATED',
      })
      const hdr = obj.slice()
      hdr[20]! ^= 1
      await expect(pool.verify(hdr)).rejects.toMatchObject({ name: 'FormatError' })
    },
  )

  it.each([1, 0])(
    'with %i workers: decodes into a destination that holds its own object (an L4 body read into the slot)',
    async (workers) => {
      const pool = new CodecPool(workers)
      pools.push(pool)
      const obj = encodeChunk(tensor, meta, { mode: 'kvgate' })
      const want = decodeChunk(obj)
      const slot = new Uint8Array(Math.max(obj.byteLength, want.byteLength) + 64)
      slot.set(obj, 64)
      const dst = slot.subarray(0, want.byteLength)
      await pool.decodeInto(slot.subarray(64, 64 + obj.byteLength), 'kvgate', dst)
      expect(Buffer.compare(dst, want)).toBe(0)
    },
  )

  it('chunks decoded at once on two workers each land in their own destination; staging stays at one job per buffer', async () => {
    const pool = new CodecPool(2)
    pools.push(pool)
    const objs = [1, 2, 3, 4, 5, 6].map((seed) =>
      encodeChunk(tensorOf(syntheticKv(g, 32, seed), g.dtype), meta, { mode: 'kvgate' }),
    )
    const outs = objs.map(() => new Uint8Array(chunkBytes(g, 32)))
    await Promise.all(objs.map((o, i) => pool.decodeInto(o, 'kvgate', outs[i]!)))
    for (const [i, o] of objs.entries()) expect(Buffer.compare(outs[i]!, decodeChunk(o))).toBe(0)
    expect(pool.counts.workerJobs).toBe(objs.length)
    // Per worker: one input and two output buffers of 1 MiB (the rounding), however many jobs ran.
    for (let round = 0; round < 3; round++) {
      expect(pool.stagingBytes).toBeGreaterThan(0)
      expect(pool.stagingBytes).toBeLessThanOrEqual(2 * 3 * 1024 * 1024)
      await Promise.all(objs.map((o, i) => pool.decodeInto(o, 'kvgate', outs[i]!)))
    }
  })

  it.each([1, 0])(
    'with %i workers: an object that fails verification is refused and its destination is left untouched',
    async (workers) => {
      const pool = new CodecPool(workers)
      pools.push(pool)
      const obj = encodeChunk(tensor, meta, { mode: 'kvgate' })
      const s = decodeHeader(obj).sections[4]!
      const flipped = obj.slice()
      flipped[s.offset + (s.length >> 1)]! ^= 0x10
      const cases: [Uint8Array, RegExp][] = [
        [flipped, /checksum/],
        [obj.subarray(0, obj.length - 1), /bytes, header says/],
        [new Uint8Array([...obj, 0]), /bytes, header says/],
      ]
      for (const [bad, why] of cases) {
        const dst = new Uint8Array(chunkBytes(g, 32))
        await expect(pool.decodeInto(bad, 'kvgate', dst)).rejects.toThrow(why)
        expect(dst.every((x) => x === 0)).toBe(true)
      }
      const short = new Uint8Array(chunkBytes(g, 32) - 2)
      await expect(pool.decodeInto(obj, 'kvgate', short)).rejects.toThrow(/output must be/)
      expect(short.every((x) => x === 0)).toBe(true)
      // The pool still decodes after the failures.
      const out = new Uint8Array(chunkBytes(g, 32))
      await pool.decodeInto(obj, 'kvgate', out)
      expect(Buffer.compare(out, decodeChunk(obj))).toBe(0)
    },
  )

  it.each([1, 0])(
    'with %i workers: a layer range decodes in one job, each slab as the whole chunk has it',
    async (workers) => {
      const pool = new CodecPool(workers)
      pools.push(pool)
      const obj = encodeChunk(tensor, meta, { mode: 'kvgate' })
      const whole = decodeChunk(obj)
      const h = decodeHeader(obj)
      const slab = layerSlabBytes(g, 32)
      const sections = [1, 2, 3].map((l) =>
        obj.subarray(h.sections[l]!.offset, h.sections[l]!.offset + h.sections[l]!.length),
      )
      const jobs = pool.counts.workerJobs
      const slabs = await pool.decodeLayers(h, 1, sections)
      expect(pool.counts.workerJobs).toBe(jobs + workers)
      expect(slabs.length).toBe(3)
      for (const [i, s] of slabs.entries())
        expect(Buffer.compare(s, whole.subarray((1 + i) * slab, (2 + i) * slab))).toBe(0)
      // A garbage section in the range fails the range.
      const bad = [sections[0]!, sections[1]!.slice().fill(0xff), sections[2]!]
      await expect(pool.decodeLayers(h, 1, bad)).rejects.toMatchObject({ code: 'ERR_CODEC' })
    },
  )

  it('an idle worker lets go of its staging; the next job gets it back', async () => {
    const pool = new CodecPool(1, false, { stagingIdleMs: 50 })
    pools.push(pool)
    const obj = encodeChunk(tensor, meta, { mode: 'kvgate' })
    const out = new Uint8Array(chunkBytes(g, 32))
    await pool.decodeInto(obj, 'kvgate', out)
    expect(pool.stagingBytes).toBeGreaterThan(0)
    for (let i = 0; i < 100 && pool.stagingBytes > 0; i++) await new Promise((r) => setTimeout(r, 20))
    expect(pool.stagingBytes).toBe(0)
    out.fill(0)
    await pool.decodeInto(obj, 'kvgate', out)
    expect(Buffer.compare(out, decodeChunk(obj))).toBe(0)
    expect(pool.stagingBytes).toBeGreaterThan(0)
  })

  it('a section whose header claims a huge layer is refused before a staging buffer is sized for it', async () => {
    const pool = new CodecPool(1)
    pools.push(pool)
    const obj = await pool.encode('kvgate', tensor, meta)
    const h = decodeHeader(obj)
    const s = h.sections[0]!
    const section = obj.subarray(s.offset, s.offset + s.length)
    const before = pool.stagingBytes
    await expect(pool.decodeSection({ ...h, tokens: 10_000_000 }, 0, section)).rejects.toMatchObject({
      code: 'ERR_CODEC',
    })
    expect(pool.stagingBytes).toBe(before)
  })

  it('a garbage section is a CorruptStreamError from the worker (a verdict on the bytes), and the pool keeps working', async () => {
    const pool = new CodecPool(1)
    pools.push(pool)
    const obj = await pool.encode('kvgate', tensor, meta)
    const h = decodeHeader(obj)
    const s = h.sections[1]!
    const bad = obj.slice(s.offset, s.offset + s.length).fill(0xff)
    const e = await pool.decodeSection(h, 1, bad).catch((x: unknown) => x)
    expect(e).toBeInstanceOf(CorruptStreamError)
    expect(provesCorrupt(e)).toBe(true)
    // A section CRC mismatch found on the worker stays a FormatError.
    const whole = obj.slice()
    const at = h.sections[2]!.offset
    whole[at] = whole[at]! ^ 1
    const f = await pool
      .decodeInto(whole, 'kvgate', new Uint8Array(tensor.byteLength))
      .catch((x: unknown) => x)
    expect(f).toMatchObject({ name: 'FormatError', code: 'ERR_FORMAT_CHECKSUM' })
    // A header of a codec version this build does not read (a newer writer's?): no verdict, its code kept.
    const good = obj.slice(s.offset, s.offset + s.length)
    const v = await pool.decodeSection({ ...h, codecVersion: 99 }, 1, good).catch((x: unknown) => x)
    expect(v).toMatchObject({ name: 'CodecError', code: 'ERR_CODEC_MISMATCH' })
    expect(provesCorrupt(v)).toBe(false)
    expect((await pool.encode('lossless', tensor, meta)).byteLength).toBeGreaterThan(0)
  })
})

describe('CodecPool: a worker out of wasm memory', () => {
  it('fails the decode with a CodecError that is no verdict on the bytes; the same object decodes once memory is back', async () => {
    const { mkdtempSync, rmSync, writeFileSync } = await import('node:fs')
    const dir = mkdtempSync('/tmp/kvgate-oom-')
    const flag = `${dir}/oom`
    process.env.KVGATE_TEST_OOM_FLAG = flag
    const pool = new CodecPool(1, false, {
      workerEntry: new URL('./support/oom-codec-worker.mjs', import.meta.url),
    })
    pool.warm()
    delete process.env.KVGATE_TEST_OOM_FLAG
    try {
      const obj = await pool.encode('lossless', tensor, meta)
      const out = new Uint8Array(tensor.byteLength)
      writeFileSync(flag, '')
      const e = await pool.decodeInto(obj, 'lossless', out).catch((x: unknown) => x)
      expect(e).toMatchObject({ name: 'CodecError', code: 'ERR_CODEC' })
      expect(provesCorrupt(e)).toBe(false)
      expect(pool.counts.inlineJobs).toBe(0)
      rmSync(flag)
      await pool.decodeInto(obj, 'lossless', out)
      expect(out).toEqual(tensor)
    } finally {
      await pool.close()
      rmSync(dir, { recursive: true, force: true })
    }
  })
})

describe('CodecPool: objects no reader would take are never returned', () => {
  // Random bytes: a lossless plane that does not compress is stored as is (plus its flag), so
  // the lossless object is a little larger than the raw one, as a chunk near 512 MiB can be.
  const noise = Uint8Array.from(
    { length: tensor.byteLength },
    (_, i) => (Math.imul(i + 7, 2654435761) >>> 13) & 255,
  )
  const rawBytes = encodeChunk(noise, meta, { mode: 'raw' }).byteLength

  it.each([
    ['on a worker', 1],
    ['inline', 0],
  ] as const)(
    '%s: a coded object over the limit is replaced by the raw one, which decodes exactly',
    async (_, workers) => {
      const pool = new CodecPool(workers, false, { maxObjectBytes: rawBytes })
      pools.push(pool)
      expect(encodeChunk(noise, meta, { mode: 'lossless' }).byteLength).toBeGreaterThan(rawBytes)
      const obj = await pool.encode('lossless', noise, meta)
      expect(obj.byteLength).toBeLessThanOrEqual(rawBytes)
      expect(decodeHeader(obj).codec).toBe('raw')
      expect(decodeChunk(obj)).toEqual(noise)
      expect(pool.counts).toMatchObject({ rawFallbacks: 1, oversizedRefused: 0 })
      // Under the limit the codec asked for is kept.
      expect(decodeHeader(await pool.encode('lossless', tensor, meta)).codec).toBe('lossless')
      expect(pool.counts.rawFallbacks).toBe(1)
    },
  )

  it('an object over the limit even raw is refused (ERR_FORMAT_TOO_LARGE), counted', async () => {
    const pool = new CodecPool(0, false, { maxObjectBytes: rawBytes - 1 })
    pools.push(pool)
    for (const codec of ['lossless', 'raw'] as const)
      await expect(pool.encode(codec, noise, meta)).rejects.toMatchObject({ code: 'ERR_FORMAT_TOO_LARGE' })
    expect(pool.counts).toMatchObject({ rawFallbacks: 0, oversizedRefused: 2 })
  })

  it('refuses a limit that is not a positive integer', () => {
    for (const maxObjectBytes of [0, -1, 1.5, Number.NaN])
      expect(() => new CodecPool(0, false, { maxObjectBytes })).toThrow(TypeError)
  })
})

describe('CodecStaging', () => {
  it('consecutive outputs never share memory (one is copied out while the worker fills the next), and buffers are reused', () => {
    const st = new CodecStaging()
    const a = st.output(3 << 20)
    const b = st.output(3 << 20)
    expect(a.buffer).not.toBe(b.buffer)
    const input = st.input(new Uint8Array(5).fill(7))
    expect([...input]).toEqual([7, 7, 7, 7, 7])
    expect(input.buffer).not.toBe(a.buffer)
    expect(input.buffer).not.toBe(b.buffer)
    const held = st.bytes
    expect(held).toBe((3 + 3 + 1) << 20)
    // The third output reuses the first buffer; smaller jobs reuse, bigger ones grow it.
    expect(st.output(1000).buffer).toBe(a.buffer)
    expect(st.output(3 << 20).buffer).toBe(b.buffer)
    expect(st.input(new Uint8Array(1000)).buffer).toBe(input.buffer)
    expect(st.bytes).toBe(held)
    expect(st.output((4 << 20) + 1).byteLength).toBe((4 << 20) + 1)
    expect(st.bytes).toBe(held + (2 << 20))
  })

  it('an output given back (its job never sent) goes to the next job, never the one before it', () => {
    const st = new CodecStaging()
    const running = st.output(1 << 20) // the job whose result is about to be copied out
    const turn = st.turn
    const unsent = st.output(1 << 20)
    st.rewind(turn)
    const next = st.output(1 << 20)
    expect(next.buffer).toBe(unsent.buffer)
    expect(next.buffer).not.toBe(running.buffer)
  })
})

describe('CodecStaging.hold', () => {
  it('holds the output buffer being copied out until the copy settles, resolved or rejected', async () => {
    const st = new CodecStaging()
    const a = st.output(1 << 20)
    let done!: () => void
    st.hold(
      a,
      new Promise<void>((r) => {
        done = r
      }),
    )
    // The next output is the other buffer: free. The one after it is a's: held.
    expect(st.nextOutputHeld).toBe(false)
    const b = st.output(1 << 20)
    expect(st.nextOutputHeld).toBe(true)
    let fail!: (e: Error) => void
    const failing = new Promise<void>((_, reject) => {
      fail = reject
    })
    failing.catch(() => {})
    st.hold(b, failing)
    done()
    await Promise.resolve()
    expect(st.nextOutputHeld).toBe(false)
    expect(st.output(1 << 20).buffer).toBe(a.buffer)
    expect(st.nextOutputHeld).toBe(true) // b's copy still runs
    fail(new Error('copy failed'))
    await Promise.resolve()
    await Promise.resolve()
    expect(st.nextOutputHeld).toBe(false)
    // A view of no output buffer of this staging holds nothing.
    st.hold(new Uint8Array(8), new Promise(() => {}))
    expect(st.nextOutputHeld).toBe(false)
  })
})

describe('CodecPool under worker failures (finding 11)', () => {
  const faulty = new URL('./support/faulty-codec-worker.mjs', import.meta.url)
  const poison = (kind: 0 | 1 | 2 | 3) => {
    const t = tensor.slice()
    t.set([0xde, 0xad, kind])
    return t
  }

  it.each([
    ['exits without an error', 0],
    ['crashes', 1],
  ] as const)(
    'a worker that %s fails only its own job (typed) and is replaced',
    async (_, kind) => {
      const pool = new CodecPool(2, false, { workerEntry: faulty })
      pools.push(pool)
      const want = encodeChunk(tensor, meta, { mode: 'lossless' })
      const good = Array.from({ length: 4 }, () => pool.encode('lossless', tensor, meta))
      const bad = pool.encode('lossless', poison(kind), meta)
      const more = Array.from({ length: 4 }, () => pool.encode('lossless', tensor, meta))
      await expect(bad).rejects.toMatchObject({ name: 'CodecWorkerLostError', code: 'ERR_CODEC' })
      for (const out of await Promise.all([...good, ...more])) expect(Buffer.compare(out, want)).toBe(0)
      expect(pool.counts.jobsLost).toBe(1)
      expect(pool.counts.workersReplaced).toBe(1)
      // The replacement takes work: still on workers, not inline.
      const before = pool.counts.workerJobs
      expect(Buffer.compare(await pool.encode('lossless', tensor, meta), want)).toBe(0)
      expect(pool.counts.workerJobs).toBe(before + 1)
      expect(pool.inline).toBeUndefined()
    },
    60_000,
  )

  it('a worker dying in a decode fails only that decode (its destination untouched); the others land whole', async () => {
    const pool = new CodecPool(2, false, { workerEntry: faulty })
    pools.push(pool)
    const obj = encodeChunk(tensor, meta, { mode: 'kvgate' })
    const want = decodeChunk(obj)
    const outs = Array.from({ length: 6 }, () => new Uint8Array(want.byteLength))
    // An odd-length destination is what the faulty worker dies on (the real one would refuse it).
    const poisonedDst = new Uint8Array(want.byteLength + 1)
    const good = outs.map((o) => pool.decodeInto(obj, 'kvgate', o))
    const bad = pool.decodeInto(obj, 'kvgate', poisonedDst)
    const more = outs.map((o) => pool.decodeInto(obj, 'kvgate', o))
    await expect(bad).rejects.toMatchObject({ name: 'CodecWorkerLostError' })
    await Promise.all([...good, ...more])
    for (const o of outs) expect(Buffer.compare(o, want)).toBe(0)
    expect(poisonedDst.every((x) => x === 0)).toBe(true)
    expect(pool.counts.jobsLost).toBe(1)
    expect(pool.counts.workersReplaced).toBe(1)
  }, 60_000)

  /** OS threads of this process (each codec worker adds its own): a hung one left running would show. */
  const threads = () => Number(/^Threads:\s+(\d+)/m.exec(readFileSync('/proc/self/status', 'utf8'))![1])
  /** Timers keeping this process alive (a job's deadline is one while it runs). */
  const timers = () => process.getActiveResourcesInfo().filter((r) => r === 'Timeout').length
  const settle = async (until: () => boolean) => {
    for (let i = 0; i < 200 && !until(); i++) await new Promise((r) => setTimeout(r, 25))
  }

  it.each([
    ['spins in JavaScript', 2],
    ['spins in wasm', 3],
  ] as const)(
    'a worker that never answers (%s) fails its job typed after the bound, is terminated and replaced; jobs queued behind it run on the replacement',
    async (_, kind) => {
      const pool = new CodecPool(1, false, {
        workerEntry: faulty,
        jobTimeout: { floorMs: 1000, msPerMiB: 0 },
      })
      pools.push(pool)
      const want = encodeChunk(tensor, meta, { mode: 'lossless' })
      expect(Buffer.compare(await pool.encode('lossless', tensor, meta), want)).toBe(0)
      const idleThreads = threads()
      const t0 = performance.now()
      const hung = pool.encode('lossless', poison(kind), meta)
      const queued = Array.from({ length: 3 }, () => pool.encode('lossless', tensor, meta))
      const e = await hung.then(
        () => undefined,
        (x: unknown) => x,
      )
      expect(performance.now() - t0).toBeGreaterThanOrEqual(990)
      expect(e).toMatchObject({ name: 'CodecJobTimeoutError', code: 'ERR_CODEC' })
      // Callers treat it as a dead worker: a counted miss, the object kept.
      expect(e).toBeInstanceOf(CodecWorkerLostError)
      expect((e as Error).message).toMatch(/did not answer within 1000 ms/)
      for (const out of await Promise.all(queued)) expect(Buffer.compare(out, want)).toBe(0)
      expect(pool.counts).toMatchObject({ jobsLost: 1, jobsTimedOut: 1, workersReplaced: 1 })
      expect(pool.inline).toBeUndefined()
      // The hung thread is gone, not left spinning beside its replacement.
      await settle(() => threads() <= idleThreads)
      expect(threads()).toBeLessThanOrEqual(idleThreads)
    },
    60_000,
  )

  it('an answer that arrived while the calling thread was blocked past the deadline is taken, not failed', async () => {
    const pool = new CodecPool(1, false, { jobTimeout: { floorMs: 200, msPerMiB: 0 } })
    pools.push(pool)
    const want = encodeChunk(tensor, meta, { mode: 'lossless' })
    await pool.encode('lossless', tensor, meta)
    const job = pool.encode('lossless', tensor, meta)
    // The worker answers in milliseconds; this thread, blocked in the check phase, sees the
    // answer only after its deadline passed, and the next turn of the event loop runs the
    // expired timer before it polls for the answer.
    await new Promise<void>((done) =>
      setImmediate(() => {
        const until = performance.now() + 1500
        while (performance.now() < until) {}
        done()
      }),
    )
    expect(Buffer.compare(await job, want)).toBe(0)
    expect(pool.counts).toMatchObject({ jobsTimedOut: 0, jobsLost: 0, workersReplaced: 0 })
  }, 60_000)

  it("the deadline grows with the bytes a job moves (a calibration's samples weighted)", async () => {
    const pool = new CodecPool(1, false, {
      workerEntry: faulty,
      jobTimeout: { floorMs: 200, msPerMiB: 20_000 },
    })
    pools.push(pool)
    const ms = Math.ceil(200 + (tensor.byteLength / 2 ** 20) * 20_000)
    expect(ms).toBeGreaterThan(300)
    await expect(pool.encode('lossless', poison(2), meta)).rejects.toThrow(
      new RegExp(`did not answer within ${ms} ms`),
    )
    // A calibration's samples count 8× (it costs ~7× a codec job per byte), though they are
    // transferred to the worker (gone from this thread once posted).
    const samples = [poison(2)]
    const calMs = Math.ceil(200 + ((8 * tensor.byteLength) / 2 ** 20) * 20_000)
    await expect(pool.buildCalibration(samples, g)).rejects.toThrow(
      new RegExp(`did not answer within ${calMs} ms`),
    )
  }, 60_000)

  it.each([-1, Number.NaN, Number.POSITIVE_INFINITY, '5', null])(
    'a jobTimeout of %s is refused when the pool is made',
    (bad) => {
      for (const key of ['floorMs', 'msPerMiB'])
        expect(() => new CodecPool(1, false, { jobTimeout: { [key]: bad as never } })).toThrow(
          new RegExp(`jobTimeout.${key} must be a finite number`),
        )
    },
  )

  it('hung workers are replaced however many hang: the pool never falls back to running such jobs on the calling thread', async () => {
    const pool = new CodecPool(1, false, { workerEntry: faulty, jobTimeout: { floorMs: 200, msPerMiB: 0 } })
    pools.push(pool)
    // More than the crash-loop cap (8 deaths a minute): each was still a hang, typed, on a worker.
    for (let i = 0; i < 10; i++)
      await expect(pool.encode('lossless', poison(3), meta)).rejects.toMatchObject({
        name: 'CodecJobTimeoutError',
      })
    expect(pool.counts).toMatchObject({ jobsTimedOut: 10, workersReplaced: 10, inlineJobs: 0 })
    expect(pool.inline).toBeUndefined()
  }, 60_000)

  it('a decode whose worker hangs half way fails typed and leaves its destination untouched; the others land whole', async () => {
    const pool = new CodecPool(1, false, { workerEntry: faulty, jobTimeout: { floorMs: 1000, msPerMiB: 0 } })
    pools.push(pool)
    const obj = encodeChunk(tensor, meta, { mode: 'kvgate' })
    const want = decodeChunk(obj)
    const outs = Array.from({ length: 3 }, () => new Uint8Array(want.byteLength))
    // An output of 3 mod 4 bytes: the faulty worker writes garbage into its staging, then spins.
    const hungDst = new Uint8Array(want.byteLength + ((3 - (want.byteLength % 4) + 4) % 4))
    expect(hungDst.byteLength % 4).toBe(3)
    const good = pool.decodeInto(obj, 'kvgate', outs[0]!)
    const hung = pool.decodeInto(obj, 'kvgate', hungDst)
    const more = outs.slice(1).map((o) => pool.decodeInto(obj, 'kvgate', o))
    await expect(hung).rejects.toMatchObject({ name: 'CodecJobTimeoutError' })
    await Promise.all([good, ...more])
    for (const o of outs) expect(Buffer.compare(o, want)).toBe(0)
    expect(hungDst.every((x) => x === 0)).toBe(true)
    expect(pool.counts).toMatchObject({ jobsTimedOut: 1, workersReplaced: 1 })
  }, 60_000)

  it("a job's deadline timer is cleared when it answers and when it times out; the pool closes cleanly after a timeout", async () => {
    const noPool = threads()
    const pool = new CodecPool(1, false, { workerEntry: faulty, jobTimeout: { floorMs: 1000, msPerMiB: 0 } })
    const want = encodeChunk(tensor, meta, { mode: 'lossless' })
    await pool.encode('lossless', tensor, meta)
    const idle = timers()
    const good = pool.encode('lossless', tensor, meta)
    expect(timers()).toBe(idle + 1) // armed while the worker runs it
    expect(Buffer.compare(await good, want)).toBe(0)
    expect(timers()).toBe(idle)
    const hung = pool.encode('lossless', poison(2), meta)
    await expect(hung).rejects.toMatchObject({ name: 'CodecJobTimeoutError' })
    expect(timers()).toBe(idle)
    // Close while the replacement starts and a job waits for it: that job fails ERR_CLOSED, nothing stays behind.
    const waiting = expect(pool.encode('lossless', tensor, meta)).rejects.toMatchObject({
      code: 'ERR_CLOSED',
    })
    await pool.close()
    await waiting
    expect(timers()).toBe(idle)
    // Every thread the pool started exits after close(), the hung one included (the OS thread may
    // outlive terminate()'s promise by a moment on a loaded machine: give it that moment).
    await settle(() => threads() <= noPool)
    expect(threads()).toBeLessThanOrEqual(noPool)
    // Closed with a hung job in flight: it fails ERR_CLOSED at once, its timer goes with it.
    const other = new CodecPool(1, false, {
      workerEntry: faulty,
      jobTimeout: { floorMs: 30_000, msPerMiB: 0 },
    })
    await other.encode('lossless', tensor, meta)
    const inFlight = expect(other.encode('lossless', poison(3), meta)).rejects.toMatchObject({
      code: 'ERR_CLOSED',
    })
    expect(timers()).toBe(idle + 1)
    await other.close()
    await inFlight
    expect(timers()).toBe(idle)
    await settle(() => threads() <= noPool)
    expect(threads()).toBeLessThanOrEqual(noPool)
  }, 60_000)

  it.each([
    ['first, taken as it is queued', true],
    ['behind another job, taken when that one answers', false],
  ])(
    'a job whose message cannot be posted (DataCloneError) fails typed, %s; the worker keeps serving',
    async (_, first) => {
      const pool = new CodecPool(1)
      pools.push(pool)
      const want = encodeChunk(tensor, meta, { mode: 'lossless' })
      await pool.encode('lossless', tensor, meta)
      const before = pool.counts.workerJobs
      const ahead = first ? undefined : pool.encode('lossless', tensor, meta)
      // A calibration that cannot be cloned, and a sample buffer twice in the transfer list.
      const noClone = { hash: 'x', bytes: () => 0 } as never
      const bad = pool.encode('kvgate', tensor, meta, 5, noClone)
      const s = tensor.slice()
      const twice = pool.buildCalibration([s, s], g)
      const after = Array.from({ length: 3 }, () => pool.encode('lossless', tensor, meta))
      for (const p of [bad, twice])
        await expect(p).rejects.toMatchObject({ name: 'CodecDispatchError', code: 'ERR_CODEC' })
      await expect(bad).rejects.toThrow(/could not be cloned/)
      await expect(twice).rejects.toThrow(/duplicate ArrayBuffer/)
      // The caller's samples were not transferred away.
      expect(s.byteLength).toBe(tensor.byteLength)
      for (const out of await Promise.all([...(ahead ? [ahead] : []), ...after]))
        expect(Buffer.compare(out, want)).toBe(0)
      expect(pool.counts.workerJobs).toBe(before + after.length + (ahead ? 1 : 0))
      expect(pool.counts.jobsUnsent).toBe(2)
      expect(pool.counts.jobsLost).toBe(0)
      expect(pool.inline).toBeUndefined()
    },
    60_000,
  )

  it('many hung jobs: threads and memory stay bounded, and the pool still answers', async () => {
    // The healthy jobs share the deadline: 1 s is ~40× the slowest small job seen on a loaded machine.
    const pool = new CodecPool(2, false, { workerEntry: faulty, jobTimeout: { floorMs: 1000, msPerMiB: 0 } })
    pools.push(pool)
    const want = encodeChunk(tensor, meta, { mode: 'lossless' })
    await Promise.all([pool.encode('lossless', tensor, meta), pool.encode('lossless', tensor, meta)])
    const baseThreads = threads()
    const baseRss = process.memoryUsage().rss
    let peak = 0
    const watch = setInterval(() => {
      peak = Math.max(peak, threads())
    }, 10)
    try {
      for (let round = 0; round < 3; round++) {
        const hung = [pool.encode('lossless', poison(2), meta), pool.encode('lossless', poison(3), meta)]
        const good = pool.encode('lossless', tensor, meta)
        for (const r of await Promise.allSettled(hung)) expect(r.status).toBe('rejected')
        expect(Buffer.compare(await good, want)).toBe(0)
      }
    } finally {
      clearInterval(watch)
    }
    expect(pool.counts.jobsTimedOut).toBe(6)
    // At most both slots' old workers being torn down while their replacements start (a worker is
    // two threads here); 6 hung workers left behind would be 12 more.
    expect(peak).toBeLessThanOrEqual(baseThreads + 8)
    await settle(() => threads() <= baseThreads)
    expect(threads()).toBeLessThanOrEqual(baseThreads)
    expect(process.memoryUsage().rss - baseRss).toBeLessThan(256 * 1024 * 1024)
    expect(Buffer.compare(await pool.encode('lossless', tensor, meta), want)).toBe(0)
  }, 60_000)

  it('the queue is bounded: past it a job is refused with CodecBusyError, the rest complete', async () => {
    const pool = new CodecPool(1, false, { maxQueuedJobs: 2 })
    pools.push(pool)
    const results = await Promise.allSettled(
      Array.from({ length: 8 }, () => pool.encode('lossless', tensor, meta)),
    )
    const refused = results.filter((r) => r.status === 'rejected')
    expect(refused.length).toBeGreaterThan(0)
    for (const r of refused)
      expect((r as PromiseRejectedResult).reason).toMatchObject({ name: 'CodecBusyError' })
    expect(results.filter((r) => r.status === 'fulfilled').length).toBeGreaterThanOrEqual(2)
    expect(pool.counts.jobsRefused).toBe(refused.length)
  }, 60_000)

  it('a worker that never finishes starting is given up after its start deadline: queued jobs run inline', async () => {
    const idleThreads = threads()
    const pool = new CodecPool(1, false, {
      workerEntry: new URL('./support/stuck-codec-worker.mjs', import.meta.url),
      workerStartTimeoutMs: 500,
    })
    pools.push(pool)
    const want = encodeChunk(tensor, meta, { mode: 'lossless' })
    const outs = await Promise.all([
      pool.encode('lossless', tensor, meta),
      pool.encode('lossless', tensor, meta),
    ])
    for (const out of outs) expect(Buffer.compare(out, want)).toBe(0)
    expect(pool.inline).toMatch(/did not start within 500 ms/)
    expect(pool.counts).toMatchObject({ inlineJobs: 2, workerJobs: 0, jobsLost: 0, workersReplaced: 0 })
    await settle(() => threads() <= idleThreads)
    expect(threads()).toBeLessThanOrEqual(idleThreads)
  }, 20_000)

  it.each([-1, Number.NaN, Number.POSITIVE_INFINITY, '5'])(
    'a workerStartTimeoutMs of %s is refused when the pool is made',
    (bad) => {
      expect(() => new CodecPool(1, false, { workerStartTimeoutMs: bad as never })).toThrow(
        /workerStartTimeoutMs must be a finite number/,
      )
    },
  )

  it('workers that cannot start: jobs run inline and `inline` says why', async () => {
    const pool = new CodecPool(2, false, {
      workerEntry: new URL('./support/broken-codec-worker.mjs', import.meta.url),
    })
    pools.push(pool)
    const out = await pool.encode('lossless', tensor, meta)
    expect(Buffer.compare(out, encodeChunk(tensor, meta, { mode: 'lossless' }))).toBe(0)
    expect(pool.inline).toMatch(/unavailable/)
    expect(pool.counts.jobsLost).toBe(0)
  }, 60_000)
})
