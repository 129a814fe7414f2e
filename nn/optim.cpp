#include "nn/optim.h"

#include <string>
#include <unordered_map>

#include "core/autograd.h"

namespace nanoddp::nn {

SGD::SGD(std::vector<Tensor> params, SGDOptions options) : params_(std::move(params)), options_(options) {
  NANODDP_CHECK(options.lr >= 0.0f, ValueError, "SGD: invalid learning rate ", options.lr);
  NANODDP_CHECK(options.momentum >= 0.0f, ValueError, "SGD: invalid momentum ", options.momentum);
  NANODDP_CHECK(options.weight_decay >= 0.0f, ValueError, "SGD: invalid weight_decay ", options.weight_decay);
  NANODDP_CHECK(!options.nesterov || (options.momentum > 0.0f && options.dampening == 0.0f), ValueError,
                "SGD: nesterov momentum requires a momentum and zero dampening");
  std::unordered_map<const TensorImpl*, size_t> index_of;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor& p = params_[i];
    NANODDP_CHECK(p.defined() && p.dtype() == DType::Float32, ValueError, "SGD: parameters must be float32 tensors");
    auto [it, inserted] = index_of.emplace(p.impl(), i);
    NANODDP_CHECK(inserted, ValueError, "SGD: parameter ", i, " is parameter ", it->second,
                  " again; a parameter listed twice would be stepped twice (pass model.parameters(), "
                  "which lists a tied parameter once)");
  }
  momentum_buffers_.resize(params_.size());
}

void SGD::step() {
  NoGradGuard no_grad;
  trace::Span span(trace::Lane::Optimizer, "optimizer.step");
  for (size_t i = 0; i < params_.size(); ++i) {
    Tensor& p = params_[i];
    const Tensor g = p.grad();
    if (!g.defined()) continue;
    NANODDP_CHECK(g.device() == p.device() && g.shape() == p.shape(), ShapeError, "SGD: parameter ", i, " is ",
                  p.shape(), " on ", p.device(), " but its grad is ", g.shape(), " on ", g.device());
    float* buffer = nullptr;
    bool first_step = false;
    if (options_.momentum != 0.0f) {
      Tensor& buf = momentum_buffers_[i];
      if (!buf.defined() || buf.device() != p.device()) {
        if (buf.defined()) {
          buf = buf.to(p.device());
        } else {
          buf = Tensor::empty(p.shape(), DType::Float32, p.device());
          first_step = true;
        }
      }
      buffer = buf.data<float>();
    }
    NANODDP_DISPATCH(p.device(), sgd_step, p.data<float>(), buffer, g.data<float>(), p.numel(), options_, first_step);
  }
}

void SGD::zero_grad() {
  for (Tensor& p : params_) p.set_grad(Tensor());
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
  for (const auto& [name, t] : state) {
    const std::string prefix = "momentum_buffer.";
    NANODDP_CHECK(name.rfind(prefix, 0) == 0, ValueError, "SGD.load_state_dict: unexpected key '", name, "'");
    size_t index = 0;
    try {
      index = std::stoul(name.substr(prefix.size()));
    } catch (const std::exception&) {
      NANODDP_THROW(ValueError, "SGD.load_state_dict: bad key '", name, "'");
    }
    NANODDP_CHECK(index < params_.size(), ValueError, "SGD.load_state_dict: '", name, "' but only ", params_.size(),
                  " parameters");
    NANODDP_CHECK(t.shape() == params_[index].shape(), ShapeError, "SGD.load_state_dict: '", name, "' is ",
                  t.shape(), " but parameter ", index, " is ", params_[index].shape());
    buffers[index] = t.to(params_[index].device()).clone();
  }
  momentum_buffers_ = buffers;
}

}  // namespace nanoddp::nn
