#include "data/sampler.h"

#include <numeric>
#include <utility>

#include "core/error.h"
#include "core/random.h"

namespace nanoddp::data {

std::vector<int64_t> randperm(int64_t n, uint64_t seed) {
  NANODDP_CHECK(n >= 0, ValueError, "randperm: n must be >= 0, got ", n);
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), int64_t{0});
  Generator gen(seed);
  for (int64_t i = 0; i + 1 < n; ++i) {
    const auto j = i + static_cast<int64_t>(gen.random() % static_cast<uint64_t>(n - i));
    std::swap(order[i], order[j]);
  }
  return order;
}

DistributedSampler::DistributedSampler(int64_t size, int num_replicas, int rank, bool shuffle, uint64_t seed,
                                       bool drop_last)
    : DistributedSampler(size, num_replicas, rank, shuffle, seed, drop_last, /*even_split=*/true) {}

DistributedSampler DistributedSampler::for_evaluation(int64_t size, int num_replicas, int rank) {
  return DistributedSampler(size, num_replicas, rank, /*shuffle=*/false, /*seed=*/0, /*drop_last=*/false,
                            /*even_split=*/false);
}

DistributedSampler::DistributedSampler(int64_t size, int num_replicas, int rank, bool shuffle, uint64_t seed,
                                       bool drop_last, bool even_split)
    : size_(size),
      num_replicas_(num_replicas),
      rank_(rank),
      shuffle_(shuffle),
      seed_(seed),
      drop_last_(drop_last),
      even_split_(even_split) {
  NANODDP_CHECK(size >= 0, ValueError, "DistributedSampler: size must be >= 0, got ", size);
  NANODDP_CHECK(num_replicas >= 1, ValueError, "DistributedSampler: num_replicas must be >= 1, got ",
                num_replicas);
  NANODDP_CHECK(rank >= 0 && rank < num_replicas, ValueError, "DistributedSampler: rank ", rank,
                " is outside [0, num_replicas) = [0, ", num_replicas, ")");
  const int64_t W = num_replicas;
  if (!even_split) {
    num_samples_ = size / W + (rank < size % W ? 1 : 0);
    total_size_ = size;
  } else {
    // torch: drop_last and N % W != 0 -> ceil((N - W) / W), which is floor(N / W) (0 when
    // N < W); otherwise ceil(N / W).
    // The ceiling is formed without size + W - 1, which wraps for a size near 2^63.
    num_samples_ = size / W + (!drop_last && size % W != 0 ? 1 : 0);
    NANODDP_CHECK(!__builtin_mul_overflow(num_samples_, W, &total_size_), ValueError, "DistributedSampler: size ",
                  size, " padded to a multiple of num_replicas ", W, " does not fit in int64");
  }
}

std::vector<int64_t> DistributedSampler::indices() const {
  std::vector<int64_t> order;
  if (shuffle_) {
    // Unsigned wrap-around for a negative epoch, as torch.Generator.manual_seed wraps a negative
    // seed + epoch: the low 32 bits, all randperm uses, are the same.
    order = randperm(size_, seed_ + static_cast<uint64_t>(epoch_));
  } else {
    order.resize(static_cast<size_t>(size_));
    std::iota(order.begin(), order.end(), int64_t{0});
  }
  // Position k of the padded (or cut) order is order[k mod N]: torch's indices[:padding]
  // and its repeated list both continue the order cyclically from its start.
  std::vector<int64_t> mine;
  mine.reserve(static_cast<size_t>(num_samples_));
  for (int64_t k = rank_; k < total_size_; k += num_replicas_) mine.push_back(order[k % size_]);
  NANODDP_ASSERT(static_cast<int64_t>(mine.size()) == num_samples_);
  return mine;
}

}  // namespace nanoddp::data
