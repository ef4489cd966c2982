// kvgate/core: the runtime-neutral contracts (keys, chunk object format, KV
// geometry, errors) shared by the client, the gateway and the codec.

export * from './checksum.ts'
export * from './dtype.ts'
export * from './errors.ts'
export * from './format.ts'
export * from './keys.ts'
export * from './layout.ts'
