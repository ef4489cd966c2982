// `kvgate token`: creates a random bearer token and prints the entry the gateway's token
// table needs (its SHA-256, never the token), as YAML for `kvgate serve` and JSON for KVGATE_TOKENS / R2 / SSM.

import { randomBytes } from 'node:crypto'
import { InvalidArgumentError } from '../../core/errors.ts'
import { isNamespaceName } from '../../core/keys.ts'
import { hashToken, type Scope, type TokenGrant } from '../../gateway/middleware/auth.ts'
import { parseCommandArgs } from '../args.ts'

const HELP = `Usage: kvgate token [options]

Creates a random bearer token and prints its entry for the gateway's token table.
The token is printed once (to stderr with --json); the gateway stores only its SHA-256.

Options:
  --name NAME            label in the gateway's logs [fleet]
  --scope SCOPE          read | write | admin (admin ⊇ write ⊇ read) [write]
  --namespaces LIST      comma-separated namespaces, or '*' for all [default]
  --token TOKEN          hash this token instead of creating one
  --json                 print {"token", "entry"} as JSON (entry: one element of KVGATE_TOKENS)
  -h, --help

Use the entry in the gateway's YAML (auth.tokens), in KVGATE_TOKENS (a JSON array),
in the Workers secret KVGATE_TOKENS (wrangler secret put) or in the Lambda's SSM parameter.
Give the token to clients as remote.token / KVGATE_REMOTE_TOKEN.`

const SCOPES: readonly Scope[] = ['read', 'write', 'admin']

export async function run(argv: string[]): Promise<number> {
  const { values, help } = parseCommandArgs(argv, {
    name: { type: 'string' },
    scope: { type: 'string' },
    namespaces: { type: 'string' },
    token: { type: 'string' },
    json: { type: 'boolean' },
  })
  if (help) {
    console.log(HELP)
    return 0
  }
  const scope = (values.scope ?? 'write') as Scope
  if (!SCOPES.includes(scope)) {
    throw new InvalidArgumentError(`--scope must be read, write or admin, got '${values.scope}'`)
  }
  const nsArg = values.namespaces ?? 'default'
  let namespaces: TokenGrant['namespaces'] = '*'
  if (nsArg !== '*') {
    namespaces = nsArg.split(',').map((s) => s.trim())
    const bad = namespaces.find((n) => !isNamespaceName(n))
    if (bad !== undefined) {
      throw new InvalidArgumentError(
        `--namespaces: '${bad}' is not a namespace name (lowercase [a-z0-9._-], 1..63)`,
      )
    }
  }
  if (values.token !== undefined && (values.token.length < 16 || /\s/.test(values.token))) {
    throw new InvalidArgumentError('--token must be at least 16 characters without whitespace')
  }
  // 32 random bytes: brute force of the stored hash is out of reach.
  const token = values.token ?? `kvg_${randomBytes(32).toString('base64url')}`
  const entry: TokenGrant = {
    name: values.name ?? 'fleet',
    sha256: await hashToken(token),
    scopes: scope,
    namespaces,
  }
  if (values.json) {
    console.log(JSON.stringify({ token, entry }))
    return 0
  }
  const ns = namespaces === '*' ? "'*'" : `[${namespaces.join(', ')}]`
  // Quoted unless plain: `ops: admin` or `a, scopes: admin` would break (or rewrite) the flow mapping.
  const yamlName = /^[A-Za-z0-9][A-Za-z0-9._-]*$/.test(entry.name!) ? entry.name : JSON.stringify(entry.name)
  console.log(`token (give it to clients; it is not stored anywhere):
  ${token}

gateway YAML (auth.tokens):
  - { name: ${yamlName}, sha256: ${entry.sha256}, scopes: ${scope}, namespaces: ${ns} }

KVGATE_TOKENS / Workers secret / SSM parameter (a JSON array of such entries):
  ${JSON.stringify([entry])}`)
  return 0
}
