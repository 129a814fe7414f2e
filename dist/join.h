// Join: training with uneven inputs, where ranks run out of batches at different iterations
// (torch.distributed.algorithms.Join, with Joinable and JoinHook).
//
//   dist::Join join({ddp});                                  // ddp: a DistributedDataParallel
//   for (auto& batch : my_batches) { loss_fn(ddp(batch.x), batch.y).backward(); opt.step(); }
//   join.finish();                                           // required: runs the join loop
//
// Without Join, a rank that has no batch left stops calling the collectives its peers still
// call, and they fail (the collective check's DistError, or a timeout). With Join, a rank that
// reaches finish() has "joined": until every rank has joined it shadows, iteration by
// iteration, the collectives the others still issue (DDP: all-reduces of zeros for every
// bucket), so they finish their batches; then the post-hooks run on every rank (DDP: the
// parameters of a rank that joined last are broadcast, so every replica ends equal). Note
// [Join] in join.cpp gives the protocol, collective by collective.
//
// Contract:
//  - Collective: every rank of the group constructs its Join with the same joinables (all on
//    one process group), in the same order, and calls finish() after its own last iteration.
//  - Each joinable calls Join::notify_join_context(*this) at the start of every iteration,
//    before its own collectives (DDP does it in forward); one iteration is one forward and at
//    most one backward.
//  - finish() is how the context ends; it may throw. The destructor cannot throw, so a Join
//    destroyed without finish() while no exception is in flight is a bug in the program: as
//    std::thread's destructor does for a thread never joined, it prints what to fix and calls
//    std::terminate(), instead of leaving the other ranks waiting. While an exception unwinds,
//    the destructor only ends the context (PyTorch's __exit__ re-raises at once likewise).
//  - Every wait ends by the earlier of JoinOptions::timeout and the group's timeout
//    (TimeoutError).
//  - The joinables must outlive the Join; a joinable takes part in one Join at a time.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "core/device.h"
#include "dist/process_group.h"

namespace nanoddp::dist {

struct JoinOptions {
  // false: the context does nothing (no collective, finish() returns at once); for inputs
  // known to be even (PyTorch's enable).
  bool enable = true;
  // true: as soon as one rank runs out of inputs, every rank throws a DistError naming the
  // rank(s) that ran out (PyTorch's throw_on_early_termination; the others throw it from
  // their next forward, the ranks that ran out from finish()).
  bool throw_on_early_termination = false;
  // Passed to every joinable's join_hook, as PyTorch forwards Join's **kwargs. DDP's
  // divide_by_initial_world_size (default true, as PyTorch): divide the summed gradients by
  // the world size even after ranks joined, so a joined rank counts as a zero gradient and
  // the step shrinks; false: divide by the number of ranks still training in that iteration,
  // so each step is the mean of the real gradients.
  bool divide_by_initial_world_size = true;
  // How long each collective of the join protocol may wait (bounded by the group's timeout).
  std::chrono::milliseconds timeout = kDefaultTimeout;
};

// What a joinable does once this rank has joined (torch's JoinHook).
class JoinHook {
 public:
  virtual ~JoinHook() = default;
  // Called once per iteration that some other rank still runs: issue exactly the
  // collectives this joinable issues in one iteration, with neutral values.
  virtual void main_hook() {}
  // Called once on every rank after all ranks joined. is_last_joiner: this rank ran the most
  // iterations (no main_hook call); several ranks may be last.
  virtual void post_hook(bool is_last_joiner) { (void)is_last_joiner; }
};

// A class whose per-iteration collectives a Join can shadow (torch's Joinable).
class Joinable {
 public:
  virtual ~Joinable() = default;
  // The hook this joinable runs once joined; called by Join's constructor.
  virtual std::unique_ptr<JoinHook> join_hook(const JoinOptions& options) = 0;
  // The device and group of the join protocol's own collectives (the first joinable's).
  virtual Device join_device() const = 0;
  virtual std::shared_ptr<ProcessGroup> join_process_group() const = 0;

 protected:
  // Set by the Join this joinable is in, cleared when it ends (torch's _JoinConfig).
  struct JoinConfig {
    bool enable = false;
    bool throw_on_early_termination = false;
    bool is_first_joinable = false;
    std::chrono::milliseconds timeout = kDefaultTimeout;
  };
  const JoinConfig& join_config() const { return join_config_; }

 private:
  friend class Join;
  JoinConfig join_config_;
  bool in_join_ = false;
};

class Join {
 public:
  // Throws ValueError when joinables is empty, lists one twice, holds one already in another
  // Join, or when they do not all share one process group. Issues no collective.
  explicit Join(std::vector<std::reference_wrapper<Joinable>> joinables, JoinOptions options = {});
  ~Join();  // see the contract: std::terminate() when finish() was forgotten
  Join(const Join&) = delete;
  Join& operator=(const Join&) = delete;

  // Ends the context on this rank: until every rank has joined, runs every joinable's
  // main_hook once per iteration another rank still runs; then every post_hook (PyTorch's
  // Join.__exit__). Throws DistError with throw_on_early_termination when ranks ran out at
  // different iterations, TimeoutError when a peer stops answering, and whatever the hooks
  // throw; the context is over either way. ValueError when called twice.
  void finish();

  // Called by a joinable at the start of each iteration, before its own collectives
  // (torch's Join.notify_join_context). Outside a Join, or for any joinable but the first,
  // returns nullopt and issues nothing. Otherwise all-reduces this rank's "not joined yet"
  // and returns how many ranks have not joined (this one included); with
  // throw_on_early_termination it then throws the DistError naming the ranks that ran out,
  // if any did. PyTorch returns the all-reduce's work; we wait for it here, one 8-byte
  // all-reduce per iteration, so the count is at hand (DDP divides by it).
  static std::optional<int64_t> notify_join_context(Joinable& joinable);

 private:
  void end_context();

  std::vector<std::reference_wrapper<Joinable>> joinables_;
  std::vector<std::unique_ptr<JoinHook>> hooks_;
  JoinOptions options_;
  std::shared_ptr<ProcessGroup> pg_;
  Device device_ = Device::cpu();
  int uncaught_at_construction_ = 0;
  bool finished_ = false;
};

}  // namespace nanoddp::dist
