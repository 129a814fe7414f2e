#include "dist/ring.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "dist/detail.h"

namespace nanoddp::dist {

namespace {

template <typename T>
void combine(T* into, const T* from, int64_t n, ReduceOp op) {
  for (int64_t i = 0; i < n; ++i) {
    const T a = into[i], b = from[i];
    switch (op) {
      case ReduceOp::Sum:
      case ReduceOp::Avg:
        into[i] = a + b;
        break;
      case ReduceOp::Max:
        into[i] = detail::max_of(a, b);  // Note [Max and Min]
        break;
      case ReduceOp::Min:
        into[i] = detail::min_of(a, b);
        break;
    }
  }
}

// into (op)= from, element-wise; both the same length and dtype.
void combine(Tensor& into, const Tensor& from, ReduceOp op) {
  if (into.dtype() == DType::Float32)
    combine(into.data<float>(), from.data<float>(), into.numel(), op);
  else
    combine(into.data<int64_t>(), from.data<int64_t>(), into.numel(), op);
}

}  // namespace

void ring_all_reduce(ProcessGroup& pg, Tensor& tensor, ReduceOp op, std::chrono::milliseconds timeout) {
  NANODDP_CHECK(tensor.defined() && tensor.device().is_cpu() &&
                    (tensor.dtype() == DType::Float32 || tensor.dtype() == DType::Int64),
                ValueError, "ring_all_reduce: needs a float32 or int64 CPU tensor");
  NANODDP_CHECK(op != ReduceOp::Avg || tensor.dtype() == DType::Float32, ValueError,
                "ring_all_reduce: avg needs float32 (an int64 average would round); use sum");
  const int n = pg.size(), rank = pg.rank();
  if (n == 1) return;
  const int right = (rank + 1) % n, left = (rank - 1 + n) % n;

  // The N parts, as tensors of their own: part p is elements [p*chunk, min((p+1)*chunk, numel)).
  const int64_t numel = tensor.numel(), chunk = (numel + n - 1) / n;
  const size_t element_size = dtype_size(tensor.dtype());
  std::vector<Tensor> parts;
  for (int p = 0; p < n; ++p) {
    const int64_t begin = std::min(numel, p * chunk), end = std::min(numel, begin + chunk);
    parts.push_back(Tensor::empty({end - begin}, tensor.dtype()));
    // An empty part has no storage (a null pointer), which memcpy may not be given even for 0 bytes.
    if (end > begin)
      std::memcpy(detail::bytes_of(parts[p]), detail::bytes_of(tensor) + begin * element_size,
                  (end - begin) * element_size);
  }
  auto part = [n](int p) { return ((p % n) + n) % n; };

  // One step: send part `out` to the right while part `in` arrives from the left. Both are
  // issued before either is waited for, so no rank blocks its neighbour.
  // A part is empty when numel < N; both ends know it, so nothing moves.
  auto step = [&](int out, int in, bool reduce) {
    Tensor incoming = Tensor::empty({parts[in].numel()}, tensor.dtype());
    auto sent = parts[out].numel() > 0 ? pg.send(parts[out], right) : std::make_shared<CompletedWork>();
    auto received = incoming.numel() > 0 ? pg.recv(incoming, left) : std::make_shared<CompletedWork>();
    received->wait(timeout);
    sent->wait(timeout);
    if (reduce)
      combine(parts[in], incoming, op);
    else
      parts[in] = incoming;
  };
  // Reduce-scatter: after step s, rank r's part r-s-2 holds the reduction over s+2 ranks;
  // after N-1 steps part r holds all N. (N-1) parts sent.
  for (int s = 0; s < n - 1; ++s) step(part(rank - s - 1), part(rank - s - 2), true);
  // All-gather: rank r starts with part r complete and passes each complete part on.
  // (N-1) more parts sent: 2(N-1)/N of the tensor in all.
  for (int s = 0; s < n - 1; ++s) step(part(rank - s), part(rank - s - 1), false);

  for (int p = 0; p < n; ++p) {
    if (parts[p].numel() > 0)
      std::memcpy(detail::bytes_of(tensor) + p * chunk * element_size, detail::bytes_of(parts[p]),
                  parts[p].nbytes());
  }
  if (op == ReduceOp::Avg) detail::divide_by_world_size(tensor, n);
}

}  // namespace nanoddp::dist
