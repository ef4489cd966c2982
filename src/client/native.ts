// Typed loader and wrapper for kvgate's native addon (native/): pinned host
// memory, GPU copies through a run-time libcudart, CUDA IPC, O_DIRECT file I/O.
//
// JS validates every argument here; the C++ side trusts the shapes it gets,
// re-checks host ranges before any copy, and does blocking work off the JS
// thread. Every failure surfaces as a {@link NativeError} (ERR_NATIVE / ERR_CUDA).

import { existsSync, statSync } from 'node:fs'
import { createRequire } from 'node:module'
import { resolve } from 'node:path'
import { KvgateError, type KvgateErrorOptions } from '../core/errors.ts'
import { installedAsDependency, packageRoot } from '../package-files.ts'

/** The addon contract version this wrapper speaks (native/src/addon.cc `abiVersion`). */
export const NATIVE_ABI_VERSION = 12

/** O_DIRECT alignment kvgate uses for buffer addresses and file offsets (bytes). */
export const DIRECT_ALIGNMENT = 4096

/**
 * Largest single pinned allocation: Node 20 backs external ArrayBuffers with
 * Buffers, capped at `buffer.constants.MAX_LENGTH` (4 GiB). Larger L1 regions
 * need several allocations.
 */
export const MAX_PINNED_BYTES = 2 ** 32

const ROOT = packageRoot()

/** Where things are on disk, and the command that builds them. */
export const nativePaths = {
  /** A local build (node-gyp's Release output): in a checkout, or after `npx kvgate build-native`. */
  addon: resolve(ROOT, 'native/build/Release/kvgate_native.node'),
  /** The binary built when the package was packed (linux-x64), loaded when there is no local build. */
  prebuilt: resolve(ROOT, 'prebuilds', `${process.platform}-${process.arch}`, 'kvgate_native.node'),
  /** The stub libcudart the tests load through `KVGATE_CUDART`. */
  stubCudart: resolve(ROOT, 'native/test-stub/build/libcudart_stub.so'),
  /** A command that exists where kvgate runs: the package's CLI when installed, the npm script in a checkout. */
  buildCommand: installedAsDependency()
    ? 'npx kvgate build-native   (needs g++, make, python3 and the Node headers)'
    : 'npm run build:native   (runs scripts/build-native.sh; needs g++, make, python3, Node headers)',
} as const

export type NativeErrorCode = 'ERR_NATIVE' | 'ERR_CUDA'

/** A failure in the native layer: misuse (ERR_NATIVE) or a CUDA runtime error (ERR_CUDA). */
export class NativeError extends KvgateError {
  /** The cudaError_t value, for ERR_CUDA errors that came from a CUDA call. */
  readonly cudaError: number | undefined
  /** errno of a failed system call (e.g. 22 for EINVAL). */
  readonly errno: number | undefined
  /** errno's name, e.g. `'ENOENT'`. */
  readonly syscode: string | undefined
  /** The failed call: a syscall or CUDA function name. */
  readonly syscall: string | undefined

  constructor(
    code: NativeErrorCode,
    message: string,
    options: KvgateErrorOptions & {
      cudaError?: number
      errno?: number
      syscode?: string
      syscall?: string
    } = {},
  ) {
    super(code, message, options)
    this.name = 'NativeError'
    this.cudaError = options.cudaError
    this.errno = options.errno
    this.syscode = options.syscode
    this.syscall = options.syscall
  }
}

function misuse(message: string): NativeError {
  return new NativeError('ERR_NATIVE', message)
}

/** Turns whatever the addon threw into a NativeError (keeping its fields). */
function translate(e: unknown): NativeError {
  if (e instanceof NativeError) return e
  const err = e as {
    code?: unknown
    message?: unknown
    cudaError?: unknown
    errno?: unknown
    syscode?: unknown
    syscall?: unknown
  }
  const code: NativeErrorCode = err?.code === 'ERR_CUDA' ? 'ERR_CUDA' : 'ERR_NATIVE'
  const num = (v: unknown) => (typeof v === 'number' ? v : undefined)
  const str = (v: unknown) => (typeof v === 'string' ? v : undefined)
  return new NativeError(code, typeof err?.message === 'string' ? err.message : String(e), {
    cause: e,
    cudaError: num(err?.cudaError),
    errno: num(err?.errno),
    syscode: str(err?.syscode),
    syscall: str(err?.syscall),
  })
}

function call<T>(fn: () => T): T {
  try {
    return fn()
  } catch (e) {
    throw translate(e)
  }
}

async function callAsync<T>(fn: () => Promise<T>): Promise<T> {
  try {
    return await fn()
  } catch (e) {
    throw translate(e)
  }
}

// ---------------------------------------------------------------------------
// Loader

interface RawPinned {
  buffer: ArrayBuffer
  kind: PinnedKind
  reason: string
  hugePages: boolean
}
interface RawIo {
  bytes: number
  direct: boolean
  reason: string
}
interface RawCuda {
  probe(): CudaStatus
  setDevice(device: number): void
  getDevice(): number
  malloc(bytes: number): bigint
  free(ptr: bigint): void
  streamCreate(device?: number): bigint
  streamDestroy(stream: bigint): void
  copy(
    direction: 1 | 2 | 3,
    host: ArrayBuffer | null,
    hostOffset: number,
    hostLength: number,
    descriptors: BigInt64Array,
    stream: bigint,
    device?: number,
  ): Promise<CopyResult>
  /** cuda.cc (abi 10): strided copies, [deviceOffset, hostOffset, width, height, devicePitch, hostPitch] 6-tuples. */
  copy2D(
    direction: 1 | 2,
    host: ArrayBuffer,
    hostOffset: number,
    hostLength: number,
    base: bigint,
    descriptors: Float64Array,
    stream: bigint,
    device?: number,
  ): Promise<CopyResult>
  ipcOpen(handle: Uint8Array, flags: number, device?: number): Promise<bigint>
  ipcClose(ptr: bigint, device?: number): Promise<void>
  ipcGetHandle(ptr: bigint): Uint8Array
  stubControl(spec: string): number
  deviceByPciBusId(id: string): number
  pciBusId(device?: number): string
}

/** Options as the addon reads them (`prefault` absent reads as false, as in builds before it). */
type RawAllocOptions = Required<Omit<AllocPinnedOptions, 'prefault'>> & { prefault?: boolean }

/** The addon's raw exports. Prefer the typed functions below: they validate. */
export interface NativeBinding {
  abiVersion: number
  directAlignment: number
  allocPinned(bytes: number, opts: RawAllocOptions): Promise<RawPinned>
  allocPinnedSync(bytes: number, opts: RawAllocOptions): RawPinned
  freePinned(buffer: ArrayBuffer): void
  pinnedInfo(buffer: ArrayBuffer): PinnedInfo | null
  memoryStats(): NativeMemoryStats
  registerHost(buffer: ArrayBuffer): Promise<void>
  unregisterHost(buffer: ArrayBuffer): void
  copyHost(
    dst: ArrayBuffer,
    dstOffset: number,
    src: ArrayBuffer,
    srcOffset: number,
    length: number,
  ): Promise<void>
  copyViews(dst: Uint8Array, src: Uint8Array): Promise<void>
  readFile(
    path: string,
    buffer: ArrayBuffer,
    byteOffset: number,
    capacity: number,
    fileOffset: number,
    length: number,
    mode: 0 | 1 | 2,
  ): Promise<RawIo>
  readFileCrc(
    path: string,
    buffer: ArrayBuffer,
    byteOffset: number,
    capacity: number,
    fileOffset: number,
    length: number,
    mode: 0 | 1 | 2,
    ranges: Float64Array,
    dst?: ArrayBuffer,
    dstOffset?: number,
    dstLength?: number,
    dstFileOffset?: number,
    expected?: Float64Array,
    gate?: unknown,
  ): Promise<RawIo & { crcs: Uint32Array; copied: Uint8Array }>
  newCopyGate(): unknown
  closeCopyGate(gate: unknown): void
  writeFile(
    path: string,
    buffer: ArrayBuffer,
    byteOffset: number,
    length: number,
    fileOffset: number,
    mode: 0 | 1 | 2,
    fsync: boolean,
    truncate: boolean,
  ): Promise<RawIo>
  evictFileCache(path: string): Promise<void>
  /** io.cc (abi 9): whether a connected socket's peer shut down its side (POLLRDHUP). */
  peerClosed?(fd: number): boolean
  /** mmap.cc; absent from builds that predate it. */
  mapFile?(path: string, offset: number, length: number, writable: boolean): ArrayBuffer
  unmapFile?(buffer: ArrayBuffer): void
  mapStats?(): FileMapStats
  /** mmap.cc; absent from builds that predate it. */
  copyRuns?(dst: HostBuffer, src: HostBuffer, runs: Float64Array): void
  copyRunsAsync?(buffers: HostBuffer[], runs: Float64Array, parts: number): Promise<void>
  /** mmap.cc (2-D row sets); absent from builds that predate them. */
  copyRows?(dst: HostBuffer, src: HostBuffer, rows: Float64Array): void
  copyRowsAsync?(buffers: HostBuffer[], rows: Float64Array, parts: number): Promise<void>
  /** mmap.cc (abi 11: 3-D row sets); absent from builds that predate them. */
  copyPlanes?(dst: HostBuffer, src: HostBuffer, sets: Float64Array): void
  copyPlanesAsync?(buffers: HostBuffer[], sets: Float64Array, parts: number): Promise<void>
  /** keys.cc; absent from builds that predate it. */
  sha256V1Chain?(
    parent: Uint8Array,
    tokens: Uint32Array,
    chunkTokens: number,
    chunks: number,
    out: Uint8Array,
  ): void
  cuda: RawCuda
}

let loaded: NativeBinding | undefined
let loadError: NativeError | undefined

/**
 * Paths the loader tries, in order: `KVGATE_NATIVE_PATH` alone when set, else a local
 * Release build, the prebuilt binary shipped in the package, and a Debug build.
 */
export function nativeCandidates(): string[] {
  const override = process.env.KVGATE_NATIVE_PATH
  // An explicit path is the only one tried: silently loading another build
  // would hide a broken override.
  if (override) return [resolve(override)]
  return [nativePaths.addon, nativePaths.prebuilt, resolve(ROOT, 'native/build/Debug/kvgate_native.node')]
}

/**
 * Loads the addon once per process. Throws one NativeError (ERR_NATIVE) that
 * lists every path tried, why each failed, and the command that builds it.
 */
export function loadNative(): NativeBinding {
  if (loaded) return loaded
  if (loadError) throw loadError
  const require = createRequire(import.meta.url)
  const tried: string[] = []
  for (const path of nativeCandidates()) {
    if (!existsSync(path)) {
      tried.push(`${path}: not found`)
      continue
    }
    try {
      const binding = require(path) as NativeBinding
      if (binding.abiVersion !== NATIVE_ABI_VERSION) {
        tried.push(`${path}: stale build (abi ${binding.abiVersion}, this code needs ${NATIVE_ABI_VERSION})`)
        continue
      }
      loaded = binding
      return binding
    } catch (e) {
      tried.push(`${path}: ${(e as Error).message.split('\n')[0]}`)
    }
  }
  loadError = new NativeError(
    'ERR_NATIVE',
    `kvgate native addon could not be loaded. Tried:\n${tried.map((t) => `  - ${t}`).join('\n')}\n` +
      `Build it with: ${nativePaths.buildCommand}`,
  )
  throw loadError
}

/** True when the addon loads; never throws. */
export function nativeAvailable(): boolean {
  try {
    loadNative()
    return true
  } catch {
    return false
  }
}

// ---------------------------------------------------------------------------
// Host buffers

/** Host memory kvgate can read or write: an ArrayBuffer or any view of one (not a SharedArrayBuffer). */
export type HostBuffer = ArrayBuffer | ArrayBufferView

interface HostRange {
  buffer: ArrayBuffer
  offset: number
  length: number
}

// Buffers given to freePinned: later use gets a clear message instead of a
// generic "empty buffer" one (a freed buffer is detached, byteLength 0).
const freedBuffers = new WeakSet<ArrayBuffer>()

function hostRange(b: unknown, what: string): HostRange {
  let buffer: unknown
  let offset = 0
  let length: number
  if (b instanceof ArrayBuffer) {
    buffer = b
    length = b.byteLength
  } else if (ArrayBuffer.isView(b)) {
    buffer = b.buffer
    offset = b.byteOffset
    length = b.byteLength
  } else {
    throw misuse(`${what} must be an ArrayBuffer or an ArrayBufferView`)
  }
  if (!(buffer instanceof ArrayBuffer)) throw misuse(`${what} must not be backed by a SharedArrayBuffer`)
  if (freedBuffers.has(buffer)) throw misuse(`${what} was freed with freePinned and cannot be used again`)
  if (unmappedBuffers.has(buffer))
    throw misuse(`${what} was unmapped with unmapFile and cannot be used again`)
  return { buffer, offset, length }
}

function checkSize(bytes: unknown, what: string, max: number, min = 1): number {
  if (typeof bytes !== 'number' || !Number.isSafeInteger(bytes))
    throw misuse(`${what} must be an integer, got ${String(bytes)}`)
  if (bytes < min || bytes > max) throw misuse(`${what} must be in [${min}, ${max}], got ${bytes}`)
  return bytes
}

function checkPtr(p: unknown, what: string): bigint {
  if (typeof p !== 'bigint') throw misuse(`${what} must be a bigint device pointer`)
  if (p <= 0n || p >= 2n ** 64n) throw misuse(`${what} must be a non-null 64-bit pointer`)
  return p
}

// ---------------------------------------------------------------------------
// Pinned memory

/** How the memory is pinned: CUDA page-locked, mlock'ed, or merely page-aligned. */
export type PinnedKind = 'cuda' | 'mlock' | 'none'

export interface AllocPinnedOptions {
  /**
   * Use cudaHostAlloc when CUDA is usable (the only kind a GPU copies from at
   * full speed without staging).
   * @default true
   */
  cuda?: boolean
  /**
   * mlock the pages when not CUDA-allocated. Failure is not an error: the
   * result's `kind` is `'none'` and `reason` says why (RLIMIT_MEMLOCK is
   * typically 8 MiB for non-root users).
   * @default true
   */
  lock?: boolean
  /**
   * Align allocations of ≥ 2 MiB to 2 MiB and ask for transparent huge pages
   * (MADV_HUGEPAGE) — fewer TLB misses on large copies.
   * @default true
   */
  hugePages?: boolean
  /**
   * Fault every page in now (on the worker thread) when the memory is not locked, so the
   * first copy into it does not pay one page fault per page: what mlock would have done,
   * without RLIMIT_MEMLOCK. The memory is resident (counted in RSS) from the start.
   * @default false
   */
  prefault?: boolean
}

export interface PinnedAllocation {
  /** Zero-filled memory. Freed by {@link freePinned} or, failing that, when garbage collected. */
  buffer: ArrayBuffer
  kind: PinnedKind
  /** Why this kind: which paths were tried and what failed (CUDA unavailable, mlock ENOMEM…). */
  reason: string
  /** Whether MADV_HUGEPAGE was applied. */
  hugePages: boolean
}

export interface PinnedInfo {
  kind: PinnedKind
  reason: string
  bytes: number
  hugePages: boolean
  /** Async operations using the buffer right now (freePinned refuses while > 0). */
  busy: number
  /** Registered with cudaHostRegister. */
  registered: boolean
}

export interface NativeMemoryStats {
  /** Live pinned allocations (not yet freed or collected). */
  pinnedBlocks: number
  pinnedBytes: number
  /** Buffers registered with cudaHostRegister. */
  registered: number
}

function allocOptions(opts: AllocPinnedOptions): Required<AllocPinnedOptions> {
  if (typeof opts !== 'object' || opts === null) throw misuse('allocPinned options must be an object')
  return {
    cuda: opts.cuda ?? true,
    lock: opts.lock ?? true,
    hugePages: opts.hugePages ?? true,
    prefault: opts.prefault ?? false,
  }
}

/**
 * Allocates `bytes` of pinned host memory off the JS thread (mlock and
 * cudaHostAlloc fault every page in: ~0.1–0.3 s per GiB).
 * @throws NativeError ERR_NATIVE for a bad size or when the memory cannot be mapped.
 */
export async function allocPinned(bytes: number, opts: AllocPinnedOptions = {}): Promise<PinnedAllocation> {
  checkSize(bytes, 'bytes', MAX_PINNED_BYTES)
  const o = allocOptions(opts)
  const n = loadNative()
  return callAsync(() => n.allocPinned(bytes, o))
}

/** {@link allocPinned} on the calling thread: for small buffers and tests. */
export function allocPinnedSync(bytes: number, opts: AllocPinnedOptions = {}): PinnedAllocation {
  checkSize(bytes, 'bytes', MAX_PINNED_BYTES)
  const o = allocOptions(opts)
  const n = loadNative()
  return call(() => n.allocPinnedSync(bytes, o))
}

/**
 * Frees a pinned allocation now. The ArrayBuffer is detached: existing views
 * read as empty and every kvgate call given it again throws ERR_NATIVE.
 * Refuses (ERR_NATIVE) while a copy or file operation still uses it.
 */
export function freePinned(buffer: ArrayBuffer): void {
  if (!(buffer instanceof ArrayBuffer)) throw misuse('freePinned expects the ArrayBuffer from allocPinned')
  if (freedBuffers.has(buffer)) throw misuse('buffer was already freed')
  const n = loadNative()
  call(() => n.freePinned(buffer))
  freedBuffers.add(buffer)
}

/** What kvgate knows about a pinned buffer, or null when it is not one (or was freed). */
export function pinnedInfo(buffer: ArrayBuffer): PinnedInfo | null {
  if (!(buffer instanceof ArrayBuffer)) return null
  return loadNative().pinnedInfo(buffer)
}

/** Live pinned allocations and registrations of this process (leak checks). */
export function nativeMemoryStats(): NativeMemoryStats {
  return loadNative().memoryStats()
}

/**
 * Page-locks a JS-owned buffer for CUDA (cudaHostRegister, portable) — the
 * whole ArrayBuffer behind a view. The buffer is kept alive until
 * {@link unregisterHost}. Needs CUDA (ERR_CUDA otherwise).
 */
export async function registerHost(buffer: HostBuffer): Promise<void> {
  const r = hostRange(buffer, 'buffer')
  if (r.buffer.byteLength === 0) throw misuse('cannot register an empty (or freed) buffer')
  const n = loadNative()
  await callAsync(() => n.registerHost(r.buffer))
}

/** Undoes {@link registerHost}. */
export function unregisterHost(buffer: HostBuffer): void {
  const r = hostRange(buffer, 'buffer')
  const n = loadNative()
  call(() => n.unregisterHost(r.buffer))
}

// ---------------------------------------------------------------------------
// CUDA

export interface CudaStatus {
  /** True when libcudart loaded, every needed symbol resolved and ≥ 1 device answered. */
  available: boolean
  /** Why not, when unavailable (dlopen errors, cudaGetDeviceCount's error…); '' otherwise. */
  reason: string
  /** The libcudart that was loaded ('' when none). */
  library: string
  deviceCount: number
  /** e.g. 13000 for CUDA 13.0; 0 when unknown. */
  runtimeVersion: number
  /** 0 when no driver is installed. */
  driverVersion: number
  /** The loaded library is kvgate's test stub. */
  stub: boolean
  /** cudaIpcGetMemHandle is present. */
  ipcGetHandle: boolean
  /** cudaMemcpy2DAsync is present (else {@link cuda.copy2D} issues one cudaMemcpyAsync per row). */
  memcpy2D: boolean
}

/** A stream handle from {@link cuda.createStream}. */
export type CudaStream = bigint & { readonly __cudaStream: unique symbol }

export interface CopyOptions {
  /** Stream to queue on; default: kvgate's own non-blocking stream of the copy's device. */
  stream?: CudaStream
  /**
   * The GPU the copy runs on (made current on the worker thread; its device pointers must be
   * valid there, e.g. mapped by {@link cuda.ipcOpen} with the same device). Default: the
   * stream's device, else the one chosen by {@link cuda.setDevice}.
   */
  device?: number
}

/** A device ordinal argument: undefined (the setDevice choice) or 0..deviceCount-1. */
function deviceArg(device: number | undefined): number | undefined {
  if (device === undefined) return undefined
  checkSize(device, 'device', 1024, 0)
  return device
}

export interface CopyResult {
  /** Descriptors given (zero-length ones included). */
  descriptors: number
  /** CUDA copy calls made: after merging adjacent descriptors (copyBatch); 2-D and 1-D calls (copy2D). */
  issued: number
  bytes: number
}

/** Direction of a batched copy: host→device, device→host, device→device. */
export type CopyDirection = 'h2d' | 'd2h' | 'd2d'

const DIRECTIONS = { h2d: 1, d2h: 2, d2d: 3 } as const

function streamArg(opts: CopyOptions): bigint {
  if (typeof opts !== 'object' || opts === null) throw misuse('copy options must be an object')
  if (opts.stream === undefined) return 0n
  return checkPtr(opts.stream, 'stream')
}

function cudaBinding(): RawCuda {
  return loadNative().cuda
}

/**
 * CUDA through a libcudart loaded at run time (`KVGATE_CUDART`, else
 * libcudart.so / .so.13 / .so.12 …). Which library is loaded is fixed per
 * process at the first call. Every call needing a GPU throws ERR_CUDA with
 * {@link CudaStatus.reason} when CUDA is unavailable.
 */
export const cuda = {
  /** Probes once (dlopen + cudaGetDeviceCount) and reports; never throws except when the addon is missing. */
  status(): CudaStatus {
    return cudaBinding().probe()
  },
  /** Shorthand for `status().available`. */
  get available(): boolean {
    return cudaBinding().probe().available
  },
  /** Shorthand for `status().reason`. */
  get reason(): string {
    return cudaBinding().probe().reason
  },
  /** Devices the runtime reports (0 when unavailable). */
  deviceCount(): number {
    return cudaBinding().probe().deviceCount
  },
  /** Selects the device every later kvgate CUDA call (on any thread) uses. */
  setDevice(device: number): void {
    checkSize(device, 'device', 1024, 0)
    call(() => cudaBinding().setDevice(device))
  },
  /** The device chosen by {@link cuda.setDevice} (0 by default). */
  getDevice(): number {
    return cudaBinding().getDevice()
  },
  /** cudaMalloc on the current device (synchronous; for tests and copy sinks). */
  deviceAlloc(bytes: number): bigint {
    checkSize(bytes, 'bytes', Number.MAX_SAFE_INTEGER)
    return call(() => cudaBinding().malloc(bytes))
  },
  /** cudaFree (synchronous; waits for the device). */
  deviceFree(ptr: bigint): void {
    checkPtr(ptr, 'device pointer')
    call(() => cudaBinding().free(ptr))
  },
  /** A non-blocking stream of `device` (default: the setDevice choice); destroy it with {@link cuda.destroyStream}. */
  createStream(device?: number): CudaStream {
    const d = deviceArg(device)
    return call(() => cudaBinding().streamCreate(d)) as CudaStream
  },
  /** Refuses (ERR_NATIVE) while copies on the stream are in flight. */
  destroyStream(stream: CudaStream): void {
    checkPtr(stream, 'stream')
    call(() => cudaBinding().streamDestroy(stream))
  },
  /** Copies all of `src` to device memory at `dst`; resolves when the copy completed. */
  async copyToDevice(src: HostBuffer, dst: bigint, opts: CopyOptions = {}): Promise<CopyResult> {
    const r = hostRange(src, 'src')
    checkPtr(dst, 'dst')
    return cuda.copyBatch('h2d', src, new BigInt64Array([0n, dst, BigInt(r.length)]), opts)
  },
  /** Fills all of `dst` from device memory at `src`. */
  async copyFromDevice(src: bigint, dst: HostBuffer, opts: CopyOptions = {}): Promise<CopyResult> {
    const r = hostRange(dst, 'dst')
    checkPtr(src, 'src')
    return cuda.copyBatch('d2h', dst, new BigInt64Array([src, 0n, BigInt(r.length)]), opts)
  },
  async copyDeviceToDevice(
    src: bigint,
    dst: bigint,
    bytes: number,
    opts: CopyOptions = {},
  ): Promise<CopyResult> {
    checkPtr(src, 'src')
    checkPtr(dst, 'dst')
    checkSize(bytes, 'bytes', Number.MAX_SAFE_INTEGER, 0)
    return cuda.copyBatch('d2d', null, new BigInt64Array([src, dst, BigInt(bytes)]), opts)
  },
  /**
   * Many copies, one completion: `descriptors` holds `[src, dst, bytes]`
   * triples. The host side of each triple (src for 'h2d', dst for 'd2h') is a
   * byte offset into `host` (a view's offsets are relative to the view); the
   * device side is a device pointer. Ranges adjacent on both sides are merged.
   * Every host range is bounds-checked before anything is queued (ERR_NATIVE);
   * the descriptors are copied, so the array may be reused at once.
   * Runs on the libuv pool and resolves after a CUDA event recorded behind the
   * copies completes; separate calls are not ordered with respect to each
   * other (even on one stream) until awaited. The host buffer is kept alive
   * and, if pinned, cannot be freed until the promise settles.
   */
  copyBatch(
    direction: CopyDirection,
    host: HostBuffer | null,
    descriptors: BigInt64Array,
    opts: CopyOptions = {},
  ): Promise<CopyResult> {
    return callAsync(async () => {
      const dir = DIRECTIONS[direction as CopyDirection]
      if (dir === undefined) throw misuse(`direction must be 'h2d', 'd2h' or 'd2d', got ${String(direction)}`)
      if (!(descriptors instanceof BigInt64Array)) throw misuse('descriptors must be a BigInt64Array')
      if (descriptors.length % 3 !== 0) throw misuse('descriptors must hold [src, dst, bytes] triples')
      const stream = streamArg(opts)
      const device = deviceArg(opts.device)
      let r: HostRange | null = null
      if (direction === 'd2d') {
        if (host !== null && host !== undefined) throw misuse("a 'd2d' copy takes no host buffer (pass null)")
      } else {
        r = hostRange(host, 'host')
      }
      const c = cudaBinding()
      return c.copy(dir, r?.buffer ?? null, r?.offset ?? 0, r?.length ?? 0, descriptors, stream, device)
    })
  },
  /**
   * Strided copies between `host` and device memory at `base`, one completion: `descriptors`
   * holds `[deviceOffset, hostOffset, width, height, devicePitch, hostPitch]` 6-tuples. Row r
   * (0 ≤ r < height) of a descriptor copies `width` bytes between `base + deviceOffset + r ×
   * devicePitch` and host byte `hostOffset + r × hostPitch` (host offsets are relative to the
   * view given). A descriptor of height 1 is one cudaMemcpyAsync (its pitches are not used); a
   * taller one is one cudaMemcpy2DAsync (pitches ≥ width and < 2^31), or one cudaMemcpyAsync per
   * row when the runtime lacks it ({@link CudaStatus.memcpy2D}). Descriptors are issued in order,
   * the rows of one in no particular order. Every value is checked (non-negative safe integers,
   * every row inside the host range) before anything is queued (ERR_NATIVE); the descriptors are
   * copied, so the array may be reused at once. Completion, streams, devices and the host
   * buffer's lifetime as in {@link cuda.copyBatch}.
   */
  copy2D(
    direction: 'h2d' | 'd2h',
    host: HostBuffer,
    base: bigint,
    descriptors: Float64Array,
    opts: CopyOptions = {},
  ): Promise<CopyResult> {
    return callAsync(async () => {
      if (direction !== 'h2d' && direction !== 'd2h')
        throw misuse(`copy2D direction must be 'h2d' or 'd2h', got ${String(direction)}`)
      checkPtr(base, 'device base')
      if (!(descriptors instanceof Float64Array)) throw misuse('descriptors must be a Float64Array')
      if (descriptors.length % 6 !== 0)
        throw misuse(
          'descriptors must hold [deviceOffset, hostOffset, width, height, devicePitch, hostPitch] 6-tuples',
        )
      const stream = streamArg(opts)
      const device = deviceArg(opts.device)
      const r = hostRange(host, 'host')
      return cudaBinding().copy2D(
        DIRECTIONS[direction],
        r.buffer,
        r.offset,
        r.length,
        base,
        descriptors,
        stream,
        device,
      )
    })
  },
  /**
   * Maps another process's device allocation (cudaIpcOpenMemHandle with
   * lazy peer access) into `device`'s context (default: the setDevice choice)
   * and answers its device pointer in this process. Open it on the GPU that
   * holds it, and copy through it with that `device`.
   */
  ipcOpen(handle: Uint8Array, opts: { lazyPeerAccess?: boolean; device?: number } = {}): Promise<bigint> {
    return callAsync(async () => {
      if (!(handle instanceof Uint8Array) || handle.byteLength !== 64)
        throw misuse('IPC handle must be a 64-byte Uint8Array')
      const device = deviceArg(opts.device)
      return cudaBinding().ipcOpen(handle, opts.lazyPeerAccess === false ? 0 : 1, device)
    })
  },
  /** Unmaps a pointer from {@link cuda.ipcOpen}, on the device it was opened on. */
  ipcClose(ptr: bigint, opts: { device?: number } = {}): Promise<void> {
    return callAsync(async () => {
      checkPtr(ptr, 'device pointer')
      const device = deviceArg(opts.device)
      return cudaBinding().ipcClose(ptr, device)
    })
  },
  /**
   * This process's ordinal of the GPU at PCI bus id `id` ("0000:3b:00.0";
   * cudaDeviceGetByPCIBusId). Processes with different CUDA_VISIBLE_DEVICES
   * number GPUs differently; the bus id names the same GPU in all of them.
   * ERR_CUDA when no visible device has that id.
   */
  deviceByPciBusId(id: string): number {
    if (typeof id !== 'string' || id.length === 0 || id.length > 63)
      throw misuse('PCI bus id must be a string of 1 to 63 characters')
    return call(() => cudaBinding().deviceByPciBusId(id))
  },
  /** The PCI bus id of `device` (default: the setDevice choice), as cudaDeviceGetPCIBusId spells it. */
  pciBusId(device?: number): string {
    const d = deviceArg(device)
    return call(() => cudaBinding().pciBusId(d))
  },
  /** The 64-byte IPC handle of a device allocation (cudaIpcGetMemHandle), for another process. */
  ipcGetHandle(ptr: bigint): Uint8Array {
    checkPtr(ptr, 'device pointer')
    return call(() => cudaBinding().ipcGetHandle(ptr))
  },
  /**
   * Test stub only (native/test-stub): injects failures/delays
   * (`'cudaMemcpyAsync=2@1*1'`, `'delay_us=50000'`, `'reset'`), and answers
   * the stub's live allocations + registrations + open IPC mappings.
   * Throws ERR_NATIVE when the loaded libcudart is not the stub.
   */
  stubControl(spec = ''): number {
    if (typeof spec !== 'string') throw misuse('spec must be a string')
    return call(() => cudaBinding().stubControl(spec))
  },
}

// ---------------------------------------------------------------------------
// Files

/** `'auto'`: O_DIRECT when aligned and accepted, else buffered; `'require'`: O_DIRECT or an error; `'off'`: buffered. */
export type DirectMode = 'auto' | 'require' | 'off'

const MODES = { off: 0, auto: 1, require: 2 } as const

export interface FileIoResult {
  bytes: number
  /** Whether O_DIRECT was used. */
  direct: boolean
  /** Why buffered I/O was used ('' when direct). */
  reason: string
}

export interface ReadFileOptions {
  /** Byte offset in the file. O_DIRECT needs a multiple of {@link DIRECT_ALIGNMENT}. @default 0 */
  fileOffset?: number
  /** Bytes to read; default: to the end of the file (regular files only). Must fit `into`. */
  length?: number
  /** @default 'auto' */
  direct?: DirectMode
}

export interface WriteFileOptions {
  /** @default 0 */
  fileOffset?: number
  /** @default 'auto' */
  direct?: DirectMode
  /** fsync before resolving (durable once resolved). @default false */
  fsync?: boolean
  /** Truncate the file first. @default true when fileOffset is 0, else false */
  truncate?: boolean
}

function directMode(m: unknown): 0 | 1 | 2 {
  const v = MODES[(m ?? 'auto') as DirectMode]
  if (v === undefined) throw misuse(`direct must be 'auto', 'require' or 'off', got ${String(m)}`)
  return v
}

function checkPath(path: unknown): string {
  if (typeof path !== 'string' || path.length === 0 || path.includes('\0')) {
    throw misuse('path must be a non-empty string without NUL')
  }
  return path
}

function checkDirectOffset(mode: 0 | 1 | 2, fileOffset: number): void {
  if (mode === 2 && fileOffset % DIRECT_ALIGNMENT !== 0) {
    throw misuse(
      `misaligned O_DIRECT request: file offset ${fileOffset} is not a multiple of ${DIRECT_ALIGNMENT}`,
    )
  }
}

/**
 * Reads a file (or a range) into `into` off the JS thread. With O_DIRECT the
 * buffer address and file offset must be 4096-aligned (allocPinned memory
 * is); the length need not be. Resolves with the bytes read (short at EOF).
 */
export function readFileDirect(
  path: string,
  into: HostBuffer,
  opts: ReadFileOptions = {},
): Promise<FileIoResult> {
  return callAsync(async () => {
    const { r, mode, fileOffset, length } = readArgs(path, into, opts)
    return loadNative().readFile(path, r.buffer, r.offset, r.length, fileOffset, length, mode)
  })
}

/** The checked arguments every file read shares (readFileDirect, readFileCrc). */
function readArgs(path: string, into: HostBuffer, opts: ReadFileOptions) {
  checkPath(path)
  const r = hostRange(into, 'into')
  const mode = directMode(opts.direct)
  const fileOffset = checkSize(opts.fileOffset ?? 0, 'fileOffset', Number.MAX_SAFE_INTEGER, 0)
  const length = opts.length === undefined ? -1 : checkSize(opts.length, 'length', r.length, 0)
  checkDirectOffset(mode, fileOffset)
  return { r, mode, fileOffset, length }
}

export interface ReadFileCrcResult extends FileIoResult {
  /** CRC-32 (zlib's, as core/checksum.ts crc32) of each requested range, in order. */
  crcs: Uint32Array
  /** Per range: 1 when it was verified and copied to `copyTo.into` on the worker. */
  copied: Uint8Array
}

/**
 * Closes a window in which readFileCrc may copy into a caller's buffer: once
 * close() returns, no copy is running or will start (a read that lands later
 * copies nothing). close() waits for at most the copy in progress.
 */
export class CopyGate {
  readonly handle: unknown
  #closed = false

  constructor() {
    this.handle = loadNative().newCopyGate()
  }

  get closed(): boolean {
    return this.#closed
  }

  close(): void {
    if (this.#closed) return
    this.#closed = true
    loadNative().closeCopyGate(this.handle)
  }
}

export interface CopyTo {
  /** Where verified bytes go: into[0] holds the file's byte `fileOffset`. */
  into: HostBuffer
  fileOffset: number
  /** Per range: the CRC-32 it must have to be copied, or undefined (never copied). */
  expected: readonly (number | undefined)[]
  gate: CopyGate
}

/**
 * Copies all of `src` into the start of `dst` on a libuv worker (memmove), so a
 * large host copy does not hold the JS thread. Both stay referenced until it settles;
 * do not detach or free either meanwhile (a pinned one refuses freePinned while busy).
 */
export function copyHost(dst: HostBuffer, src: HostBuffer): Promise<void> {
  return callAsync(async () => {
    const d = hostRange(dst, 'dst')
    const s = hostRange(src, 'src')
    if (s.length > d.length) throw misuse(`src (${s.length} bytes) does not fit dst (${d.length} bytes)`)
    return loadNative().copyHost(d.buffer, d.offset, s.buffer, s.offset, s.length)
  })
}

/**
 * Copies at least this large go to the addon's pool (copyViews) where a caller may move them
 * off its thread: below it a round trip to the pool costs more than the copy it moves.
 */
export const COPY_VIEWS_MIN_BYTES = 2 * 1024 * 1024

let copyViewsLoaded: boolean | undefined
/** True when the loaded addon has {@link copyViews} (checked once); never throws. */
export function copyViewsReady(): boolean {
  if (copyViewsLoaded === undefined) {
    try {
      copyViewsLoaded = typeof loadNative().copyViews === 'function'
    } catch {
      copyViewsLoaded = false
    }
  }
  return copyViewsLoaded
}

/**
 * Copies all of `src` into the start of `dst` on a libuv worker with streaming stores. Unlike
 * copyHost, either may lie in a SharedArrayBuffer (a codec worker's staging). Both stay
 * referenced until it settles; the caller must not write `src` (nor read `dst`) meanwhile.
 */
export function copyViews(dst: Uint8Array, src: Uint8Array): Promise<void> {
  return callAsync(async () => {
    if (!(dst instanceof Uint8Array) || !(src instanceof Uint8Array))
      throw misuse('copyViews takes two Uint8Arrays')
    if (src.byteLength > dst.byteLength)
      throw misuse(`src (${src.byteLength} bytes) does not fit dst (${dst.byteLength} bytes)`)
    for (const [v, what] of [
      [dst, 'dst'],
      [src, 'src'],
    ] as const) {
      if (v.buffer instanceof ArrayBuffer && freedBuffers.has(v.buffer))
        throw misuse(`${what} was freed with freePinned and cannot be used again`)
      if (v.buffer instanceof ArrayBuffer && unmappedBuffers.has(v.buffer))
        throw misuse(`${what} was unmapped with unmapFile and cannot be used again`)
    }
    return loadNative().copyViews(dst, src)
  })
}

/**
 * readFileDirect, and the libuv worker that read the bytes also computes the CRC-32
 * of each `[start, end)` range (offsets into `into`, i.e. relative to fileOffset), so
 * verification runs beside the I/O on the pool instead of on the JS thread. A range
 * past a short read is cut at `bytes`: check `bytes` before trusting its CRC.
 */
export function readFileCrc(
  path: string,
  into: HostBuffer,
  ranges: readonly (readonly [number, number])[],
  opts: ReadFileOptions & { copyTo?: CopyTo } = {},
): Promise<ReadFileCrcResult> {
  return callAsync(async () => {
    const { r, mode, fileOffset, length } = readArgs(path, into, opts)
    if (!Array.isArray(ranges)) throw misuse('ranges must be an array of [start, end) pairs')
    const flat = new Float64Array(ranges.length * 2)
    ranges.forEach((pair, i) => {
      if (!Array.isArray(pair) || pair.length !== 2) throw misuse(`range ${i} must be a [start, end) pair`)
      const start = checkSize(pair[0], `ranges[${i}][0]`, r.length, 0)
      const end = checkSize(pair[1], `ranges[${i}][1]`, r.length, start)
      flat[2 * i] = start
      flat[2 * i + 1] = end
    })
    const c = opts.copyTo
    if (c === undefined)
      return loadNative().readFileCrc(path, r.buffer, r.offset, r.length, fileOffset, length, mode, flat)
    const d = hostRange(c.into, 'copyTo.into')
    const dstFileOffset = checkSize(c.fileOffset, 'copyTo.fileOffset', Number.MAX_SAFE_INTEGER, 0)
    if (!Array.isArray(c.expected) || c.expected.length !== ranges.length)
      throw misuse('copyTo.expected must hold one entry per range')
    if (!(c.gate instanceof CopyGate)) throw misuse('copyTo.gate must be a CopyGate')
    const expected = Float64Array.from(c.expected, (e, i) =>
      e === undefined ? -1 : checkSize(e, `copyTo.expected[${i}]`, 0xffffffff, 0),
    )
    return loadNative().readFileCrc(
      path,
      r.buffer,
      r.offset,
      r.length,
      fileOffset,
      length,
      mode,
      flat,
      d.buffer,
      d.offset,
      d.length,
      dstFileOffset,
      expected,
      c.gate.handle,
    )
  })
}

/** Writes all of `from` to a file off the JS thread; O_DIRECT for the aligned body, the tail buffered. */
export function writeFileDirect(
  path: string,
  from: HostBuffer,
  opts: WriteFileOptions = {},
): Promise<FileIoResult> {
  return callAsync(async () => {
    checkPath(path)
    const r = hostRange(from, 'from')
    const mode = directMode(opts.direct)
    const fileOffset = checkSize(opts.fileOffset ?? 0, 'fileOffset', Number.MAX_SAFE_INTEGER, 0)
    checkDirectOffset(mode, fileOffset)
    const truncate = opts.truncate ?? fileOffset === 0
    return loadNative().writeFile(
      path,
      r.buffer,
      r.offset,
      r.length,
      fileOffset,
      mode,
      opts.fsync === true,
      truncate,
    )
  })
}

/**
 * Writes back a file's dirty pages and drops its page-cache pages
 * (fdatasync + POSIX_FADV_DONTNEED): the next buffered read comes from the
 * device, and a freshly written L2 file stops occupying RAM. Unprivileged,
 * unlike `echo 3 > /proc/sys/vm/drop_caches`.
 */
export function evictFileCache(path: string): Promise<void> {
  return callAsync(async () => loadNative().evictFileCache(checkPath(path)))
}

/**
 * Whether the peer of the connected socket `fd` shut down its side: the kernel knows the
 * moment the peer closes (POLLRDHUP), ahead of unread data, where a socket's 'close' event
 * reaches JS turns later. undefined when the addon is not loaded or the check failed;
 * never throws.
 */
export function socketPeerClosed(fd: number): boolean | undefined {
  try {
    const n = loadNative()
    return n.peerClosed ? n.peerClosed(fd) : undefined
  } catch {
    return undefined
  }
}

// ---------------------------------------------------------------------------
// File mappings

export interface MapFileOptions {
  /** Byte offset in the file (any value; the mapping is page-aligned underneath). @default 0 */
  offset?: number
  /** Bytes to map; default: to the end of the file. At most {@link MAX_PINNED_BYTES}. */
  length?: number
  /**
   * `true`: MAP_SHARED read-write, stores reach the file (and every process mapping it).
   * `false`: a private copy-on-write view; stores stay in this process.
   * @default false
   */
  writable?: boolean
}

export interface FileMapStats {
  /** Live mappings (not yet unmapped or collected). */
  mappings: number
  mappedBytes: number
}

// Buffers given to unmapFile: later use gets a clear message (they are detached).
const unmappedBuffers = new WeakSet<ArrayBuffer>()

function mapBinding(): Required<Pick<NativeBinding, 'mapFile' | 'unmapFile' | 'mapStats'>> {
  const n = loadNative()
  if (!n.mapFile || !n.unmapFile || !n.mapStats) {
    throw misuse(`this build of the native addon predates mapFile; rebuild it: ${nativePaths.buildCommand}`)
  }
  return n as Required<NativeBinding>
}

/** True when the loaded addon has {@link copyRuns}; never throws. */
export function copyRunsAvailable(): boolean {
  try {
    return typeof loadNative().copyRuns === 'function'
  } catch {
    return false
  }
}

/**
 * Copies scattered runs from `src` into `dst` on this thread, in one call: `runs` holds
 * [dstOffset, srcOffset, bytes] triples (byte offsets into the views). Runs of 4 KiB and
 * more use non-temporal stores (they bypass the cache: for copies much larger than it
 * that are not read back soon, as a chunk's blocks between engine memory and L1, that
 * saves the read-for-ownership of every destination line). Every run is checked against
 * both views before any byte moves.
 * @throws NativeError ERR_NATIVE for a run outside either view or a malformed `runs`.
 */
export function copyRuns(dst: HostBuffer, src: HostBuffer, runs: Float64Array): void {
  const n = loadNative()
  if (!n.copyRuns) {
    throw misuse(`this build of the native addon predates copyRuns; rebuild it: ${nativePaths.buildCommand}`)
  }
  if (!(runs instanceof Float64Array)) throw misuse('runs must be a Float64Array')
  call(() => n.copyRuns!(dst, src, runs))
}

/** True when the loaded addon has {@link copyRunsAsync}; never throws. */
export function copyRunsAsyncAvailable(): boolean {
  try {
    return typeof loadNative().copyRunsAsync === 'function'
  } catch {
    return false
  }
}

/**
 * {@link copyRuns} off the JS thread and across threads: `runs` holds
 * [dstBuffer, dstOffset, srcBuffer, srcOffset, bytes] quintuples (indexes into `buffers`,
 * byte offsets into those views). Every run is checked before any byte moves; the bytes
 * are then cut into grains of about 256 KiB that up to `parts` libuv pool threads share
 * (each takes the next grain left); the promise settles once every grain was copied.
 * Until the promise settles the buffers stay referenced, a pinned one cannot be freed and
 * a file mapping's munmap waits; the caller must not read the destinations or change the
 * sources meanwhile. Runs must not overlap one another (they run in any order).
 * @throws NativeError ERR_NATIVE (synchronously) for a run outside a buffer or malformed arguments.
 */
export function copyRunsAsync(buffers: HostBuffer[], runs: Float64Array, parts: number): Promise<void> {
  const n = loadNative()
  if (!n.copyRunsAsync) {
    throw misuse(
      `this build of the native addon predates copyRunsAsync; rebuild it: ${nativePaths.buildCommand}`,
    )
  }
  if (!(runs instanceof Float64Array)) throw misuse('runs must be a Float64Array')
  if (!Number.isInteger(parts) || parts < 1 || parts > 64) throw misuse('parts must be an integer in [1, 64]')
  return call(() => n.copyRunsAsync!(buffers, runs, parts)).catch((e) => {
    throw translate(e)
  })
}

/**
 * True when the loaded addon has {@link copyRows}, {@link copyRowsAsync}, {@link copyPlanes} and
 * {@link copyPlanesAsync}; never throws.
 */
export function copyRowsAvailable(): boolean {
  try {
    const n = loadNative()
    return (
      typeof n.copyRows === 'function' &&
      typeof n.copyRowsAsync === 'function' &&
      typeof n.copyPlanes === 'function' &&
      typeof n.copyPlanesAsync === 'function'
    )
  } catch {
    return false
  }
}

/**
 * {@link copyRuns} with 2-D row sets: `rows` holds [dstOffset, srcOffset, width, height,
 * dstPitch, srcPitch] sextuples; row r of a set copies `width` bytes from
 * `srcOffset + r * srcPitch` to `dstOffset + r * dstPitch`. A strided view's many small runs
 * (one per token and head) are a few sets, copied without a per-run crossing or check.
 * Every set is checked before any byte moves: each row inside its view, the destination's
 * rows apart (dstPitch ≥ width when height > 1), the set's source and destination ranges
 * disjoint.
 * @throws NativeError ERR_NATIVE for a set that fails those checks or a malformed `rows`.
 */
export function copyRows(dst: HostBuffer, src: HostBuffer, rows: Float64Array): void {
  const n = loadNative()
  if (!n.copyRows) {
    throw misuse(`this build of the native addon predates copyRows; rebuild it: ${nativePaths.buildCommand}`)
  }
  if (!(rows instanceof Float64Array)) throw misuse('rows must be a Float64Array')
  call(() => n.copyRows!(dst, src, rows))
}

/**
 * {@link copyRunsAsync} with {@link copyRows}' row sets: `rows` holds [dstBuffer, dstOffset,
 * srcBuffer, srcOffset, width, height, dstPitch, srcPitch] octuples. Checked as copyRows
 * checks them before any byte moves; the sets are cut between rows into the same grains.
 * @throws NativeError ERR_NATIVE (synchronously) for a bad set or malformed arguments.
 */
export function copyRowsAsync(buffers: HostBuffer[], rows: Float64Array, parts: number): Promise<void> {
  const n = loadNative()
  if (!n.copyRowsAsync) {
    throw misuse(
      `this build of the native addon predates copyRowsAsync; rebuild it: ${nativePaths.buildCommand}`,
    )
  }
  if (!(rows instanceof Float64Array)) throw misuse('rows must be a Float64Array')
  if (!Number.isInteger(parts) || parts < 1 || parts > 64) throw misuse('parts must be an integer in [1, 64]')
  return call(() => n.copyRowsAsync!(buffers, rows, parts)).catch((e) => {
    throw translate(e)
  })
}

/**
 * {@link copyRows} with 3-D row sets: `sets` holds [dstOffset, srcOffset, width, height,
 * dstPitch, srcPitch, planes, dstPlanePitch, srcPlanePitch] nonuples; plane q of a set is its
 * row set at `dstOffset + q * dstPlanePitch` and `srcOffset + q * srcPlanePitch`. An HND view's
 * block side (each head's tokens in the engine, each token's heads in the chunk) is one set.
 * Checked as copyRows checks its sets before any byte moves; the destination's rows must not
 * touch: rows apart in a plane, and the planes one after another or each between two rows.
 * @throws NativeError ERR_NATIVE for a set that fails those checks or a malformed `sets`.
 */
export function copyPlanes(dst: HostBuffer, src: HostBuffer, sets: Float64Array): void {
  const n = loadNative()
  if (!n.copyPlanes) {
    throw misuse(
      `this build of the native addon predates copyPlanes; rebuild it: ${nativePaths.buildCommand}`,
    )
  }
  if (!(sets instanceof Float64Array)) throw misuse('sets must be a Float64Array')
  call(() => n.copyPlanes!(dst, src, sets))
}

/**
 * {@link copyRowsAsync} with {@link copyPlanes}' 3-D sets: `sets` holds [dstBuffer, dstOffset,
 * srcBuffer, srcOffset, width, height, dstPitch, srcPitch, planes, dstPlanePitch, srcPlanePitch]
 * 11-tuples, checked before any byte moves and cut between planes into the same grains.
 * @throws NativeError ERR_NATIVE (synchronously) for a bad set or malformed arguments.
 */
export function copyPlanesAsync(buffers: HostBuffer[], sets: Float64Array, parts: number): Promise<void> {
  const n = loadNative()
  if (!n.copyPlanesAsync) {
    throw misuse(
      `this build of the native addon predates copyPlanesAsync; rebuild it: ${nativePaths.buildCommand}`,
    )
  }
  if (!(sets instanceof Float64Array)) throw misuse('sets must be a Float64Array')
  if (!Number.isInteger(parts) || parts < 1 || parts > 64) throw misuse('parts must be an integer in [1, 64]')
  return call(() => n.copyPlanesAsync!(buffers, sets, parts)).catch((e) => {
    throw translate(e)
  })
}

/**
 * The sha256-v1 chain keys of `chunks` full chunks of `tokens`, chained from `parent`, in one
 * call (32 bytes per key, in order), or undefined when the addon is absent or predates it: the
 * caller then hashes in JS. Same bytes as chainKeys (docs/keys.md); one JS → OpenSSL call per
 * key is what made a 512-chunk chain cost milliseconds.
 */
export function sha256V1Chain(
  parent: Uint8Array,
  tokens: Uint32Array,
  chunkTokens: number,
  chunks: number,
): Uint8Array | undefined {
  let n: NativeBinding
  try {
    n = loadNative()
  } catch {
    return undefined
  }
  if (typeof n.sha256V1Chain !== 'function') return undefined
  if (!(parent instanceof Uint8Array) || parent.length !== 32) throw misuse('parent must be a 32-byte key')
  if (!(tokens instanceof Uint32Array)) throw misuse('tokens must be a Uint32Array')
  if (!Number.isInteger(chunkTokens) || chunkTokens < 1 || chunkTokens > 1 << 20)
    throw misuse('chunkTokens must be an integer in 1..2^20')
  if (!Number.isInteger(chunks) || chunks < 0 || chunks * chunkTokens > tokens.length)
    throw misuse('chunks × chunkTokens must fit in tokens')
  const out = new Uint8Array(32 * chunks)
  call(() => n.sha256V1Chain!(parent, tokens, chunkTokens, chunks, out))
  return out
}

/** True when the loaded addon has {@link mapFile}; never throws. */
export function mapFileAvailable(): boolean {
  try {
    mapBinding()
    return true
  } catch {
    return false
  }
}

/**
 * Maps `[offset, offset + length)` of a regular file as an ArrayBuffer. Unmapped by
 * {@link unmapFile} or, failing that, when the buffer is garbage collected. Truncating
 * the file under a live mapping makes access to the lost pages fault (SIGBUS): map only
 * files whose size their owner keeps. {@link copyRuns} and {@link copyRunsAsync} survive it
 * (the copy fails with ERR_NATIVE, syscode EFAULT); any other access (a typed array over the
 * mapping) still kills the process.
 * @throws NativeError ERR_NATIVE for bad arguments, a range past the end, or a failed open/mmap.
 */
export function mapFile(path: string, opts: MapFileOptions = {}): ArrayBuffer {
  checkPath(path)
  if (typeof opts !== 'object' || opts === null) throw misuse('mapFile options must be an object')
  for (const k of Object.keys(opts)) {
    if (k !== 'offset' && k !== 'length' && k !== 'writable') throw misuse(`unknown mapFile option '${k}'`)
  }
  if (opts.writable !== undefined && typeof opts.writable !== 'boolean')
    throw misuse('writable must be a boolean')
  const offset = checkSize(opts.offset ?? 0, 'offset', Number.MAX_SAFE_INTEGER, 0)
  let size: number
  try {
    const st = statSync(path)
    if (!st.isFile()) throw misuse(`${path} is not a regular file`)
    size = st.size
  } catch (e) {
    if (e instanceof NativeError) throw e
    const err = e as NodeJS.ErrnoException
    throw new NativeError('ERR_NATIVE', `mapFile(${path}): ${err.message}`, {
      cause: e,
      syscode: err.code,
      syscall: 'stat',
    })
  }
  if (offset >= size) throw misuse(`offset ${offset} is not inside ${path} (${size} bytes)`)
  const length =
    opts.length === undefined
      ? Math.min(size - offset, MAX_PINNED_BYTES)
      : checkSize(opts.length, 'length', Math.min(size - offset, MAX_PINNED_BYTES))
  const n = mapBinding()
  return call(() => n.mapFile(path, offset, length, opts.writable === true))
}

/**
 * Unmaps a {@link mapFile} buffer now. The ArrayBuffer is detached: views read as
 * empty and every kvgate call given it again throws ERR_NATIVE. The caller must not
 * have an asynchronous kvgate operation on it in flight.
 */
export function unmapFile(buffer: ArrayBuffer): void {
  if (!(buffer instanceof ArrayBuffer)) throw misuse('unmapFile expects the ArrayBuffer from mapFile')
  if (unmappedBuffers.has(buffer)) throw misuse('mapping was already unmapped')
  const n = mapBinding()
  call(() => n.unmapFile(buffer))
  unmappedBuffers.add(buffer)
}

/** Live file mappings of this process (leak checks). */
export function fileMapStats(): FileMapStats {
  return mapBinding().mapStats()
}
