// Asserting the native wrapper's typed errors. native.ts reads its environment
// (KVGATE_CUDART, KVGATE_NATIVE_PATH) only when first called, so importing it
// here, before a test file sets them, changes nothing.

import { expect } from 'vitest'
import { NativeError } from '../../src/client/native.ts'

/** Awaits `p` (or calls it) and asserts it failed with a NativeError of `code` (and `message`). */
export async function rejectsWith(
  p: Promise<unknown> | (() => unknown),
  code: string,
  message?: RegExp,
): Promise<NativeError> {
  let err: unknown
  try {
    await (typeof p === 'function' ? p() : p)
  } catch (e) {
    err = e
  }
  expect(err, 'expected an error').toBeInstanceOf(NativeError)
  expect((err as NativeError).code).toBe(code)
  if (message) expect((err as Error).message).toMatch(message)
  return err as NativeError
}
