// Eigen views of our row-major storage. Eigen is column-major by default; every map here
// says RowMajor so that element (r, c) is at r * cols + c, as in a Tensor.
#pragma once

// GCC 12's AVX-512 intrinsics start from an undefined vector on purpose (_mm512_undefined_ps),
// and -Wmaybe-uninitialized reports it at every use inlined from Eigen's packet math, about 150
// times per build (GCC bug 105593). The state is looked up at the intrinsics' own lines, so
// this must come before the first Eigen include of the file, and stays on for the rest of it.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <Eigen/Core>
#include <cstdint>

namespace nanoddp::kernels::cpu {

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MatrixMap = Eigen::Map<RowMatrix>;
using ConstMatrixMap = Eigen::Map<const RowMatrix>;
using VectorMap = Eigen::Map<Eigen::VectorXf>;
using ConstVectorMap = Eigen::Map<const Eigen::VectorXf>;
using ConstRowVectorMap = Eigen::Map<const Eigen::RowVectorXf>;

inline VectorMap vec(float* p, int64_t n) { return VectorMap(p, n); }
inline ConstVectorMap vec(const float* p, int64_t n) { return ConstVectorMap(p, n); }
inline MatrixMap mat(float* p, int64_t rows, int64_t cols) { return MatrixMap(p, rows, cols); }
inline ConstMatrixMap mat(const float* p, int64_t rows, int64_t cols) { return ConstMatrixMap(p, rows, cols); }

}  // namespace nanoddp::kernels::cpu
