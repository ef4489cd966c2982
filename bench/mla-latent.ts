// MLA chunks stored as latent chunks vs the K/V "split slab" they replaced, in one run:
// the same DeepSeek-shaped latent KV (512 compressed + 64 rope channels, bf16) coded with
// kvgate at the default level and with lossless, both ways. Reports stored bytes, the
// latent's channel-centred error, and the attention-output error after the up-projections
// (random W_UK / W_UV, queries scaled to a 5-nat logit spread: the codec's σ), plus encode
// and decode times (interleaved A/B, median of repeats). The data is synthetic (no MLA
// weights in the repository): the figures compare the two storages, not a model.
//
//   node --import tsx bench/mla-latent.ts [--layers 4] [--tokens 256] [--repeats 7]

import { decodeChunk, encodeChunk } from '../src/codec/node.ts'
import type { CodecMode } from '../src/codec/params.ts'
import type { KvGeometry } from '../src/core/layout.ts'
import { gaussian, metaFor, rng, tensorOf, valuesOf } from '../test/codec-fixtures.ts'
import { machineLine, median, writeResult } from './lib/stats.ts'

const arg = (name: string, dflt: number) => {
  const i = process.argv.indexOf(`--${name}`)
  return i > 0 ? Number(process.argv[i + 1]) : dflt
}
const LAYERS = arg('layers', 4)
const T = arg('tokens', 256)
const REPEATS = arg('repeats', 7)
const NOPE = 512
const ROPE = 64
const C = NOPE + ROPE
const HEADS = 4
const HD = 64 // per-head nope dim after up-projection (K: HD + ROPE, V: HD)
const QUERIES = 32
const SIGMA = 5

const latent: KvGeometry = { layers: LAYERS, kvHeads: 1, headDim: C, dtype: 'bf16', latent: true }
const split: KvGeometry = { layers: LAYERS, kvHeads: 1, headDim: C / 2, dtype: 'bf16' }

/** [layer][token][latent]: RMS-normed c_KV (per-channel gains, token locality) then rope'd k_pe. */
function latentKv(seed: number): Float32Array {
  const n = gaussian(rng(seed))
  const out = new Float32Array(LAYERS * T * C)
  for (let l = 0; l < LAYERS; l++) {
    const gain = Array.from({ length: NOPE }, () => Math.exp(0.5 * n()))
    const x = new Float64Array(C).map(() => n())
    for (let t = 0; t < T; t++) {
      const row = out.subarray((l * T + t) * C, (l * T + t + 1) * C)
      let ss = 0
      for (let ch = 0; ch < NOPE; ch++) {
        x[ch] = 0.9 * x[ch]! + 0.44 * n()
        ss += x[ch]! ** 2
      }
      const rms = Math.sqrt(ss / NOPE)
      for (let ch = 0; ch < NOPE; ch++) row[ch] = (gain[ch]! * x[ch]!) / rms
      for (let p = 0; p < ROPE / 2; p++) {
        const a = 0.95 * x[NOPE + 2 * p]! + 0.3 * n()
        const b = 0.95 * x[NOPE + 2 * p + 1]! + 0.3 * n()
        x[NOPE + 2 * p] = a
        x[NOPE + 2 * p + 1] = b
        const th = t * 10000 ** (-(2 * p) / ROPE)
        row[NOPE + 2 * p] = 2 * (a * Math.cos(th) - b * Math.sin(th))
        row[NOPE + 2 * p + 1] = 2 * (a * Math.sin(th) + b * Math.cos(th))
      }
    }
  }
  return out
}

/** Per layer: W_UK, W_UV (NOPE × HEADS·HD) and queries (HEADS × QUERIES × (HD + ROPE)). */
function model(seed: number, kv: Float32Array) {
  const n = gaussian(rng(seed))
  const mat = (r: number, c: number) => Float32Array.from({ length: r * c }, () => n() / Math.sqrt(r))
  return Array.from({ length: LAYERS }, (_, l) => {
    const wk = mat(NOPE, HEADS * HD)
    const wv = mat(NOPE, HEADS * HD)
    const q = Float32Array.from({ length: HEADS * QUERIES * (HD + ROPE) }, () => n())
    const layer = { wk, wv, q, scale: new Float32Array(HEADS * QUERIES).fill(1) }
    // Scale each query so its logits over the original keys have a spread of SIGMA nats.
    const logits = attentionLogits(layer, kv.subarray(l * T * C, (l + 1) * T * C))
    for (let i = 0; i < HEADS * QUERIES; i++) {
      const z = logits.subarray(i * T, (i + 1) * T)
      const m = z.reduce((a, b) => a + b, 0) / T
      const sd = Math.sqrt(z.reduce((a, b) => a + (b - m) ** 2, 0) / T)
      layer.scale[i] = SIGMA / (sd || 1)
    }
    return layer
  })
}

type Layer = ReturnType<typeof model>[number]

function project(x: Float32Array, w: Float32Array, h: number, t: number): Float32Array {
  const out = new Float32Array(HD)
  for (let ch = 0; ch < NOPE; ch++) {
    const v = x[t * C + ch]!
    if (v === 0) continue
    const row = ch * HEADS * HD + h * HD
    for (let d = 0; d < HD; d++) out[d]! += v * w[row + d]!
  }
  return out
}

function attentionLogits(
  L: Pick<Layer, 'wk' | 'q'> & { scale?: Float32Array },
  x: Float32Array,
): Float32Array {
  const out = new Float32Array(HEADS * QUERIES * T)
  for (let h = 0; h < HEADS; h++)
    for (let t = 0; t < T; t++) {
      const k = project(x, L.wk, h, t)
      for (let i = 0; i < QUERIES; i++) {
        const q = L.q.subarray((h * QUERIES + i) * (HD + ROPE), (h * QUERIES + i + 1) * (HD + ROPE))
        let s = 0
        for (let d = 0; d < HD; d++) s += q[d]! * k[d]!
        for (let d = 0; d < ROPE; d++) s += q[HD + d]! * x[t * C + NOPE + d]!
        out[(h * QUERIES + i) * T + t] = s * (L.scale?.[h * QUERIES + i] ?? 1)
      }
    }
  return out
}

function attentionOutput(L: Layer, x: Float32Array): Float32Array {
  const z = attentionLogits(L, x)
  const out = new Float32Array(HEADS * QUERIES * HD)
  for (let h = 0; h < HEADS; h++) {
    const v = Array.from({ length: T }, (_, t) => project(x, L.wv, h, t))
    for (let i = 0; i < QUERIES; i++) {
      const row = z.subarray((h * QUERIES + i) * T, (h * QUERIES + i + 1) * T)
      const mx = Math.max(...row)
      let sum = 0
      const p = Array.from(row, (s) => {
        const e = Math.exp(s - mx)
        sum += e
        return e
      })
      const o = out.subarray((h * QUERIES + i) * HD, (h * QUERIES + i + 1) * HD)
      for (let t = 0; t < T; t++) for (let d = 0; d < HD; d++) o[d]! += (p[t]! / sum) * v[t]![d]!
    }
  }
  return out
}

function rel(a: Float32Array, b: Float32Array): number {
  let se = 0
  let ss = 0
  for (let i = 0; i < a.length; i++) {
    se += (a[i]! - b[i]!) ** 2
    ss += a[i]! ** 2
  }
  return Math.sqrt(se / ss)
}

function centred(a: Float32Array, b: Float32Array): number {
  let se = 0
  let ss = 0
  for (let l = 0; l < LAYERS; l++)
    for (let ch = 0; ch < C; ch++) {
      let m = 0
      for (let t = 0; t < T; t++) m += a[(l * T + t) * C + ch]! / T
      for (let t = 0; t < T; t++) {
        const i = (l * T + t) * C + ch
        se += (a[i]! - b[i]!) ** 2
        ss += (a[i]! - m) ** 2
      }
    }
  return Math.sqrt(se / ss)
}

const stats = (xs: number[]) => {
  const s = [...xs].sort((a, b) => a - b)
  return `${s[0]!.toFixed(1)}/${s[s.length >> 1]!.toFixed(1)}/${s[s.length - 1]!.toFixed(1)}`
}

const values = latentKv(7)
const tensor = tensorOf(values, 'bf16')
const input = valuesOf(tensor, 'bf16')
const layers = model(11, input)
const reference = layers.map((L, l) => attentionOutput(L, input.subarray(l * T * C, (l + 1) * T * C)))

console.log(
  `MLA latent vs split slab: ${LAYERS} layers × ${T} tokens × latent ${C} (${NOPE}+${ROPE} rope), bf16, ${tensor.byteLength} B raw; ${REPEATS} repeats, interleaved`,
)
const rows: Record<string, unknown>[] = []
for (const mode of ['kvgate', 'lossless'] as CodecMode[]) {
  const times = {
    latent: { enc: [] as number[], dec: [] as number[] },
    split: { enc: [] as number[], dec: [] as number[] },
  }
  const last: Record<string, { bytes: number; back: Float32Array }> = {}
  for (let r = 0; r < REPEATS; r++) {
    for (const [name, g] of (r % 2
      ? [
          ['split', split],
          ['latent', latent],
        ]
      : [
          ['latent', latent],
          ['split', split],
        ]) as ['latent' | 'split', KvGeometry][]) {
      let t0 = performance.now()
      const obj = encodeChunk(tensor, metaFor(g, T), { mode })
      times[name].enc.push(performance.now() - t0)
      t0 = performance.now()
      const back = decodeChunk(obj)
      times[name].dec.push(performance.now() - t0)
      last[name] = { bytes: obj.byteLength, back: valuesOf(back, 'bf16') }
    }
  }
  for (const name of ['latent', 'split'] as const) {
    const { bytes, back } = last[name]!
    const attn =
      mode === 'lossless'
        ? 0
        : layers.reduce(
            (a, L, l) =>
              a + rel(reference[l]!, attentionOutput(L, back.subarray(l * T * C, (l + 1) * T * C))),
            0,
          ) / LAYERS
    rows.push({
      mode,
      storage: name,
      ratio: tensor.byteLength / bytes,
      bytes,
      latentErr: centred(input, back),
      attentionErr: attn,
      encodeMsMedian: median(times[name].enc),
      decodeMsMedian: median(times[name].dec),
    })
    console.log(
      `${mode.padEnd(8)} ${name.padEnd(6)} ratio ${(tensor.byteLength / bytes).toFixed(2)}× (${bytes} B)  latent err (centred) ${(100 * centred(input, back)).toFixed(2)} %  attention-output err ${(100 * attn).toFixed(2)} %  encode ms min/med/max ${stats(times[name].enc)}  decode ${stats(times[name].dec)}`,
    )
  }
}
// Like every benchmark, the figures also go to <out>/mla-latent.json (kvgate bench --out).
const path = writeResult({
  name: 'mla-latent',
  date: new Date().toISOString(),
  machine: await machineLine(),
  command: 'node --import tsx bench/mla-latent.ts',
  geometry: { layers: LAYERS, tokens: T, latent: C, repeats: REPEATS },
  rows,
  bars: [],
})
console.log(`wrote ${path}`)
