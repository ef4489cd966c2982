// Module entry of kvgate_native: wires the memory, CUDA and file I/O parts
// into one exports object. JS (src/client/native.ts) validates before calling.
#include "common.h"

namespace kvgate {

Napi::Object Init(Napi::Env env, Napi::Object exports) {
  InitMemory(env, exports);
  InitCuda(env, exports);
  InitIo(env, exports);
  // Bumped when the JS-facing contract changes; the loader refuses a stale build.
  exports.Set("abiVersion", Napi::Number::New(env, 1));
  return exports;
}

}  // namespace kvgate

static Napi::Object InitAddon(Napi::Env env, Napi::Object exports) { return kvgate::Init(env, exports); }

NODE_API_MODULE(kvgate_native, InitAddon)
