// How the client reaches the native addon: loaded once, and its absence (no
// build, no compiler) is a normal, reported condition rather than an error.

import * as native from './native.ts'

export type NativeModule = typeof native

export interface NativeLoad {
  api: NativeModule | undefined
  /** Why the addon is not usable. */
  reason: string | undefined
}

let cached: NativeLoad | undefined

/** The addon wrapper when the addon loads; never throws. */
export function loadNative(): NativeLoad {
  if (cached) return cached
  try {
    native.loadNative()
    cached = { api: native, reason: undefined }
  } catch (e) {
    // The whole message on one line: every path tried, why it failed, and the build command.
    const lines = (e as Error).message.split('\n').map((l) => l.trim().replace(/^- /, ''))
    cached = { api: undefined, reason: lines.filter((l) => l !== '').join(' | ') }
  }
  return cached
}
