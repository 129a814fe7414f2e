// Internal to the launcher (launch.cpp, child_group.cpp, child_group_wait.cpp): the signal
// self-pipe, output streams and the record of one child. Not a public header.
#pragma once

#include <signal.h>

#include <chrono>
#include <cstddef>
#include <string>
#include <vector>

#include "dist/launch.h"

namespace nanoddp::dist {
namespace launch_detail {

using Clock = std::chrono::steady_clock;

// The signals a supervising ChildGroup handles, and what it does with them: SIGCHLD wakes the
// loop; SIGINT/SIGTERM/SIGHUP/SIGQUIT are forwarded and end the job; SIGUSR1/SIGUSR2 are
// passed on to every rank and the job goes on under nanoddp-run (the ranks decide what they
// mean: Slurm's `--signal=USR1@120` warns of a preemption so that they can checkpoint), and
// left to the caller's handlers under spawn (Options::pass_on_user_signals); SIGTSTP (Ctrl-Z) stops
// the ranks, then the launcher, and continues them when the launcher is continued; SIGPIPE is
// ignored so that a closed stdout (say, `nanoddp-run ... | head`) cannot kill the launcher and
// orphan the ranks. Each rank is in a process group of its own (so that the group kill reaches
// what it started), out of the terminal's reach: what the terminal sends only the launcher
// gets, so a signal it left to its default action would end or stop it alone.
constexpr int kHandledSignals[] = {SIGCHLD, SIGINT,  SIGTERM, SIGHUP, SIGQUIT,
                                   SIGTSTP, SIGPIPE, SIGUSR1, SIGUSR2};
constexpr size_t kNumHandled = sizeof(kHandledSignals) / sizeof(kHandledSignals[0]);

// Self-pipe: the handler writes the signal number, the poll loop reads it. -1 when no
// ChildGroup is alive.
extern int g_signal_pipe[2];
extern struct sigaction g_saved_actions[kNumHandled];

inline bool is_forwarded(int signal) {
  return signal == SIGINT || signal == SIGTERM || signal == SIGHUP || signal == SIGQUIT;
}
inline bool is_passed_on(int signal) { return signal == SIGUSR1 || signal == SIGUSR2; }
// The signals a user may have told the launcher to ignore (nohup, a background job): they stay
// ignored, here and in the ranks.
inline bool kept_if_ignored(int signal) {
  return is_forwarded(signal) || is_passed_on(signal) || signal == SIGTSTP;
}

// The handler of every signal in kHandledSignals but SIGPIPE.
void on_signal(int signal);
// The signals the handler has written to the self-pipe since the last call, in order
// (SIGCHLD included; write_all's reader-gone wake-up is not one); never blocks.
std::vector<int> take_signals();

// Writes all of `data` to `fd`; gives up quietly when the reader is gone (EPIPE) or the fd is
// broken, because losing output must never stop supervision. Nothing, for fd 1 or 2, once
// this process called drop_launcher_output() (Note [Output relay] in dist/output_relay.h;
// a child forked later writes its own). An EPIPE on fd 1 or 2 marks the reader gone
// (launcher_reader_gone) and wakes the supervision loop through the self-pipe.
void write_all(int fd, const char* data, size_t size);
inline void write_all(int fd, const std::string& data) { write_all(fd, data.data(), data.size()); }
void drop_launcher_output();
// Also forgets a reader gone: each round (ChildGroup::wait) starts with its readers tried anew.
void resume_launcher_output();
// Whether a write to stdout or stderr found its reader gone since resume_launcher_output().
bool launcher_reader_gone();

void close_fd(int& fd);

// Largest amount of a line kept while waiting for its '\n'; beyond it the text is printed as
// a line of its own so a child that never writes '\n' cannot grow our memory without bound.
constexpr size_t kMaxPendingLine = 64 * 1024;
constexpr size_t kMaxMessage = 64 * 1024;
// After the ranks have exited, how much more a stream is read: what a pipe holds, and some of
// what a process that escaped its rank's group (setsid) still writes.
constexpr size_t kMaxDrainBytes = 1024 * 1024;
// After the last child has exited, how long to keep reading pipes still held open by
// processes that escaped their rank's group (setsid).
constexpr std::chrono::milliseconds kDrainTimeout{1000};

struct Stream {
  int fd = -1;       // read end of the child's pipe; -1 once at EOF
  int dst = -1;      // 1 or 2: where its lines go; -1: kept as the child's message
  std::string pending;
  bool line_split = false;  // pending's line was printed in part, for being too long
  size_t drained = 0;       // bytes read after the ranks have exited
};

// Runs in a child before it sets its own variables (Note [Innermost launcher wins] in
// launch.cpp).
void clear_outer_launcher_env();

// "5 s" for whole seconds, else "1500 ms".
std::string format_ms(std::chrono::milliseconds ms);

}  // namespace launch_detail

struct ChildGroup::Child {
  int rank = 0;
  std::string name;
  std::string prefix;
  pid_t pid = -1;
  launch_detail::Stream out, err, msg;
  bool exited = false;  // seen by waitid(WNOWAIT): a zombie, not yet reaped
  bool reaped = false;
  bool failed = false;  // exited by a failure of its own (see poll_exit in wait())
  bool named = false;   // its failure has been reported
  ExitStatus status;
  // Options::children_end_with_their_own: whether it has started processes of its own, and
  // since when none of them runs (max: some do, or none was started yet).
  bool had_children = false;
  std::chrono::steady_clock::time_point own_children_ended = std::chrono::steady_clock::time_point::max();
};

}  // namespace nanoddp::dist
