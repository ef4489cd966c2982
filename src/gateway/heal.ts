// Corruption heals: a stored object is read back and verified completely (streaming),
// and only an object this gateway itself found corrupt is deleted, so the next writer
// replaces it. Never acts on a client's claim alone; verifications are deduplicated
// per object and bounded in number.

import { isKvgateError, KvgateError } from '../core/errors.ts'
import { HEADER_PREFIX_BYTES, namesNewerFeature } from '../core/format.ts'
import type { GatewayState } from './context.ts'
import { collectAtMost } from './stores/types.ts'
import { objectCheck } from './verified-read.ts'

export type Verdict = 'ok' | 'corrupt' | 'missing'

/** A verification's outcome; `deleted` only for the corrupt version it read (never one put back since). */
export interface Verified {
  verdict: Verdict
  deleted: boolean
}

export interface VerifyTarget {
  ns: string
  key: string
  /** Object name in the store. */
  name: string
}

const NAMESPACE_ID = /^[0-9a-f]{32}$/

/** A namespace named by its 32-hex namespace id binds the id its chunks must carry. */
export function namespaceIdOf(ns: string): string | undefined {
  return NAMESPACE_ID.test(ns) ? ns : undefined
}

/** True for failures that mean "these bytes are not a sound chunk" (not a store or network fault). */
export function isCorruption(e: unknown): boolean {
  return isKvgateError(e) && (e.code.startsWith('ERR_FORMAT_') || e.code === 'ERR_INVALID_KEY')
}

/**
 * Reads `t` from the store and verifies all of it. A corrupt object is deleted,
 * counted and its presence (and its chain's later keys) forgotten. Store faults
 * throw; they say nothing about the object.
 */
export function verifyStored(state: GatewayState, t: VerifyTarget, by: 'get' | 'verify'): Promise<Verified> {
  const running = state.verifying.get(t.name)
  if (running) return running
  if (state.verifying.size >= state.limits.maxConcurrentVerifies) {
    state.metrics.busy.inc({ what: 'verify' })
    return Promise.reject(
      new KvgateError('ERR_BUSY', 'too many verifications in flight; retry later', { status: 503 }),
    )
  }
  const p = (async (): Promise<Verified> => {
    const obj = await state.store.get(t.name)
    if (!obj) {
      state.lookup.invalidateFrom(t.name)
      return { verdict: 'missing', deleted: false }
    }
    const nsId = namespaceIdOf(t.ns)
    const check = objectCheck({
      keyHex: t.key,
      maxBytes: Math.max(state.limits.maxChunkBytes, obj.size),
      ...(nsId ? { namespaceIdHex: nsId } : {}),
    })
    const reader = obj.body.getReader()
    let seen = 0
    let failure: unknown
    let ended = false
    try {
      for (;;) {
        const { done, value } = await reader.read()
        if (done) {
          ended = true
          break
        }
        seen += value.length
        // Bytes past what the store said it holds are the store's fault, not the object's:
        // the verifier would call them corrupt and delete a sound object.
        if (seen > obj.length)
          throw new KvgateError('ERR_STORE', `store sent more than the ${obj.length} bytes it reported`, {
            status: 502,
          })
        try {
          check.push(value)
        } catch (e) {
          failure = e
          break
        }
      }
      if (failure === undefined && seen !== obj.length) {
        throw new KvgateError('ERR_STORE', `store sent ${seen} of ${obj.length} bytes`, { status: 502 })
      }
      if (failure === undefined) {
        try {
          check.finish()
        } catch (e) {
          failure = e
        }
      }
    } finally {
      // Stopped before the end (a corrupt piece, a store fault): release the store's stream.
      if (!ended) await reader.cancel(failure ?? new Error('verification stopped')).catch(() => {})
      reader.releaseLock()
    }
    if (failure === undefined) return { verdict: 'ok', deleted: false }
    if (!isCorruption(failure)) throw failure
    if (check.headerUndecoded() && (await isNewerFormat(state, t.name, obj.etag, failure))) {
      // Until this gateway is upgraded every GET of it fails the same way: not read again for each.
      state.newerFormat.set(newerFormatKey(t.name, obj.size), true)
      throw new KvgateError(
        (failure as KvgateError).code,
        `stored chunk is in a format this gateway cannot read, with an intact header (a newer writer's?): left in place. ${(failure as Error).message}`,
        { status: 502 },
      )
    }
    // Only the version read: a sound copy put back while it was read (after a DELETE elsewhere) stays.
    const deleted = await state.store.delete(t.name, { ifMatch: obj.etag })
    state.lookup.invalidateFrom(t.name)
    state.headers.delete(t.name)
    state.metrics.corrupt.inc({ by })
    return { verdict: 'corrupt', deleted }
  })().finally(() => state.verifying.delete(t.name))
  state.verifying.set(t.name, p)
  return p.then((v) => {
    state.metrics.verifies.inc({ verdict: v.verdict })
    return v
  })
}

/** Largest header a newer format's object is read back for (v2 at MAX_LAYERS is ~16 KiB). */
const MAX_NEWER_HEADER_BYTES = 1024 * 1024

/**
 * True when the refused header of `name` is intact and names a format version, flag, codec or
 * dtype added since this build (core/format.ts namesNewerFeature). docs/format.md adds those
 * so that older readers refuse them cleanly: an older gateway in a fleet mid-upgrade must
 * refuse such a chunk, not delete it as rot. Any other refusal (a field out of range, a
 * broken CRC) is corruption, as before.
 */
async function isNewerFormat(
  state: GatewayState,
  name: string,
  etag: string | undefined,
  failure: unknown,
): Promise<boolean> {
  const code = (failure as KvgateError).code
  if (code !== 'ERR_FORMAT_BAD_VERSION' && code !== 'ERR_FORMAT_BAD_FIELD') return false
  const prefix = await readBytes(state, name, HEADER_PREFIX_BYTES)
  if (!prefix || prefix.bytes.length < HEADER_PREFIX_BYTES) return false
  const headerBytes = new DataView(prefix.bytes.buffer, prefix.bytes.byteOffset).getUint32(8, true)
  if (headerBytes < HEADER_PREFIX_BYTES + 4 || headerBytes > MAX_NEWER_HEADER_BYTES) return false
  const header = await readBytes(state, name, headerBytes)
  if (!header) return false
  // Another version since the one verified: nothing is known about either (no delete).
  if (etag !== undefined && header.etag !== undefined && header.etag !== etag)
    throw new KvgateError('ERR_STORE', 'the object changed while it was verified', { status: 503 })
  return namesNewerFeature(header.bytes)
}

/** The object's first `length` bytes (fewer when it is shorter), or undefined when it is gone. */
async function readBytes(
  state: GatewayState,
  name: string,
  length: number,
): Promise<{ bytes: Uint8Array; etag?: string | undefined } | undefined> {
  const obj = await state.store.get(name, { range: { offset: 0, length } })
  if (!obj) return undefined
  const bytes = await collectAtMost(obj.body, length)
  return bytes && { bytes, etag: obj.etag }
}

/** How long a newer writer's object (by name and size) is not verified again on a GET. */
export const NEWER_FORMAT_TTL_MS = 5 * 60_000
/** Objects remembered as a newer writer's at once (a key and a number each). */
export const NEWER_FORMAT_ENTRIES = 10_000

/** The newer-format verdict's key: an object put back under the name with another size is another one. */
export function newerFormatKey(name: string, size: number): string {
  return `${name}|${size}`
}

/**
 * A GET found bad bytes: verify the stored object in the background (deletes it if corrupt).
 * `size`: the object's size as the GET saw it, where known; an object of that name and size
 * verified lately as a newer writer's (mid-upgrade) is not read again.
 */
export function reportCorruptRead(
  state: GatewayState,
  t: VerifyTarget,
  layers: boolean,
  size: number | undefined,
): void {
  state.metrics.corruptReads.inc({ layers: String(layers) })
  state.headers.delete(t.name)
  if (size !== undefined && state.newerFormat.has(newerFormatKey(t.name, size))) return
  verifyStored(state, t, 'get').catch(() => {
    // A store fault or a full verify queue: the next corrupt read tries again.
  })
}
