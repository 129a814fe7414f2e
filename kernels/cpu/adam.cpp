// The fused Adam / AdamW step on the CPU: one pass over param, grad and the moment buffers.
#include <algorithm>
#include <cmath>

#include "kernels/kernels.h"

namespace nanoddp::kernels::cpu {

void adam_step(float* param, float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq, const float* grad,
               int64_t n, AdamConfig c) {
  for (int64_t i = 0; i < n; ++i) {
    float p = param[i];
    if (c.param_scale != 1.0f) p *= c.param_scale;
    const float g = c.l2 != 0.0f ? grad[i] + c.l2 * p : grad[i];
    const float m = exp_avg[i] * c.beta1 + c.one_minus_beta1 * g;
    float v = exp_avg_sq[i] * c.beta2 + c.one_minus_beta2 * g * g;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if (c.amsgrad) {
      v = std::max(max_exp_avg_sq[i], v);
      max_exp_avg_sq[i] = v;
    }
    const float denom = std::sqrt(v) / c.bias_correction2_sqrt + c.eps;
    param[i] = p - c.step_size * m / denom;
  }
}

}  // namespace nanoddp::kernels::cpu
