// An engine's KV tensor in GPU memory, reached through a CUDA IPC handle the engine
// exported: one cudaIpcOpenMemHandle per allocation, batched async copies per layer.

import type { NativeModule } from '../client/native-api.ts'
import type { KvTensor } from './host-tensor.ts'
import { AgentError } from './protocol.ts'

/** IPC mappings of one registration: layers often share one allocation, which CUDA maps once per process. */
export class IpcMappings {
  readonly #native: NativeModule
  readonly #open = new Map<string, Promise<bigint>>()

  constructor(native: NativeModule) {
    this.#native = native
  }

  map(handle: Uint8Array): Promise<bigint> {
    const id = Buffer.from(handle.buffer, handle.byteOffset, handle.byteLength).toString('hex')
    let p = this.#open.get(id)
    if (!p) {
      p = this.#native.cuda.ipcOpen(handle).catch((e: Error) => {
        this.#open.delete(id)
        throw new AgentError('ERR_CUDA', `cannot open the engine's CUDA IPC handle: ${e.message}`)
      })
      this.#open.set(id, p)
    }
    return p
  }

  /** Unmaps every allocation (after the last copy of this registration). */
  async close(): Promise<void> {
    const all = [...this.#open.values()]
    this.#open.clear()
    await Promise.all(
      all.map(async (p) => {
        try {
          await this.#native.cuda.ipcClose(await p)
        } catch {}
      }),
    )
  }
}

export class DeviceTensor implements KvTensor {
  readonly #native: NativeModule
  readonly #ptr: bigint
  readonly bytes: number

  constructor(native: NativeModule, base: bigint, offset: number, bytes: number) {
    this.#native = native
    this.#ptr = base + BigInt(offset)
    this.bytes = bytes
  }

  async gather(runs: ArrayLike<number>, host: Uint8Array): Promise<void> {
    const d = new BigInt64Array(runs.length)
    for (let i = 0; i < runs.length; i += 3) {
      d[i] = this.#ptr + BigInt(runs[i]!)
      d[i + 1] = BigInt(runs[i + 1]!)
      d[i + 2] = BigInt(runs[i + 2]!)
    }
    await this.#native.cuda.copyBatch('d2h', host, d)
  }

  async scatter(host: Uint8Array, runs: ArrayLike<number>): Promise<void> {
    const d = new BigInt64Array(runs.length)
    for (let i = 0; i < runs.length; i += 3) {
      d[i] = BigInt(runs[i + 1]!)
      d[i + 1] = this.#ptr + BigInt(runs[i]!)
      d[i + 2] = BigInt(runs[i + 2]!)
    }
    await this.#native.cuda.copyBatch('h2d', host, d)
  }
}
