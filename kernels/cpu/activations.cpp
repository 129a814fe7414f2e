// CPU kernels of the pointwise activations in nn/activations.h (declared there), as Eigen
// array expressions: vectorised, including tanh, exp and erf.
#include <cmath>
#include <limits>

#include "kernels/activation_constants.h"
#include "kernels/cpu/eigen_maps.h"  // first of the Eigen headers: its GCC pragma must come first
#include <unsupported/Eigen/SpecialFunctions>

namespace nanoddp::kernels::cpu {

// ---- sigmoid ------------------------------------------------------------------------------

void sigmoid_forward(float* y, const float* x, int64_t n) {
  // 1 / (1 + e^-x): e^-x overflows to inf for x < -88 and the quotient is then exactly 0.
  vec(y, n).array() = (1.0f + (-vec(x, n).array()).exp()).inverse();
}

void sigmoid_backward(float* dx, const float* dy, const float* y, int64_t n) {
  const auto s = vec(y, n).array();
  vec(dx, n).array() = vec(dy, n).array() * s * (1.0f - s);
}

// ---- tanh ---------------------------------------------------------------------------------

void tanh_forward(float* y, const float* x, int64_t n) { vec(y, n).array() = vec(x, n).array().tanh(); }

void tanh_backward(float* dx, const float* dy, const float* y, int64_t n) {
  vec(dx, n).array() = vec(dy, n).array() * (1.0f - vec(y, n).array().square());
}

// ---- gelu ---------------------------------------------------------------------------------

void gelu_forward(float* y, const float* x, bool tanh_approximation, int64_t n) {
  const auto v = vec(x, n).array();
  if (tanh_approximation) {
    vec(y, n).array() = 0.5f * v * (1.0f + (kSqrt2OverPi * (v + kGeluCubic * v.cube())).tanh());
  } else {
    vec(y, n).array() = 0.5f * v * (1.0f + (v * kSqrt1_2).erf());
  }
}

void gelu_backward(float* dx, const float* dy, const float* x, bool tanh_approximation, int64_t n) {
  const auto v = vec(x, n).array();
  const auto g = vec(dy, n).array();
  if (tanh_approximation) {
    // d/dx [x/2 (1 + t)] = (1 + t)/2 + x/2 (1 - t^2) u', t = tanh(u), u' = sqrt(2/pi)(1 + 3c x^2)
    const Eigen::ArrayXf t = (kSqrt2OverPi * (v + kGeluCubic * v.cube())).tanh();
    vec(dx, n).array() =
        g * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t.square()) * kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * v.square()));
  } else {
    // d/dx [x Phi(x)] = Phi(x) + x phi(x). At x = +-inf, x phi(x) is inf * 0 = NaN, as torch's
    // (and the CUDA kernel's): Eigen's vectorised exp clamps its argument, so exp(-inf) is a
    // tiny positive number in the packets and the product +-inf there, NaN in the tail.
    const float nan = std::numeric_limits<float>::quiet_NaN();
    vec(dx, n).array() = g * (0.5f * (1.0f + (v * kSqrt1_2).erf()) +
                              v.isInf().select(nan, v * kInvSqrt2Pi * (-0.5f * v.square()).exp()));
  }
}

// ---- softplus -----------------------------------------------------------------------------

void softplus_forward(float* y, const float* x, float beta, float threshold, int64_t n) {
  const auto bx = vec(x, n).array() * beta;
  vec(y, n).array() = (bx > threshold).select(vec(x, n).array(), bx.exp().log1p() / beta);
}

void softplus_backward(float* dx, const float* dy, const float* x, float beta, float threshold, int64_t n) {
  const auto bx = vec(x, n).array() * beta;
  const auto g = vec(dy, n).array();
  vec(dx, n).array() = (bx > threshold).select(g, g / (1.0f + (-bx).exp()));
}

}  // namespace nanoddp::kernels::cpu
