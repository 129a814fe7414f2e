// One element of the fused Adam / AdamW step (torch.optim.Adam / AdamW, PyTorch 1.13's
// single-tensor update; the constants are folded into AdamConfig, see kernels.h). The CPU loop
// (kernels/cpu/adam.cpp) and the CUDA kernel (kernels/cuda/adam.cu) both call it, so the two
// devices compute the same expression.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/host_device.h"
#include "kernels/kernels.h"

namespace nanoddp::kernels {

// max_exp_avg_sq is read and written only with amsgrad. amsgrad keeps the larger second moment
// as torch.maximum does: a NaN on either side wins, so a NaN gradient is not hidden.
NANODDP_HOST_DEVICE inline void adam_update(float* param, float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq,
                                            const float* grad, int64_t i, const AdamConfig& c) {
  // Each step rounded as PyTorch's (Note [Optimizer rounding] in kernels/cpu/sgd.cpp).
  float p = param[i];
  if (c.param_scale != 1.0f) p *= c.param_scale;
  const float raw = c.maximize ? -grad[i] : grad[i];
  const float g = c.l2 != 0.0f ? multiply_add(p, c.l2, raw) : raw;
  const float m = multiply_add(g, c.one_minus_beta1, exp_avg[i] * c.beta1);
  float v = multiply_add(c.one_minus_beta2 * g, g, exp_avg_sq[i] * c.beta2);
  exp_avg[i] = m;
  exp_avg_sq[i] = v;
  if (c.amsgrad) {
    const float kept = max_exp_avg_sq[i];
    if (kept > v || kept != kept) v = kept;
    max_exp_avg_sq[i] = v;
  }
  const float denom = sqrtf(v) / c.bias_correction2_sqrt + c.eps;
  const float update = -c.step_size * m;
  param[i] = p + update / denom;
}

}  // namespace nanoddp::kernels
