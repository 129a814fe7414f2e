// A deliberately wrong ring, kept so that the grader's test can show it is caught: each rank
// waits for its send before it posts its recv, and a send may wait for its receiver, which
// waits for its own send: every rank waits for ever (here, until the timeout).
// tools/exercise check ring exercises/broken/ring_send_before_recv.cpp must fail, saying so.
#include "dist/ring.h"

#include "core/error.h"

namespace nanoddp::dist {

void ring_all_reduce(ProcessGroup& pg, Tensor& tensor, ReduceOp op, std::chrono::milliseconds timeout) {
  NANODDP_CHECK(!(tensor.dtype() == DType::Int64 && op == ReduceOp::Avg), ValueError, "int64 has no Avg");
  const int n = pg.size(), rank = pg.rank();
  if (n == 1) return;
  Tensor flat = tensor.reshape({tensor.numel()});
  Tensor received = Tensor::empty({tensor.numel()}, tensor.dtype());
  for (int step = 0; step < n - 1; ++step) {
    pg.send(flat, (rank + 1) % n)->wait(timeout);  // the mistake: the recv is not posted yet
    pg.recv(received, (rank + n - 1) % n)->wait(timeout);
  }
}

}  // namespace nanoddp::dist
