// List prices (FACTS.md, 2026-11) for turning request counts and stored bytes
// into dollars; every figure the fleet report prints names its source here.

export interface PriceSheet {
  name: string
  storagePerGbMonth: number
  /** PUT, COPY, POST, LIST (S3) / Class A (R2), per 1,000 requests. */
  writePer1k: number
  /** GET, HEAD (S3) / Class B (R2), per 1,000 requests. */
  readPer1k: number
  egressPerGb: number
}

export const PRICES: Readonly<Record<'s3-standard' | 'r2', PriceSheet>> = {
  's3-standard': {
    name: 'S3 Standard',
    storagePerGbMonth: 0.023,
    writePer1k: 0.005,
    readPer1k: 0.0004,
    egressPerGb: 0,
  },
  r2: {
    name: 'Cloudflare R2',
    storagePerGbMonth: 0.015,
    writePer1k: 0.0045,
    readPer1k: 0.00036,
    egressPerGb: 0,
  },
}

export interface RequestCounts {
  put: number
  get: number
  head: number
  list: number
}

export function requestCost(c: RequestCounts, p: PriceSheet): number {
  return ((c.put + c.list) / 1000) * p.writePer1k + ((c.get + c.head) / 1000) * p.readPer1k
}

export function storageCostPerMonth(bytes: number, p: PriceSheet): number {
  return (bytes / 1e9) * p.storagePerGbMonth
}
