// The shared-memory group's algorithms, as process_group_shm.cpp calls them: the ring
// (all-reduce, reduce-scatter, all-gather, broadcast over the segment's slots) and the direct
// in-place all-reduce of a collective buffer. Their text is in ring_shm.cpp. Internal: not a
// public header.
//
//   Ring ring{shm, envelope, deadline, what};
//   ring.all_reduce(tensor, ReduceOp::Sum);                // reduce-scatter, then all-gather
//   direct_all_reduce(shm, envelope, *buffer, dtype, op, deadline, what);
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "dist/detail.h"
#include "dist/process_group.h"
#include "dist/shm_segment.h"

namespace nanoddp::dist::shm {

// out[i] = a[i] (op) b[i] for n elements of one dtype; out may be a (in place).
using ReduceFn = void (*)(void* out, const void* a, const void* b, int64_t n);
// The element-wise reduction for dtype and op (Avg sums; the caller divides at the end).
ReduceFn reduce_fn(DType dtype, ReduceOp op);

using detail::bytes_of;

// The N parts a ring works on: part p is numel[p] elements at data[p].
struct Parts {
  std::vector<uint8_t*> data;
  std::vector<int64_t> numel;
  size_t element_size = 4;

  // One buffer cut into N parts of ceil(numel / N) elements (the last ones shorter or empty).
  static Parts of_buffer(uint8_t* data, int64_t numel, size_t element_size, int n);
  // One part per tensor, in order (all_gather's outputs, reduce_scatter's inputs): tensors of
  // one shape and dtype, as ProcessGroup::check_list makes sure.
  static Parts of_tensors(const std::vector<Tensor>& tensors);
  // Every step moves this many pieces (the same on every rank; pieces past a short part's end
  // are empty but still travel, which keeps the channel counters in step).
  int64_t pieces() const;
  // Elements [first, first + count) of piece i of part p.
  std::pair<int64_t, int64_t> piece(int p, int64_t i) const;
};

// One collective's run of the ring on this rank: its envelope, its deadline, and `what`, the
// text every error opens with.
struct Ring {
  ShmSegment& shm;
  Envelope envelope;
  Clock::time_point deadline;
  const std::string& what;

  int rank() const { return shm.rank(); }
  int n() const { return shm.world_size(); }
  int right() const;
  int left() const;

  // Afterwards rank r holds part r reduced over all ranks: N-1 steps, (N-1)/N of the data sent.
  void reduce_scatter(Parts& parts, ReduceFn reduce);
  // The same sums, out of place: inputs (this rank's N parts) are only read, and part r's
  // result goes to output. The running sums that travel the ring need one part of scratch
  // (N > 2), not a copy of the whole input.
  void reduce_scatter(const Parts& inputs, uint8_t* output, ReduceFn reduce);
  // Starting from rank r holding part r, every rank gets every part: N-1 steps, (N-1)/N sent.
  void all_gather(Parts& parts);
  // tensor reduced in place over all ranks: reduce_scatter, then all_gather.
  void all_reduce(Tensor& tensor, ReduceOp op);
  // root's buffer travels the ring root -> root+1 -> ... -> root-1, piece by piece.
  void broadcast(uint8_t* data, int64_t numel, size_t element_size, int root);

 private:
  // Sends part `out` of parts' cut, read from send_from, to the right; hands each piece of
  // part `in` that arrives from the left to combine(first element, count, received bytes).
  void step(const Parts& parts, int out, const uint8_t* send_from, int in,
            const std::function<void(int64_t, int64_t, const uint8_t*)>& combine);
};

// Every rank's buffer holds its input; afterwards every rank's holds the reduced result
// (Note [Shm direct all-reduce]). Throws as ShmSegment's waits do, and DistError when the
// ranks are not at the same all-reduce of the same buffer.
void direct_all_reduce(ShmSegment& shm, const Envelope& envelope, SharedBuffer& buffer, DType dtype,
                       ReduceOp op, Clock::time_point deadline, const std::string& what);

}  // namespace nanoddp::dist::shm
