// CPU kernels of BatchNorm (declared in nn/batch_norm.cpp). Each sample is a [C, L] block
// (row c: channel c's L values); per-channel sums add the blocks' row sums in double, in a
// fixed order, so the result does not depend on timing.
#include <algorithm>
#include <cmath>

#include "kernels/cpu/eigen_maps.h"

namespace nanoddp::kernels::cpu {

namespace {
using Doubles = Eigen::ArrayXd;
// Sample n's [C, L] values as a C x L array of doubles: row c holds channel c's L values.
auto sample(const float* in, int64_t n, int64_t C, int64_t L) { return mat(in + n * C * L, C, L).cast<double>().array(); }
Doubles doubles(const float* p, int64_t C) { return vec(p, C).cast<double>().array(); }
}  // namespace

void batch_norm_stats(float* mean, float* var, const float* in, int64_t N, int64_t C, int64_t L) {
  const double count = static_cast<double>(N * L);
  Doubles sum = Doubles::Zero(C), squares = Doubles::Zero(C);
  for (int64_t n = 0; n < N; ++n) sum += sample(in, n, C, L).rowwise().sum();
  const Doubles m = sum / count;
  for (int64_t n = 0; n < N; ++n) squares += (sample(in, n, C, L).colwise() - m).square().rowwise().sum();
  vec(mean, C).array() = m.cast<float>();
  vec(var, C).array() = (squares / count).cast<float>();
}

void batch_norm_sums(float* sums, const float* in, int64_t N, int64_t C, int64_t L) {
  Doubles sum = Doubles::Zero(C), squares = Doubles::Zero(C);
  for (int64_t n = 0; n < N; ++n) {
    sum += sample(in, n, C, L).rowwise().sum();
    squares += sample(in, n, C, L).square().rowwise().sum();
  }
  vec(sums, C).array() = sum.cast<float>();
  vec(sums + C, C).array() = squares.cast<float>();
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
  const Doubles m = doubles(mean, C);
  const Doubles scale = doubles(invstd, C) * (weight ? doubles(weight, C) : Doubles::Ones(C));
  const Doubles shift = bias ? doubles(bias, C) : Doubles::Zero(C);
  for (int64_t n = 0; n < N; ++n)
    mat(out + n * C * L, C, L).array() =
        (((sample(in, n, C, L).colwise() - m).colwise() * scale).colwise() + shift).cast<float>();
}

void batch_norm_backward_reduce(float* sums, const float* dout, const float* in, const float* mean,
                                const float* invstd, int64_t N, int64_t C, int64_t L) {
  const Doubles m = doubles(mean, C);
  Doubles dy_sum = Doubles::Zero(C), dy_centered_sum = Doubles::Zero(C);
  for (int64_t n = 0; n < N; ++n) {
    const auto dy = sample(dout, n, C, L);
    dy_sum += dy.rowwise().sum();
    dy_centered_sum += (dy * (sample(in, n, C, L).colwise() - m)).rowwise().sum();
  }
  vec(sums, C).array() = dy_sum.cast<float>();
  vec(sums + C, C).array() = (dy_centered_sum * doubles(invstd, C)).cast<float>();
}

void batch_norm_backward(float* din, float* dweight, float* dbias, const float* dout, const float* in,
                         const float* mean, const float* invstd, const float* weight, const float* local_sums,
                         const float* total_sums, double count, int64_t N, int64_t C, int64_t L) {
  if (dweight != nullptr) vec(dweight, C) = vec(local_sums + C, C);
  if (dbias != nullptr) vec(dbias, C) = vec(local_sums, C);
  if (din == nullptr) return;
  const Doubles m = doubles(mean, C), s = doubles(invstd, C);
  const Doubles g = s * (weight ? doubles(weight, C) : Doubles::Ones(C));
  const Doubles dy_mean = count > 0 ? (doubles(total_sums, C) / count).eval() : Doubles::Zero(C);
  const Doubles dy_xhat_mean = count > 0 ? (doubles(total_sums + C, C) / count).eval() : Doubles::Zero(C);
  for (int64_t n = 0; n < N; ++n) {
    const auto xhat = (sample(in, n, C, L).colwise() - m).colwise() * s;
    mat(din + n * C * L, C, L).array() =
        (((sample(dout, n, C, L).colwise() - dy_mean) - xhat.colwise() * dy_xhat_mean).colwise() * g).cast<float>();
  }
}

}  // namespace nanoddp::kernels::cpu
