// CPU kernels of LayerNorm (declared in nn/normalization.cpp): two passes per row (mean, then
// variance about it) in double, so a row of large equal values has variance 0, not noise.
#include <cmath>

#include "kernels/cpu/eigen_maps.h"

namespace nanoddp::kernels::cpu {

void layer_norm_forward(float* out, float* mean, float* rstd, const float* in, const float* weight,
                        const float* bias, int64_t N, int64_t D, float eps) {
  for (int64_t r = 0; r < N; ++r) {
    const auto x = vec(in + r * D, D).cast<double>().array();
    const double m = x.mean();
    const double var = (x - m).square().mean();
    const double s = 1.0 / std::sqrt(var + eps);
    mean[r] = static_cast<float>(m);
    rstd[r] = static_cast<float>(s);
    auto y = vec(out + r * D, D).array();
    y = ((x - m) * s).cast<float>();
    if (weight != nullptr) y *= vec(weight, D).array();
    if (bias != nullptr) y += vec(bias, D).array();
  }
}

void layer_norm_backward(float* din, float* dweight, float* dbias, const float* dout, const float* in,
                         const float* mean, const float* rstd, const float* weight, int64_t N, int64_t D) {
  Eigen::ArrayXd dweight_sum = Eigen::ArrayXd::Zero(dweight ? D : 0), dbias_sum = Eigen::ArrayXd::Zero(dbias ? D : 0);
  Eigen::ArrayXd dy(D), xhat(D), g(D);
  for (int64_t r = 0; r < N; ++r) {
    dy = vec(dout + r * D, D).cast<double>().array();
    xhat = (vec(in + r * D, D).cast<double>().array() - double(mean[r])) * double(rstd[r]);
    if (dweight != nullptr) dweight_sum += dy * xhat;
    if (dbias != nullptr) dbias_sum += dy;
    if (din == nullptr) continue;
    g = weight != nullptr ? (dy * vec(weight, D).cast<double>().array()).eval() : dy;
    const double g_mean = g.mean(), gx_mean = (g * xhat).mean();
    vec(din + r * D, D).array() = (double(rstd[r]) * (g - g_mean - xhat * gx_mean)).cast<float>();
  }
  if (dweight != nullptr) vec(dweight, D).array() = dweight_sum.cast<float>();
  if (dbias != nullptr) vec(dbias, D).array() = dbias_sum.cast<float>();
}

}  // namespace nanoddp::kernels::cpu
