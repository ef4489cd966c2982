// kvgate as a user gets it: `npm pack`, the tarball installed into a fresh app from the
// npm cache (offline), every entry imported by plain Node, a strict TypeScript consumer, the CLI run from the app.

import { execFile, spawn, spawnSync } from 'node:child_process'
import {
  copyFileSync,
  cpSync,
  existsSync,
  mkdtempSync,
  readFileSync,
  rmSync,
  statSync,
  writeFileSync,
} from 'node:fs'
import { tmpdir } from 'node:os'
import { join, resolve } from 'node:path'
import { createInterface } from 'node:readline'
import { promisify } from 'node:util'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { crc32 } from '../src/core/checksum.ts'

const exec = promisify(execFile)
const repo = resolve(import.meta.dirname, '..')
const work = mkdtempSync(join(tmpdir(), 'kvgate-package-'))
const app = join(work, 'app')
let tarball = ''
let packedFiles: string[] = []
/** The checkout's built CLI's mode, read as the build left it (before any npm run could chmod it). */
let checkoutBinMode = 0

// npm's own variables from a surrounding `npm test` must not leak into the nested npm runs.
const cleanEnv = Object.fromEntries(
  Object.entries(process.env).filter(([k]) => !k.toLowerCase().startsWith('npm_')),
)

/** Debian's Python with msgpack (the connector's agent client needs it) and pip + setuptools (to install it), or not. */
const PYTHON = '/usr/bin/python3'
const pythonClient = (() => {
  try {
    return (
      spawnSync(PYTHON, ['-c', 'import msgpack, setuptools'], { encoding: 'utf8' }).status === 0 &&
      spawnSync(PYTHON, ['-m', 'pip', '--version'], { encoding: 'utf8' }).status === 0
    )
  } catch {
    return false
  }
})()
if (!pythonClient)
  console.warn(
    `skipping the agent-from-the-app test: ${PYTHON} with python3-msgpack, pip and setuptools is not installed`,
  )

async function run(cmd: string, args: string[], cwd: string, env: NodeJS.ProcessEnv = cleanEnv) {
  try {
    return await exec(cmd, args, { cwd, env, encoding: 'utf8', maxBuffer: 64 << 20 })
  } catch (e) {
    const err = e as { stdout?: string; stderr?: string; message: string }
    throw new Error(
      `${cmd} ${args.join(' ')} failed: ${err.message}\n${err.stdout ?? ''}\n${err.stderr ?? ''}`,
    )
  }
}

/**
 * The app's lockfile, from the repo's: kvgate's runtime dependencies at the versions the repo
 * pinned, so `npm install --offline` needs nothing but the cache (no registry metadata).
 */
function appLockfile(tgz: string): object {
  const lock = JSON.parse(readFileSync(join(repo, 'package-lock.json'), 'utf8')) as {
    packages: Record<string, Record<string, unknown>>
  }
  const me = lock.packages['']!
  const keep = (k: string, v: Record<string, unknown>) =>
    v.dev !== true || k === 'node_modules/@types/node' || k === 'node_modules/undici-types'
  const packages: Record<string, unknown> = {}
  for (const [k, v] of Object.entries(lock.packages)) {
    if (k === '' || !keep(k, v)) continue
    const entry = { ...v }
    delete entry.dev
    delete entry.devOptional
    if (entry.resolved === undefined && entry.link === undefined) {
      const name = k.slice(k.lastIndexOf('node_modules/') + 'node_modules/'.length)
      entry.resolved = `https://registry.npmjs.org/${name}/-/${name.split('/').pop()}-${String(entry.version)}.tgz`
    }
    packages[k] = entry
  }
  const root = {
    name: 'consumer',
    dependencies: { kvgate: `file:${tgz}` },
    devDependencies: { '@types/node': lock.packages['node_modules/@types/node']!.version },
  }
  packages['node_modules/kvgate'] = {
    version: me.version,
    resolved: `file:${tgz}`,
    dependencies: me.dependencies,
    bin: { kvgate: 'dist/src/cli/bin.js' },
  }
  return { name: 'consumer', lockfileVersion: 3, requires: true, packages: { '': root, ...packages } }
}

beforeAll(async () => {
  // prepare builds dist/, prepack the prebuilt addon.
  const { stdout } = await run('npm', ['pack', '--json', '--pack-destination', work], repo)
  const info = JSON.parse(stdout.slice(stdout.indexOf('['))) as {
    filename: string
    files: { path: string }[]
  }[]
  tarball = join(work, info[0]!.filename)
  checkoutBinMode = statSync(join(repo, 'dist/src/cli/bin.js')).mode
  packedFiles = info[0]!.files.map((f) => f.path)
  await run('mkdir', ['-p', app], work)
  const lock = appLockfile(tarball) as { packages: Record<string, unknown> }
  writeFileSync(
    join(app, 'package.json'),
    JSON.stringify({ ...(lock.packages[''] as object), private: true, type: 'module' }),
  )
  writeFileSync(join(app, 'package-lock.json'), JSON.stringify(lock))
  await run('npm', ['install', '--offline', '--no-audit', '--no-fund'], app)
}, 240_000)

afterAll(() => rmSync(work, { recursive: true, force: true }))

describe("the checkout's CLI (the README's first command: npm install && npx kvgate demo)", () => {
  it('the build leaves dist/src/cli/bin.js executable, and npx kvgate runs it', async () => {
    // npx in the checkout runs the bin file as the build left it (npm makes an installed
    // package's bin executable, not the root project's): 0644 was "Permission denied".
    expect((checkoutBinMode & 0o111).toString(8)).toBe('111')
    const { stdout } = await run('npx', ['--no-install', 'kvgate', '--version'], repo)
    const me = JSON.parse(readFileSync(join(repo, 'package.json'), 'utf8')) as { version: string }
    expect(stdout.trim()).toBe(me.version)
  })
})

describe('the packed kvgate, installed into a fresh app', () => {
  it('ships only what users need: compiled code, types, wasm, the prebuilt addon and its sources', () => {
    for (const f of [
      'dist/src/client/index.js',
      'dist/src/client/index.d.ts',
      'dist/src/cli/bin.js',
      'dist/wasm/kvgate_codec.wasm',
      'dist/src/client/codec-worker-entry.mjs',
      'prebuilds/linux-x64/kvgate_native.node',
      'native/binding.gyp',
      'scripts/build-native.sh',
      'LICENSE',
      'README.md',
    ]) {
      expect(packedFiles, f).toContain(f)
    }
    // Sources stay out; the READMEs the packed docs link to are in (src/client, wasm).
    const unwanted = packedFiles.filter(
      (f) =>
        /^(src|test|bench|\.ci|infra|wasm)\/|\.test\.|^native\/build\//.test(f) && !/\/README\.md$/.test(f),
    )
    expect(unwanted).toEqual([])
    const pkg = JSON.parse(readFileSync(join(app, 'node_modules/kvgate/package.json'), 'utf8'))
    for (const dev of ['tsx', 'esbuild', '@aws-sdk/lib-storage', '@aws-sdk/client-ssm']) {
      expect(pkg.dependencies[dev], dev).toBeUndefined()
    }
  })

  it('every relative link in the packed README and docs names a file in the package', () => {
    const root = join(app, 'node_modules/kvgate')
    const docs = ['README.md', ...packedFiles.filter((f) => /^docs\/[^/]+\.md$/.test(f))]
    expect(docs.length).toBeGreaterThan(5)
    const missing: string[] = []
    for (const doc of docs) {
      const text = readFileSync(join(root, doc), 'utf8')
      for (const [, target] of text.matchAll(/\]\(([^)#\s]+)(?:#[^)]*)?\)/g)) {
        if (/^[a-z]+:/.test(target!)) continue // http(s), mailto
        if (!existsSync(join(root, doc, '..', target!))) missing.push(`${doc} -> ${target}`)
      }
    }
    expect(missing).toEqual([])
    // The examples the README points to ship, so an app can run them from node_modules.
    expect(packedFiles).toContain('examples/client.mjs')
  })

  it('every entry imports in plain Node (no loader); the codec works from dist', async () => {
    const script = `
      const out = {}
      for (const e of ['core', 'codec', 'codec/node', 'gateway', 'gateway/node', 'client']) {
        out[e] = Object.keys(await import('kvgate/' + e)).length
      }
      const { FsStore, S3Store, serveGateway, createGateway } = await import('kvgate/gateway')
      out.gatewayEmbeds = [FsStore, S3Store, serveGateway, createGateway].every((f) => typeof f === 'function')
      const codec = await import('kvgate/codec/node')
      out.codecWorks = typeof codec.encodeChunk === 'function'
      console.log(JSON.stringify(out))`
    const { stdout } = await run(process.execPath, ['--input-type=module', '-e', script], app)
    const out = JSON.parse(stdout)
    for (const e of ['core', 'codec', 'codec/node', 'gateway', 'gateway/node', 'client'])
      expect(out[e], e).toBeGreaterThan(0)
    expect(out.gatewayEmbeds).toBe(true)
    expect(out.codecWorks).toBe(true)
  })

  it('CommonJS require()s every Node entry (Node >= 20.19 loads ES modules from require)', async () => {
    // The app is "type": "module"; a .cjs file is what a CommonJS project runs. Without a
    // "default" condition require() failed with ERR_PACKAGE_PATH_NOT_EXPORTED.
    const script = `
      const out = {}
      for (const e of ['core', 'codec', 'codec/node', 'gateway', 'gateway/node', 'client']) {
        out[e] = Object.keys(require('kvgate/' + e)).length
      }
      out.client = typeof require('kvgate/client').KVCache
      console.log(JSON.stringify(out))`
    writeFileSync(join(app, 'require-entries.cjs'), script)
    const { stdout, stderr } = await run(process.execPath, ['require-entries.cjs'], app)
    const out = JSON.parse(stdout)
    for (const e of ['core', 'codec', 'codec/node', 'gateway', 'gateway/node'])
      expect(out[e], e).toBeGreaterThan(0)
    expect(out.client).toBe('function')
    expect(stderr).not.toMatch(/ExperimentalWarning/)
  })

  it('the codec worker entry runs the compiled worker', async () => {
    const entry = join(app, 'node_modules/kvgate/dist/src/client/codec-worker-entry.mjs')
    const script = `
      import { Worker } from 'node:worker_threads'
      const w = new Worker(${JSON.stringify(entry)}, { execArgv: [] })
      const data = new Uint8Array([1, 2, 3, 4, 5])
      // Jobs carry views of the pool's shared staging (codec-worker.ts's CodecRequest).
      w.postMessage({ id: 7, op: 'crc', data, ranges: [0, 5] })
      // A worker says {ready: true} once loaded, then answers jobs.
      w.on('message', (m) => { if (m.ready) return; console.log(JSON.stringify({ id: m.id, crc: new Uint32Array(m.bytes)[0], error: m.error })); w.terminate() })
      w.once('error', (e) => { console.log(JSON.stringify({ error: e.message })); process.exit(1) })`
    const { stdout } = await run(process.execPath, ['--input-type=module', '-e', script], app)
    const m = JSON.parse(stdout)
    expect(m.error).toBeUndefined()
    expect(m).toMatchObject({ id: 7, crc: crc32(new Uint8Array([1, 2, 3, 4, 5])) })
  })

  it('a strict TypeScript consumer type-checks (NodeNext, exactOptionalPropertyTypes, no DOM, skipLibCheck off)', async () => {
    writeFileSync(
      join(app, 'tsconfig.json'),
      JSON.stringify({
        compilerOptions: {
          module: 'NodeNext',
          moduleResolution: 'NodeNext',
          target: 'ES2022',
          lib: ['ES2023'],
          types: ['node'],
          strict: true,
          exactOptionalPropertyTypes: true,
          noUncheckedIndexedAccess: true,
          skipLibCheck: false,
          noEmit: true,
        },
        include: ['consumer.ts'],
      }),
    )
    writeFileSync(
      join(app, 'consumer.ts'),
      `import { KVCache, type KVCacheOptions, type KVCacheStats } from 'kvgate/client'
import { chainKeys, type KeyNamespace, MODEL_PRESETS } from 'kvgate/core'
import { encodeChunk } from 'kvgate/codec/node'
import { createGateway, FsStore, MemoryStore, S3Store, serveGateway, type ObjectStore } from 'kvgate/gateway'
const opts: KVCacheOptions = { model: 'stories260k', memory: { bytes: '16MiB' }, remote: { url: 'http://127.0.0.1:8787', token: 't' } }
const cache: KVCache = await KVCache.open(opts)
const stats: KVCacheStats = cache.stats()
const store: ObjectStore = new MemoryStore()
const gw = await serveGateway(createGateway({ store }), { port: 0 })
const ns: KeyNamespace = { modelId: 'm', geometry: MODEL_PRESETS['llama-3.1-8b'], chunkTokens: 256 }
void [chainKeys([1, 2, 3], ns), encodeChunk, FsStore, S3Store, stats.native.loaded, gw.url]
`,
    )
    const tsc = join(repo, 'node_modules/typescript/bin/tsc')
    const r = await exec(process.execPath, [tsc, '-p', app], { cwd: app, encoding: 'utf8' }).then(
      (x) => ({ code: 0, out: x.stdout }),
      (e: { code: number; stdout: string }) => ({ code: e.code, out: e.stdout }),
    )
    expect(r.out).toBe('')
    expect(r.code).toBe(0)
  })

  it('the prebuilt addon loads in the app (nothing was built there)', async () => {
    expect(existsSync(join(app, 'node_modules/kvgate/native/build'))).toBe(false)
    const script = `
      const { KVCache } = await import('kvgate/client')
      const c = await KVCache.open({ model: 'stories260k', memory: { bytes: 1 << 22 } })
      console.log(JSON.stringify(c.stats().native)); await c.close()`
    const { stdout } = await run(process.execPath, ['--input-type=module', '-e', script], app)
    expect(JSON.parse(stdout)).toEqual({ loaded: true })
  })

  it('the examples run against the installed package', async () => {
    for (const f of ['client.mjs', 'embedded-gateway.mjs'])
      copyFileSync(join(repo, 'examples', f), join(app, f))
    const client = JSON.parse((await run(process.execPath, ['client.mjs'], app)).stdout)
    expect(client).toEqual({ stored: 2, cachedTokens: 512, retrieved: true, native: true })
    const embedded = JSON.parse((await run(process.execPath, ['embedded-gateway.mjs'], app)).stdout)
    expect(embedded).toMatchObject({ found: 512, tier: 'remote', identical: true })
  })

  // The engine side as an operator runs it: the app's `kvgate agent`, and the Python connector's
  // own client (python/kvgate_vllm, Debian's python3-msgpack) saying hello as vLLM's connector does.
  it.skipIf(!pythonClient)(
    "kvgate agent runs from the app; the pip-installed connector's client says hello and reads its stats",
    async () => {
      const bin = join(app, 'node_modules/.bin/kvgate')
      const socket = join(work, 'agent.sock')
      const agent = spawn(bin, ['agent', '--socket', socket], {
        cwd: app,
        env: { ...cleanEnv, KVGATE_CLIENT_CONFIG: '', KVGATE_MEMORY_BYTES: String(64 << 20) },
        stdio: ['ignore', 'pipe', 'pipe'],
      })
      let stderr = ''
      agent.stderr!.on('data', (d: Buffer) => {
        stderr += d.toString()
      })
      try {
        const ready = await new Promise<{ socket: string }>((ok, fail) => {
          createInterface({ input: agent.stdout! }).on('line', (l) => {
            const j = JSON.parse(l) as { socket?: string }
            if (j.socket) ok(j as { socket: string })
          })
          agent.once('exit', (code) => fail(new Error(`kvgate agent exited ${code}: ${stderr}`)))
        })
        expect(ready.socket).toBe(socket)
        expect(statSync(socket).mode & 0o777).toBe(0o600)
        const hello = {
          protocol: 1,
          model: 'package-test',
          hashSeed: '0',
          geometry: {
            layout: 'flash-attn',
            dtype: 'float16',
            layers: 2,
            kvHeads: 2,
            headSize: 16,
            blockSize: 16,
            world: 1,
          },
        }
        const py = [
          'import json, sys',
          'from kvgate_vllm.client import AgentClient, PROTOCOL_VERSION',
          'hello = json.loads(sys.argv[2])',
          'assert hello["protocol"] == PROTOCOL_VERSION',
          'c = AgentClient(sys.argv[1], hello, reconnect_interval=0)',
          'assert c.ensure(raise_refusal=True)',
          'print(json.dumps(c.call("stats", {}, timeout=10)))',
          'c.close()',
        ].join('\n')
        // The connector as pip installs it (`pip install ./python`, offline: pure Python, its
        // dependencies the system's), from a copy: pip builds in the source tree.
        const src = join(work, 'python-src')
        cpSync(join(repo, 'python'), src, {
          recursive: true,
          filter: (f) => !/(^|\/)(build|tests|__pycache__|[^/]*\.egg-info)$/.test(f),
        })
        const lib = join(work, 'python-lib')
        await run(
          PYTHON,
          [
            '-m',
            'pip',
            'install',
            '--quiet',
            '--no-deps',
            '--no-build-isolation',
            '--no-index',
            '--target',
            lib,
            src,
          ],
          app,
          { ...cleanEnv, PIP_DISABLE_PIP_VERSION_CHECK: '1', PIP_ROOT_USER_ACTION: 'ignore' },
        )
        const { stdout } = await run(PYTHON, ['-c', py, socket, JSON.stringify(hello)], app, {
          ...cleanEnv,
          PYTHONPATH: lib,
        })
        const stats = JSON.parse(stdout) as Record<string, unknown>
        expect(stats).toMatchObject({ connections: expect.any(Number), requests: expect.any(Number) })
      } finally {
        agent.kill('SIGTERM')
      }
    },
  )

  it('kvgate serve and kvgate smoke run from the app; smoke says auth is off', async () => {
    const bin = join(app, 'node_modules/.bin/kvgate')
    const serve = spawn(bin, ['serve', '--store', 'memory', '--port', '0'], {
      cwd: app,
      env: { ...cleanEnv, KVGATE_CONFIG: '' },
      stdio: ['ignore', 'pipe', 'pipe'],
    })
    try {
      const url = await new Promise<string>((ok, fail) => {
        createInterface({ input: serve.stdout! }).on('line', (l) => {
          const j = JSON.parse(l) as { msg?: string; url?: string }
          if (j.msg === 'listening' && j.url) ok(j.url)
        })
        serve.once('exit', (code) => fail(new Error(`serve exited ${code}`)))
      })
      const smoke = await run(bin, ['smoke', '--url', url], app)
      expect(smoke.stdout).toMatch(/PASS: \d+\/\d+ steps passed/)
      expect(smoke.stdout).toContain('auth is off')
    } finally {
      serve.kill('SIGTERM')
    }
  })
})
