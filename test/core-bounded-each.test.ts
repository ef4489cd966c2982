import { describe, expect, it } from 'vitest'
import { eachBounded } from '../src/core/bounded-each.ts'

describe('eachBounded', () => {
  it('runs every item with at most `limit` at once', async () => {
    let running = 0
    let peak = 0
    const seen: number[] = []
    await eachBounded([1, 2, 3, 4, 5, 6, 7], 3, async (i) => {
      running++
      peak = Math.max(peak, running)
      await new Promise((r) => setTimeout(r, 5))
      seen.push(i)
      running--
    })
    expect(peak).toBe(3)
    expect(seen.sort()).toEqual([1, 2, 3, 4, 5, 6, 7])
  })

  it('rejects with the failure only once no started call still runs', async () => {
    let running = 0
    const err = new Error('item 1')
    const p = eachBounded([1, 2, 3], 3, async (i) => {
      running++
      try {
        if (i === 1) throw err
        await new Promise((r) => setTimeout(r, 30))
      } finally {
        running--
      }
    })
    await expect(p).rejects.toBe(err)
    expect(running).toBe(0)
  })
})
