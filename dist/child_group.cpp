// The launcher's process management: a ChildGroup forks the ranks, gives each its process
// group, pipes and signals, and kills them all when the job ends. Supervision and the failure
// chain are in child_group_wait.cpp. See Note [Launch contract] in dist/launch.h.
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
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <dirent.h>
#include <fstream>
#include <set>
#include <thread>

#include "core/error.h"
#include "dist/deadline.h"
#include "dist/launcher_link.h"
#include "dist/launch_detail.h"

namespace nanoddp::dist {

namespace launch_detail {

int g_signal_pipe[2] = {-1, -1};
struct sigaction g_saved_actions[kNumHandled];

void on_signal(int signal) {
  const int saved_errno = errno;
  const unsigned char byte = static_cast<unsigned char>(signal);
  ssize_t ignored = write(g_signal_pipe[1], &byte, 1);  // full pipe: a wake-up is pending anyway
  (void)ignored;
  errno = saved_errno;
}

namespace {
std::atomic<pid_t> g_output_dropped_by{0};  // the process that gave its readers up
}  // namespace

namespace {
std::atomic<bool> g_reader_gone{false};
// The byte write_all puts in the self-pipe for a reader gone: 0 is no signal's number.
constexpr unsigned char kReaderGoneByte = 0;
}  // namespace

void drop_launcher_output() { g_output_dropped_by = getpid(); }
void resume_launcher_output() {
  g_output_dropped_by = 0;
  g_reader_gone = false;
}
bool launcher_reader_gone() { return g_reader_gone; }

// Writes all of `data` to `fd`; gives up quietly when the reader is gone (EPIPE) or the fd is
// broken, because losing output must never stop supervision.
void write_all(int fd, const char* data, size_t size) {
  if ((fd == 1 || fd == 2) && g_output_dropped_by == getpid()) return;
  // A write into a pipe whose reader is gone raises SIGPIPE, which ends the process where no
  // ChildGroup ignores it (a report written between rounds). Blocked on this thread for the
  // write, and taken back if raised, so that the write only fails with EPIPE.
  struct SigpipeBlocked {
    sigset_t pipe, before;
    SigpipeBlocked() {
      sigemptyset(&pipe);
      sigaddset(&pipe, SIGPIPE);
      pthread_sigmask(SIG_BLOCK, &pipe, &before);
    }
    ~SigpipeBlocked() {
      if (sigismember(&before, SIGPIPE) == 0) {
        const timespec now{0, 0};
        while (sigtimedwait(&pipe, nullptr, &now) == SIGPIPE) {
        }
        pthread_sigmask(SIG_SETMASK, &before, nullptr);
      }
    }
  } blocked;
  size_t done = 0;
  while (done < size) {
    const ssize_t n = write(fd, data + done, size - done);
    if (n > 0) {
      done += static_cast<size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && errno == EAGAIN) {
      pollfd p{fd, POLLOUT, 0};
      poll(&p, 1, 100);
    } else {
      if (n < 0 && errno == EPIPE && (fd == 1 || fd == 2) && !g_reader_gone.exchange(true) &&
          g_signal_pipe[1] >= 0) {
        ssize_t ignored = write(g_signal_pipe[1], &kReaderGoneByte, 1);  // a wake-up, not a signal
        (void)ignored;
      }
      return;
    }
  }
}

std::vector<int> take_signals() {
  std::vector<int> signals;
  unsigned char bytes[64];
  ssize_t n;
  while ((n = read(g_signal_pipe[0], bytes, sizeof(bytes))) > 0)
    for (ssize_t i = 0; i < n; ++i)
      if (bytes[i] != kReaderGoneByte) signals.push_back(bytes[i]);
  return signals;
}

void close_fd(int& fd) {
  if (fd >= 0) close(fd);
  fd = -1;
}

// A launcher started with stdin, stdout or stderr closed (`nanoddp-run ... >&- 2>&-`) would
// get that number for its next descriptor: its signal pipe at 1 read the ranks' output as
// signals. Each closed one is opened on /dev/null first, as daemons do, so what the ranks
// write there is dropped, as the user asked.
void open_closed_standard_streams() {
  for (int fd = 0; fd <= 2; ++fd) {
    if (fcntl(fd, F_GETFD) != -1 || errno != EBADF) continue;
    const int opened = open("/dev/null", O_RDWR);  // the lowest free number: fd itself
    if (opened >= 0 && opened != fd) {
      dup2(opened, fd);
      close(opened);
    }
  }
}

std::string format_ms(std::chrono::milliseconds ms) {
  if (ms.count() % 1000 == 0) return std::to_string(ms.count() / 1000) + " s";
  return std::to_string(ms.count()) + " ms";
}

}  // namespace launch_detail

using namespace launch_detail;

ChildGroup::ChildGroup(Options options) : options_(std::move(options)), created_(Clock::now()) {
  // Note [Long timeouts]: the output relay compares the grace period with a clock's nanoseconds.
  options_.grace_period = detail::cap_timeout(options_.grace_period);
  options_.timeout = detail::cap_timeout(options_.timeout);
  NANODDP_CHECK(g_signal_pipe[0] < 0, DistError,
                "launch: another launch or spawn is already supervising children in this process");
  open_closed_standard_streams();
  NANODDP_CHECK(pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) == 0, DistError, "launch: pipe2 failed: ",
                std::strerror(errno));
  // Note [Launcher link] in dist/launcher_link.h. Both pipes are close-on-exec here; a child
  // clears the flag on the ends it inherits.
  if (pipe2(alive_pipe_, O_CLOEXEC) != 0 || pipe2(failure_pipe_, O_CLOEXEC | O_NONBLOCK) != 0) {
    const int err = errno;
    for (int* fd : {&alive_pipe_[0], &alive_pipe_[1], &failure_pipe_[0], &failure_pipe_[1], &g_signal_pipe[0],
                    &g_signal_pipe[1]})
      close_fd(*fd);
    NANODDP_THROW(DistError, "launch: pipe2 failed: ", std::strerror(err));
  }
  for (size_t i = 0; i < kNumHandled; ++i) {
    struct sigaction action {};
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    action.sa_handler = kHandledSignals[i] == SIGPIPE ? SIG_IGN : on_signal;
    if (kHandledSignals[i] == SIGCHLD) action.sa_flags |= SA_NOCLDSTOP;
    sigaction(kHandledSignals[i], nullptr, &g_saved_actions[i]);
    // An ignored SIGINT/SIGTERM/SIGHUP/SIGQUIT/SIGTSTP/SIGUSR1/SIGUSR2 (nohup, a background job) stays
    // ignored: we must not turn a hang-up the user asked to ignore into the end of the job.
    if (kept_if_ignored(kHandledSignals[i]) && g_saved_actions[i].sa_handler == SIG_IGN) continue;
    if (!takes_over(kHandledSignals[i])) continue;
    sigaction(kHandledSignals[i], &action, nullptr);
  }
}

ChildGroup::~ChildGroup() {
  // Whatever wait() did not finish (an exception, or wait() never called): kill and reap.
  for (Child& c : children_) {
    if (!c.reaped && c.pid > 0) {
      kill(-c.pid, SIGKILL);
      kill(c.pid, SIGKILL);
      int status = 0;
      while (waitpid(c.pid, &status, 0) < 0 && errno == EINTR) {
      }
    }
    close_fd(c.out.fd);
    close_fd(c.err.fd);
    close_fd(c.msg.fd);
  }
  for (size_t i = 0; i < kNumHandled; ++i)
    if (takes_over(kHandledSignals[i])) sigaction(kHandledSignals[i], &g_saved_actions[i], nullptr);
  close_fd(g_signal_pipe[0]);
  close_fd(g_signal_pipe[1]);
  for (int* fd : {&alive_pipe_[0], &alive_pipe_[1], &failure_pipe_[0], &failure_pipe_[1]}) close_fd(*fd);
}

// Between two starts, whatever would make wait() end the job: a failed start, a forwarded
// signal (read from the self-pipe and kept for wait()), the timeout, or a child that has
// already failed (looked for only after a SIGCHLD; wait() looks at every child anyway, so
// consuming the SIGCHLD bytes here loses nothing).
bool ChildGroup::must_stop_starting() {
  if (!start_error_.empty() || pending_signal_ != 0) return true;
  if (options_.timeout.count() > 0 && Clock::now() >= detail::deadline_after(options_.timeout, created_)) return true;
  bool child_exited = false;
  for (const int signal : take_signals()) {
    if (signal == SIGCHLD) {
      child_exited = true;
    } else if (signal == SIGTSTP) {
      stop_with_children();  // Ctrl-Z while starting: those started stop too; then go on
    } else if (is_passed_on(signal)) {
      pass_on(signal);  // to the ranks started so far; the others start with its default
    } else if (pending_signal_ == 0) {
      pending_signal_ = signal;
    }
  }
  if (pending_signal_ != 0) return true;
  if (!child_exited) return false;
  for (const Child& c : children_) {
    siginfo_t info{};
    if (waitid(P_PID, static_cast<id_t>(c.pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid == c.pid &&
        !(info.si_code == CLD_EXITED && info.si_status == 0))
      return true;
  }
  return false;
}

bool ChildGroup::start(int rank, std::string name, std::string prefix,
                       const std::function<void(int msg_fd)>& child_main) {
  NANODDP_CHECK(!waited_, DistError, "launch: start() after wait()");
  if (must_stop_starting()) return false;
  auto fail = [&](const std::string& why) {
    start_error_ = why;
    start_error_name_ = name;
    return false;
  };
  int out[2] = {-1, -1}, err[2] = {-1, -1}, msg[2] = {-1, -1};
  for (int* fds : {out, err, msg}) {
    if (pipe2(fds, O_CLOEXEC) == 0) continue;
    const int pipe_errno = errno;
    for (int* opened : {out, err, msg}) {
      close_fd(opened[0]);
      close_fd(opened[1]);
    }
    return fail(std::string("pipe2 failed: ") + std::strerror(pipe_errno) +
                (pipe_errno == EMFILE ? " (each rank holds 3 descriptors in the launcher: raise `ulimit -n`)" : ""));
  }

  // Signals stay blocked across fork so that the child cannot run our handler (and write into
  // our self-pipe) before it has restored the handlers it should have.
  sigset_t all, previous;
  sigfillset(&all);
  sigprocmask(SIG_BLOCK, &all, &previous);
  fflush(nullptr);  // or the child would print the parent's buffered output a second time
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);
    // No orphans (Note [Launcher link]): SIGKILL when we die. Had we died before the prctl,
    // the child has been reparented already and must not start at all.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(128 + SIGKILL);
    close(alive_pipe_[1]);
    close(failure_pipe_[0]);
    for (int fd : {alive_pipe_[0], failure_pipe_[1]}) fcntl(fd, F_SETFD, 0);
    clear_outer_launcher_env();  // child_main sets this launcher's variables
    setenv(kLauncherFdEnv, describe_pipe_end(alive_pipe_[0]).c_str(), 1);
    setenv(kFailureFdEnv, describe_pipe_end(failure_pipe_[1]).c_str(), 1);
    // A rank starts as a fresh program would: SIGINT/SIGTERM/SIGHUP/SIGQUIT/SIGTSTP (and, under
    // nanoddp-run, SIGUSR1/SIGUSR2) at their defaults (unless the launcher was told to ignore
    // them), so that our SIGTERM terminates it even when it is a fork of a program with handlers
    // of its own (spawn); SIGCHLD and SIGPIPE as they were. spawn's ranks keep whatever
    // SIGUSR1/SIGUSR2 handlers the caller has at the fork, as a fork does: untouched here.
    for (size_t i = 0; i < kNumHandled; ++i) {
      if (!takes_over(kHandledSignals[i])) continue;
      struct sigaction action = g_saved_actions[i];
      if (kept_if_ignored(kHandledSignals[i]) && action.sa_handler != SIG_IGN) {
        action = {};
        action.sa_handler = SIG_DFL;
      }
      sigaction(kHandledSignals[i], &action, nullptr);
    }
    close(g_signal_pipe[0]);
    close(g_signal_pipe[1]);
    for (Child& other : children_) {
      close(other.out.fd);
      close(other.err.fd);
      close(other.msg.fd);
    }
    const int devnull = open("/dev/null", O_RDONLY);
    if (devnull >= 0) dup2(devnull, 0);
    dup2(out[1], 1);
    dup2(err[1], 2);
    close(out[0]);
    close(err[0]);
    close(msg[0]);
    sigprocmask(SIG_SETMASK, &previous, nullptr);
    child_main(msg[1]);
    _exit(127);
  }
  const int fork_errno = errno;
  if (pid > 0) setpgid(pid, pid);  // also here: kill(-pid) must work as soon as fork returns
  sigprocmask(SIG_SETMASK, &previous, nullptr);
  close(out[1]);
  close(err[1]);
  close(msg[1]);
  if (pid < 0) {
    close(out[0]);
    close(err[0]);
    close(msg[0]);
    return fail(std::string("fork failed: ") + std::strerror(fork_errno));
  }
  Child c;
  c.rank = rank;
  c.name = std::move(name);
  c.prefix = std::move(prefix);
  c.pid = pid;
  c.out = {out[0], 1, {}};
  c.err = {err[0], 2, {}};
  c.msg = {msg[0], -1, {}};
  for (int fd : {out[0], err[0], msg[0]}) fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  children_.push_back(std::move(c));
  return true;
}

// Ctrl-Z: what the terminal would do to the ranks were they in its foreground group, then to
// the launcher. The shell sees the launcher stop; its fg or bg continues it, and it continues
// the ranks. A rank that handles SIGTSTP decides for itself. The launcher stops by SIGTSTP at
// its default action, not by SIGSTOP: in an orphaned process group (a shell that has exited)
// the kernel drops that stop, nobody could continue it, and the ranks are continued at once.
std::chrono::steady_clock::duration ChildGroup::stop_with_children() {
  auto signal_all = [&](int signal) {
    for (const Child& c : children_)
      if (!c.reaped) signal_child(c, signal);
  };
  signal_all(SIGTSTP);
  const auto stopped_at = Clock::now();
  struct sigaction stop {
  }, handler{};
  stop.sa_handler = SIG_DFL;
  sigemptyset(&stop.sa_mask);
  sigaction(SIGTSTP, &stop, &handler);
  sigset_t tstp, mask;
  sigemptyset(&tstp);
  sigaddset(&tstp, SIGTSTP);
  sigprocmask(SIG_UNBLOCK, &tstp, &mask);
  raise(SIGTSTP);
  sigprocmask(SIG_SETMASK, &mask, nullptr);
  sigaction(SIGTSTP, &handler, nullptr);
  signal_all(SIGCONT);
  return Clock::now() - stopped_at;
}

// The whole group: the rank and whatever it started. An exited rank's zombie still holds its
// pgid, so leftovers of a finished rank are reached too. Without its group, the rank alone.
void ChildGroup::signal_child(const Child& c, int signal) {
  if (kill(-c.pid, signal) != 0 && !c.exited) kill(c.pid, signal);
}

bool ChildGroup::takes_over(int signal) const {
  return !is_passed_on(signal) || options_.pass_on_user_signals;
}

void ChildGroup::pass_on(int signal) {
  for (const Child& c : children_) {
    if (c.exited) continue;
    // mpirun passes SIGUSR1 and SIGUSR2 on to its ranks itself.
    if (options_.children_relay_signals)
      kill(c.pid, signal);
    else
      signal_child(c, signal);
  }
}

void ChildGroup::terminate_all(int signal) {
  for (Child& c : children_) {
    if (c.reaped) continue;
    signal_child(c, signal);
    // A stopped rank (SIGSTOP, Ctrl-Z) holds a SIGTERM until it runs again: wake it, so that
    // it ends now rather than at the grace period's SIGKILL.
    if (signal != SIGKILL && !c.exited) signal_child(c, SIGCONT);
  }
}

}  // namespace nanoddp::dist
