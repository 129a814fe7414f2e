#include "nn/optim.h"

#include <string>

#include "core/autograd.h"
#include "core/memory.h"

namespace nanoddp::nn {

SGD::SGD(std::vector<Tensor> params, SGDOptions options) : Optimizer("SGD", std::move(params)), options_(options) {
  NANODDP_CHECK(options.lr >= 0.0, ValueError, "SGD: invalid learning rate ", options.lr);
  NANODDP_CHECK(options.momentum >= 0.0f, ValueError, "SGD: invalid momentum ", options.momentum);
  NANODDP_CHECK(options.weight_decay >= 0.0f, ValueError, "SGD: invalid weight_decay ", options.weight_decay);
  NANODDP_CHECK(!options.nesterov || (options.momentum > 0.0f && options.dampening == 0.0f), ValueError,
                "SGD: nesterov momentum requires a momentum and zero dampening");
  momentum_buffers_.resize(params_.size());
}

void SGD::set_lr(double lr) {
  NANODDP_CHECK(lr >= 0.0, ValueError, "SGD: invalid learning rate ", lr);
  options_.lr = lr;
}

void SGD::step() {
  NoGradGuard no_grad;
  trace::Span span(trace::Lane::Optimizer, "optimizer.step");
  MemoryCategoryScope state_memory(MemoryCategory::OptimizerState);  // the buffers made here
  // The kernel's hyper-parameters are float32, as the scalars reach PyTorch's float kernels.
  const kernels::SgdConfig config{
      static_cast<float>(options_.lr), options_.momentum, static_cast<float>(1.0 - options_.dampening),
      options_.weight_decay,           options_.nesterov, options_.maximize};
  const std::vector<Tensor> grads = checked_grads();
  for (size_t i = 0; i < params_.size(); ++i) {
    Tensor& p = params_[i];
    const Tensor& g = grads[i];
    if (!g.defined()) continue;
    float* buffer = nullptr;
    bool first_step = false;
    if (options_.momentum != 0.0f) {
      Tensor& buf = momentum_buffers_[i];
      if (!buf.defined()) {
        buf = Tensor::empty(p.shape(), DType::Float32, p.device());
        first_step = true;
      } else if (buf.device() != p.device()) {
        buf = buf.to(p.device());
      }
      buffer = buf.data<float>();
    }
    NANODDP_DISPATCH(p.device(), sgd_step, p.data<float>(), buffer, g.data<float>(), p.numel(), config,
                     first_step);
  }
}

StateDict SGD::state_dict() const {
  StateDict state;
  for (size_t i = 0; i < momentum_buffers_.size(); ++i)
    if (momentum_buffers_[i].defined())
      state["momentum_buffer." + std::to_string(i)] = momentum_buffers_[i].to(Device::cpu()).clone();
  return state;
}

void SGD::load_state_dict(const StateDict& state) {
  std::vector<Tensor> buffers(params_.size());
  for (const auto& [key, t] : state) {
    const StateKey parsed = parse_state_key(key, {"momentum_buffer"});
    buffers[parsed.index] = load_state_tensor(key, t, parsed.index, params_[parsed.index].shape());
  }
  momentum_buffers_ = std::move(buffers);
}

}  // namespace nanoddp::nn
