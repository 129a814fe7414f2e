// Loss CUDA kernels: mean squared error, cross-entropy with a fused, stable log-softmax, that
// log-softmax alone, and the negative log-likelihood of its output.
// Reductions to one value go through deterministic_sum (Note [Deterministic reduction]).

#include <cmath>

#include "kernels/cuda/launch.cuh"
#include "kernels/kernels.h"

namespace nanoddp::kernels::cuda {
namespace {

struct SquaredDiff {
  const float* input;
  const float* target;
  __device__ float operator()(int64_t i) const {
    const float d = input[i] - target[i];
    return d * d;
  }
};

struct LoadValue {
  const float* in;
  __device__ float operator()(int64_t i) const { return in[i]; }
};

// Class c's weight, 1 without a weight (the unweighted arithmetic exactly).
__device__ __forceinline__ float weight_of(const float* weight, int64_t c) {
  return weight != nullptr ? weight[c] : 1.0f;
}

// What a row adds to cross_entropy's Mean divisor: 0 when its target is ignore_index, else its
// target's weight (1 without a weight). A target outside [0, C) adds NaN, weighted or not: its
// loss is NaN, and so the Mean and every counted row's gradient.
struct CountedRow {
  const int64_t* target;
  const float* weight;
  int64_t C;
  int64_t ignore_index;
  __device__ float operator()(int64_t i) const {
    const int64_t t = target[i];
    if (t == ignore_index) return 0.0f;
    if (t < 0 || t >= C) return NAN;
    return weight_of(weight, t);
  }
};

// out[0] = the sum of row_loss (Sum), or that sum over the counted rows' weight (Mean): both
// summed on the device (the divisor a float: exact up to 2^24 rows without a weight), so the
// host never waits for the targets. smoothed: a Mean over counted weights that sum to 0 is NaN
// (torch's 0 / 0 of the unsmoothed part; the smoothed part alone would be inf).
void reduce_row_losses(float* out, const float* row_loss, const CountedRow& counted_row, int64_t N,
                       Reduction reduction, bool smoothed) {
  ScratchBuffer<float> counted(1);
  if (reduction == Reduction::Mean) deterministic_sum(counted.data(), counted_row, N, 1.0);
  deterministic_sum(out, LoadValue{row_loss}, N, 1.0, reduction == Reduction::Mean ? counted.data() : nullptr,
                    smoothed);
}

}  // namespace

// ---- mse -------------------------------------------------------------------------------------

// Reduction::None: out[i] = (input[i] - target[i])^2.
__global__ void mse_forward_kernel(float* out, const float* input, const float* target, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    const float d = input[i] - target[i];
    out[i] = d * d;
  }
}

void mse_forward(float* out, const float* input, const float* target, int64_t n, Reduction reduction) {
  if (reduction == Reduction::None) {
    if (n <= 0) return;
    mse_forward_kernel<<<grid_for(n), kBlock, 0, stream()>>>(out, input, target, n);
    NANODDP_CUDA_CHECK_LAUNCH("mse_forward_kernel");
    return;
  }
  const double divisor = reduction == Reduction::Mean ? static_cast<double>(n) : 1.0;
  deterministic_sum(out, SquaredDiff{input, target}, n, divisor);
}

// None: dinput[i] = 2 (input[i] - target[i]) dout[i]. Mean, Sum: dinput[i] = s (input[i] -
// target[i]) with s = 2 dout[0] / divisor (n or 1): the CPU kernel's order of operations.
__global__ void mse_backward_kernel(float* dinput, const float* dout, const float* input, const float* target,
                                    int64_t n, float divisor, bool per_element) {
  const float scale = per_element ? 0.0f : 2.0f * dout[0] / divisor;
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    const float d = input[i] - target[i];
    dinput[i] = per_element ? 2.0f * d * dout[i] : scale * d;
  }
}

void mse_backward(float* dinput, const float* dout, const float* input, const float* target, int64_t n,
                  Reduction reduction) {
  if (n <= 0) return;
  const float divisor = reduction == Reduction::Mean ? static_cast<float>(n) : 1.0f;
  mse_backward_kernel<<<grid_for(n), kBlock, 0, stream()>>>(dinput, dout, input, target, n, divisor,
                                                            reduction == Reduction::None);
  NANODDP_CUDA_CHECK_LAUNCH("mse_backward_kernel");
}

// ---- cross-entropy -----------------------------------------------------------------------------

constexpr int kRowsPerBlock = kBlock / 32;  // one warp per row

__device__ __forceinline__ float warp_max(float value) {
  for (int offset = 16; offset > 0; offset /= 2) value = fmaxf(value, __shfl_xor_sync(kFullMask, value, offset));
  return value;
}

__device__ __forceinline__ float warp_all_sum(float value) {
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(kFullMask, value, offset);
  return value;
}

__device__ __forceinline__ double warp_all_sum(double value) {
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(kFullMask, value, offset);
  return value;
}

// A row of C values read by the 32 lanes of one warp: its max and sum exp(x - max), the
// stable log-softmax's parts. Butterfly reductions: every lane ends with the same bits, which
// all of them use.
struct RowExpSum {
  float max;
  float exp_sum;
};
__device__ __forceinline__ RowExpSum warp_row_exp_sum(const float* x, int64_t C, int lane) {
  float row_max = -INFINITY;
  for (int64_t c = lane; c < C; c += 32) row_max = fmaxf(row_max, x[c]);
  row_max = warp_max(row_max);
  float exp_sum = 0.0f;
  for (int64_t c = lane; c < C; c += 32) exp_sum += expf(x[c] - row_max);
  return {row_max, warp_all_sum(exp_sum)};
}

// logits: [N, C], target: [N] -> probs: [N, C] = softmax(logits), row_loss: [N] =
// -w[t] log_softmax(logits)[t] = w[t] (log(sum exp(x - max)) - (x[t] - max)), and with label
// smoothing s: (1 - s) times that + s / C * sum_c -w[c] log_softmax(logits)[c]; w = 1 without a
// weight. One warp per row;
// the max subtraction keeps exp finite for any finite logits. A row whose target is
// ignore_index gets 0; another target outside [0, C) gives NaN and is never read from.
__global__ void cross_entropy_forward_kernel(float* row_loss, float* probs, const float* logits,
                                             const int64_t* target, const float* weight, int64_t N, int64_t C,
                                             int64_t ignore_index, float label_smoothing) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= N) return;  // whole warps leave together
  const float* x = logits + row * C;
  float* p = probs + row * C;
  const auto [row_max, exp_sum] = warp_row_exp_sum(x, C, lane);

  for (int64_t c = lane; c < C; c += 32) p[c] = expf(x[c] - row_max) / exp_sum;

  const float log_sum_exp = logf(exp_sum);
  // In double, as the CPU: a sum over every class (tens of thousands for a vocabulary).
  double sum_of_minus_log_p = 0.0;
  if (label_smoothing > 0.0f) {
    for (int64_t c = lane; c < C; c += 32)
      sum_of_minus_log_p += static_cast<double>(weight_of(weight, c)) * (log_sum_exp - (x[c] - row_max));
    sum_of_minus_log_p = warp_all_sum(sum_of_minus_log_p);
  }
  if (lane == 0) {
    const int64_t t = target[row];
    const bool valid = t >= 0 && t < C;
    const float w_t = valid ? weight_of(weight, t) : 1.0f;
    float loss = t == ignore_index ? 0.0f : valid ? w_t * (log_sum_exp - (x[t] - row_max)) : NAN;
    if (label_smoothing > 0.0f && t != ignore_index)
      loss = static_cast<float>((1.0 - label_smoothing) * loss +
                                label_smoothing / static_cast<double>(C) * sum_of_minus_log_p);
    row_loss[row] = loss;
  }
}

void cross_entropy_forward(float* out, float* probs, const float* logits, const int64_t* target,
                           const float* weight, int64_t N, int64_t C, int64_t ignore_index,
                           float label_smoothing, Reduction reduction) {
  const int64_t blocks = (N + kRowsPerBlock - 1) / kRowsPerBlock;
  NANODDP_CHECK(blocks <= 0x7fffffff, ValueError, "cross_entropy: ", N,
                " rows is more than one launch takes");
  if (reduction == Reduction::None) {
    if (N <= 0) return;
    cross_entropy_forward_kernel<<<static_cast<unsigned>(blocks), kBlock, 0, stream()>>>(
        out, probs, logits, target, weight, N, C, ignore_index, label_smoothing);
    NANODDP_CUDA_CHECK_LAUNCH("cross_entropy_forward_kernel");
    return;
  }
  ScratchBuffer<float> row_loss(N > 0 ? static_cast<size_t>(N) : 1);
  if (N > 0) {
    cross_entropy_forward_kernel<<<static_cast<unsigned>(blocks), kBlock, 0, stream()>>>(
        row_loss.data(), probs, logits, target, weight, N, C, ignore_index, label_smoothing);
    NANODDP_CUDA_CHECK_LAUNCH("cross_entropy_forward_kernel");
  }
  reduce_row_losses(out, row_loss.data(), CountedRow{target, weight, C, ignore_index}, N, reduction,
                    label_smoothing > 0.0f);
}

// dlogits[r, c] = h_r probs[r, c] - h_r [c == t], with h_r = g_r w[t] (w = 1 without a weight),
// t = target[r], g_r = dout[0] / counted[0] (Mean), dout[0] (Sum) or dout[r] (None); with label
// smoothing s, g_r (((1 - s) w[t] + s / C W) probs[r, c] - s / C w[c]) - h_r (1 - s) [c == t],
// W = weight_total[0] (C without a weight): the CPU kernel's order of operations. WRITES. Rows with target
// ignore_index, or outside [0, C), get 0 - probs * 0: zeros, NaN where probs is (torch's log_softmax backward
// of a zero gradient).
__global__ void cross_entropy_backward_kernel(float* dlogits, const float* dout, const float* probs,
                                              const float* counted, const int64_t* target,
                                              const float* weight, const float* weight_total, int64_t N,
                                              int64_t C, int64_t ignore_index, float label_smoothing,
                                              bool mean, bool per_row) {
  const int64_t n = N * C;
  const float shared_grad = per_row ? 0.0f : mean ? dout[0] / counted[0] : dout[0];
  const float share = label_smoothing / static_cast<float>(C);
  const float total = weight_total != nullptr ? weight_total[0] : static_cast<float>(C);
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    const int64_t row = i / C;
    const int64_t c = i - row * C;
    const int64_t t = target[row];
    const bool counts = t != ignore_index && t >= 0 && t < C;
    const float g = per_row ? dout[row] : shared_grad;
    const float w_t = counts ? weight_of(weight, t) : 1.0f;
    const float h = __fmul_rn(g, w_t);  // no fma: round each product first, as the CPU
    float value;
    if (label_smoothing > 0.0f) {
      const float w_c = weight_of(weight, c);
      const float p_coefficient = __fadd_rn(__fmul_rn(1.0f - label_smoothing, w_t), __fmul_rn(share, total));
      value = __fmul_rn(g, __fsub_rn(__fmul_rn(p_coefficient, probs[i]), __fmul_rn(share, w_c)));
      if (c == t) value = __fsub_rn(value, __fmul_rn(h, 1.0f - label_smoothing));
    } else {
      const float scaled = __fmul_rn(h, probs[i]);
      value = c == t ? scaled - h : scaled;
    }
    if (mean && label_smoothing > 0.0f && counted[0] == 0.0f) value = NAN;  // as the forward's NaN
    dlogits[i] = counts ? value : 0.0f - __fmul_rn(probs[i], 0.0f);
  }
}

void cross_entropy_backward(float* dlogits, const float* dout, const float* probs, const int64_t* target,
                            const float* weight, int64_t N, int64_t C, int64_t ignore_index,
                            float label_smoothing, Reduction reduction) {
  const int64_t n = N * C;
  if (n <= 0) return;
  ScratchBuffer<float> counted(1), weight_total(1);
  if (reduction == Reduction::Mean)
    deterministic_sum(counted.data(), CountedRow{target, weight, C, ignore_index}, N, 1.0);
  if (weight != nullptr && label_smoothing > 0.0f)
    deterministic_sum(weight_total.data(), LoadValue{weight}, C, 1.0);
  cross_entropy_backward_kernel<<<grid_for(n), kBlock, 0, stream()>>>(
      dlogits, dout, probs, counted.data(), target, weight,
      weight != nullptr && label_smoothing > 0.0f ? weight_total.data() : nullptr, N, C, ignore_index,
      label_smoothing, reduction == Reduction::Mean, reduction == Reduction::None);
  NANODDP_CUDA_CHECK_LAUNCH("cross_entropy_backward_kernel");
}

// ---- log_softmax ---------------------------------------------------------------------------

// out[r, c] = x[r, c] - max_r - log(sum exp(x[r] - max_r)). One warp per row, as cross_entropy.
__global__ void log_softmax_forward_kernel(float* out, const float* in, int64_t N, int64_t C) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= N) return;  // whole warps leave together
  const float* x = in + row * C;
  const auto [row_max, exp_sum] = warp_row_exp_sum(x, C, lane);
  const float log_sum_exp = logf(exp_sum);
  for (int64_t c = lane; c < C; c += 32) out[row * C + c] = x[c] - row_max - log_sum_exp;
}

void log_softmax_forward(float* out, const float* in, int64_t N, int64_t C) {
  if (N <= 0 || C <= 0) return;
  const int64_t blocks = (N + kRowsPerBlock - 1) / kRowsPerBlock;
  NANODDP_CHECK(blocks <= 0x7fffffff, ValueError, "log_softmax: ", N, " rows is more than one launch takes");
  log_softmax_forward_kernel<<<static_cast<unsigned>(blocks), kBlock, 0, stream()>>>(out, in, N, C);
  NANODDP_CUDA_CHECK_LAUNCH("log_softmax_forward_kernel");
}

// din[r, c] = dout[r, c] - exp(out[r, c]) * sum_c dout[r, c]. One warp per row.
__global__ void log_softmax_backward_kernel(float* din, const float* dout, const float* out, int64_t N,
                                            int64_t C) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= N) return;
  float sum = 0.0f;
  for (int64_t c = lane; c < C; c += 32) sum += dout[row * C + c];
  sum = warp_all_sum(sum);
  for (int64_t c = lane; c < C; c += 32) {
    const int64_t i = row * C + c;
    din[i] = dout[i] - expf(out[i]) * sum;
  }
}

void log_softmax_backward(float* din, const float* dout, const float* out, int64_t N, int64_t C) {
  if (N <= 0 || C <= 0) return;
  const int64_t blocks = (N + kRowsPerBlock - 1) / kRowsPerBlock;
  NANODDP_CHECK(blocks <= 0x7fffffff, ValueError, "log_softmax: ", N, " rows is more than one launch takes");
  log_softmax_backward_kernel<<<static_cast<unsigned>(blocks), kBlock, 0, stream()>>>(din, dout, out, N, C);
  NANODDP_CUDA_CHECK_LAUNCH("log_softmax_backward_kernel");
}

// ---- nll_loss ------------------------------------------------------------------------------

// row_loss[r] = -w[t] log_probs[r, t], 0 for an ignored row, NaN for a target outside [0, C).
__global__ void nll_loss_rows_kernel(float* row_loss, const float* log_probs, const int64_t* target,
                                     const float* weight, int64_t N, int64_t C, int64_t ignore_index) {
  for (int64_t r = first_index(); r < N; r += grid_stride()) {
    const int64_t t = target[r];
    if (t == ignore_index) {
      row_loss[r] = 0.0f;
    } else if (t >= 0 && t < C) {
      row_loss[r] = -(weight_of(weight, t) * log_probs[r * C + t]);
    } else {
      row_loss[r] = NAN;
    }
  }
}

void nll_loss_forward(float* out, const float* log_probs, const int64_t* target, const float* weight,
                      int64_t N, int64_t C, int64_t ignore_index, Reduction reduction) {
  if (reduction == Reduction::None) {
    if (N <= 0) return;
    nll_loss_rows_kernel<<<grid_for(N), kBlock, 0, stream()>>>(out, log_probs, target, weight, N, C,
                                                               ignore_index);
    NANODDP_CUDA_CHECK_LAUNCH("nll_loss_rows_kernel");
    return;
  }
  ScratchBuffer<float> row_loss(N > 0 ? static_cast<size_t>(N) : 1);
  if (N > 0) {
    nll_loss_rows_kernel<<<grid_for(N), kBlock, 0, stream()>>>(row_loss.data(), log_probs, target, weight, N,
                                                               C, ignore_index);
    NANODDP_CUDA_CHECK_LAUNCH("nll_loss_rows_kernel");
  }
  reduce_row_losses(out, row_loss.data(), CountedRow{target, weight, C, ignore_index}, N, reduction,
                    /*smoothed=*/false);
}

// din[r, c] = -(w[t] g_r) at c == t, else 0; g_r = dout[0] / counted[0] (Mean), dout[0] (Sum) or
// dout[r] (None): the CPU kernel's order of operations.
__global__ void nll_loss_backward_kernel(float* din, const float* dout, const float* counted,
                                         const int64_t* target, const float* weight, int64_t N, int64_t C,
                                         int64_t ignore_index, bool mean, bool per_row) {
  const int64_t n = N * C;
  const float shared_grad = per_row ? 0.0f : mean ? dout[0] / counted[0] : dout[0];
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    const int64_t row = i / C;
    const int64_t t = target[row];
    const bool counts = t != ignore_index && t >= 0 && t < C && i - row * C == t;
    const float g = per_row ? dout[row] : shared_grad;
    din[i] = counts ? -__fmul_rn(weight_of(weight, t), g) : 0.0f;
  }
}

void nll_loss_backward(float* din, const float* dout, const int64_t* target, const float* weight, int64_t N,
                       int64_t C, int64_t ignore_index, Reduction reduction) {
  const int64_t n = N * C;
  if (n <= 0) return;
  ScratchBuffer<float> counted(1);
  if (reduction == Reduction::Mean)
    deterministic_sum(counted.data(), CountedRow{target, weight, C, ignore_index}, N, 1.0);
  nll_loss_backward_kernel<<<grid_for(n), kBlock, 0, stream()>>>(
      din, dout, counted.data(), target, weight, N, C, ignore_index, reduction == Reduction::Mean,
      reduction == Reduction::None);
  NANODDP_CUDA_CHECK_LAUNCH("nll_loss_backward_kernel");
}

}  // namespace nanoddp::kernels::cuda
