#include "nn/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>

#include "core/error.h"

namespace nanoddp::nn {

namespace {

void write_all(int fd, const std::string& bytes, const std::string& path, const char* what) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    NANODDP_CHECK(n > 0, IOError, what, " ", path, ": write failed at byte offset ", done, ": ", std::strerror(errno));
    done += static_cast<size_t>(n);
  }
}

}  // namespace

std::string folder_of(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
}

void check_writable(const std::string& path, const char* what) {
  struct stat info {};
  NANODDP_CHECK(::stat(path.c_str(), &info) != 0 || S_ISREG(info.st_mode), IOError, what, " ", path,
                " exists but is not a regular file");
  const std::string dir = folder_of(path);
  NANODDP_CHECK(::access(dir.c_str(), W_OK) == 0, IOError, what, " ", path, ": cannot write in folder ", dir, ": ",
                std::strerror(errno));
}

void write_file_atomically(const std::string& path, const std::string& bytes, const char* what) {
  // Each write has a temporary file of its own (mkstemp's unique name) in path's folder, so
  // processes writing the same path at once never truncate or rename away each other's file:
  // the last rename wins and path always holds one whole file.
  std::string tmp = path + ".tmp.XXXXXX";
  const int fd = ::mkostemp(tmp.data(), O_CLOEXEC);
  NANODDP_CHECK(fd >= 0, IOError, what, ": cannot create a temporary file ", tmp, " next to ", path, ": ",
                std::strerror(errno));
  try {
    // mkstemp creates 0600; the file is as readable as any other the program writes.
    NANODDP_CHECK(::fchmod(fd, 0644) == 0, IOError, what, ": chmod ", tmp, ": ", std::strerror(errno));
    write_all(fd, bytes, tmp, what);
    NANODDP_CHECK(::fsync(fd) == 0, IOError, what, ": fsync ", tmp, ": ", std::strerror(errno));
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int error = errno;
    ::unlink(tmp.c_str());
    NANODDP_THROW(IOError, what, ": rename ", tmp, " -> ", path, ": ", std::strerror(error));
  }
  // Make the rename itself durable.
  const int dir_fd = ::open(folder_of(path).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    ::fsync(dir_fd);
    ::close(dir_fd);
  }
}

std::string read_regular_file(const std::string& path, const char* what) {
  struct stat info {};
  NANODDP_CHECK(::stat(path.c_str(), &info) == 0, IOError, what, " ", path, ": cannot open: ", std::strerror(errno));
  NANODDP_CHECK(S_ISREG(info.st_mode), IOError, what, " ", path, ": not a regular file");
  std::ifstream file(path, std::ios::binary);
  NANODDP_CHECK(file.good(), IOError, what, " ", path, ": cannot open: ", std::strerror(errno));
  std::string bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  NANODDP_CHECK(!file.bad(), IOError, what, " ", path, ": read failed: ", std::strerror(errno));
  return bytes;
}

}  // namespace nanoddp::nn
