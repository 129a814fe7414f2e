// Multi-process test harness: fork one child per rank, run a function in each, collect the
// outcome with a deadline, and never leave a process behind.
//
//   int port = free_port();
//   std::string failures = run_ranks(4, [&](int rank) { ... throw on a wrong value ... });
//   CHECK_MESSAGE(failures.empty(), failures);
//
// A child reports failure by throwing: the message goes to stderr prefixed with its rank,
// and the child _exit()s 1 (never returning into doctest). The parent waits up to timeout,
// then SIGKILLs the children still running and reports them as timed out.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace nanoddp::testing {

// A TCP port that was free a moment ago (bind port 0, read it back, close).
inline int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    throw std::runtime_error("free_port: bind failed");
  }
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

// Runs fn(rank) in world_size forked children. Returns "" when every child succeeded, else
// one line per failed or timed-out rank.
inline std::string run_ranks(int world_size, const std::function<void(int rank)>& fn,
                             std::chrono::seconds timeout = std::chrono::seconds(60)) {
  std::fflush(nullptr);
  std::vector<pid_t> pids;
  for (int rank = 0; rank < world_size; ++rank) {
    pid_t pid = ::fork();
    if (pid == 0) {
      int code = 0;
      try {
        fn(rank);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "[rank %d] %s\n", rank, e.what());
        code = 1;
      } catch (...) {
        std::fprintf(stderr, "[rank %d] unknown exception\n", rank);
        code = 1;
      }
      std::fflush(nullptr);
      ::_exit(code);
    }
    pids.push_back(pid);
  }
  std::ostringstream failures;
  auto deadline = std::chrono::steady_clock::now() + timeout;
  std::vector<bool> done(pids.size(), false);
  size_t remaining = pids.size();
  while (remaining > 0) {
    for (size_t r = 0; r < pids.size(); ++r) {
      if (done[r]) continue;
      int status = 0;
      if (::waitpid(pids[r], &status, WNOHANG) == pids[r]) {
        done[r] = true;
        --remaining;
        if (WIFEXITED(status) && WEXITSTATUS(status) != 0)
          failures << "rank " << r << " exited with " << WEXITSTATUS(status) << "\n";
        else if (WIFSIGNALED(status))
          failures << "rank " << r << " killed by signal " << WTERMSIG(status) << "\n";
      }
    }
    if (remaining == 0) break;
    if (std::chrono::steady_clock::now() > deadline) {
      for (size_t r = 0; r < pids.size(); ++r) {
        if (done[r]) continue;
        ::kill(pids[r], SIGKILL);
        ::waitpid(pids[r], nullptr, 0);
        failures << "rank " << r << " timed out after " << timeout.count() << " s\n";
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return failures.str();
}

// Throws std::runtime_error(message) when cond is false: the child-side CHECK.
template <typename... Parts>
void expect(bool cond, const Parts&... parts) {
  if (cond) return;
  std::ostringstream out;
  (out << ... << parts);
  throw std::runtime_error(out.str());
}

}  // namespace nanoddp::testing
