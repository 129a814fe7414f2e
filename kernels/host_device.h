// NANODDP_HOST_DEVICE marks an inline function that the CPU kernels and the CUDA kernels both
// call, so the two devices compute one expression written once (kernels/adam_update.h,
// kernels/sgd_update.h, kernels/pool_window.h).
#pragma once

#ifdef __CUDACC__
#define NANODDP_HOST_DEVICE __host__ __device__
#else
#define NANODDP_HOST_DEVICE
#endif

#include <cmath>

namespace nanoddp::kernels {

// a * b + c rounded as PyTorch's CPU kernels round `c.add_(a, alpha=b)`: once, by a fused
// multiply-add, where the CPU has one (PyTorch's AVX2 kernels use vfmadd), else twice (its
// default kernels). The optimizer steps spell out PyTorch's order with it, in files compiled
// without the compiler's own contraction (Note [Optimizer rounding] in kernels/cpu/sgd.cpp).
NANODDP_HOST_DEVICE inline float multiply_add(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return fmaf(a, b, c);
#elif defined(__FMA__)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

}  // namespace nanoddp::kernels
