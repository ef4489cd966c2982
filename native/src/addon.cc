// Module entry of kvgate_native: wires the memory, CUDA and file I/O parts
// into one exports object. JS (src/client/native.ts) validates before calling.
#include <dlfcn.h>

#include "common.h"

namespace kvgate {

// Node dlcloses an addon when the last worker thread using it exits; the next
// load would start with fresh globals while libcudart (and CUDA registrations)
// keep their state, and pool threads may still be running our code. Pin the
// library for the life of the process instead.
static void PinLibrary() {
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&PinLibrary), &info) != 0 && info.dli_fname != nullptr) {
    dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD | RTLD_NODELETE);
  }
}

Napi::Object Init(Napi::Env env, Napi::Object exports) {
  PinLibrary();
  InitMemory(env, exports);
  InitCuda(env, exports);
  InitIo(env, exports);
  InitMmap(env, exports);
  InitKeys(env, exports);
  // Bumped when the JS-facing contract changes; the loader refuses a stale build.
  exports.Set("abiVersion", Napi::Number::New(env, 12));
  return exports;
}

}  // namespace kvgate

static Napi::Object InitAddon(Napi::Env env, Napi::Object exports) { return kvgate::Init(env, exports); }

NODE_API_MODULE(kvgate_native, InitAddon)
