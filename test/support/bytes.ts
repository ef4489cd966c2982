// Byte helpers shared by the native suites: a deterministic fill pattern and an
// exact comparison that works on views of any buffer (pinned, device-stub, plain).

export function same(a: Uint8Array, b: Uint8Array): boolean {
  return Buffer.from(a.buffer, a.byteOffset, a.byteLength).equals(
    Buffer.from(b.buffer, b.byteOffset, b.byteLength),
  )
}

export function pattern(n: number, seed = 1): Uint8Array {
  const u = new Uint8Array(n)
  let x = seed >>> 0
  for (let i = 0; i < n; i++) {
    x = (x * 1103515245 + 12345) >>> 0
    u[i] = x >>> 24
  }
  return u
}
