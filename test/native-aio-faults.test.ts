// readFileCrc's AIO piece reads (native/src/io.cc ReadPieces) under faults the kernel can
// produce but a test cannot provoke: an LD_PRELOAD shim (test/support/aio-faults.c) bends
// the addon's AIO system calls in a child process with one pool thread, so its one AIO
// context serves all three reads: a failed read must leave no piece behind in it.

import { execFileSync, spawnSync } from 'node:child_process'
import { randomBytes } from 'node:crypto'
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join, resolve } from 'node:path'
import { afterAll, describe, expect, it } from 'vitest'
import { nativePaths } from '../src/client/native.ts'

const dir = mkdtempSync(join(tmpdir(), 'kvgate-aio-'))
afterAll(() => rmSync(dir, { recursive: true, force: true }))

const shim = join(dir, 'aio-faults.so')
const built = (() => {
  try {
    execFileSync('cc', [
      '-shared',
      '-fPIC',
      '-O1',
      '-o',
      shim,
      resolve(import.meta.dirname, 'support/aio-faults.c'),
      '-ldl',
    ])
    return true
  } catch {
    return false
  }
})()
// 11 MiB and a bit: six 2 MiB pieces (more than the four in flight) and an unaligned tail.
const file = join(dir, 'object')
writeFileSync(file, randomBytes(11 * (1 << 20) + 4096 + 300))

type Read = {
  ok: boolean
  error: string
  bytes: number
  direct: boolean
  same: boolean
  crcs: boolean
  copied: number
  copiedRanges: number[]
  wrong: number
}

function reads(fault: string): { reads: Read[]; submits: number } {
  const r = spawnSync(
    process.execPath,
    [resolve(import.meta.dirname, 'support/aio-faults-reader.cjs'), nativePaths.addon, file],
    {
      env: { ...process.env, LD_PRELOAD: shim, AIOFAULT: fault, UV_THREADPOOL_SIZE: '1' },
      encoding: 'utf8',
      timeout: 60_000,
    },
  )
  expect(r.status, r.stderr).toBe(0)
  return {
    reads: r.stdout
      .trim()
      .split('\n')
      .map((l) => JSON.parse(l) as Read),
    submits: r.stderr.split('\n').filter((l) => l === 'submit').length,
  }
}

const whole: Partial<Read> = {
  ok: true,
  bytes: 11 * (1 << 20) + 4096 + 300,
  direct: true,
  same: true,
  crcs: true,
  copied: 12, // every range
  wrong: 0,
}

describe.skipIf(!built)(
  'readFileCrc AIO pieces under injected faults (one pool thread, one AIO context)',
  () => {
    it('no fault: read through AIO, CRCs and copies whole', () => {
      const { reads: got, submits } = reads('none')
      expect(submits).toBeGreaterThan(0)
      for (const r of got) expect(r).toMatchObject(whole)
    })

    it('io_setup refused (aio-max-nr reached): every read by pread, whole', () => {
      const { reads: got, submits } = reads('setup')
      expect(submits).toBe(0)
      for (const r of got) expect(r).toMatchObject(whole)
    })

    it('io_submit takes fewer pieces than asked or none (EAGAIN), io_getevents interrupted (EINTR), a piece short mid-file: whole', () => {
      for (const fault of ['partial', 'eintr', 'evshort']) {
        for (const r of reads(fault).reads) expect(r, fault).toMatchObject(whole)
      }
    })

    // A range is copied as soon as its pieces have landed and its CRC matches, while later
    // pieces are still in flight: a read that then fails may have copied those ranges (whole,
    // verified bytes; the caller counts the object a miss), never one that reaches the piece
    // that failed or any after it. How many landed first is up to the disk's timing.
    it('a piece that fails, or waiting that fails with pieces in flight: that read fails, copies no range at or past the failure; the next reads on the same context are whole', () => {
      for (const [fault, message, firstUncopyable] of [
        // Piece 2 = bytes [4 MiB, 6 MiB): ranges 0-2 ([700 + i MiB, 700 + (i+1) MiB)) end before it.
        ['evfail', 'Input/output error', 3],
        // The first wait fails: no piece was ever seen landed.
        ['getfail', 'Bad file descriptor', 0],
      ] as const) {
        const [first, ...rest] = reads(fault).reads
        expect(first!.ok, fault).toBe(false)
        expect(first!.error).toContain(message)
        expect(first!.wrong, fault).toBe(0)
        for (const i of first!.copiedRanges) expect(i, fault).toBeLessThan(firstUncopyable)
        for (const r of rest) expect(r, fault).toMatchObject(whole)
      }
    })
  },
)
