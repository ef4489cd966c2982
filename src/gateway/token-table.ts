// The gateway's token table schema (valibot; Node, Lambda and workerd alike): hashes with
// scopes and namespaces, unknown keys rejected, so a typo can never leave a gateway without auth.

import * as v from 'valibot'
import { parseConfig } from '../core/config-check.ts'
import { ConfigError } from '../core/errors.ts'
import { isNamespaceName } from '../core/keys.ts'
import type { TokenGrant } from './middleware/auth.ts'

const SCOPE = v.picklist(['read', 'write', 'admin'], 'expected read, write or admin')

export const TokenGrantSchema = v.strictObject({
  name: v.optional(v.string()),
  sha256: v.pipe(
    v.string('expected the 64-hex SHA-256 of the token'),
    v.regex(/^[0-9a-f]{64}$/i, 'expected the 64-hex SHA-256 of the token (kvgate token prints it)'),
  ),
  scopes: v.union(
    [SCOPE, v.pipe(v.array(SCOPE), v.minLength(1, 'at least one scope'))],
    'expected read, write or admin',
  ),
  namespaces: v.union(
    [
      v.literal('*'),
      v.array(
        v.pipe(
          v.string(),
          v.check((n: string) => isNamespaceName(n), 'not a namespace name (lowercase [a-z0-9._-], 1..63)'),
        ),
      ),
    ],
    "expected '*' or a list of namespace names",
  ),
})

export const TokenTableSchema = v.array(
  TokenGrantSchema,
  'expected a non-empty JSON array (a YAML list) of {name, sha256, scopes, namespaces}',
)

/** Parses a JSON token table (KVGATE_TOKENS, an SSM parameter); errors name `source` and the entry. */
export function parseTokenTable(json: string, source: string, requireEntries = true): TokenGrant[] {
  let doc: unknown
  try {
    doc = JSON.parse(json)
  } catch (e) {
    throw new ConfigError(`${source} is not valid JSON (kvgate token prints an entry)`, { cause: e })
  }
  const tokens = parseConfig(TokenTableSchema, doc, source) as TokenGrant[]
  if (requireEntries && tokens.length === 0) {
    throw new ConfigError(`${source} must be a non-empty JSON array of {name, sha256, scopes, namespaces}`)
  }
  return tokens
}
