// Rung 1, naive: after backward, one blocking all_reduce per parameter, then divide by the
// world size.
//
// Fixes (from one process): W ranks each run forward and backward on 1/W of the global batch,
// and averaging their gradients gives every rank the gradient of the whole batch, so every
// rank takes the step one process would take on it.
// Still gets wrong: one collective per parameter, so a step pays a collective's latency once
// per parameter (the MLP: 6 calls; a transformer: hundreds), most of them on tiny tensors
// (a bias: 40 bytes); and every one waits for the last before it starts, after backward has
// finished: the network idles during backward and the cores idle during communication.
// Next rung (flat.h): one call for all of it.
//
// Per step: P all_reduce calls (P = parameters that require grad), 4 bytes per element in all.
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
      grad.copy_(grad * (1.0f / static_cast<float>(pg_->size())));
    }
  }
};

}  // namespace nanoddp::ladder
