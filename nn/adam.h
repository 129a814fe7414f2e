// Adam and AdamW: torch.optim.Adam and torch.optim.AdamW (PyTorch 1.13), one fused kernel
// per parameter (kernels/cpu/adam.cpp, kernels/cuda/adam.cu).
//
//   nn::AdamW opt(model.parameters(), {/*lr=*/1e-3});      // weight_decay 1e-2 by default
//   opt.zero_grad();  loss.backward();  opt.step();
//   nn::save_checkpoint("run.ckpt", opt.state_dict());      // step, exp_avg, exp_avg_sq
//
// The update of a parameter p with gradient g, at its step t = 1, 2, ... (PyTorch's exactly;
// the factors in double precision, the tensors in float32):
//   AdamW only:  p = p * (1 - lr * weight_decay)            (decoupled weight decay)
//   Adam only:   g = g + weight_decay * p                   (L2 penalty in the gradient)
//   m = beta1 * m + (1 - beta1) * g;   v = beta2 * v + (1 - beta2) * g^2
//   amsgrad:     v_max = max(v_max, v), used instead of v below
//   p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// eps is added after the bias correction of sqrt(v), as in PyTorch (not the paper's
// sqrt(v_hat) + eps with v_hat's own rounding). A parameter whose .grad is undefined is
// skipped: its step count and moments do not move. maximize negates g first, before the
// weight decay (PyTorch's order). foreach, capturable, fused and differentiable are not
// offered (PyTorch's defaults).
//
// When to use which: Adam (weight_decay 0) for fast progress on badly scaled problems; AdamW
// when regularising, since Adam's L2 term is divided by sqrt(v) and so decays parameters with
// large gradients less (Loshchilov & Hutter); SGD with momentum often generalises best on
// vision models given a tuned schedule. docs/optimizers.md says more.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "nn/optimizer.h"

namespace nanoddp::nn {

// lr, betas and weight_decay are doubles, as torch's Python floats: 1 - beta2 is then 1 - 0.999
// rounded to float32 (0.001f), as torch passes it to its kernel, not 1 - 0.999f (0.000999987),
// and AdamW's 1 - lr * weight_decay is 0.91f for 0.3 and 0.3, not 0.90999997f. eps reaches the
// kernel as float32, as torch's does.
struct AdamOptions {
  double lr = 1e-3;
  std::pair<double, double> betas = {0.9, 0.999};
  float eps = 1e-8f;
  double weight_decay = 0.0;
  bool amsgrad = false;
  bool maximize = false;
};

// AdamW's defaults differ from Adam's only in weight_decay (1e-2, torch.optim.AdamW's).
struct AdamWOptions {
  double lr = 1e-3;
  std::pair<double, double> betas = {0.9, 0.999};
  float eps = 1e-8f;
  double weight_decay = 1e-2;
  bool amsgrad = false;
  bool maximize = false;
};

class Adam : public Optimizer {
 public:
  // Throws ValueError (PyTorch's checks and messages) for lr < 0, eps < 0, a beta outside
  // [0, 1), weight_decay < 0; and for the parameters Optimizer refuses (none, an op's output,
  // one that is not float32 or listed twice).
  Adam(std::vector<Tensor> params, AdamOptions options);

  void step() override;
  double lr() const override { return options_.lr; }
  void set_lr(double lr) override;
  const AdamOptions& options() const { return options_; }

  // Per parameter that has stepped: "step.<i>" (int64, one element: the number of steps taken),
  // "exp_avg.<i>", "exp_avg_sq.<i>" and, with amsgrad, "max_exp_avg_sq.<i>" (float32, the
  // parameter's shape). load_state_dict needs all of a parameter's entries or none.
  StateDict state_dict() const override;
  void load_state_dict(const StateDict& state) override;

  // Bytes of state held for the parameters that have stepped (the moments, not the counts).
  int64_t state_nbytes() const;

 protected:
  Adam(std::string name, std::vector<Tensor> params, AdamOptions options, bool decoupled_weight_decay);

 private:
  struct State {
    int64_t step = 0;  // 0: no state yet
    Tensor exp_avg, exp_avg_sq, max_exp_avg_sq;
  };
  void check_options() const;

  std::vector<State> state_;
  AdamOptions options_;
  bool decoupled_weight_decay_;
};

class AdamW : public Adam {
 public:
  // Throws as Adam's constructor does.
  AdamW(std::vector<Tensor> params, AdamWOptions options);
};

}  // namespace nanoddp::nn
