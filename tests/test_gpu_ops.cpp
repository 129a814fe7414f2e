// The op harness, CUDA column: every row of tests/op_cases.h on cuda:0 against the CPU, on
// the same inputs: the forward, each input's gradient, and the forward with NaN/±inf in the
// first input. Exits 77 (SKIP) without a GPU (tests/test_gpu_main.cpp).
#include "tests/test_gpu_util.h"

#include "core/autograd.h"
#include "tests/op_cases.h"

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
