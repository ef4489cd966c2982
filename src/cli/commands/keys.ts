// `kvgate keys`: prints the chained prefix keys of a token list, so operators can
// check that two nodes (or kvgate and vLLM) derive the same keys for a prompt.

import { readFileSync } from 'node:fs'
import { InvalidArgumentError } from '../../core/errors.ts'
import { chainKeys, type KeyScheme, namespaceId } from '../../core/keys.ts'
import { MODEL_PRESETS, type PresetName, resolveGeometry } from '../../core/layout.ts'
import { parseCommandArgs } from '../args.ts'

const HELP = `Usage: kvgate keys [--model <preset>] [--chunk-tokens N] [--scheme S] [--hash-seed S]
                   [--partial] [--json] (--tokens 1,2,3 | --file tokens.json | --file -)

Prints the chain key of every chunk of a token list.

Options:
  --model <preset>     ${Object.keys(MODEL_PRESETS).join(', ')} (default llama-3.1-8b)
  --chunk-tokens <n>   tokens per chunk (default 256)
  --scheme <s>         sha256-v1 (default) or vllm-sha256-cbor
  --hash-seed <s>      extra seed (sha256-v1) or vLLM's PYTHONHASHSEED (vllm-sha256-cbor)
  --partial            also key a trailing partial chunk
  --tokens <list>      comma-separated token ids
  --file <path>        a JSON array of token ids ('-' reads standard input)
  --json               print JSON
  -h, --help           show this help`

function parseTokens(text: string, flag: string): number[] {
  const trimmed = text.trim()
  let values: unknown
  if (trimmed.startsWith('[')) {
    try {
      values = JSON.parse(trimmed)
    } catch (e) {
      throw new InvalidArgumentError(`${flag}: not a JSON array (${(e as Error).message})`)
    }
  } else
    values = trimmed
      .split(/[\s,]+/)
      .filter(Boolean)
      .map(Number)
  if (!Array.isArray(values))
    throw new InvalidArgumentError(`${flag}: tokens must be a JSON array or a comma-separated list`)
  return values as number[]
}

export async function run(argv: string[]): Promise<number> {
  const { values, help } = parseCommandArgs(argv, {
    model: { type: 'string' },
    'chunk-tokens': { type: 'string' },
    scheme: { type: 'string' },
    'hash-seed': { type: 'string' },
    partial: { type: 'boolean' },
    tokens: { type: 'string' },
    file: { type: 'string' },
    json: { type: 'boolean' },
  })
  if (help) {
    console.log(HELP)
    return 0
  }
  const preset = resolveGeometry((values.model ?? 'llama-3.1-8b') as PresetName)
  const chunkTokens = Number(values['chunk-tokens'] ?? 256)
  let tokens: number[]
  if (values.tokens !== undefined) tokens = parseTokens(values.tokens, '--tokens')
  else if (values.file !== undefined)
    tokens = parseTokens(readFileSync(values.file === '-' ? 0 : values.file, 'utf8'), '--file')
  else {
    console.error('kvgate keys: give --tokens or --file (see --help)')
    return 2
  }
  const ns = {
    modelId: preset.modelId,
    geometry: preset,
    chunkTokens,
    scheme: (values.scheme ?? 'sha256-v1') as KeyScheme,
    ...(values['hash-seed'] !== undefined ? { hashSeed: values['hash-seed'] } : {}),
  }
  const keys = chainKeys(tokens, ns, { includePartial: values.partial === true })
  if (values.json) {
    console.log(
      JSON.stringify(
        {
          namespaceId: namespaceId(ns),
          keys: keys.map(({ index, start, end, hex, partial }) => ({ index, start, end, key: hex, partial })),
        },
        null,
        2,
      ),
    )
  } else {
    console.log(`namespace ${namespaceId(ns)} (${preset.modelId}, ${chunkTokens}-token chunks, ${ns.scheme})`)
    // Ranges padded to the widest, so the keys line up in one column.
    const range = (k: (typeof keys)[number]) => `[${k.start}, ${k.end})`
    const width = Math.max(0, ...keys.map((k) => range(k).length))
    for (const k of keys)
      console.log(
        `${String(k.index).padStart(5)}  ${range(k).padEnd(width)}  ${k.hex}${k.partial ? '  partial' : ''}`,
      )
    if (keys.length === 0)
      console.log(`no full chunk in ${tokens.length} tokens (use --partial to key the tail)`)
  }
  return 0
}
