// Gradient accumulation over micro-batches, with the loss weighted so that the accumulated
// gradient is the big batch's gradient, and with no all_reduce until the last micro-batch.
//
//   auto micro = dist::split_micro_batches(batch.input, batch.target, 4);
//   opt.zero_grad();
//   Tensor loss = dist::accumulate_gradients(ddp, micro, loss_fn);  // ddp, fsdp or a ladder rung
//   opt.step();
//
// Note [Micro-batch weights]
// A mean loss over a micro-batch of n_i samples has gradient (1/n_i) sum of its samples'
// gradients. The big batch's mean loss over N = sum n_i samples has (1/N) sum of all of them.
// So micro-batch i's mean loss is weighted by n_i / N, and the weighted sum is exactly the big
// batch's mean. Weighting each by 1/k (a mean of micro-batch means) is the same only when
// every n_i = N/k: with micro-batches of 5, 3 and 4 samples the 3 samples of the second count
// 5/3 times as much as those of the first. That bug shipped in public trainers (the last,
// short micro-batch of an epoch; padding-free sequence packing, where n_i counts tokens).
// Across ranks, DDP then averages the ranks' gradients: the global batch's mean when every
// rank's N is the same (DistributedSampler's equal shares; weight by the global count, one
// all_reduce, when they differ).
#pragma once

#include <cstdint>
#include <vector>

#include "core/autograd.h"
#include "core/error.h"
#include "core/ops.h"
#include "core/tensor.h"

namespace nanoddp::dist {

struct MicroBatch {
  Tensor input;   // (n_i, ...)
  Tensor target;  // (n_i, ...)
};

// input: (N, ...), target: (N, ...) -> k micro-batches of consecutive rows, sizes ceil(N/k)
// for the first N % k and floor(N/k) after (torch.tensor_split's split). Each is a view of
// the batch's memory (Tensor::slice_view). Throws ValueError when k < 1, k > N, or input and
// target disagree on N.
inline std::vector<MicroBatch> split_micro_batches(const Tensor& input, const Tensor& target, int64_t k) {
  const int64_t n = input.size(0);
  NANODDP_CHECK(target.size(0) == n, ValueError, "split_micro_batches: input has ", n, " rows, target ",
                target.size(0));
  NANODDP_CHECK(k >= 1 && k <= n, ValueError, "split_micro_batches: ", k, " micro-batches of ", n,
                " samples: give 1 to ", n);
  auto rows = [](const Tensor& t, int64_t begin, int64_t count) {
    std::vector<int64_t> sizes = t.shape().sizes();
    const int64_t row_numel = t.numel() / sizes[0];
    sizes[0] = count;
    return t.slice_view(begin * row_numel, Shape(sizes));
  };
  std::vector<MicroBatch> micro;
  int64_t begin = 0;
  for (int64_t i = 0; i < k; ++i) {
    const int64_t count = n / k + (i < n % k ? 1 : 0);
    micro.push_back({rows(input, begin, count), rows(target, begin, count)});
    begin += count;
  }
  return micro;
}

// Runs forward and backward on every micro-batch, in order; loss_fn(model(input), target) is
// the micro-batch's mean loss, and it is weighted by n_i / N (Note [Micro-batch weights]).
// Every backward but the last runs under model.no_sync(): the gradients accumulate locally
// and the last backward reduces their sum once (torch's recipe). model: anything with
// operator()(Tensor) and no_sync() (DistributedDataParallel, FullyShardedDataParallel, a
// ladder rung; a ladder rung's finish_gradient_sync() is the caller's, after this returns).
// .grad is added to, not replaced: zero it before. loss_scale multiplies each weighted loss
// before its backward: pass a float16 GradScaler's get_scale(), as torch's recipe calls
// scaler.scale(loss).backward() in every micro-step (1, the default, adds no op); as there,
// loss_fn should return float32 (autocast's losses do): a scaled 16-bit loss overflows.
// Returns the big batch's mean loss, unscaled (detached, 0-dim). Throws ValueError for no
// micro-batches, and what forward and backward throw.
template <typename Model, typename LossFn>
Tensor accumulate_gradients(Model& model, const std::vector<MicroBatch>& micro_batches, LossFn&& loss_fn,
                            float loss_scale = 1.0f) {
  NANODDP_CHECK(!micro_batches.empty(), ValueError, "accumulate_gradients: no micro-batches");
  int64_t total = 0;
  for (const MicroBatch& m : micro_batches) total += m.input.size(0);
  Tensor batch_loss;
  for (size_t i = 0; i < micro_batches.size(); ++i) {
    const MicroBatch& m = micro_batches[i];
    const float weight = static_cast<float>(m.input.size(0)) / static_cast<float>(total);
    auto run = [&] {
      Tensor loss = loss_fn(model(m.input), m.target) * weight;
      (loss_scale == 1.0f ? loss : loss * loss_scale).backward();
      NoGradGuard no_grad;
      batch_loss = batch_loss.defined() ? batch_loss + loss.detach() : loss.detach();
    };
    if (i + 1 < micro_batches.size()) {
      [[maybe_unused]] auto guard = model.no_sync();
      run();
    } else {
      run();
    }
  }
  return batch_loss;
}

}  // namespace nanoddp::dist
