// Convolution and max pooling over NCHW images: Conv2d and MaxPool2d (torch.nn's), and their
// functional forms conv2d and max_pool2d.
//
//   nn::Conv2d conv(1, 32, /*kernel_size=*/3, gen);         // x: [N, 1, 28, 28] -> [N, 32, 26, 26]
//   nn::MaxPool2d pool(2);                                   // -> [N, 32, 13, 13]
//   Tensor y = pool(relu(conv(x)));
//
// Sizes per axis: out = (in + 2 padding - dilation (kernel - 1) - 1) / stride + 1, rounded
// down (torch's formula, ceil_mode=False). Inputs are float32 [N, C, H, W] on any device;
// a wrong rank, channel count or an empty output is a ShapeError naming the shapes; a
// size, stride or dilation below 1, or a negative padding, is a ValueError.
#pragma once

#include <cstdint>

#include "core/random.h"
#include "core/tensor.h"
#include "nn/module.h"

namespace nanoddp {

// A size per spatial axis: 3 means (3, 3); {3, 5} means height 3, width 5 (torch's int or
// tuple arguments).
struct Size2 {
  Size2(int64_t both) : h(both), w(both) {}  // NOLINT: implicit, as torch takes an int
  Size2(int64_t height, int64_t width) : h(height), w(width) {}
  int64_t h, w;
};

// input: [N, C, H, W], weight: [OC, C, kh, kw], bias: [OC] or undefined
// -> [N, OC, OH, OW] (torch.nn.functional.conv2d with groups=1). Computed as im2col + GEMM,
// weight [OC, C kh kw] · cols [C kh kw, OH OW], one image at a time on the CPU (the GEMM writes
// the image's NCHW output), for the whole batch on CUDA (cols [C kh kw, N OH OW], then
// reordered to NCHW). Cost: forward 2 N OC OH OW C kh kw FLOPs (+ N OC OH OW for the bias);
// backward twice that (on the CPU, plus im2col again for the weight gradient). Memory: on the
// CPU one image's cols (C kh kw OH OW floats) and, with padding, one zero-bordered input
// plane ((H + 2 ph)(W + 2 pw) floats, up to 4 H W or 64 K floats: larger padding reads
// positions one by one instead), and the input and weight kept for backward; on
// CUDA cols (C kh kw N OH OW floats) kept for backward with the weight, and the output twice
// while reordering. When no graph is recorded (no_grad, or no input requires grad) nothing is
// kept: CUDA goes through the images in chunks whose cols take at most about 16 MB (one image
// at least), with the same result bit for bit. On the CPU a 3x3 kernel at stride 1 and
// dilation 1 with C, OC >= 8 and padding <= 2 runs as Winograd F(2x2, 3x3) instead, forward
// and both gradients (kernels/cpu/winograd.h): 16/36 of those FLOPs per 2x2 outputs (rounded
// up to whole tiles) plus additions, and 16 (C + OC) floats per tile of about 256 tiles of
// scratch; its rounding differs from im2col + GEMM within float32 error, and inputs, weights
// or gradients with NaN or inf use im2col + GEMM, whose values for them are torch's.
// dtypes: float32, or under nn::autocast its 16-bit dtype (every float32 operand cast by a
// recorded op; the 16-bit operands widened and convolved in float32, the output rounded
// once: torch's CPU autocast). A 16-bit input outside autocast needs the same dtype for
// weight and bias (ValueError otherwise) and gives that dtype. Throws ValueError for a
// kernel, stride, padding or dilation beyond 2^61 (torch takes any), ShapeError for an input
// smaller than the dilated kernel with its padding.
Tensor conv2d(const Tensor& input, const Tensor& weight, const Tensor& bias, Size2 stride = 1, Size2 padding = 0,
              Size2 dilation = 1);

// input: [N, C, H, W] -> [N, C, OH, OW], the maximum of each window; padding counts as -inf
// and is at most half the kernel (ValueError otherwise), as in torch.nn.functional.max_pool2d.
// A NaN in a window is its maximum. The gradient goes to the window's maximum (the first one
// on ties). Cost: one comparison per window position inside the input (N C OH OW kh kw at
// most; a window's positions on padding are skipped, not visited); when it records a graph (grad enabled and
// input requires grad) it also keeps the argmax of each output (int32, 4 bytes per output element; torch
// keeps int64) for backward, and otherwise (torch.no_grad(), evaluation) computes none. A 16-bit input gives
// a 16-bit output (computed in float32, rounded: exact for a maximum). Throws ValueError for planes of 2^31
// elements or more, and for sizes beyond 2^61 as conv2d, ShapeError for an input with no channel, row or
// column (only N may be 0, as in torch).
Tensor max_pool2d(const Tensor& input, Size2 kernel_size, Size2 stride, Size2 padding = 0, Size2 dilation = 1);
// Windows side by side: the stride is the kernel size (torch's default, max_pool2d(x, 2)).
inline Tensor max_pool2d(const Tensor& input, Size2 kernel_size) {
  return max_pool2d(input, kernel_size, kernel_size);
}

namespace nn {

// conv2d with a weight [out_channels, in_channels, kh, kw] and bias [out_channels]
// (torch.nn.Conv2d, groups=1, padding_mode='zeros'). Initialised as torch does: weight and
// bias uniform in [-1/sqrt(fan_in), 1/sqrt(fan_in)) with fan_in = in_channels kh kw, drawn
// from gen (weight, then bias; nn/init.h): a gen seeded as torch.manual_seed gives torch's
// values bit for bit.
class Conv2d : public Module {
 public:
  Conv2d(int64_t in_channels, int64_t out_channels, Size2 kernel_size, Generator& gen = default_generator(),
         Size2 stride = 1, Size2 padding = 0, Size2 dilation = 1, bool bias = true);
  Tensor forward(const Tensor& input) override;
  Tensor weight;
  Tensor bias;  // undefined when built with bias = false

 private:
  Size2 stride_, padding_, dilation_;
};

// max_pool2d (torch.nn.MaxPool2d); stride defaults to kernel_size, as in torch.
class MaxPool2d : public Module {
 public:
  explicit MaxPool2d(Size2 kernel_size) : MaxPool2d(kernel_size, kernel_size) {}
  MaxPool2d(Size2 kernel_size, Size2 stride, Size2 padding = 0, Size2 dilation = 1)
      : kernel_size_(kernel_size), stride_(stride), padding_(padding), dilation_(dilation) {}
  Tensor forward(const Tensor& input) override {
    return max_pool2d(input, kernel_size_, stride_, padding_, dilation_);
  }

 private:
  Size2 kernel_size_, stride_, padding_, dilation_;
};

}  // namespace nn
}  // namespace nanoddp
