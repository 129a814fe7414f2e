// Constants of the GELU and its derivative (torch.nn.GELU, exact and tanh), shared by the CPU
// (kernels/cpu/activations.cpp) and CUDA (kernels/cuda/activations.cu) kernels.
#pragma once

namespace nanoddp::kernels {

constexpr float kSqrt1_2 = 0.70710678118654752f;      // 1 / sqrt(2)
constexpr float kInvSqrt2Pi = 0.39894228040143268f;   // 1 / sqrt(2 pi)
constexpr float kSqrt2OverPi = 0.79788456080286536f;  // sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;

}  // namespace nanoddp::kernels
