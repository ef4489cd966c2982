// Wires the cold tier into a gateway app: a use recorder (with its flush middleware)
// and the fleet accounting view, both on by default and off with `coldTier: false`.

import type { Hono } from 'hono'
import { FleetAccounting } from '../../coldtier/accounting.ts'
import { DEFAULT_USAGE, type UsageOptions } from '../../coldtier/policy.ts'
import type { GatewayState } from '../context.ts'
import type { GatewayEnv } from '../env.ts'
import { usageFlush } from './flush-middleware.ts'
import { UsageRecorder } from './recorder.ts'

export interface ColdTierGatewayOptions {
  /** Record uses for gc. @default true */
  tracking?: boolean
  usage?: Partial<UsageOptions>
  /** How often the accounting snapshot is re-read (ms). @default 300000 */
  accountingRefreshMs?: number
  /** Clock for use records (tests). @default Date.now */
  now?: () => number
}

export function coldTierHooks(
  app: Hono<GatewayEnv>,
  state: GatewayState,
  opts: false | ColdTierGatewayOptions | undefined,
): void {
  if (opts === false) return
  if (opts?.tracking ?? true) {
    state.usage = new UsageRecorder(state.store, state.prefix, state.metrics, {
      ...DEFAULT_USAGE,
      ...opts?.usage,
      ...(opts?.now ? { now: opts.now } : {}),
    })
    app.use('*', usageFlush(state.usage))
  }
  state.accounting = new FleetAccounting(state.store, state.prefix, state.metrics, {
    pricePerGBMonth: state.storagePricePerGBMonth,
    ...(state.usage ? { usage: state.usage } : {}),
    ...(opts?.accountingRefreshMs !== undefined ? { refreshMs: opts.accountingRefreshMs } : {}),
  })
}
