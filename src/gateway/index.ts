// Public entry of kvgate/gateway: the runtime-neutral app factory, the store
// interface and the runtime-neutral stores. Node-only stores live in ./node.ts.

export type { GatewayApp, GatewayOptions } from './app.ts'
export { createGateway } from './app.ts'
export type { ChainLookupOptions, LookupResult } from './chain-lookup.ts'
export type { GatewayLimits, PresignOptions } from './context.ts'
export type { GatewayBindings, GatewayEnv } from './env.ts'
export { GatewayMetrics } from './metrics.ts'
export type { AuthOptions, Scope, TokenGrant } from './middleware/auth.ts'
export { authorize, hashToken } from './middleware/auth.ts'
export type { RequestLogger } from './middleware/request-log.ts'
export type { UploadAnswer, UploadOptions } from './routes/uploads.ts'
export { RangeNotSatisfiableError } from './stores/errors.ts'
export { MemoryStore } from './stores/memory.ts'
export type {
  ByteRange,
  GetOptions,
  ObjectStore,
  PresignUploadOptions,
  PutResult,
  StoreEntry,
  StoreObject,
  UploadPart,
  UploadTargets,
} from './stores/types.ts'
export { resolveRange } from './stores/types.ts'
