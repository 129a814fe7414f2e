// The op harness, CPU column: every row of tests/op_cases.cpp, forward against a float64
// reference, backward against central finite differences of that reference, and NaN/±inf
// inputs against the reference. To add an op, add a row to op_cases().
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "core/autograd.h"
#include "core/ops.h"
#include "core/random.h"
#include "core/trace.h"
#include "kernels/cpu/conv.h"
#include "kernels/dropout_mask.h"
#include "kernels/pool_window.h"
#include "nn/conv.h"
#include "nn/conv_groups.h"
#include "nn/dropout.h"
#include "nn/layers.h"
#include "tests/op_cases.h"

using namespace nanoddp;
using namespace nanoddp::testing;

namespace {

// Whether actual matches the reference value: NaN where it is NaN, the same infinity, or
// within tolerance * max(1, |expected|).
bool matches(float actual, double expected, double tolerance) {
  if (std::isnan(expected)) return std::isnan(actual);
  if (std::isinf(expected)) return actual == expected;
  return std::abs(actual - expected) <= tolerance * scale_of(expected);
}

}  // namespace

TEST_CASE("op harness: forward vs float64, backward vs central differences") {
  Generator gen(1234);
  for (const OpCase& c : op_cases()) {
    CAPTURE(c.name);
    std::vector<Values> values = make_inputs(c, gen);
    std::vector<Tensor> inputs = to_tensors(c, values);

    const Tensor out = c.op(inputs);
    const Values expected = c.reference(values);
    const std::vector<float> actual = out.to_vector();
    REQUIRE(actual.size() == expected.size());
    for (size_t i = 0; i < expected.size(); ++i) {
      CAPTURE(i);
      CHECK_MESSAGE(matches(actual[i], expected[i], c.forward_tolerance),  // NaN: a mean of an empty batch
                    "output ", i, " is ", actual[i], ", the float64 reference ", expected[i]);
    }
    if (!c.differentiable) continue;

    // d/dx of sum(out * w) for random w: backward with explicit gradient w against the
    // central difference of the float64 reference.
    Values w(expected.size());
    for (double& x : w) x = static_cast<float>(gen.normal());
    out.backward(Tensor::from_vector(std::vector<float>(w.begin(), w.end())).reshape(out.shape()));
    auto projected = [&](const std::vector<Values>& v) {
      const Values o = c.reference(v);
      double s = 0;
      for (size_t i = 0; i < o.size(); ++i) s += o[i] * w[i];
      return s;
    };
    for (size_t k = 0; k < inputs.size(); ++k) {
      if (c.inputs[k].kind == Kind::Labels) continue;
      CAPTURE(k);
      const std::vector<float> grad = inputs[k].grad().to_vector();
      REQUIRE(grad.size() == values[k].size());
      for (size_t j = 0; j < values[k].size(); ++j) {
        CAPTURE(j);
        constexpr double h = 1e-6;
        std::vector<Values> plus = values, minus = values;
        plus[k][j] += h;
        minus[k][j] -= h;
        const double numeric = (projected(plus) - projected(minus)) / (2 * h);
        CHECK_MESSAGE(std::abs(grad[j] - numeric) <= c.backward_tolerance * scale_of(numeric), "input ", k,
                      " element ", j, ": backward gives ", grad[j], ", central differences ", numeric);
      }
    }
  }
}

TEST_CASE("op harness: NaN, +inf and -inf inputs give what the reference (PyTorch's rule) gives") {
  // One special value in the first input at a time: at its first element, and for inputs of
  // more than one element also at its last, so NaN must reach exactly the outputs that
  // depend on it and no others.
  const double specials[] = {std::nan(""), HUGE_VAL, -HUGE_VAL};
  Generator gen(99);
  for (const OpCase& c : op_cases()) {
    CAPTURE(c.name);
    const std::vector<Values> values = make_inputs(c, gen);
    if (c.inputs[0].kind == Kind::Labels || values[0].empty()) continue;
    for (double special : specials) {
      for (size_t position : {size_t(0), values[0].size() - 1}) {
        CAPTURE(special);
        CAPTURE(position);
        std::vector<Values> changed = values;
        changed[0][position] = special;
        const Values expected = c.reference(changed);
        NoGradGuard no_grad;
        const std::vector<float> actual = c.op(to_tensors(c, changed)).to_vector();
        REQUIRE(actual.size() == expected.size());
        for (size_t i = 0; i < expected.size(); ++i) {
          CAPTURE(i);
          CAPTURE(expected[i]);
          CAPTURE(actual[i]);
          CHECK(matches(actual[i], expected[i], c.forward_tolerance));
        }
      }
    }
  }
}

TEST_CASE("op harness: every op's forward records a span on the trace's compute lane") {
  Generator gen(99);
  for (const OpCase& c : op_cases()) {
    CAPTURE(c.name);
    const std::vector<Tensor> inputs = to_tensors(c, make_inputs(c, gen));
    trace::start("");  // in memory
    const double before = trace::now_us();
    const Tensor out = c.op(inputs);
    const std::vector<trace::Event> events = trace::events_since(before);
    trace::stop();
    if (out.impl()->storage == inputs[0].impl()->storage) continue;  // a view: no forward work
    CHECK(std::any_of(events.begin(), events.end(),
                      [](const trace::Event& e) { return e.lane == static_cast<int>(trace::Lane::Compute); }));
  }
}

TEST_CASE("Linear forward with given weights: exact values") {
  // x = [[1, 2], [3, 4]], W = [[1, 0], [0.5, -1], [2, 2]], b = [0.25, 0, -1]
  // y = x W^T + b = [[1.25, -1.5, 5], [3.25, -2.5, 13]]
  const Tensor x = Tensor::from_vector({1, 2, 3, 4}, {2, 2});
  const Tensor w = Tensor::from_vector({1, 0, 0.5f, -1, 2, 2}, {3, 2});
  const Tensor b = Tensor::from_vector({0.25f, 0, -1}, {3});
  const Tensor y = linear(x, w, b);
  CHECK(y.shape() == Shape{2, 3});
  CHECK(y.to_vector() == std::vector<float>{1.25f, -1.5f, 5, 3.25f, -2.5f, 13});
}

TEST_CASE("mse_loss and its gradient on small tensors: exact values") {
  // diffs 1, -2, 0.5, 0 -> squares 1, 4, 0.25, 0: sum 5.25, mean 1.3125
  const Tensor x = Tensor::from_vector({2, 0, 1.5f, 3}, {2, 2}).set_requires_grad(true);
  const Tensor t = Tensor::from_vector({1, 2, 1, 3}, {2, 2});
  const Tensor loss = mse_loss(x, t);
  CHECK(loss.item() == 1.3125f);
  loss.backward();
  // d/dx = 2 (x - t) / 4
  CHECK(x.grad().to_vector() == std::vector<float>{0.5f, -1.0f, 0.25f, 0.0f});
  CHECK(mse_loss(x, t, Reduction::Sum).item() == 5.25f);
  CHECK(mse_loss(x, t, Reduction::None).to_vector() == std::vector<float>{1, 4, 0.25f, 0});
}

TEST_CASE("cross_entropy on extreme logits is exact and finite") {
  // [1000, 0]: log-softmax = [0, -1000] exactly in float; target 1 -> loss 1000.
  // [-1e30, 1e30] target 1 -> loss 0; target 0 -> 2e30.
  // [88, 89, 90] (exp overflows float without the max shift) target 2 -> log(1 + e^-1 + e^-2).
  const Tensor logits = Tensor::from_vector({1000, 0, -1e30f, 1e30f}, {2, 2});
  const Tensor target = Tensor::from_vector(std::vector<int64_t>{1, 1});
  const std::vector<float> per_row = cross_entropy(logits, target, Reduction::None).to_vector();
  CHECK(per_row[0] == 1000.0f);
  CHECK(per_row[1] == 0.0f);
  const float huge = cross_entropy(logits, Tensor::from_vector(std::vector<int64_t>{1, 0}), Reduction::None)
                         .to_vector()[1];
  CHECK(huge == 2e30f);
  const Tensor spread = Tensor::from_vector({88, 89, 90}, {1, 3}).set_requires_grad(true);
  const Tensor loss = cross_entropy(spread, Tensor::from_vector(std::vector<int64_t>{2}, {1}));
  CHECK(loss.item() == doctest::Approx(std::log(1 + std::exp(-1.0) + std::exp(-2.0))).epsilon(1e-6));
  loss.backward();
  for (float g : spread.grad().to_vector()) CHECK(std::isfinite(g));
}

TEST_CASE("cross_entropy rejects a target outside [0, C)") {
  const Tensor logits = Tensor::zeros({2, 3});
  try {
    cross_entropy(logits, Tensor::from_vector(std::vector<int64_t>{0, 3}));
    FAIL("expected IndexError");
  } catch (const IndexError& e) {
    CHECK(std::string(e.what()).find("target[1] = 3") != std::string::npos);
  }
}

TEST_CASE("cross_entropy with label_smoothing gives torch's losses and gradients") {
  // torch 1.13: F.cross_entropy(x, [2, 0, -100], label_smoothing=0.1) on the logits below.
  const std::vector<float> values = {1, 2, 3, 1, -1, 0.5f, 0, 4, -2};
  const Tensor target = Tensor::from_vector(std::vector<int64_t>{2, 0, -100});
  Tensor logits = Tensor::from_vector(values, {3, 3}).set_requires_grad(true);
  Tensor loss = cross_entropy(logits, target, Reduction::Mean, kDefaultIgnoreIndex, 0.1);
  CHECK(loss.item() == doctest::Approx(0.5729480981826782).epsilon(1e-6));
  CHECK(cross_entropy(logits, target, Reduction::Sum, kDefaultIgnoreIndex, 0.1).item() ==
        doctest::Approx(1.1458961963653564).epsilon(1e-6));
  const std::vector<float> rows =
      cross_entropy(logits, target, Reduction::None, kDefaultIgnoreIndex, 0.1).to_vector();
  CHECK(rows[0] == doctest::Approx(0.5076059103012085).epsilon(1e-6));
  CHECK(rows[1] == doctest::Approx(0.638290286064148).epsilon(1e-6));
  CHECK(rows[2] == 0.0f);
  loss.backward();
  const std::vector<double> want = {0.02834862284362316,
                                    0.10569757968187332,
                                    -0.13404616713523865,
                                    -0.17961817979812622,
                                    0.02218112163245678,
                                    0.1574370414018631,
                                    0,
                                    0,
                                    0};
  const std::vector<float> grad = logits.grad().to_vector();
  for (int k = 0; k < 9; ++k) CHECK(grad[k] == doctest::Approx(want[k]).epsilon(1e-6));

  // A row's -inf logit makes its smoothed loss inf, with a finite gradient (torch: inf,
  // [0.20227477, -0.06666667, -0.13560808] at label_smoothing 0.2).
  Tensor with_minus_inf =
      Tensor::from_vector(std::vector<float>{0, -INFINITY, 1}, {1, 3}).set_requires_grad(true);
  Tensor inf_loss =
      cross_entropy(with_minus_inf, Tensor::from_vector(std::vector<int64_t>{2}), Reduction::Mean, -100, 0.2);
  CHECK(std::isinf(inf_loss.item()));
  inf_loss.backward();
  const std::vector<float> inf_grad = with_minus_inf.grad().to_vector();
  const std::vector<double> want_inf_grad = {0.20227476954460144, -0.06666667014360428, -0.13560807704925537};
  for (int k = 0; k < 3; ++k) CHECK(inf_grad[k] == doctest::Approx(want_inf_grad[k]).epsilon(1e-6));

  // 1 is allowed (the uniform target alone: torch 1.397948146); 0 is the plain loss, bit for bit.
  CHECK(cross_entropy(logits.detach(), target, Reduction::Mean, -100, 1.0).item() ==
        doctest::Approx(1.397948145866394).epsilon(1e-6));
  CHECK(cross_entropy(logits.detach(), target, Reduction::None, -100, 0.0).to_vector() ==
        cross_entropy(logits.detach(), target, Reduction::None).to_vector());
  // Outside [0, 1], NaN included, is refused as torch refuses it; nn::CrossEntropyLoss passes it on.
  for (double bad : {-0.1, 1.5, std::nan("")})
    CHECK_THROWS_WITH_AS(cross_entropy(logits, target, Reduction::Mean, -100, bad),
                         doctest::Contains("label_smoothing must be between 0.0 and 1.0"), ValueError);
  CHECK(nn::CrossEntropyLoss(Reduction::Sum, kDefaultIgnoreIndex, 0.1)(logits, target).item() ==
        doctest::Approx(1.1458961963653564).epsilon(1e-6));
}

TEST_CASE(
    "cross_entropy with a class weight gives torch's losses and gradients, with and without smoothing") {
  // torch 1.13: F.cross_entropy(x, [2, 0, -100, 1], weight=[0.5, 2, 1.5], label_smoothing=s).
  const std::vector<float> values = {1, 2, 3, 1, -1, 0.5f, 0, 4, -2, 2, 0, 1};
  const Tensor target = Tensor::from_vector(std::vector<int64_t>{2, 0, -100, 1});
  const Tensor weight = Tensor::from_vector(std::vector<float>{0.5f, 2.0f, 1.5f});
  struct Expected {
    double smoothing, mean, sum;
    std::vector<double> rows, grad;
  };
  const std::vector<Expected> expected = {
      {0.0,
       1.4260249137878418,
       5.704099655151367,
       {0.6114089488983154, 0.27747848629951477, 0.0, 4.815212249755859},
       {0.03376146778464317, 0.09177318215370178, -0.12553462386131287, -0.053237877786159515,
        0.009711947292089462, 0.043525926768779755, 0, 0, 0, 0.33262044191360474, -0.45498472452163696,
        0.12236423045396805}},
      {0.1,
       1.4395112991333008,
       5.758045196533203,
       {0.7046155333518982, 0.48205822706222534, 0.0, 4.571372032165527},
       {0.029219672083854675, 0.07408680766820908, -0.10330644249916077, -0.03294418379664421,
        -0.0053360615856945515, 0.03828024864196777, 0, 0, 0, 0.31736642122268677, -0.4231519103050232,
        0.10578541457653046}}};
  for (const Expected& e : expected) {
    CAPTURE(e.smoothing);
    Tensor logits = Tensor::from_vector(values, {4, 3}).set_requires_grad(true);
    Tensor loss = cross_entropy(logits, target, Reduction::Mean, kDefaultIgnoreIndex, e.smoothing, weight);
    CHECK(loss.item() == doctest::Approx(e.mean).epsilon(1e-6));
    CHECK(cross_entropy(logits, target, Reduction::Sum, kDefaultIgnoreIndex, e.smoothing, weight).item() ==
          doctest::Approx(e.sum).epsilon(1e-6));
    const std::vector<float> rows =
        cross_entropy(logits, target, Reduction::None, kDefaultIgnoreIndex, e.smoothing, weight).to_vector();
    for (int r = 0; r < 4; ++r) CHECK(rows[r] == doctest::Approx(e.rows[r]).epsilon(1e-6));
    loss.backward();
    const std::vector<float> grad = logits.grad().to_vector();
    for (int k = 0; k < 12; ++k) CHECK(grad[k] == doctest::Approx(e.grad[k]).epsilon(1e-6).scale(1e-6));
  }
  // A weight of all ones is no weight, bit for bit; rows whose target weighs 0 leave a Mean of
  // 0 / 0 (torch: nan).
  const Tensor logits = Tensor::from_vector(values, {4, 3});
  CHECK(cross_entropy(logits, target, Reduction::None, -100, 0.1, Tensor::ones({3})).to_vector() ==
        cross_entropy(logits, target, Reduction::None, -100, 0.1).to_vector());
  CHECK(std::isnan(cross_entropy(Tensor::from_vector(std::vector<float>{1, 2, 3}, {1, 3}),
                                 Tensor::from_vector(std::vector<int64_t>{0}), Reduction::Mean, -100, 0.0,
                                 Tensor::from_vector(std::vector<float>{0, 1, 1}))
                       .item()));
  // torch 1.13 with weight [0, 1, 2], targets [0, -100, 0]: with or without smoothing the Mean
  // is nan and the counted rows' gradients are nan, the ignored row's 0 (the smoothed part
  // alone, s / C sum_c -w_c log p_c over 0, would be inf).
  for (const double smoothing : {0.0, 0.2}) {
    CAPTURE(smoothing);
    Tensor x = Tensor::from_vector({1, 2, 3, 0.5f, -1, 2, 0, 4, -2}, {3, 3}).set_requires_grad(true);
    Tensor mean = cross_entropy(x, Tensor::from_vector(std::vector<int64_t>{0, -100, 0}), Reduction::Mean,
                                -100, smoothing, Tensor::from_vector(std::vector<float>{0, 1, 2}));
    CHECK(std::isnan(mean.item()));
    mean.backward();
    const std::vector<float> grad = x.grad().to_vector();
    for (int k : {0, 1, 2, 6, 7, 8}) CHECK(std::isnan(grad[k]));
    for (int k : {3, 4, 5}) CHECK(grad[k] == 0.0f);
  }
  // Weights of both signs that sum to 0 without smoothing: torch 1.13's quotient, -inf, for
  // cross_entropy and nll_loss(log_softmax) alike, and its gradient [[nan, inf, inf], [-inf,
  // nan, -inf]].
  {
    Tensor x = Tensor::from_vector({1, 2, 3, 0.5f, -1, 2}, {2, 3}).set_requires_grad(true);
    const Tensor targets = Tensor::from_vector(std::vector<int64_t>{0, 1});
    const Tensor signed_weight = Tensor::from_vector(std::vector<float>{1, -1, 0});
    Tensor mean = cross_entropy(x, targets, Reduction::Mean, -100, 0.0, signed_weight);
    CHECK(mean.item() == -INFINITY);
    CHECK(nll_loss(log_softmax(x.detach(), 1), targets, Reduction::Mean, -100, signed_weight).item() ==
          -INFINITY);
    mean.backward();
    const std::vector<float> grad = x.grad().to_vector();
    CHECK((std::isnan(grad[0]) && std::isnan(grad[4])));
    CHECK((grad[1] == INFINITY && grad[2] == INFINITY && grad[3] == -INFINITY && grad[5] == -INFINITY));
  }
  // No gradient reaches the weight; a weight of another shape or dtype is refused, naming it.
  Tensor trained_weight = Tensor::from_vector(std::vector<float>{0.5f, 2.0f, 1.5f}).set_requires_grad(true);
  Tensor x = Tensor::from_vector(values, {4, 3}).set_requires_grad(true);
  cross_entropy(x, target, Reduction::Mean, -100, 0.0, trained_weight).backward();
  CHECK(x.grad().defined());
  CHECK(!trained_weight.grad().defined());
  CHECK_THROWS_WITH_AS(cross_entropy(logits, target, Reduction::Mean, -100, 0.0, Tensor::ones({4})),
                       doctest::Contains("weight [4] must be [C] = [3]"), ShapeError);
  CHECK_THROWS_WITH_AS(cross_entropy(logits, target, Reduction::Mean, -100, 0.0,
                                     Tensor::from_vector(std::vector<int64_t>{1, 1, 1})),
                       doctest::Contains("weight must be float32"), ValueError);
  // nn::CrossEntropyLoss passes it on.
  CHECK(nn::CrossEntropyLoss(Reduction::Sum, kDefaultIgnoreIndex, 0.1, weight)(logits, target).item() ==
        doctest::Approx(5.758045196533203).epsilon(1e-6));
}

TEST_CASE("log_softmax and nll_loss give torch's values and gradients; together they are cross_entropy") {
  // torch 1.13: torch.log_softmax(x, 1) and its backward from g.
  const std::vector<float> values = {1, 2, 3, 1, -1, 0.5f, 0, 4, -2, 2, 0, 1};
  Tensor x = Tensor::from_vector(values, {4, 3}).set_requires_grad(true);
  Tensor y = log_softmax(x, 1);
  const std::vector<double> want_y = {-2.4076058864593506, -1.4076058864593506,   -0.40760594606399536,
                                      -0.5549569725990295, -2.5549569129943848,   -1.0549569129943848,
                                      -4.020581245422363,  -0.020581139251589775, -6.020581245422363,
                                      -0.4076060354709625, -2.4076061248779297,   -1.4076060056686401};
  const std::vector<float> got_y = y.to_vector();
  for (int k = 0; k < 12; ++k) CHECK(got_y[k] == doctest::Approx(want_y[k]).epsilon(1e-6));
  const Tensor g =
      Tensor::from_vector(std::vector<float>{0.1f, -0.2f, 0.3f, 1, 0, 0, 0, 0, 2, -1, 0.5f, 0.25f}, {4, 3});
  sum(mul(y, g)).backward();
  const std::vector<double> want_dx = {0.08199388533830643,  -0.2489456981420517, 0.16695180535316467,
                                       0.4259030222892761,   -0.0776955783367157, -0.34820741415023804,
                                       -0.03588506579399109, -1.9592584371566772, 1.9951435327529907,
                                       -0.83368980884552,    0.5225076675415039,  0.3111821115016937};
  const std::vector<float> dx = x.grad().to_vector();
  for (int k = 0; k < 12; ++k) CHECK(dx[k] == doctest::Approx(want_dx[k]).epsilon(1e-6).scale(1e-6));
  // Huge values stay finite; a row of -inf is NaN (torch: [0, -1e30, -2e30] and NaN).
  const std::vector<float> extreme =
      log_softmax(
          Tensor::from_vector(std::vector<float>{1e30f, 0, -1e30f, -INFINITY, -INFINITY, -INFINITY}, {2, 3}),
          -1)
          .to_vector();
  CHECK(extreme[0] == 0.0f);
  CHECK(extreme[1] == -1e30f);
  CHECK(extreme[2] == -2e30f);
  for (int k = 3; k < 6; ++k) CHECK(std::isnan(extreme[k]));
  CHECK_THROWS_WITH_AS(log_softmax(x, 0), doctest::Contains("dim 0 is not the class dimension"), ValueError);
  // A 16-bit input is cast up: float32 out (autocast's float32 group).
  CHECK(log_softmax(x.detach().to(DType::BFloat16), 1).dtype() == DType::Float32);
  CHECK_THROWS_AS(log_softmax(Tensor::zeros({2, 3, 4}), 1), ShapeError);

  // torch 1.13: F.nll_loss on fixed log-probabilities, targets [2, 0, -100, 1], with and without
  // weight [0.5, 2, 1.5].
  const Tensor target = Tensor::from_vector(std::vector<int64_t>{2, 0, -100, 1});
  const Tensor weight = Tensor::from_vector(std::vector<float>{0.5f, 2.0f, 1.5f});
  Tensor log_probs =
      Tensor::from_vector(std::vector<float>{-0.5f, -1, -2, -3, -0.25f, -1.5f, -1, -1, -1, -0.1f, -2, -4},
                          {4, 3})
          .set_requires_grad(true);
  CHECK(nll_loss(log_probs, target).item() == doctest::Approx(2.3333332538604736).epsilon(1e-6));
  CHECK(nll_loss(log_probs, target, Reduction::Sum).item() == 7.0f);
  CHECK(nll_loss(log_probs, target, Reduction::None).to_vector() == std::vector<float>{2, 3, 0, 2});
  CHECK(nll_loss(log_probs, target, Reduction::Sum, kDefaultIgnoreIndex, weight).item() == 8.5f);
  CHECK(nll_loss(log_probs, target, Reduction::None, kDefaultIgnoreIndex, weight).to_vector() ==
        std::vector<float>{3, 1.5f, 0, 4});
  Tensor weighted_mean = nll_loss(log_probs, target, Reduction::Mean, kDefaultIgnoreIndex, weight);
  CHECK(weighted_mean.item() == 2.125f);
  weighted_mean.backward();
  CHECK(log_probs.grad().to_vector() ==
        std::vector<float>{0, 0, -0.375f, -0.125f, 0, 0, 0, 0, 0, 0, -0.5f, 0});
  CHECK_THROWS_WITH_AS(nll_loss(log_probs, Tensor::from_vector(std::vector<int64_t>{0, 3, 1, 1})),
                       doctest::Contains("nll_loss: target[1] = 3 is not a class in [0, 3)"), IndexError);
  CHECK(std::isnan(
      nll_loss(log_probs, Tensor::from_vector(std::vector<int64_t>{-100, -100, -100, -100})).item()));

  // nn::LogSoftmax then nn::NLLLoss is nn::CrossEntropyLoss: the same loss and gradient.
  Tensor a = Tensor::from_vector(values, {4, 3}).set_requires_grad(true);
  Tensor b = Tensor::from_vector(values, {4, 3}).set_requires_grad(true);
  Tensor composed =
      nn::NLLLoss(Reduction::Mean, kDefaultIgnoreIndex, weight)(nn::LogSoftmax(1).forward(a), target);
  Tensor fused = nn::CrossEntropyLoss(Reduction::Mean, kDefaultIgnoreIndex, 0.0, weight)(b, target);
  CHECK(composed.item() == doctest::Approx(fused.item()).epsilon(1e-6));
  composed.backward();
  fused.backward();
  const std::vector<float> ga = a.grad().to_vector(), gb = b.grad().to_vector();
  for (int k = 0; k < 12; ++k) CHECK(ga[k] == doctest::Approx(gb[k]).epsilon(1e-6).scale(1e-6));
}

TEST_CASE("cross_entropy ignores rows labelled ignore_index (-100 by default), as PyTorch") {
  // logits [[1, 2, 3], [0, 1, 0], [3, 2, 1]], targets [-100, 1, 1]: row 0 counts for nothing.
  // Row 1: log(2 + e) - 1; row 2: log(e^3 + e^2 + e) - 2; mean over the 2 rows counted is
  // 0.97953 (torch 1.13: 0.9795). The gradient of row r is (softmax - onehot) / 2, row 0's 0.
  const std::vector<float> values = {1, 2, 3, 0, 1, 0, 3, 2, 1};
  const Tensor target = Tensor::from_vector(std::vector<int64_t>{-100, 1, 1});
  const double e = std::exp(1.0);
  const double row1 = std::log(2 + e) - 1, row2 = std::log(e * e * e + e * e + e) - 2;
  Tensor logits = Tensor::from_vector(values, {3, 3}).set_requires_grad(true);
  Tensor loss = cross_entropy(logits, target);
  CHECK(loss.item() == doctest::Approx((row1 + row2) / 2).epsilon(1e-6));
  loss.backward();
  const std::vector<float> grad = logits.grad().to_vector();
  for (int c = 0; c < 3; ++c) CHECK((grad[c] == 0.0f && !std::signbit(grad[c])));
  const double z1 = 2 + e, z2 = e * e * e + e * e + e;
  const std::vector<double> want = {1 / z1 / 2, (e / z1 - 1) / 2, 1 / z1 / 2,
                                    e * e * e / z2 / 2, (e * e / z2 - 1) / 2, e / z2 / 2};
  for (int k = 0; k < 6; ++k) CHECK(grad[3 + k] == doctest::Approx(want[k]).epsilon(1e-6));

  // Sum leaves the row out; None gives it 0.
  CHECK(cross_entropy(logits, target, Reduction::Sum).item() == doctest::Approx(row1 + row2).epsilon(1e-6));
  const std::vector<float> rows = cross_entropy(logits, target, Reduction::None).to_vector();
  CHECK(rows[0] == 0.0f);
  CHECK(rows[1] == doctest::Approx(row1).epsilon(1e-6));
  // Every row ignored: the mean of nothing is NaN (torch too), the sum 0, and no gradient.
  const Tensor all_ignored = Tensor::from_vector(std::vector<int64_t>{-100, -100, -100});
  CHECK(std::isnan(cross_entropy(logits, all_ignored).item()));
  CHECK(cross_entropy(logits, all_ignored, Reduction::Sum).item() == 0.0f);
  // Another ignore_index, inside [0, C): class 1 is ignored, so only row 0 counts (log(e^3 + e^2 + e) - 3).
  CHECK(cross_entropy(logits, Tensor::from_vector(std::vector<int64_t>{2, 1, 1}), Reduction::Mean, 1).item() ==
        doctest::Approx(std::log(z2) - 3).epsilon(1e-6));
  // No class at all: only ignored rows are possible, and no logit is read. [2, 0] logits give
  // a mean of nothing (NaN), a sum of 0 and an empty gradient.
  Tensor no_classes = Tensor::zeros({2, 0}).set_requires_grad(true);
  const Tensor ignored2 = Tensor::from_vector(std::vector<int64_t>{-100, -100});
  CHECK(std::isnan(cross_entropy(no_classes, ignored2).item()));
  CHECK(cross_entropy(no_classes, ignored2, Reduction::None).to_vector() == std::vector<float>{0.0f, 0.0f});
  Tensor no_class_sum = cross_entropy(no_classes, ignored2, Reduction::Sum);
  CHECK(no_class_sum.item() == 0.0f);
  no_class_sum.backward();
  CHECK(no_classes.grad().shape() == Shape{2, 0});
  // Any other negative target is still refused, naming ignore_index.
  try {
    cross_entropy(logits, Tensor::from_vector(std::vector<int64_t>{0, -1, 1}));
    FAIL("expected IndexError");
  } catch (const IndexError& err) {
    CHECK(std::string(err.what()).find("target[1] = -1 is not a class in [0, 3) nor ignore_index -100") !=
          std::string::npos);
  }
}

TEST_CASE("cross_entropy: an ignored row's gradient is NaN where its logits are, as torch's") {
  // torch 1.13: logits [[nan, 0, 1], [1, 2, 3]], target [-100, 1] gives the loss of row 1
  // alone, 1.40760589, and the gradient [[nan, nan, nan], [0.0900306, -0.7552716, 0.6652410]]:
  // log_softmax's backward of the zero gradient nll_loss gives row 0 is 0 - softmax * 0.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  Tensor logits = Tensor::from_vector({nan, 0, 1, 1, 2, 3}, {2, 3}).set_requires_grad(true);
  Tensor loss = cross_entropy(logits, Tensor::from_vector(std::vector<int64_t>{-100, 1}));
  const double z = std::exp(1.0) + std::exp(2.0) + std::exp(3.0);
  CHECK(loss.item() == doctest::Approx(std::log(z) - 2).epsilon(1e-6));
  loss.backward();
  const std::vector<float> grad = logits.grad().to_vector();
  for (int c = 0; c < 3; ++c) CHECK(std::isnan(grad[c]));
  const std::vector<double> want = {std::exp(1.0) / z, std::exp(2.0) / z - 1, std::exp(3.0) / z};
  for (int c = 0; c < 3; ++c) CHECK(grad[3 + c] == doctest::Approx(want[c]).epsilon(1e-6));
}

TEST_CASE("shape mismatches throw with both shapes in the message") {
  auto message_of = [](auto&& fn) {
    try {
      fn();
    } catch (const ShapeError& e) {
      return std::string(e.what());
    }
    return std::string("no ShapeError");
  };
  const Tensor a = Tensor::zeros({2, 3}), b = Tensor::zeros({4, 5}), c = Tensor::zeros({3, 2});
  std::string m = message_of([&] { matmul(a, b); });
  CHECK(m.find("[2, 3]") != std::string::npos);
  CHECK(m.find("[4, 5]") != std::string::npos);
  m = message_of([&] { add(a, c); });
  CHECK(m.find("[2, 3]") != std::string::npos);
  CHECK(m.find("[3, 2]") != std::string::npos);
  m = message_of([&] { mse_loss(a, c); });  // same numel: a loss never broadcasts or reshapes
  CHECK(m.find("[2, 3]") != std::string::npos);
  CHECK(m.find("[3, 2]") != std::string::npos);
  m = message_of([&] { mse_loss(Tensor::zeros({4, 1}), Tensor::zeros({4})); });
  CHECK(m.find("[4, 1]") != std::string::npos);
  CHECK(m.find("[4]") != std::string::npos);
  m = message_of([&] { linear(Tensor::zeros({8, 1}), Tensor::zeros({1, 2}), Tensor::zeros({1})); });
  CHECK(m.find("[8, 1]") != std::string::npos);
  CHECK(m.find("[1, 2]") != std::string::npos);
}

TEST_CASE("NaN and Inf propagate as in PyTorch") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> r = relu(Tensor::from_vector({nan, -inf, inf, -1, 0, 2, -0.0f})).to_vector();
  CHECK(std::isnan(r[0]));  // torch.relu(nan) = nan
  CHECK(r[1] == 0.0f);
  CHECK(r[2] == inf);
  CHECK(r[3] == 0.0f);
  CHECK((r[4] == 0.0f && !std::signbit(r[4])));
  CHECK(r[5] == 2.0f);
  CHECK((r[6] == 0.0f && std::signbit(r[6])));  // torch.relu(-0.0) = -0.0 (clamp_min keeps x unless x < 0)
  // torch's threshold_backward zeroes where the output is <= 0, so a NaN passes its gradient:
  // relu([NaN, 1, -1]).backward([.5, .5, .5]) gives [.5, .5, 0].
  const Tensor x = Tensor::from_vector({nan, 1, -1}).set_requires_grad(true);
  relu(x).backward(Tensor::from_vector({0.5f, 0.5f, 0.5f}));
  CHECK(x.grad().to_vector() == std::vector<float>{0.5f, 0.5f, 0.0f});
  const Tensor m = matmul(Tensor::from_vector({nan, 1}, {1, 2}), Tensor::from_vector({1, 1}, {2, 1}));
  CHECK(std::isnan(m.item()));
  CHECK(std::isnan(mse_loss(Tensor::from_vector({nan}), Tensor::from_vector({0.0f})).item()));
  CHECK(std::isinf(sum(Tensor::from_vector({inf, 1})).item()));
  CHECK(std::isnan(mean(Tensor::zeros({0})).item()));  // mean of nothing
}

TEST_CASE("div by a float is a true division, bit for bit, also where it multiplies by an exact reciprocal") {
  // The kernel multiplies when 1/s is exact (s = 2^e): the rounded result must still be a / s.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const float tiny = std::numeric_limits<float>::denorm_min(), least_normal = std::numeric_limits<float>::min();
  const float largest = std::numeric_limits<float>::max();
  const std::vector<float> values{1.0f, -3.0f, 0.1f, 1.0f / 3.0f, 7e-39f, tiny, 3 * tiny, least_normal, largest,
                                  -largest, 0.0f, -0.0f, nan, inf, -inf, 16777215.0f};
  const Tensor a = Tensor::from_vector(values);
  for (const float s : {2.0f, 4.0f, 0.5f, -8.0f, 3.0f, 0.1f, 1024.0f, std::ldexp(1.0f, -126), std::ldexp(1.0f, -127),
                        std::ldexp(1.0f, 127), std::ldexp(1.0f, -149), inf, 0.0f}) {
    CAPTURE(s);
    const std::vector<float> got = div(a, s).to_vector();
    for (size_t i = 0; i < values.size(); ++i) {
      CAPTURE(values[i]);
      const volatile float expected = values[i] / s;  // one scalar IEEE division
      if (std::isnan(expected)) {
        CHECK(std::isnan(got[i]));
      } else {
        uint32_t got_bits = 0, expected_bits = 0;
        const float e = expected;
        std::memcpy(&got_bits, &got[i], 4);
        std::memcpy(&expected_bits, &e, 4);
        CHECK(got_bits == expected_bits);
      }
    }
  }
}

TEST_CASE("argmax: first index wins ties, NaN counts as the largest") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const Tensor a = Tensor::from_vector({1, 3, 3, 0, 5, nan, 2, 9, -1, -2, -3, -1}, {3, 4});
  CHECK(argmax(a).to_int_vector() == std::vector<int64_t>{1, 1, 0});
  // No rows is fine, no columns is not, with rows or without (torch's "Expected reduction dim
  // 1 to have non-zero size").
  CHECK(argmax(Tensor::zeros({0, 3})).shape() == Shape{0});
  CHECK_THROWS_WITH_AS(argmax(Tensor::zeros({0, 0})), doctest::Contains("has no columns"), ShapeError);
  CHECK_THROWS_WITH_AS(argmax(Tensor::zeros({2, 0})), doctest::Contains("has no columns"), ShapeError);
}

TEST_CASE("conv2d refuses a weight with no output channel, as torch") {
  CHECK_THROWS_WITH_AS(conv2d(Tensor::zeros({1, 2, 4, 4}), Tensor::zeros({0, 2, 3, 3}), Tensor()),
                       doctest::Contains("weight [0, 2, 3, 3] has no output channel"), ShapeError);
}

// Note [Images per GEMM]: the grouping CUDA uses, checked here where no GPU runs it. conv2d's
// backward divides by the group, so an empty batch must still group 1 image.
TEST_CASE(
    "conv2d's images per GEMM: 1 on the CPU; on CUDA the batch, or chunks on 48-column boundaries within 16 "
    "MiB of cols; never 0") {
  using nn::detail::images_per_gemm;
  const Device cpu = Device::cpu(), cuda = Device::cuda(0);
  CHECK(images_per_gemm(cpu, true, 64, 288, 121) == 1);
  CHECK(images_per_gemm(cpu, false, 0, 288, 121) == 1);
  CHECK(images_per_gemm(cuda, true, 0, 288, 121) == 1);  // an empty batch: one (empty) group
  CHECK(images_per_gemm(cuda, false, 0, 288, 121) == 1);
  CHECK(images_per_gemm(cuda, true, 1000, 288, 121) == 1000);  // cols kept for backward: one GEMM
  CHECK(images_per_gemm(cuda, false, 1000, 9, 16) == 1000);    // 16 positions: not chunked
  // The example's second convolution (32 channels, 3x3, 11x11 out) on a 1000-image test batch:
  // 139,392 bytes of cols per image, 120 fit in 16 MiB, and 48 images make whole 48-column
  // panels (121 is odd), so 96.
  const int64_t second = images_per_gemm(cuda, false, 1000, 288, 121);
  CHECK(second == 96);
  CHECK(second * 288 * 121 * 4 <= nn::detail::kMaxUnsavedColsBytes);
  CHECK(images_per_gemm(cuda, false, 5, 288, 121) == 5);  // a batch smaller than a chunk
  // 40 positions: every 6 images end on a 48-column boundary; 7 images fit, all in one group.
  CHECK(images_per_gemm(cuda, false, 7, 1, 40) == 7);
  // An image whose cols alone pass 16 MiB (576 x 100 x 100 floats): the fewest images that
  // end on a boundary, 3 (30,000 columns), not 0.
  CHECK(images_per_gemm(cuda, false, 10, 576, 10000) == 3);
}

TEST_CASE("conv2d under no_grad (cols not kept) equals conv2d recording a graph, bit for bit") {
  // 300 images whose cols take 144 * 15 * 15 floats (130 kB) each: without a graph only one
  // image's cols exist at a time (Note [Images per GEMM]); the result must not change with it.
  Generator gen(7);
  const Tensor x = Tensor::randn({300, 16, 17, 17}, gen);
  const Tensor w = Tensor::randn({8, 16, 3, 3}, gen).set_requires_grad(true);
  const Tensor b = Tensor::randn({8}, gen).set_requires_grad(true);
  const std::vector<float> recorded = conv2d(x, w, b).to_vector();
  std::vector<float> chunked;
  {
    NoGradGuard no_grad;
    chunked = conv2d(x, w, b).to_vector();
  }
  REQUIRE(chunked.size() == recorded.size());
  size_t differing = 0;
  for (size_t i = 0; i < recorded.size(); ++i) differing += std::memcmp(&chunked[i], &recorded[i], sizeof(float)) != 0;
  CHECK(differing == 0);
}

TEST_CASE("cpu matmul's direct paths (thin products and small panels) match a float64 reference") {
  // Note [Thin matmuls]: K <= 16 without transposes, and 2 <= M <= 8 with K >= 128 and b
  // transposed, run direct loops in blocks of 8 rows x 8 columns and of 4 x 2 dot products
  // over 8 lanes (with AVX2 or AVX-512; an SSE2 build runs Eigen's GEMM for all). Note [Panel
  // matmuls]: with at least a block of rows, K <= 64 and K N <= 4096 without transposes, and
  // M N <= 4096 with K <= 1024 and a transposed, run blocks of 6 or 8 rows x 2 vectors of 8 or
  // 16 columns (the Winograd convolution's shapes are here). The sizes leave every remainder
  // (rows, columns, lanes) and cross each limit into Eigen's GEMM.
  struct Case {
    int64_t M, K, N;
    bool trans_b, trans_a = false;
  };
  const Case cases[] = {{1, 1, 1, false},
                        {13, 9, 27, false},
                        {8, 16, 8, false},
                        {32, 9, 676, false},
                        {3, 17, 5, false},
                        {1, 1, 1, true},
                        {9, 676, 32, true},
                        {5, 21, 7, true},
                        {16, 8, 3, true},
                        {4, 3, 2, true},
                        {17, 9, 3, true},
                        // dot products: rows and lanes left over, and each limit crossed
                        {3, 203, 9, true},
                        {8, 784, 5, true},
                        {2, 128, 10, true},
                        {5, 130, 3, true},
                        {9, 700, 4, true},
                        {1, 300, 7, true},
                        {4, 127, 6, true},
                        // panels, without transposes: the CNN's forward and input gradient,
                        // remainders of rows, of vectors and of single columns, past K 64
                        {252, 32, 64, false},
                        {245, 64, 32, false},
                        {13, 40, 37, false},
                        {7, 17, 24, false},
                        {1, 64, 64, false},
                        {5, 65, 16, false},
                        {9, 33, 125, false},
                        // panels with a transposed: the weight gradient, remainders, past M N 4096
                        {32, 252, 64, false, true},
                        {9, 50, 20, false, true},
                        {64, 3, 64, false, true},
                        {65, 3, 64, false, true},
                        {5, 10, 7, false, true},
                        {1, 1, 16, false, true},
                        // and past K 1024 with a transposed; fewer rows than a block
                        {8, 1024, 16, false, true},
                        {8, 1025, 16, false, true},
                        {1, 32, 128, false},
                        {5, 32, 128, false},
                        {7, 40, 64, false}};
  Generator gen(21);
  for (const Case& k : cases) {
    for (const float beta : {0.0f, 1.0f}) {
      CAPTURE(k.M);
      CAPTURE(k.K);
      CAPTURE(k.N);
      CAPTURE(k.trans_b);
      CAPTURE(k.trans_a);
      CAPTURE(beta);
      const std::vector<float> a = Tensor::randn({k.M * k.K}, gen).to_vector();
      const std::vector<float> b = Tensor::randn({k.K * k.N}, gen).to_vector();
      // beta 0 ignores out's old contents, even NaN; beta 1 adds to them.
      std::vector<float> out = beta == 0.0f ? std::vector<float>(k.M * k.N, std::nanf(""))
                                            : Tensor::randn({k.M * k.N}, gen).to_vector();
      const std::vector<float> old = out;
      kernels::cpu::matmul(out.data(), a.data(), b.data(), k.M, k.K, k.N, k.trans_a, k.trans_b, beta);
      size_t wrong = 0;
      for (int64_t m = 0; m < k.M; ++m)
        for (int64_t n = 0; n < k.N; ++n) {
          double want = beta == 0.0f ? 0.0 : old[m * k.N + n], magnitude = std::abs(want);
          for (int64_t i = 0; i < k.K; ++i) {
            const double product = double(k.trans_a ? a[i * k.M + m] : a[m * k.K + i]) *
                                   (k.trans_b ? b[n * k.K + i] : b[i * k.N + n]);
            want += product;
            magnitude += std::abs(product);
          }
          // float32 sums of K + 1 terms: within a few units of rounding of the terms' magnitude.
          wrong += !(std::abs(out[m * k.N + n] - want) <= 1e-6 * (k.K + 1) * magnitude);
        }
      CHECK(wrong == 0);
    }
  }
}

TEST_CASE("im2col / col2im for stride_w 1 equal the general reference loops bit for bit") {
  // Windows that put a row's run at the left edge, the right edge, inside, and nowhere
  // (padding wider than the image); dilation and a vertical stride the runs do not see.
  struct Case {
    int64_t C, H, W, kh, kw, stride_h, pad_h, pad_w, dilation_h, dilation_w;
  };
  // Runs of every length from 1 to 8 (copy_run's overlapping pieces of 1, 2, 4 and 8), and of
  // 11 and 20: whole vectors of 8 and a remainder (copy_run, add_run).
  const Case cases[] = {{16, 8, 8, 3, 3, 1, 1, 1, 1, 1}, {3, 7, 9, 3, 2, 2, 0, 0, 1, 1}, {2, 6, 5, 2, 3, 1, 2, 2, 2, 2},
                        {1, 2, 2, 1, 4, 1, 0, 3, 1, 1},  {4, 5, 6, 3, 3, 1, 0, 1, 1, 3}, {4, 13, 13, 3, 3, 1, 0, 0, 1, 1},
                        {2, 6, 20, 3, 3, 1, 1, 1, 1, 1}, {2, 5, 3, 3, 3, 1, 0, 0, 1, 1}, {2, 4, 5, 2, 3, 1, 1, 0, 1, 1},
                        {3, 6, 6, 3, 3, 2, 1, 0, 1, 1},  {2, 7, 7, 3, 3, 1, 1, 1, 1, 1}, {1, 3, 6, 2, 1, 1, 0, 0, 1, 1}};
  Generator gen(11);
  for (const Case& k : cases) {
    kernels::Window2d g;
    g.channels = k.C, g.height = k.H, g.width = k.W, g.kernel_h = k.kh, g.kernel_w = k.kw;
    g.stride_h = k.stride_h, g.pad_h = k.pad_h, g.pad_w = k.pad_w, g.dilation_h = k.dilation_h;
    g.dilation_w = k.dilation_w;
    g.out_h = (k.H + 2 * k.pad_h - k.dilation_h * (k.kh - 1) - 1) / k.stride_h + 1;
    g.out_w = k.W + 2 * k.pad_w - k.dilation_w * (k.kw - 1);
    CAPTURE(k.W);
    CAPTURE(k.kw);
    CAPTURE(k.pad_w);
    CAPTURE(k.dilation_w);
    REQUIRE(g.out_h >= 1);
    REQUIRE(g.out_w >= 1);
    const int64_t N = 3, cols_size = k.C * k.kh * k.kw * N * g.out_h * g.out_w, images_size = N * k.C * k.H * k.W;
    const std::vector<float> images = Tensor::randn({images_size}, gen).to_vector();
    std::vector<float> fast(cols_size, -1.0f), reference(cols_size, -2.0f);
    kernels::cpu::im2col(fast.data(), images.data(), N, g);
    kernels::cpu::im2col_reference(reference.data(), images.data(), N, g);
    CHECK(std::memcmp(fast.data(), reference.data(), fast.size() * sizeof(float)) == 0);

    const std::vector<float> dcols = Tensor::randn({cols_size}, gen).to_vector();
    std::vector<float> dfast(images_size, -1.0f), dreference(images_size, -2.0f);
    kernels::cpu::col2im(dfast.data(), dcols.data(), N, g);
    kernels::cpu::col2im_reference(dreference.data(), dcols.data(), N, g);
    CHECK(std::memcmp(dfast.data(), dreference.data(), dfast.size() * sizeof(float)) == 0);
  }
}

TEST_CASE("window_taps and taps_reaching equal the taps a scan of the whole kernel finds") {
  int checked = 0;
  for (int64_t size = 1; size <= 7; ++size)
    for (int64_t kernel = 1; kernel <= 6; ++kernel)
      for (int64_t dilation = 1; dilation <= 4; ++dilation)
        for (int64_t stride = 1; stride <= 4; ++stride)
          for (int64_t pad = 0; pad <= 6; ++pad) {
            const int64_t span = size + 2 * pad - dilation * (kernel - 1) - 1;
            if (span < 0) continue;
            const int64_t out = span / stride + 1;
            // Windows: the taps inside [0, size), a contiguous range, for every output.
            for (int64_t o = 0; o < out; ++o) {
              std::vector<int64_t> want;
              for (int64_t i = 0; i < kernel; ++i)
                if (o * stride - pad + i * dilation >= 0 && o * stride - pad + i * dilation < size)
                  want.push_back(i);
              const kernels::Taps taps = kernels::window_taps(o * stride - pad, size, kernel, dilation);
              std::vector<int64_t> got;
              for (int64_t i = taps.first; i < taps.last; ++i) got.push_back(i);
              CHECK(got == want);
            }
            // Positions: the taps by which some window start o stride, o in [0, out), can be reached.
            for (int64_t x = 0; x < size; ++x) {
              std::vector<int64_t> want;
              for (int64_t i = 0; i < kernel; ++i) {
                const int64_t start = x + pad - i * dilation;
                if (start >= 0 && start <= (out - 1) * stride) want.push_back(i);
              }
              const kernels::Taps taps = kernels::taps_reaching(x, pad, kernel, dilation, stride, out);
              std::vector<int64_t> got;
              for (int64_t i = taps.first; i < taps.last; ++i) got.push_back(i);
              CHECK(got == want);
              ++checked;
            }
          }
  CHECK(checked > 1000);
}

TEST_CASE("max_pool2d without padding (no bounds tests) equals max_pool2d_window bit for bit, with or without indices: ties, NaN, inf; backward equals the zero-fill-and-add scatter") {
  // Values from {-2, ..., 2} so that windows hold ties (the first maximum wins), with NaN
  // (the last one wins), +inf and -inf among them; overlapping, dilated and strided windows.
  struct Case {
    int64_t H, W, kh, kw, stride_h, stride_w, dilation_h, dilation_w;
  };
  // Rows of 3, 13, 18 and 19 windows of horizontal stride 2: the vectors of 8 windows, whole and
  // partial, read in place and, for the last plane's last rows, through scratch rows
  // (kernels/cpu/conv.cpp's StrideTwoPoolRows); 2 x 2 windows take its unrolled path.
  const Case cases[] = {{6, 6, 2, 2, 2, 2, 1, 1},   {7, 5, 3, 3, 1, 1, 1, 1},   {8, 9, 2, 3, 1, 2, 2, 2},
                        {5, 4, 1, 1, 3, 2, 1, 1},   {26, 26, 2, 2, 2, 2, 1, 1}, {6, 40, 3, 3, 2, 2, 1, 2},
                        {9, 38, 2, 2, 2, 2, 1, 1}, {11, 10, 3, 3, 3, 3, 1, 1}};
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(), INFINITY, -INFINITY};
  Generator gen(5);
  for (const Case& k : cases) {
    kernels::Window2d g;
    g.channels = 1, g.height = k.H, g.width = k.W, g.kernel_h = k.kh, g.kernel_w = k.kw;
    g.stride_h = k.stride_h, g.stride_w = k.stride_w, g.dilation_h = k.dilation_h, g.dilation_w = k.dilation_w;
    g.out_h = (k.H - k.dilation_h * (k.kh - 1) - 1) / k.stride_h + 1;
    g.out_w = (k.W - k.dilation_w * (k.kw - 1) - 1) / k.stride_w + 1;
    CAPTURE(k.kh);
    CAPTURE(k.stride_w);
    CAPTURE(k.dilation_w);
    const int64_t planes = 3, in_plane = k.H * k.W, out_plane = g.out_h * g.out_w;
    std::vector<float> in = Tensor::randn({planes * in_plane}, gen).to_vector();
    for (size_t i = 0; i < in.size(); ++i) in[i] = i % 11 == 4 ? specials[i % 3] : std::round(in[i] * 1.5f);
    std::vector<float> out(planes * out_plane, -7.0f);
    std::vector<int32_t> indices(planes * out_plane, -7);
    kernels::cpu::max_pool2d_forward(out.data(), indices.data(), in.data(), planes, g);
    size_t differing = 0;
    for (int64_t p = 0; p < planes; ++p)
      for (int64_t oh = 0; oh < g.out_h; ++oh)
        for (int64_t ow = 0; ow < g.out_w; ++ow) {
          const kernels::WindowMax want = kernels::max_pool2d_window(in.data() + p * in_plane, g, oh, ow);
          const int64_t o = p * out_plane + oh * g.out_w + ow;
          differing += std::memcmp(&out[o], &want.value, sizeof(float)) != 0 || indices[o] != want.index;
        }
    CHECK(differing == 0);
    // Without indices (a forward that keeps no graph): the same values, from the same paths.
    std::vector<float> values_only(planes * out_plane, -7.0f);
    kernels::cpu::max_pool2d_forward(values_only.data(), nullptr, in.data(), planes, g);
    CHECK(std::memcmp(values_only.data(), out.data(), out.size() * sizeof(float)) == 0);
    // Backward: disjoint windows (stride >= kernel) store each gradient, overlapping ones add
    // them; both must give the sum, bit for bit (a -0 gradient lands as +0, as 0 + -0 does).
    std::vector<float> dout = Tensor::randn({planes * out_plane}, gen).to_vector();
    dout[0] = -0.0f;
    std::vector<float> want(planes * in_plane, 0.0f), din(planes * in_plane, -7.0f);
    for (int64_t p = 0; p < planes; ++p)
      for (int64_t o = 0; o < out_plane; ++o) want[p * in_plane + indices[p * out_plane + o]] += dout[p * out_plane + o];
    kernels::cpu::max_pool2d_backward(din.data(), dout.data(), indices.data(), planes, g);
    CHECK(std::memcmp(din.data(), want.data(), din.size() * sizeof(float)) == 0);
  }
}

TEST_CASE("dropout's counter-based draw: splitmix64's outputs, about 1 - p kept, a new key per call") {
  // splitmix64 from state 0 gives 0xe220a8397b1dcdaf, 0x6e789e6aa1b965f4, 0x06c45d188009454f;
  // their top 24 bits over 2^24 are the first three draws of key 0.
  CHECK(kernels::dropout_uniform(0, 0) == 0xe220a8 / 16777216.0f);
  CHECK(kernels::dropout_uniform(0, 1) == 0x6e789e / 16777216.0f);
  CHECK(kernels::dropout_uniform(0, 2) == 0x06c45d / 16777216.0f);
  // 100000 elements at p = 0.25: kept ones are 4/3, about 75000 of them (binomial standard
  // deviation 137, so 1000 off is over 7 deviations).
  Generator gen(8);
  const Tensor ones = Tensor::ones({100000});
  const std::vector<float> first = dropout(ones, 0.25f, /*training=*/true, gen).to_vector();
  int64_t kept = 0;
  for (float v : first) {
    REQUIRE((v == 0.0f || v == 1.0f / 0.75f));
    kept += v != 0.0f;
  }
  CHECK(std::abs(kept - 75000) < 1000);
  // The next call draws a new key, so another mask (two equal ones by chance: 0.625^100000).
  CHECK(dropout(ones, 0.25f, /*training=*/true, gen).to_vector() != first);
  // The same seed gives the same mask.
  Generator again(8);
  CHECK(dropout(ones, 0.25f, /*training=*/true, again).to_vector() == first);
}

TEST_CASE("dropout scales what it keeps by torch's float32 1 / (1 - p), p taken as a double") {
  // torch 1.13's kept values of F.dropout(torch.ones(100000), p) on CPU. From a float p, 1 - 0.9f
  // is 0.100000024 and the scale 9.99999809.
  const std::vector<std::pair<double, float>> torch_scales = {
      {0.9, 10.0f}, {0.99, 100.0f}, {0.3, 1.42857146f}, {0.1, 1.11111116f}, {0.5, 2.0f}};
  for (const auto& p_scale : torch_scales) {
    const double p = p_scale.first;  // not a structured binding: doctest's messages capture it
    const float scale = p_scale.second;
    Generator gen(3);
    const std::vector<float> y = dropout(Tensor::ones({1000}), p, /*training=*/true, gen).to_vector();
    int64_t kept = 0;
    for (float v : y) {
      kept += v != 0.0f;
      if (v != 0.0f) REQUIRE_MESSAGE(v == scale, "p ", p, ": kept ", v, ", torch ", scale);
    }
    CHECK_MESSAGE(kept > 0, "p ", p);
  }
}
