// A codec worker whose wasm memory is exhausted for decode jobs while the file named by
// KVGATE_TEST_OOM_FLAG exists: the real worker then runs the job in a full instance (a worker
// out of memory, as a large decode beside others can leave it), so its error is the real one.
// The memory taken is given back after each job. Anything else is the real worker.
import { existsSync } from 'node:fs'
import { parentPort } from 'node:worker_threads'
import { register } from 'tsx/esm/api'

register()
// The codec's instance, caught as it is made (the wrapper keeps it private).
let codec
WebAssembly.Instance = new Proxy(WebAssembly.Instance, {
  construct(target, args) {
    const instance = Reflect.construct(target, args)
    if ('kv_alloc' in instance.exports) codec = instance.exports
    return instance
  },
})
/** Allocates all the instance's memory can give (an allocation that cannot be had traps); returns what to free. */
function exhaust(ex) {
  const held = []
  for (let n = 256 << 20; n >= 64; ) {
    let p = 0
    try {
      p = ex.kv_alloc(n)
    } catch {}
    if (p === 0) n >>= 1
    else held.push([p, n])
  }
  return held
}
const flag = process.env.KVGATE_TEST_OOM_FLAG
const on = parentPort.on.bind(parentPort)
parentPort.on = (event, listener) =>
  on(event, (m) => {
    if (event !== 'message' || m.op !== 'decode' || !flag || !existsSync(flag) || !codec) return listener(m)
    const ex = codec
    const held = exhaust(ex)
    try {
      return listener(m)
    } finally {
      for (const [p, n] of held) ex.kv_free(p, n)
    }
  })
await import('../../src/client/codec-worker.ts')
