// The slice of the native addon (src/client/native.ts, written by the native
// helper) that the client uses, loaded lazily so the client runs without it.

/** What the client needs from the addon; every member is optional because builds differ. */
export interface NativeApi {
  /** Page-aligned host memory, pinned (cudaHostAlloc) or mlocked when possible. */
  allocPinned?: (bytes: number) => unknown
  /** Host → device copy; resolves when the copy completed. */
  copyHostToDevice?: (devicePtr: bigint, src: Uint8Array) => Promise<void>
  /** Device → host copy; resolves when the copy completed. */
  copyDeviceToHost?: (dst: Uint8Array, devicePtr: bigint) => Promise<void>
  /** Batched copies; descriptors are (device address, host offset, length) triples. */
  copyBatch?: (...args: unknown[]) => Promise<void>
  cuda?: { available: boolean; reason?: string } | (() => { available: boolean; reason?: string })
  readDirect?: (...args: unknown[]) => unknown
  writeDirect?: (...args: unknown[]) => unknown
  [k: string]: unknown
}

export interface NativeLoad {
  api: NativeApi | undefined
  /** Why the addon is not usable (absent module, failed build, ...). */
  reason: string | undefined
}

let loaded: Promise<NativeLoad> | undefined

/** Loads src/client/native.ts once; never throws (absence is a normal condition). */
export function loadNative(): Promise<NativeLoad> {
  loaded ??= (async (): Promise<NativeLoad> => {
    // A computed specifier: the module may not exist in this checkout.
    const spec = './native.ts'
    try {
      const mod = (await import(spec)) as NativeApi & { default?: NativeApi; loadNative?: () => NativeApi }
      const api = typeof mod.loadNative === 'function' ? mod.loadNative() : (mod.default ?? mod)
      return { api, reason: undefined }
    } catch (e) {
      return { api: undefined, reason: `native addon unavailable: ${(e as Error).message.split('\n')[0]}` }
    }
  })()
  return loaded
}

/**
 * Normalizes whatever allocPinned returned (ArrayBuffer, Buffer, typed array or
 * `{ buffer, pinned, reason }`) into a byte view and whether it is pinned.
 */
export function pinnedView(v: unknown): { bytes: Uint8Array; pinned: boolean; reason?: string } | undefined {
  if (v instanceof ArrayBuffer) return { bytes: new Uint8Array(v), pinned: true }
  if (ArrayBuffer.isView(v)) return { bytes: new Uint8Array(v.buffer, v.byteOffset, v.byteLength), pinned: true }
  if (typeof v === 'object' && v !== null && 'buffer' in v) {
    const o = v as { buffer: unknown; pinned?: unknown; locked?: unknown; reason?: unknown }
    const inner = pinnedView(o.buffer)
    if (!inner) return undefined
    const pinned = o.pinned === undefined ? o.locked !== false : o.pinned === true
    return { bytes: inner.bytes, pinned, reason: typeof o.reason === 'string' ? o.reason : undefined }
  }
  return undefined
}
