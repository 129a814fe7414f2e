#include "dist/join.h"

#include <cstdio>
#include <exception>
#include <sstream>

#include "core/error.h"

namespace nanoddp::dist {

// Note [Join]
// Collectives match by order alone, so a rank that has joined (reached Join::finish()) must
// issue, in every iteration the others still run, the same collectives they issue, with the
// same sizes, dtypes and ops. One iteration, rank by rank:
//
//   a rank still training (DDP's forward, then backward)  | a joined rank (Join::finish)
//   1. notify_join_context: all_reduce(sum) of 1 int64 = 1 | 1'. the same with 0: the sum is
//                                                          |     the number of ranks still
//                                                          |     training; 0 ends the loop
//   2. throw_on_early_termination only: all_reduce(max)    | 2'. the same with 1 at its own
//      of world_size int64 flags, all 0                    |     index; every rank throws
//   3. DDP: all_reduce(sum) of 1 int64: does this          | 3'. DDP's main_hook: the same
//      iteration's backward sync? (grad mode, no no_sync)  |     with 0; when the sum is 0
//                                                          |     it stops after 3b'
//   3b. DDP with buffers to broadcast, when the iteration  | 3b'. the same with -1, then
//      before synced (Note [Buffer broadcast]):            |     the same broadcasts; the
//      all_reduce(max) of its rank = the source; then one  |     iteration before synced
//      broadcast per buffer dtype                          |     when its 3' sum was > 0
//   3c. DDP, when syncing, once, after the first synced    | 3c'. the same (rebuild_buckets;
//      backward: broadcast of rank 0's ready order, one    |     a 4' counts as a synced
//      int64 per parameter, then the new buckets from the  |     backward, as a 4 does)
//      group (Note [Bucket rebuild])                       |
//   4. backward: one all_reduce(sum) per bucket, in plan   | 4'. shadow_synced_backward:
//      order; find_unused_parameters: the used map,        |     zeros in every bucket, a
//      all_reduce(max) of one int64 per parameter (with    |     used map of zeros when the
//      static_graph in the first synced backward only)     |     others send theirs
//   5. ZeroRedundancyOptimizer in the Join: step():        | 5'. its main_hook: the local
//      the local step of this rank's shard, then one       |     step of this rank's shard
//      broadcast per parameter from its owner              |     with the .grad 4' left, then
//                                                          |     the same broadcasts
// A joined rank contributes zeros, so the sums are those of the ranks still training. DDP
// divides them by the world size (divide_by_initial_world_size, PyTorch's default: a joined
// rank weighs as a zero gradient) or by the count from step 1 (each rank divides what it adds,
// so the joined rank's zeros need no divisor). A parameter that only joined ranks would have
// used is used by no rank in the map: its .grad is undefined on every rank (the joined ones
// included, whatever their last batch left) and no rank steps it. A
// joined rank keeps what it receives in .grad, as the others do. A plain optimizer is not
// stepped there any more (the post-hook below gives it the others' model), but ZeRO's owner
// of a parameter must step it for everyone, and does so with the gradient the others step
// with (PyTorch's ZeRO join hook steps with whatever .grad the joined rank last had).
// Once every rank has joined, the post-hooks run on every rank: DDP all-reduces (max) the
// rank of a last joiner (-1 from the others) and broadcasts that rank's parameters, so the
// ranks that stopped early end with the same model as the ones that ran longest.
// With throw_on_early_termination, the first iteration in which any rank has joined ends the
// job on every rank: step 2 tells every rank which ranks ran out. Both sides have just
// matched their collectives, so the group stays usable after the error.
// Cost on the ranks still training: steps 1 and 3 (and 2) are 8-byte all-reduces, waited for
// in forward, every iteration while the Join is active.
// Any collective DDP adds to its forward or backward (a buffer broadcast, a bucket re-plan)
// needs its shadow in DDP's main_hook at the same place in this order, or a joined rank's
// peers fail with the collective check's mismatch error. With a comm hook (dist/comm_hooks.h)
// step 4 is whatever the hook issues per bucket (a 16-bit all-reduce, say), and step 4' calls
// the same hook on buckets of zeros; the hook divides by its own group's size.

namespace {

// One of the protocol's own all-reduces (steps 1 and 2), named for the collective check: a
// peer that issues anything else there (a collective of something that is not a joinable)
// gets a mismatch error that says whose call met whose.
std::vector<int64_t> all_reduce_on(ProcessGroup& pg, Device device, const std::vector<int64_t>& values, ReduceOp op,
                                   std::chrono::milliseconds timeout) {
  const CollectivePurpose purpose(CollectivePurpose::Kind::Join, op == ReduceOp::Sum ? 0 : 1);
  Tensor tensor = Tensor::from_vector(values, {}, device);
  pg.all_reduce(tensor, op)->wait(timeout);
  return tensor.to_int_vector();
}

// Step 2 of Note [Join]: flags[r] != 0 for every rank r that has run out of inputs.
void throw_if_any_ran_out(ProcessGroup& pg, const std::vector<int64_t>& flags) {
  std::ostringstream ran_out;
  int count = 0;
  for (size_t r = 0; r < flags.size(); ++r)
    if (flags[r] != 0) ran_out << (count++ ? ", " : "") << r;
  if (count == 0) return;
  NANODDP_THROW(DistError, "dist::Join on rank ", pg.rank(), "/", pg.size(), ": rank", count > 1 ? "s " : " ",
                ran_out.str(), count > 1 ? " have" : " has",
                " exhausted all inputs while other ranks still had batches; with throw_on_early_termination every "
                "rank throws this error");
}

}  // namespace

Join::Join(std::vector<std::reference_wrapper<Joinable>> joinables, JoinOptions options)
    : joinables_(std::move(joinables)), options_(options), uncaught_at_construction_(std::uncaught_exceptions()) {
  NANODDP_CHECK(!joinables_.empty(), ValueError, "dist::Join needs at least one joinable");
  for (size_t i = 0; i < joinables_.size(); ++i) {
    Joinable& joinable = joinables_[i].get();
    NANODDP_CHECK(!joinable.in_join_, ValueError, "dist::Join: joinable #", i,
                  " is already in another active Join (finish that one first)");
    for (size_t j = 0; j < i; ++j)
      NANODDP_CHECK(&joinables_[j].get() != &joinable, ValueError, "dist::Join: joinables #", j, " and #", i,
                    " are the same object");
    const auto pg = joinable.join_process_group();
    NANODDP_CHECK(pg != nullptr, ValueError, "dist::Join: joinable #", i, " has no process group");
    if (i == 0) {
      pg_ = pg;
      device_ = joinable.join_device();
    }
    NANODDP_CHECK(pg == pg_, ValueError, "dist::Join: joinable #", i,
                  " uses another process group than joinable #0; a Join runs on one group");
  }
  for (Joinable& joinable : joinables_) hooks_.push_back(joinable.join_hook(options_));
  for (size_t i = 0; i < joinables_.size(); ++i) {
    Joinable& joinable = joinables_[i].get();
    joinable.in_join_ = true;
    joinable.join_config_ = {options_.enable, options_.throw_on_early_termination, i == 0, options_.timeout};
  }
}

Join::~Join() {
  if (!finished_ && std::uncaught_exceptions() == uncaught_at_construction_) {
    std::fprintf(stderr,
                 "dist::Join on rank %d/%d was destroyed without finish(): the other ranks would wait for its "
                 "collectives until they time out. Call join.finish() after this rank's last iteration (it runs "
                 "the join loop and may throw). Terminating, as std::thread does when never joined.\n",
                 pg_->rank(), pg_->size());
    std::fflush(stderr);
    std::terminate();
  }
  end_context();
}

void Join::end_context() {
  for (Joinable& joinable : joinables_) {
    joinable.join_config_ = {};
    joinable.in_join_ = false;
  }
  hooks_.clear();  // a hook may restore its joinable's settings when destroyed
}

void Join::finish() {
  NANODDP_CHECK(!finished_, ValueError, "dist::Join::finish() called twice");
  finished_ = true;
  struct EndAtExit {
    Join& join;
    ~EndAtExit() { join.end_context(); }
  } end_at_exit{*this};
  if (!options_.enable) return;

  ProcessGroup& pg = *pg_;
  bool is_last_joiner = true;
  for (;;) {
    const int64_t not_joined = all_reduce_on(pg, device_, {0}, ReduceOp::Sum, options_.timeout)[0];  // 1'
    if (not_joined == 0) break;
    if (options_.throw_on_early_termination) {  // 2'
      std::vector<int64_t> flags(static_cast<size_t>(pg.size()), 0);
      flags[static_cast<size_t>(pg.rank())] = 1;
      throw_if_any_ran_out(pg, all_reduce_on(pg, device_, flags, ReduceOp::Max, options_.timeout));
    }
    for (auto& hook : hooks_) hook->main_hook();  // 3' to 5'
    is_last_joiner = false;
  }
  for (auto& hook : hooks_) hook->post_hook(is_last_joiner);
}

std::optional<int64_t> Join::notify_join_context(Joinable& joinable) {
  const Joinable::JoinConfig& config = joinable.join_config_;
  if (!config.enable || !config.is_first_joinable) return std::nullopt;
  const auto pg = joinable.join_process_group();
  const Device device = joinable.join_device();
  const int64_t not_joined = all_reduce_on(*pg, device, {1}, ReduceOp::Sum, config.timeout)[0];  // 1
  if (config.throw_on_early_termination) {  // 2
    const std::vector<int64_t> none(static_cast<size_t>(pg->size()), 0);
    throw_if_any_ran_out(*pg, all_reduce_on(*pg, device, none, ReduceOp::Max, config.timeout));
  }
  return not_joined;
}

}  // namespace nanoddp::dist
