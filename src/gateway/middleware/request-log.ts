// One structured record per request (route, status, latency, bytes, namespace,
// error code) into the metrics and to an optional logger (JSON lines in `serve`).

import type { MiddlewareHandler } from 'hono'
import type { GatewayState } from '../context.ts'
import type { GatewayEnv } from '../env.ts'

export type RequestLogger = (entry: Record<string, unknown>) => void

export function requestLog(
  state: GatewayState,
  logger: RequestLogger | undefined,
): MiddlewareHandler<GatewayEnv> {
  return async (c, next) => {
    const t0 = performance.now()
    await next()
    const seconds = (performance.now() - t0) / 1000
    const route = c.req.routePath && c.req.routePath !== '/*' ? c.req.routePath : 'unmatched'
    const status = c.res.status
    state.metrics.requests.inc({ route, method: c.req.method, status: String(status) })
    state.metrics.requestSeconds.observe(seconds, { route })
    if (logger) {
      const entry: Record<string, unknown> = {
        level: status >= 500 ? 'error' : 'info',
        time: new Date().toISOString(),
        method: c.req.method,
        path: new URL(c.req.url).pathname,
        route,
        status,
        ms: Math.round(seconds * 1e4) / 10,
      }
      const ns = c.get('ns')
      if (ns) entry.ns = ns
      const bytes = c.get('bytes')
      if (bytes !== undefined) entry.bytes = bytes
      const code = c.res.headers.get('x-kvgate-error')
      if (code) entry.code = code
      const grant = c.get('grant')
      if (grant && grant.name !== 'anonymous') entry.token = grant.name
      logger(entry)
    }
  }
}
