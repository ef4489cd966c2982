import { execFile } from 'node:child_process'
import { mkdtempSync, readFileSync, truncateSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { promisify } from 'node:util'
import { describe, expect, it } from 'vitest'
import { sampleChunkObject } from '../src/cli/commands/inspect.ts'
import { decodeHeader, encodeChunk } from '../src/core/format.ts'
import { chainKeys } from '../src/core/keys.ts'
import { MODEL_PRESETS } from '../src/core/layout.ts'

const exec = promisify(execFile)
const bin = new URL('../bin/kvgate.mjs', import.meta.url).pathname

async function kvgate(...args: string[]): Promise<{ code: number; stdout: string; stderr: string }> {
  try {
    const { stdout, stderr } = await exec(process.execPath, [bin, ...args], { encoding: 'utf8' })
    return { code: 0, stdout, stderr }
  } catch (e) {
    const err = e as { code: number; stdout: string; stderr: string }
    return { code: err.code, stdout: err.stdout, stderr: err.stderr }
  }
}

describe('kvgate CLI', () => {
  it('--help lists the commands; --version prints the package version', async () => {
    const help = await kvgate('--help')
    expect(help.code).toBe(0)
    for (const c of ['demo', 'serve', 'inspect', 'keys', 'bench']) expect(help.stdout).toContain(c)
    const v = await kvgate('--version')
    expect(v.stdout.trim()).toBe(JSON.parse(readFileSync('package.json', 'utf8')).version)
  })
  it('a missing command or benchmark name is wrong usage: exit 2, the usage on stderr', async () => {
    for (const args of [[], ['bench']]) {
      const r = await kvgate(...args)
      expect(r.code).toBe(2)
      expect(r.stdout).toBe('')
      expect(r.stderr).toContain('Usage: kvgate')
    }
  })
  it('unknown commands fail with a pointer to --help, even prototype names', async () => {
    for (const name of ['nope', 'toString', '__proto__']) {
      const r = await kvgate(name)
      expect(r.code).toBe(2)
      expect(r.stderr).toContain('--help')
    }
  })
  it('help <command> for a command that does not exist is the same error as the command itself', async () => {
    const r = await kvgate('help', 'nope')
    expect(r.code).toBe(2)
    expect(r.stdout).toBe('')
    expect(r.stderr).toContain("unknown command 'nope'")
    expect(r.stderr).toContain('--help')
    const ok = await kvgate('help', 'gc')
    expect(ok.code).toBe(0)
    expect(ok.stdout).toContain('Usage: kvgate gc')
  })
  it('gc --namespace with a name no namespace can have is wrong usage, not a pass over nothing', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'kvgate-cli-gc-'))
    for (const ns of ['../prod', 'a/b', '_usage', '']) {
      const r = await kvgate('gc', '--dry-run', '--dir', dir, '--namespace', ns)
      expect(r.code).toBe(2)
      expect(r.stdout).toBe('')
      expect(r.stderr).toContain(`--namespace '${ns}'`)
    }
  })
  it('gc --price and --concurrency take plain decimal numbers only', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'kvgate-cli-gc-'))
    for (const [flag, value] of [
      ['--price', 'Infinity'],
      ['--price', ''],
      ['--concurrency', '0x10'],
      ['--concurrency', '1e1'],
      ['--concurrency', ''],
    ]) {
      const r = await kvgate('gc', '--dry-run', '--dir', dir, `${flag}=${value}`)
      expect(r.code, `${flag}=${value}`).toBe(2)
      expect(r.stderr).toContain(flag)
    }
    const ok = await kvgate('gc', '--dry-run', '--dir', dir, '--price=0.015', '--concurrency=4', '-q')
    expect(ok.code).toBe(0)
  })
  it('keys: a token list that is not JSON is wrong usage naming the flag; the usage shows only what runs', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'kvgate-cli-keys-'))
    const file = join(dir, 'tokens.json')
    writeFileSync(file, '[1, 2,')
    for (const args of [
      ['--tokens', '[1,2'],
      ['--file', file],
    ]) {
      const r = await kvgate('keys', '--chunk-tokens', '1', ...args)
      expect(r.code, args.join(' ')).toBe(2)
      expect(r.stderr).toContain(`${args[0]}: not a JSON array`)
    }
    // The usage line offered a bare '-', which is refused as a stray argument.
    const help = await kvgate('keys', '--help')
    expect(help.stdout).not.toMatch(/\| -\)/)
    expect((await kvgate('keys', '-')).code).toBe(2)
  })
  it('keys: the keys line up in one column whatever the width of the token ranges', async () => {
    const tokens = Array.from({ length: 34 }, (_, i) => i).join(',')
    const r = await kvgate(
      'keys',
      '--model',
      'stories260k',
      '--chunk-tokens',
      '8',
      '--partial',
      '--tokens',
      tokens,
    )
    expect(r.code).toBe(0)
    const lines = r.stdout.trim().split('\n').slice(1)
    expect(lines).toHaveLength(5)
    const columns = new Set(lines.map((l) => l.search(/[0-9a-f]{64}/)))
    expect([...columns]).toHaveLength(1)
  })
  it('gc on the memory store (nothing outlives a process) is wrong usage, not a pass over an empty bucket', async () => {
    const r = await kvgate('gc', '--store', 'memory', '--dry-run')
    expect(r.code).toBe(2)
    expect(r.stdout).toBe('')
    expect(r.stderr).toContain('fs or s3')
  })
  it('inspect reports an intact sample, then a damaged one, with exit codes', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'kvgate-cli-'))
    const file = join(dir, 'sample.kvc')
    expect((await kvgate('inspect', '--write-sample', file)).code).toBe(0)
    const ok = await kvgate('inspect', file)
    expect(ok.code).toBe(0)
    expect(ok.stdout).toContain('OK')
    expect(ok.stdout).toMatch(/5 layers × 4 kv heads × 8 dims/)
    const json = JSON.parse((await kvgate('inspect', file, '--json')).stdout)
    expect(json.ok).toBe(true)
    expect(json.sections).toHaveLength(5)
    const bytes = readFileSync(file)
    bytes[bytes.length - 1]! ^= 0xff
    writeFileSync(file, bytes)
    const bad = await kvgate('inspect', file, '--json')
    expect(bad.code).toBe(1)
    const report = JSON.parse(bad.stdout)
    expect(report.sections.map((s: { ok: boolean }) => s.ok)).toEqual([true, true, true, true, false])
    writeFileSync(file, bytes.subarray(0, 100))
    const cut = await kvgate('inspect', file)
    expect(cut.code).toBe(1)
    // A latent (MLA) chunk says so.
    const latent = encodeChunk(
      {
        codec: 'raw',
        codecVersion: 1,
        codecParams: new Uint8Array(16),
        geometry: { layers: 2, kvHeads: 1, headDim: 64, dtype: 'bf16', latent: true },
        tokens: 4,
        chunkIndex: 0,
        partial: false,
        namespaceId: new Uint8Array(16),
        chainKey: new Uint8Array(32).fill(1),
        parentKey: new Uint8Array(32),
      },
      [new Uint8Array(4 * 64 * 2), new Uint8Array(4 * 64 * 2)],
    )
    writeFileSync(file, latent)
    const mla = await kvgate('inspect', file)
    expect(mla.code).toBe(0)
    expect(mla.stdout).toMatch(/2 layers × latent 64 \(MLA/)
    expect(cut.stdout).toContain('ERR_FORMAT_TRUNCATED')
    expect((await kvgate('inspect', join(dir, 'missing'))).code).toBe(2)
    expect((await kvgate('inspect', '--bogus')).stderr).toContain('--help')
  })
  it('inspect on an endless device or a large non-chunk file answers from the header, without reading it all', async () => {
    // Without a bound, /dev/zero grows a buffer until the process dies (or the timeout).
    const r = await new Promise<{ code: number | null; stdout: string }>((resolve) => {
      execFile(
        process.execPath,
        [bin, 'inspect', '/dev/zero', '--json'],
        { encoding: 'utf8', timeout: 20_000 },
        (e, stdout) => resolve({ code: e ? (typeof e.code === 'number' ? e.code : null) : 0, stdout }),
      )
    })
    expect(r.code).toBe(1)
    expect(JSON.parse(r.stdout).error.code).toBe('ERR_FORMAT_BAD_MAGIC')
    // A sparse 8 GiB file (over what readFileSync takes): its size, and the header's verdict.
    const dir = mkdtempSync(join(tmpdir(), 'kvgate-cli-'))
    const file = join(dir, 'sparse.kvc')
    writeFileSync(file, '')
    truncateSync(file, 8 * 1024 ** 3)
    const big = await kvgate('inspect', file, '--json')
    expect(big.code).toBe(1)
    expect(JSON.parse(big.stdout)).toMatchObject({
      ok: false,
      bytes: 8 * 1024 ** 3,
      error: { code: 'ERR_FORMAT_BAD_MAGIC' },
    })
    // A valid object followed by extra bytes: the file's real length is reported.
    const sample = join(dir, 'longer.kvc')
    const bytes = sampleChunkObject()
    writeFileSync(sample, Buffer.concat([bytes, Buffer.alloc(1000)]))
    const longer = JSON.parse((await kvgate('inspect', sample, '--json')).stdout)
    expect(longer).toMatchObject({ ok: false, bytes: bytes.length + 1000 })
    expect(longer.error.message).toBe(`file is ${bytes.length + 1000} bytes, header says ${bytes.length}`)
    expect(longer.sections.every((s: { ok: boolean }) => s.ok)).toBe(true)
  })
  it('inspect shows the calibration a format-v2 object names', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'kvgate-cli-'))
    const file = join(dir, 'calibrated.kvc')
    const v1 = sampleChunkObject()
    const h = decodeHeader(v1)
    const sections = h.sections.map((s) => v1.subarray(s.offset, s.offset + s.length))
    const hash = 'c0ffee'.padEnd(64, '1')
    writeFileSync(file, encodeChunk({ ...h, calibration: hash }, sections))
    const text = await kvgate('inspect', file)
    expect(text.code).toBe(0)
    expect(text.stdout).toContain('format v2')
    expect(text.stdout).toContain(`calibration ${hash}`)
    const json = JSON.parse((await kvgate('inspect', file, '--json')).stdout)
    expect([json.ok, json.header.formatVersion, json.header.calibration]).toEqual([true, 2, hash])
  })
  it('keys prints the same chain as the library', async () => {
    const r = await kvgate(
      'keys',
      '--model',
      'stories260k',
      '--chunk-tokens',
      '4',
      '--tokens',
      '1,2,3,4,5,6,7,8',
      '--json',
    )
    const p = MODEL_PRESETS.stories260k
    const expected = chainKeys([1, 2, 3, 4, 5, 6, 7, 8], { modelId: p.modelId, geometry: p, chunkTokens: 4 })
    expect(JSON.parse(r.stdout).keys.map((k: { key: string }) => k.key)).toEqual(expected.map((k) => k.hex))
  })
  it('every command answers --help', async () => {
    for (const c of ['inspect', 'keys']) {
      const r = await kvgate(c, '--help')
      expect(r.code).toBe(0)
      expect(r.stdout).toContain(`kvgate ${c}`)
    }
  })
})
