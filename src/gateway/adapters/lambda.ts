// AWS Lambda adapter: function URL events (payload v2) in, streamed responses out
// (awslambda.streamifyResponse); the gateway is built once per cold start from env.

import type { Writable } from 'node:stream'
import { Readable } from 'node:stream'
import { pipeline } from 'node:stream/promises'
import { type ColdTierConfig, parseColdTier } from '../../coldtier/policy.ts'
import { nearestKey } from '../../core/config-check.ts'
import { ConfigError, isKvgateError } from '../../core/errors.ts'
import { createGateway } from '../app.ts'
import { DEFAULT_READER_MIN_BYTES_PER_SECOND } from '../context.ts'
import { BODY_HOLD_BYTES, DEFAULT_MAX_HELD_BYTES, lambdaMaxHeldBytes } from '../memory-budget.ts'
import type { TokenGrant } from '../middleware/auth.ts'
import type { ObjectStore } from '../stores/types.ts'
import { parseTokenTable } from '../token-table.ts'

/** A Lambda function URL / API Gateway HTTP API event, payload format 2.0. */
export interface FunctionUrlEvent {
  version?: string
  rawPath: string
  rawQueryString?: string
  headers?: Record<string, string | undefined>
  cookies?: string[]
  body?: string | null
  isBase64Encoded?: boolean
  requestContext: {
    domainName?: string
    http: { method: string; sourceIp?: string }
  }
}

/** The buffered answer (when the function is not in RESPONSE_STREAM mode). */
export interface FunctionUrlResult {
  statusCode: number
  headers: Record<string, string>
  cookies?: string[]
  body: string
  isBase64Encoded: boolean
}

interface ResponseMetadata {
  statusCode: number
  headers: Record<string, string>
  cookies: string[]
}

/** The globals the Node.js Lambda runtime provides for response streaming. */
export interface AwsLambdaGlobal {
  streamifyResponse<E>(fn: (event: E, responseStream: Writable, context: unknown) => Promise<void>): unknown
  HttpResponseStream: { from(stream: Writable, metadata: ResponseMetadata): Writable }
}

/** Anything with a Web fetch: the gateway app (with its state when it is the gateway). */
export interface FetchApp {
  fetch(request: Request): Response | Promise<Response>
  state?: { usage?: { pending: Promise<void> | undefined } }
}

/** An EventBridge schedule's event for gc (the Terraform module sends `{"kvgate": "gc"}`). */
export function isGcEvent(event: unknown): boolean {
  const e = event as { kvgate?: unknown; source?: unknown } | null
  return e?.kvgate === 'gc' || e?.source === 'aws.events'
}

/** One gc pass with the function's own settings (store, prefix, KVGATE_COLD_TIER). */
export async function lambdaGc(env: Record<string, string | undefined> = process.env) {
  const cfg = configFromEnv({ ...env, KVGATE_AUTH: 'disabled' }) // gc serves no requests
  const { runGc } = await import('../../coldtier/gc.ts')
  const store = await openStore(cfg)
  try {
    const report = await runGc({ store, prefix: cfg.prefix, config: cfg.coldTier, pricePerGBMonth: 0.023 })
    console.log(
      JSON.stringify({
        msg: 'kvgate gc',
        ...report,
        namespaces: report.namespaces.map(({ policy: _, ...n }) => n),
      }),
    )
    return report
  } finally {
    await store.close?.()
  }
}

/** Builds a Web Request from a function URL event (headers, cookies, base64 bodies). */
export function eventToRequest(event: FunctionUrlEvent): Request {
  const headers = new Headers()
  for (const [k, v] of Object.entries(event.headers ?? {})) if (v !== undefined) headers.set(k, v)
  if (event.cookies?.length) headers.set('cookie', event.cookies.join('; '))
  const host = event.requestContext.domainName ?? headers.get('host') ?? 'lambda.invalid'
  const query = event.rawQueryString ? `?${event.rawQueryString}` : ''
  const method = event.requestContext.http.method.toUpperCase()
  let body: Uint8Array<ArrayBuffer> | undefined
  if (event.body != null && method !== 'GET' && method !== 'HEAD') {
    const buf = Buffer.from(event.body, event.isBase64Encoded ? 'base64' : 'utf8')
    body = new Uint8Array(buf.buffer, buf.byteOffset, buf.byteLength) as Uint8Array<ArrayBuffer>
  }
  return new Request(`https://${host}${event.rawPath}${query}`, { method, headers, body })
}

function metadataOf(res: Response): ResponseMetadata {
  const headers: Record<string, string> = {}
  const cookies: string[] = []
  res.headers.forEach((value, name) => {
    if (name === 'set-cookie') cookies.push(value)
    else headers[name] = value
  })
  return { statusCode: res.status, headers, cookies }
}

function internalError(e: unknown): Response {
  const known = isKvgateError(e)
  const status = known ? e.status : 500
  const code = known ? e.code : 'ERR_STORE_UNAVAILABLE'
  const message = known ? e.message : 'gateway failed to start'
  return Response.json({ error: { code, message } }, { status })
}

async function respond(getApp: () => Promise<FetchApp>, event: FunctionUrlEvent): Promise<Response> {
  let request: Request
  try {
    request = eventToRequest(event)
  } catch (e) {
    return Response.json(
      { error: { code: 'ERR_INVALID_ARGUMENT', message: `bad request: ${(e as Error).message}` } },
      { status: 400 },
    )
  }
  try {
    return await (await getApp()).fetch(request)
  } catch (e) {
    // The app answers its own errors; this is a failed cold start (config, SSM).
    console.error('kvgate: gateway unavailable', e)
    return internalError(e)
  }
}

/**
 * The streaming handler body: status and headers first, then the body as it comes
 * from the store. A store failure mid-body destroys the stream, so the client sees
 * a cut response (which the chunk format's CRCs reject) rather than appended text.
 */
export function streamingHandler(getApp: () => Promise<FetchApp>, aws: AwsLambdaGlobal) {
  return async (event: FunctionUrlEvent, responseStream: Writable): Promise<void> => {
    if (isGcEvent(event)) {
      const report = await lambdaGc()
      responseStream.end(JSON.stringify({ run: report.run, errors: report.errors.length }))
      return
    }
    const res = await respond(getApp, event)
    const out = aws.HttpResponseStream.from(responseStream, metadataOf(res))
    if (!res.body) {
      out.end()
      return
    }
    try {
      await pipeline(Readable.fromWeb(res.body as import('node:stream/web').ReadableStream<Uint8Array>), out)
    } catch (e) {
      console.error('kvgate: response stream failed', e)
      out.destroy(e as Error)
    }
    // A use-record flush started by this request finishes before the environment freezes.
    await (await getApp().catch(() => undefined))?.state?.usage?.pending
  }
}

/** Fallback for BUFFERED invoke mode: the whole body base64-encoded (Lambda caps it at 6 MB). */
export function bufferedHandler(getApp: () => Promise<FetchApp>) {
  return async (event: FunctionUrlEvent): Promise<FunctionUrlResult> => {
    if (isGcEvent(event)) {
      const report = await lambdaGc()
      return {
        statusCode: 200,
        headers: {},
        body: JSON.stringify({ run: report.run }),
        isBase64Encoded: false,
      }
    }
    const res = await respond(getApp, event)
    const { statusCode, headers, cookies } = metadataOf(res)
    const body = Buffer.from(await res.arrayBuffer())
    return { statusCode, headers, cookies, body: body.toString('base64'), isBase64Encoded: true }
  }
}

/** Wraps an app factory in the streaming handler when the runtime offers it, buffered otherwise. */
export function createLambdaHandler(getApp: () => Promise<FetchApp>): unknown {
  const aws = (globalThis as { awslambda?: Partial<AwsLambdaGlobal> }).awslambda
  // The AWS SDK (@aws/lambda-invoke-store) plants an empty `awslambda` object when it
  // loads first outside Lambda: only a runtime that can stream counts.
  return typeof aws?.streamifyResponse === 'function' && aws.HttpResponseStream
    ? aws.streamifyResponse(streamingHandler(getApp, aws as AwsLambdaGlobal))
    : bufferedHandler(getApp)
}

// ---------------------------------------------------------------- configuration

export interface LambdaGatewayConfig {
  bucket?: string
  region?: string
  /** S3-compatible endpoint instead of AWS S3 (local runs against RadosGW / MinIO). */
  endpoint?: string
  prefix: string
  /** SSM SecureString parameter with the token table (JSON TokenGrant[]). */
  authParameter?: string
  /** Token table given inline (local runs); SSM is preferred in AWS. */
  tokensJson?: string
  /** Explicitly run without auth (local runs only). */
  authDisabled: boolean
  /** Store in a directory instead of S3 (local runs of the bundle). */
  fsRoot?: string
  presignMinBytes: number
  presignTtlSeconds: number
  maxChunkBytes: number
  /** KVGATE_MAX_CALIBRATION_BYTES: calibration bodies travel in the event (~4.5 MiB at most). */
  maxCalibrationBytes: number
  /** KVGATE_CALIBRATION_CACHE_BYTES: verified calibration bodies kept per environment (0: none). */
  calibrationCacheBytes: number
  /** KVGATE_COLD_TIER: retention/quota per namespace, grace, use tracking. */
  coldTier: ColdTierConfig
  /** Bodies from this size are written through presigned staging uploads (KVGATE_UPLOAD_MIN_BYTES). */
  uploadMinBytes: number
  /** Largest chunk accepted through an upload (KVGATE_UPLOAD_MAX_BYTES). */
  uploadMaxBytes: number
  /** Lifetime of presigned upload targets, seconds (KVGATE_UPLOAD_TTL). */
  uploadTtlSeconds: number
  /** Staging prefix for uploads (KVGATE_STAGING_PREFIX); `<prefix>-staging` by default. */
  stagingPrefix?: string
  /**
   * KVGATE_MAX_HELD_BYTES: bytes held for requests at once (limits.maxHeldBytes). By default
   * from the function's memory (AWS_LAMBDA_FUNCTION_MEMORY_SIZE, see lambdaMaxHeldBytes).
   */
  maxHeldBytes: number
  /** KVGATE_READER_MIN_BYTES_PER_SECOND: a GET reader slower than this is cut off (0: off). */
  readerMinBytesPerSecond: number
}

/** S3 part size the Lambda store uses (the S3Store default). */
const LAMBDA_PART_BYTES = 16 * 1024 * 1024

/** What an upload commit holds beside its parts: the staged GET's and the verifier's read-ahead. */
const LAMBDA_COMMIT_READ_AHEAD = BODY_HOLD_BYTES + 4 * 1024 * 1024

/**
 * Parts in flight per S3 multipart upload (an upload commit's store side) that fit `budget`
 * beside the read-ahead: each holds a 16 MiB part, plus the one being filled. 1 to 4.
 */
export function lambdaPartConcurrency(budget: number): number {
  return Math.max(1, Math.min(4, Math.floor((budget - LAMBDA_COMMIT_READ_AHEAD) / LAMBDA_PART_BYTES) - 1))
}

/** SigV4's longest presigned URL (7 days), as createGateway checks. */
const MAX_PRESIGN_SECONDS = 604_800

function intFromEnv(
  env: Record<string, string | undefined>,
  name: string,
  fallback: number,
  // The range createGateway takes: checked here so the error names the variable, not an option.
  min = 0,
  max = Number.MAX_SAFE_INTEGER,
): number {
  const raw = env[name]
  if (raw === undefined || raw === '') return fallback
  const n = Number(raw)
  // Decimal digits only (as the Node settings): Number() would also take 0x10, 1e6 and -0.
  if (!/^\s*\d+\s*$/.test(raw) || !Number.isSafeInteger(n) || n < min || n > max)
    throw new ConfigError(`${name} must be an integer in ${min}..${max}, got ${raw}`)
  return n
}

/** Reads the gateway settings the Terraform module sets (KVGATE_* environment variables). */
// Every KVGATE_* name the function reads: Terraform (or a console edit) sets them by hand, and a
// misspelt one left its default in place in silence. Node-only settings (KVGATE_PORT …) are
// refused too: they would do nothing here.
const LAMBDA_VARS = [
  'KVGATE_S3_BUCKET',
  'KVGATE_S3_ENDPOINT',
  'KVGATE_S3_PREFIX',
  'KVGATE_AUTH_SSM_PARAMETER',
  'KVGATE_TOKENS',
  'KVGATE_AUTH',
  'KVGATE_FS_ROOT',
  'KVGATE_PRESIGN_THRESHOLD',
  'KVGATE_PRESIGN_TTL',
  'KVGATE_MAX_CHUNK_BYTES',
  'KVGATE_MAX_CALIBRATION_BYTES',
  'KVGATE_CALIBRATION_CACHE_BYTES',
  'KVGATE_COLD_TIER',
  'KVGATE_UPLOAD_MIN_BYTES',
  'KVGATE_UPLOAD_MAX_BYTES',
  'KVGATE_UPLOAD_TTL',
  'KVGATE_STAGING_PREFIX',
  'KVGATE_MAX_HELD_BYTES',
  'KVGATE_READER_MIN_BYTES_PER_SECOND',
] as const

/** Variables whose value is used as a name (numbers are trimmed; JSON ones may hold whitespace). */
const NAME_VARS = [
  'KVGATE_S3_BUCKET',
  'KVGATE_S3_ENDPOINT',
  'KVGATE_S3_PREFIX',
  'KVGATE_AUTH_SSM_PARAMETER',
  'KVGATE_FS_ROOT',
  'KVGATE_STAGING_PREFIX',
] as const

function checkVars(env: Record<string, string | undefined>): void {
  for (const name of Object.keys(env)) {
    if (!name.startsWith('KVGATE_') || (LAMBDA_VARS as readonly string[]).includes(name)) continue
    const near = nearestKey(name, LAMBDA_VARS)
    throw new ConfigError(
      `unknown variable ${name}${near ? ` (did you mean '${near}'?)` : ''}: the Lambda gateway reads ${LAMBDA_VARS.join(', ')} (docs/deploy-aws.md)`,
    )
  }
  if (env.KVGATE_AUTH !== undefined && env.KVGATE_AUTH !== 'disabled')
    throw new ConfigError(`KVGATE_AUTH: expected 'disabled' or unset, got '${env.KVGATE_AUTH}'`)
  // Names taken as given: a pasted trailing space or newline would fail later, unrelatedly.
  for (const name of NAME_VARS) {
    const v = env[name]
    if (v !== undefined && v.trim() !== v)
      throw new ConfigError(`${name}: must not begin or end with whitespace, got ${JSON.stringify(v)}`)
  }
}

export function configFromEnv(env: Record<string, string | undefined> = process.env): LambdaGatewayConfig {
  checkVars(env)
  const cfg: LambdaGatewayConfig = {
    bucket: env.KVGATE_S3_BUCKET || undefined,
    region: env.AWS_REGION || undefined,
    endpoint: env.KVGATE_S3_ENDPOINT || undefined,
    prefix: env.KVGATE_S3_PREFIX ?? 'kv',
    authParameter: env.KVGATE_AUTH_SSM_PARAMETER || undefined,
    tokensJson: env.KVGATE_TOKENS || undefined,
    authDisabled: env.KVGATE_AUTH === 'disabled',
    fsRoot: env.KVGATE_FS_ROOT || undefined,
    // 1 MiB: bytes above it cost Lambda duration and stream at 2 MB/s past the first 6 MB.
    presignMinBytes: intFromEnv(env, 'KVGATE_PRESIGN_THRESHOLD', 1024 * 1024),
    presignTtlSeconds: intFromEnv(env, 'KVGATE_PRESIGN_TTL', 300, 1, MAX_PRESIGN_SECONDS),
    maxChunkBytes: intFromEnv(env, 'KVGATE_MAX_CHUNK_BYTES', 4 * 1024 * 1024, 1),
    maxCalibrationBytes: intFromEnv(env, 'KVGATE_MAX_CALIBRATION_BYTES', 4 * 1024 * 1024, 1),
    // A few of the 4 MiB bodies, small beside the function's memory (256 MB at the least).
    calibrationCacheBytes: intFromEnv(env, 'KVGATE_CALIBRATION_CACHE_BYTES', 16 * 1024 * 1024),
    coldTier: parseColdTier(env.KVGATE_COLD_TIER, 'KVGATE_COLD_TIER'),
    // Bodies above ~4.5 MiB cannot reach the function at all (6 MB events, base64);
    // from 1 MiB they already cost more in function duration than two small requests.
    uploadMinBytes: intFromEnv(env, 'KVGATE_UPLOAD_MIN_BYTES', 1024 * 1024),
    uploadMaxBytes: intFromEnv(env, 'KVGATE_UPLOAD_MAX_BYTES', 512 * 1024 * 1024),
    uploadTtlSeconds: intFromEnv(env, 'KVGATE_UPLOAD_TTL', 900, 1, MAX_PRESIGN_SECONDS),
    stagingPrefix: env.KVGATE_STAGING_PREFIX || undefined,
    // One request at a time per execution environment, in the memory the function was given.
    maxHeldBytes: intFromEnv(
      env,
      'KVGATE_MAX_HELD_BYTES',
      env.AWS_LAMBDA_FUNCTION_MEMORY_SIZE
        ? lambdaMaxHeldBytes(intFromEnv(env, 'AWS_LAMBDA_FUNCTION_MEMORY_SIZE', 1024))
        : DEFAULT_MAX_HELD_BYTES,
      1,
    ),
    // The response streams through the runtime (streamifyResponse): the pace holds as far as
    // its stream passes the client's backpressure on to ours. One request per environment, so
    // a slow reader holds only its own memory; the function timeout bounds it in any case.
    readerMinBytesPerSecond: intFromEnv(
      env,
      'KVGATE_READER_MIN_BYTES_PER_SECOND',
      DEFAULT_READER_MIN_BYTES_PER_SECOND,
      0,
      1024 ** 3,
    ),
  }
  if (!cfg.bucket && !cfg.fsRoot)
    throw new ConfigError('set KVGATE_S3_BUCKET (or KVGATE_FS_ROOT for a local run)')
  if (!cfg.authParameter && !cfg.tokensJson && !cfg.authDisabled) {
    throw new ConfigError(
      'no tokens: set KVGATE_AUTH_SSM_PARAMETER (or KVGATE_TOKENS); a function URL is public, so auth is required',
    )
  }
  return cfg
}

/** Parses and checks a token table (a JSON array of TokenGrant). */
export function parseTokens(json: string, source: string): TokenGrant[] {
  return parseTokenTable(json, source)
}

async function loadTokensFromSsm(name: string, region: string | undefined): Promise<TokenGrant[]> {
  // Imported lazily: only the AWS deployment pays for the SSM client's load time.
  const { SSMClient, GetParameterCommand } = await import('@aws-sdk/client-ssm')
  const client = new SSMClient(region ? { region } : {})
  try {
    const out = await client.send(new GetParameterCommand({ Name: name, WithDecryption: true }))
    const value = out.Parameter?.Value
    if (!value) throw new ConfigError(`SSM parameter ${name} is empty`)
    return parseTokens(value, `SSM parameter ${name}`)
  } finally {
    client.destroy()
  }
}

async function openStore(cfg: LambdaGatewayConfig): Promise<ObjectStore> {
  if (cfg.fsRoot) {
    const { FsStore } = await import('../stores/fs.ts')
    return new FsStore({ root: cfg.fsRoot }).open()
  }
  const { S3Store } = await import('../stores/s3.ts')
  // Lambda runs close to S3: a short connect timeout, and few sockets per instance
  // (one request at a time per execution environment).
  return new S3Store({
    bucket: cfg.bucket!,
    region: cfg.region,
    ...(cfg.endpoint ? { endpoint: cfg.endpoint } : {}),
    maxSockets: 16,
    partSize: LAMBDA_PART_BYTES,
    partConcurrency: lambdaPartConcurrency(cfg.maxHeldBytes),
  })
}

/** Builds the gateway app from a config (what the cold start does). */
export async function gatewayFromConfig(cfg: LambdaGatewayConfig): Promise<FetchApp> {
  const tokens = cfg.authDisabled
    ? []
    : cfg.tokensJson
      ? parseTokens(cfg.tokensJson, 'KVGATE_TOKENS')
      : await loadTokensFromSsm(cfg.authParameter!, cfg.region)
  const store = await openStore(cfg)
  return createGateway({
    store,
    auth: tokens.length > 0 ? { tokens } : undefined,
    limits: {
      maxChunkBytes: cfg.maxChunkBytes,
      maxCalibrationBytes: cfg.maxCalibrationBytes,
      calibrationCacheBytes: cfg.calibrationCacheBytes,
      maxHeldBytes: cfg.maxHeldBytes,
      readerMinBytesPerSecond: cfg.readerMinBytesPerSecond,
    },
    presign: { minBytes: cfg.presignMinBytes, expiresSeconds: cfg.presignTtlSeconds },
    uploads: {
      minBytes: cfg.uploadMinBytes,
      maxBytes: cfg.uploadMaxBytes,
      expiresSeconds: cfg.uploadTtlSeconds,
      ...(cfg.stagingPrefix ? { stagingPrefix: cfg.stagingPrefix } : {}),
    },
    prefix: cfg.prefix,
    storagePricePerGBMonth: 0.023,
    coldTier: cfg.coldTier.tracking ? { usage: cfg.coldTier.usage } : { tracking: false },
  })
}

/** One app per execution environment: built on first use, rebuilt after a failed start. */
export function cachedApp(factory: () => Promise<FetchApp>): () => Promise<FetchApp> {
  let pending: Promise<FetchApp> | undefined
  return () => {
    pending ??= factory().catch((e: unknown) => {
      pending = undefined
      throw e
    })
    return pending
  }
}

const defaultApp = cachedApp(async () => gatewayFromConfig(configFromEnv()))

/** The function's entry point (`index.handler` in the zip built by scripts/build-lambda.ts). */
export const handler = createLambdaHandler(defaultApp)
