// The gateway as a runtime-neutral Hono app: routes by concern over one shared
// state (store, lookup engine, metrics). Adapters (node, workers, lambda) mount it.

import { Hono } from 'hono'
import type { ChainLookupOptions } from './chain-lookup.ts'
import {
  createState,
  type GatewayLimits,
  type GatewayState,
  knownKeys,
  type PresignOptions,
} from './context.ts'
import type { GatewayEnv } from './env.ts'
import { notFound } from './http-errors.ts'
import type { GatewayMetrics } from './metrics.ts'
import { type AuthOptions, bearerAuth } from './middleware/auth.ts'
import { errorResponse } from './middleware/errors.ts'
import { type RequestLogger, requestLog } from './middleware/request-log.ts'
import { calibrationRoutes } from './routes/calibrations.ts'
import { chunkRoutes } from './routes/chunks.ts'
import { lookupRoutes } from './routes/lookup.ts'
import { opsRoutes } from './routes/ops.ts'
import { type UploadOptions, uploadRoutes } from './routes/uploads.ts'
import { verifyRoutes } from './routes/verify.ts'
import type { ObjectStore } from './stores/types.ts'
import type { ColdTierGatewayOptions } from './usage/hooks.ts'
import { coldTierHooks } from './usage/hooks.ts'

export interface GatewayOptions {
  /** Where chunk objects live. */
  store: ObjectStore
  /** Bearer tokens; none configured = auth off (local use only). */
  auth?: AuthOptions
  limits?: GatewayLimits
  /** Answer GETs of large objects with 307 to a presigned store URL (stores with presignGet). */
  presign?: PresignOptions
  /** Registry to export into (share one across apps); a fresh one by default. */
  metrics?: GatewayMetrics
  lookup?: ChainLookupOptions
  /**
   * Coalesce concurrent GETs of one object; bodies ≤ maxBytes are shared, and at most
   * maxBufferedBytes are buffered at once (above it GETs stream on their own). false disables.
   * @default { maxBytes: 8 MiB, maxBufferedBytes: 64 MiB }
   */
  coalesce?: false | { maxBytes?: number; maxBufferedBytes?: number }
  /** Object name prefix in the store. @default 'kvgate' */
  prefix?: string
  /** $/GB-month for the status page's cost estimate. @default 0.023 (S3 Standard) */
  storagePricePerGBMonth?: number
  /** Large writes straight into the store (presigned staging + verified commit); off = every upload answers "direct". */
  uploads?: UploadOptions
  /** Receives one record per request. */
  logger?: RequestLogger
  /** Use tracking + fleet accounting for gc (docs/cold-tier.md). false turns both off. @default on */
  coldTier?: false | ColdTierGatewayOptions
}

export type GatewayApp = Hono<GatewayEnv> & { readonly state: GatewayState }

const OPTION_KEYS = [
  'store',
  'auth',
  'limits',
  'presign',
  'metrics',
  'lookup',
  'coalesce',
  'prefix',
  'storagePricePerGBMonth',
  'uploads',
  'logger',
  'coldTier',
] as const satisfies readonly (keyof GatewayOptions)[]

export function createGateway(options: GatewayOptions): GatewayApp {
  knownKeys(options, OPTION_KEYS, '')
  knownKeys(options.auth, ['tokens', 'publicStatus'], 'auth')
  knownKeys(
    options.lookup,
    ['cacheEntries', 'fanout', 'concurrency', 'presenceTtlMs', 'verifyInferred'],
    'lookup',
  )
  if (options.coldTier) {
    knownKeys(options.coldTier, ['tracking', 'usage', 'accountingRefreshMs', 'now'], 'coldTier')
    knownKeys(options.coldTier.usage, ['flushIntervalMs', 'maxDelayMs', 'maxKeys'], 'coldTier.usage')
  }
  const state = createState(options)
  const app = new Hono<GatewayEnv>()
  app.onError((err, c) => errorResponse(state, err, c))
  app.notFound((c) =>
    errorResponse(state, notFound(`no route for ${c.req.method} ${new URL(c.req.url).pathname}`), c),
  )
  coldTierHooks(app, state, options.coldTier)
  app.use('*', requestLog(state, options.logger))
  app.use('*', bearerAuth(options.auth))
  lookupRoutes(app, state)
  chunkRoutes(app, state)
  calibrationRoutes(app, state)
  uploadRoutes(app, state, options.uploads)
  verifyRoutes(app, state)
  opsRoutes(app, state, { publicStatus: options.auth?.publicStatus ?? false })
  return Object.assign(app, { state })
}
