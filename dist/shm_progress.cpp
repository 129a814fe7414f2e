// How the shared-memory group's works progress: on the thread that waits, in issue order.
//
// Note [Shm progress]
// A collective or send/recv returns its Work at once and runs when some wait() needs it, on
// the waiting thread (as MPI without a progress thread: "the collective moves only while
// some rank sits in an MPI call"). wait() runs the pending works in issue order: a collective
// runs to its end before anything after it, so works complete in the order issued; sends and
// receives issued before it progress together, piece by piece, so that an exchange (rank 0
// sends to 1 while 1 sends to 0) does not deadlock on full slots. On a CPU there is no
// overlap to win by a thread of our own (it would take its cycles from backward's cores),
// and not having one is what keeps a small all-reduce in microseconds
// (Note [Gloo worker thread] is the other side of that).
// is_completed() does not run anything: it reports, and stays false until some wait() ran it.
// When the group ends, the works still pending fail (ShmEngine::drop_pending): a Work dropped
// unwaited never ran, and its peers learn it by their own timeout or the lost connection.
#include "dist/shm_progress.h"

#include "core/error.h"
#include "dist/deadline.h"

namespace nanoddp::dist::shm {

std::shared_ptr<Work> ShmEngine::issue(std::shared_ptr<ShmEngine> self, std::string description, int peer,
                                       std::function<bool(Clock::time_point)> step) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (failure_) {
    try {
      std::rethrow_exception(failure_);
    } catch (const std::exception& e) {
      NANODDP_THROW(DistError, description,
                    ": the group is unusable after an earlier error: ", message_of(e));
    }
  }
  auto work = std::make_shared<ShmWork>(std::move(self), std::move(description), peer, std::move(step));
  pending_.push_back(work);
  return work;
}

void ShmEngine::run_until(ShmWork& target, std::chrono::milliseconds timeout) {
  const auto deadline = detail::deadline_after(timeout);
  std::lock_guard<std::mutex> lock(mutex_);
  try {
    segment_->wait_timeout = timeout;
    while (!target.done_) {
      const uint32_t rings = segment_->rings();
      bool progressed = false;
      for (auto& work : pending_) {
        if (work->done_) continue;
        if (work->collective_) {
          if (work == first_unfinished()) {
            work->step_(deadline);
            finish(*work);
            progressed = true;
          }
          break;  // nothing after a collective starts before it has finished
        }
        if (work->step_(deadline)) {
          finish(*work);
          progressed = true;
        }
      }
      while (!pending_.empty() && pending_.front()->done_) pending_.pop_front();
      if (!progressed && !target.done_) segment_->doze(rings, target.peer_, deadline, target.description_);
    }
  } catch (...) {
    // The group is out of step now: every unfinished work fails with this error.
    failure_ = std::current_exception();
    for (auto& work : pending_) {
      if (work->done_) continue;
      work->error_ = failure_;
      finish(*work);
    }
    pending_.clear();
  }
}

void ShmEngine::drop_pending() noexcept {
  std::deque<std::shared_ptr<ShmWork>> dropped;  // their tensors go outside the lock
  try {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto destroyed = std::make_exception_ptr(
        DistError("shm: the process group was destroyed before this work ran (a Work runs when it, or a later "
                  "one, is waited on)"));
    for (auto& work : pending_) {
      if (work->done_) continue;
      work->error_ = destroyed;
      finish(*work);
    }
    dropped.swap(pending_);
  } catch (...) {
    // No memory for the error: the works stay pending (and held) until the engine goes.
  }
}

bool ShmEngine::done(const ShmWork& work) {
  std::lock_guard<std::mutex> lock(mutex_);
  return work.done_;
}

std::shared_ptr<ShmWork> ShmEngine::first_unfinished() {
  for (auto& work : pending_)
    if (!work->done_) return work;
  return nullptr;
}

void ShmEngine::finish(ShmWork& work) {
  work.done_ = true;
  work.step_ = nullptr;  // lets go of the tensors
}

void ShmWork::wait(std::chrono::milliseconds timeout) {
  if (!engine_->done(*this)) engine_->run_until(*this, effective_wait_timeout(timeout, engine_->timeout()));
  // This work's own error, or the earlier one that left the group out of step.
  if (error_) std::rethrow_exception(error_);
}

bool ShmWork::is_completed() { return engine_->done(*this); }

}  // namespace nanoddp::dist::shm
