// `kvgate serve`: runs the gateway on Node. Config from a YAML file, KVGATE_* env
// and flags (flags win); fs store in ./.kvgate/store on 127.0.0.1:8787 by default.

import { InvalidArgumentError } from '../../core/errors.ts'
import { serveGateway } from '../../gateway/adapters/node.ts'
import { createGateway } from '../../gateway/app.ts'
import {
  CONFIG_ENV,
  ENV_VARS,
  resolveServeConfig,
  type ServeConfig,
  type ServeSettings,
  settingsFromEnv,
  settingsFromFile,
  settingsFromFlags,
} from '../../gateway/config.ts'
import { hashToken } from '../../gateway/middleware/auth.ts'
import { FsStore } from '../../gateway/stores/fs.ts'
import { MemoryStore } from '../../gateway/stores/memory.ts'
import { S3Store } from '../../gateway/stores/s3.ts'
import type { ObjectStore } from '../../gateway/stores/types.ts'
import { parseCommandArgs } from '../args.ts'

const HELP = `Usage: kvgate serve [options]

Runs the kvgate gateway (HTTP API /v1, /healthz, /metrics, status page at /).
With no options: fs store in ./.kvgate/store, http://127.0.0.1:8787, auth off.

Options (flags override KVGATE_* env vars, which override the config file):
  -c, --config FILE          YAML config file (env: KVGATE_CONFIG; unknown keys are errors)
      --host HOST            bind address [127.0.0.1]
  -p, --port N               port, 0 = any free one [8787]
      --store KIND           fs | s3 | memory [fs]
      --dir DIR              fs store directory [./.kvgate/store]
      --prefix P             object name prefix [kvgate]
      --s3-bucket NAME       s3 bucket
      --s3-endpoint URL      S3-compatible endpoint (RadosGW, MinIO, R2...)
      --s3-region REGION     [us-east-1]
      --s3-path-style        path-style URLs (default on when an endpoint is set)
      --presign-min-bytes N  answer GETs of objects >= N bytes with 307 to a presigned URL
                             (s3 store; default 8388608; 'off' proxies every byte)
      --upload-min-bytes N   hand bodies >= N bytes presigned staging uploads (s3 store;
                             the client uploads to the bucket, the gateway verifies the
                             commit) [off]
      --max-chunk-bytes N    largest chunk accepted [536870912]
      --presence-ttl-ms N    how long a cached presence is trusted [30000]
      --body-idle-timeout-ms N     a PUT body silent this long fails with 408 [30000]
      --reader-idle-timeout-ms N   a GET reader idle this long is cut off [30000]
      --reader-min-bytes-per-second N
                                   a GET reader slower than this over that time
                                   is cut off; 0 = off [65536]
      --max-in-flight-bytes N      declared PUT bytes in flight, 503 above [1073741824]
      --max-held-bytes N           bytes held for requests (read-ahead, parts, bodies),
                                   503 above [268435456]
      --max-connections N          open connections at most [1024]
      --log LEVEL            info | warn | error | silent [info]
      --status-public        serve the status page and /metrics without a token, so a
                             browser can open http://HOST:PORT/ (loopback binds only,
                             unless --insecure; env: KVGATE_PUBLIC_STATUS=true)
      --insecure             allow a non-loopback bind without tokens
      --hash-token TOKEN     print the SHA-256 of TOKEN, and exit (kvgate token makes
                             a new token and prints its whole entry)
  -h, --help

S3 credentials come from KVGATE_S3_ACCESS_KEY_ID / KVGATE_S3_SECRET_ACCESS_KEY or
the AWS SDK's default chain (AWS_* env, profile, instance role).

Environment: ${ENV_VARS.join(' ')}

Config file:
  host: 127.0.0.1
  port: 8787
  prefix: kvgate
  store: { kind: s3, s3: { bucket: kv, endpoint: http://127.0.0.1:7480, region: us-east-1 } }
  presign: { minBytes: 8388608, expiresSeconds: 60 }   # s3 default; minBytes: off to proxy all
  uploads: { minBytes: 8MiB, expiresSeconds: 900, stagingPrefix: kvgate-staging }   # s3; off by default
  auth:
    tokens:
      - { name: fleet, sha256: <kvgate token prints it>, scopes: write, namespaces: [prod] }
      - { name: ops, sha256: <...>, scopes: admin, namespaces: '*' }
    publicStatus: false
  coldTier:                            # env: KVGATE_COLD_TIER (the same as JSON); see docs/cold-tier.md
    grace: 10m                         # never delete what was read or written this recently
    usage: { flushInterval: 60s, maxDelay: 5m, maxKeys: 20000 }
    namespaces:
      prod: { retention: 30d, quota: 500GiB }
      '*': { retention: 90d }
  maxChunkBytes: 512MiB     # byte sizes take units: 4096, 8MiB, 10GB
  maxCalibrationBytes: 16MiB  # calibration objects (docs/calibration.md); env KVGATE_MAX_CALIBRATION_BYTES
  calibrationCacheBytes: 64MiB  # verified calibrations kept in memory; larger ones stream. env KVGATE_CALIBRATION_CACHE_BYTES

Exit status: 0 after a clean stop, 1 on a failure, 2 on a wrong flag, file key or KVGATE_* value.
`

export async function run(argv: string[]): Promise<number> {
  const { values, help } = parseCommandArgs(argv, {
    config: { type: 'string', short: 'c' },
    host: { type: 'string' },
    port: { type: 'string', short: 'p' },
    store: { type: 'string' },
    dir: { type: 'string' },
    prefix: { type: 'string' },
    's3-bucket': { type: 'string' },
    's3-endpoint': { type: 'string' },
    's3-region': { type: 'string' },
    's3-path-style': { type: 'boolean' },
    'presign-min-bytes': { type: 'string' },
    'max-chunk-bytes': { type: 'string' },
    'upload-min-bytes': { type: 'string' },
    'presence-ttl-ms': { type: 'string' },
    'body-idle-timeout-ms': { type: 'string' },
    'reader-idle-timeout-ms': { type: 'string' },
    'reader-min-bytes-per-second': { type: 'string' },
    'max-in-flight-bytes': { type: 'string' },
    'max-held-bytes': { type: 'string' },
    'max-connections': { type: 'string' },
    log: { type: 'string' },
    insecure: { type: 'boolean' },
    'status-public': { type: 'boolean' },
    'hash-token': { type: 'string' },
  })
  if (help) {
    console.log(HELP)
    return 0
  }
  if (values['hash-token'] !== undefined) {
    console.log(await hashToken(values['hash-token']))
    return 0
  }
  const flags: ServeSettings = {}
  const map: [keyof typeof values, keyof ServeSettings][] = [
    ['host', 'host'],
    ['port', 'port'],
    ['store', 'store'],
    ['dir', 'dir'],
    ['prefix', 'prefix'],
    ['s3-bucket', 's3Bucket'],
    ['s3-endpoint', 's3Endpoint'],
    ['s3-region', 's3Region'],
    ['s3-path-style', 's3PathStyle'],
    ['presign-min-bytes', 'presignMinBytes'],
    ['max-chunk-bytes', 'maxChunkBytes'],
    ['upload-min-bytes', 'uploadMinBytes'],
    ['presence-ttl-ms', 'presenceTtlMs'],
    ['body-idle-timeout-ms', 'bodyIdleTimeoutMs'],
    ['reader-idle-timeout-ms', 'readerIdleTimeoutMs'],
    ['reader-min-bytes-per-second', 'readerMinBytesPerSecond'],
    ['max-in-flight-bytes', 'maxInFlightBytes'],
    ['max-held-bytes', 'maxHeldBytes'],
    ['max-connections', 'maxConnections'],
    ['log', 'log'],
    ['insecure', 'insecure'],
    ['status-public', 'publicStatus'],
  ]
  for (const [flag, key] of map) {
    const v = values[flag]
    if (v !== undefined) (flags as Record<string, unknown>)[key] = v
  }
  const file = (values.config as string | undefined) ?? process.env[CONFIG_ENV]
  const config = resolveServeConfig(
    file ? settingsFromFile(file) : {},
    settingsFromEnv(process.env),
    settingsFromFlags(flags as Record<string, unknown>),
  )
  return serve(config)
}

export async function openStore(config: ServeConfig): Promise<ObjectStore> {
  const s = config.store
  if (s.kind === 'fs') return new FsStore({ root: s.dir, fsync: s.fsync }).open()
  if (s.kind === 'memory') return new MemoryStore()
  return new S3Store({
    bucket: s.bucket,
    region: s.region,
    ...(s.endpoint ? { endpoint: s.endpoint } : {}),
    ...(s.forcePathStyle !== undefined ? { forcePathStyle: s.forcePathStyle } : {}),
    ...(s.accessKeyId && s.secretAccessKey
      ? { credentials: { accessKeyId: s.accessKeyId, secretAccessKey: s.secretAccessKey } }
      : {}),
  })
}

const LEVELS = { info: 0, warn: 1, error: 2, silent: 3 } as const

async function serve(config: ServeConfig): Promise<number> {
  if (config.presign && config.store.kind !== 's3') {
    throw new InvalidArgumentError('presigned redirects need the s3 store')
  }
  let store: ObjectStore
  try {
    store = await openStore(config)
  } catch (e) {
    const code = (e as NodeJS.ErrnoException).code
    if (
      config.store.kind === 'fs' &&
      code &&
      ['ENOTDIR', 'EACCES', 'EPERM', 'EEXIST', 'EROFS', 'ENOENT'].includes(code)
    ) {
      const why =
        {
          ENOTDIR: 'a path component is a file, not a directory',
          EEXIST: 'exists and is not a directory',
          EROFS: 'on a read-only file system',
        }[code as 'ENOTDIR'] ?? 'not writable'
      console.error(
        `kvgate serve: store directory ${config.store.dir}: ${why} [${code}]; choose another with --dir (or KVGATE_STORE_DIR, store.dir)`,
      )
      return 1
    }
    throw e
  }
  const min = LEVELS[config.log]
  const write = (entry: Record<string, unknown>) => {
    const level = (entry.level as keyof typeof LEVELS) ?? 'info'
    if (LEVELS[level] >= min && min < LEVELS.silent) process.stdout.write(`${JSON.stringify(entry)}\n`)
  }
  const app = createGateway({
    store,
    prefix: config.prefix,
    ...(config.tokens.length ? { auth: { tokens: config.tokens, publicStatus: config.publicStatus } } : {}),
    ...(config.presign ? { presign: config.presign } : {}),
    ...(config.uploads ? { uploads: config.uploads } : {}),
    limits: {
      ...(config.maxChunkBytes ? { maxChunkBytes: config.maxChunkBytes } : {}),
      bodyIdleTimeoutMs: config.bodyIdleTimeoutMs,
      bodyMinBytesPerSecond: config.bodyMinBytesPerSecond,
      readerIdleTimeoutMs: config.readerIdleTimeoutMs,
      readerMinBytesPerSecond: config.readerMinBytesPerSecond,
      maxInFlightBytes: config.maxInFlightBytes,
      maxHeldBytes: config.maxHeldBytes,
      maxConcurrentVerifies: config.maxConcurrentVerifies,
      maxCalibrationBytes: config.maxCalibrationBytes,
      calibrationCacheBytes: config.calibrationCacheBytes,
    },
    lookup: { presenceTtlMs: config.presenceTtlMs },
    coalesce: { maxBytes: config.coalesceMaxBytes, maxBufferedBytes: config.coalesceMaxBufferedBytes },
    coldTier: config.coldTier.tracking ? { usage: config.coldTier.usage } : { tracking: false },
    logger: (e) =>
      write({
        ...e,
        level: (e.status as number) >= 500 ? 'error' : (e.status as number) >= 400 ? 'warn' : 'info',
      }),
  })
  app.state.usage?.start()
  let gw: Awaited<ReturnType<typeof serveGateway>>
  try {
    gw = await serveGateway(app, {
      host: config.host,
      port: config.port,
      maxConnections: config.maxConnections,
    })
  } catch (e) {
    await app.state.usage?.close().catch(() => {})
    await store.close?.()
    const code = (e as NodeJS.ErrnoException).code
    if (code === 'EADDRINUSE') {
      console.error(
        `kvgate serve: port ${config.port} on ${config.host} is already in use; pick another with --port (or KVGATE_PORT; 0 picks a free one) [EADDRINUSE]`,
      )
      return 1
    }
    if (code === 'EADDRNOTAVAIL' || code === 'ENOTFOUND' || code === 'EACCES') {
      console.error(
        `kvgate serve: cannot listen on ${config.host}:${config.port} [${code}]; check --host / --port (or KVGATE_HOST / KVGATE_PORT)`,
      )
      return 1
    }
    throw e
  }
  // The listening line is printed at any level but silent: scripts read the URL from it.
  const announce =
    min < LEVELS.silent
      ? (e: Record<string, unknown>) => process.stdout.write(`${JSON.stringify(e)}\n`)
      : write
  announce({
    level: 'info',
    time: new Date().toISOString(),
    msg: 'listening',
    url: gw.url,
    store: config.store.kind,
    ...(config.store.kind === 'fs' ? { dir: config.store.dir } : {}),
    ...(config.store.kind === 's3' ? { bucket: config.store.bucket } : {}),
    auth: config.tokens.length > 0,
  })
  if (config.tokens.length === 0) {
    process.stderr.write(`kvgate serve: auth is off (no tokens configured); listening on ${gw.url} only\n`)
  }
  await new Promise<void>((resolve) => {
    const stop = (signal: string) => {
      write({ level: 'info', time: new Date().toISOString(), msg: 'stopping', signal })
      resolve()
    }
    process.once('SIGINT', () => stop('SIGINT'))
    process.once('SIGTERM', () => stop('SIGTERM'))
  })
  await gw.close(5000)
  // Unflushed use records would otherwise be lost with the process (gc would see older last uses).
  await app.state.usage?.close().catch(() => {})
  await store.close?.()
  return 0
}
