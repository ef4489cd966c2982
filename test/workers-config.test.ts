// The Worker's settings come from wrangler.toml's [vars] (and secrets), typed by hand: a typo
// must not leave a default in place in silence. Checked in Node on gatewayFromEnv; the real
// isolate answers the same ConfigError as 500 ERR_CONFIG (test/workers.test.ts).

import { describe, expect, it } from 'vitest'
import { gatewayFromEnv, type WorkerEnv } from '../src/gateway/adapters/workers.ts'
import type { R2BucketLike } from '../src/gateway/stores/r2.ts'

const bucket = { get: async () => null, put: async () => null } as unknown as R2BucketLike
const worker = (vars: Record<string, unknown>) =>
  gatewayFromEnv({ KVGATE_BUCKET: bucket, KVGATE_AUTH: 'disabled', ...vars } as WorkerEnv)

describe('Worker [vars]', () => {
  it('an unknown KVGATE_* variable is an error naming it and the nearest known one', () => {
    expect(() => worker({ KVGATE_MAX_CHUNKS_BYTES: '1000' })).toThrow(
      "unknown variable KVGATE_MAX_CHUNKS_BYTES (did you mean 'KVGATE_MAX_CHUNK_BYTES'?)",
    )
    // Settings of the Node gateway that the Worker does not read are unknown here too.
    expect(() => worker({ KVGATE_S3_BUCKET: 'b' })).toThrow('unknown variable KVGATE_S3_BUCKET')
  })

  it('KVGATE_PUBLIC_STATUS and KVGATE_AUTH take only their documented values', () => {
    expect(() => worker({ KVGATE_PUBLIC_STATUS: 'yes' })).toThrow(
      "KVGATE_PUBLIC_STATUS: expected 'true' or 'false'",
    )
    expect(() =>
      gatewayFromEnv({ KVGATE_BUCKET: bucket, KVGATE_AUTH: 'off', KVGATE_TOKENS: '[]' } as WorkerEnv),
    ).toThrow("KVGATE_AUTH: expected 'disabled' or unset")
  })

  it('KVGATE_READER_MIN_BYTES_PER_SECOND sets the GET reader pace (0: off); a bad one is an error naming it', () => {
    expect(worker({}).state.limits.readerMinBytesPerSecond).toBe(64 * 1024)
    expect(
      worker({ KVGATE_READER_MIN_BYTES_PER_SECOND: '131072' }).state.limits.readerMinBytesPerSecond,
    ).toBe(131072)
    expect(worker({ KVGATE_READER_MIN_BYTES_PER_SECOND: 0 }).state.limits.readerMinBytesPerSecond).toBe(0)
    expect(worker({}).state.limits.readerIdleTimeoutMs).toBe(30_000)
    expect(worker({ KVGATE_READER_IDLE_TIMEOUT_MS: '5000' }).state.limits.readerIdleTimeoutMs).toBe(5000)
    for (const bad of ['0', '-1', 'soon'])
      expect(() => worker({ KVGATE_READER_IDLE_TIMEOUT_MS: bad }), bad).toThrow(
        /KVGATE_READER_IDLE_TIMEOUT_MS must be an integer/,
      )
    for (const bad of ['-1', '1.5', 'fast', 2 ** 60])
      expect(() => worker({ KVGATE_READER_MIN_BYTES_PER_SECOND: bad }), String(bad)).toThrow(
        /KVGATE_READER_MIN_BYTES_PER_SECOND must be an integer/,
      )
  })

  it('known variables and other bindings pass', () => {
    const app = worker({ KVGATE_MAX_CHUNK_BYTES: '1000', KVGATE_PUBLIC_STATUS: 'false', OTHER_BINDING: 'x' })
    expect(app.state.limits.maxChunkBytes).toBe(1000)
  })

  it('JSON-typed [vars] (an unquoted TOML number or boolean) are read as the values they are', () => {
    // `KVGATE_MAX_CHUNK_BYTES = 1000` without quotes reaches the Worker as the number 1000: it
    // was refused as "must be an integer ≥ 1, got 1000", and `true` as "expected 'true', got 'true'".
    const app = worker({ KVGATE_MAX_CHUNK_BYTES: 1000, KVGATE_PUBLIC_STATUS: true })
    expect(app.state.limits.maxChunkBytes).toBe(1000)
    const typed = worker({ KVGATE_PRESENCE_TTL_MS: 5000, KVGATE_PUBLIC_STATUS: false })
    expect(typed.state.limits.maxChunkBytes).toBe(90 * 1024 * 1024)
    // A number that is no such integer is still an error naming the variable.
    for (const bad of [1.5, -1, 0, Number.NaN, 2 ** 60])
      expect(() => worker({ KVGATE_MAX_CHUNK_BYTES: bad })).toThrow(
        /KVGATE_MAX_CHUNK_BYTES must be an integer/,
      )
    expect(() => worker({ KVGATE_PUBLIC_STATUS: 1 })).toThrow(
      "KVGATE_PUBLIC_STATUS: expected 'true' or 'false'",
    )
  })
})
