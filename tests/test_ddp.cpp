// DistributedDataParallel on real process groups: N ranks must train exactly like one rank on
// the concatenated batch. Each case runs its ranks on Gloo, forked (tests/multiprocess.h);
// the last cases run this same file again with NANODDP_TEST_BACKEND=shm (every case on the
// shared-memory group) and under `mpirun -np 2`, where every 2-rank case runs on the MPI
// backend with MPI's ranks.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <sstream>
#include <tuple>

#include "core/half.h"
#include "core/ops.h"
#include "dist/comm_hooks.h"
#include "dist/ddp.h"
#include "dist/init.h"
#include "dist/zero_redundancy_optimizer.h"
#include "nn/adam.h"
#include "nn/batch_norm.h"
#include "nn/checkpoint.h"
#include "nn/layers.h"
#include "nn/optim.h"
#include "tests/batches.h"
#include "tests/dist_ranks.h"
#include "tests/multiprocess.h"
#include "tests/subprocess.h"

using namespace nanoddp;
using nanoddp::testing::Batch;
using nanoddp::testing::expect;
using nanoddp::testing::make_mlp;
using nanoddp::testing::rows;
using nanoddp::testing::on_ranks;
using nanoddp::testing::under_mpirun;
using namespace std::chrono_literals;

namespace {

// The global batch of step s: 16 samples; rank r of W takes rows [r*16/W, (r+1)*16/W).
Batch global_batch(int step) { return testing::random_batch(1000 + static_cast<uint64_t>(step), 16, 5, 3); }

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
  nn::SGD opt(model->parameters(), {/*lr=*/0.1, /*momentum=*/0.9f});
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
    std::vector<std::vector<float>> trained[2];
    for (const bool views : {false, true}) {
      dist::DDPOptions options;
      options.gradient_as_bucket_view = views;
      // Rank 1 starts from other weights: wrapping must replace them with rank 0's.
      dist::DistributedDataParallel ddp(make_mlp(rank == 0 ? 7 : 99), pg, options);
      nn::SGD opt(ddp.parameters(), {/*lr=*/0.1, /*momentum=*/0.9f});
      for (int s = 0; s < 10; ++s) {
        const Batch b = rows(global_batch(s), 8 * rank, 8 * rank + 8);
        // With views, .grad is zeroed in place (torch 1.13's default) and stays the bucket's,
        // except at step 5, where set_to_none makes the next backward copy into the bucket
        // and bind .grad to it again (Note [Gradient as bucket view]).
        opt.zero_grad(/*set_to_none=*/!views || s == 5);
        cross_entropy(ddp(b.x), b.y).backward();
        opt.step();
      }
      bool ok = false;
      const std::string report = compare(ddp.module().named_parameters(), train_reference(10, false), 1e-5f, &ok);
      expect(ok, "rank ", rank, (views ? " with" : " without"), " gradient_as_bucket_view differs from the 1-rank reference:\n", report);
      for (const Tensor& p : ddp.parameters()) trained[views].push_back(p.to_vector());
    }
    // In place or copied, the same float operations in the same order.
    expect(trained[0] == trained[1], "rank ", rank, ": gradient_as_bucket_view changed the trained parameters");
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("no_sync accumulation equals one rank accumulating all micro-batches, into bucket views too") {
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [port](int rank) {
    auto pg = join(rank, 2, port);
    for (const bool views : {false, true}) {
      dist::DDPOptions options;
      options.gradient_as_bucket_view = views;
      dist::DistributedDataParallel ddp(make_mlp(7), pg, options);
      nn::SGD opt(ddp.parameters(), {/*lr=*/0.1, /*momentum=*/0.9f});
      for (int s = 0; s < 5; ++s) {
        const Batch b = global_batch(s);
        const Batch first = rows(b, 8 * rank, 8 * rank + 4), second = rows(b, 8 * rank + 4, 8 * rank + 8);
        opt.zero_grad(/*set_to_none=*/!views);
        {
          auto guard = ddp.no_sync();
          cross_entropy(ddp(first.x), first.y).backward();
        }
        cross_entropy(ddp(second.x), second.y).backward();
        opt.step();
      }
      bool ok = false;
      const std::string report = compare(ddp.module().named_parameters(), train_reference(5, true), 1e-5f, &ok);
      expect(ok, "rank ", rank, (views ? " with" : " without"),
             " gradient_as_bucket_view differs from the accumulating reference:\n", report);
    }
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

// make_mlp's gradients become ready 2.weight, 2.bias, 0.weight, 0.bias (LinearBackward hands
// the engine a layer's weight before its bias), so with caps of 100 and 150 bytes the plan
// rebuilt after the first synced backward (Note [Bucket rebuild]) cuts other buckets than the
// first plan: {2.weight, 2.bias} (108 B >= 100), {0.weight} (160 B >= 150), {0.bias} (32 B).
const std::vector<std::vector<size_t>> kMlpFirstPlan = {{3, 2}, {1, 0}}, kMlpRebuiltPlan = {{2, 3}, {0}, {1}};

TEST_CASE("counters: one all-reduce per bucket per optimizer step, none inside no_sync") {
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [port](int rank) {
    auto pg = join(rank, 2, port);
    dist::DDPOptions options;
    options.first_bucket_cap_bytes = 100;  // two buckets: 2.bias + 2.weight (108 B), 0.bias + 0.weight (192 B)
    options.bucket_cap_bytes = 150;        // then three, from step 1: kMlpRebuiltPlan
    dist::DistributedDataParallel ddp(make_mlp(7), pg, options);
    nn::SGD opt(ddp.parameters(), {/*lr=*/0.1});
    pg->reset_counts();  // construction's all_gathers and broadcasts are not part of a step
    auto all_reduces = [&] { return pg->count(dist::Collective::AllReduce); };
    auto calls_after_step = [](int s) { return s < 0 ? 0 : 2 + 3 * s; };  // 2 buckets in step 0, then 3
    for (int s = 0; s < 3; ++s) {
      const Batch b = global_batch(s);
      const Batch first = rows(b, 8 * rank, 8 * rank + 4), second = rows(b, 8 * rank + 4, 8 * rank + 8);
      opt.zero_grad();
      {
        auto guard = ddp.no_sync();
        cross_entropy(ddp(first.x), first.y).backward();
      }
      expect(all_reduces().calls == calls_after_step(s - 1), "rank ", rank, " step ", s, ": ", all_reduces().calls,
             " all-reduces after the no_sync backward, expected ", calls_after_step(s - 1));
      cross_entropy(ddp(second.x), second.y).backward();
      opt.step();
      expect(all_reduces().calls == calls_after_step(s) && all_reduces().bytes == 300 * (s + 1), "rank ", rank,
             " step ", s, ": ", all_reduces().calls, " all-reduces of ", all_reduces().bytes, " bytes, expected ",
             calls_after_step(s), " of ", 300 * (s + 1));
      expect(ddp.reducer().bucket_plan() == (s == 0 ? kMlpFirstPlan : kMlpRebuiltPlan), "rank ", rank, " step ", s,
             ": unexpected bucket plan");
    }
    // The one broadcast: rank 0's ready order (4 int64) for the re-plan, in step 1's synced forward.
    const dist::CollectiveCount broadcasts = pg->count(dist::Collective::Broadcast);
    expect(broadcasts.calls == 1 && broadcasts.bytes == 32 && pg->count(dist::Collective::Barrier).calls == 0,
           "rank ", rank, ": training issued ", broadcasts.calls, " broadcasts of ", broadcasts.bytes,
           " bytes (expected the re-plan's 1 of 32) or a barrier");
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

TEST_CASE("with find_unused_parameters, a rank that skipped a parameter contributes the .grad it holds") {
  // y = a x + (b x when use_b): dL/da = dL/db = x, with x = rank + 1. Gradients are never
  // zeroed, so they accumulate over the three backwards. torch's reducer puts a skipped
  // parameter's existing .grad in its bucket slot (mark_variable_ready_dense); zeros there
  // gave b 1.25 after step 2 instead of 2 (and, with bucket views, zeros after step 3).
  struct Branch : nn::Module {
    std::shared_ptr<nn::Linear> a =
        register_module("a", std::make_shared<nn::Linear>(1, 1, default_generator(), false));
    std::shared_ptr<nn::Linear> b =
        register_module("b", std::make_shared<nn::Linear>(1, 1, default_generator(), false));
    bool use_b = true;
    Tensor forward(const Tensor& x) override { return use_b ? (*a)(x) + (*b)(x) : (*a)(x); }
  };
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [port](int rank) {
    auto pg = join(rank, 2, port);
    for (bool views : {false, true}) {
      dist::DDPOptions options;
      options.find_unused_parameters = true;
      options.gradient_as_bucket_view = views;
      auto model = std::make_shared<Branch>();
      dist::DistributedDataParallel ddp(model, pg, options);
      const Tensor x = Tensor::full({1, 1}, static_cast<float>(rank + 1));
      auto step = [&](bool use_b, float a_grad, float b_grad) {
        model->use_b = use_b;
        sum(ddp(x)).backward();
        expect(model->a->weight.grad().item() == a_grad && model->b->weight.grad().item() == b_grad, "rank ",
               rank, " views ", views, " use_b ", use_b, ": a.grad ", model->a->weight.grad().item(),
               " (expected ", a_grad, "), b.grad ", model->b->weight.grad().item(), " (expected ", b_grad,
               ")");
      };
      step(true, 1.5f, 1.5f);  // means of 1 and 2
      // Rank 1 skips b: a is mean(1.5 + 1, 1.5 + 2) = 3; b is mean(1.5 + 1, 1.5) = 2.
      step(rank == 0, 3.0f, 2.0f);
      // No rank uses b: a is mean(3 + 1, 3 + 2) = 4.5; b keeps 2 (the mean of two 2s with views).
      step(false, 4.5f, 2.0f);
    }
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

namespace {

// A module whose buffers are registered per rank by the test, and one parameter that is the
// same everywhere (DDP refuses a module with nothing to train).
struct BuffersOnly : nn::Module {
  BuffersOnly() { register_parameter("scale", Tensor::ones({1}).set_requires_grad(true)); }
  Tensor forward(const Tensor& input) override { return input; }
};

// Constructs DDP over model and returns the DistError's text ("" when construction succeeds).
std::string construction_error(std::shared_ptr<nn::Module> model, std::shared_ptr<dist::ProcessGroup> pg) {
  try {
    dist::DistributedDataParallel ddp(std::move(model), std::move(pg));
  } catch (const DistError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("ranks with different models get an error naming the parameter or buffer and the other rank") {
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [port](int rank) {
    auto pg = join(rank, 2, port);
    const int other = 1 - rank;
    auto contains = [](const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; };
    Generator gen(0);
    auto model = std::make_shared<nn::Sequential>();
    model->add(nn::Linear(4, rank == 0 ? 3 : 5, gen));
    std::string m = construction_error(model, pg);
    expect(contains(m, "0.weight") && contains(m, rank == 0 ? "[5, 4]" : "[3, 4]"),
           "rank ", rank, ": no DistError naming 0.weight and the other rank's shape: ", m);

    // Buffers are checked as parameters are (every case in this one launch: a failed
    // construction leaves both ranks after the same collectives). BatchNorm's running stats of
    // 3 and 4 features: the flat broadcast would have had 7 and 9 floats.
    auto norm = std::make_shared<nn::Sequential>();
    norm->add(nn::BatchNorm1d(rank == 0 ? 3 : 4, 1e-5f, 0.1f, /*affine=*/false));
    norm->add(nn::Linear(1, 1, gen));
    m = construction_error(norm, pg);
    expect(contains(m, "DDP on rank " + std::to_string(rank) + "/2: buffer #0 '0.running_mean' [" +
                           (rank == 0 ? "3" : "4") + "] differs from rank " + std::to_string(other) +
                           "'s buffer #0 of shape [" + (rank == 0 ? "4" : "3") + "]"),
           "rank ", rank, ": ", m);
    // The same number of values in another shape: the broadcast would have gone through and
    // filled each rank's buffer with the other's values in the wrong places.
    auto transposed = std::make_shared<BuffersOnly>();
    transposed->register_buffer("stats", rank == 0 ? Tensor::zeros({2, 3}) : Tensor::zeros({3, 2}));
    m = construction_error(transposed, pg);
    expect(contains(m, "buffer #0 'stats' [" + std::string(rank == 0 ? "2, 3" : "3, 2") + "] differs from rank " +
                           std::to_string(other) + "'s buffer #0 of shape [" + (rank == 0 ? "3, 2" : "2, 3") + "]"),
           "rank ", rank, ": ", m);
    auto counted = std::make_shared<BuffersOnly>();
    counted->register_buffer("stats", Tensor::zeros({2}));
    if (rank == 1) counted->register_buffer("extra", Tensor::zeros({2}));
    m = construction_error(counted, pg);
    expect(contains(m, rank == 0 ? "this rank has 1 buffers but rank 1 has 2" : "this rank has 2 buffers but rank 0 has 1"),
           "rank ", rank, ": ", m);
    auto typed = std::make_shared<BuffersOnly>();
    typed->register_buffer("steps", rank == 0 ? Tensor::zeros({2}) : Tensor::zeros({2}, DType::Int64));
    m = construction_error(typed, pg);
    expect(contains(m, rank == 0 ? "buffer #0 'steps' is float32 here but int64 on rank 1"
                                 : "buffer #0 'steps' is int64 here but float32 on rank 0"),
           "rank ", rank, ": ", m);

    // Matching buffers still pass, and rank 0's values reach rank 1.
    auto same = std::make_shared<BuffersOnly>();
    same->register_buffer("stats", Tensor::full({2, 3}, rank == 0 ? 1.5f : -1.0f));
    m = construction_error(same, pg);
    expect(m.empty(), "rank ", rank, ": ", m);
    expect(same->named_buffers()[0].second.to_vector() == std::vector<float>(6, 1.5f), "rank ", rank,
           ": buffer not rank 0's");
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

namespace {

// What a compression hook must produce, computed here from the rule: each rank rounds its
// values to 16 bits and divides by world size in 16 bits; the ranks' results are summed in
// 16 bits (widen, add, round: exact whatever the order when no sum needs rounding, and for
// two ranks a single rounding of a + b).
template <typename T>
std::vector<float> compressed_mean(const std::vector<std::vector<float>>& per_rank) {
  const float world = static_cast<float>(per_rank.size());
  std::vector<float> mean(per_rank[0].size(), 0.0f);
  for (const auto& values : per_rank)
    for (size_t i = 0; i < values.size(); ++i) {
      const float part = T::from_float(T::from_float(values[i]).to_float() / world).to_float();
      mean[i] = T::from_float(mean[i] + part).to_float();
    }
  return mean;
}

// Rank r's gradients of make_mlp(7) on its 8 rows of global batch 0, in registration order.
std::vector<std::vector<float>> local_gradients(int rank, int world) {
  auto model = make_mlp(7);
  const int64_t per_rank = 16 / world;
  const Batch b = rows(global_batch(0), per_rank * rank, per_rank * rank + per_rank);
  cross_entropy((*model)(b.x), b.y).backward();
  std::vector<std::vector<float>> grads;
  for (Tensor& p : model->parameters()) grads.push_back(p.grad().to_vector());
  return grads;
}

}  // namespace

TEST_CASE("comm hooks: allreduce_hook equals the default path; a hook sees each bucket once, in plan order") {
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [port](int rank) {
    auto pg = join(rank, 2, port);
    dist::DDPOptions options;
    options.first_bucket_cap_bytes = 100;  // kMlpFirstPlan in step 0, kMlpRebuiltPlan after
    options.bucket_cap_bytes = 150;
    dist::DistributedDataParallel plain(make_mlp(7), pg, options), hooked(make_mlp(7), pg, options);
    struct Seen {
      size_t index;
      std::vector<int64_t> offsets;
      int64_t numel;
      size_t parameters;
      bool is_last;
    };
    auto seen = std::make_shared<std::vector<Seen>>();
    hooked.register_comm_hook(std::shared_ptr<dist::ProcessGroup>(),  // null: DDP's own group
                              [seen](std::shared_ptr<dist::ProcessGroup>& group, dist::GradBucket& bucket) {
                                seen->push_back({bucket.index(), bucket.offsets(), bucket.buffer().numel(),
                                                 bucket.parameters().size(), bucket.is_last()});
                                return dist::allreduce_hook(group, bucket);
                              });
    bool threw_twice = false;
    try {
      hooked.register_comm_hook(pg, dist::allreduce_hook);
    } catch (const ValueError& e) {
      threw_twice = std::string(e.what()).find("only be called once") != std::string::npos;
    }
    expect(threw_twice, "rank ", rank, ": a second register_comm_hook was accepted");
    nn::SGD plain_opt(plain.parameters(), {/*lr=*/0.1, /*momentum=*/0.9f});
    nn::SGD hooked_opt(hooked.parameters(), {/*lr=*/0.1, /*momentum=*/0.9f});
    for (int s = 0; s < 3; ++s) {
      const Batch b = rows(global_batch(s), 8 * rank, 8 * rank + 8);
      for (auto [ddp, opt] : {std::pair{&plain, &plain_opt}, std::pair{&hooked, &hooked_opt}}) {
        opt->zero_grad();
        cross_entropy((*ddp)(b.x), b.y).backward();
        opt->step();
      }
    }
    const auto want = plain.module().parameters();
    const auto got = hooked.module().parameters();
    for (size_t i = 0; i < want.size(); ++i)
      expect(got[i].to_vector() == want[i].to_vector(), "rank ", rank, ": parameter ", i,
             " differs between allreduce_hook and the default path");
    // Step 0, kMlpFirstPlan: bucket 0 = 2.bias (3) + 2.weight (24), 1 = 0.bias (8) + 0.weight (40).
    // Steps 1 and 2, kMlpRebuiltPlan: 0 = 2.weight (24) + 2.bias (3), 1 = 0.weight (40), 2 = 0.bias (8).
    const std::vector<Seen> want_seen = {{0, {0, 3}, 27, 2, false}, {1, {0, 8}, 48, 2, true},
                                         {0, {0, 24}, 27, 2, false}, {1, {0}, 40, 1, false},
                                         {2, {0}, 8, 1, true},       {0, {0, 24}, 27, 2, false},
                                         {1, {0}, 40, 1, false},     {2, {0}, 8, 1, true}};
    expect(seen->size() == want_seen.size(), "rank ", rank, ": the hook ran ", seen->size(),
           " times in 3 steps, expected ", want_seen.size(), " (2 buckets, then 3 after the re-plan)");
    for (size_t call = 0; call < std::min(seen->size(), want_seen.size()); ++call) {
      const Seen& bucket = (*seen)[call];
      const Seen& want_bucket = want_seen[call];
      expect(bucket.index == want_bucket.index && bucket.offsets == want_bucket.offsets &&
                 bucket.numel == want_bucket.numel && bucket.parameters == want_bucket.parameters &&
                 bucket.is_last == want_bucket.is_last,
             "rank ", rank, ": hook call ", call, " saw bucket ", bucket.index, " of ", bucket.numel, " elements in ",
             bucket.parameters, " parameters, is_last ", bucket.is_last, "; expected bucket ", want_bucket.index,
             " of ", want_bucket.numel, " in ", want_bucket.parameters);
    }
    bool threw_late = false;
    try {
      plain.register_comm_hook(pg, dist::allreduce_hook);
    } catch (const ValueError& e) {
      threw_late = std::string(e.what()).find("before the first backward") != std::string::npos;
    }
    expect(threw_late, "rank ", rank, ": register_comm_hook after a backward was accepted");
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("fp16 and bf16 compression hooks: the mean of the rounded values, in half the bytes") {
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [port](int rank) {
    auto pg = join(rank, 2, port);
    dist::DDPOptions options;
    options.first_bucket_cap_bytes = 100;
    options.bucket_cap_bytes = 150;
    std::vector<std::vector<float>> grads[2] = {local_gradients(0, 2), local_gradients(1, 2)};
    using Hook = std::shared_ptr<dist::Future> (*)(std::shared_ptr<dist::ProcessGroup>&, dist::GradBucket&);
    for (const auto& [name, hook, bfloat] : {std::tuple{"fp16", Hook{dist::fp16_compress_hook}, false},
                                            std::tuple{"bf16", Hook{dist::bf16_compress_hook}, true}}) {
      auto model = make_mlp(7);
      dist::DistributedDataParallel ddp(model, pg, options);
      ddp.register_comm_hook(pg, hook);
      pg->reset_counts();
      const Batch b = rows(global_batch(0), 8 * rank, 8 * rank + 8);
      cross_entropy(ddp(b.x), b.y).backward();
      // The uncompressed step moves 300 bytes in 2 all-reduces (the counters case above).
      const dist::CollectiveCount count = pg->count(dist::Collective::AllReduce);
      expect(count.calls == 2 && count.bytes == 150, "rank ", rank, " ", name, ": ", count.calls,
             " all-reduces of ", count.bytes, " bytes, expected 2 of 150");
      const auto params = model->parameters();
      bool rounding_showed = false;
      for (size_t i = 0; i < params.size(); ++i) {
        const std::vector<float> want = bfloat ? compressed_mean<BFloat16>({grads[0][i], grads[1][i]})
                                               : compressed_mean<Float16>({grads[0][i], grads[1][i]});
        const std::vector<float> got = params[i].grad().to_vector();
        expect(got == want, "rank ", rank, " ", name, ": parameter ", i, "'s gradient is not the 16-bit mean");
        for (size_t j = 0; j < got.size(); ++j)
          rounding_showed |= got[j] != (grads[0][i][j] / 2 + grads[1][i][j] / 2);
      }
      expect(rounding_showed, "rank ", rank, " ", name, ": no gradient differs from the float32 mean");
    }
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("DDPOptions::reduce_dtype: the compression hooks' 16-bit mean in half the bytes; no second hook") {
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [port](int rank) {
    auto pg = join(rank, 2, port);
    std::vector<std::vector<float>> grads[2] = {local_gradients(0, 2), local_gradients(1, 2)};
    for (const DType dtype : {DType::Float16, DType::BFloat16}) {
      dist::DDPOptions options;
      options.first_bucket_cap_bytes = 100;
      options.bucket_cap_bytes = 150;
      options.reduce_dtype = dtype;
      auto model = make_mlp(7);
      dist::DistributedDataParallel ddp(model, pg, options);
      pg->reset_counts();
      const Batch b = rows(global_batch(0), 8 * rank, 8 * rank + 8);
      cross_entropy(ddp(b.x), b.y).backward();
      // 75 float32 gradients: 300 bytes in float32, 150 in 16 bits, in the same 2 buckets.
      const dist::CollectiveCount count = pg->count(dist::Collective::AllReduce);
      expect(count.calls == 2 && count.bytes == 150, "rank ", rank, " ", dtype, ": ", count.calls,
             " all-reduces of ", count.bytes, " bytes, expected 2 of 150");
      const auto params = model->parameters();
      for (size_t i = 0; i < params.size(); ++i) {
        const std::vector<float> want = dtype == DType::BFloat16
                                            ? compressed_mean<BFloat16>({grads[0][i], grads[1][i]})
                                            : compressed_mean<Float16>({grads[0][i], grads[1][i]});
        expect(params[i].grad().dtype() == DType::Float32 && params[i].grad().to_vector() == want, "rank ", rank,
               " ", dtype, ": parameter ", i, "'s gradient is not the 16-bit mean");
      }
      bool refused = false;
      try {
        ddp.register_comm_hook(pg, dist::allreduce_hook);
      } catch (const ValueError&) {
        refused = true;
      }
      expect(refused, "rank ", rank, ": a comm hook was accepted on top of reduce_dtype ", dtype);
    }
    dist::DDPOptions bad;
    bad.reduce_dtype = DType::Int64;
    bool threw = false;
    try {
      dist::DistributedDataParallel ddp(make_mlp(7), pg, bad);
    } catch (const ValueError&) {
      threw = true;
    }
    expect(threw, "rank ", rank, ": reduce_dtype int64 was accepted");
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("compression hooks at 4 ranks: each rank's rounded share, summed in 16 bits") {
  const int port = testing::free_port();
  const std::string failures = on_ranks(4, [port](int rank) {
    auto pg = join(rank, 4, port);
    // Rank r holds (i + r) / 4 plus a part below half a 16-bit unit, which rounding drops;
    // every partial sum of the shares is a multiple of 1/16 below 3, exact in both formats,
    // so the result does not depend on the order the backend adds the ranks in.
    auto values = [](int r) {
      std::vector<float> v;
      for (int i = 0; i < 8; ++i) v.push_back(static_cast<float>(i + r) / 4 + std::ldexp(1.0f, -20) * (i % 3));
      return v;
    };
    const std::vector<std::vector<float>> all = {values(0), values(1), values(2), values(3)};
    for (DType format : {DType::Float16, DType::BFloat16}) {
      Tensor buffer = Tensor::from_vector(values(rank));
      dist::GradBucket bucket(0, buffer, {}, {0}, true);
      pg->reset_counts();
      auto future = format == DType::Float16 ? dist::fp16_compress_hook(pg, bucket) : dist::bf16_compress_hook(pg, bucket);
      const std::vector<float> got = future->wait(std::chrono::seconds(30)).to_vector();
      const std::vector<float> want =
          format == DType::Float16 ? compressed_mean<Float16>(all) : compressed_mean<BFloat16>(all);
      expect(got == want && buffer.to_vector() == want, "rank ", rank, " ", format, ": not the 16-bit mean");
      std::vector<float> exact(8, 0.0f);
      for (const auto& v : all)
        for (size_t i = 0; i < 8; ++i) exact[i] += v[i] / 4;
      expect(got != exact, "rank ", rank, " ", format, ": equals the float32 mean; the rounding did not show");
      expect(pg->count(dist::Collective::AllReduce).bytes == 16, "rank ", rank, " ", format, ": ",
             pg->count(dist::Collective::AllReduce).bytes, " bytes all-reduced, expected 8 x 2");
    }
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("gradient_as_bucket_view: each .grad is its slot of the buffer a comm hook sees, across steps and the bucket rebuild") {
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [port](int rank) {
    auto pg = join(rank, 2, port);
    const std::vector<std::vector<float>> grads[2] = {local_gradients(0, 2), local_gradients(1, 2)};
    dist::DDPOptions options;
    options.first_bucket_cap_bytes = 100;  // buckets {2.bias, 2.weight} and {0.bias, 0.weight}
    options.bucket_cap_bytes = 150;
    options.gradient_as_bucket_view = true;
    auto model = make_mlp(7);
    dist::DistributedDataParallel ddp(model, pg, options);
    auto buffers = std::make_shared<std::vector<dist::GradBucket>>();
    ddp.register_comm_hook(pg, [buffers](std::shared_ptr<dist::ProcessGroup>& group, dist::GradBucket& bucket) {
      buffers->push_back(bucket);
      return dist::allreduce_hook(group, bucket);
    });
    const auto params = model->parameters();
    // Every .grad is its slot of the buffer its hook saw: same memory, at its offset, and the
    // buffer is the gradients side by side; each .grad holds the exact mean a / 2 + b / 2.
    auto check_buckets = [&](size_t first, size_t count, const char* when) {
      expect(buffers->size() == first + count, "rank ", rank, " ", when, ": the hook saw ", buffers->size() - first,
             " buckets, expected ", count);
      for (size_t call = first; call < buffers->size(); ++call) {
        const dist::GradBucket& bucket = (*buffers)[call];
        std::vector<float> concatenated;
        for (size_t i = 0; i < bucket.parameters().size(); ++i) {
          const Tensor grad = bucket.parameters()[i].grad();
          expect(grad.is_alias_of(bucket.buffer()) &&
                     grad.storage_offset() == bucket.buffer().storage_offset() + bucket.offsets()[i],
                 "rank ", rank, " ", when, ": bucket ", bucket.index(), " parameter ", i,
                 "'s .grad is not its slot of the buffer");
          const std::vector<float> g = grad.to_vector();
          concatenated.insert(concatenated.end(), g.begin(), g.end());
        }
        expect(bucket.buffer().to_vector() == concatenated, "rank ", rank, " ", when, ": bucket ", bucket.index(),
               "'s buffer is not its gradients side by side");
      }
      for (size_t i = 0; i < params.size(); ++i) {
        std::vector<float> mean;
        for (size_t j = 0; j < grads[0][i].size(); ++j) mean.push_back(grads[0][i][j] / 2 + grads[1][i][j] / 2);
        expect(params[i].grad().to_vector() == mean, "rank ", rank, " ", when, ": parameter ", i,
               "'s .grad is not the mean");
      }
    };
    const Batch b = rows(global_batch(0), 8 * rank, 8 * rank + 8);
    cross_entropy(ddp(b.x), b.y).backward();
    check_buckets(0, 2, "step 1");
    // Writes go both ways: through a .grad into the buffer, through the buffer into every .grad.
    const dist::GradBucket last = buffers->back();  // {0.bias (8), 0.weight (40)}
    params[1].grad().fill_(7.0f);                   // 0.bias: the first 8 elements
    const std::vector<float> seen = last.buffer().to_vector();
    expect(std::vector<float>(seen.begin(), seen.begin() + 8) == std::vector<float>(8, 7.0f), "rank ", rank,
           ": a write through .grad did not reach the buffer");
    Tensor(last.buffer()).fill_(3.0f);
    expect(params[0].grad().to_vector() == std::vector<float>(40, 3.0f), "rank ", rank,
           ": a write through the buffer did not reach .grad");
    // The next forward re-plans the buckets ({2.weight, 2.bias}, {0.weight}, {0.bias}: Note
    // [Bucket rebuild]); each .grad moves into its new slot with its values.
    std::vector<std::vector<float>> before;
    for (const Tensor& p : params) before.push_back(p.grad().to_vector());
    const Tensor out = ddp(b.x);
    expect(ddp.reducer().buckets_rebuilt(), "rank ", rank, ": the buckets were not rebuilt");
    std::vector<Tensor> rebound;
    for (size_t i = 0; i < params.size(); ++i) {
      rebound.push_back(params[i].grad());
      expect(params[i].grad().to_vector() == before[i] && !params[i].grad().is_alias_of(last.buffer()), "rank ", rank,
             ": parameter ", i, "'s .grad did not move into the new buckets with its values");
    }
    // The next step keeps those tensors: zeroed in place, filled by backward, reduced there.
    nn::SGD opt(ddp.parameters(), {/*lr=*/0.1});
    opt.zero_grad(/*set_to_none=*/false);
    cross_entropy(out, b.y).backward();
    check_buckets(2, 3, "step 2, rebuilt");
    for (size_t i = 0; i < params.size(); ++i)
      expect(params[i].grad().is_same(rebound[i]), "rank ", rank, ": parameter ", i,
             "'s .grad was replaced in the second step");
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("gradient_as_bucket_view with find_unused_parameters and a frozen layer") {
  // always: used on both ranks; rank1_only: used by rank 1 only; never: unused; frozen: no grad.
  struct Branches : nn::Module {
    std::shared_ptr<nn::Linear> always = register_module("always", std::make_shared<nn::Linear>(2, 1));
    std::shared_ptr<nn::Linear> rank1_only = register_module("rank1_only", std::make_shared<nn::Linear>(2, 1));
    std::shared_ptr<nn::Linear> never = register_module("never", std::make_shared<nn::Linear>(2, 1));
    std::shared_ptr<nn::Linear> frozen = register_module("frozen", std::make_shared<nn::Linear>(2, 1));
    bool use_rank1_only = false;
    Tensor forward(const Tensor& x) override {
      Tensor y = (*always)(x) + (*frozen)(x);
      return use_rank1_only ? y + (*rank1_only)(x) : y;
    }
  };
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [port](int rank) {
    auto pg = join(rank, 2, port);
    auto model = std::make_shared<Branches>();
    model->frozen->weight.set_requires_grad(false);
    model->frozen->bias.set_requires_grad(false);
    model->use_rank1_only = rank == 1;
    dist::DDPOptions options;
    options.find_unused_parameters = true;
    options.gradient_as_bucket_view = true;
    dist::DistributedDataParallel ddp(model, pg, options);
    nn::SGD opt(ddp.parameters(), {/*lr=*/0.1});
    for (int step = 0; step < 2; ++step) {
      opt.zero_grad(/*set_to_none=*/false);
      const float x = static_cast<float>(rank + 1);  // 1 and 2
      sum(ddp(Tensor::full({1, 2}, x))).backward();
      // d sum / d weight = x: mean 1.5; rank1_only's: (0 + 2) / 2 = 1, its bias (0 + 1) / 2.
      expect(model->always->weight.grad().to_vector() == std::vector<float>{1.5f, 1.5f} &&
                 model->rank1_only->weight.grad().to_vector() == std::vector<float>{1.0f, 1.0f} &&
                 model->rank1_only->bias.grad().to_vector() == std::vector<float>{0.5f},
             "rank ", rank, " step ", step, ": always.weight.grad ", model->always->weight.grad(),
             " rank1_only.weight.grad ", model->rank1_only->weight.grad());
      expect(model->rank1_only->weight.grad().is_alias_of(model->always->weight.grad()), "rank ", rank,
             ": rank1_only.weight.grad is not in the bucket");
      expect(!model->never->weight.grad().defined() && !model->frozen->weight.grad().defined(), "rank ", rank,
             ": an unused or frozen parameter got a .grad");
      opt.step();
    }
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

// ---- ZeroRedundancyOptimizer (ZeRO stage 1) --------------------------------------------------

namespace {
using LocalFactory = dist::ZeroRedundancyOptimizer::LocalOptimizerFactory;
const LocalFactory kSgdMomentum = [](std::vector<Tensor> p) {
  return std::make_unique<nn::SGD>(std::move(p), nn::SGDOptions{/*lr=*/0.1, /*momentum=*/0.9f});
};
const LocalFactory kAdam = [](std::vector<Tensor> p) {
  return std::make_unique<nn::Adam>(std::move(p), nn::AdamOptions{/*lr=*/0.01});
};

// One rank with the unsharded optimizer on the whole batch of 16, 5 steps.
std::vector<Tensor> train_unsharded(const LocalFactory& make, nn::StateDict* state = nullptr) {
  auto model = make_mlp(7);
  std::unique_ptr<nn::Optimizer> opt = make(model->parameters());
  for (int s = 0; s < 5; ++s) {
    const Batch b = global_batch(s);
    opt->zero_grad();
    cross_entropy((*model)(b.x), b.y).backward();
    opt->step();
  }
  if (state) *state = opt->state_dict();
  return model->parameters();
}

// Runs fn on a rank; throws unless it throws an E whose message contains part.
template <typename E>
void expect_throws(const std::function<void()>& fn, const std::string& part) {
  try {
    fn();
  } catch (const E& e) {
    expect(std::string(e.what()).find(part) != std::string::npos, "expected '", part, "' in: ", e.what());
    return;
  }
  expect(false, "no exception; expected one with '", part, "'");
}

// On each of `world` ranks: DDP + ZeRO over SGD with momentum, then over Adam, 5 steps each,
// equal to the unsharded optimizer. make_mlp's parameters have 40, 8, 24 and 3 elements:
// sorted 40, 24, 8, 3, the greedy rule gives owners {0, 1, 1, 1} at 2 ranks (40 | 24+8+3)
// and {0, 2, 1, 3} at 4 ranks; state bytes per rank follow (4 bytes per element for SGD's
// momentum, 8 for Adam's two moments).
void check_zero(int world, const std::vector<int>& owners, const std::vector<int64_t>& sgd_bytes) {
  nn::StateDict sgd_state, adam_state;
  const std::vector<Tensor> want_sgd = train_unsharded(kSgdMomentum, &sgd_state),
                            want_adam = train_unsharded(kAdam, &adam_state);
  const int port = testing::free_port();
  const std::string failures = on_ranks(world, [&](int rank) {
    auto pg = join(rank, world, port);
    for (const bool adam : {false, true}) {
      // The Adam run keeps its gradients in the buckets (gradient_as_bucket_view, zeroed in
      // place): the sharded step must read them there the same.
      dist::DDPOptions options;
      options.gradient_as_bucket_view = adam;
      dist::DistributedDataParallel ddp(make_mlp(7), pg, options);
      dist::ZeroRedundancyOptimizer opt(ddp.parameters(), pg, adam ? kAdam : kSgdMomentum);
      for (size_t i = 0; i < owners.size(); ++i) expect(opt.owner(i) == owners[i], "parameter ", i, " owned by ", opt.owner(i));
      const int64_t per_row = 16 / world;
      for (int s = 0; s < 5; ++s) {
        const Batch b = rows(global_batch(s), per_row * rank, per_row * rank + per_row);
        opt.zero_grad(/*set_to_none=*/!adam);
        cross_entropy(ddp(b.x), b.y).backward();
        opt.step();
      }
      bool ok = false;
      const std::string report = compare(ddp.module().named_parameters(), adam ? want_adam : want_sgd, 1e-5f, &ok);
      expect(ok, "rank ", rank, (adam ? " Adam" : " SGD"), " differs from the unsharded optimizer:\n", report);
      const int64_t bytes = sgd_bytes[static_cast<size_t>(rank)] * (adam ? 2 : 1);
      expect(opt.state_nbytes() == bytes, "rank ", rank, " holds ", opt.state_nbytes(), " bytes of state, not ", bytes);
      for (const auto& entry : opt.local_state_dict()) {
        if (entry.first == dist::ZeroRedundancyOptimizer::kOwnedParametersKey) continue;
        const size_t index = std::stoul(entry.first.substr(entry.first.rfind('.') + 1));
        expect(opt.owner(index) == rank, "rank ", rank, " has state ", entry.first, " of a parameter it does not own");
      }
      // consolidate_state_dict onto the last rank: there, the unsharded optimizer's state, key
      // for key; elsewhere, as before it, state_dict() refuses (torch raises), and
      // local_state_dict() is still the shard.
      const size_t shard_entries = opt.local_state_dict().size();
      expect_throws<ValueError>([&] { (void)opt.state_dict(); },
                                "the state has not been consolidated on this rank");
      opt.consolidate_state_dict(world - 1);
      const nn::StateDict& want_state = adam ? adam_state : sgd_state;
      if (rank == world - 1) {
        const nn::StateDict got_state = opt.state_dict();
        expect(got_state.size() == want_state.size(), "rank ", rank, ": consolidated ", got_state.size(),
               " entries, the unsharded optimizer has ", want_state.size());
        for (const auto& [key, want] : want_state) {
          const auto it = got_state.find(key);
          expect(it != got_state.end(), "rank ", rank, ": no consolidated entry ", key);
          if (it == got_state.end()) continue;
          const std::vector<float> g = it->second.dtype() == DType::Float32 ? it->second.to_vector() : std::vector<float>{};
          const std::vector<float> w = want.dtype() == DType::Float32 ? want.to_vector() : std::vector<float>{};
          expect(it->second.shape() == want.shape() && g.size() == w.size(), "rank ", rank, ": entry ", key, " is ",
                 it->second.shape(), ", not ", want.shape());
          for (size_t i = 0; i < std::min(g.size(), w.size()); ++i)
            expect(std::abs(g[i] - w[i]) <= 1e-5f * std::max(1.0f, std::abs(w[i])), "rank ", rank, ": ", key, "[", i,
                   "] = ", g[i], ", unsharded ", w[i]);
        }
      } else {
        expect_throws<ValueError>([&] { (void)opt.state_dict(); }, "call consolidate_state_dict(to) on every rank");
        expect(opt.local_state_dict().size() == shard_entries, "rank ", rank, " is not the target but holds ",
               opt.local_state_dict().size(), " entries after consolidating");
      }
      // A rank's own local_state_dict loads back; the next rank's (its owned list) is refused on
      // every rank, naming what this rank owns: it would leave those parameters without state.
      const nn::StateDict mine = opt.local_state_dict();
      const std::vector<int64_t> owned = mine.at(dist::ZeroRedundancyOptimizer::kOwnedParametersKey).to_int_vector();
      expect(owned == std::vector<int64_t>(opt.local_indices().begin(), opt.local_indices().end()),
             "rank ", rank, ": local_state_dict lists other parameters than local_indices()");
      opt.load_state_dict(mine);
      const int next = (rank + 1) % world;
      std::vector<int64_t> next_owned;
      for (size_t i = 0; i < owners.size(); ++i)
        if (owners[i] == next) next_owned.push_back(static_cast<int64_t>(i));
      nn::StateDict other = mine;
      other[dist::ZeroRedundancyOptimizer::kOwnedParametersKey] =
          Tensor::from_vector(next_owned, Shape{static_cast<int64_t>(next_owned.size())});
      expect_throws<ValueError>([&] { opt.load_state_dict(other); },
                                "another rank's shard, or one saved at another world size");
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

TEST_CASE(
    "ZeroRedundancyOptimizer over fewer parameters than ranks: a rank that owns none steps nothing and gets "
    "the values") {
  if (under_mpirun()) return;  // mpirun fixes the world size
  const int port = testing::free_port();
  const std::string failures = on_ranks(3, [&](int rank) {
    auto pg = join(rank, 3, port);
    Tensor p = Tensor::from_vector({1.0f, 2.0f}).set_requires_grad(true);
    // Ranks 1 and 2 own nothing: their local SGD is built over no parameters, which a plain
    // SGD refuses (torch.optim's "empty parameter list").
    dist::ZeroRedundancyOptimizer opt({p}, pg, kSgdMomentum);
    expect(opt.owner(0) == 0, "rank ", rank, ": the one parameter is owned by rank ", opt.owner(0));
    expect(opt.local_indices().size() == (rank == 0 ? 1u : 0u), "rank ", rank, " owns ",
           opt.local_indices().size(), " parameters");
    for (int step = 0; step < 2; ++step) {
      p.set_grad(Tensor::from_vector({0.5f, -1.0f}));
      opt.step();
    }
    // SGD lr 0.1, momentum 0.9, gradient g twice: p - 0.1 g - 0.1 (0.9 g + g) = p - 0.29 g.
    const std::vector<float> want = {1.0f - 0.1f * 0.5f - 0.1f * (0.9f * 0.5f + 0.5f),
                                     2.0f + 0.1f * 1.0f + 0.1f * (0.9f * 1.0f + 1.0f)};
    const std::vector<float> got = p.to_vector();
    for (size_t i = 0; i < 2; ++i)
      expect(std::abs(got[i] - want[i]) <= 1e-6f, "rank ", rank, ": p[", i, "] = ", got[i], ", want ",
             want[i]);
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

namespace {
// The gradient of make_mlp's parameter i at step s: small values that differ per element.
void set_zero_test_grads(const std::vector<Tensor>& params, int s) {
  for (size_t i = 0; i < params.size(); ++i) {
    std::vector<float> g(static_cast<size_t>(params[i].numel()));
    for (size_t k = 0; k < g.size(); ++k) g[k] = 0.125f * static_cast<float>((s + 1) * (k % 5)) - 0.25f * i;
    Tensor p = params[i];
    p.set_grad(Tensor::from_vector(g, p.shape()));
  }
}
}  // namespace

TEST_CASE("ZeroRedundancyOptimizer state round trip: resumes bit for bit at 2 ranks and 1; a bad state fails every rank alike") {
  // Reference: unsharded Adam, 5 steps, uninterrupted.
  auto reference = make_mlp(7);
  std::unique_ptr<nn::Optimizer> reference_opt = kAdam(reference->parameters());
  for (int s = 0; s < 5; ++s) {
    set_zero_test_grads(reference->parameters(), s);
    reference_opt->step();
  }
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [&](int rank) {
    auto pg = join(rank, 2, port);
    // 2 steps of ZeRO (owners {0, 1, 1, 1}), then the whole state gathered onto each rank.
    auto model = make_mlp(7);
    dist::ZeroRedundancyOptimizer opt(model->parameters(), pg, kAdam);
    for (int s = 0; s < 2; ++s) {
      set_zero_test_grads(model->parameters(), s);
      opt.step();
    }
    nn::StateDict whole;
    for (int to = 0; to < 2; ++to) {
      opt.consolidate_state_dict(to);
      if (rank == to) whole = nn::parse_checkpoint(nn::checkpoint_bytes(opt.state_dict()), "whole");
    }
    const nn::StateDict two_steps = model->state_dict();
    // A step moves the state on: the gathered copy is dropped, and state_dict() refuses again.
    set_zero_test_grads(model->parameters(), 2);
    opt.step();
    expect_throws<ValueError>([&] { (void)opt.state_dict(); }, "has not been consolidated on this rank");
    const auto resume_and_compare = [&](nn::Optimizer& resumed, nn::Module& resumed_model, const char* what) {
      for (int s = 2; s < 5; ++s) {
        set_zero_test_grads(resumed_model.parameters(), s);
        resumed.step();
      }
      const auto got = resumed_model.named_parameters(), want = reference->named_parameters();
      for (size_t i = 0; i < want.size(); ++i)
        expect(got[i].second.to_vector() == want[i].second.to_vector(), "rank ", rank, " ", what, ": ",
               want[i].first, " is ", got[i].second, ", uninterrupted ", want[i].second);
    };
    // A state of another model: exp_avg.2 belongs to rank 1's parameter 2 ([3, 8]), yet rank 0
    // must refuse it too, or it would wait for rank 1 in the next step. Then a partial state
    // (no step.3), which only rank 1 can see: both throw, neither loads.
    nn::StateDict other_shape = whole, partial = whole;
    other_shape["exp_avg.2"] = Tensor::zeros({3});
    partial.erase("step.3");
    auto fresh = make_mlp(7);
    fresh->load_state_dict(two_steps);
    dist::ZeroRedundancyOptimizer resumed(fresh->parameters(), pg, kAdam);
    expect_throws<ShapeError>([&] { resumed.load_state_dict(other_shape); }, "'exp_avg.2' is [3] but parameter 2 is [3, 8]");
    expect_throws<ValueError>([&] { resumed.load_state_dict(partial); },
                              rank == 1 ? "on rank 1 (its local parameters are 0 -> 1, 1 -> 2, 2 -> 3): "
                                          "Adam.load_state_dict: parameter 2 has only part of its state"
                                        : "on rank 0: rank(s) 1 could not load their share");
    expect(resumed.local_optimizer().state_dict().empty(), "rank ", rank, ": a refused state was partly loaded");
    // The whole state resumes at 2 ranks, and at 1 rank (another world size), bit for bit.
    resumed.load_state_dict(whole);
    resume_and_compare(resumed, *fresh, "ZeRO at 2 ranks");
    auto alone = make_mlp(7);
    alone->load_state_dict(two_steps);
    std::unique_ptr<nn::Optimizer> unsharded = kAdam(alone->parameters());
    unsharded->load_state_dict(whole);
    resume_and_compare(*unsharded, *alone, "unsharded Adam");
    // One rank consolidating while the other loads: both begin with a one-int64 all_gather,
    // which only their purposes tell apart. Every rank gets the mismatch, naming both calls,
    // and the loading rank keeps the state it had.
    const std::string kept = nn::checkpoint_bytes(resumed.local_optimizer().state_dict());
    expect_throws<DistError>(
        [&] {
          if (rank == 0)
            resumed.consolidate_state_dict(0);
          else
            resumed.load_state_dict(whole);
        },
        "ZeroRedundancyOptimizer.consolidate_state_dict");
    expect(nn::checkpoint_bytes(resumed.local_optimizer().state_dict()) == kept, "rank ", rank,
           ": the refused load changed the local state");
    // The mismatch ends the group (Note [Out of step]); under mpirun the next case, in this
    // process, then makes a new one.
    testing::expect_out_of_step(*pg, rank, "#");
    if (under_mpirun()) dist::destroy_process_group();
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

// ---- Bucket rebuild and static_graph (Note [Bucket rebuild], Note [Static graph]) -----------

namespace {

// Registers its head before its trunk and uses them the other way round, so the first plan
// (reverse registration order) has the head's gradients, ready first, in the last bucket.
// Parameters: 0 head.weight [1, 4] 16 B, 1 head.bias 4 B, 2 trunk.weight [4, 2] 32 B,
// 3 trunk.bias 16 B; with an aux head, registered last and used only when asked:
// 4 aux.weight [1, 2] 8 B, 5 aux.bias 4 B.
struct HeadFirst : nn::Module {
  explicit HeadFirst(bool with_aux) {
    if (with_aux) aux = register_module("aux", std::make_shared<nn::Linear>(2, 1));
    const std::vector<std::pair<Tensor*, std::vector<float>>> values = {
        {&head->weight, {0.5f, -1, 0.5f, 1}}, {&head->bias, {0}},
        {&trunk->weight, {1, -1, 0.5f, 1, -1, 0.5f, 1, 0}}, {&trunk->bias, {0, 0.5f, 1, -0.5f}}};
    for (const auto& [p, v] : values) p->copy_(Tensor::from_vector(v, p->shape()));
  }
  std::shared_ptr<nn::Linear> head = register_module("head", std::make_shared<nn::Linear>(4, 1));
  std::shared_ptr<nn::Linear> trunk = register_module("trunk", std::make_shared<nn::Linear>(2, 4));
  std::shared_ptr<nn::Linear> aux;
  bool use_aux = false;
  Tensor forward(const Tensor& x) override {
    Tensor y = (*head)(relu((*trunk)(x)));
    return use_aux ? y + (*aux)(x) : y;
  }
};

// Step s's global batch: 4 rows of small integers; rank r of 2 takes rows 2r, 2r + 1.
// With the dyadic weights above and lr 1/4, every value of two steps (outputs, gradients,
// their sums over 2 or 4 rows, the updates) is a dyadic fraction of at most 23 significant
// bits (checked in exact rational arithmetic), so float32 holds it exactly and DDP's result
// equals the 1-rank one bit for bit.
Batch head_first_batch(int step, int64_t begin, int64_t end) {
  const std::vector<std::vector<float>> x = {{1, 2, -1, 1, 2, 0, 0, -2}, {2, 1, 1, -1, -2, 1, 1, 1}};
  const std::vector<std::vector<float>> t = {{1, -1, 2, 0}, {0, 2, -1, 1}};
  const auto& xs = x[static_cast<size_t>(step)];
  const auto& ts = t[static_cast<size_t>(step)];
  return {Tensor::from_vector(std::vector<float>(xs.begin() + 2 * begin, xs.begin() + 2 * end), {end - begin, 2}),
          Tensor::from_vector(std::vector<float>(ts.begin() + begin, ts.begin() + end), {end - begin, 1})};
}
constexpr float kHeadFirstLr = 0.25f;

}  // namespace

TEST_CASE("bucket rebuild: after the first backward every rank plans from rank 0's ready order; 2 ranks == 1 rank") {
  // Caps 20 and 48 bytes. First plan, reverse registration: trunk.bias + trunk.weight (48 B
  // >= 20), then head.bias + head.weight (20 B, no parameters left). Gradients become ready
  // head.weight, head.bias, trunk.weight, trunk.bias (the head runs last in forward, and
  // LinearBackward gives a weight before its bias), so the rebuilt plan is head.weight +
  // head.bias (20 B >= 20), then trunk.weight + trunk.bias (48 B >= 48): the head's bucket,
  // complete first, now launches first. With static_graph and the unused aux head, the aux
  // parameters (not ready on rank 0) go last, in reverse registration order.
  const std::vector<std::vector<size_t>> first_plan = {{3, 2}, {1, 0}}, rebuilt_plan = {{0, 1}, {2, 3}};
  const std::vector<std::vector<size_t>> aux_first_plan = {{5, 4, 3}, {2, 1, 0}},
                                         aux_rebuilt_plan = {{0, 1}, {2, 3}, {5, 4}};
  dist::DDPOptions caps;
  caps.first_bucket_cap_bytes = 20;
  caps.bucket_cap_bytes = 48;
  // The reference: one rank, the whole batch of 4, two SGD steps.
  HeadFirst reference(false);
  nn::SGD reference_opt(reference.parameters(), {kHeadFirstLr});
  for (int s = 0; s < 2; ++s) {
    const Batch b = head_first_batch(s, 0, 4);
    reference_opt.zero_grad();
    mse_loss(reference(b.x), b.y).backward();
    reference_opt.step();
  }
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [&](int rank) {
    auto pg = join(rank, 2, port);
    // Two steps of 2 rows per rank; the second runs on the rebuilt plan. Checks the plan
    // before and after each step, and the result against the reference, exactly.
    auto train = [&](const std::string& what, HeadFirst& model, dist::DistributedDataParallel& ddp,
                     const std::vector<std::vector<size_t>>& before, const std::vector<std::vector<size_t>>& after) {
      nn::SGD opt(ddp.parameters(), {kHeadFirstLr});
      expect(ddp.reducer().bucket_plan() == before, what, " rank ", rank, ": unexpected first plan");
      for (int s = 0; s < 2; ++s) {
        const Batch b = head_first_batch(s, 2 * rank, 2 * rank + 2);
        opt.zero_grad();
        mse_loss(ddp(b.x), b.y).backward();
        opt.step();
        expect(ddp.reducer().bucket_plan() == (s == 0 ? before : after), what, " rank ", rank, " after step ", s,
               ": the plan is not the ", s == 0 ? "first" : "rebuilt", " one");
      }
      const auto got = model.parameters(), want = reference.parameters();
      for (size_t i = 0; i < want.size(); ++i)
        expect(got[i].to_vector() == want[i].to_vector(), what, " rank ", rank, ": parameter ", i, " is ", got[i],
               ", the 1-rank reference ", want[i]);
    };

    {  // Default options: the re-plan costs one broadcast of rank 0's order (4 int64).
      auto model = std::make_shared<HeadFirst>(false);
      dist::DistributedDataParallel ddp(model, pg, caps);
      pg->reset_counts();
      train("default", *model, ddp, first_plan, rebuilt_plan);
      const dist::CollectiveCount broadcasts = pg->count(dist::Collective::Broadcast);
      expect(broadcasts.calls == 1 && broadcasts.bytes == 32, "rank ", rank, ": ", broadcasts.calls,
             " broadcasts of ", broadcasts.bytes, " bytes, expected 1 of 32");
      expect(pg->count(dist::Collective::AllReduce).calls == 4, "rank ", rank, ": ",
             pg->count(dist::Collective::AllReduce).calls, " all-reduces in 2 steps of 2 buckets");
    }
    {  // find_unused_parameters without static_graph: the used set may change, no re-plan.
      dist::DDPOptions options = caps;
      options.find_unused_parameters = true;
      auto model = std::make_shared<HeadFirst>(true);
      dist::DistributedDataParallel ddp(model, pg, options);
      pg->reset_counts();
      train("find_unused_parameters", *model, ddp, aux_first_plan, aux_first_plan);
      expect(pg->count(dist::Collective::Broadcast).calls == 0, "rank ", rank,
             ": find_unused_parameters re-planned the buckets");
    }
    // static_graph: aux unused is allowed; the used map is all-reduced in the first step only:
    // 2 buckets + the map, then 3 buckets.
    dist::DDPOptions options = caps;
    options.static_graph = true;
    auto model = std::make_shared<HeadFirst>(true);
    dist::DistributedDataParallel ddp(model, pg, options);
    pg->reset_counts();
    train("static_graph", *model, ddp, aux_first_plan, aux_rebuilt_plan);
    expect(pg->count(dist::Collective::AllReduce).calls == 6, "rank ", rank, ": ",
           pg->count(dist::Collective::AllReduce).calls, " all-reduces in 2 static_graph steps, expected 2 + 1 + 3");
    expect(!model->aux->weight.grad().defined() && !model->aux->bias.grad().defined(), "rank ", rank,
           ": the unused aux head got a .grad");
    // Breaking the promise: aux gets gradients that no rank had in the first iteration.
    model->use_aux = true;
    std::string message;
    try {
      const Batch b = head_first_batch(0, 2 * rank, 2 * rank + 2);
      mse_loss(ddp(b.x), b.y).backward();
    } catch (const DistError& e) {
      message = e.what();
    }
    expect(message.find("static_graph") != std::string::npos &&
               message.find("aux.weight, aux.bias") != std::string::npos,
           "rank ", rank, ": no DistError naming aux.weight, aux.bias: '", message, "'");
    // The error comes after the step's collectives: the group is still in step.
    Tensor t = Tensor::full({1}, 1.0f);
    pg->all_reduce(t)->wait();
    expect(t.item() == 2.0f, "rank ", rank, ": the group is out of step after the error: ", t);
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("static_graph: a parameter used in the first iteration and by no rank later is a DistError, not a zero gradient") {
  // Note [Static graph], the other way round: aux is used on every rank in the first step and
  // on none in the second. Its mean would be zeros, which SGD's momentum and weight decay would
  // then apply; PyTorch reports the broken promise instead, on every rank that dropped it. One
  // rank (no all-reduce at all) and two ranks.
  for (const int world : {1, 2}) {
    const int port = testing::free_port();
    const std::string failures = on_ranks(world, [&](int rank) {
      auto pg = join(rank, world, port);
      dist::DDPOptions options;
      options.static_graph = true;
      auto model = std::make_shared<HeadFirst>(true);
      model->use_aux = true;
      dist::DistributedDataParallel ddp(model, pg, options);
      nn::SGD opt(ddp.parameters(), {kHeadFirstLr, /*momentum=*/0.5f, /*dampening=*/0, /*weight_decay=*/0.5f});
      const Batch b = head_first_batch(0, 2 * rank, 2 * rank + 2);
      opt.zero_grad();
      mse_loss(ddp(b.x), b.y).backward();
      opt.step();
      const std::vector<float> aux_weight = model->aux->weight.to_vector();
      model->use_aux = false;
      opt.zero_grad();
      std::string message;
      try {
        mse_loss(ddp(b.x), b.y).backward();
      } catch (const DistError& e) {
        message = e.what();
      }
      expect(message.find("used in the first iteration but received no gradient in this one: aux.weight, aux.bias") !=
                     std::string::npos &&
                 message.find("static_graph") != std::string::npos,
             "world ", world, " rank ", rank, ": no DistError naming aux.weight, aux.bias: '", message, "'");
      expect(!model->aux->weight.grad().defined() && !model->aux->bias.grad().defined(), "world ", world, " rank ",
             rank, ": the dropped aux head got a .grad (", model->aux->weight.grad(), ")");
      // A loop that catches the error and steps anyway: SGD skips a parameter without .grad; a
      // .grad of zeros would move aux.weight by its momentum and weight decay.
      opt.step();
      expect(model->aux->weight.to_vector() == aux_weight, "world ", world, " rank ", rank, ": aux.weight moved to ",
             model->aux->weight);
      // The error comes after the step's collectives: the group is still in step.
      Tensor t = Tensor::full({1}, 1.0f);
      pg->all_reduce(t)->wait();
      expect(t.item() == static_cast<float>(world), "world ", world, " rank ", rank,
             ": the group is out of step after the error: ", t);
      if (world == 1) {  // a newly used parameter, which at one rank has no all-reduce to learn from
        auto other = std::make_shared<HeadFirst>(true);
        dist::DistributedDataParallel other_ddp(other, pg, options);
        mse_loss(other_ddp(b.x), b.y).backward();
        other->use_aux = true;
        message.clear();
        try {
          mse_loss(other_ddp(b.x), b.y).backward();
        } catch (const DistError& e) {
          message = e.what();
        }
        expect(message.find("no rank used them in the first iteration: aux.weight, aux.bias") != std::string::npos,
               "world 1: no DistError for the newly used aux head: '", message, "'");
      }
    });
    CHECK_MESSAGE(failures.empty(), failures);
  }
}

TEST_CASE("the 2-rank cases pass on the MPI backend too (this file under mpirun -np 2)") {
  if (under_mpirun()) return;
  if (!testing::have_mpirun()) {
    MESSAGE("mpirun not found: the MPI half of this file did not run");
    return;
  }
  const testing::RunResult r = testing::mpirun_self("tests/test_ddp", 2, "--test-case-exclude='*mpirun*'", 120s);
  CHECK_MESSAGE(r.code() == 0, "mpirun run failed:\n", r.out, r.err);
}

TEST_CASE("every case passes on the shm backend too (this file with NANODDP_TEST_BACKEND=shm)") {
  if (under_mpirun() || std::getenv("NANODDP_TEST_BACKEND") != nullptr) return;
  const testing::RunResult r = testing::rerun_with_backend(
      "tests/test_ddp", "shm", "--test-case-exclude='*mpirun*,*NANODDP_TEST_BACKEND*'", 120s);
  CHECK_MESSAGE(r.code() == 0, "shm run failed:\n", r.out, r.err);
}
