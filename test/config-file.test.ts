// Hostile or broken YAML config files (kvgate serve / gc via settingsFromFile, kvgate agent and
// the client via optionsFromEnvironment): each is one ConfigError naming the file, promptly;
// never a hang, an out-of-memory crash or a value silently changed.

import { execFile } from 'node:child_process'
import { mkdtempSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { promisify } from 'node:util'
import { describe, expect, it } from 'vitest'
import { optionsFromEnvironment } from '../src/client/config.ts'
import { MAX_CONFIG_FILE_BYTES } from '../src/core/config-file.ts'
import { resolveServeConfig, settingsFromEnv, settingsFromFile } from '../src/gateway/config.ts'

const dir = mkdtempSync(join(tmpdir(), 'kvgate-config-file-'))
const file = (name: string, body: string | Uint8Array) => {
  const path = join(dir, name)
  writeFileSync(path, body)
  return path
}

// Both readers, so every case is checked for the gateway file and the client file.
const readers: [string, (path: string) => unknown][] = [
  ['gateway (serve, gc)', (path) => settingsFromFile(path)],
  [
    'client (agent, optionsFromEnvironment)',
    (path) => optionsFromEnvironment({ KVGATE_CLIENT_CONFIG: path }),
  ],
]

describe.each(readers)('%s config file', (_, read) => {
  it('non-UTF-8 bytes are an error, not U+FFFD in a path or token', () => {
    const path = file('latin1.yaml', Buffer.from('namespace: caf\xe9\nhost: caf\xe9\n', 'latin1'))
    expect(() => read(path)).toThrow(`config file ${path} is not UTF-8 text`)
  })

  it('a file over the size bound is refused before it is parsed', () => {
    const path = file('big.yaml', `# ${'x'.repeat(MAX_CONFIG_FILE_BYTES)}\n`)
    expect(() => read(path)).toThrow(`config file ${path} is larger than`)
  })

  it('an endless device (/dev/zero) ends in the same error, not a hang', () => {
    expect(() => read('/dev/zero')).toThrow('config file /dev/zero is larger than')
  })

  it('a document that is not a mapping says so', () => {
    for (const body of ['just a string\n', '- a\n- b\n', '42\n']) {
      const path = file('scalar.yaml', body)
      expect(() => read(path)).toThrow(`config file ${path}: expected a mapping (key: value lines)`)
    }
  })

  it('an unknown tag is an error naming it, not a warning and a string', () => {
    const path = file('tag.yaml', 'namespace: !!js/function "f() {}"\n')
    expect(() => read(path)).toThrow(/js\/function/)
  })

  it('an alias bomb is refused', () => {
    const lines = ['a0: &a0 [x, x, x, x, x, x, x, x, x]']
    for (let i = 1; i < 10; i++)
      lines.push(
        `a${i}: &a${i} [${Array(9)
          .fill(`*a${i - 1}`)
          .join(', ')}]`,
      )
    const path = file('bomb.yaml', `${lines.join('\n')}\n`)
    expect(() => read(path)).toThrow(/resource exhaustion|alias/i)
  })

  it('an empty file is no settings', () => {
    expect(read(file('empty.yaml', '# nothing\n'))).toEqual({})
  })
})

describe('a section that is not a mapping', () => {
  // `presign: 5` or an empty `store:` is a value of the wrong type, not an unknown key: the
  // message must not call the key unknown and suggest that very key.
  it.each([
    ['gateway', 'presign: 5\n', 'presign'],
    ['gateway', 'store:\n', 'store'],
    ['client', 'memory: 5\n', 'memory'],
    ['client', 'remote:\n', 'remote'],
  ])('%s: %j names the section and says a mapping is expected', (which, body, key) => {
    const path = file('section.yaml', body)
    const read = which === 'gateway' ? readers[0]![1] : readers[1]![1]
    let message = ''
    try {
      read(path)
    } catch (e) {
      message = (e as Error).message
    }
    expect(message).toContain(`${path}: ${key}: expected a mapping`)
    expect(message).not.toContain('unknown key')
  })
})

describe('kvgate serve with a non-UTF-8 config file', () => {
  it('exits 2 with one line naming the file', async () => {
    const path = file(
      'serve-latin1.yaml',
      Buffer.from(`store: { kind: fs, dir: ${dir}/caf\xe9 }\nport: 0\n`, 'latin1'),
    )
    const bin = new URL('../bin/kvgate.mjs', import.meta.url).pathname
    const r = await promisify(execFile)(process.execPath, [bin, 'serve', '--config', path], {
      encoding: 'utf8',
      env: { ...process.env, KVGATE_CONFIG: '' },
      timeout: 20_000, // without the check it serves (from a directory named with U+FFFD)
    }).then(
      () => ({ code: 0, stderr: '' }),
      (e: { code: number; stderr: string }) => e,
    )
    expect(r.code).toBe(2)
    expect(r.stderr.trim()).toBe(`kvgate serve: config file ${path} is not UTF-8 text [ERR_CONFIG]`)
  })
})

describe('client KVGATE_* variables with a fixed set of values', () => {
  // Checked when read, naming the variable: the agent reads them at start-up and must not
  // start with a value that fails every engine's registration later.
  it.each([
    ['KVGATE_REMOTE_CODEC', 'zip', 'kvgate, lossless or raw'],
    ['KVGATE_KEY_SCHEME', 'md5', 'sha256-v1 or vllm-sha256-cbor'],
    ['KVGATE_DISK_STORE_AS', 'zstd', 'raw or lossless'],
    ['KVGATE_DISK', 'no', 'on or off'],
    ['KVGATE_REMOTE', 'disabled', 'on or off'],
  ])('%s=%s is an error naming the variable', (name, value, expected) => {
    expect(() => optionsFromEnvironment({ [name]: value })).toThrow(
      `invalid ${name}: '${value}' (${expected})`,
    )
  })

  it('the valid values still work', () => {
    expect(
      optionsFromEnvironment({
        KVGATE_REMOTE_CODEC: 'lossless',
        KVGATE_KEY_SCHEME: 'vllm-sha256-cbor',
        KVGATE_DISK_STORE_AS: 'lossless',
        KVGATE_REMOTE: 'on',
      }),
    ).toEqual({ keyScheme: 'vllm-sha256-cbor', disk: { storeAs: 'lossless' }, remote: { codec: 'lossless' } })
    expect(optionsFromEnvironment({ KVGATE_DISK: 'off', KVGATE_REMOTE: 'false' })).toEqual({
      disk: false,
      remote: false,
    })
  })
})

describe('the gateway cold-tier settings', () => {
  it('a mistake names KVGATE_COLD_TIER or the file, not an internal coldTier', () => {
    expect(() => settingsFromEnv({ KVGATE_COLD_TIER: '{bad' })).toThrow('KVGATE_COLD_TIER is not valid JSON')
    expect(() => settingsFromEnv({ KVGATE_COLD_TIER: '{"namespaces":{"*":{"retenion":"30d"}}}' })).toThrow(
      'KVGATE_COLD_TIER.namespaces.*: unknown key "retenion"',
    )
    const path = file('cold.yaml', 'coldTier:\n  grace: soon\n')
    expect(() => settingsFromFile(path)).toThrow(`${path}: coldTier.grace`)
    // Valid settings pass through unchanged (resolved later with the rest).
    expect(settingsFromEnv({ KVGATE_COLD_TIER: '{"grace":"10m"}' })).toEqual({ coldTier: '{"grace":"10m"}' })
  })
})

describe('gateway string settings with surrounding whitespace', () => {
  // A value pasted with a trailing space or newline (a secret file's last line) must not become
  // a bind address, bucket or key that fails later with an unrelated error (ENOTFOUND,
  // SignatureDoesNotMatch): it is an error naming the variable.
  it.each([
    ['KVGATE_HOST', ' 0.0.0.0 '],
    ['KVGATE_S3_BUCKET', 'kv '],
    ['KVGATE_S3_REGION', '\tus-east-1'],
    ['KVGATE_S3_ACCESS_KEY_ID', 'AKIA\n'],
    ['KVGATE_S3_SECRET_ACCESS_KEY', 'secret\n'],
    ['KVGATE_STORE_DIR', '/var/lib/kvgate '],
  ])('%s=%j names the variable and the whitespace', (name, value) => {
    expect(() => settingsFromEnv({ [name]: value })).toThrow(`${name}: must not begin or end with whitespace`)
  })

  it('the same in the file, and values without it pass', () => {
    const path = file('ws.yaml', 'host: "127.0.0.1 "\n')
    expect(() => settingsFromFile(path)).toThrow(`${path}: host: must not begin or end with whitespace`)
    expect(settingsFromEnv({ KVGATE_HOST: '0.0.0.0', KVGATE_S3_BUCKET: 'kv' })).toEqual({
      host: '0.0.0.0',
      s3Bucket: 'kv',
    })
  })
})

describe('S3 credentials given by halves', () => {
  // One of the pair alone was dropped in silence: the SDK's default chain (AWS_* variables, a
  // profile, an instance role) then signed for whichever account it found.
  it('an access key id without its secret, or the reverse, is an error naming both', () => {
    const half = [{ KVGATE_S3_ACCESS_KEY_ID: 'AKIAEXAMPLE' }, { KVGATE_S3_SECRET_ACCESS_KEY: 'secret' }]
    for (const env of half)
      expect(() =>
        resolveServeConfig(settingsFromEnv({ KVGATE_STORE: 's3', KVGATE_S3_BUCKET: 'kv', ...env })),
      ).toThrow(/KVGATE_S3_ACCESS_KEY_ID and KVGATE_S3_SECRET_ACCESS_KEY/)
    const both = resolveServeConfig(
      settingsFromEnv({
        KVGATE_STORE: 's3',
        KVGATE_S3_BUCKET: 'kv',
        KVGATE_S3_ACCESS_KEY_ID: 'AKIAEXAMPLE',
        KVGATE_S3_SECRET_ACCESS_KEY: 'secret',
      }),
    )
    expect(both.store).toMatchObject({ accessKeyId: 'AKIAEXAMPLE', secretAccessKey: 'secret' })
    expect(
      resolveServeConfig(settingsFromEnv({ KVGATE_STORE: 's3', KVGATE_S3_BUCKET: 'kv' })).store,
    ).not.toHaveProperty('accessKeyId')
  })
})

describe('client option values of the wrong type', () => {
  // `chunkTokens: "256"` (quoted in YAML) was refused as "expected an integer …, got 256".
  it('a string where a number belongs is shown quoted, so the message says what is wrong', async () => {
    const { resolveOptions } = await import('../src/client/config.ts')
    expect(() => resolveOptions({ model: 'stories260k', chunkTokens: '256' } as never)).toThrow(
      'invalid chunkTokens: expected an integer in 1..1048576, got "256"',
    )
    expect(() => resolveOptions({ model: 'stories260k', chunkTokens: 0 })).toThrow(
      'invalid chunkTokens: expected an integer in 1..1048576, got 0',
    )
  })
})
