// `kvgate smoke`: checks a deployed gateway end to end with a generated chunk: put
// (and conditional re-put), head, get (full, layer range, byte range), lookup, auth.

import { type UploadTransport, uploadChunk } from '../../client/remote-upload.ts'
import { decodeHeader, encodeChunk, layerSpan } from '../../core/format.ts'
import {
  assertNamespaceName,
  chainKeys,
  isNamespaceName,
  type KeyNamespace,
  namespaceSeed,
} from '../../core/keys.ts'
import { type KvGeometry, layerSlabBytes, MODEL_PRESETS, type PresetName } from '../../core/layout.ts'
import { parseCommandArgs } from '../args.ts'

const HELP = `Usage: kvgate smoke --url <gateway url> [--token <bearer token>] [options]

Puts a freshly generated chunk into a running gateway, reads it back (whole, a
layer range and a byte range, following 307 redirects to presigned URLs), runs a
lookup, and prints PASS/FAIL per step. Exit code 0 only when every step passes.

Options:
  --url <url>            gateway base URL (or KVGATE_URL), e.g. https://xyz.lambda-url.us-east-1.on.aws/
  --token <token>        bearer token with read+write on the namespace (or KVGATE_TOKEN)
  --ns <name>            namespace to write into (default: smoke)
  --chunk-tokens <n>     tokens per generated chunk; sets its size (default: 64 → ~128 KiB)
  --model <preset>       full-size KV geometry of a model preset, e.g. llama-3.1-8b
                         (256 tokens → a 32 MiB chunk); default: a small 4-layer geometry
  --cleanup              DELETE the chunk at the end (needs an admin token)
  --timeout <ms>         per-request timeout (default: 30000)
  --json                 print the report as JSON
  -h, --help             show this help`

export interface SmokeOptions {
  url: string
  token?: string
  ns?: string
  chunkTokens?: number
  /** A MODEL_PRESETS name: chunks of that model's full KV geometry. */
  model?: PresetName
  cleanup?: boolean
  timeoutMs?: number
  /** Injected for tests; defaults to the global fetch. */
  fetch?: typeof fetch
}

export interface SmokeStep {
  name: string
  ok: boolean
  detail: string
  ms: number
}

export interface SmokeReport {
  ok: boolean
  url: string
  ns: string
  key: string
  bytes: number
  steps: SmokeStep[]
  /** The gateway answered a request without a token: anyone who reaches it can read and write. */
  authOff: boolean
  /** Things the user should know that are not step failures (auth off, a stripped /v1). */
  notes: string[]
}

/** The base URL without trailing slashes or a trailing /v1 (the API paths add /v1 themselves). */
export function gatewayBase(url: string): { base: string; strippedV1: boolean } {
  const trimmed = url.replace(/\/+$/, '')
  const base = trimmed.replace(/\/v1$/, '')
  return { base, strippedV1: base !== trimmed }
}

// Small but real: 4 layers of bf16 K and V, so layer ranges and the layer index matter.
const GEOMETRY: KvGeometry = { layers: 4, kvHeads: 2, headDim: 64, dtype: 'bf16' }

class StepFailure extends Error {}

function check(cond: unknown, message: string): asserts cond {
  if (!cond) throw new StepFailure(message)
}

function sameBytes(a: Uint8Array, b: Uint8Array): boolean {
  if (a.length !== b.length) return false
  for (let i = 0; i < a.length; i++) if (a[i] !== b[i]) return false
  return true
}

function randomTokens(n: number): Uint32Array {
  const t = crypto.getRandomValues(new Uint32Array(n))
  for (let i = 0; i < n; i++) t[i]! %= 128_000
  return t
}

/** Builds one chunk object (codec 'raw', random KV) and the chain it belongs to. */
function generateChunk(chunkTokens: number, model: PresetName | undefined) {
  const preset = model ? MODEL_PRESETS[model] : undefined
  const geometry: KvGeometry = preset
    ? { layers: preset.layers, kvHeads: preset.kvHeads, headDim: preset.headDim, dtype: preset.dtype }
    : GEOMETRY
  const ns: KeyNamespace = { modelId: preset?.modelId ?? 'kvgate-smoke', geometry, chunkTokens }
  const keys = chainKeys(randomTokens(2 * chunkTokens), ns)
  const first = keys[0]!
  const sections = Array.from({ length: geometry.layers }, () => {
    const s = new Uint8Array(layerSlabBytes(geometry, chunkTokens))
    // getRandomValues fills at most 64 KiB per call.
    for (let o = 0; o < s.length; o += 65536)
      crypto.getRandomValues(s.subarray(o, Math.min(o + 65536, s.length)))
    return s
  })
  const bytes = encodeChunk(
    {
      codec: 'raw',
      codecVersion: 1,
      codecParams: new Uint8Array(0),
      geometry,
      tokens: chunkTokens,
      chunkIndex: 0,
      partial: false,
      namespaceId: namespaceSeed(ns).subarray(0, 16),
      chainKey: first.key,
      parentKey: new Uint8Array(32),
    },
    sections,
  )
  return { key: first.hex, nextKey: keys[1]!.hex, bytes }
}

export async function runSmoke(opts: SmokeOptions): Promise<SmokeReport> {
  const doFetch = opts.fetch ?? fetch
  const { base, strippedV1 } = gatewayBase(opts.url)
  const notes: string[] = []
  if (strippedV1) notes.push(`the URL ends in /v1: using ${base} (the API paths add /v1 themselves)`)
  let authOff = false
  const ns = assertNamespaceName(opts.ns ?? 'smoke')
  const timeoutMs = opts.timeoutMs ?? 30_000
  if (opts.model !== undefined && !Object.hasOwn(MODEL_PRESETS, opts.model))
    throw new TypeError(`unknown model preset ${JSON.stringify(opts.model)}`)
  const chunk = generateChunk(opts.chunkTokens ?? 64, opts.model)
  const header = decodeHeader(chunk.bytes)
  const chunkUrl = `${base}/v1/ns/${ns}/chunks/${chunk.key}`
  const auth: Record<string, string> = opts.token ? { authorization: `Bearer ${opts.token}` } : {}
  const steps: SmokeStep[] = []

  const request = (url: string, init: RequestInit = {}, withAuth = true) =>
    doFetch(url, {
      ...init,
      redirect: 'manual',
      headers: { ...(withAuth ? auth : {}), ...(init.headers as Record<string, string> | undefined) },
      signal: AbortSignal.timeout(timeoutMs),
    })

  // A 307 points at a presigned store URL: GET it without our bearer token, keeping the Range.
  const getBytes = async (
    url: string,
    range?: string,
  ): Promise<{ status: number; body: Uint8Array; res: Response }> => {
    const headers: Record<string, string> = range ? { range } : {}
    let res = await request(url, { headers })
    if (res.status === 307) {
      const location = res.headers.get('location')
      check(location, '307 without a Location header')
      await res.body?.cancel()
      res = await request(new URL(location, url).toString(), { headers }, false)
    }
    return { status: res.status, body: new Uint8Array(await res.arrayBuffer()), res }
  }

  const step = async (name: string, fn: () => Promise<string>) => {
    const t0 = performance.now()
    let ok = true
    let detail: string
    try {
      detail = await fn()
    } catch (e) {
      ok = false
      const cause = (e as { cause?: { code?: string; message?: string } }).cause
      const why = cause ? ` (${cause.code ?? cause.message})` : ''
      detail = e instanceof StepFailure ? e.message : `${(e as Error).name}: ${(e as Error).message}${why}`
      if (cause?.code === 'ECONNREFUSED' || cause?.code === 'ENOTFOUND') {
        detail = `${cause.code}: nothing answers at ${base}. Is the gateway running at that URL? (kvgate serve prints the URL it listens on)`
      }
    }
    steps.push({ name, ok, detail, ms: Math.round(performance.now() - t0) })
  }

  const report = (): SmokeReport => ({
    ok: steps.every((s) => s.ok),
    url: base,
    ns,
    key: chunk.key,
    bytes: chunk.bytes.length,
    steps,
    authOff,
    notes,
  })

  await step('healthz', async () => {
    const res = await request(`${base}/healthz`)
    await res.body?.cancel()
    if (res.status === 401 || res.status === 403) {
      throw new StepFailure(
        `GET /healthz answered ${res.status}: the gateway does not accept this token (check --token / KVGATE_TOKEN; kvgate token creates one)`,
      )
    }
    check(res.status === 200, `GET /healthz answered ${res.status}: is ${base} a kvgate gateway?`)
    return '200'
  })
  // Nothing else can pass when the gateway is not there: one clear failure, not ten.
  if (!steps[0]!.ok) return report()

  // Whether the gateway asks for a token at all (a HEAD of a key that is not there yet).
  await step(opts.token ? 'auth required' : 'auth', async () => {
    const res = await request(chunkUrl, { method: 'HEAD' }, false)
    await res.body?.cancel()
    if (res.status !== 401 && res.status !== 403) {
      authOff = true
      notes.push(
        `auth is off at ${base}: it answered ${res.status} without a token, so anyone who reaches it can read and write (create tokens with: kvgate token)`,
      )
    }
    if (opts.token) check(!authOff, `HEAD without a token answered ${res.status}, expected 401 (auth is off)`)
    else check(authOff, 'the gateway requires a token: pass --token or set KVGATE_TOKEN')
    return authOff ? `${res.status} without a token: auth is off` : '401 without a token'
  })
  if (!opts.token && !authOff) return report()

  // Writes go through the upload protocol every deployment speaks: the gateway answers
  // "direct" (PUT the body to it) or presigned store targets, then a verified commit.
  const transport: UploadTransport = {
    // `path` is absolute (it carries any URL path prefix of the gateway).
    gateway: async (path, body, ms) => {
      const res = await doFetch(`${new URL(base).origin}${path}`, {
        method: 'POST',
        body,
        headers: { ...auth, 'content-type': 'application/json' },
        signal: AbortSignal.timeout(ms),
      })
      return { status: res.status, body: new Uint8Array(await res.arrayBuffer()) }
    },
    storePut: async (url, bytes, ms) => {
      const res = await doFetch(url, {
        method: 'PUT',
        body: bytes as Uint8Array<ArrayBuffer>,
        signal: AbortSignal.timeout(ms),
      })
      await res.body?.cancel()
      return res.status
    },
  }
  const put = async (expected: 201 | 200): Promise<string> => {
    const out = await uploadChunk(transport, chunk.key, chunk.bytes, {
      base: new URL(`${base}/v1/ns/${ns}`).pathname,
      timeoutMs,
      commitTimeoutMs: timeoutMs,
    })
    const word = expected === 201 ? 'created' : 'exists'
    if (out.kind === 'failed') throw new StepFailure(out.reason)
    if (out.kind === 'stored') {
      check(out.status === expected, `upload answered ${out.status} ${out.via}, expected ${expected} ${word}`)
      check(out.bytes === chunk.bytes.length, `upload answered ${out.bytes} bytes`)
      const how = out.via === 'exists' ? 'gateway knew the key' : `presigned upload, ${out.parts} part(s)`
      return `${expected} ${word}, ${chunk.bytes.length} bytes (${how})`
    }
    const res = await request(chunkUrl, {
      method: 'PUT',
      body: chunk.bytes as Uint8Array<ArrayBuffer>,
      headers: { 'content-type': 'application/octet-stream' },
    })
    const text = await res.text()
    check(res.status === expected, `PUT answered ${res.status}: ${text.slice(0, 200)}`)
    const body = JSON.parse(text) as { status?: string; bytes?: number }
    check(body.status === word && body.bytes === chunk.bytes.length, `unexpected body ${text}`)
    return `${expected} ${word}, ${chunk.bytes.length} bytes (direct PUT)`
  }

  await step('put', () => put(201))
  await step('put again (create-only)', () => put(200))

  await step('head', async () => {
    const res = await request(chunkUrl, { method: 'HEAD' })
    await res.body?.cancel()
    check(res.status === 200, `HEAD answered ${res.status}`)
    check(
      res.headers.get('content-length') === String(chunk.bytes.length),
      `content-length ${res.headers.get('content-length')}, expected ${chunk.bytes.length}`,
    )
    return `200, ${chunk.bytes.length} bytes`
  })

  await step('get', async () => {
    const { status, body, res } = await getBytes(chunkUrl)
    check(status === 200, `GET answered ${status}`)
    check(sameBytes(body, chunk.bytes), `body differs (${body.length} bytes, expected ${chunk.bytes.length})`)
    return res.url.startsWith(base) || res.url === ''
      ? 'identical bytes'
      : 'identical bytes (via presigned URL)'
  })

  await step('get layers 1-2', async () => {
    const span = layerSpan(header, 1, 2)
    const expected = new Uint8Array(header.headerBytes + span.end - span.start)
    expected.set(chunk.bytes.subarray(0, header.headerBytes))
    expected.set(chunk.bytes.subarray(span.start, span.end), header.headerBytes)
    const res = await request(`${chunkUrl}?layers=1-2`)
    if (res.status === 307) {
      // Redirected: the layer form becomes two ranged reads of the presigned object.
      await res.body?.cancel()
      const head = await getBytes(`${chunkUrl}?layers=1-2`, `bytes=0-${header.headerBytes - 1}`)
      const sections = await getBytes(`${chunkUrl}?layers=1-2`, `bytes=${span.start}-${span.end - 1}`)
      check(
        head.status === 206 && sections.status === 206,
        `ranged reads answered ${head.status}/${sections.status}`,
      )
      const joined = new Uint8Array(head.body.length + sections.body.length)
      joined.set(head.body)
      joined.set(sections.body, head.body.length)
      check(sameBytes(joined, expected), 'layer bytes differ (via presigned URL)')
      return `header + ${span.end - span.start} section bytes (via presigned URL)`
    }
    const body = new Uint8Array(await res.arrayBuffer())
    check(res.status === 200 || res.status === 206, `GET ?layers=1-2 answered ${res.status}`)
    check(
      res.headers.get('x-kvgate-layers') === '1-2',
      `x-kvgate-layers is ${res.headers.get('x-kvgate-layers')}`,
    )
    check(sameBytes(body, expected), `layer bytes differ (${body.length} bytes, expected ${expected.length})`)
    return `header + ${span.end - span.start} section bytes`
  })

  await step('get byte range', async () => {
    const span = layerSpan(header, 3, 3)
    const { status, body } = await getBytes(chunkUrl, `bytes=${span.start}-${span.end - 1}`)
    check(status === 206, `ranged GET answered ${status}`)
    check(sameBytes(body, chunk.bytes.subarray(span.start, span.end)), 'ranged bytes differ')
    return `206, ${body.length} bytes`
  })

  await step('lookup', async () => {
    const res = await request(`${base}/v1/ns/${ns}/lookup`, {
      method: 'POST',
      body: JSON.stringify({ keys: [chunk.key, chunk.nextKey], sizes: true }),
      headers: { 'content-type': 'application/json' },
    })
    const text = await res.text()
    check(res.status === 200, `lookup answered ${res.status}: ${text.slice(0, 200)}`)
    const body = JSON.parse(text) as { present?: number; sizes?: number[] }
    check(body.present === 1, `present ${body.present}, expected 1 (chunk 0 stored, chunk 1 not)`)
    check(body.sizes?.[0] === chunk.bytes.length, `sizes ${JSON.stringify(body.sizes)}`)
    return 'present 1 of 2'
  })

  if (opts.cleanup) {
    await step('delete', async () => {
      const res = await request(chunkUrl, { method: 'DELETE' })
      await res.body?.cancel()
      check(res.status === 204, `DELETE answered ${res.status}`)
      return '204'
    })
  }

  return report()
}

/** The command's flags (the deploy guides' smoke lines are checked against them). */
export const SMOKE_OPTIONS = {
  url: { type: 'string' },
  token: { type: 'string' },
  ns: { type: 'string' },
  'chunk-tokens': { type: 'string' },
  model: { type: 'string' },
  cleanup: { type: 'boolean' },
  timeout: { type: 'string' },
  json: { type: 'boolean' },
} as const

export async function run(argv: string[]): Promise<number> {
  const { values, help } = parseCommandArgs(argv, SMOKE_OPTIONS)
  if (help) {
    console.log(HELP)
    return 0
  }
  const url = values.url ?? process.env.KVGATE_URL
  if (!url) {
    console.error('kvgate smoke: --url is required (or set KVGATE_URL). Run with --help for usage.')
    return 2
  }
  let protocol: string
  try {
    protocol = new URL(url).protocol
  } catch {
    console.error(`kvgate smoke: --url ${JSON.stringify(url)} is not a URL`)
    return 2
  }
  if (protocol !== 'http:' && protocol !== 'https:') {
    console.error(`kvgate smoke: --url ${JSON.stringify(url)} is not an http:// or https:// URL`)
    return 2
  }
  if (values.ns !== undefined && !isNamespaceName(values.ns)) {
    console.error(
      `kvgate smoke: --ns ${JSON.stringify(values.ns)} is not a namespace name (1-63 characters of a-z 0-9 . _ -, starting with a letter or digit)`,
    )
    return 2
  }
  const chunkTokens = Number(values['chunk-tokens'] ?? 64)
  const timeoutMs = Number(values.timeout ?? 30_000)
  if (!Number.isInteger(chunkTokens) || chunkTokens < 1 || chunkTokens > 65536) {
    console.error('kvgate smoke: --chunk-tokens must be an integer in 1..65536')
    return 2
  }
  if (!Number.isFinite(timeoutMs) || timeoutMs <= 0) {
    console.error('kvgate smoke: --timeout must be a positive number of milliseconds')
    return 2
  }
  const model = values.model
  if (model !== undefined && !Object.hasOwn(MODEL_PRESETS, model)) {
    console.error(`kvgate smoke: --model must be one of ${Object.keys(MODEL_PRESETS).join(', ')}`)
    return 2
  }
  const report = await runSmoke({
    url,
    ...(model !== undefined ? { model: model as PresetName } : {}),
    token: values.token ?? process.env.KVGATE_TOKEN,
    ns: values.ns,
    chunkTokens,
    cleanup: values.cleanup === true,
    timeoutMs,
  })
  if (values.json) {
    console.log(JSON.stringify(report, null, 2))
  } else {
    console.log(
      `kvgate smoke: ${report.url} ns=${report.ns} key=${report.key.slice(0, 16)}… (${report.bytes} bytes)`,
    )
    const width = Math.max(...report.steps.map((s) => s.name.length))
    for (const s of report.steps) {
      console.log(
        `  ${s.ok ? 'PASS' : 'FAIL'}  ${s.name.padEnd(width)}  ${String(s.ms).padStart(5)} ms  ${s.detail}`,
      )
    }
    for (const n of report.notes) console.log(`  NOTE  ${n}`)
    const passed = report.steps.filter((s) => s.ok).length
    console.log(`${report.ok ? 'PASS' : 'FAIL'}: ${passed}/${report.steps.length} steps passed`)
  }
  return report.ok ? 0 : 1
}
