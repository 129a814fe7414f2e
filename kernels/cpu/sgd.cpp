// The fused SGD step on the CPU: one pass over param, grad and momentum buffer.
#include "kernels/kernels.h"

namespace nanoddp::kernels::cpu {

void sgd_step(float* param, float* momentum_buffer, const float* grad, int64_t n, SgdConfig config, bool first_step) {
  const float lr = config.lr, momentum = config.momentum, weight_decay = config.weight_decay;
  const float keep = 1.0f - config.dampening;
  for (int64_t i = 0; i < n; ++i) {
    float g = grad[i];
    if (weight_decay != 0.0f) g += weight_decay * param[i];
    if (momentum != 0.0f) {
      const float buf = first_step ? g : momentum * momentum_buffer[i] + keep * g;
      momentum_buffer[i] = buf;
      g = config.nesterov ? g + momentum * buf : buf;
    }
    param[i] -= lr * g;
  }
}

}  // namespace nanoddp::kernels::cpu
