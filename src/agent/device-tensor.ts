// An engine's KV tensor in GPU memory, reached through a CUDA IPC handle the engine
// exported: one cudaIpcOpenMemHandle per allocation, batched async copies per layer.
// Everything runs on the engine's own GPU: the mapping is opened in that device's
// context, copies go on kvgate's stream of that device (so ranks on different GPUs copy
// side by side), and the mapping is closed there. On a node with 8 GPUs, mapping every
// rank into device 0 would route all traffic through GPU 0 and its context.
// A layer's runs go as strided copies (strided-copies.ts): vLLM's packed K/V layouts cut a block
// into head-sized runs a fixed pitch apart, a few 2-D copies instead of thousands of memcpys.

import type { NativeModule } from '../client/native-api.ts'
import { rowsOf } from './copy-rows.ts'
import type { KvTensor } from './host-tensor.ts'
import { AgentError } from './protocol.ts'
import { stridedCopies } from './strided-copies.ts'

/** Where a cuda-ipc tensor lives, as the engine named it in `register`. */
export interface EngineDevice {
  /** The engine's CUDA ordinal (its own CUDA_VISIBLE_DEVICES numbering). */
  device?: unknown
  /** The GPU's PCI bus id ("0000:3b:00.0"): the same GPU whatever each process's CUDA_VISIBLE_DEVICES. */
  pciBusId?: unknown
}

// What cudaDeviceGetByPCIBusId documents: [domain:]bus:device[.function], hexadecimal.
const PCI_BUS_ID = /^(?:[0-9a-f]{1,8}:)?[0-9a-f]{1,2}:[0-9a-f]{1,2}(?:\.[0-9a-f])?$/i

/**
 * The agent's ordinal of the engine's GPU: `pciBusId` when given (resolved here, as the
 * engine's and the agent's CUDA_VISIBLE_DEVICES may differ), else `device`, else 0.
 * Malformed → ERR_INVALID_ARGUMENT; a GPU this agent cannot see → ERR_CUDA (nothing mapped).
 */
export function resolveDevice(native: NativeModule, t: EngineDevice, what: string): number {
  const count = native.cuda.deviceCount()
  if (t.pciBusId !== undefined) {
    if (typeof t.pciBusId !== 'string' || !PCI_BUS_ID.test(t.pciBusId))
      throw new AgentError(
        'ERR_INVALID_ARGUMENT',
        `${what}.pciBusId must be a PCI bus id like "0000:3b:00.0", got ${JSON.stringify(t.pciBusId)}`,
      )
  }
  if (
    t.device !== undefined &&
    (typeof t.device !== 'number' || !Number.isSafeInteger(t.device) || t.device < 0)
  )
    throw new AgentError(
      'ERR_INVALID_ARGUMENT',
      `${what}.device must be an integer >= 0, got ${JSON.stringify(t.device)}`,
    )
  if (typeof t.pciBusId === 'string') {
    try {
      return native.cuda.deviceByPciBusId(t.pciBusId)
    } catch (e) {
      throw new AgentError(
        'ERR_CUDA',
        `${what}: the agent sees no GPU with PCI bus id ${t.pciBusId} among its ${count} device(s) ` +
          `(is the agent's CUDA_VISIBLE_DEVICES hiding it?): ${(e as Error).message}`,
      )
    }
  }
  const device = (t.device as number | undefined) ?? 0
  if (device >= count)
    throw new AgentError(
      'ERR_CUDA',
      `${what}.device ${device} is not a GPU this agent can use (it sees ${count} device(s)); ` +
        'when the engine and the agent have different CUDA_VISIBLE_DEVICES, send pciBusId',
    )
  return device
}

/** IPC mappings of one registration on one GPU: layers often share one allocation, which CUDA maps once per process. */
export class IpcMappings {
  readonly #native: NativeModule
  readonly device: number
  readonly #open = new Map<string, Promise<bigint>>()

  constructor(native: NativeModule, device: number) {
    this.#native = native
    this.device = device
  }

  map(handle: Uint8Array): Promise<bigint> {
    const id = Buffer.from(handle.buffer, handle.byteOffset, handle.byteLength).toString('hex')
    let p = this.#open.get(id)
    if (!p) {
      p = this.#native.cuda.ipcOpen(handle, { device: this.device }).catch((e: Error) => {
        this.#open.delete(id)
        throw new AgentError(
          'ERR_CUDA',
          `cannot open the engine's CUDA IPC handle on device ${this.device}: ${e.message}`,
        )
      })
      this.#open.set(id, p)
    }
    return p
  }

  /** Unmaps every allocation, on the device it was opened on (after the last copy of this registration). */
  async close(): Promise<void> {
    const all = [...this.#open.values()]
    this.#open.clear()
    await Promise.all(
      all.map(async (p) => {
        try {
          await this.#native.cuda.ipcClose(await p, { device: this.device })
        } catch {}
      }),
    )
  }
}

export class DeviceTensor implements KvTensor {
  readonly #native: NativeModule
  readonly #ptr: bigint
  readonly device: number
  readonly bytes: number

  constructor(native: NativeModule, device: number, base: bigint, offset: number, bytes: number) {
    this.#native = native
    this.device = device
    this.#ptr = base + BigInt(offset)
    this.bytes = bytes
  }

  async gather(runs: ArrayLike<number>, host: Uint8Array): Promise<void> {
    this.#inside(runs)
    await this.#native.cuda.copy2D('d2h', host, this.#ptr, stridedCopies(runs), { device: this.device })
  }

  async scatter(host: Uint8Array, runs: ArrayLike<number>): Promise<void> {
    this.#inside(runs)
    await this.#native.cuda.copy2D('h2d', host, this.#ptr, stridedCopies(runs), { device: this.device })
  }

  /**
   * The addon checks the host side of every copy but cannot know where the tensor ends on the
   * GPU: a run past its registered bytes would read or write the engine's other GPU memory. O(1)
   * per layer (a chunk's row sets are made once); malformed runs are left to the addon to refuse.
   */
  #inside(runs: ArrayLike<number>): void {
    const sets = rowsOf(runs)
    if (sets.valid && sets.tensorEnd > this.bytes)
      throw new AgentError(
        'ERR_INVALID_ARGUMENT',
        `a copy run reaches byte ${sets.tensorEnd} of a GPU tensor of ${this.bytes} bytes`,
      )
  }
}
