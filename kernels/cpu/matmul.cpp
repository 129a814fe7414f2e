// CPU matmul on Eigen's GEMM (row-major maps; see eigen_maps.h).
#include "kernels/cpu/eigen_maps.h"
#include "kernels/kernels.h"

namespace nanoddp::kernels::cpu {

void matmul(float* out, const float* a, const float* b, int64_t M, int64_t K, int64_t N, bool trans_a, bool trans_b,
            float beta) {
  auto o = mat(out, M, N);
  if (K == 0) {
    if (beta == 0.0f) o.setZero();
    return;
  }
  const auto A = trans_a ? mat(a, K, M) : mat(a, M, K);
  const auto B = trans_b ? mat(b, N, K) : mat(b, K, N);
  // Each branch names its transposes so Eigen picks a GEMM without temporaries.
  auto product = [&](auto&& lhs, auto&& rhs) {
    if (beta == 0.0f) {
      o.noalias() = lhs * rhs;
    } else {
      o.noalias() += lhs * rhs;
    }
  };
  if (!trans_a && !trans_b) product(A, B);
  if (!trans_a && trans_b) product(A, B.transpose());
  if (trans_a && !trans_b) product(A.transpose(), B);
  if (trans_a && trans_b) product(A.transpose(), B.transpose());
}

}  // namespace nanoddp::kernels::cpu
