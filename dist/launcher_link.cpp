// The rank's side of Note [Launcher link] (dist/launcher_link.h).
#include "dist/launcher_link.h"

#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <sstream>
#include <thread>

namespace nanoddp::dist {

namespace {

// The descriptor named by variable `name` ("<fd>:<inode>") when it is still that pipe; else -1.
int inherited_pipe(const char* name) {
  const char* text = std::getenv(name);
  if (text == nullptr) return -1;
  char* end = nullptr;
  const long fd = std::strtol(text, &end, 10);
  if (end == text || *end != ':' || fd < 0 || fd > 1 << 20) return -1;
  const char* inode_text = end + 1;
  const unsigned long long inode = std::strtoull(inode_text, &end, 10);
  if (end == inode_text || *end != '\0') return -1;
  struct stat st {};
  if (fstat(static_cast<int>(fd), &st) != 0 || !S_ISFIFO(st.st_mode) || st.st_ino != inode) return -1;
  return static_cast<int>(fd);
}

// One report line on the failure pipe, formatted in a fixed buffer (a report may be written
// while an exception unwinds, where an allocation that threw would end the process) and
// written at once: short and atomic, see the Note.
template <typename... Args>
void write_report(const char* format, Args... args) {
  const int fd = inherited_pipe(kFailureFdEnv);
  if (fd < 0) return;
  char line[64];
  const int length = std::snprintf(line, sizeof line, format, args...);
  if (length <= 0 || static_cast<size_t>(length) >= sizeof line) return;
  ssize_t ignored = write(fd, line, static_cast<size_t>(length));
  (void)ignored;
}

}  // namespace

std::string describe_pipe_end(int fd) {
  struct stat st {};
  fstat(fd, &st);
  return std::to_string(fd) + ":" + std::to_string(static_cast<unsigned long long>(st.st_ino));
}

void watch_launcher(int rank) {
  static std::once_flag once;
  std::call_once(once, [rank] {
    const int fd = inherited_pipe(kLauncherFdEnv);
    if (fd < 0) return;
    std::thread([fd, rank] {
      sigset_t pipe_signal;  // a write to a dead launcher's pipe must fail, not kill us first
      sigemptyset(&pipe_signal);
      sigaddset(&pipe_signal, SIGPIPE);
      pthread_sigmask(SIG_BLOCK, &pipe_signal, nullptr);
      while (true) {
        pollfd p{fd, POLLIN, 0};
        const int ready = poll(&p, 1, -1);
        if (ready < 0 && errno == EINTR) continue;
        char byte;
        if (ready < 0 || ((p.revents & (POLLHUP | POLLERR | POLLNVAL)) != 0) || read(fd, &byte, 1) <= 0) break;
      }
      // Our stderr was the launcher's pipe and is likely gone too; try once, then end the
      // rank's whole group (the rank and what it started), as the launcher would have.
      const std::string who = rank >= 0 ? "rank " + std::to_string(rank) : "a rank";
      const std::string line = who + ": the launcher has died; ending this rank\n";
      ssize_t ignored = write(2, line.data(), line.size());
      (void)ignored;
      kill(0, SIGKILL);
      _exit(128 + SIGKILL);
    }).detach();
  });
}

void report_lost_peer(int rank, int lost_rank) {
  if (rank >= 0 && lost_rank >= 0) write_report("%d lost %d\n", rank, lost_rank);
}

void report_rendezvous(int rank, int world_size, RendezvousStage stage) {
  if (rank < 0) return;
  if (stage == RendezvousStage::Joined) write_report("%d joined\n", rank);
  if (stage == RendezvousStage::Left) write_report("%d left\n", rank);
  if (stage == RendezvousStage::Joining) write_report("%d joining %d\n", rank, world_size);
}

LauncherReports parse_launcher_reports(const std::string& text) {
  LauncherReports reports;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    std::istringstream words(line);
    int rank = -1, number = -1;
    std::string verb, rest;
    if (!(words >> rank >> verb) || rank < 0) continue;
    if (verb == "joined" || verb == "left") {
      if (!(words >> rest))
        reports.rendezvous.push_back(
            {rank, verb == "joined" ? RendezvousStage::Joined : RendezvousStage::Left, 0});
    } else if (words >> number && number >= 0 && !(words >> rest)) {
      if (verb == "lost") reports.lost.emplace_back(rank, number);
      if (verb == "joining" && number >= 1)
        reports.rendezvous.push_back({rank, RendezvousStage::Joining, number});
    }
  }
  return reports;
}

}  // namespace nanoddp::dist
