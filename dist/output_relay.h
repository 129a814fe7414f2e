// The launcher's output: what ChildGroup::wait prints (the ranks' lines, its own reports)
// goes through writer threads. Internal to the launcher (not installed).
//
// Note [Output relay]
// A reader that stops reading the launcher's stdout or stderr (a paused pager, a stuck
// `| tee`, a log collector that fell behind) blocks whoever writes there. Were that the
// supervision loop, SIGTERM, Ctrl-C, --timeout and stopping the others after a failure would
// all wait for the reader. So the loop only queues its lines, and a writer thread per
// destination writes them in order: one for stdout and one for stderr, so that a stalled
// stdout does not hold the launcher's own reports back, or one for both when they are the same
// file (2>&1), whose lines must not interleave. When a writer holds kMaxQueuedBytes, the loop
// stops reading the pipes whose lines go to it until it catches up, so a rank that prints
// faster than the reader takes blocks on its own pipe, as it would without a launcher. When the ranks have
// exited, what they left in their pipes is read (what a process that escaped a rank's group still writes, up
// to 1 MiB), and flush() waits for the queues to drain. A job that ended by itself waits however long the
// readers take, as any program writing to a pipe does (`| less`, read page by page), unless a
// signal comes while it waits (Ctrl-C at a paused pager). A job stopped by a signal (before or
// during that wait) or its timeout gives up after a stall as long as the grace period: the rest is
// dropped, with what the launcher prints until its next round starts (torchrun's ranks write to the
// terminal themselves and never hold it either). A reader gone (EPIPE) ends the job instead:
// Outcome::reader_gone in dist/launch.h.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

namespace nanoddp::dist::launch_detail {

class OutputRelay {
 public:
  static constexpr size_t kMaxQueuedBytes = size_t{4} << 20;
  // A stall limit of no limit (compared as such: converted to nanoseconds it would overflow).
  static constexpr std::chrono::milliseconds kWaitForever = std::chrono::milliseconds::max();

  OutputRelay();
  OutputRelay(const OutputRelay&) = delete;
  OutputRelay& operator=(const OutputRelay&) = delete;
  // Lets the writers go: each joined when its queue is empty, else left to finish (or to the
  // process's exit).
  ~OutputRelay();
  // Writers let go while still writing (blocked on a reader), alive now in this process.
  static int writers_left_behind();

  // Queues text for fd (1 or 2). Never blocks on the reader.
  void write(int fd, std::string text);
  // Whether the loop should stop reading the pipes whose lines go to fd, for now.
  bool full(int fd) const;
  // Waits until everything queued is written; false when the readers took nothing for
  // stall_limit(), and then this process's output to fd 1 and 2 is dropped until
  // resume_launcher_output() (dist/launch_detail.h). stall_limit is asked again every 10 ms or
  // so (a signal may shorten it while the flush waits); kWaitForever for no limit.
  bool flush(const std::function<std::chrono::milliseconds()>& stall_limit);

 private:
  struct Writer {
    std::mutex mutex;
    std::condition_variable changed;  // a line queued, a line written, or stop
    std::deque<std::pair<int, std::string>> lines;
    size_t queued_bytes = 0;
    // When a byte was last written, or the queue last went from empty to not.
    std::chrono::steady_clock::time_point last_progress;
    bool writing = false;  // a line is out of the queue, in write()
    bool stop = false;
    bool left_behind = false;  // detached while writing
    std::thread thread;        // started with the first line
  };
  static void run(const std::shared_ptr<Writer>& writer);

  std::shared_ptr<Writer> stdout_writer_, stderr_writer_;  // the same one when 2>&1
};

}  // namespace nanoddp::dist::launch_detail
