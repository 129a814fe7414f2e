// CPU kernels of BatchNorm (declared in nn/batch_norm.cpp). A channel's values are N runs of L
// contiguous floats, C * L apart; every per-channel sum is kept in double, in a fixed order.
#include <algorithm>
#include <cmath>

#include "kernels/cpu/eigen_maps.h"

namespace nanoddp::kernels::cpu {

namespace {
// f(run) summed over channel c's N runs of L values, where run is an Eigen array of doubles.
template <typename F>
double channel_sum(const float* in, int64_t N, int64_t C, int64_t L, int64_t c, F f) {
  double total = 0.0;
  for (int64_t n = 0; n < N; ++n) total += f(vec(in + (n * C + c) * L, L).cast<double>().array());
  return total;
}
}  // namespace

void batch_norm_stats(float* mean, float* var, const float* in, int64_t N, int64_t C, int64_t L) {
  const double count = static_cast<double>(N * L);
  for (int64_t c = 0; c < C; ++c) {
    const double m = channel_sum(in, N, C, L, c, [](const auto& x) { return x.sum(); }) / count;
    const double v = channel_sum(in, N, C, L, c, [m](const auto& x) { return (x - m).square().sum(); }) / count;
    mean[c] = static_cast<float>(m);
    var[c] = static_cast<float>(v);
  }
}

void batch_norm_sums(float* sums, const float* in, int64_t N, int64_t C, int64_t L) {
  for (int64_t c = 0; c < C; ++c) {
    sums[c] = static_cast<float>(channel_sum(in, N, C, L, c, [](const auto& x) { return x.sum(); }));
    sums[C + c] = static_cast<float>(channel_sum(in, N, C, L, c, [](const auto& x) { return x.square().sum(); }));
  }
  sums[2 * C] = static_cast<float>(N * L);
}

void batch_norm_stats_from_sums(float* mean, float* var, const float* sums, int64_t C, double count) {
  for (int64_t c = 0; c < C; ++c) {
    const double m = sums[c] / count;
    const double v = sums[C + c] / count - m * m;
    mean[c] = static_cast<float>(m);
    var[c] = static_cast<float>(std::isnan(v) ? v : std::max(v, 0.0));  // rounding can dip below 0
  }
}

void batch_norm_invstd(float* invstd, const float* var, int64_t C, float eps) {
  for (int64_t c = 0; c < C; ++c) invstd[c] = static_cast<float>(1.0 / std::sqrt(double(var[c]) + eps));
}

void batch_norm_update_running(float* running_mean, float* running_var, const float* mean, const float* var,
                               int64_t C, float momentum, double unbiased_scale) {
  for (int64_t c = 0; c < C; ++c) {
    running_mean[c] = static_cast<float>((1.0 - momentum) * running_mean[c] + double(momentum) * mean[c]);
    running_var[c] =
        static_cast<float>((1.0 - momentum) * running_var[c] + double(momentum) * var[c] * unbiased_scale);
  }
}

void batch_norm_forward(float* out, const float* in, const float* mean, const float* invstd, const float* weight,
                        const float* bias, int64_t N, int64_t C, int64_t L) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c) {
      const double scale = double(invstd[c]) * (weight ? weight[c] : 1.0f);
      const double shift = bias ? bias[c] : 0.0f;
      const int64_t at = (n * C + c) * L;
      vec(out + at, L).array() = ((vec(in + at, L).cast<double>().array() - double(mean[c])) * scale + shift).cast<float>();
    }
}

void batch_norm_backward_reduce(float* sums, const float* dout, const float* in, const float* mean,
                                const float* invstd, int64_t N, int64_t C, int64_t L) {
  for (int64_t c = 0; c < C; ++c) {
    double dy_sum = 0.0, dy_xhat_sum = 0.0;
    for (int64_t n = 0; n < N; ++n) {
      const int64_t at = (n * C + c) * L;
      const auto dy = vec(dout + at, L).cast<double>().array();
      dy_sum += dy.sum();
      dy_xhat_sum += (dy * (vec(in + at, L).cast<double>().array() - double(mean[c]))).sum() * double(invstd[c]);
    }
    sums[c] = static_cast<float>(dy_sum);
    sums[C + c] = static_cast<float>(dy_xhat_sum);
  }
}

void batch_norm_backward(float* din, float* dweight, float* dbias, const float* dout, const float* in,
                         const float* mean, const float* invstd, const float* weight, const float* local_sums,
                         const float* total_sums, double count, int64_t N, int64_t C, int64_t L) {
  for (int64_t c = 0; c < C; ++c) {
    if (dweight != nullptr) dweight[c] = local_sums[C + c];
    if (dbias != nullptr) dbias[c] = local_sums[c];
  }
  if (din == nullptr) return;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c) {
      const double s = invstd[c], g = s * (weight ? weight[c] : 1.0f);
      const double dy_mean = count > 0 ? total_sums[c] / count : 0.0;
      const double dy_xhat_mean = count > 0 ? total_sums[C + c] / count : 0.0;
      const int64_t at = (n * C + c) * L;
      const auto xhat = (vec(in + at, L).cast<double>().array() - double(mean[c])) * s;
      vec(din + at, L).array() =
          (g * (vec(dout + at, L).cast<double>().array() - dy_mean - xhat * dy_xhat_mean)).cast<float>();
    }
}

}  // namespace nanoddp::kernels::cpu
