// The shared-memory group's works and what moves them: ShmWork, the Work its collectives and
// send/recv return, and ShmEngine, which runs pending works on the thread that waits for one
// (Note [Shm progress] in shm_progress.cpp). Internal: not a public header.
//
//   auto engine = std::make_shared<ShmEngine>(std::make_unique<ShmSegment>(...), group_timeout);
//   auto work = engine->issue(engine, "all_reduce", ShmWork::kCollective, step);
//   work->wait(timeout);  // runs step, and every work issued before it
#pragma once

#include <chrono>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "dist/process_group.h"
#include "dist/shm_segment.h"

namespace nanoddp::dist::shm {

class ShmEngine;

class ShmWork : public Work {
 public:
  // peer == kCollective: step() runs the collective to its end (blocking until the
  // deadline). Otherwise it is a send/recv with rank peer: step() moves what it can and
  // returns true once finished, never blocking.
  static constexpr int kCollective = -1;
  ShmWork(std::shared_ptr<ShmEngine> engine, std::string description, int peer,
          std::function<bool(Clock::time_point)> step)
      : engine_(std::move(engine)),
        description_(std::move(description)),
        collective_(peer == kCollective),
        peer_(peer),
        step_(std::move(step)) {}

  void wait(std::chrono::milliseconds timeout) override;
  bool is_completed() override;

 private:
  friend class ShmEngine;
  std::shared_ptr<ShmEngine> engine_;
  std::string description_;
  bool collective_;
  int peer_;
  std::function<bool(Clock::time_point)> step_;
  bool done_ = false;  // guarded by the engine's mutex
  std::exception_ptr error_;
};

class ShmEngine {
 public:
  // timeout: the group's, which bounds every wait (effective_wait_timeout in process_group.h).
  ShmEngine(std::unique_ptr<ShmSegment> segment, std::chrono::milliseconds timeout)
      : segment_(std::move(segment)), timeout_(timeout) {}

  ShmSegment& segment() { return *segment_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  // A new pending work; throws DistError when an earlier error left the group unusable.
  std::shared_ptr<Work> issue(std::shared_ptr<ShmEngine> self, std::string description, int peer,
                              std::function<bool(Clock::time_point)> step);

  // Runs pending works in issue order until `target` is done (Note [Shm progress]).
  void run_until(ShmWork& target, std::chrono::milliseconds timeout);
  // At the group's end: works not run yet fail (their waits throw DistError, as the two-level
  // group's do), and let go of what they hold (a pending work and the engine hold each other,
  // and the engine holds the shared segment). Running them instead could hold the process's
  // exit for the group's timeout, waiting for peers that moved on. Never throws.
  void drop_pending() noexcept;

  bool done(const ShmWork& work);

 private:
  std::shared_ptr<ShmWork> first_unfinished();
  static void finish(ShmWork& work);

  std::unique_ptr<ShmSegment> segment_;
  std::chrono::milliseconds timeout_;
  std::mutex mutex_;
  std::deque<std::shared_ptr<ShmWork>> pending_;
  std::exception_ptr failure_;
};

}  // namespace nanoddp::dist::shm
