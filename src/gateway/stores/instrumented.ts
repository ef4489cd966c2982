// Wraps any ObjectStore so every operation is counted and timed in the gateway
// metrics (ops by outcome, latency histograms), without the backends knowing.

import type { GatewayMetrics } from '../metrics.ts'
import type { ObjectStore } from './types.ts'

export function instrumentStore(store: ObjectStore, metrics: GatewayMetrics): ObjectStore {
  const timed = async <T>(op: string, fn: () => Promise<T>, outcome: (v: T) => string): Promise<T> => {
    const t0 = performance.now()
    try {
      const v = await fn()
      metrics.storeOps.inc({ op, store: store.kind, result: outcome(v) })
      return v
    } catch (e) {
      metrics.storeOps.inc({ op, store: store.kind, result: 'error' })
      throw e
    } finally {
      metrics.storeSeconds.observe((performance.now() - t0) / 1000, { op, store: store.kind })
    }
  }
  const found = (v: unknown) => (v === undefined ? 'absent' : 'ok')
  const wrapped: ObjectStore = {
    kind: store.kind,
    get: (name, opts) => timed('get', () => store.get(name, opts), found),
    head: (name) => timed('head', () => store.head(name), found),
    putIfAbsent: (name, body, size) =>
      timed(
        'put',
        () => store.putIfAbsent(name, body, size),
        (r) => r,
      ),
    delete: (name, opts) =>
      timed(
        'delete',
        () => store.delete(name, opts),
        (r) => (r ? 'ok' : 'absent'),
      ),
    list: (prefix, opts) =>
      timed(
        'list',
        () => store.list(prefix, opts),
        () => 'ok',
      ),
  }
  if (store.presignGet) wrapped.presignGet = (name, s) => store.presignGet!(name, s)
  if (store.presignUpload) wrapped.presignUpload = (name, size, o) => store.presignUpload!(name, size, o)
  if (store.completeUpload)
    wrapped.completeUpload = (name, id, lengths) =>
      timed(
        'complete',
        () => store.completeUpload!(name, id, lengths),
        (r) => (r === 'completed' ? 'ok' : r),
      )
  if (store.abortUpload) wrapped.abortUpload = (name, id) => store.abortUpload!(name, id)
  if (store.putHoldBytes) wrapped.putHoldBytes = (size) => store.putHoldBytes!(size)
  if (store.getHoldBytes) wrapped.getHoldBytes = (length) => store.getHoldBytes!(length)
  if (store.stats) wrapped.stats = () => store.stats!()
  if (store.close) wrapped.close = () => store.close!()
  return wrapped
}
