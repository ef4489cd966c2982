// Differential check of two wasm codec builds, for speed work that must not move a bit:
// both encode the same corpus (every shape class the fast paths split on: C a multiple of 8
// or not, one row or many, fp16/bf16/fp32, kvgate levels q1/q5/q9 with channels that do and
// do not predict from the previous token, lossless), the objects must be identical, and then
// both decode the same mutated sections (bit flips, truncations, random runs, tail bytes):
// the same accept/reject and, when accepted, the same bytes. No trap may escape either build.
// Usage: [KVGATE_DIFF_MUTATIONS=20000] node --import tsx bench/codec-diff.ts <old.wasm>
// [new.wasm (default: the committed build)] — exit code 1 on any difference.

import { readFileSync } from 'node:fs'

type Exports = Record<string, (...a: number[]) => number> & { memory: WebAssembly.Memory }

const [oldPath, newPath = new URL('../wasm/kvgate_codec.wasm', import.meta.url).pathname] =
  process.argv.slice(2)
if (!oldPath) {
  console.error('usage: node --import tsx bench/codec-diff.ts <old.wasm> [new.wasm]')
  process.exit(2)
}
const ITERATIONS = Number(process.env.KVGATE_DIFF_MUTATIONS ?? 20_000)
const ELEM_BYTES: Record<number, number> = { 1: 2, 2: 2, 3: 4 } // fp16, bf16, fp32

let seed = 20261124
const rnd = () => {
  seed = (Math.imul(seed, 1103515245) + 12345) >>> 0
  return seed / 2 ** 32
}

const instance = (path: string): Exports =>
  new WebAssembly.Instance(new WebAssembly.Module(readFileSync(path)), {}).exports as Exports

function encode(
  e: Exports,
  mode: number,
  dt: number,
  t: number,
  c: number,
  slab: Uint8Array,
  params: number[],
) {
  const src = e.kv_alloc!(slab.length)
  const par = e.kv_alloc!(32)
  new Uint8Array(e.memory.buffer, src, slab.length).set(slab)
  new Float32Array(e.memory.buffer, par, 8).set(params)
  const n = e.kv_encode!(mode, src, dt, t, c, par)
  const out = n >= 0 ? new Uint8Array(e.memory.buffer, e.kv_result_ptr!(), n).slice() : null
  e.kv_result_clear!()
  e.kv_free!(src, slab.length)
  e.kv_free!(par, 32)
  return out
}

function decode(e: Exports, mode: number, dt: number, t: number, c: number, section: Uint8Array) {
  const size = 2 * t * c * ELEM_BYTES[dt]!
  const len = Math.max(1, section.length)
  const src = e.kv_alloc!(len)
  const dst = e.kv_alloc!(size)
  new Uint8Array(e.memory.buffer, src, section.length).set(section)
  const rc = e.kv_decode!(mode, src, section.length, dt, t, c, dst)
  const out = new Uint8Array(e.memory.buffer, dst, size).slice()
  e.kv_free!(src, len)
  e.kv_free!(dst, size)
  return { rc, out }
}

/** K then V (T×C each): per-channel offsets and scales, rare outliers (escapes), and half the
 * channels a slow walk over tokens (so the encoder predicts them from the previous token). */
function slab(dt: number, t: number, c: number): Uint8Array {
  const n = 2 * t * c
  const f = new Float32Array(n)
  const scale = Array.from({ length: c }, () => 0.05 + rnd() * (rnd() < 0.1 ? 20 : 2))
  const offset = Array.from({ length: c }, () => (rnd() - 0.5) * 4)
  const walk = Array.from({ length: c }, () => rnd() < 0.5)
  for (let i = 0; i < n; i++) {
    const ch = i % c
    const fresh = offset[ch]! + scale[ch]! * (rnd() + rnd() + rnd() - 1.5) * (rnd() < 0.002 ? 30 : 1)
    const firstRow = i % (t * c) < c
    f[i] = walk[ch] && !firstRow ? f[i - c]! + 0.02 * scale[ch]! * (rnd() - 0.5) : fresh
  }
  if (dt === 3) return new Uint8Array(f.buffer)
  const u = new Uint16Array(n)
  const bits = new Uint32Array(f.buffer)
  for (let i = 0; i < n; i++) {
    const b = bits[i]!
    if (dt === 2) u[i] = b >>> 16
    else {
      const sign = (b >>> 16) & 0x8000
      const exp = ((b >>> 23) & 0xff) - 127 + 15
      u[i] = exp <= 0 ? sign : exp >= 31 ? sign | 0x7bff : sign | (exp << 10) | ((b >>> 13) & 0x3ff)
    }
  }
  return new Uint8Array(u.buffer)
}

const a = instance(oldPath)
const b = instance(newPath)
let differences = 0
const report = (what: string) => {
  differences++
  if (differences <= 10) console.log(`DIFFERENT: ${what}`)
}
const corpus: { mode: number; dt: number; t: number; c: number; s: Uint8Array }[] = []
const shapes: [number, number][] = [
  [1, 8],
  [2, 8],
  [3, 16],
  [17, 64],
  [33, 128],
  [64, 256],
  [256, 1024],
  [5, 12],
  [9, 1000],
  // C not a multiple of 4 (scalar tails), and T ≥ 128 (sampled prediction rows).
  [7, 30],
  [130, 6],
  [129, 20],
]
for (const [t, c] of shapes)
  for (const dt of [1, 2, 3])
    for (const [mode, eps] of [
      [2, 0.56],
      [2, 0.14],
      [2, 0.01],
      [1, 0],
    ] as const) {
      const params = [-eps / 5, eps, 0, 0, 1, 8, 0, 0]
      const data = slab(dt, t, c)
      const sa = encode(a, mode, dt, t, c, data, params)
      const sb = encode(b, mode, dt, t, c, data, params)
      if (!sa || !sb || Buffer.compare(sa, sb) !== 0)
        report(`encode mode ${mode} dtype ${dt} ${t}×${c} eps ${eps}`)
      else corpus.push({ mode, dt, t, c, s: sa })
    }
// The encoder's other kvgate paths (objects compared; the decoders see them above): per-channel
// K and per-token V steps, one V step from the row maxima, channel and token scales,
// rate-distortion rounding (when both builds have it), an MLA latent, and kv_stats' counts.
const variants: [string, number[], number][] = [
  ['levels 12:16', [0, 0, 0, 0, 1, 8, 12, 16], 0],
  ['levels 12:-16', [0, 0, 0, 0, 1, 8, 12, -16], 0],
  ['gammas', [-0.03, 0.14, 0.5, 0.5, 1, 4, 0, 0], 0],
  ['rd', [-0.03, 0.14, 0, 0, 1, 8, 0, 0], 0.5],
  ['no delta', [-0.03, 0.14, 0, 0, 0, 2, 0, 0], 0],
]
const LATENT = 0x100
let otherPaths = 0
for (const [t, c] of shapes)
  for (const dt of [1, 2, 3]) {
    const data = slab(dt, t, c)
    for (const [name, params, rd] of variants) {
      if (rd > 0 && !(a.kv_set_rd_lambda && b.kv_set_rd_lambda)) continue
      a.kv_set_rd_lambda?.(rd)
      b.kv_set_rd_lambda?.(rd)
      const sa = encode(a, 2, dt, t, c, data, params)
      const sb = encode(b, 2, dt, t, c, data, params)
      a.kv_set_rd_lambda?.(0)
      b.kv_set_rd_lambda?.(0)
      if (!sa || !sb || Buffer.compare(sa, sb) !== 0) report(`encode ${name} dtype ${dt} ${t}×${c}`)
      otherPaths++
    }
    const params = [-0.03, 0.14, 0, 0, 1, 8, 0, 0]
    const half = data.subarray(0, data.length / 2)
    const la = encode(a, 2, dt | LATENT, t, c, half, params)
    const lb = encode(b, 2, dt | LATENT, t, c, half, params)
    if (!la || !lb || Buffer.compare(la, lb) !== 0) report(`encode latent dtype ${dt} ${t}×${c}`)
    otherPaths++
    const counts = (e: Exports) => {
      const src = e.kv_alloc!(data.length)
      const par = e.kv_alloc!(32)
      new Uint8Array(e.memory.buffer, src, data.length).set(data)
      new Float32Array(e.memory.buffer, par, 8).set(params)
      const n = e.kv_stats!(src, dt, t, c, par)
      const out = n >= 0 ? new Uint8Array(e.memory.buffer, e.kv_result_ptr!(), n).slice() : null
      e.kv_result_clear!()
      e.kv_free!(src, data.length)
      e.kv_free!(par, 32)
      return out
    }
    const ca = counts(a)
    const cb = counts(b)
    if (!ca || !cb || Buffer.compare(ca, cb) !== 0) report(`kv_stats dtype ${dt} ${t}×${c}`)
    otherPaths++
  }
for (const { mode, dt, t, c, s } of corpus) {
  const da = decode(a, mode, dt, t, c, s)
  const db = decode(b, mode, dt, t, c, s)
  if (da.rc !== 0 || db.rc !== 0 || Buffer.compare(da.out, db.out) !== 0)
    report(`decode mode ${mode} dtype ${dt} ${t}×${c}`)
}
let accepted = 0
for (let i = 0; i < ITERATIONS; i++) {
  const { mode, dt, t, c, s: clean } = corpus[Math.floor(rnd() * corpus.length)]!
  let s = clean.slice()
  const kind = rnd()
  if (kind < 0.5) {
    for (let k = 1 + Math.floor(rnd() * 4); k > 0; k--) {
      const p = Math.floor(rnd() * s.length)
      s[p] = s[p]! ^ (1 << Math.floor(rnd() * 8))
    }
  } else if (kind < 0.7) s = s.subarray(0, Math.floor(rnd() * s.length))
  else if (kind < 0.85) {
    const p = Math.floor(rnd() * s.length)
    for (let j = p; j < Math.min(s.length, p + 1 + Math.floor(rnd() * 64)); j++)
      s[j] = Math.floor(rnd() * 256)
  } else s[Math.max(0, s.length - 1 - Math.floor(rnd() * 200))] = Math.floor(rnd() * 256)
  const da = decode(a, mode, dt, t, c, s)
  const db = decode(b, mode, dt, t, c, s)
  if (da.rc === 0) accepted++
  if (da.rc !== db.rc || (da.rc === 0 && Buffer.compare(da.out, db.out) !== 0))
    report(`mutated decode mode ${mode} dtype ${dt} ${t}×${c}: rc ${da.rc} vs ${db.rc}`)
}
console.log(
  `codec-diff: ${corpus.length} sections encoded identically (and ${otherPaths} other encoder paths` +
    ` compared); ${ITERATIONS} mutated sections, ` +
    `${accepted} accepted by the old build; ${differences} differences`,
)
process.exitCode = differences === 0 ? 0 : 1
