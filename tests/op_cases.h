// The op table: one row per differentiable op, read by three harnesses.
//   tests/test_ops.cpp       forward vs a float64 reference, backward vs central differences
//                            of it, and NaN/±inf inputs against the reference's own NaN/±inf
//   tests/test_gpu_ops.cpp   CUDA vs CPU, forward and gradients (SKIP without a GPU)
//   tests/test_ops_ddp.cpp   2-rank DDP vs 1-rank training on a small model around the op
// The rows live in tests/op_cases.cpp, compiled once for the three (so an edit of a layer's
// header recompiles the table once, not every harness).
// To add an op, add a row to op_cases() in tests/op_cases.cpp: its call, its float64 reference, and (for a layer) a
// model builder with .in_model(sample_shape, builder); a pointwise activation goes through
// add_activation, which also runs it on [-100, 100].
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/ops.h"
#include "core/random.h"

namespace nanoddp::nn {
class Module;
}

namespace nanoddp::testing {

using Values = std::vector<double>;

enum class Kind { Normal, Labels };

struct InputSpec {
  Shape shape;
  Kind kind = Kind::Normal;
  int64_t classes = 0;  // for Labels
};

// Builds a model around the op from gen: input [N, sample...] -> logits [N, 3].
using ModelBuilder = std::function<std::shared_ptr<nn::Module>(Generator& gen)>;

struct OpCase {
  std::string name;
  std::vector<InputSpec> inputs;
  std::function<Tensor(const std::vector<Tensor>&)> op;
  // float64 forward on the same (flattened) inputs; returns the flattened output. It also
  // defines the NaN/±inf behaviour (PyTorch's), so write it as PyTorch computes.
  std::function<Values(const std::vector<Values>&)> reference;
  double forward_tolerance = 1e-5;   // relative to max(1, |reference|)
  double backward_tolerance = 1e-4;
  bool differentiable = true;
  Shape sample{};        // the DDP model's per-sample input shape
  ModelBuilder model{};  // empty: no DDP check (a plain op, or one ranks cannot reproduce)
  // The op computes statistics over the batch (BatchNorm): each rank sees only its share, so
  // 2-rank DDP does NOT equal 1-rank training; test_ops_ddp checks that it differs.
  bool batch_statistics = false;
  // The first input's values: standard normals, or, when low < high, uniform in [low, high]
  // with low and high themselves at its first and last elements (the far ends of an op's
  // branches: where exp overflows in float, or a threshold switches formulas).
  double input_low = 0, input_high = 0;

  OpCase& in_model(Shape sample_shape, ModelBuilder builder) {
    sample = sample_shape;
    model = std::move(builder);
    return *this;
  }
  OpCase& with_batch_statistics() {
    batch_statistics = true;
    return *this;
  }
};

// Every row (tests/op_cases.cpp).
std::vector<OpCase> op_cases();

// Random inputs for a row: standard normals, or the first input over the row's range
// (OpCase::input_low/high), rounded to float32 (so the reference sees the float inputs
// exactly), or labels.
std::vector<Values> make_inputs(const OpCase& c, Generator& gen);

// The inputs as tensors on device; float inputs require grad.
std::vector<Tensor> to_tensors(const OpCase& c, const std::vector<Values>& values, Device device = Device::cpu());

inline double scale_of(double reference) { return std::max(1.0, std::abs(reference)); }

// batch_norm over x [N, C, L] (L = 1 for [N, C]) as torch computes it: the batch's mean and
// biased variance per channel (two passes), or running_mean/running_var when not empty.
Values ref_batch_norm(const Values& x, const Values& w, const Values& b, int64_t N, int64_t C, int64_t L,
                      const Values& running_mean = {}, const Values& running_var = {}, double eps = 1e-5);

}  // namespace nanoddp::testing
