// When an NCCL collective is issued, finished, and safe to release, and when a queued
// send/recv goes out: the NCCL process group's protocol, written against a two-function view
// of the communicator so that a test can drive it without a GPU by answering "in progress"
// from a script (tests/test_nccl_protocol.cpp). Internal to dist/ (not a public header);
// compiled in every build.
//
//   detail::issue_and_wait_enqueued(comm, what, timeout, [&](std::string* error) { ... ncclAllReduce ... });
//   cudaEventRecord(done, stream);                   // only now: the collective is on the stream
//   auto work = std::make_shared<detail::EventWork>(what, comm_ptr, event, keep_alive, timeout);
//
// Note [NCCL stream-ordered wait]
// EventWork::wait() does what torch's ProcessGroupNCCL Work.wait() does by default: it makes
// the compute stream wait for the collective's done event, and returns. The host does not
// wait, so every kernel and copy issued afterwards sees the result, and a DDP step is queued
// whole without waiting for the device (Note [Host syncs] in kernels/device_memory.h). The
// timeout still holds. As torch's watchdog does, one thread for the process (the Watchdog)
// follows every collective from its launch, waited on or not: it holds the tensors until the
// done event has passed, then lets them go, so dropping a Work never blocks. Should the
// deadline (the group's timeout from the launch, or a shorter wait(timeout)) pass first, or
// NCCL or the device report an error, the watchdog aborts the communicator (which ends its
// kernels, so the compute stream moves on) and says so on stderr; a collective never waited
// on cannot hang the process either (freeing memory waits for the whole device). The failure
// is kept: every later call on that communicator throws DistError naming the collective; and
// when the abort cut short a collective that a stream-ordered wait had handed to the compute
// stream, what the device computes from it may rest on values never reduced, so every later
// wait of the host for the device (a copy to the host, item(), synchronize()) throws too. torch's watchdog ends the process instead (NCCL_ASYNC_ERROR_HANDLING); here the
// program gets the error where it next reads. A barrier still waits on the host, as torch's
// does (that is its purpose), and then the host wait keeps the deadline.
//
// Note [NCCL non-blocking]
// The group builds its communicator with config.blocking = 0, so that no NCCL call can block
// the host forever (a peer that never arrives ends in TimeoutError and ncclCommAbort, not a
// hang). The contract this relies on, from NCCL's user guide (communicator options, error
// handling and fault tolerance; NCCL 2.14 to 2.28):
//   (a) on such a communicator any call may return ncclInProgress: it was accepted but has not
//       finished; for a collective, its kernel may not be on the stream yet (NCCL finishes the
//       launch from its own thread);
//   (b) ncclCommGetAsyncError(comm) then reports ncclInProgress until that call has finished,
//       ncclSuccess once it has (for a collective: enqueued, and ordinary CUDA stream semantics
//       apply from there), or the error that broke the communicator;
//   (c) the application must not issue the next call on the communicator while (b) still says
//       ncclInProgress;
//   (d) ncclCommAbort and ncclCommDestroy block; ncclCommFinalize may return ncclInProgress.
// Hence the order, for every NCCL call the group makes:
//   1. issue the call; an immediate error other than ncclInProgress throws DistError, and
//      aborts the communicator unless (b) then says ncclSuccess (it keeps the error, and
//      refuses every call, or is still launching);
//   2. on ncclInProgress, poll (b) until it is not in progress, up to the group's timeout;
//      an error or the timeout aborts the communicator and throws (DistError / TimeoutError);
//   3. only then queue what must follow the collective on its stream: a copy out of its
//      buffer, the next NCCL call, the done event that Work::wait and the watchdog follow.
// Recording the done event right after step 1 would let wait() return before the reduction
// ran (DDP would copy un-reduced gradients), and the next call could be refused.
#pragma once

#include <chrono>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <list>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "dist/process_group.h"

namespace nanoddp::dist::detail {

// What an asynchronous library call or device event says about itself.
enum class AsyncState { Done, InProgress, Failed };

// A communicator as the protocol sees it: ncclCommGetAsyncError and ncclCommAbort in the NCCL
// group, a script in tests. Works call state() and abort() from any thread, so an
// implementation serialises them with its other calls (the NCCL group: Note [NCCL threads] in
// dist/process_group_nccl.cpp).
class AsyncComm {
 public:
  virtual ~AsyncComm() = default;
  // Done (nothing pending), InProgress (the last call has not finished) or Failed, with
  // *error set to the library's text. After abort(): Failed.
  virtual AsyncState state(std::string* error) = 0;
  // Stops everything in flight on the communicator; idempotent; never throws.
  virtual void abort() = 0;
  virtual bool aborted() const = 0;

  // Why the communicator was aborted, as the wait that timed out or failed said it (the
  // watchdog's, a host wait's, a device error seen by is_completed), set just before the
  // abort; empty otherwise. The first reason stays. Safe from any thread.
  std::string abort_reason() const;
  void set_abort_reason(const std::string& reason);
  // "the communicator was aborted after an earlier timeout or error", with the reason if known.
  std::string aborted_message() const;
  // How many of its collectives the compute stream reads and the Watchdog has not yet seen
  // pass (Watchdog::Watched::mark_stream_ordered; Watchdog::aborting reads it).
  int watched_collectives() const { return watched_collectives_.load(); }
  // The watchdog has begun an abort of this communicator (Watchdog::abort), which may not have
  // run yet: a close() then aborts rather than finalizes.
  bool abort_begun() const { return abort_begun_.load(); }

 private:
  friend class Watchdog;
  mutable std::mutex reason_mutex_;
  std::string abort_reason_;
  std::atomic<int> watched_collectives_{0};
  // The watchdog has begun an abort, on a thread of its own that may not have run yet: its
  // later rounds count the communicator as aborted, not as failing again.
  std::atomic<bool> abort_begun_{false};
};

// Note [NCCL non-blocking] steps 1-2. issue makes the call and returns its immediate state
// (setting *error when Failed). Returns once the call is no longer in progress. Throws
// DistError naming `what` when the call or the communicator failed, TimeoutError after
// timeout; both abort comm. An immediate failure of the call itself (NCCL reports a bad
// argument that way) aborts comm unless comm's state then says Done: a non-blocking NCCL
// communicator keeps such an error as its asynchronous error and refuses every later call.
void issue_and_wait_enqueued(AsyncComm& comm, const std::string& what, std::chrono::milliseconds timeout,
                             const std::function<AsyncState(std::string* error)>& issue);

// Note [NCCL stream-ordered wait]: follows every collective from its launch until its done
// event has passed, holding its tensors, and aborts its communicator past its deadline or on
// an error. One per process; its thread starts at the first watch() and polls only while
// something is watched.
class Watchdog {
 public:
  // One collective as its Work and the watchdog both see it. Safe from any thread.
  class Watched {
   public:
    // query: the done event's (EventWork::Event); timeout: the group's, from now on.
    Watched(std::string what, std::shared_ptr<AsyncComm> comm,
            std::function<AsyncState(std::string* error)> query, std::chrono::milliseconds timeout);

    const std::string what;  // the collective, as its errors name it
    const std::shared_ptr<AsyncComm> comm;
    const std::function<AsyncState(std::string* error)> query;

    // The watchdog gives up at the deadline: launch + timeout, or earlier for a wait(timeout)
    // with a shorter timeout, which its error then names.
    struct Deadline {
      std::chrono::steady_clock::time_point at;
      std::chrono::milliseconds timeout;
    };
    Deadline deadline() const;
    // now + timeout, when that is earlier.
    void tighten_deadline(std::chrono::milliseconds timeout);
    // A stream-ordered wait() has made the compute stream read the result without the host
    // seeing it pass: from now on an abort of comm before it is seen to pass fails the host's
    // reads (AsyncComm::watched_collectives counts it until then).
    void mark_stream_ordered();
    bool stream_ordered() const;
    // How many host waits (EventWork::Waits::Host) are polling the event now: while one runs,
    // it keeps the deadline and handles NCCL's errors, and the watchdog only holds the tensors.
    std::atomic<int> host_waiting{0};

   private:
    friend class Watchdog;
    void seen_finished() noexcept;  // by the watchdog, when it lets the tensors go

    mutable std::mutex mutex_;  // guards the three below
    Deadline deadline_;
    bool stream_ordered_ = false;
    bool finished_ = false;
  };

  static Watchdog& instance();
  // Watches until the event has passed, then drops keep_alive. Past the deadline, or when the
  // communicator or the event reports an error, it sets the communicator's abort reason, says
  // so on stderr and aborts the communicator on a thread of its own, and keeps keep_alive until
  // the event has passed (the abort ends NCCL's kernel; what the collective queued after it on
  // its stream runs then); a stream-ordered collective also makes every later
  // host wait for the device throw (kernels::cuda::fail_host_syncs). A communicator found
  // aborted by anyone else fails the host's waits too, for a stream-ordered collective not yet
  // seen to pass (the abort may have cut it short), and its tensors stay until its event has
  // passed. Throws only what starting the thread or storing the entry throws (then nothing is
  // watched).
  void watch(std::shared_ptr<Watched> watched, std::vector<Tensor> keep_alive);
  // For a communicator that has been finalized or aborted (Note [NCCL shutdown]): drops what is
  // watched on it, except, after an abort, collectives whose events have not passed, which
  // stay watched until they do.
  void forget(const AsyncComm& comm);
  // Called by a communicator's abort() once it is marked aborted and before it stops anything:
  // a stream-ordered collective watched on it is cut short, so host reads fail from now on
  // (kernels::cuda::fail_host_syncs). Also for a collective that finished but has not been
  // polled since: conservative, and an abort means a failure anyway. Takes no lock (abort()
  // holds the NCCL call mutex, which poll() needs); never throws.
  static void aborting(const AsyncComm& comm) noexcept;
  // Host reads fail from now on: what, a collective on comm, may have been cut short by comm's
  // abort. Never throws.
  static void fail_host_syncs_cut_short(const std::string& what, const AsyncComm& comm) noexcept;
  // How many collectives the watchdog holds the tensors of, those in a poll round included
  // (0: it holds no tensor).
  size_t watched() const { return entries_alive_.load(); }

 private:
  // Counts an Entry in entries_alive_ until its last member has gone (declared first).
  struct Alive {
    Alive() { ++entries_alive_; }
    ~Alive() { --entries_alive_; }
    Alive(const Alive&) = delete;
    Alive& operator=(const Alive&) = delete;
  };
  struct Entry {
    Entry(std::shared_ptr<Watched> watched, std::vector<Tensor> keep_alive)
        : watched(std::move(watched)), keep_alive(std::move(keep_alive)) {}
    ~Entry() { watched->seen_finished(); }  // before keep_alive goes
    Entry(const Entry&) = delete;
    Entry& operator=(const Entry&) = delete;

    Alive alive;
    std::shared_ptr<Watched> watched;
    std::vector<Tensor> keep_alive;
    bool reported = false;  // the host's reads were failed for it after an abort elsewhere
  };
  enum class Verdict { Running, Finished, Failed };

  Watchdog() = default;
  void run();
  static Verdict poll(Entry& entry, std::string* reason);
  // What one round does with an entry that failed: its reason set, the host's reads failed
  // (when stream-ordered), a line on stderr. reason may be empty (no memory for one). Never throws.
  static void report_failure(const Watched& watched, const std::string& reason) noexcept;
  static void abort(const std::shared_ptr<AsyncComm>& comm);

  std::mutex mutex_;
  std::condition_variable wake_;
  // A list: the thread moves entries out and back by splicing, which never allocates, so no
  // entry (and no tensor a kernel may still write) is lost to an allocation failure.
  std::list<Entry> watched_;
  size_t in_hand_ = 0;  // taken out of watched_ by the thread, not yet handled
  bool started_ = false;
  static inline std::atomic<size_t> entries_alive_{0};
};

// A collective that is finished when a device event is (the NCCL group's done event, recorded
// after Note [NCCL non-blocking] step 3). One EventWork may stand behind several Works (every
// send/recv of one NCCL group), so wait() and is_completed() may run on several threads at once.
class EventWork : public Work {
 public:
  struct Event {
    // cudaEventQuery: Done, InProgress (cudaErrorNotReady) or Failed with *error set.
    std::function<AsyncState(std::string* error)> query;
    // cudaStreamWaitEvent(compute stream, event): later kernels see the result.
    std::function<void()> order_compute_stream;
  };

  // keep_alive: the tensors the collective reads and writes; timeout: the group's. The Watchdog
  // follows the collective from here (as torch's ProcessGroupNCCL watchdog does every Work
  // from its launch): it holds keep_alive until the event has passed, and aborts the
  // communicator when the collective has not finished within timeout or fails, waited on or
  // not. Should the watchdog not be had (no thread, no memory), the Work holds keep_alive
  // itself and its destructor waits for the event (see ~EventWork).
  EventWork(std::string what, std::shared_ptr<AsyncComm> comm, Event event, std::vector<Tensor> keep_alive,
            std::chrono::milliseconds timeout);
  // Returns at once: the watchdog holds the tensors (torch: dropping a Work never blocks).
  // Without a watchdog it waits until the event has passed, since NCCL may still write the
  // tensors and the caching allocator would hand their memory out again; past the timeout it
  // aborts the communicator (which stops NCCL's kernels) and says so on stderr. Never throws.
  ~EventWork() override;

  // How wait() waits: StreamOrdered (every collective, send and recv) or Host (a barrier).
  enum class Waits { StreamOrdered, Host };

  // Orders the compute stream after the event (once, whichever thread comes first). Then:
  // StreamOrdered: returns at once, the watchdog keeping the deadline, now at most timeout
  // away (Note [NCCL stream-ordered wait]); Host: polls the event from the host and returns
  // once it has passed, TimeoutError after timeout, DistError when the communicator or the
  // device reports an error (both abort the communicator). Both throw DistError, with the
  // reason, once the communicator was aborted, and Host, as every host wait, once the
  // watchdog made host waits fail (kernels::cuda::check_host_syncs).
  void wait(std::chrono::milliseconds timeout) override;
  // True once the event has passed. When an abort let it pass, the collective may have been
  // cut short: wait() throws, and for a StreamOrdered Work host reads of device memory fail
  // from then on (kernels::cuda::fail_host_syncs). DistError when the device reports an error
  // (the communicator is aborted).
  bool is_completed() override;

  // Before the first wait().
  void set_waits(Waits waits) { waits_ = waits; }
  Waits waits() const { return waits_; }

 private:
  void wait_on_host(std::chrono::milliseconds timeout);
  // Whether the event has passed (is_completed() without its failing of host reads). DistError
  // when the device reports an error (the communicator is aborted).
  bool event_passed();
  // DistError, with the reason, once the communicator was aborted: an abort lets the event
  // pass too, with no result behind it.
  void throw_if_aborted() const;

  std::string what_;
  std::shared_ptr<AsyncComm> comm_;
  Event event_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<Watchdog::Watched> watched_;
  Waits waits_ = Waits::StreamOrdered;
  std::mutex mutex_;  // guards the four below; never held while sleeping between polls
  std::vector<Tensor> keep_alive_;  // empty unless the watchdog could not be had
  bool ordered_ = false;
  bool completed_ = false;
  bool cut_short_ = false;  // the event was seen to pass only after the communicator's abort
};

// Note [NCCL point-to-point]: send() and recv() add their call here; the calls go out together,
// as one NCCL group, when the first of these happens: a Work of theirs is waited on, tested or
// dropped, issue() is called (the group does before every collective), or close() (the group's
// end). So calls made one after another form one group, as torch.distributed.batch_isend_irecv
// would make them, and none is left behind. Dropping a send's Work does not wait for the peer
// to receive it: the Watchdog holds the group's tensors until it has finished.
class PointToPointQueue {
 public:
  struct Call {
    Tensor tensor;
    int peer;
    bool is_send;
  };
  // Enqueues calls as one NCCL group (on the point-to-point communicator and stream) and
  // returns the Work that finishes with all of them; throws when that fails.
  using IssueGroup = std::function<std::shared_ptr<Work>(const std::vector<Call>& calls)>;

  // group_timeout: the process group's timeout, which a Work's wait(0ms) stands for.
  PointToPointQueue(IssueGroup issue_group, std::chrono::milliseconds group_timeout)
      : issue_group_(std::move(issue_group)), group_timeout_(group_timeout) {}

  // Queues call and returns its Work. The Work's wait() and is_completed() issue the queue if
  // it has not gone out yet and then follow the group's Work; both rethrow the error that
  // issuing met. wait(timeout) gives the group's Work what is left of timeout after issuing;
  // issuing itself waits until NCCL has enqueued the group, which is bounded by the group's
  // timeout (issue_and_wait_enqueued), not by this one. Dropping the Work issues the queue too
  // (errors go to stderr: destructors never throw).
  static std::shared_ptr<Work> add(const std::shared_ptr<PointToPointQueue>& queue, Call call);
  // Issues every queued call as one group; nothing when the queue is empty. Throws what
  // issue_group throws (every Work of those calls then reports it).
  void issue();
  // The group's end: issues what is still queued (errors to stderr). Never throws.
  void close();

 private:
  class QueuedWork;
  // What a queued call's Work learns when its group goes out. Guarded by mutex_.
  struct Outcome {
    std::shared_ptr<Work> issued;
    std::exception_ptr error;
  };
  void issue_locked();
  std::shared_ptr<Work> issued(Outcome& outcome);

  IssueGroup issue_group_;
  std::chrono::milliseconds group_timeout_;
  std::mutex mutex_;
  std::vector<Call> calls_;
  std::vector<std::shared_ptr<Outcome>> outcomes_;
};

// An NCCL setting as NCCL itself resolves it: the environment first, then the user's file
// (NCCL_CONF_FILE, else .nccl.conf in the passwd entry's home), then /etc/nccl.conf; NCCL copies
// the files' lines into the environment when it initialises, without overwriting what is set
// (NCCL's user guide, "Environment Variables"). A file line is NAME=VALUE, read as NCCL reads it:
// split at the first '=', nothing trimmed; lines starting with '#' are skipped. conf_files replaces the two files (tests). No value: nullopt.
struct NcclSetting {
  std::string value;
  std::string source;  // "the environment" or the file's path
};
std::vector<std::string> nccl_conf_files();
std::optional<NcclSetting> nccl_setting(const std::string& name,
                                        const std::vector<std::string>& conf_files = nccl_conf_files());

}  // namespace nanoddp::dist::detail
