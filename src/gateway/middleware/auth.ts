// Bearer-token auth with read/write/admin scopes per namespace. Tokens are kept as
// SHA-256 hashes; a presented token is hashed (WebCrypto) and compared in constant
// time against every grant, so neither the token nor the match position leaks.

import type { Context, MiddlewareHandler } from 'hono'
import { KvgateError } from '../../core/errors.ts'
import type { GatewayEnv } from '../env.ts'

export type Scope = 'read' | 'write' | 'admin'
const RANK: Record<Scope, number> = { read: 1, write: 2, admin: 3 }

export interface TokenGrant {
  /** Label for logs (never the token). */
  name?: string
  /** Hex SHA-256 of the token (`printf %s "$TOKEN" | sha256sum`). */
  sha256: string
  /** Highest scope: admin ⊇ write ⊇ read. A list is accepted; its highest entry counts. */
  scopes: Scope | Scope[]
  /** Namespaces this token may touch, or '*' for all. */
  namespaces: string[] | '*'
}

export interface AuthOptions {
  tokens: TokenGrant[]
  /** Serve /metrics and the status page without a token. @default false */
  publicStatus?: boolean
}

export interface Grant {
  name: string
  rank: number
  namespaces: Set<string> | '*'
}

interface CompiledGrant extends Grant {
  hash: Uint8Array
}

export function compileGrants(tokens: TokenGrant[]): CompiledGrant[] {
  if (!Array.isArray(tokens)) throw new TypeError('auth.tokens must be an array')
  return tokens.map((t, i) => {
    if (typeof t?.sha256 !== 'string' || !/^[0-9a-fA-F]{64}$/.test(t.sha256)) {
      throw new TypeError(`auth.tokens[${i}].sha256 must be 64 hex characters (the SHA-256 of the token)`)
    }
    const scopes = Array.isArray(t.scopes) ? t.scopes : [t.scopes]
    if (scopes.length === 0 || !scopes.every((s) => s in RANK)) {
      throw new TypeError(`auth.tokens[${i}].scopes must be read, write or admin`)
    }
    if (
      t.namespaces !== '*' &&
      (!Array.isArray(t.namespaces) || t.namespaces.some((n) => typeof n !== 'string'))
    ) {
      throw new TypeError(`auth.tokens[${i}].namespaces must be '*' or a list of namespace names`)
    }
    const hash = new Uint8Array(32)
    for (let j = 0; j < 32; j++) hash[j] = Number.parseInt(t.sha256.slice(j * 2, j * 2 + 2), 16)
    return {
      name: t.name ?? `token-${i}`,
      rank: Math.max(...scopes.map((s) => RANK[s])),
      namespaces: t.namespaces === '*' ? '*' : new Set(t.namespaces),
      hash,
    }
  })
}

/** Hex SHA-256 of a token, as stored in config. */
export async function hashToken(token: string): Promise<string> {
  const d = new Uint8Array(await crypto.subtle.digest('SHA-256', new TextEncoder().encode(token)))
  return [...d].map((b) => b.toString(16).padStart(2, '0')).join('')
}

function unauthorized(message: string): KvgateError {
  return new KvgateError('ERR_UNAUTHORIZED', message, { status: 401 })
}

/** Resolves the bearer token to a grant (c.var.grant); no grants configured = auth off. */
export function bearerAuth(opts: AuthOptions | undefined): MiddlewareHandler<GatewayEnv> {
  const grants = compileGrants(opts?.tokens ?? [])
  return async (c, next) => {
    if (grants.length === 0) {
      c.set('grant', { name: 'anonymous', rank: RANK.admin, namespaces: '*' })
      return next()
    }
    const header = c.req.header('authorization')
    if (header !== undefined) {
      const m = /^Bearer +([\x21-\x7e]{1,512})$/i.exec(header)
      if (!m) throw unauthorized('malformed Authorization header: expected "Bearer <token>"')
      const presented = new Uint8Array(await crypto.subtle.digest('SHA-256', new TextEncoder().encode(m[1]!)))
      let found: CompiledGrant | undefined
      for (const g of grants) {
        let diff = 0
        for (let i = 0; i < 32; i++) diff |= g.hash[i]! ^ presented[i]!
        // No early exit: every grant is compared whatever matched.
        if (diff === 0 && found === undefined) found = g
      }
      if (!found) throw unauthorized('invalid token')
      c.set('grant', found)
    }
    return next()
  }
}

/** True when auth is off (no tokens configured). */
export function authEnabled(opts: AuthOptions | undefined): boolean {
  return (opts?.tokens.length ?? 0) > 0
}

/** Throws 401/403 unless the request's grant has `scope` on namespace `ns` ('*' = global). */
export function authorize(c: Context<GatewayEnv>, ns: string | '*', scope: Scope): void {
  const g = c.get('grant')
  if (!g) throw unauthorized('missing bearer token')
  if (g.rank < RANK[scope])
    throw new KvgateError('ERR_FORBIDDEN', `token lacks the ${scope} scope`, { status: 403 })
  const nsOk = g.namespaces === '*' || (ns !== '*' && g.namespaces.has(ns))
  if (!nsOk) throw new KvgateError('ERR_FORBIDDEN', `token is not valid for namespace ${ns}`, { status: 403 })
}
