// POST /v1/ns/{ns}/lookup: how many leading chunks of a key chain are stored,
// answered by ChainLookup (probing, not one HEAD per key). Sizes only on request
// (`"sizes": true`): S3 has no cheap source of sizes, so they cost a HEAD per unknown chunk.

import type { Context, Hono } from 'hono'
import { assertKeysHex, assertNamespaceName, objectName } from '../../core/keys.ts'
import { admitted } from '../admission.ts'
import type { GatewayState } from '../context.ts'
import type { GatewayEnv } from '../env.ts'
import { badRequest, lengthRequired, payloadTooLarge, unsupportedMediaType } from '../http-errors.ts'
import { LOOKUP_EXTRA_VALUES, lookupHoldBytes } from '../memory-budget.ts'
import { authorize } from '../middleware/auth.ts'
import { type BodyPace, readPromptly } from '../request-body.ts'

export function lookupRoutes(app: Hono<GatewayEnv>, state: GatewayState): void {
  app.post('/v1/ns/:ns/lookup', async (c) => {
    const ns = assertNamespaceName(c.req.param('ns'))
    authorize(c, ns, 'read')
    c.set('ns', ns)
    const type = (c.req.header('content-type') ?? '').split(';')[0]!.trim().toLowerCase()
    if (type !== 'application/json') throw unsupportedMediaType('lookup bodies must be application/json')
    const max = state.limits.maxLookupBodyBytes
    const declared = declaredLength(c.req.raw, max)
    // The body, its text and the parsed keys are held at once: reserved before reading, so
    // many large lookups at once get 503 ERR_BUSY instead of filling a 128 MB isolate.
    const held = lookupHoldBytes(declared ?? max, state.limits.maxLookupKeys)
    return admitted(state, 'lookup', { declared: 0, held }, () => answer(c, state, ns, max))
  })
}

async function answer(c: Context<GatewayEnv>, state: GatewayState, ns: string, max: number) {
  const text = await readCapped(c.req.raw, max, state.limits)
  // JSON.parse builds up to ~22x a body of small values (`[{},{},…]`): what the reservation
  // covers is only as many values as a lookup may have, so count them before parsing.
  const values = state.limits.maxLookupKeys + LOOKUP_EXTRA_VALUES
  if (jsonValueBound(text, values) > values) {
    throw payloadTooLarge(
      `more than ${values} JSON values; at most ${state.limits.maxLookupKeys} keys per lookup`,
    )
  }
  let body: unknown
  try {
    body = JSON.parse(text)
  } catch {
    throw badRequest('lookup body is not valid JSON')
  }
  const keys = (body as { keys?: unknown })?.keys
  if (!Array.isArray(keys)) throw badRequest('lookup body must be {"keys": ["<64 hex>", ...]}')
  if (keys.length > state.limits.maxLookupKeys) {
    throw payloadTooLarge(`${keys.length} keys; at most ${state.limits.maxLookupKeys} per lookup`)
  }
  const sizes = (body as { sizes?: unknown }).sizes
  if (sizes !== undefined && typeof sizes !== 'boolean') throw badRequest('"sizes" must be a boolean')
  // objectName() re-validates prefix and namespace per call; for up to 4096 keys
  // validate those once and the keys in one pass; names are built only for probes.
  const first = objectName(state.prefix, ns, '0'.repeat(64))
  const base = first.slice(0, first.length - 64 - 3)
  const r = await state.lookup.lookup({ base, keys: assertKeysHex(keys) }, { sizes: sizes ?? false })
  if (r.present > 0) state.usage?.use(ns, keys[r.present - 1] as string, r.present)
  c.header('x-kvgate-store-requests', String(r.storeRequests))
  c.header('x-kvgate-store-rounds', String(r.rounds))
  return c.json(sizes === true ? { present: r.present, sizes: r.sizes } : { present: r.present })
}

/** The body's declared length (refused past `max`), or undefined when it declares none. */
function declaredLength(req: Request, max: number): number | undefined {
  const declared = req.headers.get('content-length')
  if (declared === null) return undefined
  const n = Number(declared)
  if (!/^\d+$/.test(declared) || !Number.isSafeInteger(n)) throw badRequest('invalid Content-Length')
  if (n > max) throw payloadTooLarge(`body exceeds ${max} bytes`)
  return n
}

/**
 * An upper bound on the values JSON.parse would build from `text`, counted up to `limit` + 1:
 * its structural characters (`{ [ , :`) outside strings. Lexed as JSON lexes strings, so
 * a text that is not JSON is bounded up to where the parser would give up.
 */
function jsonValueBound(text: string, limit: number): number {
  let n = 1
  let inString = false
  for (let i = 0; i < text.length; i++) {
    const c = text.charCodeAt(i)
    if (inString) {
      // A backslash escapes the next character: \" does not end the string.
      if (c === 0x5c) i++
      else if (c === 0x22) inString = false
    } else if (c === 0x22) inString = true
    else if ((c === 0x7b || c === 0x5b || c === 0x2c || c === 0x3a) && ++n > limit) return n
  }
  return n
}

/** Reads a request body as text, refusing more than `max` bytes (declared or actual). */
async function readCapped(req: Request, max: number, pace: BodyPace): Promise<string> {
  if (!req.body) throw lengthRequired()
  const all = await readPromptly(req.body, { max }, pace)
  if (!all) throw payloadTooLarge(`body exceeds ${max} bytes`)
  try {
    return new TextDecoder('utf-8', { fatal: true }).decode(all)
  } catch {
    throw badRequest('lookup body is not UTF-8')
  }
}
