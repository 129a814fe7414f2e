// spawn(): fork, set the env, run fn(rank), supervise. See dist/spawn.h.
#include "dist/spawn.h"

#include <dirent.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iostream>

#include "core/error.h"
#include "core/trace.h"
#include "dist/output_relay.h"

namespace nanoddp::dist {

namespace {

// Threads of this process, from /proc/self/task (one entry per thread).
int thread_count() {
  int count = 0;
  if (DIR* dir = opendir("/proc/self/task")) {
    while (dirent* e = readdir(dir))
      if (e->d_name[0] != '.') ++count;
    closedir(dir);
  }
  return count;
}

void write_text(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

// The child's whole life after fork: never returns.
[[noreturn]] void run_rank(const std::function<void(int)>& fn, int rank, int world_size,
                           const std::vector<std::pair<std::string, std::string>>& env, int msg_fd) {
  for (const auto& [key, value] : env) setenv(key.c_str(), value.c_str(), 1);
  // stdout is now a pipe, which stdio would block-buffer; lines should appear as they are printed.
  setvbuf(stdout, nullptr, _IOLBF, 0);
  int code = 0;
  std::string error;
  try {
    // Named before fn, so that a rank failing before init_process_group names it still
    // writes its own file below, not the world-of-one one.
    trace::set_rank(rank, world_size);
    fn(rank);
  } catch (const std::exception& e) {
    error = message_of(e);
    code = 1;
  } catch (...) {
    error = "an exception not derived from std::exception";
    code = 1;
  }
  try {
    trace::write();  // _exit below skips the write at exit; does nothing when not recording
  } catch (const std::exception& e) {
    if (code == 0) {
      error = message_of(e);
      code = 1;
    }
  }
  std::cout.flush();
  std::cerr.flush();
  if (code != 0) {
    const std::string line = "exception: " + error + "\n";
    fflush(stderr);
    write_text(2, line);
    write_text(msg_fd, error);
  }
  fflush(nullptr);
  _exit(code);  // not exit(): the parent's atexit handlers and static destructors are not ours
}

}  // namespace

void spawn(const std::function<void(int rank)>& fn, int nprocs, const SpawnOptions& options) {
  NANODDP_CHECK(nprocs >= 1 && nprocs <= kMaxProcPerNode, ValueError, "spawn: nprocs must be between 1 and ",
                kMaxProcPerNode, ", got ", nprocs);
  const int threads = thread_count();
  const int left_behind = launch_detail::OutputRelay::writers_left_behind();
  NANODDP_CHECK(
      options.allow_threads || threads <= 1, DistError, "spawn: this process already runs ", threads,
      " threads; fork() would copy only one of them (and any lock another holds). Call spawn() "
      "before creating threads, process groups or CUDA contexts, or set allow_threads",
      left_behind > 0 ? " (" + std::to_string(left_behind) +
                            " of them still write an earlier spawn's output to a reader that stopped reading)"
                      : std::string());

  LaunchOptions launch;
  launch.nproc_per_node = nprocs;
  launch.master_addr = options.master_addr;
  launch.master_port = options.master_port;
  launch.backend = options.backend;
  give_job_identity(launch);
  const int port = options.master_port != 0 ? options.master_port : pick_free_port(options.master_addr);

  ChildGroup::Options group_options;
  group_options.grace_period = options.grace_period;
  group_options.timeout = options.timeout;
  group_options.reporter = "spawn";
  group_options.report = false;  // the exception says it
  ChildGroup group(group_options);
  std::cout.flush();
  std::cerr.flush();
  for (int rank = 0; rank < nprocs; ++rank) {
    const auto env = rank_env(launch, rank, port);
    const std::string name = "rank " + std::to_string(rank);
    // false: a start failed, or a signal, a failed rank or the timeout came first; wait() ends
    // the job and the outcome says why
    const std::string prefix = options.prefix_output ? "[" + name + "] " : "";
    if (!group.start(rank, name, prefix, [&](int msg_fd) { run_rank(fn, rank, nprocs, env, msg_fd); })) break;
  }
  const Outcome outcome = group.wait();
  // The ranks wrote their traces. A caller that recorded nothing itself would write an empty
  // one at exit, over rank 0's when nprocs is 1.
  if (trace::enabled() && trace::events_since(0).empty()) trace::stop();
  // A signal that came while the ranks were being stopped for another reason (Outcome::late_signal).
  const std::string interrupted =
      outcome.late_signal != 0 ? "; " + signal_name(outcome.late_signal) + " came while they were stopping"
                               : "";
  switch (outcome.kind) {
    case Outcome::Kind::AllSucceeded:
      return;
    case Outcome::Kind::ChildFailed:
      NANODDP_THROW(DistError, "spawn: ", outcome.failed_name, " (pid ", outcome.failed_pid, ") of ", nprocs,
                    " failed: ", outcome.failed_status.describe(),
                    outcome.failed_message.empty() ? "" : ": " + outcome.failed_message,
                    "; the other ranks were terminated", interrupted);
    case Outcome::Kind::StartFailed:
      NANODDP_THROW(DistError, "spawn: could not start ", outcome.failed_name, " of ", nprocs, ": ",
                    outcome.failed_message, "; the ranks already started were terminated", interrupted);
    case Outcome::Kind::TimedOut:
      NANODDP_THROW(TimeoutError, "spawn: ", nprocs, " ranks did not finish within ", options.timeout.count(),
                    " ms; all were terminated", interrupted);
    case Outcome::Kind::Interrupted:
      NANODDP_THROW(DistError, "spawn: interrupted by ", signal_name(outcome.signal), "; all ", nprocs,
                    " ranks were terminated");
  }
}

}  // namespace nanoddp::dist
