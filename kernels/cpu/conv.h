// Conv2d's im2col / col2im on the CPU (kernels/cpu/conv.cpp), for tests: the kernels nn/conv.cpp
// dispatches to (fast for stride_w == 1) and the general loops they fall back to otherwise
// (any stride, padding and dilation, every element's bounds tested), which tests compare
// them with.
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

// cols [C kh kw, N OH OW] from images N of [C, H, W]; layout as nn/conv.cpp's im2col.
void im2col_reference(float* cols, const float* images, int64_t N, Window2d g);
// dimages = the sum, over the cols entries that read each pixel, of dcols. WRITES.
void col2im_reference(float* dimages, const float* dcols, int64_t N, Window2d g);

}  // namespace nanoddp::kernels::cpu
