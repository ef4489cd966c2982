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

struct Piece {
  uint8_t* dst;
  const uint8_t* src;
  size_t n;
};

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
  for (size_t i = 0; i < count; i++) {
    if (pieces[i].n >= kStreamRunBytes) {
      _mm_sfence();  // streamed stores are visible before this returns
      break;
    }
  }
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

// copyRunsAsync(buffers: (ArrayBuffer | typed array)[], runs: Float64Array of
// [dstBuffer, dstOffset, srcBuffer, srcOffset, bytes] quintuples, parts) -> Promise<void>.
// Every run is checked before any byte moves; the bytes are then cut into grains (a run may
// be cut) that up to `parts` libuv pool threads share, each taking the next grain left.
// Until the promise settles every buffer stays referenced, a pinned one busy and a
// mapping's munmap deferred; the caller must not change the ranges meanwhile.
Napi::Value CopyRunsAsync(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (!info[0].IsArray()) ThrowNative(env, "copyRunsAsync: buffers must be an array");
  Napi::Array list = info[0].As<Napi::Array>();
  uint32_t nbuf = list.Length();
  if (nbuf == 0 || nbuf > 65536) ThrowNative(env, "copyRunsAsync: buffers must hold 1 to 65536 entries");
  std::vector<uint8_t*> data(nbuf);
  std::vector<size_t> length(nbuf);
  std::vector<Napi::ArrayBuffer> backing(nbuf);
  for (uint32_t i = 0; i < nbuf; i++) {
    Napi::Value v = list.Get(i);
    if (!ByteRange(v, &data[i], &length[i]))
      ThrowNative(env, "copyRunsAsync: buffers[" + std::to_string(i) + "] must be an ArrayBuffer or a typed array");
    backing[i] = v.IsArrayBuffer() ? v.As<Napi::ArrayBuffer>() : v.As<Napi::TypedArray>().ArrayBuffer();
  }
  if (!info[1].IsTypedArray() || info[1].As<Napi::TypedArray>().TypedArrayType() != napi_float64_array)
    ThrowNative(env, "copyRunsAsync: runs must be a Float64Array");
  Napi::Float64Array runs = info[1].As<Napi::Float64Array>();
  size_t count = runs.ElementLength();
  if (count % 5 != 0)
    ThrowNative(env, "copyRunsAsync: runs must hold [dstBuffer, dstOffset, srcBuffer, srcOffset, bytes] quintuples");
  size_t wantParts = ToSize(env, info[2], "parts");
  if (wantParts < 1 || wantParts > kMaxParts) ThrowNative(env, "copyRunsAsync: parts must be in [1, 64]");
  const double* r = runs.Data();
  constexpr double kMax = 9007199254740991.0;  // 2^53 - 1
  auto whole = [](double x, double limit) {
    return x >= 0 && x <= limit && x == static_cast<double>(static_cast<uint64_t>(x));
  };
  std::vector<Piece> pieces;
  pieces.reserve(count / 5);
  size_t total = 0;
  for (size_t i = 0; i < count; i += 5) {
    double db = r[i], d = r[i + 1], sb = r[i + 2], s = r[i + 3], n = r[i + 4];
    bool ok = whole(db, nbuf - 1) && whole(sb, nbuf - 1) && whole(d, kMax) && whole(s, kMax) && whole(n, kMax);
    if (ok) {
      size_t dl = length[static_cast<size_t>(db)], sl = length[static_cast<size_t>(sb)];
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
    uint8_t* to = data[static_cast<size_t>(db)] + static_cast<size_t>(d);
    const uint8_t* from = data[static_cast<size_t>(sb)] + static_cast<size_t>(s);
    // Pieces run concurrently: a run reading what it writes has no defined result.
    if (to < from + nu && from < to + nu) {
      ThrowNative(env, "copyRunsAsync: run " + std::to_string(i / 5) + " overlaps itself");
    }
    pieces.push_back({to, from, nu});
    total += nu;
  }
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
    for (uint32_t i = 0; i < nbuf; i++) HoldBuffer(env, job, backing[i]);
  } catch (...) {
    ReleaseJob(job);
    napi_resolve_deferred(env, deferred, env.Undefined());  // nobody sees this promise: the call throws
    delete job;
    throw;
  }
  // Grains of about kGrainBytes (a run longer than that is cut at 4 KiB of it, so a thread
  // streams whole pages of it), taken by the parts' threads one at a time.
  job->pieces.reserve(pieces.size() + total / kGrainBytes + 1);
  job->grains.reserve(total / kGrainBytes + 2);
  job->grains.push_back(0);
  size_t have = 0;
  for (Piece pc : pieces) {
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
      if (have >= kGrainBytes || (take == 0 && have > 0)) {
        job->grains.push_back(job->pieces.size());
        have = 0;
      }
    }
  }
  if (have > 0) job->grains.push_back(job->pieces.size());
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

}  // namespace

void InitMmap(Napi::Env env, Napi::Object exports) {
  exports.Set("copyRuns", Napi::Function::New(env, CopyRuns, "copyRuns"));
  exports.Set("copyRunsAsync", Napi::Function::New(env, CopyRunsAsync, "copyRunsAsync"));
  exports.Set("mapFile", Napi::Function::New(env, MapFile, "mapFile"));
  exports.Set("unmapFile", Napi::Function::New(env, UnmapFile, "unmapFile"));
  exports.Set("mapStats", Napi::Function::New(env, MapStats, "mapStats"));
}

}  // namespace kvgate
