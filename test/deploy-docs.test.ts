// The deploy guides' commands, run: docs/deploy-node.md end to end (hash tokens, the
// config file, `kvgate serve`, `kvgate smoke` as processes), the token-table one-liners
// of the Workers and AWS guides, and every guide's closing smoke line against the CLI.

import { type ChildProcess, spawn, spawnSync } from 'node:child_process'
import { createHash } from 'node:crypto'
import { existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join, resolve } from 'node:path'
import { createInterface } from 'node:readline'
import { parseArgs } from 'node:util'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { SMOKE_OPTIONS } from '../src/cli/commands/smoke.ts'
import { compileGrants, type TokenGrant } from '../src/gateway/middleware/auth.ts'

const ROOT = resolve(import.meta.dirname, '..')
const KVGATE = join(ROOT, 'bin', 'kvgate.mjs')
const GUIDES = ['deploy-node.md', 'deploy-workers.md', 'deploy-aws.md'] as const
const doc = (name: string) => readFileSync(join(ROOT, 'docs', name), 'utf8')

/** Fenced blocks of a markdown file with their info string. */
function blocks(md: string): { lang: string; body: string }[] {
  return [...md.matchAll(/^```(\w*)\n([\s\S]*?)^```$/gm)].map((m) => ({ lang: m[1]!, body: m[2]! }))
}

/** Runs a guide's shell line in bash, with `npx kvgate` meaning this checkout's CLI. */
function bash(
  script: string,
  env: Record<string, string> = {},
): { code: number | null; out: string; err: string } {
  const r = spawnSync(
    'bash',
    [
      '-euo',
      'pipefail',
      '-c',
      `npx() { if [ "$1" = kvgate ]; then shift; node ${JSON.stringify(KVGATE)} "$@"; else return 127; fi; }\n${script}`,
    ],
    { cwd: ROOT, env: { ...process.env, ...env }, encoding: 'utf8', timeout: 60_000 },
  )
  return { code: r.status, out: r.stdout, err: r.stderr }
}

const sha256 = (s: string) => createHash('sha256').update(s).digest('hex')

describe('every deploy guide', () => {
  for (const name of GUIDES) {
    it(`${name} ends with a smoke test whose command the CLI accepts`, () => {
      const md = doc(name)
      const sections = md.split(/^## /m)
      const last = sections[sections.length - 1]!
      expect(last.startsWith('Smoke test'), `${name}: last section`).toBe(true)
      const lines = blocks(last)
        .flatMap((b) => b.body.split('\n'))
        .filter((l) => l.startsWith('npx kvgate smoke'))
      expect(lines).toHaveLength(1)
      // Shell words: "$(...)" and "$VAR" become placeholders; the flags must parse strictly.
      const words = lines[0]!
        .replace(/"\$\([^)]*\)[^"]*"/g, 'SUBST')
        .replace(/"[^"]*"/g, 'QUOTED')
        .split(/\s+/)
        .slice(3)
      const { values } = parseArgs({
        args: words,
        options: SMOKE_OPTIONS,
        strict: true,
        allowPositionals: false,
      })
      expect(values.url, name).toBeDefined()
      expect(values.token, name).toBeDefined()
    })
  }

  it('mention only package scripts and paths that exist', () => {
    const pkg = JSON.parse(readFileSync(join(ROOT, 'package.json'), 'utf8')) as {
      scripts: Record<string, string>
    }
    for (const name of GUIDES) {
      for (const m of doc(name).matchAll(/npm run ([\w:-]+)/g))
        expect(pkg.scripts[m[1]!], `${name}: ${m[0]}`).toBeDefined()
      for (const m of doc(name).matchAll(/-chdir=([\w/.-]+)/g))
        expect(existsSync(join(ROOT, m[1]!)), m[0]).toBe(true)
    }
  })
})

describe('docs/deploy-workers.md', () => {
  it('the token-table line produces a table the gateway accepts, matching wrangler.toml', () => {
    const md = doc('deploy-workers.md')
    const wrangler = readFileSync(join(ROOT, 'wrangler.toml'), 'utf8')
    const deploy = blocks(md).find((b) => b.body.includes('wrangler deploy'))!.body
    const bucket = /wrangler r2 bucket create (\S+)/.exec(deploy)?.[1]
    expect(wrangler).toContain(`bucket_name = "${bucket}"`)
    expect(deploy).toContain('secret put KVGATE_TOKENS')
    const table = blocks(md).find((b) => b.body.includes('| npx wrangler secret put'))!.body
    const script = table.replace(/\s*\\\n\s*\| npx wrangler secret put KVGATE_TOKENS\s*$/, '')
    const r = bash(script)
    expect(r.code, r.err).toBe(0)
    const fleet = /^FLEET_TOKEN=/m.test(script)
    expect(fleet).toBe(true)
    const grants = JSON.parse(r.out) as TokenGrant[]
    expect(() => compileGrants(grants)).not.toThrow()
    expect(grants.map((g) => [g.name, g.scopes])).toEqual([
      ['fleet', 'write'],
      ['ops', 'admin'],
    ])
    expect(grants.every((g) => /^[0-9a-f]{64}$/.test(g.sha256))).toBe(true)
  })
})

describe('docs/deploy-aws.md', () => {
  it('the TF_VAR line yields a token table for the fleet token, and the example finds the built zip', () => {
    const md = doc('deploy-aws.md')
    const prep = blocks(md).find((b) => b.body.includes('TF_VAR_auth_tokens_json'))!.body
    const r = bash(`${prep}\nprintf '%s\\n%s' "$FLEET_TOKEN" "$TF_VAR_auth_tokens_json"`)
    expect(r.code, r.err).toBe(0)
    const [fleetToken, json] = r.out.split('\n')
    const grants = JSON.parse(json!) as TokenGrant[]
    expect(() => compileGrants(grants)).not.toThrow()
    expect(grants[0]!.sha256).toBe(sha256(fleetToken!))
    // terraform -chdir=examples/basic resolves the default zip path from that directory.
    const example = readFileSync(join(ROOT, 'infra/terraform/aws/examples/basic/variables.tf'), 'utf8')
    const zip = /default\s*=\s*"([^"]+\.zip)"/.exec(example)?.[1]
    expect(resolve(ROOT, 'infra/terraform/aws/examples/basic', zip!)).toBe(
      join(ROOT, 'dist/lambda/kvgate-gateway.zip'),
    )
    expect(readFileSync(join(ROOT, 'scripts/build-lambda.ts'), 'utf8')).toContain(
      "'dist/lambda/kvgate-gateway.zip'",
    )
  })
})

describe('docs/deploy-node.md, run as written', () => {
  let work: string
  let server: ChildProcess | undefined
  let url: string
  const tokens = { FLEET_TOKEN: '', OPS_TOKEN: '' }

  beforeAll(async () => {
    work = mkdtempSync(join(tmpdir(), 'kvgate-node-doc-'))
    const md = doc('deploy-node.md')
    // Step 1: the token lines, as written (openssl + kvgate serve --hash-token).
    const step1 = blocks(md).find((b) => b.body.includes('--hash-token'))!.body
    const r = bash(`${step1}\necho "FLEET_TOKEN=$FLEET_TOKEN"\necho "OPS_TOKEN=$OPS_TOKEN"`)
    expect(r.code, r.err).toBe(0)
    const lines = r.out.trim().split('\n')
    tokens.FLEET_TOKEN = lines.find((l) => l.startsWith('FLEET_TOKEN='))!.slice(12)
    tokens.OPS_TOKEN = lines.find((l) => l.startsWith('OPS_TOKEN='))!.slice(10)
    const [fleetHash, opsHash] = lines.filter((l) => /^[0-9a-f]{64}$/.test(l))
    expect(fleetHash).toBe(sha256(tokens.FLEET_TOKEN))
    expect(opsHash).toBe(sha256(tokens.OPS_TOKEN))
    // Step 2: the config file, with the printed hashes and a scratch store directory.
    const yaml = blocks(md)
      .find((b) => b.lang === 'yaml')!
      .body.replace('FLEET_TOKEN_SHA256', fleetHash!)
      .replace('OPS_TOKEN_SHA256', opsHash!)
      .replace('/var/lib/kvgate/store', join(work, 'store'))
    const config = join(work, 'config.yaml')
    writeFileSync(config, yaml)
    // Step 3: the systemd ExecStart command; only the bind address and port are changed
    // (loopback, a free port) so the test can run anywhere.
    const unit = blocks(md).find((b) => b.lang === 'ini')!.body
    const exec = /^ExecStart=(.*)$/m.exec(unit)![1]!.split(' ')
    expect(exec.slice(0, 2)).toEqual(['/usr/bin/node', '/opt/kvgate/bin/kvgate.mjs'])
    const args = exec.slice(2).map((a) => (a === '/etc/kvgate/config.yaml' ? config : a))
    server = spawn(
      process.execPath,
      [KVGATE, ...args, '--host', '127.0.0.1', '--port', '0', '--log', 'warn'],
      {
        cwd: ROOT,
        stdio: ['ignore', 'pipe', 'pipe'],
      },
    )
    url = await new Promise<string>((ok, fail) => {
      let err = ''
      server!.stderr!.on('data', (d: Buffer) => {
        err += d.toString()
      })
      server!.once('exit', (code) => fail(new Error(`kvgate serve exited ${code}: ${err}`)))
      createInterface({ input: server!.stdout! }).on('line', (line) => {
        const e = JSON.parse(line) as { msg?: string; url?: string; auth?: boolean }
        if (e.msg === 'listening') {
          expect(e.auth).toBe(true)
          ok(e.url!)
        }
      })
    })
  })

  afterAll(async () => {
    if (server && server.exitCode === null) {
      server.kill('SIGTERM')
      await new Promise((r) => server!.once('exit', r))
    }
    if (work) rmSync(work, { recursive: true, force: true })
  })

  const smokeLine = () => {
    const last = doc('deploy-node.md').split(/^## /m).pop()!
    return blocks(last)
      .flatMap((b) => b.body.split('\n'))
      .find((l) => l.startsWith('npx kvgate smoke'))!
      .replace('http://127.0.0.1:8787', url)
  }

  it('the smoke line passes against the served gateway', () => {
    const r = bash(smokeLine(), tokens)
    expect(r.code, r.out + r.err).toBe(0)
    expect(r.out).toMatch(/^PASS: (\d+)\/\1 steps passed$/m)
    expect(r.out).not.toMatch(/^\s+FAIL/m)
  })

  it('--cleanup with the ops token deletes the chunk it wrote', () => {
    const r = bash(`${smokeLine().replace('$FLEET_TOKEN', '$OPS_TOKEN')} --cleanup --json`, tokens)
    expect(r.code, r.out + r.err).toBe(0)
    const report = JSON.parse(r.out) as { ok: boolean; steps: { name: string; ok: boolean }[] }
    expect(report.steps.find((s) => s.name === 'delete')?.ok).toBe(true)
  })

  it('fails loudly (exit 1, FAIL lines) with a wrong token, and exit 2 without --url', () => {
    const bad = bash(smokeLine(), { FLEET_TOKEN: 'not-the-token' })
    expect(bad.code).toBe(1)
    // The first step names the cause and smoke stops there (no cascade of FAIL lines).
    expect(bad.out).toMatch(/^\s+FAIL\s+healthz\s.*does not accept this token/m)
    expect(bad.out).not.toMatch(/^\s+FAIL\s+put\s/m)
    expect(bad.out).toMatch(/^FAIL: \d+\/\d+ steps passed$/m)
    const noUrl = bash('npx kvgate smoke --token x', { KVGATE_URL: '' })
    expect(noUrl.code).toBe(2)
    expect(noUrl.err).toMatch(/--url is required/)
    const badNs = bash(`npx kvgate smoke --url ${url} --ns ../etc`)
    expect(badNs.code).toBe(2) // wrong usage, named before any request
    expect(badNs.err).toMatch(/--ns "\.\.\/etc" is not a namespace name/)
  })
})

describe("docs/deploy-node.md's table of every setting", () => {
  type S = { type?: string; entries?: Record<string, S>; wrapped?: S; getter?: (x: unknown) => S }
  /** Dotted paths of the file schema's leaves (its lazy `store` taken as the mapping). */
  function leaves(s: S, pre: string[] = []): string[] {
    while (s && !s.entries) {
      if (s.type === 'lazy') s = s.getter!({})
      else if (s.wrapped) s = s.wrapped
      else break
    }
    if (!s?.entries) return [pre.join('.')]
    return Object.entries(s.entries).flatMap(([k, v]) => leaves(v, [...pre, k]))
  }
  it('lists exactly the keys, variables and flags kvgate serve accepts', async () => {
    const { ENV_VARS, GATEWAY_FILE_SCHEMA } = await import('../src/gateway/config.ts')
    const md = doc('deploy-node.md')
    const section = md.slice(md.indexOf('### Every setting'), md.indexOf('## 3a.'))
    const rows = section
      .split('\n')
      .filter((l) => l.startsWith('| `'))
      .map((l) => l.split('|').map((c) => c.trim()))
    const cell = (c: string) => /^`([^`]+)`/.exec(c)?.[1]
    const keys = rows.map((r) => cell(r[1]!)!)
    expect(keys.sort()).toEqual(leaves(GATEWAY_FILE_SCHEMA as unknown as S).sort())
    expect(rows.map((r) => cell(r[2]!)!).sort()).toEqual([...ENV_VARS].sort())
    const help = spawnSync(process.execPath, [KVGATE, 'serve', '--help'], { encoding: 'utf8' }).stdout
    for (const flag of rows.map((r) => cell(r[3]!)).filter((f) => f !== undefined))
      expect(help, flag).toMatch(new RegExp(`^\\s+(-\\w, )?${flag}\\b`, 'm'))
  })
})
