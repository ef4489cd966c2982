// The client side of the gateway's upload protocol: POST …/uploads, then PUT the body
// straight to the presigned store targets (never with the bearer token), then commit.
// One implementation for the remote tier and `kvgate smoke`; only the transports differ.

import type { Dispatcher } from 'undici'

/** How the protocol reaches the gateway and the store; retries live in the transports. */
export interface UploadTransport {
  /** A JSON POST to the gateway with the bearer token; undefined when it could not be made. */
  gateway(
    path: string,
    body: string,
    timeoutMs: number,
  ): Promise<{ status: number; body: Uint8Array } | undefined>
  /** A PUT of `bytes` to a presigned store URL, without the bearer token; the HTTP status or undefined. */
  storePut(url: string, bytes: Uint8Array, timeoutMs: number): Promise<number | undefined>
}

export type UploadOutcome =
  /** The gateway takes this body as a plain PUT (fs/memory/r2 stores, small bodies, older gateways). */
  | { kind: 'direct'; presignMinBytes: number | null }
  /** Stored (201) or already stored by someone (200): the gateway's answer, like a PUT's. */
  | { kind: 'stored'; status: 200 | 201; bytes: number; via: 'commit' | 'exists'; parts: number }
  /**
   * `by`: who failed. 'gateway': a request to it failed or was refused (the transport saw it);
   * 'store': a part PUT to the presigned target; 'answer': the gateway's answer is not one of the protocol.
   */
  | { kind: 'failed'; reason: string; status?: number; by: 'gateway' | 'store' | 'answer' }

export interface UploadChunkOptions {
  /** Gateway path of the namespace, e.g. `/v1/ns/prod` (a URL path prefix included). */
  base: string
  /** Deadline of one gateway request or one part PUT. */
  timeoutMs: number
  /** Deadline of the commit (the gateway reads and verifies the whole object). */
  commitTimeoutMs: number
  /** Parts uploaded at once. @default 4 */
  partConcurrency?: number
}

interface PresignedAnswer {
  mode: 'presigned'
  uploadId: string
  parts: { url: string; offset: number; length: number }[]
}

/** Runs the whole protocol for one chunk object. Never throws. */
export async function uploadChunk(
  t: UploadTransport,
  hex: string,
  object: Uint8Array,
  opts: UploadChunkOptions,
): Promise<UploadOutcome> {
  const opened = await t.gateway(
    `${opts.base}/uploads`,
    JSON.stringify({ key: hex, bytes: object.byteLength }),
    opts.timeoutMs,
  )
  if (!opened) return { kind: 'failed', reason: 'upload request failed', by: 'gateway' }
  // A gateway from before the protocol: it only knows PUT.
  if (opened.status === 404 || opened.status === 405) return { kind: 'direct', presignMinBytes: null }
  const answer = parseJson(opened.body) as
    | { mode?: unknown; presignMinBytes?: unknown; bytes?: unknown }
    | undefined
  if (opened.status !== 200 || !answer)
    return {
      kind: 'failed',
      reason: `upload request answered ${opened.status}`,
      status: opened.status,
      by: 'gateway',
    }
  if (answer.mode === 'direct') {
    const min = answer.presignMinBytes
    return { kind: 'direct', presignMinBytes: typeof min === 'number' && min >= 0 ? min : null }
  }
  if (answer.mode === 'exists') {
    const bytes = typeof answer.bytes === 'number' ? answer.bytes : object.byteLength
    return { kind: 'stored', status: 200, bytes, via: 'exists', parts: 0 }
  }
  const presigned = checkPresigned(answer, object.byteLength)
  if (!presigned) return { kind: 'failed', reason: 'malformed upload answer', by: 'answer' }

  // Parts in order with a bounded number in flight; the first failure stops the rest.
  let next = 0
  let failure: string | undefined
  const worker = async () => {
    while (failure === undefined && next < presigned.parts.length) {
      const p = presigned.parts[next++]!
      const status = await t.storePut(p.url, object.subarray(p.offset, p.offset + p.length), opts.timeoutMs)
      if (status === undefined || status < 200 || status > 299)
        failure ??= `store answered ${status ?? 'nothing'} to part at ${p.offset}`
    }
  }
  const lanes = Math.max(1, Math.min(opts.partConcurrency ?? 4, presigned.parts.length))
  await Promise.all(Array.from({ length: lanes }, worker))
  // Uncommitted staging is removed by the gateway's lifecycle rule; nothing is visible.
  if (failure !== undefined) return { kind: 'failed', reason: failure, by: 'store' }

  const committed = await t.gateway(
    `${opts.base}/uploads/${presigned.uploadId}/commit`,
    '{}',
    opts.commitTimeoutMs,
  )
  if (!committed) return { kind: 'failed', reason: 'commit failed', by: 'gateway' }
  const result = parseJson(committed.body) as { status?: unknown; bytes?: unknown } | undefined
  if ((committed.status === 201 || committed.status === 200) && result) {
    const bytes = typeof result.bytes === 'number' ? result.bytes : object.byteLength
    return {
      kind: 'stored',
      status: committed.status,
      bytes,
      via: committed.status === 201 ? 'commit' : 'exists',
      parts: presigned.parts.length,
    }
  }
  const err = (result as { error?: { code?: string; message?: string } } | undefined)?.error
  return {
    kind: 'failed',
    reason: `commit answered ${committed.status}${err ? ` ${err.code}: ${err.message}` : ''}`,
    status: committed.status,
    by: 'gateway',
  }
}

/** Parts must tile the body exactly, or the client would send bytes nobody verified it meant. */
function checkPresigned(a: unknown, size: number): PresignedAnswer | undefined {
  const v = a as Partial<PresignedAnswer>
  if (v.mode !== 'presigned' || typeof v.uploadId !== 'string' || !/^[A-Za-z0-9_-]{1,2048}$/.test(v.uploadId))
    return undefined
  if (!Array.isArray(v.parts) || v.parts.length === 0 || v.parts.length > 10_000) return undefined
  let at = 0
  for (const p of v.parts) {
    if (
      typeof p?.url !== 'string' ||
      !/^https?:\/\//.test(p.url) ||
      p.offset !== at ||
      !Number.isSafeInteger(p.length) ||
      p.length <= 0
    )
      return undefined
    at += p.length
  }
  return at === size ? (v as PresignedAnswer) : undefined
}

function parseJson(body: Uint8Array): unknown {
  try {
    const v = JSON.parse(new TextDecoder().decode(body))
    return typeof v === 'object' && v !== null ? v : undefined
  } catch {
    return undefined
  }
}

/**
 * Per-tier memory of what the gateway said: a gateway that answers "direct" with
 * no presign threshold (Node, Workers, fs) is not asked again, so its PUTs keep
 * costing one request.
 */
export class UploadPolicy {
  #minBytes: number | null

  constructor(minBytes: number) {
    this.#minBytes = minBytes
  }

  /** True when a body of this size should open an upload first. */
  wants(bytes: number): boolean {
    return this.#minBytes !== null && bytes >= this.#minBytes
  }

  /** Learns from a "direct" answer: the gateway's own threshold, or never. */
  learn(presignMinBytes: number | null): void {
    if (presignMinBytes === null) this.#minBytes = null
    else if (this.#minBytes !== null) this.#minBytes = Math.max(this.#minBytes, presignMinBytes)
  }
}

export interface TierUploaderOptions {
  /** Gateway path of the namespace (`…/v1/ns/{ns}`). */
  base: string
  /** Bodies from this size open an upload first (the gateway may still say "direct"). */
  minBytes: number
  timeoutMs: number
  retries: number
  /** Sends store PUTs (the tier's agent for store URLs: no bearer token). */
  agent: Dispatcher
  /** Aborted when the tier closes: a store PUT still running ends then. */
  signal?: AbortSignal
  /** The tier's gateway POST (auth, breaker, retries). */
  post(
    path: string,
    body: string,
    timeoutMs: number,
  ): Promise<{ status: number; body: Uint8Array } | undefined>
}

/** The remote tier's view: "direct" (then PUT as always), or the gateway's answer to the upload. */
export class TierUploader {
  readonly #o: TierUploaderOptions
  readonly #policy: UploadPolicy
  readonly #transport: UploadTransport

  constructor(o: TierUploaderOptions) {
    this.#o = o
    this.#policy = new UploadPolicy(o.minBytes)
    this.#transport = {
      gateway: (path, body, timeoutMs) => o.post(path, body, timeoutMs),
      storePut: (url, bytes, timeoutMs) => this.#storePut(url, bytes, timeoutMs),
    }
  }

  /**
   * 'direct': PUT it as always. A gateway's answer ({status}) or undefined when a gateway
   * request failed (counted by the tier's transport), 'lost' when the store or an answer
   * that is not one of the protocol lost it (counted by nobody yet).
   */
  async put(hex: string, object: Uint8Array): Promise<{ status: number } | undefined | 'direct' | 'lost'> {
    if (!this.#policy.wants(object.byteLength)) return 'direct'
    const out = await uploadChunk(this.#transport, hex, object, {
      base: this.#o.base,
      timeoutMs: this.#o.timeoutMs,
      // The commit streams the whole object through the gateway's verifier.
      commitTimeoutMs: Math.max(this.#o.timeoutMs, 60_000),
    })
    if (out.kind === 'direct') {
      this.#policy.learn(out.presignMinBytes)
      return 'direct'
    }
    if (out.kind === 'failed') {
      if (out.by !== 'gateway') return 'lost'
      return out.status === undefined ? undefined : { status: out.status }
    }
    return { status: out.status }
  }

  async #storePut(url: string, bytes: Uint8Array, timeoutMs: number): Promise<number | undefined> {
    const u = new URL(url)
    const closing = this.#o.signal
    for (let attempt = 0; ; attempt++) {
      if (closing?.aborted) return undefined
      let status: number | undefined
      try {
        const deadline = AbortSignal.timeout(timeoutMs)
        const r = await this.#o.agent.request({
          origin: u.origin,
          path: u.pathname + u.search,
          method: 'PUT',
          body: bytes,
          signal: closing ? AbortSignal.any([deadline, closing]) : deadline,
        })
        await r.body.dump()
        status = r.statusCode
      } catch {
        status = undefined
      }
      if ((status !== undefined && status < 500) || attempt >= this.#o.retries) return status
      await new Promise((r) => setTimeout(r, Math.random() * 25 * 2 ** attempt))
    }
  }
}
