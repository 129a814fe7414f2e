// Writing past the file size limit (RLIMIT_FSIZE, `ulimit -f`) as an error, not a death.
//
//   const FileSizeSignalHeld held;  // around the writes (or ftruncate) of one file
//   NANODDP_CHECK(::write(fd, p, n) == n, IOError, "...: ", std::strerror(errno), file_size_limit_hint(errno));
//
// Note [File size limit]
// A write or ftruncate past RLIMIT_FSIZE (`ulimit -f`, a batch system's quota) raises SIGXFSZ,
// whose default action ends the process at once: no error message, and whatever was being
// written left half done. Python ignores SIGXFSZ, so torch.save gets "OSError: [Errno 27] File
// too large" instead. While it lives, FileSizeSignalHeld blocks SIGXFSZ on the calling thread
// (the kernel sends it to the thread that wrote), so the call fails with EFBIG and the
// caller's error path runs; a SIGXFSZ that the call raised meanwhile is taken off the thread
// before the old mask returns, so it does not end the process after all. Every writer in the
// library holds one: checkpoints, safetensors and traces (core/file_io.cpp), shared-memory
// segments (dist/shm_segment.cpp, which /dev/shm counts against the limit) and the examples'
// --metrics log.
#pragma once

#include <signal.h>

#include <string>

namespace nanoddp {

class FileSizeSignalHeld {
 public:
  FileSizeSignalHeld();
  ~FileSizeSignalHeld();
  FileSizeSignalHeld(const FileSizeSignalHeld&) = delete;
  FileSizeSignalHeld& operator=(const FileSizeSignalHeld&) = delete;

 private:
  sigset_t previous_;
  bool already_pending_ = false;
};

// " (the file size limit, ulimit -f, is N bytes)" when error is EFBIG and a limit is set, else "".
std::string file_size_limit_hint(int error);

}  // namespace nanoddp
