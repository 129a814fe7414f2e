// Ordered integer keys for float32 (kernels/cuda/nan_ordered.h): what lets NCCL's integer max/min
// reduce floats with NaN propagating.

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/nan_ordered.h"

namespace nanoddp::kernels::cuda {

namespace {

constexpr uint32_t kSign = 0x80000000u;
constexpr uint32_t kQuietNaN = 0x7fc00000u;

__device__ __forceinline__ uint32_t nan_key(NanAt nan_at) { return nan_at == NanAt::Top ? 0xffffffffu : 0u; }

__global__ void floats_to_ordered_keys_kernel(uint32_t* data, int64_t n, NanAt nan_at) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    const uint32_t bits = data[i];
    const bool is_nan = (bits & 0x7fffffffu) > 0x7f800000u;
    data[i] = is_nan ? nan_key(nan_at) : (bits & kSign) ? ~bits : bits | kSign;
  }
}

__global__ void ordered_keys_to_floats_kernel(uint32_t* data, int64_t n, NanAt nan_at) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    const uint32_t key = data[i];
    data[i] = key == nan_key(nan_at) ? kQuietNaN : (key & kSign) ? key & ~kSign : ~key;
  }
}

}  // namespace

void floats_to_ordered_keys(void* data, int64_t n, NanAt nan_at, void* stream) {
  if (n <= 0) return;
  floats_to_ordered_keys_kernel<<<grid_for(n), kBlock, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<uint32_t*>(data), n, nan_at);
  NANODDP_CUDA_CHECK_LAUNCH("floats_to_ordered_keys_kernel");
}

void ordered_keys_to_floats(void* data, int64_t n, NanAt nan_at, void* stream) {
  if (n <= 0) return;
  ordered_keys_to_floats_kernel<<<grid_for(n), kBlock, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<uint32_t*>(data), n, nan_at);
  NANODDP_CUDA_CHECK_LAUNCH("ordered_keys_to_floats_kernel");
}

void preload_ordered_key_kernels() {
  cudaFuncAttributes attributes;
  NANODDP_CUDA_CHECK(cudaFuncGetAttributes(&attributes, floats_to_ordered_keys_kernel));
  NANODDP_CUDA_CHECK(cudaFuncGetAttributes(&attributes, ordered_keys_to_floats_kernel));
}

}  // namespace nanoddp::kernels::cuda
