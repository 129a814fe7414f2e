// SyncBatchNorm (torch.nn.SyncBatchNorm): a BatchNorm1d whose training statistics are those of
// every rank's batch together, so N-rank DDP normalises as 1 rank would on the global batch.
//
//   dist::convert_sync_batchnorm(model, pg);            // every BatchNorm1d in model, in place
//   dist::DistributedDataParallel ddp(model, pg);        // then train as usual
//   auto norm = std::make_shared<dist::SyncBatchNorm>(64, pg);   // or build one directly
//
// Note [SyncBatchNorm] The algorithm, per layer and training step:
//   forward  1. each rank takes its own mean_r and biased var_r per channel (two passes in
//               double) and counts its values M_r = N_r * L;
//            2. all_reduce(sum) of [M_r mean_r, M_r] ([C + 1] floats): M = sum of M_r and
//               mean = sum of M_r mean_r / M;
//            3. all_reduce(sum) of M_r var_r + M_r (mean_r - mean)^2 ([C] floats): var = that / M
//               (biased, to normalise; the running var takes M / (M - 1) of it). Every rank
//               normalises with the same statistics, and its running statistics get the same
//               update (Note [SyncBatchNorm statistics] in nn/batch_norm.cpp);
//   backward 4. each rank sums dy and dy * xhat per channel: [2 C] floats;
//            5. one all_reduce(sum) of them; dx uses the totals and M, so it is the gradient
//               of the sum of every rank's loss. The weight and bias gradients stay this rank's
//               share: DDP averages them as any parameter's, as PyTorch does.
// eval() communicates nothing (as PyTorch): it uses the running statistics, or without
// track_running_stats this rank's own batch.
//
// Contract: every rank runs forward and backward of each SyncBatchNorm in the same order (they
// are collectives); a rank may hold 0 samples, but all ranks together need more than 1 value
// per channel. Cost: three all-reduces of at most 2 C + 1 floats per layer per step, two in
// forward and one inside backward, where they cannot overlap with compute: latency-bound
// (Gloo: ~ms each). PyTorch does one all_gather of every rank's mean, invstd and count in
// forward instead of two all-reduces; the merge is the same in spirit, and neither cancels
// when |mean| >> std (sum x^2 / M - mean^2 from float32 sums would keep about
// 7 - 2 log10(|mean| / std) digits of the variance).
// Differences from PyTorch: CPU tensors work too (PyTorch's needs CUDA), and
// convert_sync_batchnorm converts in place (same Module objects and parameter handles, so an
// optimizer built before still works) instead of returning a new module tree.
// Errors: as BatchNorm1d; DistError or TimeoutError from the collectives.
#pragma once

#include <chrono>
#include <memory>
#include <optional>

#include "dist/process_group.h"
#include "nn/batch_norm.h"

namespace nanoddp::dist {

// Sums batch statistics over a process group (what SyncBatchNorm plugs into BatchNorm1d).
class ProcessGroupStatsAllReduce : public BatchStatsAllReduce {
 public:
  explicit ProcessGroupStatsAllReduce(std::shared_ptr<ProcessGroup> pg,
                                      std::chrono::milliseconds timeout = kDefaultTimeout)
      : pg_(std::move(pg)), timeout_(timeout) {}
  void all_reduce_sum(Tensor& t) override { pg_->all_reduce(t, ReduceOp::Sum)->wait(timeout_); }

 private:
  std::shared_ptr<ProcessGroup> pg_;
  std::chrono::milliseconds timeout_;
};

// torch.nn.SyncBatchNorm(num_features, eps, momentum, affine, track_running_stats,
// process_group), for [N, C] and [N, C, L] inputs (BatchNorm1d's). ValueError for a null pg,
// and in training, on every rank, when all ranks together hold one value per channel (torch's
// SyncBatchNorm checks that only at world size 1, and gives a NaN running_var).
class SyncBatchNorm : public nn::BatchNorm1d {
 public:
  SyncBatchNorm(int64_t num_features, std::shared_ptr<ProcessGroup> pg, float eps = 1e-5f,
                std::optional<float> momentum = 0.1f, bool affine = true, bool track_running_stats = true);
};

// Makes every BatchNorm1d in module (itself included) synchronise its statistics over pg, in
// place, and returns module (torch.nn.SyncBatchNorm.convert_sync_batchnorm). Parameters,
// buffers and their values are kept. ValueError for a null module or pg.
std::shared_ptr<nn::Module> convert_sync_batchnorm(std::shared_ptr<nn::Module> module, std::shared_ptr<ProcessGroup> pg);

}  // namespace nanoddp::dist
