// The fused Adam / AdamW step (torch.optim.Adam / AdamW's update, see
// kernels/kernel_list.inc). Memory-bound: it reads param, grad and both moments and writes
// param and both moments, 7 floats per parameter (9 with amsgrad).

#include "kernels/adam_update.h"
#include "kernels/cuda/launch.cuh"

namespace nanoddp::kernels::cuda {

// The four buffers never overlap (__restrict__ lets loads run ahead of stores).
__global__ void adam_step_forward_kernel(float* __restrict__ param, float* __restrict__ exp_avg,
                                         float* __restrict__ exp_avg_sq, float* __restrict__ max_exp_avg_sq,
                                         const float* __restrict__ grad, int64_t n, AdamConfig c) {
  for (int64_t i = first_index(); i < n; i += grid_stride())
    adam_update(param, exp_avg, exp_avg_sq, max_exp_avg_sq, grad, i, c);
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
