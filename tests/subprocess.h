// Running the project's programs from tests: a child with its output captured in files, a
// deadline after which it is killed (and the test fails), and the paths of built programs.
//
//   RunResult r = run({launcher_path(), "--nproc-per-node", "2", built("examples/toy_ddp")});
//   CHECK(r.code() == 0);   lines_of(r.out);
#pragma once

#include <doctest/doctest.h>
#include <fcntl.h>
#include <poll.h>
#include <pty.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"

namespace nanoddp::testing {

using namespace std::chrono_literals;

// The build and source folders: NANODDP_BUILD_DIR and NANODDP_SOURCE_DIR, which meson test
// passes, else the ones this test program was built from (tests/meson.build), so that a test
// program also runs by hand.
#ifndef NANODDP_TEST_BUILD_DIR  // a program built outside tests/meson.build (the exercises' grader)
#define NANODDP_TEST_BUILD_DIR nullptr
#define NANODDP_TEST_SOURCE_DIR nullptr
#endif
inline std::string test_folder(const char* variable, const char* built_in) {
  const char* dir = std::getenv(variable);
  if (dir == nullptr) dir = built_in;
  REQUIRE_MESSAGE(dir != nullptr, variable, " is not set (meson test sets it)");
  return dir;
}
inline std::string build_dir() { return test_folder("NANODDP_BUILD_DIR", NANODDP_TEST_BUILD_DIR); }
inline std::string source_dir() { return test_folder("NANODDP_SOURCE_DIR", NANODDP_TEST_SOURCE_DIR); }

// A program of the build folder.
inline std::string built(const std::string& relative) { return build_dir() + "/" + relative; }

inline std::string launcher_path() { return built("tools/nanoddp-run"); }

inline std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// A fresh folder for one test's pid files, removed at the end.
// A fresh folder under $TMPDIR (/tmp without it), removed with everything in it at the end.
struct TempDir {
  std::string path;
  TempDir() {
    const char* tmpdir = std::getenv("TMPDIR");
    std::string name = std::string(tmpdir != nullptr && *tmpdir != '\0' ? tmpdir : "/tmp") + "/nanoddp_launch_XXXXXX";
    REQUIRE(mkdtemp(name.data()) != nullptr);
    path = name;
  }
  ~TempDir() { std::system(("rm -rf '" + path + "'").c_str()); }
};

struct RunResult {
  int status = 0;  // from waitpid
  std::string out, err;
  double seconds = 0;
  int code() const { return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status); }
};

// Runs argv with stdout/stderr captured in files (so no pipe can fill up), killing it and
// failing the test when it outlives `timeout`. `on_started(pid)` runs once it is started.
inline RunResult run(const std::vector<std::string>& args, std::chrono::seconds timeout = 30s,
              const std::function<void(pid_t)>& on_started = nullptr) {
  TempDir dir;
  const std::string out_path = dir.path + "/out", err_path = dir.path + "/err";
  std::vector<char*> argv;
  std::vector<std::string> copy = args;
  for (auto& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  const auto started = std::chrono::steady_clock::now();
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    const int out = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    const int err = open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    dup2(out, 1);
    dup2(err, 2);
    // As from a terminal: a test runner started in the background (a non-interactive shell's
    // `&`) ignores SIGINT and SIGQUIT, and exec would keep them ignored in the program.
    ::signal(SIGINT, SIG_DFL);
    ::signal(SIGQUIT, SIG_DFL);
    execv(argv[0], argv.data());
    _exit(127);
  }
  if (on_started) on_started(pid);
  RunResult result;
  while (true) {
    const pid_t done = waitpid(pid, &result.status, WNOHANG);
    if (done == pid) break;
    if (std::chrono::steady_clock::now() - started > timeout) {
      kill(pid, SIGKILL);
      waitpid(pid, &result.status, 0);
      FAIL("launcher still running after ", timeout.count(), " s; stderr: ", read_file(err_path));
    }
    std::this_thread::sleep_for(10ms);
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  result.out = read_file(out_path);
  result.err = read_file(err_path);
  return result;
}

// Runs `/bin/sh -c command` on a pseudo-terminal of its own (stdin, stdout and stderr), as a
// user at a terminal would, and returns all it wrote there in `out`. Reads until every copy
// of the terminal is closed (EIO), so the last bytes a process writes as it dies are kept,
// which script(1) can lose under load. Kills it and fails the test past `timeout`.
inline RunResult run_on_terminal(const std::string& command, std::chrono::seconds timeout = 30s) {
  int master = -1;
  const auto started = std::chrono::steady_clock::now();
  const pid_t pid = ::forkpty(&master, nullptr, nullptr, nullptr);
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::signal(SIGINT, SIG_DFL);
    ::signal(SIGQUIT, SIG_DFL);
    execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  RunResult result;
  char buffer[4096];
  while (true) {
    pollfd p{master, POLLIN, 0};
    const int ready = ::poll(&p, 1, 100);
    if (ready > 0) {
      const ssize_t n = ::read(master, buffer, sizeof(buffer));
      if (n > 0) {
        result.out.append(buffer, static_cast<size_t>(n));
      } else if (n == 0 || errno != EINTR) {
        break;  // EIO: no process holds the terminal any more, and nothing is left in it
      }
    }
    // Checked after every read too: a program that never stops writing must time out.
    if (std::chrono::steady_clock::now() - started > timeout) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &result.status, 0);
      ::close(master);
      FAIL("still running on its terminal after ", timeout.count(), " s; output: ", result.out);
    }
  }
  ::close(master);
  ::waitpid(pid, &result.status, 0);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return result;
}

inline std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// The message of the IOError that `write` throws in a forked child whose file size limit
// (ulimit -f) is `limit_bytes`, with SIGXFSZ at its default action, which would kill it: the
// limit is the whole process's, so it is set where nothing else runs. The test fails when the
// child is killed or `write` returns without throwing.
inline std::string io_error_past_file_size_limit(rlim_t limit_bytes, const std::function<void()>& write) {
  // The calls stay outside the assertions: a build with DOCTEST_CONFIG_DISABLE (the exercises'
  // grader includes this header) compiles the assertions away, and what is inside them.
  int message_pipe[2];
  [[maybe_unused]] const int piped = ::pipe(message_pipe);
  REQUIRE(piped == 0);
  std::fflush(nullptr);
  const pid_t writer = ::fork();
  REQUIRE(writer >= 0);
  if (writer == 0) {
    ::close(message_pipe[0]);
    ::signal(SIGXFSZ, SIG_DFL);
    const rlimit limit{limit_bytes, limit_bytes};
    ::setrlimit(RLIMIT_FSIZE, &limit);
    try {
      write();
    } catch (const IOError& e) {
      const std::string message = e.what();
      const bool sent = ::write(message_pipe[1], message.data(), message.size()) ==
                        static_cast<ssize_t>(message.size());
      ::_exit(sent ? 0 : 2);
    }
    ::_exit(1);
  }
  ::close(message_pipe[1]);
  std::string message;
  char chunk[4096];
  for (ssize_t n; (n = ::read(message_pipe[0], chunk, sizeof chunk)) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;
    message.append(chunk, static_cast<size_t>(n));
  }
  ::close(message_pipe[0]);
  int status = 0;
  [[maybe_unused]] const pid_t waited = ::waitpid(writer, &status, 0);
  REQUIRE(waited == writer);
  REQUIRE_MESSAGE(WIFEXITED(status), "the writer was killed by signal ", WTERMSIG(status));
  REQUIRE_MESSAGE(WEXITSTATUS(status) == 0, "the write did not throw an IOError (exit ", WEXITSTATUS(status), ")");
  return message;
}

}  // namespace nanoddp::testing
