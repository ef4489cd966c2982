// `kvgate agent` as a library: start an agent in-process (tests, benchmarks, embedding).

import { existsSync } from 'node:fs'
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
    copyGate: testCopyGate(process.env.KVGATE_AGENT_TEST_COPY_GATE),
    version,
  })
  return AgentServer.listen(agent, {
    socketPath: config.socket,
    maxFrameBytes: config.maxFrameBytes,
    metricsPort: config.metricsPort,
  })
}

/**
 * Test hook (the Python harness's stalled copier): with KVGATE_AGENT_TEST_COPY_GATE set to a
 * path, every copy into or out of the engine's blocks, once started, waits while that file
 * exists, then lands. Never set in service.
 */
function testCopyGate(path: string | undefined): (() => Promise<void>) | undefined {
  if (!path) return undefined
  // Said once at start: set by accident in service, it stalls every copy while the file exists.
  console.warn(
    `kvgate agent: test hook KVGATE_AGENT_TEST_COPY_GATE is set: every copy waits while ${path} exists; unset it outside tests`,
  )
  return async () => {
    while (existsSync(path)) await new Promise((r) => setTimeout(r, 10))
  }
}
