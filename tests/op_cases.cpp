// The op table's rows and the float64 references they use (tests/op_cases.h says how the
// three harnesses read them).
#include "tests/op_cases.h"

#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/ops.h"
#include "core/random.h"
#include "kernels/dropout_mask.h"
#include "nn/activations.h"
#include "nn/batch_norm.h"
#include "nn/conv.h"
#include "nn/dropout.h"
#include "nn/layers.h"
#include "nn/normalization.h"

namespace nanoddp::testing {

// batch_norm over x [N, C, L] (L = 1 for [N, C]) as torch computes it: the batch's mean and
// biased variance per channel (two passes), or running_mean/running_var when not empty.
Values ref_batch_norm(const Values& x, const Values& w, const Values& b, int64_t N, int64_t C, int64_t L,
                      const Values& running_mean, const Values& running_var, double eps) {
  Values out(x.size());
  for (int64_t c = 0; c < C; ++c) {
    double mean = 0, var = 0;
    const double count = static_cast<double>(N * L);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t l = 0; l < L; ++l) mean += x[(n * C + c) * L + l] / count;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t l = 0; l < L; ++l) var += (x[(n * C + c) * L + l] - mean) * (x[(n * C + c) * L + l] - mean) / count;
    if (!running_mean.empty()) {
      mean = running_mean[c];
      var = running_var[c];
    }
    for (int64_t n = 0; n < N; ++n)
      for (int64_t l = 0; l < L; ++l) {
        const size_t i = (n * C + c) * L + l;
        out[i] = (x[i] - mean) / std::sqrt(var + eps) * (w.empty() ? 1.0 : w[c]) + (b.empty() ? 0.0 : b[c]);
      }
  }
  return out;
}

namespace {

// Linear(F, 8) -> layer -> Linear(8, 3): a model around a layer that keeps its input's shape.
ModelBuilder mlp_around(std::function<std::shared_ptr<nn::Module>()> layer, int64_t F = 5) {
  return [layer, F](Generator& gen) -> std::shared_ptr<nn::Module> {
    auto model = std::make_shared<nn::Sequential>();
    model->add(nn::Linear(F, 8, gen));
    model->add(layer());
    model->add(nn::Linear(8, 3, gen));
    return model;
  };
}

// f applied to each element (a pointwise op's reference).
template <typename F>
Values pointwise(const Values& in, F f) {
  Values out(in.size());
  for (size_t i = 0; i < in.size(); ++i) out[i] = f(in[i]);
  return out;
}

// ---- float64 references -----------------------------------------------------------------
Values ref_matmul(const Values& a, const Values& b, int64_t M, int64_t K, int64_t N) {
  Values out(M * N, 0.0);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j)
      for (int64_t k = 0; k < K; ++k) out[i * N + j] += a[i * K + k] * b[k * N + j];
  return out;
}

Values ref_linear(const Values& x, const Values& w, const Values& b, int64_t N, int64_t in, int64_t out_f) {
  Values out(N * out_f, 0.0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < out_f; ++o) {
      double acc = b.empty() ? 0.0 : b[o];
      for (int64_t k = 0; k < in; ++k) acc += x[n * in + k] * w[o * in + k];
      out[n * out_f + o] = acc;
    }
  return out;
}

Values ref_binary(const Values& a, const Values& b, char op) {
  Values out(a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    const double y = b[i % b.size()];  // b is a.size() long or one row, repeated
    out[i] = op == '+' ? a[i] + y : op == '-' ? a[i] - y : a[i] * y;
  }
  return out;
}

Values ref_mse(const Values& x, const Values& t, Reduction r) {
  Values out;
  double total = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double d = (x[i] - t[i]) * (x[i] - t[i]);
    out.push_back(d);
    total += d;
  }
  if (r == Reduction::None) return out;
  return {r == Reduction::Mean ? total / x.size() : total};
}

// The class weights of the weighted cross_entropy rows: 0.5, 1, 1.5, ... for C classes.
Values class_weights(int64_t C) {
  Values w;
  for (int64_t c = 0; c < C; ++c) w.push_back(0.5 * static_cast<double>(c + 1));
  return w;
}

Values ref_cross_entropy(const Values& logits, const Values& target, int64_t N, int64_t C, Reduction r,
                         double label_smoothing = 0.0, const Values& weight = {}) {
  const auto w = [&](int64_t c) { return weight.empty() ? 1.0 : weight[c]; };
  Values out;
  double total = 0, counted = 0;
  for (int64_t n = 0; n < N; ++n) {
    double max = logits[n * C];
    for (int64_t c = 1; c < C; ++c) max = std::max(max, logits[n * C + c]);
    double s = 0;
    for (int64_t c = 0; c < C; ++c) s += std::exp(logits[n * C + c] - max);
    const double log_sum_exp = max + std::log(s);
    const auto t = static_cast<int64_t>(target[n]);
    double loss = w(t) * (log_sum_exp - logits[n * C + t]);
    if (label_smoothing > 0) {  // mixed with the mean over classes of -w[c] log p[c]
      double uniform = 0;
      for (int64_t c = 0; c < C; ++c)
        uniform += w(c) * (log_sum_exp - logits[n * C + c]) / static_cast<double>(C);
      loss = (1 - label_smoothing) * loss + label_smoothing * uniform;
    }
    out.push_back(loss);
    total += loss;
    counted += w(t);
  }
  if (r == Reduction::None) return out;
  return {r == Reduction::Mean ? total / counted : total};
}

Values ref_log_softmax(const Values& x, int64_t N, int64_t C) {
  Values out;
  for (int64_t n = 0; n < N; ++n) {
    double max = x[n * C];
    for (int64_t c = 1; c < C; ++c) max = std::max(max, x[n * C + c]);
    double s = 0;
    for (int64_t c = 0; c < C; ++c) s += std::exp(x[n * C + c] - max);
    for (int64_t c = 0; c < C; ++c) out.push_back(x[n * C + c] - max - std::log(s));
  }
  return out;
}

Values ref_nll_loss(const Values& log_probs, const Values& target, int64_t N, int64_t C, Reduction r,
                    const Values& weight = {}) {
  Values out;
  double total = 0, counted = 0;
  for (int64_t n = 0; n < N; ++n) {
    const auto t = static_cast<int64_t>(target[n]);
    const double w = weight.empty() ? 1.0 : weight[t];
    out.push_back(-w * log_probs[n * C + t]);
    total += out.back();
    counted += w;
  }
  if (r == Reduction::None) return out;
  return {r == Reduction::Mean ? total / counted : total};
}

double ref_sum(const Values& a) {
  double s = 0;
  for (double v : a) s += v;
  return s;
}

// conv2d over x [N, C, H, W], w [OC, C, kh, kw], b [OC] or empty, as torch computes it.
Values ref_conv2d(const Values& x, const Values& w, const Values& b, Shape in, Shape weight, Size2 stride,
                         Size2 padding, Size2 dilation) {
  const int64_t N = in[0], C = in[1], H = in[2], W = in[3], OC = weight[0], KH = weight[2], KW = weight[3];
  const int64_t OH = (H + 2 * padding.h - dilation.h * (KH - 1) - 1) / stride.h + 1;
  const int64_t OW = (W + 2 * padding.w - dilation.w * (KW - 1) - 1) / stride.w + 1;
  Values out;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < OC; ++o)
      for (int64_t oh = 0; oh < OH; ++oh)
        for (int64_t ow = 0; ow < OW; ++ow) {
          double acc = b.empty() ? 0.0 : b[o];
          for (int64_t c = 0; c < C; ++c)
            for (int64_t i = 0; i < KH; ++i)
              for (int64_t j = 0; j < KW; ++j) {
                const int64_t h = oh * stride.h - padding.h + i * dilation.h;
                const int64_t v = ow * stride.w - padding.w + j * dilation.w;
                if (h >= 0 && h < H && v >= 0 && v < W)
                  acc += x[((n * C + c) * H + h) * W + v] * w[((o * C + c) * KH + i) * KW + j];
              }
          out.push_back(acc);
        }
  return out;
}

// max_pool2d over x [N, C, H, W]: padding never wins; a NaN in a window is its maximum.
Values ref_max_pool2d(const Values& x, Shape in, Size2 kernel, Size2 stride, Size2 padding) {
  const int64_t planes = in[0] * in[1], H = in[2], W = in[3];
  const int64_t OH = (H + 2 * padding.h - kernel.h) / stride.h + 1, OW = (W + 2 * padding.w - kernel.w) / stride.w + 1;
  Values out;
  for (int64_t p = 0; p < planes; ++p)
    for (int64_t oh = 0; oh < OH; ++oh)
      for (int64_t ow = 0; ow < OW; ++ow) {
        double best = -HUGE_VAL;
        for (int64_t i = 0; i < kernel.h; ++i)
          for (int64_t j = 0; j < kernel.w; ++j) {
            const int64_t h = oh * stride.h - padding.h + i, v = ow * stride.w - padding.w + j;
            if (h < 0 || h >= H || v < 0 || v >= W) continue;
            const double value = x[(p * H + h) * W + v];
            if (value > best || std::isnan(value)) best = value;
          }
        out.push_back(best);
      }
  return out;
}

// layer_norm over rows of D elements, with weight and bias (either may be empty).
Values ref_layer_norm(const Values& x, const Values& w, const Values& b, int64_t D, double eps = 1e-5) {
  Values out(x.size());
  for (size_t r = 0; r * D < x.size(); ++r) {
    double mean = 0, var = 0;
    for (int64_t d = 0; d < D; ++d) mean += x[r * D + d] / D;
    for (int64_t d = 0; d < D; ++d) var += (x[r * D + d] - mean) * (x[r * D + d] - mean) / D;
    for (int64_t d = 0; d < D; ++d)
      out[r * D + d] = (x[r * D + d] - mean) / std::sqrt(var + eps) * (w.empty() ? 1.0 : w[d]) + (b.empty() ? 0.0 : b[d]);
  }
  return out;
}


// A small CNN on [1, 6, 6] images: Conv2d(1, 2, 3, padding 1) - ReLU - MaxPool2d(2) -
// Flatten - Linear(18, 3).
std::shared_ptr<nn::Module> small_cnn(Generator& gen) {
  auto model = std::make_shared<nn::Sequential>();
  model->add(nn::Conv2d(1, 2, 3, gen, /*stride=*/1, /*padding=*/1));
  model->add(nn::ReLU());
  model->add(nn::MaxPool2d(2));
  model->add(nn::Flatten());
  model->add(nn::Linear(18, 3, gen));
  return model;
}

// A CNN on [8, 5, 5] samples whose convolutions take the CPU's Winograd path (8 channels in
// and out, 3x3, stride 1): Conv2d(8, 8, 3, padding 1) - ReLU - Conv2d(8, 8, 3) - Flatten -
// Linear(72, 3). The second convolution's input gradient runs too.
std::shared_ptr<nn::Module> winograd_cnn(Generator& gen) {
  auto model = std::make_shared<nn::Sequential>();
  model->add(nn::Conv2d(8, 8, 3, gen, /*stride=*/1, /*padding=*/1));
  model->add(nn::ReLU());
  model->add(nn::Conv2d(8, 8, 3, gen));
  model->add(nn::Flatten());
  model->add(nn::Linear(72, 3, gen));
  return model;
}

// ---- empty batches ------------------------------------------------------------------------
// Every op on a batch of N = 0 samples: an empty output (or the reduction of nothing: a sum
// of 0, a mean of NaN, as torch), empty input gradients, and exactly zero gradients for the
// parameters (weight, bias, the other matmul operand), which no sample reached. A rank whose
// share of a dataset is empty runs these. The references are the ones above at N = 0.
// (add_activation adds each activation's own N = 0 row.)
void add_empty_batch_rows(std::vector<OpCase>& rows) {
  rows.push_back({"N = 0: matmul 0x7 . 7x3", {{{0, 7}}, {{7, 3}}}, [](auto& in) { return matmul(in[0], in[1]); },
                  [](auto& in) { return ref_matmul(in[0], in[1], 0, 7, 3); }});
  rows.push_back({"N = 0: linear [0,6] -> [0,3]", {{{0, 6}}, {{3, 6}}, {{3}}},
                  [](auto& in) { return linear(in[0], in[1], in[2]); },
                  [](auto& in) { return ref_linear(in[0], in[1], in[2], 0, 6, 3); }});
  rows.push_back({"N = 0: add bias broadcast [0,4]+[4]", {{{0, 4}}, {{4}}}, [](auto& in) { return in[0] + in[1]; },
                  [](auto& in) { return ref_binary(in[0], in[1], '+'); }});
  rows.push_back({"N = 0: sub", {{{0, 4}}, {{0, 4}}}, [](auto& in) { return in[0] - in[1]; },
                  [](auto&) { return Values{}; }});
  rows.push_back({"N = 0: mul broadcast", {{{0, 4}}, {{4}}}, [](auto& in) { return in[0] * in[1]; },
                  [](auto&) { return Values{}; }});
  rows.push_back({"N = 0: mul scalar, div scalar", {{{0, 4}}}, [](auto& in) { return in[0] * 2.5f / 3.0f; },
                  [](auto&) { return Values{}; }});
  rows.push_back({"N = 0: sum", {{{0, 6}}}, [](auto& in) { return sum(in[0]); }, [](auto&) { return Values{0.0}; }});
  rows.push_back({"N = 0: mean (NaN)", {{{0, 6}}}, [](auto& in) { return mean(in[0]); },
                  [](auto&) { return Values{std::nan("")}; }});
  rows.push_back({"N = 0: conv2d stride 2x1, padding 1x0, dilation 1x2, bias", {{{0, 3, 6, 5}}, {{4, 3, 3, 2}}, {{4}}},
                  [](auto& in) { return conv2d(in[0], in[1], in[2], {2, 1}, {1, 0}, {1, 2}); },
                  [](auto&) { return Values{}; }});
  rows.push_back({"N = 0: conv2d 3x3 Winograd, 8 channels, padding 1", {{{0, 8, 5, 4}}, {{3, 8, 3, 3}}, {{3}}},
                  [](auto& in) { return conv2d(in[0], in[1], in[2], 1, 1); }, [](auto&) { return Values{}; }});
  rows.push_back({"N = 0: max_pool2d 2, stride 2", {{{0, 2, 5, 5}}}, [](auto& in) { return max_pool2d(in[0], 2, 2); },
                  [](auto&) { return Values{}; }});
  rows.push_back({"N = 0: layer_norm [0,4,5] over [5]", {{{0, 4, 5}}, {{5}}, {{5}}},
                  [](auto& in) { return layer_norm(in[0], {5}, in[1], in[2]); }, [](auto&) { return Values{}; }});
  rows.push_back({"N = 0: batch_norm training [0,4]", {{{0, 4}}, {{4}}, {{4}}},
                  [](auto& in) {
                    const Device device = in[0].device();
                    const Tensor running_mean = Tensor::from_vector({0.5f, -1, 2, 0}, {}, device);
                    const Tensor running_var = Tensor::from_vector({0.25f, 2, 1, 3}, {}, device);
                    const Tensor out =
                        batch_norm(in[0], running_mean, running_var, in[1], in[2], /*training=*/true);
                    // Nothing to average: the running statistics stay exactly as they were.
                    NANODDP_CHECK(running_mean.to_vector() == std::vector<float>({0.5f, -1, 2, 0}) &&
                                      running_var.to_vector() == std::vector<float>({0.25f, 2, 1, 3}),
                                  ValueError, "batch_norm on an empty batch changed the running statistics");
                    return out;
                  },
                  [](auto&) { return Values{}; }});
  rows.push_back({"N = 0: batch_norm eval [0,3,4]", {{{0, 3, 4}}, {{3}}, {{3}}},
                  [](auto& in) {
                    const Device device = in[0].device();
                    const Tensor running_mean = Tensor::from_vector({0.5f, -1, 2}, {}, device);
                    const Tensor running_var = Tensor::from_vector({0.25f, 2, 1}, {}, device);
                    return batch_norm(in[0], running_mean, running_var, in[1], in[2], /*training=*/false);
                  },
                  [](auto&) { return Values{}; }});
  rows.push_back({"N = 0: dropout p=0.3", {{{0, 6}}},
                  [](auto& in) { Generator gen(5); return dropout(in[0], 0.3f, /*training=*/true, gen); },
                  [](auto&) { return Values{}; }});
  rows.push_back({"N = 0: flatten [0,3,4] -> [0,12]", {{{0, 3, 4}}}, [](auto& in) { return nn::Flatten()(in[0]); },
                  [](auto&) { return Values{}; }});
  rows.push_back({"N = 0: reshape [0,6] -> [0,2,3]", {{{0, 6}}},
                  [](auto& in) { return in[0].reshape({0, 2, 3}) * 1.0f; }, [](auto&) { return Values{}; }});
  for (Reduction r : {Reduction::Mean, Reduction::Sum, Reduction::None}) {
    const std::string suffix = r == Reduction::Mean ? "mean (NaN)" : r == Reduction::Sum ? "sum" : "none";
    rows.push_back({"N = 0: mse_loss " + suffix, {{{0, 3}}, {{0, 3}}},
                    [r](auto& in) { return mse_loss(in[0], in[1], r); },
                    [r](auto& in) { return ref_mse(in[0], in[1], r); }});
    rows.push_back({"N = 0: cross_entropy " + suffix, {{{0, 5}}, {{0}, Kind::Labels, 5}},
                    [r](auto& in) { return cross_entropy(in[0], in[1], r); },
                    [r](auto& in) { return ref_cross_entropy(in[0], in[1], 0, 5, r); }});
    rows.push_back({"N = 0: nll_loss " + suffix,
                    {{{0, 5}}, {{0}, Kind::Labels, 5}},
                    [r](auto& in) { return nll_loss(in[0], in[1], r); },
                    [r](auto& in) { return ref_nll_loss(in[0], in[1], 0, 5, r); }});
  }
  rows.push_back({"N = 0: log_softmax",
                  {{{0, 5}}},
                  [](auto& in) { return log_softmax(in[0], 1); },
                  [](auto& in) { return ref_log_softmax(in[0], 0, 5); }});
  rows.push_back({"N = 0: two-layer MLP, summed loss", {{{0, 5}}, {{6, 5}}, {{6}}, {{3, 6}}, {{3}}, {{0}, Kind::Labels, 3}},
                  [](auto& in) {
                    return cross_entropy(linear(relu(linear(in[0], in[1], in[2])), in[3], in[4]), in[5], Reduction::Sum);
                  },
                  [](auto&) { return Values{0.0}; }});
}

}  // namespace

// ---- the table ----------------------------------------------------------------------------
std::vector<OpCase> op_cases() {
  std::vector<OpCase> rows;
  // A pointwise activation: its row on standard normals, and a twin on [-100, 100] (the DDP
  // check runs once, on the first).
  // An activation's row, the same on [-100, 100], and on a batch of N = 0 rows (an empty
  // output and gradient: a rank whose share of a dataset is empty runs it).
  auto add_activation = [&rows](OpCase row) {
    OpCase wide = row;
    wide.name += " on [-100, 100]";
    wide.input_low = -100, wide.input_high = 100;
    wide.model = nullptr;
    OpCase empty{"N = 0: " + row.name + " [0," + std::to_string(row.inputs[0].shape[1]) + "]",
                 {{{0, row.inputs[0].shape[1]}}},
                 row.op,
                 [](auto&) { return Values{}; }};
    rows.push_back(std::move(row));
    rows.push_back(std::move(wide));
    rows.push_back(std::move(empty));
  };
  rows.push_back({"matmul 5x7 . 7x3", {{{5, 7}}, {{7, 3}}},
                  [](auto& in) { return matmul(in[0], in[1]); },
                  [](auto& in) { return ref_matmul(in[0], in[1], 5, 7, 3); }});
  rows.push_back({"matmul 33x17 . 17x5", {{{33, 17}}, {{17, 5}}},
                  [](auto& in) { return matmul(in[0], in[1]); },
                  [](auto& in) { return ref_matmul(in[0], in[1], 33, 17, 5); }});
  rows.push_back({"linear [4,6] -> [4,3]", {{{4, 6}}, {{3, 6}}, {{3}}},
                  [](auto& in) { return linear(in[0], in[1], in[2]); },
                  [](auto& in) { return ref_linear(in[0], in[1], in[2], 4, 6, 3); }});
  rows.push_back({"linear without bias", {{{4, 6}}, {{3, 6}}},
                  [](auto& in) { return linear(in[0], in[1], Tensor()); },
                  [](auto& in) { return ref_linear(in[0], in[1], {}, 4, 6, 3); }});
  rows.push_back({"add", {{{3, 4}}, {{3, 4}}}, [](auto& in) { return in[0] + in[1]; },
                  [](auto& in) { return ref_binary(in[0], in[1], '+'); }});
  rows.push_back({"add bias broadcast [3,4]+[4]", {{{3, 4}}, {{4}}}, [](auto& in) { return in[0] + in[1]; },
                  [](auto& in) { return ref_binary(in[0], in[1], '+'); }});
  rows.push_back({"sub", {{{3, 4}}, {{3, 4}}}, [](auto& in) { return in[0] - in[1]; },
                  [](auto& in) { return ref_binary(in[0], in[1], '-'); }});
  rows.push_back({"sub broadcast", {{{2, 3, 4}}, {{4}}}, [](auto& in) { return in[0] - in[1]; },
                  [](auto& in) { return ref_binary(in[0], in[1], '-'); }});
  rows.push_back({"mul", {{{3, 4}}, {{3, 4}}}, [](auto& in) { return in[0] * in[1]; },
                  [](auto& in) { return ref_binary(in[0], in[1], '*'); }});
  rows.push_back({"mul broadcast", {{{3, 4}}, {{4}}}, [](auto& in) { return in[0] * in[1]; },
                  [](auto& in) { return ref_binary(in[0], in[1], '*'); }});
  rows.push_back({"mul scalar", {{{3, 4}}}, [](auto& in) { return in[0] * 2.5f; },
                  [](auto& in) { Values o = in[0]; for (double& v : o) v *= 2.5; return o; }});
  rows.push_back({"div scalar", {{{3, 4}}}, [](auto& in) { return in[0] / 3.0f; },
                  [](auto& in) { Values o = in[0]; for (double& v : o) v /= 3.0; return o; }});
  rows.push_back({"sum", {{{5, 6}}}, [](auto& in) { return sum(in[0]); },
                  [](auto& in) { return Values{ref_sum(in[0])}; }});
  rows.push_back({"mean", {{{5, 6}}}, [](auto& in) { return mean(in[0]); },
                  [](auto& in) { return Values{ref_sum(in[0]) / in[0].size()}; }});
  add_activation(OpCase{"relu", {{{4, 5}}}, [](auto& in) { return relu(in[0]); },
                        [](auto& in) { return pointwise(in[0], [](double v) { return v > 0 || std::isnan(v) ? v : 0; }); }}
                     .in_model({5}, mlp_around([] { return std::make_shared<nn::ReLU>(); })));
  add_activation(OpCase{"sigmoid", {{{4, 5}}}, [](auto& in) { return sigmoid(in[0]); },
                        [](auto& in) { return pointwise(in[0], [](double v) { return 1 / (1 + std::exp(-v)); }); }}
                     .in_model({5}, mlp_around([] { return std::make_shared<nn::Sigmoid>(); })));
  add_activation(OpCase{"tanh", {{{4, 5}}}, [](auto& in) { return tanh(in[0]); },
                        [](auto& in) { return pointwise(in[0], [](double v) { return std::tanh(v); }); }}
                     .in_model({5}, mlp_around([] { return std::make_shared<nn::Tanh>(); })));
  add_activation(OpCase{"gelu", {{{4, 5}}}, [](auto& in) { return gelu(in[0]); },
                        [](auto& in) { return pointwise(in[0], [](double v) { return 0.5 * v * (1 + std::erf(v / std::sqrt(2.0))); }); }}
                     .in_model({5}, mlp_around([] { return std::make_shared<nn::GELU>(); })));
  add_activation(OpCase{"gelu tanh", {{{4, 5}}}, [](auto& in) { return gelu(in[0], "tanh"); },
                        [](auto& in) {
                          return pointwise(in[0], [](double v) {
                            return 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)));
                          });
                        }}
                     .in_model({5}, mlp_around([] { return std::make_shared<nn::GELU>("tanh"); })));
  add_activation(OpCase{"softplus beta 2, threshold 10", {{{4, 5}}}, [](auto& in) { return softplus(in[0], 2, 10); },
                        [](auto& in) { return pointwise(in[0], [](double v) { return 2 * v > 10 ? v : std::log1p(std::exp(2 * v)) / 2; }); }}
                     .in_model({5}, mlp_around([] { return std::make_shared<nn::Softplus>(2, 10); })));
  rows.push_back(OpCase{"conv2d stride 2x1, padding 1x0, dilation 1x2, bias", {{{2, 3, 6, 5}}, {{4, 3, 3, 2}}, {{4}}},
                        [](auto& in) { return conv2d(in[0], in[1], in[2], {2, 1}, {1, 0}, {1, 2}); },
                        [](auto& in) { return ref_conv2d(in[0], in[1], in[2], {2, 3, 6, 5}, {4, 3, 3, 2}, {2, 1}, {1, 0}, {1, 2}); }}
                     .in_model({1, 6, 6}, small_cnn));
  // One input channel: the GEMMs have an inner size (forward) or a row count (weight gradient)
  // of 9, the thin loops of kernels/cpu/matmul.cpp (Note [Thin matmuls]); 15 positions per image
  // leave remainders of their 8-float vectors.
  rows.push_back({"conv2d one input channel, bias", {{{2, 1, 5, 7}}, {{3, 1, 3, 3}}, {{3}}},
                  [](auto& in) { return conv2d(in[0], in[1], in[2]); },
                  [](auto& in) { return ref_conv2d(in[0], in[1], in[2], {2, 1, 5, 7}, {3, 1, 3, 3}, 1, 0, 1); }});
  rows.push_back({"conv2d 3x3 padding 1, no bias", {{{1, 2, 4, 4}}, {{3, 2, 3, 3}}},
                  [](auto& in) { return conv2d(in[0], in[1], Tensor(), 1, 1); },
                  [](auto& in) { return ref_conv2d(in[0], in[1], {}, {1, 2, 4, 4}, {3, 2, 3, 3}, 1, 1, 1); }});
  // 3x3 at stride 1 with 8 or more channels: Winograd F(2x2, 3x3) on the CPU, forward and both
  // gradients (kernels/cpu/winograd.h; NaN and inf inputs take im2col + GEMM). 9 and 10 channels
  // leave a remainder of its 8-channel vectors; odd output sizes leave half tiles; the input
  // gradient runs at padding 2 - pad, so 0, 1 and 2 each appear.
  rows.push_back(OpCase{"conv2d 3x3 Winograd, 9 channels, padding 0, bias", {{{2, 9, 6, 7}}, {{10, 9, 3, 3}}, {{10}}},
                        [](auto& in) { return conv2d(in[0], in[1], in[2]); },
                        [](auto& in) { return ref_conv2d(in[0], in[1], in[2], {2, 9, 6, 7}, {10, 9, 3, 3}, 1, 0, 1); }}
                     .in_model({8, 5, 5}, winograd_cnn));
  rows.push_back({"conv2d 3x3 Winograd, 1 x 2 images, padding 2", {{{2, 8, 1, 2}}, {{8, 8, 3, 3}}, {{8}}},
                  [](auto& in) { return conv2d(in[0], in[1], in[2], 1, 2); },
                  [](auto& in) { return ref_conv2d(in[0], in[1], in[2], {2, 8, 1, 2}, {8, 8, 3, 3}, 1, 2, 1); }});
  rows.push_back({"conv2d 3x3 Winograd, 8 channels, padding (2, 1)", {{{1, 8, 5, 4}}, {{3, 8, 3, 3}}},
                  [](auto& in) { return conv2d(in[0], in[1], Tensor(), 1, {2, 1}); },
                  [](auto& in) { return ref_conv2d(in[0], in[1], {}, {1, 8, 5, 4}, {3, 8, 3, 3}, 1, {2, 1}, 1); }});
  // Rows of 8 pixels or more move between channels first and last 8 x 8 at a time (Note
  // [Channel transposes]): 11 and 9 pixels leave an overlapping last block, 12 channels a
  // remainder of 4; the input gradient transposes 16 channels of rows of 11 pixels.
  rows.push_back({"conv2d 3x3 Winograd, rows of 9 and 11 pixels, 12 channels, padding 1",
                  {{{1, 12, 9, 11}}, {{16, 12, 3, 3}}, {{16}}},
                  [](auto& in) { return conv2d(in[0], in[1], in[2], 1, 1); },
                  [](auto& in) { return ref_conv2d(in[0], in[1], in[2], {1, 12, 9, 11}, {16, 12, 3, 3}, 1, 1, 1); }});
  rows.push_back({"conv2d 3x3 Winograd, rows of 8 pixels, 16 channels", {{{1, 16, 8, 10}}, {{8, 16, 3, 3}}},
                  [](auto& in) { return conv2d(in[0], in[1], Tensor()); },
                  [](auto& in) { return ref_conv2d(in[0], in[1], {}, {1, 16, 8, 10}, {8, 16, 3, 3}, 1, 0, 1); }});
  rows.push_back(OpCase{"max_pool2d 2, stride 2", {{{2, 2, 5, 5}}},
                        [](auto& in) { return max_pool2d(in[0], 2, 2); },
                        [](auto& in) { return ref_max_pool2d(in[0], {2, 2, 5, 5}, 2, 2, 0); }}
                     .in_model({1, 6, 6}, small_cnn));
  rows.push_back({"max_pool2d 3, stride 2, padding 1 (overlapping)", {{{1, 3, 5, 6}}},
                  [](auto& in) { return max_pool2d(in[0], 3, 2, 1); },
                  [](auto& in) { return ref_max_pool2d(in[0], {1, 3, 5, 6}, 3, 2, 1); }});
  // Large planes: the CUDA backward spreads a plane's elements over the grid; overlapping
  // windows (kernel 3, stride 2) give elements several gradients to add, in the CPU's order.
  rows.push_back({"max_pool2d 3, stride 2, padding 1 on 40x40 planes", {{{1, 2, 40, 40}}},
                  [](auto& in) { return max_pool2d(in[0], 3, 2, 1); },
                  [](auto& in) { return ref_max_pool2d(in[0], {1, 2, 40, 40}, 3, 2, 1); }});
  // Many rows: the CUDA weight and bias gradients split 600 rows into chunks over the grid.
  rows.push_back({"layer_norm [600,6] over [6], affine (many rows)", {{{600, 6}}, {{6}}, {{6}}},
                  [](auto& in) { return layer_norm(in[0], {6}, in[1], in[2]); },
                  [](auto& in) { return ref_layer_norm(in[0], in[1], in[2], 6); }});
  rows.push_back(OpCase{"layer_norm [3,4,5] over [5]", {{{3, 4, 5}}, {{5}}, {{5}}},
                        [](auto& in) { return layer_norm(in[0], {5}, in[1], in[2]); },
                        [](auto& in) { return ref_layer_norm(in[0], in[1], in[2], 5); }}
                     .in_model({5}, mlp_around([] { return std::make_shared<nn::LayerNorm>(std::vector<int64_t>{8}); })));
  rows.push_back({"layer_norm over [4,5], no affine", {{{3, 4, 5}}},
                  [](auto& in) { return layer_norm(in[0], {4, 5}, Tensor(), Tensor()); },
                  [](auto& in) { return ref_layer_norm(in[0], {}, {}, 20); }});
  rows.push_back(OpCase{"batch_norm training [6,4]", {{{6, 4}}, {{4}}, {{4}}},
                        [](auto& in) { return batch_norm(in[0], Tensor(), Tensor(), in[1], in[2], /*training=*/true); },
                        [](auto& in) { return ref_batch_norm(in[0], in[1], in[2], 6, 4, 1); }}
                     .in_model({5}, mlp_around([] { return std::make_shared<nn::BatchNorm1d>(8); }))
                     .with_batch_statistics());
  rows.push_back({"batch_norm training [5,3,4]", {{{5, 3, 4}}, {{3}}, {{3}}},
                  [](auto& in) { return batch_norm(in[0], Tensor(), Tensor(), in[1], in[2], /*training=*/true); },
                  [](auto& in) { return ref_batch_norm(in[0], in[1], in[2], 5, 3, 4); }});
  rows.push_back({"batch_norm training [4,3,2], no affine", {{{4, 3, 2}}},
                  [](auto& in) { return batch_norm(in[0], Tensor(), Tensor(), Tensor(), Tensor(), /*training=*/true); },
                  [](auto& in) { return ref_batch_norm(in[0], {}, {}, 4, 3, 2); }});
  rows.push_back({"batch_norm eval [5,3,4] (running statistics)", {{{5, 3, 4}}, {{3}}, {{3}}},
                  [](auto& in) {
                    const Device device = in[0].device();  // the GPU column runs this row on CUDA
                    const Tensor running_mean = Tensor::from_vector({0.5f, -1, 2}, {}, device);
                    const Tensor running_var = Tensor::from_vector({0.25f, 2, 1}, {}, device);
                    return batch_norm(in[0], running_mean, running_var, in[1], in[2], /*training=*/false);
                  },
                  [](auto& in) { return ref_batch_norm(in[0], in[1], in[2], 5, 3, 4, {0.5, -1, 2}, {0.25, 2, 1}); }});
  // Dropout has no DDP row: each rank draws the masks of its own samples.
  rows.push_back({"dropout p=0.3", {{{4, 6}}},
                  [](auto& in) { Generator gen(5); return dropout(in[0], 0.3f, /*training=*/true, gen); },
                  [](auto& in) {
                    Generator gen(5);
                    const uint64_t key = dropout_key(gen);  // one key per call (nn/dropout.h)
                    const double scale = 1.0f / (1.0f - 0.3f);  // as dropout computes it, in float
                    Values out(in[0].size());
                    for (size_t i = 0; i < out.size(); ++i)
                      out[i] = in[0][i] * (kernels::dropout_uniform(key, int64_t(i)) >= 0.3f ? scale : 0.0);
                    return out;
                  }});
  rows.push_back({"flatten [2,3,4] -> [2,12]", {{{2, 3, 4}}},
                  [](auto& in) { return nn::Flatten()(in[0]); }, [](auto& in) { return in[0]; }});
  for (Reduction r : {Reduction::Mean, Reduction::Sum, Reduction::None}) {
    const std::string suffix = r == Reduction::Mean ? "mean" : r == Reduction::Sum ? "sum" : "none";
    rows.push_back({"mse_loss " + suffix, {{{4, 3}}, {{4, 3}}},
                    [r](auto& in) { return mse_loss(in[0], in[1], r); },
                    [r](auto& in) { return ref_mse(in[0], in[1], r); }});
    rows.push_back({"cross_entropy " + suffix, {{{6, 5}}, {{6}, Kind::Labels, 5}},
                    [r](auto& in) { return cross_entropy(in[0], in[1], r); },
                    [r](auto& in) { return ref_cross_entropy(in[0], in[1], 6, 5, r); }});
    rows.push_back({"cross_entropy label_smoothing 0.1 " + suffix,
                    {{{6, 5}}, {{6}, Kind::Labels, 5}},
                    [r](auto& in) { return cross_entropy(in[0], in[1], r, kDefaultIgnoreIndex, 0.1); },
                    [r](auto& in) { return ref_cross_entropy(in[0], in[1], 6, 5, r, 0.1); }});
    for (bool weighted : {false, true}) {
      rows.push_back(
          {std::string("nll_loss ") + (weighted ? "weight " : "") + suffix,
           {{{6, 5}}, {{6}, Kind::Labels, 5}},
           [r, weighted](auto& in) {
             const Values w = class_weights(5);
             const Tensor weight =
                 weighted ? Tensor::from_vector(std::vector<float>(w.begin(), w.end())).to(in[0].device())
                          : Tensor();
             return nll_loss(in[0], in[1], r, kDefaultIgnoreIndex, weight);
           },
           [r, weighted](auto& in) {
             return ref_nll_loss(in[0], in[1], 6, 5, r, weighted ? class_weights(5) : Values{});
           }});
    }
    for (double smoothing : {0.0, 0.1}) {
      rows.push_back({"cross_entropy weight, label_smoothing " + std::to_string(smoothing) + " " + suffix,
                      {{{6, 5}}, {{6}, Kind::Labels, 5}},
                      [r, smoothing](auto& in) {
                        const Values w = class_weights(5);
                        const Tensor weight =
                            Tensor::from_vector(std::vector<float>(w.begin(), w.end())).to(in[0].device());
                        return cross_entropy(in[0], in[1], r, kDefaultIgnoreIndex, smoothing, weight);
                      },
                      [r, smoothing](auto& in) {
                        return ref_cross_entropy(in[0], in[1], 6, 5, r, smoothing, class_weights(5));
                      }});
    }
  }
  rows.push_back({"log_softmax [6,5]",
                  {{{6, 5}}},
                  [](auto& in) { return log_softmax(in[0], 1); },
                  [](auto& in) { return ref_log_softmax(in[0], 6, 5); }});
  rows.push_back({"reshape", {{{2, 6}}}, [](auto& in) { return in[0].reshape({3, -1}) * 1.0f; },
                  [](auto& in) { return in[0]; }});
  rows.push_back({"two-layer MLP", {{{4, 5}}, {{6, 5}}, {{6}}, {{3, 6}}, {{3}}, {{4}, Kind::Labels, 3}},
                  [](auto& in) { return cross_entropy(linear(relu(linear(in[0], in[1], in[2])), in[3], in[4]), in[5]); },
                  [](auto& in) {
                    Values h = ref_linear(in[0], in[1], in[2], 4, 5, 6);
                    for (double& v : h) v = v > 0 || std::isnan(v) ? v : 0;  // relu keeps NaN
                    return ref_cross_entropy(ref_linear(h, in[3], in[4], 4, 6, 3), in[5], 4, 3, Reduction::Mean);
                  }});
  add_empty_batch_rows(rows);
  return rows;
}

std::vector<Values> make_inputs(const OpCase& c, Generator& gen) {
  std::vector<Values> values;
  for (const InputSpec& spec : c.inputs) {
    Values v(spec.shape.numel());
    const bool ranged = values.empty() && c.input_low < c.input_high && spec.kind == Kind::Normal;
    for (double& x : v)
      x = spec.kind == Kind::Labels ? static_cast<double>(gen.randint(spec.classes))
          : ranged                  ? c.input_low + (c.input_high - c.input_low) * gen.uniform()
                                    : static_cast<double>(gen.normal());
    if (ranged && !v.empty()) v.front() = c.input_low, v.back() = c.input_high;
    for (double& x : v) x = static_cast<float>(x);
    values.push_back(v);
  }
  return values;
}

std::vector<Tensor> to_tensors(const OpCase& c, const std::vector<Values>& values, Device device) {
  std::vector<Tensor> tensors;
  for (size_t i = 0; i < values.size(); ++i) {
    const InputSpec& spec = c.inputs[i];
    if (spec.kind == Kind::Labels) {
      std::vector<int64_t> labels(values[i].begin(), values[i].end());
      tensors.push_back(Tensor::from_vector(labels, spec.shape, device));
    } else {
      std::vector<float> floats(values[i].begin(), values[i].end());
      tensors.push_back(Tensor::from_vector(floats, spec.shape, device).set_requires_grad(true));
    }
  }
  return tensors;
}

}  // namespace nanoddp::testing
