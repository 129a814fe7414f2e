#include "dist/nccl_protocol.h"

#include <pwd.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <thread>

#include "core/error.h"
#include "dist/deadline.h"
#include "kernels/device_memory.h"

namespace nanoddp::dist::detail {

namespace {

using Clock = std::chrono::steady_clock;

// Between two polls of NCCL or of an event: short next to a collective, long next to the poll.
constexpr auto kPollInterval = std::chrono::microseconds(20);
// How long a wait polls without sleeping. A small collective on one node finishes within
// tens of microseconds, and a 20 µs sleep lasts about 70 (Linux's default timer slack is
// 50 µs): sleeping from the first poll would time the sleep, not NCCL.
constexpr auto kSpinFor = std::chrono::microseconds(100);

// The pause between two polls of one wait: a yield for the first kSpinFor, then kPollInterval
// of sleep, so that a long wait leaves the core to the other ranks' compute.
class PollPause {
 public:
  void operator()() const {
    if (Clock::now() - start_ < kSpinFor)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(kPollInterval);
  }

 private:
  Clock::time_point start_ = Clock::now();
};

}  // namespace

std::string AsyncComm::abort_reason() const {
  std::lock_guard<std::mutex> lock(reason_mutex_);
  return abort_reason_;
}

void AsyncComm::set_abort_reason(const std::string& reason) {
  std::lock_guard<std::mutex> lock(reason_mutex_);
  if (abort_reason_.empty()) abort_reason_ = reason;
}

std::string AsyncComm::aborted_message() const {
  const std::string reason = abort_reason();
  return "the communicator was aborted after an earlier timeout or error" + (reason.empty() ? "" : " (" + reason + ")");
}

void issue_and_wait_enqueued(AsyncComm& comm, const std::string& what, std::chrono::milliseconds timeout,
                             const std::function<AsyncState(std::string* error)>& issue) {
  NANODDP_CHECK(!comm.aborted(), DistError, what, ": ", comm.aborted_message());
  // Step 1.
  std::string error;
  const AsyncState issued = issue(&error);
  if (issued == AsyncState::Failed) {
    // A non-blocking communicator may record the call's error as its own asynchronous error
    // (NCCL's enqueue check and its group cleanup do): then it refuses every later call, and
    // only an abort frees it. One that still reports the call in progress may be adding
    // kernels to the stream from NCCL's thread: aborted too. Only one that answers Done (an
    // argument refused before NCCL touched the communicator) is left usable.
    std::string comm_error;
    const AsyncState after = comm.state(&comm_error);
    if (after != AsyncState::Done) {
      comm.abort();
      NANODDP_THROW(DistError, what, ": ", error, "; NCCL then reported ",
                    after == AsyncState::Failed ? comm_error : std::string("the call still in progress"),
                    " for the communicator, which was aborted");
    }
    NANODDP_THROW(DistError, what, ": ", error);
  }
  if (issued == AsyncState::Done) return;
  // Step 2.
  const auto deadline = deadline_after(timeout);
  const PollPause pause;
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
    pause();
  }
}

EventWork::EventWork(std::string what, std::shared_ptr<AsyncComm> comm, Event event, std::vector<Tensor> keep_alive,
                     std::chrono::milliseconds timeout)
    : what_(std::move(what)), comm_(std::move(comm)), event_(std::move(event)), timeout_(timeout) {
  try {
    watched_ = std::make_shared<Watchdog::Watched>(what_, comm_, event_.query, timeout_);
    Watchdog::instance().watch(watched_, keep_alive);  // a copy: kept below should this throw
  } catch (const std::exception&) {
    watched_.reset();
    keep_alive_ = std::move(keep_alive);
  }
}

EventWork::~EventWork() {
  if (completed_ || keep_alive_.empty()) return;  // the watchdog holds them
  try {
    const auto deadline = deadline_after(timeout_);
    std::string error;
    // The event passes once everything the collective queued has run, after an abort too (the
    // flag is set before the abort stops anything); a failed event means the device is gone.
    while (event_.query(&error) == AsyncState::InProgress) {
      if (!comm_->aborted() && comm_->state(&error) == AsyncState::Failed) comm_->abort();
      if (Clock::now() > deadline) {
        std::fprintf(stderr,
                     "nanoddp: %s was dropped without wait() and had not finished after %lld ms; aborting the "
                     "NCCL communicator before its tensors are freed\n",
                     what_.c_str(), static_cast<long long>(timeout_.count()));
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
  const bool stream_ordered = waits_ == Waits::StreamOrdered && watched_ != nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    throw_if_aborted();  // before completed_
    if (completed_) {
      keep_alive_.clear();
      return;
    }
    if (!ordered_) {
      // Marked before the stream reads it: an abort from here on fails the host's reads
      // (Watchdog::aborting), and the check below sees an abort that came before.
      if (stream_ordered) watched_->mark_stream_ordered();
      event_.order_compute_stream();
      ordered_ = true;
    }
  }
  if (!stream_ordered) return wait_on_host(timeout);  // a barrier, or no watchdog to be had
  if (comm_->aborted()) {
    // The compute stream now reads a result that the abort may have cut short.
    Watchdog::fail_host_syncs_cut_short(what_, *comm_);
    throw_if_aborted();
  }
  // Note [NCCL stream-ordered wait]: the host goes on; the watchdog keeps the deadline.
  watched_->tighten_deadline(effective_wait_timeout(timeout, timeout_));
}

void EventWork::wait_on_host(std::chrono::milliseconds timeout) {
  kernels::cuda::count_host_sync();  // the polls below wait for the device (Note [Host syncs])
  kernels::cuda::check_host_syncs();
  timeout = effective_wait_timeout(timeout, timeout_);
  const auto deadline = deadline_after(timeout);
  // This wait keeps the deadline while it runs (Watched::host_waiting), however it ends.
  struct HostWaiting {
    Watchdog::Watched* watched;
    explicit HostWaiting(Watchdog::Watched* watched) : watched(watched) {
      if (watched != nullptr) ++watched->host_waiting;
    }
    ~HostWaiting() {
      if (watched != nullptr) --watched->host_waiting;
    }
  } host_waiting(watched_.get());
  const PollPause pause;
  std::string error;
  while (!event_passed()) {
    throw_if_aborted();  // an abort elsewhere (another thread's timeout, the group's end)
    if (comm_->state(&error) == AsyncState::Failed) {
      throw_if_aborted();  // NCCL's error may be an abort elsewhere, begun after the check above
      comm_->set_abort_reason(what_ + ": NCCL reported " + error);
      comm_->abort();
      NANODDP_THROW(DistError, what_, ": NCCL reported ", error, "; the communicator was aborted");
    }
    if (Clock::now() > deadline) {
      comm_->set_abort_reason(what_ + ": did not complete within " + std::to_string(timeout.count()) + " ms");
      comm_->abort();
      NANODDP_THROW(TimeoutError, what_, ": did not complete within ", timeout.count(),
                    " ms (a peer may have exited or be out of step); the communicator was aborted");
    }
    pause();
  }
  throw_if_aborted();  // which also lets the event pass
  std::lock_guard<std::mutex> lock(mutex_);
  keep_alive_.clear();
  kernels::cuda::check_host_syncs();  // as after any host wait for the device
}

void EventWork::throw_if_aborted() const {
  NANODDP_CHECK(!comm_->aborted(), DistError, what_, ": ", comm_->aborted_message(), "; its result cannot be trusted");
}

bool EventWork::event_passed() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (completed_) return true;
  std::string error;
  const AsyncState state = event_.query(&error);
  if (state == AsyncState::Failed) {
    comm_->set_abort_reason(what_ + ": the device reported " + error);
    comm_->abort();
    NANODDP_THROW(DistError, what_, ": the device reported ", error, "; the communicator was aborted");
  }
  if (state != AsyncState::Done) return false;
  // Read after the event: the flag is set before an abort stops any kernel, so an event seen
  // passed on a communicator not (yet) aborted passed on its own.
  cut_short_ = comm_->aborted();
  completed_ = true;
  return true;
}

bool EventWork::is_completed() {
  if (!event_passed()) return false;
  // Finished, but not successfully (wait() throws): a caller who reads the result now must not
  // get it. A Work that waits on the host is read only after its wait, which throws.
  if (cut_short_ && waits_ == Waits::StreamOrdered) Watchdog::fail_host_syncs_cut_short(what_, *comm_);
  return true;
}

// ---- the watchdog (Note [NCCL stream-ordered wait]) ---------------------------------------

namespace {

// How often the watchdog polls what it watches: often enough that a finished collective's
// tensors return to the caching allocator within a step, rarely enough to cost no core.
constexpr auto kWatchInterval = std::chrono::microseconds(500);

// kernels::cuda::fail_host_syncs(reason()), or with its preset reason when there is no memory
// to build this one. Never throws.
template <typename Reason>
void fail_host_syncs_saying(Reason&& reason) noexcept {
  try {
    kernels::cuda::fail_host_syncs(reason());
  } catch (...) {
    kernels::cuda::fail_host_syncs({});
  }
}

}  // namespace

Watchdog::Watched::Watched(std::string what, std::shared_ptr<AsyncComm> comm,
                           std::function<AsyncState(std::string* error)> query, std::chrono::milliseconds timeout)
    : what(std::move(what)),
      comm(std::move(comm)),
      query(std::move(query)),
      deadline_{deadline_after(timeout), timeout} {}

Watchdog::Watched::Deadline Watchdog::Watched::deadline() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return deadline_;
}

void Watchdog::Watched::tighten_deadline(std::chrono::milliseconds timeout) {
  const Deadline tighter{deadline_after(timeout), timeout};
  std::lock_guard<std::mutex> lock(mutex_);
  if (tighter.at < deadline_.at) deadline_ = tighter;
}

void Watchdog::Watched::mark_stream_ordered() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (stream_ordered_) return;
  stream_ordered_ = true;
  if (!finished_) ++comm->watched_collectives_;
}

bool Watchdog::Watched::stream_ordered() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stream_ordered_;
}

void Watchdog::Watched::seen_finished() noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  if (finished_) return;
  finished_ = true;
  if (stream_ordered_) --comm->watched_collectives_;
}

Watchdog& Watchdog::instance() {
  static Watchdog* watchdog = new Watchdog;  // never destroyed: Works may be waited on during exit
  return *watchdog;
}

void Watchdog::watch(std::shared_ptr<Watched> watched, std::vector<Tensor> keep_alive) {
  std::lock_guard<std::mutex> lock(mutex_);
  // Started at the first watch. A child forked after it has no watchdog thread, but it cannot
  // use CUDA either (CUDA is not usable across fork).
  if (!started_) {
    std::thread([this] { run(); }).detach();
    started_ = true;
  }
  // Woken only from idle: polls keep their interval however many collectives a step launches.
  if (watched_.empty()) wake_.notify_one();
  watched_.emplace_back(std::move(watched), std::move(keep_alive));
}

void Watchdog::forget(const AsyncComm& comm) {
  std::list<Entry> dropped;  // their tensors go outside the lock
  std::unique_lock<std::mutex> lock(mutex_);
  // One being polled now is put back first, so that none is polled after this call (those
  // already handed to an abort's thread go when that abort, which close() waits for, returns).
  wake_.wait(lock, [&] { return in_hand_ == 0; });
  for (auto it = watched_.begin(); it != watched_.end();) {
    auto next = std::next(it);
    if (it->watched->comm.get() == &comm) dropped.splice(dropped.end(), watched_, it);
    it = next;
  }
  lock.unlock();
  // Finalizing completed their calls.
  if (!comm.aborted()) return;
  // After an abort the work they queued behind NCCL's kernels may still run: those stay
  // watched until their events pass (poll's cut-short case asks nothing of the communicator).
  // And the abort may have cut them short.
  std::list<Entry> running;
  for (auto it = dropped.begin(); it != dropped.end();) {
    auto next = std::next(it);
    std::string error;
    if (it->watched->query(&error) == AsyncState::InProgress) running.splice(running.end(), dropped, it);
    it = next;
  }
  bool cut_short = false;
  for (const std::list<Entry>* entries : {&dropped, &running})
    for (const Entry& entry : *entries) cut_short = cut_short || entry.watched->stream_ordered();
  if (cut_short) fail_host_syncs_cut_short((dropped.empty() ? running : dropped).front().watched->what, comm);
  if (running.empty()) return;
  lock.lock();
  if (watched_.empty()) wake_.notify_one();
  watched_.splice(watched_.end(), running);
}

// One poll of entry: Finished (its tensors may go), Running, or Failed with *reason set (the
// deadline passed, or NCCL or the device reported an error: its communicator must be aborted).
Watchdog::Verdict Watchdog::poll(Entry& entry, std::string* reason) {
  const Watched& watched = *entry.watched;
  std::string error;
  // The event first: the aborted flag is set before an abort stops any kernel, so an event
  // seen passed on a communicator not (yet) aborted passed on its own.
  const AsyncState event = watched.query(&error);
  // A reason is set just before an abort starts (this watchdog's, in an earlier round, for
  // another collective on the same communicator): aborted as well, and not to be aborted twice.
  const auto aborted = [&] {
    return watched.comm->aborted() || watched.comm->abort_begun() || !watched.comm->abort_reason().empty();
  };
  bool cut_short = aborted();
  // A host wait under way keeps the deadline and handles NCCL's errors itself.
  const bool host_waiting = watched.host_waiting.load() > 0;
  std::string comm_error;
  const bool comm_failed = !cut_short && !host_waiting && event == AsyncState::InProgress &&
                           watched.comm->state(&comm_error) == AsyncState::Failed;
  if (comm_failed) cut_short = aborted();  // NCCL's error may be an abort, begun after the look above
  if (cut_short) {
    // Aborted by anyone (a host wait's timeout, the group's end, this watchdog for another
    // collective): a result the compute stream reads may have been cut short, so host reads
    // fail from now on. The tensors stay until the event has passed (or the device is gone),
    // which it does once the abort has stopped NCCL's kernels.
    if (!entry.reported && watched.stream_ordered()) {
      fail_host_syncs_cut_short(watched.what, *watched.comm);
      entry.reported = true;
    }
    return event == AsyncState::InProgress ? Verdict::Running : Verdict::Finished;
  }
  if (event == AsyncState::Done) return Verdict::Finished;
  if (host_waiting) return Verdict::Running;
  if (event == AsyncState::Failed) {
    *reason = watched.what + ": the device reported " + error;
    return Verdict::Failed;
  }
  if (comm_failed) {
    *reason = watched.what + ": NCCL reported " + comm_error;
    return Verdict::Failed;
  }
  if (const Watched::Deadline deadline = watched.deadline(); Clock::now() > deadline.at) {
    *reason = watched.what + ": did not complete within " + std::to_string(deadline.timeout.count()) +
              " ms (a peer may have exited or be out of step)";
    return Verdict::Failed;
  }
  return Verdict::Running;
}

void Watchdog::report_failure(const Watched& watched, const std::string& reason) noexcept {
  try {
    if (!reason.empty()) watched.comm->set_abort_reason(reason);
  } catch (...) {
    // No memory for it: the abort goes ahead without a reason.
  }
  // The failed reads before the abort: once it has ended the kernels, a host wait returns, and
  // it must find them. (The abort fails them anyway while a stream-ordered collective on the
  // communicator is watched: Watchdog::aborting.)
  if (watched.stream_ordered()) {
    fail_host_syncs_saying([&] {
      return reason + "; the NCCL communicator was aborted, so the device's results after it may rest on values "
                      "that were never reduced";
    });
  }
  std::fprintf(stderr, "nanoddp: %s; the NCCL communicator was aborted\n",
               reason.empty() ? watched.what.c_str() : reason.c_str());
}

void Watchdog::abort(const std::shared_ptr<AsyncComm>& comm) {
  // On a thread of its own, not joined: freeing one communicator can wait for a kernel of
  // another, which only this watchdog's next round may abort (Note [NCCL shutdown]).
  comm->abort_begun_.store(true);
  try {
    std::thread([comm] { comm->abort(); }).detach();
  } catch (...) {
    comm->abort();  // no thread to be had: here, then
  }
}

void Watchdog::aborting(const AsyncComm& comm) noexcept {
  if (comm.watched_collectives() > 0) fail_host_syncs_cut_short("an NCCL collective", comm);
}

void Watchdog::fail_host_syncs_cut_short(const std::string& what, const AsyncComm& comm) noexcept {
  fail_host_syncs_saying([&] { return what + ": " + comm.aborted_message() + " before it was seen to finish"; });
}

void Watchdog::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    wake_.wait(lock, [&] { return !watched_.empty(); });
    wake_.wait_for(lock, kWatchInterval);
    // Handled outside the lock: a query or an abort must not stall watch() on the main thread.
    std::list<Entry> polled, still_running;
    polled.splice(polled.end(), watched_);
    in_hand_ = polled.size();
    lock.unlock();
    // The communicators of failed entries, each aborted once.
    std::vector<std::shared_ptr<AsyncComm>> to_abort;
    while (!polled.empty()) {
      auto entry = polled.begin();
      Verdict verdict = Verdict::Running;
      std::string reason;
      try {
        verdict = poll(*entry, &reason);
      } catch (...) {
        // No memory for the reason, say: polled again next round, unless its time is up.
        reason.clear();
        const Watched& watched = *entry->watched;
        const bool cut_short = watched.comm->aborted() || watched.comm->abort_begun();
        if (!cut_short && watched.host_waiting.load() == 0 && Clock::now() > watched.deadline().at)
          verdict = Verdict::Failed;
      }
      if (verdict == Verdict::Failed) {
        // Its tensors stay watched: the abort ends NCCL's kernel, but what the collective
        // queued after it on its stream (copies out, key conversions) runs only then, so
        // they go when the event has passed (poll's cut-short case, the reason being set).
        report_failure(*entry->watched, reason);
        const std::shared_ptr<AsyncComm>& comm = entry->watched->comm;
        if (std::find(to_abort.begin(), to_abort.end(), comm) == to_abort.end()) {
          try {
            to_abort.push_back(comm);
          } catch (...) {
            comm->abort();  // no memory for the list: abort here
          }
        }
        verdict = Verdict::Running;
      }
      if (verdict == Verdict::Running)
        still_running.splice(still_running.end(), polled, entry);
      else
        polled.erase(entry);  // finished: the tensors go, outside the lock
    }
    for (const auto& comm : to_abort) abort(comm);
    lock.lock();
    watched_.splice(watched_.end(), still_running);
    in_hand_ = 0;
    wake_.notify_all();  // forget() may be waiting for in_hand_
  }
}

// The Work of one queued call: it shares the queue, so it may outlive the process group.
class PointToPointQueue::QueuedWork : public Work {
 public:
  QueuedWork(std::shared_ptr<PointToPointQueue> queue, std::shared_ptr<Outcome> outcome)
      : queue_(std::move(queue)), outcome_(std::move(outcome)) {}
  // Fire and forget (torch.distributed.isend without wait()): the call still goes out.
  ~QueuedWork() override {
    try {
      std::lock_guard<std::mutex> lock(queue_->mutex_);
      if (!outcome_->issued && !outcome_->error) queue_->issue_locked();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "nanoddp: a send/recv dropped without wait() could not be issued: %s\n",
                   message_of(e).c_str());
    } catch (...) {
    }
  }
  void wait(std::chrono::milliseconds timeout) override {
    const std::chrono::milliseconds whole = effective_wait_timeout(timeout, queue_->group_timeout_);
    const auto deadline = deadline_after(whole);
    const std::shared_ptr<Work> group = queue_->issued(*outcome_);
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    try {
      group->wait(std::max(left, std::chrono::milliseconds(1)));  // 0 would mean "the group's timeout"
    } catch (const TimeoutError& e) {
      // Said only when issuing took a noticeable part of the wait.
      if (whole - left < std::max(whole / 100, std::chrono::milliseconds(100))) throw;
      NANODDP_THROW(TimeoutError, message_of(e), " (what was left of a wait of ", whole.count(),
                    " ms, after issuing the send/recv group)");
    }
  }
  bool is_completed() override { return queue_->issued(*outcome_)->is_completed(); }

 private:
  std::shared_ptr<PointToPointQueue> queue_;
  std::shared_ptr<Outcome> outcome_;
};

std::shared_ptr<Work> PointToPointQueue::add(const std::shared_ptr<PointToPointQueue>& queue, Call call) {
  auto outcome = std::make_shared<Outcome>();
  {
    std::lock_guard<std::mutex> lock(queue->mutex_);
    queue->calls_.push_back(std::move(call));
    queue->outcomes_.push_back(outcome);
  }
  return std::make_shared<QueuedWork>(queue, std::move(outcome));
}

void PointToPointQueue::issue() {
  std::lock_guard<std::mutex> lock(mutex_);
  issue_locked();
}

void PointToPointQueue::issue_locked() {
  if (calls_.empty()) return;
  std::vector<Call> calls;
  calls.swap(calls_);
  std::vector<std::shared_ptr<Outcome>> outcomes;
  outcomes.swap(outcomes_);
  std::shared_ptr<Work> group;
  try {
    group = issue_group_(calls);
  } catch (...) {
    for (auto& outcome : outcomes) outcome->error = std::current_exception();
    throw;
  }
  for (auto& outcome : outcomes) outcome->issued = group;
}

std::shared_ptr<Work> PointToPointQueue::issued(Outcome& outcome) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!outcome.issued && !outcome.error) {
    try {
      issue_locked();
    } catch (...) {
      // Recorded in outcome.error (this call was in the group), rethrown below.
    }
  }
  if (outcome.error) std::rethrow_exception(outcome.error);
  return outcome.issued;
}

void PointToPointQueue::close() {
  try {
    std::lock_guard<std::mutex> lock(mutex_);
    issue_locked();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "nanoddp: send/recv still queued at the group's end could not be issued: %s\n",
                 message_of(e).c_str());
  } catch (...) {
  }
}

std::vector<std::string> nccl_conf_files() {
  std::vector<std::string> files;
  if (const char* file = std::getenv("NCCL_CONF_FILE"); file != nullptr && *file != '\0') {
    files.emplace_back(file);
  } else {
    // The passwd entry's home, as NCCL's userHomeDir() takes it: NCCL does not read $HOME.
    std::vector<char> buffer(16384);
    passwd entry{};
    passwd* found = nullptr;
    if (::getpwuid_r(::getuid(), &entry, buffer.data(), buffer.size(), &found) == 0 && found != nullptr &&
        found->pw_dir != nullptr)
      files.push_back(std::string(found->pw_dir) + "/.nccl.conf");
  }
  files.emplace_back("/etc/nccl.conf");
  return files;
}

std::optional<NcclSetting> nccl_setting(const std::string& name, const std::vector<std::string>& conf_files) {
  if (const char* value = std::getenv(name.c_str())) return NcclSetting{value, "the environment"};
  for (const std::string& path : conf_files) {
    std::ifstream file(path);
    std::string line;
    // As NCCL reads a line: the name is everything before the first '=', the value everything
    // after it, neither trimmed (so " NCCL_X = 1" names another variable, which NCCL ignores).
    while (std::getline(file, line)) {
      const size_t equals = line.find('=');
      if (line.empty() || line[0] == '#' || equals == std::string::npos) continue;
      if (line.compare(0, equals, name) == 0 && equals == name.size()) return NcclSetting{line.substr(equals + 1), path};
    }
  }
  return std::nullopt;
}

}  // namespace nanoddp::dist::detail
