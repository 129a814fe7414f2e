// SGD: torch.optim.SGD, one fused kernel per parameter. Adam and AdamW are in nn/adam.h;
// the interface they share (step, zero_grad, lr, state_dict) in nn/optimizer.h.
//
//   SGD opt(model.parameters(), {/*lr=*/0.1, /*momentum=*/0.9f});
//   opt.zero_grad();  loss.backward();  opt.step();
//
// The update, for each parameter p with gradient g (exactly PyTorch's):
//   g = g + weight_decay * p
//   if momentum != 0:  buf = g on the first step, else momentum * buf + (1 - dampening) * g
//                      g = nesterov ? g + momentum * buf : buf
//   p = p - lr * g
// A parameter whose .grad is undefined is skipped (its buffer untouched).
#pragma once

#include <vector>

#include "core/tensor.h"
#include "kernels/kernels.h"
#include "nn/module.h"
#include "nn/optimizer.h"

namespace nanoddp::nn {

// torch.optim.SGD's arguments. lr and dampening are doubles, as torch's Python floats: the
// kernel takes lr, and 1 - dampening computed in double, as float32, as torch's does. lr's
// default is torch 2.2's 1e-3 (torch 1.13 has none and requires it). maximize steps up the
// gradient (torch negates it first, before weight decay). No foreach, differentiable or fused.
struct SGDOptions {
  double lr = 1e-3;
  float momentum = 0.0f;
  double dampening = 0.0;
  float weight_decay = 0.0f;
  bool nesterov = false;
  bool maximize = false;
};

class SGD : public Optimizer {
 public:
  // Throws ValueError for lr < 0, momentum < 0, weight_decay < 0, or nesterov without
  // momentum > 0 and dampening == 0 (PyTorch's checks; a NaN lr, momentum or weight_decay is
  // refused too, where PyTorch's `< 0` lets it through), and for the parameters Optimizer
  // refuses: none, an op's output, one listed twice (PyTorch warns that this will become an
  // error; stepping it twice is never meant).
  SGD(std::vector<Tensor> params, SGDOptions options);

  void step() override;

  const SGDOptions& options() const { return options_; }
  double lr() const override { return options_.lr; }
  void set_lr(double lr) override;

  // Momentum buffers keyed "momentum_buffer.<index>" (index into params), for checkpoints.
  // Parameters that have no buffer yet are absent, as in torch.optim's state.
  StateDict state_dict() const override;
  void load_state_dict(const StateDict& state) override;

 private:
  std::vector<Tensor> momentum_buffers_;  // undefined until a parameter's first step
  SGDOptions options_;
};

}  // namespace nanoddp::nn
