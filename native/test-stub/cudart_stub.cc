// A stand-in libcudart for machines without a GPU: "device memory" is host
// memory, each stream is a worker thread that runs queued memcpys in order.
//
// Loaded by the addon through KVGATE_CUDART. It checks what a real runtime
// checks (device pointers inside live allocations, known streams/events,
// registered ranges) so misuse returns CUDA errors instead of crashing, and it
// injects failures on request:
//   env KVGATE_STUB_FAIL   initial spec, e.g. "cudaGetDeviceCount=35"
//   env KVGATE_STUB_DEVICES  device count (default 1; 0 answers cudaErrorNoDevice)
//   env KVGATE_STUB_DEVICE_BYTES  device memory size (default 1 GiB)
//   kvgate_stub_control(spec)   same spec at run time; returns live allocations
// Spec: comma-separated `fn=code[@skip][*times]` (fail `fn` with `code` after
// `skip` successful calls, `times` times, default forever), `delay_us=N` (each
// queued copy sleeps N µs first), `hold=D` / `release=D` (copies on device D's
// streams wait until released), `calls=fn@D` (answer how many successful `fn`
// calls ran with device D current, instead of the allocation count), `reset`
// (clear rules, delays, holds and call counts), or "" (query).
//
// Devices: each thread has a current device (cudaSetDevice); allocations,
// streams and IPC mappings belong to the device current when they were made.
// Stricter than CUDA (which reaches peer memory through unified addressing):
// a copy must run with its stream's device current and touch only device
// memory allocated on, or IPC-opened on, that device; an IPC mapping must be
// closed on the device it was opened on. So work issued from the wrong
// device's context fails here instead of silently crossing devices.
// PCI bus ids: device d is "0000:<0x10 * (d + 1)>:00.0".
//
// cudaMemcpy2DAsync checks pitches (>= width, < 2^31: cudaErrorInvalidPitchValue) and
// every row's device range, and counts like cudaMemcpyAsync. Built with
// -DKVGATE_STUB_NO_MEMCPY2D (libcudart_stub_no2d.so) it lacks that symbol, as a
// runtime the addon must fall back from.
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>

namespace {

enum : int {
  kSuccess = 0,
  kInvalidValue = 1,
  kMemoryAllocation = 2,
  kInvalidPitchValue = 12,
  kInsufficientDriver = 35,
  kNoDevice = 100,
  kInvalidDevice = 101,
  kInvalidResourceHandle = 400,
  kNotReady = 600,
  kHostMemoryAlreadyRegistered = 712,
  kHostMemoryNotRegistered = 713,
};

struct Rule {
  int code;
  long skip;
  long times;  // < 0: forever
};

std::mutex g_mu;  // guards every table below
std::map<std::string, Rule> g_rules;
long g_delayUs = 0;
bool g_initialized = false;

struct Region {
  size_t size;
  int device;                  // current device at cudaMalloc
  std::map<int, int> ipcOpen;  // open IPC mappings by the device they were opened on
};
std::map<uintptr_t, Region> g_device;     // cudaMalloc
std::map<uintptr_t, size_t> g_hostAlloc;  // cudaHostAlloc
std::map<uintptr_t, size_t> g_registered;
size_t g_deviceBytes = 0;
size_t g_deviceLimit = size_t(1) << 30;
int g_deviceCount = 1;
thread_local int t_device = 0;
std::map<std::string, long> g_calls;  // "fn@device" -> successful calls
std::set<int> g_held;                 // devices whose copies wait (hold=D)
std::atomic<bool> g_anyHeld{false};   // g_held is not empty: lets copies skip g_mu when nothing is held
std::condition_variable g_release;    // signalled (under g_mu) when g_held shrinks

void CountLocked(const char* fn) { g_calls[std::string(fn) + "@" + std::to_string(t_device)]++; }

struct Copy {
  void* dst;
  const void* src;
  size_t count;  // bytes of each row
  long delayUs;
  size_t height = 1;  // rows (cudaMemcpy2DAsync), dpitch / spitch apart
  size_t dpitch = 0;
  size_t spitch = 0;
};

void WaitWhileHeld(int device) {
  if (!g_anyHeld.load(std::memory_order_acquire)) return;
  std::unique_lock<std::mutex> lock(g_mu);
  g_release.wait(lock, [device] { return g_held.count(device) == 0; });
}

// One worker thread per stream runs queued copies in order. It takes the whole
// queue at once and signals only when someone waits, so a batch of thousands
// of small copies costs one wake-up, not one per copy.
struct Stream {
  std::mutex mu;
  std::condition_variable work;
  std::condition_variable done;
  std::deque<Copy> queue;
  uint64_t submitted = 0;
  uint64_t completed = 0;
  int waiters = 0;
  bool idle = false;
  bool stop = false;
  const int device;
  std::thread worker;

  explicit Stream(int dev) : device(dev) {
    worker = std::thread([this] { Run(); });
  }
  void Run() {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      idle = true;
      work.wait(lock, [this] { return stop || !queue.empty(); });
      idle = false;
      if (queue.empty()) return;  // stop requested and drained
      std::deque<Copy> batch;
      batch.swap(queue);
      lock.unlock();
      for (const Copy& c : batch) {
        WaitWhileHeld(device);
        if (c.delayUs > 0) std::this_thread::sleep_for(std::chrono::microseconds(c.delayUs));
        for (size_t r = 0; r < c.height; r++) {
          std::memmove(static_cast<char*>(c.dst) + r * c.dpitch, static_cast<const char*>(c.src) + r * c.spitch,
                       c.count);
        }
      }
      lock.lock();
      completed += batch.size();
      if (waiters > 0) done.notify_all();
    }
  }
  void Push(const Copy& c) {
    std::lock_guard<std::mutex> lock(mu);
    queue.push_back(c);
    submitted++;
    if (idle) work.notify_one();
  }
  uint64_t Mark() {
    std::lock_guard<std::mutex> lock(mu);
    return submitted;
  }
  void WaitFor(uint64_t seq) {
    std::unique_lock<std::mutex> lock(mu);
    waiters++;
    done.wait(lock, [&] { return completed >= seq; });
    waiters--;
  }
  bool Done(uint64_t seq) {
    std::lock_guard<std::mutex> lock(mu);
    return completed >= seq;
  }
  ~Stream() {
    {
      std::lock_guard<std::mutex> lock(mu);
      stop = true;
      work.notify_all();
    }
    worker.join();
  }
};

struct Event {
  Stream* stream = nullptr;
  uint64_t seq = 0;
};

std::set<Stream*> g_streams;
std::set<Event*> g_events;
std::map<int, Stream*> g_legacy;  // the null stream of each device; never destroyed

void ApplySpecLocked(const std::string& spec, bool& ok, long& query) {
  size_t i = 0;
  while (i <= spec.size()) {
    size_t j = spec.find(',', i);
    if (j == std::string::npos) j = spec.size();
    std::string item = spec.substr(i, j - i);
    i = j + 1;
    if (item.empty()) continue;
    if (item == "reset") {
      g_rules.clear();
      g_delayUs = 0;
      g_calls.clear();
      g_held.clear();
      g_anyHeld = false;
      g_release.notify_all();
      continue;
    }
    size_t eq = item.find('=');
    if (eq == std::string::npos) {
      ok = false;
      continue;
    }
    std::string key = item.substr(0, eq);
    std::string val = item.substr(eq + 1);
    if (key == "delay_us") {
      g_delayUs = std::strtol(val.c_str(), nullptr, 10);
      continue;
    }
    if (key == "hold" || key == "release") {
      char* end = nullptr;
      long d = std::strtol(val.c_str(), &end, 10);
      if (val.empty() || *end != '\0' || d < 0) {
        ok = false;
      } else if (key == "hold") {
        g_held.insert(static_cast<int>(d));
        g_anyHeld = true;
      } else {
        g_held.erase(static_cast<int>(d));
        g_anyHeld = !g_held.empty();
        g_release.notify_all();
      }
      continue;
    }
    if (key == "calls") {
      size_t at = val.rfind('@');
      char* end = nullptr;
      if (at == std::string::npos || val.rfind("cuda", 0) != 0 || at + 1 >= val.size()) {
        ok = false;
        continue;
      }
      std::strtol(val.c_str() + at + 1, &end, 10);
      if (*end != '\0') {
        ok = false;
        continue;
      }
      query = g_calls[val];  // "fn@device", as CountLocked spells it
      continue;
    }
    Rule r{0, 0, -1};
    char* end = nullptr;
    r.code = static_cast<int>(std::strtol(val.c_str(), &end, 10));
    if (end != nullptr && *end == '@') r.skip = std::strtol(end + 1, &end, 10);
    if (end != nullptr && *end == '*') r.times = std::strtol(end + 1, &end, 10);
    if (end == nullptr || *end != '\0' || key.rfind("cuda", 0) != 0) {
      ok = false;
      continue;
    }
    if (r.code == 0) {
      g_rules.erase(key);
    } else {
      g_rules[key] = r;
    }
  }
}

void InitLocked() {
  if (g_initialized) return;
  g_initialized = true;
  if (const char* s = std::getenv("KVGATE_STUB_FAIL")) {
    bool ok = true;
    long query = -1;
    ApplySpecLocked(s, ok, query);
  }
  if (const char* s = std::getenv("KVGATE_STUB_DEVICES")) g_deviceCount = std::atoi(s);
  if (const char* s = std::getenv("KVGATE_STUB_DEVICE_BYTES")) g_deviceLimit = std::strtoull(s, nullptr, 10);
}

// The injected error for `fn`, or 0. Called with g_mu held.
int InjectedLocked(const char* fn) {
  InitLocked();
  auto it = g_rules.find(fn);
  if (it == g_rules.end()) return 0;
  Rule& r = it->second;
  if (r.skip > 0) {
    r.skip--;
    return 0;
  }
  if (r.times == 0) return 0;
  if (r.times > 0) r.times--;
  return r.code;
}

#define STUB_INJECT(fn)                   \
  do {                                    \
    int injected_ = InjectedLocked(fn);   \
    if (injected_ != 0) return injected_; \
  } while (0)

// True when [p, p+len) lies inside one device allocation that the current
// device may touch: allocated on it, or IPC-opened on it.
bool InDeviceLocked(uintptr_t p, size_t len) {
  auto it = g_device.upper_bound(p);
  if (it == g_device.begin()) return false;
  --it;
  if (!(p >= it->first && len <= it->second.size && p - it->first <= it->second.size - len)) return false;
  if (it->second.device == t_device) return true;
  auto o = it->second.ipcOpen.find(t_device);
  return o != it->second.ipcOpen.end() && o->second > 0;
}

// The stream `s` (null: the current device's legacy stream); ok = false when
// unknown or when it belongs to another device than the current one.
Stream* StreamLocked(void* s, bool& ok) {
  ok = true;
  if (s == nullptr) {
    Stream*& legacy = g_legacy[t_device];
    if (legacy == nullptr) legacy = new Stream(t_device);
    return legacy;
  }
  Stream* st = static_cast<Stream*>(s);
  if (g_streams.count(st) == 0 || st->device != t_device) ok = false;
  return st;
}

}  // namespace

extern "C" {

typedef struct {
  char reserved[64];
} cudaIpcMemHandle_t;

const char* cudaGetErrorString(int err) {
  switch (err) {
    case kSuccess: return "no error";
    case kInvalidValue: return "invalid argument";
    case kMemoryAllocation: return "out of memory";
    case kInvalidPitchValue: return "invalid pitch argument";
    case kInsufficientDriver: return "CUDA driver version is insufficient for CUDA runtime version";
    case kNoDevice: return "no CUDA-capable device is detected";
    case kInvalidDevice: return "invalid device ordinal";
    case kInvalidResourceHandle: return "invalid resource handle";
    case kNotReady: return "device not ready";
    case kHostMemoryAlreadyRegistered: return "part or all of the requested memory range is already mapped";
    case kHostMemoryNotRegistered: return "pointer does not correspond to a registered memory region";
    default: return "unrecognized error code";
  }
}

const char* cudaGetErrorName(int err) {
  switch (err) {
    case kSuccess: return "cudaSuccess";
    case kInvalidValue: return "cudaErrorInvalidValue";
    case kMemoryAllocation: return "cudaErrorMemoryAllocation";
    case kInvalidPitchValue: return "cudaErrorInvalidPitchValue";
    case kInsufficientDriver: return "cudaErrorInsufficientDriver";
    case kNoDevice: return "cudaErrorNoDevice";
    case kInvalidDevice: return "cudaErrorInvalidDevice";
    case kInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case kNotReady: return "cudaErrorNotReady";
    case kHostMemoryAlreadyRegistered: return "cudaErrorHostMemoryAlreadyRegistered";
    case kHostMemoryNotRegistered: return "cudaErrorHostMemoryNotRegistered";
    default: return "cudaErrorUnknown";
  }
}

int cudaRuntimeGetVersion(int* v) {
  *v = 13000;
  return kSuccess;
}

int cudaDriverGetVersion(int* v) {
  *v = 13000;
  return kSuccess;
}

int cudaGetDeviceCount(int* n) {
  std::lock_guard<std::mutex> lock(g_mu);
  STUB_INJECT("cudaGetDeviceCount");
  *n = g_deviceCount;
  return g_deviceCount > 0 ? kSuccess : kNoDevice;
}

int cudaSetDevice(int d) {
  std::lock_guard<std::mutex> lock(g_mu);
  STUB_INJECT("cudaSetDevice");
  if (d < 0 || d >= g_deviceCount) return kInvalidDevice;
  t_device = d;
  return kSuccess;
}

int cudaGetDevice(int* d) {
  *d = t_device;
  return kSuccess;
}

int cudaMalloc(void** p, size_t size) {
  std::lock_guard<std::mutex> lock(g_mu);
  STUB_INJECT("cudaMalloc");
  if (p == nullptr) return kInvalidValue;
  if (size == 0) {
    *p = nullptr;
    return kSuccess;
  }
  if (size > g_deviceLimit - g_deviceBytes) return kMemoryAllocation;
  void* m = nullptr;
  if (posix_memalign(&m, 256, size) != 0) return kMemoryAllocation;
  g_device[reinterpret_cast<uintptr_t>(m)] = Region{size, t_device, {}};
  g_deviceBytes += size;
  CountLocked("cudaMalloc");
  *p = m;
  return kSuccess;
}

int cudaFree(void* p) {
  std::lock_guard<std::mutex> lock(g_mu);
  STUB_INJECT("cudaFree");
  if (p == nullptr) return kSuccess;
  auto it = g_device.find(reinterpret_cast<uintptr_t>(p));
  if (it == g_device.end()) return kInvalidValue;
  g_deviceBytes -= it->second.size;
  g_device.erase(it);
  std::free(p);
  return kSuccess;
}

int cudaHostAlloc(void** p, size_t size, unsigned flags) {
  std::lock_guard<std::mutex> lock(g_mu);
  STUB_INJECT("cudaHostAlloc");
  if (p == nullptr || size == 0) return kInvalidValue;
  // mmap like the driver does, so freed pinned memory leaves the process.
  void* m = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return kMemoryAllocation;
  g_hostAlloc[reinterpret_cast<uintptr_t>(m)] = size;
  *p = m;
  return kSuccess;
}

int cudaFreeHost(void* p) {
  std::lock_guard<std::mutex> lock(g_mu);
  STUB_INJECT("cudaFreeHost");
  auto it = g_hostAlloc.find(reinterpret_cast<uintptr_t>(p));
  if (it == g_hostAlloc.end()) return kInvalidValue;
  munmap(p, it->second);
  g_hostAlloc.erase(it);
  return kSuccess;
}

int cudaHostRegister(void* p, size_t size, unsigned flags) {
  std::lock_guard<std::mutex> lock(g_mu);
  STUB_INJECT("cudaHostRegister");
  if (p == nullptr || size == 0) return kInvalidValue;
  uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = g_registered.upper_bound(a + size - 1);
  if (it != g_registered.begin()) {
    --it;
    if (it->first + it->second > a) return kHostMemoryAlreadyRegistered;
  }
  g_registered[a] = size;
  return kSuccess;
}

int cudaHostUnregister(void* p) {
  std::lock_guard<std::mutex> lock(g_mu);
  STUB_INJECT("cudaHostUnregister");
  if (g_registered.erase(reinterpret_cast<uintptr_t>(p)) == 0) return kHostMemoryNotRegistered;
  return kSuccess;
}

int cudaStreamCreate(void** s) {
  std::lock_guard<std::mutex> lock(g_mu);
  STUB_INJECT("cudaStreamCreate");
  Stream* st = new Stream(t_device);
  g_streams.insert(st);
  CountLocked("cudaStreamCreate");
  *s = st;
  return kSuccess;
}

int cudaStreamCreateWithFlags(void** s, unsigned flags) {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    STUB_INJECT("cudaStreamCreateWithFlags");
  }
  return cudaStreamCreate(s);
}

int cudaStreamDestroy(void* s) {
  Stream* st = static_cast<Stream*>(s);
  {
    std::lock_guard<std::mutex> lock(g_mu);
    STUB_INJECT("cudaStreamDestroy");
    if (g_streams.erase(st) == 0) return kInvalidResourceHandle;
  }
  delete st;  // drains queued work first, as the real one does asynchronously
  return kSuccess;
}

int cudaStreamSynchronize(void* s) {
  Stream* st;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    STUB_INJECT("cudaStreamSynchronize");
    bool ok;
    st = StreamLocked(s, ok);
    if (!ok) return kInvalidResourceHandle;
  }
  st->WaitFor(st->Mark());
  return kSuccess;
}

int cudaMemcpyAsync(void* dst, const void* src, size_t count, int kind, void* s) {
  Stream* st;
  long delay;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    STUB_INJECT("cudaMemcpyAsync");
    bool ok;
    st = StreamLocked(s, ok);
    if (!ok) return kInvalidResourceHandle;
    if (count == 0) return kSuccess;
    if (dst == nullptr || src == nullptr) return kInvalidValue;
    const uintptr_t d = reinterpret_cast<uintptr_t>(dst), sr = reinterpret_cast<uintptr_t>(src);
    // 1 = host->device, 2 = device->host, 3 = device->device, 4 = default (any)
    bool valid = kind == 4 || (kind == 1 && InDeviceLocked(d, count)) || (kind == 2 && InDeviceLocked(sr, count)) ||
                 (kind == 3 && InDeviceLocked(d, count) && InDeviceLocked(sr, count));
    if (!valid) return kInvalidValue;
    delay = g_delayUs;
    CountLocked("cudaMemcpyAsync");
  }
  st->Push(Copy{dst, src, count, delay});
  return kSuccess;
}

#ifndef KVGATE_STUB_NO_MEMCPY2D
int cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height, int kind,
                      void* s) {
  Stream* st;
  long delay;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    STUB_INJECT("cudaMemcpy2DAsync");
    bool ok;
    st = StreamLocked(s, ok);
    if (!ok) return kInvalidResourceHandle;
    if (width == 0 || height == 0) return kSuccess;
    if (dst == nullptr || src == nullptr) return kInvalidValue;
    const size_t maxPitch = (size_t(1) << 31) - 1;
    if (dpitch < width || spitch < width || dpitch > maxPitch || spitch > maxPitch || height > maxPitch) {
      return kInvalidPitchValue;
    }
    // The bytes from the first row's start to the last row's end, on each side.
    const size_t dspan = (height - 1) * dpitch + width, sspan = (height - 1) * spitch + width;
    const uintptr_t d = reinterpret_cast<uintptr_t>(dst), sr = reinterpret_cast<uintptr_t>(src);
    bool valid = kind == 4 || (kind == 1 && InDeviceLocked(d, dspan)) || (kind == 2 && InDeviceLocked(sr, sspan)) ||
                 (kind == 3 && InDeviceLocked(d, dspan) && InDeviceLocked(sr, sspan));
    if (!valid) return kInvalidValue;
    delay = g_delayUs;
    CountLocked("cudaMemcpy2DAsync");
  }
  st->Push(Copy{dst, src, width, delay, height, dpitch, spitch});
  return kSuccess;
}
#endif

int cudaEventCreate(void** e) {
  std::lock_guard<std::mutex> lock(g_mu);
  STUB_INJECT("cudaEventCreate");
  Event* ev = new Event();
  g_events.insert(ev);
  *e = ev;
  return kSuccess;
}

int cudaEventCreateWithFlags(void** e, unsigned flags) {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    STUB_INJECT("cudaEventCreateWithFlags");
  }
  return cudaEventCreate(e);
}

int cudaEventRecord(void* e, void* s) {
  std::lock_guard<std::mutex> lock(g_mu);
  STUB_INJECT("cudaEventRecord");
  Event* ev = static_cast<Event*>(e);
  if (g_events.count(ev) == 0) return kInvalidResourceHandle;
  bool ok;
  Stream* st = StreamLocked(s, ok);
  if (!ok) return kInvalidResourceHandle;
  ev->stream = st;
  ev->seq = st->Mark();
  CountLocked("cudaEventRecord");
  return kSuccess;
}

int cudaEventQuery(void* e) {
  Event ev;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    STUB_INJECT("cudaEventQuery");
    Event* p = static_cast<Event*>(e);
    if (g_events.count(p) == 0) return kInvalidResourceHandle;
    ev = *p;
  }
  if (ev.stream == nullptr) return kSuccess;
  return ev.stream->Done(ev.seq) ? kSuccess : kNotReady;
}

int cudaEventSynchronize(void* e) {
  Event ev;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    Event* p = static_cast<Event*>(e);
    if (g_events.count(p) == 0) return kInvalidResourceHandle;
    ev = *p;
  }
  if (ev.stream != nullptr) ev.stream->WaitFor(ev.seq);
  // Injected after the wait: like a real asynchronous error, the copies ran.
  std::lock_guard<std::mutex> lock(g_mu);
  STUB_INJECT("cudaEventSynchronize");
  return kSuccess;
}

int cudaEventDestroy(void* e) {
  std::lock_guard<std::mutex> lock(g_mu);
  STUB_INJECT("cudaEventDestroy");
  Event* p = static_cast<Event*>(e);
  if (g_events.erase(p) == 0) return kInvalidResourceHandle;
  delete p;
  return kSuccess;
}

// Handle layout: "KVGSTUB1", pid, base pointer, size (all this process only).
int cudaIpcGetMemHandle(cudaIpcMemHandle_t* h, void* p) {
  std::lock_guard<std::mutex> lock(g_mu);
  STUB_INJECT("cudaIpcGetMemHandle");
  auto it = g_device.find(reinterpret_cast<uintptr_t>(p));
  if (h == nullptr || it == g_device.end()) return kInvalidValue;
  std::memset(h->reserved, 0, sizeof h->reserved);
  std::memcpy(h->reserved, "KVGSTUB1", 8);
  int64_t pid = getpid();
  uint64_t base = it->first, size = it->second.size;
  std::memcpy(h->reserved + 8, &pid, 8);
  std::memcpy(h->reserved + 16, &base, 8);
  std::memcpy(h->reserved + 24, &size, 8);
  return kSuccess;
}

int cudaIpcOpenMemHandle(void** p, cudaIpcMemHandle_t h, unsigned flags) {
  std::lock_guard<std::mutex> lock(g_mu);
  STUB_INJECT("cudaIpcOpenMemHandle");
  if (p == nullptr || std::memcmp(h.reserved, "KVGSTUB1", 8) != 0) return kInvalidValue;
  int64_t pid;
  uint64_t base, size;
  std::memcpy(&pid, h.reserved + 8, 8);
  std::memcpy(&base, h.reserved + 16, 8);
  std::memcpy(&size, h.reserved + 24, 8);
  auto it = g_device.find(base);
  if (pid != getpid() || it == g_device.end() || it->second.size != size) return kInvalidResourceHandle;
  it->second.ipcOpen[t_device]++;
  CountLocked("cudaIpcOpenMemHandle");
  *p = reinterpret_cast<void*>(base);
  return kSuccess;
}

int cudaIpcCloseMemHandle(void* p) {
  std::lock_guard<std::mutex> lock(g_mu);
  STUB_INJECT("cudaIpcCloseMemHandle");
  auto it = g_device.find(reinterpret_cast<uintptr_t>(p));
  if (it == g_device.end()) return kInvalidValue;
  auto o = it->second.ipcOpen.find(t_device);  // opened on another device: not this context's mapping
  if (o == it->second.ipcOpen.end() || o->second == 0) return kInvalidValue;
  if (--o->second == 0) it->second.ipcOpen.erase(o);
  CountLocked("cudaIpcCloseMemHandle");
  return kSuccess;
}

int cudaDeviceGetPCIBusId(char* id, int len, int device) {
  std::lock_guard<std::mutex> lock(g_mu);
  STUB_INJECT("cudaDeviceGetPCIBusId");
  if (id == nullptr || len <= 0) return kInvalidValue;
  if (device < 0 || device >= g_deviceCount) return kInvalidDevice;
  std::snprintf(id, static_cast<size_t>(len), "0000:%02X:00.0", 0x10 * (device + 1));
  return kSuccess;
}

// Accepts what CUDA documents: "domain:bus:device.function", "domain:bus:device"
// and "bus:device.function", hexadecimal, either case.
int cudaDeviceGetByPCIBusId(int* device, const char* id) {
  std::lock_guard<std::mutex> lock(g_mu);
  STUB_INJECT("cudaDeviceGetByPCIBusId");
  if (device == nullptr || id == nullptr) return kInvalidValue;
  unsigned dom = 0, bus = 0, dev = 0, fn = 0;
  char tail = 0;
  bool parsed = std::sscanf(id, "%x:%x:%x.%x%c", &dom, &bus, &dev, &fn, &tail) == 4 ||
                std::sscanf(id, "%x:%x:%x%c", &dom, &bus, &dev, &tail) == 3 ||
                (dom = 0, std::sscanf(id, "%x:%x.%x%c", &bus, &dev, &fn, &tail) == 3);
  if (!parsed) return kInvalidValue;
  for (int d = 0; d < g_deviceCount; d++) {
    if (dom == 0 && bus == static_cast<unsigned>(0x10 * (d + 1)) && dev == 0 && fn == 0) {
      *device = d;
      return kSuccess;
    }
  }
  return kInvalidDevice;
}

// Test control (see the header comment). Returns the number of live device
// allocations + host allocations + registrations + open IPC mappings, or -1
// for a malformed spec.
int kvgate_stub_control(const char* spec) {
  std::lock_guard<std::mutex> lock(g_mu);
  InitLocked();
  bool ok = true;
  long query = -1;
  if (spec != nullptr) ApplySpecLocked(spec, ok, query);
  if (!ok) return -1;
  if (query >= 0) return static_cast<int>(query);
  int ipc = 0;
  for (const auto& kv : g_device)
    for (const auto& o : kv.second.ipcOpen) ipc += o.second;
  return static_cast<int>(g_device.size() + g_hostAlloc.size() + g_registered.size()) + ipc;
}

}  // extern "C"
