// Node-only pieces of the gateway: the fs and s3 stores and the Node server
// adapter. Import from here in Node; index.ts stays runtime-neutral.

export type { NodeServerOptions, RunningGateway } from './adapters/node.ts'
export { serveGateway } from './adapters/node.ts'
export type { FsStoreOptions } from './stores/fs.ts'
export { FsStore } from './stores/fs.ts'
export type { S3StoreOptions } from './stores/s3.ts'
export { S3Store } from './stores/s3.ts'
