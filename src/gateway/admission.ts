// Admission of a request that takes a body in (chunk PUT, calibration PUT, upload commit, lookup):
// its declared bytes count against limits.maxInFlightBytes (how much upload traffic one
// gateway takes on at once) and the bytes it will hold against the memory budget
// (limits.maxHeldBytes). Both are taken before the body is read and given back in one
// finally, whichever way the request ends (done, error, client abort), so no route
// releases anything itself.

import { KvgateError } from '../core/errors.ts'
import type { GatewayState } from './context.ts'

export interface Need {
  /** Body bytes the request declares (Content-Length, an upload's size). */
  declared: number
  /** Bytes the gateway will hold for it at most (memory-budget.ts). */
  held: number
}

/**
 * Runs `run` with the request admitted, or throws 503 ERR_BUSY (errors.ts adds Retry-After) before
 * anything is read or stored. `what` labels kvgate_busy_total.
 */
export async function admitted<T>(
  state: GatewayState,
  what: string,
  need: Need,
  run: () => Promise<T>,
): Promise<T> {
  const inFlight = state.inFlight
  // A lone upload larger than maxInFlightBytes still goes (it is bounded by maxChunkBytes);
  // the memory budget has no such exception: createState checks that one request fits it.
  // A request that declares no upload bytes (a lookup) is bounded by the memory budget alone.
  const tooMuch =
    need.declared > 0 && inFlight.bytes > 0 && inFlight.bytes + need.declared > state.limits.maxInFlightBytes
  const lease = tooMuch ? undefined : state.memory.tryReserve(need.held)
  if (!lease) {
    state.metrics.busy.inc({ what })
    if (!tooMuch) throw memoryBusy()
    throw new KvgateError('ERR_BUSY', 'too many upload bytes in flight; retry later', { status: 503 })
  }
  inFlight.bytes += need.declared
  try {
    return await run()
  } finally {
    inFlight.bytes -= need.declared
    lease.release()
  }
}

/** The refusal of a request whose hold would pass limits.maxHeldBytes (errors.ts adds Retry-After). */
export function memoryBusy(): KvgateError {
  return new KvgateError(
    'ERR_BUSY',
    'the gateway holds as much request memory as it may (limits.maxHeldBytes); retry later',
    { status: 503 },
  )
}
