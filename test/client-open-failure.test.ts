// KVCache.open that fails after its L2 tier opened: nothing it acquired outlives the failure.
// The failure is injected where open() builds its StorageManager (the last step, after L1,
// the codec pool, L2, L4 and the calibration store exist); this file mocks that one module.

import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterEach, describe, expect, it, vi } from 'vitest'
import { CalibrationStore } from '../src/client/calibration-store.ts'
import { CodecPool } from '../src/client/codec-pool.ts'
import { KVCache } from '../src/client/index.ts'
import { DiskBudget, DiskTier } from '../src/client/tiers/disk.ts'
import { MemoryTier } from '../src/client/tiers/memory.ts'
import { RemoteTier } from '../src/client/tiers/remote.ts'
import { chunkBytes, MODEL_PRESETS } from '../src/core/layout.ts'

const inject = vi.hoisted(() => ({ fail: false }))

vi.mock('../src/client/storage-manager.ts', async (importOriginal) => {
  const m = await importOriginal<typeof import('../src/client/storage-manager.ts')>()
  class FailingStorageManager extends m.StorageManager {
    constructor(opts: ConstructorParameters<typeof m.StorageManager>[0]) {
      if (inject.fail) throw new Error('injected: the storage manager failed to start')
      super(opts)
    }
  }
  return { ...m, StorageManager: FailingStorageManager }
})

const T = 16
const CB = chunkBytes(MODEL_PRESETS.stories260k, T)
const tokens = Array.from({ length: 2 * T }, (_, i) => (i * 7 + 131) % 512)
const kv = Uint8Array.from({ length: 2 * CB }, (_, i) => (i * 31) & 255)

const dirs: string[] = []
afterEach(() => {
  inject.fail = false
  vi.restoreAllMocks()
  for (const d of dirs.splice(0)) rmSync(d, { recursive: true, force: true })
})

function options(dir: string) {
  return {
    model: 'stories260k' as const,
    chunkTokens: T,
    memory: { bytes: 8 * CB },
    disk: { dir, bytes: 1 << 30 },
    // Never contacted: open() connects lazily.
    namespace: 'team',
    remote: { url: 'http://127.0.0.1:9' },
  }
}

describe('KVCache.open failing after its L2 tier opened', () => {
  it('leaves the shared disk budget and closes every tier it opened; the files stay for the next open', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'kvgate-open-fail-'))
    dirs.push(dir)
    const budget = new DiskBudget(1 << 30)
    // Files in the directory: the failed open's rebuild counts them into the budget.
    const first = await KVCache.open(options(dir), { diskBudget: budget })
    await first.store(tokens, kv)
    await first.flush()
    await first.close()
    expect([budget.members, budget.used]).toEqual([0, 0])

    const closed = {
      disk: vi.spyOn(DiskTier.prototype, 'close'),
      codec: vi.spyOn(CodecPool.prototype, 'close'),
      remote: vi.spyOn(RemoteTier.prototype, 'close'),
      calibrations: vi.spyOn(CalibrationStore.prototype, 'close'),
      memory: vi.spyOn(MemoryTier.prototype, 'dispose'),
    }
    const opened = vi.spyOn(DiskTier, 'open')
    inject.fail = true
    await expect(KVCache.open(options(dir), { diskBudget: budget })).rejects.toThrow(/injected/)
    expect(opened).toHaveBeenCalledTimes(1)
    expect([budget.members, budget.used]).toEqual([0, 0])
    for (const [what, spy] of Object.entries(closed)) expect(spy, what).toHaveBeenCalledTimes(1)

    // A shared L1 is the caller's: a failed open leaves it as it was.
    const shared = await MemoryTier.create({ bytes: 8 * (CB + 4096), chunkBytes: CB + 4096 })
    closed.memory.mockClear()
    await expect(KVCache.open(options(dir), { diskBudget: budget, memory: shared })).rejects.toThrow(
      /injected/,
    )
    expect(closed.memory).not.toHaveBeenCalled()
    expect(budget.members).toBe(0)
    shared.dispose()

    inject.fail = false
    const again = await KVCache.open(options(dir), { diskBudget: budget })
    try {
      expect(budget.members).toBe(1)
      expect(budget.used).toBeGreaterThan(0)
      const found = await again.lookup(tokens)
      expect(found.chunks.map((c) => c.tier)).toEqual(['disk', 'disk'])
    } finally {
      await again.close()
    }
    expect(budget.members).toBe(0)
  })
})
