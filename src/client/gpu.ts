// GPU sources and sinks: where a chunk's K/V lives in device memory (one
// contiguous buffer, or a paged block table like vLLM's), turned into batched copies.

import { InvalidArgumentError, KvgateError } from '../core/errors.ts'
import { dtypeBytes, type KvGeometry, kvPlanes, kvRange, rowElements } from '../core/layout.ts'
import { nativePaths } from './native.ts'
import type { NativeModule } from './native-api.ts'

/** Device memory holding chunk tensors back to back, in the host `kv` layout. */
export interface GpuContiguous {
  kind: 'device'
  /** Device address of chunk 0's tensor. */
  pointer: bigint
}

/**
 * A paged KV cache: for every layer, for K and V, the device address of each
 * block in token order (the block table already applied). A block holds
 * `blockTokens` rows of kvHeads × headDim elements.
 */
export interface GpuPaged {
  kind: 'paged'
  blockTokens: number
  /** blocks[layer][0 = K, 1 = V][block index in the sequence] = device address ([layer][0] alone for a latent geometry). */
  blocks: readonly (readonly (readonly bigint[])[])[]
}

export type GpuBuffer = GpuContiguous | GpuPaged

/** One copy: `bytes` between device address `device` and offset `host` of a chunk tensor. */
export interface CopyDescriptor {
  device: bigint
  host: number
  bytes: number
}

export function isGpuBuffer(x: unknown): x is GpuBuffer {
  if (typeof x !== 'object' || x === null || ArrayBuffer.isView(x)) return false
  const k = (x as { kind?: unknown }).kind
  return k === 'device' || k === 'paged'
}

/** Throws InvalidArgumentError unless `b` can hold `chunks` chunks of this geometry. */
export function validateGpuBuffer(b: GpuBuffer, g: KvGeometry, chunkTokens: number, chunks: number): void {
  if (b.kind === 'device') {
    if (typeof b.pointer !== 'bigint' || b.pointer <= 0n) {
      throw new InvalidArgumentError('invalid GPU buffer: pointer must be a positive bigint device address')
    }
    return
  }
  if (!Number.isInteger(b.blockTokens) || b.blockTokens < 1)
    throw new InvalidArgumentError('invalid GPU buffer: blockTokens')
  if (!Array.isArray(b.blocks) || b.blocks.length !== g.layers) {
    throw new InvalidArgumentError(`invalid GPU buffer: blocks must have one entry per layer (${g.layers})`)
  }
  const need = Math.ceil((chunks * chunkTokens) / b.blockTokens)
  for (let l = 0; l < g.layers; l++) {
    const kv = b.blocks[l]
    if (!Array.isArray(kv) || kv.length !== kvPlanes(g))
      throw new InvalidArgumentError(
        `invalid GPU buffer: blocks[${l}] needs ${g.latent === true ? '[latent]' : '[K, V]'}`,
      )
    for (const side of kv) {
      if (!Array.isArray(side) || side.length < need) {
        throw new InvalidArgumentError(
          `invalid GPU buffer: blocks[${l}] needs ${need} block addresses per K/V`,
        )
      }
      for (let i = 0; i < need; i++) {
        if (typeof side[i] !== 'bigint' || (side[i] as bigint) <= 0n) {
          throw new InvalidArgumentError(
            `invalid GPU buffer: blocks[${l}] address ${i} is not a positive bigint`,
          )
        }
      }
    }
  }
}

/** The copies that move chunk `index` between `b` and one chunk tensor; adjacent ranges merged. */
export function chunkDescriptors(
  b: GpuBuffer,
  g: KvGeometry,
  chunkTokens: number,
  index: number,
): CopyDescriptor[] {
  const row = rowElements(g) * dtypeBytes(g.dtype)
  const tensorBytes = kvPlanes(g) * g.layers * chunkTokens * row
  if (b.kind === 'device')
    return [{ device: b.pointer + BigInt(index * tensorBytes), host: 0, bytes: tensorBytes }]
  const out: CopyDescriptor[] = []
  const first = index * chunkTokens
  for (let l = 0; l < g.layers; l++) {
    for (let kind = 0; kind < kvPlanes(g); kind++) {
      const base = kvRange(g, chunkTokens, l, kind as 0 | 1).start
      let t = 0
      while (t < chunkTokens) {
        const abs = first + t
        const block = Math.floor(abs / b.blockTokens)
        const within = abs - block * b.blockTokens
        const n = Math.min(b.blockTokens - within, chunkTokens - t)
        const device = b.blocks[l]![kind]![block]! + BigInt(within * row)
        const prev = out[out.length - 1]
        const host = base + t * row
        if (prev && prev.host + prev.bytes === host && prev.device + BigInt(prev.bytes) === device)
          prev.bytes += n * row
        else out.push({ device, host, bytes: n * row })
        t += n
      }
    }
  }
  return out
}

function requireCuda(native: NativeModule | undefined): NativeModule['cuda'] {
  if (!native) {
    throw new KvgateError('ERR_NATIVE', `GPU buffers need the native addon: ${nativePaths.buildCommand}`)
  }
  return native.cuda
}

/**
 * Packs descriptors as the addon's `[src, dst, bytes]` triples: for 'd2h' the
 * source is the device address and the destination a host offset; 'h2d' the reverse.
 */
export function packDescriptors(d: readonly CopyDescriptor[], direction: 'd2h' | 'h2d'): BigInt64Array {
  const out = new BigInt64Array(d.length * 3)
  d.forEach((x, i) => {
    const host = BigInt(x.host)
    out[3 * i] = direction === 'd2h' ? x.device : host
    out[3 * i + 1] = direction === 'd2h' ? host : x.device
    out[3 * i + 2] = BigInt(x.bytes)
  })
  return out
}

/** Device → host: fills `dst` (one chunk tensor) with chunk `index` of `src`. */
export async function copyChunkFromGpu(
  native: NativeModule | undefined,
  src: GpuBuffer,
  g: KvGeometry,
  chunkTokens: number,
  index: number,
  dst: Uint8Array,
): Promise<void> {
  const cuda = requireCuda(native)
  await cuda.copyBatch('d2h', dst, packDescriptors(chunkDescriptors(src, g, chunkTokens, index), 'd2h'))
}

/** Host → device: writes one chunk tensor to chunk `index` of `dst`. */
export async function copyChunkToGpu(
  native: NativeModule | undefined,
  dst: GpuBuffer,
  g: KvGeometry,
  chunkTokens: number,
  index: number,
  src: Uint8Array,
): Promise<void> {
  const cuda = requireCuda(native)
  await cuda.copyBatch('h2d', src, packDescriptors(chunkDescriptors(dst, g, chunkTokens, index), 'h2d'))
}
