// How many images conv2d puts in one im2col + GEMM (Note [Images per GEMM] in nn/conv.cpp).
// Internal to the library (not installed); declared here so that the unit suite checks the
// CUDA grouping on a machine without a GPU.
#pragma once

#include <cstdint>

#include "core/device.h"

namespace nanoddp::nn::detail {

// When cols are not kept for backward, a CUDA group's cols take about this many bytes.
inline constexpr int64_t kMaxUnsavedColsBytes = 16 << 20;

// Images per group for a batch of N images whose cols have CKK = C kh kw rows and OHW output
// positions per image: 1 on the CPU; on CUDA N when cols are kept for backward or an image
// has fewer than 32 positions, else a multiple of the images per 48-column boundary whose cols
// fit kMaxUnsavedColsBytes (at least one such multiple), at most N. Always at least 1, an
// empty batch included: backward divides by it to count the groups.
int64_t images_per_gemm(Device device, bool keeps_cols, int64_t N, int64_t CKK, int64_t OHW);

}  // namespace nanoddp::nn::detail
