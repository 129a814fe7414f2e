// Device-side helpers shared by the .cu files: launch geometry, warp and block sums, and the
// deterministic two-pass sum that every reduction (sum, mean, mse, cross_entropy) uses.
//
//   fill_forward_kernel<<<grid_for(n), kBlock, 0, stream()>>>(out, value, n);
//   for (int64_t i = first_index(); i < n; i += grid_stride()) ...   // inside a kernel
//   deterministic_sum(out, SquaredDiff{a, b}, n, double(n));        // out[0] = mean((a-b)^2)
//
// Internal to kernels/cuda (CUDA C++ only).
#pragma once

#include <cstdint>

#include "kernels/cuda/context.h"

namespace nanoddp::kernels::cuda {

constexpr int kBlock = 256;              // threads per block of the 1-d kernels
constexpr int64_t kMaxGrid = 65536;      // grid-stride loops cover whatever is beyond
constexpr unsigned kFullMask = 0xffffffffu;

// Blocks for n elements, one element per thread up to kMaxGrid blocks. Never 0 (callers
// return early for n == 0, which is a valid no-op everywhere).
inline unsigned grid_for(int64_t n, int block = kBlock) {
  int64_t blocks = (n + block - 1) / block;
  if (blocks < 1) blocks = 1;
  if (blocks > kMaxGrid) blocks = kMaxGrid;
  return static_cast<unsigned>(blocks);
}

__device__ __forceinline__ int64_t first_index() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t grid_stride() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

// Sum over the 32 lanes of a warp; the full sum lands in lane 0. The shuffle tree is fixed,
// so the result does not depend on timing.
template <typename T>
__device__ __forceinline__ T warp_sum(T value) {
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_down_sync(kFullMask, value, offset);
  return value;
}

// Sum over a block of kThreads threads (a multiple of 32, at most 1024); the result is valid
// in thread 0. Uses static shared memory: call at most once per kernel.
template <int kThreads, typename T>
__device__ __forceinline__ T block_sum(T value) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "block_sum needs whole warps");
  __shared__ T warp_sums[kThreads / 32];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  value = warp_sum(value);
  if (lane == 0) warp_sums[warp] = value;
  __syncthreads();
  if (warp == 0) {
    value = lane < kThreads / 32 ? warp_sums[lane] : T(0);
    value = warp_sum(value);
  }
  return value;
}

// ---- deterministic sum ---------------------------------------------------------------------
// Note [Deterministic reduction]
// Pass 1 gives block b the elements b*kBlock + t + k*stride and writes its sum to
// partials[b]; pass 2 sums the partials in one block. The number of blocks depends on n only
// (never on the GPU model or on timing) and each tree is fixed, so the same input gives
// bit-identical sums on every run and every GPU. No atomics. Sums are kept in double, as the
// CPU kernels keep theirs, so both round the same exact-ish total to float once at the end;
// the kernel stays memory-bound (one double add per element loaded).
constexpr int kMaxSumBlocks = 1024;
constexpr int kSumUnroll = 4;  // independent loads in flight per thread

inline int sum_blocks(int64_t n) {
  const int64_t per_block = int64_t(kBlock) * kSumUnroll;
  int64_t blocks = (n + per_block - 1) / per_block;
  return static_cast<int>(blocks < 1 ? 1 : (blocks > kMaxSumBlocks ? kMaxSumBlocks : blocks));
}

// load(i) -> float: the value to sum for element i (in[i], (a[i]-b[i])^2, ...).
template <typename Load>
__global__ void sum_partials_kernel(double* partials, Load load, int64_t n) {
  const int64_t stride = grid_stride();
  int64_t i = first_index();
  double acc = 0.0;
  for (; i + (kSumUnroll - 1) * stride < n; i += kSumUnroll * stride) {
    const float v0 = load(i), v1 = load(i + stride), v2 = load(i + 2 * stride), v3 = load(i + 3 * stride);
    acc += (double(v0) + double(v1)) + (double(v2) + double(v3));
  }
  for (; i < n; i += stride) acc += double(load(i));
  const double total = block_sum<kBlock>(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

// out[0] = float((sum of partials[0..count)) / divisor), divisor being *device_divisor when
// that is given (a count the device computed; with zero_divisor_is_nan a count of 0 gives NaN
// whatever the sum); one block of kMaxSumBlocks threads.
template <int kThreads = kMaxSumBlocks>
__global__ void sum_finish_kernel(float* out, const double* partials, int count, double divisor,
                                  const float* device_divisor = nullptr, bool zero_divisor_is_nan = false) {
  const double value = threadIdx.x < count ? partials[threadIdx.x] : 0.0;
  const double total = block_sum<kThreads>(value);
  if (threadIdx.x == 0) {
    const double by = device_divisor != nullptr ? double(*device_divisor) : divisor;
    out[0] = zero_divisor_is_nan && by == 0.0 ? NAN : static_cast<float>(total / by);
  }
}

// out[0] = (sum over i < n of load(i)) / divisor, deterministically. divisor is 1 for a sum,
// n for a mean (so a mean of nothing is 0/0 = NaN, as torch). out is device memory.
// device_divisor, when given, replaces divisor with a value in device memory (no host sync);
// zero_divisor_is_nan makes a divisor of 0 give NaN, whatever the sum.
template <typename Load>
void deterministic_sum(float* out, Load load, int64_t n, double divisor,
                       const float* device_divisor = nullptr, bool zero_divisor_is_nan = false) {
  const int blocks = n > 0 ? sum_blocks(n) : 0;
  ScratchBuffer<double> partials(blocks > 0 ? blocks : 1);
  if (blocks > 0) {
    sum_partials_kernel<<<blocks, kBlock, 0, stream()>>>(partials.data(), load, n);
    NANODDP_CUDA_CHECK_LAUNCH("sum_partials_kernel");
  }
  sum_finish_kernel<<<1, kMaxSumBlocks, 0, stream()>>>(out, partials.data(), blocks, divisor, device_divisor,
                                                       zero_divisor_is_nan);
  NANODDP_CUDA_CHECK_LAUNCH("sum_finish_kernel");
}

}  // namespace nanoddp::kernels::cuda
