// `kvgate agent` settings: the client's cache options (YAML file + KVGATE_* as for any
// kvgate process) plus the agent's own (socket, deadlines, metrics port), validated eagerly.

import { mkdirSync } from 'node:fs'
import { availableParallelism } from 'node:os'
import { join } from 'node:path'
import type { KVCacheOptions } from '../client/config.ts'
import { optionsFromEnvironment, parseBytes } from '../client/config.ts'
import { nearestKey } from '../core/config-check.ts'
import { ConfigError } from '../core/errors.ts'
import { DEFAULT_MAX_FRAME_BYTES } from './protocol.ts'

// Numbers may also be strings as typed on the command line: they are checked here, and an
// error quotes them as given.
export interface AgentSettings {
  /** Unix socket path. @default $XDG_RUNTIME_DIR/kvgate/agent.sock, else /tmp/kvgate-<uid>/agent.sock */
  socket?: string
  /** Tokens per stored chunk (a multiple of the engine's block size). @default 256 */
  chunkTokens?: number | string
  /** Lookups answer from L1/L2 after this many ms when the gateway is slow. @default 250 */
  lookupDeadlineMs?: number | string
  /** Largest accepted frame. @default 16 MiB */
  maxFrameBytes?: number | string
  /** Loopback port for Prometheus /metrics; off unless given (0 = any free port). */
  metricsPort?: number | string
  /** Refuse engines serving another model id. @default any */
  model?: string
  /**
   * Threads one save's or load's copy is split across (host-memory tensors); 0 copies on the
   * event loop instead (the pre-threaded path, for comparison). @default min(cores, 4)
   */
  copyThreads?: number | string
}

const AGENT_KEYS = [
  'socket',
  'chunkTokens',
  'lookupDeadlineMs',
  'maxFrameBytes',
  'metricsPort',
  'model',
  'copyThreads',
]

/** Copies split across more threads than this stop gaining (memory bandwidth) and crowd the libuv pool. */
export const MAX_COPY_THREADS = 64

/** The default split of one copy: every core up to 4 (a node's engines share the agent's pool). */
export function defaultCopyThreads(): number {
  return Math.max(1, Math.min(availableParallelism(), 4))
}

export interface ResolvedAgentConfig {
  socket: string
  chunkTokens: number
  lookupDeadlineMs: number
  maxFrameBytes: number
  metricsPort: number | undefined
  model: string | undefined
  copyThreads: number
  cache: Omit<KVCacheOptions, 'model' | 'keyScheme' | 'hashSeed' | 'chunkTokens'>
}

/** The default socket path; creates its directory 0700 when it is ours to create. */
export function defaultSocketPath(env: NodeJS.ProcessEnv = process.env): string {
  const dir = env.XDG_RUNTIME_DIR
    ? join(env.XDG_RUNTIME_DIR, 'kvgate')
    : join('/tmp', `kvgate-${process.getuid?.() ?? 'user'}`)
  mkdirSync(dir, { recursive: true, mode: 0o700 })
  return join(dir, 'agent.sock')
}

function int(where: string, v: unknown, min: number, max: number): number {
  const n = typeof v === 'string' && /^\s*\d+\s*$/.test(v) ? Number(v) : v
  if (typeof n !== 'number' || !Number.isSafeInteger(n) || n < min || n > max) {
    const got = typeof v === 'string' ? `'${v}'` : String(v)
    throw new ConfigError(`${where}: expected an integer in ${min}..${max}, got ${got}`)
  }
  return n
}

const kebab = (k: string) => `--${k.replace(/[A-Z]/g, (c) => `-${c.toLowerCase()}`)}`

/**
 * Flags over env over the YAML file (`agent:` section for the agent's own keys; the
 * cache keys at the top level, as for the client). Unknown agent keys are errors.
 */
export function resolveAgentConfig(
  flags: AgentSettings & { config?: string },
  env: NodeJS.ProcessEnv = process.env,
): ResolvedAgentConfig {
  const base = optionsFromEnvironment(env, flags.config, ['agent']) as Record<string, unknown>
  const file = flags.config ?? env.KVGATE_CLIENT_CONFIG
  const fromFile = (base.agent ?? {}) as Record<string, unknown>
  if (typeof fromFile !== 'object' || Array.isArray(fromFile))
    throw new ConfigError(`${file}: agent: expected a mapping`)
  for (const k of Object.keys(fromFile)) {
    if (!AGENT_KEYS.includes(k)) {
      const near = nearestKey(k, AGENT_KEYS)
      throw new ConfigError(
        `${file}: agent.${k}: unknown key${near ? ` (did you mean '${near}'?)` : ''}; valid keys here: ${AGENT_KEYS.join(', ')}`,
      )
    }
  }
  const { agent: _a, model: _m, keyScheme: _k, hashSeed: _h, chunkTokens: ct, ...cache } = base
  // Each value with where it came from, so an error names the flag, variable or file key to fix.
  const pick = (k: keyof AgentSettings, envName: string, fallback?: unknown): [unknown, string] => {
    if (flags[k] !== undefined) return [flags[k], kebab(k)]
    if (env[envName] !== undefined && env[envName] !== '') return [env[envName], envName]
    if (fromFile[k] !== undefined) return [fromFile[k], `${file}: agent.${k}`]
    return [fallback, k]
  }
  const [socket, socketWhere] = pick('socket', 'KVGATE_AGENT_SOCKET')
  // sun_path holds 108 bytes with the NUL: bytes, not characters (a non-ASCII path counts more).
  if (
    socket !== undefined &&
    (typeof socket !== 'string' || socket.length === 0 || Buffer.byteLength(socket) > 107)
  ) {
    throw new ConfigError(`${socketWhere}: expected a path of 1..107 bytes (the Unix socket limit)`)
  }
  const [metricsPort, metricsWhere] = pick('metricsPort', 'KVGATE_AGENT_METRICS_PORT')
  const [model] = pick('model', 'KVGATE_AGENT_MODEL')
  const [maxFrame, maxFrameWhere] = pick('maxFrameBytes', 'KVGATE_AGENT_MAX_FRAME_BYTES')
  const [copyThreads, copyWhere] = pick('copyThreads', 'KVGATE_AGENT_COPY_THREADS')
  const [lookupDeadline, lookupWhere] = pick('lookupDeadlineMs', 'KVGATE_AGENT_LOOKUP_DEADLINE_MS', 250)
  // chunkTokens: the flag, else the client's (KVGATE_CHUNK_TOKENS or the file's top level,
  // checked there), else the file's agent section.
  const [chunkTokens, chunkWhere]: [unknown, string] =
    flags.chunkTokens !== undefined
      ? [flags.chunkTokens, '--chunk-tokens']
      : ct !== undefined
        ? [ct, env.KVGATE_CHUNK_TOKENS ? 'KVGATE_CHUNK_TOKENS' : `${file}: chunkTokens`]
        : fromFile.chunkTokens !== undefined
          ? [fromFile.chunkTokens, `${file}: agent.chunkTokens`]
          : [256, 'chunkTokens']
  return {
    socket: (socket as string | undefined) ?? defaultSocketPath(env),
    chunkTokens: int(chunkWhere, chunkTokens, 1, 1 << 20),
    lookupDeadlineMs: int(lookupWhere, lookupDeadline, 0, 60_000),
    maxFrameBytes:
      maxFrame === undefined
        ? DEFAULT_MAX_FRAME_BYTES
        : int(maxFrameWhere, parseBytes(maxFrameWhere, maxFrame), 1024, 1 << 30),
    metricsPort: metricsPort === undefined ? undefined : int(metricsWhere, metricsPort, 0, 65535),
    model: model === undefined ? undefined : String(model),
    copyThreads:
      copyThreads === undefined ? defaultCopyThreads() : int(copyWhere, copyThreads, 0, MAX_COPY_THREADS),
    cache: cache as ResolvedAgentConfig['cache'],
  }
}
