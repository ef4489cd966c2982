// Runs a TypeScript module as a separate Node process (through tsx) and talks to
// it over the IPC channel: request/reply calls plus progress events, for demo and fleet nodes.

import { type ChildProcess, fork } from 'node:child_process'
import { fileURLToPath } from 'node:url'
import { nodeFlagsFor } from '../package-files.ts'

/** A message from a worker: the reply to call `id`, or a progress line. */
type FromWorker =
  | { kind: 'reply'; id: number; ok: true; value: unknown }
  | { kind: 'reply'; id: number; ok: false; error: string }
  | { kind: 'progress'; text: string }

type ToWorker = { kind: 'call'; id: number; method: string; params: unknown }

export interface WorkerHandle {
  readonly pid: number
  readonly process: ChildProcess
  /** Calls `method` in the worker; rejects when it throws or the process dies first. */
  call<T>(method: string, params?: unknown): Promise<T>
  /** Disconnects (the worker exits once idle) and waits for the exit, killing it after `graceMs`. */
  close(graceMs?: number): Promise<number | null>
  /** Last lines the worker wrote to stderr (for error messages). */
  stderrTail(): string
}

export interface ForkOptions {
  env?: NodeJS.ProcessEnv
  /** Progress lines the worker sends. */
  onProgress?: (text: string) => void
}

/** Starts `script` (a .ts source in a checkout, .js when installed) in its own Node process with an IPC channel. */
export function forkWorker(script: string | URL, opts: ForkOptions = {}): Promise<WorkerHandle> {
  const file = typeof script === 'string' ? script : fileURLToPath(script)
  const child = fork(file, [], {
    execArgv: nodeFlagsFor(file),
    // A worker's stdout goes to our stderr: `kvgate demo --json` keeps stdout for the JSON.
    stdio: ['ignore', 'pipe', 'pipe', 'ipc'],
    env: opts.env ?? process.env,
    serialization: 'advanced',
  })
  let stderr = ''
  child.stdout?.pipe(process.stderr, { end: false })
  child.stderr?.on('data', (d: Buffer) => {
    stderr = (stderr + String(d)).slice(-4000)
  })
  const pending = new Map<number, { resolve: (v: unknown) => void; reject: (e: Error) => void }>()
  let nextId = 1
  let exited: number | null | undefined
  const exitPromise = new Promise<number | null>((resolve) => {
    child.on('exit', (code, signal) => {
      exited = code ?? (signal ? 128 : null)
      for (const p of pending.values()) {
        p.reject(new Error(`worker ${child.pid} exited (${signal ?? code}) during a call${tail(stderr)}`))
      }
      pending.clear()
      resolve(code)
    })
  })
  child.on('message', (m: FromWorker) => {
    if (m.kind === 'progress') opts.onProgress?.(m.text)
    else if (m.kind === 'reply') {
      const p = pending.get(m.id)
      if (!p) return
      pending.delete(m.id)
      if (m.ok) p.resolve(m.value)
      else p.reject(new Error(m.error))
    }
  })
  const handle: WorkerHandle = {
    pid: child.pid ?? -1,
    process: child,
    call<T>(method: string, params?: unknown): Promise<T> {
      if (exited !== undefined || !child.connected) {
        return Promise.reject(new Error(`worker ${child.pid} is not running${tail(stderr)}`))
      }
      const id = nextId++
      return new Promise<T>((resolve, reject) => {
        pending.set(id, { resolve: resolve as (v: unknown) => void, reject })
        child.send({ kind: 'call', id, method, params } satisfies ToWorker)
      })
    },
    async close(graceMs = 5000) {
      if (exited !== undefined) return exited
      if (child.connected) child.disconnect()
      const timer = setTimeout(() => child.kill('SIGKILL'), graceMs)
      const code = await exitPromise
      clearTimeout(timer)
      return code
    },
    stderrTail: () => stderr,
  }
  // Ready once the worker says so: its imports (model, codec wasm) are loaded.
  return new Promise((resolve, reject) => {
    const onExit = () => reject(new Error(`worker ${file} exited before it was ready${tail(stderr)}`))
    child.once('exit', onExit)
    child.once('message', (m: { kind?: string }) => {
      child.off('exit', onExit)
      if (m.kind === 'ready') resolve(handle)
      else reject(new Error(`worker ${file} sent ${JSON.stringify(m)} before ready`))
    })
  })
}

function tail(stderr: string): string {
  const t = stderr.trim().split('\n').slice(-8).join('\n')
  return t ? `:\n${t}` : ''
}

/** Worker side: serves calls from the parent; exits when the parent disconnects. */
export function serveWorker(methods: Record<string, (params: never) => unknown>): void {
  if (!process.send) throw new Error('serveWorker: not started with an IPC channel (use forkWorker)')
  const send = (m: FromWorker | { kind: 'ready' }) => {
    if (process.connected) process.send!(m)
  }
  // Calls run one after another: a node handles one request at a time.
  let queue = Promise.resolve()
  process.on('message', (m: ToWorker) => {
    if (m?.kind !== 'call') return
    queue = queue.then(async () => {
      const fn = methods[m.method]
      try {
        if (!fn) throw new Error(`unknown method ${m.method}`)
        const value = await fn(m.params as never)
        send({ kind: 'reply', id: m.id, ok: true, value })
      } catch (e) {
        send({ kind: 'reply', id: m.id, ok: false, error: (e as Error).stack ?? String(e) })
      }
    })
  })
  process.on('disconnect', () => {
    void queue.then(() => process.exit(0))
  })
  send({ kind: 'ready' })
}

/** Worker side: a progress line for the parent to print. */
export function progress(text: string): void {
  if (process.connected) process.send!({ kind: 'progress', text } satisfies FromWorker)
}
