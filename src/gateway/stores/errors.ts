// Store-level errors the routes map to HTTP: an unsatisfiable range (416) and the
// StoreError codes from core (502 failure, 503 unavailable / timed out).

import { isKvgateError, KvgateError, StoreError } from '../../core/errors.ts'

export class RangeNotSatisfiableError extends KvgateError {
  readonly size: number
  constructor(size: number) {
    super('ERR_RANGE_NOT_SATISFIABLE', `range not satisfiable (object is ${size} bytes)`, { status: 416 })
    this.name = 'RangeNotSatisfiableError'
    this.size = size
  }
}

export function storeUnavailable(message: string, cause?: unknown): StoreError {
  return new StoreError(message, { code: 'ERR_STORE_UNAVAILABLE', status: 503, cause })
}

export function storeTimeout(message: string, cause?: unknown): StoreError {
  return new StoreError(message, { code: 'ERR_TIMEOUT', status: 503, cause })
}

/**
 * What a store body that broke off mid-read (a reset socket: the SDK's stream errors with a plain
 * Error) answers: the store's fault, 502 ERR_STORE, not the gateway's 500. Typed errors pass.
 */
export function storeBodyFailure(e: unknown): KvgateError {
  return isKvgateError(e)
    ? e
    : new StoreError(`reading the store body failed: ${(e as Error)?.message}`, { cause: e })
}
