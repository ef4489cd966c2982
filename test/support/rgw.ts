// Gives test suites and benches a running Ceph RadosGW (a real S3): reuses one
// named by KVGATE_RGW_* env vars (set by rgw-global-setup.ts), else starts a private one.
//
// Usage in a suite:
//   const rgw = await useRgw('s3 store')          // undefined => skip (never in CI)
//   ... rgw.endpoint, rgw.accessKeyId, rgw.secretAccessKey, rgw.bucket ...
//   await rgw.stop()                               // no-op for a shared RGW
// When Ceph is missing and cannot be installed: throws under CI=true, otherwise
// prints a loud warning and resolves to undefined so the suite can skip.

import { execFile } from 'node:child_process'
import { fileURLToPath } from 'node:url'

export interface Rgw {
  endpoint: string
  accessKeyId: string
  secretAccessKey: string
  bucket: string
  region: string
  /** The temp dir of a private RGW (logs under log/); undefined for a shared one. */
  dir: string | undefined
  /** True when this RGW is owned by someone else (env): stop() leaves it running. */
  shared: boolean
  /** Stops a private RGW and removes its dir. Idempotent. */
  stop(): Promise<void>
}

const SCRIPTS = fileURLToPath(new URL('../../scripts/rgw/', import.meta.url))
const NOT_INSTALLED = 3

function run(
  file: string,
  args: string[],
  timeoutMs: number,
): Promise<{ code: number; stdout: string; stderr: string }> {
  return new Promise((resolve) => {
    execFile(file, args, { timeout: timeoutMs, maxBuffer: 1 << 20 }, (err, stdout, stderr) => {
      const code = err ? (typeof err.code === 'number' ? err.code : 1) : 0
      resolve({ code, stdout, stderr })
    })
  })
}

function parseEnv(text: string): Record<string, string> {
  const out: Record<string, string> = {}
  for (const line of text.split('\n')) {
    const m = /^([A-Z_]+)=(.*)$/.exec(line.trim())
    if (m) out[m[1]!] = m[2]!
  }
  return out
}

/** The RGW described by KVGATE_RGW_* env vars, if any. */
export function rgwFromEnv(env: NodeJS.ProcessEnv = process.env): Rgw | undefined {
  const endpoint = env.KVGATE_RGW_ENDPOINT
  if (!endpoint) return undefined
  return {
    endpoint,
    accessKeyId: env.KVGATE_RGW_ACCESS_KEY ?? '',
    secretAccessKey: env.KVGATE_RGW_SECRET_KEY ?? '',
    bucket: env.KVGATE_RGW_BUCKET ?? 'kvgate-test',
    region: env.KVGATE_RGW_REGION ?? 'us-east-1',
    dir: undefined,
    shared: true,
    stop: async () => {},
  }
}

/** Starts a private RGW. Throws with the script's log when it cannot. */
export async function startRgw(opts: { bucket?: string; install?: boolean } = {}): Promise<Rgw> {
  const args = ['--bucket', opts.bucket ?? 'kvgate-test']
  if (opts.install ?? true) args.push('--install')
  let r = await run(`${SCRIPTS}start.sh`, args, 240_000)
  // A free port can be taken between probing and binding: one retry covers that race.
  if (r.code !== 0 && r.code !== NOT_INSTALLED) r = await run(`${SCRIPTS}start.sh`, args, 240_000)
  if (r.code !== 0) {
    const err = new Error(`scripts/rgw/start.sh failed (exit ${r.code}):\n${r.stderr.slice(-4000)}`)
    ;(err as Error & { exitCode: number }).exitCode = r.code
    throw err
  }
  const v = parseEnv(r.stdout)
  const dir = v.RGW_DIR!
  let stopped = false
  return {
    endpoint: v.RGW_ENDPOINT!,
    accessKeyId: v.RGW_ACCESS_KEY!,
    secretAccessKey: v.RGW_SECRET_KEY!,
    bucket: v.RGW_BUCKET!,
    region: v.RGW_REGION ?? 'us-east-1',
    dir,
    shared: false,
    async stop() {
      if (stopped) return
      stopped = true
      await run(`${SCRIPTS}stop.sh`, [dir], 30_000)
    },
  }
}

/**
 * The RGW a suite should use: the shared one from env, else a private one.
 * Resolves undefined (after a loud warning) only outside CI when Ceph is unavailable.
 */
export async function useRgw(suite: string): Promise<Rgw | undefined> {
  const shared = rgwFromEnv()
  if (shared) return shared
  try {
    return await startRgw()
  } catch (e) {
    const notInstalled = (e as { exitCode?: number }).exitCode === NOT_INSTALLED
    if (process.env.CI === 'true' || process.env.CI === '1' || !notInstalled) throw e
    const bar = '!'.repeat(78)
    console.warn(
      `\n${bar}\n!! SKIPPING ${suite}: Ceph RadosGW is not installed and cannot be installed here\n` +
        `!! (needs root + apt-get: apt-get install ceph-mon ceph-osd radosgw). In CI this fails.\n${bar}\n`,
    )
    return undefined
  }
}
