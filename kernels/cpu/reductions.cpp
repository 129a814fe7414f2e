// CPU reductions: sum, its backward, argmax, a gradient's norm.
#include <cmath>

#include "kernels/cpu/eigen_maps.h"
#include "kernels/grad_norm_term.h"
#include "kernels/kernels.h"

namespace nanoddp::kernels::cpu {

void sum_forward(float* out, const float* in, int64_t n) {
  // Accumulate in double: a loss sum over millions of elements keeps float32 accuracy.
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) total += in[i];
  out[0] = static_cast<float>(total);
}

void broadcast_scalar_backward(float* din, const float* dout, float scale, int64_t n) {
  vec(din, n).setConstant(dout[0] * scale);
}

void argmax_forward(int64_t* out, const float* in, int64_t N, int64_t C) {
  for (int64_t r = 0; r < N; ++r) {
    const float* row = in + r * C;
    int64_t best = 0;
    for (int64_t c = 1; c < C; ++c) {
      if (std::isnan(row[best])) break;  // the first NaN wins
      if (std::isnan(row[c]) || row[c] > row[best]) best = c;
    }
    out[r] = best;
  }
}

// Declared in nn/clip_grad.cpp: every element in order, into the running totals.
void grad_norm_accumulate(double* totals, const float* g, int64_t n, double norm_type, double rescale_by) {
  const bool sums = !std::isinf(norm_type);
  double sum = totals[0], largest = totals[1];
  for (int64_t i = 0; i < n; ++i) {
    const double a = std::fabs(static_cast<double>(g[i]));
    largest = nan_max(largest, a);
    if (sums) sum += norm_term(a, norm_type, rescale_by);
  }
  totals[0] = sum;
  totals[1] = largest;
}

}  // namespace nanoddp::kernels::cpu
