// Calibration text for a namespace's calibration object (src/codec/calibration.ts): what a
// client would calibrate on is its own traffic; the benchmark stands in with text the model
// writes itself (temperature-1 sampling, seeded), so the calibration never sees the held-out
// stories the codec is judged on.

import type { Transformer } from './forward.ts'
import { Xoshiro128 } from './synthetic.ts'
import type { Tokenizer } from './tokenizer.ts'

const PROMPTS = ['Once upon a time', 'One day', 'There was a little', 'The sun was', 'Mom said']

/** Token windows of `seqLen` tokens (BOS + a prompt + sampled text), one per seed. */
export function sampledWindows(
  transformer: Transformer,
  tokenizer: Tokenizer,
  count: number,
  seqLen: number,
  seed = 1,
): number[][] {
  const out: number[][] = []
  for (let w = 0; w < count; w++) {
    const rng = new Xoshiro128(seed + w)
    const tokens = tokenizer.encode(PROMPTS[w % PROMPTS.length]!)
    const cache = transformer.newCache()
    let logits = transformer.prefill(tokens, { cache }).logits
    while (tokens.length < seqLen) {
      // Softmax sampling at temperature 1.
      let max = -Infinity
      for (const v of logits) if (v > max) max = v
      let sum = 0
      for (const v of logits) sum += Math.exp(v - max)
      let u = (rng.next() / 2 ** 32) * sum
      let t = 0
      for (; t < logits.length - 1; t++) {
        u -= Math.exp(logits[t]! - max)
        if (u <= 0) break
      }
      tokens.push(t)
      if (tokens.length < seqLen) logits = transformer.step(t, cache)
    }
    out.push(tokens)
  }
  return out
}
