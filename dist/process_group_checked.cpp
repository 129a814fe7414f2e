// The collective check: a ProcessGroup around any backend that makes every rank agree on
// each collective before it is issued.
//
// Note [Collective check]
// The contract says every rank issues the same collectives, in the same order, with the same
// sizes, dtypes and ops. Backends do not check it, and a broken contract does not just hang:
// Gloo aborts the process on a size mismatch or returns half-reduced data as success, MPI
// fails with MPI_ERR_TRUNCATE or crashes. So, before each collective, every rank all-gathers
// a fixed-size fingerprint of what it is about to call (sequence number in the group, which
// collective, op, dtype, element count, root or list length, what it is for: Note [Collective
// purpose]) through the backend itself (or a CPU group beside it: Note [Host fingerprints]).
// A fixed-size all-gather cannot itself mismatch, and every rank sees the same table, so
// when one entry differs every rank throws the same DistError naming each rank's call, and
// no rank issues the real collective: nothing is half-sent. The group then refuses every later
// collective (Note [Out of step]). A
// rank that issues no collective at all (it exited, or is stuck) leaves the others in the
// fingerprint all-gather until the group's timeout: TimeoutError.
// PyTorch does the same only with TORCH_DISTRIBUTED_DEBUG=DETAIL (its ProcessGroupWrapper);
// here it is on by default. Cost: one small all-gather per collective, whose arrival the
// collective waits for: one more rendezvous of the ranks per collective (the copies, the
// comparison and the message text are microseconds). On an idle machine that is a few
// microseconds next to a millisecond step; on a loaded 2-core machine every rendezvous can
// cost a scheduler time slice, and the check's cost is that (benchmarks/run, "collective
// check" rows). Turn it off with InitOptions::check_collectives = false or
// NANODDP_CHECK_COLLECTIVES=0.
//
// Note [Fused collective check]
// Where the backend runs its collectives in order on a thread of its own (Gloo), the
// fingerprint all-gather, the comparison and the collective run as one task there
// (ProcessGroup::start_guarded; Gloo all-gathers the fingerprints through shared memory when
// its ranks share a machine, Note [Shared-memory fingerprints] in dist/host_fingerprints.cpp):
// the caller's thread takes no part between them, and the collective starts the moment the
// fingerprints are in, instead of at the caller's next poll or wait. The guarantees are the
// same: every rank all-gathers the same fixed-size fingerprint, sees the same table, and on
// a mismatch none runs the collective. A rank whose peer never arrives waits in that task
// until the group's timeout. Other backends return null and keep the deferred exchange
// below: shm and MPI run a collective on the caller's thread, where the two steps cost no
// hand-off.
//
// Note [Deferred check]
// A collective returns its Work at once and never waits for the peers: the call joins the
// group's queue of unsettled calls. The queue moves whenever this group is touched (a call,
// is_completed(), wait()), oldest first, one call at a time: the oldest call's fingerprint
// all-gather is issued; once it has arrived the fingerprints are compared and, when every
// rank agrees, the real collective is issued at once, and the next call's fingerprint after
// it. So the backend sees fingerprint k, collective k, fingerprint k+1 on every rank, whoever
// polls or waits when. A DDP hook that issues bucket k+1 while bucket k's fingerprints are
// still in flight does not stall (a stall there would cost the overlap); the hooks' polls of
// earlier buckets start their collectives as soon as the fingerprints are there, so a
// collective starts near the moment the last rank called it, not when somebody waits on it.
// wait() moves the queue up to its own call, waiting (up to the timeout) on each fingerprint
// on the way. A mismatch is reported by the mismatched work's wait(), on every rank.
//
// Note [Host fingerprints]
// Through NCCL the fingerprints would go the GPU's way: copied to the device, all-gathered
// there, and the table copied back for the host to compare. That is two host waits for the
// device per collective, each draining the compute stream in the middle of backward, where
// DDP's step otherwise never waits (Note [Host syncs] in kernels/device_memory.h).
// So init_process_group gives the check of an NCCL group a CPU group of the same ranks for the
// fingerprints: shared memory when every rank is on this machine (Note [Shared-memory
// fingerprints] in dist/host_fingerprints.cpp), else Gloo's sockets. torch.distributed's
// ProcessGroupWrapper all-gathers its fingerprints on a Gloo group too; a multi-node NCCL job
// then needs TCP between its nodes.
// A thread of the check's own (dist/start_worker.h) takes the calls in order. For each it
// all-gathers the fingerprints, compares them and starts the collective, as Gloo's worker does
// (Note [Fused collective check]). The caller never waits, and an NCCL collective is launched
// the moment the last rank has called it.
// The launch orders the collective after the compute stream as it is then, a little later
// than at the call: its temporaries come from the caching allocator at the launch, free from
// that point of the stream on.
// The send/recv that NCCL holds back to group them go out at the call
// (ProcessGroup::issue_queued_point_to_point), as at any collective's call, and not again at
// the launch (detail::CollectiveCalledEarlier). Those queued by then were called after the
// collective, and go out with the calls around them.
// Only a backend whose collectives progress on their own, apart from its send/recv, can be
// started so (NCCL, Gloo). shm's engine runs both in one order, in the waiting thread, and is
// refused. Under NCCL, a send/recv issued while an earlier collective still waits in the
// worker may reach NCCL before or after that collective, depending on each rank's exchange:
// the two communicators of the device then get their calls in different orders on different
// ranks. NCCL asks for the same order on every rank; a different one works only while both
// kernels fit on the GPU at once, which NCCL does not promise (Note [NCCL point-to-point]
// relies on it; a device-wide sync meanwhile, as an out-of-memory retry's cudaFree, can still
// wait for the other kernel). A deadlock so made ends at the timeout, in the abort.
// The comparison and its errors are the check's own; a failed exchange reads as the check's,
// not as a collective of the fingerprint group. Without a fingerprint group (ranks on several
// machines, a build without Gloo), the fingerprints go through the GPU as described above.

#include <algorithm>
#include <atomic>
#include <deque>
#include <functional>
#include <mutex>
#include <sstream>
#include <thread>

#include "core/error.h"
#include "dist/deadline.h"
#include "dist/host_fingerprints.h"
#include "dist/launcher_link.h"
#include "dist/nccl_protocol.h"
#include "dist/process_group.h"
#include "dist/start_worker.h"

namespace nanoddp::dist {

namespace {

enum class CallKind : int64_t { AllReduce = 1, Broadcast, AllGather, ReduceScatter, Barrier };

// A fingerprint: what a rank is about to call, as int64s on the wire:
//   [seq (1 for the group's first collective), CallKind, ReduceOp or -1, DType or -1,
//    elements per tensor, broadcast root or list length or 0, CollectivePurpose or 0]
constexpr int64_t kFingerprintFields = 7;

// Note [Collective purpose]
// Sizes, dtypes and ops do not tell two calls for different things apart: under NO_SHARD,
// FSDP's reductions of two units of the same size are the same all_reduce, and a rank whose
// backward skipped unit 'a' would pair its unit 'b' with the others' 'a', adding one unit's
// gradient to the other's. So the library's own callers say what a call is for (FSDP's
// unit, DDP's bucket), and the fingerprint carries it as one more int64; a user's collective
// outside them carries 0.
thread_local int64_t current_purpose = 0;

std::string describe_call(const int64_t* f) {
  std::ostringstream out;
  const auto kind = static_cast<CallKind>(f[1]);
  const auto op = static_cast<ReduceOp>(f[2]);
  switch (kind) {
    case CallKind::AllReduce: out << "all_reduce(" << reduce_op_name(op) << ")"; break;
    case CallKind::Broadcast: out << "broadcast from rank " << f[5]; break;
    case CallKind::AllGather: out << "all_gather"; break;
    case CallKind::ReduceScatter: out << "reduce_scatter(" << reduce_op_name(op) << ")"; break;
    case CallKind::Barrier: out << "barrier"; break;
    default: out << "collective " << f[1]; break;
  }
  out << " #" << f[0];
  if (kind != CallKind::Barrier) {
    out << ", ";
    if (kind == CallKind::AllGather || kind == CallKind::ReduceScatter) out << f[5] << " x ";
    out << f[4] << " " << (f[3] < 0 ? "undefined" : dtype_name(static_cast<DType>(f[3])));
  }
  if (f[6] != 0) out << " for " << CollectivePurpose::describe(f[6]);
  return out.str();
}

// Note [Out of step]
// A mismatch fails the call on every rank, and no rank starts it. That alone does not put the
// ranks back in step: when one rank made a call the others did not (an extra all_reduce, a
// collective skipped after an exception), its later calls pair with the others' earlier ones,
// and only those that differ would be caught. A later pair that happens to agree (two
// all_reduces of one size) would reduce unrelated tensors, with no error. The table cannot
// tell an extra call from a different one. So after a mismatch the group refuses every later
// collective, on every rank, before any exchange: each rank fails the same calls (all those
// after the mismatched one in its own order), and nothing waits for a peer that will never
// pair. torch's checking wrapper (TORCH_DISTRIBUTED_DEBUG=DETAIL) makes no promise either way;
// its errors end the job.
// The same holds for a call every rank agreed on that could not start on this rank (its
// tensor on another device than the group's, no memory): the others started it, and this
// rank's next call would pair with it.
class OutOfStep {
 public:
  // Records the first reason, a clause: "the ranks called different ones as #k (rank 0: ...)".
  void record(const std::string& reason) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (reason_.empty()) reason_ = reason;
  }
  bool recorded() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return !reason_.empty();
  }
  // Throws the DistError that refuses the call `description` once a reason is recorded.
  void refuse(const std::string& description) const {
    std::string reason;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      reason = reason_;
    }
    NANODDP_CHECK(reason.empty(), DistError, description, ": not started: this group takes no more collectives since ",
                  reason,
                  ", after which the ranks' calls may no longer pair up (Note [Out of step] in "
                  "dist/process_group_checked.cpp); end the job (nanoddp-run --max-restarts starts it again)");
  }

 private:
  mutable std::mutex mutex_;
  std::string reason_;
};

// Starts a call every rank agreed on; a start that throws puts the group out of step.
std::shared_ptr<Work> start_agreed(const std::function<std::shared_ptr<Work>()>& start, OutOfStep& out_of_step,
                                   const std::vector<int64_t>& mine) {
  try {
    return start();
  } catch (const std::exception& e) {
    out_of_step.record("this rank could not start " + describe_call(mine.data()) +
                       ", which every rank agreed on and the others started (" + message_of(e) + ")");
    throw;
  }
}

// Throws the DistError every rank reports when the table (every rank's fingerprint, rank-major)
// holds one that differs from `mine`, after recording it in out_of_step; returns when all are
// the same.
void throw_on_mismatch(const std::string& description, const std::vector<int64_t>& mine,
                       const std::vector<int64_t>& table, OutOfStep& out_of_step) {
  const int world = static_cast<int>(table.size() / kFingerprintFields);
  bool same = true;
  for (int r = 0; r < world; ++r)
    same = same && std::equal(mine.begin(), mine.end(), table.begin() + r * kFingerprintFields);
  if (same) return;
  std::ostringstream calls;
  for (int r = 0; r < world; ++r)
    calls << (r ? "; " : "") << "rank " << r << ": " << describe_call(table.data() + r * kFingerprintFields);
  out_of_step.record("the ranks called different ones as #" + std::to_string(mine[0]) + " (" + calls.str() + ")");
  NANODDP_THROW(DistError, description, ": ranks called different collectives as #", mine[0], " (", calls.str(),
                "). Every rank must issue the same collectives in the same order, with the same sizes, "
                "dtypes and ops; none of these calls was started, and the group takes no more collectives: a "
                "rank that made one call more or fewer would pair its later calls with the others' (Note [Out "
                "of step] in dist/process_group_checked.cpp)");
}

class CheckedWork;

// What the group and its works share: the backend, and the calls not yet settled, oldest
// first (Note [Deferred check]).
struct CheckState {
  std::shared_ptr<ProcessGroup> inner;
  // Shared with the calls' guards, which run on the backend's or the check's thread.
  std::shared_ptr<OutOfStep> out_of_step = std::make_shared<OutOfStep>();
  std::mutex mutex;  // one caller at a time moves the queue
  std::deque<std::shared_ptr<CheckedWork>> unsettled;
  int64_t seq = 0;
  std::chrono::milliseconds timeout{};  // the group's: no wait through this group lasts longer
  std::string store_prefix;             // this group's keys in the store (Note [Naming the straggler])

  // Note [Naming the straggler]: " straggler: rank 1 never reached <call> ..." for the ranks that did
  // not say within kStragglerGrace that they reached call #mine[0], or "" (all did, or the
  // group has no store).
  std::string stragglers(const std::vector<int64_t>& mine);
  // Writes that this rank reached call #mine[0]; never throws. Returns false when the store
  // gave no reply in time (its server, rank 0's process, does not answer).
  bool say_reached(const std::vector<int64_t>& mine);

  // Moves the queue: issues the oldest call's fingerprints, settles it once they arrived,
  // and goes on with the next. until == null: never waits, stops at the first fingerprint
  // still in flight. Otherwise waits (up to timeout) on each fingerprint until `until` is
  // settled, then goes on without waiting. Held: mutex.
  void advance(const CheckedWork* until, std::chrono::milliseconds timeout);
};

// Rethrows the error a wait on call `mine` ended with (the current exception); a TimeoutError
// gains the ranks that never reached the call (Note [Naming the straggler]).
[[noreturn]] void rethrow_naming_stragglers(CheckState& state, const std::vector<int64_t>& mine) {
  try {
    throw;
  } catch (const TimeoutError& e) {
    const std::string named = state.stragglers(mine);
    if (named.empty()) throw;
    NANODDP_THROW(TimeoutError, message_of(e), ";", named);
  } catch (const DistError&) {
    // Failed here for another reason (the group aborted): not a straggler. A call the group
    // refused (Note [Out of step]) was never waited for by anyone, and says nothing.
    if (!state.out_of_step->recorded()) state.say_reached(mine);
    throw;
  }
}

// Work::wait's contract for a wait that failed (a timeout too): every later wait throws the
// same error at once, and the work counts as completed. Without it a backend would wait again
// (MPI: the whole timeout once more), or report success for a collective the group gave up on
// (Gloo, when the data arrived after the timeout).
class FailedWait {
 public:
  template <typename Wait>
  void run(Wait&& wait) {
    if (const std::exception_ptr earlier = error()) std::rethrow_exception(earlier);
    try {
      wait();
    } catch (const DistError&) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error_) error_ = std::current_exception();
      throw;
    }
  }
  bool failed() const { return error() != nullptr; }

 private:
  std::exception_ptr error() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return error_;
  }
  mutable std::mutex mutex_;  // threads may wait on one work
  std::exception_ptr error_;
};

class CheckedWork : public Work {
 public:
  CheckedWork(std::string description, std::vector<int64_t> mine,
              std::function<std::shared_ptr<Work>()> start, std::shared_ptr<CheckState> state)
      : description_(std::move(description)),
        mine_(std::move(mine)),
        start_(std::move(start)),
        state_(std::move(state)) {}

  void wait(std::chrono::milliseconds timeout) override {
    failed_wait_.run([&] {
      try {
        wait_for_call(timeout);
      } catch (const DistError&) {
        rethrow_naming_stragglers(*state_, mine_);
      }
    });
  }

  void wait_for_call(std::chrono::milliseconds timeout) {
    timeout = effective_wait_timeout(timeout, state_->timeout);
    const auto begin = std::chrono::steady_clock::now();
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      if (!settled_) state_->advance(this, timeout);
    }
    if (error_) std::rethrow_exception(error_);
    NANODDP_CHECK(settled_, DistError, description_,
                  ": the group was destroyed before this collective started");
    real_->wait(detail::timeout_left(timeout, begin));
  }

  bool is_completed() override {
    if (failed_wait_.failed()) return true;
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      state_->advance(nullptr, std::chrono::milliseconds(0));
      if (!settled_) return false;
    }
    return error_ != nullptr || real_ == nullptr || real_->is_completed();
  }

  // Issues the fingerprint all-gather, once (CheckState::mutex held).
  void exchange() {
    if (fingerprints_ || settled_) return;
    try {
      state_->out_of_step->refuse(description_);  // Note [Out of step]: before any exchange
    } catch (...) {
      fail(std::current_exception());
      return;
    }
    const int world = state_->inner->size();
    // The fingerprint lives on the backend's device (NCCL takes only its GPU's tensors; a CPU
    // group's stays on the host even when the collective's tensors are on a GPU).
    const Device device = state_->inner->device();
    try {
      Tensor send = Tensor::from_vector(mine_).to(device);
      // The all-gather's outputs are views of one table, which the host then reads in one copy.
      table_ = Tensor::empty({world * kFingerprintFields}, DType::Int64, device);
      std::vector<Tensor> received;
      for (int r = 0; r < world; ++r) received.push_back(table_.slice_view(r * kFingerprintFields, {kFingerprintFields}));
      fingerprints_ = state_->inner->all_gather(received, send);
      // The host reads the fingerprints, so their wait is the host's, with its TimeoutError,
      // also on NCCL, whose waits otherwise only order the device's stream (Note [NCCL
      // stream-ordered wait]).
      if (auto* on_device = dynamic_cast<detail::EventWork*>(fingerprints_.get()))
        on_device->set_waits(detail::EventWork::Waits::Host);
    } catch (...) {
      fail(naming_the_call(std::current_exception()));
    }
  }

  bool fingerprints_arrived() { return settled_ || (fingerprints_ && fingerprints_->is_completed()); }

  // Whether the exchange is over, however it ended; never throws.
  bool exchange_over() {
    try {
      return fingerprints_->is_completed();
    } catch (...) {
      return true;  // it ended in an error, which a wait rethrows
    }
  }

  // A wait that timed out on an exchange over by now: the fingerprints came just after the
  // deadline (MPI gives up on nothing) and are taken, or the exchange ended in the timeout or
  // an error, which is thrown again.
  void wait_for_fingerprints(std::chrono::milliseconds timeout) {
    try {
      fingerprints_->wait(timeout);
    } catch (const TimeoutError&) {
      if (!exchange_over()) throw;
      const std::exception_ptr timed_out = std::current_exception();
      try {
        fingerprints_->wait(std::chrono::milliseconds(1));
      } catch (const DistError&) {
        // Elsewhere an error that came just after the timeout is thrown again; on NCCL the
        // timeout aborted the exchange, which ends it too, and the timeout stays the error.
        if (dynamic_cast<detail::EventWork*>(fingerprints_.get()) == nullptr) throw;
        std::rethrow_exception(timed_out);
      }
    }
  }

  // Waits for the fingerprints, compares them and starts the collective, or records the
  // mismatch (CheckState::mutex held). TimeoutError leaves the call unsettled while the
  // exchange is still going: the queue may still see the peers arrive when a later call moves
  // it (this work's own wait throws its first error again: FailedWait). One that ended in
  // the timeout (shm gives up on it) settles the call with that error, so that is_completed()
  // and later calls, which look at it too, do not throw it.
  void settle(std::chrono::milliseconds timeout) {
    if (settled_) return;
    try {
      wait_for_fingerprints(timeout);
    } catch (const TimeoutError& e) {
      std::exception_ptr error;
      try {
        NANODDP_THROW(TimeoutError, description_, ": not every rank reached a collective to compare #",
                      mine_[0],
                      " with (a peer exited, is stuck, or issues fewer collectives): ", message_of(e));
      } catch (...) {
        error = std::current_exception();
      }
      if (!exchange_over()) std::rethrow_exception(error);
      fail(error);
      return;
    } catch (...) {
      fail(naming_the_call(std::current_exception()));
      return;
    }
    settled_ = true;
    const std::vector<int64_t> table = table_.to(Device::cpu()).to_int_vector();
    table_ = Tensor();
    fingerprints_ = nullptr;
    // On a mismatch no rank starts the call (Note [Out of step]); when the backend refuses the
    // call, this work's wait reports that.
    try {
      throw_on_mismatch(description_, mine_, table, *state_->out_of_step);
      real_ = start_agreed(start_, *state_->out_of_step, mine_);
    } catch (...) {
      error_ = std::current_exception();
    }
    start_ = nullptr;
  }

  bool settled() const { return settled_; }

 private:
  // The backend refused the fingerprint all-gather: the call is over, with that error.
  // The fingerprints' all_gather failed (a peer is gone, the group aborted): a DistError then
  // opens with the collective the caller issued, not only the check's own all_gather of int64s.
  std::exception_ptr naming_the_call(std::exception_ptr error) const {
    try {
      std::rethrow_exception(error);
    } catch (const TimeoutError&) {
      return error;
    } catch (const DistError& e) {
      try {
        NANODDP_THROW(DistError, description_, ", while comparing it with the other ranks' collective #",
                      mine_[0], ": ", message_of(e));
      } catch (...) {
        return std::current_exception();
      }
    } catch (...) {
      return error;
    }
  }

  void fail(std::exception_ptr error) {
    error_ = std::move(error);
    settled_ = true;
    start_ = nullptr;
    table_ = Tensor();
    fingerprints_ = nullptr;
  }

  std::string description_;
  std::vector<int64_t> mine_;
  std::function<std::shared_ptr<Work>()> start_;
  std::shared_ptr<CheckState> state_;
  Tensor table_;                        // every rank's fingerprint, rank-major, once they have arrived
  std::shared_ptr<Work> fingerprints_;  // in flight between exchange() and settle()
  bool settled_ = false;
  std::shared_ptr<Work> real_;  // the collective, once started
  std::exception_ptr error_;    // the mismatch, when there was one
  FailedWait failed_wait_;
};

// The fused path's work (Note [Fused collective check]): the backend's, with stragglers named.
class FusedWork : public Work {
 public:
  FusedWork(std::shared_ptr<Work> inner, std::vector<int64_t> mine, std::shared_ptr<CheckState> state)
      : inner_(std::move(inner)), mine_(std::move(mine)), state_(std::move(state)) {}
  void wait(std::chrono::milliseconds timeout) override {
    failed_wait_.run([&] {
      try {
        inner_->wait(effective_wait_timeout(timeout, state_->timeout));
      } catch (const DistError&) {
        rethrow_naming_stragglers(*state_, mine_);
      }
    });
  }
  bool is_completed() override { return failed_wait_.failed() || inner_->is_completed(); }

 private:
  FailedWait failed_wait_;
  std::shared_ptr<Work> inner_;
  std::vector<int64_t> mine_;
  std::shared_ptr<CheckState> state_;
};

// Note [Naming the straggler]
// A collective that times out names the waiting rank; the rank at fault is the one that did
// not come (stopped by SIGSTOP, stuck in a deadlock of its own, or on a slow disk): it is
// alive, so no connection closes and nothing else names it. So a rank whose wait on call #k
// timed out writes "reached" for #k into the store, and waits up to kStragglerGrace for every
// other rank's key: the ranks that reached #k time out within a moment of each other and
// write theirs. The ranks whose key is missing are named in the TimeoutError, with the call,
// and the first of them is reported to the launcher as the rank this one lost (Note
// [Launcher link]). The store's server runs in rank 0's process: when rank 0 is the one that
// stopped, the store gives no reply either. So a rank on rank 0's machine that finds it
// stopped (/proc) names it at once; elsewhere, a store that gives no reply to "reached" in
// time names rank 0, without the poll. A rank that dies is named by its closed connection or
// its gone pid, not here; MPI has no store, and its timeout names no straggler.
constexpr std::chrono::milliseconds kStragglerGrace{1000};

std::string reached_key(const std::string& prefix, int64_t seq) { return prefix + "reached/" + std::to_string(seq) + "/"; }

bool CheckState::say_reached(const std::vector<int64_t>& mine) {
  try {
    inner->store().set(reached_key(store_prefix, mine[0]) + std::to_string(inner->rank()), std::string("1"));
  } catch (const TimeoutError&) {
    return false;  // the server took the request and never answered
  } catch (const std::exception&) {
    // no store (MPI), or it is gone too: nobody can read it
  }
  return true;
}

std::string CheckState::stragglers(const std::vector<int64_t>& mine) {
  const int rank = inner->rank(), world = inner->size();
  bool server_stopped = false;
  try {
    server_stopped = rank != 0 && inner->store().server_stopped();
  } catch (const std::exception&) {
    // no store (MPI)
  }
  if (server_stopped) {
    report_lost_peer(rank, 0);
    return " straggler: rank 0, which serves the store, is stopped (SIGSTOP, Ctrl-Z or a debugger) and never "
           "reached " +
           describe_call(mine.data());
  }
  if (!say_reached(mine) && rank != 0) {
    report_lost_peer(rank, 0);
    return " straggler: rank 0 never reached " + describe_call(mine.data()) +
           ", and the store it serves gave no reply in time either: it is stopped, stuck, or slow";
  }
  std::vector<int> missing;
  bool polled = false;
  try {
    Store& store = inner->store();
    const std::string call = reached_key(store_prefix, mine[0]);
    const auto deadline = std::chrono::steady_clock::now() + std::min(kStragglerGrace, timeout);
    while (true) {
      std::vector<int> not_yet;
      for (int r = 0; r < world; ++r)
        if (r != rank && !store.check({call + std::to_string(r)})) not_yet.push_back(r);
      missing = std::move(not_yet);
      polled = true;
      if (missing.empty() || std::chrono::steady_clock::now() >= deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  } catch (const std::exception&) {
    // No store, or it went away during the grace: the rank that serves it timed out a moment
    // earlier, named the straggler and ended. The last complete look stands.
    if (!polled) return "";
  }
  if (missing.empty()) return "";
  report_lost_peer(rank, missing.front());
  std::ostringstream ranks;
  for (size_t i = 0; i < missing.size(); ++i) ranks << (i ? ", " : "") << missing[i];
  std::ostringstream text;
  text << " straggler: " << (missing.size() == 1 ? "rank " : "ranks ") << ranks.str() << " never reached "
       << describe_call(mine.data()) << " (the ranks waiting there said so in the store within "
       << std::min(kStragglerGrace, timeout).count() << " ms; " << (missing.size() == 1 ? "it" : "they")
       << " did not: stopped, stuck elsewhere, or slow)";
  return text.str();
}

void CheckState::advance(const CheckedWork* until, std::chrono::milliseconds timeout) {
  bool waiting = until != nullptr;
  while (!unsettled.empty()) {
    const std::shared_ptr<CheckedWork> work = unsettled.front();
    work->exchange();
    if (!waiting && !work->fingerprints_arrived()) return;
    work->settle(timeout);
    unsettled.pop_front();
    if (work.get() == until) waiting = false;
  }
}

std::atomic<int> next_checked_group_id{0};

class CheckedProcessGroup : public ProcessGroup {
 public:
  CheckedProcessGroup(std::shared_ptr<ProcessGroup> inner, std::chrono::milliseconds timeout,
                      std::shared_ptr<ProcessGroup> fingerprints)
      : ProcessGroup(inner->rank(), inner->size()) {
    state_->inner = std::move(inner);
    state_->timeout = detail::cap_timeout(timeout);  // Note [Long timeouts]
    if (fingerprints) {
      fingerprint_group_ = std::move(fingerprints);
      worker_ = std::make_unique<detail::StartWorker>("the collective check", detail::StartWorker::AtEnd::Drop);
    }
    // Checked groups are made in the same order on every rank: the count names the same one.
    state_->store_prefix = "check/" + std::to_string(next_checked_group_id++) + "/";
  }
  // Calls never waited on and not yet settled are dropped, never started (their works hold
  // the state: this also breaks that cycle).
  ~CheckedProcessGroup() override {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->unsettled.clear();
  }

  std::string backend_name() const override { return state_->inner->backend_name(); }
  Device device() const override { return state_->inner->device(); }
  Store& store() override { return state_->inner->store(); }
  Tensor new_collective_buffer(int64_t numel, DType dtype, Device device) override {
    return state_->inner->new_collective_buffer(numel, dtype, device);
  }
  std::string all_reduce_algorithm() const override { return state_->inner->all_reduce_algorithm(); }
  std::string all_reduce_algorithm_for(const Tensor& tensor) const override {
    return state_->inner->all_reduce_algorithm_for(tensor);
  }
  bool collectives_run_in_wait() const override { return state_->inner->collectives_run_in_wait(); }
  void issue_queued_point_to_point() override { state_->inner->issue_queued_point_to_point(); }
  MovedBytes moved_bytes() const override { return state_->inner->moved_bytes(); }

  // Arguments are checked here, at the call, as the backends do; the backend checks the device.
  std::shared_ptr<Work> all_reduce(Tensor& tensor, ReduceOp op) override {
    const std::string what = std::string("all_reduce(") + reduce_op_name(op) + ")";
    check_tensor(what, tensor, device_of(tensor));
    check_reduce(what, tensor, op);
    count_call(Collective::AllReduce, tensor);
    return checked(CallKind::AllReduce, what, tensor, static_cast<int64_t>(op), 0,
                   [inner = state_->inner, tensor, op]() mutable { return inner->all_reduce(tensor, op); });
  }
  std::shared_ptr<Work> broadcast(Tensor& tensor, int root) override {
    check_tensor("broadcast", tensor, device_of(tensor));
    NANODDP_CHECK(root >= 0 && root < world_size_, ValueError, describe("broadcast", tensor), ": root ", root,
                  " is not a rank of this group");
    count_call(Collective::Broadcast, tensor);
    return checked(
        CallKind::Broadcast, "broadcast from rank " + std::to_string(root), tensor, -1, root,
        [inner = state_->inner, tensor, root]() mutable { return inner->broadcast(tensor, root); });
  }
  std::shared_ptr<Work> all_gather(std::vector<Tensor>& outputs, const Tensor& input) override {
    check_tensor("all_gather", input, device_of(input));
    check_list("all_gather", outputs, input);
    count_call(Collective::AllGather, input);
    return checked(
        CallKind::AllGather, "all_gather", input, -1, static_cast<int64_t>(outputs.size()),
        [inner = state_->inner, outputs, input]() mutable { return inner->all_gather(outputs, input); });
  }
  std::shared_ptr<Work> reduce_scatter(Tensor& output, const std::vector<Tensor>& inputs,
                                       ReduceOp op) override {
    const std::string what = std::string("reduce_scatter(") + reduce_op_name(op) + ")";
    check_tensor(what, output, device_of(output));
    check_reduce(what, output, op);
    check_list(what, inputs, output);
    count_call(Collective::ReduceScatter, output);
    return checked(CallKind::ReduceScatter, what, output, static_cast<int64_t>(op),
                   static_cast<int64_t>(inputs.size()),
                   [inner = state_->inner, output, inputs, op]() mutable {
                     return inner->reduce_scatter(output, inputs, op);
                   });
  }
  std::shared_ptr<Work> barrier() override {
    count_call(Collective::Barrier);
    return checked(CallKind::Barrier, "barrier", Tensor(), -1, 0,
                   [inner = state_->inner] { return inner->barrier(); });
  }
  // Point-to-point is between two ranks, not a collective: no fingerprint, straight through.
  std::shared_ptr<Work> send(const Tensor& tensor, int dst, int tag) override {
    return state_->inner->send(tensor, dst, tag);
  }
  std::shared_ptr<Work> recv(Tensor& tensor, int src, int tag) override {
    return state_->inner->recv(tensor, src, tag);
  }

 private:
  static Device device_of(const Tensor& t) { return t.defined() ? t.device() : Device::cpu(); }

  // Note [Deferred check]: queues the call and moves the queue without waiting; the
  // comparison and the collective itself start as soon as the fingerprints are there.
  std::shared_ptr<Work> checked(CallKind kind, const std::string& what, const Tensor& tensor, int64_t op,
                                int64_t extra, std::function<std::shared_ptr<Work>()> start) {
    if (world_size_ == 1) return start();
    std::lock_guard<std::mutex> lock(state_->mutex);
    // Taken once the call is queued: a call that fails before leaves the ranks in step.
    const int64_t seq = state_->seq + 1;
    std::vector<int64_t> mine = {seq,
                                 static_cast<int64_t>(kind),
                                 op,
                                 tensor.defined() ? static_cast<int64_t>(tensor.dtype()) : -1,
                                 tensor.defined() ? tensor.numel() : 0,
                                 extra,
                                 CollectivePurpose::current()};
    const std::string description = describe(what, tensor);
    const auto guard = [&] {
      return CollectiveGuard{
          mine,
          [description, mine, out_of_step = state_->out_of_step](const std::vector<int64_t>& table) {
            throw_on_mismatch(description, mine, table, *out_of_step);
          },
          [description, out_of_step = state_->out_of_step] { out_of_step->refuse(description); }};
    };
    // Note [Host fingerprints]: the worker exchanges and starts; the send/recv the backend holds
    // back go out now, as at any collective's call.
    if (worker_) {
      state_->inner->issue_queued_point_to_point();
      detail::StartWorker::Call call;
      call.before = [fingerprints = fingerprint_group_, guard = guard(), description, timeout = state_->timeout] {
        guard.refuse();
        guard.verify(all_gather_fingerprints(*fingerprints, guard.fingerprint, description, timeout));
      };
      call.start = [start = std::move(start), out_of_step = state_->out_of_step, mine] {
        const detail::CollectiveCalledEarlier called_earlier;
        return start_agreed(start, *out_of_step, mine);
      };
      call.description = description;
      call.still_before =
          "the collective check was still comparing it with the other ranks' calls, or starting it (a peer may "
          "have exited, be stuck, or issue fewer collectives)";
      auto started = worker_->queue(std::move(call));
      state_->seq = seq;
      return std::make_shared<FusedWork>(std::move(started), std::move(mine), state_);
    }
    // Note [Fused collective check]. Nothing is ever queued here on such a backend.
    if (state_->unsettled.empty()) {
      if (auto fused = state_->inner->start_guarded(guard(), start)) {
        state_->seq = seq;
        return std::make_shared<FusedWork>(std::move(fused), std::move(mine), state_);
      }
    }
    auto work = std::make_shared<CheckedWork>(description, std::move(mine), std::move(start), state_);
    state_->unsettled.push_back(work);
    state_->seq = seq;
    state_->advance(nullptr, std::chrono::milliseconds(0));
    return work;
  }

  std::shared_ptr<CheckState> state_ = std::make_shared<CheckState>();
  // With a fingerprint group (Note [Host fingerprints]): every call goes through the worker,
  // whose exchanges hold the group until they end.
  std::shared_ptr<ProcessGroup> fingerprint_group_;
  std::unique_ptr<detail::StartWorker> worker_;
};

}  // namespace

namespace {
thread_local bool collective_called_earlier = false;
}  // namespace

detail::CollectiveCalledEarlier::CollectiveCalledEarlier() : previous_(collective_called_earlier) {
  collective_called_earlier = true;
}

detail::CollectiveCalledEarlier::~CollectiveCalledEarlier() { collective_called_earlier = previous_; }

bool detail::CollectiveCalledEarlier::active() { return collective_called_earlier; }

CollectivePurpose::CollectivePurpose(Kind kind, size_t index) : previous_(current_purpose) {
  current_purpose = (static_cast<int64_t>(kind) << 32) | static_cast<int64_t>(index & 0xffffffffu);
}

CollectivePurpose::~CollectivePurpose() { current_purpose = previous_; }

int64_t CollectivePurpose::current() { return current_purpose; }

std::string CollectivePurpose::describe(int64_t code) {
  if (code == 0) return "";
  const int64_t index = code & 0xffffffff;
  switch (static_cast<Kind>(code >> 32)) {
    case Kind::FsdpUnit:
      return "FSDP unit " + std::to_string(index);
    case Kind::DdpBucket:
      return "DDP bucket " + std::to_string(index);
    case Kind::FsdpStateDict:
      return "FSDP unit " + std::to_string(index) + "'s state dict";
    case Kind::FsdpLoadStateDict:
      return "FSDP unit " + std::to_string(index) + "'s state dict load";
    case Kind::FsdpOptimState:
      return "FSDP unit " + std::to_string(index) + "'s optimizer state";
    case Kind::ZeroConsolidate:
      return "ZeroRedundancyOptimizer.consolidate_state_dict";
    case Kind::ZeroLoad:
      return "ZeroRedundancyOptimizer.load_state_dict";
    case Kind::Join:
      return index == 0 ? "Join's count of ranks still training" : "Join's check for ranks that ran out";
    case Kind::GradScalerUnscale:
      return "GradScaler.unscale_'s inf/NaN check";
    case Kind::FsdpLoadCheck:
      return "FullyShardedDataParallel.load_full_state_dict's check";
  }
  return "purpose " + std::to_string(code);
}

std::shared_ptr<ProcessGroup> make_checked_process_group(std::shared_ptr<ProcessGroup> inner,
                                                         std::chrono::milliseconds timeout,
                                                         std::shared_ptr<ProcessGroup> fingerprint_group) {
  NANODDP_CHECK(inner != nullptr, ValueError, "make_checked_process_group: no group");
  if (fingerprint_group) {
    NANODDP_CHECK(fingerprint_group->device() == Device::cpu() && fingerprint_group->rank() == inner->rank() &&
                      fingerprint_group->size() == inner->size(),
                  ValueError, "make_checked_process_group: the fingerprint group (", fingerprint_group->backend_name(),
                  ", rank ", fingerprint_group->rank(), "/", fingerprint_group->size(), " on ",
                  fingerprint_group->device(), ") is not a CPU group of the checked group's ranks (rank ",
                  inner->rank(), "/", inner->size(), ")");
    NANODDP_CHECK(!inner->collectives_run_in_wait(), ValueError, "make_checked_process_group: a ",
                  inner->backend_name(),
                  " group runs its collectives and send/recv in one order, in the waiting thread: its "
                  "collectives cannot be started later by the check's thread, so its fingerprints go "
                  "through the group itself (no fingerprint group)");
  }
  return std::make_shared<CheckedProcessGroup>(std::move(inner), timeout, std::move(fingerprint_group));
}

}  // namespace nanoddp::dist
