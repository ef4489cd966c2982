// SHA-256 in plain TypeScript: calibration objects are named by their hash in every runtime
// the codec runs in (Node, workerd without nodejs_compat, browsers), synchronously.
// Objects are small (kilobytes to a few MiB) and hashed once per open or serve: speed matters little.

const K = new Uint32Array([
  0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5, 0xd807aa98,
  0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786,
  0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8,
  0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13,
  0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819,
  0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a,
  0x5b9cca4f, 0x682e6ff3, 0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
  0xc67178f2,
])

/**
 * Incremental SHA-256: `update()` with pieces as they arrive, then `hex()` once. The gateway
 * hashes a calibration it streams (one too large for its cache) without holding it whole.
 */
export class Sha256 {
  readonly #h = new Uint32Array([
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
  ])
  readonly #w = new Uint32Array(64)
  /** The partial block carried between updates. */
  readonly #block = new Uint8Array(64)
  #buffered = 0
  #length = 0
  #done = false

  update(data: Uint8Array): this {
    if (this.#done) throw new Error('Sha256: update() after hex()')
    this.#length += data.byteLength
    let at = 0
    if (this.#buffered > 0) {
      const take = Math.min(64 - this.#buffered, data.byteLength)
      this.#block.set(data.subarray(0, take), this.#buffered)
      this.#buffered += take
      at = take
      if (this.#buffered < 64) return this
      this.#compress(new DataView(this.#block.buffer), 0)
      this.#buffered = 0
    }
    const dv = new DataView(data.buffer, data.byteOffset, data.byteLength)
    for (; at + 64 <= data.byteLength; at += 64) this.#compress(dv, at)
    this.#block.set(data.subarray(at))
    this.#buffered = data.byteLength - at
    return this
  }

  /** The digest as 64 lowercase hex digits; the hasher is spent afterwards. */
  hex(): string {
    if (this.#done) throw new Error('Sha256: hex() called twice')
    const len = this.#length
    const tail = new Uint8Array(this.#buffered + 9 <= 64 ? 64 : 128)
    tail.set(this.#block.subarray(0, this.#buffered))
    tail[this.#buffered] = 0x80
    const dv = new DataView(tail.buffer)
    dv.setUint32(tail.length - 8, Math.floor(len / 0x20000000), false)
    dv.setUint32(tail.length - 4, (len << 3) >>> 0, false)
    for (let off = 0; off < tail.length; off += 64) this.#compress(dv, off)
    this.#done = true
    let hex = ''
    for (const v of this.#h) hex += v.toString(16).padStart(8, '0')
    return hex
  }

  #compress(dv: DataView, off: number): void {
    const h = this.#h
    const w = this.#w
    for (let i = 0; i < 16; i++) w[i] = dv.getUint32(off + 4 * i, false)
    for (let i = 16; i < 64; i++) {
      const x = w[i - 15]!
      const y = w[i - 2]!
      const s0 = ((x >>> 7) | (x << 25)) ^ ((x >>> 18) | (x << 14)) ^ (x >>> 3)
      const s1 = ((y >>> 17) | (y << 15)) ^ ((y >>> 19) | (y << 13)) ^ (y >>> 10)
      w[i] = (w[i - 16]! + s0 + w[i - 7]! + s1) | 0
    }
    // Plain locals, not a destructured typed array: this loop is the whole cost.
    let a = h[0]! | 0
    let b = h[1]! | 0
    let c = h[2]! | 0
    let d = h[3]! | 0
    let e = h[4]! | 0
    let f = h[5]! | 0
    let g = h[6]! | 0
    let k = h[7]! | 0
    for (let i = 0; i < 64; i++) {
      const s1 = ((e >>> 6) | (e << 26)) ^ ((e >>> 11) | (e << 21)) ^ ((e >>> 25) | (e << 7))
      const ch = (e & f) ^ (~e & g)
      const t1 = (k + s1 + ch + K[i]! + w[i]!) | 0
      const s0 = ((a >>> 2) | (a << 30)) ^ ((a >>> 13) | (a << 19)) ^ ((a >>> 22) | (a << 10))
      const maj = (a & b) ^ (a & c) ^ (b & c)
      k = g
      g = f
      f = e
      e = (d + t1) | 0
      d = c
      c = b
      b = a
      a = (t1 + s0 + maj) | 0
    }
    h[0] = h[0]! + a
    h[1] = h[1]! + b
    h[2] = h[2]! + c
    h[3] = h[3]! + d
    h[4] = h[4]! + e
    h[5] = h[5]! + f
    h[6] = h[6]! + g
    h[7] = h[7]! + k
  }
}

/** SHA-256 of `data` as 64 lowercase hex digits. */
export function sha256Hex(data: Uint8Array): string {
  return new Sha256().update(data).hex()
}
