// The check family for CUDA, cuBLAS and NCCL calls: each throws nanoddp::DeviceError with
// the call's text, the library's error name and string, and file:line.
//
//   NANODDP_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, kind, stream));
//   my_kernel<<<grid, block, 0, stream>>>(...);  NANODDP_CUDA_CHECK_LAUNCH("my_kernel");
//   NANODDP_CUBLAS_CHECK(cublasSgemm(handle, ...));
//
// Internal to kernels/cuda and dist/ (the NCCL process group): includes the CUDA runtime
// headers, so keep it out of headers that plain C++ code includes.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "core/error.h"

#if NANODDP_WITH_NCCL
#include <nccl.h>
#endif

namespace nanoddp::kernels::cuda::detail {

// The failure is the DeviceError's: cleared as the thread's last CUDA error, which the next
// launch check (NANODDP_CUDA_CHECK_LAUNCH) would otherwise report as its own kernel's. A
// sticky error (the context is lost) stays whatever is done.
[[noreturn]] inline void throw_cuda_error(cudaError_t error, const char* call, const char* file, int line) {
  (void)cudaGetLastError();
  ::nanoddp::detail::raise<DeviceError>(file, line, "CUDA call failed: ", call, ": ",
                                        cudaGetErrorName(error), " (", cudaGetErrorString(error), ")");
}

[[noreturn]] inline void throw_cublas_error(cublasStatus_t status, const char* call, const char* file,
                                            int line) {
  ::nanoddp::detail::raise<DeviceError>(file, line, "cuBLAS call failed: ", call, ": ",
                                        cublasGetStatusString(status), " (status ", static_cast<int>(status), ")");
}

#if NANODDP_WITH_NCCL
[[noreturn]] inline void throw_nccl_error(ncclResult_t result, const char* call, const char* file, int line) {
  ::nanoddp::detail::raise<DeviceError>(file, line, "NCCL call failed: ", call, ": ", ncclGetErrorString(result),
                                        " (", ncclGetLastError(nullptr), ")");
}
#endif

}  // namespace nanoddp::kernels::cuda::detail

// Throws DeviceError when a CUDA runtime call does not return cudaSuccess.
#define NANODDP_CUDA_CHECK(call)                                                                  \
  do {                                                                                            \
    const cudaError_t nanoddp_cuda_error_ = (call);                                               \
    if (nanoddp_cuda_error_ != cudaSuccess)                                                       \
      ::nanoddp::kernels::cuda::detail::throw_cuda_error(nanoddp_cuda_error_, #call, __FILE__, __LINE__); \
  } while (0)

// Right after a <<<...>>> launch: a bad configuration (grid too large, too much shared
// memory) is reported by cudaGetLastError, not by the launch statement itself.
#define NANODDP_CUDA_CHECK_LAUNCH(kernel_name)                                                    \
  do {                                                                                            \
    const cudaError_t nanoddp_cuda_error_ = cudaGetLastError();                                   \
    if (nanoddp_cuda_error_ != cudaSuccess)                                                       \
      ::nanoddp::kernels::cuda::detail::throw_cuda_error(nanoddp_cuda_error_, "launch of " kernel_name, \
                                                          __FILE__, __LINE__);                    \
  } while (0)

// Throws DeviceError when a cuBLAS call does not return CUBLAS_STATUS_SUCCESS.
#define NANODDP_CUBLAS_CHECK(call)                                                                \
  do {                                                                                            \
    const cublasStatus_t nanoddp_cublas_status_ = (call);                                         \
    if (nanoddp_cublas_status_ != CUBLAS_STATUS_SUCCESS)                                          \
      ::nanoddp::kernels::cuda::detail::throw_cublas_error(nanoddp_cublas_status_, #call, __FILE__, __LINE__); \
  } while (0)

#if NANODDP_WITH_NCCL
// Throws DeviceError when an NCCL call returns anything but ncclSuccess (ncclInProgress
// included: nanoddp uses blocking communicators).
#define NANODDP_NCCL_CHECK(call)                                                                  \
  do {                                                                                            \
    const ncclResult_t nanoddp_nccl_result_ = (call);                                             \
    if (nanoddp_nccl_result_ != ncclSuccess)                                                      \
      ::nanoddp::kernels::cuda::detail::throw_nccl_error(nanoddp_nccl_result_, #call, __FILE__, __LINE__); \
  } while (0)
#endif
