// ZeRO stage 1's memory and time on the default Fashion-MNIST MLP (784-256-128-10, 235,146
// weights) with Adam: the optimizer-state bytes each rank holds, and the time of a training
// step (forward, backward with DDP's all-reduce, optimizer step) with ZeroRedundancyOptimizer
// and with a plain Adam on every rank, measured alternately in one run.
//
//   build/tools/nanoddp-run --nproc-per-node 2 build/benchmarks/zero_bench   # one JSON line
//
// state_bytes_per_rank[r] = float32 state rank r holds (Adam: exp_avg + exp_avg_sq, 8 bytes
// per weight it owns); unsharded_state_bytes = what every rank holds without ZeRO.
// step_ms_* are medians over 30 steps of a batch of 64 per rank, after 3 warm-up steps.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <vector>

#include "benchmarks/no_arguments.h"
#include "core/ops.h"
#include "dist/ddp.h"
#include "dist/host_collectives.h"
#include "dist/init.h"
#include "dist/zero_redundancy_optimizer.h"
#include "nn/adam.h"
#include "nn/layers.h"
#include "tests/batches.h"

using namespace nanoddp;

namespace {

// Median milliseconds of one step, over `steps` after `warmup`.
double step_ms(dist::DistributedDataParallel& ddp, nn::Optimizer& opt, const Tensor& x, const Tensor& y) {
  std::vector<double> times;
  for (int s = 0; s < 33; ++s) {
    const auto start = std::chrono::steady_clock::now();
    opt.zero_grad();
    cross_entropy(ddp(x), y).backward();
    opt.step();
    if (s >= 3) times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  return times[times.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  if (const int status = benchmarks::refuse_arguments(
          argc, argv,
          "zero_bench (under nanoddp-run --nproc-per-node 2) prints one JSON line: the optimizer state per "
          "rank of ZeRO-1 and its step time against plain Adam");
      status >= 0)
    return status;
  try {
    auto pg = dist::init_process_group({});
    const int rank = pg->rank(), world = pg->size();
    Generator gen(static_cast<uint64_t>(rank) + 1);
    const Tensor x = Tensor::randn({64, 784}, gen);
    std::vector<int64_t> labels(64);
    for (auto& l : labels) l = static_cast<int64_t>(gen.randint(10));
    const Tensor y = Tensor::from_vector(labels);
    const auto adam = [](std::vector<Tensor> p) { return std::make_unique<nn::Adam>(std::move(p), nn::AdamOptions{}); };

    dist::DistributedDataParallel zero_ddp(testing::make_fashion_mnist_mlp(), pg);
    dist::ZeroRedundancyOptimizer zero(zero_ddp.parameters(), pg, adam);
    dist::DistributedDataParallel plain_ddp(testing::make_fashion_mnist_mlp(), pg);
    nn::Adam plain(plain_ddp.parameters(), nn::AdamOptions{});
    double zero_ms = 0, plain_ms = 0;
    for (int round = 0; round < 2; ++round) {  // alternated, so machine noise hits both
      zero_ms += step_ms(zero_ddp, zero, x, y) / 2;
      plain_ms += step_ms(plain_ddp, plain, x, y) / 2;
    }
    std::vector<float> bytes(static_cast<size_t>(world), 0.0f);
    bytes[static_cast<size_t>(rank)] = static_cast<float>(zero.state_nbytes());
    bytes = dist::all_reduce_host(*pg, bytes, dist::ReduceOp::Sum);
    const std::vector<float> slowest =
        dist::all_reduce_host(*pg, std::vector<float>{static_cast<float>(zero_ms), static_cast<float>(plain_ms)},
                              dist::ReduceOp::Max);
    if (rank == 0) {
      std::printf("{\"bench\":\"zero\",\"world_size\":%d,\"state_bytes_per_rank\":[", world);
      for (int r = 0; r < world; ++r) std::printf("%s%.0f", r ? "," : "", bytes[static_cast<size_t>(r)]);
      std::printf("],\"unsharded_state_bytes\":%lld,\"step_ms_zero\":%.3f,\"step_ms_plain\":%.3f}\n",
                  static_cast<long long>(plain.state_nbytes()), slowest[0], slowest[1]);
      std::fflush(stdout);
    }
    pg->barrier()->wait();
    dist::destroy_process_group();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zero_bench: %s\n", message_of(e).c_str());
    return 1;
  }
}
