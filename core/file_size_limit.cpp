#include "core/file_size_limit.h"

#include <pthread.h>
#include <sys/resource.h>

#include <cerrno>

namespace nanoddp {

namespace {

sigset_t file_size_signal() {
  sigset_t xfsz;
  sigemptyset(&xfsz);
  sigaddset(&xfsz, SIGXFSZ);
  return xfsz;
}

bool file_size_signal_pending() {
  sigset_t pending;
  sigemptyset(&pending);
  return ::sigpending(&pending) == 0 && sigismember(&pending, SIGXFSZ) == 1;
}

}  // namespace

FileSizeSignalHeld::FileSizeSignalHeld() {
  const sigset_t xfsz = file_size_signal();
  ::pthread_sigmask(SIG_BLOCK, &xfsz, &previous_);
  already_pending_ = file_size_signal_pending();
}

FileSizeSignalHeld::~FileSizeSignalHeld() {
  if (!already_pending_ && file_size_signal_pending()) {
    const sigset_t xfsz = file_size_signal();
    const timespec now{0, 0};
    ::sigtimedwait(&xfsz, nullptr, &now);
  }
  ::pthread_sigmask(SIG_SETMASK, &previous_, nullptr);
}

std::string file_size_limit_hint(int error) {
  rlimit limit{};
  if (error != EFBIG || ::getrlimit(RLIMIT_FSIZE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return "";
  return " (the file size limit, ulimit -f, is " + std::to_string(limit.rlim_cur) + " bytes)";
}

}  // namespace nanoddp
