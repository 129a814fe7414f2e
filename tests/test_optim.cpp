#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "core/ops.h"
#include "core/random.h"
#include "nn/adam.h"
#include "nn/clip_grad.h"
#include "nn/lr_scheduler.h"
#include "nn/optim.h"

using namespace nanoddp;
using namespace nanoddp::nn;

namespace {
// One parameter p = [1, -2] whose gradient is fixed to g = [0.5, 1] at every step.
Tensor param_with_grad() {
  Tensor p = Tensor::from_vector({1.0f, -2.0f}).set_requires_grad(true);
  p.set_grad(Tensor::from_vector({0.5f, 1.0f}));
  return p;
}

void step_times(SGD& opt, Tensor& p, int steps) {
  for (int i = 0; i < steps; ++i) {
    p.set_grad(Tensor::from_vector({0.5f, 1.0f}));
    opt.step();
  }
}
}  // namespace

TEST_CASE("SGD with momentum and weight decay over three steps matches hand-computed values") {
  // lr 0.1, momentum 0.9, weight_decay 0.1 (PyTorch's rule, decay before momentum):
  // element 0: p=1,    g=0.5
  //   step 1: d = 0.5 + 0.1*1 = 0.6;       buf = 0.6;                       p = 1 - 0.06 = 0.94
  //   step 2: d = 0.5 + 0.094 = 0.594;     buf = 0.54 + 0.594 = 1.134;      p = 0.94 - 0.1134 = 0.8266
  //   step 3: d = 0.5 + 0.08266 = 0.58266; buf = 1.0206 + 0.58266 = 1.60326; p = 0.8266 - 0.160326 = 0.666274
  // element 1: p=-2,   g=1
  //   step 1: d = 1 - 0.2 = 0.8;           buf = 0.8;                       p = -2.08
  //   step 2: d = 1 - 0.208 = 0.792;       buf = 0.72 + 0.792 = 1.512;      p = -2.2312
  //   step 3: d = 1 - 0.22312 = 0.77688;   buf = 1.3608 + 0.77688 = 2.13768; p = -2.444968
  Tensor p = param_with_grad();
  SGD opt({p}, {/*lr=*/0.1, /*momentum=*/0.9f, /*dampening=*/0.0f, /*weight_decay=*/0.1f});
  step_times(opt, p, 1);
  CHECK(p.at({0}) == doctest::Approx(0.94).epsilon(1e-6));
  CHECK(p.at({1}) == doctest::Approx(-2.08).epsilon(1e-6));
  step_times(opt, p, 1);
  CHECK(p.at({0}) == doctest::Approx(0.8266).epsilon(1e-6));
  CHECK(p.at({1}) == doctest::Approx(-2.2312).epsilon(1e-6));
  step_times(opt, p, 1);
  CHECK(p.at({0}) == doctest::Approx(0.666274).epsilon(1e-6));
  CHECK(p.at({1}) == doctest::Approx(-2.444968).epsilon(1e-6));
}

TEST_CASE("SGD's 1 - dampening and AdamW's 1 - lr * weight_decay are doubles rounded once, as PyTorch's Python floats") {
  // SGD(lr=1, momentum=0.9, dampening=0.09), p = 0: a zero gradient leaves buf = 0, then a
  // gradient of 1 gives buf = 0.9 * 0 + float32(1 - 0.09) * 1 = 0.91f and p = -0.91f, as torch
  // 1.13 gives. 1.0f - 0.09f would be 0.90999997f.
  Tensor p = Tensor::from_vector({0.0f}).set_requires_grad(true);
  SGD sgd({p}, {/*lr=*/1.0, /*momentum=*/0.9f, /*dampening=*/0.09});
  p.set_grad(Tensor::from_vector({0.0f}));
  sgd.step();
  p.set_grad(Tensor::from_vector({1.0f}));
  sgd.step();
  CHECK(p.at({0}) == -0.91f);
  CHECK(static_cast<float>(1.0 - 0.09) != 1.0f - 0.09f);  // the case tells the two apart
  // AdamW(lr=0.3, weight_decay=0.3), p = 1, gradient 0: p = float32(1 - 0.3 * 0.3) = 0.91f
  // (torch: 0.910000026), where a float32 weight_decay gives 0.909999967.
  Tensor q = Tensor::from_vector({1.0f}).set_requires_grad(true);
  AdamWOptions options;
  options.lr = 0.3;
  options.weight_decay = 0.3;
  AdamW adamw({q}, options);
  q.set_grad(Tensor::from_vector({0.0f}));
  adamw.step();
  CHECK(q.at({0}) == 0.91f);
  CHECK(static_cast<float>(1.0 - 0.3 * static_cast<double>(0.3f)) != 0.91f);
}

TEST_CASE("SGD with dampening and nesterov") {
  // dampening 0.5, momentum 0.5, lr 1, p = 1, g = 0.5: step 1 buf = g = 0.5 (no dampening on
  // the first step), p = 0.5; step 2 buf = 0.25 + 0.25 = 0.5, p = 0.
  Tensor p = param_with_grad();
  SGD damped({p}, {/*lr=*/1.0, /*momentum=*/0.5f, /*dampening=*/0.5f});
  step_times(damped, p, 2);
  CHECK(p.at({0}) == doctest::Approx(0.0).epsilon(1e-7));
  // nesterov, momentum 0.5, lr 1, g = 0.5: step 1 buf = 0.5, d = 0.5 + 0.25 = 0.75, p = 0.25;
  // step 2 buf = 0.25 + 0.5 = 0.75, d = 0.5 + 0.375 = 0.875, p = -0.625.
  Tensor q = param_with_grad();
  SGD nesterov({q}, {/*lr=*/1.0, /*momentum=*/0.5f, /*dampening=*/0.0f, /*weight_decay=*/0.0f, /*nesterov=*/true});
  step_times(nesterov, q, 2);
  CHECK(q.at({0}) == doctest::Approx(-0.625).epsilon(1e-7));
}

TEST_CASE("a parameter with no gradient is skipped") {
  Tensor a = Tensor::from_vector({1.0f}).set_requires_grad(true);
  Tensor b = Tensor::from_vector({1.0f}).set_requires_grad(true);
  b.set_grad(Tensor::from_vector({1.0f}));
  SGD opt({a, b}, {/*lr=*/0.5, /*momentum=*/0.9f});
  opt.step();
  CHECK(a.item() == 1.0f);
  CHECK(b.item() == 0.5f);
  CHECK(opt.state_dict().size() == 1);  // no buffer for a
  opt.zero_grad();
  CHECK_FALSE(b.grad().defined());
}

TEST_CASE("zero_grad(set_to_none=false) zeroes each .grad in place, as torch 1.13's default") {
  Tensor a = Tensor::from_vector({1.0f, 2.0f}).set_requires_grad(true);
  Tensor b = Tensor::from_vector({1.0f}).set_requires_grad(true);  // no .grad: stays without one
  Tensor grad = Tensor::from_vector({3.0f, 4.0f});
  a.set_grad(grad);
  SGD opt({a, b}, {/*lr=*/0.5});
  opt.zero_grad(/*set_to_none=*/false);
  CHECK(a.grad().is_same(grad));
  CHECK(grad.to_vector() == std::vector<float>{0.0f, 0.0f});
  CHECK_FALSE(b.grad().defined());
  opt.zero_grad();
  CHECK_FALSE(a.grad().defined());
}

// Gradients that are slice_views of one flat buffer (what DDP's gradient_as_bucket_view
// makes) must give every optimizer and clip_grad_norm_ exactly what separate tensors give,
// and nothing outside a view's range may change.
TEST_CASE("SGD, Adam, AdamW, clip_grad_norm_ and zero_grad work through gradients that view one buffer") {
  const float sentinel = 1234.5f;
  const std::vector<std::function<std::unique_ptr<Optimizer>(std::vector<Tensor>)>> makers = {
      [](std::vector<Tensor> p) {
        return std::make_unique<SGD>(std::move(p), SGDOptions{/*lr=*/0.1, /*momentum=*/0.9f, /*dampening=*/0.0f,
                                                              /*weight_decay=*/0.1f});
      },
      [](std::vector<Tensor> p) {
        return std::make_unique<Adam>(std::move(p), AdamOptions{/*lr=*/0.1, {0.9, 0.999}, 1e-8f, 0.1f, true});
      },
      [](std::vector<Tensor> p) { return std::make_unique<AdamW>(std::move(p), AdamWOptions{/*lr=*/0.1}); },
  };
  for (size_t which = 0; which < makers.size(); ++which) {
    CAPTURE(which);
    auto make_params = [] {
      return std::vector<Tensor>{Tensor::from_vector({1.0f, -2.0f}).set_requires_grad(true),
                                 Tensor::from_vector({3.0f}).set_requires_grad(true)};
    };
    std::vector<Tensor> plain = make_params(), viewed = make_params();
    // [sentinel, a0, a1, b0, sentinel]: a's gradient at offset 1, b's at 3.
    Tensor flat = Tensor::full({5}, sentinel);
    viewed[0].set_grad(flat.slice_view(1, {2}));
    viewed[1].set_grad(flat.slice_view(3, {1}));
    auto opt_plain = makers[which](plain);
    auto opt_viewed = makers[which](viewed);
    for (int step = 0; step < 3; ++step) {
      const float g = 0.5f + static_cast<float>(step);
      plain[0].set_grad(Tensor::from_vector({g, -2 * g}));
      plain[1].set_grad(Tensor::from_vector({3 * g}));
      flat.copy_(Tensor::from_vector({sentinel, g, -2 * g, 3 * g, sentinel}));
      CHECK(clip_grad_norm_(plain, 1.0) == clip_grad_norm_(viewed, 1.0));
      opt_plain->step();
      opt_viewed->step();
      for (size_t i = 0; i < plain.size(); ++i) CHECK(viewed[i].to_vector() == plain[i].to_vector());
    }
    const std::vector<float> clipped = flat.to_vector();
    CHECK(clipped[0] == sentinel);
    CHECK(clipped[4] == sentinel);
    CHECK(clipped[1] == plain[0].grad().at({0}));  // clipped in place, through the view
    opt_viewed->zero_grad(/*set_to_none=*/false);
    CHECK(flat.to_vector() == std::vector<float>{sentinel, 0, 0, 0, sentinel});
    CHECK(viewed[0].grad().is_alias_of(flat));
  }
}

TEST_CASE("SGD state_dict restores momentum so a resumed run matches an uninterrupted one") {
  Tensor p = param_with_grad(), q = param_with_grad();
  const SGDOptions options{/*lr=*/0.1, /*momentum=*/0.9f};
  SGD straight({p}, options);
  step_times(straight, p, 4);
  SGD first({q}, options);
  step_times(first, q, 2);
  SGD resumed({q}, options);
  resumed.load_state_dict(first.state_dict());
  step_times(resumed, q, 2);
  CHECK(q.to_vector() == p.to_vector());
  // An index is written without leading zeros: "momentum_buffer.00" is not parameter 0's,
  // where it would stand beside "momentum_buffer.0" with nothing to say which wins.
  StateDict padded = first.state_dict();
  padded["momentum_buffer.00"] = padded.at("momentum_buffer.0");
  CHECK_THROWS_WITH_AS(resumed.load_state_dict(padded), doctest::Contains("bad key 'momentum_buffer.00'"),
                       ValueError);
}

TEST_CASE("SGD rejects bad hyper-parameters as PyTorch does") {
  Tensor p = param_with_grad();
  CHECK_THROWS_AS(SGD({p}, {/*lr=*/-1.0}), ValueError);
  CHECK_THROWS_AS(SGD({p}, {/*lr=*/0.1, /*momentum=*/-0.1f}), ValueError);
  CHECK_THROWS_AS(SGD({p}, {0.1, 0.0f, 0.0f, 0.0f, /*nesterov=*/true}), ValueError);
}

TEST_CASE("an optimizer refuses no parameters and an op's output, as torch.optim does") {
  // torch.optim.SGD([], lr=0.1): "optimizer got an empty parameter list".
  CHECK_THROWS_WITH_AS(SGD({}, {/*lr=*/0.1}), doctest::Contains("optimizer got an empty parameter list"),
                       ValueError);
  CHECK_THROWS_WITH_AS(Adam({}, AdamOptions{}), doctest::Contains("Adam: optimizer got an empty"),
                       ValueError);
  CHECK_THROWS_WITH_AS(AdamW({}, AdamWOptions{}), doctest::Contains("AdamW: optimizer got an empty"),
                       ValueError);
  // torch: "can't optimize a non-leaf Tensor".
  Tensor p = param_with_grad();
  CHECK_THROWS_WITH_AS(SGD({p, p * 2.0f}, {/*lr=*/0.1}),
                       doctest::Contains("can't optimize a non-leaf tensor (parameter 1"), ValueError);
}

TEST_CASE("SGD refuses a parameter listed twice instead of stepping it twice") {
  Tensor p = param_with_grad();
  Tensor q = param_with_grad();
  try {
    SGD opt({p, q, p}, {/*lr=*/0.1});
    FAIL("SGD accepted a duplicate parameter");
  } catch (const ValueError& e) {
    CHECK(std::string(e.what()).find("parameter 2 is parameter 0 again") != std::string::npos);
  }
}

// ---- Adam and AdamW -------------------------------------------------------------------------

namespace {
// The gradients of the three PyTorch runs below, one row per step.
const std::vector<std::vector<float>> kAdamGrads = {{0.5f, 1.0f, -0.25f}, {-0.3f, 0.8f, 0.0f}, {0.1f, -1.5f, 2.0f}};

// Steps opt over kAdamGrads from p = [1, -2, 0.5] and returns p after each step.
std::vector<std::vector<float>> adam_trajectory(const std::function<std::unique_ptr<Optimizer>(Tensor)>& make) {
  Tensor p = Tensor::from_vector({1.0f, -2.0f, 0.5f}).set_requires_grad(true);
  std::unique_ptr<Optimizer> opt = make(p);
  std::vector<std::vector<float>> out;
  for (const std::vector<float>& g : kAdamGrads) {
    p.set_grad(Tensor::from_vector(g));
    opt->step();
    out.push_back(p.to_vector());
  }
  return out;
}

void check_trajectory(const std::vector<std::vector<float>>& got, const std::vector<std::vector<double>>& expected) {
  REQUIRE(got.size() == expected.size());
  for (size_t s = 0; s < got.size(); ++s)
    for (size_t i = 0; i < got[s].size(); ++i) {
      INFO("step " << s + 1 << " element " << i);
      CHECK(got[s][i] == doctest::Approx(expected[s][i]).epsilon(2e-7));
    }
}

// torch.optim.Adam / AdamW's single-tensor update in float64, written from the formulas in
// nn/adam.h: the reference the fused float32 kernel is held to.
struct AdamReference {
  double lr, beta1, beta2, eps, weight_decay;
  bool decoupled, amsgrad;
  std::vector<double> p, m, v, vmax;
  int64_t t = 0;
  void step(const std::vector<double>& grad) {
    ++t;
    const double bc1 = 1.0 - std::pow(beta1, t), bc2_sqrt = std::sqrt(1.0 - std::pow(beta2, t));
    for (size_t i = 0; i < p.size(); ++i) {
      if (decoupled) p[i] *= 1.0 - lr * weight_decay;
      const double g = decoupled ? grad[i] : grad[i] + weight_decay * p[i];
      m[i] = beta1 * m[i] + (1.0 - beta1) * g;
      v[i] = beta2 * v[i] + (1.0 - beta2) * g * g;
      vmax[i] = std::max(vmax[i], v[i]);
      p[i] -= lr / bc1 * m[i] / (std::sqrt(amsgrad ? vmax[i] : v[i]) / bc2_sqrt + eps);
    }
  }
};
}  // namespace

// Expected values: PyTorch 1.13 (torch.optim.Adam / AdamW, CPU, float32, default
// foreach=None, so the single-tensor path), run offline on p = [1, -2, 0.5] with the grads of
// kAdamGrads, printed with 9 significant digits after each step.
TEST_CASE("Adam matches PyTorch 1.13 step by step") {
  check_trajectory(adam_trajectory([](Tensor p) { return std::make_unique<Adam>(std::vector<Tensor>{p}, AdamOptions{0.1}); }),
                   {{0.900000036, -2.0999999, 0.599999964},
                    {0.880850255, -2.19881248, 0.667005777},
                    {0.85545373, -2.19978452, 0.610034883}});
}

TEST_CASE("Adam with L2 weight decay and amsgrad matches PyTorch 1.13") {
  AdamOptions options;
  options.lr = 0.1;
  options.weight_decay = 0.1;
  options.amsgrad = true;
  check_trajectory(adam_trajectory([&](Tensor p) { return std::make_unique<Adam>(std::vector<Tensor>{p}, options); }),
                   {{0.900000036, -2.0999999, 0.600000024},
                    {0.86135304, -2.1980989, 0.642784894},
                    {0.81471777, -2.1807034, 0.582552493}});
}

TEST_CASE("AdamW's decoupled weight decay matches PyTorch 1.13") {
  AdamWOptions options;
  options.lr = 0.1;
  options.weight_decay = 0.1;
  check_trajectory(adam_trajectory([&](Tensor p) { return std::make_unique<AdamW>(std::vector<Tensor>{p}, options); }),
                   {{0.890000045, -2.07999992, 0.594999969},
                    {0.861950278, -2.15801263, 0.656055808},
                    {0.827934265, -2.13740444, 0.59252435}});
}

TEST_CASE("AdamW with its default weight decay, other betas, eps and amsgrad matches PyTorch 1.13") {
  AdamWOptions options;  // weight_decay stays at AdamW's default 1e-2
  options.lr = 0.1;
  options.betas = {0.8, 0.9};
  options.eps = 1e-3f;
  options.amsgrad = true;
  CHECK(options.weight_decay == 1e-2);
  Tensor p = Tensor::from_vector({1.0f, -2.0f, 0.5f}).set_requires_grad(true);
  AdamW opt({p}, options);
  for (const std::vector<float>& g : kAdamGrads) {
    p.set_grad(Tensor::from_vector(g));
    opt.step();
  }
  // PyTorch 1.13, as above: p after step 3 and the state (max_exp_avg_sq[0] is step 2's v).
  const std::vector<double> p3 = {0.86223048, -2.18445444, 0.597139001};
  const std::vector<double> exp_avg = {0.0360000022, -0.0439999923, 0.368000001};
  const std::vector<double> exp_avg_sq = {0.0293499995, 0.363600016, 0.405062497};
  const std::vector<double> max_exp_avg_sq = {0.0315000005, 0.363600016, 0.405062497};
  const StateDict state = opt.state_dict();
  REQUIRE(state.size() == 4);
  CHECK(state.at("step.0").to_int_vector() == std::vector<int64_t>{3});
  for (size_t i = 0; i < 3; ++i) {
    CHECK(p.to_vector()[i] == doctest::Approx(p3[i]).epsilon(2e-7));
    CHECK(state.at("exp_avg.0").to_vector()[i] == doctest::Approx(exp_avg[i]).epsilon(2e-7));
    CHECK(state.at("exp_avg_sq.0").to_vector()[i] == doctest::Approx(exp_avg_sq[i]).epsilon(2e-7));
    CHECK(state.at("max_exp_avg_sq.0").to_vector()[i] == doctest::Approx(max_exp_avg_sq[i]).epsilon(2e-7));
  }
}

// Whether this build's kernels fuse multiply-adds (the project's -mfma or -march=native on a
// CPU that has FMA), as torch's AVX2 kernels do.
#if defined(__FMA__)
constexpr bool kFusedMultiplyAdd = true;
#else
constexpr bool kFusedMultiplyAdd = false;
#endif

TEST_CASE("30 steps of SGD (momentum, dampening, nesterov, weight decay), Adam and AdamW equal PyTorch 1.13's, bit for bit") {
  // Note [Optimizer rounding] in kernels/cpu/sgd.cpp: each step rounds as torch's single-tensor
  // step. Inputs are dyadic, so both sides start from the same floats; the expected bits are
  // torch 1.13's (CPU, AVX2) after 30 steps. A build without FMA (-Dcpu_isa=portable) rounds as
  // torch's default kernels do, and is not checked here.
  if (!kFusedMultiplyAdd) return;
  const int64_t n = 16;
  auto run = [&](const std::function<std::unique_ptr<Optimizer>(std::vector<Tensor>)>& make) {
    std::vector<float> start(n);
    for (int64_t k = 0; k < n; ++k) start[static_cast<size_t>(k)] = static_cast<float>((k * 37) % 101 - 50) / 64;
    Tensor p = Tensor::from_vector(start).set_requires_grad(true);
    std::unique_ptr<Optimizer> opt = make({p});
    for (int64_t s = 0; s < 30; ++s) {
      std::vector<float> g(n);
      for (int64_t k = 0; k < n; ++k) g[static_cast<size_t>(k)] = static_cast<float>((k * 13 + s * 7) % 29 - 14) / 32;
      p.set_grad(Tensor::from_vector(g));
      opt->step();
    }
    std::vector<uint32_t> bits;
    for (float v : p.to_vector()) {
      uint32_t b;
      std::memcpy(&b, &v, sizeof b);
      bits.push_back(b);
    }
    return bits;
  };
  CHECK(run([](std::vector<Tensor> p) {
          return std::make_unique<SGD>(std::move(p), SGDOptions{/*lr=*/0.01, 0.9f, /*dampening=*/0.1f, 1e-4f});
        }) == std::vector<uint32_t>{0xbf46a379, 0xbe56ba63, 0x3ec42534, 0xbf1d0cff, 0xbd70efc2, 0x3f008d94, 0xbef62939, 0x3e1e8a72,
        0x3f2f6397, 0xbe9534ca, 0x3e61ee6a, 0xbf3c8d66, 0xbe0fdb14, 0x3ed8157a, 0xbf1732da, 0xbd364bd9});
  CHECK(run([](std::vector<Tensor> p) {
          return std::make_unique<SGD>(std::move(p), SGDOptions{/*lr=*/0.01, 0.9f, 0.0f, 1e-4f, /*nesterov=*/true});
        }) == std::vector<uint32_t>{0xbf4695cd, 0xbe56b508, 0x3ec40ed4, 0xbf1d0861, 0xbd716c02, 0x3f0092c8, 0xbef631b3, 0x3e1eabee,
        0x3f2f5fa3, 0xbe951d29, 0x3e61ed1b, 0xbf3c9749, 0xbe0fcfa0, 0x3ed8025b, 0xbf172c83, 0xbd36aa66});
  CHECK(run([](std::vector<Tensor> p) {
          return std::make_unique<Adam>(std::move(p), AdamOptions{1e-3, {0.9, 0.999}, 1e-8f, 1e-2f, /*amsgrad=*/true});
        }) == std::vector<uint32_t>{0xbf474e70, 0xbe511ad5, 0x3ebf9df5, 0xbf1f5730, 0xbd4121e1, 0x3f078a94, 0xbef15902, 0x3de8bd62,
        0x3f2f8174, 0xbe9dfb6a, 0x3e84f402, 0xbf3c2a7c, 0xbe1e757e, 0x3ed7de71, 0xbf139161, 0xbba5c26d});
  CHECK(run([](std::vector<Tensor> p) { return std::make_unique<AdamW>(std::move(p), AdamWOptions{}); }) ==
        std::vector<uint32_t>{0xbf477223, 0xbe51462b, 0x3ebfc382, 0xbf1f7aa7, 0xbd414597, 0x3f07a6c6, 0xbef186cb, 0x3de8eb7d,
        0x3f2fa3f1, 0xbe9e1730, 0x3e85904e, 0xbf3c4f15, 0xbe1e994a, 0x3ed807b9, 0xbf13b07e, 0xbba5d882});
}

TEST_CASE("the fused Adam and AdamW kernels follow a float64 reference over 20 steps") {
  Generator gen(7);
  for (bool decoupled : {false, true})
    for (bool amsgrad : {false, true}) {
      INFO((decoupled ? "AdamW" : "Adam") << (amsgrad ? " amsgrad" : ""));
      const int64_t n = 64;
      Tensor p = Tensor::randn({n}, gen).set_requires_grad(true);
      const std::vector<float> p0 = p.to_vector();
      AdamReference ref{0.01, 0.9, 0.99, 1e-6, 0.05, decoupled, amsgrad,
                        std::vector<double>(p0.begin(), p0.end()), std::vector<double>(n, 0.0),
                        std::vector<double>(n, 0.0), std::vector<double>(n, 0.0)};
      AdamOptions options{0.01f, {0.9f, 0.99f}, 1e-6f, 0.05f, amsgrad};
      std::unique_ptr<Optimizer> opt;
      if (decoupled)
        opt = std::make_unique<AdamW>(std::vector<Tensor>{p}, AdamWOptions{0.01, {0.9f, 0.99f}, 1e-6f, 0.05f, amsgrad});
      else
        opt = std::make_unique<Adam>(std::vector<Tensor>{p}, options);
      for (int step = 0; step < 20; ++step) {
        // Gradients that shrink over time, so that amsgrad's maximum differs from v.
        const Tensor g = Tensor::randn({n}, gen) * (1.0f / static_cast<float>(1 + step));
        p.set_grad(g);
        const std::vector<float> gv = g.to_vector();
        opt->step();
        ref.step(std::vector<double>(gv.begin(), gv.end()));
      }
      const std::vector<float> got = p.to_vector();
      double worst = 0.0, largest = 0.0;
      for (int64_t i = 0; i < n; ++i) {
        worst = std::max(worst, std::abs(got[i] - ref.p[i]));
        largest = std::max(largest, std::abs(ref.p[i]));
      }
      // float32 rounding: each of the 20 steps rounds p once (at most half an ulp of the
      // largest |p|) and its update (a much smaller share).
      const double ulp = std::ldexp(1.0, std::ilogb(largest) - 23);
      CHECK(worst <= 20 * 0.5 * ulp);
    }
}

TEST_CASE("Adam skips a parameter without a gradient and checks its arguments as PyTorch does") {
  Tensor a = Tensor::from_vector({1.0f}).set_requires_grad(true);
  Tensor b = Tensor::from_vector({1.0f}).set_requires_grad(true);
  Adam opt({a, b}, AdamOptions{});
  b.set_grad(Tensor::from_vector({2.0f}));
  opt.step();
  CHECK(a.item() == 1.0f);
  // Step 1 moves by lr * sign(g) (up to eps): m / sqrt(v) = g / |g| after bias correction.
  CHECK(b.item() == doctest::Approx(1.0f - 1e-3f).epsilon(1e-6));
  CHECK(opt.state_dict().count("step.0") == 0);
  CHECK(opt.state_dict().at("step.1").to_int_vector() == std::vector<int64_t>{1});
  CHECK(opt.name() == "Adam");
  auto message = [&](AdamOptions o) {
    try {
      Adam bad({a}, o);
    } catch (const ValueError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK(message({-1.0f}).find("Invalid learning rate: -1") != std::string::npos);
  CHECK(message({1e-3f, {1.0f, 0.999f}}).find("Invalid beta parameter at index 0: 1") != std::string::npos);
  CHECK(message({1e-3f, {0.9f, -0.1f}}).find("Invalid beta parameter at index 1") != std::string::npos);
  CHECK(message({1e-3f, {0.9, 0.999}, -1e-8f}).find("Invalid epsilon value") != std::string::npos);
  CHECK(message({1e-3f, {0.9, 0.999}, 1e-8f, -0.1f}).find("Invalid weight_decay value") != std::string::npos);
  CHECK_THROWS_AS(AdamW({a, a}, AdamWOptions{}), ValueError);
  CHECK_THROWS_AS(opt.set_lr(-0.5f), ValueError);
}

TEST_CASE("Adam state_dict resumes to the identical trajectory and rejects partial state") {
  AdamOptions options{0.05f, {0.9, 0.999}, 1e-8f, 0.0f, /*amsgrad=*/true};
  Tensor p = Tensor::from_vector({1.0f, -2.0f, 0.5f}).set_requires_grad(true);
  Tensor q = Tensor::from_vector({1.0f, -2.0f, 0.5f}).set_requires_grad(true);
  Adam straight({p}, options), first({q}, options);
  for (int i = 0; i < 3; ++i) {
    p.set_grad(Tensor::from_vector(kAdamGrads[i]));
    straight.step();
  }
  q.set_grad(Tensor::from_vector(kAdamGrads[0]));
  first.step();
  Adam resumed({q}, options);
  resumed.load_state_dict(first.state_dict());
  for (int i = 1; i < 3; ++i) {
    q.set_grad(Tensor::from_vector(kAdamGrads[i]));
    resumed.step();
  }
  CHECK(q.to_vector() == p.to_vector());
  StateDict partial = first.state_dict();
  partial.erase("exp_avg_sq.0");
  CHECK_THROWS_AS(resumed.load_state_dict(partial), ValueError);
  StateDict wrong_shape = first.state_dict();
  wrong_shape["exp_avg.0"] = Tensor::zeros({2});
  CHECK_THROWS_WITH_AS(resumed.load_state_dict(wrong_shape),
                       doctest::Contains("'exp_avg.0' is [2] but parameter 0 is [3]"), ShapeError);
  StateDict scalar_step = first.state_dict();
  scalar_step["step.0"] = Tensor::from_vector(std::vector<int64_t>{1}).reshape(Shape{});
  CHECK_THROWS_WITH_AS(resumed.load_state_dict(scalar_step),
                       doctest::Contains("'step.0' is [] but a step count is one value of shape [1]"),
                       ShapeError);
  StateDict undefined = first.state_dict();
  undefined["exp_avg.0"] = Tensor();
  CHECK_THROWS_WITH_AS(resumed.load_state_dict(undefined),
                       doctest::Contains("'exp_avg.0' is an undefined tensor"), ValueError);
  StateDict unknown = first.state_dict();
  unknown["momentum_buffer.0"] = Tensor::zeros({3});
  CHECK_THROWS_AS(resumed.load_state_dict(unknown), ValueError);
  CHECK(resumed.state_nbytes() == 3 * 3 * 4);  // exp_avg, exp_avg_sq, max_exp_avg_sq of 3 floats
}

// ---- learning-rate schedulers ---------------------------------------------------------------

namespace {
// get_last_lr() after construction and after each of `steps` steps.
std::vector<double> schedule_values(LRScheduler& schedule, int steps) {
  std::vector<double> values = {schedule.get_last_lr()};
  for (int i = 0; i < steps; ++i) {
    schedule.step();
    values.push_back(schedule.get_last_lr());
  }
  return values;
}

void check_schedule(const std::vector<double>& got, const std::vector<double>& expected, const Optimizer& opt) {
  REQUIRE(got.size() == expected.size());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("last_epoch " << i);
    CHECK(got[i] == expected[i]);  // bit-exact: the same double operations as PyTorch's
  }
  CHECK(opt.lr() == got.back());  // the optimizer holds the scheduler's double
}
}  // namespace

// Every expected list below but LambdaLR's is PyTorch 1.13's get_last_lr()[0] after
// construction and after each step(), printed with repr(), run offline: torch.optim.SGD([p],
// lr=0.125), then the scheduler with the same arguments, stepped after each optimizer.step().
TEST_CASE("StepLR matches PyTorch 1.13 over 13 steps") {
  Tensor p = param_with_grad();
  // From 0.125, which float and double hold exactly, so PyTorch's doubles are reproduced.
  SGD opt({p}, {/*lr=*/0.125});
  StepLR schedule(opt, /*step_size=*/3, /*gamma=*/0.1);
  check_schedule(schedule_values(schedule, 13),
                 {0.125, 0.125, 0.125, 0.0125, 0.0125, 0.0125, 0.0012500000000000002, 0.0012500000000000002,
                  0.0012500000000000002, 0.00012500000000000003, 0.00012500000000000003, 0.00012500000000000003,
                  1.2500000000000004e-05, 1.2500000000000004e-05},
                 opt);
}

TEST_CASE("CosineAnnealingLR matches PyTorch 1.13's recursion, down to eta_min and back up past T_max") {
  Tensor p = param_with_grad();
  SGD opt({p}, {/*lr=*/0.125});
  CosineAnnealingLR schedule(opt, /*T_max=*/5, /*eta_min=*/0.01);
  check_schedule(schedule_values(schedule, 13),
                 {0.125, 0.11401847717655948, 0.08526847717655947, 0.049731522823440524, 0.020981522823440527,
                  0.01, 0.020981522823440523, 0.049731522823440545, 0.08526847717655951, 0.11401847717655954,
                  0.12500000000000006, 0.11401847717655957, 0.08526847717655953, 0.04973152282344056},
                 opt);
}

TEST_CASE("LinearLR warms up over total_iters with PyTorch 1.13's defaults, then holds") {
  Tensor p = param_with_grad();
  SGD opt({p}, {/*lr=*/0.125});
  LinearLR schedule(opt);  // start_factor 1/3, end_factor 1, total_iters 5
  check_schedule(schedule_values(schedule, 10),
                 {0.041666666666666664, 0.058333333333333334, 0.07500000000000001, 0.09166666666666669,
                  0.10833333333333336, 0.12500000000000003, 0.12500000000000003, 0.12500000000000003,
                  0.12500000000000003, 0.12500000000000003, 0.12500000000000003},
                 opt);
  CHECK_THROWS_AS(LinearLR(opt, 0.0), ValueError);
  CHECK_THROWS_AS(LinearLR(opt, 0.5, 1.5), ValueError);
}

TEST_CASE(
    "LinearLR to end_factor 0 ends at 0 where torch's recursion rounds just below it, and holds there") {
  // torch.optim.SGD([p], lr=0.1) and LinearLR(opt, start, 0.0, total_iters), as above: torch
  // 1.13 ends at -1.8503717077085946e-18 and -2.220446049250312e-19; a rate the optimizer
  // refuses, which stopped training at its last warm-down step.
  struct Case {
    double start_factor;
    int64_t total_iters;
    std::vector<double> expected;
  };
  for (const Case& c : std::vector<Case>{
           {1.0 / 3, 4, {0.03333333333333333, 0.025, 0.01666666666666667, 0.008333333333333335, 0, 0, 0}},
           {0.1,
            10,
            {0.010000000000000002, 0.009000000000000003, 0.008000000000000002, 0.007000000000000002,
             0.006000000000000001, 0.005, 0.004, 0.003, 0.0019999999999999996, 0.0009999999999999996, 0, 0,
             0}}}) {
    CAPTURE(c.total_iters);
    Tensor p = param_with_grad();
    SGD opt({p}, {/*lr=*/0.1});
    LinearLR schedule(opt, c.start_factor, 0.0, c.total_iters);
    check_schedule(schedule_values(schedule, static_cast<int>(c.total_iters) + 2), c.expected, opt);
  }
}

TEST_CASE("LambdaLR is base_lr times the lambda at last_epoch") {
  Tensor p = param_with_grad();
  SGD opt({p}, {/*lr=*/0.125});
  LambdaLR schedule(opt, [](int64_t epoch) { return std::pow(0.95, static_cast<double>(epoch)); });
  // By hand: 0.125 * 0.95^e, e = 0..10.
  std::vector<double> expected;
  for (int e = 0; e <= 10; ++e) expected.push_back(0.125 * std::pow(0.95, e));
  check_schedule(schedule_values(schedule, 10), expected, opt);
  CHECK_THROWS_AS(StepLR(opt, 0), ValueError);
  CHECK_THROWS_AS(CosineAnnealingLR(opt, 0), ValueError);
}

TEST_CASE("a step the optimizer refuses leaves the scheduler where it was: its state resumes the same schedule") {
  Tensor p = param_with_grad();
  SGD opt({p}, {/*lr=*/0.5});
  // 1 - e/2: 1, 0.5, 0, then -0.5 at epoch 3, which SGD refuses.
  LambdaLR schedule(opt, [](int64_t epoch) { return 1.0 - 0.5 * static_cast<double>(epoch); });
  schedule.step();
  schedule.step();
  CHECK(opt.lr() == 0.0f);
  const StateDict before = schedule.state_dict();
  CHECK_THROWS_WITH_AS(schedule.step(), doctest::Contains("SGD: invalid learning rate -0.25"), ValueError);
  CHECK(schedule.last_epoch() == 2);
  CHECK(schedule.get_last_lr() == 0.0);
  CHECK(opt.lr() == 0.0f);
  const StateDict after = schedule.state_dict();
  REQUIRE(after.size() == before.size());
  for (const auto& entry : before) {
    const std::string& key = entry.first;
    CAPTURE(key);
    CHECK(after.at(key).to_int_vector() == entry.second.to_int_vector());
  }
  // A lambda that throws is the same.
  LambdaLR throwing(opt, [](int64_t epoch) -> double {
    if (epoch == 1) throw std::runtime_error("no rate for epoch 1");
    return 1.0;
  });
  CHECK(opt.lr() == 0.5);  // epoch 0: the optimizer's initial_lr 0.5 times 1
  CHECK_THROWS_WITH_AS(throwing.step(), "no rate for epoch 1", std::runtime_error);
  CHECK(throwing.last_epoch() == 0);
  CHECK(opt.lr() == 0.5);
}

TEST_CASE("the learning rate is a double, as torch's: a schedule from lr 0.1 is PyTorch's float64 values") {
  Tensor p = param_with_grad();
  SGD opt({p}, {/*lr=*/0.1});
  CHECK(opt.lr() == 0.1);  // not 0.10000000149011612, 0.1 rounded to float
  StepLR decay(opt, /*step_size=*/1, /*gamma=*/0.1);
  CHECK(decay.base_lr() == 0.1);
  CHECK(decay.get_last_lr() == 0.1);
  decay.step();
  // PyTorch: 0.1 * 0.1 in float64 (from a float lr it would be 0.010000000149011612).
  CHECK(decay.get_last_lr() == 0.010000000000000002);
  CHECK(opt.lr() == 0.010000000000000002);
  decay.step();
  CHECK(decay.get_last_lr() == 0.0010000000000000002);  // 0.1 * 0.1 * 0.1

  // LinearLR's recursion in float64: 0.1 * 0.5 = 0.05, 0.05 * (1 + 0.5 / 1) = 0.07500000000000001,
  // then 0.07500000000000001 * (1 + 0.5 / 1.5) = 0.1.
  Adam adam({param_with_grad()}, AdamOptions{/*lr=*/0.1});
  LinearLR warmup(adam, /*start_factor=*/0.5, /*end_factor=*/1.0, /*total_iters=*/2);
  CHECK(schedule_values(warmup, 3) == std::vector<double>{0.05, 0.07500000000000001, 0.1, 0.1});
  CHECK(adam.lr() == 0.1);
}

TEST_CASE("schedulers build on an lr set by hand and chain on one optimizer, as PyTorch's do") {
  Tensor p = param_with_grad();
  SGD opt({p}, {/*lr=*/0.125});
  StepLR halving(opt, /*step_size=*/2, /*gamma=*/0.5);
  halving.step();  // epoch 1: unchanged
  CHECK(opt.lr() == 0.125f);
  opt.set_lr(1.0f);  // by hand
  halving.step();    // epoch 2: group['lr'] * gamma = 0.5, not 0.125 * 0.5
  CHECK(opt.lr() == 0.5f);
  CHECK(halving.get_last_lr() == 0.5);
  halving.step();  // epoch 3: unchanged
  CHECK(opt.lr() == 0.5f);

  // Two schedulers stepped one after the other (torch's ChainedScheduler): every step halves,
  // every second step also quarters. By hand from 0.125: 0.0625, 0.0078125, 0.00390625, 0.00048828125.
  SGD chained({p}, {/*lr=*/0.125});
  StepLR every(chained, 1, 0.5), second(chained, 2, 0.25);
  std::vector<double> lrs;
  for (int i = 0; i < 4; ++i) {
    every.step();
    second.step();
    lrs.push_back(chained.lr());
  }
  CHECK(lrs == std::vector<double>{0.0625, 0.0078125, 0.00390625, 0.00048828125});
}

TEST_CASE("a scheduler chained after another takes the optimizer's initial_lr as base_lr, as PyTorch's") {
  Tensor p = param_with_grad();
  SGD opt({p}, {/*lr=*/1.0});
  CHECK_FALSE(opt.initial_lr().has_value());
  LinearLR warmup(opt, /*start_factor=*/0.5, /*end_factor=*/1.0, /*total_iters=*/1);
  CHECK(opt.lr() == 0.5);
  REQUIRE(opt.initial_lr().has_value());
  CHECK(*opt.initial_lr() == 1.0);
  // PyTorch 1.13: base_lrs come from group['initial_lr'], set by the first scheduler, so the
  // LambdaLR starts from 1.0, not from the 0.5 the warm-up set, and its epoch 0 sets 1.0 * 1.0.
  LambdaLR constant(opt, [](int64_t) { return 1.0; });
  CHECK(constant.base_lr() == 1.0);
  CHECK(constant.get_last_lr() == 1.0);
  CHECK(opt.lr() == 1.0);
  CHECK(*opt.initial_lr() == 1.0);
  CHECK(warmup.base_lr() == 1.0);

  // A load restores initial_lr with base_lr, as torch's optimizer.load_state_dict restores
  // param_groups: a scheduler built afterwards starts from the saved run's rate.
  SGD resumed_opt({param_with_grad()}, {/*lr=*/0.25});
  LinearLR resumed(resumed_opt, 0.5, 1.0, 1);
  CHECK(*resumed_opt.initial_lr() == 0.25);
  resumed.load_state_dict(warmup.state_dict());
  CHECK(*resumed_opt.initial_lr() == 1.0);
  // The optimizer's rate at the save (the LambdaLR's 1.0), as torch's optimizer state holds,
  // not the warm-up's own last_lr 0.5.
  CHECK(resumed_opt.lr() == 1.0);
  CHECK(resumed.get_last_lr() == 0.5);
  CHECK(resumed.base_lr() == 1.0);
  StepLR after_load(resumed_opt, /*step_size=*/1, /*gamma=*/0.5);
  CHECK(after_load.base_lr() == 1.0);
}

TEST_CASE("a scheduler's state_dict resumes the same values and restores the optimizer's lr") {
  Tensor p = param_with_grad(), q = param_with_grad();
  Adam straight_opt({p}, AdamOptions{0.125});
  CosineAnnealingLR straight(straight_opt, 7);
  const std::vector<double> values = schedule_values(straight, 10);
  Adam first_opt({q}, AdamOptions{0.125});
  CosineAnnealingLR first(first_opt, 7);
  schedule_values(first, 4);
  Adam resumed_opt({q}, AdamOptions{0.125});
  CosineAnnealingLR resumed(resumed_opt, 7);
  resumed.load_state_dict(first.state_dict());
  CHECK(resumed.last_epoch() == 4);
  CHECK(resumed_opt.lr() == values[4]);
  const std::vector<double> rest = schedule_values(resumed, 6);
  for (size_t i = 0; i < rest.size(); ++i) CHECK(rest[i] == values[4 + i]);  // bit-exact
  StateDict bad = first.state_dict();
  bad.erase("last_lr");
  CHECK_THROWS_AS(resumed.load_state_dict(bad), ValueError);
  CHECK(resumed.last_epoch() == 10);  // unchanged by the failed load
}

TEST_CASE("schedulers chained on one optimizer resume exactly whichever is loaded first, as PyTorch's") {
  // LinearLR(0.25, 1, 4) then CosineAnnealingLR(8), stepped together on SGD lr 0.1; saved
  // after 2 steps and loaded cosine first: each restoring its own last_lr left LinearLR's
  // 0.0601212 where torch has 0.0533471, and the resumed rates ran off from there.
  const auto run = [](SGD& opt, LinearLR& warmup, CosineAnnealingLR& cosine, int steps) {
    std::vector<double> lrs;
    for (int i = 0; i < steps; ++i) {
      warmup.step();
      cosine.step();
      lrs.push_back(opt.lr());
    }
    return lrs;
  };
  SGD straight_opt({param_with_grad()}, {/*lr=*/0.1});
  LinearLR straight_warmup(straight_opt, 0.25, 1.0, 4);
  CosineAnnealingLR straight_cosine(straight_opt, 8);
  const std::vector<double> want = run(straight_opt, straight_warmup, straight_cosine, 5);

  SGD first_opt({param_with_grad()}, {/*lr=*/0.1});
  LinearLR first_warmup(first_opt, 0.25, 1.0, 4);
  CosineAnnealingLR first_cosine(first_opt, 8);
  run(first_opt, first_warmup, first_cosine, 2);
  for (bool cosine_first : {true, false}) {
    CAPTURE(cosine_first);
    SGD opt({param_with_grad()}, {/*lr=*/0.1});
    LinearLR warmup(opt, 0.25, 1.0, 4);
    CosineAnnealingLR cosine(opt, 8);
    if (cosine_first) cosine.load_state_dict(first_cosine.state_dict());
    warmup.load_state_dict(first_warmup.state_dict());
    if (!cosine_first) cosine.load_state_dict(first_cosine.state_dict());
    CHECK(opt.lr() == want[1]);
    const std::vector<double> rest = run(opt, warmup, cosine, 3);
    CHECK(rest == std::vector<double>(want.begin() + 2, want.end()));  // bit-exact
  }
  CHECK(want[1] == doctest::Approx(0.0533471).epsilon(1e-6));  // torch 1.13's rate after 2 steps
}

TEST_CASE("a scheduler refuses another scheduler's state, naming it, and nothing changes") {
  Tensor p = param_with_grad();
  SGD opt({p}, SGDOptions{0.5});
  StepLR step_lr(opt, 2, 0.5);
  CosineAnnealingLR cosine(opt, 7);
  LinearLR linear(opt);
  LambdaLR lambda(opt, [](int64_t epoch) { return 1.0 / static_cast<double>(epoch + 1); });
  for (LRScheduler* s : std::vector<LRScheduler*>{&step_lr, &cosine, &linear, &lambda}) s->step();
  // The hyper-parameters are saved under PyTorch's names, as exact doubles.
  const StateDict cosine_state = cosine.state_dict();
  double t_max = 0;
  const int64_t bits = cosine_state.at("T_max").to_int_vector().at(0);
  std::memcpy(&t_max, &bits, sizeof t_max);
  CHECK(t_max == 7.0);
  // last_epoch, base_lr, last_lr, optimizer_lr, lr_lambdas: not the function
  CHECK(lambda.state_dict().size() == 5);
  // Before, each of these loaded: the cosine went on from a StepLR's last_lr and last_epoch.
  const std::vector<std::tuple<LRScheduler*, StateDict, std::string>> cases = {
      {&cosine, step_lr.state_dict(), "CosineAnnealingLR.load_state_dict: unexpected key 'gamma': this is a StepLR's "
                                      "state, not a CosineAnnealingLR's"},
      {&linear, cosine_state, "LinearLR.load_state_dict: unexpected key 'T_max': this is a CosineAnnealingLR's state"},
      {&lambda, step_lr.state_dict(), "LambdaLR.load_state_dict: unexpected key 'gamma': this is a StepLR's state"},
      {&step_lr, lambda.state_dict(), "StepLR.load_state_dict: unexpected key 'lr_lambdas': this is a LambdaLR's state"},
  };
  for (const auto& one_case : cases) {
    // Named copies, not a structured binding: clang refuses bindings inside doctest's macros.
    LRScheduler* const scheduler = std::get<0>(one_case);
    const StateDict& state = std::get<1>(one_case);
    const std::string& message = std::get<2>(one_case);
    CAPTURE(message);
    const int64_t epoch = scheduler->last_epoch();
    const double last_lr = scheduler->get_last_lr();
    opt.set_lr(0.25f);
    try {
      scheduler->load_state_dict(state);
      FAIL("expected ValueError");
    } catch (const ValueError& e) {
      CHECK_MESSAGE(std::string(e.what()).find(message) != std::string::npos, e.what());
    }
    CHECK(scheduler->last_epoch() == epoch);
    CHECK(scheduler->get_last_lr() == last_lr);
    CHECK(opt.lr() == 0.25f);
  }
  // A state without hyper-parameters (one saved before they were) still loads: its last_epoch
  // and last_lr are taken.
  StateDict legacy = lambda.state_dict();
  legacy.erase("lr_lambdas");
  legacy.at("last_epoch") = Tensor::from_vector(std::vector<int64_t>{4});
  step_lr.load_state_dict(legacy);
  CHECK(step_lr.last_epoch() == 4);
  CHECK(step_lr.get_last_lr() == lambda.get_last_lr());
  // Its own kind loads, and takes the saved T_max, as torch's load_state_dict does.
  CosineAnnealingLR longer(opt, 14);
  longer.load_state_dict(cosine_state);
  CHECK(longer.last_epoch() == 1);
  double saved_t_max = 0;
  const int64_t saved_bits = longer.state_dict().at("T_max").to_int_vector().at(0);
  std::memcpy(&saved_t_max, &saved_bits, sizeof saved_t_max);
  CHECK(saved_t_max == 7.0);
}

TEST_CASE(
    "a scheduler loaded into one built with other settings goes on along the saved schedule, as torch's") {
  // torch 1.13, from lr 0.1f: CosineAnnealingLR(T_max=10) stepped 10 times, its state loaded
  // into one built with T_max=20, gives 0.00244717, 0.00954915, 0.0206107 (the saved cosine
  // rising again); LinearLR(0.5, 1, total_iters=5) stepped twice, loaded into total_iters=10,
  // 0.08, 0.09, 0.1, 0.1 (the optimizer's lr loaded with its state_dict, as ours is here).
  auto run = [](auto make_saved, auto make_other, int saved_steps, int more_steps) {
    Tensor w = Tensor::zeros({1}).set_requires_grad(true);
    SGD saved_opt({w}, SGDOptions{0.1f}), resumed_opt({w}, SGDOptions{0.1f});
    auto saved = make_saved(saved_opt);
    for (int i = 0; i < saved_steps; ++i) saved->step();
    auto resumed = make_other(resumed_opt);
    resumed->load_state_dict(saved->state_dict());
    std::vector<double> uninterrupted, got;
    for (int i = 0; i < more_steps; ++i) {
      saved->step();
      resumed->step();
      uninterrupted.push_back(saved->get_last_lr());
      got.push_back(resumed->get_last_lr());
    }
    CHECK(got == uninterrupted);
    return got;
  };
  const std::vector<double> cosine =
      run([](Optimizer& o) { return std::make_unique<CosineAnnealingLR>(o, 10); },
          [](Optimizer& o) { return std::make_unique<CosineAnnealingLR>(o, 20); }, 10, 3);
  const std::vector<double> cosine_torch = {0.0024471742217080606, 0.009549150423546093,
                                            0.020610737692500353};
  CHECK(cosine == cosine_torch);
  const std::vector<double> linear =
      run([](Optimizer& o) { return std::make_unique<LinearLR>(o, 0.5, 1.0, 5); },
          [](Optimizer& o) { return std::make_unique<LinearLR>(o, 0.5, 1.0, 10); }, 2, 4);
  const std::vector<double> linear_torch = {0.08000000119209288, 0.0900000013411045, 0.10000000149011612,
                                            0.10000000149011612};
  for (size_t i = 0; i < linear.size(); ++i)
    CHECK(linear[i] == doctest::Approx(linear_torch[i]).epsilon(1e-12));
  run([](Optimizer& o) { return std::make_unique<StepLR>(o, 3, 0.5); },
      [](Optimizer& o) { return std::make_unique<StepLR>(o, 5, 0.9); }, 4, 7);

  // A saved value the constructor would refuse is refused too, and nothing changes.
  Tensor w = Tensor::zeros({1}).set_requires_grad(true);
  SGD opt({w}, SGDOptions{0.1f});
  CosineAnnealingLR cosine_lr(opt, 10);
  StateDict bad = cosine_lr.state_dict();
  const double zero = 0.0, half = 2.5;
  int64_t bits = 0;
  std::memcpy(&bits, &zero, sizeof bits);
  bad.at("T_max") = Tensor::from_vector(std::vector<int64_t>{bits});
  bad.at("last_epoch") = Tensor::from_vector(std::vector<int64_t>{3});
  CHECK_THROWS_WITH_AS(cosine_lr.load_state_dict(bad), doctest::Contains("T_max must be >= 1, got 0"),
                       ValueError);
  std::memcpy(&bits, &half, sizeof bits);
  bad.at("T_max") = Tensor::from_vector(std::vector<int64_t>{bits});
  CHECK_THROWS_WITH_AS(cosine_lr.load_state_dict(bad),
                       doctest::Contains("'T_max' is 2.5, not a whole number"), ValueError);
  bad.erase("eta_min");
  CHECK_THROWS_WITH_AS(cosine_lr.load_state_dict(bad), doctest::Contains("no 'eta_min' entry"), ValueError);
  CHECK(cosine_lr.last_epoch() == 0);
  CHECK(opt.lr() == 0.1f);
}

// ---- clip_grad_norm_ ------------------------------------------------------------------------

TEST_CASE("clip_grad_norm_ scales by max_norm / (total + 1e-6) and returns the norm before") {
  // Gradients [3, 4] and [12]: 2-norm sqrt(9 + 16 + 144) = 13; inf norm 12; 1-norm 19.
  auto make = [] {
    Tensor a = Tensor::from_vector({0.0f, 0.0f}).set_requires_grad(true);
    Tensor b = Tensor::from_vector({0.0f}).set_requires_grad(true);
    Tensor none = Tensor::from_vector({0.0f}).set_requires_grad(true);  // no grad: skipped
    a.set_grad(Tensor::from_vector({3.0f, 4.0f}));
    b.set_grad(Tensor::from_vector({12.0f}));
    return std::vector<Tensor>{a, none, b};
  };
  std::vector<Tensor> params = make();
  CHECK(clip_grad_norm_(params, 1.0) == doctest::Approx(13.0).epsilon(1e-7));
  const double coef = 1.0 / (13.0 + 1e-6);
  CHECK(params[0].grad().at({0}) == doctest::Approx(3.0 * coef).epsilon(1e-7));
  CHECK(params[0].grad().at({1}) == doctest::Approx(4.0 * coef).epsilon(1e-7));
  CHECK(params[2].grad().at({0}) == doctest::Approx(12.0 * coef).epsilon(1e-7));
  CHECK_FALSE(params[1].grad().defined());

  params = make();  // under max_norm: the coefficient clamps to 1 and nothing moves
  CHECK(clip_grad_norm_(params, 20.0) == doctest::Approx(13.0).epsilon(1e-7));
  CHECK(params[0].grad().to_vector() == std::vector<float>{3.0f, 4.0f});

  params = make();
  CHECK(clip_grad_norm_(params, 6.0, std::numeric_limits<double>::infinity()) == 12.0f);
  CHECK(params[2].grad().at({0}) == doctest::Approx(12.0 * 6.0 / (12.0 + 1e-6)).epsilon(1e-7));
  params = make();
  CHECK(clip_grad_norm_(params, 100.0, 1.0) == 19.0f);

  CHECK(clip_grad_norm_({Tensor::from_vector({1.0f})}, 1.0) == 0.0f);  // no gradients at all

  // The factor is float32 arithmetic, as torch's on its float32 norm, and max_norm / tensor is
  // Tensor.__rtruediv__: 1 / (total + 1e-6), then times max_norm. The gradients are torch
  // 1.13's exactly: [3, 4] clipped to 0.3 (the factor in double gives 0.17999996); [6, 8]
  // and [1, 2] to 0.1 and 0.3 (a float32 division gives 0.059999995 and 0.13416402).
  const std::vector<std::tuple<std::vector<float>, double, std::vector<float>>> cases = {
      {{3.0f, 4.0f}, 0.3, {0.17999997735023499f, 0.23999996483325958f}},
      {{6.0f, 8.0f}, 0.1, {0.05999999865889549f, 0.07999999821186066f}},
      {{1.0f, 2.0f}, 0.3, {0.13416403532028198f, 0.26832807064056396f}}};
  for (const auto& one_case : cases) {
    Tensor c = Tensor::zeros({2}).set_requires_grad(true);
    c.set_grad(Tensor::from_vector(std::get<0>(one_case)));
    clip_grad_norm_({c}, std::get<1>(one_case));
    CHECK(c.grad().to_vector() == std::get<2>(one_case));
  }
  CHECK_THROWS_AS(clip_grad_norm_(make(), -1.0), ValueError);
  CHECK_THROWS_AS(clip_grad_norm_(make(), 1.0, 0.0), ValueError);
}

TEST_CASE("maximize steps up the gradient: SGD, Adam and AdamW equal torch 1.13's bit for bit") {
  // torch.optim.<cls>([p], ..., maximize=True) from p = [1, -2, 0.5] over three gradients.
  const auto run = [](auto make) {
    Tensor p = Tensor::from_vector({1.0f, -2.0f, 0.5f}).set_requires_grad(true);
    auto opt = make(std::vector<Tensor>{p});
    for (const std::vector<float>& g :
         {std::vector<float>{0.3f, -0.1f, 2.0f}, {0.25f, 0.5f, -1.0f}, {-0.7f, 0.2f, 0.1f}}) {
      p.set_grad(Tensor::from_vector(g));
      opt->step();
    }
    return p.to_vector();
  };
  SGDOptions sgd{/*lr=*/0.1, /*momentum=*/0.9f};
  sgd.weight_decay = 0.01f;
  sgd.maximize = true;
  CHECK(run([&](std::vector<Tensor> p) { return std::make_unique<SGD>(std::move(p), sgd); }) ==
        std::vector<float>{1.05305588f, -1.90090144f, 0.858537614f});
  SGDOptions nesterov{/*lr=*/0.1, /*momentum=*/0.9f};
  nesterov.nesterov = true;
  nesterov.maximize = true;
  CHECK(run([&](std::vector<Tensor> p) { return std::make_unique<SGD>(std::move(p), nesterov); }) ==
        std::vector<float>{1.03792f, -1.86089003f, 0.935800016f});
  AdamOptions adam{/*lr=*/0.01};
  adam.weight_decay = 0.1;
  adam.maximize = true;
  CHECK(run([&](std::vector<Tensor> p) { return std::make_unique<Adam>(std::move(p), adam); }) ==
        std::vector<float>{1.01597142f, -1.97294807f, 0.514334857f});
  AdamWOptions adamw{/*lr=*/0.01};
  adamw.weight_decay = 0.1;
  adamw.amsgrad = true;
  adamw.maximize = true;
  CHECK(run([&](std::vector<Tensor> p) { return std::make_unique<AdamW>(std::move(p), adamw); }) ==
        std::vector<float>{1.01503563f, -1.99136937f, 0.513484657f});
}

TEST_CASE(
    "clip_grad_value_ clamps every gradient element as torch's, NaN kept, in Eigen's packets and the tail") {
  // torch 1.13: clip_grad_value_ with 0.1 clamps at float32(0.1); NaN stays, infinities clamp.
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> pattern = {-3.0f, 0.05f, inf, -inf, nan, 0.100000001f, 0.10000001f, -0.0f, -0.1f};
  std::vector<float> grad, want;
  for (int repeat = 0; repeat < 5; ++repeat) {  // 45 elements: whole packets and a tail
    for (float v : pattern) grad.push_back(v);
    for (float v : {-0.1f, 0.05f, 0.1f, -0.1f, nan, 0.1f, 0.1f, -0.0f, -0.1f}) want.push_back(v);
  }
  Tensor a = Tensor::zeros({45}).set_requires_grad(true);
  Tensor none = Tensor::zeros({2}).set_requires_grad(true);  // no .grad: skipped
  a.set_grad(Tensor::from_vector(grad));
  clip_grad_value_({a, none}, 0.1);
  const std::vector<float> got = a.grad().to_vector();
  for (size_t i = 0; i < got.size(); ++i) {
    CAPTURE(i);
    if (std::isnan(want[i])) {
      CHECK(std::isnan(got[i]));
    } else {
      CHECK(got[i] == want[i]);
      CHECK(std::signbit(got[i]) == std::signbit(want[i]));
    }
  }
  CHECK_FALSE(none.grad().defined());
  CHECK_THROWS_WITH_AS(clip_grad_value_({a}, -1.0), doctest::Contains("clip_value must be >= 0, got -1"),
                       ValueError);
  CHECK_THROWS_AS(clip_grad_value_({a}, std::nan("")), ValueError);
}

TEST_CASE("clip_grad_norm_ with a non-finite gradient: an error before any change, or PyTorch's scaling") {
  auto make = [](float bad) {
    Tensor a = Tensor::from_vector({0.0f, 0.0f}).set_requires_grad(true);
    a.set_grad(Tensor::from_vector({bad, 2.0f}));
    return std::vector<Tensor>{a};
  };
  std::vector<Tensor> params = make(std::numeric_limits<float>::infinity());
  CHECK_THROWS_AS(clip_grad_norm_(params, 1.0, 2.0, /*error_if_nonfinite=*/true), ValueError);
  CHECK(params[0].grad().at({1}) == 2.0f);
  // PyTorch 1.13: coef = 1 / (inf + 1e-6) = 0, so inf * 0 = NaN and 2 * 0 = 0.
  CHECK(std::isinf(clip_grad_norm_(params, 1.0)));
  CHECK(std::isnan(params[0].grad().at({0})));
  CHECK(params[0].grad().at({1}) == 0.0f);
  params = make(std::numeric_limits<float>::quiet_NaN());
  CHECK(std::isnan(clip_grad_norm_(params, 1.0, std::numeric_limits<double>::infinity())));
  CHECK(std::isnan(params[0].grad().at({1})));  // a NaN coefficient reaches every gradient
}

TEST_CASE("clip_grad_norm_ of finite gradients whose norm overflows float32: it throws, or returns inf") {
  // Gradients [3e38, 3e38]: 2-norm 4.24e38 past FLT_MAX (3.40e38). PyTorch 1.13's float32 norm
  // is inf, so error_if_nonfinite raises, and without it the coefficient 1 / (inf + 1e-6) = 0
  // zeroes both gradients.
  auto make = [] {
    Tensor a = Tensor::from_vector({0.0f, 0.0f}).set_requires_grad(true);
    a.set_grad(Tensor::from_vector({3e38f, 3e38f}));
    return std::vector<Tensor>{a};
  };
  std::vector<Tensor> params = make();
  CHECK_THROWS_WITH_AS(clip_grad_norm_(params, 1.0, 2.0, /*error_if_nonfinite=*/true),
                       doctest::Contains("is non-finite"), ValueError);
  CHECK(params[0].grad().to_vector() == std::vector<float>{3e38f, 3e38f});  // unchanged by the error
  const float total = clip_grad_norm_(params, 1.0);
  CHECK(total == std::numeric_limits<float>::infinity());
  CHECK(params[0].grad().to_vector() == std::vector<float>{0.0f, 0.0f});
  // The 1-norm 6e38 overflows alike; the inf norm, 3e38, does not.
  CHECK(clip_grad_norm_(make(), 1.0, 1.0) == std::numeric_limits<float>::infinity());
  const double inf_norm_type = std::numeric_limits<double>::infinity();
  CHECK(clip_grad_norm_(make(), 1.0, inf_norm_type, /*error_if_nonfinite=*/true) == 3e38f);
}

TEST_CASE(
    "clip_grad_norm_ of a high order: finite gradients keep their norm where |g|^p leaves double's range") {
  // |g|^p overflows (4^10000, 40^250) or underflows ((1e-3)^200) in double; the norm is the
  // largest |g| here (the others' share rounds away), and clipping scales by max_norm / norm.
  struct Case {
    std::vector<float> grads;
    double norm_type, max_norm;
    float norm;
  };
  for (const Case& c : {Case{{1.0f, -4.0f, 3.0f}, 1e4, 2.0, 4.0f}, Case{{40.0f, 1.0f}, 250.0, 20.0, 40.0f},
                        Case{{1e-3f, 2e-3f}, 200.0, 1e-3, 2e-3f}}) {
    CAPTURE(c.norm_type);
    Tensor p = Tensor::zeros({static_cast<int64_t>(c.grads.size())}).set_requires_grad(true);
    p.set_grad(Tensor::from_vector(c.grads));
    CHECK(clip_grad_norm_({p}, c.max_norm, c.norm_type, /*error_if_nonfinite=*/true) == c.norm);
    const float coef = (1.0f / (c.norm + 1e-6f)) * static_cast<float>(c.max_norm);
    std::vector<float> clipped;
    for (float g : c.grads) clipped.push_back(g * coef);
    CHECK(p.grad().to_vector() == clipped);
  }
}

TEST_CASE("amsgrad keeps a NaN second moment, as torch.maximum does (it is not hidden by the max)") {
  // Step 1: gradient NaN -> exp_avg_sq NaN; max(0, NaN) is NaN. Step 2: a finite gradient
  // leaves exp_avg_sq NaN (0.999 * NaN + ...), and the max stays NaN on both sides of it.
  Tensor p = Tensor::from_vector({1.0f}).set_requires_grad(true);
  AdamOptions options;
  options.amsgrad = true;
  Adam opt({p}, options);
  for (float g : {std::nanf(""), 1.0f}) {
    p.set_grad(Tensor::from_vector({g}));
    opt.step();
    CHECK(std::isnan(opt.state_dict().at("max_exp_avg_sq.0").to_vector()[0]));
  }
}
