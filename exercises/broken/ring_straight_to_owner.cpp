// A deliberately wrong ring, kept so that the grader's test can show it is caught: the sums are
// right and each rank sends 2(N-1) parts, but not around a ring. Every rank sends part p
// straight to rank p, which reduces it and sends it straight back to everyone: at N ranks each
// rank talks to all N-1 others at once, which is what the ring exists to avoid (one neighbour,
// one link, whatever N is). tools/exercise check ring exercises/broken/ring_straight_to_owner.cpp
// must fail, saying so.
#include <cmath>
#include <vector>

#include "core/error.h"
#include "dist/ring.h"

namespace nanoddp::dist {

namespace {

template <typename T>
void fold(T* into, const T* from, int64_t n, ReduceOp op) {
  for (int64_t i = 0; i < n; ++i) {
    const T a = into[i], b = from[i];
    if (op == ReduceOp::Sum || op == ReduceOp::Avg)
      into[i] = a + b;
    else if (b != b || a != a)
      into[i] = a != a ? a : b;  // NaN wins
    else
      into[i] = op == ReduceOp::Max ? (a > b ? a : b) : (a < b ? a : b);
  }
}

}  // namespace

void ring_all_reduce(ProcessGroup& pg, Tensor& tensor, ReduceOp op, std::chrono::milliseconds timeout) {
  NANODDP_CHECK(!(tensor.dtype() == DType::Int64 && op == ReduceOp::Avg), ValueError, "int64 has no Avg");
  const int n = pg.size(), rank = pg.rank();
  const int64_t numel = tensor.numel(), size = (numel + n - 1) / n;
  if (n == 1 || numel == 0) return;
  Tensor flat = tensor.reshape({numel});
  const auto begin = [&](int p) { return std::min(numel, p * size); };
  const auto part = [&](int p) {
    return flat.slice_view(begin(p), {std::min(numel, begin(p) + size) - begin(p)});
  };
  // Reduce: every other rank's copy of my part comes straight to me.
  std::vector<Tensor> incoming;
  std::vector<std::shared_ptr<Work>> works;
  for (int q = 0; q < n; ++q) {
    if (q == rank) continue;
    incoming.push_back(Tensor::empty({part(rank).numel()}, tensor.dtype()));
    works.push_back(pg.recv(incoming.back(), q));
    works.push_back(pg.send(part(q), q));
  }
  for (auto& w : works) w->wait(timeout);
  Tensor mine = part(rank);
  for (const Tensor& in : incoming) {
    if (tensor.dtype() == DType::Int64)
      fold(mine.data<int64_t>(), in.data<int64_t>(), mine.numel(), op);
    else
      fold(mine.data<float>(), in.data<float>(), mine.numel(), op);
  }
  if (op == ReduceOp::Avg)
    for (int64_t i = 0; i < mine.numel(); ++i) mine.data<float>()[i] /= static_cast<float>(n);
  // Gather: my reduced part straight to everyone, theirs straight to me.
  works.clear();
  for (int q = 0; q < n; ++q) {
    if (q == rank) continue;
    works.push_back(pg.send(mine, q));
    Tensor theirs = part(q);
    works.push_back(pg.recv(theirs, q));
  }
  for (auto& w : works) w->wait(timeout);
}

}  // namespace nanoddp::dist
