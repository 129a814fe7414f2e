// Layers and losses: Linear, ReLU, Flatten, Sequential, MSELoss, CrossEntropyLoss (torch.nn's).
// The other layers have a header each, included where they are used (nn/activations.h: Sigmoid,
// Tanh, GELU; nn/conv.h: Conv2d, MaxPool2d; nn/dropout.h; nn/normalization.h: LayerNorm;
// nn/batch_norm.h), so an edit to one of them rebuilds only its users; nanoddp.h has them all.
//
//   Generator gen(0);
//   Sequential mlp;  mlp.add(Linear(784, 256, gen));  mlp.add(ReLU());  mlp.add(Linear(256, 10, gen));
//   Tensor loss = CrossEntropyLoss()(mlp(x), y);   // x: [N, 784], y: [N] int64
#pragma once

#include <memory>
#include <utility>

#include "core/ops.h"
#include "core/random.h"
#include "nn/module.h"

namespace nanoddp::nn {

// y = x · weight^T + bias. input: [N, in_features] (or [..., in_features]) -> [N, out_features].
// weight: [out_features, in_features], bias: [out_features]. Initialised as torch.nn.Linear:
// weight and bias uniform in [-1/sqrt(in_features), 1/sqrt(in_features)) (kaiming_uniform
// with a = sqrt(5) reduces to that bound), drawn from gen in that order (weight row-major,
// then bias; nn/init.h). The values are PyTorch's: Linear(784, 256, gen) with Generator
// gen(0) holds what torch.manual_seed(0); torch.nn.Linear(784, 256) does. Parameters are float32; under
// nn::autocast the forward casts them to its 16-bit dtype (nn::linear's contract in core/ops.h) and the
// output is 16-bit.
class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, Generator& gen = default_generator(), bool bias = true);
  Tensor forward(const Tensor& input) override;
  Tensor weight;
  Tensor bias;  // undefined when built with bias = false
};

// max(x, 0) elementwise, any shape (torch.nn.ReLU).
class ReLU : public Module {
 public:
  Tensor forward(const Tensor& input) override { return relu(input); }
};

// log_softmax(input, dim) (torch.nn.LogSoftmax): [N, C] -> [N, C], dim 1 or -1; the layer before
// NLLLoss.
class LogSoftmax : public Module {
 public:
  explicit LogSoftmax(int64_t dim) : dim_(dim) {}
  Tensor forward(const Tensor& input) override { return log_softmax(input, dim_); }

 private:
  int64_t dim_;
};

// Merges dimensions start_dim..end_dim into one (torch.nn.Flatten; defaults keep the batch
// dimension: [N, C, H, W] -> [N, C H W]). Negative dims count from the end. A reshape: no
// copy, no FLOPs; the gradient is reshaped back. IndexError for a dim outside the input's.
class Flatten : public Module {
 public:
  explicit Flatten(int start_dim = 1, int end_dim = -1) : start_dim_(start_dim), end_dim_(end_dim) {}
  Tensor forward(const Tensor& input) override;

 private:
  int start_dim_, end_dim_;
};

// Runs its modules in order; they are named "0", "1", ... (torch.nn.Sequential). It runs its
// registered children, so one replaced through register_module("1", other) is the one that
// runs, as torch's Sequential runs its _modules.
class Sequential : public Module {
 public:
  Sequential() = default;
  template <typename M>
  Sequential& add(M module) {
    return add(std::shared_ptr<Module>(std::make_shared<M>(std::move(module))));
  }
  Sequential& add(std::shared_ptr<Module> module);
  // A shared layer (add the same one twice to tie its weights: one parameter, see Module).
  template <typename M>
  Sequential& add(std::shared_ptr<M> module) {
    return add(std::shared_ptr<Module>(std::move(module)));
  }
  Tensor forward(const Tensor& input) override;
  size_t size() const { return named_children().size(); }
  // The module at index; a negative index counts from the end, as torch's Sequential[-1].
  // IndexError naming the index and the size when it is out of range.
  Module& operator[](int64_t index);
  // Runs children [starts[k], starts[k + 1]) (the last up to the end) as one checkpointed
  // block each from now on (nn::checkpoint, nn/activation_checkpoint.h); children before
  // starts[0] run as usual. Names and parameters do not change, so state_dict is the same (as
  // torch's checkpoint_sequential, which keeps the module and splits only the run). Empty:
  // no checkpointing. Throws ValueError unless starts are increasing and below size().
  Sequential& checkpoint_blocks(std::vector<size_t> starts);
  const std::vector<size_t>& checkpoint_block_starts() const { return checkpoint_starts_; }

 private:
  std::vector<size_t> checkpoint_starts_;
};

// mse_loss(input, target, reduction) (torch.nn.MSELoss). Shapes must match exactly.
class MSELoss {
 public:
  explicit MSELoss(Reduction reduction = Reduction::Mean) : reduction_(reduction) {}
  Tensor operator()(const Tensor& input, const Tensor& target) const { return mse_loss(input, target, reduction_); }

 private:
  Reduction reduction_;
};

// cross_entropy(logits [N, C], target [N] int64, reduction, ignore_index, label_smoothing,
// weight) (torch.nn.CrossEntropyLoss; rows labelled ignore_index, -100 by default, count for
// nothing; label_smoothing in [0, 1] and weight [C] float32 or undefined, checked at the call).
// Not a Module, so model.to(device) does not move the weight: give it on the logits' device.
class CrossEntropyLoss {
 public:
  explicit CrossEntropyLoss(Reduction reduction = Reduction::Mean, int64_t ignore_index = kDefaultIgnoreIndex,
                            double label_smoothing = 0.0, Tensor weight = Tensor())
      : reduction_(reduction),
        ignore_index_(ignore_index),
        label_smoothing_(label_smoothing),
        weight_(std::move(weight)) {}
  Tensor operator()(const Tensor& logits, const Tensor& target) const {
    return cross_entropy(logits, target, reduction_, ignore_index_, label_smoothing_, weight_);
  }

 private:
  Reduction reduction_;
  int64_t ignore_index_;
  double label_smoothing_;
  Tensor weight_;
};

// nll_loss(log_probs [N, C], target [N] int64, reduction, ignore_index, weight) (torch.nn.NLLLoss:
// LogSoftmax then NLLLoss is CrossEntropyLoss). Not a Module, so model.to(device) does not move
// the weight: give it on the log-probabilities' device.
class NLLLoss {
 public:
  explicit NLLLoss(Reduction reduction = Reduction::Mean, int64_t ignore_index = kDefaultIgnoreIndex,
                   Tensor weight = Tensor())
      : reduction_(reduction), ignore_index_(ignore_index), weight_(std::move(weight)) {}
  Tensor operator()(const Tensor& log_probs, const Tensor& target) const {
    return nll_loss(log_probs, target, reduction_, ignore_index_, weight_);
  }

 private:
  Reduction reduction_;
  int64_t ignore_index_;
  Tensor weight_;
};

}  // namespace nanoddp::nn
