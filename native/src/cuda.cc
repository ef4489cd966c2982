// CUDA through a run-time dlopen of libcudart (no link-time dependency):
// probing, device memory, streams, async, batched and strided copies, IPC handles.
#include <cmath>
#include <dlfcn.h>
#include <link.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "common.h"

namespace kvgate {
namespace {

std::once_flag g_once;
CudaApi g_api;
std::atomic<int> g_device{0};

// Streams created through createStream: the device each belongs to (copies on
// it must run with that device current) and the number of copies using it
// (destroying a stream under a running copy would be a use-after-free).
struct StreamInfo {
  int device;
  int inflight;
};
std::mutex g_streamMu;
std::unordered_map<void*, StreamInfo> g_streams;
std::unordered_map<int, void*> g_defaultStreams;  // per device, created on first use

const char* ErrorName(int err) {
  if (g_api.getErrorName != nullptr) return g_api.getErrorName(err);
  return nullptr;
}

template <typename T>
bool Resolve(void* h, const char* name, T& slot) {
  slot = reinterpret_cast<T>(dlsym(h, name));
  return slot != nullptr;
}

void Probe(CudaApi& a) {
  std::vector<std::string> candidates;
  const char* override = std::getenv("KVGATE_CUDART");
  if (override != nullptr && *override != '\0') {
    candidates.push_back(override);  // an explicit choice is never second-guessed
  } else {
    candidates = {"libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0",
                  "/usr/local/cuda/lib64/libcudart.so"};
  }
  void* h = nullptr;
  std::string tried;
  for (const auto& c : candidates) {
    h = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h != nullptr) break;
    const char* e = dlerror();
    tried += (tried.empty() ? "" : "; ") + (e != nullptr ? std::string(e) : c + ": not found");
  }
  if (h == nullptr) {
    a.reason = "libcudart could not be loaded (" + tried + ")";
    if (override == nullptr) a.reason += "; set KVGATE_CUDART to its path";
    return;
  }
  struct link_map* lm = nullptr;
  a.library = (dlinfo(h, RTLD_DI_LINKMAP, &lm) == 0 && lm != nullptr && lm->l_name != nullptr && *lm->l_name)
                  ? lm->l_name
                  : candidates.front();

  std::string missing;
  auto need = [&](bool ok, const char* name) {
    if (!ok) missing += (missing.empty() ? "" : ", ") + std::string(name);
  };
#define KV_NEED(field, name) need(Resolve(h, name, a.field), name)
  KV_NEED(getDeviceCount, "cudaGetDeviceCount");
  KV_NEED(setDevice, "cudaSetDevice");
  KV_NEED(malloc, "cudaMalloc");
  KV_NEED(free, "cudaFree");
  KV_NEED(hostAlloc, "cudaHostAlloc");
  KV_NEED(freeHost, "cudaFreeHost");
  KV_NEED(hostRegister, "cudaHostRegister");
  KV_NEED(hostUnregister, "cudaHostUnregister");
  KV_NEED(memcpyAsync, "cudaMemcpyAsync");
  KV_NEED(streamCreate, "cudaStreamCreate");
  KV_NEED(streamSynchronize, "cudaStreamSynchronize");
  KV_NEED(streamDestroy, "cudaStreamDestroy");
  KV_NEED(eventCreate, "cudaEventCreate");
  KV_NEED(eventRecord, "cudaEventRecord");
  KV_NEED(eventQuery, "cudaEventQuery");
  KV_NEED(eventSynchronize, "cudaEventSynchronize");
  KV_NEED(eventDestroy, "cudaEventDestroy");
  KV_NEED(ipcOpenMemHandle, "cudaIpcOpenMemHandle");
  KV_NEED(ipcCloseMemHandle, "cudaIpcCloseMemHandle");
  KV_NEED(getErrorString, "cudaGetErrorString");
#undef KV_NEED
  Resolve(h, "cudaGetErrorName", a.getErrorName);
  Resolve(h, "cudaGetDevice", a.getDevice);
  Resolve(h, "cudaRuntimeGetVersion", a.runtimeGetVersion);
  Resolve(h, "cudaDriverGetVersion", a.driverGetVersion);
  Resolve(h, "cudaStreamCreateWithFlags", a.streamCreateWithFlags);
  Resolve(h, "cudaEventCreateWithFlags", a.eventCreateWithFlags);
  Resolve(h, "cudaIpcGetMemHandle", a.ipcGetMemHandle);
  Resolve(h, "cudaDeviceGetByPCIBusId", a.deviceGetByPCIBusId);
  Resolve(h, "cudaDeviceGetPCIBusId", a.deviceGetPCIBusId);
  Resolve(h, "cudaMemcpy2DAsync", a.memcpy2DAsync);  // copy2D issues one cudaMemcpyAsync per row without it
  Resolve(h, "kvgate_stub_control", a.stubControl);
  if (!missing.empty()) {
    a.reason = a.library + " lacks " + missing;
    a.getErrorString = nullptr;
    return;
  }
  if (a.runtimeGetVersion != nullptr) a.runtimeGetVersion(&a.runtimeVersion);
  if (a.driverGetVersion != nullptr) a.driverGetVersion(&a.driverVersion);
  int n = 0;
  int err = a.getDeviceCount(&n);
  if (err != 0) {
    // 35 (insufficient driver) is what a machine with libcudart but no GPU
    // driver answers; 100 is "no device".
    a.reason = "cudaGetDeviceCount failed: " + CudaErrorText(err) + " [" + a.library + "]";
    return;
  }
  if (n <= 0) {
    a.reason = "no CUDA device [" + a.library + "]";
    return;
  }
  a.deviceCount = n;
  a.available = true;
}

[[noreturn]] void FailCuda(Napi::Env env, const char* fn, int err, const std::string& ctx) {
  Throw(env, CudaFailure(fn, err, ctx));
}

void RequireAvailable(Napi::Env env) {
  const CudaApi& c = Cuda();
  if (c.available) return;
  Failure f;
  f.code = "ERR_CUDA";
  f.message = "CUDA is not available: " + c.reason;
  Throw(env, f);
}

Napi::Value ProbeJs(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  const CudaApi& c = Cuda();
  Napi::Object o = Napi::Object::New(env);
  o.Set("available", c.available);
  o.Set("reason", c.reason);
  o.Set("library", c.library);
  o.Set("deviceCount", c.deviceCount);
  o.Set("runtimeVersion", c.runtimeVersion);
  o.Set("driverVersion", c.driverVersion);
  o.Set("stub", c.stubControl != nullptr);
  o.Set("ipcGetHandle", c.ipcGetMemHandle != nullptr);
  o.Set("memcpy2D", c.memcpy2DAsync != nullptr);
  return o;
}

Napi::Value SetDeviceJs(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireAvailable(env);
  size_t d = ToSize(env, info[0], "device");
  const CudaApi& c = Cuda();
  if (d >= static_cast<size_t>(c.deviceCount)) {
    ThrowNative(env, "device " + std::to_string(d) + " out of range (" + std::to_string(c.deviceCount) + " device(s))");
  }
  int err = c.setDevice(static_cast<int>(d));
  if (err != 0) FailCuda(env, "cudaSetDevice", err, "setDevice");
  g_device = static_cast<int>(d);
  return env.Undefined();
}

Napi::Value GetDeviceJs(const Napi::CallbackInfo& info) { return Napi::Number::New(info.Env(), g_device.load()); }

// The device a call names: undefined or -1 = the one chosen by setDevice;
// else an ordinal below the device count, checked here on the JS thread so a
// bad one throws before anything is queued.
int DeviceArg(Napi::Env env, const Napi::Value& v) {
  if (v.IsUndefined() || v.IsNull()) return g_device.load();
  if (!v.IsNumber()) ThrowNative(env, "device must be an integer");
  double d = v.As<Napi::Number>().DoubleValue();
  if (d == -1) return g_device.load();
  const int n = Cuda().deviceCount;
  // Range first: converting a double outside int64 (1e300, Infinity) to an integer is undefined behaviour.
  if (!(d >= 0) || d >= n || d != std::floor(d)) {
    ThrowNative(env, "device " + v.ToString().Utf8Value() + " out of range (" + std::to_string(n) + " device(s))");
  }
  return static_cast<int>(d);
}

// deviceByPciBusId(id: string) -> ordinal in this process (cudaDeviceGetByPCIBusId):
// the same physical GPU whatever CUDA_VISIBLE_DEVICES each process was given.
Napi::Value DeviceByPciBusIdJs(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireAvailable(env);
  if (!info[0].IsString()) ThrowNative(env, "PCI bus id must be a string");
  std::string id = info[0].As<Napi::String>().Utf8Value();
  if (id.empty() || id.size() > 63 || id.find('\0') != std::string::npos) {
    ThrowNative(env, "PCI bus id must be 1 to 63 characters");
  }
  const CudaApi& c = Cuda();
  if (c.deviceGetByPCIBusId == nullptr) ThrowNative(env, c.library + " has no cudaDeviceGetByPCIBusId");
  int d = -1;
  int err = c.deviceGetByPCIBusId(&d, id.c_str());
  if (err != 0) FailCuda(env, "cudaDeviceGetByPCIBusId", err, "PCI bus id " + id);
  return Napi::Number::New(env, d);
}

// pciBusId(device) -> "domain:bus:device.function" (cudaDeviceGetPCIBusId).
Napi::Value PciBusIdJs(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireAvailable(env);
  int d = DeviceArg(env, info[0]);
  const CudaApi& c = Cuda();
  if (c.deviceGetPCIBusId == nullptr) ThrowNative(env, c.library + " has no cudaDeviceGetPCIBusId");
  char id[64] = {0};
  int err = c.deviceGetPCIBusId(id, sizeof id - 1, d);
  if (err != 0) FailCuda(env, "cudaDeviceGetPCIBusId", err, "device " + std::to_string(d));
  return Napi::String::New(env, id);
}

Napi::Value MallocJs(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireAvailable(env);
  size_t bytes = ToSize(env, info[0], "bytes");
  Failure f;
  if (!EnterDevice(f)) Throw(env, f);
  void* p = nullptr;
  int err = Cuda().malloc(&p, bytes);
  if (err != 0) FailCuda(env, "cudaMalloc", err, "deviceAlloc(" + std::to_string(bytes) + ")");
  return FromU64(env, reinterpret_cast<uintptr_t>(p));
}

Napi::Value FreeJs(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireAvailable(env);
  uint64_t p = ToU64(env, info[0], "device pointer");
  Failure f;
  if (!EnterDevice(f)) Throw(env, f);
  int err = Cuda().free(reinterpret_cast<void*>(p));
  if (err != 0) FailCuda(env, "cudaFree", err, "deviceFree");
  return env.Undefined();
}

Napi::Value StreamCreateJs(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireAvailable(env);
  const int device = DeviceArg(env, info[0]);
  Failure f;
  if (!EnterDeviceIndex(device, f)) Throw(env, f);
  const CudaApi& c = Cuda();
  void* s = nullptr;
  // Non-blocking: kvgate's copies must not serialize with the engine's work on
  // the legacy default stream.
  int err = c.streamCreateWithFlags != nullptr ? c.streamCreateWithFlags(&s, 1) : c.streamCreate(&s);
  if (err != 0) FailCuda(env, "cudaStreamCreate", err, "createStream");
  std::lock_guard<std::mutex> lock(g_streamMu);
  g_streams[s] = StreamInfo{device, 0};
  return FromU64(env, reinterpret_cast<uintptr_t>(s));
}

Napi::Value StreamDestroyJs(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  void* s = reinterpret_cast<void*>(ToU64(env, info[0], "stream"));
  {
    std::lock_guard<std::mutex> lock(g_streamMu);
    auto it = g_streams.find(s);
    if (it == g_streams.end()) ThrowNative(env, "unknown stream (not created by createStream, or destroyed)");
    if (it->second.inflight > 0) {
      ThrowNative(env, "stream has " + std::to_string(it->second.inflight) + " copy(ies) in flight");
    }
    g_streams.erase(it);
  }
  int err = Cuda().streamDestroy(s);
  if (err != 0) FailCuda(env, "cudaStreamDestroy", err, "destroyStream");
  return env.Undefined();
}

// Worker side, with `dev` current: the stream a copy runs on (0 = kvgate's
// stream of `dev`, one per device so copies for different GPUs run side by side).
bool StreamFor(void* requested, int dev, void** out, Failure& f) {
  if (requested != nullptr) {
    *out = requested;
    return true;
  }
  std::lock_guard<std::mutex> lock(g_streamMu);
  auto it = g_defaultStreams.find(dev);
  if (it != g_defaultStreams.end()) {
    *out = it->second;
    return true;
  }
  const CudaApi& c = Cuda();
  void* s = nullptr;
  int err = c.streamCreateWithFlags != nullptr ? c.streamCreateWithFlags(&s, 1) : c.streamCreate(&s);
  if (err != 0) {
    f = CudaFailure("cudaStreamCreate", err, "default copy stream");
    return false;
  }
  g_defaultStreams[dev] = s;
  *out = s;
  return true;
}

enum Direction { kH2D = 1, kD2H = 2, kD2D = 3 };

// Where a copy call runs: its stream (0 = kvgate's stream of the device) and device.
struct CopyPlace {
  void* stream = nullptr;
  int device = 0;
  bool deviceGiven = false;  // named by the caller, so a created stream of another device is refused
};

CopyPlace CopyPlaceArgs(Napi::Env env, const Napi::Value& stream, const Napi::Value& device) {
  CopyPlace p;
  p.stream = reinterpret_cast<void*>(ToU64(env, stream, "stream"));
  p.deviceGiven = !device.IsUndefined() && !device.IsNull() &&
                  !(device.IsNumber() && device.As<Napi::Number>().DoubleValue() == -1);
  p.device = DeviceArg(env, device);
  return p;
}

// The length of the host range [offset, offset + length) of `buffer`, checked without claiming
// it, so descriptors can be validated against it before anything is marked busy.
uint64_t HostRangeLength(Napi::Env env, const Napi::Value& buffer, const Napi::Value& offset,
                         const Napi::Value& length) {
  if (!buffer.IsArrayBuffer()) ThrowNative(env, "a host buffer is required for host copies");
  Napi::ArrayBuffer ab = buffer.As<Napi::ArrayBuffer>();
  if (ab.IsDetached()) ThrowNative(env, "host buffer is detached (freed)");
  size_t off = ToSize(env, offset, "host offset");
  size_t len = ToSize(env, length, "host length");
  if (off > ab.ByteLength() || len > ab.ByteLength() - off) ThrowNative(env, "host range is outside the buffer");
  return len;
}

// What a queued copy holds until it settles: the host range (a pinned block marked busy, so
// freePinned refuses) and its stream's in-flight count (so destroyStream refuses). Taken once
// every argument passed; QueueCopies gives both back on the JS thread.
struct CopyClaim {
  HostSpan host;
  void* stream = nullptr;
  int device = 0;
};

CopyClaim ClaimCopy(Napi::Env env, const CopyPlace& place, bool hostSide, const Napi::Value& buffer,
                    const Napi::Value& offset, const Napi::Value& length) {
  CopyClaim claim;
  claim.stream = place.stream;
  claim.device = place.device;
  if (hostSide) claim.host = AcquireHost(env, buffer, offset, length);
  if (place.stream == nullptr) return claim;
  std::unique_lock<std::mutex> lock(g_streamMu);
  auto it = g_streams.find(place.stream);
  if (it == g_streams.end()) {
    lock.unlock();
    ReleaseHost(claim.host);
    ThrowNative(env, "unknown stream (not created by createStream, or destroyed)");
  }
  if (place.deviceGiven && it->second.device != place.device) {
    const int own = it->second.device;
    lock.unlock();
    ReleaseHost(claim.host);
    ThrowNative(env,
                "stream belongs to device " + std::to_string(own) + ", not device " + std::to_string(place.device));
  }
  claim.device = it->second.device;
  it->second.inflight++;
  return claim;
}

// Queues one call's copies on stream `s` (its device current); false + failure stops the call.
using IssueFn = std::function<bool(const CudaApi& c, void* s, uint8_t* host, Failure& f)>;

// Runs `issue` on the libuv pool with the claim's device current and its stream, then waits on
// an event recorded behind the copies; settles with finish(env). The claim is given back on the
// JS thread whatever happened.
Napi::Value QueueCopies(Napi::Env env, const char* name, const CopyClaim& claim, std::vector<Napi::Object> keep,
                        IssueFn issue, FinishFn finish) {
  return RunAsync(
      env, name,
      [claim, issue](Failure& f) {
        if (!EnterDeviceIndex(claim.device, f)) return;
        const CudaApi& c = Cuda();
        void* s = nullptr;
        if (!StreamFor(claim.stream, claim.device, &s, f)) return;
        if (!issue(c, s, claim.host.data, f)) {
          // Copies already queued may still touch the host buffer: drain
          // before the buffer is released on the JS thread.
          c.streamSynchronize(s);
          return;
        }
        void* ev = nullptr;
        int err =
            c.eventCreateWithFlags != nullptr ? c.eventCreateWithFlags(&ev, 2 /* DisableTiming */) : c.eventCreate(&ev);
        if (err != 0) {
          int serr = c.streamSynchronize(s);
          if (serr != 0) f = CudaFailure("cudaStreamSynchronize", serr, "copy");
          return;
        }
        err = c.eventRecord(ev, s);
        if (err != 0) {
          c.streamSynchronize(s);
          f = CudaFailure("cudaEventRecord", err, "copy");
        } else {
          err = c.eventSynchronize(ev);
          if (err != 0) f = CudaFailure("cudaEventSynchronize", err, "copy");
        }
        c.eventDestroy(ev);
      },
      finish, keep,
      [claim]() {
        ReleaseHost(claim.host);
        if (claim.stream != nullptr) {
          std::lock_guard<std::mutex> lock(g_streamMu);
          auto it = g_streams.find(claim.stream);
          if (it != g_streams.end()) it->second.inflight--;
        }
      });
}

FinishFn CopyResult(size_t descriptors, size_t issued, uint64_t bytes) {
  return [descriptors, issued, bytes](Napi::Env env) -> Napi::Value {
    Napi::Object o = Napi::Object::New(env);
    o.Set("descriptors", Napi::Number::New(env, static_cast<double>(descriptors)));
    o.Set("issued", Napi::Number::New(env, static_cast<double>(issued)));
    o.Set("bytes", Napi::Number::New(env, static_cast<double>(bytes)));
    return o;
  };
}

struct Desc {
  uint64_t src, dst, len;
};

// copy(direction, hostBuffer|null, hostOffset, hostLength, descriptors: BigInt64Array, stream: bigint,
//      device?: number) -> Promise<{descriptors, issued, bytes}>
// Runs with `device` current (default: the stream's device, else setDevice's).
// Descriptors are [src, dst, bytes] triples; the host side of each is an
// offset into the host range, re-checked here before anything is queued.
Napi::Value CopyJs(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireAvailable(env);
  size_t dir = ToSize(env, info[0], "direction");
  if (dir < kH2D || dir > kD2D) ThrowNative(env, "direction must be 1 (h2d), 2 (d2h) or 3 (d2d)");
  if (!info[4].IsTypedArray() || info[4].As<Napi::TypedArray>().TypedArrayType() != napi_bigint64_array) {
    ThrowNative(env, "descriptors must be a BigInt64Array of [src, dst, bytes] triples");
  }
  Napi::TypedArray ta = info[4].As<Napi::TypedArray>();
  size_t n = ta.ElementLength();
  if (n % 3 != 0) ThrowNative(env, "descriptors length must be a multiple of 3");
  const CopyPlace place = CopyPlaceArgs(env, info[5], info[6]);
  // Copied out below, so later JS writes cannot change what was validated.
  const int64_t* raw = info[4].As<Napi::BigInt64Array>().Data();
  auto descs = std::make_shared<std::vector<Desc>>();
  descs->reserve(n / 3);
  const bool hostSrc = dir == kH2D, hostDst = dir == kD2H;
  // Validate bounds before claiming so a throw leaves nothing marked busy.
  const uint64_t hostLen = hostSrc || hostDst ? HostRangeLength(env, info[1], info[2], info[3]) : 0;
  uint64_t total = 0;
  for (size_t i = 0; i < n; i += 3) {
    Desc d{static_cast<uint64_t>(raw[i]), static_cast<uint64_t>(raw[i + 1]), static_cast<uint64_t>(raw[i + 2])};
    if (raw[i + 2] < 0) ThrowNative(env, "descriptor " + std::to_string(i / 3) + ": negative length");
    if (d.len == 0) continue;
    uint64_t hostOff = hostSrc ? d.src : d.dst;
    if ((hostSrc || hostDst) && (raw[hostSrc ? i : i + 1] < 0 || hostOff > hostLen || d.len > hostLen - hostOff)) {
      ThrowNative(env, "descriptor " + std::to_string(i / 3) + ": host range [" +
                           std::to_string(raw[hostSrc ? i : i + 1]) + ", +" + std::to_string(d.len) +
                           ") is outside the " + std::to_string(hostLen) + "-byte host range");
    }
    if ((!hostSrc && d.src == 0) || (!hostDst && d.dst == 0)) {
      ThrowNative(env, "descriptor " + std::to_string(i / 3) + ": null device pointer");
    }
    total += d.len;
    // Adjacent blocks (contiguous on both sides) become one memcpy.
    if (!descs->empty()) {
      Desc& last = descs->back();
      if (last.src + last.len == d.src && last.dst + last.len == d.dst) {
        last.len += d.len;
        continue;
      }
    }
    descs->push_back(d);
  }
  const CopyClaim claim = ClaimCopy(env, place, hostSrc || hostDst, info[1], info[2], info[3]);
  std::vector<Napi::Object> keep;
  if (hostSrc || hostDst) keep.push_back(info[1].As<Napi::Object>());
  const int kind = static_cast<int>(dir);
  return QueueCopies(
      env, "kvgate.copy", claim, keep,
      [descs, kind, hostSrc, hostDst](const CudaApi& c, void* s, uint8_t* host, Failure& f) {
        for (const Desc& d : *descs) {
          void* dst = hostDst ? host + d.dst : reinterpret_cast<void*>(d.dst);
          const void* src = hostSrc ? host + d.src : reinterpret_cast<const void*>(d.src);
          int err = c.memcpyAsync(dst, src, d.len, kind, s);
          if (err != 0) {
            f = CudaFailure("cudaMemcpyAsync", err, "copy");
            return false;
          }
        }
        return true;
      },
      CopyResult(n / 3, descs->size(), total));
}

// One strided copy: `height` rows of `width` bytes, row r between base + device + r * devicePitch
// and the host range at host + r * hostPitch.
struct Strided {
  uint64_t device, host, width, height, devicePitch, hostPitch;
};

// cudaMemcpy2D refuses pitches from 2^31 on (cudaErrorInvalidPitchValue on the GPUs kvgate
// targets); heights are held below it too so (height - 1) * pitch cannot overflow.
constexpr uint64_t kMaxPitch = (uint64_t(1) << 31) - 1;

// copy2D(direction 1|2, hostBuffer, hostOffset, hostLength, base: bigint, descriptors: Float64Array,
//        stream: bigint, device?: number) -> Promise<{descriptors, issued, bytes}>
// Descriptors are [deviceOffset, hostOffset, width, height, devicePitch, hostPitch] 6-tuples,
// device offsets relative to `base`. Height 1 is one cudaMemcpyAsync (its pitches are not used);
// a taller one is one cudaMemcpy2DAsync, or one cudaMemcpyAsync per row where the runtime lacks it.
// Every row is checked here before anything is queued.
Napi::Value Copy2DJs(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireAvailable(env);
  size_t dir = ToSize(env, info[0], "direction");
  if (dir != kH2D && dir != kD2H) ThrowNative(env, "copy2D direction must be 1 (h2d) or 2 (d2h)");
  const uint64_t base = ToU64(env, info[4], "device base");
  if (base == 0) ThrowNative(env, "device base is a null pointer");
  if (!info[5].IsTypedArray() || info[5].As<Napi::TypedArray>().TypedArrayType() != napi_float64_array) {
    ThrowNative(env, "descriptors must be a Float64Array of 6-tuples");
  }
  Napi::Float64Array fa = info[5].As<Napi::Float64Array>();
  const size_t n = fa.ElementLength();
  if (n % 6 != 0) ThrowNative(env, "descriptors length must be a multiple of 6");
  const CopyPlace place = CopyPlaceArgs(env, info[6], info[7]);
  const uint64_t hostLen = HostRangeLength(env, info[1], info[2], info[3]);
  const bool has2D = Cuda().memcpy2DAsync != nullptr;
  const double* r = fa.Data();
  auto descs = std::make_shared<std::vector<Strided>>();
  descs->reserve(n / 6);
  uint64_t total = 0;
  size_t issued = 0;
  static const char* const kFields[] = {"device offset", "host offset",  "width",
                                        "height",        "device pitch", "host pitch"};
  for (size_t i = 0; i < n; i += 6) {
    const std::string at = "descriptor " + std::to_string(i / 6) + ": ";
    uint64_t v[6];
    for (size_t k = 0; k < 6; k++) {
      const double x = r[i + k];
      // Integral, non-negative, at most 2^53 - 1 (NaN fails every comparison).
      if (!(x >= 0 && x <= 9007199254740991.0) || x != std::floor(x)) {
        ThrowNative(env, at + kFields[k] + " must be a non-negative safe integer");
      }
      v[k] = static_cast<uint64_t>(x);
    }
    Strided d{v[0], v[1], v[2], v[3], v[4], v[5]};
    if (d.height == 0 || d.height > kMaxPitch) {
      ThrowNative(env, at + "height must be 1 to " + std::to_string(kMaxPitch));
    }
    if (d.width == 0) continue;
    if (d.height > 1 && (d.devicePitch < d.width || d.hostPitch < d.width || d.devicePitch > kMaxPitch ||
                         d.hostPitch > kMaxPitch)) {
      ThrowNative(env, at + "pitches must be at least the width and below 2^31 (width " + std::to_string(d.width) +
                           ", device pitch " + std::to_string(d.devicePitch) + ", host pitch " +
                           std::to_string(d.hostPitch) + ")");
    }
    // Rows ascend on both sides: the last row's end bounds every row.
    const uint64_t hostSpan = (d.height - 1) * d.hostPitch + d.width;
    const uint64_t deviceSpan = (d.height - 1) * d.devicePitch + d.width;
    if (d.host > hostLen || hostSpan > hostLen - d.host) {
      ThrowNative(env, at + "host rows [" + std::to_string(d.host) + ", +" + std::to_string(hostSpan) +
                           ") run outside the " + std::to_string(hostLen) + "-byte host range");
    }
    if (d.device > UINT64_MAX - base || deviceSpan > UINT64_MAX - base - d.device) {
      ThrowNative(env, at + "device rows run past the end of the address space");
    }
    total += d.width * d.height;
    issued += d.height == 1 || has2D ? 1 : d.height;
    descs->push_back(d);
  }
  const CopyClaim claim = ClaimCopy(env, place, true, info[1], info[2], info[3]);
  const int kind = static_cast<int>(dir);
  return QueueCopies(
      env, "kvgate.copy2D", claim, {info[1].As<Napi::Object>()},
      [descs, base, kind](const CudaApi& c, void* s, uint8_t* host, Failure& f) {
        const bool toHost = kind == kD2H;
        for (const Strided& d : *descs) {
          uint8_t* h = host + d.host;
          uint8_t* dev = reinterpret_cast<uint8_t*>(base + d.device);
          void* dst = toHost ? h : dev;
          const void* src = toHost ? static_cast<const void*>(dev) : h;
          const size_t dpitch = toHost ? d.hostPitch : d.devicePitch;
          const size_t spitch = toHost ? d.devicePitch : d.hostPitch;
          if (d.height > 1 && c.memcpy2DAsync != nullptr) {
            int err = c.memcpy2DAsync(dst, dpitch, src, spitch, d.width, d.height, kind, s);
            if (err != 0) {
              f = CudaFailure("cudaMemcpy2DAsync", err, "copy2D");
              return false;
            }
            continue;
          }
          for (uint64_t row = 0; row < d.height; row++) {
            int err = c.memcpyAsync(static_cast<uint8_t*>(dst) + row * dpitch,
                                    static_cast<const uint8_t*>(src) + row * spitch, d.width, kind, s);
            if (err != 0) {
              f = CudaFailure("cudaMemcpyAsync", err, "copy2D");
              return false;
            }
          }
        }
        return true;
      },
      CopyResult(n / 6, issued, total));
}

// ipcOpen(handle: Uint8Array(64), flags, device?) -> Promise<bigint>: maps the
// allocation into `device`'s context (the engine's GPU, so copies stay on it).
Napi::Value IpcOpenJs(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireAvailable(env);
  if (!info[0].IsTypedArray() || info[0].As<Napi::TypedArray>().TypedArrayType() != napi_uint8_array ||
      info[0].As<Napi::TypedArray>().ByteLength() != sizeof(CudaIpcHandle)) {
    ThrowNative(env, "IPC handle must be a 64-byte Uint8Array");
  }
  Napi::Uint8Array u = info[0].As<Napi::Uint8Array>();
  CudaIpcHandle h;
  std::memcpy(h.reserved, u.Data(), sizeof h.reserved);
  unsigned flags = static_cast<unsigned>(ToSize(env, info[1], "flags"));
  const int device = DeviceArg(env, info[2]);
  auto out = std::make_shared<uint64_t>(0);
  return RunAsync(
      env, "kvgate.ipcOpen",
      [h, flags, device, out](Failure& f) {
        if (!EnterDeviceIndex(device, f)) return;
        void* p = nullptr;
        int err = Cuda().ipcOpenMemHandle(&p, h, flags);
        if (err != 0) {
          f = CudaFailure("cudaIpcOpenMemHandle", err, "ipcOpen");
          return;
        }
        *out = reinterpret_cast<uintptr_t>(p);
      },
      [out](Napi::Env env) { return FromU64(env, *out); });
}

Napi::Value IpcCloseJs(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireAvailable(env);
  uint64_t p = ToU64(env, info[0], "device pointer");
  const int device = DeviceArg(env, info[1]);  // the device it was opened on
  return RunAsync(
      env, "kvgate.ipcClose",
      [p, device](Failure& f) {
        if (!EnterDeviceIndex(device, f)) return;
        int err = Cuda().ipcCloseMemHandle(reinterpret_cast<void*>(p));
        if (err != 0) f = CudaFailure("cudaIpcCloseMemHandle", err, "ipcClose");
      },
      nullptr);
}

Napi::Value IpcGetHandleJs(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireAvailable(env);
  uint64_t p = ToU64(env, info[0], "device pointer");
  const CudaApi& c = Cuda();
  if (c.ipcGetMemHandle == nullptr) ThrowNative(env, c.library + " has no cudaIpcGetMemHandle");
  Failure f;
  if (!EnterDevice(f)) Throw(env, f);
  CudaIpcHandle h;
  int err = c.ipcGetMemHandle(&h, reinterpret_cast<void*>(p));
  if (err != 0) FailCuda(env, "cudaIpcGetMemHandle", err, "ipcGetHandle");
  Napi::Uint8Array u = Napi::Uint8Array::New(env, sizeof h.reserved);
  std::memcpy(u.Data(), h.reserved, sizeof h.reserved);
  return u;
}

// Test stub only: error injection / delays, answers the live allocation count.
Napi::Value StubControlJs(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  const CudaApi& c = Cuda();
  if (c.stubControl == nullptr) ThrowNative(env, "the loaded libcudart is not kvgate's test stub");
  if (!info[0].IsString()) ThrowNative(env, "stub control spec must be a string");
  int r = c.stubControl(info[0].As<Napi::String>().Utf8Value().c_str());
  if (r < 0) ThrowNative(env, "stub rejected control spec");
  return Napi::Number::New(env, r);
}

}  // namespace

const CudaApi& Cuda() {
  std::call_once(g_once, [] { Probe(g_api); });
  return g_api;
}

int CurrentDevice() { return g_device.load(); }

bool EnterDevice(Failure& f) { return EnterDeviceIndex(g_device.load(), f); }

bool EnterDeviceIndex(int device, Failure& f) {
  const CudaApi& c = Cuda();
  if (!c.available) {
    f.code = "ERR_CUDA";
    f.message = "CUDA is not available: " + c.reason;
    return false;
  }
  int err = c.setDevice(device);
  if (err != 0) {
    f = CudaFailure("cudaSetDevice", err, "device " + std::to_string(device));
    return false;
  }
  return true;
}

std::string CudaErrorText(int err) {
  const char* s = g_api.getErrorString != nullptr ? g_api.getErrorString(err) : nullptr;
  const char* name = ErrorName(err);
  std::string out = s != nullptr ? s : "CUDA error";
  out += " (";
  if (name != nullptr) out += std::string(name) + " = ";
  out += std::to_string(err) + ")";
  return out;
}

void InitCuda(Napi::Env env, Napi::Object exports) {
  Napi::Object c = Napi::Object::New(env);
  c.Set("probe", Napi::Function::New(env, ProbeJs, "probe"));
  c.Set("setDevice", Napi::Function::New(env, SetDeviceJs, "setDevice"));
  c.Set("getDevice", Napi::Function::New(env, GetDeviceJs, "getDevice"));
  c.Set("malloc", Napi::Function::New(env, MallocJs, "malloc"));
  c.Set("free", Napi::Function::New(env, FreeJs, "free"));
  c.Set("streamCreate", Napi::Function::New(env, StreamCreateJs, "streamCreate"));
  c.Set("streamDestroy", Napi::Function::New(env, StreamDestroyJs, "streamDestroy"));
  c.Set("copy", Napi::Function::New(env, CopyJs, "copy"));
  c.Set("copy2D", Napi::Function::New(env, Copy2DJs, "copy2D"));
  c.Set("ipcOpen", Napi::Function::New(env, IpcOpenJs, "ipcOpen"));
  c.Set("ipcClose", Napi::Function::New(env, IpcCloseJs, "ipcClose"));
  c.Set("ipcGetHandle", Napi::Function::New(env, IpcGetHandleJs, "ipcGetHandle"));
  c.Set("stubControl", Napi::Function::New(env, StubControlJs, "stubControl"));
  c.Set("deviceByPciBusId", Napi::Function::New(env, DeviceByPciBusIdJs, "deviceByPciBusId"));
  c.Set("pciBusId", Napi::Function::New(env, PciBusIdJs, "pciBusId"));
  exports.Set("cuda", c);
}

}  // namespace kvgate
