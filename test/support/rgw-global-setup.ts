// Optional vitest globalSetup: starts ONE RadosGW for the whole run and exports
// KVGATE_RGW_* so every suite's useRgw() shares it (add to vitest.config.ts
// `globalSetup: ['test/support/rgw-global-setup.ts']`). Without it each suite starts its own.

import { rgwFromEnv, startRgw } from './rgw.ts'

export default async function setup(): Promise<(() => Promise<void>) | undefined> {
  if (rgwFromEnv()) return undefined
  let rgw: Awaited<ReturnType<typeof startRgw>>
  try {
    rgw = await startRgw()
  } catch (e) {
    // Suites decide whether a missing RGW is fatal (CI) or a skip (local).
    console.warn(`rgw-global-setup: no shared RGW (${(e as Error).message.split('\n')[0]})`)
    return undefined
  }
  process.env.KVGATE_RGW_ENDPOINT = rgw.endpoint
  process.env.KVGATE_RGW_ACCESS_KEY = rgw.accessKeyId
  process.env.KVGATE_RGW_SECRET_KEY = rgw.secretAccessKey
  process.env.KVGATE_RGW_BUCKET = rgw.bucket
  process.env.KVGATE_RGW_REGION = rgw.region
  return () => rgw.stop()
}
