// Trace: a recorder of what a run does and when, written as Chrome trace-event JSON that
// ui.perfetto.dev and chrome://tracing open (one process per rank, one lane per kind of work).
//
//   NANODDP_TRACE=run.json build/examples/toy_ddp            // any program; or --trace run.json
//   { trace::Span span(trace::Lane::Optimizer, "step"); optimizer.step(); }
//   trace::write();                                          // also done at exit
//
// Note [Trace cost]
// Recording is off unless NANODDP_TRACE is set or start() is called. Off, every instrumented
// place costs one relaxed load of a global flag and a branch that always goes the same way:
// nothing is formatted, allocated or timed (benchmarks/run measures it: "trace off" row). On,
// an event is two clock reads and an append under a mutex; names and shapes are formatted
// only then. Recording never changes what is computed: it reads tensors' shapes, never their
// values, and it issues no collective of its own except the clock alignment that
// dist::init_process_group does when a trace is being recorded (Note [Trace clocks]).
//
// Files. A process of world size 1 writes exactly the path it was given. Rank r of a larger
// job writes path with ".rank<r>" before its extension (run.rank1.json), or, under
// nanoddp-run (which sets NANODDP_TRACE_PARTS to the name of a folder of its own, created by
// the first rank that writes a part), its part into that folder, and nanoddp-run merges the
// parts into the one file `path` when the job ends.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

namespace nanoddp::trace {

// The lanes of one rank, in display order. All-reduces get one lane per bucket (kAllReduce +
// bucket index): a bucket's all-reduce runs from launch to completion while the next ones
// launch, so their spans overlap and cannot share a lane.
enum class Lane : int { Data = 1, Compute = 2, DDP = 3, Optimizer = 4 };
constexpr int kAllReduceLane = 10;
// FSDP gets one lane per unit (kFsdpUnitLane + unit index): a unit's all_gathers and its
// reduce_scatter, so a prefetched gather shows as a span that starts before its unit computes.
constexpr int kFsdpUnitLane = 10000;
std::string lane_name(int lane);  // "data", "compute", "ddp", "optimizer", "all_reduce bucket 0"

namespace detail {
extern std::atomic<bool> recording;
}

// Whether events are being recorded: the one branch each instrumented place pays when off.
inline bool enabled() { return detail::recording.load(std::memory_order_relaxed); }

// Microseconds on the steady clock (fractional: autograd nodes of a small MLP take a few).
double now_us();

// Starts recording (dropping anything recorded before) into `path`, written by write() and
// at exit. An empty path records in memory only (what --explain reads). Throws IOError when
// `path` is not empty and its folder cannot be written, or when it names a file that is not a
// trace this library wrote (a trace replaces only a trace, as a checkpoint only a
// checkpoint), so a typo fails before training and loses nothing.
void start(const std::string& path);
// Stops recording and forgets the events (the file is not written).
void stop();
// Why the file NANODDP_TRACE names was refused as the library loaded (start() threw; the
// reason was printed to stderr then), or "" (also once a later start() succeeded: a
// program's --trace overrides the variable). init_process_group and nanoddp-run stop on it
// before any training, as a refused --trace does.
const std::string& environment_error();
// When recording in memory only (start("")): forgets the events recorded so far, so that a
// long run's memory stays bounded by what its reader still needs. Otherwise does nothing.
void forget_in_memory_events();
// Names this process "rank r" in the trace and picks its file (see the top of this file).
// Throws IOError, as start() does, when that file is run.rank<r>.json and cannot be written
// there or is not a trace.
void set_rank(int rank, int world_size);
// This process's clock reading at one instant common to all ranks (Note [Trace clocks]); the
// merge shifts each rank's events by the difference to rank 0's reading.
void set_clock_sync(double us);

// One event. args_json: the members of its "args" object, already JSON ("\"bytes\":1024").
struct Event {
  int lane = 0;
  std::string name;
  double begin_us = 0;
  double end_us = 0;  // == begin_us for an instant
  std::string args_json;
};

// Records a span [begin_us, end_us] (complete event, "ph":"X"). No-op when not recording.
void complete(int lane, std::string name, double begin_us, double end_us, std::string args_json = "");
inline void complete(Lane lane, std::string name, double begin_us, double end_us, std::string args_json = "") {
  complete(static_cast<int>(lane), std::move(name), begin_us, end_us, std::move(args_json));
}

// The events recorded since `since_us` (by begin time), in recording order: what --explain
// and tests read without going through a file.
std::vector<Event> events_since(double since_us);

// Writes the trace file now (see "Files" above) and returns its path; "" when not recording
// or when recording in memory only. Throws IOError naming the file when it cannot be written;
// the file is written to a temporary name and renamed, so it is never half-written.
std::string write();

// Merges the per-rank parts that ranks wrote into `parts_dir` (NANODDP_TRACE_PARTS) into one
// file: the path the parts name, every rank's events shifted onto rank 0's clock. Returns the
// path written, "" when the folder holds no part. Throws IOError naming a part that cannot be
// read or parsed, or parts that name different files.
std::string merge_parts(const std::string& parts_dir);

// Times its scope as one event on `lane`: nothing happens when not recording.
class Span {
 public:
  Span(Lane lane, const char* name) : lane_(static_cast<int>(lane)), name_(name) {
    if (enabled()) begin_us_ = now_us();
  }
  ~Span() {
    if (begin_us_ >= 0) complete(lane_, name_, begin_us_, now_us(), std::move(args_json_));
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

  bool active() const { return begin_us_ >= 0; }
  // Sets the event's args (JSON members); call only when active().
  void set_args(std::string args_json) { args_json_ = std::move(args_json); }

 private:
  int lane_;
  const char* name_;
  double begin_us_ = -1;
  std::string args_json_;
};

// Records nothing while it lives, for work that checks a run rather than being part of it.
class Paused {
 public:
  Paused() : was_recording_(detail::recording.exchange(false)) {}
  ~Paused() { detail::recording.store(was_recording_); }
  Paused(const Paused&) = delete;
  Paused& operator=(const Paused&) = delete;

 private:
  bool was_recording_;
};

// `text` as a JSON string literal, quotes included.
std::string json_string(const std::string& text);

}  // namespace nanoddp::trace
