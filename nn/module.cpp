#include "nn/module.h"

#include <algorithm>
#include <sstream>

#include "core/autograd.h"

namespace nanoddp::nn {

Tensor Module::register_parameter(const std::string& name, Tensor tensor) {
  tensor.set_requires_grad(true);
  parameters_.emplace_back(name, tensor);
  return tensor;
}

std::vector<std::pair<std::string, Tensor>> Module::named_parameters() const {
  std::vector<std::pair<std::string, Tensor>> named;
  std::unordered_set<const TensorImpl*> seen;
  collect_parameters("", named, seen);
  return named;
}

void Module::collect_parameters(const std::string& prefix, std::vector<std::pair<std::string, Tensor>>& named,
                                std::unordered_set<const TensorImpl*>& seen) const {
  // Identity is the handle's impl, which to() keeps (it swaps storage), so a tied parameter
  // stays one parameter across device moves.
  for (const auto& [name, p] : parameters_)
    if (seen.insert(p.impl()).second) named.emplace_back(prefix + name, p);
  for (const auto& [child_name, child] : children_) child->collect_parameters(prefix + child_name + ".", named, seen);
}

std::vector<Tensor> Module::parameters() const {
  std::vector<Tensor> params;
  for (auto& [name, p] : named_parameters()) params.push_back(p);
  return params;
}

void Module::zero_grad() {
  for (Tensor& p : parameters()) p.set_grad(Tensor());
}

void Module::train(bool mode) {
  training_ = mode;
  for (auto& [name, child] : children_) child->train(mode);
}

void Module::to(Device device) {
  for (Tensor& p : parameters()) {
    if (p.device() == device) continue;
    p.set_data(p.detach().to(device));
  }
}

StateDict Module::state_dict() const {
  StateDict state;
  for (auto& [name, p] : named_parameters()) state[name] = p.detach().to(Device::cpu()).clone();
  return state;
}

Module::IncompatibleKeys Module::load_state_dict(const StateDict& state, bool strict) {
  const auto named = named_parameters();
  std::vector<std::string> missing, unexpected;
  for (auto& [name, p] : named)
    if (state.count(name) == 0) missing.push_back(name);
  for (auto& [name, t] : state) {
    bool known = false;
    for (auto& [own, p] : named) known |= own == name;
    if (!known) unexpected.push_back(name);
  }
  if (strict && (!missing.empty() || !unexpected.empty())) {
    std::ostringstream message;
    message << "load_state_dict: keys do not match. missing: [";
    for (size_t i = 0; i < missing.size(); ++i) message << (i ? ", " : "") << missing[i];
    message << "], unexpected: [";
    for (size_t i = 0; i < unexpected.size(); ++i) message << (i ? ", " : "") << unexpected[i];
    message << "]";
    NANODDP_THROW(ValueError, message.str());
  }
  for (auto& [name, p] : named) {
    auto it = state.find(name);
    if (it == state.end()) continue;
    NANODDP_CHECK(it->second.shape() == p.shape() && it->second.dtype() == p.dtype(), ShapeError,
                  "load_state_dict: '", name, "' is ", it->second.shape(), " ", it->second.dtype(),
                  " in the state but ", p.shape(), " ", p.dtype(), " in the model");
  }
  NoGradGuard no_grad;
  for (auto& [name, p] : named) {
    auto it = state.find(name);
    if (it != state.end()) Tensor(p).copy_(it->second);
  }
  std::sort(missing.begin(), missing.end());
  return {missing, unexpected};  // unexpected is already sorted: StateDict is ordered by name
}

}  // namespace nanoddp::nn
