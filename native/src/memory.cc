// Pinned host memory: cudaHostAlloc when CUDA is usable, else page-aligned mmap
// + mlock (best effort), handed to JS as external ArrayBuffers.
// Also cudaHostRegister of JS-owned buffers, and the busy marks async ops use.
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "common.h"
#include "stream_copy.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace kvgate {
namespace {

enum class Kind { kCuda, kMlock, kNone };

const char* KindName(Kind k) {
  switch (k) {
    case Kind::kCuda: return "cuda";
    case Kind::kMlock: return "mlock";
    default: return "none";
  }
}

struct PinnedBlock {
  uint8_t* data = nullptr;
  size_t bytes = 0;
  void* mapBase = nullptr;  // what munmap gets (mmap kinds only)
  size_t mapLen = 0;
  Kind kind = Kind::kNone;
  bool hugePages = false;
  bool freed = false;
  int busy = 0;  // async operations using the block right now
  std::string reason;
};

struct AllocOptions {
  bool useCuda = true;
  bool lock = true;
  bool hugePages = true;
  bool prefault = false;
};

constexpr size_t kHugePage = 2u << 20;
// Node 20 backs external ArrayBuffers with Buffers, capped at 2^32 bytes
// (buffer.constants.MAX_LENGTH); later Node versions allow more.
constexpr size_t kMaxExternal = size_t(1) << 32;

size_t CheckAllocSize(Napi::Env env, Napi::Value v) {
  size_t bytes = ToSize(env, v, "bytes");
  if (bytes == 0) ThrowNative(env, "bytes must be at least 1");
  if (bytes > kMaxExternal) {
    ThrowNative(env, "bytes " + std::to_string(bytes) + " exceeds " + std::to_string(kMaxExternal) +
                         ", the largest external ArrayBuffer Node 20 creates; allocate several regions");
  }
  return bytes;
}

// Live blocks by data pointer, and JS buffers registered with cudaHostRegister
// (kept alive by a reference until unregistered). Guarded because worker
// threads' environments could share the addon.
std::mutex g_mu;
std::unordered_map<void*, PinnedBlock*> g_blocks;
size_t g_liveBytes = 0;
struct Registered {
  Napi::ObjectReference ref;
  napi_env env = nullptr;  // whose buffer: its teardown unregisters it
  size_t bytes = 0;
  bool pending = true;
};
std::unordered_map<void*, Registered*> g_registered;

std::string MemlockLimit() {
  struct rlimit rl;
  if (getrlimit(RLIMIT_MEMLOCK, &rl) != 0) return "unknown";
  if (rl.rlim_cur == RLIM_INFINITY) return "unlimited";
  return std::to_string(rl.rlim_cur) + " bytes";
}

void ReleaseMemory(PinnedBlock* b) {
  if (b->kind == Kind::kCuda) {
    const CudaApi& c = Cuda();
    if (c.freeHost != nullptr) c.freeHost(b->data);  // errors at exit are not actionable
  } else if (b->mapBase != nullptr) {
    munmap(b->mapBase, b->mapLen);  // also drops any mlock
  }
  b->data = nullptr;
  b->mapBase = nullptr;
}

// Pure C++ (no N-API): runs on a worker thread for allocPinned.
bool AllocateBlock(size_t bytes, const AllocOptions& o, PinnedBlock& b, Failure& f) {
  b.bytes = bytes;
  std::string why;
  if (o.useCuda) {
    const CudaApi& c = Cuda();
    if (c.available) {
      Failure df;
      void* p = nullptr;
      int err = 0;
      if (!EnterDevice(df)) {
        why = df.message + "; ";
      } else if ((err = c.hostAlloc(&p, bytes, 1 /* cudaHostAllocPortable */)) == 0) {
        std::memset(p, 0, bytes);  // ArrayBuffers are zeroed; pinned pages may be reused
        b.data = static_cast<uint8_t*>(p);
        b.kind = Kind::kCuda;
        b.reason = "cudaHostAlloc (portable) on device " + std::to_string(CurrentDevice());
        return true;
      } else {
        why = "cudaHostAlloc failed: " + CudaErrorText(err) + "; ";
      }
    } else {
      why = "CUDA unavailable (" + c.reason + "); ";
    }
  } else {
    why = "CUDA not requested; ";
  }

  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t rounded = (bytes + page - 1) / page * page;
  const bool wantHuge = o.hugePages && bytes >= kHugePage;
  const size_t mapLen = rounded + (wantHuge ? kHugePage : 0);
  void* base = mmap(nullptr, mapLen, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) {
    f = ErrnoFailure("mmap", errno, "allocPinned(" + std::to_string(bytes) + ")");
    return false;
  }
  uintptr_t start = reinterpret_cast<uintptr_t>(base);
  if (wantHuge) start = (start + kHugePage - 1) & ~(uintptr_t)(kHugePage - 1);
  b.mapBase = base;
  b.mapLen = mapLen;
  b.data = reinterpret_cast<uint8_t*>(start);
#ifdef MADV_HUGEPAGE
  if (wantHuge) b.hugePages = madvise(b.data, rounded / kHugePage * kHugePage, MADV_HUGEPAGE) == 0;
#endif
  if (!o.lock) {
    b.kind = Kind::kNone;
    b.reason = why + "page-aligned mmap, locking not requested";
  } else if (mlock(b.data, bytes) == 0) {
    b.kind = Kind::kMlock;
    b.reason = why + "page-aligned mmap + mlock";
  } else {
    int err = errno;
    b.kind = Kind::kNone;
    b.reason =
        why + "page-aligned mmap; mlock failed: " + std::strerror(err) + " (RLIMIT_MEMLOCK " + MemlockLimit() + ")";
  }
  if (b.hugePages) b.reason += ", MADV_HUGEPAGE";
  // Memory that is not locked is still faulted in lazily, one page (or huge page) per first
  // touch: a 32 MiB chunk copied into a fresh L1 slot ran at half speed. Pre-faulting here, on
  // the worker thread, moves that cost to allocation, as mlock would have.
  if (o.prefault && b.kind != Kind::kMlock) {
    bool done = false;
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older kernels answer EINVAL and the loop below runs
#endif
    done = madvise(b.data, rounded, MADV_POPULATE_WRITE) == 0;
    if (!done) {
      volatile uint8_t* p = b.data;
      for (size_t off = 0; off < rounded; off += page) p[off] = 0;
    }
    b.reason += ", pre-faulted";
  }
  return true;
}

// V8 does not see external memory: without these adjustments an unreferenced
// pinned buffer exerts no GC pressure and GBs can pile up before a collection.
void AdjustExternal(Napi::Env env, int64_t delta) { Napi::MemoryManagement::AdjustExternalMemory(env, delta); }

void FinalizeBlock(Napi::Env env, void*, PinnedBlock* b) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!b->freed) {
    AdjustExternal(env, -static_cast<int64_t>(b->bytes));
    auto it = g_blocks.find(b->data);
    if (it != g_blocks.end() && it->second == b) g_blocks.erase(it);
    g_liveBytes -= b->bytes;
    ReleaseMemory(b);
  }
  delete b;
}

Napi::Object Describe(Napi::Env env, PinnedBlock* b, Napi::ArrayBuffer ab) {
  Napi::Object o = Napi::Object::New(env);
  o.Set("buffer", ab);
  o.Set("kind", KindName(b->kind));
  o.Set("reason", b->reason);
  o.Set("hugePages", b->hugePages);
  return o;
}

// Hands a block to JS. On failure the memory is released here.
Napi::Object Publish(Napi::Env env, PinnedBlock* b) {
  // If this fails, Node runs FinalizeBlock itself (synchronously: it frees
  // the data of a Buffer it could not create), so nothing is released here;
  // doing so was a double free. Sizes are capped below kMaxExternal so the
  // one known failure (too large) cannot happen.
  Napi::ArrayBuffer ab = Napi::ArrayBuffer::New(env, b->data, b->bytes, FinalizeBlock, b);
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_blocks[b->data] = b;
    g_liveBytes += b->bytes;
  }
  AdjustExternal(env, static_cast<int64_t>(b->bytes));
  return Describe(env, b, ab);
}

AllocOptions ReadOptions(const Napi::CallbackInfo& info) {
  AllocOptions o;
  if (info.Length() > 1 && info[1].IsObject()) {
    Napi::Object opts = info[1].As<Napi::Object>();
    o.useCuda = opts.Get("cuda").ToBoolean();
    o.lock = opts.Get("lock").ToBoolean();
    o.hugePages = opts.Get("hugePages").ToBoolean();
    o.prefault = opts.Get("prefault").ToBoolean();
  }
  return o;
}

// allocPinned(bytes, {cuda, lock, hugePages, prefault}) -> Promise<{buffer, kind, reason, hugePages}>
Napi::Value AllocPinned(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  size_t bytes = CheckAllocSize(env, info[0]);
  AllocOptions o = ReadOptions(info);
  auto* b = new PinnedBlock();
  return RunAsync(
      env, "kvgate.allocPinned",
      [b, bytes, o](Failure& f) {
        if (!AllocateBlock(bytes, o, *b, f)) b->data = nullptr;
      },
      [b](Napi::Env env) -> Napi::Value { return Publish(env, b); }, {},
      // Runs before settling: a failed allocation's record is dropped here
      // because finish is not called on failure.
      [b]() {
        if (b->data == nullptr) delete b;
      });
}

Napi::Value AllocPinnedSync(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  size_t bytes = CheckAllocSize(env, info[0]);
  AllocOptions o = ReadOptions(info);
  auto* b = new PinnedBlock();
  Failure f;
  if (!AllocateBlock(bytes, o, *b, f)) {
    delete b;
    Throw(env, f);
  }
  return Publish(env, b);
}

Napi::Value FreePinned(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (!info[0].IsArrayBuffer()) ThrowNative(env, "freePinned expects an ArrayBuffer");
  Napi::ArrayBuffer ab = info[0].As<Napi::ArrayBuffer>();
  void* data = ab.Data();
  Registered* reg = nullptr;
  size_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_blocks.find(data);
    if (data == nullptr || it == g_blocks.end()) {
      ThrowNative(env, ab.IsDetached() ? "buffer was already freed (detached)" : "buffer is not a pinned allocation");
    }
    PinnedBlock* b = it->second;
    if (b->busy > 0) {
      ThrowNative(env, "pinned buffer is in use by " + std::to_string(b->busy) + " pending operation(s)");
    }
    auto rit = g_registered.find(data);
    if (rit != g_registered.end()) {
      if (rit->second->pending) ThrowNative(env, "pinned buffer is being registered with CUDA");
      reg = rit->second;
      g_registered.erase(rit);
    }
    b->freed = true;
    bytes = b->bytes;
    g_blocks.erase(it);
    g_liveBytes -= b->bytes;
    if (reg != nullptr && Cuda().hostUnregister != nullptr) Cuda().hostUnregister(data);
    ReleaseMemory(b);
  }
  delete reg;
  AdjustExternal(env, -static_cast<int64_t>(bytes));
  // Detached: every view now reads as empty and the finalizer only deletes
  // the bookkeeping (the memory is already gone).
  ab.Detach();
  return env.Undefined();
}

Napi::Value PinnedInfo(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (!info[0].IsArrayBuffer()) return env.Null();
  void* data = info[0].As<Napi::ArrayBuffer>().Data();
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_blocks.find(data);
  if (data == nullptr || it == g_blocks.end()) return env.Null();
  Napi::Object o = Napi::Object::New(env);
  o.Set("kind", KindName(it->second->kind));
  o.Set("reason", it->second->reason);
  o.Set("bytes", Napi::Number::New(env, static_cast<double>(it->second->bytes)));
  o.Set("hugePages", it->second->hugePages);
  o.Set("busy", it->second->busy);
  o.Set("registered", g_registered.count(data) > 0);
  return o;
}

Napi::Value MemoryStats(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  std::lock_guard<std::mutex> lock(g_mu);
  Napi::Object o = Napi::Object::New(env);
  o.Set("pinnedBlocks", Napi::Number::New(env, static_cast<double>(g_blocks.size())));
  o.Set("pinnedBytes", Napi::Number::New(env, static_cast<double>(g_liveBytes)));
  o.Set("registered", Napi::Number::New(env, static_cast<double>(g_registered.size())));
  return o;
}

Napi::Value RequireCuda(Napi::Env env) {
  const CudaApi& c = Cuda();
  if (!c.available) {
    Failure f;
    f.code = "ERR_CUDA";
    f.message = "CUDA is not available: " + c.reason;
    Throw(env, f);
  }
  return env.Undefined();
}

// registerHost(arrayBuffer) -> Promise<void>: cudaHostRegister of the whole buffer.
Napi::Value RegisterHost(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (!info[0].IsArrayBuffer()) ThrowNative(env, "registerHost expects an ArrayBuffer");
  Napi::ArrayBuffer ab = info[0].As<Napi::ArrayBuffer>();
  if (ab.Data() == nullptr || ab.ByteLength() == 0) ThrowNative(env, "cannot register an empty or detached buffer");
  RequireCuda(env);
  void* data = ab.Data();
  size_t bytes = ab.ByteLength();
  auto* reg = new Registered();
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_registered.count(data) > 0) {
      delete reg;
      ThrowNative(env, "buffer is already registered");
    }
    reg->ref = Napi::Persistent(ab.As<Napi::Object>());
    reg->env = env;
    reg->bytes = bytes;
    g_registered[data] = reg;
  }
  auto ok = std::make_shared<bool>(false);
  return RunAsync(
      env, "kvgate.registerHost",
      [data, bytes, ok](Failure& f) {
        if (!EnterDevice(f)) return;
        int err = Cuda().hostRegister(data, bytes, 1 /* cudaHostRegisterPortable */);
        if (err != 0) {
          f = CudaFailure("cudaHostRegister", err, "registerHost");
          return;
        }
        *ok = true;
      },
      nullptr, {},
      [data, reg, ok]() {
        std::lock_guard<std::mutex> lock(g_mu);
        if (*ok) {
          reg->pending = false;
        } else {
          g_registered.erase(data);
          delete reg;
        }
      });
}

Napi::Value UnregisterHost(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (!info[0].IsArrayBuffer()) ThrowNative(env, "unregisterHost expects an ArrayBuffer");
  void* data = info[0].As<Napi::ArrayBuffer>().Data();
  Registered* reg = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_registered.find(data);
    if (data == nullptr || it == g_registered.end()) ThrowNative(env, "buffer is not registered");
    if (it->second->pending) ThrowNative(env, "buffer registration is still in progress");
    reg = it->second;
    g_registered.erase(it);
  }
  int err = Cuda().hostUnregister(data);
  delete reg;
  if (err != 0) Throw(env, CudaFailure("cudaHostUnregister", err, "unregisterHost"));
  return env.Undefined();
}

}  // namespace

HostSpan AcquireHost(Napi::Env env, Napi::Value buffer, Napi::Value offset, Napi::Value length) {
  if (!buffer.IsArrayBuffer()) ThrowNative(env, "host buffer must be an ArrayBuffer");
  Napi::ArrayBuffer ab = buffer.As<Napi::ArrayBuffer>();
  size_t off = ToSize(env, offset, "host offset");
  size_t len = ToSize(env, length, "host length");
  if (ab.IsDetached()) ThrowNative(env, "host buffer is detached (freed)");
  size_t total = ab.ByteLength();
  if (off > total || len > total - off) {
    ThrowNative(env, "host range [" + std::to_string(off) + ", +" + std::to_string(len) + ") is outside the " +
                         std::to_string(total) + "-byte buffer");
  }
  HostSpan s;
  s.data = static_cast<uint8_t*>(ab.Data()) + off;
  s.length = len;
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_blocks.find(ab.Data());
  if (ab.Data() != nullptr && it != g_blocks.end()) {
    it->second->busy++;
    s.block = it->second;
  }
  return s;
}

HostSpan AcquireView(Napi::Env env, Napi::Value view, const char* what) {
  // A Uint8Array over an ArrayBuffer, a SharedArrayBuffer (a codec worker's staging) or pinned
  // memory: napi_get_typedarray_info gives the bytes whatever the buffer's kind (napi has no
  // SharedArrayBuffer accessor of its own in the Node versions kvgate supports).
  napi_typedarray_type type;
  size_t length = 0, offset = 0;
  void* data = nullptr;
  napi_value buffer;
  if (!view.IsTypedArray() ||
      napi_get_typedarray_info(env, view, &type, &length, &data, &buffer, &offset) != napi_ok ||
      type != napi_uint8_array) {
    ThrowNative(env, std::string(what) + " must be a Uint8Array");
  }
  if (data == nullptr && length > 0) ThrowNative(env, std::string(what) + " is detached");
  HostSpan s;
  s.data = static_cast<uint8_t*>(data);
  s.length = length;
  if (data == nullptr) return s;
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_blocks.find(static_cast<uint8_t*>(data) - offset);
  if (it != g_blocks.end()) {
    it->second->busy++;
    s.block = it->second;
  }
  return s;
}

void ReleaseHost(const HostSpan& span) {
  if (span.block == nullptr) return;
  std::lock_guard<std::mutex> lock(g_mu);
  static_cast<PinnedBlock*>(span.block)->busy--;
}

// A worker thread's environment is going away: its registered buffers are
// about to be freed, so CUDA must stop treating that memory as page-locked.
static void OnEnvTeardown(napi_env env) {
  std::vector<std::pair<void*, Registered*>> mine;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    for (auto it = g_registered.begin(); it != g_registered.end();) {
      if (it->second->env == env && !it->second->pending) {
        mine.emplace_back(it->first, it->second);
        it = g_registered.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& [data, reg] : mine) {
    if (Cuda().hostUnregister != nullptr) Cuda().hostUnregister(data);
    delete reg;
  }
}

// copyHost(dst, dstOffset, src, srcOffset, length) -> Promise<void>: a host-to-host
// copy on the libuv pool, so a retrieve's copy from an L1 slot into the caller's
// buffer runs beside the reads instead of on the JS thread. Both buffers stay
// referenced (and a pinned one busy) until it settles.
static Napi::Value CopyHost(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  HostSpan dst = AcquireHost(env, info[0], info[1], info[4]);
  HostSpan src;
  try {
    src = AcquireHost(env, info[2], info[3], info[4]);
  } catch (...) {
    ReleaseHost(dst);
    throw;
  }
  return RunAsync(
      env, "kvgate.copyHost", [dst, src](Failure&) { std::memmove(dst.data, src.data, src.length); }, nullptr,
      {info[0].As<Napi::Object>(), info[2].As<Napi::Object>()},
      [dst, src]() {
        ReleaseHost(dst);
        ReleaseHost(src);
      });
}

// copyViews(dst: Uint8Array, src: Uint8Array) -> Promise<void>: copies all of src to the start of
// dst on the libuv pool with streaming stores. Either may lie in a SharedArrayBuffer: a codec
// worker's decoded tensor goes from its staging into an L1 slot (32 MiB) without holding the JS
// thread, which copied every chunk of a cold node's L4 load before. Both views stay referenced
// (a pinned one busy) until it settles; the caller keeps src unwritten meanwhile.
static Napi::Value CopyViews(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  HostSpan dst = AcquireView(env, info[0], "dst");
  HostSpan src;
  try {
    src = AcquireView(env, info[1], "src");
  } catch (...) {
    ReleaseHost(dst);
    throw;
  }
  if (src.length > dst.length) {
    ReleaseHost(dst);
    ReleaseHost(src);
    ThrowNative(env, "src (" + std::to_string(src.length) + " bytes) does not fit dst (" +
                         std::to_string(dst.length) + " bytes)");
  }
  return RunAsync(
      env, "kvgate.copyViews",
      [dst, src](Failure&) {
        if (src.length < 4096) {
          std::memmove(dst.data, src.data, src.length);
          return;
        }
        // Overlapping views would need memmove's order; streaming stores only for disjoint ones.
        if (dst.data + src.length <= src.data || src.data + src.length <= dst.data) {
          StreamCopy(dst.data, src.data, src.length);
#if defined(__SSE2__)
          _mm_sfence();  // the streaming stores are visible before the JS thread hears of them
#endif
        } else {
          std::memmove(dst.data, src.data, src.length);
        }
      },
      nullptr, {info[0].As<Napi::Object>(), info[1].As<Napi::Object>()},
      [dst, src]() {
        ReleaseHost(dst);
        ReleaseHost(src);
      });
}

void InitMemory(Napi::Env env, Napi::Object exports) {
  napi_add_env_cleanup_hook(
      env, [](void* arg) { OnEnvTeardown(static_cast<napi_env>(arg)); }, static_cast<napi_env>(env));
  exports.Set("allocPinned", Napi::Function::New(env, AllocPinned, "allocPinned"));
  exports.Set("allocPinnedSync", Napi::Function::New(env, AllocPinnedSync, "allocPinnedSync"));
  exports.Set("freePinned", Napi::Function::New(env, FreePinned, "freePinned"));
  exports.Set("pinnedInfo", Napi::Function::New(env, PinnedInfo, "pinnedInfo"));
  exports.Set("memoryStats", Napi::Function::New(env, MemoryStats, "memoryStats"));
  exports.Set("registerHost", Napi::Function::New(env, RegisterHost, "registerHost"));
  exports.Set("unregisterHost", Napi::Function::New(env, UnregisterHost, "unregisterHost"));
  exports.Set("copyHost", Napi::Function::New(env, CopyHost, "copyHost"));
  exports.Set("copyViews", Napi::Function::New(env, CopyViews, "copyViews"));
}

}  // namespace kvgate
