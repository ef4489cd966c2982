// The pace a GET reader must keep (limits.readerIdleTimeoutMs, readerMinBytesPerSecond) for the
// store stream it holds, and that stream's place in the memory budget: what the store reads
// ahead of the reader (the S3 SDK's read-ahead) is reserved while the stream is open, so a
// reader just above the pace still holds it within limits.maxHeldBytes; a reader that idles or
// trickles is cut off, counted, and released.

import type { Context } from 'hono'
import { memoryBusy } from './admission.ts'
import type { GatewayState } from './context.ts'
import type { GatewayEnv } from './env.ts'
import type { MemoryLease } from './memory-budget.ts'
import type { StoreObject } from './stores/types.ts'
import type { CheckedStreamOptions } from './verified-read.ts'

/**
 * checkedStream's pace options: the limits, the metric, and (given the request `c`) its socket.
 * Without `c` a cut-off fails the stream, which ends the response as a store failure would.
 */
export function readerPace(
  state: GatewayState,
  c?: Context<GatewayEnv>,
  held?: MemoryLease,
): Pick<CheckedStreamOptions, 'idleTimeoutMs' | 'minBytesPerSecond' | 'onCutOff' | 'onEnd'> {
  return {
    // However the stream ends (read out, failed, cancelled, cut off): its hold is given back.
    onEnd: () => held?.release(),
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

/**
 * Reserves what `obj`'s open body holds in the store ahead of its reader (ObjectStore.getHoldBytes:
 * S3 up to 4 MiB, fs up to 2 MiB; none for memory, R2) against limits.maxHeldBytes, to be given back through readerPace's
 * onEnd. Past the bound the body is released and the GET refused with 503 ERR_BUSY, as a PUT is.
 */
export function holdStoreStream(
  state: GatewayState,
  obj: Pick<StoreObject, 'length'> & { body: { cancel(reason?: unknown): Promise<void> } },
  what: string,
): MemoryLease {
  const lease = state.memory.tryReserve(state.store.getHoldBytes?.(obj.length) ?? 0)
  if (lease) return lease
  obj.body.cancel().catch(() => {})
  state.metrics.busy.inc({ what })
  throw memoryBusy()
}
