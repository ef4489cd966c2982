// A test-only Worker: runs the wasm codec inside workerd (the .wasm imported as a
// CompiledWasm module, as in production) so the suite can compare it with Node's.

import { type CodecMode, decodeChunk, encodeChunk } from '../../src/codec/workerd.ts'
import { sampleMeta, sampleTensor } from './codec-sample.ts'

export default {
  async fetch(request: Request): Promise<Response> {
    const url = new URL(request.url)
    if (url.pathname === '/encode') {
      const mode = (url.searchParams.get('mode') ?? 'lossless') as CodecMode
      const obj = encodeChunk(sampleTensor(), sampleMeta(), { mode })
      return new Response(obj as Uint8Array<ArrayBuffer>)
    }
    if (url.pathname === '/decode') {
      const obj = new Uint8Array(await request.arrayBuffer())
      try {
        return new Response(decodeChunk(obj) as Uint8Array<ArrayBuffer>)
      } catch (e) {
        return Response.json({ error: (e as { code?: string }).code ?? String(e) }, { status: 400 })
      }
    }
    return new Response('not found', { status: 404 })
  },
}
