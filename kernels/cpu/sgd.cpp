// The fused SGD step on the CPU: one pass over param, grad and momentum buffer.
//
// Note [Optimizer rounding]
// A step rounds as PyTorch 1.13's single-tensor step does, op by op, so that a run follows
// torch's to the bit instead of drifting a few ulp per step (a few hundred after 50 steps):
//   SGD   g = g.add(p, alpha=wd); buf = buf.mul(momentum).add(g, alpha=1 - dampening);
//         g = nesterov ? g.add(buf, alpha=momentum) : buf; p = p.add(g, alpha=-lr)
//   Adam  m = m.mul(beta1).add(g, alpha=1 - beta1); v = v.mul(beta2).addcmul(g, g, 1 - beta2);
//         p = p.addcdiv(m, sqrt(v) / bias_correction2_sqrt + eps, value=-step_size)
// Each mul rounds; each add with alpha is one multiply_add (kernels/host_device.h), and so is
// addcmul's (value * g) * g + v; addcdiv rounds (value * m) / denom, then adds (measured
// against torch 1.13's CPU kernels, element by element). GCC would otherwise
// contract other pairs into fused multiply-adds (-ffp-contract=fast, its default), so these
// files turn that off and fuse explicitly.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif
#include "kernels/sgd_update.h"

namespace nanoddp::kernels::cpu {

void sgd_step(float* param, float* momentum_buffer, const float* grad, int64_t n, SgdConfig config, bool first_step) {
  if (config.momentum == 0.0f) {
    float unused = 0.0f;
    for (int64_t i = 0; i < n; ++i) sgd_update(param[i], unused, grad[i], config, first_step);
    return;
  }
  for (int64_t i = 0; i < n; ++i) sgd_update(param[i], momentum_buffer[i], grad[i], config, first_step);
}

}  // namespace nanoddp::kernels::cpu
