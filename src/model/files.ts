// Node-only: finds the shared model files (never committed to the repo) and loads
// them. Everything else in src/model works on bytes and runs in any runtime.

import { existsSync, readFileSync, statSync } from 'node:fs'
import { join, resolve } from 'node:path'
import { installedAsDependency, packageRoot } from '../package-files.ts'
import { Transformer } from './forward.ts'
import { type LlamaCheckpoint, type ParseCheckpointOptions, parseLlama2c } from './llama2c.ts'
import { ModelError } from './model-error.ts'
import { parseTokenizer, type Tokenizer } from './tokenizer.ts'

export const MODEL_FILE = 'stories260K.bin'
export const TOKENIZER_FILE = 'tok512.bin'

export interface SharedDataPaths {
  /** The directory holding both files. */
  dir: string
  /** stories260K.bin */
  model: string
  /** tok512.bin */
  tokenizer: string
}

export type SharedDataLookup =
  | { paths: SharedDataPaths; reason?: undefined }
  | { paths: undefined; reason: string }

/**
 * Locates the shared model data: $KVGATE_SHARED_DATA (or the demo's --model), else
 * ../shared/data beside the checkout. No machine's absolute path is guessed. `paths` is
 * undefined when neither holds both files, and `reason` says where it looked (tests print it when they skip).
 */
export function findSharedData(
  env: Record<string, string | undefined> = process.env,
  besideCheckout = !installedAsDependency(),
): SharedDataLookup {
  const candidates: string[] = []
  if (env.KVGATE_SHARED_DATA) candidates.push(resolve(env.KVGATE_SHARED_DATA))
  // Beside a checkout only: under node_modules, ../shared would be another package.
  if (besideCheckout) candidates.push(resolve(packageRoot(), '..', 'shared', 'data'))
  const tried: string[] = []
  for (const dir of candidates) {
    const model = join(dir, MODEL_FILE)
    const tokenizer = join(dir, TOKENIZER_FILE)
    if (existsSync(model) && existsSync(tokenizer)) return { paths: { dir, model, tokenizer } }
    tried.push(dir)
    // An explicit setting that is wrong is reported, not silently replaced by a fallback.
    if (env.KVGATE_SHARED_DATA && dir === candidates[0]) {
      return {
        paths: undefined,
        reason: `KVGATE_SHARED_DATA=${dir} has no ${MODEL_FILE} + ${TOKENIZER_FILE}`,
      }
    }
  }
  // Installed as a dependency with no KVGATE_SHARED_DATA, nothing was tried: say so rather than "not found in ".
  const where =
    tried.length > 0 ? `not found in ${tried.join(', ')}` : 'not looked for (no checkout beside this install)'
  return {
    paths: undefined,
    reason: `model data (${MODEL_FILE}, ${TOKENIZER_FILE}) ${where}; set KVGATE_SHARED_DATA (or pass --model DIR)`,
  }
}

function readBounded(path: string, maxBytes: number, what: string): Uint8Array {
  let size: number
  try {
    size = statSync(path).size
  } catch (e) {
    throw new ModelError(`${what}: cannot read ${path}: ${(e as Error).message}`, { cause: e })
  }
  if (size > maxBytes)
    throw new ModelError(`${what}: ${path} is ${size} bytes, above the limit of ${maxBytes}`)
  return new Uint8Array(readFileSync(path))
}

export function loadCheckpointFile(path: string, opts: ParseCheckpointOptions = {}): LlamaCheckpoint {
  return parseLlama2c(readBounded(path, opts.maxBytes ?? 2 ** 31, 'llama2.c checkpoint'), opts)
}

export function loadTokenizerFile(path: string, vocabSize?: number): Tokenizer {
  return parseTokenizer(
    readBounded(path, 64 << 20, 'tokenizer'),
    vocabSize === undefined ? {} : { vocabSize },
  )
}

export interface LoadedModel {
  checkpoint: LlamaCheckpoint
  tokenizer: Tokenizer
  transformer: Transformer
  paths: SharedDataPaths
}

let cached: LoadedModel | undefined

/** Loads stories260K + its tokenizer from the shared data (memoized per process). */
export function loadStories260k(paths?: SharedDataPaths): LoadedModel {
  if (!paths && cached) return cached
  let p = paths
  if (!p) {
    const found = findSharedData()
    if (!found.paths) throw new ModelError(found.reason)
    p = found.paths
  }
  const checkpoint = loadCheckpointFile(p.model)
  const tokenizer = loadTokenizerFile(p.tokenizer, checkpoint.config.vocabSize)
  const loaded = { checkpoint, tokenizer, transformer: new Transformer(checkpoint), paths: p }
  if (!paths) cached = loaded
  return loaded
}
