// A thread that starts calls in the order they were queued, each once what it waits for is
// there: the collective check's fingerprints (Note [Host fingerprints] in
// dist/process_group_checked.cpp), or a staged collective's copy to host memory (Note
// [Staging without a host wait] in dist/host_staging.cpp). Internal.
//
//   StartWorker worker("the collective check", StartWorker::AtEnd::Drop);
//   auto work = worker.queue({[group, mine] { exchange(*group, mine); },
//                             [nccl, t]() mutable { return nccl->all_reduce(t); },
//                             "all_reduce(sum) #3", "the collective check was still comparing it"});
//   work->wait(timeout);  // before() returned and the all_reduce was started on the worker
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "dist/process_group.h"

namespace nanoddp::dist::detail {

class StartWorker {
 public:
  struct Call {
    // Runs on the worker; may wait, for a bounded time (the peers, the device); what it throws
    // fails the call, which is then not started.
    std::function<void()> before;
    std::function<std::shared_ptr<Work>()> start;  // issues the call on the backend
    std::string description;                      // names the call in errors
    std::string still_before;  // what a wait that times out before the start says was under way
  };

  // What the worker's end does with the calls it holds.
  enum class AtEnd {
    // Never waits for a before() under way (one that waits for the peers): queued calls not
    // begun fail (their waits throw DistError), and the one whose before() runs is never
    // started here (a peer whose exchange ended first may have started it: its group's end then
    // waits for that collective up to the timeout, as for any collective a rank left behind).
    // The start of that call, and the backend it holds, go here; the thread is left to end by
    // itself once before() has returned, holding what before() holds until then. Otherwise the
    // thread is joined.
    Drop,
    // Starts every call queued, each after its before() (which must wait for nothing but this
    // process: the device), then joins the thread: the backend's own end deals with them as
    // with any call made before it.
    Finish,
  };

  // owner names what the thread is for, in the error when none can be had (DistError).
  StartWorker(const std::string& owner, AtEnd at_end);
  ~StartWorker();
  StartWorker(const StartWorker&) = delete;
  StartWorker& operator=(const StartWorker&) = delete;

  // Queues call behind every earlier one and returns at once. On the worker: call.before(),
  // then call.start() with the caller's memory category. The Work's wait(timeout) waits for
  // that much to happen, then for start()'s Work (a stream-ordered NCCL wait is given the
  // whole timeout: its watchdog counts from the launch). It throws what before() or start()
  // threw, or TimeoutError of its own when timeout passes before the start. Give it a timeout
  // already made effective (effective_wait_timeout): 0 here is no time at all.
  std::shared_ptr<Work> queue(Call call);

  // True when nothing is queued or in hand: a call issued now straight to the backend comes
  // after every call queued here. Only the thread that queues may rely on it.
  bool idle() const;

 private:
  struct Shared;
  std::shared_ptr<Shared> shared_;  // with the thread, which may outlive this object
  std::thread thread_;
};

}  // namespace nanoddp::dist::detail
