// The op harness, CUDA column: every row of tests/op_cases.cpp on cuda:0 against the CPU, on
// the same inputs: the forward, each input's gradient, and the forward with NaN/±inf in the
// first input. Exits 77 (SKIP) without a GPU (tests/test_gpu_main.cpp).
#include <algorithm>
#include <cmath>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/autograd.h"
#include "core/ops.h"
#include "nn/activations.h"
#include "nn/autocast.h"
#include "nn/batch_norm.h"
#include "nn/conv.h"
#include "tests/op_cases.h"
#include "tests/test_gpu_util.h"

using namespace nanoddp;
using namespace nanoddp::testing;

namespace {

// CUDA and CPU differ by float rounding (fma contraction, other summation orders).
constexpr double kRtol = 1e-5, kAtol = 1e-5;

// Forward and the gradient of sum(out * w) w.r.t. every float input, on device.
std::vector<std::vector<float>> run_on(const OpCase& c, const std::vector<Values>& values, const std::vector<float>& w,
                                       Device device) {
  std::vector<Tensor> inputs = to_tensors(c, values, device);
  const Tensor out = c.op(inputs);
  std::vector<std::vector<float>> results{out.to_vector()};
  if (!c.differentiable) return results;
  out.backward(Tensor::from_vector(w, out.shape(), device));
  for (size_t k = 0; k < inputs.size(); ++k)
    if (c.inputs[k].kind != Kind::Labels) results.push_back(inputs[k].grad().to_vector());
  return results;
}

// op(x) and its gradient for dy on the CPU and on CUDA, in the tails of an elementwise op:
// NaN where the CPU has NaN, the CPU's infinities exactly, the finite rest within rounding.
void expect_cuda_tails_match_cpu(const std::string& name, const std::vector<float>& x,
                                 const std::vector<float>& dy,
                                 const std::function<Tensor(const Tensor&)>& op) {
  std::vector<std::vector<float>> results;  // CPU value, CPU gradient, CUDA value, CUDA gradient
  for (Device device : {Device::cpu(), Device::cuda(0)}) {
    Tensor input = Tensor::from_vector(x).to(device).set_requires_grad(true);
    const Tensor y = op(input);
    y.backward(Tensor::from_vector(dy).to(device));
    results.push_back(y.to(Device::cpu()).to_vector());
    results.push_back(input.grad().to(Device::cpu()).to_vector());
  }
  for (size_t r = 0; r < 2; ++r) {
    std::vector<float> cpu = results[r], gpu = results[r + 2];
    for (size_t i = 0; i < x.size(); ++i) {
      CAPTURE(i);
      CHECK(std::isnan(gpu[i]) == std::isnan(cpu[i]));
      CHECK((std::isinf(cpu[i]) ? gpu[i] == cpu[i] : !std::isinf(gpu[i])));
      if (!std::isfinite(cpu[i])) cpu[i] = gpu[i] = 0;
    }
    expect_close(name + (r == 0 ? " value" : " gradient"), gpu, cpu, kRtol, kAtol);
  }
}

}  // namespace

TEST_CASE("op harness on CUDA: forward and gradients equal the CPU's") {
  Generator gen(4321);
  for (const OpCase& c : op_cases()) {
    CAPTURE(c.name);
    const std::vector<Values> values = make_inputs(c, gen);
    const int64_t out_numel = c.op(to_tensors(c, values)).numel();
    const std::vector<float> w = normals(out_numel, 5);
    const auto cpu = run_on(c, values, w, Device::cpu());
    const auto gpu = run_on(c, values, w, Device::cuda(0));
    REQUIRE(cpu.size() == gpu.size());
    for (size_t r = 0; r < cpu.size(); ++r)
      expect_close(c.name + (r == 0 ? " forward" : " gradient " + std::to_string(r - 1)), gpu[r], cpu[r], kRtol, kAtol);
  }
}

TEST_CASE("op harness on CUDA: NaN and ±inf inputs give the CPU's outputs") {
  Generator gen(8765);
  for (const OpCase& c : op_cases()) {
    CAPTURE(c.name);
    std::vector<Values> values = make_inputs(c, gen);
    if (c.inputs[0].kind == Kind::Labels || values[0].empty()) continue;
    for (double special : {std::nan(""), HUGE_VAL, -HUGE_VAL}) {
      values[0][0] = special;
      NoGradGuard no_grad;
      const std::vector<float> cpu = c.op(to_tensors(c, values)).to_vector();
      const std::vector<float> gpu = c.op(to_tensors(c, values, Device::cuda(0))).to_vector();
      std::vector<float> cpu_finite = cpu, gpu_finite = gpu;
      for (size_t i = 0; i < cpu.size(); ++i) {
        CHECK_MESSAGE((std::isinf(cpu[i]) ? gpu[i] == cpu[i] : true), c.name, " element ", i);
        if (std::isinf(cpu[i])) cpu_finite[i] = gpu_finite[i] = 0;
      }
      expect_close(c.name + " with " + std::to_string(special), gpu_finite, cpu_finite, kRtol, kAtol);
    }
  }
}

// Note [Images per GEMM] (nn/conv.cpp): without a graph, CUDA runs a large batch in chunks of
// images whose cols fit kMaxUnsavedColsBytes (16 MiB). Here 72 x 784 floats of cols per image
// give chunks of 72 images: 72, 72 and 56 for 200. The chunks' outputs must equal one GEMM
// over the batch (the graph-keeping forward) and the CPU's.
TEST_CASE("conv2d on CUDA without a graph runs in chunks of images and equals the whole-batch forward") {
  Generator gen(21);
  const Tensor x = Tensor::randn({200, 8, 28, 28}, gen), w = Tensor::randn({4, 8, 3, 3}, gen) * 0.3f;
  const Tensor b = Tensor::randn({4}, gen);
  const Device cuda = Device::cuda(0);
  const Tensor xg = x.to(cuda), wg = w.to(cuda).detach().set_requires_grad(true), bg = b.to(cuda);
  const std::vector<float> whole = conv2d(xg, wg, bg, 1, 1).to_vector();  // keeps cols: one GEMM
  std::vector<float> chunked;
  {
    NoGradGuard no_grad;
    chunked = conv2d(xg, wg, bg, 1, 1).to_vector();
  }
  expect_close("chunked vs whole-batch conv2d on CUDA", chunked, whole, 1e-6, 1e-6);
  NoGradGuard no_grad;
  expect_close("chunked conv2d on CUDA vs the CPU", chunked, conv2d(x, w, b, 1, 1).to_vector(), 1e-4, 1e-4);
}

// torch.nn.BatchNorm1d's running statistics: with momentum 0.1, and with momentum None (the
// cumulative average over num_batches_tracked), three training steps on CUDA end with the
// CPU's running_mean, running_var (unbiased) and count.
TEST_CASE("BatchNorm1d updates its running statistics on CUDA as on the CPU") {
  for (const std::optional<float> momentum : {std::optional<float>(0.1f), std::optional<float>()}) {
    CAPTURE(momentum.has_value());
    nn::BatchNorm1d cpu_bn(5, 1e-5f, momentum), gpu_bn(5, 1e-5f, momentum);
    gpu_bn.to(Device::cuda(0));
    Generator gen(22);
    for (int step = 0; step < 3; ++step) {
      const Tensor x = Tensor::randn({7, 5, 3}, gen) * 2.0f + Tensor::full({3}, 1.5f);
      cpu_bn(x);
      gpu_bn(x.to(Device::cuda(0)));
    }
    expect_close("running_mean", gpu_bn.running_mean.to_vector(), cpu_bn.running_mean.to_vector(), 1e-5, 1e-6);
    expect_close("running_var", gpu_bn.running_var.to_vector(), cpu_bn.running_var.to_vector(), 1e-5, 1e-6);
    CHECK(gpu_bn.num_batches_tracked.to(Device::cpu()).to_int_vector() == std::vector<int64_t>{3});
  }
}

TEST_CASE("softplus on CUDA far in the tails: value and gradient equal the CPU's, NaN and inf included") {
  // Threshold 100: between 88.7 and it, e^x is inf on both devices, so the value is inf and
  // the gradient z / (z + 1) NaN; below -88 the gradient is a subnormal; NaN stays NaN.
  const std::vector<float> x{NAN, -INFINITY, INFINITY, -1e30f, -100, -90, 0.5f, 25, 85, 90, 1e3f, 1e30f};
  const std::vector<float> dy{1, 2, 3, -1, 1, 1, 0.5f, 1, 1, 1, 1, 1};
  expect_cuda_tails_match_cpu("softplus", x, dy, [](const Tensor& input) { return softplus(input, 1, 100); });
}

TEST_CASE(
    "GELU's tanh form on CUDA far in the tails: value and gradient equal the CPU's, NaN and inf included") {
  // Past |x| = 9.6 the CPU runs the same host-device functions as the kernel; inside, its own
  // vectorised form (Note [GELU's tanh form] in kernels/cpu/activations.cpp).
  const std::vector<float> x{NAN,   -INFINITY, INFINITY, -1e15f, -1.2e13f, -12,
                             -9.7f, -9.5f,     -4.875f,  0.5f,   9.7f,     1e15f};
  expect_cuda_tails_match_cpu("gelu tanh", x, std::vector<float>(x.size(), 1.0f),
                              [](const Tensor& input) { return gelu(input, "tanh"); });
}

TEST_CASE("GELU's exact form on CUDA in its lower tail: value and gradient equal the CPU's, NaN and inf included") {
  // Below x = -3 the CPU takes Phi from erfc, the kernel from normcdff everywhere (Note
  // [GELU's lower tail] in kernels/cpu/activations.cpp): both keep their digits there.
  const std::vector<float> x{NAN, -INFINITY, INFINITY, -1e15f, -20, -13, -8, -5.62f, -3.5f, -3, -1, 0.5f, 4, 1e15f};
  expect_cuda_tails_match_cpu("gelu", x, std::vector<float>(x.size(), 1.0f),
                              [](const Tensor& input) { return gelu(input); });
}

// The CPU column's rules on CUDA too (test_nn's batch_norm case): with eps = 0 a constant
// channel gets the bias and no gradient; in eval the input gradient ignores x, NaN included.
TEST_CASE("batch_norm on CUDA: eps = 0 on a constant channel, and a NaN input in eval, as on the CPU") {
  const Device gpu = Device::cuda(0);
  const Tensor x = Tensor::from_vector({5, 1, 5, 2, 5, 3}, {3, 2});
  Tensor input = x.to(gpu).set_requires_grad(true);
  Tensor weight = Tensor::from_vector({2, 3}).to(gpu).set_requires_grad(true);
  Tensor bias = Tensor::from_vector({0.5f, -1}).to(gpu).set_requires_grad(true);
  const Tensor y = batch_norm(input, Tensor(), Tensor(), weight, bias, /*training=*/true, 0.1f, /*eps=*/0.0f);
  sum(y * Tensor::from_vector({1, 2, 3, 4, 5, 6}, {3, 2}).to(gpu)).backward();
  const std::vector<float> out = y.to(Device::cpu()).to_vector();
  const std::vector<float> dx = input.grad().to(Device::cpu()).to_vector();
  for (int64_t row = 0; row < 3; ++row) {
    CHECK(out[2 * row] == 0.5f);
    CHECK(dx[2 * row] == 0.0f);
  }
  for (float v : out) CHECK(std::isfinite(v));
  for (float v : dx) CHECK(std::isfinite(v));
  CHECK(weight.grad().to(Device::cpu()).to_vector()[0] == 0.0f);

  Tensor sample = Tensor::from_vector({1, NAN, 2, 3}, {2, 2}).to(gpu).set_requires_grad(true);
  batch_norm(sample, Tensor::zeros({2}).to(gpu), Tensor::ones({2}).to(gpu), Tensor(), Tensor(),
             /*training=*/false)
      .backward(Tensor::ones({2, 2}).to(gpu));
  const float invstd = static_cast<float>(1 / std::sqrt(1.0 + double(1e-5f)));
  CHECK(sample.grad().to(Device::cpu()).to_vector() == std::vector<float>(4, invstd));
}

TEST_CASE(
    "batch_norm on CUDA: output and every gradient equal the CPU's, NaN and inf included, in training and "
    "eval") {
  // Within 1e-6 relative; NaN where the CPU has NaN, the same infinity where it has one.
  struct Run {
    std::vector<float> out, dx, dweight, dbias;
  };
  const auto run = [](Device device, const std::vector<float>& x_values, bool training, float eps,
                      float running_var) {
    Tensor input = Tensor::from_vector(x_values, {3, 2}).to(device).set_requires_grad(true);
    Tensor weight = Tensor::from_vector({2, 3}).to(device).set_requires_grad(true);
    Tensor bias = Tensor::from_vector({0.5f, -1}).to(device).set_requires_grad(true);
    const Tensor mean = Tensor::zeros({2}).to(device), var = Tensor::full({2}, running_var).to(device);
    const Tensor y = training ? batch_norm(input, Tensor(), Tensor(), weight, bias, true, 0.1f, eps)
                              : batch_norm(input, mean, var, weight, bias, false, 0.1f, eps);
    sum(y * Tensor::from_vector({1, 2, 3, 4, 5, 6}, {3, 2}).to(device)).backward();
    const auto host = [](const Tensor& t) { return t.to(Device::cpu()).to_vector(); };
    return Run{host(y), host(input.grad()), host(weight.grad()), host(bias.grad())};
  };
  const auto same = [](const char* what, const std::vector<float>& got, const std::vector<float>& want) {
    CAPTURE(what);
    REQUIRE(got.size() == want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      CAPTURE(i);
      if (std::isnan(want[i]))
        CHECK(std::isnan(got[i]));
      else if (std::isinf(want[i]))
        CHECK(got[i] == want[i]);
      else
        CHECK(std::abs(got[i] - want[i]) <= 1e-6f * std::max(1.0f, std::abs(want[i])));
    }
  };
  struct Case {
    const char* name;
    std::vector<float> x;
    bool training;
    float eps, running_var;
  };
  const Case cases[] = {
      {"training, eps 0, channel 0 constant", {5, 1, 5, 2, 5, 3}, true, 0.0f, 1.0f},
      {"eval, a NaN input", {1, NAN, 2, 3, 4, 5}, false, 1e-5f, 1.0f},
      // In eval a zero running_var with eps 0 is 1 / 0 on both devices, as in torch: the zero
      // rule is for batch statistics only.
      {"eval, eps 0, running_var 0", {5, 1, 5, 2, 5, 3}, false, 0.0f, 0.0f},
  };
  for (const Case& c : cases) {
    CAPTURE(c.name);
    const Run want = run(Device::cpu(), c.x, c.training, c.eps, c.running_var);
    const Run got = run(Device::cuda(0), c.x, c.training, c.eps, c.running_var);
    same("output", got.out, want.out);
    same("input gradient", got.dx, want.dx);
    same("weight gradient", got.dweight, want.dweight);
    same("bias gradient", got.dbias, want.dbias);
  }
}

// The MLP of fashion_mnist in bfloat16 autocast on CUDA (cublasGemmEx, the cast kernels)
// against the same on the CPU: outputs bfloat16, parameter gradients float32, both within a
// few bfloat16 roundings of each other.
TEST_CASE("bf16 autocast on CUDA: linear, relu and cross_entropy match the CPU within bf16 tolerance") {
  Generator gen(31);
  const Tensor x = Tensor::randn({64, 784}, gen), w1 = Tensor::randn({256, 784}, gen) * 0.03f,
               w2 = Tensor::randn({10, 256}, gen) * 0.06f, b1 = Tensor::randn({256}, gen) * 0.1f;
  const Tensor y = Tensor::from_vector(std::vector<int64_t>(64, 3));
  auto run = [&](Device device) {
    Tensor p1 = w1.to(device).detach().set_requires_grad(true), p2 = w2.to(device).detach().set_requires_grad(true);
    Tensor logits;
    {
      nn::autocast guard(DType::BFloat16);
      logits = linear(relu(linear(x.to(device), p1, b1.to(device))), p2, Tensor());
    }
    CHECK(logits.dtype() == DType::BFloat16);
    cross_entropy(logits, y.to(device)).backward();
    CHECK(p1.grad().dtype() == DType::Float32);
    return std::vector<std::vector<float>>{logits.to(DType::Float32).to_vector(), p1.grad().to_vector(),
                                           p2.grad().to_vector()};
  };
  const auto gpu = run(Device::cuda(0)), cpu = run(Device::cpu());
  expect_close("bf16 logits, CUDA vs CPU", gpu[0], cpu[0], 2e-2, 2e-2);
  expect_close("first layer's weight gradient, CUDA vs CPU", gpu[1], cpu[1], 3e-2, 1e-3);
  expect_close("last layer's weight gradient, CUDA vs CPU", gpu[2], cpu[2], 3e-2, 1e-3);
}
