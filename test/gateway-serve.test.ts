// `kvgate serve`: config layering (file < env < flags), the no-auth bind guard,
// and a real process on the fs store whose data survives a restart.

import { type ChildProcess, execFileSync, spawn, spawnSync } from 'node:child_process'
import { mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { createInterface } from 'node:readline'
import { afterAll, describe, expect, it } from 'vitest'
import { resolveServeConfig, settingsFromEnv, settingsFromFile } from '../src/gateway/config.ts'
import { createGateway } from '../src/gateway/index.ts'
import { FsStore } from '../src/gateway/node.ts'
import { makeChunk, putInit } from './gateway-fixtures.ts'

const tmp = mkdtempSync(join(tmpdir(), 'kvgate-serve-'))
afterAll(() => rmSync(tmp, { recursive: true, force: true }))
const HASH = 'a'.repeat(64)

describe('serve config', () => {
  it('defaults to the fs store on 127.0.0.1:8787 with auth off', () => {
    const c = resolveServeConfig()
    expect(c).toMatchObject({
      host: '127.0.0.1',
      port: 8787,
      store: { kind: 'fs', dir: './.kvgate/store' },
      tokens: [],
    })
  })

  it('env overrides the file, flags override env', () => {
    const file = join(tmp, 'kvgate.yaml')
    writeFileSync(
      file,
      `port: 9000\nprefix: fromfile\nstore:\n  kind: s3\n  s3: { bucket: b1, endpoint: http://x:1 }\nauth:\n  tokens:\n    - { sha256: ${HASH}, scopes: read, namespaces: [a] }\n`,
    )
    const fromFile = settingsFromFile(file)
    const env = settingsFromEnv({ KVGATE_PORT: '9100', KVGATE_S3_BUCKET: 'b2', KVGATE_LOG: 'warn' })
    const c = resolveServeConfig(fromFile, env, { port: '9200' })
    expect(c.port).toBe(9200)
    expect(c.prefix).toBe('fromfile')
    expect(c.store).toMatchObject({ kind: 's3', bucket: 'b2', endpoint: 'http://x:1' })
    expect(c.log).toBe('warn')
    expect(c.tokens).toHaveLength(1)
  })

  it('redirects large S3 GETs to presigned URLs by default; never for fs; off on request', () => {
    const s3 = { store: 's3', s3Bucket: 'b', s3Endpoint: 'http://x:1' } as const
    expect(resolveServeConfig(s3).presign).toEqual({ minBytes: 8 * 1024 * 1024, expiresSeconds: 60 })
    expect(resolveServeConfig({ ...s3, presignMinBytes: 'off' }).presign).toBeUndefined()
    expect(resolveServeConfig({ ...s3, presignMinBytes: '1024' }).presign?.minBytes).toBe(1024)
    expect(resolveServeConfig().presign).toBeUndefined()
    expect(
      resolveServeConfig(
        settingsFromEnv({ KVGATE_STORE: 's3', KVGATE_S3_BUCKET: 'b', KVGATE_PRESIGN_MIN_BYTES: 'off' }),
      ).presign,
    ).toBeUndefined()
  })

  it('refuses a non-loopback bind without tokens unless --insecure', () => {
    expect(() => resolveServeConfig({ host: '0.0.0.0' })).toThrow(/refusing/)
    expect(resolveServeConfig({ host: '0.0.0.0', insecure: true }).host).toBe('0.0.0.0')
    const tokens = JSON.stringify([{ sha256: HASH, scopes: 'admin', namespaces: '*' }])
    expect(
      resolveServeConfig({ host: '0.0.0.0' }, settingsFromEnv({ KVGATE_TOKENS: tokens })).tokens,
    ).toHaveLength(1)
  })

  it('takes the healing and slow-client limits from env, file and flags', () => {
    const d = resolveServeConfig()
    expect(d).toMatchObject({
      presenceTtlMs: 30_000,
      bodyIdleTimeoutMs: 30_000,
      readerIdleTimeoutMs: 30_000,
      maxInFlightBytes: 1024 ** 3,
      maxConnections: 1024,
      maxConcurrentVerifies: 4,
      maxCalibrationBytes: 16 * 1024 * 1024,
      coalesceMaxBufferedBytes: 64 * 1024 * 1024,
    })
    expect(d.presenceTtlMs).toBeLessThanOrEqual(60_000)
    expect(
      resolveServeConfig(settingsFromEnv({ KVGATE_MAX_CALIBRATION_BYTES: '1MiB' })).maxCalibrationBytes,
    ).toBe(1024 * 1024)
    expect(() => resolveServeConfig(settingsFromEnv({ KVGATE_MAX_CALIBRATION_BYTES: '4' }))).toThrow()
    expect(() => resolveServeConfig(settingsFromEnv({ KVGATE_MAX_CALIBRATION_BYTES: 'lots' }))).toThrow()
    const file = join(tmp, 'limits.yaml')
    writeFileSync(file, 'presenceTtlMs: 5000\nmaxConnections: 10\n')
    const c = resolveServeConfig(
      settingsFromFile(file),
      settingsFromEnv({ KVGATE_READER_IDLE_TIMEOUT_MS: '700', KVGATE_MAX_CONNECTIONS: '20' }),
      { maxInFlightBytes: '1048576' },
    )
    expect(c).toMatchObject({
      presenceTtlMs: 5000,
      readerIdleTimeoutMs: 700,
      maxConnections: 20,
      maxInFlightBytes: 1048576,
    })
  })

  it('takes readerMinBytesPerSecond from env, file and flags (0: off) and refuses bad values', () => {
    expect(resolveServeConfig().readerMinBytesPerSecond).toBe(64 * 1024)
    const env = (v: string) => settingsFromEnv({ KVGATE_READER_MIN_BYTES_PER_SECOND: v })
    expect(resolveServeConfig(env('256KiB')).readerMinBytesPerSecond).toBe(256 * 1024)
    expect(resolveServeConfig(env('0')).readerMinBytesPerSecond).toBe(0)
    const file = join(tmp, 'reader-rate.yaml')
    writeFileSync(file, 'readerMinBytesPerSecond: 1MiB\n')
    expect(resolveServeConfig(settingsFromFile(file)).readerMinBytesPerSecond).toBe(1024 * 1024)
    expect(
      resolveServeConfig(settingsFromFile(file), env('2048'), { readerMinBytesPerSecond: '4096' })
        .readerMinBytesPerSecond,
    ).toBe(4096)
    for (const bad of ['fast', '-1', '1e9', '2GiB'])
      expect(() => resolveServeConfig(env(bad)), bad).toThrow(expect.objectContaining({ code: 'ERR_CONFIG' }))
    writeFileSync(file, 'readerMinBytesPerSecond: [1]\n')
    expect(() => resolveServeConfig(settingsFromFile(file))).toThrow(
      expect.objectContaining({ code: 'ERR_CONFIG' }),
    )
    // The library option: 0 is off, a fraction or a negative rate is refused at start.
    const store = { get: async () => undefined } as never
    expect(
      createGateway({ store, limits: { readerMinBytesPerSecond: 0 } }).state.limits.readerMinBytesPerSecond,
    ).toBe(0)
    expect(createGateway({ store }).state.limits.readerMinBytesPerSecond).toBe(64 * 1024)
    for (const bad of [-1, 1.5, Number.NaN])
      expect(() => createGateway({ store, limits: { readerMinBytesPerSecond: bad } })).toThrow(
        /limits\.readerMinBytesPerSecond/,
      )
  })

  it('rejects bad values with a ConfigError', () => {
    for (const bad of [
      { port: 'abc' },
      { port: 70000 },
      { store: 'ftp' },
      { store: 's3' },
      { log: 'loud' },
      { tokens: 'not json' },
      { tokens: [{ sha256: 'short', scopes: 'read', namespaces: '*' }] as never },
      { presenceTtlMs: 0 },
      { readerIdleTimeoutMs: 'soon' },
      { maxConnections: -1 },
      { maxInFlightBytes: '1e9' },
      { prefix: '..' },
      { prefix: 'kv/../x' },
      { prefix: 'kv prefix' },
    ]) {
      expect(() => resolveServeConfig(bad), JSON.stringify(bad)).toThrow(
        expect.objectContaining({ code: 'ERR_CONFIG' }),
      )
    }
  })
})

function startServe(args: string[]): Promise<{ proc: ChildProcess; url: string; lines: string[] }> {
  const main = new URL('../src/cli/main.ts', import.meta.url).pathname
  const proc = spawn(process.execPath, ['--import', 'tsx', main, 'serve', '--port', '0', ...args], {
    stdio: ['ignore', 'pipe', 'pipe'],
    env: { ...process.env, KVGATE_CONFIG: '' },
  })
  const lines: string[] = []
  return new Promise((resolve, reject) => {
    const rl = createInterface({ input: proc.stdout! })
    rl.on('line', (l) => {
      lines.push(l)
      const j = JSON.parse(l) as { msg?: string; url?: string }
      if (j.msg === 'listening') resolve({ proc, url: j.url!, lines })
    })
    proc.once('exit', (code) => reject(new Error(`serve exited with ${code}`)))
  })
}

const stop = (p: ChildProcess) =>
  new Promise<number | null>((r) => {
    p.once('exit', r)
    p.kill('SIGTERM')
  })

describe('kvgate serve process', () => {
  it('serves the fs store, logs one JSON line per request, and keeps data across restarts', async () => {
    const dir = join(tmp, 'store')
    const c = makeChunk()
    const a = await startServe(['--dir', dir])
    try {
      expect((await fetch(`${a.url}/v1/ns/demo/chunks/${c.key}`, putInit(c.bytes))).status).toBe(201)
      expect((await fetch(`${a.url}/healthz`)).status).toBe(200)
      await new Promise((r) => setTimeout(r, 100))
      const reqLines = a.lines.map((l) => JSON.parse(l)).filter((j) => j.route)
      expect(reqLines[0]).toMatchObject({
        level: 'info',
        method: 'PUT',
        status: 201,
        ns: 'demo',
        bytes: c.bytes.length,
      })
    } finally {
      expect(await stop(a.proc)).toBe(0)
    }
    const b = await startServe(['--dir', dir])
    try {
      const g = await fetch(`${b.url}/v1/ns/demo/chunks/${c.key}`)
      expect(g.status).toBe(200)
      expect(new Uint8Array(await g.arrayBuffer())).toEqual(c.bytes)
    } finally {
      await stop(b.proc)
    }
  })

  it('--help prints usage and exits 0', async () => {
    const main = new URL('../src/cli/main.ts', import.meta.url).pathname
    const p = spawn(process.execPath, ['--import', 'tsx', main, 'serve', '--help'], {
      stdio: ['ignore', 'pipe', 'inherit'],
    })
    let out = ''
    p.stdout!.on('data', (d) => (out += d))
    const code = await new Promise((r) => p.once('exit', r))
    expect(code).toBe(0)
    expect(out).toMatch(/Usage: kvgate serve/)
    expect(out).toMatch(/KVGATE_S3_BUCKET/)
  })
})

describe('fs store', () => {
  it('is create-only under concurrent writers and leaves no temp files', async () => {
    const store = await new FsStore({ root: join(tmp, 'fs1') }).open()
    const bodies = Array.from({ length: 8 }, (_, i) => new Uint8Array(1000).fill(i))
    const res = await Promise.all(bodies.map((b) => store.putIfAbsent('p/ab/obj', b, b.length)))
    expect(res.filter((r) => r === 'created')).toHaveLength(1)
    const winner = res.indexOf('created')
    const got = await store.get('p/ab/obj')
    expect(new Uint8Array(await new Response(got!.body).arrayBuffer())).toEqual(bodies[winner])
    expect((await store.list('')).entries).toEqual([
      { name: 'p/ab/obj', size: 1000, modified: expect.any(Number) },
    ])
  })

  it('a failed body leaves nothing; ranges work; unsafe names are refused', async () => {
    const store = await new FsStore({ root: join(tmp, 'fs2') }).open()
    const broken = new ReadableStream<Uint8Array>({
      start(c) {
        c.enqueue(new Uint8Array(10))
        c.error(new Error('gone'))
      },
    })
    await expect(store.putIfAbsent('x/y', broken, 100)).rejects.toThrow('gone')
    await expect(store.putIfAbsent('x/y', new Uint8Array(5), 6)).rejects.toThrow()
    expect(await store.stats()).toEqual({ objects: 0, bytes: 0 })
    const bytes = Uint8Array.from({ length: 100 }, (_, i) => i)
    await store.putIfAbsent('x/y', bytes, 100)
    const r = await store.get('x/y', { range: { suffix: 10 } })
    expect(new Uint8Array(await new Response(r!.body).arrayBuffer())).toEqual(bytes.subarray(90))
    await expect(store.get('x/y', { range: { offset: 100 } })).rejects.toMatchObject({ status: 416 })
    for (const bad of ['../etc/passwd', '/abs', 'a/../../b', 'a//b', 'a/.tmp-x']) {
      await expect(store.get(bad)).rejects.toMatchObject({ code: 'ERR_INVALID_ARGUMENT' })
    }
  })
})

// A small tmpfs fills up for real (needs root and mount); elsewhere the test is skipped.
const full = join(tmp, 'full')
const canMount = (() => {
  if (process.getuid?.() !== 0) return false
  try {
    mkdirSync(full)
    execFileSync('mount', ['-t', 'tmpfs', '-o', 'size=256k', 'tmpfs', full], { stdio: 'ignore' })
    return true
  } catch {
    return false
  }
})()
afterAll(() => {
  if (canMount) execFileSync('umount', [full], { stdio: 'ignore' })
})

describe.skipIf(!canMount)('fs store on a full disk', () => {
  it('answers 507 ERR_STORE_FULL (response, log, status page) and leaves nothing partial', async () => {
    const store = await new FsStore({ root: full }).open()
    const logs: Record<string, unknown>[] = []
    const app = createGateway({ store, logger: (e) => logs.push(e) })
    const c = makeChunk({ layers: 4, sectionBytes: 128 * 1024 })
    const r = await app.request(`/v1/ns/a/chunks/${c.key}`, putInit(c.bytes))
    expect(r.status).toBe(507)
    expect(((await r.json()) as { error: { code: string } }).error.code).toBe('ERR_STORE_FULL')
    expect(logs.at(-1)).toMatchObject({ status: 507, code: 'ERR_STORE_FULL' })
    const status = (await (await app.request('/', { headers: { accept: 'application/json' } })).json()) as {
      recentErrors: { code: string }[]
    }
    expect(status.recentErrors.map((e) => e.code)).toContain('ERR_STORE_FULL')
    const left = execFileSync('find', [full, '-type', 'f']).toString().trim()
    expect(left).toBe('')
    // A chunk that fits is still stored.
    const small = makeChunk({ layers: 2, sectionBytes: 1024 })
    expect((await app.request(`/v1/ns/a/chunks/${small.key}`, putInit(small.bytes))).status).toBe(201)
  })
})

// Which directories a create-only write fsyncs, seen by strace in a child process.
const hasStrace = (() => {
  try {
    execFileSync('strace', ['-V'], { stdio: 'ignore' })
    return true
  } catch {
    return false
  }
})()

describe.skipIf(!hasStrace)('fs store durability', () => {
  it('fsyncs the file, its directory and the parent of every directory mkdir -p created', () => {
    const root = join(tmp, 'durable')
    mkdirSync(root)
    const store = new URL('../src/gateway/stores/fs.ts', import.meta.url).pathname
    const script = `const { FsStore } = await import(${JSON.stringify(store)});
const s = await new FsStore({ root: ${JSON.stringify(root)} }).open();
await s.putIfAbsent('kvgate/ns/ab/obj', new Uint8Array(100), 100);`
    const r = spawnSync(
      'strace',
      [
        '-f',
        '-qq',
        '-e',
        'trace=openat,fsync',
        process.execPath,
        '--import',
        'tsx',
        '--input-type=module',
        '-e',
        script,
      ],
      { encoding: 'utf8', cwd: new URL('..', import.meta.url).pathname },
    )
    expect(r.status).toBe(0)
    // fd → path as opened, so each fsync names what it flushed.
    const fds = new Map<string, string>()
    const synced = new Set<string>()
    for (const line of r.stderr.split('\n')) {
      const open = /openat\(AT_FDCWD, "([^"]+)",.*\) = (\d+)$/.exec(line)
      if (open) fds.set(open[2]!, open[1]!)
      const sync = /fsync\((\d+)\)\s+= 0/.exec(line)
      if (sync && fds.has(sync[1]!)) synced.add(fds.get(sync[1]!)!)
    }
    for (const dir of ['kvgate/ns/ab', 'kvgate/ns', 'kvgate', '']) {
      expect(synced, dir).toContain(join(root, dir))
    }
  })
})
