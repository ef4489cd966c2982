// Runs an async step over many items with a bound on how many run at once.

/**
 * Calls `fn` for each item, at most `limit` at once, in order of start. Settles only once
 * every started call has (no call still runs after it returns or throws), then rejects with
 * the first failure, if any. Calls after a failure still start: items are independent.
 */
export async function eachBounded<T>(
  items: readonly T[],
  limit: number,
  fn: (item: T) => Promise<unknown>,
): Promise<void> {
  let next = 0
  const worker = async () => {
    while (next < items.length) await fn(items[next++]!)
  }
  const done = await Promise.allSettled(Array.from({ length: Math.min(limit, items.length) }, worker))
  for (const r of done) if (r.status === 'rejected') throw r.reason
}
