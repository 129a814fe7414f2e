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

}  // namespace nanoddp::kernels::cuda
