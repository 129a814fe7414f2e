// FullyShardedDataParallel on real process groups. The property that proves it: FULL_SHARD,
// SHARD_GRAD_OP, NO_SHARD and DDP on W ranks all train like one process on the global batch,
// for an MLP and a CNN, with SGD + momentum and AdamW. Cases run their ranks on Gloo, forked;
// the last cases rerun this file with NANODDP_TEST_BACKEND=shm and under `mpirun -np 2`.
#include <doctest/doctest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <sstream>

#include "core/autograd.h"
#include "core/memory.h"
#include "core/ops.h"
#include "core/trace.h"
#include "dist/ddp.h"
#include "dist/explain.h"
#include "dist/fsdp.h"
#include "dist/init.h"
#include "dist/zero_redundancy_optimizer.h"
#include "nn/adam.h"
#include "nn/batch_norm.h"
#include "nn/checkpoint.h"
#include "nn/clip_grad.h"
#include "nn/conv.h"
#include "nn/layers.h"
#include "nn/optim.h"
#include "tests/batches.h"
#include "tests/dist_ranks.h"
#include "tests/forwarding_group.h"
#include "tests/multiprocess.h"
#include "tests/subprocess.h"

using namespace nanoddp;
using nanoddp::testing::Batch;
using nanoddp::testing::expect;
using nanoddp::testing::rows;
using nanoddp::testing::on_ranks;
using nanoddp::testing::under_mpirun;
using namespace std::chrono_literals;
using dist::ShardingStrategy;

namespace {

// This rank's group: a fresh one on a forked rank; under mpirun the one MPI group, made once.
std::shared_ptr<dist::ProcessGroup> join(int rank, int world, int port) {
  if (under_mpirun() && dist::is_initialized()) return dist::default_process_group();
  return testing::join(rank, world, port);
}

constexpr int64_t kGlobalBatch = 12;  // splits evenly over 1, 2, 3 and 4 ranks

// 5 -> 6 -> 3: units of 36 and 21 elements, so shards are padded at 2 and 4 ranks (18 + 11,
// 9 + 6) and uneven at none; at 3 ranks 12 + 7.
std::shared_ptr<nn::Module> make_mlp(uint64_t seed) {
  Generator gen(seed);
  auto model = std::make_shared<nn::Sequential>();
  model->add(nn::Linear(5, 6, gen));
  model->add(nn::ReLU());
  model->add(nn::Linear(6, 3, gen));
  return model;
}

// [N, 1, 6, 6] images as rows of 36: Conv(1->2, 3) -> [N, 2, 4, 4], MaxPool(2) -> [N, 2, 2, 2],
// Linear(8, 3).
class SmallCnn : public nn::Module {
 public:
  explicit SmallCnn(uint64_t seed) {
    Generator gen(seed);
    body_ = register_module("body", std::make_shared<nn::Sequential>());
    body_->add(nn::Conv2d(1, 2, 3, gen));
    body_->add(nn::ReLU());
    body_->add(nn::MaxPool2d(2));
    body_->add(nn::Flatten());
    body_->add(nn::Linear(8, 3, gen));
  }
  Tensor forward(const Tensor& input) override { return (*body_)(input.reshape({input.size(0), 1, 6, 6})); }

 private:
  std::shared_ptr<nn::Sequential> body_;
};

struct ModelKind {
  const char* name;
  int64_t features;
  std::function<std::shared_ptr<nn::Module>(uint64_t)> make;
  dist::AutoWrapPolicy policy;
};

std::vector<ModelKind> model_kinds() {
  return {
      {"MLP, every Linear a unit", 5, make_mlp, dist::module_wrap_policy<nn::Linear>()},
      // The root keeps the last Linear: a unit of its own that is gathered once per step.
      {"MLP, the root holds the last layer", 5, make_mlp,
       [](const std::string& name, nn::Module&) { return name == "0"; }},
      {"CNN, Conv2d and Linear units", 36, [](uint64_t seed) { return std::make_shared<SmallCnn>(seed); },
       dist::module_wrap_policy<nn::Conv2d, nn::Linear>()},
  };
}

Batch global_batch(int step, int64_t features) {
  return testing::random_batch(500 + static_cast<uint64_t>(step), kGlobalBatch, features, 3);
}
Batch share(const Batch& b, int rank, int world) {
  const int64_t per_rank = kGlobalBatch / world;
  return rows(b, rank * per_rank, (rank + 1) * per_rank);
}

std::unique_ptr<nn::Optimizer> make_optimizer(bool adamw, std::vector<Tensor> params) {
  if (adamw) {
    nn::AdamWOptions options;
    options.lr = 0.05f;
    return std::make_unique<nn::AdamW>(std::move(params), options);
  }
  return std::make_unique<nn::SGD>(std::move(params), nn::SGDOptions{/*lr=*/0.1f, /*momentum=*/0.9f});
}

// One process on the global batch: the reference. prepare (if any) changes the model first.
nn::StateDict train_reference(const ModelKind& kind, bool adamw, int steps,
                              const std::function<void(nn::Module&)>& prepare = {}) {
  auto model = kind.make(7);
  if (prepare) prepare(*model);
  auto opt = make_optimizer(adamw, model->parameters());
  for (int s = 0; s < steps; ++s) {
    const Batch b = global_batch(s, kind.features);
    opt->zero_grad();
    cross_entropy((*model)(b.x), b.y).backward();
    opt->step();
  }
  return model->state_dict();
}

// Largest |a - b| of any entry, and which.
std::string worst_difference(const nn::StateDict& got, const nn::StateDict& want, float tolerance, bool* ok) {
  std::ostringstream report;
  *ok = got.size() == want.size();
  if (!*ok) report << got.size() << " entries, expected " << want.size() << "\n";
  for (const auto& [key, w] : want) {
    const auto it = got.find(key);
    if (it == got.end()) {
      report << key << ": missing\n";
      *ok = false;
      continue;
    }
    if (w.dtype() == DType::Int64) {  // step counts: equal or not
      const bool same = it->second.dtype() == DType::Int64 && it->second.to_int_vector() == w.to_int_vector();
      report << key << (same ? ": equal\n" : ": differs\n");
      *ok = *ok && same;
      continue;
    }
    const std::vector<float> a = it->second.to_vector(), b = w.to_vector();
    float worst = a.size() == b.size() ? 0.0f : INFINITY;
    for (size_t j = 0; j < std::min(a.size(), b.size()); ++j) worst = std::max(worst, std::abs(a[j] - b[j]));
    report << key << ": max |diff| " << worst << "\n";
    if (!(worst <= tolerance)) *ok = false;
  }
  return report.str();
}

constexpr float kTolerance = 2e-5f;  // float sums in another order: 4 steps of lr 0.1 / 0.05
constexpr int kSteps = 4;

dist::FSDPOptions fsdp_options(ShardingStrategy strategy, const dist::AutoWrapPolicy& policy) {
  dist::FSDPOptions options;
  options.sharding_strategy = strategy;
  options.auto_wrap_policy = policy;
  options.forward_prefetch = true;
  return options;
}

// Every strategy and DDP, every model kind and both optimizers, on `world` ranks.
void check_exactness(int world) {
  const int port = testing::free_port();
  const std::string failures = on_ranks(world, [&](int rank) {
    auto pg = join(rank, world, port);
    for (const ModelKind& kind : model_kinds()) {
      for (const bool adamw : {false, true}) {
        const nn::StateDict want = train_reference(kind, adamw, kSteps);
        for (const char* strategy : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "DDP"}) {
          nn::StateDict got;
          // Rank 1 starts from other weights: construction must replace them with rank 0's.
          auto model = kind.make(rank == 0 ? 7 : 99);
          if (std::string(strategy) == "DDP") {
            auto ddp = std::make_shared<dist::DistributedDataParallel>(model, pg);
            auto opt = make_optimizer(adamw, ddp->parameters());
            for (int s = 0; s < kSteps; ++s) {
              const Batch b = share(global_batch(s, kind.features), rank, world);
              opt->zero_grad();
              cross_entropy((*ddp)(b.x), b.y).backward();
              opt->step();
            }
            got = model->state_dict();
          } else {
            const ShardingStrategy which = std::string(strategy) == "FULL_SHARD"      ? ShardingStrategy::FULL_SHARD
                                           : std::string(strategy) == "SHARD_GRAD_OP" ? ShardingStrategy::SHARD_GRAD_OP
                                                                                      : ShardingStrategy::NO_SHARD;
            dist::FullyShardedDataParallel fsdp(model, pg, fsdp_options(which, kind.policy));
            auto opt = make_optimizer(adamw, fsdp.parameters());
            for (int s = 0; s < kSteps; ++s) {
              const Batch b = share(global_batch(s, kind.features), rank, world);
              opt->zero_grad();
              cross_entropy(fsdp(b.x), b.y).backward();
              opt->step();
            }
            got = fsdp.full_state_dict(/*rank0_only=*/false);
          }
          bool ok = false;
          const std::string report = worst_difference(got, want, kTolerance, &ok);
          expect(ok, "rank ", rank, "/", world, " ", strategy, ", ", kind.name, ", ", adamw ? "AdamW" : "SGD",
                 " differs from one process on the global batch:\n", report);
        }
      }
    }
  }, 240s);
  CHECK_MESSAGE(failures.empty(), failures);
}

}  // namespace

TEST_CASE("a frozen unit (every parameter requires_grad false) is gathered, never reduced nor stepped; the rest trains as one process") {
  // The MLP's first Linear frozen, as a frozen embedding would be: one process on the global
  // batch with the same layer frozen is the reference. AdamW's weight decay would move a
  // frozen parameter that got a zero gradient, so an unchanged first layer shows that none
  // came: torch's optimizers, and ours, skip a parameter whose .grad is undefined.
  const ModelKind kind = model_kinds()[0];
  const auto freeze_first = [](nn::Module& model) {
    for (auto& named : model.named_parameters())
      if (named.first.rfind("0.", 0) == 0) named.second.set_requires_grad(false);
  };
  const nn::StateDict initial = kind.make(7)->state_dict();
  const nn::StateDict want = train_reference(kind, /*adamw=*/true, kSteps, freeze_first);
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [&](int rank) {
    auto pg = join(rank, 2, port);
    for (const auto strategy :
         {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP, ShardingStrategy::NO_SHARD}) {
      const char* name = dist::sharding_strategy_name(strategy);
      auto model = kind.make(7);
      freeze_first(*model);
      dist::FullyShardedDataParallel fsdp(model, pg, fsdp_options(strategy, kind.policy));
      const std::vector<Tensor> shards = fsdp.parameters();
      expect(shards.size() == 2 && !shards[0].requires_grad() && shards[1].requires_grad(), name,
             ": the frozen unit's flat parameter should not require grad, the other's should");
      auto opt = make_optimizer(true, shards);
      for (int s = 0; s < kSteps; ++s) {
        const Batch b = share(global_batch(s, kind.features), rank, 2);
        opt->zero_grad();
        cross_entropy(fsdp(b.x), b.y).backward();
        expect(!shards[0].grad().defined(), name, ": the frozen unit got a gradient");
        opt->step();
      }
      const nn::StateDict got = fsdp.full_state_dict(/*rank0_only=*/false);
      bool ok = false;
      const std::string report = worst_difference(got, want, kTolerance, &ok);
      expect(ok, "rank ", rank, " ", name, ": differs from one process with the same layer frozen:\n", report);
      for (const char* frozen : {"0.weight", "0.bias"})
        expect(got.at(frozen).to_vector() == initial.at(frozen).to_vector(), "rank ", rank, " ", name, ": ", frozen,
               " moved");
      // Its state saves; an optimizer over the trainable shard alone (torch's usual filter)
      // numbers its state otherwise, and saving it is refused, saying how to build it.
      const nn::StateDict optim_state = fsdp.full_optim_state_dict(*opt);
      expect(optim_state.count("exp_avg.2") == 1 && optim_state.count("exp_avg.0") == 0, "rank ", rank, " ",
             name, ": the frozen layer has AdamW state, or the trained one none");
      auto trainable_only = make_optimizer(true, {shards[1]});
      for (const bool full : {true, false}) {
        std::string why;
        try {
          if (full) {
            fsdp.full_optim_state_dict(*trainable_only);
          } else {
            fsdp.sharded_optim_state_dict(*trainable_only);
          }
        } catch (const ValueError& e) {
          why = e.what();
        }
        expect(
            why.find(
                "the optimizer has 1 parameters; it must be built on this wrapper's parameters(), all 2 in "
                "their order (its parameter 0 is not unit 0's flat parameter): build it on parameters(), "
                "frozen units included") != std::string::npos,
            "rank ", rank, " ", name, ": ", why);
      }
    }
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("MixedPrecision bfloat16: half the all_gather and reduce_scatter bytes; training within bf16 tolerance") {
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [&](int rank) {
    auto pg = join(rank, 2, port);
    const ModelKind kind = model_kinds()[0];
    const nn::StateDict want = train_reference(kind, false, kSteps);
    // Units 36 and 21 elements: shards of 18 and 11, 29 elements per rank, 2 bytes each.
    const int64_t shard_bytes = (18 + 11) * 2;
    for (const auto strategy :
         {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP, ShardingStrategy::NO_SHARD}) {
      const char* name = dist::sharding_strategy_name(strategy);
      auto model = kind.make(7);
      dist::FSDPOptions options = fsdp_options(strategy, kind.policy);
      options.mixed_precision.param_dtype = DType::BFloat16;
      options.mixed_precision.reduce_dtype = DType::BFloat16;
      dist::FullyShardedDataParallel fsdp(model, pg, options);
      auto opt = make_optimizer(false, fsdp.parameters());
      for (int s = 0; s < kSteps; ++s) {
        const Batch b = share(global_batch(s, kind.features), rank, 2);
        pg->reset_counts();
        opt->zero_grad();
        cross_entropy(fsdp(b.x), b.y).backward();
        opt->step();
        if (s > 0) continue;  // the first step's counts, as the float32 case above
        const auto gathers = pg->count(dist::Collective::AllGather);
        const auto scatters = pg->count(dist::Collective::ReduceScatter);
        const auto reduces = pg->count(dist::Collective::AllReduce);
        if (strategy == ShardingStrategy::FULL_SHARD) {  // gathered for forward and again for backward
          expect(gathers.calls == 4 && gathers.bytes == 2 * shard_bytes && scatters.bytes == shard_bytes, "rank ",
                 rank, " ", name, ": all_gathers ", gathers.calls, " calls, ", gathers.bytes,
                 " bytes; reduce_scatters ", scatters.bytes, " bytes; expected 4 calls, ", 2 * shard_bytes, " and ",
                 shard_bytes);
        } else if (strategy == ShardingStrategy::SHARD_GRAD_OP) {
          expect(gathers.calls == 2 && gathers.bytes == shard_bytes && scatters.bytes == shard_bytes, "rank ", rank,
                 " ", name, ": all_gathers ", gathers.bytes, " bytes, reduce_scatters ", scatters.bytes, " bytes");
        } else {  // nothing to gather; the gradient all-reduced in bfloat16
          expect(gathers.calls == 0 && reduces.calls == 2 && reduces.bytes == (36 + 21) * 2, "rank ", rank, " ", name,
                 ": ", reduces.calls, " all_reduces of ", reduces.bytes, " bytes");
        }
      }
      // The shards stay float32 and the optimizer steps them in float32.
      for (const Tensor& p : fsdp.parameters())
        expect(p.dtype() == DType::Float32 && p.grad().dtype() == DType::Float32, "rank ", rank, " ", name,
               ": a shard or its gradient is not float32");
      // bfloat16 rounds each gathered weight and each gradient to 8 significant bits: 4 SGD steps
      // of lr 0.1 from weights of size ~0.4 stay within a few thousandths of float32.
      bool ok = false;
      const std::string report = worst_difference(fsdp.full_state_dict(false), want, 5e-3f, &ok);
      expect(ok, "rank ", rank, " ", name, " in bfloat16 is too far from float32:\n", report);
      bool identical = false;
      worst_difference(fsdp.full_state_dict(false), want, 0.0f, &identical);
      expect(!identical, "rank ", rank, " ", name, ": bfloat16 changed nothing: were the collectives in float32?");
      // A state dict holds the shards' float32 values, not their bfloat16 rounding (torch
      // gathers in full precision for it): 4 bytes per element cross, and loaded into a float32
      // FSDP the state gives back the same shards, bit for bit.
      pg->reset_counts();
      const nn::StateDict full = fsdp.full_state_dict(false);
      if (strategy != ShardingStrategy::NO_SHARD)
        expect(pg->count(dist::Collective::AllGather).bytes == (18 + 11) * 4, "rank ", rank, " ", name,
               ": full_state_dict gathered ", pg->count(dist::Collective::AllGather).bytes,
               " bytes, expected the float32 shards' ", (18 + 11) * 4);
      dist::FullyShardedDataParallel reloaded(kind.make(8), pg, fsdp_options(strategy, kind.policy));
      reloaded.load_full_state_dict(full);
      for (size_t i = 0; i < fsdp.parameters().size(); ++i)
        expect(reloaded.parameters()[i].to_vector() == fsdp.parameters()[i].to_vector(), "rank ", rank, " ", name,
               ": shard ", i, " differs after a full_state_dict round trip: the state was rounded");
    }
    dist::FSDPOptions bad;
    bad.mixed_precision.param_dtype = DType::Int64;
    bool threw = false;
    try {
      dist::FullyShardedDataParallel fsdp(kind.make(7), pg, bad);
    } catch (const ValueError&) {
      threw = true;
    }
    expect(threw, "rank ", rank, ": MixedPrecision with int64 was accepted");
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("2 ranks: FULL_SHARD == SHARD_GRAD_OP == NO_SHARD == DDP == one process (MLP, CNN; SGD, AdamW)") {
  check_exactness(2);
}

TEST_CASE(
    "a forward with no backward after it (a dry run, a metric between backward and step) leaves no stale "
    "weights") {
  const int port = testing::free_port();
  const std::string failures = on_ranks(
      2,
      [&](int rank) {
        auto pg = join(rank, 2, port);
        for (const ModelKind& kind : model_kinds()) {
          const nn::StateDict want = train_reference(kind, /*adamw=*/false, kSteps);
          for (const ShardingStrategy strategy :
               {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP}) {
            dist::FullyShardedDataParallel fsdp(kind.make(7), pg, fsdp_options(strategy, kind.policy));
            auto opt = make_optimizer(/*adamw=*/false, fsdp.parameters());
            const Batch held_out = share(global_batch(99, kind.features), rank, 2);
            (void)fsdp(held_out.x);  // a dry run in training mode, with grad: it keeps some units gathered
            for (int s = 0; s < kSteps; ++s) {
              const Batch b = share(global_batch(s, kind.features), rank, 2);
              opt->zero_grad();
              cross_entropy(fsdp(b.x), b.y).backward();
              (void)fsdp(held_out.x);  // a metric read before the step: its weights are the old ones
              opt->step();
            }
            bool ok = false;
            const std::string report =
                worst_difference(fsdp.full_state_dict(/*rank0_only=*/false), want, kTolerance, &ok);
            expect(ok, "rank ", rank, " ", dist::sharding_strategy_name(strategy), ", ", kind.name,
                   ": a forward without backward changed training:\n", report);
          }
        }
      },
      240s);
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("3 and 4 ranks: every strategy equals one process (uneven and padded shards)") {
  check_exactness(3);
  check_exactness(4);
}

TEST_CASE("units, shards and the bytes each collective moves per step equal the formulas") {
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [&](int rank) {
    auto pg = join(rank, 2, port);
    const ModelKind kind = model_kinds()[0];
    // Units 36 and 21 elements: shards of 18 and 11 (one padding element), 29 floats per rank.
    const int64_t shard_bytes = (18 + 11) * 4;
    for (const auto strategy : {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP, ShardingStrategy::NO_SHARD}) {
      const int64_t params_before = memory_stats(Device::cpu()).live[static_cast<int>(MemoryCategory::Parameters)];
      auto model = kind.make(7);
      dist::FullyShardedDataParallel fsdp(model, pg, fsdp_options(strategy, kind.policy));
      const auto units = fsdp.units();
      expect(units.size() == 2 && units[0].name == "0" && units[1].name == "2" && units[0].numel == 36 &&
                 units[1].numel == 21,
             "rank ", rank, ": units are not Linear 0 (36) and Linear 2 (21)");
      const bool sharded = strategy != ShardingStrategy::NO_SHARD;
      expect(units[0].shard_numel == (sharded ? 18 : 36) && units[1].shard_numel == (sharded ? 11 : 21), "rank ", rank,
             ": shards of ", units[0].shard_numel, " and ", units[1].shard_numel);
      // Between steps a rank holds its shards only (Note [Memory categories]).
      const int64_t params_now = memory_stats(Device::cpu()).live[static_cast<int>(MemoryCategory::Parameters)];
      const int64_t expected_params = sharded ? shard_bytes : (36 + 21) * 4;
      expect(params_now - params_before == expected_params, "rank ", rank, " ", dist::sharding_strategy_name(strategy),
             ": parameters hold ", params_now - params_before, " bytes between steps, expected ", expected_params);
      auto opt = make_optimizer(false, fsdp.parameters());
      const Batch b = share(global_batch(0, kind.features), rank, 2);
      pg->reset_counts();
      opt->zero_grad();
      cross_entropy(fsdp(b.x), b.y).backward();
      opt->step();
      const auto gathers = pg->count(dist::Collective::AllGather);
      const auto scatters = pg->count(dist::Collective::ReduceScatter);
      const auto reduces = pg->count(dist::Collective::AllReduce);
      if (strategy == ShardingStrategy::FULL_SHARD) {
        // Ψ gathered for forward, again for backward, reduce-scattered once: 3 × 29 floats.
        expect(gathers.calls == 4 && gathers.bytes == 2 * shard_bytes, "rank ", rank, ": FULL_SHARD all_gathers ",
               gathers.calls, " calls, ", gathers.bytes, " bytes; expected 4, ", 2 * shard_bytes);
        expect(scatters.calls == 2 && scatters.bytes == shard_bytes && reduces.calls == 0, "rank ", rank,
               ": FULL_SHARD reduce_scatters ", scatters.calls, " calls, ", scatters.bytes, " bytes");
      } else if (strategy == ShardingStrategy::SHARD_GRAD_OP) {
        expect(gathers.calls == 2 && gathers.bytes == shard_bytes, "rank ", rank, ": SHARD_GRAD_OP all_gathers ",
               gathers.calls, " calls, ", gathers.bytes, " bytes; expected 2, ", shard_bytes);
        expect(scatters.calls == 2 && scatters.bytes == shard_bytes, "rank ", rank, ": SHARD_GRAD_OP reduce_scatters ",
               scatters.calls, ", ", scatters.bytes, " bytes");
      } else {
        expect(gathers.calls == 0 && scatters.calls == 0 && reduces.calls == 2 && reduces.bytes == (36 + 21) * 4,
               "rank ", rank, ": NO_SHARD: ", reduces.calls, " all_reduces of ", reduces.bytes, " bytes");
      }
    }
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("the allocator's peak model state in a step equals --explain's prediction, per stage (2 ranks, AdamW)") {
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [&](int rank) {
    auto pg = join(rank, 2, port);
    const ModelKind kind = model_kinds()[0];
    for (const char* stage : {"ddp", "zero2", "fsdp"}) {
      const int64_t baseline = memory_stats(Device::cpu()).live_model_state;
      int64_t peak = 0;
      {
        auto model = kind.make(7);
        std::unique_ptr<dist::DistributedDataParallel> ddp;
        std::unique_ptr<dist::FullyShardedDataParallel> fsdp;
        if (std::string(stage) == "ddp")
          ddp = std::make_unique<dist::DistributedDataParallel>(model, pg);
        else
          fsdp = std::make_unique<dist::FullyShardedDataParallel>(
              model, pg,
              fsdp_options(std::string(stage) == "fsdp" ? ShardingStrategy::FULL_SHARD : ShardingStrategy::SHARD_GRAD_OP,
                           kind.policy));
        nn::Module& wrapped = ddp ? static_cast<nn::Module&>(*ddp) : *fsdp;
        auto opt = make_optimizer(true, wrapped.parameters());
        for (int s = 0; s < 2; ++s) {  // the second step, with the optimizer's state made
          const Batch b = share(global_batch(s, kind.features), rank, 2);
          opt->zero_grad();
          if (s == 1) reset_peak_memory();
          cross_entropy(wrapped(b.x), b.y).backward();
          opt->step();
        }
        peak = memory_stats(Device::cpu()).peak_model_state - baseline;
      }
      dist::ModelStateShape shape;
      shape.numel = 36 + 21;
      shape.world_size = 2;
      shape.optimizer_state_bytes_per_element = 8;
      shape.unit_numels = {36, 21};
      const int64_t predicted = dist::predicted_peak_model_state(shape, stage);
      expect(peak == predicted, "rank ", rank, " ", stage, ": measured peak model state ", peak, " bytes, predicted ",
             predicted);
    }
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("docs answers: the deep MLP's model state per rank at 2 ranks with AdamW, by stage") {
  // --hidden 1024,1024,1024,1024: Ψ = 3,962,890 in five units (docs/ddp/12-sharding.md).
  dist::ModelStateShape shape;
  shape.unit_numels = {784 * 1024 + 1024, 1024 * 1024 + 1024, 1024 * 1024 + 1024, 1024 * 1024 + 1024, 1024 * 10 + 10};
  for (int64_t n : shape.unit_numels) shape.numel += n;
  shape.world_size = 2;
  shape.optimizer_state_bytes_per_element = 8;
  CHECK(shape.numel == 3962890);
  CHECK(dist::predicted_peak_model_state(shape, "ddp") == 20 * 3962890);
  CHECK(dist::predicted_peak_model_state(shape, "zero1") == 16 * 3962890);
  CHECK(dist::predicted_peak_model_state(shape, "zero2") == 48005200);
  CHECK(dist::predicted_peak_model_state(shape, "fsdp") == 45906000);
  // The ladder's rungs: naive and overlap reduce each .grad in place (no buffer), flat keeps one
  // flat buffer as DDP keeps its buckets (docs/ladder.md's table: 2,821,752 and 3,762,336 for
  // the MLP with SGD's momentum).
  CHECK(dist::predicted_peak_model_state(shape, "naive") == 16 * 3962890);
  CHECK(dist::predicted_peak_model_state(shape, "overlap") == 16 * 3962890);
  CHECK(dist::predicted_peak_model_state(shape, "flat") == 20 * 3962890);
  dist::ModelStateShape mlp;
  mlp.numel = 235146;
  mlp.world_size = 2;
  mlp.optimizer_state_bytes_per_element = 4;
  CHECK(dist::predicted_peak_model_state(mlp, "naive") == 2821752);
  CHECK(dist::predicted_peak_model_state(mlp, "flat") == 3762336);
  // ZeRO-1 partitions whole parameters, largest first: rank 0 owns two of the three
  // 1024 x 1024 weights (2,097,152 elements), rank 1 the third, the first layer's weight and
  // the rest (1,865,738). Rank 0's AdamW state is 8 x 2,097,152 bytes, not 8 x Ψ / 2: the
  // allocator's peak on rank 0 (benchmarks/README.md, 64,331,896 bytes).
  for (int64_t n : {784 * 1024, 1024, 1024 * 1024, 1024, 1024 * 1024, 1024, 1024 * 1024, 1024, 10 * 1024, 10})
    shape.parameter_numels.push_back(n);
  CHECK(dist::partition_parameters(shape.parameter_numels, 2) == std::vector<int>{1, 1, 0, 1, 1, 1, 0, 1, 1, 1});
  CHECK(dist::predicted_peak_model_state(shape, "zero1") == 16 * 3962890 - 8 * 3962890 / 2 + 8 * 2097152);
  CHECK(dist::predicted_peak_model_state(shape, "zero1") == 64331896);
  shape.rank = 1;
  CHECK(dist::predicted_peak_model_state(shape, "zero1") == 16 * 3962890 - 8 * 3962890 / 2 + 8 * 1865738);
}

TEST_CASE("the trace shows each unit's all_gathers and reduce_scatter on the unit's own lane, with their bytes") {
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [&](int rank) {
    auto pg = join(rank, 2, port);
    const ModelKind kind = model_kinds()[0];
    dist::FullyShardedDataParallel fsdp(kind.make(7), pg, fsdp_options(ShardingStrategy::FULL_SHARD, kind.policy));
    nn::SGD opt(fsdp.parameters(), {/*lr=*/0.1});
    trace::start("");  // in memory only
    const double t0 = trace::now_us();
    const Batch b = share(global_batch(0, kind.features), rank, 2);
    cross_entropy(fsdp(b.x), b.y).backward();
    opt.step();
    // Units 0 (shard 18 floats = 72 bytes) and 1 (11 floats = 44 bytes).
    std::map<std::string, int> spans;
    for (const trace::Event& e : trace::events_since(t0)) {
      if (e.lane < trace::kFsdpUnitLane) continue;
      const int unit = e.lane - trace::kFsdpUnitLane;
      const std::string bytes = unit == 0 ? "\"bytes\":72" : "\"bytes\":44";
      expect(e.args_json.find(bytes) != std::string::npos, "rank ", rank, ": ", e.name, " on unit ", unit,
             "'s lane has args ", e.args_json);
      expect(trace::lane_name(e.lane) == "fsdp unit " + std::to_string(unit), "rank ", rank, ": lane named ",
             trace::lane_name(e.lane));
      ++spans[e.name];
    }
    trace::stop();
    const std::map<std::string, int> want = {{"all_gather '0'", 2}, {"all_gather '2'", 2},
                                             {"reduce_scatter '0'", 1}, {"reduce_scatter '2'", 1}};
    expect(spans == want, "rank ", rank, ": FSDP spans per step are not two all_gathers and one reduce_scatter "
           "per unit (", spans.size(), " kinds)");
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("no_sync accumulates full gradients and the next backward reduces their sum") {
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [&](int rank) {
    auto pg = join(rank, 2, port);
    const ModelKind kind = model_kinds()[0];
    const nn::StateDict want = train_reference(kind, false, 2);
    for (const auto strategy : {ShardingStrategy::FULL_SHARD, ShardingStrategy::NO_SHARD}) {
      dist::FullyShardedDataParallel fsdp(kind.make(7), pg, fsdp_options(strategy, kind.policy));
      auto opt = make_optimizer(false, fsdp.parameters());
      for (int s = 0; s < 2; ++s) {
        const Batch mine = share(global_batch(s, kind.features), rank, 2);  // 6 rows: two micro-batches of 3
        opt->zero_grad();
        pg->reset_counts();
        {
          auto guard = fsdp.no_sync();
          (cross_entropy(fsdp(rows(mine, 0, 3).x), rows(mine, 0, 3).y) * 0.5f).backward();
        }
        const int64_t inside = pg->count(dist::Collective::ReduceScatter).calls + pg->count(dist::Collective::AllReduce).calls;
        expect(inside == 0, "rank ", rank, ": no_sync reduced ", inside, " times");
        (cross_entropy(fsdp(rows(mine, 3, 6).x), rows(mine, 3, 6).y) * 0.5f).backward();
        opt->step();
      }
      bool ok = false;
      const std::string report = worst_difference(fsdp.full_state_dict(false), want, kTolerance, &ok);
      expect(ok, "rank ", rank, " ", dist::sharding_strategy_name(strategy), " with no_sync:\n", report);
    }
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

namespace {
// Two Linear units; the second takes part only while use_b is set (a branch some micro-batches skip).
struct Branchy : nn::Module {
  explicit Branchy(uint64_t seed) {
    Generator gen(seed);
    a = register_module("a", std::make_shared<nn::Linear>(5, 3, gen));
    b = register_module("b", std::make_shared<nn::Linear>(5, 3, gen));
  }
  Tensor forward(const Tensor& x) override { return use_b ? (*a)(x) + (*b)(x) : (*a)(x); }
  std::shared_ptr<nn::Linear> a, b;
  bool use_b = true;
};
}  // namespace

TEST_CASE("no_sync: a unit only the accumulated micro-batch reached is reduced at the synced backward") {
  // Step s: micro-batch 1 (global rows 0-5, under no_sync) runs both units, micro-batch 2
  // (rows 6-11, synced) only unit a. Unit b's gradient comes from the first alone: it must be
  // reduced at the second backward, not kept and added to the next step's.
  auto reference = std::make_shared<Branchy>(3);
  auto reference_opt = make_optimizer(false, reference->parameters());
  for (int s = 0; s < 2; ++s) {
    const Batch b = global_batch(s, 5);
    reference_opt->zero_grad();
    reference->use_b = true;
    (cross_entropy((*reference)(rows(b, 0, 6).x), rows(b, 0, 6).y) * 0.5f).backward();
    reference->use_b = false;
    (cross_entropy((*reference)(rows(b, 6, 12).x), rows(b, 6, 12).y) * 0.5f).backward();
    reference_opt->step();
  }
  const nn::StateDict want = reference->state_dict();
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [&](int rank) {
    auto pg = join(rank, 2, port);
    for (const auto strategy :
         {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP, ShardingStrategy::NO_SHARD}) {
      auto model = std::make_shared<Branchy>(3);
      dist::FullyShardedDataParallel fsdp(model, pg,
                                          fsdp_options(strategy, dist::module_wrap_policy<nn::Linear>()));
      auto opt = make_optimizer(false, fsdp.parameters());
      for (int s = 0; s < 2; ++s) {
        const Batch b = global_batch(s, 5);
        const Batch first = rows(b, 3 * rank, 3 * rank + 3), second = rows(b, 6 + 3 * rank, 9 + 3 * rank);
        opt->zero_grad();
        {
          auto guard = fsdp.no_sync();
          model->use_b = true;
          (cross_entropy(fsdp(first.x), first.y) * 0.5f).backward();
        }
        model->use_b = false;
        (cross_entropy(fsdp(second.x), second.y) * 0.5f).backward();
        opt->step();
      }
      bool ok = false;
      const std::string report = worst_difference(fsdp.full_state_dict(false), want, kTolerance, &ok);
      expect(ok, "rank ", rank, " ", dist::sharding_strategy_name(strategy), ":\n", report);
    }
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE(
    "zero_grad discards what no_sync accumulated: the optimizer's or the wrapper's, to None or to zeros") {
  // Each step: a micro-batch through both units under no_sync, then zero_grad, then a synced
  // one through unit a only. The first is discarded, so the result is training on the second
  // alone; unit b's sum must not reach the step (nor the next one).
  enum class Zeroing { OptimizerToNone, OptimizerToZeros, WrapperToNone };
  const auto train_alone = [](Zeroing zeroing) {
    auto reference = std::make_shared<Branchy>(3);
    auto reference_opt = make_optimizer(false, reference->parameters());
    reference->use_b = false;
    for (int s = 0; s < 2; ++s) {
      const Batch b = global_batch(s, 5);
      reference_opt->zero_grad(zeroing != Zeroing::OptimizerToZeros);
      cross_entropy((*reference)(rows(b, 6, 12).x), rows(b, 6, 12).y).backward();
      reference_opt->step();
    }
    return reference->state_dict();
  };
  const std::vector<Zeroing> zeroings = {Zeroing::OptimizerToNone, Zeroing::OptimizerToZeros,
                                         Zeroing::WrapperToNone};
  std::vector<nn::StateDict> wants;
  for (const Zeroing zeroing : zeroings) wants.push_back(train_alone(zeroing));
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [&](int rank) {
    auto pg = join(rank, 2, port);
    for (const auto strategy :
         {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP, ShardingStrategy::NO_SHARD}) {
      for (size_t z = 0; z < zeroings.size(); ++z) {
        auto model = std::make_shared<Branchy>(3);
        dist::FullyShardedDataParallel fsdp(model, pg,
                                            fsdp_options(strategy, dist::module_wrap_policy<nn::Linear>()));
        auto opt = make_optimizer(false, fsdp.parameters());
        for (int s = 0; s < 2; ++s) {
          const Batch b = global_batch(s, 5);
          const Batch discarded = rows(b, 3 * rank, 3 * rank + 3), kept = rows(b, 6 + 3 * rank, 9 + 3 * rank);
          {
            auto guard = fsdp.no_sync();
            model->use_b = true;
            cross_entropy(fsdp(discarded.x), discarded.y).backward();
          }
          if (zeroings[z] == Zeroing::WrapperToNone)
            fsdp.zero_grad();
          else
            opt->zero_grad(zeroings[z] == Zeroing::OptimizerToNone);
          model->use_b = false;
          cross_entropy(fsdp(kept.x), kept.y).backward();
          opt->step();
        }
        bool ok = false;
        const std::string report = worst_difference(fsdp.full_state_dict(false), wants[z], kTolerance, &ok);
        expect(ok, "rank ", rank, " ", dist::sharding_strategy_name(strategy), ", zeroing ", z, ":\n",
               report);
        // The next forward frees a discarded sum: the model's own .grad views of it go too.
        {
          auto guard = fsdp.no_sync();
          const Batch b = global_batch(0, 5);
          model->use_b = true;
          cross_entropy(fsdp(rows(b, 0, 3).x), rows(b, 0, 3).y).backward();
        }
        opt->zero_grad();
        NoGradGuard no_grad;
        (void)fsdp(rows(global_batch(0, 5), 0, 3).x);
        for (const Tensor& p : model->parameters())
          expect(!p.grad().defined(), "rank ", rank, " ", dist::sharding_strategy_name(strategy),
                 ": a model parameter kept a view of the discarded sum after the next forward");
      }
    }
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE(
    "a local state without a BatchNorm's num_batches_tracked loads into the wrapper, the counter set to 0") {
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [&](int rank) {
    auto pg = join(rank, 2, port);
    Generator gen(5);
    auto model = std::make_shared<nn::Sequential>();
    model->add(nn::Linear(5, 4, gen));
    auto norm = std::make_shared<nn::BatchNorm1d>(4);
    model->add(norm);
    dist::FullyShardedDataParallel fsdp(model, pg, fsdp_options(ShardingStrategy::FULL_SHARD, {}));
    norm->num_batches_tracked.copy_(Tensor::from_vector(std::vector<int64_t>{3}).reshape(Shape{}));
    nn::StateDict state = fsdp.state_dict();
    expect(state.erase("1.num_batches_tracked") == 1, "rank ", rank,
           ": no 1.num_batches_tracked in the wrapper's state");
    try {
      const nn::Module::IncompatibleKeys keys = fsdp.load_state_dict(state);
      expect(keys.missing_keys.empty(), "rank ", rank, ": ", keys.missing_keys.size(), " keys missing");
    } catch (const std::exception& e) {
      expect(false, "rank ", rank, ": ", e.what());
    }
    expect(norm->num_batches_tracked.to_int_vector() == std::vector<int64_t>{0}, "rank ", rank,
           ": the counter was not set to 0");
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("clip_grad_norm_ over shards is the norm of the whole gradient, and clips it as one") {
  const ModelKind kind = model_kinds()[0];
  // One process: the whole gradient's norm, and the clipped parameters after one SGD step.
  auto reference = kind.make(7);
  nn::SGD reference_opt(reference->parameters(), {/*lr=*/0.1f});
  const Batch b = global_batch(0, kind.features);
  cross_entropy((*reference)(b.x), b.y).backward();
  const float want_norm = nn::clip_grad_norm_(reference->parameters(), 0.05);
  reference_opt.step();
  const nn::StateDict want = reference->state_dict();
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [&](int rank) {
    auto pg = join(rank, 2, port);
    for (const auto strategy : {ShardingStrategy::FULL_SHARD, ShardingStrategy::NO_SHARD}) {
      dist::FullyShardedDataParallel fsdp(kind.make(7), pg, fsdp_options(strategy, kind.policy));
      nn::SGD opt(fsdp.parameters(), {/*lr=*/0.1f});
      const Batch mine = share(b, rank, 2);
      cross_entropy(fsdp(mine.x), mine.y).backward();
      const float norm = fsdp.clip_grad_norm_(0.05);
      expect(std::abs(norm - want_norm) <= 1e-5f * want_norm, "rank ", rank, " ", dist::sharding_strategy_name(strategy),
             ": norm ", norm, ", one process ", want_norm);
      opt.step();
      bool ok = false;
      const std::string report = worst_difference(fsdp.full_state_dict(false), want, 1e-6f, &ok);
      expect(ok, "rank ", rank, ": clipped step differs:\n", report);
    }
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE(
    "clip_grad_norm_ over shards of gradients near float's limits is nn::clip_grad_norm_'s norm, not inf or "
    "0") {
  // Gradients scaled by 1e22 square past float32's range, by 1e-24 below it: a sum of squares
  // sent as float32 would give inf and 0.
  const ModelKind kind = model_kinds()[0];
  auto reference = kind.make(7);
  const Batch b = global_batch(0, kind.features);
  cross_entropy((*reference)(b.x), b.y).backward();
  std::vector<Tensor> reference_grads;
  for (const Tensor& p : reference->parameters()) reference_grads.push_back(p.grad().clone());
  const std::vector<float> scales = {1e22f, 1e-24f};
  std::vector<float> want;
  for (const float scale : scales) {
    std::vector<Tensor> params = reference->parameters();
    for (size_t i = 0; i < params.size(); ++i) params[i].set_grad(reference_grads[i] * scale);
    want.push_back(nn::clip_grad_norm_(params, /*max_norm=*/1e30));
  }
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [&](int rank) {
    auto pg = join(rank, 2, port);
    for (const auto strategy : {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP}) {
      dist::FullyShardedDataParallel fsdp(kind.make(7), pg, fsdp_options(strategy, kind.policy));
      const Batch mine = share(b, rank, 2);
      cross_entropy(fsdp(mine.x), mine.y).backward();
      std::vector<Tensor> shards = fsdp.parameters(), grads;
      for (const Tensor& p : shards) grads.push_back(p.grad().clone());
      for (size_t k = 0; k < scales.size(); ++k) {
        for (size_t i = 0; i < shards.size(); ++i) shards[i].set_grad(grads[i] * scales[k]);
        const float norm = fsdp.clip_grad_norm_(/*max_norm=*/1e30);
        expect(std::isfinite(norm) && norm > 0 && std::abs(norm - want[k]) <= 1e-5f * want[k], "rank ", rank,
               " ", dist::sharding_strategy_name(strategy), " scale ", scales[k], ": norm ", norm,
               ", one process ", want[k]);
      }
    }
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("a full checkpoint (model + optimizer) saved at 2 ranks resumes at 3 and 1 exactly as if uninterrupted") {
  if (under_mpirun()) return;
  const ModelKind kind = model_kinds()[0];
  const nn::StateDict want = train_reference(kind, /*adamw=*/true, kSteps);
  // A plain AdamW's state after 2 steps: what full_optim_state_dict must give.
  auto plain = kind.make(7);
  auto plain_opt = make_optimizer(true, plain->parameters());
  for (int s = 0; s < 2; ++s) {
    const Batch b = global_batch(s, kind.features);
    plain_opt->zero_grad();
    cross_entropy((*plain)(b.x), b.y).backward();
    plain_opt->step();
  }
  const nn::StateDict plain_state = plain_opt->state_dict();
  char path_template[] = "/tmp/nanoddp-fsdp-XXXXXX";
  const int fd = ::mkstemp(path_template);
  REQUIRE(fd >= 0);
  ::close(fd);
  const std::string path = path_template;
  int port = testing::free_port();
  std::string failures = on_ranks(2, [&](int rank) {
    auto pg = join(rank, 2, port);
    dist::FullyShardedDataParallel fsdp(kind.make(7), pg, fsdp_options(ShardingStrategy::FULL_SHARD, kind.policy));
    auto opt = make_optimizer(true, fsdp.parameters());
    for (int s = 0; s < 2; ++s) {
      const Batch b = share(global_batch(s, kind.features), rank, 2);
      opt->zero_grad();
      cross_entropy(fsdp(b.x), b.y).backward();
      opt->step();
    }
    const nn::StateDict optim = fsdp.full_optim_state_dict(*opt);
    bool ok = false;
    const std::string report = worst_difference(optim, plain_state, kTolerance, &ok);
    expect(ok, "rank ", rank, ": full_optim_state_dict differs from a plain AdamW's state_dict:\n", report);
    const nn::StateDict model = fsdp.full_state_dict();
    if (rank == 0) {
      nn::StateDict all;
      nn::merge_prefixed(all, "model.", model);
      nn::merge_prefixed(all, "optimizer.", optim);
      nn::save_checkpoint(path, all);
    }
    pg->barrier()->wait();
  });
  REQUIRE_MESSAGE(failures.empty(), failures);
  for (const int world : {3, 1}) {
    port = testing::free_port();
    failures = on_ranks(world, [&](int rank) {
      auto pg = join(rank, world, port);
      const nn::StateDict saved = nn::load_checkpoint(path);
      dist::FullyShardedDataParallel fsdp(kind.make(99), pg, fsdp_options(ShardingStrategy::FULL_SHARD, kind.policy));
      fsdp.load_full_state_dict(nn::strip_prefix(saved, "model."));
      auto opt = make_optimizer(true, fsdp.parameters());
      opt->load_state_dict(fsdp.shard_full_optim_state_dict(nn::strip_prefix(saved, "optimizer.")));
      for (int s = 2; s < kSteps; ++s) {
        const Batch b = share(global_batch(s, kind.features), rank, world);
        opt->zero_grad();
        cross_entropy(fsdp(b.x), b.y).backward();
        opt->step();
      }
      bool ok = false;
      const std::string report = worst_difference(fsdp.full_state_dict(false), want, kTolerance, &ok);
      expect(ok, "rank ", rank, "/", world, ": resumed from 2 ranks, differs from the uninterrupted run:\n", report);
    });
    CHECK_MESSAGE(failures.empty(), "resumed at world size ", world, ": ", failures);
  }
  std::remove(path.c_str());
}

TEST_CASE("an optimizer state whose step differs inside one unit is refused, naming both parameters, as torch's FSDP") {
  // A unit's parameters share one flat parameter and so one step count. A plain AdamW whose
  // parameters stepped apart (one had no gradient once) has no such count: taking the first
  // would step the others' moments with the wrong bias correction.
  const ModelKind kind = model_kinds()[0];
  auto plain = kind.make(7);
  auto plain_opt = make_optimizer(true, plain->parameters());
  const Batch b = global_batch(0, kind.features);
  cross_entropy((*plain)(b.x), b.y).backward();
  plain_opt->step();
  const nn::StateDict state = plain_opt->state_dict();  // every step.i is 1
  nn::StateDict skewed = state, missing = state;
  skewed["step.1"] = Tensor::from_vector(std::vector<int64_t>{2}, state.at("step.1").shape());
  missing.erase("step.1");
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [&](int rank) {
    auto pg = join(rank, 2, port);
    dist::FullyShardedDataParallel fsdp(kind.make(7), pg, fsdp_options(ShardingStrategy::FULL_SHARD, kind.policy));
    for (const auto& [bad, has] : {std::pair<const nn::StateDict*, std::string>{&skewed, "has 2"},
                                   std::pair<const nn::StateDict*, std::string>{&missing, "has none"}}) {
      std::string message;
      try {
        fsdp.shard_full_optim_state_dict(*bad);
      } catch (const ValueError& e) {
        message = e.what();
      }
      expect(message.find("'step' must be the same for every parameter of unit '0'") != std::string::npos &&
                 message.find("'0.weight' has 1 and '0.bias' " + has) != std::string::npos,
             "rank ", rank, ": ", message.empty() ? "accepted" : message);
    }
    expect(!fsdp.shard_full_optim_state_dict(state).empty(), "rank ", rank, ": the plain state was refused");
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("ranks that built different models: every rank's FSDP constructor names the parameter, before any broadcast") {
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [&](int rank) {
    auto pg = join(rank, 2, port);
    Generator gen(7);
    auto model = std::make_shared<nn::Sequential>();
    model->add(nn::Linear(5, rank == 0 ? 6 : 7, gen));
    model->add(nn::ReLU());
    model->add(nn::Linear(rank == 0 ? 6 : 7, 3, gen));
    std::string message;
    try {
      dist::FullyShardedDataParallel fsdp(model, pg, fsdp_options(ShardingStrategy::FULL_SHARD, {}));
    } catch (const DistError& e) {
      message = e.what();
    }
    const std::string want = rank == 0 ? "FSDP on rank 0/2: parameter #0 '0.weight' [6, 5] differs from rank 1's "
                                         "parameter #0 of shape [7, 5]"
                                       : "FSDP on rank 1/2: parameter #0 '0.weight' [7, 5] differs from rank 0's "
                                         "parameter #0 of shape [6, 5]";
    expect(message.find(want) != std::string::npos, "rank ", rank, ": ", message.empty() ? "no error" : message);
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE(
    "ranks that pass other FSDPOptions (strategy, MixedPrecision, auto_wrap_policy): every rank names the "
    "option") {
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [&](int rank) {
    auto pg = join(rank, 2, port);
    const auto constructor_error = [&](const dist::FSDPOptions& options) {
      try {
        dist::FullyShardedDataParallel fsdp(make_mlp(7), pg, options);
      } catch (const DistError& e) {
        return std::string(e.what());
      }
      return std::string("no error");
    };
    const auto expect_message = [&](const std::string& message, const std::string& want) {
      expect(message.find(want) != std::string::npos, "rank ", rank, ": expected '", want, "' in: ", message);
    };
    const int other = 1 - rank;
    dist::FSDPOptions strategy =
        fsdp_options(rank == 0 ? ShardingStrategy::FULL_SHARD : ShardingStrategy::SHARD_GRAD_OP,
                     dist::module_wrap_policy<nn::Linear>());
    expect_message(constructor_error(strategy),
                   std::string(rank == 0 ? "sharding_strategy FULL_SHARD here but SHARD_GRAD_OP"
                                         : "sharding_strategy SHARD_GRAD_OP here but FULL_SHARD") +
                       " on rank " + std::to_string(other));
    dist::FSDPOptions prefetch =
        fsdp_options(ShardingStrategy::FULL_SHARD, dist::module_wrap_policy<nn::Linear>());
    prefetch.backward_prefetch = rank == 0;
    expect_message(constructor_error(prefetch),
                   rank == 0 ? "backward_prefetch true here but true and false on rank 1"
                             : "backward_prefetch false here but true and true on rank 0");
    dist::FSDPOptions precision = fsdp_options(ShardingStrategy::FULL_SHARD, {});
    if (rank == 1) precision.mixed_precision.param_dtype = DType::BFloat16;
    expect_message(constructor_error(precision), "MixedPrecision (param_dtype ");
    // Every Linear a unit on rank 0 (2 units: the root keeps nothing); no policy on rank 1 (the root).
    dist::FSDPOptions policy =
        fsdp_options(ShardingStrategy::FULL_SHARD, dist::module_wrap_policy<nn::Linear>());
    if (rank == 1) policy.auto_wrap_policy = nullptr;
    expect_message(constructor_error(policy),
                   rank == 0 ? "the model's units here are 2, on rank 1 1; every rank must "
                               "pass the same auto_wrap_policy"
                             : "the model's units here are 1, on rank 0 2");
    // The same number of units, other modules: the first Linear against the last, so the root
    // keeps the other one (21 elements against 36).
    dist::FSDPOptions which = fsdp_options(ShardingStrategy::FULL_SHARD, {});
    which.auto_wrap_policy = [rank](const std::string& name, nn::Module&) {
      return name == (rank == 0 ? "0" : "2");
    };
    expect_message(constructor_error(which),
                   rank == 0 ? "unit 0 is root of 21 elements here but of 36 elements on rank 1"
                             : "unit 0 is root of 36 elements here but of 21 elements on rank 0");
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("a rank that catches an exception from its backward and goes on is stopped, never paired with another step") {
  // As the DDP case in test_ddp_edges: rank 1's hook throws in step 1 and rank 1 goes on; its
  // next forward must not pair its reduce_scatters with rank 0's of step 1.
  if (under_mpirun()) return;  // a refused collective leaves an MPI request open at exit
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [&](int rank) {
    auto pg = join(rank, 2, port);
    auto model = make_mlp(7);
    dist::FullyShardedDataParallel fsdp(model, pg, fsdp_options(ShardingStrategy::FULL_SHARD,
                                                                dist::module_wrap_policy<nn::Linear>()));
    bool armed = false;
    if (rank == 1) testing::throw_when_armed(model->parameters().front(), &armed);
    std::string errors;
    for (int step = 0; step < 3; ++step) {
      armed = rank == 1 && step == 1;
      const Batch b = share(global_batch(step, 5), rank, 2);
      try {
        cross_entropy(fsdp(b.x), b.y).backward();
      } catch (const std::exception& e) {
        errors += "step " + std::to_string(step) + ": " + e.what() + "\n";
      }
    }
    if (rank == 1)
      expect(errors.find("step 2: FSDP on rank 1/2: the previous backward on this rank ended by an exception, and "
                         "the other ranks did not end theirs the same way") != std::string::npos,
             "rank 1: ", errors);
    else
      expect(errors.find("step 1: ") != std::string::npos, "rank 0: step 1 completed, paired with rank 1's step 2");
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

namespace {

// A Work that failed: what a backend returns for a collective it gave up on.
class FailedWork : public dist::Work {
 public:
  void wait(std::chrono::milliseconds) override { throw DistError("all_gather: injected failure"); }
  bool is_completed() override { return true; }
};

// Fails the next all_gather after `armed` is set, on every rank alike, without issuing it.
class FailingGatherGroup : public testing::ForwardingGroup {
 public:
  using ForwardingGroup::ForwardingGroup;
  std::shared_ptr<dist::Work> all_gather(std::vector<Tensor>& outs, const Tensor& in) override {
    if (!armed) return inner_->all_gather(outs, in);
    armed = false;
    return std::make_shared<FailedWork>();
  }
  bool armed = false;
};

}  // namespace

TEST_CASE("a failed all_gather is not thrown again: the next forward gathers anew and computes the model") {
  // Both ranks' first gather of a forward fails. A wrapper that kept the failed Work would
  // throw its error at every later forward and state dict, without issuing a collective.
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [&](int rank) {
    auto failing = std::make_shared<FailingGatherGroup>(join(rank, 2, port));
    dist::FullyShardedDataParallel fsdp(
        make_mlp(7), failing,
        fsdp_options(ShardingStrategy::FULL_SHARD, dist::module_wrap_policy<nn::Linear>()));
    const Tensor x = share(global_batch(0, 5), rank, 2).x;
    failing->armed = true;
    std::string first;
    try {
      (void)fsdp(x);
    } catch (const DistError& e) {
      first = e.what();
    }
    expect(first.find("injected failure") != std::string::npos, "rank ", rank, ": the first forward gave '",
           first, "'");
    const std::vector<float> got = fsdp(x).to_vector(), want = (*make_mlp(7))(x).to_vector();
    expect(got == want, "rank ", rank, ": the forward after the failed gather differs from the model's");
    expect(fsdp.full_state_dict(/*rank0_only=*/false).size() == 4, "rank ", rank,
           ": the full state dict after it is incomplete");
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

namespace {

// Two ranks, FULL_SHARD over each Linear: each runs `body` (rank, its FSDP) and must get the
// collective check's mismatch, whose message names `purpose`.
void expect_mismatch_on_every_rank(const std::function<void(int, dist::FullyShardedDataParallel&)>& body,
                                   const std::string& purpose) {
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [&](int rank) {
    auto pg = join(rank, 2, port);
    auto model = make_mlp(7);
    dist::FullyShardedDataParallel fsdp(
        model, pg, fsdp_options(ShardingStrategy::FULL_SHARD, dist::module_wrap_policy<nn::Linear>()));
    std::string error;
    try {
      body(rank, fsdp);
    } catch (const DistError& e) {
      error = e.what();
    }
    expect(error.find("ranks called different collectives") != std::string::npos &&
               error.find(purpose) != std::string::npos,
           "rank ", rank, ": ", error.empty() ? std::string("no error") : error);
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

}  // namespace

TEST_CASE(
    "state-dict gathers never pair with a forward's, nor a save's with a load's: a mismatch on every rank") {
  // All of these gather every unit in float32, of the same sizes: only the purpose in the
  // collective check's fingerprint tells them apart.
  if (under_mpirun()) return;  // a refused collective leaves an MPI request open at exit
  SUBCASE("a rank that ran one step fewer asks for the state dict") {
    // Paired with the other's second forward, it returned a state dict while its peer waited
    // for the timeout.
    expect_mismatch_on_every_rank(
        [](int rank, dist::FullyShardedDataParallel& fsdp) {
          for (int step = 0; step < (rank == 0 ? 2 : 1); ++step) {
            const Batch b = share(global_batch(step, 5), rank, 2);
            cross_entropy(fsdp(b.x), b.y).backward();
          }
          fsdp.full_state_dict(/*rank0_only=*/false);
        },
        "state dict");
  }
  SUBCASE("one rank saves the full state dict while the other loads one") {
    // Paired, the loading rank alone would copy the loaded values into its shard.
    const nn::StateDict other = make_mlp(99)->state_dict();
    expect_mismatch_on_every_rank(
        [&](int rank, dist::FullyShardedDataParallel& fsdp) {
          if (rank == 0)
            fsdp.full_state_dict(/*rank0_only=*/false);
          else
            fsdp.load_full_state_dict(other);
        },
        "load_full_state_dict's check");
  }
}

TEST_CASE("load_full_state_dict: a state one rank refuses is loaded by no rank") {
  // The header asks every rank for the same state. A rank given another one (a wrong shape
  // here) throws its ShapeError; before, its peer loaded the state and the models differed.
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [&](int rank) {
    auto pg = join(rank, 2, port);
    dist::FullyShardedDataParallel fsdp(
        make_mlp(7), pg, fsdp_options(ShardingStrategy::FULL_SHARD, dist::module_wrap_policy<nn::Linear>()));
    const nn::StateDict before = fsdp.full_state_dict(/*rank0_only=*/false);
    nn::StateDict state = make_mlp(99)->state_dict();
    if (rank == 1) state.begin()->second = Tensor::zeros({1});
    std::string error;
    try {
      fsdp.load_full_state_dict(state);
    } catch (const ShapeError& e) {
      error = rank == 1 ? "" : std::string("rank 0 threw rank 1's ShapeError: ") + e.what();
    } catch (const ValueError& e) {
      const std::string m = e.what();
      error = rank == 0 && m.find("rank(s) 1 refused the state") != std::string::npos ? "" : m;
    }
    expect(error.empty(), "rank ", rank, ": ", error);
    const nn::StateDict after = fsdp.full_state_dict(/*rank0_only=*/false);
    for (const auto& [name, value] : before)
      expect(after.at(name).to_vector() == value.to_vector(), "rank ", rank, ": '", name, "' changed");
    // A good state still loads afterwards: the ranks are in step.
    fsdp.load_full_state_dict(make_mlp(99)->state_dict());
    expect(fsdp.full_state_dict(false).at("0.weight").to_vector() ==
               make_mlp(99)->state_dict().at("0.weight").to_vector(),
           "rank ", rank, ": the good state did not load");
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE(
    "a unit whose output reaches the loss on one rank only is a mismatch naming the unit, under NO_SHARD "
    "too") {
  // Both units run their forward on every rank; rank 1's loss leaves unit b out, so its backward
  // reduces a alone. Under NO_SHARD the two units' all_reduces have the same size: only the
  // unit in the collective check's fingerprint tells rank 1's a from rank 0's b.
  if (under_mpirun()) return;  // a refused collective leaves an MPI request open at exit
  struct BothRun : nn::Module {
    BothRun() {
      Generator gen(3);
      a = register_module("a", std::make_shared<nn::Linear>(5, 3, gen));
      b = register_module("b", std::make_shared<nn::Linear>(5, 3, gen));
    }
    Tensor forward(const Tensor& x) override {
      const Tensor from_b = (*b)(x);
      return use_b ? (*a)(x) + from_b : (*a)(x);
    }
    std::shared_ptr<nn::Linear> a, b;
    bool use_b = true;
  };
  for (const auto strategy :
       {ShardingStrategy::NO_SHARD, ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP}) {
    const int port = testing::free_port();
    const std::string failures = on_ranks(2, [&](int rank) {
      auto pg = join(rank, 2, port);
      auto model = std::make_shared<BothRun>();
      model->use_b = rank == 0;
      dist::FullyShardedDataParallel fsdp(model, pg,
                                          fsdp_options(strategy, dist::module_wrap_policy<nn::Linear>()));
      const Batch mine = share(global_batch(0, 5), rank, 2);
      std::string message;
      try {
        cross_entropy(fsdp(mine.x), mine.y).backward();
        pg->barrier()->wait();  // rank 1's next collective, where rank 0 still reduces
      } catch (const DistError& e) {
        message = e.what();
      }
      expect(message.find("ranks called different collectives") != std::string::npos &&
                 message.find(" for FSDP unit ") != std::string::npos,
             "rank ", rank, " ", dist::sharding_strategy_name(strategy), ": ",
             message.empty() ? "no error" : message);
    });
    CHECK_MESSAGE(failures.empty(), failures);
  }
}

TEST_CASE("the local state_dict holds the model's buffers too: BatchNorm's running statistics load back") {
  const auto make = [](uint64_t seed) {
    Generator gen(seed);
    auto model = std::make_shared<nn::Sequential>();
    model->add(nn::Linear(5, 6, gen));
    model->add(std::make_shared<nn::BatchNorm1d>(6));
    model->add(nn::ReLU());
    model->add(nn::Linear(6, 3, gen));
    return model;
  };
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [&](int rank) {
    auto pg = join(rank, 2, port);
    auto trained_model = make(7);
    dist::FullyShardedDataParallel trained(trained_model, pg, fsdp_options(ShardingStrategy::FULL_SHARD, dist::module_wrap_policy<nn::Linear>()));
    nn::SGD opt(trained.parameters(), {/*lr=*/0.1f});
    for (int s = 0; s < 2; ++s) {
      const Batch b = share(global_batch(s, 5), rank, 2);
      opt.zero_grad();
      cross_entropy(trained(b.x), b.y).backward();
      opt.step();
    }
    const nn::StateDict local = trained.state_dict();
    for (const char* name : {"1.running_mean", "1.running_var", "1.num_batches_tracked"})
      expect(local.count(name) == 1, "rank ", rank, ": the local state_dict has no ", name);
    expect(local.at("1.num_batches_tracked").to_int_vector() == std::vector<int64_t>{2}, "rank ", rank,
           ": num_batches_tracked is not 2 after 2 steps");
    auto fresh_model = make(99);
    dist::FullyShardedDataParallel fresh(fresh_model, pg, fsdp_options(ShardingStrategy::FULL_SHARD, dist::module_wrap_policy<nn::Linear>()));
    fresh.load_state_dict(local);
    // Into the model's own buffers: what its eval-mode forward reads.
    const auto want = trained_model->named_buffers(), got = fresh_model->named_buffers();
    for (size_t i = 0; i < want.size(); ++i) {
      const bool same = want[i].second.dtype() == DType::Int64
                            ? got[i].second.to_int_vector() == want[i].second.to_int_vector()
                            : got[i].second.to_vector() == want[i].second.to_vector();
      expect(same, "rank ", rank, ": buffer ", want[i].first, " was not restored");
    }
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE(
    "a submodule put in eval() stays in eval through training forwards; the wrapper's eval() reaches all") {
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [&](int rank) {
    auto pg = join(rank, 2, port);
    Generator gen(8);
    auto model = std::make_shared<nn::Sequential>();
    model->add(nn::Linear(5, 6, gen));
    auto norm = std::make_shared<nn::BatchNorm1d>(6);
    model->add(norm);
    model->add(nn::Linear(6, 3, gen));
    norm->eval();  // frozen statistics, as when fine-tuning
    // Built before the wrapping: accepted then, refused at its step, when its parameters are
    // views of freed unit vectors that no backward gives a gradient.
    nn::SGD too_early(model->parameters(), {/*lr=*/0.1f});
    dist::FullyShardedDataParallel fsdp(model, pg, fsdp_options(ShardingStrategy::FULL_SHARD, {}));
    try {
      too_early.step();
      expect(false, "rank ", rank, ": an optimizer built before the wrapping stepped");
    } catch (const ValueError& e) {
      expect(std::string(e.what()).find(
                 "SGD: parameter 0 ([6, 5]) has its memory freed: it belongs to a model that "
                 "FullyShardedDataParallel wrapped after this optimizer was built") != std::string::npos,
             "rank ", rank, ": ", e.what());
    }
    // The model's own parameters are views of freed unit vectors: an optimizer over them would
    // step nothing.
    try {
      nn::SGD wrong(model->parameters(), {/*lr=*/0.1f});
      expect(false, "rank ", rank, ": an optimizer over the wrapped model's own parameters was accepted");
    } catch (const ValueError& e) {
      expect(
          std::string(e.what()).find("SGD: parameter 0 ([6, 5]) has its memory freed: it belongs to a model "
                                     "wrapped in FullyShardedDataParallel") != std::string::npos,
          "rank ", rank, ": ", e.what());
    }
    nn::SGD opt(fsdp.parameters(), {/*lr=*/0.1f});
    for (int s = 0; s < 2; ++s) {
      const Batch b = share(global_batch(s, 5), rank, 2);
      opt.zero_grad();
      cross_entropy(fsdp(b.x), b.y).backward();
      opt.step();
    }
    expect(!norm->is_training(), "rank ", rank, ": the forward put the BatchNorm back in training");
    expect(norm->num_batches_tracked.to_int_vector() == std::vector<int64_t>{0}, "rank ", rank,
           ": the frozen BatchNorm counted batches");
    expect(norm->running_mean.to_vector() == std::vector<float>(6, 0.0f), "rank ", rank,
           ": the frozen BatchNorm's running mean moved");
    fsdp.eval();
    expect(!model->is_training() && !(*model)[0].is_training(), "rank ", rank,
           ": eval() did not reach the model");
    fsdp.train();
    expect(model->is_training() && norm->is_training(), "rank ", rank, ": train() did not reach the model");
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("the local state_dict is this rank's shards and loads back at the same world size") {
  const int port = testing::free_port();
  const std::string failures = on_ranks(2, [&](int rank) {
    auto pg = join(rank, 2, port);
    const ModelKind kind = model_kinds()[0];
    dist::FullyShardedDataParallel trained(kind.make(7), pg, fsdp_options(ShardingStrategy::FULL_SHARD, kind.policy));
    nn::SGD opt(trained.parameters(), {/*lr=*/0.1f});
    const Batch b = share(global_batch(0, kind.features), rank, 2);
    cross_entropy(trained(b.x), b.y).backward();
    opt.step();
    const nn::StateDict local = trained.state_dict();
    expect(local.size() == 2 && local.count("0._flat_param") == 1 && local.at("0._flat_param").numel() == 18 &&
               local.at("2._flat_param").numel() == 11,
           "rank ", rank, ": local state_dict is not the two shards of 18 and 11");
    dist::FullyShardedDataParallel fresh(kind.make(99), pg, fsdp_options(ShardingStrategy::FULL_SHARD, kind.policy));
    fresh.load_state_dict(local);
    bool ok = false;
    const std::string report = worst_difference(fresh.full_state_dict(false), trained.full_state_dict(false), 0.0f, &ok);
    expect(ok, "rank ", rank, ": loading the local state did not restore the model:\n", report);
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

namespace {
// Two blocks that both hold one Linear: a parameter two units share.
class Block : public nn::Module {
 public:
  explicit Block(std::shared_ptr<nn::Linear> shared) { shared_ = register_module("shared", std::move(shared)); }
  Tensor forward(const Tensor& input) override { return (*shared_)(input); }

 private:
  std::shared_ptr<nn::Linear> shared_;
};
class TiedBlocks : public nn::Module {
 public:
  TiedBlocks() {
    auto linear = std::make_shared<nn::Linear>(3, 3);
    a_ = register_module("a", std::make_shared<Block>(linear));
    b_ = register_module("b", std::make_shared<Block>(linear));
  }
  Tensor forward(const Tensor& input) override { return (*b_)((*a_)(input)); }

 private:
  std::shared_ptr<Block> a_, b_;
};
}  // namespace

TEST_CASE("a parameter shared by two units is an error naming it and both units; a unit half frozen too") {
  if (under_mpirun()) return;
  const int port = testing::free_port();
  const std::string failures = on_ranks(1, [&](int rank) {
    auto pg = testing::join(rank, 1, port);
    dist::FSDPOptions options;
    options.auto_wrap_policy = [](const std::string& name, nn::Module&) { return name == "a" || name == "b"; };
    std::string message = "no error";
    try {
      dist::FullyShardedDataParallel fsdp(std::make_shared<TiedBlocks>(), pg, options);
    } catch (const ValueError& e) {
      message = e.what();
    }
    expect(message.find("'b.shared.weight' is shared by units 'a' and 'b'") != std::string::npos,
           "a parameter two units share: ", message);
    // Left to the root (no policy), the tied Linear is one parameter of one unit: fine. Its
    // state holds it under both names, as torch's state_dict does, the sharded one too.
    dist::FullyShardedDataParallel root_only(std::make_shared<TiedBlocks>(), pg);
    expect(root_only.units().size() == 1 && root_only.units()[0].numel == 12, "the root unit is not the 12 elements");
    const nn::StateDict full = root_only.full_state_dict();
    const dist::ShardedStateDict sharded = root_only.sharded_model_state_dict();
    for (const std::string name : {"a.shared.weight", "a.shared.bias", "b.shared.weight", "b.shared.bias"}) {
      expect(full.count(name) == 1, "full_state_dict has no '", name, "'");
      expect(sharded.count(name) == 1, "sharded_model_state_dict has no '", name, "'");
    }
    expect(full.size() == 4 && full.at("a.shared.weight").to_vector() == full.at("b.shared.weight").to_vector(),
           "the tied weight's two entries differ");
    // The wrapper's own state_dict is its flat shard: loading it into a bare model says so.
    std::string local_message = "no error";
    try {
      TiedBlocks().load_state_dict(root_only.state_dict());
    } catch (const ValueError& e) {
      local_message = e.what();
    }
    expect(local_message.find("'_flat_param' is a FullyShardedDataParallel shard") != std::string::npos &&
               local_message.find("save fsdp.full_state_dict()") != std::string::npos,
           "a local state loaded into the bare model: ", local_message);
    auto frozen = make_mlp(1);
    frozen->parameters()[1].set_requires_grad(false);
    message = "no error";
    try {
      dist::FullyShardedDataParallel fsdp(frozen, pg);
    } catch (const ValueError& e) {
      message = e.what();
    }
    expect(message.find("unit root holds '0.bias', which does not require grad, and '0.weight', which does") !=
               std::string::npos,
           "a unit that mixes frozen and trained parameters: ", message);
  });
  CHECK_MESSAGE(failures.empty(), failures);
}

TEST_CASE("the 2-rank cases pass on the MPI backend too (this file under mpirun -np 2)") {
  if (under_mpirun()) return;
  if (!testing::have_mpirun()) {
    MESSAGE("mpirun not found: the MPI half of this file did not run");
    return;
  }
  const testing::RunResult r = testing::mpirun_self("tests/test_fsdp", 2, "--test-case-exclude='*mpirun*'");
  CHECK_MESSAGE(r.code() == 0, "mpirun run failed:\n", r.out, r.err);
}

TEST_CASE("3 and 4 ranks on the MPI backend too (the exactness case under mpirun -np 3 and -np 4)") {
  if (under_mpirun()) return;
  if (!testing::have_mpirun()) {
    MESSAGE("mpirun not found: the MPI half of this file did not run");
    return;
  }
  for (const int np : {3, 4}) {
    const testing::RunResult r = testing::mpirun_self("tests/test_fsdp", np, "--test-case='3 and 4 ranks: every*'", 240s);
    CHECK_MESSAGE(r.code() == 0, "mpirun -np ", np, " failed:\n", r.out, r.err);
  }
}

TEST_CASE("every case passes on the shm backend too (this file with NANODDP_TEST_BACKEND=shm)") {
  if (under_mpirun() || std::getenv("NANODDP_TEST_BACKEND") != nullptr) return;
  const testing::RunResult r = testing::rerun_with_backend(
      "tests/test_fsdp", "shm", "--test-case-exclude='*mpirun*,*NANODDP_TEST_BACKEND*'", 240s);
  CHECK_MESSAGE(r.code() == 0, "shm run failed:\n", r.out, r.err);
}
