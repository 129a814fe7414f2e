// Matrix products on CUDA through cuBLAS, for row-major storage.
//
// Note [Row-major through cuBLAS]
// cuBLAS is column-major. A row-major [R, C] array read as column-major is its transpose
// [C, R], so out = op(a) · op(b) (row-major) is computed as out^T = op(b)^T · op(a)^T in
// column-major terms: swap the operands, keep each one's transpose flag, and pass N as
// cuBLAS's m and M as its n. Leading dimensions are the stored row lengths.

#include <climits>

#include "kernels/cuda/launch.cuh"
#include "kernels/kernels.h"

namespace nanoddp::kernels::cuda {

void matmul(float* out, const float* a, const float* b, int64_t M, int64_t K, int64_t N, bool trans_a,
            bool trans_b, float beta) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {  // an empty sum: out = beta * out, and beta 0 must overwrite NaN as well
    if (beta == 0.0f)
      fill(out, 0.0f, M * N);
    else if (beta != 1.0f)
      scalar_forward(out, out, ScalarOp::Mul, beta, M * N);
    return;
  }
  NANODDP_CHECK(M <= INT_MAX && K <= INT_MAX && N <= INT_MAX, ValueError, "matmul: [", M, ", ", K, "] x [", K,
                ", ", N, "] has a size beyond cuBLAS's 32-bit int");
  const int m = static_cast<int>(N), n = static_cast<int>(M), k = static_cast<int>(K);
  // Stored row lengths (Note [Row-major through cuBLAS]).
  const int ld_b = static_cast<int>(trans_b ? K : N);
  const int ld_a = static_cast<int>(trans_a ? M : K);
  const float alpha = 1.0f;
  NANODDP_CUBLAS_CHECK(cublasSgemm(cublas_handle(), trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                                   trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, m, n, k, &alpha, b, ld_b, a, ld_a, &beta,
                                   out, m));
}

__global__ void broadcast_rows_16bit_kernel(uint16_t* out, const uint16_t* row, int64_t N, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) out[i] = row[i % N];
}

// 16-bit operands and output, float32 accumulation: the tensor cores' bf16/fp16 path. A bias
// is copied into every row of out first and added by the GEMM (beta 1), inside its float32
// sum, as torch's addmm does. cuBLAS's default math mode, like torch's default, lets a GEMM
// that splits K reduce the parts in 16 bits: one rounding is what its kernels do otherwise,
// not a documented promise.
void matmul_16bit(uint16_t* out, const uint16_t* a, const uint16_t* b, const uint16_t* row_bias, DType format,
                  int64_t M, int64_t K, int64_t N, bool trans_a, bool trans_b) {
  if (M <= 0 || N <= 0) return;
  // Checked before the bias is broadcast into out, so that a refused product leaves out as it is.
  NANODDP_CHECK(M <= INT_MAX && K <= INT_MAX && N <= INT_MAX, ValueError, "matmul_16bit: [", M, ", ", K, "] x [",
                K, ", ", N, "] has a size beyond cuBLAS's 32-bit int");
  if (row_bias != nullptr) {
    broadcast_rows_16bit_kernel<<<grid_for(M * N), kBlock, 0, stream()>>>(out, row_bias, N, M * N);
    NANODDP_CUDA_CHECK_LAUNCH("broadcast_rows_16bit_kernel");
  }
  if (K <= 0) {  // an empty sum: the bias, or zeros (+0 has all bits clear in both formats)
    if (row_bias == nullptr)
      NANODDP_CUDA_CHECK(cudaMemsetAsync(out, 0, static_cast<size_t>(M * N) * sizeof(uint16_t), stream()));
    return;
  }
  const int m = static_cast<int>(N), n = static_cast<int>(M), k = static_cast<int>(K);
  const int ld_b = static_cast<int>(trans_b ? K : N);  // Note [Row-major through cuBLAS]
  const int ld_a = static_cast<int>(trans_a ? M : K);
  const cudaDataType type = format == DType::BFloat16 ? CUDA_R_16BF : CUDA_R_16F;
  // float scalars: CUBLAS_COMPUTE_32F takes them as float
  const float alpha = 1.0f, beta = row_bias != nullptr ? 1.0f : 0.0f;
  NANODDP_CUBLAS_CHECK(cublasGemmEx(cublas_handle(), trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                                    trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, m, n, k, &alpha, b, type, ld_b, a, type,
                                    ld_a, &beta, out, type, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

}  // namespace nanoddp::kernels::cuda
