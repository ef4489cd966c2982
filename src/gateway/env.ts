// Hono environment types shared by the app, routes and middleware: bindings
// come from the runtime adapter (R2 bucket in Workers), variables from middleware.

import type { Grant } from './middleware/auth.ts'
import type { BodyCheck } from './verified-body.ts'

/**
 * Stream I/O a runtime adapter may offer the routes (the Node adapter does, as
 * the `nativeIo` binding) so chunk bodies move as the runtime's own streams end
 * to end instead of through web streams. Handles are opaque to the app.
 */
export interface NativeIo {
  /**
   * The request body as a native stream for ObjectStore.putIfAbsentNative: each
   * piece passes `check` before it moves on; a failed check, a client that goes
   * away or stalls for `idleTimeoutMs` errors the stream (never ends it short).
   */
  requestBody(
    env: unknown,
    check: BodyCheck,
    idleTimeoutMs: number,
  ): { body: unknown; failure(): unknown } | undefined
  /** Sends `body` (a StoreObject.native) as the response, with backpressure; the Response the adapter expects back. */
  send(env: unknown, status: number, headers: Record<string, string>, body: unknown): Response
}

export type GatewayBindings = Record<string, unknown>

export interface GatewayEnv {
  Bindings: GatewayBindings
  Variables: {
    grant?: Grant
    /** Set by the chunk routes for the request log. */
    ns?: string
    bytes?: number
    /** Status of a response the adapter already sent natively (c.res is only a marker then). */
    sentStatus?: number
  }
}
