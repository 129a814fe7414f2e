#include <doctest/doctest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>

#include "core/autograd.h"
#include "core/half.h"
#include "core/hash.h"
#include "nn/activations.h"
#include "nn/adam.h"
#include "nn/batch_norm.h"
#include "nn/checkpoint.h"
#include "nn/conv.h"
#include "nn/layers.h"
#include "nn/lr_scheduler.h"
#include "nn/normalization.h"
#include "nn/optim.h"
#include "nn/safetensors.h"

using namespace nanoddp;
using namespace nanoddp::nn;

namespace {
Sequential mlp(Generator& gen) {
  Sequential model;
  model.add(Linear(4, 3, gen));
  model.add(ReLU());
  model.add(Linear(3, 2, gen));
  return model;
}

std::string temp_path(const std::string& name) {
  return "/tmp/nanoddp_test_" + std::to_string(::getpid()) + "_" + name;
}
}  // namespace

TEST_CASE("named_parameters uses dotted names in registration order") {
  Generator gen(0);
  Sequential model = mlp(gen);
  std::vector<std::string> names;
  for (auto& [name, p] : model.named_parameters()) names.push_back(name);
  CHECK(names == std::vector<std::string>{"0.weight", "0.bias", "2.weight", "2.bias"});
  CHECK(model.parameters().size() == 4);
  CHECK(model.parameters()[2].shape() == Shape{2, 3});
  for (const Tensor& p : model.parameters()) CHECK(p.requires_grad());
}

TEST_CASE("Linear init is uniform in +-1/sqrt(in_features) as torch.nn.Linear") {
  Generator gen(3);
  Linear layer(64, 200, gen);
  const float bound = 1.0f / 8.0f;
  double mean = 0;
  float lo = 1, hi = -1;
  for (float w : layer.weight.to_vector()) {
    mean += w / (64.0 * 200);
    lo = std::min(lo, w);
    hi = std::max(hi, w);
  }
  CHECK(lo >= -bound);
  CHECK(hi < bound);
  CHECK(lo < -0.95f * bound);  // the whole range is used
  CHECK(hi > 0.95f * bound);
  CHECK(std::abs(mean) < 0.005);  // 12800 draws: standard error 0.0007
  for (float b : layer.bias.to_vector()) CHECK(std::abs(b) <= bound);
}

// Values printed by torch 1.13 after torch.manual_seed(seed) (Note [Torch's draws]).
TEST_CASE("a Generator seeded as torch.manual_seed gives torch's init, rand and randint values") {
  Generator gen0(0);
  Linear small(4, 2, gen0);
  CHECK(small.weight.to_vector() == std::vector<float>{-0.00374341011f, 0.268221796f, -0.411522567f,
                                                       -0.367969513f, -0.192577183f, 0.134078681f,
                                                       -0.00990658998f, 0.396444738f});
  CHECK(small.bias.to_vector() == std::vector<float>{-0.0443720222f, 0.132306278f});
  Generator gen1(1);
  Conv2d conv(2, 2, Size2{1, 2}, gen1);
  CHECK(conv.weight.to_vector() == std::vector<float>{0.2576316f, -0.220689118f, -0.0969307423f, 0.234684467f,
                                                      -0.470718443f, 0.29985863f, -0.102862656f,
                                                      0.254371941f});
  CHECK(conv.bias.to_vector() == std::vector<float>{0.0695084929f, -0.0612220764f});
  // The fashion_mnist MLP's first layer, at its corners and inside.
  Generator gen(0);
  Linear first(784, 256, gen);
  const std::vector<float> w = first.weight.to_vector(), b = first.bias.to_vector();
  CHECK(w[0] == -0.000267386436f);
  CHECK(w[1] == 0.0191587005f);
  CHECK(w[100 * 784 + 500] == -0.0299402438f);
  CHECK(w[255 * 784 + 783] == -0.0141338157f);
  CHECK(b[0] == -0.0117177796f);
  CHECK(b[255] == 0.0134783098f);
  Generator gen7(7);
  CHECK(Tensor::rand({5}, gen7).to_vector() ==
        std::vector<float>{0.53492254f, 0.198803186f, 0.659211695f, 0.656890273f, 0.232761562f});
  std::vector<uint64_t> ints;
  for (int i = 0; i < 5; ++i) ints.push_back(gen7.randint(1000));
  CHECK(ints == std::vector<uint64_t>{347, 287, 279, 988, 761});
  // torch.randint(0, 2**33, (3,)) after manual_seed(0): 64-bit draws past 2^32.
  Generator wide(0);
  std::vector<uint64_t> big;
  for (int i = 0; i < 3; ++i) big.push_back(wide.randint(uint64_t{1} << 33));
  CHECK(big == std::vector<uint64_t>{2546248239u, 7921061056u, 7979815675u});
  // The seed's low 32 bits, as torch's generator.
  Generator low(5), high((uint64_t{1} << 32) + 5);
  CHECK(low.random() == high.random());
}

TEST_CASE("linear names a weight that is not 2-D; LayerNorm refuses eps < 0 when built, as BatchNorm1d") {
  CHECK_THROWS_WITH_AS(linear(Tensor::zeros({2, 3}), Tensor::zeros({3}), Tensor()),
                       doctest::Contains("linear: weight [3] must be [out_features, in_features]"),
                       ShapeError);
  CHECK_THROWS_WITH_AS(linear(Tensor::zeros({2, 3}), Tensor::zeros({4, 2}), Tensor()),
                       doctest::Contains("with in_features = 2"), ShapeError);
  CHECK_THROWS_WITH_AS(LayerNorm({4}, -1e-5f), doctest::Contains("LayerNorm: eps must be >= 0, got -1e-05"),
                       ValueError);
}

TEST_CASE("CrossEntropyLoss passes its reduction and ignore_index on, as torch.nn.CrossEntropyLoss") {
  // logits [[1, 2, 3], [0, 1, 0]]: with ignore_index 1 only row 0 counts, log(e + e^2 + e^3) - 3;
  // by default (-100) both do, and the sum adds log(2 + e) - 1.
  const Tensor logits = Tensor::from_vector({1, 2, 3, 0, 1, 0}, {2, 3});
  const Tensor target = Tensor::from_vector(std::vector<int64_t>{2, 1});
  const double e = std::exp(1.0), row0 = std::log(e + e * e + e * e * e) - 3, row1 = std::log(2 + e) - 1;
  CHECK(CrossEntropyLoss(Reduction::Mean, 1)(logits, target).item() == doctest::Approx(row0).epsilon(1e-6));
  CHECK(CrossEntropyLoss(Reduction::Sum)(logits, target).item() == doctest::Approx(row0 + row1).epsilon(1e-6));
}

TEST_CASE("GELU's gradient at +-inf is NaN in every element, as torch's (inf * phi(inf) = inf * 0)") {
  // 19 elements: the infinities sit in Eigen's packets (0, 9) and in the scalar tail (17, 18).
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> values(19, 1.0f);
  values[0] = values[17] = inf;
  values[9] = values[18] = -inf;
  for (const char* approximate : {"none", "tanh"}) {
    CAPTURE(approximate);
    Tensor x = Tensor::from_vector(values).set_requires_grad(true);
    sum(gelu(x, approximate)).backward();
    const std::vector<float> grad = x.grad().to_vector();
    for (size_t i : {0, 9, 17, 18}) {
      CAPTURE(i);
      CHECK(std::isnan(grad[i]));
    }
    CHECK(grad[1] == doctest::Approx(approximate == std::string("none") ? 1.0833155 : 1.0829641).epsilon(1e-6));
  }
}

TEST_CASE("tanh near saturation equals torch's, value and gradient, in Eigen's packets and in the tail") {
  // torch 1.13: tanh(8) = 0.999999762, its gradient 4.76837101e-07 (Eigen's vectorised tanh gave 1
  // and 0). 16 elements: each value in a packet, and the last ones in the scalar tail. (At 9
  // torch gives 1, where the nearest float to tanh(9) is 1 - 2^-24, which this gives.)
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> points = {8.0f, -8.0f, 7.9f, 9.5f, -7.6f, 20.0f, inf, -inf};
  const std::vector<float> torch_value = {0.999999762f,  -0.999999762f, 0.999999702f, 1.0f,
                                          -0.999999523f, 1.0f,          1.0f,         -1.0f};
  const std::vector<float> torch_grad = {
      4.76837101e-07f, 4.76837101e-07f, 5.96046334e-07f, 0.0f, 9.53674089e-07f, 0.0f, 0.0f, 0.0f};
  std::vector<float> xs = points;
  xs.insert(xs.end(), points.begin(), points.end());
  Tensor x = Tensor::from_vector(xs).set_requires_grad(true);
  const Tensor y = tanh(x);
  sum(y).backward();
  const std::vector<float> value = y.to_vector(), grad = x.grad().to_vector();
  for (size_t i = 0; i < xs.size(); ++i) {
    CAPTURE(xs[i]);
    CHECK(value[i] == torch_value[i % points.size()]);
    // 1 - y^2 by an fma (torch's AVX2 kernels; GCC here) or not (clang builds): a few units apart.
    const float want = torch_grad[i % points.size()];
    CHECK(std::fabs(grad[i] - want) <= 5e-7f * want);
  }
}

// Note [GELU's tanh form]: x / (1 + e^(-2u)) keeps its digits where x/2 (1 + tanh(u)) cancels.
TEST_CASE("GELU's tanh form: value and gradient within a few float32 roundings of float64, tails included") {
  std::vector<float> xs;
  for (float v = -12.0f; v <= 12.0f; v += 0.37f) xs.push_back(v);
  for (float v : {-4.875f, -6.0f, -9.55f, -9.65f, -10.5f, 9.7f, 1e-20f, -1e-20f, 0.0f}) xs.push_back(v);
  Tensor x = Tensor::from_vector(xs).set_requires_grad(true);
  const Tensor y = gelu(x, "tanh");
  sum(y).backward();
  const std::vector<float> value = y.to_vector(), grad = x.grad().to_vector();
  for (size_t i = 0; i < xs.size(); ++i) {
    const double v = xs[i], k = std::sqrt(2.0 / M_PI), u = k * (v + 0.044715 * v * v * v);
    // 1 + tanh(u) = 2 / (1 + e^(-2u)) and 1 - tanh(u)^2 = 4 e^(-2u) / (1 + e^(-2u))^2: in
    // float64 too, 1 + tanh(u) would cancel below x = -6.
    const double e = std::exp(-2.0 * u), one_plus_t = 2.0 / (1.0 + e),
                 one_minus_t2 = 4.0 * e / ((1.0 + e) * (1.0 + e));
    const double want_value = 0.5 * v * one_plus_t;
    const double want_grad = 0.5 * one_plus_t + 0.5 * v * one_minus_t2 * k * (1.0 + 3.0 * 0.044715 * v * v);
    CAPTURE(xs[i]);
    CAPTURE(want_value);
    CAPTURE(want_grad);
    // Relative 1e-6 (about 8 roundings), plus the rounding of u in float32, which the exp turns
    // into a relative error of |2u| roundings; or below float's normal range.
    const double rtol = 1e-6 + std::fabs(2.0 * u) * 1.2e-7;
    CHECK(std::fabs(value[i] - want_value) <= rtol * std::fabs(want_value) + 1e-37);
    CHECK(std::fabs(grad[i] - want_grad) <= rtol * std::fabs(want_grad) + 1e-37);
  }
  // Far out, x u' overflows where e^(-2|u|) is already 0: the gradient is torch's 1 and 0, not
  // inf * 0.
  Tensor far = Tensor::from_vector({1e12f, 1.2e13f, 1e15f, -1.2e13f, -1e15f}).set_requires_grad(true);
  sum(gelu(far, "tanh")).backward();
  CHECK(far.grad().to_vector() == std::vector<float>{1.0f, 1.0f, 1.0f, 0.0f, 0.0f});
  // torch 1.13's gradient at -4.875 is -3.76e-6 (its tanh form), the float64 one -3.39e-6.
  CHECK(grad[xs.size() - 9] == doctest::Approx(-3.39e-6).epsilon(1e-2));
}

// Note [GELU's lower tail]: below x = -3, Phi(x) = erfc(-x / sqrt 2) / 2, where 1 + erf cancels.
TEST_CASE("GELU's exact form: value and gradient within a few float32 roundings of float64, lower tail included") {
  std::vector<float> xs;
  for (float v = -14.0f; v <= 6.0f; v += 0.29f) xs.push_back(v);
  for (float v : {-3.0f, -3.01f, -5.62f, -8.0f, -10.0f, -13.0f}) xs.push_back(v);
  Tensor x = Tensor::from_vector(xs).set_requires_grad(true);
  const Tensor y = gelu(x);
  sum(y).backward();
  const std::vector<float> value = y.to_vector(), grad = x.grad().to_vector();
  for (size_t i = 0; i < xs.size(); ++i) {
    const double v = xs[i], cdf = 0.5 * std::erfc(-v / std::sqrt(2.0)),
                 pdf = std::exp(-0.5 * v * v) / std::sqrt(2.0 * M_PI);
    const double want_value = v * cdf, want_grad = cdf + v * pdf;
    CAPTURE(xs[i]);
    CAPTURE(want_value);
    CAPTURE(want_grad);
    // Relative 2e-6 (about 16 roundings), plus the rounding of x^2 / 2 in float32, which the exp
    // turns into a relative error of x^2 / 2 roundings; or below float's normal range. From
    // x = -3 up, 1 + erf keeps the erf's absolute error, a unit or two of float32 near 1, times
    // x / 2 (torch's formula, whose error it is); below, the erfc form has none of it.
    const double rtol = 2e-6 + 0.5 * v * v * 1.2e-7, erf_noise = v >= -3.0 ? 1.2e-7 * std::fabs(v) : 0.0;
    CHECK(std::fabs(value[i] - want_value) <= rtol * std::fabs(want_value) + erf_noise + 1e-37);
    CHECK(std::fabs(grad[i] - want_grad) <= rtol * std::fabs(want_grad) + erf_noise + 1e-37);
  }
  // x = -5.62: 1 + erf gives +3.4e-7 (torch: 0); float64's value is -5.37e-8.
  CHECK(value[xs.size() - 4] < 0.0f);
}

// Torch 1.13's values (torch.nn.functional.gelu and softplus on the CPU, float32) far in the
// tails, where Eigen's vectorised exp leaves std::exp's values (Note [Vectorised exp's range]): 19
// elements, so that each value sits in a packet and the last ones in the scalar tail.
TEST_CASE("GELU's gradient and Softplus far in the tails equal torch's, in Eigen's packets and in the tail") {
  // Within 1e-6 relative; a subnormal within 2 of its steps (torch's exp rounds them its own way).
  auto near = [](float got, double want) {
    if (std::isnan(want)) return std::isnan(got);
    if (std::isinf(want)) return got == want;
    return std::fabs(got - want) <= std::max(1e-6 * std::fabs(want), 2 * 1.401298464e-45);
  };
  const std::vector<float> gelu_x{-1e38f, -1e30f, -50,   -30,    -20, -15,  0.5f, 12,    13,   20,
                                  30,     1e30f,  1e38f, -1e38f, -20, 0.5f, 20,   1e30f, 1e38f};
  const std::vector<double> gelu_grad{
      0, 0, 0, 0, 0, 0, 0.867495059967041, 1, 1, 1, 1, 1, 1, 0, 0, 0.867495059967041, 1, 1, 1};
  Tensor x = Tensor::from_vector(gelu_x).set_requires_grad(true);
  sum(gelu(x)).backward();
  std::vector<float> grad = x.grad().to_vector();
  for (size_t i = 0; i < gelu_x.size(); ++i) {
    CAPTURE(i);
    CAPTURE(gelu_x[i]);
    CHECK(near(grad[i], gelu_grad[i]));
  }

  // softplus(x, beta 1, threshold 100): under the threshold past 88.7, torch's e^x is inf, so
  // its value is inf and its gradient z / (z + 1) NaN. Rows: x, torch's value, torch's gradient.
  const double inf = std::numeric_limits<double>::infinity(), nan = std::nan("");
  struct Row {
    float x;
    double y, grad;
  };
  const std::vector<Row> head{{-1e30f, 0, 0},
                              {-150, 0, 0},
                              {-100, 3.923635700109488e-44, 3.783505853677006e-44},
                              {-90, 8.194008692231508e-40, 8.194008692231508e-40},
                              {-88, 6.054601485195952e-39, 6.054601485195952e-39},
                              {-85, 1.2160992719555806e-37, 1.2160992719555806e-37},
                              {-79, 4.906094994852858e-35, 4.906094994852858e-35},
                              {0.5f, 0.9740769863128662, 0.622459352016449},
                              {19.9f, 19.899999618530273, 1},
                              {25, 25, 1},
                              {85, 85, 1},
                              {90, inf, nan},
                              {1e30f, 1.0000000150474662e+30, 1}};
  std::vector<Row> rows = head;
  for (size_t i : {2, 3, 7, 10, 11, 12}) rows.push_back(head[i]);  // again in the scalar tail
  std::vector<float> softplus_x;
  for (const Row& row : rows) softplus_x.push_back(row.x);
  x = Tensor::from_vector(softplus_x).set_requires_grad(true);
  Tensor y = softplus(x, 1, 100);
  sum(y).backward();
  const std::vector<float> values = y.to_vector();
  grad = x.grad().to_vector();
  for (size_t i = 0; i < rows.size(); ++i) {
    CAPTURE(i);
    CAPTURE(rows[i].x);
    CHECK(near(values[i], rows[i].y));
    CHECK(near(grad[i], rows[i].grad));
  }
}

TEST_CASE(
    "a 3x3 conv2d near float32's largest values is finite where the direct sum is (Winograd would "
    "overflow)") {
  // 8 channels, 3x3, stride 1: the CPU's Winograd path. An identity filter on 1e38: torch
  // gives 1e38; Winograd's transforms add terms before the products and overflow.
  Tensor w = Tensor::zeros({8, 8, 3, 3});
  for (int64_t o = 0; o < 8; ++o) w.data<float>()[((o * 8 + o) * 3 + 1) * 3 + 1] = 1.0f;
  const Tensor y = conv2d(Tensor::full({1, 8, 4, 4}, 1e38f), w, Tensor(), 1, 1);
  CHECK(y.to_vector() == std::vector<float>(8 * 4 * 4, 1e38f));
  // Backward: dx is 1e38 (finite), dw sums 4 to 9 products of 1e38: inf, never NaN (torch).
  Tensor x = Tensor::ones({1, 8, 4, 4}).set_requires_grad(true);
  Tensor wg = w.detach().clone().set_requires_grad(true);
  conv2d(x, wg, Tensor(), 1, 1).backward(Tensor::full({1, 8, 4, 4}, 1e38f));
  CHECK(x.grad().to_vector() == std::vector<float>(8 * 4 * 4, 1e38f));
  for (float v : wg.grad().to_vector()) CHECK(v == INFINITY);
}

TEST_CASE("a 3x3 conv2d with an inf or NaN operand gives the direct sum's values, forward and backward") {
  // 8 channels, 3x3, stride 1, padding 1: the CPU's Winograd path, whose transforms would meet
  // inf with -inf (NaN) where the direct sum, torch's, gives +-inf. Weights of both signs.
  constexpr int64_t C = 8, H = 5, W = 4;
  Generator gen(5);
  const std::vector<float> w0 = Tensor::randn({C, C, 3, 3}, gen).to_vector();
  const std::vector<float> x0 = Tensor::randn({1, C, H, W}, gen).to_vector();
  const std::vector<float> d0 = Tensor::randn({1, C, H, W}, gen).to_vector();
  // out[o, y, x] = sum over c, r, s of in(c, y + r - 1, x + s - 1) w(o, c, r, s), in double.
  // Forward multiplies the padding's zeros in, as torch's im2col does: 0 * inf is NaN (torch
  // 1.13 gives NaN in the last column for an inf at the weight's right-hand tap). The input
  // gradient does not: torch's col2im drops what falls on the padding.
  const auto direct = [&](auto in, auto weight, bool zeros_multiply) {
    std::vector<double> out(C * H * W, 0.0);
    for (int64_t o = 0; o < C; ++o)
      for (int64_t y = 0; y < H; ++y)
        for (int64_t x = 0; x < W; ++x)
          for (int64_t c = 0; c < C; ++c)
            for (int64_t r = 0; r < 3; ++r)
              for (int64_t s = 0; s < 3; ++s) {
                const int64_t iy = y + r - 1, ix = x + s - 1;
                const bool inside = iy >= 0 && iy < H && ix >= 0 && ix < W;
                if (inside || zeros_multiply)
                  out[(o * H + y) * W + x] += (inside ? in(c, iy, ix) : 0.0) * weight(o, c, r, s);
              }
    return out;
  };
  const auto same = [](const std::vector<float>& got, const std::vector<double>& want) {
    REQUIRE(got.size() == want.size());
    size_t wrong = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      const bool ok = std::isnan(want[i])   ? std::isnan(got[i])
                      : std::isinf(want[i]) ? double(got[i]) == want[i]
                                            : std::abs(got[i] - want[i]) <= 1e-4 * (1 + std::abs(want[i]));
      wrong += !ok;
    }
    return wrong;
  };
  const float inf = std::numeric_limits<float>::infinity();
  for (const float bad : {inf, -inf, std::nanf("")}) {
    for (const int which : {0, 1, 2}) {  // the bad value in the input, the weight, dout
      CAPTURE(bad);
      CAPTURE(which);
      std::vector<float> xv = x0, wv = w0, dv = d0;
      (which == 0   ? xv[(2 * H + 2) * W + 1]
       : which == 1 ? wv[((3 * C + 2) * 3 + 1) * 3 + 2]
                    : dv[(5 * H + 1) * W + 3]) = bad;
      Tensor x = Tensor::from_vector(xv, {1, C, H, W}).set_requires_grad(true);
      Tensor w = Tensor::from_vector(wv, {C, C, 3, 3}).set_requires_grad(true);
      Tensor y = conv2d(x, w, Tensor(), 1, 1);
      CHECK(same(y.to_vector(),
                 direct([&](int64_t c, int64_t i, int64_t j) { return double(xv[(c * H + i) * W + j]); },
                        [&](int64_t o, int64_t c, int64_t r, int64_t s) {
                          return double(wv[((o * C + c) * 3 + r) * 3 + s]);
                        },
                        true)) == 0);
      y.backward(Tensor::from_vector(dv, {1, C, H, W}));
      // dx: the convolution of dout with the weight turned 180 degrees, channels swapped.
      CHECK(same(x.grad().to_vector(),
                 direct([&](int64_t o, int64_t i, int64_t j) { return double(dv[(o * H + i) * W + j]); },
                        [&](int64_t c, int64_t o, int64_t r, int64_t s) {
                          return double(wv[((o * C + c) * 3 + 2 - r) * 3 + 2 - s]);
                        },
                        false)) == 0);
      // dw[o, c, r, s] = sum over pixels of dout(o, y, x) in(c, y + r - 1, x + s - 1).
      std::vector<double> dw(C * C * 9, 0.0);
      for (int64_t o = 0; o < C; ++o)
        for (int64_t c = 0; c < C; ++c)
          for (int64_t r = 0; r < 3; ++r)
            for (int64_t s = 0; s < 3; ++s)
              for (int64_t i = 0; i < H; ++i)
                for (int64_t j = 0; j < W; ++j) {
                  const int64_t iy = i + r - 1, ix = j + s - 1;
                  const bool inside = iy >= 0 && iy < H && ix >= 0 && ix < W;
                  dw[((o * C + c) * 3 + r) * 3 + s] +=
                      double(dv[(o * H + i) * W + j]) * (inside ? xv[(c * H + iy) * W + ix] : 0.0);
                }
      CHECK(same(w.grad().to_vector(), dw) == 0);
    }
  }
}

TEST_CASE("zero_grad clears gradients; train/eval propagate") {
  Generator gen(0);
  Sequential model = mlp(gen);
  sum(model(Tensor::ones({2, 4}))).backward();
  for (const Tensor& p : model.parameters()) CHECK(p.grad().defined());
  model.zero_grad();
  for (const Tensor& p : model.parameters()) CHECK_FALSE(p.grad().defined());
  // Reading such a .grad says what it is (torch's p.grad is None there).
  CHECK_THROWS_WITH_AS(model.parameters()[0].grad().to_vector(),
                       doctest::Contains("after zero_grad() with set_to_none, is undefined"), ValueError);
  model.eval();
  CHECK_FALSE(model.is_training());
  CHECK_FALSE(model[0].is_training());
  model.train();
  CHECK(model[2].is_training());
}

TEST_CASE("state_dict round-trips and load_state_dict checks keys strictly") {
  Generator g1(1), g2(2);
  Sequential a = mlp(g1), b = mlp(g2);
  b.load_state_dict(a.state_dict());
  for (size_t i = 0; i < 4; ++i) CHECK(a.parameters()[i].to_vector() == b.parameters()[i].to_vector());

  StateDict bad = a.state_dict();
  bad.erase("2.bias");
  bad["3.weight"] = Tensor::zeros({1});
  try {
    b.load_state_dict(bad);
    FAIL("expected ValueError");
  } catch (const ValueError& e) {
    const std::string m = e.what();
    CHECK(m.find("missing: [2.bias]") != std::string::npos);
    CHECK(m.find("unexpected: [3.weight]") != std::string::npos);
  }
  // check_state_dict: the same verdicts, and nothing copied.
  CHECK_THROWS_AS(b.check_state_dict(bad), ValueError);
  StateDict other = mlp(g2).state_dict();
  other["0.weight"] = Tensor::full({3, 4}, 7.0f);
  const std::vector<float> kept = b.parameters()[0].to_vector();
  CHECK(b.check_state_dict(other).empty());
  CHECK(b.parameters()[0].to_vector() == kept);
  bad.erase("3.weight");
  CHECK(b.check_state_dict(bad, /*strict=*/false).missing_keys == std::vector<std::string>{"2.bias"});
  b.load_state_dict(bad, /*strict=*/false);  // loads what is there

  StateDict wrong = a.state_dict();
  wrong["0.weight"] = Tensor::zeros({4, 3});
  const std::vector<float> before = b.parameters()[1].to_vector();
  wrong["0.bias"] = Tensor::full({3}, 9.0f);
  try {
    b.load_state_dict(wrong);
    FAIL("expected ShapeError");
  } catch (const ShapeError& e) {
    CHECK(std::string(e.what()).find("0.weight") != std::string::npos);
  }
  CHECK(b.parameters()[1].to_vector() == before);  // nothing half-loaded
  StateDict undefined = a.state_dict();
  undefined["0.bias"] = Tensor();
  for (const bool strict : {true, false}) {
    CAPTURE(strict);
    CHECK_THROWS_WITH_AS(b.load_state_dict(undefined, strict),
                         doctest::Contains("load_state_dict: '0.bias' is an undefined tensor in the state"),
                         ValueError);
  }
  CHECK(b.parameters()[1].to_vector() == before);
}

TEST_CASE("load_state_dict converts between float32, float16 and bfloat16 as torch's copy_, and refuses int64 <-> float") {
  Generator gen(3);
  Linear layer(2, 1, gen);
  // Widening is exact: bf16(1/3) = 0.333984375, f16(0.1) = 0.0999755859375, -0 stays -0.
  StateDict half;
  half["weight"] = Tensor::empty({1, 2}, DType::BFloat16);
  half["weight"].data<BFloat16>()[0] = BFloat16::from_float(1.0f / 3);
  half["weight"].data<BFloat16>()[1] = BFloat16::from_float(-0.0f);
  half["bias"] = Tensor::empty({1}, DType::Float16);
  half["bias"].data<Float16>()[0] = Float16::from_float(0.1f);
  layer.load_state_dict(half);
  CHECK(layer.weight.to_vector() == std::vector<float>{0.333984375f, -0.0f});
  CHECK(std::signbit(layer.weight.to_vector()[1]));
  CHECK(layer.bias.to_vector() == std::vector<float>{0.0999755859375f});
  CHECK(layer.weight.dtype() == DType::Float32);

  // Narrowing rounds to nearest, ties to even: into a bfloat16 buffer, 1 + 2^-8 (a tie) -> 1,
  // 1 + 3 * 2^-8 (a tie) -> 1 + 2^-6 (even), 1 + 2^-7 + 2^-9 -> 1 + 2^-7.
  struct Stats : Module {
    Tensor stats = register_buffer("stats", Tensor::zeros({3}, DType::BFloat16));
    Tensor forward(const Tensor& x) override { return x; }
  } narrow;
  StateDict wide;
  wide["stats"] = Tensor::from_vector({1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, 1.0f + 0x1p-7f + 0x1p-9f}, {3});
  narrow.load_state_dict(wide);
  const BFloat16* got = narrow.stats.data<BFloat16>();
  CHECK(got[0].to_float() == 1.0f);
  CHECK(got[1].to_float() == 1.0f + 0x1p-6f);
  CHECK(got[2].to_float() == 1.0f + 0x1p-7f);

  // int64 into float32 is refused by name, and nothing is loaded.
  StateDict counts;
  counts["weight"] = Tensor::from_vector(std::vector<int64_t>{1, 2}).reshape({1, 2});
  counts["bias"] = Tensor::full({1}, 7.0f);
  try {
    layer.load_state_dict(counts);
    FAIL("expected ShapeError");
  } catch (const ShapeError& e) {
    CHECK(std::string(e.what()).find(
              "load_state_dict: 'weight' is [1, 2] int64 in the state but [1, 2] float32 in the model (only "
              "float32, float16 and bfloat16 convert into each other)") == 0);
  }
  CHECK(layer.bias.to_vector() == std::vector<float>{0.0999755859375f});
}

TEST_CASE("checkpoints round-trip, replace atomically and reject corrupt files") {
  const std::string path = temp_path("ckpt");
  StateDict state;
  state["w"] = Tensor::from_vector({1, 2, 3, 4, 5, 6}, {2, 3});
  state["labels"] = Tensor::from_vector(std::vector<int64_t>{7, -1});
  state["empty"] = Tensor::zeros({0, 4});
  save_checkpoint(path, state);
  StateDict loaded = load_checkpoint(path);
  CHECK(loaded.size() == 3);
  CHECK(loaded["w"].shape() == Shape{2, 3});
  CHECK(loaded["w"].to_vector() == state["w"].to_vector());
  CHECK(loaded["labels"].to_int_vector() == std::vector<int64_t>{7, -1});
  CHECK(loaded["empty"].shape() == Shape{0, 4});
  // No temporary file is left behind.
  const std::string folder = path.substr(0, path.find_last_of('/'));
  const std::string base = path.substr(folder.size() + 1);
  for (const auto& entry : std::filesystem::directory_iterator(folder))
    CHECK(entry.path().filename().string().rfind(base + ".tmp", 0) != 0);

  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  auto write = [&](const std::string& content) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << content;
  };
  auto error_of = [&]() {
    try {
      load_checkpoint(path);
    } catch (const IOError& e) {
      return std::string(e.what());
    }
    return std::string("no IOError");
  };
  write(bytes.substr(0, bytes.size() / 2));
  std::string m = error_of();
  CHECK(m.find(path) != std::string::npos);
  CHECK(m.find("byte offset") != std::string::npos);
  std::string flipped = bytes;
  flipped[40] ^= 0x5a;
  write(flipped);
  CHECK(error_of().find("corrupt") != std::string::npos);
  write("NOTACKPTxxxxxxxxxxxxxxxx");
  CHECK(error_of().find("magic") != std::string::npos);
  std::remove(path.c_str());
  CHECK(error_of().find("cannot open") != std::string::npos);

  // Every dtype a save writes loads back, bit for bit (float16 and bfloat16 included: a file
  // that saves but does not load is lost).
  StateDict every;
  every["half"] = Tensor::empty({2}, DType::Float16);
  every["half"].data<Float16>()[0] = Float16::from_float(0.1f);
  every["half"].data<Float16>()[1] = Float16::from_float(-65504.0f);
  every["brain"] = Tensor::empty({1}, DType::BFloat16);
  every["brain"].data<BFloat16>()[0] = BFloat16::from_float(1.0f / 3);
  every["pixels"] = Tensor::zeros({2}, DType::UInt8);
  every["pixels"].data<uint8_t>()[1] = 255;
  save_checkpoint(path, every);
  const StateDict back = load_checkpoint(path);
  CHECK(back.at("half").dtype() == DType::Float16);
  CHECK(back.at("half").data<Float16>()[0].bits == Float16::from_float(0.1f).bits);
  CHECK(back.at("half").data<Float16>()[1].to_float() == -65504.0f);
  CHECK(back.at("brain").data<BFloat16>()[0].to_float() == 0.333984375f);
  CHECK(back.at("pixels").data<uint8_t>()[1] == 255);
  std::remove(path.c_str());
}

namespace {
// A checkpoint file written field by field (the format in nn/checkpoint.h), with a valid
// checksum, so a test can say what a dishonest but well-checksummed writer would.
struct CheckpointBytes {
  std::string bytes = std::string("NDDPCKPT");
  template <typename T>
  CheckpointBytes& put(T value) {
    bytes.append(reinterpret_cast<const char*>(&value), sizeof(T));
    return *this;
  }
  std::string sealed(uint64_t offset_basis = kFnv1aOffsetBasis) const {
    std::string out = bytes;
    const uint64_t sum = fnv1a(out, offset_basis);
    out.append(reinterpret_cast<const char*>(&sum), sizeof(sum));
    return out;
  }
};

std::string parse_error(const std::string& bytes) {
  try {
    parse_checkpoint(bytes, "crafted.ckpt");
  } catch (const IOError& e) {
    return e.what();
  }
  return "no IOError";
}
}  // namespace

TEST_CASE(
    "the checkpoint checksum is standard FNV-1a 64 (version 2); version 1 files, with the old basis, load") {
  // The FNV reference's test vectors.
  CHECK(fnv1a("") == 0xcbf29ce484222325ull);
  CHECK(fnv1a("a") == 0xaf63dc4c8601ec8cull);
  CHECK(fnv1a("foobar") == 0x85944171f73967e8ull);
  const std::string path = temp_path("fnv_ckpt");
  save_checkpoint(path, {{"w", Tensor::from_vector({1.5f})}});
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::remove(path.c_str());
  uint32_t version = 0;
  std::memcpy(&version, bytes.data() + 8, sizeof(version));
  CHECK(version == 2);
  uint64_t sum = 0;
  std::memcpy(&sum, bytes.data() + bytes.size() - 8, sizeof(sum));
  CHECK(sum == fnv1a(std::string_view(bytes).substr(0, bytes.size() - 8)));
  // A version 1 file: the same body, its checksum from version 1's basis.
  auto version1 = [](float value, uint64_t basis) {
    CheckpointBytes file;
    file.put<uint32_t>(1).put<uint64_t>(1).put<uint32_t>(1);
    file.bytes += "w";
    file.put<uint8_t>(0).put<uint8_t>(1).put<int64_t>(1).put<uint64_t>(4).put<float>(value);
    return file.sealed(basis);
  };
  const StateDict old = parse_checkpoint(version1(2.5f, kCheckpointVersion1OffsetBasis), "old.ckpt");
  CHECK(old.at("w").to_vector() == std::vector<float>{2.5f});
  CHECK(parse_error(version1(2.5f, kFnv1aOffsetBasis)).find("checksum mismatch") != std::string::npos);
}

TEST_CASE("checkpoint sizes are checked against int64 and the bytes present, naming the offset") {
  // One float32 tensor "w" of shape [2^62, 4]: 2^64 elements, 2^66 bytes, which wrap to 0,
  // so without the checks a byte count of 0 would pass for a tensor of 2^64 elements.
  auto entry = [](std::vector<int64_t> sizes, uint64_t nbytes) {
    CheckpointBytes file;
    file.put<uint32_t>(2).put<uint64_t>(1).put<uint32_t>(1);
    file.bytes += "w";
    file.put<uint8_t>(0).put<uint8_t>(static_cast<uint8_t>(sizes.size()));
    for (int64_t size : sizes) file.put<int64_t>(size);
    file.put<uint64_t>(nbytes);
    return file;
  };
  // Entry at offset 20 (8 magic + 4 version + 8 count); its sizes at 20 + 4 + 1 + 2 = 27.
  std::string m = parse_error(entry({int64_t{1} << 62, 4}, 0).sealed());
  CHECK(m.find("crafted.ckpt") != std::string::npos);
  CHECK(m.find("byte offset 27") != std::string::npos);
  CHECK(m.find("int64") != std::string::npos);
  m = parse_error(entry({-1, 4}, 0).sealed());
  CHECK(m.find("byte offset 27") != std::string::npos);
  // A zero size makes the product 0, but the others must still multiply within int64 (found
  // by fuzz_checkpoint: the loader accepted what Shape then refused with a ShapeError).
  m = parse_error(entry({0, int64_t{1} << 62, 4}, 0).sealed());
  CHECK(m.find("byte offset 27") != std::string::npos);
  CHECK(m.find("int64") != std::string::npos);
  // Elements that fit in int64 whose bytes do not: 2^62 float32 elements are 2^64 bytes.
  m = parse_error(entry({int64_t{1} << 62}, 0).sealed());
  CHECK(m.find("needs more bytes than int64 can count") != std::string::npos);
  // An honest size whose data is not there: the byte count is checked before any allocation.
  m = parse_error(entry({int64_t{1} << 40}, uint64_t{1} << 42).sealed());
  CHECK(m.find("truncated at byte offset 43") != std::string::npos);
  CHECK(m.find("4398046511104 bytes wanted, 0 left") != std::string::npos);
  // A dtype number past int32 (5, the last) is no DType.
  CheckpointBytes unknown;
  unknown.put<uint32_t>(2).put<uint64_t>(1).put<uint32_t>(1);
  unknown.bytes += "w";
  unknown.put<uint8_t>(6).put<uint8_t>(1).put<int64_t>(2).put<uint64_t>(8).put<float>(0).put<float>(0);
  m = parse_error(unknown.sealed());
  CHECK(m.find("bad dtype 6 or dim 1 of 'w' at byte offset 25") != std::string::npos);
  // A byte count that disagrees with the shape names both.
  m = parse_error(entry({2, 3}, 20).sealed());
  CHECK(m.find("claims 20 bytes for shape [2, 3] of float32 (24 bytes)") != std::string::npos);
  // A well-formed crafted file parses to what it says.
  CheckpointBytes good = entry({2}, 8);
  good.put<float>(1.5f).put<float>(-2.0f);
  const StateDict state = parse_checkpoint(good.sealed(), "crafted.ckpt");
  REQUIRE(state.count("w") == 1);
  CHECK(state.at("w").to_vector() == std::vector<float>{1.5f, -2.0f});
}

TEST_CASE("a checkpoint with two entries of one name is refused, naming it and both offsets") {
  // Two float32 [1] tensors named "w", 1.0 then 2.0. Each entry is 4 + 1 + 1 + 1 + 8 + 8 + 4 = 27
  // bytes: the first at byte offset 20 (8 magic + 4 version + 8 count), the second at 47.
  CheckpointBytes file;
  file.put<uint32_t>(2).put<uint64_t>(2);
  for (float value : {1.0f, 2.0f}) {
    file.put<uint32_t>(1);
    file.bytes += "w";
    file.put<uint8_t>(0).put<uint8_t>(1).put<int64_t>(1).put<uint64_t>(4).put<float>(value);
  }
  const std::string m = parse_error(file.sealed());
  const std::string expected =
      "checkpoint crafted.ckpt: a second entry for 'w' at byte offset 47 (the first is at byte offset 20)";
  CHECK_MESSAGE(m.rfind(expected, 0) == 0, m);
}

TEST_CASE("a checkpoint cut short is reported as truncated, naming where it ends; a flipped byte, in data or a header, stays a checksum mismatch") {
  // Two float32 tensors: "a" of 3 values at byte offset 20, its data at 20 + 4 + 1 + 1 + 1 + 8
  // + 8 = 43 to 55; "b" of 2 values at 55, its data at 78 to 86; the checksum at 86.
  StateDict state;
  state["a"] = Tensor::from_vector({1.0f, 2.0f, 3.0f});
  state["b"] = Tensor::from_vector({4.0f, 5.0f});
  const std::string whole = checkpoint_bytes(state);
  REQUIRE(whole.size() == 94);
  std::string m = parse_error(whole.substr(0, 80));
  CHECK_MESSAGE(m.find("checkpoint crafted.ckpt: truncated: the file ends at byte offset 80, in the data of entry 1 of 2 "
                       "(8 bytes from byte offset 78)") != std::string::npos, m);
  m = parse_error(whole.substr(0, 50));
  CHECK_MESSAGE(m.find("ends at byte offset 50, in the data of entry 0 of 2 (12 bytes from byte offset 43)") !=
                    std::string::npos, m);
  m = parse_error(whole.substr(0, 60));
  CHECK_MESSAGE(m.find("ends at byte offset 60, in entry 1 of 2") != std::string::npos, m);
  m = parse_error(whole.substr(0, 90));
  CHECK_MESSAGE(m.find("ends at byte offset 90, before the checksum") != std::string::npos, m);
  // A changed byte in the data, or in a header (the name's length, the dim, a size, the byte
  // count: a header no save writes), is corruption, not an end.
  for (const size_t at : {45, 21, 26, 28, 36}) {
    CAPTURE(at);
    std::string flipped = whole;
    flipped[at] ^= 0x5a;
    m = parse_error(flipped);
    CHECK_MESSAGE(m.find("checksum mismatch (checksum at byte offset 86)") != std::string::npos, m);
  }
  // A name length changed so that the name runs past the end: the "name" takes in the dtype
  // and sizes after it (control characters), so it is no name a save wrote.
  std::string longer_name = whole;
  longer_name[55] = 60;  // entry 1's name "b": 1 byte
  m = parse_error(longer_name);
  CHECK_MESSAGE(m.find("checksum mismatch (checksum at byte offset 86)") != std::string::npos, m);
  // So a save refuses such names (and names too long), before writing anything.
  for (const std::string& bad : {std::string("a\nb"), std::string("tab\there"), std::string(4097, 'x')}) {
    StateDict named;
    named[bad] = Tensor::from_vector({1.0f});
    CHECK_THROWS_AS(checkpoint_bytes(named), ValueError);
  }
  StateDict tab;
  tab["a\tb"] = Tensor::from_vector({1.0f});
  try {
    checkpoint_bytes(tab);
  } catch (const ValueError& e) {
    CHECK(std::string(e.what()).find("holds the control character 0x9 at byte 1") != std::string::npos);
  }
  StateDict longest;
  longest[std::string(4096, 'x')] = Tensor::from_vector({1.0f});
  CHECK(parse_checkpoint(checkpoint_bytes(longest), "longest.ckpt").count(std::string(4096, 'x')) == 1);
}

TEST_CASE("check_checkpoint_writable refuses a path, or a path.prev, that is someone else's file") {
  const std::string path = temp_path("writable_ckpt"), previous = path + ".prev";
  std::remove(path.c_str());
  std::remove(previous.c_str());
  auto error_of = [&]() {
    try {
      check_checkpoint_writable(path);
    } catch (const IOError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK(error_of().empty());  // neither exists
  // A folder that takes no file, whoever runs this (access() says yes to root for /proc).
  CHECK_THROWS_WITH_AS(check_checkpoint_writable("/proc/nanoddp_test.ckpt"),
                       doctest::Contains(" in folder /proc: "), IOError);
  StateDict state;
  state["w"] = Tensor::from_vector({1, 2}, {2});
  save_checkpoint(path, state);
  save_checkpoint(previous, state);
  CHECK(error_of().empty());  // both ours
  CHECK(is_checkpoint_file(path));
  {
    std::ofstream out(previous, std::ios::trunc);
    out << "# My notes\n";
  }
  CHECK(!is_checkpoint_file(previous));
  CHECK(!is_checkpoint_file(path + ".absent"));
  // A FIFO is not opened (opening it would wait for a writer), so it is no checkpoint.
  const std::string fifo = path + ".fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK(!is_checkpoint_file(fifo));
  std::remove(fifo.c_str());
  const std::string m = error_of();
  CHECK_MESSAGE(m.find("refusing to replace " + previous + ": it is not a nanoddp checkpoint (it begins \"# My notes\")") !=
                    std::string::npos,
                m);
  std::remove(previous.c_str());
  // path.prev.tmp, where keep_previous_checkpoint stages path.prev, is checked the same way;
  // keep_previous_checkpoint itself leaves a foreign one alone and says so.
  const std::string staged = previous + ".tmp";
  {
    std::ofstream out(staged, std::ios::trunc);
    out << "# My notes\n";
  }
  CHECK(error_of().find("refusing to replace " + staged + ": it is not a nanoddp checkpoint") != std::string::npos);
  std::string kept_error;
  try {
    keep_previous_checkpoint(path);
  } catch (const IOError& e) {
    kept_error = e.what();
  }
  CHECK_MESSAGE(kept_error.find("refusing to replace " + staged + ", which is not a nanoddp checkpoint") !=
                    std::string::npos,
                kept_error);
  CHECK(!is_checkpoint_file(staged));  // still the notes
  CHECK(std::filesystem::exists(staged));
  std::remove(staged.c_str());
  // A folder at path.prev is refused before any work, not when the save renames onto it.
  std::filesystem::create_directory(previous);
  CHECK(error_of().find("checkpoint " + previous + " exists but is a folder") != std::string::npos);
  std::filesystem::remove(previous);
  // A leftover of a save that died while keeping the previous checkpoint is ours to replace.
  save_checkpoint(staged, state);
  CHECK(error_of().empty());
  keep_previous_checkpoint(path);
  CHECK(!std::filesystem::exists(staged));
  CHECK(load_checkpoint(previous).at("w").to_vector() == std::vector<float>{1, 2});
  // A save that died after keeping path.prev and before replacing path left the two linked
  // to one file: it is kept as it is, and no path.prev.tmp is left (a rename between two links
  // to one file does nothing).
  keep_previous_checkpoint(path);
  CHECK(std::filesystem::equivalent(path, previous));
  CHECK(!std::filesystem::exists(staged));
  // A path that does not load (truncated by a save that died, after a resume fell back to
  // path.prev) is not kept over path.prev, the one checkpoint that loads; with no path.prev
  // it is kept (nothing better is lost).
  save_checkpoint(path, state);  // a file of its own: path.prev was a link to the last one
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 1);
  keep_previous_checkpoint(path);
  CHECK(load_checkpoint(previous).at("w").to_vector() == std::vector<float>{1, 2});
  std::remove(previous.c_str());
  keep_previous_checkpoint(path);
  CHECK(std::filesystem::exists(previous));
  std::remove(path.c_str());
  std::remove(previous.c_str());
  // Through a symbolic link: link.prev keeps the file the link names, as it was; the save then
  // replaces that file, and link.prev still loads the old one.
  const std::string link = path + ".link", link_previous = link + ".prev";
  save_checkpoint(path, state);
  std::filesystem::create_symlink(std::filesystem::path(path).filename(), link);
  keep_previous_checkpoint(link);
  StateDict next = state;
  next["w"] = Tensor::from_vector({7.0f, 8.0f});
  save_checkpoint(link, next);
  CHECK(std::filesystem::is_symlink(link));
  CHECK(load_checkpoint(link).at("w").to_vector() == std::vector<float>{7, 8});
  CHECK(!std::filesystem::is_symlink(link_previous));
  CHECK(load_checkpoint(link_previous).at("w").to_vector() == std::vector<float>{1, 2});
  for (const std::string& file : {link, link_previous, path}) std::remove(file.c_str());
  // A link to another file system (/dev/shm is tmpfs) cannot be hard-linked: a copy is kept.
  const std::string elsewhere = "/dev/shm/nanoddp_test_" + std::to_string(::getpid()) + ".ckpt";
  struct stat here {
  }, there{};
  if (::stat("/dev/shm", &there) == 0 &&
      ::stat(std::filesystem::path(path).parent_path().c_str(), &here) == 0 && here.st_dev != there.st_dev) {
    save_checkpoint(elsewhere, state);
    std::filesystem::create_symlink(elsewhere, link);
    keep_previous_checkpoint(link);
    save_checkpoint(link, next);
    CHECK(load_checkpoint(link).at("w").to_vector() == std::vector<float>{7, 8});
    CHECK(load_checkpoint(link_previous).at("w").to_vector() == std::vector<float>{1, 2});
    for (const std::string& file : {link, link_previous, elsewhere}) std::remove(file.c_str());
  } else {
    MESSAGE("no other file system at /dev/shm: the cross-device copy is not tried");
  }
}

TEST_CASE("a single process learns y = 2x with Linear(1, 1) and SGD") {
  Generator gen(0);
  Linear model(1, 1, gen);
  SGD opt(model.parameters(), {/*lr=*/0.1});
  MSELoss loss_fn;
  std::vector<float> xs, ys;
  for (int i = 0; i < 16; ++i) {
    xs.push_back(i / 16.0f);
    ys.push_back(2.0f * i / 16.0f);
  }
  const Tensor x = Tensor::from_vector(xs, {16, 1}), y = Tensor::from_vector(ys, {16, 1});
  for (int step = 0; step < 2000; ++step) {
    opt.zero_grad();
    loss_fn(model(x), y).backward();
    opt.step();
  }
  CHECK(model.weight.item() == doctest::Approx(2.0f).epsilon(1e-3));
  CHECK(std::abs(model.bias.item()) < 1e-3);
}

namespace {
// Sequential(L, L) with one bias-free Linear(2, 2): y = x W^T W^T, loss = sum(y).
// x = [1, 1], W = [[.1, .2], [.3, .4]]: h = W x = [.3, .7]; dL/dh = W^T [1, 1] = [.4, .6];
// dL/dW = [1, 1]^T h + [.4, .6]^T x = [[.7, 1.1], [.9, 1.3]]; SGD lr 0.1 steps it once:
// W' = W - 0.1 dL/dW = [[.03, .09], [.21, .27]] (twice would give [[-.04, -.02], [.12, .14]]).
// Checks that model, whose weights are tied that way, lists the weight once, saves it under
// both names (torch: Sequential(l, l).state_dict() has "0.weight" and "1.weight"), wants both
// back, and steps it once.
void check_tied_pair(Sequential& model, Tensor weight) {
  weight.detach().copy_(Tensor::from_vector({0.1f, 0.2f, 0.3f, 0.4f}, {2, 2}));
  const auto named = model.named_parameters();
  REQUIRE(named.size() == 1);
  CHECK(named[0].first == "0.weight");  // the first name, as PyTorch's remove_duplicate
  CHECK(model.parameters().size() == 1);
  const auto every_name = model.named_parameters(/*remove_duplicate=*/false);
  REQUIRE(every_name.size() == 2);
  CHECK(every_name[1].first == "1.weight");
  CHECK(every_name[1].second.impl() == weight.impl());
  const StateDict state = model.state_dict();
  CHECK(state.size() == 2);
  CHECK(state.at("0.weight").to_vector() == weight.to_vector());
  CHECK(state.at("1.weight").to_vector() == weight.to_vector());

  SGD opt(model.parameters(), {/*lr=*/0.1});
  sum(model(Tensor::ones({1, 2}))).backward();
  const std::vector<float> grad = weight.grad().to_vector();
  const std::vector<float> want_grad = {0.7f, 1.1f, 0.9f, 1.3f};
  for (size_t i = 0; i < 4; ++i) CHECK(grad[i] == doctest::Approx(want_grad[i]).epsilon(1e-6));
  opt.step();
  const std::vector<float> w = weight.to_vector();
  const std::vector<float> want = {0.03f, 0.09f, 0.21f, 0.27f};
  for (size_t i = 0; i < 4; ++i) CHECK(w[i] == doctest::Approx(want[i]).epsilon(1e-6));

  // Loading restores the tied weight everywhere it is used; as torch's, strict loading wants
  // every name ("Missing key(s) in state_dict: "1.weight"").
  model.load_state_dict(state);
  CHECK(weight.to_vector() == state.at("0.weight").to_vector());
  StateDict one_name = state;
  one_name.erase("1.weight");
  std::string message;
  try {
    model.load_state_dict(one_name);
  } catch (const ValueError& e) {
    message = e.what();
  }
  CHECK_MESSAGE(message.find("missing: [1.weight]") != std::string::npos, message);
  const Module::IncompatibleKeys keys = model.load_state_dict(one_name, /*strict=*/false);
  CHECK(keys.missing_keys == std::vector<std::string>{"1.weight"});
}
}  // namespace

TEST_CASE("a module registered twice is one parameter: listed and stepped once, saved under both names") {
  Generator gen(0);
  auto shared = std::make_shared<Linear>(2, 2, gen, /*bias=*/false);
  Sequential model;
  model.add(shared);
  model.add(shared);
  check_tied_pair(model, shared->weight);
}

TEST_CASE("weights tied with register_parameter (PyTorch's decoder.weight = encoder.weight) train as one") {
  Generator gen(0);
  auto encoder = std::make_shared<Linear>(2, 2, gen, /*bias=*/false);
  auto decoder = std::make_shared<Linear>(2, 2, gen, /*bias=*/false);
  const Tensor replaced = decoder->weight;
  decoder->weight = decoder->register_parameter("weight", encoder->weight);
  CHECK(decoder->weight.impl() == encoder->weight.impl());
  Sequential model;
  model.add(encoder);
  model.add(decoder);
  // The same numbers as one module registered twice; the replaced tensor is gone from the model.
  check_tied_pair(model, encoder->weight);
  for (const auto& entry : model.named_parameters(/*remove_duplicate=*/false)) CHECK(entry.second.impl() != replaced.impl());
}

TEST_CASE("a frozen weight tied to another module stays frozen, as torch's assigned nn.Parameter") {
  // torch: enc.weight.requires_grad_(False); dec.weight = enc.weight -> still frozen, and an
  // optimizer over every parameter leaves it unchanged. A new tensor (its detach()) is
  // wrapped as torch's nn.Parameter(t) is: it requires grad.
  Generator gen(0);
  auto encoder = std::make_shared<Linear>(2, 2, gen, /*bias=*/false);
  auto decoder = std::make_shared<Linear>(2, 2, gen);
  encoder->weight.set_requires_grad(false);
  decoder->weight = decoder->register_parameter("weight", encoder->weight);
  CHECK(!decoder->weight.requires_grad());
  Sequential model;
  model.add(encoder);
  model.add(decoder);
  const std::vector<float> before = encoder->weight.to_vector();
  SGD sgd(model.parameters(), {/*lr=*/0.5});
  sum(model.forward(Tensor::ones({3, 2}))).backward();
  sgd.step();
  CHECK(encoder->weight.to_vector() == before);
  CHECK(decoder->register_parameter("copy", encoder->weight.detach()).requires_grad());
}

TEST_CASE("load_state_dict names every key that cannot load in one error, as torch, and loads nothing") {
  Generator g1(1), g2(2);
  Sequential a = mlp(g1), b = mlp(g2);
  StateDict state = a.state_dict();
  state["0.weight"] = Tensor::zeros({3, 5});
  state["2.bias"] = Tensor::zeros({7});
  const std::vector<float> before = b.parameters()[0].to_vector();
  // Only shapes wrong: a ShapeError with both entries, strict or not.
  for (bool strict : {true, false}) {
    CAPTURE(strict);
    CHECK_THROWS_WITH_AS(
        b.load_state_dict(state, strict),
        doctest::Contains("load_state_dict: '0.weight' is [3, 5] float32 in the state but [3, 4] "
                          "float32 in the model; '2.bias' is [7] float32 in the state but [2] "
                          "float32 in the model"),
        ShapeError);
  }
  // A key missing too: one ValueError with the keys, then the shapes (torch lists all three).
  state.erase("0.bias");
  CHECK_THROWS_WITH_AS(
      b.load_state_dict(state),
      doctest::Contains("load_state_dict: keys do not match. missing: [0.bias], unexpected: []. "
                        "Also '0.weight' is [3, 5] float32 in the state but [3, 4] float32 in the "
                        "model; '2.bias' is [7] float32 in the state but [2] float32 in the model"),
      ValueError);
  CHECK(b.parameters()[0].to_vector() == before);
}

TEST_CASE("load_state_dict(strict = false) returns the missing and unexpected keys") {
  Generator g1(1), g2(2);
  Sequential a = mlp(g1), b = mlp(g2);
  Module::IncompatibleKeys exact = b.load_state_dict(a.state_dict(), /*strict=*/false);
  CHECK(exact.empty());

  // The classic mistake: a DDP checkpoint ("module.0.weight") loaded into the bare model.
  StateDict prefixed;
  for (auto& [name, t] : a.state_dict()) prefixed["module." + name] = t;
  const std::vector<float> before = b.parameters()[0].to_vector();
  Module::IncompatibleKeys keys = b.load_state_dict(prefixed, /*strict=*/false);
  CHECK(keys.missing_keys == std::vector<std::string>{"0.bias", "0.weight", "2.bias", "2.weight"});
  CHECK(keys.unexpected_keys ==
        std::vector<std::string>{"module.0.bias", "module.0.weight", "module.2.bias", "module.2.weight"});
  CHECK(b.parameters()[0].to_vector() == before);  // nothing matched, nothing loaded
  // Strict, the same mistake is named, in both directions, with what to do.
  auto strict_error = [](Module& model, const StateDict& state) {
    try {
      model.load_state_dict(state);
    } catch (const ValueError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  std::string message = strict_error(b, prefixed);
  CHECK_MESSAGE(message.find("missing: [0.bias, 0.weight, 2.bias, 2.weight], unexpected: [module.0.bias, "
                             "module.0.weight, module.2.bias, module.2.weight]. The state's keys carry the "
                             "'module.' prefix") != std::string::npos,
                message);
  CHECK(strict_error(b, strip_prefix(prefixed, "module.")).empty());
  CHECK(b.parameters()[0].to_vector() == a.parameters()[0].to_vector());
  struct Wrapper : Module {  // names its child "module", as DistributedDataParallel does
    std::shared_ptr<Sequential> inner;
    explicit Wrapper(std::shared_ptr<Sequential> model)
        : inner(register_module("module", std::move(model))) {}
    Tensor forward(const Tensor& x) override { return (*inner)(x); }
  };
  Generator g3(3);
  Wrapper wrapped(std::make_shared<Sequential>(mlp(g3)));
  message = strict_error(wrapped, a.state_dict());
  CHECK_MESSAGE(
      message.find("]. This model is a DistributedDataParallel (keys 'module.*')") != std::string::npos,
      message);
  message = strict_error(b, [&] {
    StateDict mixed = prefixed;
    mixed["module.3.weight"] = Tensor::zeros({1});  // not a model key once unprefixed: no hint
    return mixed;
  }());
  CHECK(message.find("missing: [") != std::string::npos);
  CHECK(message.find("prefix") == std::string::npos);
  message = strict_error(b, [&] {
    StateDict short_one = prefixed;
    short_one.erase("module.0.bias");  // stripping the prefix would still leave 0.bias missing: no hint
    return short_one;
  }());
  CHECK_MESSAGE(message.find("missing: [0.bias, 0.weight, 2.bias, 2.weight], unexpected: [module.0.weight, "
                             "module.2.bias, module.2.weight]") != std::string::npos,
                message);
  CHECK(message.find("prefix") == std::string::npos);
  // With a batch norm, whose counter the state may lack (it loads as 0): its prefixed key is
  // only unexpected, and the hint still comes, both ways.
  auto normed = [] {
    Sequential m;
    m.add(Linear(2, 2));
    m.add(BatchNorm1d(2));
    return m;
  };
  Sequential plain_bn = normed();
  StateDict prefixed_bn;
  for (auto& [name, t] : plain_bn.state_dict()) prefixed_bn["module." + name] = t;
  message = strict_error(plain_bn, prefixed_bn);
  CHECK_MESSAGE(message.find("unexpected: [module.0.bias, module.0.weight, module.1.bias, "
                             "module.1.num_batches_tracked, module.1.running_mean") != std::string::npos,
                message);
  CHECK_MESSAGE(message.find("The state's keys carry the 'module.' prefix") != std::string::npos, message);
  struct WrapperBn : Module {
    std::shared_ptr<Sequential> inner;
    explicit WrapperBn(std::shared_ptr<Sequential> model)
        : inner(register_module("module", std::move(model))) {}
    Tensor forward(const Tensor& x) override { return (*inner)(x); }
  };
  WrapperBn wrapped_bn(std::make_shared<Sequential>(normed()));
  message = strict_error(wrapped_bn, plain_bn.state_dict());
  CHECK_MESSAGE(
      message.find("This model is a DistributedDataParallel (keys 'module.*')") != std::string::npos,
      message);

  // A partial state loads what matches and names the rest.
  StateDict partial = a.state_dict();
  partial.erase("2.bias");
  partial["3.weight"] = Tensor::zeros({1});
  keys = b.load_state_dict(partial, /*strict=*/false);
  CHECK(keys.missing_keys == std::vector<std::string>{"2.bias"});
  CHECK(keys.unexpected_keys == std::vector<std::string>{"3.weight"});
  CHECK(b.parameters()[0].to_vector() == a.parameters()[0].to_vector());
}

TEST_CASE("a checkpoint of model, Adam and scheduler resumes to the identical trajectory") {
  // Linear(3, 2) fitted to fixed targets with AdamW (amsgrad) under a LinearLR warm-up: 6
  // steps straight, or 3 steps, a checkpoint file, fresh objects loaded from it, 3 more.
  struct Run {
    const Tensor x = Tensor::from_vector({1, -2, 0.5f, 0.25f, 3, -1}, {2, 3});
    const Tensor y = Tensor::from_vector({0.5f, -1, 2, 0}, {2, 2});
    Generator gen{5};
    Linear model{3, 2, gen};
    AdamW opt{model.parameters(), {/*lr=*/0.05, {0.9f, 0.99f}, 1e-8f, /*weight_decay=*/0.01f, /*amsgrad=*/true}};
    LinearLR schedule{opt, /*start_factor=*/0.25, /*end_factor=*/1.0, /*total_iters=*/4};
    void train(int steps) {
      for (int i = 0; i < steps; ++i) {
        opt.zero_grad();
        mse_loss(model(x), y).backward();
        opt.step();
        schedule.step();
      }
    }
  };
  Run straight;
  straight.train(6);
  Run first;
  first.train(3);
  StateDict state;
  merge_prefixed(state, "model.", first.model.state_dict());
  merge_prefixed(state, "optimizer.", first.opt.state_dict());
  merge_prefixed(state, "scheduler.", first.schedule.state_dict());
  const std::string path = temp_path("adam_ckpt");
  save_checkpoint(path, state);
  const StateDict loaded = load_checkpoint(path);
  std::remove(path.c_str());
  Run resumed;
  resumed.model.load_state_dict(strip_prefix(loaded, "model."));
  resumed.opt.load_state_dict(strip_prefix(loaded, "optimizer."));
  resumed.schedule.load_state_dict(strip_prefix(loaded, "scheduler."));
  CHECK(resumed.opt.lr() == first.opt.lr());
  resumed.train(3);
  for (size_t i = 0; i < 2; ++i) CHECK(resumed.model.parameters()[i].to_vector() == straight.model.parameters()[i].to_vector());
  CHECK(resumed.opt.state_dict().at("exp_avg_sq.0").to_vector() == straight.opt.state_dict().at("exp_avg_sq.0").to_vector());
  CHECK(resumed.schedule.get_last_lr() == straight.schedule.get_last_lr());
  CHECK(resumed.schedule.last_epoch() == 6);
}

namespace {
// A layer with state of both kinds: "steps" (int64 scalar, saved, as BatchNorm's
// num_batches_tracked) and "scratch" (float, not saved: persistent = false).
class Counted : public Module {
 public:
  explicit Counted(Generator& gen) : linear_(register_module("linear", std::make_shared<Linear>(2, 2, gen))) {
    steps = register_buffer("steps", Tensor::zeros(Shape{}, DType::Int64));
    scratch = register_buffer("scratch", Tensor::full({3}, 1.5f), /*persistent=*/false);
  }
  Tensor forward(const Tensor& x) override { return (*linear_)(x); }
  Tensor steps, scratch;

 private:
  std::shared_ptr<Linear> linear_;
};
}  // namespace

TEST_CASE("buffers: dotted names depth-first, listed once, persistent ones in state_dict under every name with their dtype") {
  Generator gen(3);
  auto shared = std::make_shared<Counted>(gen);
  Sequential model;
  model.add(shared);
  model.add(ReLU());
  model.add(std::make_shared<Counted>(gen));
  model.add(shared);  // reachable twice: one set of buffers, under its first name
  std::vector<std::string> names;
  for (auto& [name, b] : model.named_buffers()) names.push_back(name);
  CHECK(names == std::vector<std::string>{"0.steps", "0.scratch", "2.steps", "2.scratch"});
  CHECK(model.buffers().size() == 4);
  CHECK(model.buffers()[0].is_same(shared->steps));

  shared->steps.data<int64_t>()[0] = 1LL << 40;
  const StateDict state = model.state_dict();
  std::vector<std::string> keys;
  for (auto& [name, t] : state) keys.push_back(name);
  // state_dict keeps every name of the shared module's tensors, as torch's does.
  CHECK(keys == std::vector<std::string>{"0.linear.bias", "0.linear.weight", "0.steps", "2.linear.bias",
                                         "2.linear.weight", "2.steps", "3.linear.bias", "3.linear.weight",
                                         "3.steps"});
  CHECK(state.at("3.steps").to_int_vector() == std::vector<int64_t>{1LL << 40});
  CHECK(state.at("0.steps").dtype() == DType::Int64);
  CHECK(state.at("0.steps").dim() == 0);
  CHECK(state.at("0.steps").to_int_vector() == std::vector<int64_t>{1LL << 40});
  CHECK_FALSE(state.at("0.steps").is_same(shared->steps));  // a copy, as torch's detach().clone()

  // load_state_dict writes into the registered handles and reports a missing buffer.
  StateDict changed = state;
  changed["2.steps"] = Tensor::from_vector(std::vector<int64_t>{9}).reshape(Shape{});
  Generator other(4);
  Sequential target;
  auto first = std::make_shared<Counted>(other), second = std::make_shared<Counted>(other);
  target.add(first);
  target.add(ReLU());
  target.add(second);
  target.add(first);
  target.load_state_dict(changed);
  CHECK(first->steps.to_int_vector() == std::vector<int64_t>{1LL << 40});
  CHECK(second->steps.to_int_vector() == std::vector<int64_t>{9});
  changed.erase("2.steps");
  CHECK(target.load_state_dict(changed, /*strict=*/false).missing_keys == std::vector<std::string>{"2.steps"});
  changed["2.steps"] = Tensor::zeros(Shape{});  // float32 where int64 is registered
  CHECK_THROWS_AS(target.load_state_dict(changed), ShapeError);
  CHECK(second->steps.to_int_vector() == std::vector<int64_t>{9});  // untouched

  // to() keeps the handles of buffers as of parameters.
  const Tensor before = shared->steps;
  model.to(Device::cpu());
  CHECK(model.buffers()[0].is_same(before));
}

TEST_CASE("buffers survive a checkpoint file and a safetensors file (int64 as I64) into a fresh model") {
  Generator g1(5), g2(6);
  Counted a(g1), b(g2);
  a.steps.data<int64_t>()[0] = 42;
  const std::string path = temp_path("buffers.ckpt");
  save_checkpoint(path, a.state_dict());
  b.load_state_dict(load_checkpoint(path));
  CHECK(b.steps.to_int_vector() == std::vector<int64_t>{42});
  CHECK(b.steps.dim() == 0);
  CHECK(b.scratch.to_vector() == std::vector<float>{1.5f, 1.5f, 1.5f});  // not persistent: not in the file
  CHECK(load_checkpoint(path).count("scratch") == 0);
  std::remove(path.c_str());

  Generator g3(7);
  Counted c(g3);
  a.steps.data<int64_t>()[0] = -3;
  const std::string exported = temp_path("buffers.safetensors");
  save_safetensors(exported, a.state_dict());
  c.load_state_dict(load_safetensors(exported));
  CHECK(c.steps.dtype() == DType::Int64);
  CHECK(c.steps.to_int_vector() == std::vector<int64_t>{-3});
  CHECK(c.state_dict().at("linear.weight").to_vector() == a.state_dict().at("linear.weight").to_vector());
  std::remove(exported.c_str());
}

TEST_CASE("register_parameter, register_buffer and register_module: torch's name rules, re-registering replaces") {
  // torch.nn.Module raises KeyError for an empty name, a dotted one, and a name taken by
  // another kind ("attribute 'x' already exists"); the same kind's name is replaced in place.
  struct Probe : Module {
    Tensor forward(const Tensor& x) override { return x; }
  } probe;
  probe.register_parameter("w", Tensor::zeros({1}));
  probe.register_buffer("b", Tensor::zeros({1}));
  probe.register_module("m", std::make_shared<Flatten>());
  const auto message_of = [](const auto& call) {
    try {
      call();
    } catch (const ValueError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  for (const char* name : {"", "a.b"}) {
    CAPTURE(name);
    CHECK_THROWS_AS(probe.register_parameter(name, Tensor::zeros({1})), ValueError);
    CHECK_THROWS_AS(probe.register_buffer(name, Tensor::zeros({1})), ValueError);
    CHECK_THROWS_AS(probe.register_module(name, std::make_shared<Flatten>()), ValueError);
  }
  CHECK_THROWS_AS(probe.register_parameter("p", Tensor()), ValueError);
  CHECK_THROWS_AS(probe.register_buffer("p", Tensor()), ValueError);
  CHECK_THROWS_AS(probe.register_module("p", std::shared_ptr<Flatten>()), ValueError);
  CHECK(message_of([&] { probe.register_parameter("b", Tensor::zeros({1})); })
            .rfind("register_parameter: 'b' is already a buffer of this module", 0) == 0);
  CHECK(message_of([&] { probe.register_buffer("w", Tensor::zeros({1})); })
            .rfind("register_buffer: 'w' is already a parameter of this module", 0) == 0);
  CHECK(message_of([&] { probe.register_module("w", std::make_shared<Flatten>()); })
            .rfind("register_module: 'w' is already a parameter of this module", 0) == 0);
  CHECK(message_of([&] { probe.register_parameter("m", Tensor::zeros({1})); })
            .rfind("register_parameter: 'm' is already a submodule of this module", 0) == 0);
  // An op's output never gets a .grad, so it would never train (torch: "Cannot assign non-leaf
  // Tensor to parameter"); its detach() is a leaf.
  const Tensor base = Tensor::ones({1}).set_requires_grad(true);
  Probe other;
  CHECK(message_of([&] { other.register_parameter("x", base * 2.0f); })
            .rfind(
                "register_parameter: parameter 'x' is an op's output (made by MulScalarBackward), not a leaf",
                0) == 0);
  CHECK(other.parameters().empty());
  CHECK(other.register_parameter("x", (base * 2.0f).detach()).is_leaf());

  // Replacing keeps the place and the count.
  probe.register_parameter("v", Tensor::zeros({1}));
  probe.register_parameter("w", Tensor::ones({3}));
  const auto params = probe.named_parameters();
  REQUIRE(params.size() == 2);
  CHECK(params[0].first == "w");
  CHECK(params[0].second.to_vector() == std::vector<float>{1, 1, 1});
  CHECK(params[0].second.requires_grad());
  probe.register_buffer("b", Tensor::full({2}, 5.0f), /*persistent=*/false);
  REQUIRE(probe.buffers().size() == 1);
  CHECK(probe.buffers()[0].to_vector() == std::vector<float>{5, 5});
  CHECK(probe.state_dict().count("b") == 0);  // now not persistent
  auto linear = std::make_shared<Linear>(1, 2, default_generator());
  probe.register_module("m", linear);
  const auto names = probe.named_parameters();
  REQUIRE(names.size() == 4);
  CHECK(names[2].first == "m.weight");
  CHECK(names[3].first == "m.bias");

  // A Sequential runs its registered children: the one replaced in "1" is the one that runs,
  // as torch's Sequential runs its _modules. Linear(2, 1), W = [[1, 2]], b = 0: [3, 4] -> 11.
  Sequential seq;
  seq.add(Flatten());
  seq.add(Flatten());
  auto head = std::make_shared<Linear>(2, 1, default_generator());
  head->weight.detach().copy_(Tensor::from_vector({1, 2}, {1, 2}));
  head->bias.detach().zero_();
  seq.register_module("1", head);
  REQUIRE(seq.size() == 2);
  CHECK(&seq[1] == head.get());
  CHECK(&seq[-1] == head.get());  // torch's seq[-1]
  CHECK(&seq[-2] == &seq[0]);
  for (int64_t bad : {2, -3}) {
    CAPTURE(bad);
    try {
      seq[bad];
      FAIL("Sequential accepted index ", bad);
    } catch (const IndexError& e) {
      CHECK(std::string(e.what()).rfind("Sequential: index " + std::to_string(bad) + " is out of range (2 modules)", 0) ==
            0);
    }
  }
  CHECK(seq(Tensor::from_vector({3, 4}, {1, 2})).to_vector() == std::vector<float>{11});
  CHECK(seq.named_parameters().size() == 2);
  CHECK(seq.named_parameters()[0].first == "1.weight");
}

namespace {
void check_close(const std::vector<float>& got, const std::vector<double>& want) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    CAPTURE(i);
    CHECK(got[i] == doctest::Approx(want[i]).epsilon(1e-6));
  }
}
}  // namespace

TEST_CASE("BatchNorm1d running statistics after 2 steps, by hand in float64 (momentum 0.1, unbiased var)") {
  // Step 1, x [3, 2]: channel 0 = {1, 3, 5}: mean 3, biased var 8/3, unbiased 4;
  //                   channel 1 = {2, 6, 10}: mean 6, biased var 32/3, unbiased 16.
  // Step 2, x [2, 2]: channel 0 = {0, 4}: mean 2, unbiased var 8; channel 1 = {-1, 3}: mean 1, unbiased 8.
  // running_mean: 0.9 * 0 + 0.1 * 3 = 0.3, then 0.9 * 0.3 + 0.1 * 2 = 0.47; channel 1: 0.6, then 0.64.
  // running_var:  0.9 * 1 + 0.1 * 4 = 1.3, then 0.9 * 1.3 + 0.1 * 8 = 1.97; channel 1: 2.5, then 3.05.
  BatchNorm1d norm(2);
  CHECK(norm.running_mean.to_vector() == std::vector<float>{0, 0});
  CHECK(norm.running_var.to_vector() == std::vector<float>{1, 1});
  const Tensor y = norm(Tensor::from_vector({1, 2, 3, 6, 5, 10}, {3, 2}));
  const double s0 = std::sqrt(8.0 / 3 + 1e-5), s1 = std::sqrt(32.0 / 3 + 1e-5);
  check_close(y.to_vector(), {-2 / s0, -4 / s1, 0, 0, 2 / s0, 4 / s1});  // normalised by the biased var
  check_close(norm.running_mean.to_vector(), {0.3, 0.6});
  check_close(norm.running_var.to_vector(), {1.3, 2.5});
  norm(Tensor::from_vector({0, -1, 4, 3}, {2, 2}));
  check_close(norm.running_mean.to_vector(), {0.47, 0.64});
  check_close(norm.running_var.to_vector(), {1.97, 3.05});
  CHECK(norm.num_batches_tracked.to_int_vector() == std::vector<int64_t>{2});

  // eval: the running statistics, and nothing is updated.
  norm.eval();
  check_close(norm(Tensor::from_vector({1, 1}, {1, 2})).to_vector(),
              {(1 - 0.47) / std::sqrt(1.97 + 1e-5), (1 - 0.64) / std::sqrt(3.05 + 1e-5)});
  check_close(norm.running_mean.to_vector(), {0.47, 0.64});
  CHECK(norm.num_batches_tracked.to_int_vector() == std::vector<int64_t>{2});

  const StateDict state = norm.state_dict();
  CHECK(state.size() == 5);  // weight, bias, running_mean, running_var, num_batches_tracked
  CHECK(state.at("num_batches_tracked").dtype() == DType::Int64);
}

TEST_CASE("BatchNorm1d momentum = nullopt is the cumulative average; [N, C, L] counts N * L values") {
  // The same two steps: running_mean = mean of the batch means = (3 + 2) / 2, (6 + 1) / 2;
  // running_var = mean of the unbiased vars = (4 + 8) / 2, (16 + 8) / 2.
  BatchNorm1d cumulative(2, 1e-5f, std::nullopt);
  cumulative(Tensor::from_vector({1, 2, 3, 6, 5, 10}, {3, 2}));
  cumulative(Tensor::from_vector({0, -1, 4, 3}, {2, 2}));
  check_close(cumulative.running_mean.to_vector(), {2.5, 3.5});
  check_close(cumulative.running_var.to_vector(), {6, 12});

  // x [2, 1, 2]: channel 0 = {1, 3, 5, 7}: mean 4, biased var 5, unbiased 20/3.
  BatchNorm1d sequence(1);
  const Tensor y = sequence(Tensor::from_vector({1, 3, 5, 7}, {2, 1, 2}));
  CHECK(y.shape() == Shape{2, 1, 2});
  const double s = std::sqrt(5 + 1e-5);
  check_close(y.to_vector(), {-3 / s, -1 / s, 1 / s, 3 / s});
  check_close(sequence.running_mean.to_vector(), {0.4});
  check_close(sequence.running_var.to_vector(), {0.9 + 0.1 * 20.0 / 3});
}

TEST_CASE(
    "load_state_dict: only a batch norm's missing counter loads as 0; a [1] value fills a 0-d entry, as "
    "torch 1.13") {
  // A module of its own with a buffer that happens to be called num_batches_tracked: torch
  // reports it missing and leaves it; only _NormBase zeroes its counter.
  const auto counter = [](int64_t v) {
    return Tensor::from_vector(std::vector<int64_t>{v}).reshape(Shape{});
  };
  struct Counting : Module {
    explicit Counting(const Tensor& count) {
      num_batches_tracked = register_buffer("num_batches_tracked", count);
      scale = register_parameter("scale", Tensor::full(Shape{}, 2.0f));
    }
    Tensor forward(const Tensor& x) override { return x * scale; }
    Tensor num_batches_tracked, scale;
  };
  Counting counting(counter(7));
  const Module::IncompatibleKeys keys = counting.load_state_dict({}, /*strict=*/false);
  CHECK(keys.missing_keys == std::vector<std::string>{"num_batches_tracked", "scale"});
  CHECK(counting.num_batches_tracked.to_int_vector() == std::vector<int64_t>{7});
  CHECK_THROWS_WITH_AS(counting.load_state_dict({{"scale", Tensor::full(Shape{}, 1.0f)}}),
                       doctest::Contains("missing: [num_batches_tracked]"), ValueError);
  // torch 1.13: a [1] value loads into a 0-d parameter. A [2] one is refused here, where torch
  // would load its first element.
  counting.load_state_dict({{"scale", Tensor::from_vector({5.0f})},
                            {"num_batches_tracked", Tensor::from_vector(std::vector<int64_t>{3})}});
  CHECK(counting.scale.shape() == Shape{});
  CHECK(counting.scale.to_vector() == std::vector<float>{5.0f});
  CHECK(counting.num_batches_tracked.to_int_vector() == std::vector<int64_t>{3});
  CHECK_THROWS_WITH_AS(counting.load_state_dict({{"scale", Tensor::from_vector({1.0f, 2.0f})},
                                                 {"num_batches_tracked", counter(1)}}),
                       doctest::Contains("'scale' is [2]"), ShapeError);
  // A batch norm's counter, inside a Sequential, still loads as 0 when the state lacks it.
  Sequential net;
  auto norm = std::make_shared<BatchNorm1d>(2);
  net.add(norm);
  norm->num_batches_tracked.copy_(counter(4));
  StateDict without = net.state_dict();
  without.erase("0.num_batches_tracked");
  CHECK(net.load_state_dict(without).missing_keys.empty());
  CHECK(norm->num_batches_tracked.to_int_vector() == std::vector<int64_t>{0});
}

TEST_CASE(
    "batch_norm: eps = 0 on a constant channel gives the bias and no gradient; in eval a NaN input spoils no "
    "gradient") {
  // torch.nn.functional.batch_norm: 1 / sqrt(var + eps) is 0 where both are 0 (training).
  const Tensor x = Tensor::from_vector({5, 1, 5, 2, 5, 3}, {3, 2});
  Tensor input = x.clone().set_requires_grad(true);
  Tensor weight = Tensor::from_vector({2, 3}).set_requires_grad(true);
  Tensor bias = Tensor::from_vector({0.5f, -1}).set_requires_grad(true);
  const Tensor y = batch_norm(input, Tensor(), Tensor(), weight, bias, /*training=*/true, 0.1f, /*eps=*/0.0f);
  sum(y * Tensor::from_vector({1, 2, 3, 4, 5, 6}, {3, 2})).backward();
  // Channel 1: mean 2, var 2/3; y = (x - 2) sqrt(3/2) 3 - 1.
  const double s = std::sqrt(1.5);
  const std::vector<float> out = y.to_vector();
  CHECK(out[0] == 0.5f);
  CHECK(out[2] == 0.5f);
  CHECK(out[4] == 0.5f);
  CHECK(out[1] == doctest::Approx(-s * 3 - 1).epsilon(1e-6));
  CHECK(out[3] == -1.0f);
  CHECK(out[5] == doctest::Approx(s * 3 - 1).epsilon(1e-6));
  const std::vector<float> dx = input.grad().to_vector();
  CHECK(dx[0] == 0.0f);
  CHECK(dx[2] == 0.0f);
  CHECK(dx[4] == 0.0f);
  for (float v : dx) CHECK(std::isfinite(v));
  CHECK(weight.grad().to_vector()[0] == 0.0f);
  CHECK(bias.grad().to_vector()[0] == 9.0f);  // 1 + 3 + 5
  // Channel 1: dy = (2, 4, 6), xhat = (-1, 0, 1) sqrt(3/2), so dweight = (6 - 2) sqrt(3/2).
  CHECK(weight.grad().to_vector()[1] == doctest::Approx(4 * s).epsilon(1e-6));

  // Eval: the running statistics are constants, so dx = dy weight invstd, whatever x is: finite
  // for every element, the NaN's own included, as in torch.
  Tensor sample = Tensor::from_vector({1, NAN, 2, 3}, {2, 2}).set_requires_grad(true);
  batch_norm(sample, Tensor::zeros({2}), Tensor::ones({2}), Tensor(), Tensor(), /*training=*/false)
      .backward(Tensor::ones({2, 2}));
  const float invstd = static_cast<float>(1 / std::sqrt(1.0 + double(1e-5f)));
  CHECK(sample.grad().to_vector() == std::vector<float>(4, invstd));
}

TEST_CASE("BatchNorm1d without running stats normalises with the batch in eval too; bad input is refused") {
  BatchNorm1d norm(2, 1e-5f, 0.1f, /*affine=*/false, /*track_running_stats=*/false);
  CHECK(norm.parameters().empty());
  CHECK(norm.buffers().empty());
  CHECK(norm.state_dict().empty());
  const Tensor x = Tensor::from_vector({1, 2, 3, 6, 5, 10}, {3, 2});
  const std::vector<float> training = norm(x).to_vector();
  norm.eval();
  CHECK(norm(x).to_vector() == training);

  BatchNorm1d tracked(2);
  // torch checks the rank before it counts the batch (_check_input_dim), the rest after.
  CHECK_THROWS_AS(tracked(Tensor::zeros({2, 2, 2, 2})), ShapeError);  // 4-d
  CHECK_THROWS_AS(tracked(Tensor::zeros({2})), ShapeError);           // 1-d
  CHECK(tracked.num_batches_tracked.to_int_vector() == std::vector<int64_t>{0});
  CHECK_THROWS_AS(tracked(Tensor::from_vector({1, 2}, {1, 2})), ValueError);  // one value per channel
  CHECK_THROWS_AS(tracked(Tensor::zeros({4, 3})), ShapeError);                // 3 channels, not 2
  CHECK(tracked.num_batches_tracked.to_int_vector() == std::vector<int64_t>{2});
  // A state without the counter (weights exported without it) loads strictly and sets it to
  // 0, as torch's _NormBase does for a plain dict; the other keys are still required.
  StateDict without_counter = tracked.state_dict();
  without_counter.erase("num_batches_tracked");
  CHECK(tracked.load_state_dict(without_counter).empty());
  CHECK(tracked.num_batches_tracked.to_int_vector() == std::vector<int64_t>{0});
  tracked.num_batches_tracked.copy_(Tensor::from_vector(std::vector<int64_t>{2}).reshape(Shape{}));
  without_counter.erase("running_var");
  CHECK_THROWS_WITH_AS(tracked.load_state_dict(without_counter), doctest::Contains("missing: [running_var]"),
                       ValueError);
  // A refused load changes nothing.
  CHECK(tracked.num_batches_tracked.to_int_vector() == std::vector<int64_t>{2});
  // A submodule's counter too ("1.num_batches_tracked").
  Generator gen(4);
  Sequential net;
  net.add(Linear(2, 2, gen));
  auto inner = std::make_shared<BatchNorm1d>(2);
  net.add(inner);
  inner->num_batches_tracked.copy_(Tensor::from_vector(std::vector<int64_t>{5}).reshape(Shape{}));
  StateDict net_state = net.state_dict();
  net_state.erase("1.num_batches_tracked");
  CHECK(net.load_state_dict(net_state).empty());
  CHECK(inner->num_batches_tracked.to_int_vector() == std::vector<int64_t>{0});
  tracked.eval();
  CHECK(tracked(Tensor::from_vector({1, 2}, {1, 2})).to_vector() ==  // eval: one sample is fine
        std::vector<float>{static_cast<float>(1 / std::sqrt(1 + 1e-5)), static_cast<float>(2 / std::sqrt(1 + 1e-5))});
  CHECK_THROWS_AS(BatchNorm1d(0), ValueError);
}

TEST_CASE("max_pool2d refuses an input with no channel, row or column, as torch; an empty batch is fine") {
  for (const Shape& shape : {Shape{1, 0, 4, 4}, Shape{1, 2, 0, 4}, Shape{1, 2, 4, 0}}) {
    CAPTURE(shape);
    CHECK_THROWS_WITH_AS(max_pool2d(Tensor::zeros(shape), 2, 2, 1),
                         doctest::Contains("has no channel, row or column"), ShapeError);
  }
  CHECK(max_pool2d(Tensor::zeros({0, 2, 4, 4}), 2, 2).shape() == Shape{0, 2, 2, 2});
  // An empty batch may claim any plane: its size is refused before any window is looked at
  // (the scan of 2^40 rows would take most of an hour).
  CHECK_THROWS_WITH_AS(max_pool2d(Tensor::zeros({0, 1, int64_t{1} << 40, 2}), 2, 1),
                       doctest::Contains("at most 2^31 - 1 are supported"), ValueError);
}

TEST_CASE("max_pool2d(x, k) strides by the kernel, as torch's default stride") {
  Generator gen(5);
  const Tensor x = Tensor::randn({2, 3, 6, 4}, gen);
  CHECK(max_pool2d(x, 2).to_vector() == max_pool2d(x, 2, 2).to_vector());
  CHECK(max_pool2d(x, {3, 2}).shape() == Shape{2, 3, 2, 2});
}

TEST_CASE("max_pool2d refuses a window that covers only padding, naming it (no write outside the input)") {
  // Kernel 2, dilation 2, padding 1 over a 1x1 input: the one window looks at -1 and 1.
  const Tensor one = Tensor::ones({1, 1, 1, 1}).set_requires_grad(true);
  try {
    MaxPool2d(2, /*stride=*/1, /*padding=*/1, /*dilation=*/2)(one);
    FAIL("max_pool2d accepted a window of padding only");
  } catch (const ValueError& e) {
    CHECK(std::string(e.what()).find("output row 0 covers only padding") != std::string::npos);
  }
  // The same layer over a 3x3 input: output 3x3, window rows (and columns) {1}, {0, 2}, {1};
  // every window sees an element. By hand: 9 4 times, 6 and 8 twice, 7 once.
  //   1 2 3        9 6 9
  //   4 9 6   ->   8 7 8
  //   7 8 5        9 6 9
  const Tensor x = Tensor::from_vector({1, 2, 3, 4, 9, 6, 7, 8, 5}, {1, 1, 3, 3}).set_requires_grad(true);
  const Tensor y = MaxPool2d(2, 1, 1, 2)(x);
  CHECK(y.to_vector() == std::vector<float>{9, 6, 9, 8, 7, 8, 9, 6, 9});
  sum(y).backward();
  CHECK(x.grad().to_vector() == std::vector<float>{0, 0, 0, 0, 4, 2, 1, 2, 0});
}

TEST_CASE("a kernel dilated and padded far past the image: only the taps inside it cost, as torch's values") {
  // conv2d of a 4x4 image with a 3x3 kernel, padding d and dilation d: for d >= 4 only the
  // centre tap meets the image, so out = 5 x (the centre weight) + 0.5 (torch 1.13 gives this
  // for d up to 2^61), dx = 5 dout, dw = 0 but its centre, sum(x dout). The padded plane
  // would be (4 + 2d)^2 floats: 68 GB at d = 2^16; at 2^61 its size overflowed.
  const std::vector<float> image = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
  std::vector<float> want;
  for (float v : image) want.push_back(5 * v + 0.5f);
  for (const int64_t d : {int64_t{4}, int64_t{1000}, int64_t{1} << 16, int64_t{1} << 31, int64_t{1} << 61}) {
    CAPTURE(d);
    const Tensor x = Tensor::from_vector(image, {1, 1, 4, 4}).set_requires_grad(true);
    std::vector<float> kernel(9, 100.0f);
    kernel[4] = 5.0f;
    const Tensor w = Tensor::from_vector(kernel, {1, 1, 3, 3}).set_requires_grad(true);
    const Tensor b = Tensor::from_vector({0.5f}).set_requires_grad(true);
    const Tensor y = conv2d(x, w, b, /*stride=*/1, /*padding=*/d, /*dilation=*/d);
    CHECK(y.to_vector() == want);
    sum(y).backward();
    CHECK(x.grad().to_vector() == std::vector<float>(16, 5.0f));
    std::vector<float> dw(9, 0.0f);
    dw[4] = 136.0f;  // 1 + 2 + ... + 16
    CHECK(w.grad().to_vector() == dw);
  }
  CHECK_THROWS_WITH_AS(conv2d(Tensor::zeros({1, 1, 4, 4}), Tensor::zeros({1, 1, 3, 3}), Tensor(), 1,
                              int64_t{1} << 62, int64_t{1} << 62),
                       doctest::Contains("beyond 2^61"), ValueError);

  // max_pool2d with a kernel of 2^40 padded by 2^39: one window, the whole image (the scan of
  // every tap took 25 s at a kernel of 2 x 10^8).
  const Tensor x = Tensor::from_vector(image, {1, 1, 4, 4}).set_requires_grad(true);
  const Tensor y = max_pool2d(x, int64_t{1} << 40, int64_t{1} << 40, int64_t{1} << 39);
  CHECK(y.to_vector() == std::vector<float>{16});
  sum(y).backward();
  std::vector<float> dx(16, 0.0f);
  dx[15] = 1.0f;
  CHECK(x.grad().to_vector() == dx);
}

TEST_CASE("MaxPool2d under no_grad, or on an input that needs no gradient, keeps no graph and gives the same values") {
  // The padded, dilated case above (the kernel's general path), by hand; then MaxPool2d(2) and
  // an overlapping MaxPool2d(3, 1) on random values (its two fast paths), against the output
  // of the forward that records a graph and keeps the argmax.
  const Tensor x = Tensor::from_vector({1, 2, 3, 4, 9, 6, 7, 8, 5}, {1, 1, 3, 3});
  {
    NoGradGuard no_grad;
    const Tensor y = MaxPool2d(2, 1, 1, 2)(x.clone().set_requires_grad(true));
    CHECK_FALSE(y.requires_grad());
    CHECK(y.to_vector() == std::vector<float>{9, 6, 9, 8, 7, 8, 9, 6, 9});
  }
  Generator gen(4);
  const Tensor images = Tensor::randn({2, 3, 7, 20}, gen);
  for (const int64_t kernel : {2, 3}) {
    CAPTURE(kernel);
    MaxPool2d pool(kernel, /*stride=*/kernel == 2 ? 2 : 1);
    const Tensor trainable = images.clone().set_requires_grad(true);
    const Tensor recorded = pool(trainable);
    REQUIRE(recorded.requires_grad());
    Tensor under_no_grad;
    {
      NoGradGuard no_grad;
      under_no_grad = pool(trainable);
    }
    const Tensor frozen = pool(images);  // grad mode on, but nothing to differentiate
    CHECK_FALSE(under_no_grad.requires_grad());
    CHECK_FALSE(frozen.requires_grad());
    CHECK(under_no_grad.to_vector() == recorded.to_vector());
    CHECK(frozen.to_vector() == recorded.to_vector());
  }
}
