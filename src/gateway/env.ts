// Hono environment types shared by the app, routes and middleware: bindings
// come from the runtime adapter (R2 bucket in Workers), variables from middleware.

import type { Grant } from './middleware/auth.ts'

export type GatewayBindings = Record<string, unknown>

export interface GatewayEnv {
  Bindings: GatewayBindings
  Variables: {
    grant?: Grant
    /** Set by the chunk routes for the request log. */
    ns?: string
    bytes?: number
  }
}
