// libFuzzer target: the IDX reader (data::read_idx and its image/label wrappers), raw and
// gzipped. read_idx takes a path, so the input is written to an in-memory file (memfd) and
// read through /proc/self/fd, by each reader in turn. Any exception but IOError, and any
// sanitizer report, is a finding.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/error.h"
#include "data/idx.h"

namespace {
int memory_file() {
  static const int fd = ::memfd_create("fuzz_idx", MFD_CLOEXEC);
  if (fd < 0) __builtin_trap();
  return fd;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const int fd = memory_file();
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, data, size, 0) != static_cast<ssize_t>(size)) __builtin_trap();
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  // Every reader sees every input: the magic picks the one that reads past the header.
  auto attempt = [](auto&& read) {
    try {
      read();
    } catch (const nanoddp::IOError&) {
    }
  };
  attempt([&] {
    if (nanoddp::data::read_idx_labels(path).dim() != 1) __builtin_trap();
  });
  attempt([&] {
    const nanoddp::Tensor images = nanoddp::data::read_idx_images(path);
    if (images.dim() != 3 || images.size(1) <= 0 || images.size(2) <= 0) __builtin_trap();
  });
  for (int dims : {2, 4})
    attempt([&] {
      if (nanoddp::data::read_idx(path, dims).dim() != dims) __builtin_trap();
    });
  return 0;
}
