// A deliberately wrong overlap rung, kept so that the grader's test can show it is caught: at
// the end of backward it waits for the first all_reduce only, so the others may not have
// arrived when the optimizer reads .grad (on shm they never run: nobody waits on them).
// tools/exercise check overlap exercises/broken/overlap_wait_first_only.h must fail, saying so.
#pragma once

#include <memory>
#include <vector>

#include "core/autograd.h"
#include "core/ops.h"
#include "examples/ladder/rung.h"

namespace nanoddp::ladder {

class OverlapDataParallel : public Rung {
 public:
  OverlapDataParallel(std::shared_ptr<nn::Module> model, std::shared_ptr<dist::ProcessGroup> pg,
                      std::chrono::milliseconds timeout = dist::kDefaultTimeout)
      : Rung(std::move(model), std::move(pg), timeout) {
    for (auto& [name, param] : params_)
      hook_ids_.push_back(
          param.register_post_accumulate_grad_hook([this](Tensor& p) { on_gradient_ready(p); }));
  }
  ~OverlapDataParallel() override {
    for (size_t i = 0; i < params_.size(); ++i) params_[i].second.remove_hook(hook_ids_[i]);
  }

  // The waiting happened at the end of backward: here only the check that every parameter
  // was reduced.
  void finish_gradient_sync() override {
    NANODDP_CHECK(
        reduced_in_last_backward_ == params_.size(), DistError, "rank ", pg_->rank(), "/", pg_->size(), ": ",
        reduced_in_last_backward_, " of ", params_.size(),
        " parameters were reduced since the last finish_gradient_sync; every rung reduces every parameter");
    reduced_in_last_backward_ = 0;
  }

 private:
  // Runs inside backward, once param's .grad is final for this backward.
  void on_gradient_ready(Tensor& param) {
    if (!sync_) return;
    if (in_flight_.empty()) queue_callback([this] { wait_for_all(); });
    NoGradGuard no_grad;
    Tensor grad = param.grad();
    // Divide first, then sum: the mean arrives in place, with nothing left to do after the wait.
    grad.copy_(grad * (1.0f / static_cast<float>(pg_->size())));
    in_flight_.push_back(pg_->all_reduce(grad, dist::ReduceOp::Sum));
  }

  // Queued by the first hook of a backward; runs when backward has finished.
  void wait_for_all() {
    in_flight_.front()->wait(timeout_);
    reduced_in_last_backward_ = in_flight_.size();
    in_flight_.clear();
  }

  std::vector<int> hook_ids_;
  std::vector<std::shared_ptr<dist::Work>> in_flight_;  // this backward's all_reduces, in issue order
  size_t reduced_in_last_backward_ = 0;
};

}  // namespace nanoddp::ladder
