// CPU matmul on Eigen's GEMM (row-major maps; see eigen_maps.h), with direct loops for
// products that have one tiny dimension (Note [Thin matmuls]) and for small panels (Note
// [Panel matmuls]).
#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels/cpu/eigen_maps.h"
#include "kernels/kernels.h"

namespace nanoddp::kernels::cpu {

namespace {

// Note [Thin matmuls]
// Eigen's GEMM zero-fills out (for beta 0), copies both operands into packed panels, then runs
// a kernel tuned for large tiles (24 x 4 floats). When the inner size K or the output's row
// count M is tiny, that work can be out of proportion: a Conv2d over one input channel with a
// 3x3 kernel (fashion_mnist_cnn's first layer) multiplies weight [32, 9] by cols [9, 676] per
// image, and a Linear on a batch of a few samples multiplies x [M, 784] by weight^T. The two
// loops below read each operand in place and write each output once:
//   K <= kThinSize, no transposes: a block of kBlockRows rows of out, 8 columns at a time, is
//     a sum of K rows of b scaled by a's entries (the K rows of b stay in L1);
//   2 <= M <= kDotRows * 2 and K >= kDotMinInner, b transposed: out[m, n] is the dot product
//     of row m of a and row n of b, for kDotRows rows of a and kDotCols rows of b at a time.
//     It loads 6 vectors per 8 multiply-adds, so it beats Eigen only where the dot products
//     are long and few rows share each load of b: [2..8, 784] x [256, 784]^T took half to 0.85
//     of Eigen's time, while a single row (Eigen's own matrix-vector loop), K up to 64, or 9
//     rows or more (the first convolution's weight gradient, [9, 676] x [32, 676]^T: 1.3
//     times) took 1.2 to 4 times as long (AVX-512).
// Each block keeps 8 independent vector sums: one running sum would wait for its previous
// fused multiply-add (4 cycles) every time. A block that runs past the last row repeats that
// row and drops the extra sums, so that the block's size, and its registers, stay fixed.
// Sums run in a fixed order (the same result on every run), not Eigen's order; both paths are
// tested against a float64 reference at sizes with remainders (tests/test_ops.cpp).
constexpr int64_t kThinSize = 16;
constexpr int64_t kBlockRows = 8;
constexpr int64_t kDotRows = 4, kDotCols = 2;
constexpr int64_t kDotMinInner = 128;

// 8 floats (GCC's and Clang's vector extensions: one AVX register with -mavx2, two SSE ones
// without). Loads and stores go through memcpy: unaligned, and no aliasing assumptions.
using Floats8 = float __attribute__((vector_size(32)));
constexpr int64_t kLanes = 8;

inline void load(Floats8& v, const float* p) { std::memcpy(&v, p, sizeof v); }
inline void store(float* p, const Floats8& v) { std::memcpy(p, &v, sizeof v); }

// The direct loops are written for AVX2's 16 registers of 8 floats (or AVX-512's). With SSE2
// only (cpu_isa=portable: 16 registers of 4 floats) their blocks spill, and they ran as fast
// as Eigen's GEMM at best and 16 times slower at worst: such builds use Eigen throughout.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
constexpr bool kDirectLoopsPay = true;
#else
constexpr bool kDirectLoopsPay = false;
#endif

// out [M, N] = beta out + a [M, K] · b [K, N], for small K.
[[gnu::noinline]] void thin_inner_matmul(float* out, const float* a, const float* b, int64_t M, int64_t K, int64_t N, float beta) {
  for (int64_t first = 0; first < M; first += kBlockRows) {
    // Row r of the block, or the last row again past M: such a row computes and stores row
    // M - 1's value a second time (every old value is read before any is stored).
    const float* scales[kBlockRows];
    float* rows[kBlockRows];
    for (int64_t r = 0; r < kBlockRows; ++r) {
      const int64_t m = std::min(first + r, M - 1);
      scales[r] = a + m * K;
      rows[r] = out + m * N;
    }
    int64_t n = 0;
    for (; n + kLanes <= N; n += kLanes) {
      Floats8 sums[kBlockRows];
      for (Floats8& sum : sums) sum = Floats8{};
      for (int64_t k = 0; k < K; ++k) {
        Floats8 bk;
        load(bk, b + k * N + n);
        for (int64_t r = 0; r < kBlockRows; ++r) sums[r] += scales[r][k] * bk;
      }
      if (beta != 0.0f)
        for (int64_t r = 0; r < kBlockRows; ++r) {
          Floats8 old;
          load(old, rows[r] + n);
          sums[r] += old;
        }
      for (int64_t r = 0; r < kBlockRows; ++r) store(rows[r] + n, sums[r]);
    }
    for (; n < N; ++n)
      for (int64_t r = 0; r < std::min(kBlockRows, M - first); ++r) {
        float sum = 0.0f;
        for (int64_t k = 0; k < K; ++k) sum += scales[r][k] * b[k * N + n];
        rows[r][n] = beta != 0.0f ? rows[r][n] + sum : sum;
      }
  }
}

// out [M, N] = beta out + a [M, K] · b^T, b stored [N, K], for small M.
[[gnu::noinline]] void thin_outer_matmul(float* out, const float* a, const float* b, int64_t M, int64_t K, int64_t N, float beta) {
  for (int64_t first_m = 0; first_m < M; first_m += kDotRows) {
    const int64_t rows = std::min(kDotRows, M - first_m);
    const float* a_rows[kDotRows];  // (the last row again past M)
    for (int64_t r = 0; r < kDotRows; ++r) a_rows[r] = a + (first_m + std::min(r, rows - 1)) * K;
    for (int64_t first_n = 0; first_n < N; first_n += kDotCols) {
      const int64_t cols = std::min(kDotCols, N - first_n);
      const float* b_rows[kDotCols];  // (the last row again past N)
      for (int64_t c = 0; c < kDotCols; ++c) b_rows[c] = b + (first_n + std::min(c, cols - 1)) * K;
      Floats8 sums[kDotRows * kDotCols];  // (one dimension: GCC keeps it in registers)
      for (Floats8& sum : sums) sum = Floats8{};
      int64_t k = 0;
      for (; k + kLanes <= K; k += kLanes) {
        Floats8 bk[kDotCols];
        for (int64_t c = 0; c < kDotCols; ++c) load(bk[c], b_rows[c] + k);
        for (int64_t r = 0; r < kDotRows; ++r) {
          Floats8 ak;
          load(ak, a_rows[r] + k);
          for (int64_t c = 0; c < kDotCols; ++c) sums[r * kDotCols + c] += ak * bk[c];
        }
      }
      float lanes[kDotRows * kDotCols][kLanes];
      std::memcpy(lanes, sums, sizeof lanes);
      float dots[kDotRows][kDotCols];
      for (int64_t r = 0; r < kDotRows; ++r)
        for (int64_t c = 0; c < kDotCols; ++c) {
          float dot = 0.0f;
          for (float lane : lanes[r * kDotCols + c]) dot += lane;
          for (int64_t rest = k; rest < K; ++rest) dot += a_rows[r][rest] * b_rows[c][rest];
          dots[r][c] = dot;
        }
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          float& o = out[(first_m + r) * N + first_n + c];
          o = beta != 0.0f ? o + dots[r][c] : dots[r][c];
        }
    }
  }
}

// Note [Panel matmuls]
// Winograd's convolution (kernels/cpu/winograd.cpp) runs 16 products per chunk of tiles whose
// operands are small: V [~250, C] · U [C, OC] in forward and in the input gradient, and
// V^T · dM [~250, OC] -> [C, OC] in the weight gradient, with C and OC a few dozen. Eigen
// packs both operands on every call; for these sizes that packing is about a fifth of the
// work. The loop below keeps a block of kPanelRows rows of out, kPanelVectors vectors wide,
// in registers while it runs over K: each step loads the vectors of one row of b and
// broadcasts one entry of a per row of the block. b's panel (at most kPanelFloats floats)
// stays in L1 for every block (with a transposed, b is [K, N] and streams from L2 for K up to
// kPanelOuter). Measured on the example CNN's shapes (AVX-512): 105-116 GFLOP/s against
// Eigen's 90. a is read through strides, so that a stored [K, M] (the weight gradient's V^T)
// needs no transposed copy. Sums run over k in order, as in the thin loops. Eigen keeps what
// does not fit: fewer rows than a block (one row computed 8 times ran at 13 GFLOP/s against
// Eigen's 46-76), and a transposed a over K beyond kPanelOuter (K 60,000: 18 against 39).
// With AVX2 the same shapes ran at 93-103 GFLOP/s against Eigen's 81-87.
#if defined(__AVX512F__)
using Wide = float __attribute__((vector_size(64)));  // one AVX-512 register
constexpr int64_t kPanelRows = 8;                     // 16 sums of 32 registers
inline void load(Wide& v, const float* p) { std::memcpy(&v, p, sizeof v); }
inline void store(float* p, const Wide& v) { std::memcpy(p, &v, sizeof v); }
#else
using Wide = Floats8;
constexpr int64_t kPanelRows = 6;  // 12 sums of 16 AVX registers
#endif
constexpr int64_t kWideLanes = sizeof(Wide) / sizeof(float);
constexpr int64_t kPanelVectors = 2;
constexpr int64_t kPanelFloats = 4096;  // 16 KB of b
constexpr int64_t kPanelInner = 64;     // the longest K without transposes
constexpr int64_t kPanelOuter = 1024;   // the longest K with a transposed (b's [K, N] from L2)

// Columns [n, n + vectors * kWideLanes) of the block of rows rows[]: a's entry (r, k) at
// a_rows[r] + k, or at a_rows[r] + k M for a stored [K, M].
template <int64_t vectors, bool a_transposed>
inline void panel_block(float* const* rows, const float* const* a_rows, int64_t M, const float* b, int64_t K,
                        int64_t N, int64_t n, float beta) {
  const int64_t a_step = a_transposed ? M : 1;
  Wide sums[kPanelRows * vectors];  // (one dimension: GCC keeps it in registers)
  for (Wide& sum : sums) sum = Wide{};
  for (int64_t k = 0; k < K; ++k) {
    Wide bk[vectors];
    for (int64_t v = 0; v < vectors; ++v) load(bk[v], b + k * N + n + v * kWideLanes);
    for (int64_t r = 0; r < kPanelRows; ++r) {
      const float x = a_rows[r][k * a_step];
      for (int64_t v = 0; v < vectors; ++v) sums[r * vectors + v] += x * bk[v];
    }
  }
  if (beta != 0.0f)  // every old value read before any is stored (a repeated row, below)
    for (int64_t r = 0; r < kPanelRows; ++r)
      for (int64_t v = 0; v < vectors; ++v) {
        Wide old;
        load(old, rows[r] + n + v * kWideLanes);
        sums[r * vectors + v] += old;
      }
  for (int64_t r = 0; r < kPanelRows; ++r)
    for (int64_t v = 0; v < vectors; ++v) store(rows[r] + n + v * kWideLanes, sums[r * vectors + v]);
}

// out [M, N] = beta out + op(a) · b [K, N], op(a) [M, K]: a itself, or a stored [K, M]
// transposed.
template <bool a_transposed>
[[gnu::noinline]] void panel_matmul(float* out, const float* a, const float* b, int64_t M, int64_t K,
                                    int64_t N, float beta) {
  const int64_t a_row = a_transposed ? 1 : K, a_step = a_transposed ? M : 1;
  for (int64_t first = 0; first < M; first += kPanelRows) {
    // Row r of the block, or the last row again past M: it stores row M - 1's value twice.
    const float* a_rows[kPanelRows];
    float* rows[kPanelRows];
    for (int64_t r = 0; r < kPanelRows; ++r) {
      const int64_t m = std::min(first + r, M - 1);
      a_rows[r] = a + m * a_row;
      rows[r] = out + m * N;
    }
    int64_t n = 0;
    for (; n + kPanelVectors * kWideLanes <= N; n += kPanelVectors * kWideLanes)
      panel_block<kPanelVectors, a_transposed>(rows, a_rows, M, b, K, N, n, beta);
    for (; n + kWideLanes <= N; n += kWideLanes)
      panel_block<1, a_transposed>(rows, a_rows, M, b, K, N, n, beta);
    for (; n < N; ++n)
      for (int64_t r = 0; r < std::min(kPanelRows, M - first); ++r) {
        float sum = 0.0f;
        for (int64_t k = 0; k < K; ++k) sum += a_rows[r][k * a_step] * b[k * N + n];
        rows[r][n] = beta != 0.0f ? rows[r][n] + sum : sum;
      }
  }
}

}  // namespace

void matmul(float* out, const float* a, const float* b, int64_t M, int64_t K, int64_t N, bool trans_a, bool trans_b,
            float beta) {
  auto o = mat(out, M, N);
  if (K == 0) {
    if (beta == 0.0f) o.setZero();
    return;
  }
  if (kDirectLoopsPay) {
    if (!trans_a && !trans_b && K <= kThinSize) return thin_inner_matmul(out, a, b, M, K, N, beta);
    if (!trans_a && trans_b && M >= 2 && M <= 2 * kDotRows && K >= kDotMinInner)
      return thin_outer_matmul(out, a, b, M, K, N, beta);
    if (!trans_b && N >= kWideLanes && M >= kPanelRows) {  // Note [Panel matmuls]
      if (!trans_a && K <= kPanelInner && K * N <= kPanelFloats)
        return panel_matmul<false>(out, a, b, M, K, N, beta);
      if (trans_a && M * N <= kPanelFloats && K <= kPanelOuter)
        return panel_matmul<true>(out, a, b, M, K, N, beta);
    }
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

// The CPU has no 16-bit arithmetic to use here (Eigen would widen each element in the inner
// loop), so the operands are widened once, multiplied by the float32 GEMM and rounded once.
// That is the float32 sum autocast promises, at the cost of 4 bytes per operand element.
void matmul_16bit(uint16_t* out, const uint16_t* a, const uint16_t* b, const uint16_t* row_bias, DType format,
                  int64_t M, int64_t K, int64_t N, bool trans_a, bool trans_b) {
  // Buffers kept per thread: a training step calls this with the same sizes every time, and
  // fresh allocations of this size cost a page fault per 4 KiB, each step.
  thread_local std::vector<float> wide_a, wide_b, wide_out;
  wide_a.resize(static_cast<size_t>(M * K));
  wide_b.resize(static_cast<size_t>(K * N));
  wide_out.resize(static_cast<size_t>(M * N));
  float_from_16bit(wide_a.data(), a, format, M * K);
  float_from_16bit(wide_b.data(), b, format, K * N);
  // The bias starts every row's sum, so that the product and the bias are rounded together.
  if (row_bias != nullptr)
    for (int64_t i = 0; i < M; ++i) float_from_16bit(wide_out.data() + i * N, row_bias, format, N);
  matmul(wide_out.data(), wide_a.data(), wide_b.data(), M, K, N, trans_a, trans_b, row_bias != nullptr ? 1.0f : 0.0f);
  float_to_16bit(out, wide_out.data(), format, 1.0f, M * N);
}

}  // namespace nanoddp::kernels::cpu
