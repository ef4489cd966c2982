// File mappings as external ArrayBuffers: an engine's KV tensor in /dev/shm seen as
// memory, so the agent copies scattered blocks without one syscall per block.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
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

}  // namespace

void InitMmap(Napi::Env env, Napi::Object exports) {
  exports.Set("mapFile", Napi::Function::New(env, MapFile, "mapFile"));
  exports.Set("unmapFile", Napi::Function::New(env, UnmapFile, "unmapFile"));
  exports.Set("mapStats", Napi::Function::New(env, MapStats, "mapStats"));
}

}  // namespace kvgate
