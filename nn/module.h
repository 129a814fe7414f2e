// Module: the base of every layer and model (torch.nn.Module), with parameters, submodules,
// train/eval, device moves and state_dict.
//
//   auto model = std::make_shared<Sequential>();  model->add(Linear(784, 256, gen)); ...
//   for (auto& [name, p] : model->named_parameters()) std::cout << name << p.shape();  // "0.weight"
//   model->load_state_dict(model->state_dict());
//
// Ownership: a Module owns its parameters (Tensors that require grad) and its submodules
// (shared_ptr). Parameter handles stay valid for the module's life, across to(): moving
// swaps their storage (as `param.data = ...`), so an optimizer built before to() still works.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace nanoddp::nn {

// name -> tensor, ordered by name. Names are dotted paths: "0.weight", "fc1.bias".
using StateDict = std::map<std::string, Tensor>;

class Module {
 public:
  virtual ~Module() = default;

  // x -> y; shapes are documented by each layer.
  virtual Tensor forward(const Tensor& input) = 0;
  Tensor operator()(const Tensor& input) { return forward(input); }

  // All parameters, depth-first in registration order (torch.nn.Module.parameters).
  std::vector<Tensor> parameters() const;
  // The same with dotted names ("0.weight"), in the same order.
  std::vector<std::pair<std::string, Tensor>> named_parameters() const;
  // Clears every parameter's .grad (set_to_none=True, PyTorch 2's default).
  void zero_grad();
  // train(false) == eval(). Propagates to submodules. Layers here behave the same in both;
  // the flag exists for layers that do not (dropout, batch norm).
  void train(bool mode = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }
  // Moves every parameter to device, keeping the handles (torch.nn.Module.to).
  void to(Device device);

  // Copies of the parameters keyed by dotted name, on the CPU (torch's state_dict, detached).
  StateDict state_dict() const;
  // Copies values in. strict: the key sets must match exactly, else ValueError listing the
  // missing and the unexpected keys. A shape mismatch is a ShapeError naming the key and
  // both shapes. Nothing is modified unless every check passes.
  void load_state_dict(const StateDict& state, bool strict = true);

 protected:
  // Registers a parameter (sets requires_grad). Returns the stored handle.
  Tensor register_parameter(const std::string& name, Tensor tensor);
  template <typename M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> module) {
    children_.emplace_back(name, module);
    return module;
  }

 private:
  std::vector<std::pair<std::string, Tensor>> parameters_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
  bool training_ = true;
};

}  // namespace nanoddp::nn
