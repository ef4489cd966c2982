// POST /v1/ns/{ns}/chunks/{key}/verify (write scope, empty body): the gateway reads the
// stored object and verifies all of it; a corrupt one is deleted (and counted) so the
// next writer replaces it. Clients call it when an object they read fails their checks.

import type { Hono } from 'hono'
import { assertKeyHex, assertNamespaceName, objectName } from '../../core/keys.ts'
import type { GatewayState } from '../context.ts'
import type { GatewayEnv } from '../env.ts'
import { verifyStored } from '../heal.ts'
import { authorize } from '../middleware/auth.ts'

export function verifyRoutes(app: Hono<GatewayEnv>, state: GatewayState): void {
  app.post('/v1/ns/:ns/chunks/:key/verify', async (c) => {
    const ns = assertNamespaceName(c.req.param('ns'))
    const key = assertKeyHex(c.req.param('key'))
    authorize(c, ns, 'write')
    c.set('ns', ns)
    const { verdict, deleted } = await verifyStored(
      state,
      { ns, key, name: objectName(state.prefix, ns, key) },
      'verify',
    )
    return c.json({ key, verdict, deleted })
  })
}
