// A codec worker that scribbles on a decode's output before decoding it: the whole output
// buffer is filled with 0xa5, last MiB first (so a copy-out of the same shared memory the
// calling thread started a moment earlier, front to back, meets it). Then the real worker
// decodes over it. A pool that hands this job a buffer another job's result is still being
// copied out of serves 0xa5 bytes in that result.
import { parentPort } from 'node:worker_threads'
import { register } from 'tsx/esm/api'

register()
const on = parentPort.on.bind(parentPort)
parentPort.on = (event, listener) =>
  on(event, (m) => {
    if (event === 'message' && m.op === 'decode') {
      const step = 1 << 20
      for (let end = m.out.byteLength; end > 0; end -= step) m.out.fill(0xa5, Math.max(0, end - step), end)
    }
    return listener(m)
  })
await import('../../src/client/codec-worker.ts')
