// --strategy ddp|zero1|zero2|fsdp: the data-parallel wrapper an example trains through, and
// the state it saves, whichever wrapper it is.
//
//   examples::ParallelModel parallel(model, pg, "fsdp", ddp_options);
//   auto opt = parallel.make_optimizer([&](std::vector<Tensor> p) { return make_sgd(std::move(p)); });
//   loss_fn(parallel.forward_module()(x), y).backward();  opt->step();
//   nn::StateDict weights = parallel.model_state_dict();   // a collective; full on rank 0
//
// ddp    DistributedDataParallel: every rank holds everything (dist/ddp.h)
// zero1  DDP + ZeroRedundancyOptimizer: optimizer state sharded (dist/zero_redundancy_optimizer.h)
// zero2  FullyShardedDataParallel SHARD_GRAD_OP: gradients and optimizer state sharded
// fsdp   FullyShardedDataParallel FULL_SHARD: parameters too (dist/fsdp.h)
// Every Linear and Conv2d is an FSDP unit. Checkpoints hold the full model and the full
// optimizer state with the unwrapped model's names and indices, whatever the strategy, so a
// run resumes under another strategy or world size.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dist/ddp.h"
#include "dist/fsdp.h"
#include "dist/zero_redundancy_optimizer.h"
#include "nn/conv.h"
#include "nn/layers.h"

namespace nanoddp::examples {

inline const std::vector<std::string>& strategy_names() {
  static const std::vector<std::string> names = {"ddp", "zero1", "zero2", "fsdp"};
  return names;
}

class ParallelModel {
 public:
  ParallelModel(std::shared_ptr<nn::Module> model, std::shared_ptr<dist::ProcessGroup> pg, const std::string& strategy,
                const dist::DDPOptions& ddp_options)
      : model_(std::move(model)), pg_(std::move(pg)), strategy_(strategy) {
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
  nn::Module& forward_module() { return ddp_ ? static_cast<nn::Module&>(*ddp_) : *fsdp_; }
  dist::DistributedDataParallel* ddp() { return ddp_.get(); }
  dist::FullyShardedDataParallel* fsdp() { return fsdp_.get(); }

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
  // parameters holds it, on rank 0.
  nn::StateDict optimizer_state_dict(nn::Optimizer& optimizer) {
    if (fsdp_) return fsdp_->full_optim_state_dict(optimizer);
    if (auto* zero = dynamic_cast<dist::ZeroRedundancyOptimizer*>(&optimizer)) zero->consolidate_state_dict(0);
    return optimizer.state_dict();
  }
  void load_optimizer_state_dict(nn::Optimizer& optimizer, const nn::StateDict& state) {
    optimizer.load_state_dict(fsdp_ ? fsdp_->shard_full_optim_state_dict(state) : state);
  }

 private:
  std::shared_ptr<nn::Module> model_;
  std::shared_ptr<dist::ProcessGroup> pg_;
  std::string strategy_;
  std::unique_ptr<dist::DistributedDataParallel> ddp_;
  std::unique_ptr<dist::FullyShardedDataParallel> fsdp_;
};

}  // namespace nanoddp::examples
