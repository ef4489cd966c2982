// A codec worker that dies on demand, for the pool's failure tests: an encode
// whose tensor starts 0xde 0xad ends the thread, with exit code 0 and no error
// when the third byte is 0, by an uncaught error otherwise; a decode into an output of
// odd length crashes it. Anything else is the real worker.
import { parentPort } from 'node:worker_threads'
import { register } from 'tsx/esm/api'

register()
const poisoned = (m) => {
  if (m.op === 'decode') return m.out.byteLength % 2 === 1
  if (m.op !== 'encode') return false
  const t = new Uint8Array(m.tensor)
  return t[0] === 0xde && t[1] === 0xad
}
// Wraps the real worker's message listener so a poisoned job never reaches it.
const on = parentPort.on.bind(parentPort)
parentPort.on = (event, listener) =>
  on(event, (m) => {
    if (event === 'message' && poisoned(m)) {
      if (m.op === 'encode' && new Uint8Array(m.tensor)[2] === 0) process.exit(0)
      throw new Error('codec worker crashed on purpose')
    }
    return listener(m)
  })
await import('../../src/client/codec-worker.ts')
