// What the .cu files of kernels/cuda share on the host side: the compute stream and cuBLAS
// handle of the current GPU, and scratch memory from the caching allocator.
//
//   my_forward_kernel<<<grid, block, 0, stream()>>>(...);  NANODDP_CUDA_CHECK_LAUNCH("my_forward_kernel");
//   ScratchBuffer<float> partials(num_blocks);              // returned to the cache at scope end
//   NANODDP_CUBLAS_CHECK(cublasSgemm(cublas_handle(), ...));
//
// Internal to kernels/cuda: it includes CUDA headers.
#pragma once

#include <cstddef>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/device_memory.h"

namespace nanoddp::kernels::cuda {

// The GPU this thread currently uses (cudaGetDevice).
int current_device();
// The compute stream of the current GPU, created on first use (see compute_stream()).
inline cudaStream_t stream() { return static_cast<cudaStream_t>(compute_stream()); }
// The cuBLAS handle of the current GPU, bound to its compute stream. Math mode: plain
// float32 (CUBLAS_DEFAULT_MATH) unless the build sets NANODDP_TF32=1 (meson -Dtf32=true),
// so results match the CPU reference to float rounding.
cublasHandle_t cublas_handle();

// Note [Scratch on one stream]
// A kernel's temporary buffer (reduction partials, per-row losses) goes back to the cache
// when its host scope ends, while the kernels that use it may still be queued. That is safe
// because every kernel runs on the one compute stream: whoever gets the block next is queued
// behind them. Code on another stream (NCCL) must first wait for the compute stream.
template <typename T>
class ScratchBuffer {
 public:
  explicit ScratchBuffer(size_t count)
      : device_(current_device()), data_(static_cast<T*>(allocate(count * sizeof(T), device_))) {}
  ~ScratchBuffer() { deallocate(data_, device_); }
  ScratchBuffer(const ScratchBuffer&) = delete;
  ScratchBuffer& operator=(const ScratchBuffer&) = delete;
  T* data() const { return data_; }

 private:
  int device_;
  T* data_;
};

}  // namespace nanoddp::kernels::cuda
