// A chunk's validator and the conditional requests it answers (RFC 9110 §8.8.3, §13.1).
// The ETag is derived from the stored bytes' own header, never from the store's ETag (an S3
// multipart upload's differs from a single PUT's of the same bytes; fs, R2 and memory each have
// their own), so every gateway instance, runtime and restart gives the same bytes the same tag.

import type { CachedHeader } from './context.ts'

/**
 * `"kv<format version>-<size hex>-<header CRC hex>"`: the header CRC covers every header field
 * (chain key, namespace id, codec, geometry) and every section's CRC, so two different objects
 * stored under one key (a lossy re-encode after a DELETE) differ in it. Strong: chunk objects are
 * create-only, so bytes under one tag never change. A `?layers=a-b` answer is another
 * representation (the header, then some sections): its tag adds `;layers=a-b`.
 */
export function chunkETag(entry: CachedHeader, layers?: { first: number; last: number }): string {
  const b = entry.bytes
  const crc = new DataView(b.buffer, b.byteOffset, b.byteLength).getUint32(b.length - 4, true)
  const base = `kv${entry.header.formatVersion}-${entry.size.toString(16)}-${crc.toString(16).padStart(8, '0')}`
  return layers ? `"${base};layers=${layers.first}-${layers.last}"` : `"${base}"`
}

/** The entity tags an If-None-Match / If-Range value lists (quoted, weak ones keep their `W/`). */
function entityTags(value: string): string[] {
  return value.match(/(?:W\/)?"[^"]*"/g) ?? []
}

/**
 * True when If-None-Match `value` names the current representation `etag` (weak comparison,
 * §13.1.2; `*` names any): a GET or HEAD then answers 304.
 */
export function matchesNoneMatch(value: string | undefined, etag: string): boolean {
  if (value === undefined) return false
  if (value.trim() === '*') return true
  return entityTags(value).some((t) => (t.startsWith('W/') ? t.slice(2) : t) === etag)
}

/**
 * True when a Range request's If-Range `value` still holds for `etag` (§13.1.5): a strong match
 * of one entity tag. A date never holds (chunks carry no Last-Modified: it differs between
 * stores for the same bytes), nor does any tag when the current one is unknown: the whole
 * object is sent instead of the range.
 */
export function ifRangeHolds(value: string, etag: string | undefined): boolean {
  const tags = entityTags(value.trim())
  return etag !== undefined && tags.length === 1 && tags[0] === value.trim() && tags[0] === etag
}
