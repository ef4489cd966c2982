// File reads and writes into host buffers off the JS thread, with O_DIRECT
// when the request is aligned and the filesystem takes it, else buffered I/O.
// readFileCrc also CRC-32s caller-given ranges of what it read, on the same worker.
#include <fcntl.h>
#include <linux/aio_abi.h>
#include <poll.h>
#include <sys/syscall.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "common.h"
#include "stream_copy.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kvgate {
namespace {

// Logical block sizes are 512 or 4096; 4096 satisfies both.
constexpr size_t kAlign = 4096;

enum Mode { kOff = 0, kAuto = 1, kRequire = 2 };

struct IoResult {
  size_t bytes = 0;
  bool direct = false;
  std::string reason;
};

// Where readFileCrc may copy verified bytes out to (a caller's buffer), and until
// when: Close() (on the JS thread) waits for a copy in progress and refuses the
// rest, so nothing lands in the caller's buffer after its owner stopped waiting
// (a read that finishes late, past a deadline, copies nothing).
struct CopyGate {
  std::mutex mu;
  std::condition_variable idle;
  bool closed = false;
  int active = 0;
  bool Enter() {
    std::lock_guard<std::mutex> lock(mu);
    if (closed) return false;
    active++;
    return true;
  }
  void Leave() {
    std::lock_guard<std::mutex> lock(mu);
    if (--active == 0) idle.notify_all();
  }
  void Close() {
    std::unique_lock<std::mutex> lock(mu);
    closed = true;
    idle.wait(lock, [this] { return active == 0; });
  }
};
using GateRef = std::shared_ptr<CopyGate>;

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) close(fd);
  }
  int release() {
    int f = fd;
    fd = -1;
    return f;
  }
};

std::string Misalignment(const void* p, uint64_t fileOffset) {
  return "buffer address % 4096 = " + std::to_string(reinterpret_cast<uintptr_t>(p) % kAlign) +
         ", file offset % 4096 = " + std::to_string(fileOffset % kAlign);
}

// Decides direct vs buffered before opening. False + failure when `require`
// cannot be honoured.
bool PlanDirect(Mode mode, const void* p, uint64_t fileOffset, IoResult& r, Failure& f) {
  if (mode == kOff) {
    r.reason = "buffered I/O requested";
    return false;
  }
  bool aligned = reinterpret_cast<uintptr_t>(p) % kAlign == 0 && fileOffset % kAlign == 0;
  if (aligned) return true;
  if (mode == kRequire) {
    f = NativeFailure("misaligned O_DIRECT request: " + Misalignment(p, fileOffset) + " (both must be 0)");
  } else {
    r.reason = "misaligned request (" + Misalignment(p, fileOffset) + "): buffered I/O";
  }
  return false;
}

// Opens with O_DIRECT when asked; on EINVAL (the filesystem refuses O_DIRECT)
// falls back to buffered unless `require`.
int OpenFile(const std::string& path, int flags, bool& direct, Mode mode, IoResult& r, Failure& f, const char* op) {
  if (direct) {
    int fd = open(path.c_str(), flags | O_DIRECT | O_CLOEXEC, 0644);
    if (fd >= 0) return fd;
    int err = errno;
    if (err != EINVAL) {
      f = ErrnoFailure("open", err, std::string(op) + " " + path);
      return -1;
    }
    if (mode == kRequire) {
      f = ErrnoFailure("open(O_DIRECT)", err, std::string(op) + " " + path + ": the filesystem rejects O_DIRECT");
      return -1;
    }
    direct = false;
    r.reason = "filesystem rejected O_DIRECT (EINVAL): buffered I/O";
  }
  int fd = open(path.c_str(), flags | O_CLOEXEC, 0644);
  if (fd < 0) f = ErrnoFailure("open", errno, std::string(op) + " " + path);
  return fd;
}

// pread until `want` bytes, EOF, or (direct) a short read that ends the file.
bool ReadLoop(int fd, uint8_t* p, size_t want, uint64_t off, size_t& done, bool direct, bool& eof, int& err) {
  while (done < want) {
    ssize_t n = pread(fd, p + done, want - done, static_cast<off_t>(off + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      err = errno;
      return false;
    }
    if (n == 0) {
      eof = true;
      break;
    }
    done += static_cast<size_t>(n);
    if (direct && static_cast<size_t>(n) % kAlign != 0) {
      eof = true;  // only the end of the file yields an unaligned direct read
      break;
    }
  }
  return true;
}

// readFileCrc's direct reads go as kPiece pieces through Linux AIO, kWindow of them in
// flight: the thread submits the next pieces, then verifies (and copies) the ones that
// landed while those are read. With one pread per segment the disk waited for every
// segment's CRC and copy, and all four pool threads often computed at once (a device idle
// ~10 % of a cold 8-chunk retrieve, measured through /sys/block/.../inflight).
constexpr size_t kPiece = size_t{2} << 20;
constexpr size_t kWindow = 4;
// Events one thread's AIO context holds (>= kWindow).
constexpr long kAioEvents = 16;

// One AIO context per pool thread, made on its first piece read, kept for its life.
struct AioContext {
  aio_context_t ctx = 0;
  bool ok = false;
  AioContext() { ok = syscall(SYS_io_setup, kAioEvents, &ctx) == 0; }
  ~AioContext() {
    if (ok) syscall(SYS_io_destroy, ctx);
  }
};

using Progress = std::function<void(size_t)>;

// Waits for at least `min` of the events outstanding; returns how many it got, or -errno.
long GetEvents(aio_context_t ctx, long min, long max, io_event* events) {
  for (;;) {
    long n = syscall(SYS_io_getevents, ctx, min, max, events, nullptr);
    if (n >= 0 || errno != EINTR) return n < 0 ? -errno : n;
  }
}

// Reads `want` bytes (a multiple of kAlign) at `off` into p as ReadLoop(direct) would, with
// progress(n) called on this thread each time the bytes read from the start grow to n
// (never for bytes a piece has not returned). `used` false: AIO could not be used and
// nothing was read (the caller reads with pread). A piece that ends short (the end of the
// file) ends the pieces, and pieces the kernel would not take are not read here: the rest
// is read with ReadLoop from there, which decides EOF exactly as a plain direct read does.
// Returns only once no piece is in flight (they write into p).
bool ReadPieces(int fd, uint8_t* p, size_t want, uint64_t off, size_t& done, bool& eof, int& err,
                const Progress& progress, bool& used) {
  thread_local AioContext aio;
  used = false;
  if (!aio.ok) return true;
  const size_t piece = kPiece;
  const size_t n = (want + piece - 1) / piece;  // iocbs are made up front: 64 bytes per 2 MiB
  const size_t window = std::min(n, kWindow);
  std::vector<iocb> cbs(n);
  std::vector<iocb*> ptrs(n);
  for (size_t i = 0; i < n; i++) {
    std::memset(&cbs[i], 0, sizeof(iocb));
    cbs[i].aio_lio_opcode = IOCB_CMD_PREAD;
    cbs[i].aio_fildes = static_cast<uint32_t>(fd);
    cbs[i].aio_buf = reinterpret_cast<uint64_t>(p + i * piece);
    cbs[i].aio_nbytes = std::min(piece, want - i * piece);
    cbs[i].aio_offset = static_cast<int64_t>(off + i * piece);
    cbs[i].aio_data = i;
    ptrs[i] = &cbs[i];
  }
  size_t submitted = 0, outstanding = 0;
  // Submits pieces up to (not including) `upTo`; false when the kernel takes none of them now.
  auto submit = [&](size_t upTo) {
    while (submitted < upTo) {
      long k = syscall(SYS_io_submit, aio.ctx, static_cast<long>(upTo - submitted), ptrs.data() + submitted);
      if (k > 0) {
        submitted += static_cast<size_t>(k);
        outstanding += static_cast<size_t>(k);
      } else if (!(k < 0 && errno == EINTR)) {
        return false;
      }
    }
    return true;
  };
  if (!submit(window) && submitted == 0) return true;  // none taken (EAGAIN, ENOSYS...): plain preads
  used = true;
  // res per piece; kPending until its event arrives.
  constexpr long long kPending = -(1LL << 62);
  std::vector<long long> res(n, kPending);
  std::vector<io_event> events(window);
  size_t next = 0;  // the first piece not yet counted into `done`
  bool stopped = false;
  while (outstanding > 0) {
    long got = GetEvents(aio.ctx, 1, static_cast<long>(std::min(outstanding, events.size())), events.data());
    if (got < 0) {
      // Cannot wait for the pieces (never seen): they still write into p, so wait for each
      // before returning, however long it takes.
      err = static_cast<int>(-got);
      while (outstanding > 0) {
        long more = GetEvents(aio.ctx, 1, static_cast<long>(std::min(outstanding, events.size())), events.data());
        if (more > 0) outstanding -= static_cast<size_t>(more);
      }
      return false;
    }
    for (long e = 0; e < got; e++) res[events[e].data] = events[e].res;
    outstanding -= static_cast<size_t>(got);
    if (stopped) continue;
    size_t before = done;
    while (next < submitted && res[next] != kPending) {
      if (res[next] < 0) {
        err = static_cast<int>(-res[next]);
        stopped = true;
        break;
      }
      done += static_cast<size_t>(res[next]);
      if (static_cast<size_t>(res[next]) < cbs[next].aio_nbytes) {
        stopped = true;  // short: continued by ReadLoop below
        break;
      }
      next++;
    }
    if (stopped) continue;
    // The next pieces go to the disk before this thread verifies what landed. One the kernel
    // does not take now is read by ReadLoop below.
    submit(std::min(n, next + window));
    if (done > before) progress(done);
  }
  if (err != 0) return false;
  // A short piece, or pieces not submitted: the rest as a plain direct read would.
  if (done < want) {
    size_t before = done;
    if (!ReadLoop(fd, p, want, off, done, true, eof, err)) return false;
    if (done > before) progress(done);
  }
  return true;
}

bool WriteLoop(int fd, const uint8_t* p, size_t len, uint64_t off, size_t& done, int& err) {
  while (done < len) {
    ssize_t n = pwrite(fd, p + done, len - done, static_cast<off_t>(off + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      err = errno;
      return false;
    }
    done += static_cast<size_t>(n);
  }
  return true;
}

// With `progress` (readFileCrc), a direct read goes by ReadPieces and calls progress(n)
// as the bytes read from the start grow to n.
void DoRead(const std::string& path, HostSpan span, uint64_t fileOffset, int64_t length, Mode mode, IoResult& r,
            Failure& f, const Progress* progress = nullptr) {
  bool direct = PlanDirect(mode, span.data, fileOffset, r, f);
  if (f.failed()) return;
  Fd fd;
  // O_NONBLOCK: a FIFO put where a file was expected must fail the read (ESPIPE), not hold
  // this pool thread waiting for a writer; it changes nothing for regular files.
  fd.fd = OpenFile(path, O_RDONLY | O_NONBLOCK, direct, mode, r, f, "readFile");
  if (fd.fd < 0) return;
  struct stat st;
  if (fstat(fd.fd, &st) != 0) {
    f = ErrnoFailure("fstat", errno, "readFile " + path);
    return;
  }
  size_t want;
  if (length < 0) {
    if (!S_ISREG(st.st_mode)) {
      f = NativeFailure("readFile " + path + ": not a regular file; pass an explicit length");
      return;
    }
    uint64_t size = static_cast<uint64_t>(st.st_size);
    want = fileOffset >= size ? 0 : static_cast<size_t>(size - fileOffset);
  } else {
    want = static_cast<size_t>(length);
  }
  if (want > span.length) {
    f = NativeFailure("readFile " + path + ": " + std::to_string(want) + " bytes do not fit the " +
                      std::to_string(span.length) + "-byte buffer");
    return;
  }
  size_t done = 0;
  bool eof = false;
  int err = 0;
  if (direct) {
    const size_t body = want & ~(kAlign - 1);
    bool used = false, ok = true;
    if (progress && body > kPiece) ok = ReadPieces(fd.fd, span.data, body, fileOffset, done, eof, err, *progress, used);
    if (!used) ok = ReadLoop(fd.fd, span.data, body, fileOffset, done, true, eof, err);
    if (!ok) {
      if (err != EINVAL || done != 0 || mode == kRequire) {
        f = ErrnoFailure("pread", err, "readFile " + path + (direct ? " (O_DIRECT)" : ""));
        return;
      }
      // Opened fine but refused the direct read (some filesystems do).
      direct = false;
      r.reason = "filesystem rejected an O_DIRECT read (EINVAL): buffered I/O";
      close(fd.release());
      fd.fd = open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
      if (fd.fd < 0) {
        f = ErrnoFailure("open", errno, "readFile " + path);
        return;
      }
    } else if (!eof && done < want) {
      // The unaligned tail goes through an aligned bounce block.
      void* bounce = nullptr;
      if (posix_memalign(&bounce, kAlign, kAlign) != 0) {
        f = NativeFailure("readFile: out of memory for the bounce block");
        return;
      }
      std::unique_ptr<void, decltype(&std::free)> hold(bounce, &std::free);
      size_t got = 0;
      bool tailEof = false;
      if (!ReadLoop(fd.fd, static_cast<uint8_t*>(bounce), kAlign, fileOffset + done, got, true, tailEof, err)) {
        f = ErrnoFailure("pread", err, "readFile " + path + " (O_DIRECT tail)");
        return;
      }
      size_t use = std::min(got, want - done);
      std::memcpy(span.data + done, bounce, use);
      done += use;
    }
  }
  if (!direct && !ReadLoop(fd.fd, span.data, want, fileOffset, done, false, eof, err)) {
    f = ErrnoFailure("pread", err, "readFile " + path);
    return;
  }
  r.bytes = done;
  r.direct = direct;
}

void DoWrite(const std::string& path, HostSpan span, uint64_t fileOffset, Mode mode, bool doFsync, bool truncate,
             IoResult& r, Failure& f) {
  bool direct = PlanDirect(mode, span.data, fileOffset, r, f);
  if (f.failed()) return;
  const int flags = O_WRONLY | O_CREAT | (truncate ? O_TRUNC : 0);
  Fd fd;
  fd.fd = OpenFile(path, flags, direct, mode, r, f, "writeFile");
  if (fd.fd < 0) return;
  size_t done = 0;
  int err = 0;
  Fd tailFd;
  if (direct) {
    const size_t body = span.length & ~(kAlign - 1);
    if (!WriteLoop(fd.fd, span.data, body, fileOffset, done, err)) {
      if (err != EINVAL || done != 0 || mode == kRequire) {
        f = ErrnoFailure("pwrite", err, "writeFile " + path + " (O_DIRECT)");
        return;
      }
      direct = false;
      r.reason = "filesystem rejected an O_DIRECT write (EINVAL): buffered I/O";
    }
    if (direct && done < span.length) {
      // O_DIRECT writes whole blocks only: the tail goes through the page cache.
      tailFd.fd = open(path.c_str(), O_WRONLY | O_CLOEXEC);
      if (tailFd.fd < 0) {
        f = ErrnoFailure("open", errno, "writeFile " + path + " (tail)");
        return;
      }
      if (!WriteLoop(tailFd.fd, span.data, span.length, fileOffset, done, err)) {
        f = ErrnoFailure("pwrite", err, "writeFile " + path + " (tail)");
        return;
      }
    }
  }
  if (!direct) {
    if (fd.fd >= 0 && (fcntl(fd.fd, F_GETFL) & O_DIRECT) != 0) {
      close(fd.release());
      fd.fd = open(path.c_str(), O_WRONLY | O_CLOEXEC);
      if (fd.fd < 0) {
        f = ErrnoFailure("open", errno, "writeFile " + path);
        return;
      }
    }
    if (!WriteLoop(fd.fd, span.data, span.length, fileOffset, done, err)) {
      f = ErrnoFailure("pwrite", err, "writeFile " + path);
      return;
    }
  }
  if (doFsync) {
    if (tailFd.fd >= 0 && fsync(tailFd.fd) != 0) {
      f = ErrnoFailure("fsync", errno, "writeFile " + path);
      return;
    }
    if (fsync(fd.fd) != 0) {
      f = ErrnoFailure("fsync", errno, "writeFile " + path);
      return;
    }
  }
  int tail = tailFd.release();
  if (tail >= 0 && close(tail) != 0) {
    f = ErrnoFailure("close", errno, "writeFile " + path);
    return;
  }
  if (close(fd.release()) != 0) {
    f = ErrnoFailure("close", errno, "writeFile " + path);
    return;
  }
  r.bytes = done;
  r.direct = direct;
}

std::string ReadPath(Napi::Env env, Napi::Value v) {
  if (!v.IsString()) ThrowNative(env, "path must be a string");
  std::string p = v.As<Napi::String>().Utf8Value();
  if (p.empty() || p.find('\0') != std::string::npos) ThrowNative(env, "path must be non-empty and contain no NUL");
  return p;
}

Mode ReadMode(Napi::Env env, Napi::Value v) {
  size_t m = ToSize(env, v, "direct mode");
  if (m > kRequire) ThrowNative(env, "direct mode must be 0 (off), 1 (auto) or 2 (require)");
  return static_cast<Mode>(m);
}

Napi::Value Result(Napi::Env env, const IoResult& r) {
  Napi::Object o = Napi::Object::New(env);
  o.Set("bytes", Napi::Number::New(env, static_cast<double>(r.bytes)));
  o.Set("direct", r.direct);
  o.Set("reason", r.reason);
  return o;
}

// readFile(path, buffer, byteOffset, capacity, fileOffset, length|-1, mode) -> Promise<{bytes, direct, reason}>
Napi::Value ReadFileJs(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  std::string path = ReadPath(env, info[0]);
  uint64_t fileOffset = ToSize(env, info[4], "file offset");
  if (!info[5].IsNumber()) ThrowNative(env, "length must be a number");
  double len = info[5].As<Napi::Number>().DoubleValue();
  int64_t length = len < 0 ? -1 : static_cast<int64_t>(ToSize(env, info[5], "length"));
  Mode mode = ReadMode(env, info[6]);
  HostSpan span = AcquireHost(env, info[1], info[2], info[3]);
  auto r = std::make_shared<IoResult>();
  return RunAsync(
      env, "kvgate.readFile",
      [path, span, fileOffset, length, mode, r](Failure& f) { DoRead(path, span, fileOffset, length, mode, *r, f); },
      [r](Napi::Env env) { return Result(env, *r); }, {info[1].As<Napi::Object>()}, [span]() { ReleaseHost(span); });
}

// Copies a range just CRC'd (hot in this core's cache) to the caller's buffer with
// streaming stores: an ordinary memcpy of a cache-sized piece first reads every
// destination line from DRAM (read-for-ownership), which costs what the copy saves
// by reading a cached source; streaming stores only write.
void CopyOut(uint8_t* dst, const uint8_t* src, size_t n) {
  if (n < 4096) {
    std::memcpy(dst, src, n);
    return;
  }
  StreamCopy(dst, src, n);
#if defined(__SSE2__)
  _mm_sfence();  // the streaming stores are visible before the JS thread hears of them
#endif
}

GateRef* GateOf(Napi::Env env, Napi::Value v) {
  if (!v.IsExternal()) ThrowNative(env, "gate must come from newCopyGate()");
  return v.As<Napi::External<GateRef>>().Data();
}

// newCopyGate() -> an opaque gate for readFileCrc's copy-out; closeCopyGate(gate) closes it (blocking
// for at most the copy in progress, one verified range).
Napi::Value NewCopyGateJs(const Napi::CallbackInfo& info) {
  return Napi::External<GateRef>::New(info.Env(), new GateRef(std::make_shared<CopyGate>()),
                                      [](Napi::Env, GateRef* g) { delete g; });
}

Napi::Value CloseCopyGateJs(const Napi::CallbackInfo& info) {
  (*GateOf(info.Env(), info[0]))->Close();
  return info.Env().Undefined();
}

// readFileCrc(path, buffer, byteOffset, capacity, fileOffset, length|-1, mode, ranges
//             [, dst, dstOffset, dstLength, dstFileOffset, expected, gate])
//   -> Promise<{bytes, direct, reason, crcs, copied}>
// As readFile, and the worker that reads the bytes CRC-32s each range [ranges[2i],
// ranges[2i+1]) (offsets into the read, a Float64Array): a direct read, in range order,
// as soon as a range's bytes have landed (ReadPieces: the next pieces are in flight
// meanwhile), else after the read. A range past the bytes read is cut at the end of the
// read (the caller sees the short `bytes` and does not trust that CRC).
// With a destination: a range read whole whose CRC equals expected[i] (-1: none) is then
// copied, still in cache, to dst at (fileOffset + start − dstFileOffset) when it lies
// within dst and the gate is open; copied[i] = 1 says so. Bytes that fail their check
// are never copied.
Napi::Value ReadFileCrcJs(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  std::string path = ReadPath(env, info[0]);
  uint64_t fileOffset = ToSize(env, info[4], "file offset");
  if (!info[5].IsNumber()) ThrowNative(env, "length must be a number");
  double len = info[5].As<Napi::Number>().DoubleValue();
  int64_t length = len < 0 ? -1 : static_cast<int64_t>(ToSize(env, info[5], "length"));
  Mode mode = ReadMode(env, info[6]);
  if (!info[7].IsTypedArray() || info[7].As<Napi::TypedArray>().TypedArrayType() != napi_float64_array) {
    ThrowNative(env, "ranges must be a Float64Array of [start, end) pairs");
  }
  Napi::Float64Array rv = info[7].As<Napi::Float64Array>();
  if (rv.ElementLength() % 2 != 0) ThrowNative(env, "ranges must hold [start, end) pairs");
  const size_t capacity = ToSize(env, info[3], "capacity");
  auto ranges = std::make_shared<std::vector<std::pair<size_t, size_t>>>();
  ranges->reserve(rv.ElementLength() / 2);
  for (size_t i = 0; i < rv.ElementLength(); i += 2) {
    double a = rv[i], b = rv[i + 1];
    // Checked here, on the JS thread: the worker must never CRC outside the buffer.
    if (!(a >= 0 && b >= a && b <= static_cast<double>(capacity)) || a != static_cast<double>(size_t(a)) ||
        b != static_cast<double>(size_t(b))) {
      ThrowNative(env, "range " + std::to_string(i / 2) + " is not a [start, end) within the buffer");
    }
    ranges->emplace_back(static_cast<size_t>(a), static_cast<size_t>(b));
  }
  // Optional copy-out of verified ranges.
  const bool withDst = info.Length() > 8 && !info[8].IsUndefined();
  auto expected = std::make_shared<std::vector<int64_t>>(ranges->size(), -1);
  HostSpan dst;
  uint64_t dstFileOffset = 0;
  GateRef gate;
  std::vector<Napi::Object> keep{info[1].As<Napi::Object>()};
  if (withDst) {
    dstFileOffset = ToSize(env, info[11], "dst file offset");
    if (!info[12].IsTypedArray() || info[12].As<Napi::TypedArray>().TypedArrayType() != napi_float64_array) {
      ThrowNative(env, "expected must be a Float64Array (a CRC or -1 per range)");
    }
    Napi::Float64Array ev = info[12].As<Napi::Float64Array>();
    if (ev.ElementLength() != ranges->size()) ThrowNative(env, "expected must hold one value per range");
    for (size_t i = 0; i < ranges->size(); i++) {
      double e = ev[i];
      if (!(e == -1 || (e >= 0 && e <= 4294967295.0 && e == static_cast<double>(uint32_t(e))))) {
        ThrowNative(env, "expected[" + std::to_string(i) + "] must be a CRC-32 or -1");
      }
      (*expected)[i] = static_cast<int64_t>(e);
    }
    gate = *GateOf(env, info[13]);
    dst = AcquireHost(env, info[8], info[9], info[10]);
    keep.push_back(info[8].As<Napi::Object>());
  }
  HostSpan span;
  try {
    span = AcquireHost(env, info[1], info[2], info[3]);
  } catch (...) {
    // The destination was marked busy above: a refused read buffer must not leave it so
    // (freePinned would refuse it for good).
    if (withDst) ReleaseHost(dst);
    throw;
  }
  auto r = std::make_shared<IoResult>();
  auto crcs = std::make_shared<std::vector<uint32_t>>(ranges->size(), 0);
  auto copied = std::make_shared<std::vector<uint8_t>>(ranges->size(), 0);
  return RunAsync(
      env, "kvgate.readFileCrc",
      [path, span, fileOffset, length, mode, r, ranges, crcs, expected, dst, dstFileOffset, gate,
       copied](Failure& f) {
        // Range i once the bytes read end at `bytes`: its CRC, and the copy when it verifies.
        auto check = [&](size_t i, size_t bytes) {
          size_t a = std::min((*ranges)[i].first, bytes), b = std::min((*ranges)[i].second, bytes);
          (*crcs)[i] = Crc32(0, span.data + a, b - a);
          if (!gate || (*expected)[i] < 0 || b != (*ranges)[i].second) return;
          if ((*crcs)[i] != static_cast<uint32_t>((*expected)[i])) return;
          uint64_t at = fileOffset + a;
          if (at < dstFileOffset || at - dstFileOffset > dst.length || b - a > dst.length - (at - dstFileOffset)) {
            return;
          }
          if (!gate->Enter()) return;
          CopyOut(dst.data + (at - dstFileOffset), span.data + a, b - a);
          gate->Leave();
          (*copied)[i] = 1;
        };
        // Ranges in order, each as soon as every byte of it is read (the rest still in flight).
        size_t next = 0;
        const Progress progress = [&](size_t read) {
          for (; next < ranges->size() && (*ranges)[next].second <= read; next++) check(next, read);
        };
        DoRead(path, span, fileOffset, length, mode, *r, f, &progress);
        if (f.failed()) return;
        for (; next < ranges->size(); next++) check(next, r->bytes);
      },
      [r, crcs, copied](Napi::Env env) {
        Napi::Object o = Result(env, *r).As<Napi::Object>();
        Napi::Uint32Array out = Napi::Uint32Array::New(env, crcs->size());
        Napi::Uint8Array done = Napi::Uint8Array::New(env, copied->size());
        for (size_t i = 0; i < crcs->size(); i++) {
          out[i] = (*crcs)[i];
          done[i] = (*copied)[i];
        }
        o.Set("crcs", out);
        o.Set("copied", done);
        return o;
      },
      keep, [span, dst, withDst]() {
        ReleaseHost(span);
        if (withDst) ReleaseHost(dst);
      });
}

// writeFile(path, buffer, byteOffset, length, fileOffset, mode, fsync, truncate) -> Promise<{bytes, direct, reason}>
Napi::Value WriteFileJs(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  std::string path = ReadPath(env, info[0]);
  uint64_t fileOffset = ToSize(env, info[4], "file offset");
  Mode mode = ReadMode(env, info[5]);
  bool doFsync = info[6].ToBoolean();
  bool truncate = info[7].ToBoolean();
  HostSpan span = AcquireHost(env, info[1], info[2], info[3]);
  auto r = std::make_shared<IoResult>();
  return RunAsync(
      env, "kvgate.writeFile",
      [path, span, fileOffset, mode, doFsync, truncate, r](Failure& f) {
        DoWrite(path, span, fileOffset, mode, doFsync, truncate, *r, f);
      },
      [r](Napi::Env env) { return Result(env, *r); }, {info[1].As<Napi::Object>()}, [span]() { ReleaseHost(span); });
}

// evictFileCache(path) -> Promise<void>: writes back and drops the file's
// page-cache pages (fdatasync + POSIX_FADV_DONTNEED), so the next buffered
// read comes from the device and a written L2 file stops occupying RAM.
Napi::Value EvictFileCacheJs(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  std::string path = ReadPath(env, info[0]);
  return RunAsync(
      env, "kvgate.evictFileCache",
      [path](Failure& f) {
        Fd fd;
        fd.fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
        if (fd.fd < 0) {
          f = ErrnoFailure("open", errno, "evictFileCache " + path);
          return;
        }
        if (fdatasync(fd.fd) != 0 && errno != EINVAL) {
          f = ErrnoFailure("fdatasync", errno, "evictFileCache " + path);
          return;
        }
        int err = posix_fadvise(fd.fd, 0, 0, POSIX_FADV_DONTNEED);
        if (err != 0) f = ErrnoFailure("posix_fadvise", err, "evictFileCache " + path);
      },
      nullptr);
}

// Whether the peer of a connected socket shut down its side (POLLRDHUP), seen by the kernel
// the moment the peer closed, even with unread frames queued before it. The agent asks after
// a save's copy ends: the engine frees a save's blocks once its connection is gone, and the
// close event reaches JS only in a later turn of the loop (or never, while reading is paused).
Napi::Value PeerClosedJs(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (info.Length() < 1 || !info[0].IsNumber()) ThrowNative(env, "peerClosed: fd must be a number");
  double d = info[0].As<Napi::Number>().DoubleValue();
  if (!(d >= 0 && d <= 2147483647.0) || d != static_cast<double>(static_cast<int>(d)))
    ThrowNative(env, "peerClosed: fd must be a non-negative integer");
  struct pollfd p = {static_cast<int>(d), POLLRDHUP, 0};
  int r;
  do {
    r = poll(&p, 1, 0);
  } while (r < 0 && errno == EINTR);
  if (r < 0) Throw(env, ErrnoFailure("poll", errno, "peerClosed"));
  // POLLNVAL: the fd is not open any more; the connection is gone either way.
  return Napi::Boolean::New(env, r > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0);
}

}  // namespace

void InitIo(Napi::Env env, Napi::Object exports) {
  exports.Set("readFile", Napi::Function::New(env, ReadFileJs, "readFile"));
  exports.Set("readFileCrc", Napi::Function::New(env, ReadFileCrcJs, "readFileCrc"));
  exports.Set("newCopyGate", Napi::Function::New(env, NewCopyGateJs, "newCopyGate"));
  exports.Set("closeCopyGate", Napi::Function::New(env, CloseCopyGateJs, "closeCopyGate"));
  exports.Set("writeFile", Napi::Function::New(env, WriteFileJs, "writeFile"));
  exports.Set("evictFileCache", Napi::Function::New(env, EvictFileCacheJs, "evictFileCache"));
  exports.Set("peerClosed", Napi::Function::New(env, PeerClosedJs, "peerClosed"));
  exports.Set("directAlignment", Napi::Number::New(env, kAlign));
}

}  // namespace kvgate
