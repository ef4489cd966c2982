// Public entry of the client library (`kvgate/client`): the KVCache engine,
// its options and the types it hands out.

export type { ChunkCodecName } from './chunk-codec.ts'
export type { ByteSize, DiskOptions, KVCacheOptions, MemoryOptions, RemoteOptions } from './config.ts'
export { optionsFromEnvironment, parseBytes, resolveOptions } from './config.ts'
export type { CopyDescriptor, GpuBuffer, GpuContiguous, GpuPaged } from './gpu.ts'
export { chunkDescriptors } from './gpu.ts'
export type {
  KVCacheStats,
  KvLayout,
  LookupResult,
  RetrieveOptions,
  StoreOptions,
  StoreResult,
  Tokens,
} from './kv-cache.ts'
export { KVCache } from './kv-cache.ts'
export type { LayerBatch, TierName } from './storage-manager.ts'
