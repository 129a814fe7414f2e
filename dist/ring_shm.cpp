// The shared-memory group's algorithms, without the plumbing: the ring (reduce-scatter,
// all-gather, all-reduce, broadcast) over the segment's slots, and the direct all-reduce that
// reads the peers' collective buffers in place. How a slot is posted and read, and how a rank
// waits, are in shm_slots.cpp and shm_wait.h; dist/ring.cpp is the same ring on send/recv.
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
#include "dist/ring_shm.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <type_traits>

#include "core/half_convert.h"
#include "dist/detail.h"
#include "dist/shm_wait.h"

namespace nanoddp::dist::shm {

namespace {

int mod(int a, int n) { return ((a % n) + n) % n; }

}  // namespace

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

Parts Parts::of_buffer(uint8_t* data, int64_t numel, size_t element_size, int n) {
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

Parts Parts::of_tensors(const std::vector<Tensor>& tensors) {
  Parts parts;
  parts.element_size = dtype_size(tensors.at(0).dtype());
  for (const Tensor& t : tensors) {
    parts.data.push_back(bytes_of(t));
    parts.numel.push_back(t.numel());
  }
  return parts;
}

int64_t Parts::pieces() const {
  const int64_t piece = static_cast<int64_t>(kSlotBytes / element_size);
  const int64_t largest = *std::max_element(numel.begin(), numel.end());
  return std::max<int64_t>(1, (largest + piece - 1) / piece);
}

std::pair<int64_t, int64_t> Parts::piece(int p, int64_t i) const {
  const int64_t size = static_cast<int64_t>(kSlotBytes / element_size);
  const int64_t first = std::min(numel[p], i * size);
  return {first, std::min(numel[p], first + size) - first};
}

int Ring::right() const { return mod(rank() + 1, n()); }
int Ring::left() const { return mod(rank() - 1, n()); }

// One step: send part `out` to the right, fold part `in` from the left into ours with
// `combine` (a reduction, or a copy).
void Ring::step(const Parts& parts, int out, const uint8_t* send_from, int in,
                const std::function<void(int64_t, int64_t, const uint8_t*)>& combine) {
  const size_t es = parts.element_size;
  for (int64_t i = 0; i < parts.pieces(); ++i) {
    auto [out_first, out_count] = parts.piece(out, i);
    shm.post(right(), envelope, send_from + out_first * es, out_count * es, deadline, what);
    auto [in_first, in_count] = parts.piece(in, i);
    const SlotHeader* slot = shm.receive(left(), envelope, in_count * es, deadline, what);
    combine(in_first, in_count, ShmSegment::payload(slot));
    shm.release(left());
  }
}

void Ring::reduce_scatter(Parts& parts, ReduceFn reduce) {
  const size_t es = parts.element_size;
  for (int s = 0; s < n() - 1; ++s) {
    const int out = mod(rank() - s - 1, n()), in = mod(rank() - s - 2, n());
    uint8_t* into = parts.data[in];
    step(parts, out, parts.data[out], in, [&](int64_t first, int64_t count, const uint8_t* theirs) {
      reduce(into + first * es, into + first * es, theirs, count);
    });
  }
}

// Step s sends the running sum of part r-s-1 (at s = 0, this rank's input) and adds its own
// input of part r-s-2 to the running sum that arrives. The sum is written where the one it
// replaces has just been posted, piece by piece, so one scratch part is enough; the last step
// writes part r into output. Same additions in the same order as the in-place ring.
void Ring::reduce_scatter(const Parts& inputs, uint8_t* output, ReduceFn reduce) {
  const size_t es = inputs.element_size;
  const int64_t largest = *std::max_element(inputs.numel.begin(), inputs.numel.end());
  std::unique_ptr<uint8_t[]> scratch(n() > 2 ? new uint8_t[largest * es] : nullptr);
  for (int s = 0; s < n() - 1; ++s) {
    const int out = mod(rank() - s - 1, n()), in = mod(rank() - s - 2, n());
    const uint8_t* send_from = s == 0 ? inputs.data[out] : scratch.get();
    uint8_t* into = s == n() - 2 ? output : scratch.get();
    const uint8_t* mine = inputs.data[in];
    step(inputs, out, send_from, in, [&](int64_t first, int64_t count, const uint8_t* theirs) {
      reduce(into + first * es, mine + first * es, theirs, count);
    });
  }
}

void Ring::all_gather(Parts& parts) {
  const size_t es = parts.element_size;
  for (int s = 0; s < n() - 1; ++s) {
    const int out = mod(rank() - s, n()), in = mod(rank() - s - 1, n());
    uint8_t* into = parts.data[in];
    step(parts, out, parts.data[out], in, [&](int64_t first, int64_t count, const uint8_t* theirs) {
      if (count > 0) std::memcpy(into + first * es, theirs, count * es);
    });
  }
}

void Ring::all_reduce(Tensor& tensor, ReduceOp op) {
  // Reduce-scatter then all-gather, in place: each rank sends 2(N-1)/N of the buffer.
  Parts parts = Parts::of_buffer(bytes_of(tensor), tensor.numel(), dtype_size(tensor.dtype()), n());
  reduce_scatter(parts, reduce_fn(tensor.dtype(), op));
  all_gather(parts);
  if (op == ReduceOp::Avg) detail::divide_by_world_size(tensor, n());
}

void Ring::broadcast(uint8_t* data, int64_t numel, size_t element_size, int root) {
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

// ---- the direct all-reduce (Note [Shm direct all-reduce]) ----------------------------------

// Three rendezvous: all inputs are there; every part is reduced; every rank has copied.
void direct_all_reduce(ShmSegment& shm, const Envelope& envelope, SharedBuffer& buffer, DType dtype,
                       ReduceOp op, Clock::time_point deadline, const std::string& what) {
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
      reduce(mine, mine, previous, count);
      previous = mine;
    }
    if (op == ReduceOp::Avg) detail::divide_by_world_size(reinterpret_cast<float*>(parts[rank].data[rank]), count, n);
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


// ---- element-wise reductions -------------------------------------------------------------

namespace {

// out[i] = a[i] (op) b[i], Max and Min as Note [Max and Min] in dist/detail.h. out may be a,
// so no __restrict.
template <typename T, ReduceOp Op>
void reduce_into(void* out_bytes, const void* a_bytes, const void* b_bytes, int64_t n) {
  T* out = static_cast<T*>(out_bytes);
  const T* x = static_cast<const T*>(a_bytes);
  const T* y = static_cast<const T*>(b_bytes);
  for (int64_t i = 0; i < n; ++i) {
    const T a = x[i], b = y[i];
    if constexpr (Op == ReduceOp::Sum || Op == ReduceOp::Avg) {
      out[i] = a + b;
    } else if constexpr (Op == ReduceOp::Max) {
      out[i] = detail::max_of(a, b);
    } else {
      out[i] = detail::min_of(a, b);
    }
  }
}

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
void sum_16bit_into(void* out_bytes, const void* a_bytes, const void* b_bytes, int64_t n) {
  T* out = static_cast<T*>(out_bytes);
  const T* a = static_cast<const T*>(a_bytes);
  const T* b = static_cast<const T*>(b_bytes);
  if constexpr (std::is_same_v<T, Float16>) {
    float16_add(out, a, b, n);  // F16C where the CPU has it (core/half_convert.h)
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = T::from_float(a[i].to_float() + b[i].to_float());
  }
}

}  // namespace

ReduceFn reduce_fn(DType dtype, ReduceOp op) {
  switch (dtype) {
    case DType::Float32: return reduce_fn<float>(op);
    case DType::Float16: return sum_16bit_into<Float16>;
    case DType::BFloat16: return sum_16bit_into<BFloat16>;
    case DType::Int64: return reduce_fn<int64_t>(op);
    default: NANODDP_THROW(ValueError, "shm: no reduction for ", dtype_name(dtype));  // check_reduce refuses it first
  }
}

}  // namespace nanoddp::dist::shm
