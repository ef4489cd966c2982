// Child of test/native-aio-faults.test.ts (run under the aio-faults.c shim, one pool thread):
// three readFileCrc calls of one file with a copy-out, one JSON line each.
const n = require(process.argv[2])
const fs = require('node:fs')
const { crc32 } = require('node:zlib')
const path = process.argv[3]
const data = fs.readFileSync(path)
const size = data.length
const MiB = 1 << 20
const ranges = []
for (let a = 700; a < size; a += MiB) ranges.push([a, Math.min(size, a + MiB)])
const expected = ranges.map(([a, z]) => crc32(data.subarray(a, z)) >>> 0)

async function once() {
  const pinned = n.allocPinnedSync(size + 4096)
  const b = pinned.buffer ?? pinned
  const dst = new Uint8Array(size).fill(0xab)
  const gate = n.newCopyGate()
  const out = {
    ok: false,
    error: '',
    bytes: 0,
    direct: false,
    same: false,
    crcs: false,
    copied: 0,
    copiedRanges: [],
    wrong: 0,
  }
  try {
    const flat = new Float64Array(ranges.flat())
    const r = await n.readFileCrc(
      path,
      b,
      0,
      size + 4096,
      0,
      -1,
      1,
      flat,
      dst.buffer,
      0,
      size,
      0,
      new Float64Array(expected),
      gate,
    )
    Object.assign(out, { ok: true, bytes: r.bytes, direct: r.direct })
    out.same = Buffer.compare(Buffer.from(b, 0, size), data) === 0
    out.crcs = ranges.every((_, i) => r.crcs[i] === expected[i])
  } catch (e) {
    out.error = String(e.message)
  }
  ranges.forEach(([a, z], i) => {
    if (dst.subarray(a, z).every((v) => v === 0xab)) return
    out.copied++
    out.copiedRanges.push(i)
    if (Buffer.compare(dst.subarray(a, z), data.subarray(a, z)) !== 0) out.wrong++
  })
  n.closeCopyGate(gate)
  n.freePinned(b)
  return out
}

;(async () => {
  for (let i = 0; i < 3; i++) console.log(JSON.stringify(await once()))
})()
