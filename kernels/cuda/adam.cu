// The fused Adam / AdamW step (torch.optim.Adam / AdamW's update, see
// kernels/kernel_list.inc). Memory-bound: it reads param, grad and both moments and writes
// param and both moments, 7 floats per parameter (9 with amsgrad).

#include "kernels/cuda/launch.cuh"
#include "kernels/kernels.h"

namespace nanoddp::kernels::cuda {

// The four buffers never overlap (__restrict__ lets loads run ahead of stores).
__global__ void adam_step_forward_kernel(float* __restrict__ param, float* __restrict__ exp_avg,
                                         float* __restrict__ exp_avg_sq, float* __restrict__ max_exp_avg_sq,
                                         const float* __restrict__ grad, int64_t n, AdamConfig c) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    float p = param[i];
    if (c.param_scale != 1.0f) p *= c.param_scale;
    const float g = c.l2 != 0.0f ? grad[i] + c.l2 * p : grad[i];
    const float m = exp_avg[i] * c.beta1 + c.one_minus_beta1 * g;
    float v = exp_avg_sq[i] * c.beta2 + c.one_minus_beta2 * g * g;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if (c.amsgrad) {
      v = fmaxf(max_exp_avg_sq[i], v);
      max_exp_avg_sq[i] = v;
    }
    const float denom = sqrtf(v) / c.bias_correction2_sqrt + c.eps;
    param[i] = p - c.step_size * m / denom;
  }
}

void adam_step(float* param, float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq, const float* grad,
               int64_t n, AdamConfig config) {
  if (n <= 0) return;
  NANODDP_CHECK(!config.amsgrad || max_exp_avg_sq != nullptr, ValueError,
                "adam_step: amsgrad needs a max_exp_avg_sq buffer");
  adam_step_forward_kernel<<<grid_for(n), kBlock, 0, stream()>>>(param, exp_avg, exp_avg_sq, max_exp_avg_sq, grad, n,
                                                                 config);
  NANODDP_CUDA_CHECK_LAUNCH("adam_step_forward_kernel");
}

}  // namespace nanoddp::kernels::cuda
