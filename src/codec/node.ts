// Node loader: compiles wasm/kvgate_codec.wasm synchronously and initialises the
// codec on import, then re-exports the runtime-neutral API.

import { readFileSync } from 'node:fs'
import { CodecError } from '../core/errors.ts'
import { initCodec } from './runtime.ts'

// ../../wasm from src/codec in a checkout, and from dist/src/codec in an install (the build copies it there).
export const WASM_PATH = new URL('../../wasm/kvgate_codec.wasm', import.meta.url)

/** Reads and compiles the committed codec module (sync). */
export function loadCodecModule(): WebAssembly.Module {
  let bytes: Uint8Array<ArrayBuffer>
  try {
    bytes = readFileSync(WASM_PATH)
  } catch (e) {
    throw new CodecError(
      `cannot read ${WASM_PATH.pathname}: reinstall kvgate (in a checkout: npm run build:wasm)`,
      { cause: e },
    )
  }
  return new WebAssembly.Module(bytes)
}

initCodec(loadCodecModule())

export * from './index.ts'
