// LD_PRELOAD shim for test/native-aio-faults.test.ts: the addon calls Linux AIO through
// syscall(2), so this syscall() fails or bends the AIO calls as AIOFAULT says and passes
// every other system call through. It writes "submit" to stderr per io_submit it sees.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <linux/aio_abi.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static long (*real)(long, ...);
static int calls;

long syscall(long n, ...) {
  va_list ap;
  va_start(ap, n);
  long a[6];
  for (int i = 0; i < 6; i++) a[i] = va_arg(ap, long);
  va_end(ap);
  if (!real) real = (long (*)(long, ...))dlsym(RTLD_NEXT, "syscall");
  const char* m = getenv("AIOFAULT");
  if (!m) m = "";
  if (n == SYS_io_submit) write(2, "submit\n", 7);
  // No AIO context (aio-max-nr reached, or no AIO in the kernel).
  if (n == SYS_io_setup && !strcmp(m, "setup")) {
    errno = EAGAIN;
    return -1;
  }
  // The kernel takes one piece per call, and refuses every other call.
  if (n == SYS_io_submit && !strcmp(m, "partial")) {
    if (++calls % 2 == 0) {
      errno = EAGAIN;
      return -1;
    }
    return real(n, a[0], 1L, a[2]);
  }
  if (n == SYS_io_getevents) {
    if (!strcmp(m, "eintr") && ++calls % 2 == 1) {
      errno = EINTR;
      return -1;
    }
    // Waiting fails once (pieces still in flight).
    if (!strcmp(m, "getfail") && ++calls == 1) {
      errno = EBADF;
      return -1;
    }
    long got = real(n, a[0], a[1], a[2], a[3], a[4]);
    struct io_event* ev = (struct io_event*)a[3];
    for (long i = 0; i < got; i++) {
      // The third piece of the first read fails, or the second comes back short (1 MiB of 2).
      if (!strcmp(m, "evfail") && ev[i].data == 2 && ++calls == 1) ev[i].res = -EIO;
      if (!strcmp(m, "evshort") && ev[i].data == 1 && ++calls == 1) ev[i].res = 1 << 20;
    }
    return got;
  }
  return real(n, a[0], a[1], a[2], a[3], a[4], a[5]);
}
