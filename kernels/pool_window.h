// The maximum of one MaxPool2d window (torch.nn.functional.max_pool2d's rule), shared by the
// CPU loop (kernels/cpu/conv.cpp) and the CUDA kernel (kernels/cuda/conv.cu).
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/host_device.h"
#include "kernels/kernels.h"

namespace nanoddp::kernels {

struct WindowMax {
  float value;
  int64_t index;  // into the [H, W] plane; -1 only for a window of padding alone, which
                  // nn::max_pool2d refuses before any kernel runs (Note [Windows of padding only])
};

// plane: one [H, W] input plane. A NaN wins (the last one, as torch); a window of -inf still
// gets an index.
NANODDP_HOST_DEVICE inline WindowMax max_pool2d_window(const float* plane, const Window2d& g, int64_t oh, int64_t ow) {
  WindowMax best{-INFINITY, -1};
  for (int64_t i = 0; i < g.kernel_h; ++i) {
    const int64_t h = oh * g.stride_h - g.pad_h + i * g.dilation_h;
    if (h < 0 || h >= g.height) continue;
    for (int64_t j = 0; j < g.kernel_w; ++j) {
      const int64_t w = ow * g.stride_w - g.pad_w + j * g.dilation_w;
      if (w < 0 || w >= g.width) continue;
      const float v = plane[h * g.width + w];
      if (best.index < 0 || v > best.value || v != v) best = {v, h * g.width + w};
    }
  }
  return best;
}

}  // namespace nanoddp::kernels
