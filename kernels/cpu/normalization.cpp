// CPU kernels of LayerNorm (declared in nn/normalization.cpp): two passes per row (mean, then
// variance about it) in double, so a row of large equal values has variance 0, not noise.
// The row sums run in lanes (kernels/cpu/double_sums.h); the elementwise loops are plain so
// that the compiler vectorises the float <-> double conversions.
#include <cmath>
#include <vector>

#include "kernels/cpu/double_sums.h"

namespace nanoddp::kernels::cpu {

void layer_norm_forward(float* out, float* mean, float* rstd, const float* in, const float* weight,
                        const float* bias, int64_t N, int64_t D, float eps) {
  for (int64_t r = 0; r < N; ++r) {
    const float* x = in + r * D;
    float* y = out + r * D;
    const double m = lane_sum(D, [x](int64_t i) { return double(x[i]); }) / double(D);
    const double var = lane_sum(D, [x, m](int64_t i) {
      const double centered = double(x[i]) - m;
      return centered * centered;
    }) / double(D);
    const double s = 1.0 / std::sqrt(var + eps);
    mean[r] = static_cast<float>(m);
    rstd[r] = static_cast<float>(s);
    for (int64_t i = 0; i < D; ++i) y[i] = static_cast<float>((double(x[i]) - m) * s);
    if (weight != nullptr)
      for (int64_t i = 0; i < D; ++i) y[i] *= weight[i];
    if (bias != nullptr)
      for (int64_t i = 0; i < D; ++i) y[i] += bias[i];
  }
}

void layer_norm_backward(float* din, float* dweight, float* dbias, const float* dout, const float* in,
                         const float* mean, const float* rstd, const float* weight, int64_t N, int64_t D) {
  std::vector<double> dweight_sum(dweight ? D : 0, 0.0), dbias_sum(dbias ? D : 0, 0.0);
  std::vector<double> xhat(D), g(D);
  for (int64_t r = 0; r < N; ++r) {
    const float* dy = dout + r * D;
    const float* x = in + r * D;
    const double m = mean[r], s = rstd[r];
    for (int64_t i = 0; i < D; ++i) xhat[i] = (double(x[i]) - m) * s;
    if (dweight != nullptr)
      for (int64_t i = 0; i < D; ++i) dweight_sum[i] += double(dy[i]) * xhat[i];
    if (dbias != nullptr)
      for (int64_t i = 0; i < D; ++i) dbias_sum[i] += double(dy[i]);
    if (din == nullptr) continue;
    if (weight != nullptr)
      for (int64_t i = 0; i < D; ++i) g[i] = double(dy[i]) * double(weight[i]);
    else
      for (int64_t i = 0; i < D; ++i) g[i] = double(dy[i]);
    const double g_mean = lane_sum(D, [&g](int64_t i) { return g[i]; }) / double(D);
    const double gx_mean = lane_sum(D, [&g, &xhat](int64_t i) { return g[i] * xhat[i]; }) / double(D);
    float* dx = din + r * D;
    for (int64_t i = 0; i < D; ++i) dx[i] = static_cast<float>(s * (g[i] - g_mean - xhat[i] * gx_mean));
  }
  if (dweight != nullptr)
    for (int64_t i = 0; i < D; ++i) dweight[i] = static_cast<float>(dweight_sum[i]);
  if (dbias != nullptr)
    for (int64_t i = 0; i < D; ++i) dbias[i] = static_cast<float>(dbias_sum[i]);
}

}  // namespace nanoddp::kernels::cpu
