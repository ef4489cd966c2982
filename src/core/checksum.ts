// CRC-32 (IEEE 802.3, the polynomial zlib and gzip use) over chunk sections and
// headers. Node's native zlib.crc32 runs at memory speed; runtimes without it
// (workerd without nodejs_compat) use a slicing-by-8 table in plain JS.

type Crc32Fn = (data: Uint8Array, value?: number) => number

function nativeCrc32(): Crc32Fn | undefined {
  // No static node: import: this module must load in workerd too.
  const proc = (globalThis as { process?: { getBuiltinModule?: (id: string) => unknown } }).process
  const zlib = proc?.getBuiltinModule?.('node:zlib') as { crc32?: Crc32Fn } | undefined
  return typeof zlib?.crc32 === 'function' ? zlib.crc32 : undefined
}

let tables: Uint32Array[] | undefined

function buildTables(): Uint32Array[] {
  const t: Uint32Array[] = []
  for (let k = 0; k < 8; k++) t.push(new Uint32Array(256))
  for (let i = 0; i < 256; i++) {
    let c = i
    for (let j = 0; j < 8; j++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1
    t[0]![i] = c >>> 0
  }
  for (let i = 0; i < 256; i++) {
    let c = t[0]![i]!
    for (let k = 1; k < 8; k++) {
      c = t[0]![c & 0xff]! ^ (c >>> 8)
      t[k]![i] = c >>> 0
    }
  }
  return t
}

/** Portable CRC-32; same results as zlib.crc32. Exported for tests and non-Node runtimes. */
export function crc32Portable(data: Uint8Array, value = 0): number {
  tables ??= buildTables()
  const [t0, t1, t2, t3, t4, t5, t6, t7] = tables as [
    Uint32Array,
    Uint32Array,
    Uint32Array,
    Uint32Array,
    Uint32Array,
    Uint32Array,
    Uint32Array,
    Uint32Array,
  ]
  let c = ~value >>> 0
  let i = 0
  const n = data.length
  for (; i + 8 <= n; i += 8) {
    const a = (c ^ (data[i]! | (data[i + 1]! << 8) | (data[i + 2]! << 16) | (data[i + 3]! << 24))) >>> 0
    c =
      t7[a & 0xff]! ^
      t6[(a >>> 8) & 0xff]! ^
      t5[(a >>> 16) & 0xff]! ^
      t4[a >>> 24]! ^
      t3[data[i + 4]!]! ^
      t2[data[i + 5]!]! ^
      t1[data[i + 6]!]! ^
      t0[data[i + 7]!]!
  }
  for (; i < n; i++) c = t0[(c ^ data[i]!) & 0xff]! ^ (c >>> 8)
  return ~c >>> 0
}

const native = nativeCrc32()

/** CRC-32 of `data`, continuing from `value` (the CRC of the bytes before). */
export const crc32: Crc32Fn = native ? (data, value = 0) => native(data, value) >>> 0 : crc32Portable

/** Which implementation `crc32` uses here (reported by benchmarks). */
export const crc32Implementation: 'native' | 'portable' = native ? 'native' : 'portable'

// crc32Combine: zlib's crc32_combine (x^(8·len2) mod P, applied to crc1), so CRCs of
// pieces computed apart (the addon's I/O threads read and CRC a file in ranges) join
// into the CRC of the whole without touching the bytes again.
const POLY = 0xedb88320

/** (a · b) mod P over GF(2), reflected like the CRC. */
function multModP(a: number, b: number): number {
  let m = 0x80000000
  let p = 0
  for (;;) {
    if (a & m) {
      p ^= b
      if ((a & (m - 1)) === 0) break
    }
    m >>>= 1
    b = b & 1 ? (b >>> 1) ^ POLY : b >>> 1
  }
  return p >>> 0
}

let x2nTable: Uint32Array | undefined

/** x^(n·2^k) mod P. */
function x2nModP(n: number, k: number): number {
  if (!x2nTable) {
    x2nTable = new Uint32Array(32)
    let p = 0x40000000 // x^1
    x2nTable[0] = p
    for (let i = 1; i < 32; i++) x2nTable[i] = p = multModP(p, p)
  }
  let p = 0x80000000 // x^0
  while (n > 0) {
    if (n % 2 === 1) p = multModP(x2nTable[k & 31]!, p)
    n = Math.floor(n / 2)
    k++
  }
  return p
}

/** CRC-32 of A‖B from crc32(A), crc32(B) and B's length (zlib's crc32_combine). */
export function crc32Combine(crcA: number, crcB: number, lengthB: number): number {
  if (!Number.isSafeInteger(lengthB) || lengthB < 0) throw new RangeError(`invalid length ${lengthB}`)
  return (multModP(x2nModP(lengthB, 3), crcA >>> 0) ^ crcB) >>> 0
}
