// The fused SGD step: one pass over param, grad and momentum buffer (torch.optim.SGD's
// update, see kernels/kernel_list.inc). Memory-bound: with momentum it moves 5 floats per
// parameter (read param, grad, buffer; write param, buffer), so its speed is judged against a
// device-to-device copy (benchmarks/gpu).

#include "kernels/cuda/launch.cuh"
#include "kernels/kernels.h"
#include "kernels/sgd_update.h"

namespace nanoddp::kernels::cuda {

// param, momentum_buffer and grad never overlap (__restrict__ lets loads run ahead of stores).
__global__ void sgd_step_forward_kernel(float* __restrict__ param, float* __restrict__ momentum_buffer,
                                        const float* __restrict__ grad, int64_t n, SgdConfig config,
                                        bool first_step) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    float p = param[i];
    float b = 0.0f;
    if (config.momentum != 0.0f && !first_step) b = momentum_buffer[i];
    sgd_update(p, b, grad[i], config, first_step);
    param[i] = p;
    if (config.momentum != 0.0f) momentum_buffer[i] = b;
  }
}

void sgd_step(float* param, float* momentum_buffer, const float* grad, int64_t n, SgdConfig config,
              bool first_step) {
  if (n <= 0) return;
  NANODDP_CHECK(config.momentum == 0.0f || momentum_buffer != nullptr, ValueError,
                "sgd_step: momentum ", config.momentum, " needs a momentum buffer");
  sgd_step_forward_kernel<<<grid_for(n), kBlock, 0, stream()>>>(param, momentum_buffer, grad, n, config,
                                                                first_step);
  NANODDP_CUDA_CHECK_LAUNCH("sgd_step_forward_kernel");
}

}  // namespace nanoddp::kernels::cuda
