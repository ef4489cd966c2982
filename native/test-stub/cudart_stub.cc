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
// queued copy sleeps N µs first), `reset` (clear everything), or "" (query).
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
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
  int ipcOpen;
};
std::map<uintptr_t, Region> g_device;     // cudaMalloc
std::map<uintptr_t, size_t> g_hostAlloc;  // cudaHostAlloc
std::map<uintptr_t, size_t> g_registered;
size_t g_deviceBytes = 0;
size_t g_deviceLimit = size_t(1) << 30;
int g_deviceCount = 1;
thread_local int t_device = 0;

struct Copy {
  void* dst;
  const void* src;
  size_t count;
  long delayUs;
};

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
  std::thread worker;

  Stream() {
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
        if (c.delayUs > 0) std::this_thread::sleep_for(std::chrono::microseconds(c.delayUs));
        std::memmove(c.dst, c.src, c.count);
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
Stream* g_legacy = nullptr;  // the null stream; never destroyed

void ApplySpecLocked(const std::string& spec, bool& ok) {
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
    ApplySpecLocked(s, ok);
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

// True when [p, p+len) lies inside one device allocation.
bool InDeviceLocked(uintptr_t p, size_t len) {
  auto it = g_device.upper_bound(p);
  if (it == g_device.begin()) return false;
  --it;
  return p >= it->first && len <= it->second.size && p - it->first <= it->second.size - len;
}

Stream* StreamLocked(void* s, bool& ok) {
  ok = true;
  if (s == nullptr) {
    if (g_legacy == nullptr) g_legacy = new Stream();
    return g_legacy;
  }
  Stream* st = static_cast<Stream*>(s);
  if (g_streams.count(st) == 0) ok = false;
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
  g_device[reinterpret_cast<uintptr_t>(m)] = Region{size, 0};
  g_deviceBytes += size;
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
  Stream* st = new Stream();
  g_streams.insert(st);
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
  }
  st->Push(Copy{dst, src, count, delay});
  return kSuccess;
}

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
  it->second.ipcOpen++;
  *p = reinterpret_cast<void*>(base);
  return kSuccess;
}

int cudaIpcCloseMemHandle(void* p) {
  std::lock_guard<std::mutex> lock(g_mu);
  STUB_INJECT("cudaIpcCloseMemHandle");
  auto it = g_device.find(reinterpret_cast<uintptr_t>(p));
  if (it == g_device.end() || it->second.ipcOpen == 0) return kInvalidValue;
  it->second.ipcOpen--;
  return kSuccess;
}

// Test control (see the header comment). Returns the number of live device
// allocations + host allocations + registrations + open IPC mappings, or -1
// for a malformed spec.
int kvgate_stub_control(const char* spec) {
  std::lock_guard<std::mutex> lock(g_mu);
  InitLocked();
  bool ok = true;
  if (spec != nullptr) ApplySpecLocked(spec, ok);
  if (!ok) return -1;
  int ipc = 0;
  for (const auto& kv : g_device) ipc += kv.second.ipcOpen;
  return static_cast<int>(g_device.size() + g_hostAlloc.size() + g_registered.size()) + ipc;
}

}  // extern "C"
