#include "dist/start_worker.h"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>
#include <utility>

#include "core/error.h"
#include "core/memory.h"
#include "dist/deadline.h"
#include "dist/nccl_protocol.h"

namespace nanoddp::dist::detail {

namespace {

// How one queued call ended, shared by the worker and the call's Work.
struct Outcome {
  std::mutex mutex;
  std::condition_variable done_cv;
  bool done = false;
  std::shared_ptr<Work> started;  // the call, once before() has returned
  std::exception_ptr error;       // what ended the call instead: before() or start() threw

  void finish(std::shared_ptr<Work> work, std::exception_ptr failure) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      started = std::move(work);
      error = std::move(failure);
      done = true;
    }
    done_cv.notify_all();
  }
  void fail_destroyed(const std::string& description) {
    try {
      NANODDP_THROW(DistError, description, ": the process group was destroyed before this collective started");
    } catch (...) {
      finish(nullptr, std::current_exception());
    }
  }
};

class GuardedWork : public Work {
 public:
  GuardedWork(std::string description, std::string still_before, std::shared_ptr<Outcome> outcome)
      : description_(std::move(description)), still_before_(std::move(still_before)), outcome_(std::move(outcome)) {}

  void wait(std::chrono::milliseconds timeout) override {
    const auto begin = std::chrono::steady_clock::now();
    std::shared_ptr<Work> started;
    {
      std::unique_lock<std::mutex> lock(outcome_->mutex);
      const bool done =
          outcome_->done_cv.wait_until(lock, deadline_after(timeout, begin), [&] { return outcome_->done; });
      NANODDP_CHECK(done, TimeoutError, description_, ": not started within ", timeout.count(), " ms: ",
                    still_before_);
      if (outcome_->error) std::rethrow_exception(outcome_->error);
      started = outcome_->started;
    }
    // A stream-ordered NCCL wait does not block the host: its timeout is the watchdog's
    // deadline, counted from the launch (Work::wait), not what before() left of this one.
    const auto* on_device = dynamic_cast<const EventWork*>(started.get());
    if (on_device != nullptr && on_device->waits() == EventWork::Waits::StreamOrdered) {
      started->wait(timeout);
      return;
    }
    started->wait(timeout_left(timeout, begin));
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
  std::string still_before_;
  std::shared_ptr<Outcome> outcome_;
};

}  // namespace

struct StartWorker::Shared {
  struct Task {
    Call call;
    std::shared_ptr<Outcome> outcome;
    MemoryCategory category = MemoryCategory::Other;  // the caller's, for the call's temporaries
  };

  AtEnd at_end = AtEnd::Drop;
  mutable std::mutex mutex;
  std::condition_variable wake;
  std::deque<Task> queue;  // guarded by mutex
  bool stopping = false;   // guarded by mutex
  bool in_hand = false;    // guarded by mutex: a task is between the queue and the return of its start
  bool before_running = false;  // guarded by mutex: the task in hand is in its before()
  // The start of the task in hand, guarded by mutex: the worker's end takes it, so that the
  // backend it holds goes with its owner, not with a thread left to end by itself.
  std::function<std::shared_ptr<Work>()> in_hand_start;

  void run() {
    while (true) {
      Task task;
      {
        std::unique_lock<std::mutex> lock(mutex);
        wake.wait(lock, [&] { return stopping || !queue.empty(); });
        if (queue.empty()) return;  // stopping, and nothing left
        task = std::move(queue.front());
        queue.pop_front();
        in_hand_start = std::move(task.call.start);
        in_hand = true;
        before_running = true;
      }
      std::exception_ptr error;
      try {
        if (task.call.before) task.call.before();
      } catch (...) {
        error = std::current_exception();
      }
      task.call.before = nullptr;  // what it holds goes here, before the start
      std::function<std::shared_ptr<Work>()> start;
      {
        std::lock_guard<std::mutex> lock(mutex);
        start = std::move(in_hand_start);
        in_hand_start = nullptr;
        before_running = false;
      }
      std::shared_ptr<Work> started;
      const bool dropped = !error && !start;  // the owner ended meanwhile: never started
      if (!error && start) {
        try {
          const MemoryCategoryScope category(task.category);
          started = start();
        } catch (...) {
          error = std::current_exception();
        }
      }
      start = nullptr;  // its tensors go with it, here rather than when the Work goes
      {
        // Idle before the caller hears: a call it makes once its wait returns may go straight
        // to the backend, after this one.
        std::lock_guard<std::mutex> lock(mutex);
        in_hand = false;
      }
      if (dropped)
        task.outcome->fail_destroyed(task.call.description);
      else
        task.outcome->finish(std::move(started), std::move(error));
    }
  }
};

StartWorker::StartWorker(const std::string& owner, AtEnd at_end) : shared_(std::make_shared<Shared>()) {
  shared_->at_end = at_end;
  try {
    thread_ = std::thread([shared = shared_] { shared->run(); });
  } catch (const std::system_error& e) {
    NANODDP_THROW(DistError, owner, " could not start its thread: ", e.what());
  }
}

StartWorker::~StartWorker() {
  if (shared_->at_end == AtEnd::Finish) {
    {
      std::lock_guard<std::mutex> lock(shared_->mutex);
      shared_->stopping = true;  // run() empties the queue first
    }
    shared_->wake.notify_all();
    thread_.join();
    return;
  }
  std::deque<Shared::Task> dropped;
  std::function<std::shared_ptr<Work>()> in_hand;  // let go of here, after the lock
  bool before_running = false;
  {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    shared_->stopping = true;
    dropped.swap(shared_->queue);
    in_hand = std::move(shared_->in_hand_start);
    shared_->in_hand_start = nullptr;
    // Left to end by itself only while a before() may wait (for the peers, the device).
    // Otherwise it ends soon (a start issues, and waits for no peer), and joined it lets go of
    // what the calls hold here.
    before_running = shared_->before_running;
  }
  shared_->wake.notify_all();
  for (Shared::Task& task : dropped) task.outcome->fail_destroyed(task.call.description);
  if (before_running)
    thread_.detach();
  else
    thread_.join();
}

std::shared_ptr<Work> StartWorker::queue(Call call) {
  auto outcome = std::make_shared<Outcome>();
  auto work = std::make_shared<GuardedWork>(call.description, call.still_before, outcome);
  {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    shared_->queue.push_back(Shared::Task{std::move(call), outcome, current_memory_category()});
  }
  shared_->wake.notify_one();
  return work;
}

bool StartWorker::idle() const {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  return shared_->queue.empty() && !shared_->in_hand;
}

}  // namespace nanoddp::dist::detail
