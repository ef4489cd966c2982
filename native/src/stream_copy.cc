// Streaming-store copies (stream_copy.h).
#include "stream_copy.h"

#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#include <immintrin.h>
#endif

namespace kvgate {

// memcpy with non-temporal stores. A chunk's blocks (32 KiB runs of a 32 MiB chunk) are far
// larger than the cache in total and are not read back soon: ordinary stores read every
// destination line first (read-for-ownership), a third more memory traffic, which is why
// glibc streams only single copies above ~3/4 of the LLC and 1024 block copies ran at
// 0.65-0.8x one big memcpy. The caller issues _mm_sfence once after its runs.
// Loads are prefetched kPrefetchBytes ahead: an engine's shm KV has 4 KiB pages (tmpfs without
// huge pages), where the hardware prefetcher stops, and a 32 KiB block is 8 of them: the next
// page's first lines are asked for before the loop reaches it (a save's copy 5-7 % faster on 2
// threads, a load's 1-7 %, interleaved with the build without; 2 KiB ahead was slower). A
// prefetch never faults: one past the run's end, or the mapping's, is dropped.
constexpr size_t kPrefetchBytes = 512;

#if defined(__x86_64__)
// StreamCopy with 32-byte loads and streaming stores, where the CPU has AVX2 (checked once at
// run time: the addon is built for any x86-64). 8-11 % faster than the SSE2 loop on a
// save-shaped copy, 0-7 % on a load's (in-process, the two builds interleaved, 1 and 2 threads).
namespace {

__attribute__((target("avx2"))) void StreamCopyAvx2(uint8_t* dst, const uint8_t* src, size_t n) {
  size_t head = (32 - (reinterpret_cast<uintptr_t>(dst) & 31)) & 31;
  if (head > n) head = n;
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  for (; n >= 128; n -= 128, dst += 128, src += 128) {
    _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchBytes), _MM_HINT_NTA);
    _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchBytes + 64), _MM_HINT_NTA);
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32));
    __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 64));
    __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 96), d);
  }
  std::memcpy(dst, src, n);
}
}  // namespace
#endif

void StreamCopy(uint8_t* dst, const uint8_t* src, size_t n) {
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2) {
    StreamCopyAvx2(dst, src, n);
    return;
  }
#endif
#if defined(__SSE2__)
  size_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;
  if (head > n) head = n;
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(src + i + kPrefetchBytes), _MM_HINT_NTA);
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  std::memcpy(dst + i, src + i, n - i);
#else
  std::memcpy(dst, src, n);
#endif
}

}  // namespace kvgate
