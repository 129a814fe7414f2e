#include "nn/optimizer.h"

#include <unordered_map>

#include "core/memory.h"

namespace nanoddp::nn {

namespace {
thread_local int no_parameters_allowed = 0;  // live AllowNoParameters on this thread
}  // namespace

Optimizer::AllowNoParameters::AllowNoParameters() { ++no_parameters_allowed; }
Optimizer::AllowNoParameters::~AllowNoParameters() { --no_parameters_allowed; }

Optimizer::Optimizer(std::string name, std::vector<Tensor> params) : params_(std::move(params)), name_(std::move(name)) {
  NANODDP_CHECK(!params_.empty() || no_parameters_allowed > 0, ValueError, name_,
                ": optimizer got an empty parameter list (does the model register its layers, with "
                "register_module or in a Sequential, and its tensors with register_parameter?)");
  std::unordered_map<const TensorImpl*, size_t> index_of;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor& p = params_[i];
    NANODDP_CHECK(p.defined() && p.dtype() == DType::Float32, ValueError, name_,
                  ": parameters must be float32 tensors (parameter ", i, " is not)");
    NANODDP_CHECK(p.is_leaf(), ValueError, name_, ": can't optimize a non-leaf tensor (parameter ", i, ", ",
                  p.shape(),
                  ", is an op's output, which the next forward computes again; pass the leaf it "
                  "comes from, or a detached copy made a parameter)");
    NANODDP_CHECK(
        !p.impl()->storage->is_freed(), ValueError, name_, ": parameter ", i, " (", p.shape(),
        ") has its memory freed: it belongs to a model wrapped in FullyShardedDataParallel, whose shards "
        "hold the values; build the optimizer on the wrapper's parameters() (fsdp.parameters())");
    auto [it, inserted] = index_of.emplace(p.impl(), i);
    NANODDP_CHECK(inserted, ValueError, name_, ": parameter ", i, " is parameter ", it->second,
                  " again; a parameter listed twice would be stepped twice (pass model.parameters(), "
                  "which lists a tied parameter once)");
  }
}

void Optimizer::set_initial_lr(double lr) {
  NANODDP_CHECK(lr >= 0.0, ValueError, name_, ": invalid initial learning rate ", lr);
  initial_lr_ = lr;
}

void Optimizer::zero_grad(bool set_to_none) {
  for (Tensor& p : params_) zero_grad_of(p, set_to_none);
}

Optimizer::StateKey Optimizer::parse_state_key(const std::string& key, const std::vector<std::string>& buffers) const {
  const size_t dot = key.rfind('.');
  StateKey parsed;
  parsed.buffer = dot == std::string::npos ? key : key.substr(0, dot);
  bool known = false;
  for (const std::string& b : buffers) known = known || b == parsed.buffer;
  NANODDP_CHECK(known && dot != std::string::npos, ValueError, name_, ".load_state_dict: unexpected key '", key, "'");
  const std::string digits = key.substr(dot + 1);
  // The index as state_dict writes it: no leading zero, so that "momentum_buffer.01" cannot
  // stand for parameter 1 beside "momentum_buffer.1".
  NANODDP_CHECK(!digits.empty() && digits.size() < 19 &&
                    digits.find_first_not_of("0123456789") == std::string::npos &&
                    (digits[0] != '0' || digits.size() == 1),
                ValueError, name_, ".load_state_dict: bad key '", key, "'");
  parsed.index = std::stoul(digits);
  NANODDP_CHECK(parsed.index < params_.size(), ValueError, name_, ".load_state_dict: '", key, "' but only ",
                params_.size(), " parameters");
  return parsed;
}

Tensor Optimizer::load_state_tensor(const std::string& key, const Tensor& t, size_t index,
                                    const Shape& expected_shape, DType expected_dtype,
                                    bool step_count) const {
  NANODDP_CHECK(t.defined(), ValueError, name_, ".load_state_dict: '", key,
                "' is an undefined tensor (a Tensor())");
  NANODDP_CHECK(t.shape() == expected_shape, ShapeError, name_, ".load_state_dict: '", key, "' is ",
                t.shape(),
                step_count ? " but a step count is one value of shape "
                           : " but parameter " + std::to_string(index) + " is ",
                expected_shape);
  NANODDP_CHECK(t.dtype() == expected_dtype, ValueError, name_, ".load_state_dict: '", key, "' is ",
                dtype_name(t.dtype()), ", expected ", dtype_name(expected_dtype));
  MemoryCategoryScope state_memory(MemoryCategory::OptimizerState);
  return t.detach().to(params_[index].device()).clone();
}

Tensor Optimizer::checked_grad(size_t index) const {
  const Tensor& p = params_[index];
  // Built before FullyShardedDataParallel wrapped the model: the parameter is now a view of a
  // unit's full vector, freed between forwards, and never gets a gradient again.
  NANODDP_CHECK(
      !p.impl()->storage->is_freed(), ValueError, name_, ": parameter ", index, " (", p.shape(),
      ") has its memory freed: it belongs to a model that FullyShardedDataParallel wrapped after this "
      "optimizer was built, and would never be stepped; build the optimizer on the wrapper's "
      "parameters() (fsdp.parameters()) after wrapping");
  Tensor g = p.grad();
  if (g.defined())
    NANODDP_CHECK(g.device() == p.device() && g.shape() == p.shape(), ShapeError, name_, ": parameter ", index,
                  " is ", p.shape(), " on ", p.device(), " but its grad is ", g.shape(), " on ", g.device());
  return g;
}

std::vector<Tensor> Optimizer::checked_grads() const {
  std::vector<Tensor> grads;
  grads.reserve(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) grads.push_back(checked_grad(i));
  return grads;
}

}  // namespace nanoddp::nn
