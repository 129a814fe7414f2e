// CPU loss kernels: mse, cross-entropy with a stable log-softmax, that log-softmax alone, and
// the negative log-likelihood of its output.
// The CUDA kernels round every product before adding it (kernels/cuda/losses.cu), and the GPU
// tests compare the two: keep GCC from fusing a * b + c into one FMA here (-ffp-contract=fast is
// its C++ default, and -march=native builds have FMA).
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif
#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"
#include "kernels/kernels.h"

namespace nanoddp::kernels::cpu {

void mse_forward(float* out, const float* input, const float* target, int64_t n, Reduction reduction) {
  if (reduction == Reduction::None) {
    for (int64_t i = 0; i < n; ++i) {
      const float d = input[i] - target[i];
      out[i] = d * d;
    }
    return;
  }
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(input[i]) - static_cast<double>(target[i]);
    total += d * d;
  }
  out[0] = static_cast<float>(reduction == Reduction::Mean ? total / static_cast<double>(n) : total);
}

void mse_backward(float* dinput, const float* dout, const float* input, const float* target, int64_t n,
                  Reduction reduction) {
  if (reduction == Reduction::None) {
    for (int64_t i = 0; i < n; ++i) dinput[i] = 2.0f * (input[i] - target[i]) * dout[i];
    return;
  }
  const float scale = reduction == Reduction::Mean ? 2.0f * dout[0] / static_cast<float>(n) : 2.0f * dout[0];
  for (int64_t i = 0; i < n; ++i) dinput[i] = scale * (input[i] - target[i]);
}

namespace {

// Class c's weight; without a weight every class weighs 1, and the arithmetic is the
// unweighted one exactly.
float weight_of(const float* weight, int64_t c) { return weight != nullptr ? weight[c] : 1.0f; }

// The Mean's divisor of cross_entropy and nll_loss: the counted rows' target weights (their
// number without a weight), summed in double.
double counted_weight(const int64_t* target, const float* weight, int64_t N, int64_t ignore_index) {
  double counted = 0.0;
  for (int64_t r = 0; r < N; ++r)
    if (target[r] != ignore_index) counted += weight_of(weight, target[r]);
  return counted;
}

// A row's max and log(sum exp(x - max)), the stable log-softmax's parts: log_softmax(x)_c =
// x_c - max - log_sum_exp, every exponent <= 0. A NaN is the max (the row comes out NaN); with
// no column the max is 0 and nothing is read.
struct RowLogSumExp {
  float max;
  double log_sum_exp;
};
RowLogSumExp row_log_sum_exp(const float* x, int64_t C) {
  float max = C > 0 ? x[0] : 0.0f;
  for (int64_t c = 1; c < C; ++c) max = std::isnan(x[c]) || x[c] > max ? x[c] : max;
  double sum_exp = 0.0;
  for (int64_t c = 0; c < C; ++c) sum_exp += std::exp(static_cast<double>(x[c]) - max);
  return {max, std::log(sum_exp)};
}

void check_target(const char* op, const int64_t* target, int64_t r, int64_t C, int64_t ignore_index) {
  const int64_t t = target[r];
  NANODDP_CHECK(t == ignore_index || (t >= 0 && t < C), IndexError, op, ": target[", r, "] = ", t,
                " is not a class in [0, ", C, ") nor ignore_index ", ignore_index);
}

}  // namespace

void cross_entropy_forward(float* out, float* probs, const float* logits, const int64_t* target,
                           const float* weight, int64_t N, int64_t C, int64_t ignore_index,
                           float label_smoothing, Reduction reduction) {
  const double smoothing = label_smoothing;
  double total = 0.0, counted = 0.0;
  for (int64_t r = 0; r < N; ++r) {
    const float* x = logits + r * C;
    float* p = probs + r * C;
    const int64_t t = target[r];
    const bool ignored = t == ignore_index;
    check_target("cross_entropy", target, r, C, ignore_index);
    // With no class (C == 0) every row passed the check as ignored, and there is nothing to read.
    const auto [max, log_sum_exp] = row_log_sum_exp(x, C);
    for (int64_t c = 0; c < C; ++c) p[c] = static_cast<float>(std::exp(static_cast<double>(x[c]) - max - log_sum_exp));
    double loss = 0.0;
    if (!ignored) {
      loss = static_cast<double>(weight_of(weight, t)) * -(static_cast<double>(x[t]) - max - log_sum_exp);
      if (smoothing > 0.0) {
        double weighted_minus_log_p = 0.0;
        for (int64_t c = 0; c < C; ++c)
          weighted_minus_log_p -=
              static_cast<double>(weight_of(weight, c)) * (static_cast<double>(x[c]) - max - log_sum_exp);
        loss = (1.0 - smoothing) * loss + smoothing / static_cast<double>(C) * weighted_minus_log_p;
      }
      counted += weight_of(weight, t);
    }
    if (reduction == Reduction::None) {
      out[r] = static_cast<float>(loss);
    } else {
      total += loss;
    }
  }
  // Smoothed, over counted weights that sum to 0: NaN, torch's 0 / 0 of the unsmoothed part
  // (the smoothed part alone would give inf). Otherwise the quotient, NaN when none counted.
  if (reduction == Reduction::Mean)
    out[0] = smoothing > 0.0 && counted == 0.0 ? NAN : static_cast<float>(total / counted);
  if (reduction == Reduction::Sum) out[0] = static_cast<float>(total);
}

void cross_entropy_backward(float* dlogits, const float* dout, const float* probs, const int64_t* target,
                            const float* weight, int64_t N, int64_t C, int64_t ignore_index,
                            float label_smoothing, Reduction reduction) {
  double weight_total = 0.0;
  for (int64_t c = 0; c < C; ++c) weight_total += weight_of(weight, c);
  const auto rows = static_cast<float>(counted_weight(target, weight, N, ignore_index));
  const float share = C > 0 ? label_smoothing / static_cast<float>(C) : 0.0f;
  for (int64_t r = 0; r < N; ++r) {
    float* d = dlogits + r * C;
    const float* p = probs + r * C;
    const int64_t t = target[r];
    if (t == ignore_index) {  // 0, but NaN where the row's softmax is (torch's log_softmax backward)
      for (int64_t c = 0; c < C; ++c) d[c] = 0.0f - p[c] * 0.0f;
      continue;
    }
    const float scale = reduction == Reduction::None   ? dout[r]
                        : reduction == Reduction::Mean ? dout[0] / rows
                                                       : dout[0];
    const float g = scale * weight_of(weight, t);  // the target's term
    if (reduction == Reduction::Mean && label_smoothing > 0.0f && rows == 0.0f) {  // as the forward's NaN
      for (int64_t c = 0; c < C; ++c) d[c] = NAN;
    } else if (label_smoothing > 0.0f) {
      // (1 - s) w_t (p - onehot) + s / C (W p - w), W the sum of the weights.
      const float p_coefficient =
          (1.0f - label_smoothing) * weight_of(weight, t) + share * static_cast<float>(weight_total);
      for (int64_t c = 0; c < C; ++c) d[c] = scale * (p_coefficient * p[c] - share * weight_of(weight, c));
      d[t] -= g * (1.0f - label_smoothing);
    } else {
      for (int64_t c = 0; c < C; ++c) d[c] = g * p[c];
      d[t] -= g;
    }
  }
}

void log_softmax_forward(float* out, const float* in, int64_t N, int64_t C) {
  for (int64_t r = 0; r < N; ++r) {
    const float* x = in + r * C;
    float* y = out + r * C;
    const auto [max, log_sum_exp] = row_log_sum_exp(x, C);
    for (int64_t c = 0; c < C; ++c) y[c] = static_cast<float>(static_cast<double>(x[c]) - max - log_sum_exp);
  }
}

void log_softmax_backward(float* din, const float* dout, const float* out, int64_t N, int64_t C) {
  for (int64_t r = 0; r < N; ++r) {
    const float* dy = dout + r * C;
    const float* y = out + r * C;
    double sum = 0.0;
    for (int64_t c = 0; c < C; ++c) sum += dy[c];
    for (int64_t c = 0; c < C; ++c)
      din[r * C + c] = static_cast<float>(dy[c] - std::exp(static_cast<double>(y[c])) * sum);
  }
}

void nll_loss_forward(float* out, const float* log_probs, const int64_t* target, const float* weight,
                      int64_t N, int64_t C, int64_t ignore_index, Reduction reduction) {
  double total = 0.0;
  for (int64_t r = 0; r < N; ++r) {
    check_target("nll_loss", target, r, C, ignore_index);
    const int64_t t = target[r];
    const double loss =
        t == ignore_index ? 0.0 : -static_cast<double>(weight_of(weight, t)) * log_probs[r * C + t];
    if (reduction == Reduction::None) {
      out[r] = static_cast<float>(loss);
    } else {
      total += loss;
    }
  }
  if (reduction == Reduction::Mean)
    out[0] =
        static_cast<float>(total / counted_weight(target, weight, N, ignore_index));  // none counted: NaN
  if (reduction == Reduction::Sum) out[0] = static_cast<float>(total);
}

void nll_loss_backward(float* din, const float* dout, const int64_t* target, const float* weight, int64_t N,
                       int64_t C, int64_t ignore_index, Reduction reduction) {
  const auto counted = reduction == Reduction::Mean
                           ? static_cast<float>(counted_weight(target, weight, N, ignore_index))
                           : 1.0f;
  std::fill(din, din + N * C, 0.0f);
  for (int64_t r = 0; r < N; ++r) {
    const int64_t t = target[r];
    if (t == ignore_index) continue;
    const float g = reduction == Reduction::None ? dout[r] : dout[0] / counted;
    din[r * C + t] = -(weight_of(weight, t) * g);
  }
}

}  // namespace nanoddp::kernels::cpu
