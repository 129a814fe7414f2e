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

// The taps [first, last) of one window along one axis: those i in [0, kernel) whose position
// start + i dilation lies in [0, size), start being o stride - pad. The others fall on
// padding. Computed, not scanned, so a kernel of 10^8 padded by half of it costs what a small
// one does. Empty (first >= last) for a window of padding alone. make_window keeps padding,
// stride and dilation below 2^61 and the window's extent below 2^62, and size is a plane's
// (max_pool2d first refuses planes of 2^31 elements or more, even for an empty batch), so
// nothing here overflows.
struct Taps {
  int64_t first, last;
};
NANODDP_HOST_DEVICE inline Taps window_taps(int64_t start, int64_t size, int64_t kernel, int64_t dilation) {
  const int64_t first = start >= 0 ? 0 : (-start + dilation - 1) / dilation;
  const int64_t past_end = start >= size ? 0 : (size - start + dilation - 1) / dilation;
  return {first, past_end < kernel ? past_end : kernel};
}

// The other way round: the taps [first, last) by which windows can reach input position x
// along one axis, those i in [0, kernel) with 0 <= x + pad - i dilation <= (out - 1) stride
// (the window's start, o stride; whether stride divides it is left to the caller). Computed,
// so a backward visits no more taps than there are windows. Used by max_pool2d's backward
// and conv2d's col2im, which has no plane limit: what keeps it from overflowing is
// make_window's bound on the span, H + 2 pad - extent - 1 <= 2^62 with x < H, so beyond +
// dilation - 1 stays at or below 2^63 - 2 (little margin: loosen those bounds only with care).
NANODDP_HOST_DEVICE inline Taps taps_reaching(int64_t x, int64_t pad, int64_t kernel, int64_t dilation,
                                              int64_t stride, int64_t out) {
  const int64_t reach = x + pad;                      // i dilation <= reach
  const int64_t beyond = reach - (out - 1) * stride;  // i dilation >= beyond
  const int64_t first = beyond <= 0 ? 0 : (beyond + dilation - 1) / dilation;
  const int64_t last = reach / dilation + 1;
  return {first, last < kernel ? last : kernel};
}

// plane: one [H, W] input plane. A NaN wins (the last one, as torch); a window of -inf still
// gets an index. Taps are visited row by row, in increasing order, so ties go to the first.
NANODDP_HOST_DEVICE inline WindowMax max_pool2d_window(const float* plane, const Window2d& g, int64_t oh, int64_t ow) {
  WindowMax best{-INFINITY, -1};
  const int64_t top = oh * g.stride_h - g.pad_h, left = ow * g.stride_w - g.pad_w;
  const Taps rows = window_taps(top, g.height, g.kernel_h, g.dilation_h);
  const Taps columns = window_taps(left, g.width, g.kernel_w, g.dilation_w);
  for (int64_t i = rows.first; i < rows.last; ++i) {
    const int64_t h = top + i * g.dilation_h;
    for (int64_t j = columns.first; j < columns.last; ++j) {
      const int64_t w = left + j * g.dilation_w;
      const float v = plane[h * g.width + w];
      if (best.index < 0 || v > best.value || v != v) best = {v, h * g.width + w};
    }
  }
  return best;
}

}  // namespace nanoddp::kernels
