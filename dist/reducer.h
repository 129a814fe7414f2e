// Reducer: the gradient all-reduce inside DistributedDataParallel (c10d's Reducer).
//
//   Reducer reducer(params, pg, options);   // plans buckets, registers one hook per parameter
//   loss.backward();                         // hooks call mark_ready; buckets reduce; at the
//                                            // end of backward, finalize() writes .grad back
//
// The algorithm, as the rest of dist/ refers to it:
//   1. Plan (Note [Bucket order]): parameters in reverse registration order are packed into
//      buckets; the first holds up to first_bucket_cap_bytes, the others bucket_cap_bytes.
//      The plan depends only on the parameters' order and sizes, so it is the same on every
//      rank, and so is the order of the all-reduces. Once, after the first synced backward,
//      rebuild_buckets() re-plans under the same caps from the order in which gradients
//      became ready on rank 0 (Note [Bucket rebuild] in reducer.cpp).
//   2. mark_ready(i), called when parameter i's gradient is final for this backward: copy it
//      into its bucket's flat buffer, divided by world_size (the averaging folded into the
//      copy; under dist::Join, possibly by the ranks still training: set_divide_factor); with
//      gradient_as_bucket_view the .grad already is its slot of the buffer, divided there in
//      place (Note [Gradient as bucket view] in reducer.cpp). When a bucket's last parameter is in, and
//      overlap is on, launch the all-reduces of every complete bucket in plan order (never out of order:
//      ranks must agree). With one rank the mean is the gradient itself: nothing is copied or reduced. With a
//      comm hook (dist/comm_hooks.h) the copy does not divide, and launching a bucket calls the hook, which
//      reduces and averages (set_divide_factor does not apply); this holds at one rank too.
//   3. finalize(), queued to run when backward ends: a parameter not ready in this backward
//      but used in an earlier no_sync backward contributes its accumulated .grad; any other
//      is an error naming it, or (find_unused_parameters) contributes its .grad as it stands,
//      zeros without one (as torch's reducer); launch what is
//      left in order; with find_unused_parameters, all-reduce which parameters each rank
//      used (Note [Unused parameters] in reducer.cpp; with static_graph only in the first
//      synced backward, Note [Static graph]); wait for every bucket (its all-reduce,
//      or its hook's future) with the timeout, in plan order; copy each bucket's means into .grad of every
//      parameter some rank used (a .grad is created where this rank had none; with gradient_as_bucket_view
//      nothing is copied: each such .grad is its slot of the bucket, which holds the means). A parameter no
//      rank used keeps its .grad, so the optimizer skips it on every rank, as in PyTorch.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "dist/comm_hooks.h"
#include "dist/process_group.h"

namespace nanoddp::dist {

// PyTorch's defaults: bucket_cap_mb = 25 and dist._DEFAULT_FIRST_BUCKET_BYTES = 1 MiB.
constexpr size_t kDefaultBucketCapBytes = 25u << 20;
constexpr size_t kDefaultFirstBucketCapBytes = 1u << 20;

struct ReducerOptions {
  size_t bucket_cap_bytes = kDefaultBucketCapBytes;
  size_t first_bucket_cap_bytes = kDefaultFirstBucketCapBytes;
  // Parameters may go unused in a backward, and differently on each rank (PyTorch's flag):
  // costs one extra all-reduce of one int64 per parameter per synced backward.
  bool find_unused_parameters = false;
  // Launch a bucket's all-reduce as soon as it is full, while backward goes on (PyTorch's
  // behaviour, and what pays on GPUs). false: launch all buckets when backward ends, which
  // costs less CPU time on machines with few cores (see benchmarks/).
  bool overlap = true;
  // Every iteration uses the same parameters (PyTorch's static_graph): parameters may go
  // unused, as with find_unused_parameters, but which ones some rank used is all-reduced in
  // the first synced backward only and kept; and the buckets are rebuilt even when parameters
  // go unused. Takes precedence over find_unused_parameters, as in PyTorch. A later backward
  // in which a parameter gets a gradient that no rank's gradient reached in the first, or in
  // which a parameter this rank used in the first gets none, is a DistError (the graph was not
  // static), also at one rank. Note [Static graph] in reducer.cpp.
  bool static_graph = false;
  // Each parameter's .grad becomes a view of its slot in its bucket (PyTorch's flag, default
  // false there too): no copy into the bucket before the all-reduce, none out after, and one
  // copy of the gradients in memory instead of two. Keep the views with
  // zero_grad(/*set_to_none=*/false); Note [Gradient as bucket view] in reducer.cpp.
  bool gradient_as_bucket_view = false;
  std::chrono::milliseconds timeout = kDefaultTimeout;
};

class Reducer {
 public:
  // params: (name, parameter) pairs, in registration order; names are used in messages.
  Reducer(std::vector<std::pair<std::string, Tensor>> params, std::shared_ptr<ProcessGroup> pg,
          ReducerOptions options);
  ~Reducer();  // removes the hooks
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // While false (no_sync), a forward prepares a backward that does not reduce: gradients
  // accumulate locally (torch's require_backward_grad_sync).
  void set_sync(bool sync) { sync_ = sync; }
  bool sync() const { return sync_; }
  // Called by each forward with grad enabled: whether the backward of its graph reduces, as
  // torch's forward decides when it calls prepare_for_backward. So a forward under no_sync
  // whose backward runs outside it keeps local gradients, and the reverse reduces, as in
  // torch.
  void set_backward_syncs(bool syncs) { backward_syncs_ = syncs; }
  // Called when a backward passes through the output of a DDP forward (DistributedDataParallel's
  // sink node, after torch's _DDPSink), before any of that forward's parameters gets its
  // gradient: the gradient hooks act only in such a backward, until it ends. A parameter the
  // forward did not use but the loss did (a regulariser on it) may get its gradient earlier in
  // the pass: its hook is held and acts when the sink runs, reading .grad then (after any
  // later post-accumulate-grad hook of that parameter has run). A backward that does not pass
  // through one (the bare model, ddp.module(), on one rank or all) keeps its gradients local and
  // issues no collective. This is nanoddp's own rule: torch's Reducer arms its hooks at the
  // forward until the next reduction ends, so there a bare backward after a DDP forward is
  // reduced, and one after a DDP backward that threw too. The mark is keyed to the pass
  // (core/autograd.h's backward_pass_id), so it ends with the pass however the pass ends.
  void begin_ddp_backward();

  // Every bucket goes through hook instead of the built-in divide-and-all-reduce
  // (DistributedDataParallel::register_comm_hook). Throws ValueError when a hook is already
  // registered or a backward has already run: every rank must reduce every iteration the
  // same way, and PyTorch allows one hook, registered once.
  void register_comm_hook(CommHook hook);
  bool has_comm_hook() const { return comm_hook_ != nullptr; }

  // Note [Bucket rebuild] in reducer.cpp (PyTorch's Reducer::rebuild_buckets): once, after
  // the first synced backward, re-plans the buckets under the same caps from the order in
  // which gradients became ready on rank 0 (broadcast: one int64 per parameter), so every
  // rank gets the same plan. Not with find_unused_parameters unless static_graph. Collective
  // when it re-plans: every rank calls it at the same point between two backwards (DDP's
  // forward does, when that forward's backward will sync; a joined rank's DDP join hook at
  // the same step). Returns true when it re-planned; false, issuing nothing, when no
  // re-plan is due. Throws what the broadcast throws (DistError, TimeoutError).
  bool rebuild_buckets();
  // Note [Interrupted backward] in reducer.cpp: when the last synced backward ended by an
  // exception (its end-of-backward callback never ran), waits for the buckets it launched,
  // drops their results, starts a fresh iteration and agrees with the other ranks (one
  // all_reduce) that theirs ended the same way; does nothing otherwise. DDP's forward calls it
  // first. Throws what the waits throw (DistError, TimeoutError), and DistError when another
  // rank launched other buckets or finished its backward: the ranks are out of step.
  void abandon_interrupted_backward();
  // Whether rebuild_buckets has re-planned: bucket_plan() is then the rebuilt plan, final.
  bool buckets_rebuilt() const { return rebuilt_; }
  // The order the current plan packs the parameters in (indices into the constructor's list).
  // A checkpoint keeps it so that a resumed run reduces in the buckets of the run it resumes.
  const std::vector<int64_t>& bucket_order() const { return plan_order_; }
  // Re-plans the buckets from `order` (what bucket_order() gave, on the same model) and counts
  // as the re-plan: rebuild_buckets will not re-plan again. Collective like rebuild_buckets
  // (every rank, the same order, between two backwards), but issues no collective itself on
  // CPU backends other than shm (which maps the new buckets). Throws ValueError when order is
  // not a permutation of the parameter indices.
  void load_bucket_order(const std::vector<int64_t>& order);

  // The plan: bucket b holds these parameter indices (into the constructor's list).
  std::vector<std::vector<size_t>> bucket_plan() const;
  const ReducerOptions& options() const { return options_; }

  // ---- For dist::Join (Note [Join] in dist/join.cpp); nothing else here depends on them ----
  // The divisor of the gradients in the coming synced backward(s): world_size (the default)
  // or, under Join with divide_by_initial_world_size = false, the number of ranks still
  // training. Throws ValueError outside [1, world_size].
  void set_divide_factor(int64_t ranks);
  int64_t divide_factor() const { return divide_factor_; }
  // On a rank that has joined: issues exactly the collectives of one synced backward (an
  // all-reduce of zeros per bucket, in plan order, or the comm hook called on a bucket of
  // zeros; with find_unused_parameters the used map, all zeros, with static_graph only the
  // first time, as the others) and waits for them (options.timeout). What they return goes
  // into .grad as on the others, so this rank holds the gradients they step with (a
  // ZeroRedundancyOptimizer in the Join steps its shard with them); a parameter no rank used
  // has no .grad, as after their zero_grad(). It counts as a synced backward for
  // rebuild_buckets, as it does on the others.
  void shadow_synced_backward();

 private:
  struct Bucket {
    std::vector<size_t> params;    // indices into params_, in plan order
    std::vector<int64_t> offsets;  // element offset of each parameter in flat
    Tensor flat;                   // [sum of numel] float32 on the parameters' device
    std::vector<Tensor> views;     // gradient_as_bucket_view: each parameter's slot of flat
    size_t pending = 0;            // parameters not yet ready in this iteration
    std::shared_ptr<Future> reduced;  // the in-flight all-reduce (or hook), if launched
    double launched_us = -1;       // when tracing: launch time until its completion is recorded
  };

  // Step 1: packs the parameters, in this order, into buckets under the caps.
  void plan_buckets(const std::vector<size_t>& order);
  bool should_rebuild() const;
  // gradient_as_bucket_view: makes each bucket's views of the current plan and points every
  // parameter's defined .grad at its view, copying its values there (PyTorch's
  // initialize_bucket_views). Run after planning; a new plan runs it again, and .grad follows.
  void bind_grads_to_buckets();
  void mark_ready(size_t param_index);
  // Marks the parameter ready (used in this backward) and contributes its .grad.
  void copy_into_bucket(size_t param_index);
  // Puts .grad into the parameter's bucket slot, divided as the bucket's collective needs.
  void contribute(size_t param_index);
  void launch_ready_buckets();
  void launch(Bucket& bucket);
  void finalize();
  std::vector<int64_t> agree_on_used(const std::vector<bool>& used_here);
  void write_gradients(Bucket& bucket, const Tensor& mean, const std::vector<int64_t>& used_anywhere,
                       const std::vector<bool>& dropped);
  void check_static_graph(const std::vector<bool>& dropped) const;
  void reset_iteration();
  void trace_completions();
  // Whether buckets are used at all: not at one rank without a hook (the mean is the gradient).
  bool reduces() const { return pg_->size() > 1 || comm_hook_ != nullptr; }

  std::vector<std::pair<std::string, Tensor>> params_;
  std::shared_ptr<ProcessGroup> pg_;
  ReducerOptions options_;
  std::vector<Bucket> buckets_;
  std::vector<std::pair<size_t, size_t>> location_;  // param index -> (bucket, slot)
  std::vector<bool> ready_;           // gradient final in this (synced) backward
  std::vector<bool> used_in_window_;  // gradient accumulated since the last reduction
  std::vector<int> hook_ids_;
  size_t next_bucket_to_launch_ = 0;
  bool finalize_queued_ = false;
  bool sync_ = true;
  bool backward_syncs_ = true;  // set_backward_syncs
  uint64_t ddp_backward_pass_ = 0;  // begin_ddp_backward's backward_pass_id(): the hooks act in it
  uint64_t early_pass_ = 0;         // the pass whose hooks fired before its sink ran
  std::vector<size_t> early_ready_;  // their parameters, acted on if the sink runs in that pass
  int64_t divide_factor_;  // Join: see set_divide_factor
  CommHook comm_hook_;
  bool backward_seen_ = false;  // a synced backward has run (hooks must come before)
  int64_t synced_backwards_ = 0;     // finalized (or shadowed under Join) so far
  std::vector<size_t> ready_order_;  // Note [Bucket rebuild]: recorded in the first synced backward
  std::vector<int64_t> plan_order_;  // what plan_buckets packed, in order
  bool rebuilt_ = false;
  std::vector<int64_t> static_used_anywhere_;  // Note [Static graph]: learnt in the first synced backward
  std::vector<bool> static_used_here_;         // Note [Static graph]: this rank's, from the same backward
};

}  // namespace nanoddp::dist
