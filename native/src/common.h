// Declarations shared by the addon's sources: the failure record carried out of
// worker threads, the promise-settling worker, host-buffer pinning and CUDA.
#pragma once

#include <napi.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace kvgate {

// What went wrong on a worker thread. Plain data so Execute() never touches
// N-API; turned into a JS Error with a stable `code` on the JS thread.
struct Failure {
  std::string code;  // "ERR_NATIVE" or "ERR_CUDA"; empty while nothing failed
  std::string message;
  int cudaError = 0;
  int sysErrno = 0;
  std::string syscall;
  bool failed() const { return !code.empty(); }
};

Failure NativeFailure(std::string message);
Failure ErrnoFailure(const char* syscall, int err, const std::string& context);
Failure CudaFailure(const char* fn, int err, const std::string& context);

Napi::Error ToError(Napi::Env env, const Failure& f);
[[noreturn]] void Throw(Napi::Env env, const Failure& f);
[[noreturn]] void ThrowNative(Napi::Env env, const std::string& message);

// Runs `work` on the libuv pool and settles the returned promise on the JS
// thread: rejected with ToError(failure), else resolved with finish(env).
// `keepAlive` objects stay referenced until then (so GC cannot free a buffer
// a copy is using); `cleanup` always runs on the JS thread before settling.
using WorkFn = std::function<void(Failure&)>;
using FinishFn = std::function<Napi::Value(Napi::Env)>;
Napi::Value RunAsync(Napi::Env env, const char* name, WorkFn work, FinishFn finish,
                     const std::vector<Napi::Object>& keepAlive = {}, std::function<void()> cleanup = nullptr);

// A host range that an async operation will read or write. Acquire validates
// the ArrayBuffer and the range, marks a pinned block busy (so freePinned
// refuses while the op runs); Release undoes that on the JS thread.
struct HostSpan {
  uint8_t* data = nullptr;  // start of the range
  size_t length = 0;
  void* block = nullptr;  // the pinned block it lies in, if any
};
HostSpan AcquireHost(Napi::Env env, Napi::Value buffer, Napi::Value offset, Napi::Value length);
// The same for a Uint8Array over any buffer (an ArrayBuffer, a SharedArrayBuffer, pinned memory).
HostSpan AcquireView(Napi::Env env, Napi::Value view, const char* what);
void ReleaseHost(const HostSpan& span);

// Argument readers for already-validated values (JS validates; these only
// refuse what would be unsafe, as ERR_NATIVE).
size_t ToSize(Napi::Env env, Napi::Value v, const char* what);
uint64_t ToU64(Napi::Env env, Napi::Value v, const char* what);
Napi::Value FromU64(Napi::Env env, uint64_t v);

// ---- CUDA (cuda.cc) ----
// The subset of the runtime API kvgate calls, resolved with dlsym. Types are
// spelled with plain C types so no CUDA header is needed to build.
struct CudaIpcHandle {
  char reserved[64];
};
struct CudaApi {
  int (*getDeviceCount)(int*) = nullptr;
  int (*setDevice)(int) = nullptr;
  int (*malloc)(void**, size_t) = nullptr;
  int (*free)(void*) = nullptr;
  int (*hostAlloc)(void**, size_t, unsigned) = nullptr;
  int (*freeHost)(void*) = nullptr;
  int (*hostRegister)(void*, size_t, unsigned) = nullptr;
  int (*hostUnregister)(void*) = nullptr;
  int (*memcpyAsync)(void*, const void*, size_t, int, void*) = nullptr;
  int (*streamCreate)(void**) = nullptr;
  int (*streamSynchronize)(void*) = nullptr;
  int (*streamDestroy)(void*) = nullptr;
  int (*eventCreate)(void**) = nullptr;
  int (*eventRecord)(void*, void*) = nullptr;
  int (*eventQuery)(void*) = nullptr;
  int (*eventSynchronize)(void*) = nullptr;
  int (*eventDestroy)(void*) = nullptr;
  int (*ipcOpenMemHandle)(void**, CudaIpcHandle, unsigned) = nullptr;
  int (*ipcCloseMemHandle)(void*) = nullptr;
  const char* (*getErrorString)(int) = nullptr;
  // Optional: used when the library has them.
  const char* (*getErrorName)(int) = nullptr;
  int (*getDevice)(int*) = nullptr;
  int (*runtimeGetVersion)(int*) = nullptr;
  int (*driverGetVersion)(int*) = nullptr;
  int (*streamCreateWithFlags)(void**, unsigned) = nullptr;
  int (*eventCreateWithFlags)(void**, unsigned) = nullptr;
  int (*ipcGetMemHandle)(CudaIpcHandle*, void*) = nullptr;
  int (*deviceGetByPCIBusId)(int*, const char*) = nullptr;
  int (*deviceGetPCIBusId)(char*, int, int) = nullptr;
  // cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, stream)
  int (*memcpy2DAsync)(void*, size_t, const void*, size_t, size_t, size_t, int, void*) = nullptr;
  int (*stubControl)(const char*) = nullptr;  // only in kvgate's test stub

  bool available = false;
  std::string reason;
  std::string library;
  int deviceCount = 0;
  int runtimeVersion = 0;
  int driverVersion = 0;
};

// Loads and probes libcudart once per process (thread-safe).
const CudaApi& Cuda();
// The device chosen by setDevice: the default for calls that name none.
int CurrentDevice();
// cudaSetDevice(CurrentDevice()) on the calling thread; false + failure if not.
bool EnterDevice(Failure& f);
// cudaSetDevice(device) on the calling thread (a worker thread serves calls for
// any device, so each call selects its own); false + failure if not.
bool EnterDeviceIndex(int device, Failure& f);
std::string CudaErrorText(int err);

// CRC-32 of data, continuing from crc (0 to start), as zlib's crc32 (crc32.cc):
// PCLMULQDQ folding when the CPU has it, zlib's code otherwise and for tails.
uint32_t Crc32(uint32_t crc, const uint8_t* data, size_t len);

void InitMemory(Napi::Env env, Napi::Object exports);
void InitCuda(Napi::Env env, Napi::Object exports);
void InitIo(Napi::Env env, Napi::Object exports);
void InitMmap(Napi::Env env, Napi::Object exports);  // mmap.cc
void InitKeys(Napi::Env env, Napi::Object exports);  // keys.cc

}  // namespace kvgate
