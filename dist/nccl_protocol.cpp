#include "dist/nccl_protocol.h"

#include <cstdio>
#include <thread>

#include "core/error.h"

namespace nanoddp::dist::detail {

namespace {

using Clock = std::chrono::steady_clock;

// Between two polls of NCCL or of an event: short next to a collective, long next to the poll.
constexpr auto kPollInterval = std::chrono::microseconds(20);

}  // namespace

void issue_and_wait_enqueued(AsyncComm& comm, const std::string& what, std::chrono::milliseconds timeout,
                             const std::function<AsyncState(std::string* error)>& issue) {
  NANODDP_CHECK(!comm.aborted(), DistError, what, ": the communicator was aborted after an earlier timeout or error");
  // Step 1.
  std::string error;
  const AsyncState issued = issue(&error);
  NANODDP_CHECK(issued != AsyncState::Failed, DistError, what, ": ", error);
  if (issued == AsyncState::Done) return;
  // Step 2.
  const auto deadline = Clock::now() + timeout;
  while (true) {
    const AsyncState state = comm.state(&error);
    if (state == AsyncState::Done) return;
    if (state == AsyncState::Failed) {
      comm.abort();
      NANODDP_THROW(DistError, what, ": NCCL reported ", error, " while the call was in progress; the communicator "
                    "was aborted");
    }
    if (Clock::now() > deadline) {
      comm.abort();
      NANODDP_THROW(TimeoutError, what, ": NCCL still reported the call in progress after ", timeout.count(),
                    " ms; the communicator was aborted");
    }
    std::this_thread::sleep_for(kPollInterval);
  }
}

EventWork::EventWork(std::string what, std::shared_ptr<AsyncComm> comm, Event event, std::vector<Tensor> keep_alive,
                     std::chrono::milliseconds release_timeout)
    : what_(std::move(what)),
      comm_(std::move(comm)),
      event_(std::move(event)),
      keep_alive_(std::move(keep_alive)),
      release_timeout_(release_timeout) {}

EventWork::~EventWork() {
  if (completed_ || keep_alive_.empty()) return;
  try {
    const auto deadline = Clock::now() + release_timeout_;
    std::string error;
    // An aborted communicator runs no kernel any more; a failed event means the device is gone.
    while (!comm_->aborted() && event_.query(&error) == AsyncState::InProgress) {
      if (comm_->state(&error) == AsyncState::Failed) {
        comm_->abort();
        break;
      }
      if (Clock::now() > deadline) {
        std::fprintf(stderr,
                     "nanoddp: %s was dropped without wait() and had not finished after %lld ms; aborting the "
                     "NCCL communicator before its tensors are freed\n",
                     what_.c_str(), static_cast<long long>(release_timeout_.count()));
        comm_->abort();
        break;
      }
      std::this_thread::sleep_for(kPollInterval);
    }
  } catch (...) {
    // Destructors never throw; the checks above only call into the library.
  }
}

void EventWork::wait(std::chrono::milliseconds timeout) {
  if (completed_) return;
  NANODDP_CHECK(!comm_->aborted(), DistError, what_,
                ": the communicator was aborted after an earlier timeout or error; this work did not finish");
  if (!ordered_) {
    event_.order_compute_stream();
    ordered_ = true;
  }
  const auto deadline = Clock::now() + timeout;
  std::string error;
  while (!is_completed()) {
    if (comm_->state(&error) == AsyncState::Failed) {
      comm_->abort();
      NANODDP_THROW(DistError, what_, ": NCCL reported ", error, "; the communicator was aborted");
    }
    if (Clock::now() > deadline) {
      comm_->abort();
      NANODDP_THROW(TimeoutError, what_, ": did not complete within ", timeout.count(),
                    " ms (a peer may have exited or be out of step); the communicator was aborted");
    }
    std::this_thread::sleep_for(kPollInterval);
  }
  keep_alive_.clear();
}

bool EventWork::is_completed() {
  if (completed_) return true;
  std::string error;
  const AsyncState state = event_.query(&error);
  if (state == AsyncState::Failed) {
    comm_->abort();
    NANODDP_THROW(DistError, what_, ": the device reported ", error, "; the communicator was aborted");
  }
  completed_ = state == AsyncState::Done;
  return completed_;
}

}  // namespace nanoddp::dist::detail
