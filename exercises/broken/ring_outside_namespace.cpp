// A deliberately wrong ring, kept so that the grader's test can show it is caught: it is
// defined in namespace nanoddp, not nanoddp::dist, so it is another function than the one
// dist/ring.h declares. Linked in, it would leave the library's own ring to be graded.
// tools/exercise check ring exercises/broken/ring_outside_namespace.cpp must fail, saying so.
#include "dist/ring.h"

namespace nanoddp {

void ring_all_reduce(dist::ProcessGroup& pg, Tensor& tensor, dist::ReduceOp op,
                     std::chrono::milliseconds timeout) {
  dist::ring_all_reduce(pg, tensor, op, timeout);
}

}  // namespace nanoddp
