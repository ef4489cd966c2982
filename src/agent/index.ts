// `kvgate agent` as a library: start an agent in-process (tests, benchmarks, embedding).

import { Agent } from './agent.ts'
import type { ResolvedAgentConfig } from './config.ts'
import { AgentServer } from './server.ts'

export { Agent } from './agent.ts'
export { type AgentSettings, type ResolvedAgentConfig, resolveAgentConfig } from './config.ts'
export { AGENT_ERROR_CODES, AgentError, type AgentErrorCode, PROTOCOL_VERSION } from './protocol.ts'
export { AgentServer } from './server.ts'

/** Starts an agent listening on `config.socket`; close() the result to stop it. */
export function startAgent(config: ResolvedAgentConfig, version: string): Promise<AgentServer> {
  const agent = new Agent({
    chunkTokens: config.chunkTokens,
    cache: config.cache,
    lookupDeadlineMs: config.lookupDeadlineMs,
    model: config.model,
    copyThreads: config.copyThreads,
    version,
  })
  return AgentServer.listen(agent, {
    socketPath: config.socket,
    maxFrameBytes: config.maxFrameBytes,
    metricsPort: config.metricsPort,
  })
}
