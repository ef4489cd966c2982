// R2Store against an in-memory fake of the R2 binding that enforces R2's rules
// (conditional puts, known-length streams, multipart part sizes), for the paths the
// workerd suite cannot drive deterministically: races, aborts, stream failures.

import { afterEach, describe, expect, it } from 'vitest'
import { objectName } from '../src/core/keys.ts'
import { gatewayFromEnv } from '../src/gateway/adapters/workers.ts'
import { RangeNotSatisfiableError } from '../src/gateway/stores/errors.ts'
import {
  type R2BucketLike,
  type R2MultipartUploadLike,
  type R2ObjectBodyLike,
  type R2ObjectLike,
  type R2RangeLike,
  R2Store,
  type R2UploadedPartLike,
} from '../src/gateway/stores/r2.ts'
import { makeChunk } from './gateway-fixtures.ts'

const MIB = 1024 * 1024

async function drain(v: Uint8Array | ReadableStream<Uint8Array>): Promise<Uint8Array> {
  if (v instanceof Uint8Array) return v.slice()
  return new Uint8Array(await new Response(v).arrayBuffer())
}

class FakeR2 implements R2BucketLike {
  readonly objects = new Map<string, Uint8Array>()
  readonly ops: string[] = []
  uploads = 0
  aborted = 0
  /** Runs after each uploaded part (to simulate a concurrent writer). */
  onPart?: (key: string, partNumber: number) => void

  async get(key: string, options?: { range?: R2RangeLike }): Promise<R2ObjectBodyLike | null> {
    this.ops.push('get')
    const bytes = this.objects.get(key)
    if (!bytes) return null
    let slice = bytes
    const r = options?.range
    if (r) {
      const offset = 'suffix' in r ? Math.max(0, bytes.length - r.suffix) : r.offset
      const length = 'suffix' in r ? bytes.length - offset : (r.length ?? bytes.length - offset)
      // Like R2: a range starting past the end is an error, not an empty body.
      if (offset >= bytes.length) throw new Error('get: The requested range is not satisfiable (10039)')
      slice = bytes.subarray(offset, offset + length)
    }
    return {
      key,
      size: bytes.length,
      etag: 'e',
      body: new Response(slice as Uint8Array<ArrayBuffer>).body as ReadableStream<Uint8Array>,
    }
  }

  async head(key: string): Promise<R2ObjectLike | null> {
    this.ops.push('head')
    const bytes = this.objects.get(key)
    return bytes ? { key, size: bytes.length, etag: 'e' } : null
  }

  async put(
    key: string,
    value: Uint8Array | ReadableStream<Uint8Array>,
    options?: { onlyIf?: { etagDoesNotMatch?: string } },
  ): Promise<R2ObjectLike | null> {
    this.ops.push('put')
    if (!(value instanceof Uint8Array) && !(value as { knownLength?: boolean }).knownLength) {
      throw new TypeError('Provided readable stream must have a known length')
    }
    if (options?.onlyIf?.etagDoesNotMatch === '*' && this.objects.has(key)) {
      // Answer before reading the body, as R2 may.
      return null
    }
    const bytes = await drain(value)
    if (options?.onlyIf?.etagDoesNotMatch === '*' && this.objects.has(key)) return null
    this.objects.set(key, bytes)
    return { key, size: bytes.length, etag: 'e' }
  }

  async delete(keys: string | string[]): Promise<void> {
    this.ops.push('delete')
    for (const k of Array.isArray(keys) ? keys : [keys]) this.objects.delete(k)
  }

  async list(options: { prefix?: string; cursor?: string; limit?: number } = {}) {
    this.ops.push('list')
    const names = [...this.objects.keys()]
      .filter((k) => k.startsWith(options.prefix ?? '') && (!options.cursor || k > options.cursor))
      .sort()
    const page = names.slice(0, options.limit ?? 1000)
    const truncated = names.length > page.length
    return {
      objects: page.map((k) => ({ key: k, size: this.objects.get(k)!.length, etag: 'e' })),
      truncated,
      ...(truncated ? { cursor: page[page.length - 1] } : {}),
    }
  }

  async createMultipartUpload(key: string): Promise<R2MultipartUploadLike> {
    this.ops.push('createMultipartUpload')
    this.uploads++
    const parts = new Map<number, Uint8Array>()
    let done = false
    return {
      uploadPart: async (partNumber, value): Promise<R2UploadedPartLike> => {
        if (done) throw new Error('upload is finished')
        parts.set(partNumber, await drain(value))
        this.onPart?.(key, partNumber)
        return { partNumber, etag: `p${partNumber}` }
      },
      complete: async (uploaded) => {
        done = true
        const sizes = uploaded.map((p) => parts.get(p.partNumber)!.length)
        // R2: every part but the last is ≥ 5 MiB and all of them are the same size.
        for (const s of sizes.slice(0, -1)) {
          if (s < 5 * MIB || s !== sizes[0]) throw new Error(`bad part sizes ${sizes}`)
        }
        const all = new Uint8Array(sizes.reduce((a, b) => a + b, 0))
        let o = 0
        for (const p of uploaded) {
          all.set(parts.get(p.partNumber)!, o)
          o += parts.get(p.partNumber)!.length
        }
        this.objects.set(key, all)
        return { key, size: all.length, etag: `m-${uploaded.length}` }
      },
      abort: async () => {
        done = true
        this.aborted++
      },
    }
  }
}

/** Stand-in for workerd's FixedLengthStream: errors when the byte count is off. */
class FakeFixedLengthStream {
  readonly readable: ReadableStream<Uint8Array>
  readonly writable: WritableStream<Uint8Array>
  constructor(length: number) {
    let seen = 0
    const t = new TransformStream<Uint8Array, Uint8Array>({
      transform(chunk, c) {
        seen += chunk.length
        if (seen > length) throw new TypeError('too many bytes for FixedLengthStream')
        c.enqueue(chunk)
      },
      flush() {
        if (seen !== length) throw new TypeError('FixedLengthStream ended early')
      },
    })
    this.readable = Object.assign(t.readable, { knownLength: true })
    this.writable = t.writable
  }
}

/** Buffer.equals: vitest's deep equality walks typed arrays key by key (seconds per MiB). */
function same(a: Uint8Array | undefined, b: Uint8Array): boolean {
  return (
    a !== undefined &&
    Buffer.from(a.buffer, a.byteOffset, a.length).equals(Buffer.from(b.buffer, b.byteOffset, b.length))
  )
}

function bytes(n: number, seed = 1): Uint8Array {
  const b = new Uint8Array(n)
  for (let i = 0; i < n; i++) b[i] = (i * 131 + seed) & 0xff
  return b
}

/** A stream delivering `data` in uneven pieces, optionally failing after `failAt` bytes. */
function streamOf(data: Uint8Array, piece = 1 * MIB + 7, failAt?: number): ReadableStream<Uint8Array> {
  let at = 0
  return new ReadableStream<Uint8Array>({
    pull(c) {
      if (failAt !== undefined && at >= failAt) {
        c.error(Object.assign(new Error('verification failed'), { code: 'ERR_FORMAT_CHECKSUM' }))
        return
      }
      if (at >= data.length) return c.close()
      c.enqueue(data.slice(at, at + piece))
      at += piece
    },
  })
}

const g = globalThis as { FixedLengthStream?: unknown }
afterEach(() => {
  delete g.FixedLengthStream
})

describe('R2Store', () => {
  it('refuses bad options and a missing binding', () => {
    expect(() => new R2Store(undefined as unknown as R2BucketLike)).toThrow(TypeError)
    expect(() => new R2Store(new FakeR2(), { partBytes: 4 * MIB })).toThrow(/at least/)
    expect(() => new R2Store(new FakeR2(), { partBytes: 8 * MIB, multipartThreshold: 6 * MIB })).toThrow(
      /multipartThreshold/,
    )
  })

  it('creates once with a conditional put (bytes and streams through FixedLengthStream)', async () => {
    g.FixedLengthStream = FakeFixedLengthStream
    const r2 = new FakeR2()
    const store = new R2Store(r2)
    const data = bytes(3 * MIB)
    expect(await store.putIfAbsent('k/a', data, data.length)).toBe('created')
    expect(await store.putIfAbsent('k/a', bytes(3 * MIB, 9), data.length)).toBe('exists')
    expect(same(r2.objects.get('k/a'), data)).toBe(true)
    expect(await store.putIfAbsent('k/b', streamOf(data), data.length)).toBe('created')
    expect(same(r2.objects.get('k/b'), data)).toBe(true)
    // An existing key answers without waiting for the rest of a slow body.
    expect(await store.putIfAbsent('k/b', streamOf(data), data.length)).toBe('exists')
    expect(r2.uploads).toBe(0)
  })

  it('a body that fails mid-stream surfaces its own error and stores nothing', async () => {
    g.FixedLengthStream = FakeFixedLengthStream
    const r2 = new FakeR2()
    const store = new R2Store(r2)
    const data = bytes(3 * MIB)
    await expect(
      store.putIfAbsent('k/x', streamOf(data, 256 * 1024, MIB), data.length),
    ).rejects.toMatchObject({
      code: 'ERR_FORMAT_CHECKSUM',
    })
    expect(r2.objects.has('k/x')).toBe(false)
  })

  it('a body shorter or longer than declared fails the put', async () => {
    g.FixedLengthStream = FakeFixedLengthStream
    const store = new R2Store(new FakeR2())
    await expect(store.putIfAbsent('k/s', streamOf(bytes(1000)), 2000)).rejects.toThrow()
    await expect(store.putIfAbsent('k/l', streamOf(bytes(3000)), 2000)).rejects.toThrow()
    await expect(store.putIfAbsent('k/u', bytes(10), 11)).rejects.toThrow(TypeError)
  })

  it('uploads large bodies in equal parts of partBytes, one part in memory at a time', async () => {
    const r2 = new FakeR2()
    const store = new R2Store(r2, { multipartThreshold: 6 * MIB, partBytes: 5 * MIB })
    const data = bytes(12 * MIB + 12345)
    expect(await store.putIfAbsent('k/big', streamOf(data), data.length)).toBe('created')
    expect(same(r2.objects.get('k/big'), data)).toBe(true)
    expect(r2.uploads).toBe(1)
    expect(r2.aborted).toBe(0)
    // A part boundary that falls exactly on a piece boundary works too.
    const exact = bytes(10 * MIB, 3)
    expect(await store.putIfAbsent('k/exact', streamOf(exact, MIB), exact.length)).toBe('created')
    expect(same(r2.objects.get('k/exact'), exact)).toBe(true)
  })

  it('multipart: an existing object short-circuits before any upload', async () => {
    const r2 = new FakeR2()
    r2.objects.set('k/big', bytes(10))
    const store = new R2Store(r2, { multipartThreshold: 6 * MIB, partBytes: 5 * MIB })
    const data = bytes(8 * MIB)
    expect(await store.putIfAbsent('k/big', streamOf(data), data.length)).toBe('exists')
    expect(r2.uploads).toBe(0)
    expect(same(r2.objects.get('k/big'), bytes(10))).toBe(true)
  })

  it('multipart: a writer that loses the race aborts and leaves the winner in place', async () => {
    const r2 = new FakeR2()
    const winner = bytes(100, 5)
    r2.onPart = (key, n) => {
      if (n === 1) r2.objects.set(key, winner)
    }
    const store = new R2Store(r2, { multipartThreshold: 6 * MIB, partBytes: 5 * MIB })
    const data = bytes(11 * MIB)
    expect(await store.putIfAbsent('k/race', streamOf(data), data.length)).toBe('exists')
    expect(r2.aborted).toBe(1)
    expect(same(r2.objects.get('k/race'), winner)).toBe(true)
  })

  it('multipart: a failing body aborts the upload and stores nothing', async () => {
    const r2 = new FakeR2()
    const store = new R2Store(r2, { multipartThreshold: 6 * MIB, partBytes: 5 * MIB })
    const data = bytes(12 * MIB)
    await expect(store.putIfAbsent('k/bad', streamOf(data, MIB, 7 * MIB), data.length)).rejects.toMatchObject(
      {
        code: 'ERR_FORMAT_CHECKSUM',
      },
    )
    expect(r2.aborted).toBe(1)
    expect(r2.objects.has('k/bad')).toBe(false)
    await expect(
      store.putIfAbsent('k/short', streamOf(data.subarray(0, 9 * MIB)), data.length),
    ).rejects.toThrow(/ended at/)
    expect(r2.objects.has('k/short')).toBe(false)
  })

  it('gets whole objects and ranges; 416 past the end; undefined when absent', async () => {
    const r2 = new FakeR2()
    const data = bytes(5000)
    r2.objects.set('k/r', data)
    const store = new R2Store(r2)
    const whole = await store.get('k/r')
    expect(whole).toMatchObject({ size: 5000, offset: 0, length: 5000 })
    expect(same(await drain(whole!.body), data)).toBe(true)
    const mid = await store.get('k/r', { range: { offset: 100, length: 50 } })
    expect(mid).toMatchObject({ size: 5000, offset: 100, length: 50 })
    expect(same(await drain(mid!.body), data.subarray(100, 150))).toBe(true)
    const tail = await store.get('k/r', { range: { suffix: 10 } })
    expect(tail).toMatchObject({ offset: 4990, length: 10 })
    expect(same(await drain(tail!.body), data.subarray(4990))).toBe(true)
    const open = await store.get('k/r', { range: { offset: 4000 } })
    expect(open).toMatchObject({ offset: 4000, length: 1000 })
    await open!.body.cancel()
    await expect(store.get('k/r', { range: { offset: 5000 } })).rejects.toBeInstanceOf(
      RangeNotSatisfiableError,
    )
    expect(await store.get('k/none')).toBeUndefined()
    expect(await store.get('k/none', { range: { offset: 5 } })).toBeUndefined()
  })

  it('delete says whether the object existed; list pages in name order', async () => {
    const r2 = new FakeR2()
    for (const n of ['p/c', 'p/a', 'p/b', 'q/a']) r2.objects.set(n, bytes(n.length))
    const store = new R2Store(r2)
    expect(await store.delete('p/none')).toBe(false)
    expect(await store.delete('q/a')).toBe(true)
    expect(r2.objects.has('q/a')).toBe(false)
    const first = await store.list('p/', { limit: 2 })
    expect(first.entries.map((e) => e.name)).toEqual(['p/a', 'p/b'])
    const second = await store.list('p/', { limit: 2, cursor: first.cursor })
    expect(second).toEqual({ entries: [{ name: 'p/c', size: 3 }] })
  })

  it('delete with ifMatch keeps another version (the binding has no condition: checked by HEAD)', async () => {
    const r2 = new FakeR2()
    r2.objects.set('k/v', bytes(10))
    const store = new R2Store(r2)
    expect(await store.delete('k/v', { ifMatch: 'an-older-version' })).toBe(false)
    expect(r2.objects.has('k/v')).toBe(true)
    expect(await store.delete('k/v', { ifMatch: (await store.head('k/v'))!.etag })).toBe(true)
    expect(r2.objects.has('k/v')).toBe(false)
  })

  it('maps binding failures to StoreError (502), keeping the cause', async () => {
    const r2 = new FakeR2()
    r2.head = async () => {
      throw new Error('network connection lost')
    }
    const store = new R2Store(r2)
    await expect(store.head('k/a')).rejects.toMatchObject({ code: 'ERR_STORE', status: 502 })
  })

  it('Worker gateway: a Range GET reads no header only to tag its 206; one whose header read fails is served untagged', async () => {
    const r2 = new FakeR2()
    const c = makeChunk({ layers: 6, sectionBytes: 100 })
    r2.objects.set(objectName('kv', 'a', c.key), c.bytes)
    const url = `https://gw.example/v1/ns/a/chunks/${c.key}`
    const worker = () => gatewayFromEnv({ KVGATE_BUCKET: r2, KVGATE_AUTH: 'disabled' })
    const etag = (await worker().request(url, { method: 'HEAD' })).headers.get('etag')!
    expect(etag).toMatch(/^"kv1-/)
    const get = r2.get.bind(r2)
    const ranges: string[] = []
    let failing = false
    r2.get = async (key, options) => {
      const r = options?.range
      ranges.push(r ? JSON.stringify(r) : 'whole')
      if (failing && r && 'offset' in r && r.offset === 0) throw new Error('network connection lost')
      return get(key, options)
    }
    const plain = await worker().request(url, { headers: { range: 'bytes=100-199' } })
    expect([plain.status, plain.headers.get('etag')]).toEqual([206, null])
    expect(await drain(plain.body!)).toEqual(c.bytes.subarray(100, 200))
    expect(ranges).toEqual([JSON.stringify({ offset: 100, length: 100 })])
    failing = true
    const nm = await worker().request(url, { headers: { range: 'bytes=100-199', 'if-none-match': etag } })
    expect([nm.status, nm.headers.get('etag')]).toEqual([206, null])
    expect(await drain(nm.body!)).toEqual(c.bytes.subarray(100, 200))
  })
})
