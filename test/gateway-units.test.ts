// Small gateway parts on their own: Range parsing, the GET
// coalescer's size cap, the chain lookup's probing budget, the metrics text.

import { createHash } from 'node:crypto'
import { describe, expect, it, vi } from 'vitest'
import { assertKeysHex, objectName } from '../src/core/keys.ts'
import {
  ChainLookup,
  type ChainLookupOptions,
  chainName,
  splitChainName,
} from '../src/gateway/chain-lookup.ts'
import { ifRangeHolds, matchesNoneMatch } from '../src/gateway/chunk-etag.ts'
import { GetCoalescer } from '../src/gateway/coalesce.ts'
import { GatewayMetrics } from '../src/gateway/metrics.ts'
import { parseRange } from '../src/gateway/routes/chunks.ts'
import { MemoryStore } from '../src/gateway/stores/memory.ts'
import { checkedStream, resumedReader } from '../src/gateway/verified-read.ts'

describe('If-None-Match and If-Range against a chunk tag', () => {
  const tag = '"kv1-4d0-0a1b2c3d"'
  it('If-None-Match: weak comparison over a list, *; malformed values name nothing', () => {
    for (const v of [tag, `W/${tag}`, `"a", ${tag}`, ` ${tag} `, '*', `"a",W/${tag}`])
      expect(matchesNoneMatch(v, tag), v).toBe(true)
    for (const v of [
      undefined,
      '',
      '"a"',
      tag.slice(1, -1),
      tag.slice(0, -1),
      'W/',
      '**',
      `"${tag}"`,
      'x'.repeat(100_000),
    ])
      expect(matchesNoneMatch(v, tag), String(v).slice(0, 20)).toBe(false)
  })
  it('If-Range: one strong tag equal to the current one; a weak tag, a date, a list or an unknown tag do not hold', () => {
    expect(ifRangeHolds(tag, tag)).toBe(true)
    expect(ifRangeHolds(` ${tag}`, tag)).toBe(true)
    for (const v of [
      `W/${tag}`,
      'Wed, 21 Oct 2015 07:28:00 GMT',
      `${tag}, ${tag}`,
      `${tag}x`,
      '',
      '"kv1-0-0"',
    ])
      expect(ifRangeHolds(v, tag), v).toBe(false)
    expect(ifRangeHolds(tag, undefined)).toBe(false)
  })
})

describe('parseRange', () => {
  it('parses the three forms and rejects the rest', () => {
    expect(parseRange('bytes=0-9')).toEqual({ offset: 0, length: 10 })
    expect(parseRange('bytes=5-')).toEqual({ offset: 5 })
    expect(parseRange('bytes=-3')).toEqual({ suffix: 3 })
    for (const bad of [
      'bytes=',
      'bytes=-',
      'items=0-1',
      'bytes=0-1,2-3',
      'bytes=a-b',
      `bytes=0-${'9'.repeat(20)}`,
    ]) {
      expect(() => parseRange(bad), bad).toThrow()
    }
    expect(() => parseRange('bytes=9-1')).toThrow(expect.objectContaining({ status: 416 }))
    expect(() => parseRange('bytes=-0')).toThrow(expect.objectContaining({ status: 416 }))
  })
})

describe('GetCoalescer', () => {
  it('does not share bodies above the cap: each caller gets its own GET', async () => {
    const c = new GetCoalescer(4)
    let calls = 0
    let release!: () => void
    const gate = new Promise<void>((r) => (release = r))
    const fetch = async () => {
      calls++
      await gate
      const bytes = new Uint8Array(100)
      return { body: new Response(bytes).body!, size: 100, offset: 0, length: 100 }
    }
    const a = c.get('k', fetch)
    const b = c.get('k', fetch)
    release()
    const [ra, rb] = await Promise.all([a, b])
    expect(calls).toBe(2)
    expect(ra.coalesced || rb.coalesced).toBe(false)
    expect((await new Response(ra.obj!.body).arrayBuffer()).byteLength).toBe(100)
    expect((await new Response(rb.obj!.body).arrayBuffer()).byteLength).toBe(100)
    expect(c.inflight).toBe(0)
  })

  it('shares a failure with the followers and forgets the key', async () => {
    const c = new GetCoalescer(1024)
    const boom = async () => {
      await new Promise((r) => setTimeout(r, 5))
      throw new Error('store down')
    }
    const rs = await Promise.allSettled([c.get('k', boom), c.get('k', boom)])
    expect(rs.every((r) => r.status === 'rejected')).toBe(true)
    expect(c.inflight).toBe(0)
  })
})

describe('GetCoalescer over a store that breaks a body off', () => {
  const body = (pieces: Uint8Array[], fail?: Error) =>
    new ReadableStream<Uint8Array>({
      start(c) {
        for (const p of pieces) c.enqueue(p)
        if (fail) c.error(fail)
        else c.close()
      },
    })
  it('a body shorter or longer than the store said, or one that errors, is a store fault (502), not a 500', async () => {
    const cases = [
      body([new Uint8Array(60)]),
      body([new Uint8Array(60), new Uint8Array(60)]),
      body([new Uint8Array(60)], Object.assign(new Error('socket hang up'), { code: 'ECONNRESET' })),
    ]
    for (const b of cases) {
      const c = new GetCoalescer(1024)
      const got = c.get('k', async () => ({ body: b, size: 100, offset: 0, length: 100 }))
      await expect(got).rejects.toMatchObject({ code: 'ERR_STORE', status: 502 })
      expect(c.bufferedBytes).toBe(0)
    }
  })
})

describe('GetCoalescer memory bound (Workers: 128 MB isolates)', () => {
  const obj = (n: number) => {
    const bytes = new Uint8Array(n).fill(1)
    return { body: new Response(bytes).body!, size: n, offset: 0, length: n }
  }

  it('buffers at most maxBufferedBytes across keys; above it GETs stream unshared', async () => {
    const c = new GetCoalescer(1000, 1500)
    const originals = new Set<ReadableStream<Uint8Array>>()
    const results = await Promise.all(
      ['a', 'b', 'c', 'd'].map((k) =>
        c.get(k, async () => {
          await new Promise((r) => setTimeout(r, 5))
          const o = obj(600)
          originals.add(o.body)
          return o
        }),
      ),
    )
    // Two 600-byte buffers fit under 1500; the others pass their store stream through.
    const buffered = results.filter((r) => !originals.has(r.obj!.body)).length
    expect(buffered).toBe(2)
    expect(c.bufferedBytes).toBe(1200)
    // Buffers are held until their readers take them, then released.
    for (const r of results) expect((await new Response(r.obj!.body).arrayBuffer()).byteLength).toBe(600)
    expect(c.bufferedBytes).toBe(0)
  })

  it('a buffered body counts until every sharer has taken or dropped it', async () => {
    const c = new GetCoalescer(1000, 10_000)
    let release!: () => void
    const gate = new Promise<void>((r) => (release = r))
    const fetch = async () => {
      await gate
      return obj(800)
    }
    const a = c.get('k', fetch)
    const b = c.get('k', fetch)
    release()
    const [ra, rb] = await Promise.all([a, b])
    expect(rb.coalesced).toBe(true)
    expect(c.bufferedBytes).toBe(800)
    await new Response(ra.obj!.body).arrayBuffer()
    expect(c.bufferedBytes).toBe(800)
    await rb.obj!.body.cancel()
    expect(c.bufferedBytes).toBe(0)
  })

  it('a leader whose store body fails mid-way cancels the store read', async () => {
    const c = new GetCoalescer(1 << 20)
    let cancelled: unknown
    const body = new ReadableStream<Uint8Array>({
      pull(ctl) {
        ctl.enqueue(new Uint8Array(10))
        // More than announced: the leader gives up on this body.
      },
      cancel(reason) {
        cancelled = reason ?? 'cancelled'
      },
    })
    await expect(c.get('k', async () => ({ body, size: 15, offset: 0, length: 15 }))).rejects.toThrow(
      /more bytes/,
    )
    expect(cancelled).toBeDefined()
    expect(c.bufferedBytes).toBe(0)
    expect(c.inflight).toBe(0)
  })
})

describe('ChainLookup', () => {
  async function chain(n: number, present: (i: number) => boolean, opts: ChainLookupOptions = {}) {
    let heads = 0
    const store = new MemoryStore({ onOp: (op) => op === 'head' && heads++ })
    const base = 'p/ns/'
    const keys = Array.from({ length: n }, (_, i) => createHash('sha256').update(String(i)).digest('hex'))
    const names = keys.map((k) => chainName(base, k))
    for (const [i, name] of names.entries())
      if (present(i)) await store.putIfAbsent(name, new Uint8Array(i + 1), i + 1)
    heads = 0
    const lookup = new ChainLookup(store, new GatewayMetrics(), opts)
    return { lookup, chain: { base, keys }, names, heads: () => heads, store }
  }

  it('finds the boundary of a 4096-key chain in ≤ 3 rounds without sizes', async () => {
    for (const n of [0, 1, 24, 25, 1000, 4095, 4096]) {
      // Foreground budget only: no background checks of inferred keys.
      const c = await chain(4096, (i) => i < n, { verifyInferred: 0 })
      const r = await c.lookup.lookup(c.chain, { sizes: false })
      expect(r.present, `n=${n}`).toBe(n)
      expect(r.rounds, `n=${n}`).toBeLessThanOrEqual(3)
      expect(c.heads()).toBe(r.storeRequests)
      expect(r.storeRequests).toBeLessThanOrEqual(3 * 24)
    }
  })

  it('checks inferred keys earliest first in the background: an expired early chunk stops the answer', async () => {
    // Chunk 3 expired behind the gateway; the search's probes happen to skip it.
    const c = await chain(100, (i) => i !== 3, { fanout: 8, verifyInferred: 4 })
    const first = await c.lookup.lookup(c.chain)
    for (let i = 0; i < 100 && c.lookup.checking > 0; i++) await new Promise((r) => setTimeout(r, 5))
    const second = await c.lookup.lookup(c.chain)
    expect(first.present).toBeGreaterThan(3) // the search alone inferred it present
    expect(second.present).toBe(3)
  })

  it('a repeated lookup of a chain is all cache; sizes asked later are still exact', async () => {
    const c = await chain(500, () => true)
    const first = await c.lookup.lookup(c.chain)
    expect(first.present).toBe(500)
    expect(first.storeRequests).toBeGreaterThan(0)
    expect(first.storeRequests).toBeLessThan(100)
    const again = await c.lookup.lookup(c.chain)
    expect([again.present, again.storeRequests]).toEqual([500, 0])
    // Chunks answered present by inference have no size to give out.
    const inferred = c.names.findIndex((n) => c.lookup.cached(n) === undefined)
    expect(inferred).toBeGreaterThanOrEqual(0)
    const withSizes = await c.lookup.lookup(c.chain, { sizes: true })
    expect(withSizes.sizes).toEqual(Array.from({ length: 500 }, (_, i) => i + 1))
    expect(withSizes.storeRequests).toBeGreaterThan(0)
    expect(c.lookup.cached(c.names[inferred]!)).toBe(inferred + 1)
  })

  it('returns exact sizes and stops at a hole', async () => {
    const c = await chain(100, (i) => i !== 40)
    const r = await c.lookup.lookup(c.chain, { sizes: true })
    expect(r.present).toBe(40)
    expect(r.sizes).toEqual(Array.from({ length: 40 }, (_, i) => i + 1))
  })

  it("a key sharing another's cache slot (same first 40 bits) is never answered from the other's entry", async () => {
    const c = await chain(1, () => true)
    const a = c.chain.keys[0]!
    expect((await c.lookup.lookup(c.chain)).present).toBe(1)
    expect(c.lookup.cached(c.names[0]!)).toBe(1)
    // Same slot, another key, not stored: a probe, and absent.
    const b = a.slice(0, 10) + (a[10] === '0' ? '1' : '0') + a.slice(11)
    const other = { base: c.chain.base, keys: [b] }
    const r = await c.lookup.lookup(other)
    expect([r.present, r.storeRequests]).toEqual([0, 1])
    expect(c.lookup.cached(chainName(c.chain.base, b))).toBeUndefined()
    // The same key under another namespace is another object.
    const r2 = await c.lookup.lookup({ base: 'p/other/', keys: [a] })
    expect([r2.present, r2.storeRequests]).toEqual([0, 1])
    expect(c.lookup.cached(chainName('p/other/', a))).toBeUndefined()
    // Storing the slot's other key takes the slot; the first key is then a probe again, still exact.
    await c.store.putIfAbsent(chainName(c.chain.base, b), new Uint8Array(7), 7)
    c.lookup.remember(chainName(c.chain.base, b), 7)
    expect(c.lookup.cached(chainName(c.chain.base, b))).toBe(7)
    expect(c.lookup.cached(c.names[0]!)).toBeUndefined()
    const again = await c.lookup.lookup(c.chain, { sizes: true })
    expect([again.present, again.sizes]).toEqual([1, [1]])
  })

  it('a read that misses invalidates only its own name, not a slot-sharing one', async () => {
    const c = await chain(3, () => true)
    expect((await c.lookup.lookup(c.chain, { sizes: true })).present).toBe(3)
    const a = c.chain.keys[1]!
    const twin = chainName(c.chain.base, a.slice(0, 10) + (a[10] === '0' ? '1' : '0') + a.slice(11))
    expect(c.lookup.invalidateFrom(twin)).toBe(0)
    expect(c.lookup.cached(c.names[1]!)).toBe(2)
    expect(c.lookup.invalidateFrom(c.names[1]!)).toBe(2) // it and the key after it
    expect(c.lookup.cached(c.names[0]!)).toBe(1)
    expect(c.lookup.cached(c.names[2]!)).toBeUndefined()
  })

  it('object names split back into base and key exactly as objectName builds them', () => {
    const key = createHash('sha256').update('k').digest('hex')
    for (const [prefix, base] of [
      ['', 'ns1/'],
      ['a/b', 'a/b/ns1/'],
    ] as const) {
      const name = objectName(prefix, 'ns1', key)
      expect(chainName(base, key)).toBe(name)
      expect(splitChainName(name)).toEqual({ base, key })
    }
    for (const bad of [
      'x',
      `ns1/${key.slice(0, 2)}/${key.slice(1)}`,
      `ns1/zz/${key}`,
      `ns1/${key.slice(0, 2)}/${key.toUpperCase()}`,
      `ns1${key.slice(0, 2)}/${key}x`,
      `${key.slice(0, 2)}/${key}`,
    ])
      expect(splitChainName(bad), bad).toBeUndefined()
  })

  it('rejects bad options with a TypeError', () => {
    const store = new MemoryStore()
    expect(() => new ChainLookup(store, new GatewayMetrics(), { fanout: 1 })).toThrow(TypeError)
    expect(() => new ChainLookup(store, new GatewayMetrics(), { concurrency: 0 })).toThrow(TypeError)
  })
})

describe('assertKeysHex', () => {
  const good = Array.from({ length: 40 }, (_, i) => createHash('sha256').update(String(i)).digest('hex'))
  it('accepts lowercase 64-hex keys and rejects any other element, naming it', () => {
    expect(assertKeysHex(good)).toBe(good)
    expect(assertKeysHex([])).toEqual([])
    const cases: [unknown, RegExp][] = [
      [good[3]!.toUpperCase(), /invalid chunk key "[0-9A-F]{64}"/],
      [`${good[3]!.slice(0, 63)}g`, /invalid chunk key/],
      [`${good[3]!.slice(0, 63)}é`, /invalid chunk key/],
      [`${good[3]!.slice(0, 62)}Ab`, /invalid chunk key/],
      [good[3]!.slice(1), /invalid chunk key/],
      [`${good[3]}0`, /invalid chunk key/],
      [` ${good[3]!.slice(1)}`, /invalid chunk key/],
      [7, /invalid chunk key number/],
      [null, /invalid chunk key object/],
    ]
    for (const [bad, msg] of cases)
      for (const at of [0, 17, 39]) {
        const keys: unknown[] = [...good]
        keys[at] = bad
        expect(() => assertKeysHex(keys), `${String(bad)} at ${at}`).toThrow(msg)
      }
  })
})

describe('metrics text', () => {
  it('renders counters and histograms in Prometheus exposition format', () => {
    const m = new GatewayMetrics()
    m.requests.inc({ route: '/x', method: 'GET', status: '200' })
    m.storeSeconds.observe(0.003, { op: 'get', store: 's3' })
    m.errors.inc({ code: 'a"b' })
    const t = m.render()
    expect(t).toContain('# TYPE kvgate_http_requests_total counter')
    expect(t).toContain('kvgate_http_requests_total{method="GET",route="/x",status="200"} 1')
    expect(t).toContain('kvgate_store_op_seconds_bucket{op="get",store="s3",le="0.0025"} 0')
    expect(t).toContain('kvgate_store_op_seconds_bucket{op="get",store="s3",le="0.005"} 1')
    expect(t).toContain('kvgate_store_op_seconds_count{op="get",store="s3"} 1')
    expect(t).toContain('kvgate_errors_total{code="a\\"b"} 1')
  })
})

describe('checkedStream: the pace a GET reader must keep', () => {
  const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms))
  /** `n` pieces of `size` bytes, each after `delayMs` (the store's pace); records a cancel. */
  function source(n: number, size: number, delayMs: number) {
    const seen = { cancelled: undefined as unknown, sent: 0 }
    const src = new ReadableStream<Uint8Array>({
      async pull(c) {
        if (delayMs) await sleep(delayMs)
        if (seen.sent === n) return c.close()
        c.enqueue(new Uint8Array(size).fill(seen.sent++ & 0xff))
      },
      cancel(reason) {
        seen.cancelled = reason
      },
    })
    return { src, seen }
  }
  /** `src` behind checkedStream with this window and rate; `why` collects the cut-offs it reports. */
  function paced(src: ReadableStream<Uint8Array>, idleTimeoutMs: number, minBytesPerSecond: number) {
    const why: string[] = []
    const s = checkedStream(src, undefined, {
      idleTimeoutMs,
      minBytesPerSecond,
      onCorrupt: () => {},
      onCutOff: (w) => {
        why.push(w)
        return false
      },
    })
    return { s, why }
  }
  /** Reads `s` whole, waiting `delayMs` before each read (the client's pace). */
  async function drain(s: ReadableStream<Uint8Array>, delayMs: number): Promise<number> {
    const r = s.getReader()
    let bytes = 0
    for (;;) {
      if (delayMs) await sleep(delayMs)
      const { done, value } = await r.read()
      if (done) return bytes
      bytes += value.length
    }
  }

  it('cuts off a reader that trickles below minBytesPerSecond without idling, and releases the store stream', async () => {
    const { src, seen } = source(200, 16 * 1024, 0)
    const { s, why } = paced(src, 300, 1024 * 1024)
    // 16 KiB every 50 ms: 320 KB/s, never idle for 300 ms; 200 pieces would take 10 s.
    const t0 = Date.now()
    await expect(drain(s, 50)).rejects.toThrow(/reader takes less than 1048576 bytes\/s/)
    expect(Date.now() - t0).toBeLessThan(3000)
    expect(why).toEqual(['slow'])
    expect(seen.cancelled).toMatchObject({ code: 'ERR_TIMEOUT' })
  })

  it('does not count time spent waiting on the store: a slow store and an eager reader complete', async () => {
    const { src, seen } = source(12, 1024, 80) // 12 KiB at 12.5 KiB/s, a second in all
    const { s, why } = paced(src, 200, 1024 * 1024)
    expect(await drain(s, 0)).toBe(12 * 1024)
    expect(why).toEqual([])
    expect(seen.cancelled).toBeUndefined()
  })

  it('waits out a long store read without spinning its watchdog', async () => {
    vi.useFakeTimers({ toFake: ['setTimeout', 'clearTimeout', 'Date'] })
    try {
      // Two pieces at once, the third after 1 s: the store read begins with the window all but
      // spent (99 of 100 ms waited on the reader), and the window ends inside it.
      const delays = [0, 0, 1000]
      let n = 0
      const src = new ReadableStream<Uint8Array>({
        async pull(c) {
          if (n === delays.length) return c.close()
          const d = delays[n++]!
          if (d) await new Promise((r) => setTimeout(r, d))
          c.enqueue(new Uint8Array(1024))
        },
      })
      const s = checkedStream(src, undefined, {
        idleTimeoutMs: 100,
        minBytesPerSecond: 1024,
        onCorrupt: () => {},
      })
      const r = s.getReader()
      await vi.advanceTimersByTimeAsync(99)
      expect((await r.read()).value?.length).toBe(1024) // the store read of the third piece begins
      const spy = vi.spyOn(globalThis, 'setTimeout')
      await vi.advanceTimersByTimeAsync(1000)
      // An eighth of a window at the least: some 80 wake-ups in the second, not one a millisecond.
      expect(spy.mock.calls.length).toBeLessThan(150)
      spy.mockRestore()
      expect((await r.read()).value?.length).toBe(1024)
    } finally {
      vi.useRealTimers()
    }
  })

  it('never cuts off a reader that keeps the rate in pieces a window may hold only one of', async () => {
    vi.useFakeTimers({ toFake: ['setTimeout', 'clearTimeout', 'Date'] })
    try {
      // 64 KiB pieces taken every 600 ms: 107 KiB/s, above the 100 KiB/s asked, never idle for a
      // window (1 s). A window then holds one or two pieces given: one is 64 KiB/s.
      const { src, seen } = source(20, 64 * 1024, 0)
      const { s, why } = paced(src, 1000, 100 * 1024)
      const r = s.getReader()
      let bytes = 0
      for (;;) {
        await vi.advanceTimersByTimeAsync(600)
        const { done, value } = await r.read()
        if (done) break
        bytes += value.length
      }
      expect(why).toEqual([])
      expect(bytes).toBe(20 * 64 * 1024)
      expect(seen.cancelled).toBeUndefined()
    } finally {
      vi.useRealTimers()
    }
  })

  it('still cuts off a reader below the rate in pieces a window holds several of', async () => {
    vi.useFakeTimers({ toFake: ['setTimeout', 'clearTimeout', 'Date'] })
    try {
      // 16 KiB every 300 ms: 53 KiB/s, below the 100 KiB/s asked, never idle for a window.
      const { src, seen } = source(60, 16 * 1024, 0)
      const { s, why } = paced(src, 1000, 100 * 1024)
      const r = s.getReader()
      const done = (async () => {
        for (;;) {
          await sleep(300)
          if ((await r.read()).done) return
        }
      })()
      const failed = expect(done).rejects.toThrow(/reader takes less than/)
      for (let i = 0; i < 400 && why.length === 0; i++) await vi.advanceTimersByTimeAsync(100)
      await vi.advanceTimersByTimeAsync(1000)
      await failed
      expect(why).toEqual(['slow'])
      expect(seen.cancelled).toMatchObject({ code: 'ERR_TIMEOUT' })
    } finally {
      vi.useRealTimers()
    }
  })

  it('0 turns the rate off: the same trickle completes', async () => {
    const { src } = source(20, 16 * 1024, 0)
    const { s, why } = paced(src, 300, 0)
    expect(await drain(s, 50)).toBe(20 * 16 * 1024)
    expect(why).toEqual([])
  })
})

describe('resumedReader', () => {
  it('hands on the pieces read already, then the rest of the body; a cancel reaches the store body', async () => {
    const piece = (n: number) => new Uint8Array(4).fill(n)
    let cancelled: unknown
    let pulled = 0
    const src = new ReadableStream<Uint8Array>(
      {
        pull(c) {
          if (++pulled > 3) return c.close()
          c.enqueue(piece(pulled))
        },
        cancel(why) {
          cancelled = why
        },
      },
      { highWaterMark: 0 },
    )
    const reader = src.getReader()
    const head = [(await reader.read()).value!]
    const out = checkedStream(resumedReader(head, reader), undefined, {
      onCorrupt: () => {},
      idleTimeoutMs: 0,
    })
    expect(new Uint8Array(await new Response(out).arrayBuffer())).toEqual(
      new Uint8Array([...piece(1), ...piece(2), ...piece(3)]),
    )
    expect(head[0]!.length).toBe(0) // not kept once handed on
    // Cancelled before its head is out: the store body is cancelled with the reason.
    const src2 = new ReadableStream<Uint8Array>({
      cancel(why) {
        cancelled = why
      },
    })
    const r2 = resumedReader([piece(9)], src2.getReader())
    expect(await r2.read()).toEqual({ done: false, value: piece(9) })
    await r2.cancel('client gone')
    expect(cancelled).toBe('client gone')
  })
})
