#include "dist/fsdp.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <sstream>
#include <unordered_map>

#include "core/autograd.h"
#include "core/hash.h"
#include "core/memory.h"
#include "core/op_helpers.h"
#include "core/ops.h"
#include "core/trace.h"
#include "dist/detail.h"
#include "dist/host_collectives.h"
#include "kernels/kernels.h"

namespace nanoddp::dist {

const char* sharding_strategy_name(ShardingStrategy strategy) {
  switch (strategy) {
    case ShardingStrategy::FULL_SHARD: return "FULL_SHARD";
    case ShardingStrategy::SHARD_GRAD_OP: return "SHARD_GRAD_OP";
    case ShardingStrategy::NO_SHARD: return "NO_SHARD";
  }
  return "?";
}

// One unit of Note [FSDP units].
struct FullyShardedDataParallel::Unit {
  std::string name;              // the module's dotted name; "" for the root
  nn::Module* module = nullptr;  // null for the root, whose forward is this wrapper's
  std::vector<std::pair<std::string, Tensor>> params;  // the model's own, in model order
  std::vector<int64_t> offsets;                        // each one's first element in full
  int64_t numel = 0;        // the parameters' elements
  int64_t shard_numel = 0;  // S; full holds W * S (NO_SHARD: S = numel, full is shard)
  Tensor shard;             // this rank's [S], a parameter of the wrapper
  Tensor full;              // [W * S], freed between uses unless NO_SHARD
  Tensor full_grad;         // [W * S] while a backward accumulates into it
  std::shared_ptr<Work> gather_work;
  // With MixedPrecision in 16 bits: the shard rounded for the all_gather and the gathered
  // [W * S] it writes, until wait_gathered widens it into full; the rounded [W * S] gradient
  // that the reduce_scatter reads, until it completes.
  Tensor low_shard, low_full, low_grad;
  double gather_issued_us = 0;
  bool gathered = false;
  bool prepared = false;  // this backward made .grad views of full_grad
  size_t pending = 0;     // parameters whose gradient this backward has not accumulated yet
  bool reduced = false;   // this backward issued the reduction
  std::shared_ptr<Work> reduce_work;
  Tensor reduce_output;   // the shard's mean gradient once reduce_work completes
  double reduce_issued_us = 0;
  std::vector<int> hook_ids;  // each parameter's post-accumulate-grad hook
  // Every parameter is frozen (requires_grad false): the unit is gathered for its forward and
  // for the backward through it, and has no gradient to reduce.
  bool frozen = false;
  // After a no_sync backward: the shard's .grad, and its version then (Note [FSDP no_sync]).
  Tensor accumulated_for;
  uint64_t accumulated_version = 0;
};

namespace {

constexpr int kFsdpLane = trace::kFsdpUnitLane;

std::string unit_label(const std::string& name) { return name.empty() ? "root" : "'" + name + "'"; }

}  // namespace

// The node FSDP puts on a unit's output: identity in value; its backward runs first among the
// unit's nodes, so it is where the unit's parameters are gathered again (step 3).
struct FSDPBackwardMarker {
  static Tensor apply(FullyShardedDataParallel& fsdp, size_t u, const Tensor& output) {
    FullyShardedDataParallel* self = &fsdp;
    return record("FSDPPreBackward", output.detach(), {output}, {}, [self, u](const Node&, const Tensor& dy) {
      self->on_unit_backward_pre(u);
      return std::vector<Tensor>{dy};
    });
  }
};

FullyShardedDataParallel::FullyShardedDataParallel(std::shared_ptr<nn::Module> module, std::shared_ptr<ProcessGroup> pg,
                                                   FSDPOptions options)
    : module_(std::move(module)), pg_(std::move(pg)), options_(std::move(options)) {
  NANODDP_CHECK(module_ != nullptr && pg_ != nullptr, ValueError, "FullyShardedDataParallel needs a model and a group");
  for (DType dtype : {options_.mixed_precision.param_dtype, options_.mixed_precision.reduce_dtype})
    NANODDP_CHECK(dtype == DType::Float32 || is_16bit_float(dtype), ValueError,
                  "FullyShardedDataParallel: MixedPrecision dtypes must be float32, float16 or bfloat16, got ", dtype);
  // Before the units' broadcasts, which would misalign (or abort the process under Gloo
  // without the collective check) on ranks that built different models.
  detail::verify_same_model(*pg_, *module_, "FSDP", options_.timeout);
  build_units();
  register_model_buffers();
}

namespace {

// An empty module on the path of a model's buffer (Note [FSDP buffers]).
class BufferPath : public nn::Module {
 public:
  Tensor forward(const Tensor& input) override { return input; }
  std::shared_ptr<BufferPath> child(const std::string& name) {
    auto& found = children_by_name_[name];
    if (found == nullptr) found = register_module(name, std::make_shared<BufferPath>());
    return found;
  }

 private:
  std::map<std::string, std::shared_ptr<BufferPath>> children_by_name_;
};

}  // namespace

// Note [FSDP buffers]
// The model is not a registered child of the wrapper (its parameters are views of the units'
// gathered vectors), so state_dict() would hold the shards only, and BatchNorm's running
// statistics would be lost from a local checkpoint. Each persistent buffer of the model is
// registered here under its own name ("1.running_mean"), through empty modules along its
// path, sharing the model's tensor: state_dict() saves it beside the shards and
// load_state_dict() copies into the model's own buffer, as torch's LOCAL_STATE_DICT keeps
// buffers; to() moves it once (the tensor is the same).
std::vector<Tensor> FullyShardedDataParallel::zero_if_missing() {
  std::vector<Tensor> zeroable;
  for (auto& [path, module] : module_->named_modules())
    for (Tensor& t : module->zero_if_missing()) zeroable.push_back(t);
  return zeroable;
}

void FullyShardedDataParallel::register_model_buffers() {
  std::map<std::string, std::shared_ptr<BufferPath>> top;
  for (const auto& [name, buffer] : module_->named_persistent_buffers()) {
    const size_t first_dot = name.find('.');
    if (first_dot == std::string::npos) {
      register_buffer(name, buffer);
      continue;
    }
    std::shared_ptr<BufferPath>& root = top[name.substr(0, first_dot)];
    if (root == nullptr) root = register_module(name.substr(0, first_dot), std::make_shared<BufferPath>());
    std::shared_ptr<BufferPath> holder = root;
    size_t start = first_dot + 1;
    for (size_t dot = name.find('.', start); dot != std::string::npos; start = dot + 1, dot = name.find('.', start))
      holder = holder->child(name.substr(start, dot - start));
    holder->register_buffer(name.substr(start), buffer);
  }
}

FullyShardedDataParallel::~FullyShardedDataParallel() {
  for (auto& [module, ids] : hooks_)
    for (int id : ids) module->remove_forward_hook(id);
  for (auto& unit : units_)
    for (size_t i = 0; i < unit->hook_ids.size(); ++i) unit->params[i].second.remove_hook(unit->hook_ids[i]);
  // A prefetch still in flight writes into memory the model's parameters keep alive; wait for
  // it so that nothing writes after the wrapper is gone (on NCCL the wait orders the device's
  // stream, and the watchdog holds the memory until the gather has finished).
  for (auto& unit : units_) {
    try {
      if (unit->gather_work) unit->gather_work->wait(options_.timeout);
    } catch (...) {  // destructors never throw; the group reports the failure to its next user
    }
  }
}

void FullyShardedDataParallel::build_units() {
  const int world = pg_->size();
  const int rank = pg_->rank();
  // Every parameter goes to the deepest unit module that holds it (pre-order: a nested unit
  // comes after its parent and takes its parameters).
  std::vector<std::pair<std::string, nn::Module*>> unit_modules = {{"", nullptr}};
  if (options_.auto_wrap_policy) {
    for (auto& [name, m] : module_->named_modules())
      if (!name.empty() && options_.auto_wrap_policy(name, *m)) unit_modules.emplace_back(name, m);
  }
  std::unordered_map<const TensorImpl*, size_t> owner;
  const auto contains = [](const std::string& outer, const std::string& inner) {
    return outer.empty() || inner.rfind(outer + ".", 0) == 0;
  };
  for (size_t u = 1; u < unit_modules.size(); ++u) {
    for (auto& [pname, p] : unit_modules[u].second->named_parameters()) {
      auto [it, fresh] = owner.emplace(p.impl(), u);
      if (fresh) continue;
      const std::string& other = unit_modules[it->second].first;
      NANODDP_CHECK(contains(other, unit_modules[u].first), ValueError, "FullyShardedDataParallel: parameter '",
                    unit_modules[u].first, ".", pname, "' is shared by units ", unit_label(other), " and ",
                    unit_label(unit_modules[u].first),
                    ": a unit's parameters are flattened and sharded together, so a tied parameter must belong to "
                    "one unit (wrap a module that holds both users, or leave both to the root)");
      it->second = u;
    }
  }
  std::vector<std::unique_ptr<Unit>> units(unit_modules.size());
  for (size_t u = 0; u < units.size(); ++u) {
    units[u] = std::make_unique<Unit>();
    units[u]->name = unit_modules[u].first;
    units[u]->module = unit_modules[u].second;
  }
  const auto named = module_->named_parameters();
  NANODDP_CHECK(!named.empty(), ValueError, "FullyShardedDataParallel: the model has no parameter to shard");
  for (auto& [pname, p] : named) {
    NANODDP_CHECK(p.dtype() == DType::Float32, ValueError, "FullyShardedDataParallel: parameter '", pname, "' is ",
                  dtype_name(p.dtype()), ", float32 expected");
    const auto it = owner.find(p.impl());
    Unit& unit = *units[it == owner.end() ? 0 : it->second];
    unit.offsets.push_back(unit.numel);
    unit.params.emplace_back(pname, p);
    unit.numel += p.numel();
  }
  // Units in the order of their first parameter, the root first; units without parameters
  // (every parameter taken by nested units) are dropped. A unit's parameters are one flat
  // parameter, which requires grad or not: all frozen or none (torch's FSDP with
  // use_orig_params=False asks the same).
  for (auto& unit : units) {
    if (unit->params.empty()) continue;
    const auto frozen = std::find_if(unit->params.begin(), unit->params.end(),
                                     [](const auto& named_param) { return !named_param.second.requires_grad(); });
    const auto trained = std::find_if(unit->params.begin(), unit->params.end(),
                                      [](const auto& named_param) { return named_param.second.requires_grad(); });
    NANODDP_CHECK(frozen == unit->params.end() || trained == unit->params.end(), ValueError,
                  "FullyShardedDataParallel: unit ", unit_label(unit->name), " holds '", frozen->first,
                  "', which does not require grad, and '", trained->first,
                  "', which does: a unit's parameters are flattened into one, frozen or not, so freeze all of "
                  "them or none (wrap the frozen ones in a unit of their own)");
    unit->frozen = trained == unit->params.end();
    units_.push_back(std::move(unit));
  }

  verify_same_units();

  const Device device = named[0].second.device();
  const bool no_shard = options_.sharding_strategy == ShardingStrategy::NO_SHARD;
  for (size_t u = 0; u < units_.size(); ++u) {
    Unit& unit = *units_[u];
    unit.shard_numel = no_shard ? unit.numel : (unit.numel + world - 1) / world;
    const int64_t padded = no_shard ? unit.numel : unit.shard_numel * world;
    Tensor full;
    {
      MemoryCategoryScope parameters(MemoryCategory::Parameters);
      full = Tensor::zeros({padded}, DType::Float32, device);
    }
    for (size_t i = 0; i < unit.params.size(); ++i) {
      Tensor& p = unit.params[i].second;
      NANODDP_CHECK(p.device() == device, DeviceError, "FullyShardedDataParallel: parameter '", unit.params[i].first,
                    "' is on ", p.device(), ", the first on ", device);
      copy_bytes(full.data<float>() + unit.offsets[i], device, p.data<float>(), p.device(), p.nbytes());
    }
    // sync_module_states: every rank starts from rank 0's values.
    if (world > 1) pg_->broadcast(full, 0)->wait(options_.timeout);
    for (size_t i = 0; i < unit.params.size(); ++i) {
      Tensor& p = unit.params[i].second;
      p.set_grad(Tensor());
      p.set_data(full.slice_view(unit.offsets[i], p.shape()));
    }
    unit.full = full;
    if (no_shard) {
      unit.shard = register_parameter_at_path(unit.name.empty() ? "_flat_param" : unit.name + "._flat_param", full);
      unit.gathered = true;
    } else {
      Tensor shard;
      {
        MemoryCategoryScope parameters(MemoryCategory::Parameters);
        shard = full.slice_view(rank * unit.shard_numel, {unit.shard_numel}).clone();
      }
      unit.shard = register_parameter_at_path(unit.name.empty() ? "_flat_param" : unit.name + "._flat_param", shard);
      unit.full.impl()->storage->free_memory();
    }
    if (unit.frozen) unit.shard.set_requires_grad(false);
    // Step 4 of Note [FSDP units]: count each parameter's accumulated gradient.
    if (!unit.frozen)
      for (auto& [pname, p] : unit.params)
        unit.hook_ids.push_back(p.register_post_accumulate_grad_hook([this, u](Tensor&) { on_param_ready(u); }));
    if (unit.module != nullptr) {
      const int pre = unit.module->register_forward_pre_hook(
          [this, u](nn::Module&, const Tensor&) { on_unit_forward_pre(u); });
      const int post = unit.module->register_forward_hook(
          [this, u](nn::Module&, const Tensor&, const Tensor& output) { return on_unit_forward_post(u, output); });
      hooks_.emplace_back(unit.module, std::vector<int>{pre, post});
    }
  }
  // Buffers (BatchNorm's running statistics) start as rank 0's, as DDP's do.
  if (world > 1)
    for (Tensor& b : module_->buffers()) pg_->broadcast(b, 0)->wait(options_.timeout);
}

// Every rank must split and run the model alike: the same sharding strategy, MixedPrecision,
// prefetch flags and units (what the auto-wrap policy picked). Checked before the first broadcast, whose
// sizes would otherwise differ and be reported as a mismatched broadcast, naming no option.
void FullyShardedDataParallel::verify_same_units() const {
  const int world = pg_->size();
  if (world == 1) return;
  const std::string who = detail::wrapper_on_rank("FSDP", *pg_);
  const MixedPrecision& mp = options_.mixed_precision;
  const std::vector<int64_t> settings = {static_cast<int64_t>(options_.sharding_strategy),
                                         static_cast<int64_t>(mp.param_dtype),
                                         static_cast<int64_t>(mp.reduce_dtype),
                                         static_cast<int64_t>(units_.size()),
                                         options_.forward_prefetch ? 1 : 0,
                                         options_.backward_prefetch ? 1 : 0};
  const auto all_settings = all_gather_host(*pg_, settings, options_.timeout);
  for (int r = 0; r < world; ++r) {
    const std::vector<int64_t>& theirs = all_settings[static_cast<size_t>(r)];
    NANODDP_CHECK(theirs[0] == settings[0], DistError, who, ": sharding_strategy ",
                  sharding_strategy_name(options_.sharding_strategy), " here but ",
                  sharding_strategy_name(static_cast<ShardingStrategy>(theirs[0])), " on rank ", r,
                  "; every rank must pass the same FSDPOptions");
    NANODDP_CHECK(theirs[1] == settings[1] && theirs[2] == settings[2], DistError, who,
                  ": MixedPrecision (param_dtype ", mp.param_dtype, ", reduce_dtype ", mp.reduce_dtype,
                  ") here but (", static_cast<DType>(theirs[1]), ", ", static_cast<DType>(theirs[2]),
                  ") on rank ", r, "; every rank must pass the same FSDPOptions");
    NANODDP_CHECK(theirs[3] == settings[3], DistError, who, ": the model's units here are ", units_.size(),
                  ", on rank ", r, " ", theirs[3],
                  "; every rank must pass the same auto_wrap_policy (one that picks the same modules)");
    // Prefetching issues all_gathers earlier: ranks that differ would pair one rank's
    // all_gather with another's reduce_scatter.
    const auto on_off = [](int64_t flag) { return flag != 0 ? "true" : "false"; };
    NANODDP_CHECK(theirs[4] == settings[4] && theirs[5] == settings[5], DistError, who, ": forward_prefetch ",
                  on_off(settings[4]), " and backward_prefetch ", on_off(settings[5]), " here but ",
                  on_off(theirs[4]), " and ", on_off(theirs[5]), " on rank ", r,
                  "; every rank must pass the same FSDPOptions");
  }
  std::vector<int64_t> layout;
  for (const auto& unit : units_) {
    layout.push_back(static_cast<int64_t>(fnv1a(unit->name) >> 1));
    layout.push_back(unit->numel);
  }
  const auto all_layouts = all_gather_host(*pg_, layout, options_.timeout);
  for (int r = 0; r < world; ++r)
    for (size_t u = 0; u < units_.size(); ++u) {
      const int64_t* theirs = all_layouts[static_cast<size_t>(r)].data() + 2 * u;
      NANODDP_CHECK(
          theirs[0] == layout[2 * u] && theirs[1] == layout[2 * u + 1], DistError, who, ": unit ", u, " is ",
          unit_label(units_[u]->name), " of ", units_[u]->numel, " elements here but ",
          theirs[0] == layout[2 * u] ? "of " + std::to_string(theirs[1]) + " elements" : "another module",
          " on rank ", r,
          "; every rank must pass the same auto_wrap_policy (one that picks the same modules)");
    }
}

std::vector<FullyShardedDataParallel::UnitInfo> FullyShardedDataParallel::units() const {
  std::vector<UnitInfo> infos;
  for (const auto& unit : units_) {
    UnitInfo info;
    info.name = unit->name;
    for (auto& [pname, p] : unit->params) info.parameter_names.push_back(pname);
    info.numel = unit->numel;
    info.shard_numel = unit->shard_numel;
    infos.push_back(std::move(info));
  }
  return infos;
}

bool FullyShardedDataParallel::frees_after_forward(size_t u) const {
  if (options_.sharding_strategy == ShardingStrategy::NO_SHARD) return false;
  if (!is_grad_enabled() || !is_training()) return true;
  // The root's backward comes first, so it keeps its parameters (torch's root does too).
  return options_.sharding_strategy == ShardingStrategy::FULL_SHARD && units_[u]->module != nullptr;
}

void FullyShardedDataParallel::gather(size_t u) {
  Unit& unit = *units_[u];
  if (unit.gathered || unit.gather_work) return;
  // A state dict's gathers are told apart from a forward's: a rank that ran one step fewer
  // would pair its state-dict gathers with the others' forward ones, of the same sizes.
  const CollectivePurpose purpose(gather_purpose_, u);
  const int world = pg_->size();
  unit.full.impl()->storage->reallocate();
  std::vector<Tensor> outputs;
  for (int r = 0; r < world; ++r) outputs.push_back(unit.full.slice_view(r * unit.shard_numel, {unit.shard_numel}));
  if (trace::enabled()) unit.gather_issued_us = trace::now_us();
  const DType param_dtype = options_.mixed_precision.param_dtype;
  if (param_dtype == DType::Float32 || gather_purpose_ == CollectivePurpose::Kind::FsdpStateDict) {
    unit.gather_work = pg_->all_gather(outputs, unit.shard.detach());
    return;
  }
  // MixedPrecision.param_dtype: the same all_gather at half the bytes, into a 16-bit buffer.
  const Device device = unit.full.device();
  unit.low_shard = Tensor::empty({unit.shard_numel}, param_dtype, device);
  unit.low_full = Tensor::empty({world * unit.shard_numel}, param_dtype, device);
  NANODDP_DISPATCH(device, float_to_16bit, bits16(unit.low_shard), unit.shard.data<float>(), param_dtype, 1.0f,
                   unit.shard_numel);
  std::vector<Tensor> low_outputs;
  for (int r = 0; r < world; ++r)
    low_outputs.push_back(unit.low_full.slice_view(r * unit.shard_numel, {unit.shard_numel}));
  unit.gather_work = pg_->all_gather(low_outputs, unit.low_shard);
}

// The unit's gather Work goes whether its wait returns or throws: a wrapper that kept a failed
// one would throw its error again at every later forward, state dict and destructor, without
// issuing anything, while the other ranks wait in their next gather. A failed gather leaves the
// unit ungathered; the next forward gathers again (Work::wait's error says whether the group
// still takes collectives).
void FullyShardedDataParallel::finish_gather(Unit& unit) {
  const std::shared_ptr<Work> work = std::move(unit.gather_work);  // leaves it null
  try {
    work->wait(options_.timeout);
  } catch (...) {
    unit.low_shard = Tensor();
    unit.low_full = Tensor();
    throw;
  }
}

void FullyShardedDataParallel::wait_gathered(size_t u) {
  Unit& unit = *units_[u];
  if (unit.gathered) return;
  gather(u);
  if (pg_->collectives_run_in_wait() && trace::enabled()) unit.gather_issued_us = trace::now_us();
  finish_gather(unit);
  unit.gathered = true;
  const size_t gathered_bytes = unit.low_shard.defined() ? unit.low_shard.nbytes() : unit.shard.nbytes();
  if (unit.low_full.defined()) {  // widened back: the forward's parameters are float32 again
    NANODDP_DISPATCH(unit.full.device(), float_from_16bit, unit.full.data<float>(), bits16(unit.low_full),
                     unit.low_full.dtype(), unit.low_full.numel());
    unit.low_shard = Tensor();
    unit.low_full = Tensor();
  }
  if (trace::enabled())
    trace::complete(kFsdpLane + static_cast<int>(u), "all_gather " + unit_label(unit.name), unit.gather_issued_us,
                    trace::now_us(),
                    "\"unit\":" + std::to_string(u) + ",\"bytes\":" + std::to_string(gathered_bytes) +
                        ",\"world_size\":" + std::to_string(pg_->size()));
}

void FullyShardedDataParallel::reshard(size_t u) {
  Unit& unit = *units_[u];
  if (options_.sharding_strategy == ShardingStrategy::NO_SHARD || !unit.gathered) return;
  unit.full.impl()->storage->free_memory();
  unit.gathered = false;
}

// Every unit's all_gather issued first, then waited in order: they run back to back.
// A prefetched all_gather whose unit this iteration never reached read the shard before the
// coming optimizer step: finish it and free its result, so that the next gather reads the
// stepped shard.
void FullyShardedDataParallel::drop_unused_prefetches() {
  for (size_t u = 0; u < units_.size(); ++u) {
    Unit& unit = *units_[u];
    if (!unit.gather_work) continue;
    finish_gather(unit);
    unit.low_shard = Tensor();
    unit.low_full = Tensor();
    unit.gathered = true;
    reshard(u);
  }
}

void FullyShardedDataParallel::gather_all() {
  for (size_t u = 0; u < units_.size(); ++u) gather(u);
  for (size_t u = 0; u < units_.size(); ++u) wait_gathered(u);
}

void FullyShardedDataParallel::reshard_all() {
  for (size_t u = 0; u < units_.size(); ++u) reshard(u);
}

void FullyShardedDataParallel::prefetch_after(const std::vector<size_t>& order, size_t u) {
  const auto it = std::find(order.begin(), order.end(), u);
  if (it != order.end() && it + 1 != order.end()) gather(*(it + 1));
}

void FullyShardedDataParallel::on_unit_forward_pre(size_t u) {
  // A checkpoint's rerun in backward (nn/activation_checkpoint.h) is not a forward: it must
  // neither add to the forward order nor prefetch the next unit, whose backward has run.
  const bool training = is_grad_enabled() && is_training() && !is_recomputing();
  if (training && !forward_order_known_) forward_order_.push_back(u);
  wait_gathered(u);
  if (training && options_.forward_prefetch && forward_order_known_) prefetch_after(forward_order_, u);
}

Tensor FullyShardedDataParallel::on_unit_forward_post(size_t u, const Tensor& output) {
  if (frees_after_forward(u)) reshard(u);
  if (!is_grad_enabled() || !output.defined() || !output.requires_grad()) return output;
  return FSDPBackwardMarker::apply(*this, u, output);
}

// The model is not a registered child (its parameters are views), so the mode is passed on here.
void FullyShardedDataParallel::train(bool mode) {
  Module::train(mode);
  module_->train(mode);
}

Tensor FullyShardedDataParallel::forward(const Tensor& input) {
  abandon_interrupted_backward();
  drop_unused_prefetches();  // a forward with no backward after it may have left one
  // Such a forward (a dry run, a metric read between backward and step) may also have left
  // units gathered, with the parameters as they were then: an optimizer step or a
  // load_state_dict has changed the shards since. This forward gathers them anew; a backward
  // still to come through that forward's graph gathers them again itself.
  reshard_all();
  // A sum a zero_grad discarded is freed here, before this forward's activations take memory.
  for (auto& unit : units_) drop_discarded_accumulation(*unit);
  const bool training = is_grad_enabled() && is_training();
  if (training && !forward_order_.empty()) forward_order_known_ = true;  // the first forward recorded it
  const bool has_root = units_[0]->module == nullptr;
  if (has_root) on_unit_forward_pre(0);
  Tensor output = (*module_)(input);
  if (!has_root) return output;
  return on_unit_forward_post(0, output);
}

// Note [FSDP no_sync]
// A no_sync backward leaves the unit's sum in full_grad, outside any tensor an optimizer sees.
// In torch it is flat_param.grad, so zero_grad discards it; here the shard's .grad stands for
// it. After a no_sync backward the shard gets a .grad (zeros if it had none) and the unit
// remembers that tensor and its version. A zero_grad replaces the .grad (set_to_none) or
// changes its version (zero_), and the next forward or backward then frees the sum and starts
// from zeros instead of adding to a sum the user discarded.
void FullyShardedDataParallel::remember_accumulation(Unit& unit) {
  if (!unit.full_grad.defined() || unit.frozen) return;
  if (!unit.shard.grad().defined()) {
    MemoryCategoryScope gradients(MemoryCategory::Gradients);
    unit.shard.set_grad(Tensor::zeros(unit.shard.shape(), DType::Float32, unit.shard.device()));
  }
  unit.accumulated_for = unit.shard.grad();
  unit.accumulated_version = unit.accumulated_for.impl()->storage->version();
}

void FullyShardedDataParallel::drop_discarded_accumulation(Unit& unit) {
  if (!unit.full_grad.defined() || unit.prepared) return;
  const Tensor grad = unit.shard.grad();
  const bool kept = unit.accumulated_for.defined() && grad.defined() &&
                    grad.impl() == unit.accumulated_for.impl() &&
                    grad.impl()->storage->version() == unit.accumulated_version;
  if (kept) return;
  for (auto& [pname, p] : unit.params)
    if (p.grad().is_alias_of(unit.full_grad)) p.set_grad(Tensor());
  unit.full_grad = Tensor();
  unit.accumulated_for = Tensor();
}

void FullyShardedDataParallel::on_unit_backward_pre(size_t u) {
  if (!in_backward_) {
    in_backward_ = true;
    reduce_order_.clear();
    reductions_finished_ = 0;
    queue_callback([this] { finish_backward(); });
  }
  Unit& unit = *units_[u];
  if (!backward_order_known_ && std::find(backward_order_.begin(), backward_order_.end(), u) == backward_order_.end())
    backward_order_.push_back(u);
  wait_gathered(u);  // a frozen unit too: the gradient of its input reads its parameters
  if (!unit.prepared && !unit.frozen) {
    drop_discarded_accumulation(unit);
    if (!unit.full_grad.defined()) {
      MemoryCategoryScope gradients(MemoryCategory::Gradients);
      unit.full_grad = Tensor::zeros(unit.full.shape(), DType::Float32, unit.full.device());
    }
    for (size_t i = 0; i < unit.params.size(); ++i) {
      Tensor& p = unit.params[i].second;
      Tensor view = unit.full_grad.slice_view(unit.offsets[i], p.shape());
      if (!p.grad().is_alias_of(unit.full_grad)) p.set_grad(view);
    }
    unit.pending = unit.params.size();
    unit.reduced = false;
    unit.prepared = true;
  }
  if (options_.backward_prefetch && backward_order_known_) prefetch_after(backward_order_, u);
}

void FullyShardedDataParallel::on_param_ready(size_t u) {
  Unit& unit = *units_[u];
  if (!in_backward_ || !unit.prepared || unit.pending == 0) return;
  if (--unit.pending == 0) reduce(u);
}

// Step 4: the unit's gradient is complete on this rank.
void FullyShardedDataParallel::reduce(size_t u) {
  Unit& unit = *units_[u];
  if (unit.reduced) return;
  unit.reduced = true;
  if (sync_) {
    const CollectivePurpose purpose(CollectivePurpose::Kind::FsdpUnit, u);
    if (trace::enabled()) unit.reduce_issued_us = trace::now_us();
    const DType reduce_dtype = options_.mixed_precision.reduce_dtype;
    if (reduce_dtype != DType::Float32) {
      // MixedPrecision.reduce_dtype: round, divide by world_size and round again (Avg is
      // float32 only), then sum in 16 bits, as DDP's compression hooks do; finish_reduction
      // widens the result.
      const Device device = unit.full_grad.device();
      const int64_t numel = unit.full_grad.numel(), world = pg_->size();
      const bool sharded = options_.sharding_strategy != ShardingStrategy::NO_SHARD;
      MemoryCategoryScope gradients(MemoryCategory::Gradients);
      unit.low_grad = Tensor::empty({numel}, reduce_dtype, device);
      NANODDP_DISPATCH(device, float_to_16bit, bits16(unit.low_grad), unit.full_grad.data<float>(), reduce_dtype,
                       static_cast<float>(world), numel);
      if (sharded) {
        unit.reduce_output = Tensor::empty({unit.shard_numel}, reduce_dtype, device);
        std::vector<Tensor> inputs;
        for (int r = 0; r < world; ++r)
          inputs.push_back(unit.low_grad.slice_view(r * unit.shard_numel, {unit.shard_numel}));
        unit.reduce_work = pg_->reduce_scatter(unit.reduce_output, inputs, ReduceOp::Sum);
      } else {
        unit.reduce_output = unit.low_grad;
        unit.reduce_work = pg_->all_reduce(unit.reduce_output, ReduceOp::Sum);
      }
    } else if (options_.sharding_strategy == ShardingStrategy::NO_SHARD) {
      unit.reduce_output = unit.full_grad;
      unit.reduce_work = pg_->all_reduce(unit.reduce_output, ReduceOp::Avg);
    } else {
      {
        MemoryCategoryScope gradients(MemoryCategory::Gradients);
        unit.reduce_output = Tensor::empty({unit.shard_numel}, DType::Float32, unit.full.device());
      }
      std::vector<Tensor> inputs;
      for (int r = 0; r < pg_->size(); ++r)
        inputs.push_back(unit.full_grad.slice_view(r * unit.shard_numel, {unit.shard_numel}));
      unit.reduce_work = pg_->reduce_scatter(unit.reduce_output, inputs, ReduceOp::Avg);
    }
    reduce_order_.push_back(u);
    // Finish every earlier reduction now, so that at most two units' full gradients are
    // alive at once (this one's, being reduced, and the next one's, accumulating) instead
    // of every unit's until backward ends. Works complete in issue order, so this waits for
    // the previous unit's only.
    while (reduce_order_.size() - reductions_finished_ > 1) finish_reduction(reduce_order_[reductions_finished_++]);
  }
  reshard(u);
}

// Adds a finished reduction into the shard's .grad and drops the unit's full gradient.
void FullyShardedDataParallel::finish_reduction(size_t u) {
  Unit& unit = *units_[u];
  if (pg_->collectives_run_in_wait() && trace::enabled()) unit.reduce_issued_us = trace::now_us();
  unit.reduce_work->wait(options_.timeout);
  unit.reduce_work.reset();
  if (trace::enabled())
    trace::complete(kFsdpLane + static_cast<int>(u),
                    std::string(options_.sharding_strategy == ShardingStrategy::NO_SHARD ? "all_reduce "
                                                                                         : "reduce_scatter ") +
                        unit_label(unit.name),
                    unit.reduce_issued_us, trace::now_us(),
                    "\"unit\":" + std::to_string(u) + ",\"bytes\":" + std::to_string(unit.reduce_output.nbytes()));
  if (unit.reduce_output.dtype() != DType::Float32) {  // MixedPrecision.reduce_dtype: widen
    MemoryCategoryScope gradients(MemoryCategory::Gradients);
    Tensor wide = Tensor::empty(unit.reduce_output.shape(), DType::Float32, unit.reduce_output.device());
    NANODDP_DISPATCH(wide.device(), float_from_16bit, wide.data<float>(), bits16(unit.reduce_output),
                     unit.reduce_output.dtype(), wide.numel());
    unit.reduce_output = wide;
    unit.low_grad = Tensor();
  }
  Tensor grad = unit.shard.grad();
  if (!grad.defined()) {
    unit.shard.set_grad(unit.reduce_output);
  } else {
    NANODDP_DISPATCH(grad.device(), accumulate, grad.data<float>(), unit.reduce_output.data<float>(), 1.0f,
                     grad.numel());
  }
  unit.reduce_output = Tensor();
  for (auto& [pname, p] : unit.params) p.set_grad(Tensor());
  unit.full_grad = Tensor();
  unit.accumulated_for = Tensor();
}

// Step 5, queued by the first unit's backward: runs once every node and hook is done.
void FullyShardedDataParallel::finish_backward() {
  in_backward_ = false;
  if (!backward_order_.empty()) backward_order_known_ = true;
  // A unit this backward reached, with a parameter no gradient reached, is reduced now, in
  // unit order, so that every rank issues the same collectives. So is one that only earlier
  // no_sync backwards reached: its full gradient holds their sum, which this step must reduce
  // (else the step misses it, and the next backward into the unit adds it again).
  for (size_t u = 0; u < units_.size(); ++u) {
    Unit& unit = *units_[u];
    drop_discarded_accumulation(unit);
    const bool accumulated_only = sync_ && !unit.prepared && unit.full_grad.defined();
    if (accumulated_only) unit.reduced = false;
    if ((unit.prepared || accumulated_only) && !unit.reduced) reduce(u);
  }
  while (reductions_finished_ < reduce_order_.size()) finish_reduction(reduce_order_[reductions_finished_++]);
  reduce_order_.clear();
  reductions_finished_ = 0;
  // The units are reset even when a prefetch's wait throws: a unit left prepared (and reduced)
  // would make the next backward skip its reduction without an error.
  std::exception_ptr prefetch_error;
  try {
    drop_unused_prefetches();
  } catch (...) {
    prefetch_error = std::current_exception();
  }
  for (size_t u = 0; u < units_.size(); ++u) {
    units_[u]->prepared = false;
    if (!sync_) remember_accumulation(*units_[u]);
    reshard(u);
  }
  if (prefetch_error) std::rethrow_exception(prefetch_error);
}

// The engine dropped finish_backward: the reductions issued so far are waited for and their
// results dropped; what earlier ones added to the shards' .grad is a partial sum that
// zero_grad clears. Then the ranks agree that each issued as many (Note [Interrupted
// backward] in dist/reducer.cpp): a rank whose backward went on is still inside a collective.
void FullyShardedDataParallel::abandon_interrupted_backward() {
  if (!in_backward_) return;
  in_backward_ = false;
  const int64_t issued_reductions = static_cast<int64_t>(reduce_order_.size());
  if (!backward_order_known_) backward_order_.clear();  // the first backward records again
  std::vector<std::shared_ptr<Work>> issued;
  for (size_t i = reductions_finished_; i < reduce_order_.size(); ++i)
    issued.push_back(std::move(units_[reduce_order_[i]]->reduce_work));
  reduce_order_.clear();
  reductions_finished_ = 0;
  for (size_t u = 0; u < units_.size(); ++u) {
    Unit& unit = *units_[u];
    for (auto& [pname, p] : unit.params)
      if (p.grad().is_alias_of(unit.full_grad)) p.set_grad(Tensor());
    unit.full_grad = Tensor();
    unit.accumulated_for = Tensor();
    unit.prepared = false;
    unit.pending = 0;
    reshard(u);
  }
  for (auto& work : issued) work->wait(options_.timeout);
  for (auto& unit : units_) {
    unit->reduce_output = Tensor();
    unit->low_grad = Tensor();
  }
  detail::agree_after_interrupted_backward(*pg_, issued_reductions, "FSDP", options_.timeout);
}

float FullyShardedDataParallel::clip_grad_norm_(double max_norm, double norm_type, bool error_if_nonfinite) {
  const bool infinity = std::isinf(norm_type) && norm_type > 0;
  NANODDP_CHECK(norm_type == 2.0 || infinity, ValueError,
                "FullyShardedDataParallel.clip_grad_norm_: norm_type must be 2 or infinity, got ", norm_type);
  NANODDP_CHECK(max_norm >= 0, ValueError, "FullyShardedDataParallel.clip_grad_norm_: max_norm must be >= 0, got ",
                max_norm);
  // Each shard's gradient is read to the host once per pass, one unit at a time.
  const auto for_each_gradient = [this](auto&& f) {
    for (const auto& unit : units_) {
      const Tensor grad = unit->shard.grad();
      if (!grad.defined()) continue;
      for (float g : grad.to_vector()) f(g);
    }
  };
  // The largest |g| first (NaN wins): the infinity norm itself, and the scale of the 2-norm.
  double largest = 0;
  for_each_gradient([&largest](float g) {
    const double a = std::fabs(static_cast<double>(g));
    largest = std::isnan(a) || std::isnan(largest) ? NAN : std::max(largest, a);
  });
  const bool sharded = options_.sharding_strategy != ShardingStrategy::NO_SHARD && pg_->size() > 1;
  // float32 on the wire: the groups reduce float32 and int64 only. A max is exact in float32.
  if (sharded)
    largest = all_reduce_host(*pg_, std::vector<float>{static_cast<float>(largest)}, ReduceOp::Max)[0];
  double total = largest;
  if (!infinity && std::isfinite(largest) && largest > 0) {
    // Sums of (|g| / largest)^2 are at most the element count: no float32 sum of squares on the
    // wire to overflow (gradients of 1e22) or underflow (1e-24), as nn::clip_grad_norm_'s double
    // sum does not either.
    double scaled = 0;
    for_each_gradient([&scaled, largest](float g) {
      const double a = static_cast<double>(g) / largest;
      scaled += a * a;
    });
    if (sharded)
      scaled = all_reduce_host(*pg_, std::vector<float>{static_cast<float>(scaled)}, ReduceOp::Sum)[0];
    total = largest * std::sqrt(scaled);
  }
  const float norm = static_cast<float>(total);
  NANODDP_CHECK(std::isfinite(norm) || !error_if_nonfinite, ValueError,
                "FullyShardedDataParallel.clip_grad_norm_: the total norm of order ", norm_type, " is ", norm,
                " (a NaN or infinite gradient); with error_if_nonfinite=false the gradients are scaled anyway");
  // float32, as torch's FSDP: torch.tensor(max_norm) / (total_norm + 1e-6), a division
  // (nn::clip_grad_norm_'s Python float on the left multiplies by a reciprocal instead).
  const float coef = static_cast<float>(max_norm) / (norm + 1e-6f);
  if (coef < 1.0f || std::isnan(coef)) {
    NoGradGuard no_grad;
    for (const auto& unit : units_) {
      Tensor grad = unit->shard.grad();
      if (grad.defined()) grad.copy_(grad * coef);
    }
  }
  return norm;
}

nn::StateDict FullyShardedDataParallel::full_state_dict(bool rank0_only) {
  // The state holds the float32 parameters whatever param_dtype the forward gathers in (torch
  // gathers in full precision for a state dict too): a 16-bit gathered copy, done or in flight,
  // is dropped first, and the units are gathered in float32.
  drop_unused_prefetches();
  reshard_all();
  gather_all_for_state_dict(CollectivePurpose::Kind::FsdpStateDict);
  nn::StateDict state;
  if (!rank0_only || pg_->rank() == 0) state = module_->state_dict();
  reshard_all();
  return state;
}

void FullyShardedDataParallel::gather_all_for_state_dict(CollectivePurpose::Kind purpose) {
  struct BackToForward {
    CollectivePurpose::Kind& purpose;
    ~BackToForward() { purpose = CollectivePurpose::Kind::FsdpUnit; }
  } back_to_forward{gather_purpose_};
  gather_purpose_ = purpose;
  gather_all();
}

void FullyShardedDataParallel::load_full_state_dict(const nn::StateDict& state) {
  // Every rank checks the state first and learns whether all passed, so that no rank loads a
  // state another refused (the ranks would go on with different models).
  std::exception_ptr error;
  try {
    module_->check_state_dict(state);
  } catch (const Error&) {
    error = std::current_exception();
  }
  std::string refused;
  {
    const CollectivePurpose purpose(CollectivePurpose::Kind::FsdpLoadCheck, 0);
    refused = ranks_that_failed(*pg_, error != nullptr, options_.timeout);
  }
  if (error) std::rethrow_exception(error);
  NANODDP_CHECK(refused.empty(), ValueError, "FullyShardedDataParallel.load_full_state_dict on rank ",
                pg_->rank(), ": rank(s) ", refused,
                " refused the state (their errors say why); no rank loaded it. Every rank "
                "passes the same full state");
  gather_all_for_state_dict(CollectivePurpose::Kind::FsdpLoadStateDict);
  try {
    module_->load_state_dict(state);
  } catch (...) {
    reshard_all();
    throw;
  }
  if (options_.sharding_strategy != ShardingStrategy::NO_SHARD) {
    for (auto& unit : units_) {
      const Tensor mine = unit->full.slice_view(pg_->rank() * unit->shard_numel, {unit->shard_numel});
      unit->shard.detach().copy_(mine);
    }
  }
  reshard_all();
}

namespace {

// The optimizer state's keys number the optimizer's parameters; they name the units only when
// the optimizer was built on parameters() itself, all of it, in its order. ValueError otherwise,
// saying how to build it (frozen units included: an optimizer skips a parameter without a
// gradient, as torch's do, so holding them costs nothing).
void check_built_on(const std::vector<Tensor>& shards, const nn::Optimizer& optimizer, const char* where) {
  const std::vector<Tensor>& params = optimizer.params();
  size_t same = 0;
  while (same < std::min(params.size(), shards.size()) && params[same].impl() == shards[same].impl()) ++same;
  if (same == params.size() && same == shards.size()) return;
  NANODDP_THROW(ValueError, "FullyShardedDataParallel.", where, ": the optimizer has ", params.size(),
                " parameters; it must be built on this wrapper's parameters(), all ", shards.size(),
                " in their order (",
                same < params.size() && same < shards.size()
                    ? "its parameter " + std::to_string(same) + " is not unit " + std::to_string(same) +
                          "'s flat parameter"
                    : std::string("a subset or more"),
                "): build it on parameters(), frozen units included (an optimizer skips a parameter that "
                "gets no gradient)");
}

// "exp_avg.3" -> {"exp_avg", 3}; ValueError otherwise.
std::pair<std::string, size_t> split_state_key(const std::string& key) {
  const size_t dot = key.rfind('.');
  NANODDP_CHECK(dot != std::string::npos && dot + 1 < key.size() &&
                    key.find_first_not_of("0123456789", dot + 1) == std::string::npos,
                ValueError, "FullyShardedDataParallel: optimizer state key '", key,
                "' is not <buffer>.<parameter index>");
  return {key.substr(0, dot), static_cast<size_t>(std::stoull(key.substr(dot + 1)))};
}

// A unit's parameters share one flat parameter, so one optimizer entry: a state that is not
// per element (Adam's step) must be the same for each of them. unit: its unit_label. params:
// the unit's (name, tensor); found: (k, entry) for each of its parameters k that has one.
// Throws ValueError naming the first two that differ, a missing one included, as torch's FSDP
// does ("must have scalar state with the same value and dtype").
void check_same_scalar_state(const std::string& where, const std::string& buffer, const std::string& unit,
                             const std::vector<std::pair<std::string, Tensor>>& params,
                             const std::vector<std::pair<size_t, Tensor>>& found) {
  std::vector<std::pair<std::string, Tensor>> values(params.size());  // parameter k's, or undefined
  for (size_t k = 0; k < params.size(); ++k) values[k].first = params[k].first;
  for (const auto& [k, value] : found) values[k].second = value;
  const auto describe = [](const Tensor& t) {
    if (!t.defined()) return std::string("none");
    std::ostringstream text;
    if (t.dtype() == DType::Int64 && t.numel() == 1)
      text << t.to_int_vector()[0];
    else if (t.dtype() == DType::Float32 && t.numel() == 1)
      text << t.to_vector()[0];
    else
      text << dtype_name(t.dtype()) << " " << t.shape();
    return text.str();
  };
  const auto same = [](const Tensor& a, const Tensor& b) {
    if (!a.defined() || !b.defined()) return a.defined() == b.defined();
    if (a.dtype() != b.dtype() || a.shape() != b.shape()) return false;
    if (a.dtype() == DType::Int64) return a.to_int_vector() == b.to_int_vector();
    if (a.dtype() == DType::Float32) return a.to_vector() == b.to_vector();
    return true;  // another dtype: refused where it is loaded
  };
  for (size_t k = 1; k < values.size(); ++k)
    NANODDP_CHECK(same(values[0].second, values[k].second), ValueError, where, ": '", buffer,
                  "' must be the same for every parameter of unit ", unit, " (they share one flat parameter), but '",
                  values[0].first, "' has ", describe(values[0].second), " and '", values[k].first, "' has ",
                  describe(values[k].second), "; was the state saved by an optimizer that stepped them apart?");
}

}  // namespace

std::unordered_map<const TensorImpl*, size_t> FullyShardedDataParallel::model_parameter_index() const {
  std::unordered_map<const TensorImpl*, size_t> index;
  const auto model_params = module_->parameters();
  for (size_t j = 0; j < model_params.size(); ++j) index[model_params[j].impl()] = j;
  return index;
}

std::vector<std::pair<size_t, size_t>> FullyShardedDataParallel::unit_place_of_parameters() const {
  const auto model_index = model_parameter_index();
  std::vector<std::pair<size_t, size_t>> where(module_->parameters().size());
  for (size_t u = 0; u < units_.size(); ++u)
    for (size_t k = 0; k < units_[u]->params.size(); ++k)
      where[model_index.at(units_[u]->params[k].second.impl())] = {u, k};
  return where;
}

nn::StateDict FullyShardedDataParallel::full_optim_state_dict(const nn::Optimizer& optimizer) {
  check_built_on(parameters(), optimizer, "full_optim_state_dict");
  const nn::StateDict local = optimizer.state_dict();
  const auto model_index = model_parameter_index();
  nn::StateDict full;
  for (const auto& [key, value] : local) {  // the same keys in the same order on every rank
    const auto [buffer, i] = split_state_key(key);
    NANODDP_CHECK(i < units_.size(), ValueError, "FullyShardedDataParallel.full_optim_state_dict: key '", key,
                  "' names flat parameter ", i, " but the wrapper has ", units_.size(), " (one per unit)");
    const Unit& unit = *units_[i];
    const bool flat = value.dtype() == DType::Float32 && value.numel() == unit.shard_numel && value.dim() == 1;
    Tensor gathered;
    if (flat && options_.sharding_strategy != ShardingStrategy::NO_SHARD) {
      // Gathered where the group's collectives run, then brought to the CPU like every entry.
      const CollectivePurpose purpose(CollectivePurpose::Kind::FsdpOptimState, i);
      Tensor on_group_device = Tensor::empty({unit.shard_numel * pg_->size()}, DType::Float32, pg_->device());
      std::vector<Tensor> outputs;
      for (int r = 0; r < pg_->size(); ++r)
        outputs.push_back(on_group_device.slice_view(r * unit.shard_numel, {unit.shard_numel}));
      pg_->all_gather(outputs, value.to(pg_->device()))->wait(options_.timeout);
      gathered = on_group_device.to(Device::cpu());
    } else if (flat) {
      gathered = value.to(Device::cpu());
    }
    for (size_t k = 0; k < unit.params.size(); ++k) {
      const Tensor& p = unit.params[k].second;
      const std::string name = buffer + "." + std::to_string(model_index.at(p.impl()));
      full[name] = flat ? gathered.slice_view(unit.offsets[k], p.shape()).clone()
                        : value.detach().to(Device::cpu()).clone();
    }
  }
  return full;
}

nn::StateDict FullyShardedDataParallel::shard_full_optim_state_dict(const nn::StateDict& full) const {
  const std::vector<std::pair<size_t, size_t>> where = unit_place_of_parameters();  // model index -> (unit, k)
  // buffer -> unit -> entries found
  std::map<std::string, std::map<size_t, std::vector<std::pair<size_t, Tensor>>>> grouped;
  for (const auto& [key, value] : full) {
    const auto [buffer, j] = split_state_key(key);
    NANODDP_CHECK(j < where.size(), ValueError, "FullyShardedDataParallel.shard_full_optim_state_dict: key '",
                  key, "' names parameter ", j, " but the model has ", where.size(), " (0..", where.size() - 1, ")");
    grouped[buffer][where[j].first].emplace_back(where[j].second, value);
  }
  nn::StateDict sharded;
  const bool no_shard = options_.sharding_strategy == ShardingStrategy::NO_SHARD;
  for (const auto& [buffer, by_unit] : grouped) {
    for (const auto& [u, entries] : by_unit) {
      const Unit& unit = *units_[u];
      const std::string key = buffer + "." + std::to_string(u);
      const Tensor& first_param = unit.params[entries[0].first].second;
      const bool per_element = entries[0].second.dtype() == DType::Float32 &&
                               entries[0].second.shape() == first_param.shape();
      if (!per_element) {
        check_same_scalar_state("FullyShardedDataParallel.shard_full_optim_state_dict", buffer, unit_label(unit.name),
                                unit.params, entries);
        sharded[key] = entries[0].second.clone();
        continue;
      }
      const int64_t padded = no_shard ? unit.numel : unit.shard_numel * pg_->size();
      Tensor flat = Tensor::zeros({padded});
      for (const auto& [k, value] : entries) {
        const Tensor& p = unit.params[k].second;
        NANODDP_CHECK(value.shape() == p.shape() && value.dtype() == DType::Float32, ShapeError,
                      "FullyShardedDataParallel.shard_full_optim_state_dict: '", buffer, "' of parameter '",
                      unit.params[k].first, "' is ", value.shape(), " ", dtype_name(value.dtype()), ", expected ",
                      p.shape(), " float32");
        flat.slice_view(unit.offsets[k], p.shape()).copy_(value.to(Device::cpu()));
      }
      sharded[key] = no_shard ? flat : flat.slice_view(pg_->rank() * unit.shard_numel, {unit.shard_numel}).clone();
    }
  }
  return sharded;
}

namespace {

// The elements [begin, end) of a parameter at offset (numel elements) that fall inside
// [shard_begin, shard_end) of its unit's flat vector; {0, 0} when none do.
std::pair<int64_t, int64_t> part_in_shard(int64_t offset, int64_t numel, int64_t shard_begin,
                                          int64_t shard_end) {
  const int64_t lo = std::max(offset, shard_begin), hi = std::min(offset + numel, shard_end);
  if (lo >= hi) return {0, 0};
  return {lo - offset, hi - offset};
}

}  // namespace

// Elements [begin, end) of unit u's flat vector that rank holds in a sharded checkpoint:
// its shard, less the padding; under NO_SHARD, where every rank holds all, rank 0 alone.
std::pair<int64_t, int64_t> FullyShardedDataParallel::saved_range(size_t u, int rank) const {
  const Unit& unit = *units_[u];
  if (options_.sharding_strategy == ShardingStrategy::NO_SHARD)
    return rank == 0 ? std::make_pair(int64_t{0}, unit.numel) : std::make_pair(int64_t{0}, int64_t{0});
  return {std::min(unit.numel, rank * unit.shard_numel), std::min(unit.numel, (rank + 1) * unit.shard_numel)};
}

ShardedStateDict FullyShardedDataParallel::sharded_model_state_dict() const {
  const auto buffers = module_->named_buffers();
  NANODDP_CHECK(buffers.empty(), ValueError,
                "FullyShardedDataParallel.sharded_model_state_dict: the model has ", "buffers ('",
                buffers.empty() ? "" : buffers[0].first, "', ...), which a sharded set does not ",
                "hold: save it with full_state_dict");
  ShardedStateDict out;
  for (size_t u = 0; u < units_.size(); ++u) {
    const Unit& unit = *units_[u];
    const auto [shard_begin, shard_end] = saved_range(u, pg_->rank());
    // The shard starts at r S (0 under NO_SHARD, where it is the whole vector).
    const int64_t shard_offset =
        options_.sharding_strategy == ShardingStrategy::NO_SHARD ? 0 : pg_->rank() * unit.shard_numel;
    const Tensor shard = unit.shard.detach().to(Device::cpu());
    for (size_t k = 0; k < unit.params.size(); ++k) {
      const Tensor& p = unit.params[k].second;
      const auto [begin, end] = part_in_shard(unit.offsets[k], p.numel(), shard_begin, shard_end);
      ShardedEntry entry;
      entry.shape = p.shape();
      entry.begin = begin;
      entry.end = end;
      if (begin < end)
        entry.piece = shard.slice_view(unit.offsets[k] + begin - shard_offset, {end - begin}).clone();
      out[unit.params[k].first] = entry;
    }
  }
  // A tied parameter is in the units once, under its first name; the set holds it under
  // every name, as state_dict does.
  std::map<const TensorImpl*, std::string> first_name;
  for (const auto& [name, p] : module_->named_parameters(/*remove_duplicate=*/false)) {
    const auto [first, fresh] = first_name.emplace(p.impl(), name);
    if (!fresh && out.count(first->second) > 0) out[name] = out.at(first->second);
  }
  return out;
}

ShardedStateDict FullyShardedDataParallel::sharded_optim_state_dict(const nn::Optimizer& optimizer) const {
  check_built_on(parameters(), optimizer, "sharded_optim_state_dict");
  const auto model_index = model_parameter_index();
  const bool no_shard = options_.sharding_strategy == ShardingStrategy::NO_SHARD;
  ShardedStateDict out;
  for (const auto& [key, value] : optimizer.state_dict()) {
    const auto [buffer, u] = split_state_key(key);
    NANODDP_CHECK(u < units_.size(), ValueError, "FullyShardedDataParallel.sharded_optim_state_dict: key '",
                  key, "' names flat parameter ", u, " but the wrapper has ", units_.size(), " (one per unit)");
    const Unit& unit = *units_[u];
    const bool flat =
        value.dtype() == DType::Float32 && value.numel() == unit.shard_numel && value.dim() == 1;
    const auto [shard_begin, shard_end] = saved_range(u, pg_->rank());
    const int64_t shard_offset = no_shard ? 0 : pg_->rank() * unit.shard_numel;
    for (size_t k = 0; k < unit.params.size(); ++k) {
      const Tensor& p = unit.params[k].second;
      const std::string name = buffer + "." + std::to_string(model_index.at(p.impl()));
      ShardedEntry entry;
      if (flat) {
        const auto [begin, end] = part_in_shard(unit.offsets[k], p.numel(), shard_begin, shard_end);
        entry.shape = p.shape();
        entry.begin = begin;
        entry.end = end;
        if (begin < end)
          entry.piece = value.to(Device::cpu())
                            .slice_view(unit.offsets[k] + begin - shard_offset, {end - begin})
                            .clone();
      } else {
        // Equal on every rank (a step count): each saves it, so a reader finds it in any file.
        entry = whole_entry(value);
      }
      out[name] = entry;
    }
  }
  return out;
}

nn::StateDict FullyShardedDataParallel::read_local_state_dict(ShardedCheckpointReader& reader,
                                                              const std::string& prefix) const {
  const bool no_shard = options_.sharding_strategy == ShardingStrategy::NO_SHARD;
  nn::StateDict out;
  for (const auto& unit : units_) {
    // This rank's shard [r S, (r + 1) S) of the flat vector; all of it under NO_SHARD.
    const int64_t shard_begin = no_shard ? 0 : pg_->rank() * unit->shard_numel;
    Tensor shard = Tensor::zeros({unit->shard_numel});
    for (size_t k = 0; k < unit->params.size(); ++k) {
      const Tensor& p = unit->params[k].second;
      const std::string name = prefix + unit->params[k].first;
      NANODDP_CHECK(reader.contains(name), ValueError, "sharded checkpoint ", reader.path(), " holds no '",
                    name, "': it was saved from another model");
      NANODDP_CHECK(reader.shape(name) == p.shape() && reader.dtype(name) == DType::Float32, ShapeError,
                    "sharded checkpoint ", reader.path(), ": '", name, "' is ", reader.shape(name), " ",
                    dtype_name(reader.dtype(name)), ", the model's parameter is ", p.shape(), " float32");
      const auto [begin, end] =
          part_in_shard(unit->offsets[k], p.numel(), shard_begin, shard_begin + unit->shard_numel);
      if (begin < end)
        shard.slice_view(unit->offsets[k] + begin - shard_begin, {end - begin})
            .copy_(reader.read_range(name, begin, end));
    }
    out[unit->name.empty() ? "_flat_param" : unit->name + "._flat_param"] = shard;
  }
  return out;
}

nn::StateDict FullyShardedDataParallel::read_local_optim_state_dict(ShardedCheckpointReader& reader,
                                                                    const std::string& prefix) const {
  const std::vector<std::pair<size_t, size_t>> where = unit_place_of_parameters();  // model index -> (unit, k)
  // buffer -> unit -> (k, name in the set)
  std::map<std::string, std::map<size_t, std::vector<std::pair<size_t, std::string>>>> grouped;
  for (const std::string& name : reader.names()) {
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    const auto [buffer, j] = split_state_key(name.substr(prefix.size()));
    NANODDP_CHECK(j < where.size(), ValueError, "sharded checkpoint ", reader.path(), ": '", name,
                  "' names parameter ", j, " but the model has ", where.size(), " (0..", where.size() - 1, ")");
    grouped[buffer][where[j].first].emplace_back(where[j].second, name);
  }
  const bool no_shard = options_.sharding_strategy == ShardingStrategy::NO_SHARD;
  nn::StateDict out;
  for (const auto& [buffer, by_unit] : grouped) {
    for (const auto& [u, entries] : by_unit) {
      const Unit& unit = *units_[u];
      const std::string key = buffer + "." + std::to_string(u);
      const std::string& first = entries[0].second;
      const bool per_element = reader.dtype(first) == DType::Float32 &&
                               reader.shape(first) == unit.params[entries[0].first].second.shape();
      if (!per_element) {  // a step count: the same for every parameter of the unit
        std::vector<std::pair<size_t, Tensor>> found;
        for (const auto& [k, name] : entries) found.emplace_back(k, reader.read(name));
        check_same_scalar_state("sharded checkpoint " + reader.path(), buffer, unit_label(unit.name), unit.params,
                                found);
        out[key] = found[0].second;
        continue;
      }
      const int64_t shard_begin = no_shard ? 0 : pg_->rank() * unit.shard_numel;
      Tensor flat = Tensor::zeros({unit.shard_numel});
      for (const auto& [k, name] : entries) {
        const Tensor& p = unit.params[k].second;
        NANODDP_CHECK(reader.shape(name) == p.shape() && reader.dtype(name) == DType::Float32, ShapeError,
                      "sharded checkpoint ", reader.path(), ": '", name, "' is ", reader.shape(name), " ",
                      dtype_name(reader.dtype(name)), ", its parameter '", unit.params[k].first, "' is ",
                      p.shape(), " float32");
        const auto [begin, end] =
            part_in_shard(unit.offsets[k], p.numel(), shard_begin, shard_begin + unit.shard_numel);
        if (begin < end)
          flat.slice_view(unit.offsets[k] + begin - shard_begin, {end - begin})
              .copy_(reader.read_range(name, begin, end));
      }
      out[key] = flat;
    }
  }
  return out;
}

}  // namespace nanoddp::dist
