// The shared-memory group's slot rings (Note [Shm segment] in shm_segment.h): posting a piece
// into channel (rank, dst), reading it at the other end, checking its Envelope, and the flags
// the direct all-reduce meets at (Note [Shm direct all-reduce] in ring_shm.cpp).
#include <cstring>
#include <sstream>

#include "dist/process_group.h"
#include "dist/shm_wait.h"

namespace nanoddp::dist::shm {

const char* kind_name(Kind kind) {
  switch (kind) {
    case Kind::AllReduce: return "all_reduce";
    case Kind::Broadcast: return "broadcast";
    case Kind::AllGather: return "all_gather";
    case Kind::ReduceScatter: return "reduce_scatter";
    case Kind::Barrier: return "barrier";
    case Kind::Send: return "send/recv";
  }
  return "?";
}

std::string Envelope::str() const {
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

// ---- posting and reading one slot of a channel -------------------------------------------

bool ShmSegment::try_post(int dst, const Envelope& envelope, const void* data, size_t nbytes) {
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

const SlotHeader* ShmSegment::try_peek(int src) {
  Channel& c = channel(src, rank_);
  const uint32_t consumed = c.consumed.load(std::memory_order_relaxed);
  if (c.posted.load(std::memory_order_acquire) == consumed) return nullptr;
  return reinterpret_cast<const SlotHeader*>(slot(src, rank_, consumed % kSlotsPerChannel));
}

void ShmSegment::release(int src) {
  Channel& c = channel(src, rank_);
  c.consumed.store(c.consumed.load(std::memory_order_relaxed) + 1, std::memory_order_release);
  ring(src);
}

void ShmSegment::post(int dst, const Envelope& envelope, const void* data, size_t nbytes,
                      Clock::time_point deadline, const std::string& what) {
  wait_until([&] { return try_post(dst, envelope, data, nbytes); }, dst, deadline, what);
}

const SlotHeader* ShmSegment::receive(int src, const Envelope& expected, size_t nbytes,
                                      Clock::time_point deadline, const std::string& what) {
  const SlotHeader* header = nullptr;
  wait_until([&] { return (header = try_peek(src)) != nullptr; }, src, deadline, what);
  check_envelope(src, *header, expected, nbytes, what);
  return header;
}

void ShmSegment::check_envelope(int src, const SlotHeader& header, const Envelope& expected, size_t nbytes,
                                const std::string& what) {
  if (header.envelope == expected && header.nbytes == nbytes) return;
  const bool point_to_point = header.envelope.kind == Kind::Send || expected.kind == Kind::Send;
  abort(
      what + ": rank " + std::to_string(src) + " is at " + header.envelope.str() + " while this rank is at " +
      expected.str() +
      (point_to_point
           ? " (on shm, the sends and recvs between two ranks go through the channel their collectives use, "
             "in order: a message sent before a collective is received before it, and messages are received "
             "in the order sent, whatever their tags; Gloo and MPI have no such order)"
           : " (every rank must issue the same collectives in the same order, with the same dtype, size, op "
             "and "
             "root)"));
}

// ---- the direct all-reduce's rendezvous ----------------------------------------------------

void ShmSegment::reach(uint64_t phase) {
  info(rank_).direct_phase.store(phase, std::memory_order_release);
  for (int r = 0; r < world_size_; ++r)
    if (r != rank_) ring(r);
}

bool ShmSegment::all_reached(uint64_t phase) {
  for (int r = 0; r < world_size_; ++r)
    if (r != rank_ && info(r).direct_phase.load(std::memory_order_acquire) < phase) return false;
  return true;
}

int ShmSegment::peer_in_ring(const SlotHeader** header) {
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

}  // namespace nanoddp::dist::shm
