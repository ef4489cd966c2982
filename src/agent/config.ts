// `kvgate agent` settings: the client's cache options (YAML file + KVGATE_* as for any
// kvgate process) plus the agent's own (socket, deadlines, metrics port), validated eagerly.

import { mkdirSync } from 'node:fs'
import { availableParallelism } from 'node:os'
import { join } from 'node:path'
import type { KVCacheOptions } from '../client/config.ts'
import { optionsFromEnvironment, parseBytes } from '../client/config.ts'
import { ConfigError } from '../core/errors.ts'
import { DEFAULT_MAX_FRAME_BYTES } from './protocol.ts'

export interface AgentSettings {
  /** Unix socket path. @default $XDG_RUNTIME_DIR/kvgate/agent.sock, else /tmp/kvgate-<uid>/agent.sock */
  socket?: string
  /** Tokens per stored chunk (a multiple of the engine's block size). @default 256 */
  chunkTokens?: number
  /** Lookups answer from L1/L2 after this many ms when the gateway is slow. @default 250 */
  lookupDeadlineMs?: number
  /** Largest accepted frame. @default 16 MiB */
  maxFrameBytes?: number
  /** Loopback port for Prometheus /metrics; off unless given (0 = any free port). */
  metricsPort?: number
  /** Refuse engines serving another model id. @default any */
  model?: string
  /**
   * Threads one save's or load's copy is split across (host-memory tensors); 0 copies on the
   * event loop instead (the pre-threaded path, for comparison). @default min(cores, 4)
   */
  copyThreads?: number
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

function int(name: string, v: unknown, min: number, max: number): number {
  const n = typeof v === 'string' && /^\s*\d+\s*$/.test(v) ? Number(v) : v
  if (typeof n !== 'number' || !Number.isSafeInteger(n) || n < min || n > max)
    throw new ConfigError(`invalid ${name}: expected an integer in ${min}..${max}, got ${String(v)}`)
  return n
}

/**
 * Flags over env over the YAML file (`agent:` section for the agent's own keys; the
 * cache keys at the top level, as for the client). Unknown agent keys are errors.
 */
export function resolveAgentConfig(
  flags: AgentSettings & { config?: string },
  env: NodeJS.ProcessEnv = process.env,
): ResolvedAgentConfig {
  const base = optionsFromEnvironment(env, flags.config, ['agent']) as Record<string, unknown>
  const fromFile = (base.agent ?? {}) as Record<string, unknown>
  if (typeof fromFile !== 'object' || Array.isArray(fromFile))
    throw new ConfigError('agent: expected a mapping')
  for (const k of Object.keys(fromFile)) {
    if (!AGENT_KEYS.includes(k))
      throw new ConfigError(`unknown agent option '${k}' (${AGENT_KEYS.join(', ')})`)
  }
  const { agent: _a, model: _m, keyScheme: _k, hashSeed: _h, chunkTokens: ct, ...cache } = base
  const pick = (k: keyof AgentSettings, envName: string): unknown =>
    flags[k] ?? (env[envName] !== undefined && env[envName] !== '' ? env[envName] : undefined) ?? fromFile[k]
  const socket = pick('socket', 'KVGATE_AGENT_SOCKET')
  if (socket !== undefined && (typeof socket !== 'string' || socket.length === 0 || socket.length > 107)) {
    throw new ConfigError('invalid socket: a path of 1..107 characters (the Unix socket limit)')
  }
  const metricsPort = pick('metricsPort', 'KVGATE_AGENT_METRICS_PORT')
  const model = pick('model', 'KVGATE_AGENT_MODEL')
  const maxFrame = pick('maxFrameBytes', 'KVGATE_AGENT_MAX_FRAME_BYTES')
  const copyThreads = pick('copyThreads', 'KVGATE_AGENT_COPY_THREADS')
  return {
    socket: (socket as string | undefined) ?? defaultSocketPath(env),
    chunkTokens: int('chunkTokens', flags.chunkTokens ?? ct ?? fromFile.chunkTokens ?? 256, 1, 1 << 20),
    lookupDeadlineMs: int(
      'lookupDeadlineMs',
      pick('lookupDeadlineMs', 'KVGATE_AGENT_LOOKUP_DEADLINE_MS') ?? 250,
      0,
      60_000,
    ),
    maxFrameBytes:
      maxFrame === undefined
        ? DEFAULT_MAX_FRAME_BYTES
        : int('maxFrameBytes', parseBytes('maxFrameBytes', maxFrame), 1024, 1 << 30),
    metricsPort: metricsPort === undefined ? undefined : int('metricsPort', metricsPort, 0, 65535),
    model: model === undefined ? undefined : String(model),
    copyThreads:
      copyThreads === undefined ? defaultCopyThreads() : int('copyThreads', copyThreads, 0, MAX_COPY_THREADS),
    cache: cache as ResolvedAgentConfig['cache'],
  }
}
