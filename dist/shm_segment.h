// The shared-memory group's segment as its other files see it: the layout, the Envelope every
// slot carries, and ShmSegment, the mapped segment with the waiting, posting and reading that
// every collective is built from. Internal: not a public header.
//
//   ShmSegment shm(store, "shm/0/", rank, world_size, timeout);
//   shm.post(right, envelope, data, nbytes, deadline, what);       // into the next slot to the right
//   const SlotHeader* slot = shm.receive(left, envelope, nbytes, deadline, what);  // then release(left)
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
// The segment is made through the store, in numbered steps (ShmSegment's constructor, in
// shm_segment.cpp):
//   1. Rank 0 removes segments left by jobs whose rank 0 died (the name holds its pid), then
//      creates "/nanoddp.<pid>.<group>", sized and zeroed, and publishes the name with this
//      machine's boot id.
//   2. Every other rank reads the name, checks the boot id (the backend needs one machine),
//      maps the segment and writes its pid into its RankInfo.
//   3. Every rank sets "mapped/<rank>" and waits for all of them; rank 0 then unlinks the name.
// From step 3 on, the segment has no name: the kernel frees it when the last rank unmaps it
// or dies, so no exit path, however abrupt, leaves it behind in /dev/shm.
#pragma once

#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dist/store.h"

namespace nanoddp::dist::shm {

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

const char* kind_name(Kind kind);

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
  std::string str() const;
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
  // How many collectives this rank has begun (the running one's seq + 1): a wait that times
  // out names the ranks behind it, not only the neighbour it waited on (Note [Shm waiting]).
  alignas(64) std::atomic<uint64_t> collectives_begun{0};
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
  // The abort began as a timeout: every rank that fails on it throws TimeoutError, so that
  // the collective check can name the rank that never came (Note [Naming the straggler]).
  int32_t abort_timed_out = 0;
  char abort_message[kAbortMessageBytes] = {};
};

inline size_t align_up(size_t n) { return (n + 63) / 64 * 64; }

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

// ---- making segments (shm_segment.cpp) ----

// Sizes a new segment; "" on success, else why not.
std::string segment_sizing_failure(int fd, size_t bytes);
// Whether this process could make a segment of nbytes now (/dev/shm is there and writable,
// `ulimit -f` allows the size); makes one and removes it at once.
bool segment_possible(size_t nbytes);
// This machine as the ranks compare it: its boot id and host name (containers on one
// machine share the boot id; two machines never do).
std::string machine_id();
// False once pid has exited, even while it is an unreaped zombie (a launcher may keep
// exited ranks as zombies until the job ends).
bool process_alive(int pid);
// "/nanoddp.<pid>.<n>": unique on this machine while this process lives, and recognisable by
// remove_stale_segments once it is gone.
std::string new_segment_name();
// Maps nbytes of the shared-memory object fd (named name, for messages) read-write.
uint8_t* map_region(int fd, size_t nbytes, const std::string& name, const std::string& what);
// Sets "<key><rank>" and waits until every rank has set its own.
void arrive_and_wait(Store& store, const std::string& key, int rank, int world_size,
                     std::chrono::milliseconds timeout);

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

// Makes collective buffer #id of nbytes on every rank and maps every rank's into this one
// (Note [Shm direct all-reduce]), meeting under the store keys that start with key. what
// opens every error. Collective; throws DistError when ranks ask for different sizes.
std::shared_ptr<SharedBuffer> map_shared_buffer(Store& store, const std::string& key, int64_t id,
                                                size_t nbytes, int rank, int world_size,
                                                std::chrono::milliseconds timeout, const std::string& what);

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

  // ---- posting and reading one slot of a channel (Note [Shm segment]; shm_slots.cpp) ----
  // Fills the next slot of channel (rank, dst); false when both are still unread.
  bool try_post(int dst, const Envelope& envelope, const void* data, size_t nbytes);
  // The oldest unread slot of channel (src, rank), or nullptr when there is none.
  const SlotHeader* try_peek(int src);
  static const uint8_t* payload(const SlotHeader* header) {
    return reinterpret_cast<const uint8_t*>(header) + kSlotHeaderBytes;
  }
  // Hands the slot try_peek returned back to src.
  void release(int src);

  // Blocking forms for the collectives: wait (Note [Shm waiting]) for a free slot / a slot.
  void post(int dst, const Envelope& envelope, const void* data, size_t nbytes, Clock::time_point deadline,
            const std::string& what);
  // Waits for the next slot from src and checks that it belongs to `expected` and holds nbytes.
  const SlotHeader* receive(int src, const Envelope& expected, size_t nbytes, Clock::time_point deadline,
                            const std::string& what);
  void check_envelope(int src, const SlotHeader& header, const Envelope& expected, size_t nbytes,
                      const std::string& what);

  // Spins, then sleeps on this rank's doorbell, until ready() is true. `peer` is the rank
  // being waited for (-1: any), checked for liveness. Throws TimeoutError after deadline and
  // DistError when the group was aborted or the peer died. Defined in shm_wait.h.
  template <typename Ready>
  void wait_until(Ready&& ready, int peer, Clock::time_point deadline, const std::string& what);

  // ---- the direct all-reduce's rendezvous (Note [Shm direct all-reduce]; shm_slots.cpp) ----
  void announce(const Envelope& envelope) { info(rank_).direct_envelope = envelope; }
  const Envelope& announced(int r) { return info(r).direct_envelope; }
  // Publishes that this rank reached `phase` and rings every peer.
  void reach(uint64_t phase);
  bool all_reached(uint64_t phase);
  // A collective's slot from some peer: that peer runs the ring where this rank runs the
  // direct all-reduce (their tensors differ in being collective buffers). -1: none.
  int peer_in_ring(const SlotHeader** header);

  // ---- doorbells, the abort flag and the peers' liveness (shm_wait.cpp) ----
  // This rank's doorbell count: read it before looking for progress, then doze(count) sleeps
  // only if nobody rang since (send/recv progress).
  uint32_t rings() { return info(rank_).bell.rings.load(); }
  // peer: the rank whose progress is awaited, watched for liveness (not every rank: one that
  // has finished its part may have exited already).
  void doze(uint32_t since, int peer, Clock::time_point deadline, const std::string& what);

  // Marks the group aborted with why (the first reason wins) and wakes every rank. lost_rank:
  // the dead rank that is the reason, or -1; timed_out: the reason is a wait that timed out.
  void mark_aborted(const std::string& why, int lost_rank = -1, bool timed_out = false);
  [[noreturn]] void abort(const std::string& why, int lost_rank = -1);
  void check_abort(const std::string& what);
  bool peers_alive(int peer);
  void check_alive(int peer, const std::string& what);

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }

  // Brackets a collective's run (seq: its Envelope::seq), so that a wait inside it that times
  // out can say which ranks have not begun it (behind_note).
  void begin_collective(uint64_t seq);
  void end_collective() { in_collective_ = false; }
  // Inside a collective whose wait for peer (-1: any) timed out: "; rank 1 has not begun it"
  // (or "ranks 1 and 3 have ..."), unless that is peer alone; else "".
  std::string behind_note(int peer);

  // The timeout the running wait() was given, for messages.
  std::chrono::milliseconds wait_timeout{0};

 private:
  void map(int fd, const std::string& name, const std::string& where);
  void ring(int r, bool always_wake = false);

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
  bool in_collective_ = false;
};

}  // namespace nanoddp::dist::shm
