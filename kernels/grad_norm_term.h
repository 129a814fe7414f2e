// One element of clip_grad_norm_'s sums. The CPU loop (kernels/cpu/reductions.cpp), the CUDA
// kernels (kernels/cuda/reductions.cu) and the host's sum over devices (nn/clip_grad.cpp) all
// call these, so every device raises |g| and takes the largest |g| one way.
#pragma once

#include <cmath>

#include "kernels/host_device.h"

namespace nanoddp::kernels {

// The larger of a and b, NaN when either is (fmax alone would drop the NaN).
NANODDP_HOST_DEVICE inline double nan_max(double a, double b) { return a != a || b != b ? NAN : fmax(a, b); }

// a = |g| raised to norm_type: a square for 2, a itself for 1, else pow; with rescale_by > 0,
// (a / rescale_by) raised instead, by pow always.
NANODDP_HOST_DEVICE inline double norm_term(double a, double norm_type, double rescale_by) {
  if (rescale_by > 0.0) return pow(a / rescale_by, norm_type);
  return norm_type == 2.0 ? a * a : norm_type == 1.0 ? a : pow(a, norm_type);
}

}  // namespace nanoddp::kernels
