#include "nn/adam.h"

#include <cmath>
#include <string>

#include "core/autograd.h"
#include "core/memory.h"
#include "kernels/kernels.h"

namespace nanoddp::nn {

Adam::Adam(std::vector<Tensor> params, AdamOptions options) : Adam("Adam", std::move(params), options, false) {}

Adam::Adam(std::string name, std::vector<Tensor> params, AdamOptions options, bool decoupled_weight_decay)
    : Optimizer(std::move(name), std::move(params)), options_(options), decoupled_weight_decay_(decoupled_weight_decay) {
  check_options();
  state_.resize(params_.size());
}

AdamW::AdamW(std::vector<Tensor> params, AdamWOptions o)
    : Adam("AdamW", std::move(params),
           AdamOptions{o.lr, o.betas, o.eps, o.weight_decay, o.amsgrad, o.maximize}, true) {}

void Adam::check_options() const {
  const AdamOptions& o = options_;
  NANODDP_CHECK(o.lr >= 0.0, ValueError, name_, ": Invalid learning rate: ", o.lr);
  NANODDP_CHECK(o.eps >= 0.0f, ValueError, name_, ": Invalid epsilon value: ", o.eps);
  NANODDP_CHECK(o.betas.first >= 0.0f && o.betas.first < 1.0f, ValueError, name_,
                ": Invalid beta parameter at index 0: ", o.betas.first);
  NANODDP_CHECK(o.betas.second >= 0.0f && o.betas.second < 1.0f, ValueError, name_,
                ": Invalid beta parameter at index 1: ", o.betas.second);
  NANODDP_CHECK(o.weight_decay >= 0.0, ValueError, name_, ": Invalid weight_decay value: ", o.weight_decay);
}

void Adam::set_lr(double lr) {
  NANODDP_CHECK(lr >= 0.0, ValueError, name_, ": Invalid learning rate: ", lr);
  options_.lr = lr;
}

void Adam::step() {
  NoGradGuard no_grad;
  trace::Span span(trace::Lane::Optimizer, "optimizer.step");
  MemoryCategoryScope state_memory(MemoryCategory::OptimizerState);  // the moments made here
  // The factors are computed in double, as PyTorch does in Python, and rounded to float for
  // the kernel, as the scalars reach PyTorch's float kernels.
  const double lr = options_.lr, beta1 = options_.betas.first, beta2 = options_.betas.second;
  const double weight_decay = options_.weight_decay;
  kernels::AdamConfig config;
  config.beta1 = static_cast<float>(beta1);
  config.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  config.beta2 = static_cast<float>(beta2);
  config.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  config.eps = options_.eps;
  config.amsgrad = options_.amsgrad;
  config.maximize = options_.maximize;
  if (decoupled_weight_decay_)
    config.param_scale = static_cast<float>(1.0 - lr * weight_decay);
  else
    config.l2 = static_cast<float>(weight_decay);
  const std::vector<Tensor> grads = checked_grads();
  for (size_t i = 0; i < params_.size(); ++i) {
    Tensor& p = params_[i];
    const Tensor& g = grads[i];
    if (!g.defined()) continue;
    State& s = state_[i];
    if (s.step == 0) {
      s.exp_avg = Tensor::zeros(p.shape(), DType::Float32, p.device());
      s.exp_avg_sq = Tensor::zeros(p.shape(), DType::Float32, p.device());
      if (options_.amsgrad) s.max_exp_avg_sq = Tensor::zeros(p.shape(), DType::Float32, p.device());
    } else if (s.exp_avg.device() != p.device()) {  // the model moved after the state was made
      s.exp_avg = s.exp_avg.to(p.device());
      s.exp_avg_sq = s.exp_avg_sq.to(p.device());
      if (s.max_exp_avg_sq.defined()) s.max_exp_avg_sq = s.max_exp_avg_sq.to(p.device());
    }
    if (options_.amsgrad && !s.max_exp_avg_sq.defined())  // amsgrad state loaded from a run without it
      s.max_exp_avg_sq = Tensor::zeros(p.shape(), DType::Float32, p.device());
    s.step += 1;
    const double t = static_cast<double>(s.step);
    config.step_size = static_cast<float>(lr / (1.0 - std::pow(beta1, t)));
    config.bias_correction2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, t)));
    float* max_exp_avg_sq = options_.amsgrad ? s.max_exp_avg_sq.data<float>() : nullptr;
    NANODDP_DISPATCH(p.device(), adam_step, p.data<float>(), s.exp_avg.data<float>(), s.exp_avg_sq.data<float>(),
                     max_exp_avg_sq, g.data<float>(), p.numel(), config);
  }
}

StateDict Adam::state_dict() const {
  StateDict state;
  for (size_t i = 0; i < state_.size(); ++i) {
    const State& s = state_[i];
    if (s.step == 0) continue;
    const std::string index = "." + std::to_string(i);
    state["step" + index] = Tensor::from_vector(std::vector<int64_t>{s.step});
    state["exp_avg" + index] = s.exp_avg.to(Device::cpu()).clone();
    state["exp_avg_sq" + index] = s.exp_avg_sq.to(Device::cpu()).clone();
    if (s.max_exp_avg_sq.defined()) state["max_exp_avg_sq" + index] = s.max_exp_avg_sq.to(Device::cpu()).clone();
  }
  return state;
}

void Adam::load_state_dict(const StateDict& state) {
  std::vector<State> loaded(params_.size());
  std::vector<int> entries(params_.size(), 0);
  for (const auto& [key, t] : state) {
    const StateKey k = parse_state_key(key, {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"});
    State& s = loaded[k.index];
    ++entries[k.index];
    if (k.buffer == "step") {
      const Tensor step =
          load_state_tensor(key, t, k.index, Shape{1}, DType::Int64, /*step_count=*/true).to(Device::cpu());
      s.step = step.to_int_vector()[0];
      NANODDP_CHECK(s.step > 0, ValueError, name_, ".load_state_dict: '", key, "' is ", s.step, ", not a step count");
      continue;
    }
    Tensor buffer = load_state_tensor(key, t, k.index, params_[k.index].shape());
    if (k.buffer == "exp_avg") s.exp_avg = buffer;
    if (k.buffer == "exp_avg_sq") s.exp_avg_sq = buffer;
    if (k.buffer == "max_exp_avg_sq") s.max_exp_avg_sq = buffer;
  }
  for (size_t i = 0; i < loaded.size(); ++i) {
    const State& s = loaded[i];
    const int expected = 3 + (s.max_exp_avg_sq.defined() ? 1 : 0);
    NANODDP_CHECK(entries[i] == 0 || (s.step > 0 && s.exp_avg.defined() && s.exp_avg_sq.defined() &&
                                      entries[i] == expected),
                  ValueError, name_, ".load_state_dict: parameter ", i,
                  " has only part of its state (step, exp_avg and exp_avg_sq go together)");
  }
  state_ = std::move(loaded);
}

int64_t Adam::state_nbytes() const {
  int64_t total = 0;
  for (const State& s : state_)
    for (const Tensor* t : {&s.exp_avg, &s.exp_avg_sq, &s.max_exp_avg_sq})
      if (t->defined()) total += static_cast<int64_t>(t->nbytes());
  return total;
}

}  // namespace nanoddp::nn
