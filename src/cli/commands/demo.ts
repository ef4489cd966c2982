// `kvgate demo`: kvgate's main job on the embedded default — two node processes share
// a prompt's KV through a local gateway on the fs store; exits non-zero when a check fails.

import { InvalidArgumentError } from '../../core/errors.ts'
import { renderDemo } from '../../demo/report.ts'
import { runDemo } from '../../demo/run.ts'
import type { DemoCodec } from '../../demo/types.ts'
import { parseCommandArgs } from '../args.ts'

const HELP = `Usage: kvgate demo [options]

Starts a gateway on the fs store (127.0.0.1, random port) and two client "nodes" as
separate processes with their own L1 (memory) and L2 (disk) tiers. Node A prefills a
prompt and stores its KV; node B, cold, looks it up and retrieves it through the
gateway, recomputes only the partial tail and continues generating.

With the model files (stories260K.bin + tok512.bin in --model DIR, $KVGATE_SHARED_DATA
or ../shared/data) the nodes run the TypeScript forward pass and node B's continuation
must match node A's (identical with --codec lossless; ≥ 99% teacher-forced next-token
agreement with the lossy kvgate codec). Without them the KV is synthetic
Llama-3.1-8B-shaped KV, checked byte for byte (lossless) or against an error bound.

Options:
      --codec C          L4 codec: kvgate (lossy, default) | lossless
      --model DIR        directory with stories260K.bin and tok512.bin
      --synthetic        use synthetic 8B-shaped KV even when the model is there
      --chunk-tokens N   tokens per chunk [64 with the model, 256 synthetic]
      --chunks N         synthetic: whole chunks in the prompt [3]
      --dir DIR          work directory (store, L2 dirs), kept afterwards [a temp dir]
      --keep             keep the temp work directory
      --gateway-down     failure injection: stop the gateway before node B starts
      --json             print the full result as JSON (progress goes to stderr)
  -h, --help

Exit status: 0 when every check passes, 1 when one fails, 2 on bad usage.`

export async function run(argv: string[]): Promise<number> {
  try {
    return await demo(argv)
  } catch (e) {
    if (!(e instanceof InvalidArgumentError)) throw e
    console.error(`kvgate demo: ${e.message}`)
    return 2
  }
}

async function demo(argv: string[]): Promise<number> {
  const { values, help } = parseCommandArgs(argv, {
    codec: { type: 'string' },
    model: { type: 'string' },
    synthetic: { type: 'boolean' },
    'chunk-tokens': { type: 'string' },
    chunks: { type: 'string' },
    dir: { type: 'string' },
    keep: { type: 'boolean' },
    'gateway-down': { type: 'boolean' },
    json: { type: 'boolean' },
  })
  if (help) {
    console.log(HELP)
    return 0
  }
  const codec = (values.codec ?? 'kvgate') as DemoCodec
  if (codec !== 'kvgate' && codec !== 'lossless') {
    throw new InvalidArgumentError(`invalid --codec '${codec}' (kvgate or lossless)`)
  }
  const json = values.json === true
  // With --json, stdout carries only the JSON document.
  const say = (line: string) => (json ? process.stderr.write(`${line}\n`) : process.stdout.write(`${line}\n`))
  const result = await runDemo({
    codec,
    ...(values.model !== undefined ? { modelDir: values.model } : {}),
    synthetic: values.synthetic === true,
    ...(values['chunk-tokens'] !== undefined
      ? { chunkTokens: positiveInt('--chunk-tokens', values['chunk-tokens']) }
      : {}),
    ...(values.chunks !== undefined ? { chunks: positiveInt('--chunks', values.chunks) } : {}),
    ...(values.dir !== undefined ? { dir: values.dir } : {}),
    keep: values.keep === true || values.dir !== undefined,
    gatewayDown: values['gateway-down'] === true,
    onStep: say,
    onDetail: say,
  })
  if (json) process.stdout.write(`${JSON.stringify(result, null, 2)}\n`)
  else say(renderDemo(result))
  return result.ok ? 0 : 1
}

function positiveInt(flag: string, v: string): number {
  const n = Number(v)
  if (!/^\d+$/.test(v) || !Number.isSafeInteger(n) || n < 1) {
    throw new InvalidArgumentError(`invalid ${flag} '${v}': a positive integer`)
  }
  return n
}
