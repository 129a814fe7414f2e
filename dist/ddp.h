// DistributedDataParallel: wraps a model so that backward averages gradients across ranks
// (torch.nn.parallel.DistributedDataParallel).
//
//   auto pg = dist::init_process_group();
//   dist::DistributedDataParallel ddp(model, pg);          // model: shared_ptr<nn::Module>
//   loss_fn(ddp(x), y).backward();  opt.step();            // .grad = mean over ranks
//
// Note [DDP construction]
// Construction (collective: every rank must construct it, in the same order):
//   1. checks that every rank has the same parameters and buffers: count, names and shapes
//      (and each parameter's requires_grad, each buffer's dtype). The error names the first
//      mismatching parameter or buffer, this rank and the other rank;
//   2. broadcasts rank 0's parameter and buffer values to every rank, so all start equal
//      (buffers always, as PyTorch's _sync_module_states, whatever broadcast_buffers says);
//   3. plans the gradient buckets and registers one hook per parameter (dist/reducer.h; the
//      plan is redone once, from the order gradients became ready, after the first synced
//      backward).
// Parameters with requires_grad false (frozen) are checked and broadcast but get no bucket and
// no hook (Note [Frozen parameters] in ddp.cpp); freeze them before constructing DDP, the same
// on every rank (a difference is a DistError naming the parameter and both ranks). Freezing or
// unfreezing a parameter after construction is a ValueError at the next forward with grad
// enabled, naming it: PyTorch's DDP silently leaves an unfrozen parameter's gradient
// un-averaged (each rank steps its own), and reports a frozen one as unused. To change what
// trains (fine-tuning schedules), construct a new DistributedDataParallel over the model.
// Then every backward through the model all-reduces the gradients (mean over ranks) before
// backward() returns, with buckets overlapping the rest of backward.
//
// Note [Buffer broadcast]
// Buffers (BatchNorm's running statistics) are not gradients: each rank updates its own from
// its own batch, so they drift apart. With broadcast_buffers (PyTorch's default) a forward
// first overwrites every rank's buffers with rank 0's when the forward before it synced
// gradients (grad enabled, not under no_sync) or it is the first, as PyTorch 1.13's forward
// decides from require_forward_param_sync before its _sync_buffers. So the buffers a synced
// step updated are made equal once, before whatever forward comes next: an evaluation
// forward under no_grad after a training step sees rank 0's running stats on every rank, and
// the first synced forward after no_sync micro-steps does not broadcast (the micro-steps'
// forwards did not sync): a window of micro-steps starts from rank 0's running stats, and
// after training the ranks' buffers differ only by the last window's own updates. Since the
// broadcast is a collective, every rank must run the same forwards through DDP, evaluation
// included (evaluating through DDP on rank 0 alone waits for the others, as in PyTorch).
// Inside a Join the source is the highest rank still training
// (one more 8-byte all-reduce(max) finds it, and a joined rank shadows both), and the final
// model sync sends the buffers with the parameters (PyTorch's _sync_final_model). Cost: one
// broadcast per dtype among the buffers (any dtype, as torch's; BatchNorm's are float32 and
// int64), of all buffers of that dtype packed into one flat tensor, so a model with 50
// BatchNorm layers pays 2 collectives per step, not 150.
// Packing copies the buffers (2 C floats + 1 int64 per BatchNorm, kilobytes) and a broadcast
// costs a collective's latency (Gloo: ~ms on one machine), so the flat packing is what keeps
// it small. Turn it off when buffers need no agreement: SyncBatchNorm (its statistics are
// already global, and the running stats it computes are equal on every rank). A model
// without buffers sends nothing.
//
// Uneven inputs: DDP is a Joinable (dist/join.h), as in PyTorch. Inside a dist::Join every
// forward first tells the Join this rank has not joined, and then whether its backward will
// sync; a rank that has joined shadows the bucket all-reduces and, at the end, the
// parameters of a rank that joined last are broadcast to all (Note [Join] in join.cpp):
//   dist::Join join({ddp}, join_options);   // dist::JoinOptions: divide_by_initial_world_size, ...
//   for (auto& [x, y] : my_batches) { opt.zero_grad(); loss_fn(ddp(x), y).backward(); opt.step(); }
//   join.finish();
//
// Only a backward through DDP's forward reduces: the output passes through an identity node
// (DDPSinkBackward, after torch's _DDPSink) that tells the Reducer so, and every parameter
// that gets a gradient in that backward is reduced, a regulariser's too. A backward through
// the model itself, ddp.module(), keeps each rank's gradients and issues no collective, on
// every rank or on one (Reducer::begin_ddp_backward). torch's DDP arms its hooks at the forward
// instead, so there a bare backward after a DDP forward is reduced.
//
// state_dict: DDP is itself a Module whose only child is the model, registered as "module",
// so ddp.state_dict() names parameters "module.0.weight" exactly as PyTorch does. Save
// ddp.module().state_dict() (no prefix) to load the weights into an unwrapped model, and load
// into ddp.module() likewise.
//
// Where PyTorch 1.13's DDP lets the ranks drift apart, this one keeps them equal (each case
// checked against torch's DDP on Gloo):
//  - a parameter whose gradient was accumulated only under no_sync gets the mean at the next
//    synced backward (Note [Unused parameters] in reducer.cpp); torch's leaves each rank its
//    own sum without find_unused_parameters, and with it (but no gradient_as_bucket_view);
//  - a second backward through one forward (retain_graph) is reduced like the first, so .grad
//    holds the sum of two means; torch reduces the first only and adds each rank's own second;
//  - static_graph with two forwards before one backward runs as without static_graph, where
//    torch raises "Your training graph has changed";
//  - a parameter that got no gradient (without find_unused_parameters) is a DistError at the
//    end of that backward, naming it, where torch raises "Expected to have finished
//    reduction in the prior iteration" at the next forward.
//
// Errors: ValueError at construction when no parameter requires grad (all frozen, or none),
// as torch's "DistributedDataParallel is not needed when a module doesn't have any parameter
// that requires a gradient"; DistError for parameter or buffer mismatches across ranks, for a parameter that
// got no gradient in an iteration (unless find_unused_parameters), for collective failures, and (Join with
// throw_on_early_termination) from forward when a rank ran out of inputs; TimeoutError when a peer does not
// answer within options.timeout.
#pragma once

#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "dist/comm_hooks.h"
#include "dist/join.h"
#include "dist/process_group.h"
#include "dist/reducer.h"
#include "nn/module.h"

namespace nanoddp::dist {

// The reducer's options (bucket_cap_bytes, first_bucket_cap_bytes, find_unused_parameters,
// overlap, static_graph, gradient_as_bucket_view, timeout) and DDP's own.
struct DDPOptions : ReducerOptions {
  // Broadcast rank 0's buffers before each forward that syncs (Note [Buffer broadcast]),
  // as torch's DistributedDataParallel(broadcast_buffers=True).
  bool broadcast_buffers = true;
  // The dtype gradients are all-reduced in (torch FSDP's MixedPrecision.reduce_dtype; torch's
  // DDP gets the same from bf16_compress_hook). Float16 or BFloat16 send half the bytes: each
  // bucket is rounded to 16 bits, divided by world_size (rounded again), summed in 16 bits and
  // widened back into the float32 .grad, as torch's hooks (buffer.to(float16).div_(world_size)):
  // a gradient above float16's 65504 is inf even when the mean would fit. It is the built-in
  // fp16_compress_hook / bf16_compress_hook that does it, which
  // this option registers (one piece of code for both). Float32, the default, all-reduces
  // float32. ValueError for another dtype; register_comm_hook then throws ValueError too.
  DType reduce_dtype = DType::Float32;
};

class DistributedDataParallel : public nn::Module, public Joinable {
 public:
  DistributedDataParallel(std::shared_ptr<nn::Module> module, std::shared_ptr<ProcessGroup> pg,
                          DDPOptions options = {});
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  // The wrapped model's forward. With grad enabled, first checks that no parameter's
  // requires_grad changed since construction (ValueError naming them, see above; one bool
  // per parameter, no collective). Inside a Join, first the join protocol's two 8-byte
  // all-reduces (Note [Join]), so every forward is an iteration there; then the buffer
  // broadcast (Note [Buffer broadcast]); then, once, before the second synced backward, the
  // bucket re-plan (Reducer::rebuild_buckets, one broadcast of an int64 per parameter).
  Tensor forward(const Tensor& input) override;

  nn::Module& module() { return *module_; }
  const ProcessGroup& process_group() const { return *pg_; }
  const Reducer& reducer() const { return *reducer_; }
  // Reducer::load_bucket_order: a resumed run takes the bucket plan of the run it resumes.
  void load_bucket_order(const std::vector<int64_t>& order) { reducer_->load_bucket_order(order); }

  // A forward run while the guard lives prepares a backward that does not all-reduce:
  // gradients accumulate locally, and the backward of the first forward after it reduces the
  // accumulated sum (torch's ddp.no_sync(), decided by the forward as torch's is).
  //   { auto guard = ddp.no_sync(); loss(ddp(x1)).backward(); }   loss(ddp(x2)).backward();
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(Reducer& reducer) : reducer_(reducer), previous_(reducer.sync()) { reducer_.set_sync(false); }
    ~NoSyncGuard() { reducer_.set_sync(previous_); }
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    Reducer& reducer_;
    bool previous_;
  };
  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(*reducer_); }

  // Joinable (PyTorch's DDP join_hook): the hook reads options.divide_by_initial_world_size
  // and applies it while the Join lasts. join_device is the group's device.
  std::unique_ptr<JoinHook> join_hook(const JoinOptions& options) override;
  Device join_device() const override { return pg_->device(); }
  std::shared_ptr<ProcessGroup> join_process_group() const override { return pg_; }

  // Every gradient bucket is reduced by hook(state, bucket) instead of the built-in
  // all-reduce (DistributedDataParallel.register_comm_hook; dist/comm_hooks.h has the
  // contract and the built-ins allreduce_hook, fp16_compress_hook, bf16_compress_hook).
  // hook: callable as std::shared_ptr<Future>(State&, GradBucket&); state is kept with it.
  // A null std::shared_ptr<ProcessGroup> state stands for this DDP's group (PyTorch's None).
  // Call it once, on every rank, before the first backward; ValueError otherwise.
  //   ddp.register_comm_hook(pg, dist::fp16_compress_hook);
  template <typename State, typename Hook>
  void register_comm_hook(State state, Hook hook) {
    NANODDP_CHECK(reduce_dtype_ == DType::Float32, ValueError, "register_comm_hook: this DDP reduces in ",
                  reduce_dtype_, " (DDPOptions::reduce_dtype), which is itself a comm hook; use one or the other");
    if constexpr (std::is_same_v<State, std::shared_ptr<ProcessGroup>>) {
      if (state == nullptr) state = pg_;
    }
    reducer_->register_comm_hook(
        [state = std::move(state), hook = std::move(hook)](GradBucket& bucket) mutable { return hook(state, bucket); });
  }

 private:
  friend class DDPJoinHook;
  void verify_model_matches();
  // ValueError naming every parameter whose requires_grad differs from construction.
  void check_requires_grad_unchanged() const;
  void broadcast_parameters(int root);
  void sync_final_model(bool is_last_joiner);
  // root's buffers to every rank, one flat broadcast per dtype.
  void broadcast_buffers(int root);
  // Whether buffers are broadcast at all (the same on every rank).
  bool syncs_buffers() const { return broadcast_buffers_ && pg_->size() > 1 && !module_->buffers().empty(); }
  // Whether the next forward broadcasts buffers first (Note [Buffer broadcast]): the previous
  // forward ran with grad enabled outside no_sync, or none ran yet (torch's
  // require_forward_param_sync).
  bool require_forward_param_sync_ = true;

  std::shared_ptr<nn::Module> module_;
  std::shared_ptr<ProcessGroup> pg_;
  std::chrono::milliseconds timeout_;
  bool broadcast_buffers_;
  DType reduce_dtype_ = DType::Float32;
  std::shared_ptr<Reducer> reducer_;
  // Every parameter and whether it required grad at construction (Note [Frozen parameters]).
  std::vector<std::pair<Tensor, bool>> requires_grad_at_construction_;
  bool divide_by_initial_world_size_ = true;  // set by the join hook while a Join lasts
};

}  // namespace nanoddp::dist
