// Rung 3, overlap: each parameter's all_reduce starts from its post-accumulate-grad hook,
// while backward goes on computing the gradients of the layers before it; a callback queued
// for the end of backward waits for all of them.
//
// Fixes (from flat.h): communication starts during backward. Backward produces the last
// layer's gradients first (Note [Bucket order] in dist/), so their all_reduces run while the
// earlier layers' gradients are computed, and only what is still in flight when backward ends
// is exposed. No flat copy either: each .grad is reduced in place.
// Still gets wrong: one collective per parameter again, so the per-call latency of naive.h is
// back (P calls a step) and the small tensors use the network badly; on a backend whose
// collectives only move while someone waits (shm, Note [Shm progress]) launching early hides
// nothing. Next rung (buckets, dist/reducer.h): group parameters into buckets of ~25 MiB and
// launch a bucket when its last gradient is in: few calls, large messages, still overlapped.
//
// Per step: P all_reduce calls, 4 bytes per parameter element in all, issued in the order
// backward finishes the gradients (the same on every rank: the same graph).
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

  // A backward that ended by an exception never ran wait_for_all (the engine drops the
  // callbacks of a failed pass): its all_reduces are waited for here, and dropped, so that
  // every rank that got as far stays in step (Note [Interrupted backward] in dist/reducer.cpp).
  Tensor forward(const Tensor& input) override {
    if (!in_flight_.empty()) {
      std::vector<std::shared_ptr<dist::Work>> interrupted;
      interrupted.swap(in_flight_);
      launched_us_.clear();
      for (auto& work : interrupted) work->wait(timeout_);
    }
    return Rung::forward(input);
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
    launched_us_.push_back(trace_now());
    in_flight_.push_back(pg_->all_reduce(grad, dist::ReduceOp::Sum));
  }

  // Queued by the first hook of a backward; runs when backward has finished.
  void wait_for_all() {
    for (size_t i = 0; i < in_flight_.size(); ++i) {
      // Where collectives run only inside wait() (shm), one launched early still starts here.
      const double begin_us = pg_->collectives_run_in_wait() ? trace_now() : launched_us_[i];
      in_flight_[i]->wait(timeout_);
      trace_all_reduce(i, "#" + std::to_string(i), begin_us);
    }
    reduced_in_last_backward_ = in_flight_.size();
    in_flight_.clear();
    launched_us_.clear();
  }

  std::vector<int> hook_ids_;
  std::vector<std::shared_ptr<dist::Work>> in_flight_;  // this backward's all_reduces, in issue order
  std::vector<double> launched_us_;                     // when each was launched (when tracing)
  size_t reduced_in_last_backward_ = 0;
};

}  // namespace nanoddp::ladder
