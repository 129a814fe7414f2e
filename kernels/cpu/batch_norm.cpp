// CPU kernels of BatchNorm (declared in nn/batch_norm.cpp). Each sample is a [C, L] block
// (row c: channel c's L values); per-channel sums add the blocks' row sums in double, in a
// fixed order, so the result does not depend on timing. Row sums of L > 1 values run in lanes
// (kernels/cpu/double_sums.h); for L == 1 (BatchNorm1d on [N, C], the common case) a block is
// one value per channel, and every loop runs across the channels instead, so that the
// compiler vectorises it.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/double_sums.h"

namespace nanoddp::kernels::cpu {

namespace {
using Doubles = std::vector<double>;

// acc[c] += sum over l in [0, L) of value(c, c * L + l), value returning double.
template <class Value>
void add_row_sums(double* acc, int64_t C, int64_t L, Value value) {
  if (L == 1) {
    for (int64_t c = 0; c < C; ++c) acc[c] += value(c, c);
    return;
  }
  for (int64_t c = 0; c < C; ++c) acc[c] += lane_sum(L, [&](int64_t l) { return value(c, c * L + l); });
}

// f(c, c * L + l) for every value of a [C, L] block.
template <class F>
void for_each_value(int64_t C, int64_t L, F f) {
  if (L == 1) {
    for (int64_t c = 0; c < C; ++c) f(c, c);
    return;
  }
  for (int64_t c = 0; c < C; ++c)
    for (int64_t l = 0; l < L; ++l) f(c, c * L + l);
}

Doubles doubles(const float* p, int64_t C) { return Doubles(p, p + C); }
Doubles doubles_or(const float* p, int64_t C, double otherwise) { return p ? doubles(p, C) : Doubles(C, otherwise); }
}  // namespace

void batch_norm_stats(float* mean, float* var, const float* in, int64_t N, int64_t C, int64_t L) {
  const double count = static_cast<double>(N * L);
  Doubles sum(C, 0.0), squares(C, 0.0);
  for (int64_t n = 0; n < N; ++n) {
    const float* x = in + n * C * L;
    add_row_sums(sum.data(), C, L, [x](int64_t, int64_t i) { return double(x[i]); });
  }
  Doubles m(C);
  for (int64_t c = 0; c < C; ++c) m[c] = sum[c] / count;
  for (int64_t n = 0; n < N; ++n) {
    const float* x = in + n * C * L;
    const double* mp = m.data();
    add_row_sums(squares.data(), C, L, [x, mp](int64_t c, int64_t i) {
      const double centered = double(x[i]) - mp[c];
      return centered * centered;
    });
  }
  for (int64_t c = 0; c < C; ++c) {
    mean[c] = static_cast<float>(m[c]);
    var[c] = static_cast<float>(squares[c] / count);
  }
}

void batch_norm_invstd(float* invstd, const float* var, int64_t C, float eps, bool zero_for_no_spread) {
  for (int64_t c = 0; c < C; ++c)
    invstd[c] = zero_for_no_spread && var[c] == 0.0f && eps == 0.0f
                    ? 0.0f
                    : static_cast<float>(1.0 / std::sqrt(double(var[c]) + eps));
}

void batch_norm_update_running(float* running_mean, float* running_var, const float* mean, const float* var,
                               int64_t C, float momentum, double unbiased_scale) {
  for (int64_t c = 0; c < C; ++c) {
    running_mean[c] = static_cast<float>((1.0 - momentum) * running_mean[c] + double(momentum) * mean[c]);
    running_var[c] =
        static_cast<float>((1.0 - momentum) * running_var[c] + double(momentum) * var[c] * unbiased_scale);
  }
}

void batch_norm_count_batch(int64_t* count) { ++*count; }

void batch_norm_forward(float* out, const float* in, const float* mean, const float* invstd, const float* weight,
                        const float* bias, int64_t N, int64_t C, int64_t L) {
  const Doubles m = doubles(mean, C), shift = doubles_or(bias, C, 0.0);
  Doubles scale = doubles_or(weight, C, 1.0);
  for (int64_t c = 0; c < C; ++c) scale[c] *= double(invstd[c]);
  const double *mp = m.data(), *scalep = scale.data(), *shiftp = shift.data();
  for (int64_t n = 0; n < N; ++n) {
    const float* x = in + n * C * L;
    float* y = out + n * C * L;
    for_each_value(C, L, [=](int64_t c, int64_t i) {
      y[i] = static_cast<float>((double(x[i]) - mp[c]) * scalep[c] + shiftp[c]);
    });
  }
}

void batch_norm_backward_reduce(float* sums, const float* dout, const float* in, const float* mean,
                                const float* invstd, int64_t N, int64_t C, int64_t L) {
  const Doubles m = doubles(mean, C);
  const double* mp = m.data();
  Doubles dy_sum(C, 0.0), dy_centered_sum(C, 0.0);
  for (int64_t n = 0; n < N; ++n) {
    const float* dy = dout + n * C * L;
    const float* x = in + n * C * L;
    add_row_sums(dy_sum.data(), C, L, [dy](int64_t, int64_t i) { return double(dy[i]); });
    add_row_sums(dy_centered_sum.data(), C, L,
                 [dy, x, mp](int64_t c, int64_t i) { return double(dy[i]) * (double(x[i]) - mp[c]); });
  }
  for (int64_t c = 0; c < C; ++c) {
    sums[c] = static_cast<float>(dy_sum[c]);
    sums[C + c] = static_cast<float>(dy_centered_sum[c] * double(invstd[c]));
  }
}

void batch_norm_backward(float* din, float* dweight, float* dbias, const float* dout, const float* in,
                         const float* mean, const float* invstd, const float* weight, const float* local_sums,
                         const float* total_sums, double count, int64_t N, int64_t C, int64_t L) {
  if (dweight != nullptr) std::copy(local_sums + C, local_sums + 2 * C, dweight);
  if (dbias != nullptr) std::copy(local_sums, local_sums + C, dbias);
  if (din == nullptr) return;
  const Doubles m = doubles(mean, C), s = doubles(invstd, C);
  Doubles g = doubles_or(weight, C, 1.0), dy_mean(C, 0.0), dy_xhat_mean(C, 0.0);
  for (int64_t c = 0; c < C; ++c) {
    g[c] *= s[c];
    if (count > 0) {
      dy_mean[c] = double(total_sums[c]) / count;
      dy_xhat_mean[c] = double(total_sums[C + c]) / count;
    }
  }
  const double *mp = m.data(), *sp = s.data(), *gp = g.data(), *dy_meanp = dy_mean.data(),
               *dy_xhat_meanp = dy_xhat_mean.data();
  for (int64_t n = 0; n < N; ++n) {
    const float* dy = dout + n * C * L;
    float* dx = din + n * C * L;
    if (count == 0) {  // constant statistics: no x term, so a NaN or inf input keeps a finite gradient
      for_each_value(C, L, [=](int64_t c, int64_t i) { dx[i] = static_cast<float>(double(dy[i]) * gp[c]); });
      continue;
    }
    const float* x = in + n * C * L;
    for_each_value(C, L, [=](int64_t c, int64_t i) {
      const double xhat = (double(x[i]) - mp[c]) * sp[c];
      dx[i] = static_cast<float>(((double(dy[i]) - dy_meanp[c]) - xhat * dy_xhat_meanp[c]) * gp[c]);
    });
  }
}

}  // namespace nanoddp::kernels::cpu
