// DistributedSampler: which example indices each rank visits in an epoch.
//
//   DistributedSampler sampler(dataset->size(), world_size, rank);      // shuffled, seed 0
//   for (int64_t epoch = 0; epoch < epochs; ++epoch) { sampler.set_epoch(epoch); sampler.indices(); }
//   auto eval = DistributedSampler::for_evaluation(test->size(), world_size, rank);
//
// Note [Sharding]
// Training mode follows torch.utils.data.DistributedSampler exactly, for N examples and
// W = num_replicas ranks:
//   1. order: 0..N-1, or, with shuffle, one permutation drawn from seed + epoch: every rank
//      draws the same one, so no communication is needed.
//   2. length: without drop_last the order is padded to total = ceil(N / W) * W by repeating
//      it from its start (again and again when N < W), so every rank gets ceil(N / W)
//      indices and some examples are visited twice; with drop_last it is cut to
//      total = floor(N / W) * W, and the tail is skipped this epoch.
//   3. split: rank r takes positions r, r + W, r + 2W, ... < total.
// Equal lengths matter in training: every rank must run the same number of steps, or DDP's
// all-reduces would wait for a rank that has stopped.
//
// The shuffle is torch.randperm(N) drawn from a generator seeded with seed + epoch (randperm
// below), so the indices are PyTorch's, value for value: a rank visits the examples in the
// order torch's DistributedSampler with the same seed and epoch gives it.
//
// Evaluation mode (for_evaluation) is what PyTorch lacks: steps 1-3 without padding or
// shuffling, so every example is visited exactly once across ranks and the first N mod W
// ranks get one index more. PyTorch's padding counts the repeated examples twice, so a
// test accuracy summed over ranks with its sampler is computed over the wrong set (and over
// more than N examples). Uneven lengths need one care: where a forward is itself a collective
// (FSDP's and ZeRO-2's all-gathers, DDP's broadcast of buffers), every rank must run as many
// forwards as rank 0, which has the most batches; a rank that runs out forwards a filler
// (examples/fashion_mnist.cpp's evaluate).
#pragma once

#include <cstdint>
#include <vector>

namespace nanoddp::data {

class DistributedSampler {
 public:
  // size: number of examples N >= 0; num_replicas: world size W >= 1; rank in [0, W).
  // Throws ValueError on anything else, naming the values.
  DistributedSampler(int64_t size, int num_replicas, int rank, bool shuffle = true, uint64_t seed = 0,
                     bool drop_last = false);

  // Every example exactly once across ranks, in order, no padding: rank r gets r, r + W, ...
  // < N, which is N / W indices, plus one for r < N mod W. Errors as the constructor.
  static DistributedSampler for_evaluation(int64_t size, int num_replicas, int rank);

  // The epoch whose permutation indices() returns (torch's set_epoch). Call it at the start
  // of every epoch: without it each epoch repeats epoch 0's order.
  void set_epoch(int64_t epoch) { epoch_ = epoch; }
  int64_t epoch() const { return epoch_; }

  // This rank's indices for the current epoch, num_samples() of them, each in [0, N).
  std::vector<int64_t> indices() const;
  // len(sampler): ceil(N / W) (training), floor(N / W) (drop_last), or this rank's share
  // (evaluation).
  int64_t num_samples() const { return num_samples_; }
  // Indices over all ranks in one epoch: num_samples() * W in training mode, N in evaluation.
  int64_t total_size() const { return total_size_; }

  int64_t size() const { return size_; }
  int num_replicas() const { return num_replicas_; }
  int rank() const { return rank_; }
  bool shuffle() const { return shuffle_; }
  uint64_t seed() const { return seed_; }
  bool drop_last() const { return drop_last_; }
  bool is_evaluation() const { return !even_split_; }

 private:
  DistributedSampler(int64_t size, int num_replicas, int rank, bool shuffle, uint64_t seed, bool drop_last,
                     bool even_split);

  int64_t size_;
  int num_replicas_;
  int rank_;
  bool shuffle_;
  uint64_t seed_;
  bool drop_last_;
  bool even_split_;  // training mode: pad or cut so every rank gets the same count
  int64_t epoch_ = 0;
  int64_t num_samples_;
  int64_t total_size_;
};

// torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist(): the draws of a
// Generator(seed) (core/random.h, PyTorch's CPU generator), element i swapped with element
// i + draw % (n - i) for i = 0 .. n-2. Equal to torch 1.13's values for every n, and to
// torch 2's for n below 2^32 / 20 (above, torch 2 draws 64 bits at a time). Throws
// ValueError for n < 0.
std::vector<int64_t> randperm(int64_t n, uint64_t seed);

}  // namespace nanoddp::data
