#include "dist/check_worker.h"

#include <algorithm>
#include <exception>
#include <utility>

#include "core/error.h"
#include "dist/deadline.h"
#include "dist/shm_fingerprints.h"

namespace nanoddp::dist::detail {

namespace {

// How one queued call ended, shared by the worker and the call's Work.
struct Outcome {
  std::mutex mutex;
  std::condition_variable done_cv;
  bool done = false;
  std::shared_ptr<Work> started;  // the collective, once the fingerprints agreed
  std::exception_ptr error;       // or why it was not started

  void finish(std::shared_ptr<Work> work, std::exception_ptr failure) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      started = std::move(work);
      error = std::move(failure);
      done = true;
    }
    done_cv.notify_all();
  }
};

class GuardedWork : public Work {
 public:
  GuardedWork(std::string description, std::shared_ptr<Outcome> outcome)
      : description_(std::move(description)), outcome_(std::move(outcome)) {}

  void wait(std::chrono::milliseconds timeout) override {
    const auto begin = std::chrono::steady_clock::now();
    std::shared_ptr<Work> started;
    {
      std::unique_lock<std::mutex> lock(outcome_->mutex);
      const bool done =
          outcome_->done_cv.wait_until(lock, deadline_after(timeout, begin), [&] { return outcome_->done; });
      NANODDP_CHECK(done, TimeoutError, description_, ": did not start within ", timeout.count(),
                    " ms: the collective check still waits for the other ranks to reach it (a peer may have "
                    "exited, be stuck, or issue fewer collectives)");
      if (outcome_->error) std::rethrow_exception(outcome_->error);
      started = outcome_->started;
    }
    const auto spent = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - begin);
    // At least 1 ms: 0 would mean the group's whole timeout (effective_wait_timeout).
    started->wait(std::max(timeout - spent, std::chrono::milliseconds(1)));
  }

  bool is_completed() override {
    std::shared_ptr<Work> started;
    {
      std::lock_guard<std::mutex> lock(outcome_->mutex);
      if (!outcome_->done) return false;
      if (outcome_->error) return true;
      started = outcome_->started;
    }
    return started->is_completed();
  }

 private:
  std::string description_;
  std::shared_ptr<Outcome> outcome_;
};

}  // namespace

struct CheckWorker::Task {
  CollectiveGuard guard;
  std::function<std::shared_ptr<Work>()> start;
  std::string description;
  std::shared_ptr<Outcome> outcome;
};

CheckWorker::CheckWorker(std::shared_ptr<ProcessGroup> fingerprints, std::chrono::milliseconds timeout)
    : fingerprints_(std::move(fingerprints)), timeout_(timeout), thread_([this] { run(); }) {}

CheckWorker::~CheckWorker() {
  std::deque<Task> dropped;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    dropped.swap(queue_);
  }
  wake_.notify_all();
  for (Task& task : dropped) {
    try {
      NANODDP_THROW(DistError, task.description, ": the process group was destroyed before this collective started");
    } catch (...) {
      task.outcome->finish(nullptr, std::current_exception());
    }
  }
  thread_.join();
}

std::shared_ptr<Work> CheckWorker::start_guarded(CollectiveGuard guard, std::function<std::shared_ptr<Work>()> start,
                                                 std::string description) {
  auto outcome = std::make_shared<Outcome>();
  auto work = std::make_shared<GuardedWork>(description, outcome);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(Task{std::move(guard), std::move(start), std::move(description), std::move(outcome)});
  }
  wake_.notify_one();
  return work;
}

void CheckWorker::run() {
  while (true) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and nothing left
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    std::shared_ptr<Work> started;
    std::exception_ptr error;
    try {
      const std::vector<int64_t> table =
          all_gather_fingerprints(*fingerprints_, task.guard.fingerprint, task.description, timeout_);
      task.guard.verify(table);
      started = task.start();
    } catch (...) {
      error = std::current_exception();
    }
    task.start = nullptr;  // its tensors go with it, here rather than when the Work goes
    task.outcome->finish(std::move(started), std::move(error));
  }
}

}  // namespace nanoddp::dist::detail
