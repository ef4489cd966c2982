// Reading a YAML config file (Node only: kvgate serve, gc and agent, and the client's
// optionsFromEnvironment; not exported from kvgate/core, which must load in workerd).
// A config file is small and typed by a person, so anything odd about the bytes is a
// ConfigError naming the file: a huge file or an endless device must not be read whole
// (a hang, then a crash), and bytes that are not UTF-8 must not become U+FFFD in a
// directory name or a token hash.

import { closeSync, openSync, readSync } from 'node:fs'
import { parseDocument } from 'yaml'
import { ConfigError } from './errors.ts'

/** Larger config files are refused (the documented ones are a few KiB). */
export const MAX_CONFIG_FILE_BYTES = 1024 * 1024

/** Reads at most `max` + 1 bytes of `path` (pipes and process substitution work too). */
function readBounded(path: string, max: number): Buffer {
  const buf = Buffer.alloc(max + 1)
  let fd: number
  try {
    fd = openSync(path, 'r')
  } catch (e) {
    throw new ConfigError(`cannot read config file ${path}: ${(e as Error).message}`, { cause: e })
  }
  try {
    let n = 0
    while (n < buf.length) {
      const got = readSync(fd, buf, n, buf.length - n, null)
      if (got === 0) break
      n += got
    }
    return buf.subarray(0, n)
  } catch (e) {
    throw new ConfigError(`cannot read config file ${path}: ${(e as Error).message}`, { cause: e })
  } finally {
    closeSync(fd)
  }
}

/**
 * The top-level mapping of the YAML file at `path`, or undefined when the file holds no
 * document (empty, only comments). Throws a ConfigError naming the file for anything else:
 * too large, not UTF-8, YAML errors or warnings (unknown tags), too many aliases, or a
 * document that is not a mapping.
 */
export function readConfigFile(path: string): Record<string, unknown> | undefined {
  const bytes = readBounded(path, MAX_CONFIG_FILE_BYTES)
  if (bytes.length > MAX_CONFIG_FILE_BYTES)
    throw new ConfigError(
      `config file ${path} is larger than ${MAX_CONFIG_FILE_BYTES} bytes; is it the right file?`,
    )
  let text: string
  try {
    text = new TextDecoder('utf-8', { fatal: true }).decode(bytes)
  } catch (e) {
    throw new ConfigError(`config file ${path} is not UTF-8 text`, { cause: e })
  }
  let doc: unknown
  try {
    const parsed = parseDocument(text, { uniqueKeys: true })
    const problem = parsed.errors[0] ?? parsed.warnings[0]
    if (problem) throw problem
    // toJS expands aliases; its default maxAliasCount (100) stops an alias bomb.
    doc = parsed.toJS({ maxAliasCount: 100 })
  } catch (e) {
    throw new ConfigError(`cannot read config file ${path}: ${(e as Error).message}`, { cause: e })
  }
  if (doc === null || doc === undefined) return undefined
  if (typeof doc !== 'object' || Array.isArray(doc))
    throw new ConfigError(`config file ${path}: expected a mapping (key: value lines)`)
  return doc as Record<string, unknown>
}
