// `kvgate agent`: the per-node sidecar vLLM's KVGateConnector talks to. Owns the KV cache
// tiers (L1, L2, gateway) and moves KV between engine memory and them (docs/vllm.md).

import { resolveAgentConfig } from '../../agent/config.ts'
import { startAgent } from '../../agent/index.ts'
import { parseCommandArgs } from '../args.ts'
import { version } from '../main.ts'

const HELP = `Usage: kvgate agent [options]

Runs the kvgate agent: engines (vLLM with kvgate_vllm.KVGateConnector) register their
KV cache with it over a Unix socket and look up, load and save KV chunks through it.
Protocol: docs/agent-protocol.md. Operations guide: docs/vllm.md.

Options (flags override KVGATE_* env vars, which override the config file):
  -c, --config FILE            YAML config file (env: KVGATE_CLIENT_CONFIG); cache keys at the top
                               level (memory, disk, remote, namespace), agent keys under agent:
  -s, --socket PATH            Unix socket, created 0600 (env: KVGATE_AGENT_SOCKET)
                               [$XDG_RUNTIME_DIR/kvgate/agent.sock or /tmp/kvgate-<uid>/agent.sock]
      --chunk-tokens N         tokens per stored chunk, a multiple of vLLM's block size
                               (env: KVGATE_CHUNK_TOKENS) [256]
      --lookup-deadline-ms N   answer lookups from local tiers after N ms (env:
                               KVGATE_AGENT_LOOKUP_DEADLINE_MS) [250]
      --metrics-port N         Prometheus /metrics on 127.0.0.1:N, 0 = any free port
                               (env: KVGATE_AGENT_METRICS_PORT) [off]
      --model ID               refuse engines serving another model (env: KVGATE_AGENT_MODEL)
      --copy-threads N         threads one save or load copies with, off the event loop; 0 copies
                               on the event loop (env: KVGATE_AGENT_COPY_THREADS) [min(cores, 4)]
  -h, --help                   show this help

Cache tiers as for the client: KVGATE_MEMORY_BYTES (the one L1 of every engine and rank,
per chunk size; faulted in when the first engine registers), KVGATE_DISK_DIR /
KVGATE_DISK_BYTES (L2: a subdirectory per KV space, one budget for all), KVGATE_REMOTE_URL /
KVGATE_REMOTE_TOKEN / KVGATE_REMOTE_CODEC (the gateway), KVGATE_NAMESPACE. Largest frame an
engine may send: KVGATE_AGENT_MAX_FRAME_BYTES or agent.maxFrameBytes [16MiB].
Prints one JSON line {"socket", "metricsPort"} when ready.
`

export async function run(argv: string[]): Promise<number> {
  const { values, help } = parseCommandArgs(argv, {
    config: { type: 'string', short: 'c' },
    socket: { type: 'string', short: 's' },
    'chunk-tokens': { type: 'string' },
    'lookup-deadline-ms': { type: 'string' },
    'metrics-port': { type: 'string' },
    model: { type: 'string' },
    'copy-threads': { type: 'string' },
  })
  if (help) {
    console.log(HELP)
    return 0
  }
  // Flags go in as typed: resolveAgentConfig checks them and quotes a bad one with its flag.
  const config = resolveAgentConfig({
    config: values.config,
    socket: values.socket,
    chunkTokens: values['chunk-tokens'],
    lookupDeadlineMs: values['lookup-deadline-ms'],
    metricsPort: values['metrics-port'],
    model: values.model,
    copyThreads: values['copy-threads'],
  })
  const server = await startAgent(config, version())
  console.log(JSON.stringify({ socket: server.socketPath, metricsPort: server.metricsPort ?? null }))
  await new Promise<void>((resolve) => {
    const stop = () => resolve()
    process.once('SIGINT', stop)
    process.once('SIGTERM', stop)
  })
  await server.close()
  return 0
}
