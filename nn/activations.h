// Pointwise activations: each one in one place, its kernels declared, its forward and its
// backward, and the Module that applies it (torch.nn's Sigmoid, GELU, ...).
//
//   Tensor y = gelu(x);                                   // any shape -> the same shape
//   Sequential mlp;  mlp.add(Linear(784, 256, gen));  mlp.add(GELU("tanh"));  ...
//   docs/adding-a-layer.md adds one of these, end to end.
//
// Every op here takes a float32, float16 or bfloat16 tensor of any shape on any device
// (ValueError for another dtype) and returns a new tensor of the same shape and dtype; a
// 16-bit input is computed in float32 and rounded once (Note [16-bit elementwise ops]; so
// gelu takes float16 on the CPU, which torch 1.13's CPU does not). NaN stays NaN; ±inf map as the PyTorch
// function named on each op does. Cost, for n elements: the forward reads and writes n floats, the backward
// reads two and writes one, and each op keeps one n-float tensor for backward.
#pragma once

#include <string>

#include "core/autograd.h"
#include "core/op_helpers.h"
#include "kernels/kernels.h"
#include "nn/module.h"

namespace nanoddp {

// ---- sigmoid ------------------------------------------------------------------------------
// y = 1 / (1 + e^-x) (torch.sigmoid): sigmoid(-inf) = 0, sigmoid(inf) = 1.
// Backward from the saved output: dx = dy * y * (1 - y). ~4 FLOPs + one exp per element.
NANODDP_DECLARE_KERNEL(sigmoid_forward, float* y, const float* x, int64_t n)
NANODDP_DECLARE_KERNEL(sigmoid_backward, float* dx, const float* dy, const float* y, int64_t n)  // WRITES

inline Tensor sigmoid(const Tensor& x) {
  if (x.defined() && is_16bit_float(x.dtype()))  // Note [16-bit elementwise ops]
    return computed_in_float32(x, [&](const Tensor& wide) { return sigmoid(wide); });
  ForwardSpan span("sigmoid", {&x});
  check_float("sigmoid", x, "input");
  Tensor y = empty_like(x);
  NANODDP_DISPATCH(x.device(), sigmoid_forward, ptr(y), ptr(x), x.numel());
  return record("SigmoidBackward", y, {x}, {y}, [](const Node& node, const Tensor& dy) {
    const Tensor& y = node.saved(0);
    Tensor dx = empty_like(y);
    NANODDP_DISPATCH(y.device(), sigmoid_backward, ptr(dx), ptr(dy), ptr(y), y.numel());
    return std::vector<Tensor>{dx};
  });
}

// ---- tanh ---------------------------------------------------------------------------------
// y = tanh(x) (torch.tanh): tanh(±inf) = ±1. Backward from the saved output:
// dx = dy * (1 - y^2). One tanh + 3 FLOPs per element.
NANODDP_DECLARE_KERNEL(tanh_forward, float* y, const float* x, int64_t n)
NANODDP_DECLARE_KERNEL(tanh_backward, float* dx, const float* dy, const float* y, int64_t n)  // WRITES

inline Tensor tanh(const Tensor& x) {
  if (x.defined() && is_16bit_float(x.dtype()))  // Note [16-bit elementwise ops]
    return computed_in_float32(x, [&](const Tensor& wide) { return tanh(wide); });
  ForwardSpan span("tanh", {&x});
  check_float("tanh", x, "input");
  Tensor y = empty_like(x);
  NANODDP_DISPATCH(x.device(), tanh_forward, ptr(y), ptr(x), x.numel());
  return record("TanhBackward", y, {x}, {y}, [](const Node& node, const Tensor& dy) {
    const Tensor& y = node.saved(0);
    Tensor dx = empty_like(y);
    NANODDP_DISPATCH(y.device(), tanh_backward, ptr(dx), ptr(dy), ptr(y), y.numel());
    return std::vector<Tensor>{dx};
  });
}

// ---- gelu ---------------------------------------------------------------------------------
// approximate "none": y = x * Phi(x) = x/2 * (1 + erf(x / sqrt 2));
// approximate "tanh": y = x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))
// (torch.nn.functional.gelu(x, approximate=...)). gelu(inf) = inf; gelu(-inf) is NaN, as
// in PyTorch (-inf * 0). Backward from the saved input. ~15 FLOPs + one erf/tanh per element.
// The exact form is computed as written on the CPU, as PyTorch does, except below x = -3,
// where 1 + erf is 1 minus nearly 1 and its few digits left are noise (torch gives 0 at
// x = -5.62, float64 -5.4e-8): there Phi(x) is erfc(-x / sqrt 2) / 2, so value and gradient
// keep their digits (Note [GELU's lower tail] in kernels/cpu/activations.cpp). CUDA takes Phi
// from normcdff at every x: within a few roundings of the CPU's. The tanh form is computed as the
// equal x / (1 + e^(-2u)), u the tanh's argument, in which nothing cancels: its value and
// gradient keep their digits in the tails (at x = -4.875 the gradient is float64's -3.4e-6,
// where torch's tanh form gives -3.76e-6), and elsewhere differ from torch's by rounding.
// Throws ValueError for another approximate.
NANODDP_DECLARE_KERNEL(gelu_forward, float* y, const float* x, bool tanh_approximation, int64_t n)
NANODDP_DECLARE_KERNEL(gelu_backward, float* dx, const float* dy, const float* x, bool tanh_approximation,
                       int64_t n)  // WRITES

inline Tensor gelu(const Tensor& x, const std::string& approximate = "none") {
  if (x.defined() && is_16bit_float(x.dtype()))  // Note [16-bit elementwise ops]
    return computed_in_float32(x, [&](const Tensor& wide) { return gelu(wide, approximate); });
  ForwardSpan span("gelu", {&x});
  check_float("gelu", x, "input");
  NANODDP_CHECK(approximate == "none" || approximate == "tanh", ValueError, "gelu: approximate must be 'none' or ",
                "'tanh', got '", approximate, "'");
  const bool tanh_approximation = approximate == "tanh";
  Tensor y = empty_like(x);
  NANODDP_DISPATCH(x.device(), gelu_forward, ptr(y), ptr(x), tanh_approximation, x.numel());
  return record("GeluBackward", y, {x}, {x}, [tanh_approximation](const Node& node, const Tensor& dy) {
    const Tensor& x = node.saved(0);
    Tensor dx = empty_like(x);
    NANODDP_DISPATCH(x.device(), gelu_backward, ptr(dx), ptr(dy), ptr(x), tanh_approximation, x.numel());
    return std::vector<Tensor>{dx};
  });
}

// ---- softplus -----------------------------------------------------------------------------
// y = log(1 + e^(beta x)) / beta, and y = x where beta x > threshold (torch.nn.functional.
// softplus): there the two agree to float precision, and e^(beta x) would overflow past 88.
// softplus(-inf) = 0, softplus(inf) = inf. Backward from the saved input: dx = dy where
// beta x > threshold, else dy z / (z + 1) with z = e^(beta x), as torch's softplus_backward
// (so NaN where beta x is under a threshold above 88.7: z is inf there, in torch too). One exp
// and one log1p per element.
NANODDP_DECLARE_KERNEL(softplus_forward, float* y, const float* x, float beta, float threshold, int64_t n)
NANODDP_DECLARE_KERNEL(softplus_backward, float* dx, const float* dy, const float* x, float beta, float threshold,
                       int64_t n)  // WRITES

inline Tensor softplus(const Tensor& x, float beta = 1.0f, float threshold = 20.0f) {
  if (x.defined() && is_16bit_float(x.dtype()))  // Note [16-bit elementwise ops]
    return computed_in_float32(x, [&](const Tensor& wide) { return softplus(wide, beta, threshold); });
  ForwardSpan span("softplus", {&x});
  check_float("softplus", x, "input");
  Tensor y = empty_like(x);
  NANODDP_DISPATCH(x.device(), softplus_forward, ptr(y), ptr(x), beta, threshold, x.numel());
  return record("SoftplusBackward", y, {x}, {x}, [beta, threshold](const Node& node, const Tensor& dy) {
    const Tensor& x = node.saved(0);
    Tensor dx = empty_like(x);
    NANODDP_DISPATCH(x.device(), softplus_backward, ptr(dx), ptr(dy), ptr(x), beta, threshold, x.numel());
    return std::vector<Tensor>{dx};
  });
}

namespace nn {

// sigmoid(x), any shape (torch.nn.Sigmoid).
class Sigmoid : public Module {
 public:
  Tensor forward(const Tensor& input) override { return sigmoid(input); }
};

// tanh(x), any shape (torch.nn.Tanh).
class Tanh : public Module {
 public:
  Tensor forward(const Tensor& input) override { return tanh(input); }
};

// gelu(x, approximate), any shape (torch.nn.GELU). approximate: "none" or "tanh"
// (ValueError otherwise, at construction).
class GELU : public Module {
 public:
  explicit GELU(std::string approximate = "none") : approximate_(std::move(approximate)) {
    NANODDP_CHECK(approximate_ == "none" || approximate_ == "tanh", ValueError,
                  "GELU: approximate must be 'none' or 'tanh', got '", approximate_, "'");
  }
  Tensor forward(const Tensor& input) override { return gelu(input, approximate_); }

 private:
  std::string approximate_;
};

// softplus(x, beta, threshold), any shape (torch.nn.Softplus, defaults beta 1, threshold 20).
class Softplus : public Module {
 public:
  explicit Softplus(float beta = 1.0f, float threshold = 20.0f) : beta_(beta), threshold_(threshold) {}
  Tensor forward(const Tensor& input) override { return softplus(input, beta_, threshold_); }

 private:
  float beta_, threshold_;
};

}  // namespace nn
}  // namespace nanoddp
