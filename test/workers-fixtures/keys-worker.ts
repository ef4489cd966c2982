// A test-only Worker: computes chain keys inside workerd (WebCrypto path of
// src/core/keys.ts) for the cases POSTed to it, so the suite can compare with Node.

import { chainKeysAsync, type KeyNamespace, namespaceSeedAsync, toHex } from '../../src/core/keys.ts'

interface KeyCase {
  namespace: KeyNamespace
  tokens: number[]
  includePartial: boolean
}

export default {
  async fetch(request: Request): Promise<Response> {
    const cases = (await request.json()) as KeyCase[]
    const out = []
    for (const c of cases) {
      const seed = await namespaceSeedAsync(c.namespace)
      const keys = await chainKeysAsync(c.tokens, c.namespace, { includePartial: c.includePartial })
      out.push({
        namespaceId: toHex(seed.subarray(0, 16)),
        keys: keys.map((k) => k.hex),
        // Proves the sync node:crypto path is really absent here (no nodejs_compat).
        hasNodeCrypto: typeof (globalThis as { process?: unknown }).process !== 'undefined',
      })
    }
    return Response.json(out)
  },
}
