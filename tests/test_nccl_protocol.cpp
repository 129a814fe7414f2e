// Note [NCCL non-blocking], Note [NCCL stream-ordered wait] and the send/recv queue of Note [NCCL point-to-point]
// (dist/nccl_protocol.h), driven without a GPU: a scripted communicator answers "in progress" as
// NCCL's non-blocking one does, a scripted event stands in for the collective's done event, and
// a recorder stands in for the NCCL group that the queue issues.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "dist/nccl_protocol.h"
#include "kernels/device_memory.h"

using namespace nanoddp;
using dist::detail::AsyncState;
using namespace std::chrono_literals;

namespace {

// Answers state() from a script (the last answer repeats) and logs every call. The watchdog's
// thread and its abort threads call it too: every member is guarded.
class ScriptedComm : public dist::detail::AsyncComm {
 public:
  explicit ScriptedComm(std::deque<AsyncState> script) : script_(std::move(script)) {}
  AsyncState state(std::string* error) override {
    std::lock_guard<std::mutex> lock(mutex_);
    log_.push_back("state");
    if (aborted_) {
      *error = "aborted";
      return AsyncState::Failed;
    }
    AsyncState next = script_.front();
    if (script_.size() > 1) script_.pop_front();
    if (next == AsyncState::Failed) *error = "unhandled system error (remote peer closed the connection)";
    return next;
  }
  // As NcclComm::abort: marked aborted, then the watchdog told, before anything stops.
  // abort_delay first: a thread slow to start, as on a loaded machine.
  void abort() override {
    std::this_thread::sleep_for(abort_delay);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      log_.push_back("abort");
      aborted_ = true;
    }
    dist::detail::Watchdog::aborting(*this);
  }
  bool aborted() const override { return aborted_; }
  std::chrono::milliseconds abort_delay{0};
  void note(const std::string& entry) {
    std::lock_guard<std::mutex> lock(mutex_);
    log_.push_back(entry);
  }
  std::vector<std::string> log() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return log_;
  }

 private:
  mutable std::mutex mutex_;
  std::vector<std::string> log_;
  std::deque<AsyncState> script_;
  std::atomic<bool> aborted_{false};
};

// A communicator that is always fine (safe to ask from several threads).
class HealthyComm : public dist::detail::AsyncComm {
 public:
  AsyncState state(std::string*) override { return aborted_ ? AsyncState::Failed : AsyncState::Done; }
  void abort() override {
    aborted_ = true;
    dist::detail::Watchdog::aborting(*this);
  }
  bool aborted() const override { return aborted_; }

 private:
  std::atomic<bool> aborted_{false};
};

int count(const ScriptedComm& comm, const std::string& entry) {
  const std::vector<std::string> log = comm.log();
  return static_cast<int>(std::count(log.begin(), log.end(), entry));
}

// Whether done() holds within 10 s (polled): for what the watchdog's threads do.
template <typename Done>
bool eventually(Done&& done) {
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(100us);
  }
  return true;
}

// An event that has not passed for `pending` queries, then has. The watchdog's thread queries
// it too, and may outlive the test's scope with it: the counters live in shared state.
struct ScriptedEvent {
  struct State {
    std::atomic<int> pending{0};
    std::atomic<int> queries{0};
    std::atomic<int> orderings{0};
    std::function<void()> on_query;  // runs at every query that answers InProgress
  };
  std::shared_ptr<State> state = std::make_shared<State>();
  std::atomic<int>& pending = state->pending;
  std::atomic<int>& queries = state->queries;
  std::atomic<int>& orderings = state->orderings;
  std::function<void()>& on_query = state->on_query;

  dist::detail::EventWork::Event make() {
    dist::detail::EventWork::Event event;
    event.query = [state = state](std::string*) {
      if (++state->queries > state->pending) return AsyncState::Done;
      if (state->on_query) state->on_query();
      return AsyncState::InProgress;
    };
    event.order_compute_stream = [state = state] { ++state->orderings; };
    return event;
  }
};

// Until the watchdog holds nothing (what it watched has finished or was aborted); false if it
// still does after 10 s.
bool watchdog_idle() {
  return eventually([] { return dist::detail::Watchdog::instance().watched() == 0; });
}

// What fail_host_syncs was told since the last call ("" if nothing), forgetting it: a test
// that fails host reads on purpose leaves the process as it found it.
std::string take_host_syncs_failure() {
  const std::string reason = kernels::cuda::host_syncs_failure();
  kernels::cuda::clear_host_syncs_failure();
  return reason;
}

// The abort (or the peer) let the event pass: the watchdog lets go of everything, and no host
// read was failed.
void ends_clean(ScriptedEvent& event) {
  event.pending = 0;
  CHECK(watchdog_idle());
  CHECK(take_host_syncs_failure().empty());
}

// The watchdog holds buffer (beside the test's own reference) until the event passes, then
// lets it go.
void held_until_passed(ScriptedEvent& event, const Tensor& buffer) {
  CHECK(buffer.use_count() == 2);
  event.pending = 0;
  REQUIRE(watchdog_idle());
  CHECK(buffer.use_count() == 1);
}

// A barrier's Work on comm, waiting on the host, whose event has not passed.
std::unique_ptr<dist::detail::EventWork> pending_barrier(const std::shared_ptr<dist::detail::AsyncComm>& comm,
                                                         ScriptedEvent& event, std::chrono::milliseconds timeout) {
  event.pending = 1 << 30;
  auto work = std::make_unique<dist::detail::EventWork>("barrier", comm, event.make(),
                                                        std::vector<Tensor>{Tensor::zeros({4})}, timeout);
  work->set_waits(dist::detail::EventWork::Waits::Host);
  return work;
}

}  // namespace

TEST_CASE("a call answered 'in progress' is polled until NCCL reports it enqueued, then the event follows") {
  ScriptedComm comm({AsyncState::InProgress, AsyncState::InProgress, AsyncState::InProgress, AsyncState::Done});
  dist::detail::issue_and_wait_enqueued(comm, "all_reduce", 5s, [&](std::string*) {
    comm.note("issue");
    return AsyncState::InProgress;
  });
  comm.note("record done event");
  CHECK(comm.log() ==
        std::vector<std::string>{"issue", "state", "state", "state", "state", "record done event"});
}

TEST_CASE("a call that finished at once is not polled") {
  ScriptedComm comm({AsyncState::InProgress});
  dist::detail::issue_and_wait_enqueued(comm, "broadcast", 5s, [](std::string*) { return AsyncState::Done; });
  CHECK(comm.log().empty());
}

TEST_CASE("an immediate error throws DistError with NCCL's text and leaves the communicator usable") {
  ScriptedComm comm({AsyncState::Done});
  try {
    dist::detail::issue_and_wait_enqueued(comm, "rank 0/2 on h: nccl all_reduce(sum)", 5s, [](std::string* error) {
      *error = "invalid argument (count 0)";
      return AsyncState::Failed;
    });
    FAIL("no throw");
  } catch (const DistError& e) {
    CHECK(std::string(e.what()).find("rank 0/2 on h: nccl all_reduce(sum): invalid argument (count 0)") !=
          std::string::npos);
  }
  CHECK(!comm.aborted());
  CHECK(comm.log() == std::vector<std::string>{"state"});
}

TEST_CASE("an immediate error that the communicator keeps as its own aborts it, and later calls are refused") {
  // A non-blocking NCCL communicator records an argument error as its asynchronous error.
  ScriptedComm comm({AsyncState::Failed});
  CHECK_THROWS_WITH_AS(dist::detail::issue_and_wait_enqueued(comm, "nccl all_reduce(sum)", 5s,
                                                              [](std::string* error) {
                                                                *error = "invalid argument (count 0)";
                                                                return AsyncState::Failed;
                                                              }),
                       doctest::Contains("nccl all_reduce(sum): invalid argument (count 0); NCCL then reported "
                                         "unhandled system error (remote peer closed the connection) for the "
                                         "communicator, which was aborted"),
                       DistError);
  CHECK(comm.log() == std::vector<std::string>{"state", "abort"});
  // Still in progress after the error (NCCL's group end can fail after starting its launch
  // thread): aborted as well, before anything else goes on the stream.
  ScriptedComm launching({AsyncState::InProgress});
  CHECK_THROWS_WITH_AS(dist::detail::issue_and_wait_enqueued(launching, "nccl group", 5s,
                                                              [](std::string* error) {
                                                                *error = "internal error";
                                                                return AsyncState::Failed;
                                                              }),
                       doctest::Contains("nccl group: internal error; NCCL then reported the call still in progress "
                                         "for the communicator, which was aborted"),
                       DistError);
  CHECK(launching.log() == std::vector<std::string>{"state", "abort"});
  bool issued = false;
  CHECK_THROWS_WITH_AS(dist::detail::issue_and_wait_enqueued(comm, "barrier", 5s,
                                                              [&](std::string*) {
                                                                issued = true;
                                                                return AsyncState::Done;
                                                              }),
                       doctest::Contains("barrier: the communicator was aborted"), DistError);
  CHECK(!issued);
}

TEST_CASE("an error while in progress aborts the communicator and throws DistError") {
  ScriptedComm comm({AsyncState::InProgress, AsyncState::Failed});
  CHECK_THROWS_WITH_AS(
      dist::detail::issue_and_wait_enqueued(comm, "all_gather", 5s, [](std::string*) { return AsyncState::InProgress; }),
      doctest::Contains("remote peer closed the connection"), DistError);
  CHECK(count(comm, "abort") == 1);
  // Every later call is refused before it reaches NCCL.
  bool issued = false;
  CHECK_THROWS_AS(dist::detail::issue_and_wait_enqueued(comm, "barrier", 5s,
                                                         [&](std::string*) {
                                                           issued = true;
                                                           return AsyncState::Done;
                                                         }),
                  DistError);
  CHECK(!issued);
}

TEST_CASE("a call that stays in progress times out and aborts") {
  ScriptedComm comm({AsyncState::InProgress});
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_AS(
      dist::detail::issue_and_wait_enqueued(comm, "all_reduce", 30ms, [](std::string*) { return AsyncState::InProgress; }),
      TimeoutError);
  CHECK(std::chrono::steady_clock::now() - start >= 30ms);
  CHECK(count(comm, "abort") == 1);
}

TEST_CASE("a Work dropped without wait() returns at once; the watchdog holds its tensors until the event has passed") {
  auto comm = std::make_shared<ScriptedComm>(std::deque<AsyncState>{AsyncState::Done});
  Tensor buffer = Tensor::zeros({1024});
  ScriptedEvent event;
  event.pending = 1 << 30;  // until the test lets it pass
  const auto start = std::chrono::steady_clock::now();
  {
    dist::detail::EventWork work("all_reduce", comm, event.make(), {buffer}, 60s);
    CHECK(buffer.use_count() == 2);  // the caller's and the watchdog's
  }
  CHECK(std::chrono::steady_clock::now() - start < 5s);  // torch: dropping a Work never blocks
  CHECK(buffer.use_count() == 2);
  CHECK(event.orderings == 0);  // nothing waited: the compute stream does not read it
  event.pending = event.queries + 2;  // two more polls answer "not yet", then it has passed
  REQUIRE(watchdog_idle());
  CHECK(buffer.use_count() == 1);
  CHECK(count(*comm, "abort") == 0);
  CHECK(take_host_syncs_failure().empty());
}

TEST_CASE("a collective never waited on is timed out from its launch: the watchdog aborts its communicator") {
  auto comm = std::make_shared<ScriptedComm>(std::deque<AsyncState>{AsyncState::InProgress});
  Tensor buffer = Tensor::zeros({16});
  ScriptedEvent event;
  event.pending = 1 << 30;
  { dist::detail::EventWork work("all_reduce #3", comm, event.make(), {buffer}, 20ms); }
  REQUIRE(eventually([&] { return comm->aborted(); }));
  // Held until the event passes: the abort ends NCCL's kernel, and what the collective queued
  // behind it on its stream runs only then.
  held_until_passed(event, buffer);
  CHECK(count(*comm, "abort") == 1);
  CHECK(comm->abort_reason() == "all_reduce #3: did not complete within 20 ms (a peer may have exited or be out of "
                                "step)");
  CHECK(watchdog_idle());
  CHECK(take_host_syncs_failure().empty());  // no wait() handed its result to the compute stream
}

TEST_CASE("a wait() with a timeout shorter than the group's brings the deadline forward, and its error names it") {
  auto comm = std::make_shared<ScriptedComm>(std::deque<AsyncState>{AsyncState::InProgress});
  ScriptedEvent event;
  event.pending = 1 << 30;
  dist::detail::EventWork work("all_reduce", comm, event.make(), {Tensor::zeros({4})}, 600s);
  work.wait(30ms);  // returns at once
  REQUIRE(eventually([&] { return comm->aborted(); }));
  CHECK(comm->abort_reason() == "all_reduce: did not complete within 30 ms (a peer may have exited or be out of step)");
  event.pending = 0;  // the abort stopped the kernel
  CHECK(watchdog_idle());
  // The compute stream reads its result: host reads fail from now on.
  CHECK(take_host_syncs_failure().find("all_reduce: did not complete within 30 ms") == 0);
}

TEST_CASE("a timeout as long as the clock (milliseconds::max) is no timeout") {
  auto comm = std::make_shared<ScriptedComm>(std::deque<AsyncState>{AsyncState::InProgress});
  ScriptedEvent event;
  event.pending = 1 << 30;
  dist::detail::EventWork work("all_reduce", comm, event.make(), {Tensor::zeros({4})},
                               std::chrono::milliseconds::max());
  work.wait(0ms);
  const int seen = event.queries;
  REQUIRE(eventually([&] { return event.queries >= seen + 3; }));  // polled, not aborted
  CHECK(!comm->aborted());
  ends_clean(event);
}

TEST_CASE("a poll that throws (no memory) still ends in the abort once the deadline has passed") {
  // Once, also when the watchdog's abort thread starts many rounds later.
  for (const auto abort_delay : {0ms, 30ms}) {
    CAPTURE(abort_delay.count());
    auto comm = std::make_shared<ScriptedComm>(std::deque<AsyncState>{AsyncState::InProgress});
    comm->abort_delay = abort_delay;
    Tensor buffer = Tensor::zeros({4});
    dist::detail::EventWork::Event event;
    // Throws until the abort (which stops the kernel: then the event has passed).
    event.query = [comm = comm.get()](std::string*) -> AsyncState {
      if (!comm->aborted()) throw std::bad_alloc();
      return AsyncState::Done;
    };
    event.order_compute_stream = [] {};
    { dist::detail::EventWork work("all_reduce", comm, std::move(event), {buffer}, 20ms); }
    REQUIRE(eventually([&] { return buffer.use_count() == 1; }));
    std::this_thread::sleep_for(2 * abort_delay);  // a second abort, begun meanwhile, would have logged
    CHECK(count(*comm, "abort") == 1);
    CHECK(comm->abort_reason().empty());  // none could be written
    CHECK(watchdog_idle());
    CHECK(take_host_syncs_failure().empty());
  }
}

TEST_CASE("wait() orders the compute stream once and returns; the watchdog releases the tensors once the event passes") {
  auto comm = std::make_shared<ScriptedComm>(std::deque<AsyncState>{AsyncState::Done});
  Tensor buffer = Tensor::zeros({16});
  ScriptedEvent event;
  event.pending = 1 << 30;  // until the test lets it pass
  dist::detail::EventWork work("all_reduce", comm, event.make(), {buffer}, 60s);
  work.wait(60s);  // returns with the event still pending: the host goes on (Note [NCCL stream-ordered wait])
  CHECK(event.orderings == 1);
  CHECK(buffer.use_count() == 2);  // the caller's and the watchdog's
  CHECK(!work.is_completed());
  event.pending = event.queries + 2;  // two more polls answer "not yet", then it has passed
  REQUIRE(watchdog_idle());
  CHECK(buffer.use_count() == 1);
  CHECK(work.is_completed());
  work.wait(5s);
  CHECK(event.orderings == 1);
  CHECK(count(*comm, "abort") == 0);
}

TEST_CASE("a finished collective's tensors go at the watchdog's next poll, waited on or not") {
  auto comm = std::make_shared<ScriptedComm>(std::deque<AsyncState>{AsyncState::Done});
  Tensor buffer = Tensor::zeros({16});
  ScriptedEvent event;
  dist::detail::EventWork work("all_reduce", comm, event.make(), {buffer}, 5s);
  REQUIRE(watchdog_idle());
  CHECK(buffer.use_count() == 1);
  work.wait(5s);
  CHECK(event.orderings == 1);
  CHECK(count(*comm, "abort") == 0);
}

TEST_CASE("the watchdog aborts a waited collective that times out or fails, and later calls say why") {
  SUBCASE("timeout, also for wait(0ms), which means the group's timeout") {
    for (const std::chrono::milliseconds requested : {20ms, 0ms}) {
      CAPTURE(requested.count());
      auto comm = std::make_shared<ScriptedComm>(std::deque<AsyncState>{AsyncState::InProgress});
      Tensor buffer = Tensor::zeros({4});
      ScriptedEvent event;
      event.pending = 1 << 30;
      dist::detail::EventWork work("all_reduce #7", comm, event.make(), {buffer}, 20ms);
      work.wait(requested);  // returns at once
      REQUIRE(eventually([&] { return comm->aborted(); }));
      held_until_passed(event, buffer);  // what the collective queued after NCCL's kernel runs first
      CHECK(count(*comm, "abort") == 1);
      CHECK(comm->abort_reason() == "all_reduce #7: did not complete within 20 ms (a peer may have exited or be out "
                                    "of step)");
      CHECK_THROWS_WITH_AS(work.wait(5s), doctest::Contains("aborted after an earlier timeout or error (all_reduce #7: "
                                                            "did not complete within 20 ms"),
                           DistError);
      CHECK_THROWS_WITH_AS(dist::detail::issue_and_wait_enqueued(*comm, "all_reduce #8", 5s,
                                                                 [](std::string*) { return AsyncState::Done; }),
                           doctest::Contains("all_reduce #8: the communicator was aborted after an earlier timeout or "
                                             "error (all_reduce #7: did not complete"),
                           DistError);
      CHECK(take_host_syncs_failure().find("all_reduce #7: did not complete within 20 ms") == 0);
    }
  }
  SUBCASE("NCCL's asynchronous error") {
    auto comm = std::make_shared<ScriptedComm>(std::deque<AsyncState>{AsyncState::Failed});
    ScriptedEvent event;
    event.pending = 1 << 30;
    dist::detail::EventWork work("all_reduce", comm, event.make(), {Tensor::zeros({4})}, 5s);
    work.wait(5s);
    REQUIRE(eventually([&] { return comm->aborted(); }));
    CHECK(count(*comm, "abort") == 1);
    CHECK(comm->abort_reason() == "all_reduce: NCCL reported unhandled system error (remote peer closed the connection)");
    CHECK(take_host_syncs_failure().find("all_reduce: NCCL reported unhandled system error") == 0);
    event.pending = 0;  // the abort stopped the kernel
    CHECK(watchdog_idle());
    take_host_syncs_failure();  // its later polls' report of the same abort
  }
  SUBCASE("the group's end lets go of what is watched on its communicator, with no reason of its own") {
    auto comm = std::make_shared<ScriptedComm>(std::deque<AsyncState>{AsyncState::InProgress});
    Tensor buffer = Tensor::zeros({4});
    ScriptedEvent event;
    event.pending = 1 << 30;
    dist::detail::EventWork work("all_reduce", comm, event.make(), {buffer}, 5s);
    work.wait(5s);
    dist::detail::Watchdog::instance().forget(*comm);  // as ~NcclLane does, once the communicator is closed
    CHECK(dist::detail::Watchdog::instance().watched() == 0);
    CHECK(buffer.use_count() == 1);
    CHECK(comm->abort_reason().empty());
    CHECK(take_host_syncs_failure().empty());  // finalizing completed it
  }
}

TEST_CASE("the compute stream reads a collective from its wait() until the watchdog sees it pass") {
  auto comm = std::make_shared<HealthyComm>();
  ScriptedEvent event;
  event.pending = 1 << 30;
  dist::detail::EventWork work("all_reduce", comm, event.make(), {Tensor::zeros({4})}, 60s);
  CHECK(comm->watched_collectives() == 0);  // issued, not waited
  work.wait(60s);
  CHECK(comm->watched_collectives() == 1);
  work.wait(60s);
  CHECK(comm->watched_collectives() == 1);  // counted once
  event.pending = 0;
  REQUIRE(watchdog_idle());
  CHECK(comm->watched_collectives() == 0);
}

TEST_CASE("is_completed() of a collective an abort cut short: true, and host reads and wait() fail") {
  auto comm = std::make_shared<HealthyComm>();
  ScriptedEvent event;
  event.pending = 1 << 30;
  dist::detail::EventWork work("all_reduce #2", comm, event.make(), {Tensor::zeros({4})}, 60s);
  comm->abort();
  CHECK(take_host_syncs_failure().empty());  // nothing read it yet
  event.pending = 0;                          // the abort stopped the kernel
  CHECK(work.is_completed());
  CHECK(take_host_syncs_failure().find("all_reduce #2: the communicator was aborted") == 0);
  CHECK_THROWS_WITH_AS(work.wait(5s), doctest::Contains("all_reduce #2: the communicator was aborted"), DistError);
  CHECK(watchdog_idle());
}

TEST_CASE("a Work that waits on the host (a barrier) times out, or reports NCCL's asynchronous error, and aborts") {
  using Waits = dist::detail::EventWork::Waits;
  SUBCASE("timeout") {
    auto comm = std::make_shared<ScriptedComm>(std::deque<AsyncState>{AsyncState::Done});
    ScriptedEvent event;
    const auto work = pending_barrier(comm, event, 5s);
    CHECK_THROWS_WITH_AS(work->wait(20ms), doctest::Contains("within 20 ms"), TimeoutError);
    CHECK(count(*comm, "abort") == 1);
    CHECK_THROWS_AS(work->wait(20ms), DistError);  // the same group cannot go on
    ends_clean(event);                             // the host saw it fail; nothing read it
  }
  SUBCASE("while the host wait runs, it keeps the deadline (its TimeoutError, not the watchdog's abort)") {
    auto comm = std::make_shared<ScriptedComm>(std::deque<AsyncState>{AsyncState::Done});
    ScriptedEvent event;
    const auto work = pending_barrier(comm, event, 300ms);
    const auto start = std::chrono::steady_clock::now();
    CHECK_THROWS_WITH_AS(work->wait(0ms), doctest::Contains("barrier: did not complete within 300 ms"), TimeoutError);
    CHECK(std::chrono::steady_clock::now() - start >= 300ms);
    CHECK(count(*comm, "abort") == 1);
    event.pending = 0;
    CHECK(work->is_completed());  // as the collective check asks after a timeout
    CHECK(watchdog_idle());
    CHECK(take_host_syncs_failure().empty());  // the host saw it fail; nothing read it
  }
  SUBCASE("asynchronous error") {
    // Done first: should the watchdog poll before set_waits, it sees a healthy communicator.
    auto comm = std::make_shared<ScriptedComm>(std::deque<AsyncState>{AsyncState::Done, AsyncState::Failed});
    ScriptedEvent event;
    const auto work = pending_barrier(comm, event, 5s);
    CHECK_THROWS_WITH_AS(work->wait(5s), doctest::Contains("remote peer closed"), DistError);
    CHECK(count(*comm, "abort") == 1);
    ends_clean(event);
  }
  SUBCASE("held but not waited on: the watchdog keeps the group's timeout") {
    auto comm = std::make_shared<ScriptedComm>(std::deque<AsyncState>{AsyncState::InProgress});
    ScriptedEvent event;
    const auto work = pending_barrier(comm, event, 20ms);
    REQUIRE(eventually([&] { return comm->aborted(); }));
    CHECK(comm->abort_reason() == "barrier: did not complete within 20 ms (a peer may have exited or be out of step)");
    ends_clean(event);
  }
  SUBCASE("passed") {
    auto comm = std::make_shared<ScriptedComm>(std::deque<AsyncState>{AsyncState::Done});
    Tensor buffer = Tensor::zeros({4});
    ScriptedEvent event;
    event.pending = 2;
    dist::detail::EventWork work("barrier", comm, event.make(), {buffer}, 5s);
    work.set_waits(Waits::Host);
    work.wait(5s);
    CHECK(event.queries >= 3);  // polled until it passed
    REQUIRE(watchdog_idle());
    CHECK(buffer.use_count() == 1);
  }
}

namespace {

// Stands in for issuing an NCCL group: records the calls of each group and returns `next_work`
// (a finished Work when empty), or throws when `fail` is set.
struct GroupRecorder {
  std::vector<std::vector<std::string>> groups;  // "send 1", "recv 1", ... per group
  std::function<std::shared_ptr<dist::Work>()> next_work;
  bool fail = false;
  std::chrono::milliseconds issue_takes{0};  // how long NCCL takes to enqueue the group
  std::chrono::milliseconds group_timeout = 5s;
  std::shared_ptr<dist::detail::PointToPointQueue> queue() {
    return std::make_shared<dist::detail::PointToPointQueue>(
        [this](
            const std::vector<dist::detail::PointToPointQueue::Call>& calls) -> std::shared_ptr<dist::Work> {
          if (fail) NANODDP_THROW(DistError, "nccl group of ", calls.size(), " send/recv: invalid usage");
          std::vector<std::string> names;
          for (const auto& call : calls)
            names.push_back((call.is_send ? "send " : "recv ") + std::to_string(call.peer));
          groups.push_back(names);
          if (issue_takes.count() > 0) std::this_thread::sleep_for(issue_takes);
          return next_work ? next_work() : std::make_shared<dist::CompletedWork>();
        },
        group_timeout);
  }
};

using Groups = std::vector<std::vector<std::string>>;

// A Work that is complete, and records the timeout its last wait() was given.
struct TimeoutRecordingWork : dist::Work {
  std::chrono::milliseconds waited_with{-1};
  bool times_out = false;  // wait() throws the TimeoutError an EventWork would
  void wait(std::chrono::milliseconds timeout) override {
    waited_with = timeout;
    if (times_out) NANODDP_THROW(TimeoutError, "send/recv: did not complete within ", timeout.count(), " ms");
  }
  bool is_completed() override { return true; }
};

}  // namespace

TEST_CASE("send/recv queue: a send whose Work is dropped goes out at once (torch isend without wait)") {
  GroupRecorder recorder;
  auto queue = recorder.queue();
  Tensor t = Tensor::zeros({4});
  dist::detail::PointToPointQueue::add(queue, {t, 1, true});  // fire and forget
  CHECK(recorder.groups == Groups{{"send 1"}});
  // Nothing is issued twice, and the group's end finds nothing left.
  queue->close();
  CHECK(recorder.groups.size() == 1);
}

TEST_CASE("send/recv queue: calls made back to back go out as one group at the first wait, test, collective or end") {
  GroupRecorder recorder;
  auto queue = recorder.queue();
  Tensor a = Tensor::zeros({4}), b = Tensor::zeros({4});
  auto sent = dist::detail::PointToPointQueue::add(queue, {a, 1, true});
  auto received = dist::detail::PointToPointQueue::add(queue, {b, 1, false});
  CHECK(recorder.groups.empty());
  received->wait(5s);  // an exchange: both in one group, whichever is waited on first
  CHECK(recorder.groups == Groups{{"send 1", "recv 1"}});
  sent->wait(5s);
  CHECK(recorder.groups.size() == 1);

  auto tested = dist::detail::PointToPointQueue::add(queue, {a, 2, true});
  CHECK(tested->is_completed());
  CHECK(recorder.groups.back() == std::vector<std::string>{"send 2"});

  auto before_collective = dist::detail::PointToPointQueue::add(queue, {a, 3, true});
  queue->issue();  // what the NCCL group does before each collective
  CHECK(recorder.groups.back() == std::vector<std::string>{"send 3"});

  auto held = dist::detail::PointToPointQueue::add(queue, {b, 3, false});
  queue->close();  // the group's end: a held, unwaited call still goes out
  CHECK(recorder.groups == Groups{{"send 1", "recv 1"}, {"send 2"}, {"send 3"}, {"recv 3"}});
  held->wait(5s);
  CHECK(recorder.groups.size() == 4);
}

TEST_CASE("send/recv queue: when the group cannot be issued, every Work of it reports the error") {
  GroupRecorder recorder;
  recorder.fail = true;
  auto queue = recorder.queue();
  Tensor t = Tensor::zeros({2});
  auto first = dist::detail::PointToPointQueue::add(queue, {t, 1, true});
  auto second = dist::detail::PointToPointQueue::add(queue, {t, 1, false});
  CHECK_THROWS_WITH_AS(second->wait(5s), doctest::Contains("nccl group of 2 send/recv: invalid usage"), DistError);
  CHECK_THROWS_WITH_AS(first->is_completed(), doctest::Contains("invalid usage"), DistError);
  CHECK_THROWS_AS(first->wait(5s), DistError);
  // The failed calls left the queue: later calls form a group of their own.
  recorder.fail = false;
  dist::detail::PointToPointQueue::add(queue, {t, 2, true});
  CHECK(recorder.groups == Groups{{"send 2"}});
}

TEST_CASE("send/recv queue: a dropped send does not block until received; the watchdog holds it until it has finished") {
  auto comm = std::make_shared<HealthyComm>();
  Tensor buffer = Tensor::zeros({64});
  ScriptedEvent event;
  event.pending = 1 << 30;  // the peer has not received it
  GroupRecorder recorder;
  recorder.next_work = [&] {
    return std::make_shared<dist::detail::EventWork>("nccl group of 1 send/recv", comm, event.make(),
                                                     std::vector<Tensor>{buffer}, 60s);
  };
  auto queue = recorder.queue();
  dist::detail::PointToPointQueue::add(queue, {buffer, 1, true});
  CHECK(recorder.groups == Groups{{"send 1"}});  // dropping it issued it
  queue->close();
  CHECK(buffer.use_count() == 2);  // the caller's and the watchdog's
  event.pending = event.queries + 2;
  REQUIRE(watchdog_idle());
  CHECK(buffer.use_count() == 1);
  CHECK(!comm->aborted());
}

TEST_CASE("two threads wait on the send and the recv of one group (one EventWork behind both)") {
  auto comm = std::make_shared<HealthyComm>();
  for (int round = 0; round < 200; ++round) {
    CAPTURE(round);
    Tensor out = Tensor::zeros({32}), in = Tensor::zeros({32});
    ScriptedEvent event;
    event.pending = 20;
    GroupRecorder recorder;
    recorder.next_work = [&] {
      auto scripted = event.make();
      // A slow cudaStreamWaitEvent widens the window in which both threads could order it.
      scripted.order_compute_stream = [order = scripted.order_compute_stream] {
        std::this_thread::sleep_for(50us);
        order();
      };
      return std::make_shared<dist::detail::EventWork>("nccl group of 2 send/recv", comm, std::move(scripted),
                                                       std::vector<Tensor>{out, in}, 5s);
    };
    auto queue = recorder.queue();
    auto sent = dist::detail::PointToPointQueue::add(queue, {out, 1, true});
    auto received = dist::detail::PointToPointQueue::add(queue, {in, 1, false});
    std::atomic<int> finished{0};
    std::thread sender([&] {
      sent->wait(5s);
      ++finished;
    });
    std::thread receiver([&] {
      received->wait(5s);
      ++finished;
    });
    sender.join();
    receiver.join();
    REQUIRE(finished == 2);
    REQUIRE(recorder.groups.size() == 1);
    REQUIRE(event.orderings == 1);  // the compute stream is ordered once, by whichever came first
    queue->close();
    sent.reset();
    received.reset();
    REQUIRE(watchdog_idle());  // the waited group's tensors are the watchdog's until its event passes
    REQUIRE(out.use_count() == 1);
    REQUIRE(in.use_count() == 1);
  }
  CHECK(!comm->aborted());
}

TEST_CASE("NCCL settings resolve as NCCL does: environment, then the user's file, then the system's") {
  char folder[] = "/tmp/nanoddp_nccl_conf_XXXXXX";
  REQUIRE(mkdtemp(folder) != nullptr);
  const std::string user = std::string(folder) + "/user.conf", system = std::string(folder) + "/system.conf";
  std::ofstream(user) << "# a comment\n\n NCCL_DEBUG = INFO\nNCCL_DEBUG=WARN\nNCCL_COMM_BLOCKING=1\n";
  std::ofstream(system) << "NCCL_COMM_BLOCKING=0\nNCCL_SOCKET_IFNAME==eth0\nNOT_A_SETTING\n";
  ::unsetenv("NCCL_COMM_BLOCKING");
  ::unsetenv("NCCL_SOCKET_IFNAME");
  ::unsetenv("NCCL_DEBUG");

  auto blocking = dist::detail::nccl_setting("NCCL_COMM_BLOCKING", {user, system});
  REQUIRE(blocking.has_value());
  CHECK(blocking->value == "1");  // the user's file comes before the system's
  CHECK(blocking->source == user);
  auto debug = dist::detail::nccl_setting("NCCL_DEBUG", {user, system});
  REQUIRE(debug.has_value());
  // NCCL trims nothing: " NCCL_DEBUG " is another name, so the next line is the one it reads.
  CHECK(debug->value == "WARN");
  auto interface = dist::detail::nccl_setting("NCCL_SOCKET_IFNAME", {user, system});
  REQUIRE(interface.has_value());
  CHECK(interface->value == "=eth0");  // only the first '=' separates
  CHECK(interface->source == system);
  CHECK_FALSE(dist::detail::nccl_setting("NOT_A_SETTING", {user, system}).has_value());
  CHECK_FALSE(dist::detail::nccl_setting("NCCL_COMM_BLOCKING", {folder + std::string("/missing.conf")}));

  ::setenv("NCCL_COMM_BLOCKING", "0", 1);  // the environment wins over every file
  blocking = dist::detail::nccl_setting("NCCL_COMM_BLOCKING", {user, system});
  ::unsetenv("NCCL_COMM_BLOCKING");
  REQUIRE(blocking.has_value());
  CHECK(blocking->value == "0");
  CHECK(blocking->source == "the environment");

  // Without a list: NCCL_CONF_FILE replaces ~/.nccl.conf, and /etc/nccl.conf comes last.
  ::setenv("NCCL_CONF_FILE", user.c_str(), 1);
  const std::vector<std::string> files = dist::detail::nccl_conf_files();
  ::unsetenv("NCCL_CONF_FILE");
  CHECK(files == std::vector<std::string>{user, "/etc/nccl.conf"});
  // Without NCCL_CONF_FILE, the passwd entry's home, whatever $HOME says (as NCCL's userHomeDir).
  const char* home = std::getenv("HOME");
  const std::string saved_home = home != nullptr ? home : "";
  ::setenv("HOME", "/nowhere", 1);
  const std::vector<std::string> default_files = dist::detail::nccl_conf_files();
  if (home != nullptr) ::setenv("HOME", saved_home.c_str(), 1); else ::unsetenv("HOME");
  REQUIRE(default_files.size() == 2);
  CHECK(default_files[0] != "/nowhere/.nccl.conf");
  CHECK(default_files[0].size() > std::string("/.nccl.conf").size());
  CHECK(default_files[0].substr(default_files[0].size() - 11) == "/.nccl.conf");
  CHECK(default_files[1] == "/etc/nccl.conf");
  std::system(("rm -rf '" + std::string(folder) + "'").c_str());
}

TEST_CASE("send/recv queue: a wait keeps to one timeout, the time NCCL took to enqueue the group included") {
  for (const std::chrono::milliseconds requested : {0ms, 400ms}) {
    CAPTURE(requested.count());
    GroupRecorder recorder;
    recorder.issue_takes = 100ms;
    recorder.group_timeout = 1000ms;
    auto group_work = std::make_shared<TimeoutRecordingWork>();
    recorder.next_work = [&] { return group_work; };
    auto queue = recorder.queue();
    auto received = dist::detail::PointToPointQueue::add(queue, {Tensor::zeros({4}), 1, false});
    received->wait(requested);
    // The group's Work gets what is left of 1000 ms (0 ms: the group's timeout) or 400 ms:
    // at most the whole less the 100 ms of issuing, and (however late the sleep wakes) far
    // more than the 1 ms floor.
    const auto whole = requested.count() > 0 ? requested : recorder.group_timeout;
    CHECK(group_work->waited_with <= whole - recorder.issue_takes);
    CHECK(group_work->waited_with >= (whole - recorder.issue_takes) / 2);
  }
  // When what is left runs out, the TimeoutError says the wait was the rest of a longer one.
  GroupRecorder recorder;
  recorder.issue_takes = 200ms;
  auto group_work = std::make_shared<TimeoutRecordingWork>();
  group_work->times_out = true;
  recorder.next_work = [&] { return group_work; };
  auto queue = recorder.queue();
  auto received = dist::detail::PointToPointQueue::add(queue, {Tensor::zeros({4}), 1, false});
  CHECK_THROWS_WITH_AS(
      received->wait(1000ms),
      doctest::Contains("ms (what was left of a wait of 1000 ms, after issuing the send/recv group)"),
      TimeoutError);
}

TEST_CASE("a communicator aborted by someone else: the watchdog holds the tensors until the event has passed, "
          "also past the group's end") {
  auto comm = std::make_shared<HealthyComm>();
  Tensor buffer = Tensor::zeros({8});
  ScriptedEvent event;
  event.pending = 1 << 30;
  dist::detail::EventWork work("all_reduce", comm, event.make(), {buffer}, 60s);
  work.wait(60s);
  comm->abort();  // as another wait's timeout or the group's end does
  // At once, before any kernel stops: the compute stream reads what the abort may cut short.
  CHECK(take_host_syncs_failure().find("an NCCL collective: the communicator was aborted") == 0);
  const int seen = event.queries;
  REQUIRE(eventually([&] { return event.queries >= seen + 3; }));  // polled on, aborted
  // The group's end (~NcclLane) after the abort: what the collective queued behind NCCL's
  // kernel may still run, so it stays watched.
  dist::detail::Watchdog::instance().forget(*comm);
  CHECK(dist::detail::Watchdog::instance().watched() == 1);
  held_until_passed(event, buffer);  // the abort may not have stopped NCCL's kernels yet
  CHECK_THROWS_WITH_AS(work.wait(60s), doctest::Contains("the communicator was aborted"), DistError);
  take_host_syncs_failure();  // the watchdog's own report of it, if its poll came first
}

TEST_CASE("a Work that waits on the host fails when another thread's abort lets its event pass") {
  auto comm = std::make_shared<HealthyComm>();
  ScriptedEvent event;
  event.pending = 1 << 30;
  dist::detail::EventWork work("barrier", comm, event.make(), {Tensor::zeros({4})}, 60s);
  work.set_waits(dist::detail::EventWork::Waits::Host);
  std::thread elsewhere([&] {
    std::this_thread::sleep_for(20ms);
    comm->abort();        // another wait's timeout, say
    event.pending = 0;    // the abort stopped the kernel: the event passes
  });
  CHECK_THROWS_WITH_AS(work.wait(60s), doctest::Contains("barrier: the communicator was aborted"), DistError);
  elsewhere.join();
  CHECK(watchdog_idle());
  CHECK(take_host_syncs_failure().empty());  // the host saw it fail; nothing read it
}
