// The collective check's own thread, for a group whose fingerprints travel through a CPU group
// beside it (Note [Host fingerprints] in dist/process_group_checked.cpp). Internal.
//
//   CheckWorker worker(fingerprint_group, timeout);
//   auto work = worker.start_guarded(guard, [&] { return nccl->all_reduce(t); }, description);
//   work->wait();  // the fingerprints agreed and the all_reduce was started on the worker
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "dist/process_group.h"

namespace nanoddp::dist::detail {

class CheckWorker {
 public:
  // fingerprints: a CPU group of the checked group's ranks, used by this worker only; every
  // exchange waits for the peers up to timeout.
  CheckWorker(std::shared_ptr<ProcessGroup> fingerprints, std::chrono::milliseconds timeout);
  // Calls queued and not begun fail (their waits throw DistError); one under way is waited
  // for: its exchange ends when the peers reach it, when one is lost, or at the timeout.
  ~CheckWorker();
  CheckWorker(const CheckWorker&) = delete;
  CheckWorker& operator=(const CheckWorker&) = delete;

  // Queues, behind every earlier call: all-gather guard.fingerprint through the fingerprint
  // group, guard.verify the table, then start() (which issues the collective). Returns at once.
  // The Work's wait(timeout) waits for that much to happen, then for start()'s Work; it throws
  // what the exchange, verify or start threw (TimeoutError when the peers did not come), or
  // TimeoutError of its own when timeout passes first. description names the call in errors.
  std::shared_ptr<Work> start_guarded(CollectiveGuard guard, std::function<std::shared_ptr<Work>()> start,
                                      std::string description);

 private:
  struct Task;
  void run();

  std::shared_ptr<ProcessGroup> fingerprints_;
  std::chrono::milliseconds timeout_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Task> queue_;  // guarded by mutex_
  bool stopping_ = false;   // guarded by mutex_
  std::thread thread_;      // last: started once the rest is built
};

}  // namespace nanoddp::dist::detail
