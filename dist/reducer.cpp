#include "dist/reducer.h"

#include <sstream>

#include "core/autograd.h"
#include "core/memory.h"
#include "dist/detail.h"
#include "dist/host_collectives.h"
#include "core/trace.h"
#include "kernels/kernels.h"

namespace nanoddp::dist {

// Note [Bucket order]
// Backward produces gradients roughly in reverse registration order: the autograd engine runs
// the most recently created node first (core/autograd.h), so the last layer's parameters are
// ready first. Buckets are therefore filled from the last parameter backwards, and bucket 0
// (the first to fill) is kept small (1 MiB) so the first all-reduce starts early. Every rank
// computes the same plan from the same parameter list and launches buckets strictly in plan
// order, so the collectives match across ranks even if one rank's hooks fire in a different
// order. Reverse registration order is only a guess at the ready order: Note [Bucket rebuild].

// Note [Bucket rebuild]
// A model may register its layers in another order than it uses them (a head defined before
// its trunk, a shared embedding); then the first plan's bucket 0 fills late, and since
// buckets launch strictly in order, little overlaps. So, as PyTorch's reducer does, the first
// synced backward records the order in which gradients became ready, and the forward before
// the next synced backward re-plans once from it, under the same caps (first bucket
// first_bucket_cap_bytes, then bucket_cap_bytes). Ranks may observe different orders, and the
// plan must be the same everywhere: rank 0's order is broadcast (one int64 per parameter) and
// every rank plans from it. Parameters that were not ready there (unused) go last, in reverse
// registration order. The same caps over another order can cut other buckets: our
// LinearBackward gives a layer's weight before its bias (the reverse of registration order),
// so with caps of 100 and 150 bytes make_mlp's {2.bias, 2.weight}, {0.bias, 0.weight} become
// {2.weight, 2.bias}, {0.weight}, {0.bias}: 0.weight alone reaches the cap
// (tests/test_ddp.cpp counts it). With the default caps a small model stays one bucket.
// Skipped with find_unused_parameters (the used set may change from one iteration to the
// next, so the first order says little), unless static_graph, as in PyTorch. Nothing else
// changes: the hooks are per parameter, and a parameter's gradient is the same mean whichever
// bucket carries it, equal to float rounding (at 3 ranks or more the ring's pieces fall
// elsewhere in another bucket, so its sums may run in another order: a resumed run loads the
// order, load_bucket_order, to reduce bit for bit as the run it resumes). The new buckets come from the group (new_collective_buffer, itself a
// collective on shm), in plan order, which is the same on every rank; the old ones are
// released first, so the peak stays one set of buckets. Called between backwards only, so no
// bucket is in flight, and what a no_sync backward noted (used_in_window_) is kept.

// Note [Static graph]
// static_graph promises that every iteration uses the same parameters (PyTorch's flag). The
// first synced backward runs as with find_unused_parameters: unused parameters contribute
// their .grad or zeros (Note [Unused parameters]), and one all-reduce (max) of a flag per parameter finds
// which ones some rank used. That answer is kept, and later backwards skip the all-reduce: a parameter unused
// here contributes as with find_unused_parameters, a parameter no rank used keeps its .grad. The promise can
// break two ways, and each is a DistError naming the parameters, raised after the step's collectives so that
// the ranks stay in step:
//   - a parameter gets a gradient although no rank used it in the first iteration (its mean
//     would be dropped);
//   - a parameter this rank used in the first iteration gets none (a mean of zeros, which
//     momentum and weight decay would move it by). Its .grad is left untouched.
// The second is checked per rank, against what this rank used first, as PyTorch's reducer
// counts each rank's own hooks (it reports "Your training graph has changed in this
// iteration"). Both hold at one rank too, where nothing is all-reduced. PyTorch's
// static_graph also lets a parameter's hook fire several times in one backward (reentrant
// activation checkpointing); our engine has no reentrant backward, so a second gradient in
// one backward stays an error.

// Note [Unused parameters]
// With find_unused_parameters, a parameter may be used on one rank and not on another (a
// branch taken by the data). Every rank must still apply the same update, so, as PyTorch's
// reducer does with its "locally used" map: a rank that did not use a parameter puts its .grad
// as it stands in its bucket slot (what earlier steps accumulated when nothing zeroed it), or
// zeros when it has none (torch's mark_variable_ready_dense); after the buckets, one all-reduce (max) of a
// 0/1 flag per parameter tells every rank which parameters some rank used. Those get the mean in .grad on
// every rank (a .grad is created where the rank had none); a parameter no rank used keeps its .grad
// (undefined after zero_grad), so the optimizer skips it everywhere. "Used" covers the whole
// accumulation window: a parameter whose gradient was accumulated in a backward under
// no_sync counts as used at the next synced backward, and its accumulated .grad is what it
// contributes (with or without find_unused_parameters). PyTorch 1.13's reducer averages such a
// parameter only with gradient_as_bucket_view; otherwise each of its ranks keeps its own sum.

// Note [Averaging in the copy]
// DDP's gradient is the mean over ranks. Each rank divides its gradient by world_size while
// copying it into the bucket, and the all-reduce sums: sum_r (g_r / N) is the mean, with no
// pass over the bucket after the collective. PyTorch's reducer folds it into the same copy
// (it multiplies by 1/world_size); dividing keeps an exactly representable mean exact.

// Note [no_sync]
// In the backward of a forward run under no_sync (set_backward_syncs: the forward decides, as
// torch's prepare_for_backward), the hooks only note that the parameter was used (Note
// [Unused parameters]) and return: gradients accumulate in .grad as in a plain model, no
// bucket is touched and nothing is launched. The first backward that syncs then copies
// the accumulated .grad (every micro-batch's sum) into the buckets, so one all-reduce per
// bucket carries them all: the counters show exactly that (tests/test_ddp.cpp).

// Note [Gradient as bucket view]
// With gradient_as_bucket_view, a parameter's .grad is a slice_view of its slot in its
// bucket (core/storage.h, Note [Storage views]), as PyTorch's bucket views, so the gradients
// exist once, in the buckets:
//   - bind_grads_to_buckets makes the views once the plan exists, and points every .grad that
//     is already defined at its view, copying its values in; plan_buckets runs it, so after
//     the re-plan (Note [Bucket rebuild]) every .grad moves into its new slot with its values.
//     Until then the views keep the old buckets alive: the re-plan holds two sets of buckets
//     for that moment instead of one;
//   - backward adds into an existing .grad in place (core/autograd.cpp), so it writes into the
//     bucket; mark_ready then only divides the slot by world_size, in place;
//   - a .grad that is not the view (none before the first backward, or after
//     zero_grad(set_to_none=true)) is copied into its slot as without the flag, and .grad is
//     then replaced by the view: from that backward on it lives in the bucket;
//   - after the all-reduce the bucket holds the means, which .grad shows: no copy out (a comm
//     hook whose future holds another tensor is copied into the bucket once).
// zero_grad(/*set_to_none=*/false) (torch 1.13's default) keeps the views, so a step copies
// nothing; set_to_none=true makes every backward pay the copy in again, as in PyTorch. With
// find_unused_parameters, a parameter this rank did not use contributes its .grad (Note
// [Unused parameters]), which is its slot: one that no rank used ends with the mean of the
// ranks' .grads, as in PyTorch (its own value when they are equal, within rounding: exact at
// 2 ranks, an ulp off in a few elements at 3), where without views it keeps its .grad exactly.
// The flag also binds at one rank, where nothing is reduced, so .grad is the same kind of
// tensor at every world size. On shm the buckets are memory every rank maps (Note [Shm direct
// all-reduce]); a view of one is an ordinary tensor in that memory, so .grad lives there too.

Reducer::Reducer(std::vector<std::pair<std::string, Tensor>> params, std::shared_ptr<ProcessGroup> pg,
                 ReducerOptions options)
    : params_(std::move(params)), pg_(std::move(pg)), options_(options) {
  NANODDP_CHECK(pg_ != nullptr, ValueError, "Reducer: no process group");
  divide_factor_ = pg_->size();
  NANODDP_CHECK(options_.bucket_cap_bytes > 0 && options_.first_bucket_cap_bytes > 0, ValueError,
                "Reducer: bucket caps must be > 0 bytes");
  const Device device = params_.empty() ? Device::cpu() : params_[0].second.device();
  for (const auto& [name, p] : params_) {
    NANODDP_CHECK(p.dtype() == DType::Float32 && p.requires_grad() && p.is_leaf(), ValueError,
                  "DDP: parameter '", name, "' must be a float32 leaf that requires grad");
    NANODDP_CHECK(p.device() == device, DeviceError, "DDP: parameter '", name, "' is on ", p.device(),
                  " but '", params_[0].first, "' is on ", device, "; move the whole model first");
  }

  // 1. Plan: reverse registration order.
  std::vector<size_t> reverse_registration;
  for (size_t k = params_.size(); k-- > 0;) reverse_registration.push_back(k);
  plan_buckets(reverse_registration);

  for (size_t k = 0; k < params_.size(); ++k) {
    Tensor& p = params_[k].second;
    hook_ids_.push_back(p.register_post_accumulate_grad_hook([this, k](Tensor&) { mark_ready(k); }));
  }
  reset_iteration();
}

// A bucket closes once it reaches its cap: the first bucket's, then bucket_cap_bytes.
void Reducer::plan_buckets(const std::vector<size_t>& order) {
  NANODDP_ASSERT(order.size() == params_.size());
  plan_order_.assign(order.begin(), order.end());
  const Device device = params_.empty() ? Device::cpu() : params_[0].second.device();
  buckets_.clear();
  location_.assign(params_.size(), {0, 0});
  Bucket current;
  size_t current_bytes = 0;
  auto close_bucket = [&] {
    // Buckets are all-reduced every step: the group may place them where that is fastest.
    current.flat = pg_->new_collective_buffer(static_cast<int64_t>(current_bytes / sizeof(float)), DType::Float32,
                                              device);
    set_memory_category(current.flat, MemoryCategory::CommBuffers);
    buckets_.push_back(std::move(current));
    current = Bucket();
    current_bytes = 0;
  };
  for (size_t k : order) {
    location_[k] = {buckets_.size(), current.params.size()};
    current.offsets.push_back(current_bytes / sizeof(float));
    current.params.push_back(k);
    current_bytes += params_[k].second.nbytes();
    const size_t cap = buckets_.empty() ? options_.first_bucket_cap_bytes : options_.bucket_cap_bytes;
    if (current_bytes >= cap) close_bucket();
  }
  if (!current.params.empty()) close_bucket();
  for (Bucket& b : buckets_) b.pending = b.params.size();
  next_bucket_to_launch_ = 0;
  if (options_.gradient_as_bucket_view) bind_grads_to_buckets();  // .grad follows the plan
}

bool Reducer::should_rebuild() const {
  return !rebuilt_ && (options_.static_graph || !options_.find_unused_parameters);
}

// Note [Bucket rebuild]
bool Reducer::rebuild_buckets() {
  if (!should_rebuild() || synced_backwards_ == 0) return false;
  NANODDP_ASSERT(!finalize_queued_);  // between backwards: nothing in flight
  rebuilt_ = true;
  std::vector<int64_t> order;
  std::vector<bool> placed(params_.size(), false);
  for (size_t k : ready_order_) {
    order.push_back(static_cast<int64_t>(k));
    placed[k] = true;
  }
  for (size_t k = params_.size(); k-- > 0;)
    if (!placed[k]) order.push_back(static_cast<int64_t>(k));
  ready_order_.clear();
  if (pg_->size() > 1) {
    Tensor rank0_order = Tensor::from_vector(order, {}, pg_->device());  // NCCL takes device tensors only
    pg_->broadcast(rank0_order, /*root=*/0)->wait(options_.timeout);
    order = rank0_order.to_int_vector();
  }
  std::vector<size_t> plan_order;
  for (int64_t k : order) {
    NANODDP_ASSERT(k >= 0 && static_cast<size_t>(k) < params_.size());  // the same parameters everywhere
    plan_order.push_back(static_cast<size_t>(k));
  }
  plan_buckets(plan_order);
  return true;
}

void Reducer::load_bucket_order(const std::vector<int64_t>& order) {
  NANODDP_CHECK(!finalize_queued_, ValueError, "DDP: load_bucket_order during a backward pass");
  std::vector<bool> seen(params_.size(), false);
  bool permutation = order.size() == params_.size();
  for (int64_t k : order) {
    permutation = permutation && k >= 0 && static_cast<size_t>(k) < params_.size() && !seen[static_cast<size_t>(k)];
    if (permutation) seen[static_cast<size_t>(k)] = true;
  }
  NANODDP_CHECK(permutation, ValueError, "DDP: a bucket order of ", order.size(),
                " entries is not an order of this model's ", params_.size(),
                " parameters (was it saved with another model?)");
  rebuilt_ = true;
  ready_order_.clear();
  plan_buckets(std::vector<size_t>(order.begin(), order.end()));
}

Reducer::~Reducer() {
  for (size_t k = 0; k < hook_ids_.size(); ++k) params_[k].second.remove_hook(hook_ids_[k]);
}

std::vector<std::vector<size_t>> Reducer::bucket_plan() const {
  std::vector<std::vector<size_t>> plan;
  for (const Bucket& b : buckets_) plan.push_back(b.params);
  return plan;
}

void Reducer::bind_grads_to_buckets() {
  for (Bucket& bucket : buckets_) {
    bucket.views.clear();
    for (size_t slot = 0; slot < bucket.params.size(); ++slot)
      bucket.views.push_back(bucket.flat.slice_view(bucket.offsets[slot], params_[bucket.params[slot]].second.shape()));
  }
  // Read every .grad before writing any slot: after a re-plan that kept a buffer, one
  // parameter's new slot may overlap another's old one.
  std::vector<Tensor> sources(params_.size());
  for (size_t k = 0; k < params_.size(); ++k) {
    const Tensor grad = params_[k].second.grad();
    auto [b, slot] = location_[k];
    if (!grad.defined() || grad.is_same(buckets_[b].views[slot])) continue;
    bool in_a_bucket = false;
    for (const Bucket& bucket : buckets_) in_a_bucket = in_a_bucket || grad.is_alias_of(bucket.flat);
    sources[k] = in_a_bucket ? grad.clone() : grad;
  }
  for (size_t k = 0; k < params_.size(); ++k) {
    if (!sources[k].defined()) continue;
    auto [b, slot] = location_[k];
    Tensor& view = buckets_[b].views[slot];
    view.copy_(sources[k]);
    params_[k].second.set_grad(view);
  }
}

void Reducer::register_comm_hook(CommHook hook) {
  NANODDP_CHECK(hook != nullptr, ValueError, "register_comm_hook: the hook is empty");
  NANODDP_CHECK(comm_hook_ == nullptr, ValueError,
                "register_comm_hook can only be called once (a hook is already registered)");
  NANODDP_CHECK(!backward_seen_, ValueError,
                "register_comm_hook must be called before the first backward: the gradients of earlier "
                "iterations were averaged without it");
  comm_hook_ = std::move(hook);
}

void Reducer::reset_iteration() {
  if (synced_backwards_ == 0) ready_order_.clear();  // a first backward that failed records again
  ready_.assign(params_.size(), false);
  used_in_window_.assign(params_.size(), false);
  for (Bucket& b : buckets_) {
    b.pending = b.params.size();
    b.reduced.reset();
    b.launched_us = -1;
  }
  next_bucket_to_launch_ = 0;
  finalize_queued_ = false;
}

// Note [Interrupted backward]
// An exception inside backward (a user's hook, an op, a comm hook) ends the pass, and the
// engine drops the callbacks queued for its end: finalize never runs. The buckets launched
// before the exception are in flight, and this Reducer still counts them as pending. The next
// forward calls abandon_interrupted_backward: it waits for each launched bucket, drops the
// results (the iteration failed; .grad holds partial sums, which zero_grad clears) and resets.
// That keeps the group in step only if every rank's backward ended the same way, having
// launched the same buckets. A rank whose backward did not throw is still in finalize, inside
// the all_reduce of a bucket this rank never launched: had this rank gone on, its next
// iteration's bucket would pair with that one, and both ranks would step on a mix of two
// iterations' gradients. So the ranks agree first, with one all_reduce of the number of
// buckets each launched (MAX of it and of its negation): where it differs, or where a rank is
// still in finalize (its bucket all_reduce meets this int64 one: the collective check's
// mismatch error, on both), every rank throws. That last case needs the collective check
// (on by default): without it, backends pair collectives by order alone, and the two
// all_reduces of different sizes may hang until the timeout or mix their data. PyTorch's
// Reducer raises "Expected to have finished reduction in the prior iteration" on the failed
// rank, and it cannot train on.
void Reducer::abandon_interrupted_backward() {
  if (!finalize_queued_) return;
  int64_t launched = 0;
  try {
    for (Bucket& bucket : buckets_)
      if (bucket.reduced) {
        bucket.reduced->wait(options_.timeout);
        ++launched;
      }
  } catch (...) {
    reset_iteration();
    throw;
  }
  reset_iteration();
  detail::agree_after_interrupted_backward(*pg_, launched, "DDP", options_.timeout);
}

void Reducer::begin_ddp_backward() {
  const uint64_t pass = backward_pass_id();
  if (ddp_backward_pass_ == pass) return;  // a second DDP output in the same graph
  ddp_backward_pass_ = pass;
  if (early_pass_ != pass) return;
  std::vector<size_t> early;
  early.swap(early_ready_);
  early_pass_ = 0;
  for (size_t k : early) mark_ready(k);
}

// 2. A parameter's gradient is final for this backward.
void Reducer::mark_ready(size_t k) {
  const uint64_t pass = backward_pass_id();
  if (ddp_backward_pass_ != pass) {
    // Before this pass's DDP sink ran (a parameter behind the loss but not the output), or in a
    // pass that has none: held until the sink runs, dropped with the pass otherwise (local,
    // as in a plain model).
    if (early_pass_ != pass) {
      early_pass_ = pass;
      early_ready_.clear();
    }
    early_ready_.push_back(k);
    return;
  }
  used_in_window_[k] = true;  // also inside no_sync: see Note [Unused parameters]
  backward_seen_ = true;
  if (!backward_syncs_) return;
  if (!finalize_queued_) {
    queue_callback([this] { finalize(); });
    finalize_queued_ = true;
  }
  NANODDP_CHECK(!ready_[k], DistError, "DDP: parameter '", params_[k].first,
                "' received its gradient twice in one backward pass; a parameter may be used many times "
                "in a forward pass, but backward must run once per iteration");
  copy_into_bucket(k);
  if (options_.overlap) launch_ready_buckets();
}

void Reducer::copy_into_bucket(size_t k) {
  ready_[k] = true;
  if (synced_backwards_ == 0 && should_rebuild()) ready_order_.push_back(k);  // Note [Bucket rebuild]
  contribute(k);
}

void Reducer::contribute(size_t k) {
  // The mean over one rank is the gradient itself; views are still bound (Note [Gradient as
  // bucket view]).
  if (!reduces() && !options_.gradient_as_bucket_view) return;
  auto [b, slot] = location_[k];
  Bucket& bucket = buckets_[b];
  Tensor& param = params_[k].second;
  const Tensor grad = param.grad();
  const double ready_us = trace::enabled() ? trace::now_us() : 0;
  float* into = bucket.flat.data<float>() + bucket.offsets[slot];
  const bool in_bucket = options_.gradient_as_bucket_view && grad.is_same(bucket.views[slot]);
  // world_size unless Join says otherwise; a hook averages itself, and one rank has no mean to take.
  const bool divides = reduces() && !comm_hook_;
  if (divides) {  // out of place, or in place when .grad is the slot
    NANODDP_DISPATCH(grad.device(), scalar_forward, into, grad.data<float>(), kernels::ScalarOp::Div,
                     static_cast<float>(divide_factor_), grad.numel());
  } else if (!in_bucket) {
    copy_bytes(into, bucket.flat.device(), grad.data<float>(), grad.device(), grad.nbytes());
  }
  if (options_.gradient_as_bucket_view && !in_bucket) param.set_grad(bucket.views[slot]);
  if (!reduces()) return;
  --bucket.pending;
  if (trace::enabled()) {
    trace::complete(trace::Lane::DDP, params_[k].first + " ready -> bucket " + std::to_string(b), ready_us,
                    trace::now_us(),
                    "\"param\":" + trace::json_string(params_[k].first) + ",\"bucket\":" + std::to_string(b) +
                        ",\"bytes\":" + std::to_string(grad.nbytes()));
    trace_completions();
  }
}

void Reducer::launch_ready_buckets() {
  while (next_bucket_to_launch_ < buckets_.size() && buckets_[next_bucket_to_launch_].pending == 0)
    launch(buckets_[next_bucket_to_launch_++]);
}

void Reducer::launch(Bucket& bucket) {
  if (trace::enabled()) bucket.launched_us = trace::now_us();
  const size_t index = static_cast<size_t>(&bucket - buckets_.data());
  const CollectivePurpose purpose(CollectivePurpose::Kind::DdpBucket, index);
  if (!comm_hook_) {
    bucket.reduced = std::make_shared<Future>(pg_->all_reduce(bucket.flat, ReduceOp::Sum), bucket.flat);
    return;
  }
  std::vector<Tensor> parameters;
  for (size_t k : bucket.params) parameters.push_back(params_[k].second);
  GradBucket grad_bucket(index, bucket.flat, std::move(parameters), bucket.offsets, index + 1 == buckets_.size());
  bucket.reduced = comm_hook_(grad_bucket);
  NANODDP_CHECK(bucket.reduced != nullptr, ValueError, "DDP comm hook returned no future for bucket ", index);
}

// When tracing: each launched bucket's all-reduce becomes one event on its own lane, from launch
// (or, on a backend that runs collectives in wait(), from finalize's first wait) to the first
// moment it is seen complete (at a later hook, or when finalize waits for it).
void Reducer::trace_completions() {
  for (size_t b = 0; b < buckets_.size(); ++b) {
    Bucket& bucket = buckets_[b];
    if (bucket.launched_us < 0 || !bucket.reduced->is_completed()) continue;
    trace::complete(trace::kAllReduceLane + static_cast<int>(b), "all_reduce bucket " + std::to_string(b),
                    bucket.launched_us, trace::now_us(),
                    "\"bucket\":" + std::to_string(b) + ",\"bytes\":" + std::to_string(bucket.flat.nbytes()) +
                        ",\"params\":" + std::to_string(bucket.params.size()) +
                        ",\"backend\":" + trace::json_string(pg_->backend_name()) +
                        ",\"algorithm\":" + trace::json_string(pg_->all_reduce_algorithm_for(bucket.flat)) +
                        ",\"world_size\":" + std::to_string(pg_->size()));
    bucket.launched_us = -1;
  }
}

// 3. Backward has ended.
void Reducer::finalize() {
  // However this ends (a collective may throw: a timeout, ranks out of step), the next
  // backward starts a fresh iteration.
  struct ResetAtExit {
    Reducer& reducer;
    ~ResetAtExit() { reducer.reset_iteration(); }
  } reset_at_exit{*this};
  // Note [Static graph]: unused parameters are allowed; after the first synced backward,
  // which ones some rank used is known.
  const bool allow_unused = options_.find_unused_parameters || options_.static_graph;
  std::vector<std::string> unready;
  for (size_t k = 0; k < params_.size(); ++k) {
    if (ready_[k]) continue;
    if (used_in_window_[k] && params_[k].second.grad().defined()) {
      copy_into_bucket(k);  // used only in an earlier no_sync backward: its sum is in .grad
      continue;
    }
    if (!allow_unused) {
      unready.push_back(params_[k].first);
      continue;
    }
    if (!reduces()) continue;
    // Unused here (Note [Unused parameters]): its .grad as it stands, or zeros without one.
    if (params_[k].second.grad().defined()) {
      contribute(k);
      continue;
    }
    auto [b, slot] = location_[k];
    Bucket& bucket = buckets_[b];
    NANODDP_DISPATCH(bucket.flat.device(), fill, bucket.flat.data<float>() + bucket.offsets[slot], 0.0f,
                     params_[k].second.numel());
    --bucket.pending;
  }
  if (!unready.empty()) {
    std::ostringstream names;
    for (size_t i = 0; i < unready.size(); ++i) names << (i ? ", " : "") << unready[i];
    NANODDP_THROW(DistError, "DDP on rank ", pg_->rank(), "/", pg_->size(),
                  ": these parameters received no gradient in this iteration: ", names.str(),
                  ". Make every parameter take part in the loss, or pass find_unused_parameters = true");
  }
  // Note [Static graph]: what this rank uses in its first synced backward it must use in all.
  std::vector<bool> dropped(params_.size(), false);
  if (options_.static_graph) {
    if (static_used_here_.empty()) {
      static_used_here_ = ready_;
    } else {
      for (size_t k = 0; k < params_.size(); ++k) dropped[k] = static_used_here_[k] && !ready_[k];
    }
  }
  ++synced_backwards_;
  if (!reduces()) {
    if (options_.static_graph) {
      // One rank: what it used is what any rank used, learnt without an all-reduce.
      if (static_used_anywhere_.empty()) static_used_anywhere_.assign(ready_.begin(), ready_.end());
      check_static_graph(dropped);
    }
    return;
  }
  launch_ready_buckets();
  NANODDP_ASSERT(next_bucket_to_launch_ == buckets_.size());
  // A backend that runs collectives in wait() has run none of the buckets yet, however early
  // they were launched: their events begin at the first wait below, and none counts as hidden.
  if (trace::enabled() && pg_->collectives_run_in_wait()) {
    const double now = trace::now_us();
    for (Bucket& bucket : buckets_)
      if (bucket.launched_us >= 0) bucket.launched_us = now;
  }
  // Issued after every bucket, so the order of collectives is the same on every rank.
  const std::vector<int64_t> used_anywhere = agree_on_used(ready_);
  for (Bucket& bucket : buckets_) {
    Tensor mean;
    {
      // The exposed communication: backward is over and this rank can only wait.
      trace::Span waiting(trace::Lane::DDP, "wait for all_reduce");
      if (waiting.active()) waiting.set_args("\"bucket\":" + std::to_string(&bucket - buckets_.data()));
      mean = bucket.reduced->wait(options_.timeout);
    }
    if (trace::enabled()) trace_completions();
    write_gradients(bucket, mean, used_anywhere, dropped);
  }
  if (options_.static_graph) check_static_graph(dropped);
}

// Note [Unused parameters]: which parameters any rank used, given those this rank used. All,
// without find_unused_parameters or static_graph; with static_graph, the answer of the first
// synced backward, kept (Note [Static graph]); else an all_reduce(max) of one int64 per
// parameter on the group's device, the same collective on every rank.
std::vector<int64_t> Reducer::agree_on_used(const std::vector<bool>& used_here) {
  if (options_.static_graph && !static_used_anywhere_.empty()) return static_used_anywhere_;
  if (!options_.find_unused_parameters && !options_.static_graph)
    return std::vector<int64_t>(params_.size(), 1);
  std::vector<int64_t> flags(params_.size());
  for (size_t k = 0; k < params_.size(); ++k) flags[k] = used_here[k] ? 1 : 0;
  std::vector<int64_t> used_anywhere = all_reduce_host(*pg_, flags, ReduceOp::Max, options_.timeout);
  if (options_.static_graph) static_used_anywhere_ = used_anywhere;
  return used_anywhere;
}

// Step 4's end: the bucket's reduced values (mean, what its all-reduce or comm hook left) into
// the .grad of each parameter some rank used (used_anywhere) and this backward did not drop.
void Reducer::write_gradients(Bucket& bucket, const Tensor& mean, const std::vector<int64_t>& used_anywhere,
                              const std::vector<bool>& dropped) {
  const size_t index = static_cast<size_t>(&bucket - buckets_.data());
  NANODDP_CHECK(mean.defined() && mean.dtype() == DType::Float32 && mean.numel() == bucket.flat.numel() &&
                    mean.device() == bucket.flat.device(),
                ValueError, "DDP comm hook: the future of bucket ", index, " holds ",
                mean.defined()
                    ? mean.shape().str() + " " + dtype_name(mean.dtype()) + " on " + mean.device().str()
                    : std::string("an undefined tensor"),
                "; expected its buffer's ", bucket.flat.numel(), " float32 values on ", bucket.flat.device());
  if (options_.gradient_as_bucket_view) {  // Note [Gradient as bucket view]: no copy out
    if (mean.data<float>() != bucket.flat.data<float>())
      copy_bytes(bucket.flat.data<float>(), bucket.flat.device(), mean.data<float>(), mean.device(),
                 bucket.flat.nbytes());
    for (size_t slot = 0; slot < bucket.params.size(); ++slot) {
      const size_t k = bucket.params[slot];
      Tensor& p = params_[k].second;
      if (used_anywhere[k] != 0 && !dropped[k] && !p.grad().is_same(bucket.views[slot]))
        p.set_grad(bucket.views[slot]);
    }
    return;
  }
  for (size_t slot = 0; slot < bucket.params.size(); ++slot) {
    const size_t k = bucket.params[slot];
    if (used_anywhere[k] == 0) continue;  // no rank used it: .grad untouched, as in PyTorch
    if (dropped[k]) continue;             // an error after the collectives: .grad untouched
    Tensor& p = params_[k].second;
    if (!p.grad().defined()) {
      p.set_grad(Tensor::empty(p.shape(), DType::Float32, p.device()));
      set_memory_category(p.grad(), MemoryCategory::Gradients);
    }
    Tensor grad = p.grad();
    copy_bytes(grad.data<float>(), grad.device(), mean.data<float>() + bucket.offsets[slot], mean.device(),
               grad.nbytes());
  }
}

// Note [Static graph]: throws, naming the parameters, when this backward broke the promise.
// Called after the step's collectives, so that the ranks stay in step.
void Reducer::check_static_graph(const std::vector<bool>& dropped) const {
  std::ostringstream newly_used, now_unused;
  int newly_used_count = 0, now_unused_count = 0;
  for (size_t k = 0; k < params_.size(); ++k) {
    if (ready_[k] && static_used_anywhere_[k] == 0)
      newly_used << (newly_used_count++ ? ", " : "") << params_[k].first;
    if (dropped[k]) now_unused << (now_unused_count++ ? ", " : "") << params_[k].first;
  }
  NANODDP_CHECK(newly_used_count == 0, DistError, "DDP on rank ", pg_->rank(), "/", pg_->size(),
                " with static_graph: these parameters received a gradient, but no rank used them in the first "
                "iteration: ",
                newly_used.str(), ". The set of used parameters changed; pass find_unused_parameters = true "
                "instead of static_graph");
  NANODDP_CHECK(now_unused_count == 0, DistError, "DDP on rank ", pg_->rank(), "/", pg_->size(),
                " with static_graph: these parameters were used in the first iteration but received no gradient "
                "in this one: ",
                now_unused.str(), ". Your training graph has changed in this iteration; pass "
                "find_unused_parameters = true instead of static_graph");
}

// ---- dist::Join (Note [Join] in dist/join.cpp) ----

void Reducer::set_divide_factor(int64_t ranks) {
  NANODDP_CHECK(ranks >= 1 && ranks <= pg_->size(), ValueError, "Reducer: divide factor ", ranks,
                " is not a number of ranks in [1, ", pg_->size(), "]");
  divide_factor_ = ranks;
}

void Reducer::shadow_synced_backward() {
  ++synced_backwards_;  // as the others' finalize counts theirs: Note [Bucket rebuild] waits for one
  if (pg_->size() == 1) return;  // a synced backward issues nothing either
  for (Bucket& bucket : buckets_) {  // step 3's launch, in plan order
    // The bucket itself, zeroed, through the others' launch: on shm a bucket must meet a
    // bucket (Note [Shm direct all-reduce]), and a comm hook issues its collectives (16-bit
    // ones, say) here too, on zeros, as PyTorch's join hook does
    // (_match_all_reduce_for_bwd_pass).
    bucket.flat.zero_();
    launch(bucket);
  }
  const std::vector<bool> none(params_.size(), false);  // this rank used and dropped nothing
  const std::vector<int64_t> used_anywhere = agree_on_used(none);
  // Note [Join] step 4': the gradients the others step with, into this rank's .grad. A
  // parameter nobody used has no gradient there (their zero_grad cleared it): nor here, where
  // the .grad of this rank's last batch would otherwise still be.
  for (size_t k = 0; k < params_.size(); ++k)
    if (used_anywhere[k] == 0) params_[k].second.set_grad(Tensor());
  for (Bucket& bucket : buckets_) {
    const Tensor mean = bucket.reduced->wait(options_.timeout);
    bucket.reduced.reset();
    bucket.launched_us = -1;  // a shadow is not traced
    write_gradients(bucket, mean, used_anywhere, none);
  }
}

}  // namespace nanoddp::dist
