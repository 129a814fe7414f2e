// The fused Adam / AdamW step on the CPU: one pass over param, grad and the moment buffers.
// Rounded as PyTorch's step, op by op: Note [Optimizer rounding] in kernels/cpu/sgd.cpp.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif
#include "kernels/adam_update.h"

namespace nanoddp::kernels::cpu {

void adam_step(float* param, float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq, const float* grad,
               int64_t n, AdamConfig c) {
  NANODDP_CHECK(!c.amsgrad || max_exp_avg_sq != nullptr, ValueError, "adam_step: amsgrad needs a max_exp_avg_sq buffer");
  for (int64_t i = 0; i < n; ++i) adam_update(param, exp_avg, exp_avg_sq, max_exp_avg_sq, grad, i, c);
}

}  // namespace nanoddp::kernels::cpu
