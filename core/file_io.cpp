#include "core/file_io.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <mutex>

#include "core/error.h"
#include "core/file_size_limit.h"
#include "core/hash.h"
#include "core/tensor.h"

namespace nanoddp {

namespace {

// Writes bytes into fd, the temporary file tmp that will become path; errors name path, the
// file the caller asked for, and then the temporary (removed by the caller on the way out).
void write_all(int fd, const std::string& bytes, const std::string& path, const std::string& tmp, const char* what) {
  const FileSizeSignalHeld file_size_signal_held;  // Note [File size limit]
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    const int error = n < 0 ? errno : ENOSPC;  // write() returning 0 for a regular file: no room
    NANODDP_CHECK(n > 0, IOError, what, " ", path, ": write failed at byte offset ", done, " of ", bytes.size(),
                  " (into the temporary file ", tmp, ", removed; ", path, " is as it was): ", std::strerror(error),
                  file_size_limit_hint(error));
    done += static_cast<size_t>(n);
  }
}

// Note [Temporary files and signals]
// Ctrl-C (SIGINT), SIGTERM or SIGHUP in the middle of a write would end the process with the
// temporary file half written next to the target. While a write is under way, each of these
// signals that nothing else handles (its action is the default: end the process) runs
// remove_temporaries_and_die instead: it removes the temporary files being written (unlink is
// async-signal-safe) and ends the process by the same signal, as it would have ended. The
// target is untouched either way (the rename is what replaces it). SIGKILL cannot be caught:
// kill -9 may still leave a temporary file.
constexpr int kCleanedSignals[] = {SIGINT, SIGTERM, SIGHUP};
constexpr size_t kNumCleaned = sizeof(kCleanedSignals) / sizeof(kCleanedSignals[0]);

struct Temporary {
  std::atomic<bool> claimed{false};  // by a writer
  std::atomic<bool> ready{false};    // path is written: the handler may remove it
  char path[4096];
};
Temporary g_temporaries[16];  // writes under way at once; more are written, just not cleaned

std::mutex g_signals_mutex;
int g_writers = 0;                           // under g_signals_mutex
struct sigaction g_saved[kNumCleaned];       // under g_signals_mutex
bool g_installed[kNumCleaned] = {};          // under g_signals_mutex

extern "C" void remove_temporaries_and_die(int signal_number) {
  for (Temporary& temporary : g_temporaries)
    if (temporary.ready.load(std::memory_order_acquire)) ::unlink(temporary.path);
  struct sigaction default_action {};
  default_action.sa_handler = SIG_DFL;
  ::sigaction(signal_number, &default_action, nullptr);
  ::raise(signal_number);  // blocked while this handler runs: delivered, by default, when it returns
}

// While it lives, the cleaned signals run remove_temporaries_and_die, and the file given to
// track() is removed by it. Made before the file is created: a signal between the creation and
// track() would otherwise find the handlers missing or the file not yet registered.
class TemporaryFileGuard {
 public:
  TemporaryFileGuard() {
    std::lock_guard<std::mutex> lock(g_signals_mutex);
    if (g_writers++ > 0) return;
    for (size_t i = 0; i < kNumCleaned; ++i) {
      struct sigaction current {};
      g_installed[i] = ::sigaction(kCleanedSignals[i], nullptr, &current) == 0 &&
                       !(current.sa_flags & SA_SIGINFO) && current.sa_handler == SIG_DFL;
      if (!g_installed[i]) continue;
      g_saved[i] = current;
      struct sigaction cleanup {};
      cleanup.sa_handler = remove_temporaries_and_die;
      sigemptyset(&cleanup.sa_mask);
      ::sigaction(kCleanedSignals[i], &cleanup, nullptr);
    }
  }
  void track(const std::string& path) {
    for (Temporary& temporary : g_temporaries) {
      bool expected = false;
      if (path.size() >= sizeof temporary.path) break;
      if (!temporary.claimed.compare_exchange_strong(expected, true)) continue;
      std::memcpy(temporary.path, path.c_str(), path.size() + 1);
      temporary.ready.store(true, std::memory_order_release);
      slot_ = &temporary;
      break;
    }
  }
  ~TemporaryFileGuard() {
    {
      std::lock_guard<std::mutex> lock(g_signals_mutex);
      if (--g_writers == 0)
        for (size_t i = 0; i < kNumCleaned; ++i)
          if (g_installed[i]) ::sigaction(kCleanedSignals[i], &g_saved[i], nullptr);
    }
    if (slot_ == nullptr) return;
    slot_->ready.store(false, std::memory_order_release);
    slot_->claimed.store(false, std::memory_order_release);
  }
  TemporaryFileGuard(const TemporaryFileGuard&) = delete;
  TemporaryFileGuard& operator=(const TemporaryFileGuard&) = delete;

 private:
  Temporary* slot_ = nullptr;
};

// A new file from name_template (mkostemp's "...XXXXXX", which it fills in) that guard removes
// if a cleaned signal comes before it is gone: the signals wait on this thread from the file's
// creation until it is registered. Returns the descriptor, or -1 with errno set.
int create_temporary_file(std::string& name_template, TemporaryFileGuard& guard) {
  sigset_t cleaned, previous;
  sigemptyset(&cleaned);
  for (int signal_number : kCleanedSignals) sigaddset(&cleaned, signal_number);
  ::pthread_sigmask(SIG_BLOCK, &cleaned, &previous);
  const int fd = ::mkostemp(name_template.data(), O_CLOEXEC);
  const int create_error = errno;
  if (fd >= 0) guard.track(name_template);
  ::pthread_sigmask(SIG_SETMASK, &previous, nullptr);
  errno = create_error;
  return fd;
}

// Note [Stale temporary files]
// A kill -9 or a power cut mid-write leaves the temporary file behind (no handler runs), and a
// job that is killed and restarted often (--max-restarts, a preempted node) leaves one per kill,
// each as large as a checkpoint. A temporary file's name therefore says who writes it,
// "<path>.tmp.<space>.<pid>.XXXXXX", and each write first removes the ones of its path whose
// writer, in its own pid space, is gone: kill(pid, 0) answers ESRCH. The space is 16 hex
// digits of a hash of the boot id and the PID namespace, the only scope in which a pid names
// one process: the files of another machine, of another container (which may have the same
// host name), of a live writer, or of a pid a new process has taken, stay. A name that would be
// longer than a file name may be is "<path>.tmp.XXXXXX", which no write removes.
constexpr size_t kMaxFileName = 255;

std::string pid_space() {
  std::string boot_id;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot_id;
  struct stat namespace_info {};
  const bool known = !boot_id.empty() && ::stat("/proc/self/ns/pid", &namespace_info) == 0;
  if (!known) return "";
  char hex[17];
  std::snprintf(
      hex, sizeof hex, "%016llx",
      static_cast<unsigned long long>(fnv1a(boot_id + "/" + std::to_string(namespace_info.st_ino))));
  return hex;
}

std::string temporary_template(const std::string& path) {
  const std::string prefix = temporary_file_prefix(path);
  return prefix.empty() ? path + ".tmp.XXXXXX" : prefix + std::to_string(::getpid()) + ".XXXXXX";
}

}  // namespace

void remove_stale_temporaries(const std::string& path) {
  const std::string folder = folder_of(path), prefix = temporary_file_prefix(path);
  if (prefix.empty()) return;
  const std::string name_prefix = prefix.substr(prefix.find_last_of('/') + 1);  // npos + 1 = 0
  DIR* dir = ::opendir(folder.c_str());
  if (dir == nullptr) return;
  while (const dirent* entry = ::readdir(dir)) {
    const std::string name = entry->d_name;
    if (name.compare(0, name_prefix.size(), name_prefix) != 0) continue;
    const size_t dot = name.find('.', name_prefix.size());
    if (dot == std::string::npos) continue;
    const std::string digits = name.substr(name_prefix.size(), dot - name_prefix.size());
    if (digits.empty() || digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos)
      continue;
    const pid_t writer = static_cast<pid_t>(std::stol(digits));
    if (writer > 0 && writer != ::getpid() && ::kill(writer, 0) != 0 && errno == ESRCH)
      ::unlink((folder + "/" + name).c_str());
  }
  ::closedir(dir);
}

std::string temporary_file_prefix(const std::string& path) {
  static const std::string space = pid_space();
  if (space.empty()) return "";
  const std::string prefix = path + ".tmp." + space + ".";
  const size_t slash = prefix.find_last_of('/');
  const size_t name_length = prefix.size() - (slash == std::string::npos ? 0 : slash + 1);
  if (name_length + 10 + 7 > kMaxFileName) return "";  // + pid and ".XXXXXX"
  return prefix;
}

std::string folder_of(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
}

// Note [Save target] The file a save replaces, checked before any byte is written. A symlink
// is followed to the file it names (as open() would, and torch.save does): renaming over the
// link itself would turn it into a regular file in the link's folder and leave its target
// stale. What is there must be absent or a regular file: a rename over a folder fails only
// after the whole temporary file is written, and over a device or a pipe (say /dev/null) it
// would replace the device. The folder must exist (torch.save: "Parent directory ... does not
// exist"). Throws IOError naming path (and where its links lead).
std::string save_target(const std::string& path, const char* what) {
  NANODDP_CHECK(!path.empty(), IOError, what, ": the path is empty");
  std::string target = path;
  for (int hops = 0;; ++hops) {
    struct stat info {};
    if (::lstat(target.c_str(), &info) != 0) break;  // absent: created by the rename
    if (S_ISLNK(info.st_mode)) {
      NANODDP_CHECK(hops < 40, IOError, what, " ", path, ": too many levels of symbolic links");
      std::string link(4096, '\0');
      const ssize_t n = ::readlink(target.c_str(), link.data(), link.size());
      NANODDP_CHECK(n > 0 && static_cast<size_t>(n) < link.size(), IOError, what, " ", path, ": cannot read link ",
                    target, ": ", std::strerror(errno));
      link.resize(static_cast<size_t>(n));
      target = link[0] == '/' ? link : folder_of(target) + "/" + link;
      continue;
    }
    NANODDP_CHECK(S_ISREG(info.st_mode), IOError, what, " ", path, (target == path ? "" : " (a link to " + target + ")"),
                  " exists but is ", S_ISDIR(info.st_mode) ? "a folder" : "not a regular file (a device, pipe or socket)",
                  "; a save replaces a regular file only");
    break;
  }
  const std::string dir = folder_of(target);
  struct stat info {};
  NANODDP_CHECK(::stat(dir.c_str(), &info) == 0, IOError, what, " ", path, ": folder ", dir, " does not exist (",
                std::strerror(errno), "); create it first");
  NANODDP_CHECK(S_ISDIR(info.st_mode), IOError, what, " ", path, ": ", dir, " is not a folder");
  return target;
}

// Note [Saved file mode] torch.save opens its path with open(path, "wb"): a new file gets
// 0666 less the process's umask, and a file it overwrites keeps its mode. A save here writes
// a temporary file (mkstemp makes it 0600) and renames it over the path, so the temporary file
// is given that mode first: a checkpoint kept private (chmod 600, or umask 077) stays private,
// and a new one is as readable as any other file the program creates.
mode_t saved_file_mode(const std::string& target) {
  struct stat info {};
  if (::stat(target.c_str(), &info) == 0) return info.st_mode & 0777;
  // The umask, read without changing it (umask() would, for every thread, for a moment).
  mode_t mask = 022;
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("Umask:", 0) == 0) mask = static_cast<mode_t>(std::stoul(line.substr(6), nullptr, 8)) & 0777;
  return 0666 & ~mask;
}

void check_writable(const std::string& path, const char* what) {
  const std::string target = save_target(path, what), dir = folder_of(target);
  NANODDP_CHECK(::access(dir.c_str(), W_OK) == 0, IOError, what, " ", path, ": cannot write in folder ", dir, ": ",
                std::strerror(errno));
  // access() answers yes to root for any folder, /proc's included: so make (and remove) the
  // temporary file a save makes there.
  std::string probe = temporary_template(target);
  TemporaryFileGuard removed_on_signal;  // Note [Temporary files and signals]
  const int fd = create_temporary_file(probe, removed_on_signal);
  NANODDP_CHECK(fd >= 0, IOError, what, " ", path, ": cannot create a file in folder ", dir, ": ",
                std::strerror(errno));
  ::close(fd);
  ::unlink(probe.c_str());
}

void write_file_atomically(const std::string& given_path, const std::string& bytes, const char* what) {
  const std::string path = save_target(given_path, what);  // Note [Save target]
  // Each write has a temporary file of its own (mkstemp's unique name) in path's folder, so
  // processes writing the same path at once never truncate or rename away each other's file:
  // the last rename wins and path always holds one whole file.
  remove_stale_temporaries(path);  // Note [Stale temporary files]
  std::string tmp = temporary_template(path);
  TemporaryFileGuard removed_on_signal;  // Note [Temporary files and signals]
  const int fd = create_temporary_file(tmp, removed_on_signal);
  NANODDP_CHECK(fd >= 0, IOError, what, ": cannot create a temporary file ", tmp, " next to ", path, ": ",
                std::strerror(errno));
  try {
    NANODDP_CHECK(::fchmod(fd, saved_file_mode(path)) == 0, IOError, what, ": chmod ", tmp, ": ",
                  std::strerror(errno));  // Note [Saved file mode]
    write_all(fd, bytes, path, tmp, what);
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

bool is_regular_file(const std::string& path) {
  struct stat info {};
  return !path.empty() && ::stat(path.c_str(), &info) == 0 && S_ISREG(info.st_mode);
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

Tensor host_tensor_to_save(const Tensor& tensor, const std::string& where, const std::string& name) {
  NANODDP_CHECK(tensor.defined(), ValueError, where, ": tensor '", name,
                "' is undefined (a Tensor() with no values)");
  NANODDP_CHECK(!tensor.impl()->storage->is_freed(), ValueError, where, ": tensor '", name, "' (",
                tensor.shape(),
                ") has its memory freed: a model's parameter under FullyShardedDataParallel, outside "
                "its forward; save the wrapper's full_state_dict() or state_dict() instead");
  return tensor.to(Device::cpu());
}

}  // namespace nanoddp
