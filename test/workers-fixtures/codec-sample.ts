// The KV sample both runtimes encode in the cross-runtime codec test: deterministic,
// runtime-neutral (no node: imports), so Node and workerd build identical tensors.

import type { KvGeometry } from '../../src/core/layout.ts'
import { metaFor, syntheticKv, tensorOf } from '../codec-fixtures.ts'

export const SAMPLE_GEOMETRY: KvGeometry = { layers: 4, kvHeads: 2, headDim: 64, dtype: 'fp16' }
export const SAMPLE_TOKENS = 32

export function sampleTensor(): Uint8Array {
  return tensorOf(syntheticKv(SAMPLE_GEOMETRY, SAMPLE_TOKENS, 42), SAMPLE_GEOMETRY.dtype)
}

export function sampleMeta() {
  return metaFor(SAMPLE_GEOMETRY, SAMPLE_TOKENS)
}
