// Module: the base of every layer and model (torch.nn.Module), with parameters, buffers,
// submodules, train/eval, device moves and state_dict.
//
//   auto model = std::make_shared<Sequential>();  model->add(Linear(784, 256, gen)); ...
//   for (auto& [name, p] : model->named_parameters()) std::cout << name << p.shape();  // "0.weight"
//   model->load_state_dict(model->state_dict());
//
// Ownership: a Module owns its parameters (Tensors that require grad), its buffers (state
// that is not trained: BatchNorm's running statistics) and its submodules (shared_ptr).
// Parameter and buffer handles stay valid for the module's life, across to(): moving swaps
// their storage (as `param.data = ...`), so an optimizer built before to() still works.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_set>
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
  // forward with this module's hooks around it (torch.nn.Module.__call__): the forward
  // pre-hooks, forward, then the forward hooks, each in registration order. Containers call
  // their children this way, so hooks on a submodule run inside the model's forward.
  Tensor operator()(const Tensor& input);

  // fn(module, input) runs before every forward through operator()
  // (torch.nn.Module.register_forward_pre_hook). Returns an id for remove_forward_hook.
  using ForwardPreHook = std::function<void(Module& module, const Tensor& input)>;
  int register_forward_pre_hook(ForwardPreHook hook);
  // fn(module, input, output) runs after every forward through operator() and returns the
  // output the caller gets: output itself, or a tensor that replaces it
  // (torch.nn.Module.register_forward_hook, whose hook may return a new output).
  using ForwardHook = std::function<Tensor(Module& module, const Tensor& input, const Tensor& output)>;
  int register_forward_hook(ForwardHook hook);
  // Removes a pre-hook or hook by id; an unknown id does nothing.
  void remove_forward_hook(int id);

  // All parameters, depth-first in registration order (torch.nn.Module.parameters). A
  // parameter reachable twice (tied weights: a module registered in two places, or one
  // tensor registered under two names) is one parameter and is listed once, under its first
  // name (PyTorch's remove_duplicate=True), so an optimizer steps it once and DDP reduces it
  // once.
  std::vector<Tensor> parameters() const;
  // The same with dotted names ("0.weight"), in the same order. remove_duplicate = false
  // lists a tied parameter under every name it has, as state_dict does
  // (torch.nn.Module.named_parameters(remove_duplicate=False)).
  std::vector<std::pair<std::string, Tensor>> named_parameters(bool remove_duplicate = true) const;
  // All buffers, persistent or not, depth-first in registration order, each listed once
  // under its first name (torch.nn.Module.buffers / named_buffers, remove_duplicate=True).
  std::vector<Tensor> buffers() const;
  std::vector<std::pair<std::string, Tensor>> named_buffers() const;
  // The buffers state_dict saves (the persistent ones), with dotted names, in its order.
  std::vector<std::pair<std::string, Tensor>> named_persistent_buffers() const;
  // This module and every submodule, depth-first, each once, with dotted names (this one
  // is "") (torch.nn.Module.named_modules). The pointers live as long as this module.
  std::vector<std::pair<std::string, Module*>> named_modules();
  // The direct submodules with their names, in registration order
  // (torch.nn.Module.named_children); a replaced one is in its predecessor's place.
  const std::vector<std::pair<std::string, std::shared_ptr<Module>>>& named_children() const { return children_; }
  // Registers state that is saved and moved with the module but not trained
  // (torch.nn.Module.register_buffer): buffers(), to() and DDP's broadcast_buffers see it;
  // state_dict and load_state_dict see it when persistent. Any dtype (num_batches_tracked is
  // int64). Returns the stored handle: keep it, it stays valid across to(). A name this
  // module already uses for a buffer is given to the new tensor, in the old one's place (as
  // torch). ValueError for an undefined tensor, an empty name, a name with '.', or a name this
  // module uses for a parameter or submodule.
  Tensor register_buffer(const std::string& name, Tensor tensor, bool persistent = true);
  // Registers tensor as parameter `name` (torch.nn.Module.register_parameter) and sets its
  // requires_grad, as wrapping it in torch.nn.Parameter does; a tensor that already is some
  // module's parameter keeps its requires_grad (a frozen weight tied stays frozen, as an
  // nn.Parameter assigned in torch does; its detach() is a new tensor). Returns the stored handle,
  // which the module's member must hold: forward uses the member, the optimizer and
  // state_dict the registered tensor. A name this module already uses for a parameter is
  // given to the new tensor, in the old one's place (as torch), which is how weights are
  // tied to another module's (PyTorch's `decoder.weight = encoder.weight`):
  //
  //   decoder->weight = decoder->register_parameter("weight", encoder->weight);
  //
  // ValueError for an undefined tensor, an empty name, a name with '.', or a name this
  // module uses for a buffer or submodule.
  Tensor register_parameter(const std::string& name, Tensor tensor);
  // Registers a submodule under name (torch.nn.Module.register_module / add_module); its
  // parameters and buffers are named "<name>.<theirs>". A name already used for a submodule
  // is given to the new one, in the old one's place (as torch). ValueError for a null
  // module, an empty name, a name with '.', or a name this module uses for a parameter or
  // buffer.
  template <typename M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> module) {
    register_child(name, module);
    return module;
  }
  // Clears every parameter's .grad: undefined with set_to_none (PyTorch 2's default), else
  // filled with zeros in place (torch 1.13's default); see Optimizer::zero_grad.
  void zero_grad(bool set_to_none = true);
  // train(false) == eval(). Propagates to submodules. Layers here behave the same in both;
  // the flag exists for layers that do not (dropout, batch norm). Virtual for a wrapper
  // whose model is not a registered child (FullyShardedDataParallel).
  virtual void train(bool mode = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }
  // Moves every parameter and buffer to device, keeping the handles (torch.nn.Module.to).
  void to(Device device);

  // Copies of the parameters and persistent buffers keyed by dotted name, on the CPU, in
  // their own dtypes (torch's state_dict, detached). A tied parameter or buffer is there
  // under every name it has, as in torch ({"0.weight", "1.weight"} for Sequential(l, l)),
  // and load_state_dict wants every one of them.
  StateDict state_dict() const;
  // The keys load_state_dict did not match (torch.nn.modules.module._IncompatibleKeys):
  // missing = the model's parameters and persistent buffers absent from the state (left
  // unchanged), unexpected = the state's keys the model has no such entry for (ignored). Both sorted by name.
  struct IncompatibleKeys {
    std::vector<std::string> missing_keys;
    std::vector<std::string> unexpected_keys;
    bool empty() const { return missing_keys.empty() && unexpected_keys.empty(); }
  };
  // Copies values in and returns the keys that did not match. strict: the key sets must
  // match exactly, else ValueError listing the missing and the unexpected keys (as
  // torch.nn.Module.load_state_dict), and, when they differ only by DistributedDataParallel's
  // 'module.' prefix (in either direction), saying which of the two to unwrap; !strict:
  // loads the keys that match and returns the rest, so a 'module.' prefix mistake (every key
  // missing and unexpected) is visible to the caller. A shape mismatch is a ShapeError naming
  // every such key and both shapes, strict or not (strict with keys that do not match too: the
  // ValueError lists them after the keys, all in one message, as torch's); an undefined
  // Tensor() as a value, a ValueError naming the key. Values in another floating dtype (float32,
  // float16, bfloat16: a half-precision safetensors file into a float32 model) are converted
  // as torch's copy_ does: exactly when widening, rounded to nearest even when narrowing.
  // Between an integer and a floating dtype, where torch's copy_ would convert silently (a
  // float step counter truncated into int64), it is a ShapeError naming both. A [1] value
  // loads into a 0-d entry, as torch 1.13 allows for states saved before 0-d tensors. A batch
  // norm's num_batches_tracked that the state lacks is set to 0, not missing, as torch 1.13's
  // _NormBase does for a state without version metadata (which every file gives); any other
  // module's buffer of that name is missing as usual (zero_if_missing). Nothing is modified
  // unless every check passes.
  IncompatibleKeys load_state_dict(const StateDict& state, bool strict = true);
  // Every check of load_state_dict, with the same errors and result, copying nothing: for a
  // caller that must learn whether a load would pass before it loads (FullyShardedDataParallel
  // asks every rank before any rank loads).
  IncompatibleKeys check_state_dict(const StateDict& state, bool strict = true);
  // The buffers of this module (or of a model it wraps without registering it) that
  // load_state_dict sets to 0 when the state lacks them, instead of reporting them missing:
  // BatchNorm1d's num_batches_tracked, as torch's _NormBase._load_from_state_dict does. None
  // by default.
  virtual std::vector<Tensor> zero_if_missing() { return {}; }

 protected:
  // register_parameter for a parameter that has no module of its own: a dotted name
  // ("0._flat_param") is allowed. FullyShardedDataParallel registers each unit's flat
  // parameter on itself under the unit's path this way.
  Tensor register_parameter_at_path(const std::string& name, Tensor tensor);

 private:
  // register_module's work, for any module type.
  void register_child(const std::string& name, std::shared_ptr<Module> module);
  // ValueError, naming register_<function>, unless name can be an entry of kind ("parameter",
  // "buffer", "submodule"): non-empty, no '.', and not used by this module for another kind.
  void check_name(const char* function, const char* kind, const std::string& name) const;
  struct Buffer {
    std::string name;
    Tensor tensor;
    bool persistent;
  };
  enum class Which { Parameters, Buffers, PersistentBuffers };
  // Appends this module's tensors of one kind, then its children's, skipping any already in
  // seen; with seen null, every name of every tensor.
  void collect(Which which, const std::string& prefix, std::vector<std::pair<std::string, Tensor>>& named,
               std::unordered_set<const TensorImpl*>* seen) const;
  // What state_dict and load_state_dict cover: parameters, then persistent buffers, under
  // every name each has.
  std::vector<std::pair<std::string, Tensor>> named_state() const;
  // load_state_dict's checks, then its copies when copy is true.
  IncompatibleKeys load_or_check(const StateDict& state, bool strict, bool copy);

  std::vector<std::pair<std::string, Tensor>> parameters_;
  std::vector<Buffer> buffers_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
  std::vector<std::pair<int, ForwardPreHook>> forward_pre_hooks_;
  std::vector<std::pair<int, ForwardHook>> forward_hooks_;
  int next_hook_id_ = 0;
  bool training_ = true;
};

// What Module::zero_grad and Optimizer::zero_grad do to one parameter: its .grad undefined
// (set_to_none) or, when defined, filled with zeros in place.
void zero_grad_of(Tensor& param, bool set_to_none);

}  // namespace nanoddp::nn
