// ZeroRedundancyOptimizer: ZeRO stage 1, as torch.distributed.optim.ZeroRedundancyOptimizer.
// Each rank keeps the optimizer state (momentum buffers, Adam's moments) of a share of the
// parameters only, steps that share, then every parameter is broadcast from its owner.
//
//   dist::DistributedDataParallel ddp(model, pg);
//   dist::ZeroRedundancyOptimizer opt(ddp.parameters(), pg, [](std::vector<Tensor> p) {
//     return std::make_unique<nn::Adam>(std::move(p), nn::AdamOptions{1e-3}); });
//   opt.zero_grad();  loss.backward();  opt.step();      // gradients averaged by DDP first
//
// Contract (every rank): the same parameters in the same order, the same local optimizer;
// step() is a collective (one broadcast per parameter, issued in parameter order, then
// waited), so every rank calls it at the same point. After step() every rank holds the same
// parameters as an unsharded optimizer would give, and 1/W of its state (for parameters
// of similar size).
//
// Uneven inputs (torch's Join([model, optimizer])): pass it to dist::Join after the DDP,
//   dist::Join join({ddp, opt});  for (...) { ...backward(); opt.step(); }  join.finish();
// with one step() per iteration. A rank that has run out of batches goes on stepping its
// shard, in each iteration the others still run, with the gradients DDP's join hook left in
// .grad (the others' average), and broadcasts it: every rank ends with the parameters and
// state of an unsharded optimizer in the same Join (Note [Join] in dist/join.cpp, step 5).
//
// Partition (PyTorch 1.13's _partition_parameters): parameters sorted by numel, largest
// first (a stable sort: ties keep their order), each to the rank whose assigned numel is
// smallest so far (the lowest rank on ties). Frozen parameters given to it count too, as in
// torch: a rank that owns only frozen ones holds no optimizer state (no gradient, no state),
// so pass only the parameters that train for an even split of the state.
//
// Why one broadcast per parameter, not per owner's flat buffer: our parameters each own
// their storage, so a flat buffer would add a copy in and a copy out of every parameter on
// every rank per step; per-parameter broadcasts are what PyTorch does by default
// (parameters_as_bucket_view=False) and send the same bytes. A model of many tiny
// parameters would pay per-call latency instead (docs/zero.md).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "dist/join.h"
#include "dist/process_group.h"
#include "dist/sharded_checkpoint.h"
#include "nn/optimizer.h"

namespace nanoddp::dist {

// The partition above: the rank that owns each parameter, given their element counts in
// parameter order. --explain predicts ZeRO-1's optimizer state from it (dist/explain.h).
std::vector<int> partition_parameters(const std::vector<int64_t>& numels, int world_size);

class ZeroRedundancyOptimizer : public nn::Optimizer, public Joinable {
 public:
  // Builds the local optimizer over this rank's share (torch's optimizer_class + defaults).
  using LocalOptimizerFactory = std::function<std::unique_ptr<nn::Optimizer>(std::vector<Tensor> params)>;

  // Throws ValueError for an empty factory or one that returns no optimizer, and as
  // nn::Optimizer does for bad parameters. Parameters must be on the group's device (or on
  // the CPU for groups that stage CUDA tensors).
  ZeroRedundancyOptimizer(std::vector<Tensor> params, std::shared_ptr<ProcessGroup> pg,
                          const LocalOptimizerFactory& make_local_optimizer);

  // The local optimizer steps this rank's share; then each parameter is broadcast from its
  // owner. Throws what the local step or the broadcasts throw (DistError, TimeoutError).
  // Inside a Join where it is the first joinable, first Join::notify_join_context.
  void step() override;

  // Joinable (torch's ZeroRedundancyOptimizer.join_hook): once this rank has joined, the hook
  // does one step() per iteration the others still run. join_device is the group's device.
  std::unique_ptr<JoinHook> join_hook(const JoinOptions& options) override;
  Device join_device() const override { return pg_->device(); }
  std::shared_ptr<ProcessGroup> join_process_group() const override { return pg_; }
  double lr() const override { return local_->lr(); }
  void set_lr(double lr) override { local_->set_lr(lr); }

  // The rank that owns parameter i (index into params()).
  int owner(size_t index) const { return owner_[index]; }
  // This rank's share, in params() order.
  const std::vector<size_t>& local_indices() const { return local_indices_; }
  const nn::Optimizer& local_optimizer() const { return *local_; }

  // Gathers every rank's shard of the state onto rank `to`
  // (torch.distributed.optim.ZeroRedundancyOptimizer.consolidate_state_dict): a collective,
  // every rank calls it. Each shard crosses as checkpoint bytes through all_gather (as torch
  // broadcasts each rank's shard to every rank in turn). Until the next step() or
  // load_state_dict(), state_dict() on rank `to` is then the whole state, the unsharded
  // optimizer's. Throws ValueError for `to` outside the group, DistError/TimeoutError from
  // the collectives.
  void consolidate_state_dict(int to = 0);
  // The whole state, the unsharded optimizer's, on the rank a consolidate_state_dict gathered
  // to, until the next step() or load_state_dict(). Throws ValueError anywhere else, as torch
  // raises "Optimizer state has not been consolidated on this rank": a shard saved as if it
  // were the whole state would resume every other rank without its state.
  nn::StateDict state_dict() const override;
  // This rank's shard of the state, keyed by index into params() ("exp_avg.5"), and the
  // indices of the parameters this rank owns (int64 [k]) under kOwnedParametersKey. Every
  // rank's entries but that one together are the unsharded optimizer's state. No collective.
  // Each rank may save its own shard; load_state_dict takes it back at the same world size.
  nn::StateDict local_state_dict() const;
  static constexpr const char* kOwnedParametersKey = "zero_owned_parameters";
  // Takes the entries of parameters this rank owns and ignores the others, so a full or a
  // per-rank state loads alike: the whole state saved at another world size loads too. A
  // local_state_dict must list every parameter this rank owns (ValueError otherwise: another
  // rank's shard, or one from another world size, would leave parameters without their
  // state, which torch's ZeroRedundancyOptimizer, loading only a consolidated state, cannot). A
  // collective (one all_gather of a flag): every rank calls it, and either every rank loads
  // or every rank throws and keeps its state (Note [ZeRO load agreement] in the .cpp).
  // Throws ValueError for a malformed key or an index past params(), ShapeError for a float32
  // entry whose shape differs from its parameter's (any rank's parameter), or as the local
  // optimizer's load_state_dict does, its message saying how its parameter numbers map to
  // params(); on the other ranks ValueError naming the ranks that failed. DistError or
  // TimeoutError from the collective.
  void load_state_dict(const nn::StateDict& state) override;

  // For save_sharded_checkpoint (dist/sharded_checkpoint.h), torch.distributed.checkpoint's
  // view of a ZeRO state: each entry of this rank's share whole, under its global key
  // ("exp_avg.5"), so the set holds every parameter's state once, in its owner's file. No
  // collective.
  ShardedStateDict sharded_state_dict() const;
  // The model's state_dict for such a set: each parameter whole on its owner, whatever else
  // (buffers) whole on rank 0. model.parameters() must be params(), in order (DDP's are);
  // ValueError otherwise. No collective.
  ShardedStateDict sharded_model_state_dict(const nn::Module& model) const;
  // The entries "<prefix><buffer>.<i>" of a set (saved at any world size, by this class or by
  // FSDP) for the parameters this rank owns now, without the prefix: what load_state_dict
  // takes. Opens only the files that hold them. No collective. IOError as the reader throws.
  nn::StateDict read_local_state_dict(ShardedCheckpointReader& reader, const std::string& prefix = "") const;

  // Bytes of float32 state this rank holds (momentum buffers, moments; not step counts).
  int64_t state_nbytes() const;

 private:
  friend class ZeroJoinHook;
  // step() without the Join notification: the local step, then the broadcasts.
  void step_and_broadcast();
  // local_state_dict without kOwnedParametersKey: what consolidate_state_dict gathers and a
  // sharded set holds.
  nn::StateDict shard_state() const;
  // ValueError when state is a local_state_dict that misses a parameter this rank owns.
  void check_covers_this_rank(const nn::StateDict& state) const;
  std::shared_ptr<ProcessGroup> pg_;
  std::vector<int> owner_;
  std::vector<size_t> local_indices_;
  std::unique_ptr<nn::Optimizer> local_;
  std::optional<nn::StateDict> consolidated_;  // on the rank consolidate_state_dict gathered to
};

}  // namespace nanoddp::dist
