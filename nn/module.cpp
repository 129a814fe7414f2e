#include "nn/module.h"

#include <algorithm>
#include <functional>
#include <sstream>

#include "core/autograd.h"
#include "core/memory.h"
#include "core/half.h"
#include "kernels/kernels.h"

namespace nanoddp::nn {

void Module::check_name(const char* function, const char* kind, const std::string& name) const {
  NANODDP_CHECK(!name.empty() && name.find('.') == std::string::npos, ValueError, "register_", function, ": name '",
                name, "' must be non-empty and contain no '.'");
  const auto has = [&](const auto& entries) {
    for (const auto& entry : entries)
      if (entry.first == name) return true;
    return false;
  };
  bool buffer = false;
  for (const Buffer& b : buffers_) buffer |= b.name == name;
  const std::string own = kind;
  const char* other = own != "parameter" && has(parameters_) ? "parameter"
                      : own != "buffer" && buffer             ? "buffer"
                      : own != "submodule" && has(children_)  ? "submodule"
                                                              : nullptr;
  NANODDP_CHECK(other == nullptr, ValueError, "register_", function, ": '", name, "' is already a ", other,
                " of this module");
}

Tensor Module::register_parameter(const std::string& name, Tensor tensor) {
  check_name("parameter", "parameter", name);
  return register_parameter_at_path(name, std::move(tensor));
}

Tensor Module::register_parameter_at_path(const std::string& name, Tensor tensor) {
  NANODDP_CHECK(tensor.defined(), ValueError, "register_parameter: parameter '", name, "' is an undefined tensor");
  NANODDP_CHECK(!name.empty(), ValueError, "register_parameter: the name is empty");
  // An op's output would never get a .grad (backward passes it on), so it would never train.
  NANODDP_CHECK(
      tensor.is_leaf(), ValueError, "register_parameter: parameter '", name, "' is an op's output (made by ",
      tensor.is_leaf() ? "" : tensor.grad_fn()->name(),
      "), not a leaf: register its detach() (torch: \"Cannot assign non-leaf Tensor to parameter\")");
  if (!tensor.impl()->is_parameter) {  // torch wraps it in nn.Parameter; an nn.Parameter stays as it is
    tensor.set_requires_grad(true);
    tensor.impl()->is_parameter = true;
  }
  set_memory_category(tensor, MemoryCategory::Parameters);
  for (auto& [own, p] : parameters_)
    if (own == name) return p = tensor;
  parameters_.emplace_back(name, tensor);
  return tensor;
}

void Module::register_child(const std::string& name, std::shared_ptr<Module> module) {
  NANODDP_CHECK(module != nullptr, ValueError, "register_module: submodule '", name, "' is null");
  check_name("module", "submodule", name);
  for (auto& [own, child] : children_)
    if (own == name) {
      child = std::move(module);
      return;
    }
  children_.emplace_back(name, std::move(module));
}

Tensor Module::operator()(const Tensor& input) {
  for (auto& [id, hook] : forward_pre_hooks_) hook(*this, input);
  Tensor output = forward(input);
  for (auto& [id, hook] : forward_hooks_) output = hook(*this, input, output);
  return output;
}

int Module::register_forward_pre_hook(ForwardPreHook hook) {
  forward_pre_hooks_.emplace_back(next_hook_id_, std::move(hook));
  return next_hook_id_++;
}

int Module::register_forward_hook(ForwardHook hook) {
  forward_hooks_.emplace_back(next_hook_id_, std::move(hook));
  return next_hook_id_++;
}

void Module::remove_forward_hook(int id) {
  const auto has_id = [id](const auto& entry) { return entry.first == id; };
  forward_pre_hooks_.erase(std::remove_if(forward_pre_hooks_.begin(), forward_pre_hooks_.end(), has_id),
                           forward_pre_hooks_.end());
  forward_hooks_.erase(std::remove_if(forward_hooks_.begin(), forward_hooks_.end(), has_id), forward_hooks_.end());
}

Tensor Module::register_buffer(const std::string& name, Tensor tensor, bool persistent) {
  NANODDP_CHECK(tensor.defined(), ValueError, "register_buffer: buffer '", name, "' is an undefined tensor");
  check_name("buffer", "buffer", name);
  for (Buffer& b : buffers_)
    if (b.name == name) {
      b = {name, tensor, persistent};
      return tensor;
    }
  buffers_.push_back({name, tensor, persistent});
  return tensor;
}

std::vector<std::pair<std::string, Tensor>> Module::named_parameters(bool remove_duplicate) const {
  std::vector<std::pair<std::string, Tensor>> named;
  std::unordered_set<const TensorImpl*> seen;
  collect(Which::Parameters, "", named, remove_duplicate ? &seen : nullptr);
  return named;
}

std::vector<std::pair<std::string, Tensor>> Module::named_buffers() const {
  std::vector<std::pair<std::string, Tensor>> named;
  std::unordered_set<const TensorImpl*> seen;
  collect(Which::Buffers, "", named, &seen);
  return named;
}

std::vector<std::pair<std::string, Tensor>> Module::named_persistent_buffers() const {
  std::vector<std::pair<std::string, Tensor>> named;
  std::unordered_set<const TensorImpl*> seen;
  collect(Which::PersistentBuffers, "", named, &seen);
  return named;
}

std::vector<std::pair<std::string, Module*>> Module::named_modules() {
  std::vector<std::pair<std::string, Module*>> named{{"", this}};
  std::unordered_set<const Module*> seen{this};
  std::function<void(Module&, const std::string&)> visit = [&](Module& m, const std::string& prefix) {
    for (auto& [name, child] : m.children_) {
      if (!seen.insert(child.get()).second) continue;
      named.emplace_back(prefix + name, child.get());
      visit(*child, prefix + name + ".");
    }
  };
  visit(*this, "");
  return named;
}

std::vector<Tensor> Module::buffers() const {
  std::vector<Tensor> result;
  for (auto& [name, b] : named_buffers()) result.push_back(b);
  return result;
}

std::vector<std::pair<std::string, Tensor>> Module::named_state() const {
  // torch's state_dict keeps every name of a tied tensor (it has no remove_duplicate).
  std::vector<std::pair<std::string, Tensor>> named;
  collect(Which::Parameters, "", named, nullptr);
  collect(Which::PersistentBuffers, "", named, nullptr);
  return named;
}

void Module::collect(Which which, const std::string& prefix, std::vector<std::pair<std::string, Tensor>>& named,
                     std::unordered_set<const TensorImpl*>* seen) const {
  // Identity is the handle's impl, which to() keeps (it swaps storage), so a tied parameter
  // stays one parameter across device moves.
  const auto first_time = [seen](const Tensor& t) { return seen == nullptr || seen->insert(t.impl()).second; };
  if (which == Which::Parameters) {
    for (const auto& [name, p] : parameters_)
      if (first_time(p)) named.emplace_back(prefix + name, p);
  } else {
    for (const Buffer& b : buffers_)
      if ((b.persistent || which == Which::Buffers) && first_time(b.tensor))
        named.emplace_back(prefix + b.name, b.tensor);
  }
  for (const auto& [child_name, child] : children_) child->collect(which, prefix + child_name + ".", named, seen);
}

std::vector<Tensor> Module::parameters() const {
  std::vector<Tensor> params;
  for (auto& [name, p] : named_parameters()) params.push_back(p);
  return params;
}

void zero_grad_of(Tensor& param, bool set_to_none) {
  if (set_to_none) {
    param.set_grad(Tensor());
  } else if (param.grad().defined()) {
    param.grad().zero_();  // in place: a .grad that views a DDP bucket stays one
  }
}

void Module::zero_grad(bool set_to_none) {
  for (Tensor& p : parameters()) zero_grad_of(p, set_to_none);
}

void Module::train(bool mode) {
  training_ = mode;
  for (auto& [name, child] : children_) child->train(mode);
}

void Module::to(Device device) {
  std::vector<Tensor> tensors = parameters();
  const size_t num_parameters = tensors.size();
  for (Tensor& b : buffers()) tensors.push_back(b);
  for (size_t i = 0; i < tensors.size(); ++i) {
    Tensor& t = tensors[i];
    if (t.device() == device) continue;
    t.set_data(t.detach().to(device));
    if (i < num_parameters) set_memory_category(t, MemoryCategory::Parameters);
  }
}

StateDict Module::state_dict() const {
  StateDict state;
  for (auto& [name, t] : named_state()) state[name] = t.detach().to(Device::cpu()).clone();
  return state;
}

namespace {

// Whether name is a batch norm's counter ("num_batches_tracked", nn/batch_norm.h), alone or
// as a submodule's ("3.num_batches_tracked").
bool is_batch_counter_name(const std::string& name) {
  const std::string counter = "num_batches_tracked";
  return name == counter || (name.size() > counter.size() &&
                             name.compare(name.size() - counter.size(), counter.size(), counter) == 0 &&
                             name[name.size() - counter.size() - 1] == '.');
}

// True when the keys of `prefixed` are exactly "module." + the keys of `plain` (both lists
// hold distinct keys, so one inclusion and equal sizes make them the same set).
bool all_prefixed(const std::vector<std::string>& prefixed, const std::vector<std::string>& plain) {
  const std::string prefix = "module.";
  for (const std::string& key : prefixed)
    if (key.rfind(prefix, 0) != 0 ||
        std::find(plain.begin(), plain.end(), key.substr(prefix.size())) == plain.end())
      return false;
  return !prefixed.empty() && prefixed.size() == plain.size();
}

// What to do when the keys differ only by DistributedDataParallel's "module." prefix, the
// mismatch PyTorch users meet as "Missing key(s) ... Unexpected key(s) module.0.weight".
std::string ddp_prefix_hint(const std::vector<std::string>& missing,
                            const std::vector<std::string>& all_unexpected) {
  // A batch norm's counter the state lacks is not missing (it loads as 0), so its key under
  // the other name is only unexpected: it does not tell the prefix apart.
  std::vector<std::string> unexpected;
  for (const std::string& key : all_unexpected)
    if (!is_batch_counter_name(key)) unexpected.push_back(key);
  if (all_prefixed(unexpected, missing))
    return ". The state's keys carry the 'module.' prefix of a DistributedDataParallel's state_dict: load "
           "nn::strip_prefix(state, \"module.\") (nn/checkpoint.h), or save ddp.module().state_dict() "
           "instead";
  if (all_prefixed(missing, unexpected))
    return ". This model is a DistributedDataParallel (keys 'module.*') and the state has no such prefix: "
           "load it "
           "into ddp.module() instead";
  return "";
}

// What to do when the state holds FullyShardedDataParallel's flat shards ("0._flat_param",
// its state_dict()), which only the same wrapper at the same world size loads.
std::string fsdp_local_hint(const std::vector<std::string>& unexpected) {
  const std::string flat = "_flat_param";
  for (const std::string& key : unexpected)
    if (key.size() >= flat.size() && key.compare(key.size() - flat.size(), flat.size(), flat) == 0)
      return ". '" + key +
             "' is a FullyShardedDataParallel shard (the wrapper's state_dict(), torch's LOCAL_STATE_DICT): "
             "save fsdp.full_state_dict() for the model's own names";
  return "";
}

bool is_floating(DType dtype) {
  return dtype == DType::Float32 || dtype == DType::Float16 || dtype == DType::BFloat16;
}

// The raw bits of a float16 or bfloat16 tensor, for the conversion kernels.
uint16_t* bits_of(const Tensor& t) {
  return t.dtype() == DType::Float16 ? &t.data<Float16>()->bits : &t.data<BFloat16>()->bits;
}

// src's values in the floating dtype `to`, on src's device, as torch's copy_ converts them:
// exact when widening, rounded to nearest (ties to even) when narrowing. Through float32 with
// the fp16/bf16 comm hooks' kernels (float_from_16bit, float_to_16bit with divisor 1).
Tensor converted(const Tensor& src, DType to) {
  const Device device = src.device();
  Tensor wide = src;
  if (src.dtype() != DType::Float32) {
    wide = Tensor::empty(src.shape(), DType::Float32, device);
    NANODDP_DISPATCH(device, float_from_16bit, wide.data<float>(), bits_of(src), src.dtype(), src.numel());
  }
  if (to == DType::Float32) return wide;
  Tensor out = Tensor::empty(src.shape(), to, device);
  NANODDP_DISPATCH(device, float_to_16bit, bits_of(out), wide.data<float>(), to, 1.0f,
                   src.numel());
  return out;
}

}  // namespace

Module::IncompatibleKeys Module::load_state_dict(const StateDict& state, bool strict) {
  return load_or_check(state, strict, true);
}

Module::IncompatibleKeys Module::check_state_dict(const StateDict& state, bool strict) {
  return load_or_check(state, strict, false);
}

Module::IncompatibleKeys Module::load_or_check(const StateDict& state, bool strict, bool copy) {
  const auto named = named_state();
  std::vector<std::string> missing, unexpected;
  // Batch norms' counters the state lacks: torch 1.13's _NormBase._load_from_state_dict fills
  // them with 0 for a state without version metadata (a plain dict, as any file gives), so
  // weights exported without them still load strictly. Found by tensor, under any name.
  std::unordered_set<const TensorImpl*> zeroable;
  for (auto& [path, module] : named_modules())
    for (const Tensor& t : module->zero_if_missing()) zeroable.insert(t.impl());
  std::vector<Tensor> counters_to_reset;
  for (auto& [name, p] : named) {
    if (state.count(name) != 0) continue;
    if (zeroable.count(p.impl()) != 0) {
      counters_to_reset.push_back(p);
    } else {
      missing.push_back(name);
    }
  }
  for (auto& [name, t] : state) {
    bool known = false;
    for (auto& [own, p] : named) known |= own == name;
    if (!known) unexpected.push_back(name);
  }
  std::sort(missing.begin(), missing.end());
  // The value each entry loads: the state's, and a [1] one as 0-d for a 0-d entry, as torch
  // 1.13 allows for states saved before 0-d tensors. Every entry that cannot load is listed
  // with the keys that do not match, in one error, as torch lists them all.
  std::vector<std::pair<Tensor, Tensor>> loads;  // (entry, value)
  std::vector<std::string> mismatched;
  for (auto& [name, p] : named) {
    auto it = state.find(name);
    if (it == state.end()) continue;
    NANODDP_CHECK(it->second.defined(), ValueError, "load_state_dict: '", name,
                  "' is an undefined tensor in the state (a Tensor() with no values)");
    const Tensor value =
        p.dim() == 0 && it->second.shape() == Shape{1} ? it->second.reshape(Shape{}) : it->second;
    const DType from = value.dtype(), to = p.dtype();
    if (value.shape() == p.shape() && (from == to || (is_floating(from) && is_floating(to)))) {
      loads.emplace_back(p, value);
      continue;
    }
    std::ostringstream why;
    why << "'" << name << "' is " << value.shape() << " " << from << " in the state but " << p.shape() << " "
        << to << " in the model"
        << (value.shape() == p.shape() ? " (only float32, float16 and bfloat16 convert into each other)"
                                       : "");
    mismatched.push_back(why.str());
  }
  std::ostringstream mismatches;
  for (size_t i = 0; i < mismatched.size(); ++i) mismatches << (i ? "; " : "") << mismatched[i];
  if (strict && (!missing.empty() || !unexpected.empty())) {
    std::ostringstream message;
    message << "load_state_dict: keys do not match. missing: [";
    for (size_t i = 0; i < missing.size(); ++i) message << (i ? ", " : "") << missing[i];
    message << "], unexpected: [";
    for (size_t i = 0; i < unexpected.size(); ++i) message << (i ? ", " : "") << unexpected[i];
    message << "]";
    if (!mismatched.empty()) message << ". Also " << mismatches.str();
    message << ddp_prefix_hint(missing, unexpected) << fsdp_local_hint(unexpected);
    NANODDP_THROW(ValueError, message.str());
  }
  NANODDP_CHECK(mismatched.empty(), ShapeError, "load_state_dict: ", mismatches.str());
  if (!copy) return {missing, unexpected};
  NoGradGuard no_grad;
  for (auto& [p, value] : loads)
    Tensor(p).copy_(value.dtype() == p.dtype() ? value : converted(value, p.dtype()));
  for (Tensor& counter : counters_to_reset)
    counter.copy_(Tensor::zeros(counter.shape(), counter.dtype(), counter.device()));
  return {missing, unexpected};  // unexpected is already sorted: StateDict is ordered by name
}

}  // namespace nanoddp::nn
