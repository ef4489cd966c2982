// What a user sees when something is wrong: one line naming the flag, key or variable, the
// documented exit status, and nothing started; plus `kvgate token` and smoke's first-step behaviour.

import { execFile } from 'node:child_process'
import { mkdtempSync, readdirSync, writeFileSync } from 'node:fs'
import { createServer } from 'node:net'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { promisify } from 'node:util'
import { describe, expect, it } from 'vitest'
import { parse as parseYaml } from 'yaml'
import { hashToken } from '../src/gateway/middleware/auth.ts'

const exec = promisify(execFile)
const bin = new URL('../bin/kvgate.mjs', import.meta.url).pathname

async function kvgate(
  args: string[],
  env: NodeJS.ProcessEnv = {},
  cwd?: string,
): Promise<{ code: number; stdout: string; stderr: string }> {
  try {
    const { stdout, stderr } = await exec(process.execPath, [bin, ...args], {
      encoding: 'utf8',
      env: { ...process.env, KVGATE_CONFIG: '', ...env },
      ...(cwd ? { cwd } : {}),
    })
    return { code: 0, stdout, stderr }
  } catch (e) {
    const err = e as { code: number; stdout: string; stderr: string }
    return { code: err.code, stdout: err.stdout, stderr: err.stderr }
  }
}

const oneLine = (s: string) => s.trim().split('\n').length === 1 && !/\n\s+at /.test(s)

describe('kvgate serve: mistakes are one line naming the fix', () => {
  const dir = mkdtempSync(join(tmpdir(), 'kvgate-cli-errors-'))

  it('unknown flags exit 2', async () => {
    const r = await kvgate(['serve', '--prot', '9000'])
    expect(r.code).toBe(2)
    expect(r.stderr).toContain('--prot')
    expect(oneLine(r.stderr)).toBe(true)
  })

  it('an unknown flag names the nearest one the command takes', async () => {
    for (const [args, near] of [
      [['serve', '--prot', '9000'], '--port'],
      [['gc', '--dryrun'], '--dry-run'],
      [['agent', '--metric-port', '9'], '--metrics-port'],
      [['token', '--namespace', 'prod'], '--namespaces'],
    ] as const) {
      const r = await kvgate([...args])
      expect(r.code, args.join(' ')).toBe(2)
      expect(r.stderr).toContain(`unknown option '${args[1]}' (did you mean '${near}'?)`)
      expect(oneLine(r.stderr)).toBe(true)
    }
    // Nothing near: the flag alone, and --help.
    const far = await kvgate(['serve', '--zzzzzzzzzz'])
    expect(far.stderr).toContain("unknown option '--zzzzzzzzzz'. Run with --help for usage.")
  })

  it("a value that looks like a flag ('--copy-threads -1') is one line naming the flag and the '=' form", async () => {
    for (const args of [
      ['agent', '--copy-threads', '-1'],
      ['serve', '--port', '-1'],
    ]) {
      const r = await kvgate(args)
      expect(r.code, args.join(' ')).toBe(2)
      expect(oneLine(r.stderr), r.stderr).toBe(true)
      expect(r.stderr).toContain(`'${args[1]}=-XYZ'. Run with --help for usage.`)
    }
  })

  it('a bad KVGATE_* value names the variable', async () => {
    const r = await kvgate(['serve'], { KVGATE_PORT: 'eighty' })
    expect(r.code).toBe(2)
    expect(r.stderr).toMatch(/KVGATE_PORT: expected an integer/)
    expect(oneLine(r.stderr)).toBe(true)
  })

  it('a typo in the YAML file (auth.token) is an error naming the path and the nearest key, not auth off', async () => {
    const file = join(dir, 'typo.yaml')
    writeFileSync(file, 'auth:\n  token:\n    - { sha256: abc, scopes: write, namespaces: [a] }\n')
    const r = await kvgate(['serve', '--config', file])
    expect(r.code).toBe(2)
    expect(r.stderr).toContain(`${file}: auth.token: unknown key (did you mean 'tokens'?)`)
    const store = join(dir, 'store.yaml')
    writeFileSync(store, 'stroe: s3\n')
    const s = await kvgate(['serve', '--config', store])
    expect(s.code).toBe(2)
    expect(s.stderr).toContain("stroe: unknown key (did you mean 'store'?)")
  })

  it('scopes: wirte is a config error naming the entry, not a TypeError', async () => {
    const file = join(dir, 'scope.yaml')
    const sha = await hashToken('x'.repeat(32))
    writeFileSync(file, `auth:\n  tokens:\n    - { sha256: ${sha}, scopes: wirte, namespaces: [a] }\n`)
    const r = await kvgate(['serve', '--config', file])
    expect(r.code).toBe(2)
    expect(r.stderr).toMatch(/auth\.tokens: 0\.scopes: expected read, write or admin/)
    expect(r.stderr).not.toContain('TypeError')
  })

  it('byte sizes take units', async () => {
    const { resolveServeConfig, settingsFromEnv } = await import('../src/gateway/config.ts')
    const c = resolveServeConfig(
      settingsFromEnv({ KVGATE_MAX_CHUNK_BYTES: '512MiB', KVGATE_COALESCE_MAX_BYTES: '4MB' }),
    )
    expect(c.maxChunkBytes).toBe(512 * 1024 ** 2)
    expect(c.coalesceMaxBytes).toBe(4_000_000)
  })

  it('a value that is not a byte size is one line, not also "at least" and "at most" lines', async () => {
    const r = await kvgate(['serve', '--max-chunk-bytes', '1XB'])
    expect(r.code).toBe(2)
    expect(r.stderr.trim()).toBe(
      'kvgate serve: --max-chunk-bytes: expected a byte size such as 4096, 512MiB or 10GB [ERR_CONFIG]',
    )
  })

  it('a store directory under a file is ENOTDIR in one line naming --dir', async () => {
    const file = join(dir, 'plain-file')
    writeFileSync(file, 'x')
    const r = await kvgate(['serve', '--dir', join(file, 'store'), '--port', '0'])
    expect(r.code).toBe(1)
    expect(r.stderr).toContain('ENOTDIR')
    expect(r.stderr).toContain('--dir')
    expect(r.stderr).not.toMatch(/\n\s+at /)
  })

  it('a port in use is EADDRINUSE in one line naming --port', async () => {
    const blocker = createServer()
    await new Promise<void>((r) => blocker.listen(0, '127.0.0.1', r))
    const port = (blocker.address() as { port: number }).port
    try {
      const r = await kvgate(['serve', '--store', 'memory', '--port', String(port)])
      expect(r.code).toBe(1)
      expect(r.stderr).toContain('EADDRINUSE')
      expect(r.stderr).toContain('--port')
      expect(r.stderr).not.toMatch(/\n\s+at /)
    } finally {
      blocker.close()
    }
  })
})

describe('stray arguments', () => {
  // `kvgate serve 9000` or `kvgate gc config.yaml` must not run with the defaults instead.
  it.each([
    ['serve', '9000'],
    ['agent', 'agent.yaml'],
    ['gc', 'prod'],
    ['keys', '1,2,3'],
    ['smoke', 'http://127.0.0.1:1'],
    ['build-native', 'clean'],
  ])('kvgate %s %s exits 2 naming the argument, starting nothing', async (command, stray) => {
    const r = await new Promise<{ code: number | null; stderr: string }>((resolve) => {
      execFile(
        process.execPath,
        [bin, command, stray],
        { encoding: 'utf8', env: { ...process.env, KVGATE_CONFIG: '' }, timeout: 15_000 },
        (e, _stdout, stderr) =>
          resolve({ code: e ? (typeof e.code === 'number' ? e.code : null) : 0, stderr }),
      )
    })
    expect(r.code).toBe(2)
    expect(r.stderr).toContain(`unexpected argument '${stray}'`)
    expect(oneLine(r.stderr)).toBe(true)
  })
})

describe('kvgate token', () => {
  it('prints a token and the matching hashed entry for the token table', async () => {
    const r = await kvgate(['token', '--json', '--name', 'ops', '--scope', 'admin', '--namespaces', '*'])
    expect(r.code).toBe(0)
    const { token, entry } = JSON.parse(r.stdout) as { token: string; entry: Record<string, unknown> }
    expect(entry).toEqual({ name: 'ops', sha256: await hashToken(token), scopes: 'admin', namespaces: '*' })
    const yaml = await kvgate(['token', '--namespaces', 'prod,staging'])
    expect(yaml.stdout).toMatch(/scopes: write, namespaces: \[prod, staging\]/)
    expect((await kvgate(['token', '--scope', 'root'])).code).toBe(2)
    expect((await kvgate(['token', '--namespaces', 'Bad Name'])).code).toBe(2)
  })

  it('the YAML line it prints parses to the same entry whatever the name holds', async () => {
    for (const name of ['ops', 'ops: admin', 'a, scopes: admin', "it's {x}", '#1']) {
      const r = await kvgate(['token', '--name', name, '--namespaces', 'prod'])
      expect(r.code).toBe(0)
      const line = r.stdout.split('\n').find((l) => l.trim().startsWith('- { name:'))!
      const [entry] = parseYaml(line.trim()) as Record<string, unknown>[]
      expect(entry, name).toMatchObject({ name, scopes: 'write', namespaces: ['prod'] })
    }
  })
})

describe('kvgate bench', () => {
  it('<name> --help prints help and starts nothing (no results written)', async () => {
    const cwd = mkdtempSync(join(tmpdir(), 'kvgate-bench-help-'))
    for (const name of ['codec', 'gateway', 'client']) {
      const r = await kvgate(['bench', name, '--help', '--out', cwd], {}, cwd)
      expect(r.code).toBe(0)
      expect(r.stdout).toContain(`kvgate bench ${name}`)
    }
    expect(readdirSync(cwd)).toEqual([])
    expect((await kvgate(['bench', 'codec', '--bogus'], {}, cwd)).code).toBe(2)
  })

  it('--help lists only runnable benchmarks, each with what it measures', async () => {
    const r = await kvgate(['bench', '--help'])
    expect(r.code).toBe(0)
    const list = r.stdout.split('Benchmarks:\n')[1]!.split('\n\n')[0]!.split('\n')
    expect(list.length).toBeGreaterThan(5)
    for (const line of list) expect(line, line).toMatch(/^ {2}[a-z0-9-]+ +\S.{10,}/)
    // A/B tools that need a second build (an old .wasm, another tree) are not offered.
    for (const tool of ['codec-diff', 'l2-ab', 'codec-context']) {
      expect(r.stdout).not.toContain(tool)
      const t = await kvgate(['bench', tool])
      expect(t.code, t.stderr).toBe(2)
      expect(t.stderr).toContain(`unknown benchmark '${tool}'`)
    }
  })
})

describe('kvgate smoke', () => {
  it('a URL that is not http(s) or a bad --ns is wrong usage (exit 2), before any request', async () => {
    for (const [args, says] of [
      [['--url', 'ftp://127.0.0.1:1'], '--url'],
      [['--url', 'file:///etc/passwd'], '--url'],
      [['--url', 'http://127.0.0.1:1', '--ns', 'Bad/ns'], '--ns'],
    ] as const) {
      const r = await kvgate(['smoke', ...args])
      expect(r.code, args.join(' ')).toBe(2)
      expect(r.stderr).toContain(says)
      expect(r.stdout).toBe('')
    }
  })

  it('on ECONNREFUSED asks once whether the gateway runs there, and stops after healthz', async () => {
    const probe = createServer()
    await new Promise<void>((r) => probe.listen(0, '127.0.0.1', r))
    const port = (probe.address() as { port: number }).port
    await new Promise((r) => probe.close(r))
    const r = await kvgate(['smoke', '--url', `http://127.0.0.1:${port}/v1`])
    expect(r.code).toBe(1)
    expect(r.stdout.match(/Is the gateway running at that URL\?/g)).toHaveLength(1)
    expect(r.stdout).toContain('FAIL: 0/1 steps passed')
    expect(r.stdout).toContain('the URL ends in /v1')
  })
})

describe('client config file', () => {
  it('is KVGATE_CLIENT_CONFIG (never the gateway file); unknown keys name the path and the nearest key; sizes take units', async () => {
    const { optionsFromEnvironment, resolveOptions } = await import('../src/client/config.ts')
    const dir = mkdtempSync(join(tmpdir(), 'kvgate-client-config-'))
    const gatewayFile = join(dir, 'gateway.yaml')
    writeFileSync(gatewayFile, 'store: memory\nport: 9000\n')
    expect(optionsFromEnvironment({ KVGATE_CONFIG: gatewayFile })).toEqual({})
    const typo = join(dir, 'typo.yaml')
    writeFileSync(typo, 'model: stories260k\nremote:\n  url: http://gw:8787\n  tokne: abc\n')
    expect(() => optionsFromEnvironment({ KVGATE_CLIENT_CONFIG: typo })).toThrow(
      `${typo}: remote.tokne: unknown key (did you mean 'token'?)`,
    )
    const sizes = join(dir, 'sizes.yaml')
    writeFileSync(
      sizes,
      'model: stories260k\nmemory: { bytes: 64MiB }\nremote: { url: http://gw:8787, maxQueuedBytes: 1GB }\n',
    )
    const r = resolveOptions(optionsFromEnvironment({ KVGATE_CLIENT_CONFIG: sizes }) as never)
    expect(r.memory.bytes).toBe(64 * 1024 ** 2)
    expect(r.remote !== false && r.remote.maxQueuedBytes).toBe(1e9)
    expect(resolveOptions({ model: 'stories260k', memory: { bytes: '32MiB' as never } }).memory.bytes).toBe(
      32 * 1024 ** 2,
    )
    expect(() => resolveOptions({ model: 'stories260k', memroy: {} } as never)).toThrow(
      /did you mean memory\?/,
    )
  })
})

describe('model data lookup', () => {
  it('looks only at KVGATE_SHARED_DATA and ../shared/data beside the checkout', async () => {
    const { findSharedData } = await import('../src/model/files.ts')
    const { packageRoot } = await import('../src/package-files.ts')
    const r = findSharedData({ KVGATE_SHARED_DATA: '' })
    if (r.paths) expect(r.paths.dir).toBe(join(packageRoot(), '..', 'shared', 'data'))
    else
      expect(r.reason).toBe(
        `model data (stories260K.bin, tok512.bin) not found in ${join(packageRoot(), '..', 'shared', 'data')}; set KVGATE_SHARED_DATA (or pass --model DIR)`,
      )
  })
})

describe('status page from a browser', () => {
  it('--status-public serves / and /metrics without a token on loopback, and is refused on other binds', async () => {
    const { resolveServeConfig, settingsFromFlags } = await import('../src/gateway/config.ts')
    const { createGateway } = await import('../src/gateway/app.ts')
    const { MemoryStore } = await import('../src/gateway/stores/memory.ts')
    const tokens = JSON.stringify([
      { sha256: await hashToken('t'.repeat(20)), scopes: 'admin', namespaces: '*' },
    ])
    const c = resolveServeConfig(settingsFromFlags({ tokens, publicStatus: true }))
    expect(c.publicStatus).toBe(true)
    const app = createGateway({
      store: new MemoryStore(),
      auth: { tokens: c.tokens, publicStatus: c.publicStatus },
    })
    expect((await app.request('/')).status).toBe(200)
    expect((await app.request('/metrics')).status).toBe(200)
    expect((await app.request('/v1/ns/a/lookup', { method: 'POST', body: '{"keys":[]}' })).status).toBe(401)
    const closed = createGateway({ store: new MemoryStore(), auth: { tokens: c.tokens } })
    expect((await closed.request('/')).status).toBe(401)
    expect(() =>
      resolveServeConfig(settingsFromFlags({ tokens, publicStatus: true, host: '0.0.0.0' })),
    ).toThrow(/--status-public on 0.0.0.0/)
  })
})

describe('presigned uploads from kvgate serve', () => {
  it('are off by default and reachable from the file, env and flags, bounded by maxChunkBytes', async () => {
    const { resolveServeConfig, settingsFromEnv, settingsFromFile, settingsFromFlags } = await import(
      '../src/gateway/config.ts'
    )
    expect(resolveServeConfig({ store: 's3', s3Bucket: 'kv' }).uploads).toBeUndefined()
    const dir = mkdtempSync(join(tmpdir(), 'kvgate-serve-uploads-'))
    const file = join(dir, 'gw.yaml')
    writeFileSync(
      file,
      'store: { kind: s3, s3: { bucket: kv } }\nmaxChunkBytes: 64MiB\nuploads: { minBytes: 4MiB, expiresSeconds: 600, stagingPrefix: kv-up }\n',
    )
    expect(resolveServeConfig(settingsFromFile(file)).uploads).toEqual({
      minBytes: 4 * 1024 ** 2,
      maxBytes: 64 * 1024 ** 2,
      expiresSeconds: 600,
      stagingPrefix: 'kv-up',
    })
    const env = settingsFromEnv({ KVGATE_UPLOAD_MIN_BYTES: '2MiB', KVGATE_UPLOAD_TTL: '300' })
    expect(resolveServeConfig(settingsFromFile(file), env).uploads).toMatchObject({
      minBytes: 2 * 1024 ** 2,
      expiresSeconds: 300,
    })
    const off = settingsFromFlags({ uploadMinBytes: 'off' })
    expect(resolveServeConfig(settingsFromFile(file), env, off).uploads).toBeUndefined()
    expect(() => settingsFromEnv({ KVGATE_UPLOAD_MIN_BYTES: 'lots' })).toThrow(/KVGATE_UPLOAD_MIN_BYTES/)
    writeFileSync(file, 'uploads: { minBytes: 4MiB, partBytes: 8MiB }\n')
    expect(() => settingsFromFile(file)).toThrow(/uploads.partBytes: unknown key/)
  })
})

describe('native addon messages', () => {
  it('stats().native.reason lists every path tried, why, and a build command that exists', async () => {
    const script = `
      const { KVCache } = await import('./src/client/index.ts')
      const c = await KVCache.open({ model: 'stories260k', memory: { bytes: 1 << 22 } })
      console.log(JSON.stringify(c.stats().native)); await c.close()`
    const { stdout } = await exec(
      process.execPath,
      ['--import', 'tsx', '--input-type=module', '-e', script],
      {
        encoding: 'utf8',
        env: { ...process.env, KVGATE_NATIVE_PATH: '/nonexistent/kvgate_native.node' },
      },
    )
    const native = JSON.parse(stdout) as { loaded: boolean; reason: string }
    expect(native.loaded).toBe(false)
    expect(native.reason).toContain('/nonexistent/kvgate_native.node: not found')
    // A checkout: the npm script, which package.json defines.
    expect(native.reason).toContain('npm run build:native')
    const pkg = JSON.parse((await import('node:fs')).readFileSync('package.json', 'utf8'))
    expect(pkg.scripts['build:native']).toBeDefined()
  })

  it('a failed build says so and why, and exits non-zero', async () => {
    const r = await exec('bash', ['scripts/build-native.sh'], {
      encoding: 'utf8',
      env: { ...process.env, CXX: '/nonexistent/g++' },
    }).then(
      () => ({ code: 0, stderr: '' }),
      (e: { code: number; stderr: string }) => e,
    )
    expect(r.code).toBe(1)
    expect(r.stderr).toContain('build-native: /nonexistent/g++ not found')
  })
})
