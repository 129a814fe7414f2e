// Exercise 1: the naive rung. Read examples/ladder/rung.h (the contract), then write
// finish_gradient_sync() below. Grade it: tools/exercise check naive
//
// After loss.backward() every rank holds the gradient of ITS share of the batch. Make every
// parameter's .grad the mean over ranks, with one blocking all_reduce per parameter.
//
// Hints:
//  - params_ holds (name, parameter) pairs; grad_of(name, param) returns its .grad (the same
//    memory: an in-place all_reduce on it changes .grad) or throws naming the parameter.
//  - pg_->all_reduce(tensor, dist::ReduceOp::Sum) returns a Work; ->wait(timeout_) blocks.
//  - A collective sums. The mean needs one more step (grad.copy_(grad * x) under NoGradGuard).
// The grader expects, per step of its MLP: 4 all_reduce calls, 228 bytes in all.
#pragma once

#include "core/ops.h"
#include "examples/ladder/rung.h"

namespace nanoddp::ladder {

class NaiveDataParallel : public Rung {
 public:
  using Rung::Rung;

  void finish_gradient_sync() override {
    NANODDP_CHECK(false, ValueError, "exercises/naive.h: finish_gradient_sync() is not written yet");
  }
};

}  // namespace nanoddp::ladder
