// `kvgate serve` in its own process on an S3 bucket (RadosGW in the benches), as it is deployed:
// its CPU is not the client's. Resolves once the listening line gives its URL.

import { spawn } from 'node:child_process'
import { createInterface } from 'node:readline'
import { fileURLToPath } from 'node:url'
import { nodeFlagsFor, siblingModule } from '../../src/package-files.ts'

export interface S3Target {
  bucket: string
  endpoint: string
  accessKeyId: string
  secretAccessKey: string
}

export interface ServeProcess {
  url: string
  pid: number
  close(): Promise<void>
}

/** Starts a gateway on `s3` under `prefix`; `extra` flags are appended; `main` is another checkout's CLI (A/B runs). */
export async function startServeProcess(
  s3: S3Target,
  prefix: string,
  extra: readonly string[] = [],
  main = fileURLToPath(siblingModule(import.meta.url, '../../src/cli/bin.ts')),
): Promise<ServeProcess> {
  const args = [
    'serve',
    '--port',
    '0',
    '--store',
    's3',
    '--s3-bucket',
    s3.bucket,
    '--s3-endpoint',
    s3.endpoint,
  ]
  const proc = spawn(
    process.execPath,
    [...nodeFlagsFor(main), main, ...args, '--prefix', prefix, '--log', 'error', ...extra],
    {
      stdio: ['ignore', 'pipe', 'inherit'],
      env: {
        ...process.env,
        KVGATE_S3_ACCESS_KEY_ID: s3.accessKeyId,
        KVGATE_S3_SECRET_ACCESS_KEY: s3.secretAccessKey,
        KVGATE_CONFIG: '',
      },
    },
  )
  const url = await new Promise<string>((resolve, reject) => {
    createInterface({ input: proc.stdout! }).on('line', (l) => {
      try {
        const j = JSON.parse(l) as { msg?: string; url?: string }
        if (j.msg === 'listening' && j.url) resolve(j.url)
      } catch {
        // not a log line of ours
      }
    })
    proc.once('exit', (code) => reject(new Error(`kvgate serve exited ${code}`)))
  })
  return {
    url,
    pid: proc.pid!,
    close: () =>
      new Promise<void>((r) => {
        if (proc.exitCode !== null) return r()
        proc.once('exit', () => r())
        proc.kill('SIGTERM')
      }),
  }
}
