// Note [NCCL non-blocking] (dist/nccl_protocol.h), driven without a GPU: a scripted
// communicator answers "in progress" as NCCL's non-blocking one does, and a scripted event
// stands in for the collective's done event.
#include <doctest/doctest.h>

#include <algorithm>
#include <deque>
#include <functional>
#include <string>
#include <vector>

#include "dist/nccl_protocol.h"

using namespace nanoddp;
using dist::detail::AsyncState;
using namespace std::chrono_literals;

namespace {

// Answers state() from a script (the last answer repeats) and logs every call.
class ScriptedComm : public dist::detail::AsyncComm {
 public:
  explicit ScriptedComm(std::deque<AsyncState> script) : script_(std::move(script)) {}
  AsyncState state(std::string* error) override {
    log.push_back("state");
    if (aborted_) {
      *error = "aborted";
      return AsyncState::Failed;
    }
    AsyncState next = script_.front();
    if (script_.size() > 1) script_.pop_front();
    if (next == AsyncState::Failed) *error = "unhandled system error (remote peer closed the connection)";
    return next;
  }
  void abort() override {
    log.push_back("abort");
    aborted_ = true;
  }
  bool aborted() const override { return aborted_; }
  std::vector<std::string> log;

 private:
  std::deque<AsyncState> script_;
  bool aborted_ = false;
};

int count(const std::vector<std::string>& log, const std::string& entry) {
  return static_cast<int>(std::count(log.begin(), log.end(), entry));
}

// An event that has not passed for `pending` queries, then has.
struct ScriptedEvent {
  int pending = 0;
  int queries = 0;
  int orderings = 0;
  std::function<void()> on_query;  // runs at every query that answers InProgress
  dist::detail::EventWork::Event make() {
    dist::detail::EventWork::Event event;
    event.query = [this](std::string*) {
      ++queries;
      if (queries > pending) return AsyncState::Done;
      if (on_query) on_query();
      return AsyncState::InProgress;
    };
    event.order_compute_stream = [this] { ++orderings; };
    return event;
  }
};

}  // namespace

TEST_CASE("a call answered 'in progress' is polled until NCCL reports it enqueued, then the event follows") {
  ScriptedComm comm({AsyncState::InProgress, AsyncState::InProgress, AsyncState::InProgress, AsyncState::Done});
  dist::detail::issue_and_wait_enqueued(comm, "all_reduce", 5s, [&](std::string*) {
    comm.log.push_back("issue");
    return AsyncState::InProgress;
  });
  comm.log.push_back("record done event");
  CHECK(comm.log ==
        std::vector<std::string>{"issue", "state", "state", "state", "state", "record done event"});
}

TEST_CASE("a call that finished at once is not polled") {
  ScriptedComm comm({AsyncState::InProgress});
  dist::detail::issue_and_wait_enqueued(comm, "broadcast", 5s, [](std::string*) { return AsyncState::Done; });
  CHECK(comm.log.empty());
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
}

TEST_CASE("an error while in progress aborts the communicator and throws DistError") {
  ScriptedComm comm({AsyncState::InProgress, AsyncState::Failed});
  CHECK_THROWS_WITH_AS(
      dist::detail::issue_and_wait_enqueued(comm, "all_gather", 5s, [](std::string*) { return AsyncState::InProgress; }),
      doctest::Contains("remote peer closed the connection"), DistError);
  CHECK(count(comm.log, "abort") == 1);
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
  CHECK(count(comm.log, "abort") == 1);
}

TEST_CASE("a Work dropped without wait() holds its tensors until the done event has passed") {
  auto comm = std::make_shared<ScriptedComm>(std::deque<AsyncState>{AsyncState::Done});
  Tensor buffer = Tensor::zeros({1024});
  ScriptedEvent event;
  event.pending = 3;
  std::vector<long> uses_while_pending;
  event.on_query = [&] { uses_while_pending.push_back(buffer.use_count()); };
  {
    dist::detail::EventWork work("all_reduce", comm, event.make(), {buffer}, 5s);
    CHECK(buffer.use_count() == 2);
  }
  CHECK(event.queries == 4);  // three "not yet", then passed
  CHECK(uses_while_pending == std::vector<long>{2, 2, 2});
  CHECK(buffer.use_count() == 1);
  CHECK(count(comm->log, "abort") == 0);
}

TEST_CASE("a dropped Work whose event never passes aborts the communicator after the timeout") {
  auto comm = std::make_shared<ScriptedComm>(std::deque<AsyncState>{AsyncState::InProgress});
  Tensor buffer = Tensor::zeros({16});
  ScriptedEvent event;
  event.pending = 1 << 30;
  { dist::detail::EventWork work("all_reduce", comm, event.make(), {buffer}, 20ms); }
  CHECK(count(comm->log, "abort") == 1);
  CHECK(buffer.use_count() == 1);
}

TEST_CASE("wait() orders the compute stream once, polls the event and releases the tensors") {
  auto comm = std::make_shared<ScriptedComm>(std::deque<AsyncState>{AsyncState::Done});
  Tensor buffer = Tensor::zeros({16});
  ScriptedEvent event;
  event.pending = 2;
  dist::detail::EventWork work("all_reduce", comm, event.make(), {buffer}, 5s);
  work.wait(5s);
  CHECK(event.orderings == 1);
  CHECK(event.queries == 3);
  CHECK(buffer.use_count() == 1);
  CHECK(work.is_completed());
  work.wait(5s);
  CHECK(event.orderings == 1);
}

TEST_CASE("wait() times out, or reports NCCL's asynchronous error, and aborts") {
  SUBCASE("timeout") {
    auto comm = std::make_shared<ScriptedComm>(std::deque<AsyncState>{AsyncState::Done});
    ScriptedEvent event;
    event.pending = 1 << 30;
    dist::detail::EventWork work("all_reduce", comm, event.make(), {Tensor::zeros({4})}, 5s);
    CHECK_THROWS_AS(work.wait(20ms), TimeoutError);
    CHECK(count(comm->log, "abort") == 1);
    CHECK_THROWS_AS(work.wait(20ms), DistError);  // the same group cannot go on
  }
  SUBCASE("asynchronous error") {
    auto comm = std::make_shared<ScriptedComm>(std::deque<AsyncState>{AsyncState::Failed});
    ScriptedEvent event;
    event.pending = 1 << 30;
    dist::detail::EventWork work("all_reduce", comm, event.make(), {Tensor::zeros({4})}, 5s);
    CHECK_THROWS_WITH_AS(work.wait(5s), doctest::Contains("remote peer closed"), DistError);
    CHECK(count(comm->log, "abort") == 1);
  }
}
