// Long fuzz run of the chunk object reader (the test suite runs a short one):
// random and mutated inputs must only ever produce typed FormatErrors, and the
// streaming verifier must agree with the whole-object verifier.
// Usage: node --import tsx bench/fuzz-format.ts [cases=200000]

import { isKvgateError } from '../src/core/errors.ts'
import { ChunkVerifier, encodeChunk, verifyChunk } from '../src/core/format.ts'

const cases = Number(process.argv[2] ?? 200_000)
let x = 0x12345678
const rnd = (n: number) => {
  x ^= x << 13
  x ^= x >>> 17
  x ^= x << 5
  return (x >>> 0) % n
}
const seedObject = (layers: number, sectionBytes: number) =>
  encodeChunk(
    {
      codec: 'raw',
      codecVersion: 1,
      codecParams: new Uint8Array(0),
      geometry: { layers, kvHeads: 2, headDim: 4, dtype: 'bf16' },
      tokens: 3,
      chunkIndex: 1,
      partial: false,
      namespaceId: new Uint8Array(16).fill(1),
      chainKey: new Uint8Array(32).fill(2),
      parentKey: new Uint8Array(32).fill(3),
    },
    Array.from({ length: layers }, (_, i) => new Uint8Array(sectionBytes).fill(i)),
  )
const seeds = [seedObject(1, 10), seedObject(4, 48), seedObject(32, 0), seedObject(2, 1000)]

function outcome(fn: () => unknown): string {
  try {
    fn()
    return 'OK'
  } catch (e) {
    if (!isKvgateError(e)) throw new Error(`untyped error: ${String(e)}`)
    return e.code
  }
}

const counts = new Map<string, number>()
const started = performance.now()
for (let i = 0; i < cases; i++) {
  let b: Uint8Array
  if (rnd(10) === 0) {
    b = new Uint8Array(rnd(600))
    for (let j = 0; j < b.length; j++) b[j] = rnd(256)
  } else {
    b = seeds[rnd(seeds.length)]!.slice()
    for (let e = 1 + rnd(6); e > 0; e--) {
      const at = rnd(b.length)
      if (rnd(2)) b[at] = rnd(256)
      else b[at]! ^= 1 << rnd(8)
    }
    if (rnd(5) === 0) b = b.subarray(0, rnd(b.length + 1))
  }
  const whole = outcome(() => verifyChunk(b))
  const streamed = outcome(() => {
    const v = new ChunkVerifier()
    for (let at = 0; at < b.length; ) {
      const n = 1 + rnd(97)
      v.push(b.subarray(at, at + n))
      at += n
    }
    v.finish()
  })
  if ((whole === 'OK') !== (streamed === 'OK'))
    throw new Error(`case ${i}: whole=${whole} streamed=${streamed}`)
  counts.set(whole, (counts.get(whole) ?? 0) + 1)
  if (i % 50_000 === 0 && i > 0) console.error(`… ${i} cases`)
}
const secs = (performance.now() - started) / 1000
console.log(
  `${cases} cases in ${secs.toFixed(1)} s, no untyped error, streaming agrees with whole-object verification`,
)
for (const [code, n] of [...counts].sort((a, b) => b[1] - a[1])) console.log(`  ${code.padEnd(24)} ${n}`)
