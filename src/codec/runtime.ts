// Holds the process-wide codec instance. Loaders (node.ts, workerd.ts) hand it
// a compiled WebAssembly.Module; init is idempotent so every entry may call it.

import { CodecError } from '../core/errors.ts'
import { WasmCodec } from './wasm-instance.ts'

declare global {
  // Public signatures name WebAssembly.Module. Consumers whose types lack WebAssembly (no
  // DOM lib with @types/node 20) get this empty declaration; it merges with the full one elsewhere.
  namespace WebAssembly {
    interface Module {}
  }
}

let codec: WasmCodec | undefined

/** Initialises the codec from a compiled module. Later calls are no-ops. */
export function initCodec(module: WebAssembly.Module): void {
  if (codec) return
  if (!(module instanceof WebAssembly.Module)) {
    throw new CodecError('initCodec expects a WebAssembly.Module (import the .wasm, or use the node loader)')
  }
  codec = new WasmCodec(module)
}

export function isCodecReady(): boolean {
  return codec !== undefined
}

/** The initialised codec, or a CodecError naming the loaders. */
export function wasmCodec(): WasmCodec {
  if (!codec) {
    throw new CodecError(
      "codec not initialised: import 'src/codec/node.ts' (Node) or call initCodec(module) (workerd) first",
    )
  }
  return codec
}
