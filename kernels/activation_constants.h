// Constants of the GELU and its derivative (torch.nn.GELU, exact and tanh), and the tanh
// form element by element, shared by the CPU (kernels/cpu/activations.cpp) and CUDA
// (kernels/cuda/activations.cu) kernels.
#pragma once

#include <cmath>

#include "kernels/host_device.h"

namespace nanoddp::kernels {

constexpr float kSqrt1_2 = 0.70710678118654752f;      // 1 / sqrt(2)
constexpr float kInvSqrt2Pi = 0.39894228040143268f;   // 1 / sqrt(2 pi)
constexpr float kSqrt2OverPi = 0.79788456080286536f;  // sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;

// The tanh form x/2 (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), as x s(2u) (Note [GELU's
// tanh form] in kernels/cpu/activations.cpp), through m = e^(-2|u|) <= 1, so that nothing
// overflows or cancels at any x: s(2u) is 1 / (1 + m) for u >= 0 and m / (1 + m) below, and
// s'(2u) / 2 = s (1 - s) = m / (1 + m)^2 either way. value: x s; slope: s + 2 x u' m / (1 + m)^2,
// whose second term is 0 once m is (x u' alone overflows from |x| = 1.2e13). At x = +-inf the
// slope is NaN (inf * 0), as torch's.
NANODDP_HOST_DEVICE inline float gelu_tanh_value(float x) {
  const float u = kSqrt2OverPi * (x + kGeluCubic * x * x * x), m = expf(-2.0f * fabsf(u));
  return x * ((u >= 0.0f ? 1.0f : m) / (1.0f + m));
}

NANODDP_HOST_DEVICE inline float gelu_tanh_slope(float x) {
  const float u = kSqrt2OverPi * (x + kGeluCubic * x * x * x), m = expf(-2.0f * fabsf(u));
  const float s = (u >= 0.0f ? 1.0f : m) / (1.0f + m);
  if (m == 0.0f && x - x == 0.0f) return s;  // finite x: the second term is 0
  return s + 2.0f * x * kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * x * x) * (m / ((1.0f + m) * (1.0f + m)));
}

}  // namespace nanoddp::kernels
