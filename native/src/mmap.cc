// File mappings as external ArrayBuffers: an engine's KV tensor in /dev/shm seen as
// memory, so the agent copies scattered blocks without one syscall per block.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#include <immintrin.h>
#endif

#include <csetjmp>
#include <csignal>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <algorithm>
#include <atomic>
#include <unordered_map>
#include <vector>

#include "common.h"
#include "stream_copy.h"

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
  // copyRunsAsync jobs reading or writing the mapping now. While > 0, unmapFile and the
  // finalizer only mark it: the last job to finish unmaps (and deletes) it, so a pool
  // thread never touches an unmapped page.
  int busy = 0;
  bool unmapPending = false;  // unmapFile or the finalizer ran while busy
  bool finalized = false;     // the ArrayBuffer is gone: the last job deletes the record
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
    if (m->busy > 0) {
      if (!m->unmapped && !m->unmapPending) {
        auto it = g_maps.find(m->data);
        if (it != g_maps.end() && it->second == m) g_maps.erase(it);
        m->unmapPending = true;
      }
      m->finalized = true;
      return;
    }
    if (!m->unmapped && !m->unmapPending) {
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
    if (m->busy > 0) {
      m->unmapPending = true;  // the last copy using it unmaps
    } else {
      Release(m);
    }
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

// ---- copies that survive a file shrinking under its mapping ----
//
// A page of a file mapping past the file's end faults with SIGBUS: an engine that truncates
// (or replaces and shrinks) its KV file while a copy runs would kill the agent, and with the
// copies on pool threads that window is a whole copy long. Copies through mappings run under
// a per-thread guard: SIGBUS inside one jumps back to the guard, which reports the copy failed
// (its bytes are then never served: the caller treats it as a failed save or load). A SIGBUS
// anywhere else goes to the handler that was there before, or kills the process as it would have.

thread_local sigjmp_buf* t_faultJump = nullptr;
struct sigaction g_previousBus;
std::once_flag g_busOnce;

void OnBus(int sig, siginfo_t* info, void* context) {
  // Only a fault (si_code > 0: BUS_ADRERR, BUS_OBJERR, ...) is a copy's. A SIGBUS sent by
  // kill, tgkill or sigqueue (si_code <= 0) is not, even when it lands on a thread in a copy.
  const bool fault = info != nullptr && info->si_code > 0;
  // The thread_local only for a fault: in a dlopen'd addon its first read on a thread goes
  // through __tls_get_addr, which may malloc (not async-signal-safe; a sent SIGBUS can land on
  // a thread inside malloc). A faulting thread is in a copy through a mapping, not in malloc.
  sigjmp_buf* jump = fault ? t_faultJump : nullptr;
  if (jump != nullptr) {
    t_faultJump = nullptr;
    siglongjmp(*jump, 1);
  }
  if ((g_previousBus.sa_flags & SA_SIGINFO) != 0 && g_previousBus.sa_sigaction != nullptr) {
    g_previousBus.sa_sigaction(sig, info, context);
    return;
  }
  if ((g_previousBus.sa_flags & SA_SIGINFO) == 0 && g_previousBus.sa_handler != SIG_DFL &&
      g_previousBus.sa_handler != SIG_IGN) {
    g_previousBus.sa_handler(sig);
    return;
  }
  // Neither a guarded copy's nor another handler's: back to the default, as before the guard.
  // A fault runs its access again and dies of it; a sent SIGBUS does not come back by itself,
  // so it is raised again (SA_NODEFER: not blocked here, it is delivered at once and kills).
  signal(SIGBUS, SIG_DFL);
  if (!fault) raise(SIGBUS);
}

void InstallBusGuard() {
  std::call_once(g_busOnce, [] {
    struct sigaction sa {};
    sa.sa_sigaction = OnBus;
    // SA_NODEFER: the handler leaves by siglongjmp without restoring a signal mask (sigsetjmp(, 0)
    // saves none: no syscall per copy), so SIGBUS must not be blocked while it runs.
    sa.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, &g_previousBus);
  });
}

// `n` bytes from `src` to `dst`, or with `rows` > 1 a 2-D row set: row r copies `n` bytes from
// src + r * srcPitch to dst + r * dstPitch (copyRows: a strided engine view's runs in one piece);
// with `planes` > 1 (then rows > 1) a 3-D one: plane q is that row set at src + q * srcPlanePitch
// and dst + q * dstPlanePitch (copyPlanes: an HND view's block side, heads × tokens, in one piece).
struct Piece {
  uint8_t* dst;
  const uint8_t* src;
  size_t n;
  size_t rows = 1;
  size_t dstPitch = 0;
  size_t srcPitch = 0;
  size_t planes = 1;
  size_t dstPlanePitch = 0;
  size_t srcPlanePitch = 0;
};

// Plane q of a 3-D piece as a 2-D one.
Piece PlaneOf(const Piece& p, size_t q) {
  return Piece{p.dst + q * p.dstPlanePitch, p.src + q * p.srcPlanePitch, p.n, p.rows, p.dstPitch, p.srcPitch};
}

// Row sets of fewer bytes (a 3-D set: counting all its planes) are copied with ordinary stores.
// Lower than kStreamRunBytes: an HND view's planes are one token's heads (8 rows of 256 B), and
// the planes of a set and the sets of a chunk follow one another in the destination (the save)
// or the source (the load), so the stores still stream.
constexpr size_t kStreamRowSetBytes = 1024;

#if defined(__SSE2__)
// Small rows into a contiguous, 16-byte aligned destination (a save of a strided view into its
// slab): 16-byte streaming stores in address order, which the write-combining buffers merge into
// whole lines whatever the rows' alignment to a line (the agent's L1 slabs are 16 B off one), no
// prefetch. A Llama-8B LBNHC save's 32 MiB (K and V rows together, see Zips): 1.3-1.5 ms against
// 2.2-2.3 with memcpy per row and ~1.8-2.2 for one memcpy, aligned or 16 B off; StreamCopy per
// row was slower than memcpy (3.9 against 3.2 ms; into the 16 B-off L1 slabs 53-63 ms: a
// streamed part line beside ordinary stores into the same line at every row). Only for a pair:
// a lone set so copied (a K pass, then a V pass over the other halves) took 4-5.5 ms.
void StreamRow16(uint8_t* d, const uint8_t* s, size_t n) {
  for (size_t i = 0; i < n; i += 16)
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
}
#endif

// `setBytes`: the bytes of the whole set the row set is a plane of (its own for a 2-D one): a 3-D
// set's planes follow one another on the side read or written in order, so a small plane still
// streams when its set is large.
bool ContiguousStream16(const Piece& p, size_t setBytes) {
#if defined(__SSE2__)
  return p.rows > 1 && p.n < kStreamRunBytes && p.dstPitch == p.n && p.n % 16 == 0 &&
         setBytes >= kStreamRowSetBytes && (reinterpret_cast<uintptr_t>(p.dst) & 15) == 0;
#else
  return false;
#endif
}

// Whether a row set's rows (not a contiguous destination's) are copied with StreamCopy: rows of
// 4 KiB and more, or whole aligned lines from a source read in order (the load of a strided view:
// 32 MiB in 1.4 ms against 2.9 with memcpy per row, on 2 cores).
bool StreamsRows(const Piece& p, size_t setBytes) {
  if (p.n >= kStreamRunBytes) return true;
  return p.n % 64 == 0 && p.dstPitch % 64 == 0 && (reinterpret_cast<uintptr_t>(p.dst) & 63) == 0 &&
         p.srcPitch == p.n && setBytes >= kStreamRowSetBytes;
}

// A row set's rows (copyRows validated that its source and destination do not overlap).
void CopyRowSet(const Piece& p, size_t setBytes) {
  uint8_t* d = p.dst;
  const uint8_t* s = p.src;
  if (StreamsRows(p, setBytes)) {
#if defined(__SSE2__)
    if (p.n < kStreamRunBytes) {
      // Short whole-line rows (a strided view's heads): StreamCopy's per-call set-up and
      // prefetch cost more than the row (a Llama-8B LBNHC load, 32 distinct layer tensors:
      // 4.0 ms per row call against the inline stores' below).
      for (size_t r = 0; r < p.rows; r++, d += p.dstPitch, s += p.srcPitch) StreamRow16(d, s, p.n);
      return;
    }
#endif
    for (size_t r = 0; r < p.rows; r++, d += p.dstPitch, s += p.srcPitch) StreamCopy(d, s, p.n);
  } else {
    for (size_t r = 0; r < p.rows; r++, d += p.dstPitch, s += p.srcPitch) std::memcpy(d, s, p.n);
  }
}

// Two row sets of one shape whose rows lie side by side in the source (a save of a strided
// view's K and V halves of each token's head, in that order: copy-rows.ts sorts the sets by
// tensor offset) are copied row by row together, so each 512 B of the view is read once, in
// order: 32 MiB in 2.4 ms instead of 3.3 with memcpy per row (1.4 with streaming stores).
// Likewise a load's two sets whose rows lie side by side in the destination (copy-rows.ts sorts
// a load's sets by tensor offset too): each 512 B of the view is written once, in order, with
// streaming stores. With a source hot in cache that was slower (1.8 ms instead of 1.45: two
// source streams), but into 32 distinct layer tensors, as an engine's are, 2.6-3.3 ms instead
// of 3.8-4.5 (the K pass and the V pass each wrote every other 256 B of every page).
// 3-D sets of one shape pair up likewise, plane by plane (an HND view's K and V of a block side).
bool Zips(const Piece& a, const Piece& b) {
  return a.rows > 1 && b.rows == a.rows && b.n == a.n && b.dstPitch == a.dstPitch && b.srcPitch == a.srcPitch &&
         b.planes == a.planes && b.dstPlanePitch == a.dstPlanePitch && b.srcPlanePitch == a.srcPlanePitch &&
         (b.src == a.src + a.n || b.dst == a.dst + a.n);
}

void CopyRowPair(const Piece& a, const Piece& b, size_t setBytes) {
#if defined(__SSE2__)
  if (ContiguousStream16(a, setBytes) && ContiguousStream16(b, setBytes)) {
    for (size_t r = 0; r < a.rows; r++) {
      StreamRow16(a.dst + r * a.n, a.src + r * a.srcPitch, a.n);
      StreamRow16(b.dst + r * b.n, b.src + r * b.srcPitch, b.n);
    }
    return;  // GuardedCopy fences once after its pieces (a fence per pair: ~0.8 of 3.2 ms for an HND save)
  }
#endif
#if defined(__SSE2__)
  if (b.dst == a.dst + a.n && StreamsRows(a, setBytes) && StreamsRows(b, setBytes) && a.n < kStreamRunBytes) {
    for (size_t r = 0; r < a.rows; r++) {
      StreamRow16(a.dst + r * a.dstPitch, a.src + r * a.srcPitch, a.n);
      StreamRow16(b.dst + r * b.dstPitch, b.src + r * b.srcPitch, b.n);
    }
    return;
  }
#endif
  if (StreamsRows(a, setBytes) && StreamsRows(b, setBytes)) {
    for (size_t r = 0; r < a.rows; r++) {
      StreamCopy(a.dst + r * a.dstPitch, a.src + r * a.srcPitch, a.n);
      StreamCopy(b.dst + r * b.dstPitch, b.src + r * b.srcPitch, b.n);
    }
    return;
  }
  for (size_t r = 0; r < a.rows; r++) {
    std::memcpy(a.dst + r * a.dstPitch, a.src + r * a.srcPitch, a.n);
    std::memcpy(b.dst + r * b.dstPitch, b.src + r * b.srcPitch, b.n);
  }
}

// Copies the pieces (streaming runs of kStreamRunBytes and more). False when one faulted:
// the destination then holds some of the bytes and must not be used.
bool GuardedCopy(const Piece* pieces, size_t count) {
  sigjmp_buf jump;
  // No local is changed between sigsetjmp and a jump back (none needs to be volatile).
  if (sigsetjmp(jump, 0) != 0) {
#if defined(__SSE2__)
    _mm_sfence();
#endif
    return false;
  }
  t_faultJump = &jump;
  for (size_t i = 0; i < count; i++) {
    const Piece& p = pieces[i];
    if (p.rows != 1) {
      const size_t setBytes = p.n * p.rows * p.planes;
      const bool pair = i + 1 < count && Zips(p, pieces[i + 1]);
      if (p.planes == 1) {
        if (pair) CopyRowPair(p, pieces[i + 1], setBytes);
        else CopyRowSet(p, setBytes);
      } else {
        // Plane by plane: a pair's K and V of one token's heads (an HND save: 2 KiB each into
        // the slab, in order) before the next token's.
        for (size_t q = 0; q < p.planes; q++) {
          if (pair) CopyRowPair(PlaneOf(p, q), PlaneOf(pieces[i + 1], q), setBytes);
          else CopyRowSet(PlaneOf(p, q), setBytes);
        }
      }
      if (pair) i++;
      continue;
    }
    // Ranges of one buffer that overlap (not an agent copy, but copyRuns allows it) get memmove.
    bool overlap = p.dst < p.src + p.n && p.src < p.dst + p.n;
    if (p.n >= kStreamRunBytes && !overlap) {
      StreamCopy(p.dst, p.src, p.n);
    } else {
      std::memmove(p.dst, p.src, p.n);
    }
  }
  t_faultJump = nullptr;
#if defined(__SSE2__)
  // Whatever streamed (a run, a row set, a pair) is visible before this returns: one fence per
  // call (a grain of a threaded copy) rather than one per piece, each of which waits for the
  // write-combining buffers to drain.
  _mm_sfence();
#endif
  return true;
}

// The failure of a copy that faulted: errno EFAULT (syscode "EFAULT", syscall "copy") tells
// callers apart from bad arguments, which are thrown before anything is copied.
Failure ShrankFailure(const char* what) {
  Failure f;
  f.code = "ERR_NATIVE";
  f.sysErrno = EFAULT;
  f.syscall = "copy";
  f.message = std::string(what) +
              ": a mapped file shrank during the copy, or its filesystem (a full /dev/shm) could not back a page (SIGBUS); "
              "the copy failed and its destination holds partial bytes";
  return f;
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
  std::vector<Piece> pieces;
  pieces.reserve(count / 3);
  for (size_t i = 0; i < count; i += 3) {
    pieces.push_back({dst + static_cast<size_t>(r[i]), src + static_cast<size_t>(r[i + 1]), static_cast<size_t>(r[i + 2])});
  }
  InstallBusGuard();
  if (!GuardedCopy(pieces.data(), pieces.size())) Throw(env, ShrankFailure("copyRuns"));
  return env.Undefined();
}

// ---- 2-D row sets: a strided view's many small runs as a few pieces ----

constexpr double kMaxWhole = 9007199254740991.0;  // 2^53 - 1

bool Whole(double x, double limit) {
  return x >= 0 && x <= limit && x == static_cast<double>(static_cast<uint64_t>(x));
}

// End (exclusive, from the buffer's start) of `planes` planes of `height` rows of `width` bytes,
// rows `pitch` and planes `planePitch` apart, from `off`; off itself when the set is empty.
// 128-bit: no sum of products of 2^53 values wraps.
unsigned __int128 SetEnd(uint64_t off, uint64_t width, uint64_t height, uint64_t pitch, uint64_t planes,
                         uint64_t planePitch) {
  if (width == 0 || height == 0 || planes == 0) return off;
  return static_cast<unsigned __int128>(planes - 1) * planePitch +
         static_cast<unsigned __int128>(height - 1) * pitch + off + width;
}

// Whether no two rows of a set touch a common byte on one side (each destination byte written
// once, whatever the order the rows run in): rows apart in a plane, and the planes either one
// after another or each inside the gap between two rows (an HND load's tensor side: a token's
// 256 B in every 8 KiB head row).
bool RowsApart(uint64_t width, uint64_t height, uint64_t pitch, uint64_t planes, uint64_t planePitch) {
  if (height > 1 && pitch < width) return false;
  if (planes <= 1) return true;
  const unsigned __int128 plane = static_cast<unsigned __int128>(height - 1) * pitch + width;
  if (planePitch >= plane) return true;
  return height > 1 && planePitch >= width &&
         static_cast<unsigned __int128>(planes - 1) * planePitch + width <= pitch;
}

// Fields of a 2-D row set (copyRows) and of a 3-D one (copyPlanes).
constexpr int kRowFields = 6;
constexpr int kPlaneFields = 9;

// One set between dst and src as a piece (n = 0 when it copies nothing), or the reason it is
// refused: [dstOffset, srcOffset, width, height, dstPitch, srcPitch] (fields = kRowFields), with
// [planes, dstPlanePitch, srcPlanePitch] after it (kPlaneFields). Every row inside its buffer;
// the destination's rows apart (RowsApart); the source's and destination's ranges disjoint (rows
// copy in any order and with memcpy, so a set reading what it writes has no defined result).
// Dimensions that add nothing fold away: a plane of one row, planes of contiguous rows.
const char* RowSetPiece(const double* r, int fields, uint8_t* dst, size_t dstLen, const uint8_t* src, size_t srcLen,
                        Piece* out) {
  for (int k = 0; k < fields; k++) {
    if (!Whole(r[k], kMaxWhole)) {
      return fields == kRowFields ? "is not six integers in [0, 2^53)" : "is not nine integers in [0, 2^53)";
    }
  }
  uint64_t d = static_cast<uint64_t>(r[0]), s = static_cast<uint64_t>(r[1]), w = static_cast<uint64_t>(r[2]),
           h = static_cast<uint64_t>(r[3]), dp = static_cast<uint64_t>(r[4]), sp = static_cast<uint64_t>(r[5]);
  uint64_t pl = 1, dpp = 0, spp = 0;
  if (fields == kPlaneFields) {
    pl = static_cast<uint64_t>(r[6]);
    dpp = static_cast<uint64_t>(r[7]);
    spp = static_cast<uint64_t>(r[8]);
  }
  unsigned __int128 dEnd = SetEnd(d, w, h, dp, pl, dpp), sEnd = SetEnd(s, w, h, sp, pl, spp);
  if (dEnd > dstLen || sEnd > srcLen) return "is outside dst or src";
  *out = Piece{dst + d, src + s, 0};
  if (w == 0 || h == 0 || pl == 0) return nullptr;
  if (!RowsApart(w, h, dp, pl, dpp)) return "has rows closer than its width in dst (they would overlap)";
  const uint8_t* dLo = dst + d;
  const uint8_t* dHi = dst + static_cast<size_t>(dEnd);
  const uint8_t* sLo = src + s;
  const uint8_t* sHi = src + static_cast<size_t>(sEnd);
  if (dLo < sHi && sLo < dHi) return "reads the range it writes (source and destination overlap)";
  // Every product below is at most the set's extent in a buffer (checked above): no wrap.
  if (pl > 1 && h == 1) {  // planes of one row: a 2-D set over the planes
    h = pl;
    dp = dpp;
    sp = spp;
    pl = 1;
  }
  if (pl > 1 && dp == w && sp == w) {  // planes of contiguous rows: rows of a plane's bytes
    w *= h;
    h = pl;
    dp = dpp;
    sp = spp;
    pl = 1;
  }
  if (h == 1 || (dp == w && sp == w)) {
    out->n = static_cast<size_t>(w * h);  // one contiguous run
  } else {
    out->n = static_cast<size_t>(w);
    out->rows = static_cast<size_t>(h);
    out->dstPitch = static_cast<size_t>(dp);
    out->srcPitch = static_cast<size_t>(sp);
    if (pl > 1) {
      out->planes = static_cast<size_t>(pl);
      out->dstPlanePitch = static_cast<size_t>(dpp);
      out->srcPlanePitch = static_cast<size_t>(spp);
    }
  }
  return nullptr;
}

std::string RowSetText(const double* r, int n) {
  std::string t = "[";
  for (int k = 0; k < n; k++) t += (k ? ", " : "") + std::to_string(r[k]);
  return t + "]";
}

// copyRows(dst, src, rows: Float64Array of [dstOffset, srcOffset, width, height, dstPitch, srcPitch])
// -> undefined: copyRuns with 2-D row sets (row r of a set copies `width` bytes from
// srcOffset + r * srcPitch to dstOffset + r * dstPitch). Every set is checked before any byte moves.
// copyPlanes(dst, src, sets: Float64Array of [dstOffset, srcOffset, width, height, dstPitch,
// srcPitch, planes, dstPlanePitch, srcPlanePitch]): the same with 3-D sets (plane q of a set is
// its row set at dstOffset + q * dstPlanePitch and srcOffset + q * srcPlanePitch).
Napi::Value CopySets(const Napi::CallbackInfo& info, int fields) {
  Napi::Env env = info.Env();
  const std::string fn = fields == kRowFields ? "copyRows" : "copyPlanes";
  uint8_t* dst = nullptr;
  uint8_t* src = nullptr;
  size_t dstLen = 0, srcLen = 0;
  if (!ByteRange(info[0], &dst, &dstLen)) ThrowNative(env, fn + ": dst must be an ArrayBuffer or a typed array");
  if (!ByteRange(info[1], &src, &srcLen)) ThrowNative(env, fn + ": src must be an ArrayBuffer or a typed array");
  if (!info[2].IsTypedArray() || info[2].As<Napi::TypedArray>().TypedArrayType() != napi_float64_array)
    ThrowNative(env, fn + (fields == kRowFields ? ": rows" : ": sets") + " must be a Float64Array");
  Napi::Float64Array rows = info[2].As<Napi::Float64Array>();
  size_t count = rows.ElementLength();
  if (count % fields != 0) {
    ThrowNative(env, fields == kRowFields
                         ? "copyRows: rows must hold [dstOffset, srcOffset, width, height, dstPitch, srcPitch] sextuples"
                         : "copyPlanes: sets must hold [dstOffset, srcOffset, width, height, dstPitch, srcPitch, "
                           "planes, dstPlanePitch, srcPlanePitch] nonuples");
  }
  const double* r = rows.Data();
  std::vector<Piece> pieces;
  pieces.reserve(count / fields);
  for (size_t i = 0; i < count; i += fields) {
    Piece pc{nullptr, nullptr, 0};
    if (const char* why = RowSetPiece(r + i, fields, dst, dstLen, src, srcLen, &pc)) {
      ThrowNative(env, fn + ": row set " + std::to_string(i / fields) + " " + RowSetText(r + i, fields) + " " + why +
                           " (dst " + std::to_string(dstLen) + " bytes, src " + std::to_string(srcLen) + " bytes)");
    }
    if (pc.n > 0) pieces.push_back(pc);
  }
  if (pieces.empty()) return env.Undefined();
  InstallBusGuard();
  if (!GuardedCopy(pieces.data(), pieces.size())) Throw(env, ShrankFailure(fn.c_str()));
  return env.Undefined();
}

Napi::Value CopyRows(const Napi::CallbackInfo& info) { return CopySets(info, kRowFields); }
Napi::Value CopyPlanes(const Napi::CallbackInfo& info) { return CopySets(info, kPlaneFields); }

// ---- copyRunsAsync: the same copies, split across pool threads ----

// Parts smaller than this are not worth a thread of their own (the wake-up costs more).
constexpr size_t kMinPartBytes = 256 * 1024;
constexpr size_t kMaxParts = 64;
// The bytes a pool thread takes at a time. The threads share the grains, each taking the next
// one left, rather than each a fixed share: a thread the kernel runs late (another process on
// the core, its wake-up) leaves its grains to the others instead of holding the copy's answer
// until its whole share is done. In-process on 2 busy cores, interleaved with fixed shares: the
// same median, the mean -9 to +1 % and the p90 0-15 % lower for a save-shaped copy.
constexpr size_t kGrainBytes = 256 * 1024;

struct CopyJob;

struct CopyPart {
  CopyJob* job = nullptr;
  napi_async_work work = nullptr;
  bool faulted = false;  // a SIGBUS stopped this part's copy (set on its pool thread)
};

// One copyRunsAsync call: what it keeps alive and busy until its last part finishes.
// Settled on the JS thread by the last part's completion, which releases everything
// the job holds in one place (references, pinned-block and mapping busy marks).
struct CopyJob {
  napi_env env = nullptr;
  napi_deferred deferred = nullptr;
  std::vector<napi_ref> refs;      // the buffers' ArrayBuffers: the GC cannot free them
  std::vector<HostSpan> pinned;    // busy marks: freePinned refuses while the copy runs
  std::vector<Mapping*> mappings;  // busy marks: unmapFile defers the munmap
  std::vector<CopyPart> parts;
  // The pieces, grain by grain: grain g is pieces[grains[g] .. grains[g + 1]).
  std::vector<Piece> pieces;
  std::vector<size_t> grains;
  std::atomic<size_t> nextGrain{0};
  std::atomic<size_t> grainsDone{0};  // grains copied in full (release: their bytes are visible)
  std::atomic<bool> stop{false};      // a part faulted: the others take no more grains
  size_t remaining = 0;
  bool faulted = false;  // some part's copy faulted: the promise rejects
  bool settled = false;  // the promise settled and the buffers were released (JS thread)
};

void ExecutePart(napi_env, void* data) {
  auto* part = static_cast<CopyPart*>(data);
  CopyJob* job = part->job;
  const size_t count = job->grains.size() - 1;
  while (!job->stop.load(std::memory_order_relaxed)) {
    size_t g = job->nextGrain.fetch_add(1, std::memory_order_relaxed);
    if (g >= count) break;
    const size_t first = job->grains[g];
    if (!GuardedCopy(job->pieces.data() + first, job->grains[g + 1] - first)) {
      part->faulted = true;
      job->stop.store(true, std::memory_order_relaxed);
      break;
    }
    job->grainsDone.fetch_add(1, std::memory_order_release);
  }
}

// Releases what the job holds. JS thread only (napi_delete_reference).
void ReleaseJob(CopyJob* job) {
  for (const HostSpan& s : job->pinned) ReleaseHost(s);
  {
    std::lock_guard<std::mutex> lock(g_mu);
    for (Mapping* m : job->mappings) {
      if (--m->busy > 0) continue;
      if (m->unmapPending && !m->unmapped) Release(m);
      if (m->finalized) delete m;
    }
  }
  job->mappings.clear();
  for (napi_ref r : job->refs) napi_delete_reference(job->env, r);
  job->refs.clear();
}

// Settles the job's promise and releases what it holds (JS thread, once): resolved when every
// grain was copied, else rejected (a fault, or work items cancelled at the environment's end).
void SettleJob(napi_env env, CopyJob* job) {
  job->settled = true;
  ReleaseJob(job);
  napi_value v;
  if (job->faulted) {
    v = ToError(Napi::Env(env), ShrankFailure("copyRunsAsync")).Value();
    napi_reject_deferred(env, job->deferred, v);
  } else if (job->grainsDone.load(std::memory_order_acquire) == job->grains.size() - 1) {
    napi_get_undefined(env, &v);
    napi_resolve_deferred(env, job->deferred, v);
  } else {
    // Only cancelled work items leave grains uncopied (the environment is shutting down).
    v = ToError(Napi::Env(env), NativeFailure("copyRunsAsync was cancelled")).Value();
    napi_reject_deferred(env, job->deferred, v);
  }
}

void CompletePart(napi_env env, napi_status, void* data) {
  auto* part = static_cast<CopyPart*>(data);
  CopyJob* job = part->job;
  napi_delete_async_work(env, part->work);
  part->work = nullptr;
  if (part->faulted) job->faulted = true;
  // Every grain copied: the copy is done though a part may not have run yet (its thread not
  // scheduled, its work item queued behind others). It settles now; that part, when it runs,
  // finds no grain left and touches no buffer (only the job, freed after the last part).
  if (!job->settled && !job->faulted &&
      job->grainsDone.load(std::memory_order_acquire) == job->grains.size() - 1) {
    SettleJob(env, job);
  }
  if (--job->remaining > 0) return;
  if (!job->settled) SettleJob(env, job);
  delete job;
}

// Marks what backs `ab` busy for the job: a pinned block or a file mapping.
void HoldBuffer(Napi::Env env, CopyJob* job, Napi::ArrayBuffer ab) {
  napi_ref ref;
  napi_create_reference(env, ab, 1, &ref);
  job->refs.push_back(ref);
  Napi::Number length = Napi::Number::New(env, static_cast<double>(ab.ByteLength()));
  HostSpan span = AcquireHost(env, ab, Napi::Number::New(env, 0), length);
  if (span.block != nullptr) job->pinned.push_back(span);
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_maps.find(ab.Data());
  if (ab.Data() != nullptr && it != g_maps.end()) {
    it->second->busy++;
    job->mappings.push_back(it->second);
  }
}

// The buffers argument of copyRunsAsync / copyRowsAsync: each one's bytes and its ArrayBuffer.
struct CopyBuffers {
  std::vector<uint8_t*> data;
  std::vector<size_t> length;
  std::vector<Napi::ArrayBuffer> backing;
};

CopyBuffers ParseBuffers(Napi::Env env, Napi::Value v, const std::string& fn) {
  if (!v.IsArray()) ThrowNative(env, fn + ": buffers must be an array");
  Napi::Array list = v.As<Napi::Array>();
  uint32_t nbuf = list.Length();
  if (nbuf == 0 || nbuf > 65536) ThrowNative(env, fn + ": buffers must hold 1 to 65536 entries");
  CopyBuffers b;
  b.data.resize(nbuf);
  b.length.resize(nbuf);
  b.backing.resize(nbuf);
  for (uint32_t i = 0; i < nbuf; i++) {
    Napi::Value e = list.Get(i);
    if (!ByteRange(e, &b.data[i], &b.length[i]))
      ThrowNative(env, fn + ": buffers[" + std::to_string(i) + "] must be an ArrayBuffer or a typed array");
    b.backing[i] = e.IsArrayBuffer() ? e.As<Napi::ArrayBuffer>() : e.As<Napi::TypedArray>().ArrayBuffer();
  }
  return b;
}

// Starts the checked pieces (`total` bytes) on up to `wantParts` pool threads: the promise of
// copyRunsAsync and copyRowsAsync. Grains of about kGrainBytes: a run longer than that is cut at
// 4 KiB of it (a thread streams whole pages of it), a row set between rows; a row set of rows
// wider than half a grain is cut as runs, row by row.
Napi::Value StartCopyJob(Napi::Env env, CopyBuffers& b, const std::vector<Piece>& pieces, size_t total,
                         size_t wantParts) {
  napi_deferred deferred;
  napi_value promise;
  if (napi_create_promise(env, &deferred, &promise) != napi_ok) {
    ThrowNative(env, "copyRunsAsync: cannot create a promise");
  }
  if (total == 0) {
    napi_resolve_deferred(env, deferred, env.Undefined());
    return Napi::Value(env, promise);
  }
  InstallBusGuard();
  size_t parts = std::min(wantParts, std::max<size_t>(1, total / kMinPartBytes));
  auto* job = new CopyJob();
  job->env = env;
  job->deferred = deferred;
  try {
    for (size_t i = 0; i < b.backing.size(); i++) HoldBuffer(env, job, b.backing[i]);
  } catch (...) {
    ReleaseJob(job);
    napi_resolve_deferred(env, deferred, env.Undefined());  // nobody sees this promise: the call throws
    delete job;
    throw;
  }
  job->pieces.reserve(pieces.size() + total / kGrainBytes + 1);
  job->grains.reserve(total / kGrainBytes + 2);
  job->grains.push_back(0);
  size_t have = 0;
  auto closeGrain = [&] {
    job->grains.push_back(job->pieces.size());
    have = 0;
  };
  auto addRun = [&](Piece pc) {
    while (pc.n > 0) {
      size_t take = std::min(pc.n, kGrainBytes - have);
      // Under 4 KiB of room and more of the run left: it starts the next grain.
      if (take < pc.n) take -= take % 4096;
      if (take > 0) {
        job->pieces.push_back({pc.dst, pc.src, take});
        pc.dst += take;
        pc.src += take;
        pc.n -= take;
        have += take;
      }
      if (have >= kGrainBytes || (take == 0 && have > 0)) closeGrain();
    }
  };
  // Cuts `pc` along its outer dimension (`count`: its rows, or a 3-D set's planes; `unit` bytes
  // each, `dstStep`/`srcStep` apart) into the grains: as many as fit in the open grain, the rest
  // in the next ones.
  auto addCut = [&](Piece pc, size_t Piece::*count, size_t unit, size_t dstStep, size_t srcStep) {
    while (pc.*count > 0) {
      size_t k = std::min(pc.*count, (kGrainBytes - have) / unit);
      if (k == 0) {  // not one more fits: the next grain (have > 0: a grain holds two)
        closeGrain();
        continue;
      }
      Piece part = pc;
      part.*count = k;
      job->pieces.push_back(part);
      pc.dst += k * dstStep;
      pc.src += k * srcStep;
      pc.*count -= k;
      have += k * unit;
      if (have >= kGrainBytes) closeGrain();
    }
  };
  auto addRows = [&](Piece pc) {
    if (pc.n * 2 > kGrainBytes) {
      for (size_t r = 0; r < pc.rows; r++) addRun({pc.dst + r * pc.dstPitch, pc.src + r * pc.srcPitch, pc.n});
      return;
    }
    addCut(pc, &Piece::rows, pc.n, pc.dstPitch, pc.srcPitch);
  };
  for (Piece pc : pieces) {
    if (pc.rows == 1) {
      addRun(pc);
      continue;
    }
    const size_t plane = pc.n * pc.rows;
    if (pc.planes == 1 || plane * 2 > kGrainBytes) {
      for (size_t q = 0; q < pc.planes; q++) addRows(PlaneOf(pc, q));
      continue;
    }
    // A 3-D set is cut between planes (an HND block side's K: 16 planes of 2 KiB).
    addCut(pc, &Piece::planes, plane, pc.dstPlanePitch, pc.srcPlanePitch);
  }
  if (have > 0) closeGrain();
  job->parts.resize(std::min(parts, job->grains.size() - 1));
  napi_value name;
  napi_create_string_utf8(env, "kvgate.copyRunsAsync", NAPI_AUTO_LENGTH, &name);
  job->remaining = job->parts.size();
  for (CopyPart& part : job->parts) {
    part.job = job;
    napi_status st = napi_create_async_work(env, nullptr, name, ExecutePart, CompletePart, &part, &part.work);
    if (st == napi_ok) st = napi_queue_async_work(env, part.work);
    if (st != napi_ok) {
      // Cannot happen short of OOM; pieces already queued finish and settle the job, so
      // this one's bytes are copied inline instead of abandoning the promise.
      if (part.work != nullptr) napi_delete_async_work(env, part.work);
      part.work = nullptr;
      ExecutePart(env, &part);
      if (part.faulted) job->faulted = true;
      job->remaining--;
    }
  }
  if (job->remaining == 0) {
    SettleJob(env, job);
    delete job;
  }
  return Napi::Value(env, promise);
}

// copyRunsAsync(buffers: (ArrayBuffer | typed array)[], runs: Float64Array of
// [dstBuffer, dstOffset, srcBuffer, srcOffset, bytes] quintuples, parts) -> Promise<void>.
// Every run is checked before any byte moves; the bytes are then cut into grains (a run may
// be cut) that up to `parts` libuv pool threads share, each taking the next grain left.
// Until the promise settles every buffer stays referenced, a pinned one busy and a
// mapping's munmap deferred; the caller must not change the ranges meanwhile.
Napi::Value CopyRunsAsync(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  CopyBuffers b = ParseBuffers(env, info[0], "copyRunsAsync");
  const size_t nbuf = b.data.size();
  if (!info[1].IsTypedArray() || info[1].As<Napi::TypedArray>().TypedArrayType() != napi_float64_array)
    ThrowNative(env, "copyRunsAsync: runs must be a Float64Array");
  Napi::Float64Array runs = info[1].As<Napi::Float64Array>();
  size_t count = runs.ElementLength();
  if (count % 5 != 0)
    ThrowNative(env, "copyRunsAsync: runs must hold [dstBuffer, dstOffset, srcBuffer, srcOffset, bytes] quintuples");
  size_t wantParts = ToSize(env, info[2], "parts");
  if (wantParts < 1 || wantParts > kMaxParts) ThrowNative(env, "copyRunsAsync: parts must be in [1, 64]");
  const double* r = runs.Data();
  std::vector<Piece> pieces;
  pieces.reserve(count / 5);
  size_t total = 0;
  for (size_t i = 0; i < count; i += 5) {
    double db = r[i], d = r[i + 1], sb = r[i + 2], s = r[i + 3], n = r[i + 4];
    bool ok = Whole(db, nbuf - 1) && Whole(sb, nbuf - 1) && Whole(d, kMaxWhole) && Whole(s, kMaxWhole) &&
              Whole(n, kMaxWhole);
    if (ok) {
      size_t dl = b.length[static_cast<size_t>(db)], sl = b.length[static_cast<size_t>(sb)];
      uint64_t du = static_cast<uint64_t>(d), su = static_cast<uint64_t>(s), nu = static_cast<uint64_t>(n);
      ok = du <= dl && nu <= dl - du && su <= sl && nu <= sl - su;
    }
    if (!ok) {
      ThrowNative(env, "copyRunsAsync: run " + std::to_string(i / 5) + " [" + std::to_string(db) + ", " +
                           std::to_string(d) + ", " + std::to_string(sb) + ", " + std::to_string(s) + ", " +
                           std::to_string(n) + "] names no buffer or is outside one");
    }
    size_t nu = static_cast<size_t>(n);
    if (nu == 0) continue;
    uint8_t* to = b.data[static_cast<size_t>(db)] + static_cast<size_t>(d);
    const uint8_t* from = b.data[static_cast<size_t>(sb)] + static_cast<size_t>(s);
    // Pieces run concurrently: a run reading what it writes has no defined result.
    if (to < from + nu && from < to + nu) {
      ThrowNative(env, "copyRunsAsync: run " + std::to_string(i / 5) + " overlaps itself");
    }
    pieces.push_back({to, from, nu});
    total += nu;
  }
  return StartCopyJob(env, b, pieces, total, wantParts);
}

// copyRowsAsync(buffers, rows: Float64Array of [dstBuffer, dstOffset, srcBuffer, srcOffset, width,
// height, dstPitch, srcPitch], parts) -> Promise<void>: copyRunsAsync with copyRows' 2-D row sets,
// checked as copyRows checks them (a set whose source and destination ranges overlap is refused)
// before any byte moves, then cut between rows into the same grains.
// copyPlanesAsync(buffers, sets: Float64Array of [dstBuffer, dstOffset, srcBuffer, srcOffset, width,
// height, dstPitch, srcPitch, planes, dstPlanePitch, srcPlanePitch], parts): the same with
// copyPlanes' 3-D sets, cut between planes (a plane wider than half a grain as copyRowsAsync cuts
// a set).
Napi::Value CopySetsAsync(const Napi::CallbackInfo& info, int fields) {
  Napi::Env env = info.Env();
  const std::string fn = fields == kRowFields ? "copyRowsAsync" : "copyPlanesAsync";
  const size_t step = static_cast<size_t>(fields) + 2;  // the buffers' indices before each set's fields
  CopyBuffers b = ParseBuffers(env, info[0], fn);
  const size_t nbuf = b.data.size();
  if (!info[1].IsTypedArray() || info[1].As<Napi::TypedArray>().TypedArrayType() != napi_float64_array)
    ThrowNative(env, fn + (fields == kRowFields ? ": rows" : ": sets") + " must be a Float64Array");
  Napi::Float64Array rows = info[1].As<Napi::Float64Array>();
  size_t count = rows.ElementLength();
  if (count % step != 0) {
    ThrowNative(env, fields == kRowFields
                         ? "copyRowsAsync: rows must hold [dstBuffer, dstOffset, srcBuffer, srcOffset, width, height, "
                           "dstPitch, srcPitch] octuples"
                         : "copyPlanesAsync: sets must hold [dstBuffer, dstOffset, srcBuffer, srcOffset, width, height, "
                           "dstPitch, srcPitch, planes, dstPlanePitch, srcPlanePitch] 11-tuples");
  }
  size_t wantParts = ToSize(env, info[2], "parts");
  if (wantParts < 1 || wantParts > kMaxParts) ThrowNative(env, fn + ": parts must be in [1, 64]");
  const double* r = rows.Data();
  std::vector<Piece> pieces;
  pieces.reserve(count / step);
  uint64_t total = 0;
  for (size_t i = 0; i < count; i += step) {
    const double* e = r + i;
    const char* why = nullptr;
    Piece pc{nullptr, nullptr, 0};
    if (!Whole(e[0], nbuf - 1) || !Whole(e[2], nbuf - 1)) {
      why = "names no buffer";
    } else {
      // As copyRows' [dstOffset, srcOffset, width, height, dstPitch, srcPitch] (copyPlanes': and
      // [planes, dstPlanePitch, srcPlanePitch]).
      double set[kPlaneFields] = {e[1], e[3], e[4], e[5], e[6], e[7], 1, 0, 0};
      if (fields == kPlaneFields) {
        set[6] = e[8];
        set[7] = e[9];
        set[8] = e[10];
      }
      size_t db = static_cast<size_t>(e[0]), sb = static_cast<size_t>(e[2]);
      why = RowSetPiece(set, fields, b.data[db], b.length[db], b.data[sb], b.length[sb], &pc);
    }
    if (why == nullptr && pc.n > 0) {
      // Each set is inside a buffer (at most 2^53 bytes): its bytes and the sum of two such do not wrap.
      total += static_cast<uint64_t>(pc.n) * pc.rows * pc.planes;
      if (total > static_cast<uint64_t>(kMaxWhole)) why = "brings the copy past 2^53 bytes";
    }
    if (why != nullptr) {
      ThrowNative(env, fn + ": row set " + std::to_string(i / step) + " " + RowSetText(e, static_cast<int>(step)) +
                           " " + why);
    }
    if (pc.n > 0) pieces.push_back(pc);
  }
  return StartCopyJob(env, b, pieces, static_cast<size_t>(total), wantParts);
}

Napi::Value CopyRowsAsync(const Napi::CallbackInfo& info) { return CopySetsAsync(info, kRowFields); }
Napi::Value CopyPlanesAsync(const Napi::CallbackInfo& info) { return CopySetsAsync(info, kPlaneFields); }

}  // namespace

void InitMmap(Napi::Env env, Napi::Object exports) {
  exports.Set("copyRuns", Napi::Function::New(env, CopyRuns, "copyRuns"));
  exports.Set("copyRunsAsync", Napi::Function::New(env, CopyRunsAsync, "copyRunsAsync"));
  exports.Set("copyRows", Napi::Function::New(env, CopyRows, "copyRows"));
  exports.Set("copyRowsAsync", Napi::Function::New(env, CopyRowsAsync, "copyRowsAsync"));
  exports.Set("copyPlanes", Napi::Function::New(env, CopyPlanes, "copyPlanes"));
  exports.Set("copyPlanesAsync", Napi::Function::New(env, CopyPlanesAsync, "copyPlanesAsync"));
  exports.Set("mapFile", Napi::Function::New(env, MapFile, "mapFile"));
  exports.Set("unmapFile", Napi::Function::New(env, UnmapFile, "unmapFile"));
  exports.Set("mapStats", Napi::Function::New(env, MapStats, "mapStats"));
}

}  // namespace kvgate
