// FullyShardedDataParallel: data parallelism that shards the model state itself
// (torch.distributed.fsdp.FullyShardedDataParallel; ZeRO stages 2 and 3).
//
//   auto pg = dist::init_process_group();
//   dist::FSDPOptions options;
//   options.auto_wrap_policy = dist::module_wrap_policy<nn::Linear, nn::Conv2d>();
//   dist::FullyShardedDataParallel fsdp(model, pg, options);      // model: shared_ptr<nn::Module>
//   nn::AdamW opt(fsdp.parameters(), {});                          // steps this rank's shards
//   opt.zero_grad();  loss_fn(fsdp(x), y).backward();  opt.step();
//
// Note [FSDP units]
// The model is split into units: every submodule the auto-wrap policy picks (each one's
// parameters, less those of units nested in it) and the root (every parameter no unit
// claimed). A unit's parameters are flattened into one vector of numel elements, padded to
// W * S with S = ceil(numel / W), and rank r keeps elements [r S, (r + 1) S): its shard, a
// parameter of this module named "<unit>._flat_param" ("_flat_param" for the root). That is
// what parameters() returns and what an optimizer steps, so its state is sharded with it.
// A unit's life in one step, with FULL_SHARD (ZeRO-3):
//   1. before the unit's forward: all_gather the shards into the full flat vector; the
//      module's own parameters are views of it (Note [Freeing a storage in place]);
//   2. after its forward: free the full vector (the root keeps it until backward, as torch's
//      root does: its backward comes first);
//   3. before its backward (an autograd node on the unit's output): all_gather again, and
//      make every parameter's .grad a view of one zeroed full-size gradient vector;
//   4. once every parameter's gradient is accumulated (post-accumulate-grad hooks):
//      reduce_scatter(avg) the gradient vector, so this rank holds the mean gradient of its
//      shard only, and free the full parameters;
//   5. when the next unit's reduction is issued, or at the end of backward: wait for the
//      reduce_scatter, add its result into the shard's .grad, free the full gradient vector
//      (so at most two units' full gradients live at once).
// SHARD_GRAD_OP (ZeRO-2) keeps the full parameters from step 1 to step 4 (one all_gather per
// step); NO_SHARD keeps everything full and replaces step 4's reduce_scatter by an
// all_reduce(avg): DDP's behaviour through the same code. A forward without grad (eval)
// frees the full parameters after every unit's forward whatever the strategy (but NO_SHARD).
// A forward first frees what an earlier forward left gathered (one no backward followed: a
// dry run, a metric read before the step), so it always computes with the current shards.
//
// Prefetch (torch's forward_prefetch / backward_prefetch=BACKWARD_PRE): the next unit's
// all_gather is issued before this unit computes, in the order units ran in the first
// forward and the first backward, so that communication overlaps computation where the
// backend moves data while no thread waits (Gloo's worker, NCCL, MPI). It costs one more
// unit's full parameters in memory.
//
// Communication per step (Ψ parameters in units the root does not hold, float32): FULL_SHARD
// all_gathers Ψ twice and reduce_scatters Ψ once, 3Ψ·4 bytes of payload against DDP's
// all-reduce of Ψ (2Ψ as a ring: a reduce-scatter plus an all-gather); SHARD_GRAD_OP 2Ψ.
// The process group's counters count each all_gather's input and each reduce_scatter's
// output, S·4 bytes per unit (docs/ddp/12-sharding.md works the numbers).
//
// Contract: every rank builds the same model and calls forward and backward in the same
// order, and every rank's backward reaches the same units. A unit whose output reaches the
// loss on some ranks only breaks it: every rank gets the collective check's DistError, which
// names the unit (Note [Collective purpose]; torch's FSDP has no such case either). Within a
// unit that backward reaches, a parameter no gradient reaches gets a zero gradient, reduced
// at the end of backward; the ranks must agree on which parameters those are (the unit's
// reduction moves to the end of backward, and ranks that disagree get that DistError). Every rank runs the
// same number of steps: the wrapper is not a Joinable (torch's FSDP is not either), so uneven inputs end in
// that DistError or the group's TimeoutError; give every rank as many batches (DistributedSampler's padding,
// or drop_last). Construction broadcasts rank 0's parameters and buffers (torch's sync_module_states=True),
// as DDP's does. A unit whose parameters are all frozen (requires_grad false, a frozen embedding) is gathered
// for its forward and for the backward through it, and has no gradient: its flat parameter does not require
// grad, and an optimizer skips it. Errors: ValueError for a model with no parameter, a unit that mixes frozen
// and trained parameters (they are flattened into one, as torch's use_orig_params=False asks), a parameter
// two units share (named, with both units), or a parameter used through the module outside forward;
// DistError, before any broadcast, naming the option when ranks pass another sharding_strategy,
// MixedPrecision, prefetch setting or auto_wrap_policy (other units); DistError and TimeoutError from the
// collectives; a parameter read while its unit is resharded throws ValueError from Tensor::data. As torch's
// flat-parameter FSDP: a parameter its forward never uses, in a unit that is used, gets a zero gradient (its
// part of the flat one), so weight decay still moves it, where DDP with find_unused_parameters leaves it
// alone. Buffers are broadcast at construction only: a plain BatchNorm's running statistics then follow each
// rank's own batches (SyncBatchNorm keeps them equal), and full_state_dict saves rank 0's.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "dist/process_group.h"
#include "dist/sharded_checkpoint.h"
#include "nn/module.h"
#include "nn/optimizer.h"

namespace nanoddp::dist {

// torch.distributed.fsdp.ShardingStrategy.
enum class ShardingStrategy { FULL_SHARD, SHARD_GRAD_OP, NO_SHARD };
const char* sharding_strategy_name(ShardingStrategy strategy);  // "FULL_SHARD", ...

// Which submodules become units: called on every module below the root, depth-first, with
// its dotted name. torch's auto_wrap_policy.
using AutoWrapPolicy = std::function<bool(const std::string& name, nn::Module& module)>;

// Every module of one of the given types is a unit (torch's ModuleWrapPolicy({nn.Linear})).
template <typename... Modules>
AutoWrapPolicy module_wrap_policy() {
  return [](const std::string&, nn::Module& module) { return ((dynamic_cast<Modules*>(&module) != nullptr) || ...); };
}

// What FSDP communicates in (torch.distributed.fsdp.MixedPrecision). Float16 or BFloat16
// halve the bytes; the shards, their gradients and the optimizer stay float32:
//   param_dtype: each rank rounds its shard to it, the units are all-gathered in it, and the
//     full parameters are widened back to float32, so a forward computes with rounded weights
//     (under nn::autocast, Linear casts them to 16 bits anyway: the same values). NO_SHARD
//     gathers nothing, so there param_dtype changes nothing and the forward computes with the
//     float32 parameters (torch casts them to param_dtype there too): use nn::autocast;
//   reduce_dtype: each unit's gradient is rounded to it, divided by world_size (rounded
//     again), reduce-scattered (all-reduced with NO_SHARD) in it, and widened into the float32
//     shard .grad. torch 1.13's FSDP divides in two parts instead, by a pre-divide factor
//     before the reduction and by the rest after (2 and 2 at world size 4): the same values
//     at world size 2; at others the rounding differs, and so do the bounds of overflow and
//     underflow (at 4 ranks a float16 gradient of 65504 on every rank is inf there, here 65504).
// Float32, the default, sends float32. ValueError for another dtype.
struct MixedPrecision {
  DType param_dtype = DType::Float32;
  DType reduce_dtype = DType::Float32;
};

struct FSDPOptions {
  ShardingStrategy sharding_strategy = ShardingStrategy::FULL_SHARD;
  MixedPrecision mixed_precision;
  // Empty: the root is the only unit.
  AutoWrapPolicy auto_wrap_policy;
  // Issue the next unit's all_gather before this unit's forward (torch's default: false).
  bool forward_prefetch = false;
  // Issue the next unit's all_gather before this unit's backward (torch's BACKWARD_PRE, its
  // default).
  bool backward_prefetch = true;
  std::chrono::milliseconds timeout = kDefaultTimeout;
};

class FullyShardedDataParallel : public nn::Module {
 public:
  // Collective: every rank constructs it in the same order over the same model, already on
  // its device (to() after wrapping would move the shards, not the units' full vectors). The
  // model's parameters become views of the units' full vectors, which hold memory only while
  // their unit is gathered (always with NO_SHARD): use the model through this wrapper, and
  // take its weights out with full_state_dict(). train() and eval() on the wrapper reach the
  // whole model, as torch's; a forward leaves every submodule's own mode as it is (a
  // BatchNorm put in eval() inside a training model stays in eval).
  FullyShardedDataParallel(std::shared_ptr<nn::Module> module, std::shared_ptr<ProcessGroup> pg,
                           FSDPOptions options = {});
  ~FullyShardedDataParallel() override;
  FullyShardedDataParallel(const FullyShardedDataParallel&) = delete;
  FullyShardedDataParallel& operator=(const FullyShardedDataParallel&) = delete;

  // The model's forward with the units gathered around their own forwards (Note [FSDP units]).
  Tensor forward(const Tensor& input) override;
  void train(bool mode = true) override;

  nn::Module& module() { return *module_; }
  const ProcessGroup& process_group() const { return *pg_; }
  ShardingStrategy sharding_strategy() const { return options_.sharding_strategy; }

  // While the guard lives, backward keeps each unit's full gradient and reduces nothing; the
  // first backward after it reduce-scatters the accumulated sum (torch's fsdp.no_sync()), for
  // every unit the guarded backwards reached, whether or not it reaches them itself. As for
  // any backward, the guarded ones must reach the same units on every rank.
  // The full gradients stay in memory meanwhile: 4 bytes per parameter, plus a shard's worth
  // (all of it under NO_SHARD). A zero_grad (the optimizer's or the wrapper's, set_to_none or
  // not) discards them, as torch's clears the flat parameters' .grad, and the next forward or
  // backward frees them: after a guarded backward each shard has a .grad (zeros if it had
  // none) that stands for its unit's sum. Nothing is reduced before the synced backward, so a
  // step() or clip_grad_norm_ before it sees those zeros (torch's FSDP asks for a synced
  // backward before the step).
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(FullyShardedDataParallel& fsdp) : fsdp_(fsdp), previous_(fsdp.sync_) { fsdp_.sync_ = false; }
    ~NoSyncGuard() { fsdp_.sync_ = previous_; }
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    FullyShardedDataParallel& fsdp_;
    bool previous_;
  };
  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(*this); }

  // Scales the shards' gradients so that the norm of the whole gradient is at most max_norm,
  // and returns that norm (torch's FullyShardedDataParallel.clip_grad_norm_): an all_reduce
  // takes the largest |g| over the ranks (the norm for norm_type infinity); for norm 2 each
  // rank then sums its shards' (|g| / largest)^2 and a second all_reduce adds them, so no sum
  // of squares on the wire overflows or underflows float32 where nn::clip_grad_norm_'s double
  // sum would not (none for NO_SHARD, where every rank holds all of it). norm_type 2 or infinity; ValueError
  // otherwise, or for max_norm < 0; and as nn::clip_grad_norm_ for a non-finite norm with
  // error_if_nonfinite. A collective.
  float clip_grad_norm_(double max_norm, double norm_type = 2.0, bool error_if_nonfinite = false);

  // The model's state_dict with its own names ("0.weight"), gathered: on rank 0 only when
  // rank0_only (torch's FULL_STATE_DICT with rank0_only=True; other ranks get {}). Loads
  // into the unwrapped model. A collective: every unit's all_gather, in unit order, in float32
  // even with MixedPrecision.param_dtype (the shards' own values, as torch's state dicts hold).
  nn::StateDict full_state_dict(bool rank0_only = true);
  // Loads a full state (the model's names and shapes; every rank passes the same) into the
  // shards, as Module::load_state_dict with strict does (same errors). Every rank checks the
  // state before any loads it: a rank that refuses it throws its own error, every other rank a
  // ValueError naming the ranks that refused, and no rank's model changes. A collective.
  void load_full_state_dict(const nn::StateDict& state);
  // state_dict() itself is this rank's shards ("0._flat_param", torch's LOCAL_STATE_DICT) and
  // the model's persistent buffers under their own names ("1.running_mean", Note [FSDP
  // buffers]): save one file per rank, load at the same world size (a shard of another size
  // is a ShapeError naming it).
  // The wrapped model's zero_if_missing buffers (a BatchNorm's num_batches_tracked): its
  // modules are not children of this one, yet their buffers are in state_dict().
  std::vector<Tensor> zero_if_missing() override;

  // The state of an optimizer built on parameters(), gathered and unflattened into the model's
  // parameters: keys "<buffer>.<i>" with i indexing module().parameters(), as a plain optimizer
  // over the unwrapped model would have it (torch's FSDP.full_optim_state_dict). A state
  // entry of a shard's size is gathered and cut per parameter; any other entry (a step count)
  // is given to each parameter of its unit. Every rank gets it. A collective. ValueError for an
  // optimizer over other parameters, a subset included (build it on all of parameters(), frozen
  // units too: an optimizer skips a parameter that gets no gradient).
  nn::StateDict full_optim_state_dict(const nn::Optimizer& optimizer);
  // The reverse, with no collective: this rank's share of such a full state, to pass to the
  // optimizer's load_state_dict (torch's FSDP.shard_full_optim_state_dict). ValueError for a
  // key of no parameter, ShapeError for an entry of the wrong shape.
  nn::StateDict shard_full_optim_state_dict(const nn::StateDict& full) const;

  // torch's SHARDED_STATE_DICT, for save_sharded_checkpoint (dist/sharded_checkpoint.h): this
  // rank's pieces of every parameter, under the model's names ("0.weight"), each piece the
  // part of the parameter that falls in this rank's shard [r S, (r + 1) S) of its unit (no
  // padding; NO_SHARD: rank 0 holds everything). No collective. ValueError for a model with
  // buffers (a sharded set holds parameters only; save those models with full_state_dict).
  ShardedStateDict sharded_model_state_dict() const;
  // The same for an optimizer built on parameters(): keys "<buffer>.<i>" as in
  // full_optim_state_dict, each float32 entry of a shard's size cut like its parameters; any
  // other entry (a step count, equal on every rank) saved whole by every rank, once per
  // parameter of its unit. No collective. ValueError for an optimizer over other parameters, as
  // full_optim_state_dict.
  ShardedStateDict sharded_optim_state_dict(const nn::Optimizer& optimizer) const;
  // Reading a set saved by either at any world size: this rank's shards as state_dict() gives
  // them ("0._flat_param": [S] float32, padding zero), to pass to load_state_dict. Reads only
  // the saved pieces inside [r S, (r + 1) S) of each unit, and so only the shard files that
  // hold them. No collective. IOError as the reader throws; ValueError naming a parameter
  // the set lacks (a set of another model) or whose shape differs.
  nn::StateDict read_local_state_dict(ShardedCheckpointReader& reader, const std::string& prefix = "") const;
  // This rank's share of the optimizer state in the set (entries "<prefix><buffer>.<i>"), as
  // the optimizer built on parameters() takes it in load_state_dict (what
  // shard_full_optim_state_dict gives from a full state). No collective; errors as above.
  nn::StateDict read_local_optim_state_dict(ShardedCheckpointReader& reader,
                                            const std::string& prefix = "") const;

  // What --explain prints: per unit its name, its parameters (elements, before padding) and
  // this rank's shard (elements).
  struct UnitInfo {
    std::string name;  // "" for the root
    std::vector<std::string> parameter_names;
    int64_t numel = 0;
    int64_t shard_numel = 0;
  };
  std::vector<UnitInfo> units() const;

 private:
  struct Unit;
  friend struct FSDPBackwardMarker;
  void build_units();
  void verify_same_units() const;
  void register_model_buffers();  // Note [FSDP buffers]
  void gather(size_t u);         // issue the all_gather unless gathered or in flight
  void wait_gathered(size_t u);  // issue if needed, then wait
  void finish_gather(Unit& unit);  // waits for unit's gather and drops its Work, also on an error
  void reshard(size_t u);
  void gather_all();
  void drop_unused_prefetches();
  // What gather() is for: a forward (FsdpUnit), a state dict (FsdpStateDict: in float32
  // whatever param_dtype) or its load. Its collectives say so (Note [Collective purpose]), so
  // that a rank saving cannot pair with one loading.
  CollectivePurpose::Kind gather_purpose_ = CollectivePurpose::Kind::FsdpUnit;
  // gather_all() for a state dict (FsdpStateDict) or its load (FsdpLoadStateDict); the purpose
  // is back to FsdpUnit when it returns or throws.
  void gather_all_for_state_dict(CollectivePurpose::Kind purpose);
  void reshard_all();
  // Each of the model's parameters (by TensorImpl) -> its index in module().parameters().
  std::unordered_map<const TensorImpl*, size_t> model_parameter_index() const;
  // For each of module().parameters(), in that order: (its unit, its place in the unit).
  std::vector<std::pair<size_t, size_t>> unit_place_of_parameters() const;
  // Elements [begin, end) of unit u's flat vector that rank holds in a sharded checkpoint.
  std::pair<int64_t, int64_t> saved_range(size_t u, int rank) const;
  void prefetch_after(const std::vector<size_t>& order, size_t u);
  void on_unit_forward_pre(size_t u);
  Tensor on_unit_forward_post(size_t u, const Tensor& output);
  void on_unit_backward_pre(size_t u);
  void on_param_ready(size_t u);
  void reduce(size_t u);
  void finish_reduction(size_t u);
  void finish_backward();
  void remember_accumulation(Unit& unit);        // Note [FSDP no_sync] in fsdp.cpp
  void drop_discarded_accumulation(Unit& unit);  // the same
  // Note [Interrupted backward] in reducer.cpp: after a backward that ended by an exception,
  // waits for the reductions it issued, drops them and every unit's full gradient, reshards.
  void abandon_interrupted_backward();
  bool frees_after_forward(size_t u) const;

  std::shared_ptr<nn::Module> module_;
  std::shared_ptr<ProcessGroup> pg_;
  FSDPOptions options_;
  std::vector<std::unique_ptr<Unit>> units_;  // the root is units_[0] when it holds parameters
  std::vector<std::pair<nn::Module*, std::vector<int>>> hooks_;  // to remove at destruction
  std::vector<size_t> forward_order_, backward_order_;
  bool forward_order_known_ = false, backward_order_known_ = false;
  bool in_backward_ = false;
  bool sync_ = true;
  std::vector<size_t> reduce_order_;  // units whose reduction was issued this backward
  size_t reductions_finished_ = 0;    // how many of them are finished
};

}  // namespace nanoddp::dist
