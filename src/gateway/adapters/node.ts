// Node adapter: serves a gateway app with @hono/node-server on a loopback (or
// given) address, with keep-alive and timeouts suited to multi-MiB chunk bodies.

import type { Server } from 'node:http'
import type { AddressInfo } from 'node:net'
import { createAdaptorServer } from '@hono/node-server'
import type { Hono } from 'hono'
import type { GatewayEnv } from '../env.ts'

export interface NodeServerOptions {
  /** @default '127.0.0.1' */
  host?: string
  /** 0 picks a free port. @default 8787 */
  port?: number
  /** Whole-request limit for slow clients (ms). @default 300000 */
  requestTimeoutMs?: number
  /** @default 65000 (above common load balancer idle timeouts) */
  keepAliveTimeoutMs?: number
  /** Open connections at most; more are refused at accept (each holds buffers and maybe a store stream). @default 1024 */
  maxConnections?: number
}

export interface RunningGateway {
  server: Server
  url: string
  port: number
  host: string
  /** Stops accepting, lets in-flight requests finish (up to `graceMs`), then closes sockets. */
  close(graceMs?: number): Promise<void>
}

export async function serveGateway(
  app: Hono<GatewayEnv>,
  opts: NodeServerOptions = {},
): Promise<RunningGateway> {
  const host = opts.host ?? '127.0.0.1'
  const server = createAdaptorServer({
    fetch: app.fetch,
    // Requests the app does not read (an early 4xx on PUT) are drained/closed by the adapter.
    autoCleanupIncoming: true,
  }) as Server
  server.requestTimeout = opts.requestTimeoutMs ?? 300_000
  server.keepAliveTimeout = opts.keepAliveTimeoutMs ?? 65_000
  server.headersTimeout = Math.min(60_000, server.requestTimeout || 60_000)
  const maxConnections = opts.maxConnections ?? 1024
  if (!Number.isInteger(maxConnections) || maxConnections < 1)
    throw new TypeError('serveGateway: invalid maxConnections')
  server.maxConnections = maxConnections
  await new Promise<void>((resolve, reject) => {
    server.once('error', reject)
    server.listen(opts.port ?? 8787, host, () => {
      server.off('error', reject)
      resolve()
    })
  })
  const port = (server.address() as AddressInfo).port
  const urlHost = host.includes(':') ? `[${host}]` : host
  return {
    server,
    port,
    host,
    url: `http://${urlHost}:${port}`,
    close: (graceMs = 5000) =>
      new Promise<void>((resolve) => {
        const timer = setTimeout(() => server.closeAllConnections(), graceMs)
        server.close(() => {
          clearTimeout(timer)
          resolve()
        })
        server.closeIdleConnections()
      }),
  }
}
