// BatchNorm1d (torch.nn.BatchNorm1d): normalises each channel over the batch, keeping running
// statistics for evaluation.
//
//   nn::BatchNorm1d norm(64);            // x: [N, 64] or [N, 64, L] -> the same shape
//   norm.train();  Tensor y = norm(x);   // batch statistics; running_mean/var updated
//   norm.eval();   Tensor z = norm(x);   // running statistics
//
// Under DDP each rank normalises with its own batch's statistics, so N-rank training is not
// 1-rank training on the global batch; dist::SyncBatchNorm (dist/sync_batch_norm.h) makes it
// so. docs/batch-norm.md says when each is right.
//
// Cost, for C channels of M = N * L values: forward ~7 M C FLOPs and three passes over x
// (mean, variance, output), backward ~10 M C FLOPs and two passes; keeps x and 2 C floats.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "nn/module.h"

namespace nanoddp {

// How batch statistics cross processes. dist::SyncBatchNorm plugs in one that all-reduces over
// a process group; nn/ includes nothing from dist/, as dependencies point down README's layout
// (core, kernels, nn, then dist), so the layer asks for this interface instead.
class BatchStatsAllReduce {
 public:
  virtual ~BatchStatsAllReduce() = default;
  // Sums t (float32, any device) over every process, in place. Every process calls it in the
  // same order: twice per training forward ([C + 1] floats, then [C]) and once per backward
  // ([2 C]).
  virtual void all_reduce_sum(Tensor& t) = 0;
};

// input: [N, C] or [N, C, L]; running_mean, running_var, weight, bias: [C] or undefined
// -> input's shape: y = (x - mean) / sqrt(var + eps) * weight + bias per channel
// (torch.nn.functional.batch_norm).
//   training: mean and the biased var are the batch's, over N (and L); when running_mean and
//     running_var are defined they are updated in place, not recorded by autograd:
//     running = (1 - momentum) running + momentum batch, with the unbiased var (M / (M - 1)).
//     An empty batch (M = 0) gives an empty output, zero weight and bias gradients, and leaves
//     the running statistics unchanged (torch.batch_norm on an input of no elements). With
//     eps = 0, a constant channel (var = 0) gets the bias and no gradient, not 0 / 0, as in
//     PyTorch, whose 1 / sqrt(var + eps) is 0 then.
//   !training: mean and var are running_mean and running_var (both must be defined).
//   all_reduce (training only): the batch is every process's batch together: each process's
//     mean and variance are merged in forward (two all-reduces, Note [SyncBatchNorm
//     statistics] in batch_norm.cpp: no cancellation however large |mean| / std), the two
//     gradient sums in backward (torch.nn.SyncBatchNorm).
// NaN or inf in a channel makes that channel NaN in training (its mean is NaN); in eval only
// the element itself (the input gradient, weight invstd dy in eval, does not depend on x). Errors: ShapeError
// for another input rank or a [C] tensor of another shape; ValueError for training with one value per channel
// (M = 1, as PyTorch), for eval without running statistics, or eps < 0; DeviceError when operands are on
// different devices.
Tensor batch_norm(const Tensor& input, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight,
                  const Tensor& bias, bool training, float momentum = 0.1f, float eps = 1e-5f,
                  std::shared_ptr<BatchStatsAllReduce> all_reduce = nullptr);

namespace nn {

// torch.nn.BatchNorm1d(num_features, eps, momentum, affine, track_running_stats), same defaults.
//   momentum: std::nullopt is PyTorch's momentum=None, the cumulative average: the factor is
//     1 / num_batches_tracked, so running stats are the plain mean of every batch's stats.
//   affine: learnable weight (ones) and bias (zeros), parameters "weight" and "bias".
//   track_running_stats: buffers "running_mean" (zeros), "running_var" (ones) and
//     "num_batches_tracked" (int64 scalar, 0), all persistent (in state_dict). Without it, no
//     buffers, and eval() normalises with batch statistics as training does.
// train(): batch statistics, running stats updated, num_batches_tracked + 1 per forward (on
//   the buffer's device; with momentum std::nullopt the count is read back to the host, one
//   wait per forward on CUDA, as torch's 1.0 / float(num_batches_tracked)).
// eval(): running statistics, nothing updated.
// ValueError for num_features < 1 or eps < 0.
class BatchNorm1d : public Module {
 public:
  explicit BatchNorm1d(int64_t num_features, float eps = 1e-5f, std::optional<float> momentum = 0.1f,
                       bool affine = true, bool track_running_stats = true);
  Tensor forward(const Tensor& input) override;
  int64_t num_features() const { return num_features_; }

  // Routes batch statistics through all_reduce (what convert_sync_batchnorm sets); null (the
  // default): this process's batch only.
  void set_stats_all_reduce(std::shared_ptr<BatchStatsAllReduce> all_reduce) { all_reduce_ = std::move(all_reduce); }
  bool syncs_stats() const { return all_reduce_ != nullptr; }

  Tensor weight, bias;                                    // [C], undefined without affine
  Tensor running_mean, running_var, num_batches_tracked;  // undefined without track_running_stats

  // num_batches_tracked: 0 when a state lacks it (Module::load_state_dict).
  std::vector<Tensor> zero_if_missing() override;

 private:
  int64_t num_features_;
  float eps_;
  std::optional<float> momentum_;
  bool track_running_stats_;
  std::shared_ptr<BatchStatsAllReduce> all_reduce_;
};

}  // namespace nn
}  // namespace nanoddp
