// Extending nanoddp with a layer of your own, in one file outside the library's folders: a
// LeakyReLU op with its forward and its backward (record(), right below), a Module that uses
// it, a gradient check by central differences, and a short DDP-ready training run.
//
//   build/examples/custom_layer                  # or under nanoddp-run: DDP works unchanged
//   build/tools/nanoddp-run --nproc-per-node 2 build/examples/custom_layer --backend gloo
//
// Inside the library a layer also gets a kernel per device and a row in the op harness
// (tests/op_cases.cpp); docs/adding-a-layer.md walks through that. Here the kernel is a plain
// host loop: on a GPU tensor (--device cuda) the op copies its input to host memory and its
// result back, which is correct but slow; a CUDA kernel is what removes those copies.
#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <optional>

#include "core/autograd.h"
#include "core/op_helpers.h"
#include "core/trace.h"
#include "dist/ddp.h"
#include "dist/explain.h"
#include "dist/init.h"
#include "examples/example_utils.h"
#include "examples/process_group_flags.h"
#include "tools/cli_checks.h"
#include "nn/layers.h"
#include "nn/optim.h"

using namespace nanoddp;

// ---- the op: y = x if x > 0 else slope * x ---------------------------------------------

// x: any shape, float32, any device -> same shape and device
// (torch.nn.functional.leaky_relu). The kernels run on the host (see the top of the file).
Tensor leaky_relu(const Tensor& x, float slope) {
  if (x.defined() && is_16bit_float(x.dtype()))  // autocast: computed in float32, rounded back
    return computed_in_float32(x, [&](const Tensor& wide) { return leaky_relu(wide, slope); });
  ForwardSpan span("leaky_relu", {&x});  // its forward on the trace's compute lane (--trace)
  check_float("leaky_relu", x, "input");
  const Device device = x.device();
  Tensor host_x, y;
  {
    NoGradGuard plain_copies;  // the copies are part of this op, not ops of their own in the graph
    host_x = x.to(Device::cpu());  // x itself on the CPU: no copy
    Tensor host_y = empty_like(host_x);
    const float* xs = host_x.data<float>();
    float* ys = host_y.data<float>();
    for (int64_t i = 0; i < x.numel(); ++i) ys[i] = xs[i] > 0.0f ? xs[i] : slope * xs[i];
    y = host_y.to(device);
  }
  // The backward, right below: dx = dy where x > 0, slope * dy elsewhere. x is saved for it
  // (save what backward reads; capture only plain values such as slope). record() keeps
  // nothing when no input requires grad.
  return record("LeakyReluBackward", y, /*inputs=*/{x}, /*saved=*/{host_x},
                [slope, device](const Node& node, const Tensor& dy) {
                  const Tensor& x = node.saved(0);
                  const Tensor host_dy = dy.to(Device::cpu());
                  Tensor dx = empty_like(x);
                  const float* xs = x.data<float>();
                  const float* g = host_dy.data<float>();
                  float* out = dx.data<float>();
                  for (int64_t i = 0; i < x.numel(); ++i) out[i] = xs[i] > 0.0f ? g[i] : slope * g[i];
                  return std::vector<Tensor>{dx.to(device)};
                });
}

// ---- the layer ------------------------------------------------------------------------------

class LeakyReLU : public nn::Module {
 public:
  explicit LeakyReLU(float slope = 0.01f) : slope_(slope) {}
  Tensor forward(const Tensor& input) override { return leaky_relu(input, slope_); }

 private:
  float slope_;
};

// Largest |analytic - numeric| of d sum(leaky_relu(x) * w) / dx, numeric by central
// differences in double on the same formula.
double gradient_check(float slope) {
  Generator gen(1);
  Tensor x = Tensor::randn({6, 5}, gen).set_requires_grad(true);
  const Tensor w = Tensor::randn({6, 5}, gen);
  leaky_relu(x, slope).backward(w);
  const std::vector<float> xs = x.to_vector(), ws = w.to_vector(), grad = x.grad().to_vector();
  double worst = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    auto f = [&](double v) { return (v > 0 ? v : slope * v) * ws[i]; };
    const double h = 1e-6, numeric = (f(xs[i] + h) - f(xs[i] - h)) / (2 * h);
    worst = std::max(worst, std::abs(grad[i] - numeric));
  }
  return worst;
}

int main(int argc, char** argv) {
  CLI::App app{"custom_layer: a user-defined LeakyReLU, gradient-checked and trained with DDP"};
  int steps = 300;
  std::string trace_file;
  bool explain = false;
  examples::ProcessGroupFlags group;
  cli::set_option_defaults(app);
  app.add_option("--steps", steps, "SGD steps")->check(cli::integer_in(1));
  group.add_to(app);
  app.add_option("--trace", trace_file, "write a Chrome trace (ui.perfetto.dev) of the run to FILE")->check(cli::file_path());
  app.add_flag("--explain", explain, "print the bucket plan, then per step the all-reduces and exposed communication");
  if (auto code = cli::parse(app, argc, argv, "custom_layer")) return *code;
  try {
    if (!trace_file.empty()) trace::start(trace_file);
    explain = explain || dist::explain_from_environment();
    const double error = gradient_check(0.1f);
    const dist::InitOptions init = group.init_options();
    auto pg = dist::init_process_group(init);
    if (pg->rank() == 0) std::printf("gradient check: max |analytic - numeric| = %.2e\n", error);
    NANODDP_CHECK(error < 1e-4, ValueError, "gradient check failed: ", error);

    // Fit y = |x| (which a LeakyReLU network can represent) on 64 points per rank.
    Generator gen(0);
    auto model = std::make_shared<nn::Sequential>();
    model->add(nn::Linear(1, 16, gen));
    model->add(LeakyReLU(0.1f));
    model->add(nn::Linear(16, 1, gen));
    model->to(init.device);
    dist::DistributedDataParallel ddp(model, pg);
    if (explain && pg->rank() == 0) std::printf("%s", dist::explain_plan(ddp).c_str());
    nn::SGD opt(ddp.parameters(), {/*lr=*/0.05, /*momentum=*/0.9f});
    Generator data_gen(100 + pg->rank());
    const Tensor host_x = Tensor::rand({64, 1}, data_gen) * 4.0f - Tensor::full({1}, 2.0f);
    std::vector<float> targets;
    for (float v : host_x.to_vector()) targets.push_back(std::abs(v));
    const Tensor x = host_x.to(init.device), y = Tensor::from_vector(targets, {64, 1}).to(init.device);
    float loss_value = 0;
    std::optional<dist::ExplainWindow> explained;
    if (explain) explained.emplace(*pg);
    for (int step = 0; step < steps; ++step) {
      opt.zero_grad();
      Tensor loss = mse_loss(ddp(x), y);
      loss.backward();
      opt.step();
      loss_value = loss.item();
    }
    if (explained && pg->rank() == 0) std::printf("%s", explained->report("training", steps).c_str());
    std::printf("rank %d: loss after %d steps %.5f\n", pg->rank(), steps, loss_value);
    pg->barrier()->wait();
    dist::destroy_process_group();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "custom_layer: %s\n", message_of(e).c_str());
    return 1;
  }
  return 0;
}
