// DistributedDataParallel on real process groups: N ranks must train exactly like one rank on
// the concatenated batch. Each case runs its ranks on Gloo, forked (tests/multiprocess.h);
// the last cases run this same file again with NANODDP_TEST_BACKEND=shm (every case on the
// shared-memory group) and under `mpirun -np 2`, where every 2-rank case runs on the MPI
// backend with MPI's ranks.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <sstream>

#include "core/ops.h"
#include "dist/ddp.h"
#include "dist/init.h"
#include "dist/zero_redundancy_optimizer.h"
#include "nn/adam.h"
#include "nn/layers.h"
#include "nn/optim.h"
#include "tests/dist_ranks.h"
#include "tests/multiprocess.h"
#include "tests/subprocess.h"

using namespace nanoddp;
using nanoddp::testing::expect;
using nanoddp::testing::on_ranks;
using nanoddp::testing::under_mpirun;
using namespace std::chrono_literals;

namespace {

std::shared_ptr<nn::Sequential> make_mlp(uint64_t seed) {
  Generator gen(seed);
  auto model = std::make_shared<nn::Sequential>();
  model->add(nn::Linear(5, 8, gen));
  model->add(nn::ReLU());
  model->add(nn::Linear(8, 3, gen));
  return model;
}

// The global batch of step s: 16 samples; rank r of W takes rows [r*16/W, (r+1)*16/W).
struct Batch {
  Tensor x, y;
};
Batch global_batch(int step) {
  Generator gen(1000 + step);
  Tensor x = Tensor::randn({16, 5}, gen);
  std::vector<int64_t> labels;
  for (int i = 0; i < 16; ++i) labels.push_back(static_cast<int64_t>(gen.randint(3)));
  return {x, Tensor::from_vector(labels)};
}
Batch rows(const Batch& b, int64_t begin, int64_t end) {
  const int64_t F = b.x.size(1);
  std::vector<float> xs = b.x.to_vector();
  std::vector<int64_t> ys = b.y.to_int_vector();
  return {Tensor::from_vector(std::vector<float>(xs.begin() + begin * F, xs.begin() + end * F), {end - begin, F}),
          Tensor::from_vector(std::vector<int64_t>(ys.begin() + begin, ys.begin() + end))};
}

// This rank's process group: a fresh Gloo (or NANODDP_TEST_BACKEND) group on a forked rank,
// the one MPI group under mpirun (MPI is initialised once per process).
std::shared_ptr<dist::ProcessGroup> join(int rank, int world, int port) {
  dist::InitOptions options;
  options.timeout = std::chrono::seconds(30);
  if (under_mpirun()) {
    if (dist::is_initialized()) return dist::default_process_group();
    options.backend = dist::Backend::Mpi;
    return dist::init_process_group(options);
  }
  options.init_method = "tcp://127.0.0.1:" + std::to_string(port);
  options.rank = rank;
  options.world_size = world;
  const char* backend = std::getenv("NANODDP_TEST_BACKEND");
  options.backend = backend != nullptr ? dist::parse_backend(backend) : dist::Backend::Gloo;
  return dist::init_process_group(options);
}

// Largest |a - b| per parameter, for the failure message.
std::string compare(const std::vector<std::pair<std::string, Tensor>>& got, const std::vector<Tensor>& want,
                    float tolerance, bool* ok) {
  std::ostringstream report;
  *ok = true;
  for (size_t i = 0; i < want.size(); ++i) {
    const std::vector<float> a = got[i].second.to_vector(), b = want[i].to_vector();
    float worst = 0;
    for (size_t j = 0; j < a.size(); ++j) worst = std::max(worst, std::abs(a[j] - b[j]));
    report << got[i].first << ": max |diff| " << worst << "\n";
    if (!(worst <= tolerance)) *ok = false;
  }
  return report.str();
}

// One rank trained on the whole 16-sample batch: the reference.
std::vector<Tensor> train_reference(int steps, bool accumulate) {
  auto model = make_mlp(7);
  nn::SGD opt(model->parameters(), {/*lr=*/0.1f, /*momentum=*/0.9f});
  for (int s = 0; s < steps; ++s) {
    const Batch b = global_batch(s);
    opt.zero_grad();
    if (!accumulate) {
      cross_entropy((*model)(b.x), b.y).backward();
    } else {
      // 4 micro-batches of 4, each a mean; two ranks average two sums: total / 2.
      for (int m = 0; m < 4; ++m) {
        const Batch mb = rows(b, 4 * m, 4 * m + 4);
        (cross_entropy((*model)(mb.x), mb.y) * 0.5f).backward();
      }
    }
    opt.step();
  }
  return model->parameters();
}

}  // namespace

TEST_CASE("2 ranks x batch 8 train exactly like 1 rank on the batch of 16 (10 SGD steps)") {
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [port](int rank) {
    auto pg = join(rank, 2, port);
    // Rank 1 starts from other weights: wrapping must replace them with rank 0's.
    dist::DistributedDataParallel ddp(make_mlp(rank == 0 ? 7 : 99), pg);
    nn::SGD opt(ddp.parameters(), {/*lr=*/0.1f, /*momentum=*/0.9f});
    for (int s = 0; s < 10; ++s) {
      const Batch b = rows(global_batch(s), 8 * rank, 8 * rank + 8);
      opt.zero_grad();
      cross_entropy(ddp(b.x), b.y).backward();
      opt.step();
    }
    bool ok = false;
    const std::string report = compare(ddp.module().named_parameters(), train_reference(10, false), 1e-5f, &ok);
    expect(ok, "rank ", rank, " differs from the 1-rank reference:\n", report);
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("no_sync accumulation equals one rank accumulating all micro-batches") {
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [port](int rank) {
    auto pg = join(rank, 2, port);
    dist::DistributedDataParallel ddp(make_mlp(7), pg);
    nn::SGD opt(ddp.parameters(), {/*lr=*/0.1f, /*momentum=*/0.9f});
    for (int s = 0; s < 5; ++s) {
      const Batch b = global_batch(s);
      const Batch first = rows(b, 8 * rank, 8 * rank + 4), second = rows(b, 8 * rank + 4, 8 * rank + 8);
      opt.zero_grad();
      {
        auto guard = ddp.no_sync();
        cross_entropy(ddp(first.x), first.y).backward();
      }
      cross_entropy(ddp(second.x), second.y).backward();
      opt.step();
    }
    bool ok = false;
    const std::string report = compare(ddp.module().named_parameters(), train_reference(5, true), 1e-5f, &ok);
    expect(ok, "rank ", rank, " differs from the accumulating reference:\n", report);
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("counters: one all-reduce per bucket per optimizer step, none inside no_sync") {
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [port](int rank) {
    auto pg = join(rank, 2, port);
    dist::DDPOptions options;
    options.first_bucket_cap_bytes = 100;  // two buckets: 2.bias + 2.weight (108 B), 0.bias + 0.weight (192 B)
    options.bucket_cap_bytes = 150;
    dist::DistributedDataParallel ddp(make_mlp(7), pg, options);
    nn::SGD opt(ddp.parameters(), {/*lr=*/0.1f});
    pg->reset_counts();  // construction's all_gathers and broadcasts are not part of a step
    auto all_reduces = [&] { return pg->count(dist::Collective::AllReduce); };
    for (int s = 0; s < 3; ++s) {
      const Batch b = global_batch(s);
      const Batch first = rows(b, 8 * rank, 8 * rank + 4), second = rows(b, 8 * rank + 4, 8 * rank + 8);
      opt.zero_grad();
      {
        auto guard = ddp.no_sync();
        cross_entropy(ddp(first.x), first.y).backward();
      }
      expect(all_reduces().calls == 2 * s, "rank ", rank, " step ", s, ": ", all_reduces().calls,
             " all-reduces after the no_sync backward, expected ", 2 * s);
      cross_entropy(ddp(second.x), second.y).backward();
      opt.step();
      expect(all_reduces().calls == 2 * (s + 1) && all_reduces().bytes == 300 * (s + 1), "rank ", rank, " step ",
             s, ": ", all_reduces().calls, " all-reduces of ", all_reduces().bytes, " bytes, expected ",
             2 * (s + 1), " of ", 300 * (s + 1));
    }
    expect(pg->count(dist::Collective::Broadcast).calls == 0 && pg->count(dist::Collective::Barrier).calls == 0,
           "rank ", rank, ": training issued collectives other than all-reduce");
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("the reduced gradient is the mean over ranks, not the sum") {
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [port](int rank) {
    auto pg = join(rank, 2, port);
    // y = w * x with w = 1 (1x1 Linear without bias): dL/dw for L = sum(w x) is x.
    auto model = std::make_shared<nn::Linear>(1, 1, default_generator(), /*bias=*/false);
    model->weight.copy_(Tensor::from_vector({1.0f}, {1, 1}));
    dist::DistributedDataParallel ddp(model, pg);
    const float x = rank == 0 ? 2.0f : 6.0f;
    sum(ddp(Tensor::from_vector({x}, {1, 1}))).backward();
    // Mean of 2 and 6 is 4 (a sum would be 8), on both ranks.
    expect(model->weight.grad().item() == 4.0f, "rank ", rank, ": reduced gradient ", model->weight.grad().item());
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("an unused parameter is an error naming it, or zeros with find_unused_parameters") {
  struct TwoHeads : nn::Module {
    std::shared_ptr<nn::Linear> used = register_module("used", std::make_shared<nn::Linear>(2, 1));
    std::shared_ptr<nn::Linear> unused = register_module("unused", std::make_shared<nn::Linear>(2, 1));
    Tensor forward(const Tensor& x) override { return (*used)(x); }
  };
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [port](int rank) {
    auto pg = join(rank, 2, port);
    {
      dist::DistributedDataParallel ddp(std::make_shared<TwoHeads>(), pg);
      bool threw = false;
      try {
        sum(ddp(Tensor::ones({1, 2}))).backward();
      } catch (const DistError& e) {
        threw = std::string(e.what()).find("unused.weight, unused.bias") != std::string::npos;
      }
      expect(threw, "rank ", rank, ": no DistError naming unused.weight, unused.bias");
    }
    dist::DDPOptions options;
    options.find_unused_parameters = true;
    auto model = std::make_shared<TwoHeads>();
    dist::DistributedDataParallel ddp(model, pg, options);
    const float x = static_cast<float>(rank + 1);  // 1 and 2: mean 1.5
    sum(ddp(Tensor::full({1, 2}, x))).backward();
    expect(!model->unused->weight.grad().defined(), "rank ", rank, ": the unused parameter got a .grad");
    expect(model->used->weight.grad().to_vector() == std::vector<float>{1.5f, 1.5f}, "rank ", rank,
           ": used.weight.grad is ", model->used->weight.grad());
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("ranks with different models get an error naming the parameter") {
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [port](int rank) {
    auto pg = join(rank, 2, port);
    Generator gen(0);
    auto model = std::make_shared<nn::Sequential>();
    model->add(nn::Linear(4, rank == 0 ? 3 : 5, gen));
    bool named = false;
    try {
      dist::DistributedDataParallel ddp(model, pg);
    } catch (const DistError& e) {
      const std::string m = e.what();
      named = m.find("0.weight") != std::string::npos && m.find(rank == 0 ? "[5, 4]" : "[3, 4]") != std::string::npos;
    }
    expect(named, "rank ", rank, ": no DistError naming 0.weight and the other rank's shape");
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("buckets follow reverse registration order and the caps") {
  const int port = testing::free_port();
  const std::string failures = on_ranks(1, [port](int rank) {
    auto pg = join(rank, 1, port);
    auto model = make_mlp(7);  // 0.weight 160 B, 0.bias 32 B, 2.weight 96 B, 2.bias 12 B
    dist::DDPOptions options;
    options.first_bucket_cap_bytes = 100;  // 2.bias + 2.weight = 108 B >= 100: closes bucket 0
    options.bucket_cap_bytes = 150;        // 0.bias + 0.weight = 192 B
    dist::DistributedDataParallel ddp(model, pg, options);
    const auto plan = ddp.reducer().bucket_plan();
    expect(plan == std::vector<std::vector<size_t>>{{3, 2}, {1, 0}}, "unexpected bucket plan");
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

// ---- ZeroRedundancyOptimizer (ZeRO stage 1) --------------------------------------------------

namespace {
using LocalFactory = dist::ZeroRedundancyOptimizer::LocalOptimizerFactory;
const LocalFactory kSgdMomentum = [](std::vector<Tensor> p) {
  return std::make_unique<nn::SGD>(std::move(p), nn::SGDOptions{/*lr=*/0.1f, /*momentum=*/0.9f});
};
const LocalFactory kAdam = [](std::vector<Tensor> p) {
  return std::make_unique<nn::Adam>(std::move(p), nn::AdamOptions{/*lr=*/0.01f});
};

// One rank with the unsharded optimizer on the whole batch of 16, 5 steps.
std::vector<Tensor> train_unsharded(const LocalFactory& make) {
  auto model = make_mlp(7);
  std::unique_ptr<nn::Optimizer> opt = make(model->parameters());
  for (int s = 0; s < 5; ++s) {
    const Batch b = global_batch(s);
    opt->zero_grad();
    cross_entropy((*model)(b.x), b.y).backward();
    opt->step();
  }
  return model->parameters();
}

// On each of `world` ranks: DDP + ZeRO over SGD with momentum, then over Adam, 5 steps each,
// equal to the unsharded optimizer. make_mlp's parameters have 40, 8, 24 and 3 elements:
// sorted 40, 24, 8, 3, the greedy rule gives owners {0, 1, 1, 1} at 2 ranks (40 | 24+8+3)
// and {0, 2, 1, 3} at 4 ranks; state bytes per rank follow (4 bytes per element for SGD's
// momentum, 8 for Adam's two moments).
void check_zero(int world, const std::vector<int>& owners, const std::vector<int64_t>& sgd_bytes) {
  const std::vector<Tensor> want_sgd = train_unsharded(kSgdMomentum), want_adam = train_unsharded(kAdam);
  const int port = testing::free_port();
  const std::string failures = on_ranks(world, [&](int rank) {
    auto pg = join(rank, world, port);
    for (const bool adam : {false, true}) {
      dist::DistributedDataParallel ddp(make_mlp(7), pg);
      dist::ZeroRedundancyOptimizer opt(ddp.parameters(), pg, adam ? kAdam : kSgdMomentum);
      for (size_t i = 0; i < owners.size(); ++i) expect(opt.owner(i) == owners[i], "parameter ", i, " owned by ", opt.owner(i));
      const int64_t per_row = 16 / world;
      for (int s = 0; s < 5; ++s) {
        const Batch b = rows(global_batch(s), per_row * rank, per_row * rank + per_row);
        opt.zero_grad();
        cross_entropy(ddp(b.x), b.y).backward();
        opt.step();
      }
      bool ok = false;
      const std::string report = compare(ddp.module().named_parameters(), adam ? want_adam : want_sgd, 1e-5f, &ok);
      expect(ok, "rank ", rank, (adam ? " Adam" : " SGD"), " differs from the unsharded optimizer:\n", report);
      const int64_t bytes = sgd_bytes[static_cast<size_t>(rank)] * (adam ? 2 : 1);
      expect(opt.state_nbytes() == bytes, "rank ", rank, " holds ", opt.state_nbytes(), " bytes of state, not ", bytes);
      for (const auto& entry : opt.state_dict()) {
        const size_t index = std::stoul(entry.first.substr(entry.first.rfind('.') + 1));
        expect(opt.owner(index) == rank, "rank ", rank, " has state ", entry.first, " of a parameter it does not own");
      }
    }
  });
  CHECK_MESSAGE(failures.empty(), failures);
}
}  // namespace

TEST_CASE("ZeroRedundancyOptimizer on 2 and 4 ranks equals the unsharded SGD and Adam, with 1/W of the state") {
  // 1 rank holds all 75 elements: 300 bytes of momentum. Per rank at 2: 160, 140; at 4: 160, 96, 32, 12.
  check_zero(2, {0, 1, 1, 1}, {160, 140});
  if (!under_mpirun()) check_zero(4, {0, 2, 1, 3}, {160, 96, 32, 12});
}

TEST_CASE("the 2-rank cases pass on the MPI backend too (this file under mpirun -np 2)") {
  if (under_mpirun()) return;
  if (testing::run({"/bin/sh", "-c", "command -v mpirun"}).code() != 0) {
    MESSAGE("mpirun not found: the MPI half of this file did not run");
    return;
  }
  ::setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
  ::setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
  const testing::RunResult r =
      testing::run({"/bin/sh", "-c",
                    "exec mpirun -np 2 --oversubscribe --bind-to none \"$0\" --test-case-exclude='*mpirun*'",
                    testing::built("tests/test_ddp")},
                   120s);
  CHECK_MESSAGE(r.code() == 0, "mpirun run failed:\n", r.out, r.err);
}

TEST_CASE("every case passes on the shm backend too (this file with NANODDP_TEST_BACKEND=shm)") {
  if (under_mpirun() || std::getenv("NANODDP_TEST_BACKEND") != nullptr) return;
  const testing::RunResult r =
      testing::run({"/bin/sh", "-c",
                    "NANODDP_TEST_BACKEND=shm exec \"$0\" --test-case-exclude='*mpirun*,*NANODDP_TEST_BACKEND*'",
                    testing::built("tests/test_ddp")},
                   120s);
  CHECK_MESSAGE(r.code() == 0, "shm run failed:\n", r.out, r.err);
}
