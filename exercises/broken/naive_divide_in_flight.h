// A deliberately wrong naive rung, kept so that the grader's test can show it is caught: it
// divides the gradient while its all_reduce is still in flight, a race that gives the right
// numbers on shm and, on Gloo, only sometimes.
// tools/exercise check naive exercises/broken/naive_divide_in_flight.h must fail, saying so.
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
      auto work = pg_->all_reduce(grad, dist::ReduceOp::Sum);
      grad.copy_(grad * (1.0f / static_cast<float>(pg_->size())));  // while the all_reduce runs
      work->wait(timeout_);
      trace_all_reduce(i, name, begin_us);
    }
  }
};

}  // namespace nanoddp::ladder
