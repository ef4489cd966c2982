// Operator endpoints: /healthz (liveness, no auth), /metrics (Prometheus text)
// and / (the HTML status page, or JSON with Accept: application/json).

import type { Hono } from 'hono'
import type { GatewayState } from '../context.ts'
import type { GatewayEnv } from '../env.ts'
import { authorize } from '../middleware/auth.ts'
import { renderStatusPage, snapshot } from '../status-page.ts'

export function opsRoutes(app: Hono<GatewayEnv>, state: GatewayState, opts: { publicStatus: boolean }): void {
  app.get('/healthz', (c) => c.json({ ok: true, store: state.store.kind }))

  app.get('/metrics', async (c) => {
    if (!opts.publicStatus) authorize(c, '*', 'admin')
    await state.accounting?.refresh()
    return c.text(state.metrics.render(), 200, { 'content-type': 'text/plain; version=0.0.4; charset=utf-8' })
  })

  app.get('/', async (c) => {
    if (!opts.publicStatus) authorize(c, '*', 'admin')
    const s = await snapshot(state)
    if ((c.req.header('accept') ?? '').includes('application/json')) return c.json(s)
    return c.html(renderStatusPage(s, state.storagePricePerGBMonth))
  })
}
