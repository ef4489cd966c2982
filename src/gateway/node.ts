// kvgate/gateway in Node: everything index.ts has, plus the fs and s3 stores and the
// Node server adapter (what embedding the gateway in a Node process needs); index.ts stays runtime-neutral.

export type { NodeServerOptions, RunningGateway } from './adapters/node.ts'
export { serveGateway } from './adapters/node.ts'
export * from './index.ts'
export type { FsStoreOptions } from './stores/fs.ts'
export { FsStore } from './stores/fs.ts'
export type { S3StoreOptions } from './stores/s3.ts'
export { S3Store } from './stores/s3.ts'
