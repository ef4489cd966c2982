// Turns every thrown error into `{error:{code,message}}` with its status; unknown
// errors become a 500 without internals. Failures are counted and remembered for
// the status page.

import type { Context } from 'hono'
import { isKvgateError } from '../../core/errors.ts'
import type { GatewayState } from '../context.ts'
import type { GatewayEnv } from '../env.ts'
import { RangeNotSatisfiableError } from '../stores/errors.ts'

const MAX_RECENT = 20

export function errorResponse(state: GatewayState, err: unknown, c: Context<GatewayEnv>): Response {
  let status = 500
  let code = 'ERR_INTERNAL'
  let message = 'internal error'
  if (isKvgateError(err)) {
    status = err.status >= 400 && err.status <= 599 ? err.status : 500
    code = err.code
    message = err.message
  } else if (err instanceof Error && /body.*(already|used|locked)/i.test(err.message)) {
    status = 400
    code = 'ERR_INVALID_ARGUMENT'
    message = err.message
  }
  state.metrics.errors.inc({ code })
  if (status >= 500 || status === 408) {
    state.recentErrors.push({
      at: new Date().toISOString(),
      method: c.req.method,
      path: new URL(c.req.url).pathname.slice(0, 200),
      status,
      code,
      message: message.slice(0, 300),
    })
    if (state.recentErrors.length > MAX_RECENT) state.recentErrors.shift()
  }
  const headers: Record<string, string> = { 'content-type': 'application/json', 'x-kvgate-error': code }
  if (status === 401) headers['www-authenticate'] = 'Bearer realm="kvgate"'
  // A busy gateway sheds load: clients back off (the client retries 503 after Retry-After).
  if (code === 'ERR_BUSY') headers['retry-after'] = '1'
  // RFC 9110 §15.5.17: a 416 tells the current length, so a client can ask again within it.
  if (err instanceof RangeNotSatisfiableError) headers['content-range'] = `bytes */${err.size}`
  if (status === 408 || status >= 500) headers.connection = 'close'
  return new Response(JSON.stringify({ error: { code, message } }), { status, headers })
}
