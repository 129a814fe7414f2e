// Optimizer: what every optimizer shares (torch.optim.Optimizer's shape), so that schedulers,
// checkpoints, gradient clipping and training loops take any of them: SGD (nn/optim.h), Adam
// and AdamW (nn/adam.h), and dist::ZeroRedundancyOptimizer.
//
//   std::unique_ptr<nn::Optimizer> opt = std::make_unique<nn::Adam>(model.parameters(), nn::AdamOptions{});
//   opt->zero_grad();  loss.backward();  opt->step();
//   nn::StepLR schedule(*opt, /*step_size=*/30);   // reads and sets opt->lr()
//
// One parameter group: every parameter shares the hyper-parameters (torch's param_groups[0]).
// State is kept per parameter, created on the parameter's first step with a defined .grad;
// state_dict() names it "<buffer>.<index>" with index into params() ("exp_avg.3"), on the CPU.
// The learning rate and initial_lr are not in state_dict(): a scheduler owns them (its
// state_dict restores both).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "nn/module.h"

namespace nanoddp::nn {

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // One update of every parameter whose .grad is defined (the others are skipped, their
  // state untouched). Throws ShapeError when a .grad's shape or device differs from its
  // parameter's, ValueError when a parameter's memory is freed (the optimizer was built on a
  // model that FullyShardedDataParallel wrapped afterwards: torch trains nothing then, silently).
  // Every parameter is checked before any changes.
  virtual void step() = 0;
  // set_to_none (torch 2's default): every parameter's .grad becomes undefined, so no memory
  // is kept and the next step skips a parameter that gets no gradient. false (torch 1.13's
  // default, zero_grad(set_to_none=False)): each defined .grad is filled with zeros in place
  // and stays the same tensor: what keeps a .grad that is a view of a DDP bucket one
  // (DDPOptions::gradient_as_bucket_view), so the next backward writes straight into it.
  void zero_grad(bool set_to_none = true);

  // The learning rate, a double as torch's param_groups[0]['lr'] (a Python float): schedulers
  // compute in double and a rate read back is the one set. The kernels take it as float32, as
  // PyTorch's do, rounded at each step.
  virtual double lr() const = 0;
  // Throws ValueError for lr < 0.
  virtual void set_lr(double lr) = 0;
  // torch's param_groups[0]['initial_lr']: the lr when the first scheduler was built on this
  // optimizer (empty until then), or the base_lr a scheduler's load_state_dict restored. Every
  // scheduler takes it as its base_lr, so one built after another changed the lr (a LinearLR
  // warm-up) still starts from the configured rate.
  const std::optional<double>& initial_lr() const { return initial_lr_; }
  // Throws ValueError for lr < 0.
  void set_initial_lr(double lr);
  const std::vector<Tensor>& params() const { return params_; }
  // "SGD", "Adam", "AdamW": names errors and the examples' JSON line.
  const std::string& name() const { return name_; }

  // Per-parameter state as CPU copies ("momentum_buffer.0", "exp_avg.2", ...).
  virtual StateDict state_dict() const = 0;
  // Replaces the state with copies of state's tensors on the parameters' devices. Throws
  // ValueError for an unknown key, an index past params() or an undefined tensor, ShapeError
  // for a tensor whose shape differs from its parameter's (or a step count not of shape [1]);
  // the state is unchanged when it throws. It cannot tell a state saved over fewer parameters:
  // the later ones start fresh, where torch compares its param_groups' sizes (this state holds
  // no param_groups).
  virtual void load_state_dict(const StateDict& state) = 0;

 protected:
  // Throws ValueError for no parameters (torch.optim's "optimizer got an empty parameter
  // list": a model whose layers were never registered would train nothing), and unless every
  // parameter is a defined float32 leaf (torch's "can't optimize a non-leaf Tensor": an op's
  // output is recomputed, not updated) listed once (a parameter listed twice would be stepped
  // twice; PyTorch warns that this will be an error) whose memory is not freed: the model's own parameters
  // once FullyShardedDataParallel has wrapped it are views of its units' full vectors, which it frees and
  // whose gradients go to its shards, so an optimizer over them would step nothing (torch's root FSDP leaves
  // the model no parameters, and its optimizer says "empty parameter list"). With NO_SHARD the vectors stay
  // allocated and this check cannot tell: build the optimizer on fsdp.parameters().
  Optimizer(std::string name, std::vector<Tensor> params);

  // While one lives on this thread, an optimizer may be built over no parameters: the local
  // optimizer of a ZeroRedundancyOptimizer rank that owns none.
  class AllowNoParameters {
   public:
    AllowNoParameters();
    ~AllowNoParameters();
    AllowNoParameters(const AllowNoParameters&) = delete;
    AllowNoParameters& operator=(const AllowNoParameters&) = delete;
  };

  // A key of state_dict split into its buffer name and parameter index, both checked:
  // the buffer must be one of buffers and the index below params().size().
  struct StateKey {
    std::string buffer;
    size_t index = 0;
  };
  StateKey parse_state_key(const std::string& key, const std::vector<std::string>& buffers) const;
  // t copied onto parameter index's device, after checking that it is defined (ValueError),
  // its shape (ShapeError, naming the parameter, or the step count when step_count) and dtype.
  Tensor load_state_tensor(const std::string& key, const Tensor& t, size_t index, const Shape& expected_shape,
                           DType expected_dtype = DType::Float32, bool step_count = false) const;
  // The .grad of parameter index, checked against the parameter; undefined when it has none.
  // ValueError when the parameter's memory is freed (wrapped by FullyShardedDataParallel after
  // the optimizer was built), which would otherwise be skipped at every step.
  Tensor checked_grad(size_t index) const;
  // checked_grad of every parameter, all checked before a step changes any.
  std::vector<Tensor> checked_grads() const;

  std::vector<Tensor> params_;
  std::string name_;

 private:
  std::optional<double> initial_lr_;
};

}  // namespace nanoddp::nn
