// Conv2d's im2col / col2im and MaxPool2d's forward on the CPU (kernels/cpu/conv.cpp), for
// tests: the kernels nn/conv.cpp dispatches to (im2col / col2im fast for stride_w == 1,
// max pooling fast without padding) and the general code they fall back to otherwise (any
// stride, padding and dilation, every element's bounds tested), which tests compare them with.
//
//   kernels::cpu::im2col_reference(cols, images, N, window);   // cols [C kh kw, N OH OW]
//   kernels::cpu::col2im_reference(dimages, dcols, N, window);  // dimages [N, C, H, W], written
#pragma once

#include <cstdint>

#include "kernels/kernels.h"

namespace nanoddp::kernels::cpu {

// The kernels, as NANODDP_DECLARE_KERNEL declares them in nn/conv.cpp.
void im2col(float* cols, const float* images, int64_t N, Window2d window);
void col2im(float* dimages, const float* dcols, int64_t N, Window2d window);
// Per plane: out = each window's maximum, indices = its position (kernels/pool_window.h's
// max_pool2d_window is the rule and the fallback); indices null: out only.
void max_pool2d_forward(float* out, int32_t* indices, const float* in, int64_t planes, Window2d window);
// din[p, indices[p, o]] += dout[p, o], din 0 elsewhere; stored rather than added when the
// windows do not overlap.
void max_pool2d_backward(float* din, const float* dout, const int32_t* indices, int64_t planes, Window2d window);

// cols [C kh kw, N OH OW] from images N of [C, H, W]; layout as nn/conv.cpp's im2col.
void im2col_reference(float* cols, const float* images, int64_t N, Window2d g);
// dimages = the sum, over the cols entries that read each pixel, of dcols. WRITES.
void col2im_reference(float* dimages, const float* dcols, int64_t N, Window2d g);

}  // namespace nanoddp::kernels::cpu
