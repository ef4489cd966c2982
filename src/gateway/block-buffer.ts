// Gathers small stream pieces (16–64 KiB socket reads) into blocks of ~1 MiB.
// Every piece that crosses a web stream, a promise or a syscall costs a fixed
// overhead; one memcpy into a block is far cheaper than thousands of those.

export const BLOCK_BYTES = 1024 * 1024

export class BlockBuffer {
  #block: Uint8Array | undefined
  #at = 0
  constructor(readonly blockBytes = BLOCK_BYTES) {}

  /** Adds a piece; returns the blocks it completed (zero or more). */
  push(piece: Uint8Array): Uint8Array[] {
    // A piece as large as a block passes through untouched when nothing is pending.
    if (this.#at === 0 && piece.length >= this.blockBytes) return [piece]
    const out: Uint8Array[] = []
    let rest = piece
    while (rest.length > 0) {
      this.#block ??= new Uint8Array(this.blockBytes)
      const take = Math.min(rest.length, this.blockBytes - this.#at)
      this.#block.set(rest.subarray(0, take), this.#at)
      this.#at += take
      rest = rest.subarray(take)
      if (this.#at === this.blockBytes) {
        out.push(this.#block)
        this.#block = undefined
        this.#at = 0
      }
    }
    return out
  }

  /** The partial block, if any, at the end of the stream. */
  flush(): Uint8Array | undefined {
    if (this.#at === 0) return undefined
    const last = this.#block!.subarray(0, this.#at)
    this.#block = undefined
    this.#at = 0
    return last
  }
}
