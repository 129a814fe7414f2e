// The shared-memory process group: CPU tensors between ranks on one machine, through one
// segment of shared memory that every rank maps. The all-reduce is the textbook ring, written
// out here so that it can be read; it is also the fast path on one machine (no sockets, no
// threads: Note [Shm progress]).
//
// Note [Shm segment]
// One POSIX shared-memory segment per group, laid out as
//
//   | Header | RankInfo x N | Channel x N*N | Slot x N*N*kSlotsPerChannel |
//
// Channel (src, dst) is a one-way mailbox of kSlotsPerChannel slots from rank src to rank dst,
// with two counters: `posted` (written only by src) and `consumed` (written only by dst).
// src may fill a slot while posted - consumed < kSlotsPerChannel; dst may read one while
// posted != consumed. The ring uses channel (r, r+1); send/recv use any (src, dst). Every slot
// carries an Envelope (which collective, its sequence number, dtype, size, op, root or tag) that
// the reader checks against its own: ranks out of step are reported at the first slot read,
// instead of mixing data (mismatch detection, as c10d's sequence numbers do).
//
// The segment is made through the store, in numbered steps (ShmSegment::open):
//   1. Rank 0 removes segments left by jobs whose rank 0 died (the name holds its pid), then
//      creates "/nanoddp.<pid>.<group>", sized and zeroed, and publishes the name with this
//      machine's boot id.
//   2. Every other rank reads the name, checks the boot id (the backend needs one machine),
//      maps the segment and writes its pid into its RankInfo.
//   3. Every rank sets "mapped/<rank>" and waits for all of them; rank 0 then unlinks the name.
// From step 3 on, the segment has no name: the kernel frees it when the last rank unmaps it
// or dies, so no exit path, however abrupt, leaves it behind in /dev/shm.
//
// Note [Shm waiting]
// A rank that waits spins for kSpinTime, then sleeps on a futex in its own Doorbell. The spin
// is long enough to cover how far apart DDP's ranks reach a bucket's all-reduce (a few
// hundred microseconds in a 1 ms step): a rank that fell asleep pays a wake-up on every
// step. Measured side by side on an idle 2-core machine, 2 ranks training the MLP on shm:
// 500 us gave 7-16% more samples/s than 20 us in 4 of 4 pairs. The spin calls
// sched_yield(), not a pause instruction: when the peer it waits for shares its core (more
// ranks than free cores, a busy machine) the peer runs at once instead of after our time
// slice. Measured on a loaded 2-core machine, 2 ranks, 4 KB: ~60 us with yield, ~400 us with
// pause (and ~2 ms when the pause spin lasted 200 us). A rank that changes a counter somebody
// may wait on rings that rank's doorbell: a fetch_add, plus a FUTEX_WAKE only when the rank says it is
// asleep. So 2 ranks on 2 cores never take the core that the other needs for its part of the
// work. Sleeps are cut into kWatchInterval slices to check the deadline, the abort flag and
// whether the awaited peer is still alive (a dead peer is reported within a slice, not after
// the whole timeout).
//
// Note [Shm progress]
// A collective or send/recv returns its Work at once and runs when some wait() needs it, on
// the waiting thread (as MPI without a progress thread: "the collective moves only while
// some rank sits in an MPI call"). wait() runs the pending works in issue order: a collective
// runs to its end before anything after it, so works complete in the order issued; sends and
// receives issued before it progress together, piece by piece, so that an exchange (rank 0
// sends to 1 while 1 sends to 0) does not deadlock on full slots. On a CPU there is no
// overlap to win by a thread of our own (it would take its cycles from backward's cores),
// and not having one is what keeps a small all-reduce in microseconds
// (Note [Gloo worker thread] is the other side of that).
// is_completed() does not run anything: it reports, and stays false until some wait() ran it.
//
// Note [Shm direct all-reduce]
// The ring moves data through slots: each rank copies a piece into the slot, its neighbour
// reads it from there. When the tensor is a collective buffer (ProcessGroup::
// new_collective_buffer: DDP's buckets), every rank has mapped every rank's buffer, and the
// all-reduce needs no slot at all:
//
//   rank 0's buffer  [ a0 | a1 ]      1. every rank's input is in its buffer (rendezvous)
//   rank 1's buffer  [ b0 | b1 ]      2. rank r sums part r from all buffers into its own:
//                                        rank 0: a0 += b0     rank 1: b1 += a1 (rendezvous)
//                                     3. rank r copies part p from rank p's buffer:
//                                        rank 0: a1 = b1      rank 1: b0 = a0  (rendezvous)
//
// It is the ring's reduce-scatter and all-gather with the neighbour's buffer read in place:
// each rank still reads 2(N-1)/N of the buffer from its peers, but nothing is copied into a
// slot first. Per rank at N = 2 that is 2.5 buffer-sizes of memory traffic instead of the
// ring's 4.5, on a machine where memory bandwidth is the cost (benchmarks/run, "shm direct"
// row). The sums run in the ring's order, so the result has the ring's bits. Envelopes are
// compared at the first rendezvous; a rank that passed an ordinary tensor (and so runs the
// ring) shows up there as a slot from it, and both are told. The last rendezvous is why a
// rank may change its buffer once wait() returns: nobody reads it any more.
#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>
#include <type_traits>

#include "core/error.h"
#include "core/file_size_limit.h"
#include "core/half_convert.h"
#include "dist/detail.h"
#include "dist/launcher_link.h"
#include "dist/process_group.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace nanoddp::dist {

namespace {

using Clock = std::chrono::steady_clock;

// One slot's payload. 256 KiB keeps a slot in L2 while it is written and read, and makes the
// per-slot hand-off (two counter updates) negligible next to the copy from 64 KiB up.
constexpr size_t kSlotBytes = 256u << 10;
// Two slots per channel: a rank fills the next slot while its neighbour reads the last one.
constexpr uint32_t kSlotsPerChannel = 2;
constexpr std::chrono::microseconds kSpinTime{500};
constexpr std::chrono::milliseconds kWatchInterval{50};
constexpr uint64_t kMagic = 0x6e616e6f64647073ull;  // "nanoddps"
constexpr size_t kAbortMessageBytes = 1024;

static_assert(std::atomic<uint32_t>::is_always_lock_free, "futexes need lock-free 32-bit atomics");
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "a futex word is 32 bits");

enum class Kind : uint32_t { AllReduce = 1, Broadcast, AllGather, ReduceScatter, Barrier, Send };

const char* kind_name(Kind kind) {
  switch (kind) {
    case Kind::AllReduce:
      return "all_reduce";
    case Kind::Broadcast:
      return "broadcast";
    case Kind::AllGather:
      return "all_gather";
    case Kind::ReduceScatter:
      return "reduce_scatter";
    case Kind::Barrier:
      return "barrier";
    case Kind::Send:
      return "send/recv";
  }
  return "?";
}

// What a slot belongs to. Equal on both ends of a channel when the ranks are in step.
struct Envelope {
  uint64_t seq = 0;  // collectives: the group's count; send/recv: the channel's message count
  Kind kind = Kind::AllReduce;
  int32_t dtype = 0;  // DType as int
  int32_t op = 0;     // ReduceOp as int (reductions only)
  int32_t root = 0;   // broadcast root, or send/recv tag
  int64_t numel = 0;  // elements of the tensor (per rank for all_gather/reduce_scatter)
  int64_t buffer = -1;  // the collective buffer all_reduce runs on directly, or -1

  bool operator==(const Envelope& o) const {
    return seq == o.seq && kind == o.kind && dtype == o.dtype && op == o.op && root == o.root &&
           numel == o.numel && buffer == o.buffer;
  }
  std::string str() const {
    std::ostringstream out;
    out << kind_name(kind);
    if (kind == Kind::AllReduce || kind == Kind::ReduceScatter)
      out << "(" << reduce_op_name(static_cast<ReduceOp>(op)) << ")";
    if (kind == Kind::Broadcast) out << " from rank " << root;
    if (kind == Kind::Send) out << " tag " << root;
    out << " #" << seq << " of " << numel << " " << dtype_name(static_cast<DType>(dtype));
    if (buffer >= 0) out << " in collective buffer #" << buffer;
    return out.str();
  }
};

// ---- the segment's layout (Note [Shm segment]) ---------------------------------------------

struct Doorbell {
  alignas(64) std::atomic<uint32_t> rings{0};  // the futex word
  std::atomic<uint32_t> sleepers{0};
};

struct RankInfo {
  alignas(64) int32_t pid = 0;
  Doorbell bell;
  // The direct all-reduce's rendezvous (Note [Shm direct all-reduce]): how far this rank got,
  // 4 * seq + phase, and what it is running.
  alignas(64) std::atomic<uint64_t> direct_phase{0};
  Envelope direct_envelope;
};

struct Channel {
  alignas(64) std::atomic<uint32_t> posted{0};    // written by the sender only
  alignas(64) std::atomic<uint32_t> consumed{0};  // written by the receiver only
};

struct SlotHeader {
  Envelope envelope;
  uint64_t nbytes = 0;
};
constexpr size_t kSlotHeaderBytes = 64;
static_assert(sizeof(SlotHeader) <= kSlotHeaderBytes, "slot header outgrew its room");
constexpr size_t kSlotStride = kSlotHeaderBytes + kSlotBytes;

struct Header {
  uint64_t magic = 0;
  int32_t world_size = 0;
  // 0: running; 1: a rank is writing why it aborted; 2: aborted, message complete.
  alignas(64) std::atomic<uint32_t> abort_state{0};
  int32_t abort_rank = -1;
  // The rank whose death made abort_rank abort, or -1: every rank that fails on the abort
  // reports that rank to the launcher, not the one that noticed first (Note [Launcher link]).
  int32_t abort_lost_rank = -1;
  char abort_message[kAbortMessageBytes] = {};
};

size_t align_up(size_t n) { return (n + 63) / 64 * 64; }

struct Layout {
  size_t ranks, channels, slots, total;
  explicit Layout(int n) {
    const size_t w = static_cast<size_t>(n);
    ranks = align_up(sizeof(Header));
    channels = ranks + align_up(w * sizeof(RankInfo));
    slots = channels + align_up(w * w * sizeof(Channel));
    total = slots + w * w * kSlotsPerChannel * kSlotStride;
  }
};

// Sizes a new segment; "" on success, else why not. With SIGXFSZ held (Note [File size limit]
// in core/file_size_limit.h): /dev/shm counts against `ulimit -f`, whose signal would end the
// process here.
std::string segment_sizing_failure(int fd, size_t bytes) {
  const FileSizeSignalHeld held;
  if (::ftruncate(fd, static_cast<off_t>(bytes)) == 0) return "";
  const int error = errno;
  return detail::errno_text(error) + (error == EFBIG ? file_size_limit_hint(error) : " (is /dev/shm full?)");
}

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  // Not FUTEX_PRIVATE_FLAG: the word is shared between processes.
  return ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::atomic_signal_fence(std::memory_order_seq_cst);
#endif
}

// False once pid has exited, even while it is an unreaped zombie (a launcher may keep
// exited ranks as zombies until the job ends).
bool process_alive(int pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  if (!std::getline(stat, text)) return ::kill(pid, 0) == 0 || errno == EPERM;
  size_t paren = text.rfind(')');
  if (paren == std::string::npos || paren + 2 >= text.size()) return true;
  char state = text[paren + 2];
  return state != 'Z' && state != 'X';
}

std::string boot_id() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  return id;
}

// "/nanoddp.<pid>.<n>": unique on this machine while this process lives, and recognisable by
// remove_stale_segments once it is gone.
std::string new_segment_name() {
  static std::atomic<int> created{0};
  return "/nanoddp." + std::to_string(::getpid()) + "." + std::to_string(created++);
}

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

// Maps nbytes of the shared-memory object fd (named name, for messages) read-write.
uint8_t* map_region(int fd, size_t nbytes, const std::string& name, const std::string& what) {
  void* mapped = ::mmap(nullptr, nbytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  NANODDP_CHECK(mapped != MAP_FAILED, DistError, what, ": mapping ", nbytes, " bytes of ", name,
                " failed: ", detail::errno_text(errno));
  return static_cast<uint8_t*>(mapped);
}

// Sets "<key><rank>" and waits until every rank has set its own.
void arrive_and_wait(Store& store, const std::string& key, int rank, int world_size,
                     std::chrono::milliseconds timeout) {
  store.set(key + std::to_string(rank), std::string("1"));
  std::vector<std::string> keys;
  for (int r = 0; r < world_size; ++r) keys.push_back(key + std::to_string(r));
  store.wait(keys, timeout);
}

// The mapped segment and the waiting, posting and reading every collective is built from.
class ShmSegment {
 public:
  ShmSegment(Store& store, const std::string& prefix, int rank, int world_size,
             std::chrono::milliseconds timeout);
  ~ShmSegment() {
    if (base_ != nullptr) ::munmap(base_, layout_.total);
  }
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  // Bytes this rank wrote into its peers' slots or read from their collective buffers
  // (ProcessGroup::moved_bytes).
  std::atomic<int64_t> moved_bytes{0};

  // ---- posting and reading one slot of a channel (Note [Shm segment]) ----
  // Fills the next slot of channel (rank, dst); false when both are still unread.
  bool try_post(int dst, const Envelope& envelope, const void* data, size_t nbytes) {
    Channel& c = channel(rank_, dst);
    const uint32_t posted = c.posted.load(std::memory_order_relaxed);
    if (posted - c.consumed.load(std::memory_order_acquire) >= kSlotsPerChannel) return false;
    uint8_t* s = slot(rank_, dst, posted % kSlotsPerChannel);
    auto* header = reinterpret_cast<SlotHeader*>(s);
    header->envelope = envelope;
    header->nbytes = nbytes;
    if (nbytes > 0) std::memcpy(s + kSlotHeaderBytes, data, nbytes);
    moved_bytes.fetch_add(static_cast<int64_t>(nbytes), std::memory_order_relaxed);
    c.posted.store(posted + 1, std::memory_order_release);
    ring(dst);
    return true;
  }
  // The oldest unread slot of channel (src, rank), or nullptr when there is none.
  const SlotHeader* try_peek(int src) {
    Channel& c = channel(src, rank_);
    const uint32_t consumed = c.consumed.load(std::memory_order_relaxed);
    if (c.posted.load(std::memory_order_acquire) == consumed) return nullptr;
    return reinterpret_cast<const SlotHeader*>(slot(src, rank_, consumed % kSlotsPerChannel));
  }
  static const uint8_t* payload(const SlotHeader* header) {
    return reinterpret_cast<const uint8_t*>(header) + kSlotHeaderBytes;
  }
  // Hands the slot try_peek returned back to src.
  void release(int src) {
    Channel& c = channel(src, rank_);
    c.consumed.store(c.consumed.load(std::memory_order_relaxed) + 1, std::memory_order_release);
    ring(src);
  }

  // Blocking forms for the collectives: wait (Note [Shm waiting]) for a free slot / a slot.
  void post(int dst, const Envelope& envelope, const void* data, size_t nbytes, Clock::time_point deadline,
            const std::string& what) {
    wait_until([&] { return try_post(dst, envelope, data, nbytes); }, dst, deadline, what);
  }
  // Waits for the next slot from src and checks that it belongs to `expected` and holds nbytes.
  const SlotHeader* receive(int src, const Envelope& expected, size_t nbytes, Clock::time_point deadline,
                            const std::string& what) {
    const SlotHeader* header = nullptr;
    wait_until([&] { return (header = try_peek(src)) != nullptr; }, src, deadline, what);
    check_envelope(src, *header, expected, nbytes, what);
    return header;
  }
  void check_envelope(int src, const SlotHeader& header, const Envelope& expected, size_t nbytes,
                      const std::string& what) {
    if (header.envelope == expected && header.nbytes == nbytes) return;
    abort(what + ": rank " + std::to_string(src) + " is at " + header.envelope.str() +
          " while this rank is at " + expected.str() +
          " (every rank must issue the same collectives in the same order, with the same "
          "dtype, size, op and root)");
  }

  // Spins, then sleeps on this rank's doorbell, until ready() is true. `peer` is the rank
  // being waited for (-1: any), checked for liveness. Throws TimeoutError after deadline and
  // DistError when the group was aborted or the peer died.
  template <typename Ready>
  void wait_until(Ready&& ready, int peer, Clock::time_point deadline, const std::string& what) {
    const auto spin_end = Clock::now() + kSpinTime;
    for (int i = 0;; ++i) {
      if (ready()) return;
      if ((i & 15) == 15 && Clock::now() > spin_end) break;
      ::sched_yield();
    }
    Doorbell& bell = info(rank_).bell;
    while (true) {
      // First: a peer may have posted its last piece and exited; what it left still counts.
      if (ready()) return;
      check_abort(what);
      auto now = Clock::now();
      if (now >= deadline) {
        std::string waited = peer >= 0 ? "rank " + std::to_string(peer) : "a peer";
        mark_aborted(what + ": rank " + std::to_string(rank_) + " timed out waiting for " + waited);
        NANODDP_THROW(TimeoutError, what, ": did not complete within ", wait_timeout.count(),
                      " ms (waiting for ", waited, "; a peer may have exited or be out of step)");
      }
      // A peer may also post its last piece and exit between the ready() above and this
      // check: look again before calling it dead (it posts before it exits).
      if (!peers_alive(peer) && ready()) return;
      check_alive(peer, what);
      const uint32_t rings = bell.rings.load();
      bell.sleepers.fetch_add(1);
      if (ready()) {
        bell.sleepers.fetch_sub(1);
        return;
      }
      auto slice = std::min<Clock::duration>(deadline - now, kWatchInterval);
      auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(slice).count();
      timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
      // Returns at once if a ring came after `rings` was read: no wake-up is lost.
      futex(&bell.rings, FUTEX_WAIT, rings, &ts);
      bell.sleepers.fetch_sub(1);
      if (ready()) return;
    }
  }

  // ---- the direct all-reduce's rendezvous (Note [Shm direct all-reduce]) ----
  void announce(const Envelope& envelope) { info(rank_).direct_envelope = envelope; }
  const Envelope& announced(int r) { return info(r).direct_envelope; }
  // Publishes that this rank reached `phase` and rings every peer.
  void reach(uint64_t phase) {
    info(rank_).direct_phase.store(phase, std::memory_order_release);
    for (int r = 0; r < world_size_; ++r)
      if (r != rank_) ring(r);
  }
  bool all_reached(uint64_t phase) {
    for (int r = 0; r < world_size_; ++r)
      if (r != rank_ && info(r).direct_phase.load(std::memory_order_acquire) < phase) return false;
    return true;
  }
  // A collective's slot from some peer: that peer runs the ring where this rank runs the
  // direct all-reduce (their tensors differ in being collective buffers). -1: none.
  int peer_in_ring(const SlotHeader** header) {
    for (int r = 0; r < world_size_; ++r) {
      if (r == rank_) continue;
      const SlotHeader* h = try_peek(r);
      if (h != nullptr && h->envelope.kind != Kind::Send) {
        *header = h;
        return r;
      }
    }
    return -1;
  }

  // This rank's doorbell count: read it before looking for progress, then doze(count) sleeps
  // only if nobody rang since (send/recv progress).
  uint32_t rings() { return info(rank_).bell.rings.load(); }
  // peer: the rank whose progress is awaited, watched for liveness (not every rank: one that
  // has finished its part may have exited already).
  void doze(uint32_t since, int peer, Clock::time_point deadline, const std::string& what) {
    wait_until([&] { return info(rank_).bell.rings.load() != since; }, peer, deadline, what);
  }

  // Marks the group aborted with why (the first reason wins) and wakes every rank. lost_rank:
  // the dead rank that is the reason, or -1.
  void mark_aborted(const std::string& why, int lost_rank = -1) {
    uint32_t expected = 0;
    if (header_->abort_state.compare_exchange_strong(expected, 1)) {
      std::snprintf(header_->abort_message, kAbortMessageBytes, "%s", why.c_str());
      header_->abort_rank = rank_;
      header_->abort_lost_rank = lost_rank;
      header_->abort_state.store(2);
      for (int r = 0; r < world_size_; ++r)
        if (r != rank_) ring(r, /*always_wake=*/true);
    }
  }
  [[noreturn]] void abort(const std::string& why, int lost_rank = -1) {
    mark_aborted(why, lost_rank);
    NANODDP_THROW(DistError, why);
  }

  void check_abort(const std::string& what) {
    if (header_->abort_state.load(std::memory_order_acquire) == 0) return;
    while (header_->abort_state.load() != 2) cpu_relax();  // the message is being written
    // Said before the throw, as Note [Launcher link] needs: this rank fails by that loss too.
    if (header_->abort_lost_rank >= 0) report_lost_peer(rank_, header_->abort_lost_rank);
    NANODDP_THROW(DistError, what, ": the group was aborted by rank ", header_->abort_rank, ": ",
                  header_->abort_message);
  }

  bool peers_alive(int peer) {
    for (int r = peer < 0 ? 0 : peer; r < (peer < 0 ? world_size_ : peer + 1); ++r)
      if (r != rank_ && watch_pids_ && !process_alive(info(r).pid)) return false;
    return true;
  }

  void check_alive(int peer, const std::string& what) {
    for (int r = peer < 0 ? 0 : peer; r < (peer < 0 ? world_size_ : peer + 1); ++r) {
      if (r == rank_ || !watch_pids_ || process_alive(info(r).pid)) continue;
      report_lost_peer(rank_, r);  // before the throw: Note [Launcher link]
      abort(what + ": rank " + std::to_string(r) + " (pid " + std::to_string(info(r).pid) +
            ") exited in the middle of the job", r);
    }
  }

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }

  // The timeout the running wait() was given, for messages.
  std::chrono::milliseconds wait_timeout{0};

 private:
  void map(int fd, const std::string& name, const std::string& where);
  void ring(int r, bool always_wake = false) {
    Doorbell& bell = info(r).bell;
    bell.rings.fetch_add(1);
    if (always_wake || bell.sleepers.load() > 0) futex(&bell.rings, FUTEX_WAKE, INT32_MAX, nullptr);
  }

  RankInfo& info(int r) { return reinterpret_cast<RankInfo*>(base_ + layout_.ranks)[r]; }
  Channel& channel(int src, int dst) {
    return reinterpret_cast<Channel*>(base_ + layout_.channels)[src * world_size_ + dst];
  }
  uint8_t* slot(int src, int dst, uint32_t index) {
    const size_t n = (static_cast<size_t>(src) * world_size_ + dst) * kSlotsPerChannel + index;
    return base_ + layout_.slots + n * kSlotStride;
  }

  int rank_;
  int world_size_;
  Layout layout_;
  uint8_t* base_ = nullptr;
  Header* header_ = nullptr;
  bool watch_pids_ = true;
};

ShmSegment::ShmSegment(Store& store, const std::string& prefix, int rank, int world_size,
                       std::chrono::milliseconds timeout)
    : rank_(rank), world_size_(world_size), layout_(world_size) {
  const std::string where = detail::where(rank, world_size) + ": shm";
  const std::string machine = boot_id() + " " + detail::host_name();
  std::string name;
  detail::Fd fd;
  if (rank == 0) {
    // Step 1 (Note [Shm segment]).
    remove_stale_segments();
    name = new_segment_name();
    fd = detail::Fd(::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600));
    NANODDP_CHECK(fd.valid(), DistError, where, ": shm_open(", name, ") failed: ", detail::errno_text(errno));
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
                  " bytes failed: ", failure);
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

// ---- element-wise reductions -------------------------------------------------------------

// out[i] = out[i] (op) in[i]. Max and Min propagate NaN (as torch.maximum/minimum and
// PyTorch's reductions do): a NaN on any rank makes the result NaN.
template <typename T, ReduceOp Op>
void reduce_into(void* out_bytes, const void* in_bytes, int64_t n) {
  T* __restrict out = static_cast<T*>(out_bytes);
  const T* __restrict in = static_cast<const T*>(in_bytes);
  for (int64_t i = 0; i < n; ++i) {
    const T a = out[i], b = in[i];
    if constexpr (Op == ReduceOp::Sum || Op == ReduceOp::Avg) {
      out[i] = a + b;
    } else if constexpr (Op == ReduceOp::Max) {
      out[i] = (a > b || a != a) ? a : b;  // a != a: a is NaN
    } else {
      out[i] = (a < b || a != a) ? a : b;
    }
  }
}

using ReduceFn = void (*)(void*, const void*, int64_t);

template <typename T>
ReduceFn reduce_fn(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg:
      return reduce_into<T, ReduceOp::Sum>;  // Avg divides at the end
    case ReduceOp::Max:
      return reduce_into<T, ReduceOp::Max>;
    case ReduceOp::Min:
      return reduce_into<T, ReduceOp::Min>;
  }
  return nullptr;
}

// Float16 / BFloat16 (Sum only: ProcessGroup::check_reduce): widen to float32, add, round
// back to nearest even, as Gloo's and NCCL's half sums do.
template <typename T>
void sum_16bit_into(void* out_bytes, const void* in_bytes, int64_t n) {
  T* __restrict out = static_cast<T*>(out_bytes);
  const T* __restrict in = static_cast<const T*>(in_bytes);
  if constexpr (std::is_same_v<T, Float16>) {
    float16_add(out, out, in, n);  // F16C where the CPU has it (core/half_convert.h)
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = T::from_float(out[i].to_float() + in[i].to_float());
  }
}

ReduceFn reduce_fn(DType dtype, ReduceOp op) {
  switch (dtype) {
    case DType::Float32: return reduce_fn<float>(op);
    case DType::Float16: return sum_16bit_into<Float16>;
    case DType::BFloat16: return sum_16bit_into<BFloat16>;
    default: return reduce_fn<int64_t>(op);
  }
}

void divide(Tensor& tensor, int world_size) {
  float* p = tensor.data<float>();
  const float w = static_cast<float>(world_size);
  for (int64_t i = 0; i < tensor.numel(); ++i) p[i] /= w;  // division: exact when representable
}

uint8_t* bytes_of(const Tensor& t) { return static_cast<uint8_t*>(t.impl()->storage->data()); }

// ---- the ring ------------------------------------------------------------------------------
//
// N ranks in a ring, each sending to its right neighbour r+1 and receiving from its left r-1.
// The buffer is cut into N parts; part p may be shorter at the end. Every "step" moves one part
// per rank, in pieces of at most kSlotBytes, so the ring is a pipeline: while rank r+1 reduces
// piece i, rank r already copies piece i+1 into the other slot.
//
//   reduce-scatter, N = 3 (a,b,c: the ranks' parts; step s: rank r sends part r-s-1, adds part
//   r-s-2 into its own)
//            part 0       part 1       part 2
//   rank 0   a0           a1           a2  ─┐ step 0: rank 0 sends part 2 to rank 1
//   rank 1   b0 ─┐        b1           b2 <─┘         rank 1 adds it: b2+a2
//   rank 2   c0 <┘        c1           c2
//   after step 1, rank r holds the sum over all ranks of part r:
//   rank 0 a0+b0+c0, rank 1 a1+b1+c1, rank 2 a2+b2+c2
//
//   all-gather: step s: rank r sends part r-s (complete), copies part r-s-1 from its left.
//   After N-1 steps every rank holds every complete part.
//
// Each rank sends N-1 parts in each phase: 2(N-1)/N of the buffer in all, whatever N is. That
// is the whole point of the ring: passing the whole buffer around (N-1 times the buffer per
// rank) is the mistake it avoids. tests/test_collectives_shm.cpp ("bytes") counts it.

// The N parts a ring works on: part p is numel[p] elements at data[p].
struct Parts {
  std::vector<uint8_t*> data;
  std::vector<int64_t> numel;
  size_t element_size = 4;

  // One buffer cut into N parts of ceil(numel / N) elements (the last ones shorter or empty).
  static Parts of_buffer(uint8_t* data, int64_t numel, size_t element_size, int n) {
    Parts parts;
    parts.element_size = element_size;
    const int64_t part = (numel + n - 1) / n;
    for (int p = 0; p < n; ++p) {
      const int64_t begin = std::min(numel, p * part);
      parts.data.push_back(data + begin * element_size);
      parts.numel.push_back(std::min(numel, begin + part) - begin);
    }
    return parts;
  }
  // Every step moves this many pieces (the same on every rank; pieces past a short part's end
  // are empty but still travel, which keeps the channel counters in step).
  int64_t pieces() const {
    const int64_t piece = static_cast<int64_t>(kSlotBytes / element_size);
    const int64_t largest = *std::max_element(numel.begin(), numel.end());
    return std::max<int64_t>(1, (largest + piece - 1) / piece);
  }
  // Elements [first, first + count) of piece i of part p.
  std::pair<int64_t, int64_t> piece(int p, int64_t i) const {
    const int64_t size = static_cast<int64_t>(kSlotBytes / element_size);
    const int64_t first = std::min(numel[p], i * size);
    return {first, std::min(numel[p], first + size) - first};
  }
};

int mod(int a, int n) { return ((a % n) + n) % n; }

struct Ring {
  ShmSegment& shm;
  Envelope envelope;
  Clock::time_point deadline;
  const std::string& what;

  int rank() const { return shm.rank(); }
  int n() const { return shm.world_size(); }
  int right() const { return mod(rank() + 1, n()); }
  int left() const { return mod(rank() - 1, n()); }

  // One step: send part `out` to the right, fold part `in` from the left into ours with
  // `combine` (a reduction, or a copy).
  void step(Parts& parts, int out, int in,
            const std::function<void(uint8_t*, const uint8_t*, int64_t)>& combine) {
    const size_t es = parts.element_size;
    for (int64_t i = 0; i < parts.pieces(); ++i) {
      auto [out_first, out_count] = parts.piece(out, i);
      shm.post(right(), envelope, parts.data[out] + out_first * es, out_count * es, deadline, what);
      auto [in_first, in_count] = parts.piece(in, i);
      const SlotHeader* slot = shm.receive(left(), envelope, in_count * es, deadline, what);
      combine(parts.data[in] + in_first * es, ShmSegment::payload(slot), in_count);
      shm.release(left());
    }
  }

  // Afterwards rank r holds part r reduced over all ranks: N-1 steps, (N-1)/N of the data sent.
  void reduce_scatter(Parts& parts, ReduceFn reduce) {
    for (int s = 0; s < n() - 1; ++s)
      step(parts, mod(rank() - s - 1, n()), mod(rank() - s - 2, n()),
           [reduce](uint8_t* mine, const uint8_t* theirs, int64_t count) { reduce(mine, theirs, count); });
  }

  // Starting from rank r holding part r, every rank gets every part: N-1 steps, (N-1)/N sent.
  void all_gather(Parts& parts) {
    const size_t es = parts.element_size;
    for (int s = 0; s < n() - 1; ++s)
      step(parts, mod(rank() - s, n()), mod(rank() - s - 1, n()),
           [es](uint8_t* mine, const uint8_t* theirs, int64_t count) {
             if (count > 0) std::memcpy(mine, theirs, count * es);
           });
  }

  // root's buffer travels the ring root -> root+1 -> ... -> root-1, piece by piece.
  void broadcast(uint8_t* data, int64_t numel, size_t element_size, int root) {
    Parts whole;
    whole.data = {data};
    whole.numel = {numel};
    whole.element_size = element_size;
    const int position = mod(rank() - root, n());
    for (int64_t i = 0; i < whole.pieces(); ++i) {
      auto [first, count] = whole.piece(0, i);
      uint8_t* piece = data + first * element_size;
      const size_t nbytes = count * element_size;
      if (position != 0) {
        const SlotHeader* slot = shm.receive(left(), envelope, nbytes, deadline, what);
        if (nbytes > 0) std::memcpy(piece, ShmSegment::payload(slot), nbytes);
        shm.release(left());
      }
      if (position != n() - 1) shm.post(right(), envelope, piece, nbytes, deadline, what);
    }
  }
};

// ---- collective buffers and the direct all-reduce (Note [Shm direct all-reduce]) -------------

// One collective buffer as this rank sees it: region[r] is rank r's buffer, mapped here; the
// caller's tensor wraps region[rank]. Unmapped when the last tensor on it is gone.
struct SharedBuffer {
  int64_t id = 0;
  size_t nbytes = 0;
  std::vector<uint8_t*> region;
  ~SharedBuffer() {
    for (uint8_t* r : region)
      if (r != nullptr) ::munmap(r, nbytes);
  }
};

// Every rank's buffer holds its input; afterwards every rank's holds the reduced result.
// Three rendezvous: all inputs are there; every part is reduced; every rank has copied.
void direct_all_reduce(ShmSegment& shm, const Envelope& envelope, SharedBuffer& buffer, DType dtype, ReduceOp op,
                       Clock::time_point deadline, const std::string& what) {
  const int n = shm.world_size(), rank = shm.rank();
  const uint64_t phase = 4 * envelope.seq;
  const size_t es = dtype_size(dtype);
  // Rank r owns part r, cut as the ring cuts it.
  std::vector<Parts> parts;
  for (int r = 0; r < n; ++r) parts.push_back(Parts::of_buffer(buffer.region[r], envelope.numel, es, n));

  // 1. Everyone's input is in place. A rank in the ring instead, or at another collective,
  //    is reported here, as the ring reports it at its first slot.
  shm.announce(envelope);
  shm.reach(phase + 1);
  const SlotHeader* stray = nullptr;
  int ring_peer = -1;
  shm.wait_until([&] { return shm.all_reached(phase + 1) || (ring_peer = shm.peer_in_ring(&stray)) >= 0; }, -1,
                 deadline, what);
  if (ring_peer >= 0)
    shm.abort(what + ": rank " + std::to_string(ring_peer) + " is at " + stray->envelope.str() +
              " while this rank is at " + envelope.str() +
              " (every rank must pass its collective buffer, or every rank an ordinary tensor)");
  for (int r = 0; r < n; ++r)
    if (r != rank && !(shm.announced(r) == envelope))
      shm.abort(what + ": rank " + std::to_string(r) + " is at " + shm.announced(r).str() +
                " while this rank is at " + envelope.str() +
                " (every rank must issue the same collectives in the same order, with the same dtype, size, "
                "op and root)");

  // 2. Reduce part `rank` straight from every rank's buffer, in the ring's order (so the
  //    result has the ring's bits, rounding included): the part starts at rank+1 and each
  //    next rank q folds what came before into its own values, B_q = B_q (op) B_prev. The
  //    peers' copies of this part are scratch: they are overwritten in step 3.
  const ReduceFn reduce = reduce_fn(dtype, op);
  const int64_t count = parts[rank].numel[rank];
  // What crosses between ranks: part `rank` of each peer's buffer is read (and written back
  // in place) here, and every other part is read from its owner in step 3.
  int64_t read_from_peers = (n - 1) * count;
  for (int p = 0; p < n; ++p)
    if (p != rank) read_from_peers += parts[p].numel[p];
  shm.moved_bytes.fetch_add(read_from_peers * static_cast<int64_t>(es), std::memory_order_relaxed);
  if (count > 0) {
    const uint8_t* previous = parts[(rank + 1) % n].data[rank];
    for (int j = 2; j <= n; ++j) {
      uint8_t* mine = parts[(rank + j) % n].data[rank];
      reduce(mine, previous, count);
      previous = mine;
    }
    if (op == ReduceOp::Avg) {
      float* p = reinterpret_cast<float*>(parts[rank].data[rank]);
      for (int64_t i = 0; i < count; ++i) p[i] /= static_cast<float>(n);
    }
  }
  shm.reach(phase + 2);
  shm.wait_until([&] { return shm.all_reached(phase + 2); }, -1, deadline, what);

  // 3. Copy every other part from its owner.
  for (int p = 0; p < n; ++p)
    if (p != rank && parts[p].numel[p] > 0) std::memcpy(parts[rank].data[p], parts[p].data[p], parts[p].numel[p] * es);
  // The peers read this rank's part until they pass here: only then may its owner change it.
  shm.reach(phase + 3);
  shm.wait_until([&] { return shm.all_reached(phase + 3); }, -1, deadline, what);
}

// ---- works and their progress (Note [Shm progress]) ------------------------------------------

class ShmEngine;

class ShmWork : public Work {
 public:
  // peer == kCollective: step() runs the collective to its end (blocking until the
  // deadline). Otherwise it is a send/recv with rank peer: step() moves what it can and
  // returns true once finished, never blocking.
  static constexpr int kCollective = -1;
  ShmWork(std::shared_ptr<ShmEngine> engine, std::string description, int peer,
          std::function<bool(Clock::time_point)> step)
      : engine_(std::move(engine)),
        description_(std::move(description)),
        collective_(peer == kCollective),
        peer_(peer),
        step_(std::move(step)) {}

  void wait(std::chrono::milliseconds timeout) override;
  bool is_completed() override;

 private:
  friend class ShmEngine;
  std::shared_ptr<ShmEngine> engine_;
  std::string description_;
  bool collective_;
  int peer_;
  std::function<bool(Clock::time_point)> step_;
  bool done_ = false;  // guarded by the engine's mutex
  std::exception_ptr error_;
};

class ShmEngine {
 public:
  explicit ShmEngine(std::unique_ptr<ShmSegment> segment) : segment_(std::move(segment)) {}

  ShmSegment& segment() { return *segment_; }

  std::shared_ptr<Work> issue(std::shared_ptr<ShmEngine> self, std::string description, int peer,
                              std::function<bool(Clock::time_point)> step) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failure_) {
      try {
        std::rethrow_exception(failure_);
      } catch (const std::exception& e) {
        NANODDP_THROW(DistError, description, ": the group is unusable after an earlier error: ", e.what());
      }
    }
    auto work = std::make_shared<ShmWork>(std::move(self), std::move(description), peer, std::move(step));
    pending_.push_back(work);
    return work;
  }

  // Runs pending works in issue order until `target` is done (Note [Shm progress]).
  void run_until(ShmWork& target, std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    std::lock_guard<std::mutex> lock(mutex_);
    try {
      segment_->wait_timeout = timeout;
      while (!target.done_) {
        const uint32_t rings = segment_->rings();
        bool progressed = false;
        for (auto& work : pending_) {
          if (work->done_) continue;
          if (work->collective_) {
            if (work == first_unfinished()) {
              work->step_(deadline);
              finish(*work);
              progressed = true;
            }
            break;  // nothing after a collective starts before it has finished
          }
          if (work->step_(deadline)) {
            finish(*work);
            progressed = true;
          }
        }
        while (!pending_.empty() && pending_.front()->done_) pending_.pop_front();
        if (!progressed && !target.done_) segment_->doze(rings, target.peer_, deadline, target.description_);
      }
    } catch (...) {
      // The group is out of step now: every unfinished work fails with this error.
      failure_ = std::current_exception();
      for (auto& work : pending_) {
        if (work->done_) continue;
        work->error_ = failure_;
        finish(*work);
      }
      pending_.clear();
    }
  }

  bool done(const ShmWork& work) {
    std::lock_guard<std::mutex> lock(mutex_);
    return work.done_;
  }

 private:
  std::shared_ptr<ShmWork> first_unfinished() {
    for (auto& work : pending_)
      if (!work->done_) return work;
    return nullptr;
  }
  static void finish(ShmWork& work) {
    work.done_ = true;
    work.step_ = nullptr;  // lets go of the tensors
  }

  std::unique_ptr<ShmSegment> segment_;
  std::mutex mutex_;
  std::deque<std::shared_ptr<ShmWork>> pending_;
  std::exception_ptr failure_;
};

void ShmWork::wait(std::chrono::milliseconds timeout) {
  if (!engine_->done(*this)) engine_->run_until(*this, timeout);
  // This work's own error, or the earlier one that left the group out of step.
  if (error_) std::rethrow_exception(error_);
}

bool ShmWork::is_completed() { return engine_->done(*this); }

// ---- the group ---------------------------------------------------------------------------

std::atomic<int> next_group_id{0};

class ProcessGroupShm : public ProcessGroup {
 public:
  ProcessGroupShm(std::shared_ptr<Store> store, const ShmOptions& options)
      : ProcessGroup(options.rank, options.world_size),
        store_(std::move(store)),
        timeout_(options.timeout),
        sent_messages_(static_cast<size_t>(options.world_size), 0),
        received_messages_(static_cast<size_t>(options.world_size), 0) {
    // Groups are built in the same order on every rank, so the counter names the same group.
    prefix_ = !options.store_prefix.empty() ? options.store_prefix
                                            : "shm/" + std::to_string(next_group_id++) + "/";
    if (world_size_ > 1)
      engine_ = std::make_shared<ShmEngine>(
          std::make_unique<ShmSegment>(*store_, prefix_, rank_, world_size_, options.timeout));
  }

  std::string backend_name() const override { return "shm"; }
  bool collectives_run_in_wait() const override { return true; }
  MovedBytes moved_bytes() const override {
    MovedBytes moved;
    moved.measured = true;
    moved.bytes = engine_ != nullptr ? engine_->segment().moved_bytes.load(std::memory_order_relaxed) : 0;
    moved.all_reduces_by_algorithm = {{"ring", ring_all_reduces_.load(std::memory_order_relaxed)},
                                      {"direct", direct_all_reduces_.load(std::memory_order_relaxed)}};
    return moved;
  }
  Store& store() override { return *store_; }

  std::shared_ptr<Work> all_reduce(Tensor& tensor, ReduceOp op) override {
    std::string name = std::string("all_reduce(") + reduce_op_name(op) + ")";
    check_tensor(name, tensor, Device::cpu());
    check_reduce(name, tensor, op);
    if (world_size_ == 1 || tensor.numel() == 0) return std::make_shared<CompletedWork>();
    Envelope envelope = next_envelope(Kind::AllReduce, tensor, op, 0);
    if (auto buffer = shared_buffer_of(tensor)) {
      direct_all_reduces_.fetch_add(1, std::memory_order_relaxed);
      envelope.buffer = buffer->id;
      return collective(describe(name, tensor), [tensor, buffer, op, envelope](Ring& ring) {
        direct_all_reduce(ring.shm, envelope, *buffer, tensor.dtype(), op, ring.deadline, ring.what);
      });
    }
    ring_all_reduces_.fetch_add(1, std::memory_order_relaxed);
    return collective(describe(name, tensor), [tensor, op, envelope](Ring& ring) mutable {
      ring.envelope = envelope;
      // Reduce-scatter then all-gather, in place: each rank sends 2(N-1)/N of the buffer.
      Parts parts = Parts::of_buffer(bytes_of(tensor), tensor.numel(), dtype_size(tensor.dtype()), ring.n());
      ring.reduce_scatter(parts, reduce_fn(tensor.dtype(), op));
      ring.all_gather(parts);
      if (op == ReduceOp::Avg) divide(tensor, ring.n());
    });
  }

  // Note [Shm direct all-reduce]: each rank makes its buffer a named segment, publishes the
  // name through the store and maps every peer's; once all are mapped the names go, as in
  // Note [Shm segment], so no exit path leaves one behind.
  Tensor new_collective_buffer(int64_t numel, DType dtype, Device device) override {
    if (world_size_ == 1 || device != Device::cpu() || numel <= 0)
      return ProcessGroup::new_collective_buffer(numel, dtype, device);
    const int64_t id = next_buffer_id_++;
    const size_t nbytes = static_cast<size_t>(numel) * dtype_size(dtype);
    const std::string what = where() + ": shm collective buffer #" + std::to_string(id) + " of " +
                             std::to_string(numel) + " " + dtype_name(dtype);
    const std::string key = prefix_ + "buffer/" + std::to_string(id) + "/";
    auto buffer = std::make_shared<SharedBuffer>();
    buffer->id = id;
    buffer->nbytes = nbytes;
    buffer->region.assign(static_cast<size_t>(world_size_), nullptr);

    const std::string name = new_segment_name();
    detail::Fd fd(::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600));
    NANODDP_CHECK(fd.valid(), DistError, what, ": shm_open(", name, ") failed: ", detail::errno_text(errno));
    struct Unlinker {
      const std::string& name;
      ~Unlinker() { ::shm_unlink(name.c_str()); }
    } unlinker{name};
    const std::string failure = segment_sizing_failure(fd.get(), nbytes);
    NANODDP_CHECK(failure.empty(), DistError, what, ": sizing ", name, " to ", nbytes, " bytes failed: ", failure);
    buffer->region[rank_] = map_region(fd.get(), nbytes, name, what);
    store_->set(key + std::to_string(rank_), name + "\n" + std::to_string(nbytes));

    std::vector<std::string> published;
    for (int r = 0; r < world_size_; ++r)
      if (r != rank_) published.push_back(key + std::to_string(r));
    store_->wait(published, timeout_);
    std::vector<std::string> names(static_cast<size_t>(world_size_));
    std::string mismatch;
    for (int r = 0; r < world_size_; ++r) {
      if (r == rank_) continue;
      const std::string entry = store_->get_string(key + std::to_string(r));
      const size_t newline = entry.find('\n');
      names[r] = entry.substr(0, newline);
      const size_t their_bytes = newline == std::string::npos ? 0 : std::stoull(entry.substr(newline + 1));
      if (their_bytes != nbytes && mismatch.empty())
        mismatch = "rank " + std::to_string(r) + " made its buffer #" + std::to_string(id) + " " +
                   std::to_string(their_bytes) + " bytes, this rank " + std::to_string(nbytes);
    }
    // Every rank has read every entry before any throws: each gets the message, not a store
    // that went away with a rank that threw first.
    arrive_and_wait(*store_, key + "read/", rank_, world_size_, timeout_);
    NANODDP_CHECK(mismatch.empty(), DistError, what, ": ", mismatch,
                  " (every rank must make the same collective buffers, in the same order)");
    for (int r = 0; r < world_size_; ++r) {
      if (r == rank_) continue;
      detail::Fd peer(::shm_open(names[r].c_str(), O_RDWR, 0600));
      NANODDP_CHECK(peer.valid(), DistError, what, ": shm_open(", names[r], ") published by rank ", r,
                    " failed: ", detail::errno_text(errno));
      buffer->region[r] = map_region(peer.get(), nbytes, names[r], what);
    }
    arrive_and_wait(*store_, key + "mapped/", rank_, world_size_, timeout_);

    {
      std::lock_guard<std::mutex> lock(buffers_mutex_);
      for (auto it = buffers_.begin(); it != buffers_.end();) it = it->second.expired() ? buffers_.erase(it) : ++it;
      buffers_[buffer->region[rank_]] = buffer;
    }
    auto impl = std::make_shared<TensorImpl>();
    impl->storage = std::make_shared<Storage>(buffer->region[rank_], nbytes, Device::cpu(),
                                              [buffer](void*) mutable { buffer.reset(); });
    impl->shape = Shape{numel};
    impl->dtype = dtype;
    return Tensor(std::move(impl));
  }

  std::shared_ptr<Work> broadcast(Tensor& tensor, int root) override {
    check_tensor("broadcast", tensor, Device::cpu());
    NANODDP_CHECK(root >= 0 && root < world_size_, ValueError, describe("broadcast", tensor), ": root ", root,
                  " is not a rank of this group");
    if (world_size_ == 1 || tensor.numel() == 0) return std::make_shared<CompletedWork>();
    Envelope envelope = next_envelope(Kind::Broadcast, tensor, ReduceOp::Sum, root);
    return collective(describe("broadcast from rank " + std::to_string(root), tensor),
                      [tensor, root, envelope](Ring& ring) {
                        ring.envelope = envelope;
                        ring.broadcast(bytes_of(tensor), tensor.numel(), dtype_size(tensor.dtype()), root);
                      });
  }

  std::shared_ptr<Work> all_gather(std::vector<Tensor>& outputs, const Tensor& input) override {
    check_tensor("all_gather", input, Device::cpu());
    check_list("all_gather", outputs, input);
    std::vector<Tensor> outs = outputs;
    if (world_size_ == 1 || input.numel() == 0) {
      outs[rank_].copy_(input);
      return std::make_shared<CompletedWork>();
    }
    Envelope envelope = next_envelope(Kind::AllGather, input, ReduceOp::Sum, 0);
    return collective(describe("all_gather", input), [outs, input, envelope](Ring& ring) {
      ring.envelope = envelope;
      Parts parts;
      parts.element_size = dtype_size(input.dtype());
      for (const Tensor& t : outs) {
        parts.data.push_back(bytes_of(t));
        parts.numel.push_back(input.numel());
      }
      std::memcpy(parts.data[ring.rank()], bytes_of(input), input.nbytes());
      ring.all_gather(parts);
    });
  }

  std::shared_ptr<Work> reduce_scatter(Tensor& output, const std::vector<Tensor>& inputs,
                                       ReduceOp op) override {
    std::string name = std::string("reduce_scatter(") + reduce_op_name(op) + ")";
    check_tensor(name, output, Device::cpu());
    check_reduce(name, output, op);
    check_list(name, inputs, output);
    if (world_size_ == 1 || output.numel() == 0) {
      output.copy_(inputs[0]);
      return std::make_shared<CompletedWork>();
    }
    Envelope envelope = next_envelope(Kind::ReduceScatter, output, op, 0);
    // The ring reduces in place, and inputs are the caller's: reduce a copy of them.
    Tensor flat = Tensor::empty({output.numel() * world_size_}, output.dtype());
    const size_t nbytes = output.nbytes();
    for (int r = 0; r < world_size_; ++r)
      std::memcpy(bytes_of(flat) + r * nbytes, bytes_of(inputs[r]), nbytes);
    return collective(describe(name, output), [flat, output, op, nbytes, envelope](Ring& ring) mutable {
      ring.envelope = envelope;
      Parts parts = Parts::of_buffer(bytes_of(flat), flat.numel(), dtype_size(flat.dtype()), ring.n());
      ring.reduce_scatter(parts, reduce_fn(flat.dtype(), op));
      std::memcpy(bytes_of(output), parts.data[ring.rank()], nbytes);
      if (op == ReduceOp::Avg) divide(output, ring.n());
    });
  }

  std::shared_ptr<Work> barrier() override {
    if (world_size_ == 1) return std::make_shared<CompletedWork>();
    // A one-element all-reduce: along the ring every rank hears, transitively, from all.
    Tensor token = Tensor::zeros({1}, DType::Int64);
    Envelope envelope = next_envelope(Kind::Barrier, token, ReduceOp::Sum, 0);
    return collective(where() + ": shm barrier", [token, envelope](Ring& ring) {
      ring.envelope = envelope;
      Parts parts = Parts::of_buffer(bytes_of(token), 1, sizeof(int64_t), ring.n());
      ring.reduce_scatter(parts, reduce_fn(DType::Int64, ReduceOp::Sum));
      ring.all_gather(parts);
    });
  }

  std::shared_ptr<Work> send(const Tensor& tensor, int dst, int tag) override {
    check_peer("send", tensor, dst, "destination");
    Envelope envelope{sent_messages_[dst]++, Kind::Send, static_cast<int32_t>(tensor.dtype()), 0, tag,
                      tensor.numel()};
    auto pieces = std::make_shared<int64_t>(0);
    ShmSegment& shm = engine_->segment();
    return engine_->issue(engine_, describe("send to rank " + std::to_string(dst), tensor), dst,
                          [&shm, tensor, dst, envelope, pieces](Clock::time_point) {
                            return piecewise(tensor, *pieces, [&](uint8_t* data, size_t nbytes) {
                              return shm.try_post(dst, envelope, data, nbytes);
                            });
                          });
  }

  std::shared_ptr<Work> recv(Tensor& tensor, int src, int tag) override {
    check_peer("recv", tensor, src, "source");
    Envelope envelope{
        received_messages_[src]++, Kind::Send, static_cast<int32_t>(tensor.dtype()), 0, tag, tensor.numel()};
    auto pieces = std::make_shared<int64_t>(0);
    ShmSegment& shm = engine_->segment();
    std::string what = describe("recv from rank " + std::to_string(src), tensor);
    return engine_->issue(engine_, what, src, [&shm, tensor, src, envelope, pieces, what](Clock::time_point) {
      return piecewise(tensor, *pieces, [&](uint8_t* data, size_t nbytes) {
        const SlotHeader* slot = shm.try_peek(src);
        if (slot == nullptr) return false;
        shm.check_envelope(src, *slot, envelope, nbytes, what);
        if (nbytes > 0) std::memcpy(data, ShmSegment::payload(slot), nbytes);
        shm.release(src);
        return true;
      });
    });
  }

 private:
  // Moves the pieces of tensor from *done on while move(piece, nbytes) succeeds; true when all
  // have moved. An empty tensor still moves one empty piece (its envelope is checked).
  template <typename Move>
  static bool piecewise(const Tensor& tensor, int64_t& done, Move&& move) {
    const int64_t total =
        std::max<int64_t>(1, (static_cast<int64_t>(tensor.nbytes()) + kSlotBytes - 1) / kSlotBytes);
    while (done < total) {
      const size_t first = static_cast<size_t>(done) * kSlotBytes;
      const size_t nbytes = std::min(kSlotBytes, tensor.nbytes() - first);
      if (!move(bytes_of(tensor) + first, nbytes)) return false;
      ++done;
    }
    return true;
  }

  void check_peer(const std::string& name, const Tensor& tensor, int peer, const char* role) const {
    check_tensor(name, tensor, Device::cpu());
    NANODDP_CHECK(peer >= 0 && peer < world_size_ && peer != rank_, ValueError, describe(name, tensor), ": ",
                  role, " rank ", peer, " must be another rank of this group (0..", world_size_ - 1, ", not ",
                  rank_, ")");
  }

  // The collective buffer that tensor is, whole; null for any other tensor.
  std::shared_ptr<SharedBuffer> shared_buffer_of(const Tensor& tensor) {
    std::lock_guard<std::mutex> lock(buffers_mutex_);
    auto it = buffers_.find(bytes_of(tensor));
    if (it == buffers_.end()) return nullptr;
    auto buffer = it->second.lock();
    return buffer != nullptr && buffer->nbytes == tensor.nbytes() ? buffer : nullptr;
  }

  Envelope next_envelope(Kind kind, const Tensor& tensor, ReduceOp op, int root) {
    return Envelope{collective_seq_++,        kind, static_cast<int32_t>(tensor.dtype()),
                    static_cast<int32_t>(op), root, tensor.numel(), -1};
  }

  std::shared_ptr<Work> collective(std::string description, std::function<void(Ring&)> body) {
    ShmSegment& shm = engine_->segment();
    auto what = std::make_shared<std::string>(description);
    return engine_->issue(engine_, std::move(description), ShmWork::kCollective,
                          [&shm, body = std::move(body), what](Clock::time_point deadline) {
                            Ring ring{shm, Envelope{}, deadline, *what};
                            body(ring);
                            return true;
                          });
  }

  std::shared_ptr<Store> store_;
  std::string prefix_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<ShmEngine> engine_;
  std::atomic<int64_t> ring_all_reduces_{0}, direct_all_reduces_{0};
  uint64_t collective_seq_ = 0;
  int64_t next_buffer_id_ = 0;
  std::mutex buffers_mutex_;
  std::map<const uint8_t*, std::weak_ptr<SharedBuffer>> buffers_;  // by region[rank]
  std::vector<uint64_t> sent_messages_;
  std::vector<uint64_t> received_messages_;
};

}  // namespace

std::shared_ptr<ProcessGroup> make_shm_process_group(std::shared_ptr<Store> store,
                                                     const ShmOptions& options) {
  NANODDP_CHECK(store != nullptr || options.world_size == 1, ValueError, "make_shm_process_group: no store");
  return std::make_shared<ProcessGroupShm>(std::move(store), options);
}

}  // namespace nanoddp::dist
