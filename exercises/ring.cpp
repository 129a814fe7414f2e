// Exercise 4: the ring all-reduce on send and recv only. Read dist/ring.h (the contract and
// the algorithm) and docs/ring-all-reduce.md, then write the body. Grade it:
// tools/exercise check ring
//
// Hints:
//  - Cut the tensor's numel elements into N parts; the first numel % N parts get one extra
//    element. A part is tensor.reshape({numel}).slice_view(offset, {count}).
//  - Step s of the reduce-scatter: send part (rank - s) mod N to rank + 1, receive part
//    (rank - s - 1) mod N from rank - 1 into a scratch tensor, and add it into that part.
//    Post the recv before waiting for the send (a send may wait for its receiver).
//  - After N - 1 steps rank r holds part (r + 1) mod N complete (dist/ring.h and
//    docs/ring-all-reduce.md number the parts one lower, so that rank r holds part r: the
//    same schedule). The all-gather: N - 1 more steps, sending the part just completed and
//    overwriting the one received.
//  - ReduceOp::Avg: sum, then divide by N; int64 has no Avg (throw ValueError first, as
//    dist/ring.h says). Max/Min: combine with the op instead of adding; a NaN on any rank
//    wins (std::max(a, b) keeps a when b is NaN: test with std::isnan).
//  - N == 1: nothing to send. Fewer elements than ranks: some parts are empty.
// The grader checks the values at 1, 2 and 3 ranks (numel not a multiple of N, and 0, 1 and 2
// elements; float32 and int64, one past 2^60 that must add exactly), NaN in Max and Min, int64
// Avg refused, that no collective was called, and that each rank sent 2(N-1) parts, not whole
// buffers. Your file must define this function exactly (namespace and parameter types).
#include "dist/ring.h"

#include "core/error.h"
#include "core/ops.h"

namespace nanoddp::dist {

void ring_all_reduce(ProcessGroup& pg, Tensor& tensor, ReduceOp op, std::chrono::milliseconds timeout) {
  (void)pg, (void)tensor, (void)op, (void)timeout;
  NANODDP_CHECK(false, ValueError, "exercises/ring.cpp: ring_all_reduce is not written yet");
}

}  // namespace nanoddp::dist
