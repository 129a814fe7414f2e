// nn::checkpoint (Note [Checkpointed regions]): gradients bitwise equal to the run without
// checkpointing on the CPU (Dropout drawing the same mask, BatchNorm counting each batch
// once), a region really rerun in backward, fewer activation bytes at the peak, clear errors,
// and DDP's buckets firing as usual with checkpointed blocks on 2 ranks.
#include <doctest/doctest.h>

#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/autograd.h"
#include "core/memory.h"
#include "core/ops.h"
#include "dist/ddp.h"
#include "dist/fsdp.h"
#include "dist/init.h"
#include "nn/activation_checkpoint.h"
#include "nn/batch_norm.h"
#include "nn/conv.h"
#include "nn/dropout.h"
#include "nn/layers.h"
#include "nn/optim.h"
#include "tests/batches.h"
#include "tests/dist_ranks.h"
#include "tests/multiprocess.h"

using namespace nanoddp;
using nanoddp::testing::Batch;
using nanoddp::testing::expect;
using nanoddp::testing::on_ranks;

namespace {

// Linear(6, 16) BatchNorm1d ReLU Dropout(0.5) | Linear(16, 16) ReLU Dropout(0.3) Linear(16, 3);
// with checkpoint, "|" splits the two checkpointed blocks. Dropout draws from dropout_gen.
std::shared_ptr<nn::Sequential> make_mlp(uint64_t seed, Generator& dropout_gen, bool checkpointed) {
  Generator gen(seed);
  auto model = std::make_shared<nn::Sequential>();
  model->add(nn::Linear(6, 16, gen));
  model->add(nn::BatchNorm1d(16));
  model->add(nn::ReLU());
  model->add(nn::Dropout(0.5f, dropout_gen));
  model->add(nn::Linear(16, 16, gen));
  model->add(nn::ReLU());
  model->add(nn::Dropout(0.3f, dropout_gen));
  model->add(nn::Linear(16, 3, gen));
  if (checkpointed) model->checkpoint_blocks({0, 4});
  return model;
}

// [N, 1, 8, 8] -> Conv2d(1, 4, 3) ReLU MaxPool2d(2) | Conv2d(4, 6, 3) ReLU Flatten Linear(24, 5).
std::shared_ptr<nn::Sequential> make_cnn(uint64_t seed, bool checkpointed) {
  Generator gen(seed);
  auto model = std::make_shared<nn::Sequential>();
  model->add(nn::Conv2d(1, 4, 3, gen));   // [N, 4, 6, 6]
  model->add(nn::ReLU());
  model->add(nn::MaxPool2d(2));           // [N, 4, 3, 3]
  model->add(nn::Conv2d(4, 6, 3, gen));   // [N, 6, 1, 1]
  model->add(nn::ReLU());
  model->add(nn::Flatten());
  model->add(nn::Linear(6, 5, gen));
  if (checkpointed) model->checkpoint_blocks({0, 3});
  return model;
}

void check_bitwise(const std::vector<Tensor>& got, const std::vector<Tensor>& want, const char* what) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO(what, " ", i);
    REQUIRE(got[i].defined());
    CHECK(got[i].to_vector() == want[i].to_vector());
  }
}

std::vector<Tensor> grads_of(const std::vector<Tensor>& params) {
  std::vector<Tensor> grads;
  for (const Tensor& p : params) grads.push_back(p.grad());
  return grads;
}

}  // namespace

TEST_CASE("MLP with Dropout and BatchNorm1d: checkpointed gradients are bitwise the plain ones") {
  Generator plain_drop(5), ckpt_drop(5);
  auto plain = make_mlp(1, plain_drop, false);
  auto ckpt = make_mlp(1, ckpt_drop, true);
  int forwards[2] = {0, 0};  // Linear(16, 16)'s forwards, plain and checkpointed
  (*plain)[4].register_forward_pre_hook([&](nn::Module&, const Tensor&) { ++forwards[0]; });
  (*ckpt)[4].register_forward_pre_hook([&](nn::Module&, const Tensor&) { ++forwards[1]; });
  nn::SGD plain_opt(plain->parameters(), {/*lr=*/0.1});
  nn::SGD ckpt_opt(ckpt->parameters(), {/*lr=*/0.1});
  for (int step = 0; step < 3; ++step) {
    const Batch b = testing::random_batch(100 + step, 8, 6, 3);
    Tensor x_plain = b.x.clone().set_requires_grad(true);
    Tensor x_ckpt = b.x.clone().set_requires_grad(true);
    plain_opt.zero_grad();
    ckpt_opt.zero_grad();
    cross_entropy((*plain)(x_plain), b.y).backward();
    cross_entropy((*ckpt)(x_ckpt), b.y).backward();
    check_bitwise(grads_of(ckpt->parameters()), grads_of(plain->parameters()), "parameter gradient");
    check_bitwise({x_ckpt.grad()}, {x_plain.grad()}, "input gradient");
    plain_opt.step();
    ckpt_opt.step();
  }
  // The block ran again in each backward; the rerun drew from copies, so the generators
  // moved once per forward, and BatchNorm counted 3 batches, not 6.
  CHECK(forwards[0] == 3);
  CHECK(forwards[1] == 6);
  CHECK(ckpt_drop.random64() == plain_drop.random64());
  // Not structured bindings: INFO's lambda cannot capture one (C++17, clang).
  for (const auto& entry : plain->named_buffers()) {
    const std::string& name = entry.first;
    const Tensor& buffer = entry.second;
    INFO(name);
    bool found = false;
    for (const auto& other : ckpt->named_buffers()) {
      if (other.first != name) continue;
      found = true;
      if (buffer.dtype() == DType::Int64) {
        CHECK(other.second.to_int_vector() == buffer.to_int_vector());
        CHECK(buffer.to_int_vector() == std::vector<int64_t>{3});
      } else {
        CHECK(other.second.to_vector() == buffer.to_vector());
      }
    }
    CHECK(found);
  }
  // Names and parameters are the model's own: the state_dicts have the same keys.
  CHECK(ckpt->state_dict().size() == plain->state_dict().size());
  CHECK(ckpt->state_dict().count("4.weight") == 1);
}

TEST_CASE("CNN block: checkpointed gradients are bitwise the plain ones") {
  auto plain = make_cnn(2, false);
  auto ckpt = make_cnn(2, true);
  Generator gen(3);
  const Tensor x = Tensor::randn({4, 1, 8, 8}, gen);
  const Tensor y = Tensor::from_vector(std::vector<int64_t>{0, 4, 2, 1});
  cross_entropy((*plain)(x), y).backward();
  cross_entropy((*ckpt)(x), y).backward();
  check_bitwise(grads_of(ckpt->parameters()), grads_of(plain->parameters()), "parameter gradient");
}

TEST_CASE("several inputs and outputs: each output's gradient reaches the inputs and the parameters") {
  Generator gen(4);
  nn::Linear layer(3, 3, gen);
  const Tensor a0 = Tensor::randn({2, 3}, gen), b0 = Tensor::randn({2, 3}, gen);
  auto region = [&layer](const std::vector<Tensor>& in) {
    const Tensor h = relu(layer(in[0] + in[1]));
    return std::vector<Tensor>{h * in[1], sum(h)};
  };
  std::vector<Tensor> grads[2];
  for (int checkpointed = 0; checkpointed < 2; ++checkpointed) {
    Tensor a = a0.clone().set_requires_grad(true), b = b0.clone().set_requires_grad(true);
    layer.zero_grad();
    const std::vector<Tensor> out = checkpointed ? nn::checkpoint(region, {a, b}) : region({a, b});
    REQUIRE(out.size() == 2);
    (sum(out[0]) + out[1] * 2.0f).backward();
    grads[checkpointed] = {a.grad(), b.grad(), layer.weight.grad(), layer.bias.grad()};
  }
  check_bitwise(grads[1], grads[0], "gradient");
}

TEST_CASE("an input of a checkpointed region changed in place before backward: the rerun throws, as torch's") {
  // w = [[1, 2]], x = [[3, 4]]: the plain gradient of sum(x w^T) is w.grad = [3, 4]. Zeroing
  // x (under no_grad) before backward would rerun the region on zeros: w.grad = [0, 0].
  Tensor w = Tensor::from_vector({1.0f, 2.0f}, {1, 2}).set_requires_grad(true);
  Tensor x = Tensor::from_vector({3.0f, 4.0f}, {1, 2}).set_requires_grad(true);
  Tensor loss = sum(nn::checkpoint([&w](const Tensor& in) { return linear(in, w, Tensor()); }, x));
  {
    NoGradGuard no_grad;
    x.fill_(0.0f);
  }
  try {
    loss.backward();
    FAIL("backward reran the region on the changed input");
  } catch (const ValueError& e) {
    CHECK(std::string(e.what()).find("checkpoint: input 0 ([1, 2] float32) was modified in place") !=
          std::string::npos);
  }
  CHECK(!w.grad().defined());
  // Unchanged, the same region gives the plain gradient.
  x = Tensor::from_vector({3.0f, 4.0f}, {1, 2}).set_requires_grad(true);
  sum(nn::checkpoint([&w](const Tensor& in) { return linear(in, w, Tensor()); }, x)).backward();
  CHECK(w.grad().to_vector() == std::vector<float>{3.0f, 4.0f});
}

TEST_CASE("peak activation bytes: a checkpointed deep MLP keeps its blocks' inputs, then one block") {
  // 8 blocks of Linear(64, 256) ReLU Linear(256, 64) ReLU on a batch of 32 rows.
  constexpr int64_t kNarrow = 32 * 64 * 4, kWide = 32 * 256 * 4;  // bytes of one activation
  Generator gen(6);
  const Tensor x = Tensor::randn({32, 64}, gen);
  const Tensor y = Tensor::from_vector(std::vector<int64_t>(32, 1));
  // x and y count as activations once a graph holds them: from the start, for both runs.
  set_memory_category(x, MemoryCategory::Activations);
  set_memory_category(y, MemoryCategory::Activations);
  int64_t peak[2] = {0, 0};
  for (int checkpointed = 0; checkpointed < 2; ++checkpointed) {
    Generator weights(7);
    auto model = std::make_shared<nn::Sequential>();
    std::vector<size_t> starts;
    for (int block = 0; block < 8; ++block) {
      starts.push_back(model->size());
      model->add(nn::Linear(64, 256, weights));
      model->add(nn::ReLU());
      model->add(nn::Linear(256, 64, weights));
      model->add(nn::ReLU());
    }
    if (checkpointed) model->checkpoint_blocks(starts);
    const int64_t before = memory_stats(Device::cpu()).live[static_cast<int>(MemoryCategory::Activations)];
    reset_peak_memory();
    cross_entropy((*model)(x), y).backward();
    const MemoryStats stats = memory_stats(Device::cpu());
    peak[checkpointed] = stats.peak[static_cast<int>(MemoryCategory::Activations)] - before;
    // Everything the graph held is freed by the end of backward.
    CHECK(stats.live[static_cast<int>(MemoryCategory::Activations)] == before);
  }
  MESSAGE("peak activation bytes beyond x and y: plain ", peak[0], ", checkpointed ", peak[1]);
  // Plain, at the end of forward: each block's two ReLU outputs (each ReLU saves its output,
  // the next Linear saves the same tensor as its input), and the softmax cross_entropy saves.
  // The Linears' outputs are held by no node (Note [Graph edges]): they are never activations.
  CHECK(peak[0] == 8 * (kWide + kNarrow) + kNarrow);
  // Checkpointed, while the last block is recomputed (the loss's node is released by then):
  // the inputs of blocks 2 to 8 (outputs of blocks 1 to 7, kept by their regions), and the
  // rerun's two ReLU outputs. The last block's output is held by nothing: the loss saves the
  // softmax. 3.4 times less.
  CHECK(peak[1] == 7 * kNarrow + kWide + kNarrow);
}

TEST_CASE("a rerun that records other ops is an error out of backward; bad arguments are errors") {
  Generator gen(8);
  nn::Linear layer(2, 2, gen);
  int calls = 0;
  // Forward records linear then relu; the rerun records linear only.
  const Tensor out = nn::checkpoint(
      [&](const Tensor& x) {
        const Tensor h = layer(x);
        return ++calls == 1 ? relu(h) * 2.0f : h;
      },
      Tensor::ones({1, 2}));
  CHECK_THROWS_WITH_AS(sum(out).backward(), doctest::Contains("the function must run the same ops"), ValueError);

  CHECK_THROWS_AS(nn::checkpoint(std::function<Tensor(const Tensor&)>(), Tensor::ones({1})), ValueError);
  nn::Sequential seq;
  seq.add(nn::ReLU());
  seq.add(nn::ReLU());
  CHECK_THROWS_WITH_AS(seq.checkpoint_blocks({2}), doctest::Contains("is not a child index"), ValueError);
  CHECK_THROWS_WITH_AS(seq.checkpoint_blocks({1, 1}), doctest::Contains("must increase"), ValueError);
}

TEST_CASE("BatchNorm switched between train and eval before backward: the rerun is refused, not mixed") {
  // Forward normalises with the batch's statistics; a rerun in eval would bring the running
  // ones into the training formula, a silently wrong gradient (torch 1.13 crashes here).
  for (const bool train_first : {true, false}) {
    CAPTURE(train_first);
    nn::BatchNorm1d norm(3);
    norm.train(train_first);
    const Tensor x =
        Tensor::from_vector({1, 2, 3, 4, 6, 9, 0, 1, 5, 2, 2, 2}, {4, 3}).set_requires_grad(true);
    const Tensor out = nn::checkpoint([&](const Tensor& in) { return norm(in); }, x);
    norm.train(!train_first);
    CHECK_THROWS_WITH_AS(
        sum(out * out).backward(),
        doctest::Contains(train_first ? "is BatchNormBackward in forward and BatchNormEvalBackward "
                                        "when recomputed"
                                      : "is BatchNormEvalBackward in forward and BatchNormBackward "
                                        "when recomputed"),
        ValueError);
  }
}

TEST_CASE("under NoGradGuard and inside another region, fn simply runs") {
  Generator gen(9);
  nn::Linear layer(2, 2, gen);
  int calls = 0;
  auto block = [&](const Tensor& x) {
    ++calls;
    return relu(layer(x));
  };
  {
    NoGradGuard no_grad;
    const Tensor out = nn::checkpoint(block, Tensor::ones({1, 2}));
    CHECK_FALSE(out.requires_grad());
  }
  CHECK(calls == 1);
  // Nested: the outer region reruns once, with the inner function inside it.
  const Tensor x = Tensor::ones({1, 2});
  const Tensor out = nn::checkpoint([&](const Tensor& h) { return nn::checkpoint(block, h) * 3.0f; }, x);
  sum(out).backward();
  CHECK(calls == 3);
  const std::vector<float> nested = layer.weight.grad().to_vector();
  layer.zero_grad();
  sum(block(x) * 3.0f).backward();
  CHECK(layer.weight.grad().to_vector() == nested);
}

TEST_CASE("DDP on 2 ranks: checkpointed blocks train bitwise like plain ones, every bucket fires in backward") {
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [port](int rank) {
    dist::InitOptions init;
    init.timeout = std::chrono::seconds(30);
    init.init_method = "tcp://127.0.0.1:" + std::to_string(port);
    init.rank = rank;
    init.world_size = 2;
    const char* backend = std::getenv("NANODDP_TEST_BACKEND");
    init.backend = backend != nullptr ? dist::parse_backend(backend) : dist::Backend::Gloo;
    auto pg = dist::init_process_group(init);
    std::vector<std::vector<float>> trained[2];
    int64_t all_reduces[2] = {0, 0};
    for (int checkpointed = 0; checkpointed < 2; ++checkpointed) {
      Generator drop(50 + static_cast<uint64_t>(rank));
      dist::DDPOptions options;
      options.first_bucket_cap_bytes = 1000;  // several buckets, filled as backward goes
      options.bucket_cap_bytes = 1000;
      dist::DistributedDataParallel ddp(make_mlp(11, drop, checkpointed == 1), pg, options);
      nn::SGD opt(ddp.parameters(), {/*lr=*/0.1, /*momentum=*/0.9f});
      pg->reset_counts();
      for (int step = 0; step < 4; ++step) {
        const Batch b = testing::rows(testing::random_batch(200 + step, 16, 6, 3), 8 * rank, 8 * rank + 8);
        opt.zero_grad();
        cross_entropy(ddp(b.x), b.y).backward();
        opt.step();
      }
      all_reduces[checkpointed] = pg->count(dist::Collective::AllReduce).calls;
      for (const Tensor& p : ddp.parameters()) trained[checkpointed].push_back(p.to_vector());
    }
    expect(trained[1] == trained[0], "rank ", rank, ": checkpointed DDP training differs from plain DDP");
    expect(all_reduces[1] == all_reduces[0] && all_reduces[0] >= 4 * 2, "rank ", rank, ": ", all_reduces[1],
           " all-reduces with checkpointing, ", all_reduces[0], " without (at least 2 buckets x 4 steps expected)");
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE(
    "FSDP on 2 ranks, a unit per Linear inside the blocks: checkpointed training is bitwise the plain one") {
  // The rerun runs the units' forward hooks again: FULL_SHARD gathers each unit once more for
  // it, SHARD_GRAD_OP (parameters kept after forward) adds nothing; forward_prefetch must not
  // prefetch from the rerun (the next unit's backward has run), so it adds nothing either.
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [port](int rank) {
    auto pg = testing::join(rank, 2, port);
    for (const auto strategy : {dist::ShardingStrategy::FULL_SHARD, dist::ShardingStrategy::SHARD_GRAD_OP}) {
      const char* name = dist::sharding_strategy_name(strategy);
      int64_t gathers[2][2] = {};  // [checkpointed][forward_prefetch]
      std::vector<std::vector<float>> trained[2][2];
      for (int checkpointed = 0; checkpointed < 2; ++checkpointed) {
        for (int prefetch = 0; prefetch < 2; ++prefetch) {
          Generator drop(60 + static_cast<uint64_t>(rank));
          dist::FSDPOptions options;
          options.sharding_strategy = strategy;
          options.auto_wrap_policy = dist::module_wrap_policy<nn::Linear>();
          options.forward_prefetch = prefetch == 1;
          dist::FullyShardedDataParallel fsdp(make_mlp(12, drop, checkpointed == 1), pg, options);
          nn::SGD opt(fsdp.parameters(), {/*lr=*/0.1, /*momentum=*/0.9f});
          pg->reset_counts();
          for (int step = 0; step < 3; ++step) {
            const Batch b =
                testing::rows(testing::random_batch(300 + step, 16, 6, 3), 8 * rank, 8 * rank + 8);
            opt.zero_grad();
            cross_entropy(fsdp(b.x), b.y).backward();
            opt.step();
          }
          gathers[checkpointed][prefetch] = pg->count(dist::Collective::AllGather).calls;
          for (const Tensor& p : fsdp.parameters()) trained[checkpointed][prefetch].push_back(p.to_vector());
        }
      }
      for (int prefetch = 0; prefetch < 2; ++prefetch)
        expect(trained[1][prefetch] == trained[0][0], "rank ", rank, " ", name, " forward_prefetch ",
               prefetch, ": checkpointed FSDP training differs from plain FSDP");
      // 3 Linear units, 3 steps: one more gather per unit per step under FULL_SHARD, none
      // under SHARD_GRAD_OP; prefetching changes no count.
      const int64_t extra = strategy == dist::ShardingStrategy::FULL_SHARD ? 9 : 0;
      expect(gathers[0][1] == gathers[0][0] && gathers[1][0] == gathers[0][0] + extra &&
                 gathers[1][1] == gathers[1][0],
             "rank ", rank, " ", name, ": all_gather calls plain ", gathers[0][0], " (prefetch ",
             gathers[0][1], "), checkpointed ", gathers[1][0], " (prefetch ", gathers[1][1], "); expected ",
             extra, " more when checkpointed and none from prefetching");
    }
    testing::leave();
  });
  CHECK_MESSAGE(failures.empty(), failures);
}
