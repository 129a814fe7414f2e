// A deliberately wrong naive rung, kept so that the grader's test can show it is caught: it
// all-reduces with Sum and never divides, so every gradient is W times the mean.
// tools/exercise check naive exercises/broken/naive_sum_without_divide.h must fail, saying so.
#pragma once

#include "core/ops.h"
#include "examples/ladder/rung.h"

namespace nanoddp::ladder {

class NaiveDataParallel : public Rung {
 public:
  using Rung::Rung;

  void finish_gradient_sync() override {
    NoGradGuard no_grad;
    for (auto& [name, param] : params_) {
      Tensor grad = grad_of(name, param);  // the same memory as param's .grad
      pg_->all_reduce(grad, dist::ReduceOp::Sum)->wait(timeout_);
    }
  }
};

}  // namespace nanoddp::ladder
