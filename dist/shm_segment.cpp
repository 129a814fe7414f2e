// The lifecycle of the shared-memory group's segments: making, sizing, publishing, mapping and
// unnaming the group's segment (the numbered steps of Note [Shm segment] in shm_segment.h)
// and each collective buffer's (Note [Shm direct all-reduce] in ring_shm.cpp).
#include "dist/shm_segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <fstream>
#include <new>

#include "core/error.h"
#include "core/file_size_limit.h"
#include "dist/detail.h"

namespace nanoddp::dist::shm {

namespace {

// Step 1 of Note [Shm segment]: unlink "nanoddp.<pid>.*" segments whose creator is gone.
void remove_stale_segments() {
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return;
  while (dirent* entry = ::readdir(dir)) {
    int pid = 0, group = 0;
    if (std::sscanf(entry->d_name, "nanoddp.%d.%d", &pid, &group) == 2 && pid > 0 && ::kill(pid, 0) != 0 &&
        errno == ESRCH)
      ::shm_unlink(("/" + std::string(entry->d_name)).c_str());
  }
  ::closedir(dir);
}

// Where shared memory cannot be had, the ranks can still talk over sockets.
constexpr const char* kOtherBackendHint = "; the gloo backend needs no shared memory (--backend gloo)";

}  // namespace

std::string machine_id() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  return id + " " + detail::host_name();
}

// With SIGXFSZ held (Note [File size limit] in core/file_size_limit.h): /dev/shm counts
// against `ulimit -f`, whose signal would end the process here.
std::string segment_sizing_failure(int fd, size_t bytes) {
  const FileSizeSignalHeld held;
  if (::ftruncate(fd, static_cast<off_t>(bytes)) == 0) return "";
  const int error = errno;
  return detail::errno_text(error) + (error == EFBIG ? file_size_limit_hint(error) : " (is /dev/shm full?)");
}

bool segment_possible(size_t nbytes) {
  const std::string name = new_segment_name();
  detail::Fd fd(::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600));
  if (!fd.valid()) return false;
  const bool sized = segment_sizing_failure(fd.get(), nbytes).empty();
  ::shm_unlink(name.c_str());
  return sized;
}

std::string new_segment_name() {
  static std::atomic<int> created{0};
  return "/nanoddp." + std::to_string(::getpid()) + "." + std::to_string(created++);
}

uint8_t* map_region(int fd, size_t nbytes, const std::string& name, const std::string& what) {
  void* mapped = ::mmap(nullptr, nbytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  NANODDP_CHECK(mapped != MAP_FAILED, DistError, what, ": mapping ", nbytes, " bytes of ", name,
                " failed: ", detail::errno_text(errno));
  return static_cast<uint8_t*>(mapped);
}

void arrive_and_wait(Store& store, const std::string& key, int rank, int world_size,
                     std::chrono::milliseconds timeout) {
  store.set(key + std::to_string(rank), std::string("1"));
  std::vector<std::string> keys;
  for (int r = 0; r < world_size; ++r) keys.push_back(key + std::to_string(r));
  store.wait(keys, timeout);
}

ShmSegment::ShmSegment(Store& store, const std::string& prefix, int rank, int world_size,
                       std::chrono::milliseconds timeout)
    : rank_(rank), world_size_(world_size), layout_(world_size) {
  const std::string where = detail::where(rank, world_size) + ": shm";
  const std::string machine = machine_id();
  std::string name;
  detail::Fd fd;
  if (rank == 0) {
    // Step 1 (Note [Shm segment]).
    remove_stale_segments();
    name = new_segment_name();
    fd = detail::Fd(::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600));
    NANODDP_CHECK(fd.valid(), DistError, where, ": shm_open(", name, ") failed: ", detail::errno_text(errno),
                  kOtherBackendHint);
  }
  // Rank 0 unlinks the name whatever happens from here on (step 3).
  struct Unlinker {
    std::string name;
    ~Unlinker() {
      if (!name.empty()) ::shm_unlink(name.c_str());
    }
  } unlinker{rank == 0 ? name : std::string()};

  if (rank == 0) {
    const std::string failure = segment_sizing_failure(fd.get(), layout_.total);
    NANODDP_CHECK(failure.empty(), DistError, where, ": sizing the segment ", name, " to ", layout_.total,
                  " bytes failed: ", failure, kOtherBackendHint);
    map(fd.get(), name, where);
    new (header_) Header();
    for (int r = 0; r < world_size; ++r) new (&info(r)) RankInfo();
    for (int c = 0; c < world_size * world_size; ++c)
      new (&reinterpret_cast<Channel*>(base_ + layout_.channels)[c]) Channel();
    header_->world_size = world_size;
    header_->magic = kMagic;
    store.set(prefix + "segment", name + "\n" + machine);  // only now may the others map it
  } else {
    // Step 2.
    std::string published = store.get_string(prefix + "segment");
    size_t newline = published.find('\n');
    name = published.substr(0, newline);
    std::string theirs = newline == std::string::npos ? "" : published.substr(newline + 1);
    NANODDP_CHECK(theirs == machine, DistError, where,
                  ": the shm backend needs every rank on one machine, but rank 0 runs on '", theirs,
                  "' and this rank on '", machine, "' (use gloo or mpi across machines)");
    fd = detail::Fd(::shm_open(name.c_str(), O_RDWR, 0600));
    NANODDP_CHECK(fd.valid(), DistError, where, ": shm_open(", name,
                  ") published by rank 0 failed: ", detail::errno_text(errno));
    map(fd.get(), name, where);
    NANODDP_CHECK(header_->magic == kMagic && header_->world_size == world_size, DistError, where,
                  ": segment ", name, " is not this group's (world size ", header_->world_size, ", expected ",
                  world_size, ")");
  }
  info(rank).pid = ::getpid();

  // Step 3.
  arrive_and_wait(store, prefix + "mapped/", rank, world_size, timeout);
  // Peers in another pid namespace show foreign pids: then liveness cannot be watched.
  for (int r = 0; r < world_size; ++r) watch_pids_ = watch_pids_ && process_alive(info(r).pid);
}

void ShmSegment::map(int fd, const std::string& name, const std::string& where) {
  base_ = map_region(fd, layout_.total, name, where);
  header_ = reinterpret_cast<Header*>(base_);
}

// Each rank makes its buffer a named segment, publishes the name through the store and maps
// every peer's; once all are mapped the names go, as in Note [Shm segment], so no exit path
// leaves one behind.
std::shared_ptr<SharedBuffer> map_shared_buffer(Store& store, const std::string& key, int64_t id,
                                                size_t nbytes, int rank, int world_size,
                                                std::chrono::milliseconds timeout, const std::string& what) {
  auto buffer = std::make_shared<SharedBuffer>();
  buffer->id = id;
  buffer->nbytes = nbytes;
  buffer->region.assign(static_cast<size_t>(world_size), nullptr);

  const std::string name = new_segment_name();
  detail::Fd fd(::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600));
  NANODDP_CHECK(fd.valid(), DistError, what, ": shm_open(", name, ") failed: ", detail::errno_text(errno));
  struct Unlinker {
    const std::string& name;
    ~Unlinker() { ::shm_unlink(name.c_str()); }
  } unlinker{name};
  const std::string failure = segment_sizing_failure(fd.get(), nbytes);
  NANODDP_CHECK(failure.empty(), DistError, what, ": sizing ", name, " to ", nbytes, " bytes failed: ", failure);
  buffer->region[rank] = map_region(fd.get(), nbytes, name, what);
  store.set(key + std::to_string(rank), name + "\n" + std::to_string(nbytes));

  std::vector<std::string> published;
  for (int r = 0; r < world_size; ++r)
    if (r != rank) published.push_back(key + std::to_string(r));
  store.wait(published, timeout);
  std::vector<std::string> names(static_cast<size_t>(world_size));
  std::string mismatch;
  for (int r = 0; r < world_size; ++r) {
    if (r == rank) continue;
    const std::string entry = store.get_string(key + std::to_string(r));
    const size_t newline = entry.find('\n');
    names[r] = entry.substr(0, newline);
    const size_t their_bytes = newline == std::string::npos ? 0 : std::stoull(entry.substr(newline + 1));
    if (their_bytes != nbytes && mismatch.empty())
      mismatch = "rank " + std::to_string(r) + " made its buffer #" + std::to_string(id) + " " +
                 std::to_string(their_bytes) + " bytes, this rank " + std::to_string(nbytes);
  }
  // Every rank has read every entry before any throws: each gets the message, not a store
  // that went away with a rank that threw first.
  arrive_and_wait(store, key + "read/", rank, world_size, timeout);
  NANODDP_CHECK(mismatch.empty(), DistError, what, ": ", mismatch,
                " (every rank must make the same collective buffers, in the same order)");
  for (int r = 0; r < world_size; ++r) {
    if (r == rank) continue;
    detail::Fd peer(::shm_open(names[r].c_str(), O_RDWR, 0600));
    NANODDP_CHECK(peer.valid(), DistError, what, ": shm_open(", names[r], ") published by rank ", r,
                  " failed: ", detail::errno_text(errno));
    buffer->region[r] = map_region(peer.get(), nbytes, names[r], what);
  }
  arrive_and_wait(store, key + "mapped/", rank, world_size, timeout);
  return buffer;
}

}  // namespace nanoddp::dist::shm
