// The collective check's own thread, for a group whose fingerprints travel through a CPU group
// beside it (Note [Host fingerprints] in dist/process_group_checked.cpp). Internal.
//
//   CheckWorker worker(fingerprint_group, timeout);
//   auto work = worker.start_guarded(guard, [nccl, t]() mutable { return nccl->all_reduce(t); }, description);
//   work->wait();  // the fingerprints agreed and the all_reduce was started on the worker
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "dist/process_group.h"

namespace nanoddp::dist::detail {

class CheckWorker {
 public:
  // fingerprints: a CPU group of the checked group's ranks, used by this worker only; every
  // exchange waits for the peers up to timeout. Throws DistError when no thread can be had.
  CheckWorker(std::shared_ptr<ProcessGroup> fingerprints, std::chrono::milliseconds timeout);
  // Never waits for the peers: calls not begun fail (their waits throw DistError), and one whose
  // exchange is under way is never started here (a peer whose exchange ended first may have
  // started it: its group's end then waits for that collective up to the timeout, as for any
  // collective a rank left behind). The start of that call, and the backend it holds, go here;
  // the thread is left to end by itself once the exchange has ended (the peers reached it, one
  // was lost, or the timeout passed), holding the fingerprint group, and with it the store,
  // until then.
  ~CheckWorker();
  CheckWorker(const CheckWorker&) = delete;
  CheckWorker& operator=(const CheckWorker&) = delete;

  // Queues, behind every earlier call: all-gather guard.fingerprint through the fingerprint
  // group, guard.verify the table, then start() (which issues the collective) with
  // CollectiveCalledEarlier and the caller's memory category alive on the worker. Returns at
  // once. The Work's wait(timeout) waits for that much to happen, then for start()'s Work (a
  // stream-ordered NCCL wait is given the whole timeout: its watchdog counts from the launch).
  // It throws what the exchange, verify or start threw (TimeoutError when the peers did not
  // come), or TimeoutError of its own when timeout passes first. description names the call in
  // errors.
  std::shared_ptr<Work> start_guarded(CollectiveGuard guard, std::function<std::shared_ptr<Work>()> start,
                                      std::string description);

 private:
  struct Shared;
  std::shared_ptr<Shared> shared_;  // with the thread, which may outlive this object
  std::thread thread_;
};

}  // namespace nanoddp::dist::detail
