// Forward + backward time of each layer on a 64 x 1024 input, one thread, on the CPU: the
// nanoddp side of benchmarks/run's layer table (torch_reference/layer_bench.py is the other).
//
//   build/benchmarks/layer_bench                 # one JSON line per layer
//   build/benchmarks/layer_bench --min-time 0.5 --only Tanh
//
// One iteration: y = layer(x); y.backward(g) with x requiring grad (and the layer's
// parameters, if any, accumulating theirs), g a fixed tensor of y's shape. Pointwise layers
// LayerNorm and BatchNorm1d (training mode) take x: [64, 1024]; Conv2d(16, 16, 3, padding 1), MaxPool2d(2)
// and Flatten take the same 65,536 values as [64, 16, 8, 8]; Conv2d(32, 64, 3), fashion_mnist_cnn's second
// convolution, its input there, [64, 32, 13, 13]. After 3 warm-up iterations, iterations run
// until --min-time seconds have passed; us_per_iter is the median over 5 such rounds of
// (round time / iterations). Each line:
//   {"example":"layer_bench","framework":"nanoddp","layer":L,"input":[...],"us_per_iter":t}
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "nn/activations.h"
#include "nn/batch_norm.h"
#include "nn/conv.h"
#include "nn/dropout.h"
#include "nn/layers.h"
#include "nn/normalization.h"
#include "tools/cli_checks.h"

using namespace nanoddp;

namespace {

struct LayerCase {
  std::string name;
  Shape input;
  std::function<std::shared_ptr<nn::Module>(Generator&)> make;
};

std::vector<LayerCase> layer_cases() {
  const Shape rows{64, 1024}, images{64, 16, 8, 8};
  const Shape cnn_pooled{64, 32, 13, 13};  // fashion_mnist_cnn's second convolution's input
  return {
      {"ReLU", rows, [](Generator&) { return std::make_shared<nn::ReLU>(); }},
      {"Sigmoid", rows, [](Generator&) { return std::make_shared<nn::Sigmoid>(); }},
      {"Tanh", rows, [](Generator&) { return std::make_shared<nn::Tanh>(); }},
      {"GELU", rows, [](Generator&) { return std::make_shared<nn::GELU>(); }},
      {"GELU(tanh)", rows, [](Generator&) { return std::make_shared<nn::GELU>("tanh"); }},
      {"Softplus", rows, [](Generator&) { return std::make_shared<nn::Softplus>(); }},
      {"Dropout(0.5)", rows, [](Generator& gen) { return std::make_shared<nn::Dropout>(0.5f, gen); }},
      {"LayerNorm(1024)", rows,
       [](Generator&) { return std::make_shared<nn::LayerNorm>(std::vector<int64_t>{1024}); }},
      {"BatchNorm1d(1024)", rows, [](Generator&) { return std::make_shared<nn::BatchNorm1d>(1024); }},
      {"Conv2d(16,16,3,p=1)", images,
       [](Generator& gen) { return std::make_shared<nn::Conv2d>(16, 16, 3, gen, 1, 1); }},
      {"Conv2d(32,64,3)", cnn_pooled,
       [](Generator& gen) { return std::make_shared<nn::Conv2d>(32, 64, 3, gen); }},
      {"MaxPool2d(2)", images, [](Generator&) { return std::make_shared<nn::MaxPool2d>(2); }},
      {"Flatten", images, [](Generator&) { return std::make_shared<nn::Flatten>(); }},
  };
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"layer_bench: forward + backward time per layer on a 64 x 1024 input"};
  double min_time = 0.2;
  std::string only;
  cli::set_option_defaults(app);
  app.add_option("--min-time", min_time, "seconds per timed round")->check(cli::number_in(0));
  std::vector<std::string> names;
  for (const LayerCase& c : layer_cases()) names.push_back(c.name);
  // A name that matches no layer is refused, not an empty table.
  app.add_option("--only", only, "one layer's name, as printed (default: every layer)")
      ->check(cli::one_of(names));
  if (auto code = cli::parse(app, argc, argv, "layer_bench")) return *code;
  try {
    for (const LayerCase& c : layer_cases()) {
      if (!only.empty() && c.name != only) continue;
      Generator gen(0);
      auto layer = c.make(gen);
      Tensor x = Tensor::randn(c.input, gen).set_requires_grad(true);
      const Tensor g = Tensor::randn((*layer)(x).shape(), gen);
      auto step = [&] {
        (*layer)(x).backward(g);
        x.set_grad(Tensor());
        layer->zero_grad();
      };
      for (int i = 0; i < 3; ++i) step();
      std::vector<double> rounds;
      for (int r = 0; r < 5; ++r) {
        int64_t iterations = 0;
        const auto start = std::chrono::steady_clock::now();
        do {
          step();
          ++iterations;
        } while (seconds_since(start) < min_time);
        rounds.push_back(seconds_since(start) / static_cast<double>(iterations));
      }
      std::sort(rounds.begin(), rounds.end());
      std::string shape;
      for (int64_t s : c.input.sizes()) shape += (shape.empty() ? "" : ",") + std::to_string(s);
      std::printf(
          "{\"example\":\"layer_bench\",\"framework\":\"nanoddp\",\"layer\":\"%s\",\"input\":[%s],"
          "\"us_per_iter\":%.2f}\n",
          c.name.c_str(), shape.c_str(), rounds[rounds.size() / 2] * 1e6);
      std::fflush(stdout);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "layer_bench: %s\n", message_of(e).c_str());
    return 1;
  }
  return 0;
}
