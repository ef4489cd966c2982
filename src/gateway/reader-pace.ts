// The pace a GET reader must keep (limits.readerIdleTimeoutMs, readerMinBytesPerSecond) for the
// store stream it holds: the S3 SDK's read-ahead or a file handle and its buffers are not in
// the memory budget, so a reader that idles or trickles is cut off, counted, and released.

import type { Context } from 'hono'
import type { GatewayState } from './context.ts'
import type { GatewayEnv } from './env.ts'
import type { CheckedStreamOptions } from './verified-read.ts'

/**
 * checkedStream's pace options: the limits, the metric, and (given the request `c`) its socket.
 * Without `c` a cut-off fails the stream, which ends the response as a store failure would.
 */
export function readerPace(
  state: GatewayState,
  c?: Context<GatewayEnv>,
): Pick<CheckedStreamOptions, 'idleTimeoutMs' | 'minBytesPerSecond' | 'onCutOff'> {
  return {
    idleTimeoutMs: state.limits.readerIdleTimeoutMs,
    minBytesPerSecond: state.limits.readerMinBytesPerSecond,
    onCutOff: (why) => {
      state.metrics.readersCutOff.inc({ reason: why })
      // A client that stopped (or all but stopped) reading also stops the adapter reading us:
      // close its socket (Node: @hono/node-server puts the ServerResponse in c.env.outgoing).
      // Elsewhere the stream fails, and the runtime ends the response.
      const outgoing = (c?.env as { outgoing?: { destroy?: () => void } } | undefined)?.outgoing
      if (typeof outgoing?.destroy !== 'function') return false
      outgoing.destroy()
      return true
    },
  }
}
