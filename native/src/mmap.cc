// File mappings as external ArrayBuffers: an engine's KV tensor in /dev/shm seen as
// memory, so the agent copies scattered blocks without one syscall per block.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <cerrno>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "common.h"

namespace kvgate {

namespace {

// One mmap. `base`/`mapped` are the page-aligned region munmap needs; `data` is
// where the caller's offset lands inside it.
struct Mapping {
  void* base = nullptr;
  size_t mapped = 0;
  uint8_t* data = nullptr;
  size_t length = 0;
  bool unmapped = false;  // by unmapFile; the finalizer then only deletes the record
};

std::mutex g_mu;
std::unordered_map<void*, Mapping*> g_maps;  // by data pointer, for unmapFile and stats
size_t g_liveBytes = 0;

constexpr size_t kMaxExternal = size_t(1) << 32;  // Node's cap on an external ArrayBuffer

void Release(Mapping* m) {
  munmap(m->base, m->mapped);
  m->unmapped = true;
  g_liveBytes -= m->length;
}

void FinalizeMapping(Napi::Env, void*, Mapping* m) {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (!m->unmapped) {
      auto it = g_maps.find(m->data);
      if (it != g_maps.end() && it->second == m) g_maps.erase(it);
      Release(m);
    }
  }
  delete m;
}

// mapFile(path, offset, length, writable) -> ArrayBuffer. JS has validated the
// shapes; the size is re-checked here against fstat of the opened file (the
// authority: the file may have changed since JS looked).
Napi::Value MapFile(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (!info[0].IsString()) ThrowNative(env, "path must be a string");
  std::string path = info[0].As<Napi::String>().Utf8Value();
  size_t offset = ToSize(env, info[1], "offset");
  size_t length = ToSize(env, info[2], "length");
  bool writable = info[3].ToBoolean();
  if (length == 0 || length > kMaxExternal) ThrowNative(env, "length must be in [1, 2^32]");
  std::string what = "mapFile(" + path + ")";
  // A read-only view is still a private writable mapping: V8 assumes every
  // ArrayBuffer is writable, and a store into a PROT_READ page would kill the
  // process. Private writes never reach the file.
  int fd = open(path.c_str(), (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) Throw(env, ErrnoFailure("open", errno, what));
  struct stat st;
  if (fstat(fd, &st) != 0) {
    int err = errno;
    close(fd);
    Throw(env, ErrnoFailure("fstat", err, what));
  }
  if (!S_ISREG(st.st_mode)) {
    close(fd);
    ThrowNative(env, what + ": not a regular file");
  }
  if (offset > static_cast<size_t>(st.st_size) || length > static_cast<size_t>(st.st_size) - offset) {
    close(fd);
    ThrowNative(env, what + ": range [" + std::to_string(offset) + ", " + std::to_string(offset + length) +
                         ") exceeds the file size " + std::to_string(st.st_size));
  }
  size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  size_t start = offset - offset % page;
  size_t mapped = offset - start + length;
  // MAP_POPULATE: the page tables are filled once here (an engine's KV tensor is
  // resident), not by one fault per 4 KiB page on the first copy through each block.
  int flags = writable ? MAP_SHARED | MAP_POPULATE : MAP_PRIVATE;
  void* base = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, flags, fd, static_cast<off_t>(start));
  int err = errno;
  close(fd);  // the mapping keeps the file referenced
  if (base == MAP_FAILED) Throw(env, ErrnoFailure("mmap", err, what));
  auto* m = new Mapping();
  m->base = base;
  m->mapped = mapped;
  m->data = static_cast<uint8_t*>(base) + (offset - start);
  m->length = length;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_maps[m->data] = m;
    g_liveBytes += length;
  }
  // On failure Node runs FinalizeMapping itself (see memory.cc Publish): nothing to undo here.
  return Napi::ArrayBuffer::New(env, m->data, m->length, FinalizeMapping, m);
}

// unmapFile(buffer): munmap now and detach, so views read as empty instead of faulting.
Napi::Value UnmapFile(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (!info[0].IsArrayBuffer()) ThrowNative(env, "unmapFile expects an ArrayBuffer");
  Napi::ArrayBuffer ab = info[0].As<Napi::ArrayBuffer>();
  void* data = ab.Data();
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_maps.find(data);
    if (data == nullptr || it == g_maps.end()) {
      ThrowNative(env, ab.IsDetached() ? "mapping was already unmapped (detached)" : "buffer is not a file mapping");
    }
    Mapping* m = it->second;
    g_maps.erase(it);
    Release(m);
  }
  ab.Detach();
  return env.Undefined();
}

Napi::Value MapStats(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  Napi::Object o = Napi::Object::New(env);
  std::lock_guard<std::mutex> lock(g_mu);
  o.Set("mappings", Napi::Number::New(env, static_cast<double>(g_maps.size())));
  o.Set("mappedBytes", Napi::Number::New(env, static_cast<double>(g_liveBytes)));
  return o;
}

// Below this many bytes a run is copied with ordinary stores: the destination of a
// small run is likely read again soon (and the head/tail alignment costs more).
constexpr size_t kStreamRunBytes = 4096;

// memcpy with non-temporal stores. A chunk's blocks (32 KiB runs of a 32 MiB chunk) are far
// larger than the cache in total and are not read back soon: ordinary stores read every
// destination line first (read-for-ownership), a third more memory traffic, which is why
// glibc streams only single copies above ~3/4 of the LLC and 1024 block copies ran at
// 0.65-0.8x one big memcpy. The caller issues _mm_sfence once after its runs.
void StreamCopy(uint8_t* dst, const uint8_t* src, size_t n) {
#if defined(__SSE2__)
  size_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;
  if (head > n) head = n;
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  size_t i = 0;
  for (; i + 64 <= n; i += 64) {
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

// A typed array or ArrayBuffer argument as a byte range (null data when detached).
bool ByteRange(Napi::Value v, uint8_t** data, size_t* length) {
  if (v.IsArrayBuffer()) {
    Napi::ArrayBuffer ab = v.As<Napi::ArrayBuffer>();
    *data = static_cast<uint8_t*>(ab.Data());
    *length = ab.ByteLength();
    return true;
  }
  if (v.IsTypedArray()) {
    Napi::TypedArray t = v.As<Napi::TypedArray>();
    Napi::ArrayBuffer ab = t.ArrayBuffer();
    *data = static_cast<uint8_t*>(ab.Data()) + t.ByteOffset();
    *length = t.ByteLength();
    return true;
  }
  return false;
}

// copyRuns(dst, src, runs: Float64Array of [dstOffset, srcOffset, bytes] triples) -> undefined.
// One call copies a layer's scattered blocks (engine tensor <-> L1 slot) on this thread:
// one JS->C++ crossing instead of one per block. Every run is checked against both
// ranges before any byte moves (a bad run copies nothing).
Napi::Value CopyRuns(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  uint8_t* dst = nullptr;
  uint8_t* src = nullptr;
  size_t dstLen = 0, srcLen = 0;
  if (!ByteRange(info[0], &dst, &dstLen)) ThrowNative(env, "copyRuns: dst must be an ArrayBuffer or a typed array");
  if (!ByteRange(info[1], &src, &srcLen)) ThrowNative(env, "copyRuns: src must be an ArrayBuffer or a typed array");
  if (!info[2].IsTypedArray() || info[2].As<Napi::TypedArray>().TypedArrayType() != napi_float64_array)
    ThrowNative(env, "copyRuns: runs must be a Float64Array");
  Napi::Float64Array runs = info[2].As<Napi::Float64Array>();
  size_t count = runs.ElementLength();
  if (count % 3 != 0) ThrowNative(env, "copyRuns: runs must hold [dstOffset, srcOffset, bytes] triples");
  const double* r = runs.Data();
  constexpr double kMax = 9007199254740991.0;  // 2^53 - 1
  for (size_t i = 0; i < count; i += 3) {
    double d = r[i], s = r[i + 1], n = r[i + 2];
    // Integral, non-negative and inside both ranges (NaN fails every comparison).
    bool ok = d >= 0 && s >= 0 && n >= 0 && d <= kMax && s <= kMax && n <= kMax && d == static_cast<double>(static_cast<uint64_t>(d)) &&
              s == static_cast<double>(static_cast<uint64_t>(s)) && n == static_cast<double>(static_cast<uint64_t>(n));
    if (ok) {
      uint64_t du = static_cast<uint64_t>(d), su = static_cast<uint64_t>(s), nu = static_cast<uint64_t>(n);
      ok = du <= dstLen && nu <= dstLen - du && su <= srcLen && nu <= srcLen - su;
    }
    if (!ok) {
      ThrowNative(env, "copyRuns: run " + std::to_string(i / 3) + " [" + std::to_string(d) + ", " + std::to_string(s) +
                           ", " + std::to_string(n) + "] is outside dst (" + std::to_string(dstLen) + " bytes) or src (" +
                           std::to_string(srcLen) + " bytes)");
    }
  }
  if (dst == nullptr || src == nullptr) return env.Undefined();  // detached: every run was 0 bytes
  bool streamed = false;
  for (size_t i = 0; i < count; i += 3) {
    size_t n = static_cast<size_t>(r[i + 2]);
    uint8_t* to = dst + static_cast<size_t>(r[i]);
    const uint8_t* from = src + static_cast<size_t>(r[i + 1]);
    // Ranges of one buffer that overlap (not an agent copy, but the call allows it) get memmove.
    bool overlap = to < from + n && from < to + n;
    if (n >= kStreamRunBytes && !overlap) {
      StreamCopy(to, from, n);
      streamed = true;
    } else {
      std::memmove(to, from, n);
    }
  }
#if defined(__SSE2__)
  if (streamed) _mm_sfence();  // streamed stores are visible before this returns
#else
  (void)streamed;
#endif
  return env.Undefined();
}

}  // namespace

void InitMmap(Napi::Env env, Napi::Object exports) {
  exports.Set("copyRuns", Napi::Function::New(env, CopyRuns, "copyRuns"));
  exports.Set("mapFile", Napi::Function::New(env, MapFile, "mapFile"));
  exports.Set("unmapFile", Napi::Function::New(env, UnmapFile, "unmapFile"));
  exports.Set("mapStats", Napi::Function::New(env, MapStats, "mapStats"));
}

}  // namespace kvgate
