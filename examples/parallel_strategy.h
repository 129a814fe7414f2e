// --strategy ddp|zero1|zero2|fsdp: the data-parallel wrapper an example trains through, and
// the state it saves, whichever wrapper it is.
//
//   examples::ParallelModel parallel(model, pg, "fsdp", ddp_options);
//   auto opt = parallel.make_optimizer([&](std::vector<Tensor> p) { return make_sgd(std::move(p)); });
//   loss_fn(parallel(x), y).backward();  parallel.finish_gradient_sync();  opt->step();
//   nn::StateDict weights = parallel.model_state_dict();   // a collective; full on rank 0
//
// ddp    DistributedDataParallel: every rank holds everything (dist/ddp.h)
// zero1  DDP + ZeroRedundancyOptimizer: optimizer state sharded (dist/zero_redundancy_optimizer.h)
// zero2  FullyShardedDataParallel SHARD_GRAD_OP: gradients and optimizer state sharded
// fsdp   FullyShardedDataParallel FULL_SHARD: parameters too (dist/fsdp.h)
// naive, flat, overlap: the ladder's rungs (examples/ladder/rung.h), the steps from nothing to DDP
// Every Linear and Conv2d is an FSDP unit. Checkpoints hold the full model and the full
// optimizer state with the unwrapped model's names and indices, whatever the strategy, so a
// run resumes under another strategy or world size. A sharded checkpoint
// (dist/sharded_checkpoint.h) holds the same entries, each rank's part in its own file.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dist/ddp.h"
#include "dist/fsdp.h"
#include "dist/sharded_checkpoint.h"
#include "dist/zero_redundancy_optimizer.h"
#include "examples/ladder/flat.h"
#include "examples/ladder/naive.h"
#include "examples/ladder/overlap.h"
#include "examples/strategy_names.h"
#include "nn/conv.h"
#include "nn/layers.h"

namespace nanoddp::examples {

class ParallelModel {
 public:
  ParallelModel(std::shared_ptr<nn::Module> model, std::shared_ptr<dist::ProcessGroup> pg, const std::string& strategy,
                const dist::DDPOptions& ddp_options)
      : model_(std::move(model)), pg_(std::move(pg)), strategy_(strategy) {
    if (strategy == "naive") rung_ = std::make_unique<ladder::NaiveDataParallel>(model_, pg_, ddp_options.timeout);
    if (strategy == "flat") rung_ = std::make_unique<ladder::FlatDataParallel>(model_, pg_, ddp_options.timeout);
    if (strategy == "overlap") rung_ = std::make_unique<ladder::OverlapDataParallel>(model_, pg_, ddp_options.timeout);
    if (rung_) return;
    if (strategy == "ddp" || strategy == "zero1") {
      ddp_ = std::make_unique<dist::DistributedDataParallel>(model_, pg_, ddp_options);
      return;
    }
    dist::FSDPOptions options;
    options.sharding_strategy =
        strategy == "zero2" ? dist::ShardingStrategy::SHARD_GRAD_OP : dist::ShardingStrategy::FULL_SHARD;
    options.auto_wrap_policy = dist::module_wrap_policy<nn::Linear, nn::Conv2d>();
    options.timeout = ddp_options.timeout;
    fsdp_ = std::make_unique<dist::FullyShardedDataParallel>(model_, pg_, options);
  }

  const std::string& strategy() const { return strategy_; }
  // What the training loop and the evaluation call.
  nn::Module& forward_module() {
    if (rung_) return *rung_;
    return ddp_ ? static_cast<nn::Module&>(*ddp_) : *fsdp_;
  }
  Tensor operator()(const Tensor& input) { return forward_module()(input); }
  dist::DistributedDataParallel* ddp() { return ddp_.get(); }
  dist::FullyShardedDataParallel* fsdp() { return fsdp_.get(); }
  ladder::Rung* rung() { return rung_.get(); }

  // After backward, before the optimizer's step: a ladder rung reduces the gradients here;
  // DDP and FSDP already did, inside backward.
  void finish_gradient_sync() {
    if (rung_) rung_->finish_gradient_sync();
  }

  // While the returned handle lives, gradients stay local (the wrapper's no_sync(): for DDP,
  // the backward of a forward run meanwhile; for FSDP and the rungs, a backward run meanwhile).
  [[nodiscard]] std::shared_ptr<void> no_sync() {
    if (rung_) return std::make_shared<Holder<ladder::Rung>>(*rung_);
    if (ddp_) return std::make_shared<Holder<dist::DistributedDataParallel>>(*ddp_);
    return std::make_shared<Holder<dist::FullyShardedDataParallel>>(*fsdp_);
  }

  // A collective: rank 0's buffers (BatchNorm's running statistics) on every rank, as DDP's
  // broadcast_buffers gives them at each forward. FSDP and the ladder's rungs leave each rank
  // its own, updated on its own batches: an evaluation over the ranks, or rank 0's checkpoint,
  // would then be of different models. Buffers are read in eval mode only, so training does
  // not change. Nothing under DDP and ZeRO-1.
  void sync_buffers() {
    if (ddp_) return;
    for (Tensor& buffer : model_->buffers()) pg_->broadcast(buffer, 0)->wait();
  }

  // make(params) builds the plain optimizer; zero1 wraps it in a ZeroRedundancyOptimizer.
  using OptimizerFactory = std::function<std::unique_ptr<nn::Optimizer>(std::vector<Tensor>)>;
  std::unique_ptr<nn::Optimizer> make_optimizer(const OptimizerFactory& make) {
    if (strategy_ == "zero1") return std::make_unique<dist::ZeroRedundancyOptimizer>(ddp_->parameters(), pg_, make);
    return make(forward_module().parameters());
  }

  // A collective: the unwrapped model's state_dict on rank 0 ({} elsewhere under FSDP).
  nn::StateDict model_state_dict() { return fsdp_ ? fsdp_->full_state_dict() : model_->state_dict(); }
  void load_model_state_dict(const nn::StateDict& state) {
    if (fsdp_)
      fsdp_->load_full_state_dict(state);
    else
      model_->load_state_dict(state);
  }
  // A collective: the optimizer's state as a plain optimizer over the unwrapped model's
  // parameters holds it, on rank 0 ({} elsewhere under zero1 and fsdp).
  nn::StateDict optimizer_state_dict(nn::Optimizer& optimizer) {
    if (fsdp_) return fsdp_->full_optim_state_dict(optimizer);
    if (auto* zero = dynamic_cast<dist::ZeroRedundancyOptimizer*>(&optimizer)) {
      zero->consolidate_state_dict(0);
      return pg_->rank() == 0 ? zero->state_dict() : nn::StateDict{};
    }
    return optimizer.state_dict();
  }
  void load_optimizer_state_dict(nn::Optimizer& optimizer, const nn::StateDict& state) {
    optimizer.load_state_dict(fsdp_ ? fsdp_->shard_full_optim_state_dict(state) : state);
  }

  // This rank's pieces of the model ("model.<name>") and of the optimizer state
  // ("optimizer.<buffer>.<i>") for save_sharded_checkpoint, under the names a full checkpoint
  // has. No collective. ValueError for ddp and the ladder's rungs, where rank 0 holds it all.
  dist::ShardedStateDict sharded_state_dict(const nn::Optimizer& optimizer) const {
    dist::ShardedStateDict state;
    if (fsdp_) {
      dist::merge_prefixed(state, "model.", fsdp_->sharded_model_state_dict());
      dist::merge_prefixed(state, "optimizer.", fsdp_->sharded_optim_state_dict(optimizer));
      return state;
    }
    const auto* zero = dynamic_cast<const dist::ZeroRedundancyOptimizer*>(&optimizer);
    NANODDP_CHECK(zero != nullptr, ValueError,
                  "a sharded checkpoint needs --strategy zero1, zero2 or fsdp, not ", strategy_);
    dist::merge_prefixed(state, "model.", zero->sharded_model_state_dict(*model_));
    dist::merge_prefixed(state, "optimizer.", zero->sharded_state_dict());
    return state;
  }

  // What this rank loads of a sharded checkpoint: read by read_sharded (it may fail on one
  // rank only, each rank reading other files), then loaded by load_local_state (a collective
  // under zero1 and fsdp) once every rank has read its part.
  struct LocalState {
    nn::StateDict model;      // fsdp: this rank's shards ("0._flat_param"); else the whole model
    nn::StateDict optimizer;  // what the optimizer's load_state_dict takes
  };
  LocalState read_sharded(dist::ShardedCheckpointReader& reader, const nn::Optimizer& optimizer) const {
    if (fsdp_)
      return {fsdp_->read_local_state_dict(reader, "model."),
              fsdp_->read_local_optim_state_dict(reader, "optimizer.")};
    if (const auto* zero = dynamic_cast<const dist::ZeroRedundancyOptimizer*>(&optimizer))
      return {reader.read_all("model."), zero->read_local_state_dict(reader, "optimizer.")};
    return {reader.read_all("model."), reader.read_all("optimizer.")};
  }
  void load_local_model(const LocalState& local) {
    if (fsdp_)
      fsdp_->load_state_dict(local.model);
    else
      model_->load_state_dict(local.model);
  }
  void load_local_optimizer(nn::Optimizer& optimizer, const LocalState& local) {
    optimizer.load_state_dict(local.optimizer);
  }

 private:
  std::shared_ptr<nn::Module> model_;
  std::shared_ptr<dist::ProcessGroup> pg_;
  std::string strategy_;
  std::unique_ptr<dist::DistributedDataParallel> ddp_;
  std::unique_ptr<dist::FullyShardedDataParallel> fsdp_;
  std::unique_ptr<ladder::Rung> rung_;

  // Keeps a wrapper's NoSyncGuard (which cannot move) alive on the heap.
  template <typename Wrapper>
  struct Holder {
    explicit Holder(Wrapper& wrapper) : guard(wrapper.no_sync()) {}
    typename Wrapper::NoSyncGuard guard;
  };
};

}  // namespace nanoddp::examples
