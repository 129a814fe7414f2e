// The op harness: every differentiable op, forward against a float64 reference and backward
// against central finite differences of that reference. To add an op, add a row to cases().
#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "core/ops.h"
#include "core/random.h"

using namespace nanoddp;

namespace {

using Values = std::vector<double>;

enum class Kind { Normal, Labels };

struct InputSpec {
  Shape shape;
  Kind kind = Kind::Normal;
  int64_t classes = 0;  // for Labels
};

struct OpCase {
  std::string name;
  std::vector<InputSpec> inputs;
  std::function<Tensor(const std::vector<Tensor>&)> op;
  // float64 forward on the same (flattened) inputs; returns the flattened output.
  std::function<Values(const std::vector<Values>&)> reference;
  double forward_tolerance = 1e-5;   // relative to max(1, |reference|)
  double backward_tolerance = 1e-4;
  bool differentiable = true;
};

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

Values ref_cross_entropy(const Values& logits, const Values& target, int64_t N, int64_t C, Reduction r) {
  Values out;
  double total = 0;
  for (int64_t n = 0; n < N; ++n) {
    double max = logits[n * C];
    for (int64_t c = 1; c < C; ++c) max = std::max(max, logits[n * C + c]);
    double s = 0;
    for (int64_t c = 0; c < C; ++c) s += std::exp(logits[n * C + c] - max);
    const double loss = max + std::log(s) - logits[n * C + static_cast<int64_t>(target[n])];
    out.push_back(loss);
    total += loss;
  }
  if (r == Reduction::None) return out;
  return {r == Reduction::Mean ? total / N : total};
}

double ref_sum(const Values& a) {
  double s = 0;
  for (double v : a) s += v;
  return s;
}

// ---- the table ----------------------------------------------------------------------------
std::vector<OpCase> cases() {
  std::vector<OpCase> rows;
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
  rows.push_back({"relu", {{{4, 5}}}, [](auto& in) { return relu(in[0]); },
                  [](auto& in) { Values o = in[0]; for (double& v : o) v = v > 0 ? v : 0; return o; }});
  for (Reduction r : {Reduction::Mean, Reduction::Sum, Reduction::None}) {
    const std::string suffix = r == Reduction::Mean ? "mean" : r == Reduction::Sum ? "sum" : "none";
    rows.push_back({"mse_loss " + suffix, {{{4, 3}}, {{4, 3}}},
                    [r](auto& in) { return mse_loss(in[0], in[1], r); },
                    [r](auto& in) { return ref_mse(in[0], in[1], r); }});
    rows.push_back({"cross_entropy " + suffix, {{{6, 5}}, {{6}, Kind::Labels, 5}},
                    [r](auto& in) { return cross_entropy(in[0], in[1], r); },
                    [r](auto& in) { return ref_cross_entropy(in[0], in[1], 6, 5, r); }});
  }
  rows.push_back({"reshape", {{{2, 6}}}, [](auto& in) { return in[0].reshape({3, -1}) * 1.0f; },
                  [](auto& in) { return in[0]; }});
  rows.push_back({"two-layer MLP", {{{4, 5}}, {{6, 5}}, {{6}}, {{3, 6}}, {{3}}, {{4}, Kind::Labels, 3}},
                  [](auto& in) { return cross_entropy(linear(relu(linear(in[0], in[1], in[2])), in[3], in[4]), in[5]); },
                  [](auto& in) {
                    Values h = ref_linear(in[0], in[1], in[2], 4, 5, 6);
                    for (double& v : h) v = v > 0 ? v : 0;
                    return ref_cross_entropy(ref_linear(h, in[3], in[4], 4, 6, 3), in[5], 4, 3, Reduction::Mean);
                  }});
  return rows;
}

std::vector<Values> make_inputs(const OpCase& c, Generator& gen) {
  std::vector<Values> values;
  for (const InputSpec& spec : c.inputs) {
    Values v(spec.shape.numel());
    for (double& x : v)
      x = spec.kind == Kind::Labels ? static_cast<double>(gen.randint(spec.classes)) : static_cast<double>(gen.normal());
    values.push_back(v);
  }
  return values;
}

std::vector<Tensor> to_tensors(const OpCase& c, const std::vector<Values>& values) {
  std::vector<Tensor> tensors;
  for (size_t i = 0; i < values.size(); ++i) {
    const InputSpec& spec = c.inputs[i];
    if (spec.kind == Kind::Labels) {
      std::vector<int64_t> labels(values[i].begin(), values[i].end());
      tensors.push_back(Tensor::from_vector(labels, spec.shape));
    } else {
      std::vector<float> floats(values[i].begin(), values[i].end());
      tensors.push_back(Tensor::from_vector(floats, spec.shape).set_requires_grad(true));
    }
  }
  return tensors;
}

double scale_of(double reference) { return std::max(1.0, std::abs(reference)); }

}  // namespace

TEST_CASE("op harness: forward vs float64, backward vs central differences") {
  Generator gen(1234);
  for (const OpCase& c : cases()) {
    CAPTURE(c.name);
    // Inputs are rounded to float32 first, so both sides see the same numbers.
    std::vector<Values> values = make_inputs(c, gen);
    for (Values& v : values)
      for (double& x : v) x = static_cast<float>(x);
    std::vector<Tensor> inputs = to_tensors(c, values);

    const Tensor out = c.op(inputs);
    const Values expected = c.reference(values);
    const std::vector<float> actual = out.to_vector();
    REQUIRE(actual.size() == expected.size());
    for (size_t i = 0; i < expected.size(); ++i) {
      CAPTURE(i);
      CHECK(std::abs(actual[i] - expected[i]) <= c.forward_tolerance * scale_of(expected[i]));
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
        CHECK(std::abs(grad[j] - numeric) <= c.backward_tolerance * scale_of(numeric));
      }
    }
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
  const std::vector<float> r = relu(Tensor::from_vector({nan, -inf, inf, -1, 0, 2})).to_vector();
  CHECK(std::isnan(r[0]));  // torch.relu(nan) = nan
  CHECK(r[1] == 0.0f);
  CHECK(r[2] == inf);
  CHECK(r[3] == 0.0f);
  CHECK(r[5] == 2.0f);
  const Tensor m = matmul(Tensor::from_vector({nan, 1}, {1, 2}), Tensor::from_vector({1, 1}, {2, 1}));
  CHECK(std::isnan(m.item()));
  CHECK(std::isnan(mse_loss(Tensor::from_vector({nan}), Tensor::from_vector({0.0f})).item()));
  CHECK(std::isinf(sum(Tensor::from_vector({inf, 1})).item()));
  CHECK(std::isnan(mean(Tensor::zeros({0})).item()));  // mean of nothing
}

TEST_CASE("argmax: first index wins ties, NaN counts as the largest") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const Tensor a = Tensor::from_vector({1, 3, 3, 0, 5, nan, 2, 9, -1, -2, -3, -1}, {3, 4});
  CHECK(argmax(a).to_int_vector() == std::vector<int64_t>{1, 1, 0});
}
