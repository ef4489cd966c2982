// UnservableKeys: when an L4 key whose reads keep failing with no verdict is held off, for how
// long, and within what memory.

import { describe, expect, it } from 'vitest'
import { UnservableKeys } from '../src/client/unservable-keys.ts'

const hex = (i: number) => i.toString(16).padStart(64, '0')

describe('UnservableKeys', () => {
  it('holds a key at its third failure within the window, for holdMs, then tries it again', () => {
    const u = new UnservableKeys({ failures: 3, windowMs: 1000, holdMs: 500, burstMs: 10 })
    expect(u.failed(hex(1), 0)).toBe(false)
    expect(u.failed(hex(1), 100)).toBe(false)
    expect(u.held(hex(1), 150)).toBe(false)
    expect(u.failed(hex(1), 200)).toBe(true)
    expect(u.held(hex(1), 201)).toBe(true)
    expect(u.held(hex(2), 201)).toBe(false) // other keys untouched
    // A GET that started before the hold and fails meanwhile neither extends nor re-counts it.
    expect(u.failed(hex(1), 400)).toBe(false)
    expect(u.held(hex(1), 699)).toBe(true)
    expect(u.held(hex(1), 700)).toBe(false)
    // Forgotten once the hold ended: three new failures to hold it again.
    expect(u.size).toBe(0)
    expect(u.failed(hex(1), 800)).toBe(false)
    expect(u.held(hex(1), 801)).toBe(false)
  })

  it('failures spread wider than the window, or in one burst, do not hold a key', () => {
    const u = new UnservableKeys({ failures: 3, windowMs: 1000, holdMs: 500, burstMs: 50 })
    // One burst (a retrieveLayers' groups, a dying worker's jobs) counts once.
    for (let t = 0; t < 40; t += 5) expect(u.failed(hex(1), t)).toBe(false)
    expect(u.failed(hex(1), 100)).toBe(false) // second
    // The window restarts past windowMs: this is the first of a new window.
    expect(u.failed(hex(1), 1000)).toBe(false)
    expect(u.failed(hex(1), 1100)).toBe(false)
    expect(u.held(hex(1), 1101)).toBe(false)
    expect(u.failed(hex(1), 1200)).toBe(true)
  })

  it('tracks at most maxKeys keys, the least recently failed dropped first', () => {
    const u = new UnservableKeys({ failures: 2, windowMs: 10_000, holdMs: 10_000, burstMs: 0, maxKeys: 4 })
    for (let i = 0; i < 100; i++) u.failed(hex(i), i)
    expect(u.size).toBe(4)
    // hex(99) is tracked (a second failure holds it); hex(0) was dropped (a second is its first).
    expect(u.failed(hex(99), 200)).toBe(true)
    expect(u.failed(hex(0), 201)).toBe(false)
    expect(u.size).toBe(4)
    expect(u.held(hex(99), 202)).toBe(true)
    u.clear()
    expect(u.size).toBe(0)
    expect(u.held(hex(99), 203)).toBe(false)
  })

  it('holdNow holds a key at once for holdMs, within maxKeys, and a failure meanwhile does not extend it', () => {
    const u = new UnservableKeys({ failures: 3, windowMs: 10_000, holdMs: 500, burstMs: 0, maxKeys: 2 })
    u.holdNow(hex(1), 0)
    expect(u.held(hex(1), 1)).toBe(true)
    expect(u.failed(hex(1), 2)).toBe(false) // held already: no new hold
    expect(u.held(hex(1), 499)).toBe(true)
    expect(u.held(hex(1), 500)).toBe(false)
    for (let i = 10; i < 20; i++) expect(u.holdNow(hex(i), i)).toBe(true)
    expect(u.size).toBe(2)
    expect(u.held(hex(19), 20)).toBe(true)
    expect(u.held(hex(10), 20)).toBe(false)
  })

  it('holdNow on a key held already (a GET that started before the hold) neither counts nor extends it', () => {
    const u = new UnservableKeys({ holdMs: 500 })
    expect(u.holdNow(hex(1), 0)).toBe(true)
    expect(u.holdNow(hex(1), 400)).toBe(false)
    expect(u.held(hex(1), 499)).toBe(true)
    expect(u.held(hex(1), 500)).toBe(false)
    // Past the hold a read that finds it again holds it afresh.
    expect(u.holdNow(hex(1), 600)).toBe(true)
    expect(u.held(hex(1), 1099)).toBe(true)
  })
})
