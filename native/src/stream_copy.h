// Copies whose destination is not read back soon (a chunk's blocks, a verified range landing
// in the caller's buffer): non-temporal stores, so the copy writes memory without first reading
// every destination line. Shared by the agent's block copies (mmap.cc) and L2 reads (io.cc).
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvgate {

// memcpy with streaming stores (AVX2 where the CPU has it, checked once at run time; SSE2;
// else memcpy). The caller issues _mm_sfence once after its copies, before another thread
// may read the bytes: streaming stores are weakly ordered.
void StreamCopy(uint8_t* dst, const uint8_t* src, size_t n);

}  // namespace kvgate
