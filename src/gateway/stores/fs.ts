// The embedded default store: one file per object under a directory. Writes go to
// a temp file, are fsynced, then link()ed into place (link fails on an existing
// name: create-only without a lock), so an acknowledged write survives a crash.

import { randomBytes } from 'node:crypto'
import { createReadStream } from 'node:fs'
import * as fsp from 'node:fs/promises'
import * as path from 'node:path'
import { Readable } from 'node:stream'
import { InvalidArgumentError, StoreError } from '../../core/errors.ts'
import { RangeNotSatisfiableError } from './errors.ts'
import type { DeleteOptions, GetOptions, ObjectStore, PutResult, StoreEntry, StoreObject } from './types.ts'
import { resolveRange } from './types.ts'

export interface FsStoreOptions {
  /** Directory that holds the objects (created when missing). */
  root: string
  /** fsync files and directories on write. @default true */
  fsync?: boolean
}

const SAFE_NAME = /^[A-Za-z0-9._-]+(\/[A-Za-z0-9._-]+)*$/
const TMP_PREFIX = '.tmp-'

/** The read stream's piece (and buffer) size: large reads, few syscalls. */
const READ_PIECE_BYTES = 1 << 20

export class FsStore implements ObjectStore {
  readonly kind = 'fs'
  readonly root: string
  readonly #fsync: boolean

  constructor(opts: FsStoreOptions) {
    if (typeof opts?.root !== 'string' || opts.root === '')
      throw new TypeError('FsStore: root must be a directory path')
    this.root = path.resolve(opts.root)
    this.#fsync = opts.fsync ?? true
  }

  /** Creates the root and removes temp files a crash left behind. */
  async open(): Promise<this> {
    await fsp.mkdir(this.root, { recursive: true })
    for await (const p of walk(this.root)) {
      if (path.basename(p).startsWith(TMP_PREFIX)) await fsp.rm(p, { force: true })
    }
    return this
  }

  // Names come from core objectName(); this is the second line of defence.
  #file(name: string): string {
    if (
      !SAFE_NAME.test(name) ||
      name.split('/').some((p) => p === '.' || p === '..' || p.startsWith(TMP_PREFIX))
    ) {
      throw new InvalidArgumentError(`unsafe object name ${JSON.stringify(name)}`)
    }
    return path.join(this.root, name)
  }

  async get(name: string, opts: GetOptions = {}): Promise<StoreObject | undefined> {
    const file = this.#file(name)
    let fh: fsp.FileHandle
    try {
      fh = await fsp.open(file, 'r')
    } catch (e) {
      if (isNotFound(e)) return undefined
      throw wrap(e, 'open')
    }
    try {
      const st = await fh.stat()
      const size = st.size
      const etag = fsEtag(st)
      const r = resolveRange(opts.range, size)
      if (!r) throw new RangeNotSatisfiableError(size)
      if (r.length === 0) {
        await fh.close()
        return { body: new ReadableStream({ start: (c) => c.close() }), size, offset: 0, length: 0, etag }
      }
      // The stream owns the handle from here (autoClose), so a rename/delete meanwhile is harmless.
      const stream = createReadStream('', {
        fd: fh,
        start: r.offset,
        end: r.offset + r.length - 1,
        highWaterMark: READ_PIECE_BYTES,
        signal: opts.signal,
      })
      return {
        body: Readable.toWeb(stream) as ReadableStream<Uint8Array>,
        size,
        offset: r.offset,
        length: r.length,
        etag,
      }
    } catch (e) {
      await fh.close().catch(() => {})
      throw e instanceof RangeNotSatisfiableError ? e : wrap(e, 'read')
    }
  }

  /**
   * A GET body reads ahead of its reader: the read stream's buffer (READ_PIECE_BYTES) and the
   * web stream's queue over it (as much again). Reserved in limits.maxHeldBytes while it is open.
   */
  getHoldBytes(length: number): number {
    return Math.min(length, 2 * READ_PIECE_BYTES)
  }

  async head(name: string): Promise<{ size: number; etag?: string } | undefined> {
    try {
      const st = await fsp.stat(this.#file(name))
      return { size: st.size, etag: fsEtag(st) }
    } catch (e) {
      if (isNotFound(e)) return undefined
      throw wrap(e, 'stat')
    }
  }

  async putIfAbsent(
    name: string,
    body: ReadableStream<Uint8Array> | Uint8Array,
    size: number,
  ): Promise<PutResult> {
    const file = this.#file(name)
    if (await this.head(name)) {
      if (!(body instanceof Uint8Array)) await body.cancel().catch(() => {})
      return 'exists'
    }
    const dir = path.dirname(file)
    let created: string | undefined
    let tmp: string | undefined
    let fh: fsp.FileHandle | undefined
    try {
      // The first directory mkdir made, if any: it and its parents' entries need an fsync too.
      created = await fsp.mkdir(dir, { recursive: true })
      tmp = path.join(dir, `${TMP_PREFIX}${randomBytes(8).toString('hex')}`)
      fh = await fsp.open(tmp, 'wx', 0o644)
      let written = 0
      if (body instanceof Uint8Array) {
        await writeAll(fh, body)
        written = body.length
      } else {
        const reader = body.getReader()
        for (;;) {
          const { done, value } = await reader.read()
          if (done) break
          written += value.length
          if (written > size) {
            await reader.cancel().catch(() => {})
            throw new InvalidArgumentError(`body is longer than the declared ${size} bytes`)
          }
          await writeAll(fh, value)
        }
      }
      if (written !== size) throw new InvalidArgumentError(`body ended at ${written} of ${size} bytes`)
      if (this.#fsync) await fh.sync()
      await fh.close()
      fh = undefined
    } catch (e) {
      await fh?.close().catch(() => {})
      if (tmp) await fsp.rm(tmp, { force: true }).catch(() => {})
      throw isErrno(e) ? wrap(e, 'write') : e
    }
    try {
      // link() refuses an existing target: the first writer wins, atomically.
      await fsp.link(tmp, file)
    } catch (e) {
      await fsp.rm(tmp, { force: true })
      if ((e as NodeJS.ErrnoException).code === 'EEXIST') return 'exists'
      throw wrap(e, 'link')
    }
    await fsp.rm(tmp, { force: true })
    if (this.#fsync) {
      try {
        await syncDir(dir)
        // Directories mkdir -p just made exist only once their parents' entries are on disk.
        if (created !== undefined) {
          for (let d = dir; d.length >= created.length && d !== path.dirname(d); d = path.dirname(d))
            await syncDir(path.dirname(d))
        }
      } catch (e) {
        throw wrap(e, 'fsync')
      }
    }
    return 'created'
  }

  async delete(name: string, opts: DeleteOptions = {}): Promise<boolean> {
    const file = this.#file(name)
    try {
      // Another version (re-created since the etag was read) stays; only a stat→unlink window is left.
      if (opts.ifMatch !== undefined && fsEtag(await fsp.stat(file)) !== opts.ifMatch) return false
      await fsp.unlink(file)
      return true
    } catch (e) {
      if (isNotFound(e)) return false
      throw wrap(e, 'unlink')
    }
  }

  async list(prefix: string, opts: { cursor?: string; limit?: number } = {}) {
    const limit = opts.limit ?? 1000
    const names: StoreEntry[] = []
    for await (const p of walk(this.root)) {
      const name = path.relative(this.root, p).split(path.sep).join('/')
      if (path.basename(p).startsWith(TMP_PREFIX) || !name.startsWith(prefix)) continue
      if (opts.cursor !== undefined && name <= opts.cursor) continue
      const st = await fsp.stat(p).catch(() => ({ size: -1, mtimeMs: 0 }))
      names.push({ name, size: st.size, modified: st.mtimeMs })
    }
    names.sort((a, b) => (a.name < b.name ? -1 : a.name > b.name ? 1 : 0))
    const entries = names.filter((e) => e.size >= 0).slice(0, limit)
    return names.length > limit ? { entries, cursor: entries[entries.length - 1]!.name } : { entries }
  }

  async stats() {
    let objects = 0
    let bytes = 0
    for await (const p of walk(this.root)) {
      if (path.basename(p).startsWith(TMP_PREFIX)) continue
      const st = await fsp.stat(p).catch(() => undefined)
      if (!st) continue
      objects++
      bytes += st.size
    }
    return { objects, bytes }
  }
}

async function* walk(dir: string): AsyncGenerator<string> {
  let entries: import('node:fs').Dirent[]
  try {
    entries = await fsp.readdir(dir, { withFileTypes: true })
  } catch (e) {
    if (isNotFound(e)) return
    throw e
  }
  for (const d of entries) {
    const p = path.join(dir, d.name)
    if (d.isDirectory()) yield* walk(p)
    else if (d.isFile()) yield p
  }
}

/**
 * write() may write less than asked (a disk filling up writes what fits and fails
 * only on the next call): loop, so a short write is never taken for a whole one.
 */
async function writeAll(fh: fsp.FileHandle, bytes: Uint8Array): Promise<void> {
  let at = 0
  while (at < bytes.length) {
    const { bytesWritten } = await fh.write(bytes, at, bytes.length - at)
    if (bytesWritten <= 0) {
      throw Object.assign(new Error('write made no progress'), { code: 'ENOSPC', syscall: 'write' })
    }
    at += bytesWritten
  }
}

/** A file's version: a re-created file gets another inode or mtime. */
function fsEtag(st: { ino: number; mtimeMs: number; size: number }): string {
  return `"${st.ino.toString(36)}-${Math.round(st.mtimeMs * 1000).toString(36)}-${st.size.toString(36)}"`
}

async function syncDir(dir: string): Promise<void> {
  const h = await fsp.open(dir, 'r')
  try {
    await h.sync()
  } finally {
    await h.close()
  }
}

function isNotFound(e: unknown): boolean {
  const code = (e as NodeJS.ErrnoException).code
  return code === 'ENOENT' || code === 'ENOTDIR'
}

function isErrno(e: unknown): boolean {
  return (
    typeof (e as NodeJS.ErrnoException)?.code === 'string' &&
    (e as NodeJS.ErrnoException).syscall !== undefined
  )
}

function wrap(e: unknown, op: string): StoreError {
  const code = (e as NodeJS.ErrnoException).code
  if (code === 'ENOSPC' || code === 'EDQUOT') {
    return new StoreError(`fs store ${op} failed: no space left on the store's device (${code})`, {
      code: 'ERR_STORE_FULL',
      status: 507,
      cause: e,
    })
  }
  return new StoreError(`fs store ${op} failed: ${code ?? (e as Error).message}`, { status: 500, cause: e })
}
