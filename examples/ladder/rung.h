// The ladder: data parallelism built up one idea at a time, each rung a file read in one
// sitting. Every rung trains the same model to the same parameters (up to float rounding);
// what changes from one rung to the next is how many collectives a step issues, how many
// bytes they carry, and how much of that time backward hides.
//
//   naive    examples/ladder/naive.h     one blocking all_reduce per parameter after backward
//   flat     examples/ladder/flat.h      one all_reduce of every gradient, flattened
//   overlap  examples/ladder/overlap.h   one async all_reduce per parameter, from its hook
//   buckets  dist/ddp.h, dist/reducer.h  async all_reduces of ~25 MiB buckets: the library's DDP
//   zero1    + dist/zero_redundancy_optimizer.h   each rank keeps 1/W of the optimizer state
//   fsdp     dist/fsdp.h                 parameters and gradients sharded too
//
//   auto dp = std::make_shared<ladder::NaiveDataParallel>(model, pg);   // rank 0's weights everywhere
//   loss_fn((*dp)(x), y).backward();  dp->finish_gradient_sync();  opt.step();
//
// The contract every rung keeps (the one torch's DistributedDataParallel keeps):
//   1. construction is collective: every rank's parameters and buffers become rank 0's;
//   2. after finish_gradient_sync(), every parameter's .grad is the mean over ranks of the
//      ranks' .grad, so one step equals one process's step on the concatenated batch;
//   3. every rank issues the same collectives in the same order (dist/process_group.h).
// Under no_sync() backward leaves the gradients local, and finish_gradient_sync() is not called;
// the next synced backward and its finish_gradient_sync() reduce the accumulated sum.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/autograd.h"
#include "core/error.h"
#include "core/trace.h"
#include "dist/process_group.h"
#include "nn/module.h"

namespace nanoddp::ladder {

class Rung : public nn::Module {
 public:
  // model: on the group's device. Throws what the broadcasts throw (DistError, TimeoutError),
  // and ValueError when no parameter requires grad.
  Rung(std::shared_ptr<nn::Module> model, std::shared_ptr<dist::ProcessGroup> pg,
       std::chrono::milliseconds timeout = dist::kDefaultTimeout)
      : model_(register_module("module", std::move(model))), pg_(std::move(pg)), timeout_(timeout) {
    NoGradGuard no_grad;
    for (auto& [name, param] : model_->named_parameters())
      if (param.requires_grad()) params_.emplace_back(name, param);
    NANODDP_CHECK(!params_.empty(), ValueError, "a data-parallel rung needs a parameter that requires grad");
    // Same start on every rank: without it each rank would train its own model.
    for (auto& [name, param] : model_->named_parameters()) pg_->broadcast(param, 0)->wait(timeout_);
    for (Tensor buffer : model_->buffers()) pg_->broadcast(buffer, 0)->wait(timeout_);
  }

  // The model's forward: data parallelism changes nothing here.
  Tensor forward(const Tensor& input) override { return (*model_)(input); }

  // Called after loss.backward() and before optimizer.step(): on return every parameter's
  // .grad holds the mean over ranks. Throws DistError naming a parameter with no gradient,
  // TimeoutError when a peer does not answer within the timeout.
  virtual void finish_gradient_sync() = 0;

  // While the guard lives, backward keeps gradients local (torch's ddp.no_sync()).
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(Rung& rung) : rung_(rung), previous_(rung.sync_) { rung_.sync_ = false; }
    ~NoSyncGuard() { rung_.sync_ = previous_; }
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    Rung& rung_;
    bool previous_;
  };
  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(*this); }

  nn::Module& module() { return *model_; }
  const dist::ProcessGroup& process_group() const { return *pg_; }

 protected:
  // param's gradient, or a DistError naming it: a rung all-reduces every parameter, so a
  // parameter that got no gradient would leave the ranks' collectives out of step.
  Tensor grad_of(const std::string& name, const Tensor& param) const {
    Tensor grad = param.grad();
    NANODDP_CHECK(grad.defined(), DistError, "rank ", pg_->rank(), "/", pg_->size(), ": parameter ", name,
                  " got no gradient in this backward; every rung reduces every parameter");
    return grad;
  }

  // Tracing, so that --trace draws the all_reduces and --explain counts their time as
  // communication (dist/explain.h): the time now, and all_reduce number `index` of this step,
  // from begin_us to now, on a lane of its own (spans that overlap cannot share one). Nothing
  // happens when no trace is recorded.
  static double trace_now() { return trace::enabled() ? trace::now_us() : 0; }
  static void trace_all_reduce(size_t index, const std::string& what, double begin_us) {
    if (trace::enabled())
      trace::complete(trace::kAllReduceLane + static_cast<int>(index), "all_reduce " + what, begin_us,
                      trace::now_us());
  }

  std::shared_ptr<nn::Module> model_;
  std::shared_ptr<dist::ProcessGroup> pg_;
  std::chrono::milliseconds timeout_;
  std::vector<std::pair<std::string, Tensor>> params_;  // those that require grad, in registration order
  bool sync_ = true;
};

}  // namespace nanoddp::ladder
