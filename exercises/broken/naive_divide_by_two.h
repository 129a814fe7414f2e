// A deliberately wrong naive rung, kept so that the grader's test can show it is caught: it
// divides by 2 instead of the world size, so it is right on 2 ranks only.
// tools/exercise check naive exercises/broken/naive_divide_by_two.h must fail, saying so.
#pragma once

#include "core/ops.h"
#include "examples/ladder/rung.h"

namespace nanoddp::ladder {

class NaiveDataParallel : public Rung {
 public:
  using Rung::Rung;

  void finish_gradient_sync() override {
    NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i) {
      auto& [name, param] = params_[i];
      Tensor grad = grad_of(name, param);  // the same memory as param's .grad
      const double begin_us = trace_now();
      // Collectives sum; the mean needs the division (ReduceOp::Avg would fold it in).
      pg_->all_reduce(grad, dist::ReduceOp::Sum)->wait(timeout_);
      trace_all_reduce(i, name, begin_us);
      grad.copy_(grad * 0.5f);  // 2, not pg_->size()
    }
  }
};

}  // namespace nanoddp::ladder
