// Helper process for bench/client.ts: a gateway on an fs store in its own
// process (so its CPU is not the client's), printing its URL on stdout.

import { createGateway } from '../../src/gateway/index.ts'
import { FsStore, serveGateway } from '../../src/gateway/node.ts'

const root = process.argv[2]
if (!root) throw new Error('usage: client-gateway-server.ts <store dir>')
const gw = await serveGateway(createGateway({ store: new FsStore({ root, fsync: false }) }), { port: 0 })
process.stdout.write(`${gw.url}\n`)
process.on('SIGTERM', () => void gw.close(100).then(() => process.exit(0)))
