// workerd / Cloudflare Workers loader: Workers cannot compile wasm from bytes, so
// the bundler imports the .wasm as a WebAssembly.Module and we hand it over.

import wasm from '../../wasm/kvgate_codec.wasm'
import { initCodec } from './runtime.ts'

initCodec(wasm)

export * from './index.ts'
