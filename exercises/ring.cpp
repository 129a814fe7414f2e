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
//  - ReduceOp::Avg: sum, then divide by N. Max/Min: combine with the op instead of adding.
//  - N == 1: nothing to send.
// The grader checks the values at 2 and 3 ranks (numel not a multiple of N; float32 and
// int64), that no collective was called, and that each rank sent 2(N-1) parts, not whole
// buffers.
#include "dist/ring.h"

#include "core/error.h"
#include "core/ops.h"

namespace nanoddp::dist {

void ring_all_reduce(ProcessGroup& pg, Tensor& tensor, ReduceOp op, std::chrono::milliseconds timeout) {
  (void)pg, (void)tensor, (void)op, (void)timeout;
  NANODDP_CHECK(false, ValueError, "exercises/ring.cpp: ring_all_reduce is not written yet");
}

}  // namespace nanoddp::dist
