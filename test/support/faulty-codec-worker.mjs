// A codec worker that dies or hangs on demand, for the pool's failure tests: an encode
// whose tensor (a calibration whose first sample) starts 0xde 0xad ends the thread, with
// exit code 0 and no error when the third byte is 0, by an uncaught error when it is 1; with
// 2 it never answers (spins in JavaScript), with 3 it spins inside wasm (a hung codec). A
// decode into an output of odd length crashes it, or, when the length is 3 mod 4, writes
// garbage into its output and then spins (a decode hung half way). Anything else is the real worker.
import { parentPort } from 'node:worker_threads'
import { register } from 'tsx/esm/api'

register()
// (func (export "f") (loop (br 0))): an infinite loop in wasm code, as a codec bug would spin.
const spinWasm = new WebAssembly.Instance(
  new WebAssembly.Module(
    new Uint8Array([
      0x00, 0x61, 0x73, 0x6d, 0x01, 0x00, 0x00, 0x00, 0x01, 0x04, 0x01, 0x60, 0x00, 0x00, 0x03, 0x02, 0x01,
      0x00, 0x07, 0x05, 0x01, 0x01, 0x66, 0x00, 0x00, 0x0a, 0x09, 0x01, 0x07, 0x00, 0x03, 0x40, 0x0c, 0x00,
      0x0b, 0x0b,
    ]),
  ),
).exports.f
const poisonedBytes = (t) => t[0] === 0xde && t[1] === 0xad
const poisoned = (m) => {
  if (m.op === 'decode') return m.out.byteLength % 2 === 1
  if (m.op === 'calibrate') return poisonedBytes(new Uint8Array(m.samples[0]))
  return m.op === 'encode' && poisonedBytes(new Uint8Array(m.tensor))
}
// Wraps the real worker's message listener so a poisoned job never reaches it.
const on = parentPort.on.bind(parentPort)
parentPort.on = (event, listener) =>
  on(event, (m) => {
    if (event === 'message' && poisoned(m)) {
      const kind =
        m.op === 'encode'
          ? new Uint8Array(m.tensor)[2]
          : m.op === 'calibrate'
            ? new Uint8Array(m.samples[0])[2]
            : m.out.byteLength % 4 === 3
              ? 4
              : 1
      if (kind === 0) process.exit(0)
      if (kind === 2) for (;;);
      if (kind === 3) spinWasm()
      if (kind === 4) {
        m.out.fill(0xa5)
        spinWasm()
      }
      throw new Error('codec worker crashed on purpose')
    }
    return listener(m)
  })
await import('../../src/client/codec-worker.ts')
