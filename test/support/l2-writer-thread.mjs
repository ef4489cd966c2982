// A worker thread writing one chunk into an L2 directory, held between its data and its rename
// (its datasync waits for a 'release' message) so the parent can open another tier on the
// directory while the write is in flight: another thread of the same process, as a KVCache in
// a worker thread is. Posts 'holding' once held, then { ok } with put()'s answer.
import { createRequire, syncBuiltinESMExports } from 'node:module'
import { parentPort, workerData } from 'node:worker_threads'
import { register } from 'tsx/esm/api'

register()
const fsp = createRequire(import.meta.url)('node:fs/promises')
const open = fsp.open
let release
const released = new Promise((r) => {
  release = r
})
parentPort.on('message', (m) => {
  if (m === 'release') release()
})
fsp.open = async (...args) => {
  const fh = await open(...args)
  const datasync = fh.datasync.bind(fh)
  fh.datasync = async () => {
    parentPort.postMessage('holding')
    await released
    return datasync()
  }
  return fh
}
// The named exports disk.ts imports follow the patched module object.
syncBuiltinESMExports()
const { DiskTier } = await import('../../src/client/tiers/disk.ts')
const tier = await DiskTier.open({ dir: workerData.dir, bytes: 1 << 20 })
const ok = await tier.put(workerData.hex, workerData.object)
parentPort.postMessage({ ok })
parentPort.close()
