#include <doctest/doctest.h>

#include <vector>

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
  SGD opt({p}, {/*lr=*/0.1f, /*momentum=*/0.9f, /*dampening=*/0.0f, /*weight_decay=*/0.1f});
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

TEST_CASE("SGD with dampening and nesterov") {
  // dampening 0.5, momentum 0.5, lr 1, p = 1, g = 0.5: step 1 buf = g = 0.5 (no dampening on
  // the first step), p = 0.5; step 2 buf = 0.25 + 0.25 = 0.5, p = 0.
  Tensor p = param_with_grad();
  SGD damped({p}, {/*lr=*/1.0f, /*momentum=*/0.5f, /*dampening=*/0.5f});
  step_times(damped, p, 2);
  CHECK(p.at({0}) == doctest::Approx(0.0).epsilon(1e-7));
  // nesterov, momentum 0.5, lr 1, g = 0.5: step 1 buf = 0.5, d = 0.5 + 0.25 = 0.75, p = 0.25;
  // step 2 buf = 0.25 + 0.5 = 0.75, d = 0.5 + 0.375 = 0.875, p = -0.625.
  Tensor q = param_with_grad();
  SGD nesterov({q}, {/*lr=*/1.0f, /*momentum=*/0.5f, /*dampening=*/0.0f, /*weight_decay=*/0.0f, /*nesterov=*/true});
  step_times(nesterov, q, 2);
  CHECK(q.at({0}) == doctest::Approx(-0.625).epsilon(1e-7));
}

TEST_CASE("a parameter with no gradient is skipped") {
  Tensor a = Tensor::from_vector({1.0f}).set_requires_grad(true);
  Tensor b = Tensor::from_vector({1.0f}).set_requires_grad(true);
  b.set_grad(Tensor::from_vector({1.0f}));
  SGD opt({a, b}, {/*lr=*/0.5f, /*momentum=*/0.9f});
  opt.step();
  CHECK(a.item() == 1.0f);
  CHECK(b.item() == 0.5f);
  CHECK(opt.state_dict().size() == 1);  // no buffer for a
  opt.zero_grad();
  CHECK_FALSE(b.grad().defined());
}

TEST_CASE("SGD state_dict restores momentum so a resumed run matches an uninterrupted one") {
  Tensor p = param_with_grad(), q = param_with_grad();
  const SGDOptions options{/*lr=*/0.1f, /*momentum=*/0.9f};
  SGD straight({p}, options);
  step_times(straight, p, 4);
  SGD first({q}, options);
  step_times(first, q, 2);
  SGD resumed({q}, options);
  resumed.load_state_dict(first.state_dict());
  step_times(resumed, q, 2);
  CHECK(q.to_vector() == p.to_vector());
}

TEST_CASE("SGD rejects bad hyper-parameters as PyTorch does") {
  Tensor p = param_with_grad();
  CHECK_THROWS_AS(SGD({p}, {/*lr=*/-1.0f}), ValueError);
  CHECK_THROWS_AS(SGD({p}, {/*lr=*/0.1f, /*momentum=*/-0.1f}), ValueError);
  CHECK_THROWS_AS(SGD({p}, {0.1f, 0.0f, 0.0f, 0.0f, /*nesterov=*/true}), ValueError);
}

TEST_CASE("SGD refuses a parameter listed twice instead of stepping it twice") {
  Tensor p = param_with_grad();
  Tensor q = param_with_grad();
  try {
    SGD opt({p, q, p}, {/*lr=*/0.1f});
    FAIL("SGD accepted a duplicate parameter");
  } catch (const ValueError& e) {
    CHECK(std::string(e.what()).find("parameter 2 is parameter 0 again") != std::string::npos);
  }
}
