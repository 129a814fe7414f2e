// One element of the fused SGD step (torch.optim.SGD, PyTorch 1.13's single-tensor update).
// The CPU loop (kernels/cpu/sgd.cpp) and the CUDA kernel (kernels/cuda/sgd.cu) both call it,
// so the two devices compute the same expression, rounded as PyTorch's (Note [Optimizer
// rounding] in kernels/cpu/sgd.cpp).
#pragma once

#include "kernels/host_device.h"
#include "kernels/kernels.h"

namespace nanoddp::kernels {

// buf is read and written only with momentum; on the first step it becomes the gradient.
NANODDP_HOST_DEVICE inline void sgd_update(float& p, float& buf, float grad, const SgdConfig& c, bool first_step) {
  if (c.maximize) grad = -grad;
  float g = c.weight_decay != 0.0f ? multiply_add(p, c.weight_decay, grad) : grad;
  if (c.momentum != 0.0f) {
    buf = first_step ? g : multiply_add(g, c.one_minus_dampening, c.momentum * buf);
    g = c.nesterov ? multiply_add(buf, c.momentum, g) : buf;
  }
  p = multiply_add(g, -c.lr, p);
}

}  // namespace nanoddp::kernels
