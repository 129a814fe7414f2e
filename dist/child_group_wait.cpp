// The launcher's supervision loop and failure chain: ChildGroup::wait() relays the ranks'
// output, names the first failure (following "rank N lost rank M" reports to the rank that
// failed first) and stops the rest. See Note [Launch contract] in dist/launch.h.
#include "dist/launch.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <netinet/in.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <dirent.h>
#include <fstream>
#include <set>
#include <thread>

#include "core/error.h"
#include "dist/deadline.h"
#include "dist/detail.h"
#include "dist/launcher_link.h"
#include "dist/launch_detail.h"
#include "dist/output_relay.h"

namespace nanoddp::dist {

using namespace launch_detail;

namespace {

// What a rank that stays alive after its peers lost it is doing, from its /proc state.
std::string stuck_state(int pid) {
  switch (detail::process_state(pid)) {
    case 'T': return "stopped: SIGSTOP or Ctrl-Z";
    case 't': return "stopped by a debugger";
    case 'D': return "in uninterruptible I/O: a slow disk or network file system?";
    case 'Z': return "exiting";
    case '\0': return "state unknown: /proc does not say";
    default: return "not stopped: hung or looping?";
  }
}

// How many of pid's children are running: not zombies (a zombie has ended; its parent has not
// reaped it yet).
int running_children(pid_t pid) {
  int running = 0;
  for (const int child : detail::child_pids(pid)) {
    const char state = detail::process_state(child);
    if (state != '\0' && state != 'Z' && state != 'X') ++running;
  }
  return running;
}

// Options::children_end_with_their_own: whether process pid, once it has started processes
// of its own (had_children), has outlived all of them by grace_period (ended: since when none
// runs). Looked at on each round of wait()'s loop, at least once a second.
bool outlived_own_children(pid_t pid, bool& had_children, std::chrono::steady_clock::time_point& ended,
                           std::chrono::milliseconds grace_period) {
  const auto now = std::chrono::steady_clock::now();
  if (running_children(pid) > 0) {
    had_children = true;
    ended = std::chrono::steady_clock::time_point::max();
    return false;
  }
  if (!had_children) return false;  // none started yet
  if (ended == std::chrono::steady_clock::time_point::max()) ended = now;
  return now - ended >= grace_period;
}

}  // namespace

void ChildGroup::read_failure_reports() {
  char buffer[4096];
  ssize_t n;
  while ((n = read(failure_pipe_[0], buffer, sizeof(buffer))) > 0) failure_text_.append(buffer, static_cast<size_t>(n));
  const size_t complete = failure_text_.rfind('\n');
  if (complete == std::string::npos) return;
  const LauncherReports reports = parse_launcher_reports(failure_text_.substr(0, complete + 1));
  // A rank's first report counts: what it lost first is why it failed.
  for (const auto& [rank, lost] : reports.lost) lost_peer_.emplace(rank, lost);
  for (const LauncherReports::Rendezvous& r : reports.rendezvous) {
    if (r.stage == RendezvousStage::Joining) joining_[r.rank] = r.world_size;
    if (r.stage == RendezvousStage::Joined) joined_.insert(r.rank);
    if (r.stage == RendezvousStage::Left) joining_.erase(r.rank);
  }
  failure_text_.erase(0, complete + 1);
}

Outcome ChildGroup::wait() {
  NANODDP_CHECK(!waited_, DistError, "launch: wait() called twice");
  waited_ = true;
  Outcome outcome;
  const auto never = Clock::time_point::max();
  auto deadline = options_.timeout.count() > 0 ? detail::deadline_after(options_.timeout, created_) : never;
  auto kill_at = never;
  bool terminating = false, killed = false;
  // Stopped because the reader of the output is gone; whether a user's signal has come.
  bool stopped_for_reader = false, user_signalled = false;
  int sent_signal = 0;  // what begin_termination sent the ranks

  OutputRelay relay;  // Note [Output relay]: nothing below blocks on the launcher's readers
  resume_launcher_output();  // a reader an earlier round gave up on is tried again
  auto report = [&](const std::string& text) {
    if (options_.report) relay.write(2, options_.reporter + ": " + text + "\n");
  };
  auto begin_termination = [&](int received, const std::string& why) {
    // mpirun passes SIGINT and SIGTERM on to its ranks but dies at once of SIGQUIT, leaving
    // them no time to end by themselves: it gets SIGTERM instead.
    const int signal = options_.children_relay_signals && received == SIGQUIT ? SIGTERM : received;
    size_t alive = 0;
    std::string names;  // of the children still running, for children that relay signals
    for (const Child& c : children_)
      if (!c.exited) {
        ++alive;
        names += (names.empty() ? "" : ", ") + c.name;
      }
    const std::string whom = options_.children_relay_signals
                                 ? names + " (which passes it on)"
                                 : "the " + std::to_string(alive) + " remaining process(es)";
    report(why + (alive > 0 ? "; sending " + signal_name(signal) + " to " + whom + ", SIGKILL after " +
                                  format_ms(options_.grace_period)
                            : ""));
    terminating = true;
    sent_signal = signal;
    terminate_all(signal);
    kill_at = detail::deadline_after(options_.grace_period);
  };

  // Emits every complete line of `s` (all of it at EOF) with the child's prefix.
  auto emit = [&](Child& c, Stream& s, bool at_eof) {
    if (s.dst < 0) return;
    // The '\n' that ends a line already printed in pieces of kMaxPendingLine ends the last piece.
    if (s.line_split && !s.pending.empty()) {
      if (s.pending[0] == '\n') s.pending.erase(0, 1);
      s.line_split = false;
    }
    // A line longer than kMaxPendingLine comes out in pieces of exactly that many bytes, each
    // a line of its own, whatever sizes the reads had.
    std::string out;
    const auto add_line = [&](size_t begin, size_t end) {
      for (; end - begin > kMaxPendingLine; begin += kMaxPendingLine)
        out += c.prefix + s.pending.substr(begin, kMaxPendingLine) + "\n";
      out += c.prefix + s.pending.substr(begin, end - begin) + "\n";
    };
    size_t begin = 0;
    for (size_t nl; (nl = s.pending.find('\n', begin)) != std::string::npos; begin = nl + 1)
      add_line(begin, nl);
    if (at_eof) {
      if (begin < s.pending.size()) add_line(begin, s.pending.size());
      begin = s.pending.size();
    } else {
      for (; s.pending.size() - begin >= kMaxPendingLine; begin += kMaxPendingLine)
        out += c.prefix + s.pending.substr(begin, kMaxPendingLine) + "\n";
      s.line_split = begin == s.pending.size() && begin > 0 && s.pending[begin - 1] != '\n';
    }
    s.pending.erase(0, begin);
    if (!out.empty()) relay.write(s.dst, std::move(out));
  };
  // Whether s may be read now: while the job runs, not when the relay holds all it may for
  // s's destination (the rest waits in the pipe); in the drain, up to kMaxDrainBytes.
  bool draining = false;
  auto readable = [&](const Stream& s) {
    if (s.fd < 0) return false;
    if (s.dst < 0) return true;  // the child's message: kept in memory, up to kMaxMessage
    return draining ? s.drained < kMaxDrainBytes : !relay.full(s.dst);
  };
  auto read_stream = [&](Child& c, Stream& s) {
    char buffer[65536];
    while (readable(s)) {
      const ssize_t n = read(s.fd, buffer, sizeof(buffer));
      if (n > 0 && draining) s.drained += static_cast<size_t>(n);
      if (n > 0) {
        if (s.dst < 0) {
          if (s.pending.size() < kMaxMessage) s.pending.append(buffer, static_cast<size_t>(n));
        } else {
          s.pending.append(buffer, static_cast<size_t>(n));
          emit(c, s, false);
        }
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else if (n < 0 && errno == EAGAIN) {
        return;
      } else {  // EOF or a broken pipe
        close_fd(s.fd);
        emit(c, s, true);
      }
    }
  };
  // One poll round over the self-pipe and every open stream; returns the signals received.
  auto poll_once = [&](std::chrono::milliseconds wait) {
    std::vector<pollfd> fds{{g_signal_pipe[0], POLLIN, 0}, {failure_pipe_[0], POLLIN, 0}};
    std::vector<std::pair<Child*, Stream*>> owners{{nullptr, nullptr}, {nullptr, nullptr}};
    for (Child& c : children_)
      for (Stream* s : {&c.out, &c.err, &c.msg})
        if (readable(*s)) {
          fds.push_back({s->fd, POLLIN, 0});
          owners.emplace_back(&c, s);
        } else if (s->fd >= 0 && !draining) {
          wait = std::min(wait, std::chrono::milliseconds(20));  // the relay is looked at again soon
        }
    std::vector<int> signals;
    const int ready = poll(fds.data(), fds.size(), detail::poll_milliseconds(wait));
    if (ready <= 0) return signals;
    if (fds[1].revents != 0) read_failure_reports();
    for (size_t i = 2; i < fds.size(); ++i)
      if (fds[i].revents != 0) read_stream(*owners[i].first, *owners[i].second);
    if (fds[0].revents != 0)
      for (const int signal : take_signals())
        if (signal != SIGCHLD) signals.push_back(signal);
    return signals;
  };

  // 0. What stopped the starts (see must_stop_starting) ends the job like a failure after start.
  if (!start_error_.empty()) {
    outcome.kind = Outcome::Kind::StartFailed;
    outcome.failed_name = start_error_name_;
    outcome.failed_message = start_error_;
    begin_termination(SIGTERM, "could not start " + start_error_name_ + ": " + start_error_);
  } else if (pending_signal_ != 0) {
    outcome.kind = Outcome::Kind::Interrupted;
    outcome.signal = pending_signal_;
    user_signalled = true;  // a second one kills
    begin_termination(pending_signal_, "received " + signal_name(pending_signal_) + " while starting ranks");
  }

  // Whether c has exited (a zombie now); records how, and whether that is a failure of its own
  // (any failure before we stop the job; a non-zero exit code while we do, unless the children
  // relay signals). WNOWAIT leaves the
  // zombie (and with it the pgid) in place until the end.
  auto poll_exit = [&](Child& c) {
    if (c.exited) return true;
    siginfo_t info{};
    if (waitid(P_PID, static_cast<id_t>(c.pid), &info, WEXITED | WNOHANG | WNOWAIT) != 0 || info.si_pid != c.pid)
      return false;
    c.exited = true;
    if (info.si_code == CLD_EXITED) {
      c.status.exited = true;
      c.status.code = info.si_status;
    } else {
      c.status.signal = info.si_status;
    }
    // Exit code 128 + n after we sent signal n is how bash and Python end on a signal they
    // handle: the rank stopped as asked, like one the signal killed, and has not failed.
    const bool obeyed = terminating && c.status.exited && c.status.code == 128 + sent_signal;
    c.failed =
        !c.status.ok() && !obeyed && (!terminating || (c.status.exited && !options_.children_relay_signals));
    // What it wrote before it exited is in its pipes now: relayed before any line of ours about
    // its end, so that its own error comes first.
    read_stream(c, c.out);
    read_stream(c, c.err);
    return true;
  };
  auto child_of_rank = [&](int rank) -> Child* {
    for (Child& c : children_)
      if (c.rank == rank) return &c;
    return nullptr;
  };
  // The failure that came first (Note [Launcher link], item 2): from a failed rank, follow
  // "lost rank R" to R while R failed too; R's failure caused the others'. *running is set to
  // the lost rank the chain stops at when that one is still running: its own failure may be
  // under way (a rank's sockets close before it has exited, say while it writes a checkpoint).
  auto first_failure = [&](Child* failed, Child** running) {
    read_failure_reports();
    *running = nullptr;
    std::set<int> seen{failed->rank};
    for (auto lost = lost_peer_.find(failed->rank); lost != lost_peer_.end(); lost = lost_peer_.find(failed->rank)) {
      Child* peer = child_of_rank(lost->second);
      if (peer == nullptr || !seen.insert(peer->rank).second) break;
      if (!poll_exit(*peer)) {
        *running = peer;
        break;
      }
      if (!peer->failed) break;
      failed = peer;
    }
    return failed;
  };
  auto describe_failure = [&](const Child& c) {
    std::string text = c.name + " (pid " + std::to_string(c.pid) + ") ";
    text += (c.pid == outcome.failed_pid ? "failed: " : "also failed: ") + c.status.describe();
    const auto lost = lost_peer_.find(c.rank);
    if (lost != lost_peer_.end()) text += " (it lost rank " + std::to_string(lost->second) + ")";
    return text;
  };
  // Options::children_end_with_their_own: mpirun's own shutdown after its last rank takes a
  // fraction of a second; it gets the grace period, but never under 5 s, so that a loaded
  // machine is not taken for a hang.
  const auto own_children_allowance = std::max(options_.grace_period, std::chrono::milliseconds(5000));
  Child* first_seen = nullptr;  // the first failed child we saw, while its blame is pending
  auto blame_until = never;     // until then, wait for the rank it lost to end by itself

  while (true) {
    // 1. Who has exited? The first failure ends the job once we know whose it is: a rank that
    //    failed by losing a rank still running is not blamed before that one has ended too
    //    (for up to a grace period). Every other rank that fails on its own is named after it.
    bool any_failed = false;
    for (Child& c : children_)
      if (!c.exited && poll_exit(c) && c.failed) any_failed = true;
    if (any_failed && !terminating && first_seen == nullptr) {
      for (Child& c : children_)
        if (first_seen == nullptr && c.failed) first_seen = &c;
      blame_until = detail::deadline_after(options_.grace_period);
    }
    // Note [Launcher link], item 3: a rank that ended with status 0 without joining, while
    // another waits in init_process_group for a world that includes it. The reports are read
    // after the exit was seen: a rank writes "joined" before it can exit.
    if (!terminating && first_seen == nullptr) {
      read_failure_reports();
      const Child* gone = nullptr;
      const Child* waiting = nullptr;
      for (const Child& c : children_)
        if (gone == nullptr && c.exited && c.status.ok() && joined_.count(c.rank) == 0)
          for (const Child& d : children_) {
            const auto joining = joining_.find(d.rank);
            if (waiting == nullptr && !d.exited && joining != joining_.end() && joining->second > c.rank &&
                joined_.count(d.rank) == 0) {
              gone = &c;
              waiting = &d;
            }
          }
      if (gone != nullptr) {
        outcome.kind = Outcome::Kind::ChildFailed;
        outcome.failed_name = gone->name;
        outcome.failed_rank = gone->rank;
        outcome.failed_pid = gone->pid;
        outcome.failed_status = gone->status;
        outcome.failed_message = "it returned before joining the process group, and " + waiting->name +
                                 " waits for it in init_process_group";
        begin_termination(SIGTERM, gone->name + " (pid " + std::to_string(gone->pid) +
                                       ") exited with status 0 before it joined the process group, while " +
                                       waiting->name +
                                       " waits for it there (it would until its timeout): every "
                                       "rank of the job must join the process group");
      }
    }
    if (first_seen != nullptr && !terminating) {
      Child* running = nullptr;
      Child* first = first_failure(first_seen, &running);
      if (running == nullptr || Clock::now() >= blame_until) {
        outcome.kind = Outcome::Kind::ChildFailed;
        outcome.failed_name = first->name;
        outcome.failed_rank = first->rank;
        outcome.failed_pid = first->pid;
        outcome.failed_status = first->status;
        first->named = true;
        // The rank it lost never ended by itself: alive but stuck (stopped, hung in a system
        // call, looping). Said, with what /proc tells of it, since the failure named is then
        // only the first symptom.
        std::string stuck = running == nullptr
                                ? ""
                                : "; " + running->name + " (pid " + std::to_string(running->pid) +
                                      "), which it lost, was still running " +
                                      format_ms(options_.grace_period) + " later (" +
                                      stuck_state(running->pid) + ")";
        // A rank that ended with status 0 while the others ran is a success to the launcher
        // (as to torchrun), but the others wait for it in their next collective or rendezvous:
        // said, since it is often why they failed.
        for (const Child& c : children_)
          if (c.exited && c.status.ok())
            stuck += "; " + c.name + " (pid " + std::to_string(c.pid) +
                     ") had already exited with status 0, and the others may have waited for it";
        begin_termination(SIGTERM, describe_failure(*first) + stuck);
      }
    }
    if (options_.children_end_with_their_own && !terminating && first_seen == nullptr)
      for (Child& c : children_) {
        if (c.exited || !outlived_own_children(c.pid, c.had_children, c.own_children_ended, own_children_allowance))
          continue;
        outcome.kind = Outcome::Kind::ChildFailed;
        outcome.failed_name = c.name;
        outcome.failed_rank = c.rank;
        outcome.failed_pid = c.pid;
        outcome.failed_status = ExitStatus{/*exited=*/true, /*code=*/1, /*signal=*/0};  // the job fails with 1
        c.named = true;
        begin_termination(SIGTERM, c.name + " (pid " + std::to_string(c.pid) + ") was still running " +
                                       format_ms(own_children_allowance) +
                                       " after every process it started had ended (" + stuck_state(c.pid) +
                                       "): the job fails");
        break;
      }
    if (terminating) {
      read_failure_reports();
      for (Child& c : children_)
        if (c.exited && c.failed && !c.named) {
          c.named = true;
          report(describe_failure(c));
        }
    }
    if (std::all_of(children_.begin(), children_.end(), [](const Child& c) { return c.exited; })) break;

    // 2. Clocks: the job's timeout, then the grace period.
    const auto now = Clock::now();
    if (!terminating && now >= deadline) {
      outcome.kind = Outcome::Kind::TimedOut;
      begin_termination(SIGTERM, options_.timeout_description.empty()
                                     ? "timed out after " + format_ms(options_.timeout)
                                     : "timed out: " + options_.timeout_description);
    }
    if (terminating && !killed && Clock::now() >= kill_at) {
      terminate_all(SIGKILL);
      killed = true;
    }

    // 3. Output and signals, until the next event or clock.
    auto next = std::min(terminating && !killed ? kill_at : never, terminating ? never : std::min(deadline, blame_until));
    auto wait = std::chrono::milliseconds(1000);  // SIGCHLD wakes us; this is only a backstop
    if (next != never)
      wait = std::min(wait, std::chrono::duration_cast<std::chrono::milliseconds>(next - Clock::now()) +
                                std::chrono::milliseconds(1));
    bool stopped = false;  // one stop for the Ctrl-Z presses read together
    for (int signal : poll_once(wait)) {
      if (is_passed_on(signal)) {
        if (!terminating) pass_on(signal);
        continue;
      }
      if (signal == SIGTSTP) {
        if (terminating || stopped) continue;
        // Time spent stopped is not the job's: the clocks move on by it.
        const auto paused = stop_with_children();
        stopped = true;
        if (deadline != never) deadline += paused;
        if (blame_until != never) blame_until += paused;
        continue;
      }
      if (!terminating) {
        outcome.kind = Outcome::Kind::Interrupted;
        outcome.signal = signal;
        user_signalled = true;
        begin_termination(signal, "received " + signal_name(signal));
      } else if (!user_signalled) {
        // The ranks are stopping politely already (a failure, the timeout, the reader gone), so
        // this is the user's first signal, not a second one: they keep their grace period, and
        // the signal is what the job ends by. Ctrl-C under `| tee` reaches tee and the launcher
        // together; after a failure, no restart follows it (launch()).
        user_signalled = true;
        if (stopped_for_reader) {
          outcome.signal = signal;
        } else {
          outcome.late_signal = signal;
          report("received " + signal_name(signal) +
                 " while the ranks are being stopped; a second one kills them");
        }
      } else if (!killed) {  // a second Ctrl-C: stop waiting politely
        terminate_all(SIGKILL);
        killed = true;
      }
    }
    // The reader of the output is gone (`| head` has its lines): the job ends as a program
    // writing there would, by SIGPIPE, its ranks stopped politely. Looked at after the
    // signals, so that a signal read with it is the user's; never a reason to SIGKILL; and not
    // while a failure waits for its blame (the failure is the outcome then).
    if (!terminating && first_seen == nullptr && launcher_reader_gone()) {
      outcome.kind = Outcome::Kind::Interrupted;
      outcome.signal = SIGPIPE;
      stopped_for_reader = true;
      begin_termination(SIGTERM, "the reader of its output is gone (stdout or stderr closed, as by | head)");
    }
  }

  // 4. Leftovers in the ranks' groups die now; then read what is still in the pipes.
  terminate_all(SIGKILL);
  const auto drain_until = Clock::now() + kDrainTimeout;
  // What the ranks left in their pipes is read whatever the readers take (a pipe holds 64
  // KiB); a process that escaped its rank's group gets at most kMaxDrainBytes a stream.
  draining = true;
  const auto drainable = [&] {
    for (const Child& c : children_)
      for (const Stream* s : {&c.out, &c.err, &c.msg})
        if (readable(*s)) return true;
    return false;
  };
  while (drainable() && Clock::now() < drain_until)
    poll_once(std::chrono::duration_cast<std::chrono::milliseconds>(drain_until - Clock::now()) +
              std::chrono::milliseconds(1));
  for (Child& c : children_) {
    for (Stream* s : {&c.out, &c.err, &c.msg}) {
      close_fd(s->fd);
      emit(c, *s, true);
    }
    int status = 0;
    while (waitpid(c.pid, &status, 0) < 0 && errno == EINTR) {
    }
    c.reaped = true;
    outcome.statuses.push_back(c.status);
    if (outcome.kind == Outcome::Kind::ChildFailed && c.pid == outcome.failed_pid)
      outcome.failed_message = c.msg.pending;
  }
  // A job that ended by itself waits for its readers however long they take (a pager read page
  // by page); one stopped by a signal or its timeout gives a stalled reader a grace period, and
  // so does a signal that comes during the wait (Outcome::late_signal: no restart follows it).
  const bool stopped = outcome.kind == Outcome::Kind::Interrupted || outcome.kind == Outcome::Kind::TimedOut;
  int late_signal = outcome.late_signal;
  relay.flush([&] {
    if (!stopped && late_signal == 0)
      for (const int signal : take_signals()) {
        if (signal == SIGTSTP) {
          stop_with_children();
        } else if (is_passed_on(signal)) {
          pass_on(signal);
        } else if (signal != SIGCHLD && late_signal == 0) {
          late_signal = signal;
        }
      }
    return stopped || late_signal != 0 || launcher_reader_gone() ? options_.grace_period
                                                                 : OutputRelay::kWaitForever;
  });
  // Read once the queue is empty: the last write may be the one that found the reader gone.
  outcome.reader_gone = launcher_reader_gone();
  if (outcome.reader_gone && late_signal == 0 && outcome.kind == Outcome::Kind::AllSucceeded) {
    outcome.kind = Outcome::Kind::Interrupted;
    outcome.signal = SIGPIPE;
  }
  outcome.late_signal = late_signal;
  if (late_signal != 0 && outcome.kind == Outcome::Kind::AllSucceeded) {
    outcome.kind = Outcome::Kind::Interrupted;
    outcome.signal = late_signal;
  }
  return outcome;
}

}  // namespace nanoddp::dist
