// Failures as data (worker threads) and as JS errors with stable codes (JS
// thread), plus the one AsyncWorker every promise-returning call goes through.
#include <cerrno>
#include <cmath>
#include <cstring>

#include "common.h"

namespace kvgate {

Failure NativeFailure(std::string message) {
  Failure f;
  f.code = "ERR_NATIVE";
  f.message = std::move(message);
  return f;
}

static const char* ErrnoName(int err) {
  switch (err) {
    case ENOENT: return "ENOENT";
    case EACCES: return "EACCES";
    case EPERM: return "EPERM";
    case EINVAL: return "EINVAL";
    case ENOMEM: return "ENOMEM";
    case ENOSPC: return "ENOSPC";
    case EISDIR: return "EISDIR";
    case ENOTDIR: return "ENOTDIR";
    case EEXIST: return "EEXIST";
    case EIO: return "EIO";
    case EBADF: return "EBADF";
    case EFBIG: return "EFBIG";
    case EROFS: return "EROFS";
    case EMFILE: return "EMFILE";
    case EAGAIN: return "EAGAIN";
    case EFAULT: return "EFAULT";
    default: return "EUNKNOWN";
  }
}

Failure ErrnoFailure(const char* syscall, int err, const std::string& context) {
  Failure f;
  f.code = "ERR_NATIVE";
  f.sysErrno = err;
  f.syscall = syscall;
  f.message = context + ": " + syscall + " failed: " + std::strerror(err) + " (" + ErrnoName(err) + ")";
  return f;
}

Failure CudaFailure(const char* fn, int err, const std::string& context) {
  Failure f;
  f.code = "ERR_CUDA";
  f.cudaError = err;
  f.syscall = fn;
  f.message = (context.empty() ? std::string() : context + ": ") + fn + " failed: " + CudaErrorText(err);
  return f;
}

Napi::Error ToError(Napi::Env env, const Failure& f) {
  Napi::Error e = Napi::Error::New(env, f.message);
  e.Set("code", Napi::String::New(env, f.code.empty() ? "ERR_NATIVE" : f.code));
  if (f.cudaError != 0) e.Set("cudaError", Napi::Number::New(env, f.cudaError));
  if (f.sysErrno != 0) {
    e.Set("errno", Napi::Number::New(env, f.sysErrno));
    e.Set("syscode", Napi::String::New(env, ErrnoName(f.sysErrno)));
  }
  if (!f.syscall.empty()) e.Set("syscall", Napi::String::New(env, f.syscall));
  return e;
}

void Throw(Napi::Env env, const Failure& f) { throw ToError(env, f); }

void ThrowNative(Napi::Env env, const std::string& message) { Throw(env, NativeFailure(message)); }

namespace {

class PromiseWorker : public Napi::AsyncWorker {
 public:
  PromiseWorker(Napi::Env env, const char* name, WorkFn work, FinishFn finish,
                const std::vector<Napi::Object>& keepAlive, std::function<void()> cleanup)
      : Napi::AsyncWorker(env, name),
        deferred_(Napi::Promise::Deferred::New(env)),
        work_(std::move(work)),
        finish_(std::move(finish)),
        cleanup_(std::move(cleanup)) {
    for (const auto& o : keepAlive) refs_.push_back(Napi::Persistent(o));
  }

  Napi::Promise Promise() { return deferred_.Promise(); }

  void Execute() override {
    try {
      work_(failure_);
    } catch (const std::bad_alloc&) {
      failure_ = NativeFailure("out of memory in native worker");
    } catch (const std::exception& e) {
      failure_ = NativeFailure(std::string("native worker failed: ") + e.what());
    }
  }

  // Errors are settled here rather than through SetError so the rejection
  // carries our code and fields, not a bare message.
  void OnOK() override {
    Napi::Env env = Env();
    Napi::HandleScope scope(env);
    if (cleanup_) cleanup_();
    if (failure_.failed()) {
      deferred_.Reject(ToError(env, failure_).Value());
      return;
    }
    try {
      deferred_.Resolve(finish_ ? finish_(env) : env.Undefined());
    } catch (const Napi::Error& e) {
      deferred_.Reject(e.Value());
    }
  }

  void OnError(const Napi::Error& e) override {
    if (cleanup_) cleanup_();
    deferred_.Reject(e.Value());
  }

 private:
  Napi::Promise::Deferred deferred_;
  WorkFn work_;
  FinishFn finish_;
  std::function<void()> cleanup_;
  std::vector<Napi::ObjectReference> refs_;
  Failure failure_;
};

}  // namespace

Napi::Value RunAsync(Napi::Env env, const char* name, WorkFn work, FinishFn finish,
                     const std::vector<Napi::Object>& keepAlive, std::function<void()> cleanup) {
  auto* w = new PromiseWorker(env, name, std::move(work), std::move(finish), keepAlive, std::move(cleanup));
  Napi::Promise p = w->Promise();
  w->Queue();
  return p;
}

size_t ToSize(Napi::Env env, Napi::Value v, const char* what) {
  if (!v.IsNumber()) ThrowNative(env, std::string(what) + " must be a number");
  double d = v.As<Napi::Number>().DoubleValue();
  if (!(d >= 0) || d > 9007199254740991.0 || std::floor(d) != d) {
    ThrowNative(env, std::string(what) + " must be a non-negative safe integer");
  }
  return static_cast<size_t>(d);
}

uint64_t ToU64(Napi::Env env, Napi::Value v, const char* what) {
  if (!v.IsBigInt()) ThrowNative(env, std::string(what) + " must be a bigint");
  bool lossless = false;
  uint64_t u = v.As<Napi::BigInt>().Uint64Value(&lossless);
  if (!lossless) ThrowNative(env, std::string(what) + " does not fit in 64 bits");
  return u;
}

Napi::Value FromU64(Napi::Env env, uint64_t v) { return Napi::BigInt::New(env, v); }

}  // namespace kvgate
