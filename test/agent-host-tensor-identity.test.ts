// HostCopier checks each engine file's size once per copy, grouping tensors by the file's
// identity (device, inode). Inode numbers past 2^53 exist (overlayfs with xino puts a layer id in
// the top bits; 64-bit inode filesystems): as JS numbers they round, and two files whose inodes
// differ in the low bits would read as one. Here fstat answers with such inodes (the kernel's
// 64-bit number, as Node reports it): two files must still be told apart.

import { randomBytes } from 'node:crypto'
import type * as Fs from 'node:fs'
import { mkdtempSync, rmSync, statSync, truncateSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, expect, it, vi } from 'vitest'

/** An inode in the top range: 2^60 plus the real one's low 7 bits (all round to 2^60 as a double). */
const highInode = (ino: bigint) => 2n ** 60n + (ino % 128n)

vi.mock('node:fs', async (importOriginal) => {
  const fs = await importOriginal<typeof Fs>()
  const fstatSync = ((fd: number, options?: Fs.StatOptions) => {
    const real = fs.fstatSync(fd, { bigint: true })
    const ino = highInode(real.ino)
    if (options?.bigint) return Object.assign(real, { ino })
    // What Node reports without bigint: the 64-bit number as a double.
    return Object.assign(fs.fstatSync(fd), { ino: Number(ino) })
  }) as typeof Fs.fstatSync
  return { ...fs, default: { ...fs, fstatSync }, fstatSync }
})

const { HostCopier, HostTensor } = await import('../src/agent/host-tensor.ts')
const { loadNative } = await import('../src/client/native-api.ts')
const native = loadNative().api

const dir = mkdtempSync(join(tmpdir(), 'kvgate-host-tensor-identity-'))
afterAll(() => rmSync(dir, { recursive: true, force: true }))

const LAYER = 256 * 1024
const SLAB = 59_192
const runs = [8192, 0, 4096, 12288, 4096, 4096, 0, 8192, 1000, 200_000, 9192, 50_000]

/** Two files whose (mocked) inodes differ but are one number as doubles. */
function twoFiles(aBytes: number, bBytes: number): [string, string] {
  const a = join(dir, 'a')
  writeFileSync(a, randomBytes(aBytes))
  for (let i = 0; ; i++) {
    const b = join(dir, `b${i}`)
    writeFileSync(b, randomBytes(bBytes))
    const [ia, ib] = [statSync(a, { bigint: true }).ino, statSync(b, { bigint: true }).ino]
    if (highInode(ia) !== highInode(ib)) {
      expect(Number(highInode(ia))).toBe(Number(highInode(ib))) // the premise: equal as numbers
      return [a, b]
    }
  }
}

it('the addon is loaded (else no HostCopier)', () => {
  expect(native?.mapFileAvailable(), loadNative().reason).toBe(true)
})

it('two files whose inodes are equal only as doubles keep a size check each: a healthy smaller file is not refused, and the other file shrunk fails before any byte moves', async () => {
  // Layers 0 and 1 in A (2 layers), layer 2 at the end of B (3 layers long).
  const [a, b] = twoFiles(2 * LAYER, 3 * LAYER)
  const layers = [
    new HostTensor(a, 0, LAYER, native),
    new HostTensor(a, LAYER, LAYER, native),
    new HostTensor(b, 2 * LAYER, LAYER, native),
  ]
  const copier = HostCopier.for(layers, native, 2)!
  const code = (code: string) => expect.objectContaining({ code })
  const chunk = new Uint8Array(3 * SLAB)
  // Both files whole: the copy goes (one check of "both" against B's end refused A's 2 layers).
  await copier.gatherChunk(runs, chunk, SLAB)
  // B shrinks under its tensor: refused before the copy (not a fault halfway through it).
  truncateSync(b, 2 * LAYER + 4096)
  const slab = new Uint8Array(SLAB).fill(7)
  expect(() => copier.scatterLayers([{ layer: 2, chunks: 1, slabs: [slab] }], [runs])).toThrow(code('ERR_IO'))
  for (const t of layers) t.close()
})
