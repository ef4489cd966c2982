// After each request, flushes the instance's use records when due: in Workers through
// waitUntil (an isolate has no timers between requests), elsewhere in the background.

import type { MiddlewareHandler } from 'hono'
import type { GatewayEnv } from '../env.ts'
import type { UsageRecorder } from './recorder.ts'

export function usageFlush(recorder: UsageRecorder): MiddlewareHandler<GatewayEnv> {
  return async (c, next) => {
    await next()
    const p = recorder.flushIfDue()
    if (!p) return
    try {
      c.executionCtx.waitUntil(p)
    } catch {
      // Not on Workers (no execution context): the promise runs on; it never rejects.
    }
  }
}
