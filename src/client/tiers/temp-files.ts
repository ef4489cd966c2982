// L2 temp files (a chunk written before its rename): their names, and what a tier opening the
// directory makes of one it finds: a dead writer's leftover (deleted) or a live writer's (kept).

import { randomBytes } from 'node:crypto'
import { readFileSync, readlinkSync } from 'node:fs'
import { readFile, stat } from 'node:fs/promises'
import { hostname } from 'node:os'
import { threadId } from 'node:worker_threads'
import { crc32 } from '../../core/checksum.ts'

export const TMP_PREFIX = '.tmp-'

/**
 * A process's start time (clock ticks after boot, field 22 of /proc/<pid>/stat), or undefined
 * where there is no /proc: with its pid it names one process, not one that had the pid earlier.
 */
function startOf(stat: string): string | undefined {
  return stat.slice(stat.lastIndexOf(')') + 2).split(' ')[19]
}

function ownStart(): string {
  try {
    return startOf(readFileSync('/proc/self/stat', 'latin1')) ?? '0'
  } catch {
    return '0'
  }
}

async function startOfPid(pid: number): Promise<string | undefined> {
  try {
    return startOf(await readFile(`/proc/${pid}/stat`, 'latin1'))
  } catch {
    return undefined
  }
}

/** This process's start ('0' without /proc): the same in every thread, another after a restart with the same pid. */
const START = ownStart()

/**
 * Where this process's pids mean something: its hostname, boot and pid namespace. Pids and
 * start times are this namespace's only, so another's names (a directory shared across
 * containers or machines) are watched until unchanged a while (StaleTempWatch), even one
 * whose pid is this process's (every container's entrypoint is pid 1). The hostname alone
 * does not tell containers apart: a Kubernetes pod with hostNetwork, or `docker run
 * --hostname`, has the node's or a given name.
 */
const HOST = crc32(new TextEncoder().encode(pidSpace())).toString(16).padStart(8, '0')

function pidSpace(): string {
  const name = hostname()
  try {
    // `pid:[4026531836]`: one per namespace while the host runs; the boot id tells reboots apart.
    return `${name}\0${readFileSync('/proc/sys/kernel/random/boot_id', 'latin1').trim()}\0${readlinkSync('/proc/self/ns/pid')}`
  } catch {
    // No /proc (not Linux, or not mounted): the hostname is all there is.
    return name
  }
}

const WRITING = Symbol.for('kvgate.l2.writingTemps')
/**
 * Temp files this thread is writing (every tier of it, whichever copy of this module made
 * it: the set lives on the thread's global). Another thread of this process keeps its own,
 * invisible here: its names carry its thread id, so they are never judged by this one.
 */
const writing: Set<string> = threadWrites()

function threadWrites(): Set<string> {
  const g = globalThis as Record<symbol, unknown>
  const had = g[WRITING]
  if (had instanceof Set) return had as Set<string>
  const set = new Set<string>()
  g[WRITING] = set
  return set
}

/** `.tmp-<hex>-<pid>-<start>-t<thread>-h<host>-<random>` */
const NAME_RE = /-(\d+)-(\d+)-t(\d+)-h([0-9a-f]{8})-[0-9a-f]+$/
/** Names before the start and thread were in them: `.tmp-<hex>-<pid>-<random>`. */
const OLD_NAME_RE = /-(\d+)-[0-9a-f]+$/

/** Names a temp file for a write of chunk `hex` by this thread and marks it live until endTemp(). */
export function beginTemp(hex: string): string {
  const name = `${TMP_PREFIX}${hex}-${process.pid}-${START}-t${threadId}-h${HOST}-${randomBytes(4).toString('hex')}`
  writing.add(name)
  return name
}

export function endTemp(name: string): void {
  writing.delete(name)
}

/**
 * Who wrote a temp file found in the directory: 'gone' when its writer cannot be running (its
 * process is dead or was an earlier one with the pid, or it is this thread's and this thread
 * is not writing it), 'live' when this thread is writing it, undefined when that cannot be
 * told from here (another thread of this process, a live process, another host or container): the caller
 * watches it (StaleTempWatch), never judging it by its mtime.
 */
export async function tempWriter(name: string): Promise<'gone' | 'live' | undefined> {
  const m = NAME_RE.exec(name)
  if (m) {
    if (m[4] !== HOST) return undefined
    const pid = Number(m[1])
    if (pid === process.pid) {
      // Another start: a process that had this pid before (a container's entrypoint is pid 1 at every restart).
      if (m[2] !== START) return 'gone'
      if (Number(m[3]) !== threadId) return undefined
      return writing.has(name) ? 'live' : 'gone'
    }
    if (!processAlive(pid)) return 'gone'
    const start = await startOfPid(pid)
    return start !== undefined && m[2] !== '0' && start !== m[2] ? 'gone' : undefined
  }
  const old = OLD_NAME_RE.exec(name)
  if (!old) return undefined
  const pid = Number(old[1])
  // No writer of this version names a temp file so: with this pid, an earlier process's.
  if (pid === process.pid) return 'gone'
  return Number.isSafeInteger(pid) && pid > 0 && !processAlive(pid) ? 'gone' : undefined
}

/** Whether a process with this pid runs on this host (EPERM: it does, owned by someone else). */
function processAlive(pid: number): boolean {
  try {
    process.kill(pid, 0)
    return true
  } catch (e) {
    return (e as NodeJS.ErrnoException).code === 'EPERM'
  }
}

/** A temp file as seen: the same again a whole watch later means no writer touched it meanwhile. */
interface Seen {
  ino: number
  size: number
  mtimeMs: number
  ctimeMs: number
}

const MAX_TIMER_MS = 2 ** 31 - 1

/** A watched file: as last seen, and when (this process's monotonic clock, once that stat answered). */
interface Watched {
  seen: Seen
  at: number
}

/**
 * Temp files whose writer cannot be told from here (another host's or container's, a live
 * process's, another thread's): a file unchanged for `periodMs`, timed by this process's own
 * monotonic clock, is a stopped writer's leftover and discarded. Never its age by its mtime:
 * that is another clock (the writer's host's, or a network file system's server's), and an hour
 * of skew between them would delete a write in flight. At most `max` files are watched at once
 * (the rest wait for a later open); a file that changed is watched another period. Each file is
 * judged a whole period after it was last seen, not when the files watched before it are: one
 * found late in a long scan is not judged over the few milliseconds left of their period.
 */
export class StaleTempWatch {
  /** In the order they are due: each entry is (re)inserted when seen, with the same period. */
  readonly #watched = new Map<string, Watched>()
  readonly #periodMs: number
  readonly #max: number
  readonly #discard: (path: string) => Promise<void>
  #timer: NodeJS.Timeout | undefined
  #checking = false
  #closed = false

  constructor(periodMs: number, max: number, discard: (path: string) => Promise<void>) {
    this.#periodMs = periodMs
    this.#max = max
    this.#discard = discard
  }

  /** Files watched now. */
  get size(): number {
    return this.#watched.size
  }

  /** Watches `path` from now (a file that cannot be stat'ed, or one past `max`, is left alone). */
  async watch(path: string): Promise<void> {
    if (this.#closed || this.#watched.size >= this.#max || this.#watched.has(path)) return
    const now = await seen(path)
    if (now === undefined || this.#closed || this.#watched.size >= this.#max || this.#watched.has(path))
      return
    this.#watched.set(path, { seen: now, at: performance.now() })
    this.#arm()
  }

  close(): void {
    this.#closed = true
    clearTimeout(this.#timer)
    this.#timer = undefined
    this.#watched.clear()
  }

  /** A timer for the first file due (none while a check runs: it arms one when done). */
  #arm(): void {
    if (this.#timer !== undefined || this.#checking || this.#closed) return
    const first = this.#watched.values().next()
    if (first.done) return
    // Node fires a timer over 2^31 - 1 ms at once: a longer period is waited for in steps.
    const wait = Math.min(MAX_TIMER_MS, Math.max(0, first.value.at + this.#periodMs - performance.now()))
    this.#timer = setTimeout(() => void this.#check(), wait)
    this.#timer.unref()
  }

  async #check(): Promise<void> {
    this.#timer = undefined
    this.#checking = true
    try {
      for (const [path, before] of [...this.#watched]) {
        // Due in order: the first not due yet ends this check (the next timer is for it).
        if (performance.now() - before.at < this.#periodMs) break
        const now = await seen(path)
        if (this.#closed) return
        this.#watched.delete(path)
        if (now === undefined) continue // renamed (the write finished) or deleted
        if (same(before.seen, now)) await this.#discard(path)
        else this.#watched.set(path, { seen: now, at: performance.now() }) // changed: another period, due last
        if (this.#closed) return
      }
    } finally {
      this.#checking = false
    }
    this.#arm()
  }
}

async function seen(path: string): Promise<Seen | undefined> {
  try {
    const s = await stat(path)
    if (!s.isFile()) return undefined
    return { ino: s.ino, size: s.size, mtimeMs: s.mtimeMs, ctimeMs: s.ctimeMs }
  } catch {
    return undefined
  }
}

function same(a: Seen, b: Seen): boolean {
  return a.ino === b.ino && a.size === b.size && a.mtimeMs === b.mtimeMs && a.ctimeMs === b.ctimeMs
}
