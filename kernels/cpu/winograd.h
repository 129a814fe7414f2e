// Conv2d on the CPU for 3x3 kernels at stride 1 and dilation 1 with 8 or more channels (the
// example CNN's second convolution), forward and both gradients, by Winograd's minimal
// filtering F(2x2, 3x3) (Lavin and Gray, "Fast Algorithms for Convolutional Neural Networks",
// 2016): 16 multiplications per 2 x 2 outputs and input channel instead of 36 (Note
// [Winograd F(2x2, 3x3)] in winograd.cpp). nn/conv.cpp uses it instead of im2col + GEMM where
// it applies.
//
//   if (winograd_applies(window, OC)) {
//     conv3x3_winograd(out, images, weight, N, OC, window);
//     if (!all_finite(out, n)) ...  // computed again by im2col + GEMM
//   }
#pragma once

#include <cstdint>

#include "kernels/kernels.h"

namespace nanoddp::kernels::cpu {

// True for a 3 x 3 window at stride 1 and dilation 1 with padding 0, 1 or 2 on each axis (the
// input gradient of such a convolution is again one: padding 2 - pad), and at least 8 input
// and 8 output channels.
bool winograd_applies(const Window2d& window, int64_t out_channels);

// False if any of the n floats at p is NaN or +-inf. Winograd's transforms add and subtract
// inputs that direct convolution only multiplies: an inf can meet -inf where conv2d gives
// +-inf, and finite values near float32's largest can overflow. A non-finite operand always
// makes some result non-finite, so the caller tests the results and computes those with any
// NaN or inf again by im2col + GEMM, which gives torch's values.
bool all_finite(const float* p, int64_t n);

// out [N, OC, OH, OW] = conv2d(images [N, C, H, W], weight [OC, C, 3, 3]) without bias, for a
// window where winograd_applies (C, H, W, padding and OH, OW from it). WRITES.
void conv3x3_winograd(float* out, const float* images, const float* weight, int64_t N, int64_t OC, Window2d window);

// dimages [N, C, H, W] = the gradient of that conv2d with respect to its images, for dout
// [N, OC, OH, OW]: the convolution of dout with the weight turned 180 degrees and its channel
// axes swapped, at padding 2 - pad (torch's conv_transpose2d with stride 1). WRITES.
void conv3x3_winograd_input_grad(float* dimages, const float* dout, const float* weight, int64_t N, int64_t OC,
                                 Window2d window);

// dweight [OC, C, 3, 3] = the gradient of that conv2d with respect to its weight, for images
// [N, C, H, W] and dout [N, OC, OH, OW]: the sum over images and positions of dout times the
// input each weight multiplied. WRITES.
void conv3x3_winograd_weight_grad(float* dweight, const float* images, const float* dout, int64_t N, int64_t OC,
                                  Window2d window);

}  // namespace nanoddp::kernels::cpu
