// The kvgate gateway embedded in your own Node process: an fs store in a temporary
// directory, bearer-token auth, and a client that writes through it and a second one that reads back.
import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { KVCache } from 'kvgate/client'
import { chunkBytes, MODEL_PRESETS } from 'kvgate/core'
import { createGateway, FsStore, hashToken, serveGateway } from 'kvgate/gateway'

const dir = mkdtempSync(join(tmpdir(), 'kvgate-example-'))
const token = 'example-token-0123456789' // in production: `npx kvgate token`
const store = await new FsStore({ root: dir }).open()
const app = createGateway({
  store,
  auth: { tokens: [{ name: 'example', sha256: await hashToken(token), scopes: 'write', namespaces: ['demo'] }] },
})
const gateway = await serveGateway(app, { host: '127.0.0.1', port: 0 })
try {
  const options = {
    model: 'stories260k',
    namespace: 'demo',
    memory: { bytes: '64MiB' },
    remote: { url: gateway.url, token, codec: 'lossless' },
  }
  const tokens = Uint32Array.from({ length: 512 }, (_, i) => (i * 31) % 512)
  const kv = new Uint8Array(2 * chunkBytes(MODEL_PRESETS.stories260k, 256)).map((_, i) => i % 253)

  const writer = await KVCache.open(options)
  await writer.store(tokens, kv)
  await writer.close() // flushes the write-behind queue to the gateway

  const reader = await KVCache.open(options) // a cold node: its own L1 is empty
  const { tokens: found, chunks } = await reader.lookup(tokens)
  const back = new Uint8Array(kv.length)
  await reader.retrieve(tokens, { into: back })
  await reader.close()
  console.log(
    JSON.stringify({ gateway: gateway.url, found, tier: chunks[0]?.tier, identical: back.every((b, i) => b === kv[i]) }),
  )
} finally {
  await gateway.close()
  await store.close?.()
  rmSync(dir, { recursive: true, force: true })
}
